"""Ring attention and all-gather attention as per-device shardlib code (JAX).

The public face is `shardlib.attention` (its docstring is the user's guide); the layouts'
arithmetic and the argument rules are pure Python in `shardlib._attention.plan`, the block
math in `shardlib._attention.blocks`.
"""

from __future__ import annotations

import functools
import math
import numbers
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from .._check.checking import check_block
from .._check.scopes import op_scope
from .._env import rules as _rules
from .._env.context import (
    forward_mode,
    manual_axis_items,
    manual_axis_sizes,
    mesh_axis_sizes,
    varying_axes,
)
from .._lang.parsing import ShapeSpec
from ..shardops import all_gather, axis_index, shift
from . import blocks as B
from .plan import (
    AttentionPlan,
    axis_error,
    block_pairs,
    chunks,
    heads_error,
    plan_attention,
    segments_meet,
    sequence_error,
    stored_positions,
)

__all__ = ["gathered", "ring"]

F32 = jnp.float32


class _Config(NamedTuple):
    """What the ring needs besides arrays (hashable: a ``custom_vjp`` static argument)."""

    plan: AttentionPlan
    c: int
    scale: float | None  # None: the scale is an array, passed to the ring as an argument
    axes: frozenset[str] | None  # the axes the results vary over (None: not tracked)
    segment_skip: bool = True  # skip blocks whose segments cannot meet (`segments_meet`)


def _prepare(
    fn: str, spec: Any, q: Any, k: Any, v: Any, axis: Any, causal: bool, layout: str, ids: Any
) -> AttentionPlan:
    """Check the arguments of ``fn`` (the rules of `shardlib._attention.plan`); the plan."""
    manual = manual_axis_sizes()
    axis = _rules.one_axis(fn, "axis", axis)
    bad = axis_error(fn, axis, manual, mesh_axis_sizes())
    if bad:
        raise ValueError(bad)
    plan = plan_attention(fn, _rules.text(spec, f"{fn}: argument `spec`"), axis, layout, causal)
    scope, items = op_scope(), manual_axis_items()
    check_block(q, plan.q, scope, items, f"{fn}: argument `q`")
    check_block(k, plan.kv, scope, items, f"{fn}: argument `k`")
    check_block(v, plan.kv, scope, items, f"{fn}: argument `v`")
    if ids is not None:
        check_block(
            ids, ShapeSpec.parse(plan.ids_text), scope, items, f"{fn}: argument `segment_ids`"
        )
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(
            f"{fn}: arguments `q`, `k` and `v` must have one dtype, got {q.dtype}, {k.dtype} "
            f"and {v.dtype}; cast them with .astype()"
        )
    heads = math.prod(manual.get(a, 1) for a in plan.q.dims[2].sharding)
    bad = heads_error(fn, plan, q.shape[2], k.shape[2], heads) or sequence_error(
        fn, plan, q.shape[1], manual[axis]
    )
    if bad:
        raise ValueError(bad)
    return plan


def _scale(fn: str, scale: Any, width: int) -> tuple[float | None, jax.Array | None]:
    """``scale`` as a Python float (fixed: folded into the program) or as a float array of
    shape ``()`` (traced, and differentiable: ``jax.grad`` w.r.t. it works); the other None."""
    if scale is None:
        return width**-0.5, None
    if isinstance(scale, numbers.Real) and not isinstance(scale, bool):
        return float(scale), None
    shape, dtype = getattr(scale, "shape", None), getattr(scale, "dtype", None)
    if shape == () and dtype is not None and jnp.issubdtype(dtype, jnp.floating):
        return None, jnp.asarray(scale)
    got = (
        f"an array of shape {tuple(shape)} and dtype {dtype}"
        if shape is not None
        else f"{type(scale).__name__} {scale!r}"
    )
    raise ValueError(
        f"{fn}: argument `scale` must be None (1/sqrt(D)), a Python float, or a float array "
        f"of shape () (it may be traced, e.g. a learned scale); got {got}"
    )


def _config(plan: AttentionPlan, q: Any, k: Any, v: Any, ids: Any, scale: float | None) -> _Config:
    c = manual_axis_sizes()[plan.axis]
    found = [varying_axes(x) for x in (q, k, v, ids) if x is not None]
    axes = None
    if all(f is not None for f in found):
        axes = frozenset({plan.axis}).union(*(f for f in found if f is not None))
    return _Config(plan, c, scale, axes)


def _factor(cfg: _Config, scale: jax.Array | None) -> Any:
    """The score scale the blocks multiply by: the fixed float, or the array in f32."""
    return cfg.scale if scale is None else scale.astype(F32)


