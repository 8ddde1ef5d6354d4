"""``typed_shard_map``: ``jax.shard_map`` with in/out specs read from annotations.

Decoration reads the annotations once into a `shardlib._shard_map.signature.ShardMapSignature`
and wraps ``f`` in its checked body (`shardlib._shard_map.body`); each call runs through
`shardlib._shard_map.call.Call`.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar, overload

import jax

from .._analysis.notes import recording
from .._check.format import annotation_str, describe_value
from .._env import context as _context
from .._env import frames as _frames
from .call import Calls
from .signature import ShardMapSignature, callable_name, check_callable

__all__ = ["typed_shard_map"]

_F = TypeVar("_F", bound=Callable[..., Any])


# For type checkers: the decorated function keeps its signature. The first overload takes
# the options too, so that ``functools.partial(typed_shard_map, check_rep=False)`` (JAX's
# usual decorator idiom) is a decorator of ``f``, not a call with ``f=None``.
@overload
def typed_shard_map(
    f: _F,
    /,
    *,
    mesh: Any | None = None,
    static_argnames: str | Iterable[str] = (),
    check_vma: bool | None = None,
    check_rep: bool | None = None,
    axis_names: str | Iterable[str] | None = None,
    **shard_map_kwargs: Any,
) -> _F: ...


@overload
def typed_shard_map(
    f: None = None,
    /,
    *,
    mesh: Any | None = None,
    static_argnames: str | Iterable[str] = (),
    check_vma: bool | None = None,
    check_rep: bool | None = None,
    axis_names: str | Iterable[str] | None = None,
    **shard_map_kwargs: Any,
) -> Callable[[_F], _F]: ...


def typed_shard_map(
    f: Callable | None = None,
    *,
    mesh: Any | None = None,
    static_argnames: str | Iterable[str] = (),
    check_vma: bool | None = None,
    check_rep: bool | None = None,
    axis_names: str | Iterable[str] | None = None,
    **shard_map_kwargs: Any,
) -> Any:
    """Run ``f`` per device with ``jax.shard_map``, reading in/out specs from annotations.

    **Arguments:**

    - `f`: the per-device function: a function, a bound method (``model.apply``), a
      ``functools.partial`` or an object with ``__call__``. Every non-static parameter and
      the return value are annotated with array types (``f32[b'batch/d len']``), pytree
      dataclasses, ``Array['layers', T]`` or tuples of those. A parameter a partial binds by
      keyword stays an input if it is annotated as an array, and is static otherwise.
    - `mesh`: a ``jax.sharding.Mesh``; default the one from ``jax.set_mesh`` or the legacy
      ``with mesh:``.
    - `static_argnames`: parameters passed through as Python values (closed over).
    - `check_vma` (alias `check_rep`), `axis_names`: passed to ``jax.shard_map``.

    **Returns:** a function taking global arrays (or NumPy arrays) and returning global
    arrays, eagerly or under ``jax.jit``. Global shapes are checked first (dtype, names,
    divisibility by the mesh axes). On meshes whose axes are all Explicit (``jax.make_mesh``'s
    default) an input in another layout is resharded to the annotated one; an input already
    in it is passed as is, so the program is the one a hand-written ``jax.shard_map`` gives.

    Inside ``f`` a fresh binding scope per call starts with the names the global checks bound
    and is shared with the ``shardops`` in the body, which check per-device blocks (times the
    manual axis sizes); the return value is checked against its annotation.

    **Raises:** ``TypeError`` at decoration time for a parameter without an array annotation
    (unless static), ``*args``/``**kwargs``, a missing return annotation, a ``mesh`` that is
    not a mesh, a class or non-callable ``f``, or a partial binding a split array positionally;
    ``ValueError`` for a call nested in a ``shard_map`` body already manual over an axis its
    annotations split over;
    ``typeguard.TypeCheckError`` for a value that does not match its annotation; ``ValueError``
    when no mesh is in force.

    Examples:
        >>> @typed_shard_map
        ... def matvec(x: f32[b'batch/d in'], w: f32[b'in out']) -> f32[b'batch/d out']:
        ...     return shardops.einsum_unreduced('batch/d in, in out -> batch/d out', x, w)
    """
    if f is None:
        return functools.partial(
            typed_shard_map,
            mesh=mesh,
            static_argnames=static_argnames,
            check_vma=check_vma,
            check_rep=check_rep,
            axis_names=axis_names,
            **shard_map_kwargs,
        )
    try:  # decoration-time errors show the user's frames only, like the call's
        fname = callable_name(f)
        check_callable(f, fname)
        _check_mesh(fname, mesh)
        _check_shard_map_kwargs(fname, shard_map_kwargs)
        check_vma = _vma_option(fname, check_vma, check_rep)
        # The scope that applies the decorator, for annotations naming its local variables
        # (functools.partial adds no Python frame); its locals are read only if needed.
        sig = ShardMapSignature(f, static_argnames, _frames.caller_frame(1))
        options = _shard_map_options(shard_map_kwargs, check_vma, axis_names)
        calls = Calls(f, _unchecked_unreduced(fname, sig, check_vma), mesh, options)
    except Exception as e:
        _frames.hide_library_frames(e)
        raise

    @functools.wraps(f)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        # Run here, not in a helper: on CPython 3.11 each frame left on the stack while the
        # body is traced can cost trace time (see benchmarks/alignment.py). A try costs
        # nothing until something is raised.
        try:
            c = calls.get()
            smap, dyn, key = c.prepare(args, kwargs)
            try:
                with recording(notes=False) as ops:  # the program as written, no notes
                    out = smap()(*dyn)
            except ValueError as e:
                hint = c.replication_error(e)
                if hint is None:
                    raise
                raise hint from None
            c.confirm(smap, dyn, key, ops)
        except Exception as e:
            # The user's frames only, as JAX shows (JAX_TRACEBACK_FILTERING=off: all).
            _frames.hide_library_frames(e)
            raise
        return out

    wrapper.__shardlib_signature__ = sig  # type: ignore[attr-defined]
    return wrapper


def _shard_map_options(
    kwargs: Mapping[str, Any], check_vma: bool | None, axis_names: str | Iterable[str] | None
) -> tuple[dict[str, Any], frozenset[str] | None]:
    """The ``jax.shard_map`` keywords, and the manual axes (None: all)."""
    extra = dict(kwargs)
    if check_vma is not None:
        extra["check_vma"] = check_vma
    manual: frozenset[str] | None = None
    if axis_names is not None:
        manual = frozenset((axis_names,) if isinstance(axis_names, str) else axis_names)
        extra["axis_names"] = set(manual)
    return extra, manual


def _vma_option(fname: str, check_vma: bool | None, check_rep: bool | None) -> bool | None:
    """``check_vma``, or its old name ``check_rep``; both given must agree."""
    if check_rep is None:
        return check_vma
    if check_vma is not None and check_vma != check_rep:
        raise ValueError(
            f"typed_shard_map({fname}): check_rep={check_rep} and check_vma={check_vma} "
            "disagree; check_rep is the old name of check_vma, pass only check_vma"
        )
    return check_rep


def _unchecked_unreduced(
    fname: str, sig: ShardMapSignature, check_vma: bool | None
) -> ShardMapSignature:
    """``sig``, refused at decoration time if it has a result annotated unreduced (``{+t}``)
    with ``check_vma=False`` on a JAX whose ``shard_map`` cannot return one so
    (`shardlib._env.context.UNCHECKED_UNREDUCED`: JAX 0.9)."""
    if check_vma is not False or _context.UNCHECKED_UNREDUCED:
        return sig
    typed = [lf for lf in sig.out_flat if lf.spec.pending]
    if not typed:
        return sig
    lf = typed[0]
    raise ValueError(
        f"typed_shard_map({fname}): the return annotation {annotation_str(lf.dtype, lf.spec)} "
        f"types the result unreduced, and JAX {jax.__version__}'s shard_map returns a result "
        "as unreduced only with check_vma on (with check_vma=False it cannot type the result "
        "unreduced, and refuses the out_specs); drop check_vma=False, or use JAX 0.10 or later"
    )


def _check_mesh(fname: str, mesh: Any) -> None:
    """Refuse, at decoration time, a ``mesh=`` that is not a mesh (``mesh='d'``)."""
    if mesh is None or isinstance(mesh, jax.sharding.Mesh | jax.sharding.AbstractMesh):
        return
    hint = (
        f"; to run the body manual over mesh axis {mesh!r} only, pass axis_names={mesh!r} "
        "(and the mesh through jax.set_mesh or mesh=)"
        if isinstance(mesh, str)
        else ""
    )
    raise TypeError(
        f"typed_shard_map({fname}): mesh must be a jax.sharding.Mesh such as "
        "jax.make_mesh((8,), ('d',)) (or left out, to use the one from jax.set_mesh), got "
        f"{describe_value(mesh)}{hint}"
    )


def _check_shard_map_kwargs(fname: str, kwargs: Mapping[str, Any]) -> None:
    """Reject, at decoration time, keywords ``jax.shard_map`` would refuse at call time."""
    for k in ("in_specs", "out_specs"):
        if k in kwargs:
            raise TypeError(
                f"typed_shard_map({fname}): do not pass {k}; it is read from {fname}'s "
                "annotations (use jax.shard_map directly to give specs by hand)"
            )
    try:
        accepted = set(inspect.signature(jax.shard_map).parameters)
    except (TypeError, ValueError):  # pragma: no cover - not introspectable: let JAX decide
        return
    unknown = sorted(set(kwargs) - accepted)
    if unknown:
        raise TypeError(
            f"typed_shard_map({fname}): unexpected keyword argument(s) {unknown}; it takes "
            "mesh, static_argnames, check_vma (or check_rep), axis_names"
        )
