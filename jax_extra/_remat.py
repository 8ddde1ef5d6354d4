"""Explicit activation checkpointing: save only what is named, recompute the rest."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any, ParamSpec, TypeVar, overload

import jax
from jax.ad_checkpoint import checkpoint_name

__all__ = ["explicit_activation_checkpointing", "save_for_backward"]

_P = ParamSpec("_P")
_R = TypeVar("_R")
_T = TypeVar("_T")

# The checkpoint name attached by `save_for_backward`. It is namespaced so that it does not clash
# with names chosen by user code calling `jax.ad_checkpoint.checkpoint_name` directly.
SAVE_FOR_BACKWARD_NAME = "jax_extra.save_for_backward"


def save_for_backward(x: _T) -> _T:
    """Mark a value to be saved for the backward pass.

    This is the identity function. Inside a function decorated with
    [`explicit_activation_checkpointing`][], the marked value is kept in memory between the
    forward and the backward pass instead of being recomputed, provided the backward pass needs
    it at all. (A mark is tied to this exact value: for example, marking the output of
    `jnp.tanh` that is then only summed saves nothing, because the derivative of `tanh` refers to
    the unmarked output of `tanh` itself; marking a value that feeds a matrix multiplication saves
    it.) Outside such a function it has no effect on what is saved.

    **Arguments:**


    - `x`: an array, or a pytree of arrays, to save.

    **Returns:**

    `x`, unchanged.

    Examples:

    ```python
    @explicit_activation_checkpointing
    def mlp(x, w1, w2):
        h = save_for_backward(jax.nn.relu(x @ w1))  # kept for the backward pass
        return h @ w2
    ```
    """
    return checkpoint_name(x, SAVE_FOR_BACKWARD_NAME)


@overload
def explicit_activation_checkpointing(f: Callable[_P, _R], /) -> Callable[_P, _R]: ...


@overload
def explicit_activation_checkpointing(
    f: None = None,
    /,
    *,
    static_argnums: int | tuple[int, ...] = (),
    static_argnames: str | Iterable[str] = (),
    prevent_cse: bool = True,
    only_save_for_backward: bool = False,
) -> Callable[[Callable[_P, _R]], Callable[_P, _R]]: ...


def explicit_activation_checkpointing(
    f: Callable[..., Any] | None = None,
    /,
    *,
    static_argnums: int | tuple[int, ...] = (),
    static_argnames: str | Iterable[str] = (),
    prevent_cse: bool = True,
    only_save_for_backward: bool = False,
) -> Any:
    """Checkpoint a function so that it saves only its arguments and named values.

    The decorated function is wrapped in `jax.checkpoint` with a policy that saves, for the
    backward pass, only the function's arguments and the values it names: those marked with
    [`save_for_backward`][] and, as in seqax (whose policy is
    `jax.checkpoint_policies.save_any_names_but_these()`), any value named with
    `jax.ad_checkpoint.checkpoint_name`. Every other intermediate value is recomputed during the
    backward pass. This makes memory use explicit: what is kept is exactly what the code says.
    With `only_save_for_backward=True`, values named with `checkpoint_name` by other code (a
    library's own names) are recomputed too; only `save_for_backward` marks are saved.

    Can be used bare (`@explicit_activation_checkpointing`) or with keyword arguments
    (`@explicit_activation_checkpointing(static_argnums=(1,))`).

    **Arguments:**


    - `f`: the function to checkpoint. Omit it to get a decorator that takes the keyword
        arguments below.
    - `static_argnums`: positions of arguments that are static Python values (such as ints or
        strings) rather than arrays; passed on to `jax.checkpoint`.
    - `static_argnames`: names of keyword arguments that are static Python values (hashable);
        they are closed over, one checkpointed function per distinct value.
    - `prevent_cse`: passed on to `jax.checkpoint`. Keep the default `True` unless the function
        is already under `jax.lax.scan` or another construct that prevents common-subexpression
        elimination of the recomputation.
    - `only_save_for_backward`: `False` (the default, seqax's behaviour): save every value named
        with `checkpoint_name`, `save_for_backward` included. `True`: save only the values
        marked with `save_for_backward`.

    **Returns:**

    The checkpointed function, with the same signature and metadata (`__name__`, `__doc__`, ...)
    as `f`, and its policy as attribute `checkpoint_policy` (`shardlib.pipeline.circular` reads
    it); or, if `f` is omitted, a decorator producing it.

    Examples:

    ```python
    @explicit_activation_checkpointing
    def layer(x, w1, w2):
        h = save_for_backward(jnp.tanh(x @ w1))  # saved
        y = jnp.tanh(h @ w2)  # recomputed in the backward pass
        return y

    @explicit_activation_checkpointing(static_argnums=(2,))
    def stack(x, w, n_layers: int):
        for _ in range(n_layers):
            x = save_for_backward(jnp.tanh(x @ w))
        return x

    @explicit_activation_checkpointing(only_save_for_backward=True)
    def block(x, w):
        h = checkpoint_name(x @ w, "library_name")  # recomputed: not a save_for_backward mark
        return save_for_backward(jnp.tanh(h))  # saved
    ```
    """

    static_names = (
        (static_argnames,) if isinstance(static_argnames, str) else tuple(static_argnames)
    )

    def decorate(fn: Callable[_P, _R]) -> Callable[_P, _R]:
        policy = _MARKED_ONLY if only_save_for_backward else _ANY_NAMES
        return _checkpointed(fn, policy, static_names, static_argnums, prevent_cse)

    if not isinstance(only_save_for_backward, bool):
        raise TypeError(
            "explicit_activation_checkpointing(only_save_for_backward=...) takes True or False, "
            f"got only_save_for_backward={only_save_for_backward!r}"
        )
    if f is None:
        return decorate
    if not callable(f):
        raise TypeError(
            "explicit_activation_checkpointing expects a callable; pass options as keyword "
            f"arguments, e.g. explicit_activation_checkpointing(static_argnums=...). Got {f!r}."
        )
    return decorate(f)


# The two policies, made once: on JAX versions where a policy is a plain closure, only the same
# object compares equal, and shardlib.explain recognises these policies by comparing them.
_ANY_NAMES = jax.checkpoint_policies.save_any_names_but_these()
_MARKED_ONLY = jax.checkpoint_policies.save_only_these_names(SAVE_FOR_BACKWARD_NAME)


def _checkpointed(
    fn: Callable[_P, _R],
    policy: Callable[..., Any],
    static_names: tuple[str, ...],
    static_argnums: int | tuple[int, ...],
    prevent_cse: bool,
) -> Callable[_P, _R]:
    """``fn`` under ``jax.checkpoint`` with ``policy``; its policy as ``checkpoint_policy``."""

    @functools.cache
    def checkpointed(static_items: tuple[tuple[str, Any], ...]) -> Callable[..., Any]:
        # Static keyword arguments are closed over (jax.checkpoint's own static_argnames
        # exists only from jax 0.10.2), one checkpointed function per distinct value.
        target = functools.partial(fn, **dict(static_items)) if static_items else fn
        return jax.checkpoint(
            target, prevent_cse=prevent_cse, policy=policy, static_argnums=static_argnums
        )

    wrapper: Callable[..., Any]
    if static_names:

        @functools.wraps(fn)
        def with_statics(*args: _P.args, **kwargs: _P.kwargs) -> _R:
            static_items = tuple(sorted((k, kwargs.pop(k)) for k in static_names if k in kwargs))
            return checkpointed(static_items)(*args, **kwargs)

        wrapper = with_statics
    else:
        # jax.checkpoint's function itself (it carries fn's metadata): no wrapper frame on the
        # stack while fn is traced (on CPython 3.11 each frame there can cost trace time:
        # benchmarks/alignment.py).
        wrapper = checkpointed(())
    # Read by shardlib.pipeline.circular, whose own checkpoint around each tick overrides inner
    # policies (JAX applies the outermost one) and so applies this one instead.
    setattr(wrapper, "checkpoint_policy", policy)  # noqa: B010
    return wrapper  # type: ignore[return-value]