def _like(cfg: _Config) -> jax.Array:
    """An f32 zero that varies over every axis the results vary over."""
    zero = jnp.zeros((), F32)
    if cfg.axes is None:
        return zero
    have = varying_axes(zero) or frozenset()
    missing = tuple(sorted(cfg.axes - have))
    return lax.pcast(zero, missing, to="varying") if missing else zero


def _positions(cfg: _Config, device: Any, local: int) -> list[jax.Array]:
    """The original positions of each chunk ``device`` holds."""
    ids = chunks(device, cfg.c, cfg.plan.layout)
    size = local // len(ids)
    return [x * size + jnp.arange(size) for x in ids]


def _split(x: jax.Array | None, n: int, axis: int) -> list[Any]:
    return [None] * n if x is None else jnp.split(x, n, axis=axis)


def _queries(cfg: _Config, q: jax.Array, ids: jax.Array | None) -> list[B.Queries]:
    """This device's query chunks, grouped by key/value head: ``(B, Lq, K, G, D)`` each."""
    me = axis_index(cfg.plan.axis)
    pos = _positions(cfg, me, q.shape[1])
    xs, segs = _split(q, len(pos), 1), _split(ids, len(pos), 1)
    return [B.Queries(x, p, s) for x, p, s in zip(xs, pos, segs, strict=True)]


def _keys(cfg: _Config, kv: tuple, src: Any) -> list[B.Keys]:
    """The key chunks of the block that device ``src`` holds."""
    k, v, ids = kv
    pos = _positions(cfg, src, k.shape[1])
    n = len(pos)
    parts = zip(_split(k, n, 1), _split(v, n, 1), pos, _split(ids, n, 1), strict=True)
    return [B.Keys(*p) for p in parts]


def _pairs(cfg: _Config, src: Any, qs: list[B.Queries], ks: list[B.Keys]) -> list:
    """(query chunk, key chunk, needed) of this device against ``src``'s block: needed by
    the causal rule (`block_needed`) and, with segment ids, when the chunks' id ranges meet
    in some batch row (`segments_meet`, on the ids that travel with the block)."""
    me = axis_index(cfg.plan.axis)
    pairs = block_pairs(me, src, cfg.c, cfg.plan.layout, cfg.plan.causal)
    if not cfg.segment_skip or qs[0].seg is None:
        return pairs
    out = []
    for a, b, needed in pairs:
        meet = _meet(qs[a], ks[b])
        out.append((a, b, meet if needed is True else jnp.logical_and(needed, meet)))
    return out


def _meet(query: B.Queries, keys: B.Keys) -> Any:
    """Whether the block may hold a visible score by its segment ids: their ranges per batch
    row meet (`segments_meet`); True without ids. The ring's rule and Ulysses' local loop's."""
    if query.seg is None or keys.seg is None:
        return True
    q, k = query.seg, keys.seg
    return segments_meet(q.min(axis=1), q.max(axis=1), k.min(axis=1), k.max(axis=1))


def _when(needed: Any, compute: Any, skip: Any, *args: Any) -> Any:
    """``compute(*args)`` where the block is needed, else ``skip(*args)`` (no work)."""
    if needed is True:
        return compute(*args)
    return lax.cond(needed, compute, skip, *args)


def _shift_kv(cfg: _Config, kv: tuple) -> tuple:
    text = cfg.plan.kv_text
    k, v, ids = kv
    k, v = shift(text, k, cfg.plan.axis), shift(text, v, cfg.plan.axis)
    if ids is not None:
        ids = shift(cfg.plan.ids_text, ids, cfg.plan.axis)
    return k, v, ids


# ---------------------------------------------------------------------------------------------
# The ring: forward and backward passes, each a loop of c steps
# ---------------------------------------------------------------------------------------------


def _forward_step(cfg: _Config, scale: Any, qs: list, states: tuple, kv: tuple, src: Any) -> tuple:
    """Every query chunk's state updated with the key chunks of ``src``'s block."""
    ks = _keys(cfg, kv, src)
    out = list(states)
    for a, b, needed in _pairs(cfg, src, qs, ks):

        def compute(st, a=a, b=b):
            return B.forward_block(st, qs[a], ks[b], cfg.plan.causal, scale)

        out[a] = _when(needed, compute, lambda st: st, out[a])
    return tuple(out)


