"""Capacity-based dispatch, the expert FFN and the combine over the expert axis (JAX).

Each device sorts its tokens into an ``(E, C, M)`` buffer (``C`` slots per expert), sends
expert ``j``'s rows to device ``j`` of the expert axis with one `shardops.all_to_all`
(``'E C/e M -> E/e C M'``: it then holds its ``E/e`` experts' slots from every device of the
axis), runs its experts as one batched matmul, and sends the results back with the reverse
all-to-all, where each token sums its experts' outputs weighted by its gates.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from .._check.scopes import Scope
from .._env import rules as _rules
from .._env.context import manual_axis_sizes, mesh_axis_sizes, varying_axes
from .._lang.scope_codec import MoeLayerScope
from ..shardops import all_to_all, einsum, pmean
from . import capacity as P
from .router import Routing, route_as

__all__ = ["GELU", "Slots", "Stats", "assign", "combine", "dispatch", "expert_ffn", "layer"]


class _Named:
    """A default function that prints as the expression naming it, so that ``help()`` shows
    ``activation=jax.nn.gelu`` rather than ``<PjitFunction of <function gelu at 0x...>>``."""

    def __init__(self, fn: Callable[[jax.Array], jax.Array], text: str) -> None:
        self.fn, self.text = fn, text

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.fn(x)

    def __repr__(self) -> str:
        return self.text


# The experts' default activation: jax.nn.gelu as JAX defines it (approximate=True, the tanh
# form).
GELU = _Named(jax.nn.gelu, "jax.nn.gelu")


class Slots(NamedTuple):
    """Where each (token, choice) went: a row of the flat ``(E * C)`` buffer, or dropped."""

    slot: jax.Array  # int32 (T, k): expert * C + position; E * C where dropped
    keep: jax.Array  # bool (T, k): False where the expert was full


class Stats(NamedTuple):
    """What a layer reports besides its output (this device's tokens)."""

    aux_loss: jax.Array  # the router's load-balancing loss
    z_loss: jax.Array  # the router's z-loss
    dropped: jax.Array  # int32 (): (token, choice) pairs beyond capacity on this device
    load: jax.Array  # int32 (E,): (token, choice) pairs routed to each expert, before drops
    capacity: int  # slots per expert per device


def assign(experts: jax.Array, num_experts: int, cap: int) -> Slots:
    """The drop rule: each (token, choice) pair's slot in its expert's ``cap`` rows.

    Slots are filled in priority order: every token's first choice in token order, then every
    token's second choice, and so on (GShard's rule: a token's best expert comes first). A
    pair finding its expert's ``cap`` slots full is dropped (``keep`` False, ``slot``
    ``num_experts * cap``).

    **Raises:** ``ValueError`` when ``num_experts`` or ``cap`` is not an int ``>= 1`` (NumPy
    ints are fine, bools and floats are not).

    Examples:
        >>> slots = moe.assign(routing.experts, 8, 4)
    """
    num_experts, cap = _counts("assign", num_experts, cap)
    return _assign(experts, num_experts, cap)


def _assign(experts: jax.Array, num_experts: int, cap: int) -> Slots:
    """The drop rule: slots are filled in priority order, every token's first choice (in token
    order), then every token's second choice, and so on; a pair finding its expert's ``cap``
    slots full is dropped."""
    t, k = experts.shape
    onehot = jax.nn.one_hot(experts.T.reshape(-1), num_experts, dtype=jnp.int32)  # (k T, E)
    before = jnp.cumsum(onehot, axis=0) - onehot  # pairs ahead of this one, per expert
    pos = jnp.sum(before * onehot, axis=1).reshape(k, t).T
    keep = pos < cap
    slot = jnp.where(keep, experts * cap + pos, num_experts * cap)
    return Slots(slot.astype(jnp.int32), keep)


def _a2a(axis: str, text: str, x: jax.Array) -> jax.Array:
    with Scope("moe"):  # the buffer's own names, apart from the caller's
        return all_to_all(text.format(a=axis), x)


def dispatch(x: jax.Array, slots: Slots, num_experts: int, cap: int, axis: str = "e") -> jax.Array:
    """This device's tokens ``(T, M)`` into the slots of its experts: ``(E/e, e * C, M)``.

    One `shardops.all_to_all` ``'E C/e M -> E/e C M'`` over mesh ``axis``: expert ``j``'s
    ``C`` rows go to the device holding expert ``j``, which receives ``C`` rows per expert
    from each of the ``e`` devices.

    **Raises:** ``ValueError`` when ``num_experts`` or ``cap`` is not an int ``>= 1``.

    Examples:
        >>> buf = moe.dispatch(tokens, slots, 8, 4, axis='e')
    """
    num_experts, cap = _counts("dispatch", num_experts, cap)
    return _dispatch(x, slots, num_experts, cap, _axis("dispatch", axis))


def _dispatch(x: jax.Array, slots: Slots, num_experts: int, cap: int, axis: str) -> jax.Array:
    """This device's tokens ``(T, M)`` into its experts' slots ``(E/e, e * C, M)``."""
    t, m = x.shape
    rows = jnp.broadcast_to(x[:, None, :], (t, slots.slot.shape[1], m)).reshape(-1, m)
    buf = jnp.zeros((num_experts * cap + 1, m), x.dtype).at[slots.slot.reshape(-1)].add(rows)
    buf = buf[:-1].reshape(num_experts, cap, m)  # the last row took the dropped pairs
    return _a2a(axis, "E C/{a} M -> E/{a} C M", buf)


def combine(y: jax.Array, slots: Slots, gates: jax.Array, axis: str = "e") -> jax.Array:
    """The experts' outputs ``(E/e, e * C, M)`` back home as tokens ``(T, M)``.

    The reverse all-to-all ``'E/e C M -> E C/e M'``, then each token's kept choices summed
    with their gates (a token with every choice dropped gets zeros).

    Examples:
        >>> out = moe.combine(y, slots, routing.gates, axis='e')
    """
    return _combine(y, slots, gates, _axis("combine", axis))


def _combine(y: jax.Array, slots: Slots, gates: jax.Array, axis: str) -> jax.Array:
    """The experts' outputs ``(E/e, e * C, M)`` back to this device's tokens ``(T, M)``,
    each the gate-weighted sum of its kept choices."""
    back = _a2a(axis, "E/{a} C M -> E C/{a} M", y)
    m = back.shape[-1]
    flat = jnp.concatenate([back.reshape(-1, m), jnp.zeros((1, m), back.dtype)])
    picked = flat[slots.slot]  # (T, k, M); the zero row where dropped
    w = jnp.where(slots.keep, gates, 0.0).astype(picked.dtype)
    return jnp.einsum("tk,tkm->tm", w, picked)


def expert_ffn(
    buf: jax.Array,
    w_in: jax.Array,
    w_out: jax.Array,
    axis: str = "e",
    hidden_axis: str | None = None,
    activation: Callable[[jax.Array], jax.Array] = GELU,
) -> jax.Array:
    """The local experts' FFN on their slots: ``activation(buf @ w_in) @ w_out`` per expert,
    ``activation`` ``jax.nn.gelu`` by default (JAX's default form, ``approximate=True``).

    ``buf`` ``(E/e, C, M)``, ``w_in`` ``f32['E/e M F']``, ``w_out`` ``f32['E/e F M']``, as
    two batched `shardops.einsum`s; with ``hidden_axis='t'`` the weights are ``F/t`` and the
    second einsum all-reduces over ``t``.

    Examples:
        >>> y = moe.expert_ffn(buf, w_in, w_out, axis='e', hidden_axis='t')
    """
    hidden = _hidden("expert_ffn", hidden_axis)
    return _expert_ffn(buf, w_in, w_out, _axis("expert_ffn", axis), hidden, activation)


def _expert_ffn(
    buf: jax.Array,
    w_in: jax.Array,
    w_out: jax.Array,
    axis: str,
    hidden_axis: str | None,
    activation: Callable[[jax.Array], jax.Array],
) -> jax.Array:
    """Every local expert's FFN on its slots, one batched matmul each way: ``buf``
    ``(E/e, C, M)``, ``w_in`` ``(E/e, M, F)``, ``w_out`` ``(E/e, F, M)`` (``F/t`` with
    ``hidden_axis='t'``: the second matmul all-reduces over ``t``)."""
    f = f"F/{hidden_axis}" if hidden_axis else "F"
    e = f"E/{axis}"
    with Scope("moe"):
        h = einsum(f"{e} C M, {e} M {f} -> {e} C {f}", buf, w_in)
        return einsum(f"{e} C {f}, {e} {f} M -> {e} C M", activation(h), w_out)


def _check_layer(fn: str, x: Any, w_router: Any, w_in: Any, w_out: Any, axes: tuple) -> int:
    """The layer's arguments against each other; the expert axis size."""
    manual, mesh = manual_axis_sizes(), mesh_axis_sizes()
    names = ("axis", "hidden_axis")
    for name, a in zip(names, axes, strict=True):
        if a is not None and (bad := P.axis_error(fn, name, a, manual, mesh)):
            raise ValueError(bad)
    e = manual[axes[0]]
    m = x.shape[-1]
    experts = w_router.shape[-1]
    checks = [
        P.experts_error(fn, experts, axes[0], e),
        P.shape_error(fn, "w_router", "0 (M)", m, w_router.shape[0], "x's last dim"),
        P.shape_error(fn, "w_in", "0 (E/e)", experts // e, w_in.shape[0], "experts / e"),
        P.shape_error(fn, "w_in", "1 (M)", m, w_in.shape[1], "x's last dim"),
        P.shape_error(fn, "w_out", "0 (E/e)", experts // e, w_out.shape[0], "experts / e"),
        P.shape_error(fn, "w_out", "1 (F/t)", w_in.shape[2], w_out.shape[1], "w_in's dim 2"),
        P.shape_error(fn, "w_out", "2 (M)", m, w_out.shape[2], "x's last dim"),
    ]
    for bad in checks:
        if bad:
            raise ValueError(bad)
    return e


def _capacity(fn: str, tokens: int, k: int, experts: int, cap: Any, factor: Any, dropless: bool):
    if dropless and cap is not None:
        raise ValueError(
            f"{fn}: arguments `capacity` ({cap!r}) and `dropless=True` disagree: dropless sets "
            f"the capacity to the tokens per device ({tokens}); pass one of them"
        )
    if dropless:
        return P.dropless_capacity(tokens)
    bad = P.capacity_error(fn, cap, factor)
    if bad:
        raise ValueError(bad)
    return int(cap) if cap is not None else max(1, P.capacity(tokens, k, experts, factor))


def _same_over_axis(tokens: jax.Array, out: jax.Array, axis: str) -> jax.Array:
    """The output typed like the tokens over the expert axis.

    Tokens replicated over ``axis`` (``x`` ``'B/d L M'``; JAX's types say so with
    ``check_vma`` on) give the same output on every device of it, but the all-to-alls type it
    varying there, and a return annotation replicated over ``axis`` is refused. Its mean over
    ``axis`` is the output itself, typed replicated (one all-reduce of ``(T, M)``; with
    ``check_vma`` off nothing is typed and nothing is added).
    """
    vary = varying_axes(tokens)
    if vary is None or axis in vary:
        return out
    with Scope("moe"):
        return pmean("T M", out, axis)


def layer(
    x: jax.Array,
    w_router: jax.Array,
    w_in: jax.Array,
    w_out: jax.Array,
    *,
    k: int = 2,
    axis: str = "e",
    hidden_axis: str | None = None,
    capacity_factor: float = 1.25,
    capacity: int | None = None,
    dropless: bool = False,
    gate: str = "softmax",
    renormalize: bool = True,
    stats_axes: str | tuple[str, ...] = (),
    activation: Callable[[jax.Array], jax.Array] = GELU,
) -> tuple[jax.Array, Stats]:
    """A mixture-of-experts FFN on this device's tokens, experts split over ``axis``.

    `route`, `assign`, `dispatch`, `expert_ffn`, `combine`, under the named scope
    ``shardlib.moe.layer[E=.. k=.. C=.. axis=..]``.

    **Arguments:**

    - `x`: this device's tokens ``(..., M)`` (any leading dims; flattened to ``T`` tokens).
    - `w_router`: ``f32['M E']``, replicated. `w_in`, `w_out`: ``f32['E/e M F']`` and
      ``f32['E/e F M']`` (``F/t`` with `hidden_axis`).
    - `k`: experts per token. `axis`: the expert mesh axis, manual here.
    - `capacity_factor`, `capacity`: slots per expert per device, ``capacity`` if given,
      else ``ceil(capacity_factor * T * k / E)`` (at least 1), computed exactly with the
      factor as written (`capacity`). `dropless`: ``C = T`` (nothing dropped).
    - `gate`, `renormalize`, `stats_axes`: as `route`'s ``gate``, ``renormalize``, ``axes``
      (an axis the tokens are replicated on, ``x`` ``'B/d L M'`` with ``('d', 'e')``, adds
      nothing: the statistics are the same on each of its devices).
    - `activation`: the experts' nonlinearity, ``jax.nn.gelu`` by default (JAX's default,
      the tanh approximation ``approximate=True``); any ``jax.Array -> jax.Array`` function,
      e.g. ``jax.nn.relu`` or ``functools.partial(jax.nn.gelu, approximate=False)``.

    Tokens replicated over ``axis`` (``x`` ``'B/d L M'``) work, as ``e`` copies of the same
    routing: every device of ``e`` sends the same tokens, and with ``check_vma`` on the
    output is averaged over ``axis`` (one more all-reduce) so that it is typed replicated
    like ``x``. Split the tokens over ``axis`` too (``'B/d/e L M'``) to spread the work.

    **Returns:** ``(y, stats)``: ``y`` shaped like ``x``; `Stats` (``aux_loss``, ``z_loss``,
    ``dropped`` pairs on this device, ``load`` pairs per expert on this device,
    ``capacity``).

    **Raises:** ``ValueError`` naming the argument, dim, expected and actual value: an axis
    that is not manual, experts not divisible by the axis size, ``k`` outside ``1..E``, a
    capacity below 1, a ``capacity_factor`` not a finite number > 0, weights whose dims
    disagree. Counts (``k``, ``capacity``) may be Python or NumPy ints, not bools or floats.

    Examples:
        >>> y, stats = moe.layer(x, w_router, w_in, w_out, k=2, axis='e')
    """
    axis, hidden_axis = _axis("layer", axis), _hidden("layer", hidden_axis)
    fn = "moe.layer"
    e = _check_layer(fn, x, w_router, w_in, w_out, (axis, hidden_axis))
    experts = w_router.shape[-1]
    tokens = x.reshape(-1, x.shape[-1])
    t = tokens.shape[0]
    r: Routing = route_as(
        fn, tokens @ w_router, k, gate=gate, renormalize=renormalize, axes=stats_axes
    )
    k = int(k)  # checked by route: a Python or NumPy int
    cap = _capacity(fn, t, k, experts, capacity, capacity_factor, dropless)
    scope = MoeLayerScope(axis, e, experts, cap, k, x.shape[-1], x.dtype.itemsize).text()
    with jax.named_scope(scope):
        slots = _assign(r.experts, experts, cap)
        buf = _dispatch(tokens, slots, experts, cap, axis)
        y = _expert_ffn(buf, w_in, w_out, axis, hidden_axis, activation)
        out = _combine(y, slots, r.gates, axis)
        out = _same_over_axis(tokens, out, axis)
    load = jnp.sum(jax.nn.one_hot(r.experts, experts, dtype=jnp.int32), axis=(0, 1))
    dropped = jnp.sum(~slots.keep).astype(jnp.int32)
    stats = Stats(r.aux_loss, r.z_loss, dropped, load, cap)
    return out.reshape(x.shape), stats


def _counts(fn: str, num_experts: Any, cap: Any) -> tuple[int, int]:
    """``num_experts`` and ``cap`` as Python ints (NumPy ints too), or a shardlib error."""
    experts = P.as_int(f"moe.{fn}", "num_experts", num_experts, "number of experts")
    return experts, P.as_int(f"moe.{fn}", "cap", cap, "slots per expert per device")


def _axis(fn: str, axis: Any) -> Any:
    """The expert axis (a mesh axis or a role) as one mesh axis."""
    return _rules.one_axis(f"moe.{fn}", "axis", axis)


def _hidden(fn: str, axis: Any) -> Any:
    """The hidden axis (a mesh axis or a role; None when its role is replicated)."""
    if axis is None:
        return None
    out = _rules.axes(axis, f"moe.{fn}: argument `hidden_axis`")
    return None if out == () else _rules.one_axis(f"moe.{fn}", "hidden_axis", axis)