def _ring_forward(
    cfg: _Config, q: jax.Array, k: jax.Array, v: jax.Array, ids: Any, scale: Any
) -> tuple:
    factor = _factor(cfg, scale)
    b, lq, h, d = q.shape
    group = h // k.shape[2]
    qs = _queries(cfg, q.reshape(b, lq, k.shape[2], group, d), ids)
    like = _like(cfg)
    states = tuple(B.start(x, like) for x in qs)
    me = axis_index(cfg.plan.axis)

    def step(carry: tuple, s: jax.Array) -> tuple:
        states, kv = carry
        sent = _shift_kv(cfg, kv)  # in flight while this block is computed
        return (_forward_step(cfg, factor, qs, states, kv, (me - s) % cfg.c), sent), None

    (states, kv), _ = lax.scan(step, (states, (k, v, ids)), jnp.arange(cfg.c - 1))
    states = _forward_step(cfg, factor, qs, states, kv, (me - (cfg.c - 1)) % cfg.c)
    outs, lses = zip(*(B.finish(st, q.dtype) for st in states), strict=True)
    return jnp.concatenate(outs, axis=1).reshape(q.shape), jnp.concatenate(lses, axis=-1)


def _backward_step(
    cfg: _Config, scale: Any, rows: list, grads: tuple, kv: tuple, src: Any
) -> tuple:
    """``grads`` = ``(dq, dkv, dscale)`` with this device's rows against ``src``'s block
    added: ``dq`` per query chunk, ``dkv`` the gradient of ``src``'s block, ``dscale`` the
    scale's (None when the scale is a fixed float)."""
    dq, dkv, dscale = grads
    with_scale = dscale is not None
    ks = _keys(cfg, kv, src)
    dqs = list(dq)
    dk, dv = list(jnp.split(dkv[0], len(ks), 1)), list(jnp.split(dkv[1], len(ks), 1))
    for a, b, needed in _pairs(cfg, src, [r[0] for r in rows], ks):
        q, do, lse, delta = rows[a]

        def compute(g, q=q, do=do, lse=lse, delta=delta, b=b):
            got = B.backward_block(
                q, ks[b], do, lse, delta, cfg.plan.causal, scale, with_scale=with_scale
            )
            return tuple(x + y for x, y in zip(g, got, strict=True))

        g = (dqs[a], dk[b], dv[b]) + ((dscale,) if with_scale else ())
        g = _when(needed, compute, lambda g: g, g)
        dqs[a], dk[b], dv[b] = g[:3]
        dscale = g[3] if with_scale else None
    return tuple(dqs), (jnp.concatenate(dk, axis=1), jnp.concatenate(dv, axis=1)), dscale


def _ring_backward(cfg: _Config, res: tuple, dout: jax.Array) -> tuple:
    q, k, v, ids, scale, out, lse = res
    factor = _factor(cfg, scale)
    b, lq, h, d = q.shape
    shape = (b, lq, k.shape[2], h // k.shape[2], d)
    qs = _queries(cfg, q.reshape(shape), ids)
    do = jnp.moveaxis(dout.reshape(shape).astype(F32), 1, 3)  # B K G Lq D
    delta = jnp.sum(do * jnp.moveaxis(out.reshape(shape).astype(F32), 1, 3), axis=-1)
    n = len(qs)
    rows = list(zip(qs, *(jnp.split(x, n, axis=3) for x in (do, lse, delta)), strict=True))
    like = _like(cfg)
    dq = tuple(jnp.zeros(x.x.shape, F32) + like for x in qs)
    zeros = (jnp.zeros(k.shape, F32) + like, jnp.zeros(v.shape, F32) + like)
    dscale = None if scale is None else like
    me, c, text = axis_index(cfg.plan.axis), cfg.c, cfg.plan.kv_text
    dq, own, dscale = _backward_step(cfg, factor, rows, (dq, zeros, dscale), (k, v, ids), me)
    if c > 1:
        # Block j's gradient travels with block j from its first stop away from home, then
        # goes home: c - 1 transfers of K/V and c - 1 of dK/dV per device.
        def step(carry: tuple, s: jax.Array) -> tuple:
            grads, kv = carry
            sent = _shift_kv(cfg, kv)
            dq, dkv, dscale = _backward_step(cfg, factor, rows, grads, kv, (me - s) % c)
            dkv = tuple(shift(text, g, cfg.plan.axis) for g in dkv)
            return ((dq, dkv, dscale), sent), None

        carry = ((dq, zeros, dscale), _shift_kv(cfg, (k, v, ids)))
        (grads, kv), _ = lax.scan(step, carry, jnp.arange(1, c - 1))
        dq, dkv, dscale = _backward_step(cfg, factor, rows, grads, kv, (me - (c - 1)) % c)
        own = tuple(o + shift(text, g, cfg.plan.axis) for o, g in zip(own, dkv, strict=True))
    dq = jnp.concatenate(dq, axis=1).reshape(q.shape).astype(q.dtype)
    if scale is not None:
        dscale = dscale.astype(scale.dtype)  # this device's part: the caller's pcast sums it
    return dq, own[0].astype(k.dtype), own[1].astype(v.dtype), None, dscale


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring(
    cfg: _Config, q: jax.Array, k: jax.Array, v: jax.Array, ids: Any, scale: Any
) -> jax.Array:
    return _ring_forward(cfg, q, k, v, ids, scale)[0]


def _ring_fwd(
    cfg: _Config, q: jax.Array, k: jax.Array, v: jax.Array, ids: Any, scale: Any
) -> tuple:
    out, lse = _ring_forward(cfg, q, k, v, ids, scale)
    return out, (q, k, v, ids, scale, out, lse)  # O(L/c) per device: no score block is kept


_ring.defvjp(_ring_fwd, _ring_backward)


def _scope(fn: str, plan: AttentionPlan, c: int) -> str:
    return f"shardlib.attention.{fn}[axis={plan.axis} c={c} layout={plan.layout}]"


def ring(
    spec: str | bytes,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    axis: str = "c",
    *,
    causal: bool = True,
    layout: str = "contiguous",
    segment_ids: jax.Array | None = None,
    scale: float | jax.Array | None = None,
    segment_skip: bool = True,
) -> jax.Array:
    """Ring attention (see `shardlib.attention.ring`). ``segment_skip=False`` (internal: for
    the benchmark and the tests) computes the blocks that only the segment ids mask."""
    plan = _prepare("ring", spec, q, k, v, axis, causal, layout, segment_ids)
    _refuse_forward_mode(
        "ring",
        (q, k, v, scale),
        "ring attention",
        "its backward is a second ring it defines itself",
    )
    fixed, traced = _scale("ring", scale, q.shape[-1])
    cfg = _config(plan, q, k, v, segment_ids, fixed)._replace(segment_skip=bool(segment_skip))
    # What travels round the ring varies over its axis once shifted: a loop carry must start so
    # (segment ids made in the body, e.g. jnp.zeros, or K/V replicated over the axis). A traced
    # scale is cast so too: each device's part of its gradient is then summed by the pcast's
    # transpose.
    k, v, segment_ids, traced = (_varying(cfg, x) for x in (k, v, segment_ids, traced))
    with jax.named_scope(_scope("ring", plan, cfg.c)):
        return _ring(cfg, q, k, v, segment_ids, traced)


def _refuse_forward_mode(fn: str, args: tuple, what: str, why: str) -> None:
    """Raise naming ``fn`` when ``args`` carry forward-mode tangents: ``what`` (e.g. ``'ring
    attention'``) defines its own backward pass (``why``, a ``jax.custom_vjp``)."""
    if forward_mode(args):
        raise TypeError(
            f"{fn}: forward-mode differentiation (jax.jvp, jax.jacfwd) of {what} is not "
            f"supported: {why} (a jax.custom_vjp). Differentiate with jax.grad, "
            "jax.value_and_grad or jax.vjp, or use attention.gathered, which plain autodiff "
            "runs in both modes"
        )


def _varying(cfg: _Config, x: Any) -> Any:
    """``x`` cast to vary over every axis the results vary over (`_like`'s), if it does not."""
    if x is None or cfg.axes is None:
        return x
    missing = tuple(sorted(cfg.axes - (varying_axes(x) or frozenset())))
    return lax.pcast(x, missing, to="varying") if missing else x


def gathered(
    spec: str | bytes,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    axis: str = "c",
    *,
    causal: bool = True,
    layout: str = "contiguous",
    segment_ids: jax.Array | None = None,
    scale: float | jax.Array | None = None,
) -> jax.Array:
    """All-gather attention (see `shardlib.attention.gathered`)."""
    plan = _prepare("gathered", spec, q, k, v, axis, causal, layout, segment_ids)
    fixed, traced = _scale("gathered", scale, q.shape[-1])
    cfg = _config(plan, q, k, v, segment_ids, fixed)
    with jax.named_scope(_scope("gathered", plan, cfg.c)):
        k_all = all_gather(plan.gathered_kv_text, k)
        v_all = all_gather(plan.gathered_kv_text, v)
        ids_all = None
        if segment_ids is not None:
            b, s = plan.q.dims[:2]
            ids_all = all_gather(f"{plan.ids_text} -> {b} {s.shape}", segment_ids)
        length = k_all.shape[1]
        pos = jnp.asarray(stored_positions(length, cfg.c, plan.layout))
        keys = B.Keys(k_all, v_all, pos, ids_all)
        b_, lq, h, d = q.shape
        qs = _queries(cfg, q.reshape(b_, lq, k.shape[2], h // k.shape[2], d), segment_ids)
        factor = _factor(cfg, traced)  # a traced scale: autodiff gives its gradient
        outs = [B.plain(x, keys, plan.causal, factor) for x in qs]
        return jnp.concatenate(outs, axis=1).reshape(q.shape)
