"""Ring attention and all-gather attention as per-device shardlib code (JAX).

The public face is `shardlib.attention` (its module docstring is the user's guide); the
layouts' arithmetic is pure Python in `shardlib._attention.chunks`, the argument rules in
`shardlib._attention.rules`, what the ring shares with Ulysses in
`shardlib._attention.common`, the block math in `shardlib._attention.blocks`.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from ..shardops import all_gather, axis_index, shift
from . import blocks as B
from .chunks import block_pairs, chunks, stored_positions
from .common import (
    Config,
    attention_scope,
    make_config,
    prepare,
    read_scale,
    refuse_forward_mode,
    score_factor,
    segments_may_meet,
    varying,
    varying_zero,
    when,
)

__all__ = ["gathered", "ring", "ring_attention"]

F32 = jnp.float32


def _positions(cfg: Config, device: Any, local: int) -> list[jax.Array]:
    """The original positions of each chunk ``device`` holds."""
    ids = chunks(device, cfg.c, cfg.checked.layout)
    size = local // len(ids)
    return [x * size + jnp.arange(size) for x in ids]


def _split(x: jax.Array | None, n: int, axis: int) -> list[Any]:
    return [None] * n if x is None else jnp.split(x, n, axis=axis)


def _queries(cfg: Config, q: jax.Array, ids: jax.Array | None) -> list[B.Queries]:
    """This device's query chunks, grouped by key/value head: ``(B, Lq, K, G, D)`` each."""
    me = axis_index(cfg.checked.axis)
    pos = _positions(cfg, me, q.shape[1])
    xs, segs = _split(q, len(pos), 1), _split(ids, len(pos), 1)
    return [B.Queries(x, p, s) for x, p, s in zip(xs, pos, segs, strict=True)]


def _keys(cfg: Config, kv: tuple, src: Any) -> list[B.Keys]:
    """The key chunks of the block that device ``src`` holds."""
    k, v, ids = kv
    pos = _positions(cfg, src, k.shape[1])
    n = len(pos)
    parts = zip(_split(k, n, 1), _split(v, n, 1), pos, _split(ids, n, 1), strict=True)
    return [B.Keys(*p) for p in parts]


def _pairs(cfg: Config, src: Any, qs: list[B.Queries], ks: list[B.Keys]) -> list:
    """(query chunk, key chunk, needed) of this device against ``src``'s block: needed by
    the causal rule (`block_needed`) and, with segment ids, when the chunks' id ranges meet
    in some batch row (`segments_meet`, on the ids that travel with the block)."""
    me = axis_index(cfg.checked.axis)
    pairs = block_pairs(me, src, cfg.c, cfg.checked.layout, cfg.checked.causal)
    if not cfg.segment_skip or qs[0].seg is None:
        return pairs
    out = []
    for a, b, needed in pairs:
        meet = segments_may_meet(qs[a], ks[b])
        out.append((a, b, meet if needed is True else jnp.logical_and(needed, meet)))
    return out


def _shift_kv(cfg: Config, kv: tuple) -> tuple:
    text = cfg.checked.kv_text
    k, v, ids = kv
    k, v = shift(text, k, cfg.checked.axis), shift(text, v, cfg.checked.axis)
    if ids is not None:
        ids = shift(cfg.checked.ids_text, ids, cfg.checked.axis)
    return k, v, ids


# ---------------------------------------------------------------------------------------------
# The ring: forward and backward passes, each a loop of c steps
# ---------------------------------------------------------------------------------------------


def _forward_step(cfg: Config, scale: Any, qs: list, states: tuple, kv: tuple, src: Any) -> tuple:
    """Every query chunk's state updated with the key chunks of ``src``'s block."""
    ks = _keys(cfg, kv, src)
    out = list(states)
    for a, b, needed in _pairs(cfg, src, qs, ks):

        def compute(st, a=a, b=b):
            return B.forward_block(st, qs[a], ks[b], cfg.checked.causal, scale)

        out[a] = when(needed, compute, lambda st: st, out[a])
    return tuple(out)


def _ring_forward(
    cfg: Config, q: jax.Array, k: jax.Array, v: jax.Array, ids: Any, scale: Any
) -> tuple:
    factor = score_factor(cfg, scale)
    b, lq, h, d = q.shape
    group = h // k.shape[2]
    qs = _queries(cfg, q.reshape(b, lq, k.shape[2], group, d), ids)
    like = varying_zero(cfg)
    states = tuple(B.start(x, like) for x in qs)
    me = axis_index(cfg.checked.axis)

    def step(carry: tuple, s: jax.Array) -> tuple:
        states, kv = carry
        sent = _shift_kv(cfg, kv)  # in flight while this block is computed
        return (_forward_step(cfg, factor, qs, states, kv, (me - s) % cfg.c), sent), None

    (states, kv), _ = lax.scan(step, (states, (k, v, ids)), jnp.arange(cfg.c - 1))
    states = _forward_step(cfg, factor, qs, states, kv, (me - (cfg.c - 1)) % cfg.c)
    outs, lses = zip(*(B.finish(st, q.dtype) for st in states), strict=True)
    return jnp.concatenate(outs, axis=1).reshape(q.shape), jnp.concatenate(lses, axis=-1)


def _backward_step(cfg: Config, scale: Any, rows: list, grads: tuple, kv: tuple, src: Any) -> tuple:
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
                q, ks[b], do, lse, delta, cfg.checked.causal, scale, with_scale=with_scale
            )
            return tuple(x + y for x, y in zip(g, got, strict=True))

        g = (dqs[a], dk[b], dv[b]) + ((dscale,) if with_scale else ())
        g = when(needed, compute, lambda g: g, g)
        dqs[a], dk[b], dv[b] = g[:3]
        dscale = g[3] if with_scale else None
    return tuple(dqs), (jnp.concatenate(dk, axis=1), jnp.concatenate(dv, axis=1)), dscale


def _ring_backward(cfg: Config, res: tuple, dout: jax.Array) -> tuple:
    q, k, v, ids, scale, out, lse = res
    factor = score_factor(cfg, scale)
    b, lq, h, d = q.shape
    shape = (b, lq, k.shape[2], h // k.shape[2], d)
    qs = _queries(cfg, q.reshape(shape), ids)
    do = jnp.moveaxis(dout.reshape(shape).astype(F32), 1, 3)  # B K G Lq D
    delta = jnp.sum(do * jnp.moveaxis(out.reshape(shape).astype(F32), 1, 3), axis=-1)
    n = len(qs)
    rows = list(zip(qs, *(jnp.split(x, n, axis=3) for x in (do, lse, delta)), strict=True))
    like = varying_zero(cfg)
    dq = tuple(jnp.zeros(x.x.shape, F32) + like for x in qs)
    zeros = (jnp.zeros(k.shape, F32) + like, jnp.zeros(v.shape, F32) + like)
    dscale = None if scale is None else like
    me, c, text = axis_index(cfg.checked.axis), cfg.c, cfg.checked.kv_text
    dq, own, dscale = _backward_step(cfg, factor, rows, (dq, zeros, dscale), (k, v, ids), me)
    if c > 1:
        # Block j's gradient travels with block j from its first stop away from home, then
        # goes home: c - 1 transfers of K/V and c - 1 of dK/dV per device.
        def step(carry: tuple, s: jax.Array) -> tuple:
            grads, kv = carry
            sent = _shift_kv(cfg, kv)
            dq, dkv, dscale = _backward_step(cfg, factor, rows, grads, kv, (me - s) % c)
            dkv = tuple(shift(text, g, cfg.checked.axis) for g in dkv)
            return ((dq, dkv, dscale), sent), None

        carry = ((dq, zeros, dscale), _shift_kv(cfg, (k, v, ids)))
        (grads, kv), _ = lax.scan(step, carry, jnp.arange(1, c - 1))
        dq, dkv, dscale = _backward_step(cfg, factor, rows, grads, kv, (me - (c - 1)) % c)
        own = tuple(o + shift(text, g, cfg.checked.axis) for o, g in zip(own, dkv, strict=True))
    dq = jnp.concatenate(dq, axis=1).reshape(q.shape).astype(q.dtype)
    if scale is not None:
        dscale = dscale.astype(scale.dtype)  # this device's part: the caller's pcast sums it
    return dq, own[0].astype(k.dtype), own[1].astype(v.dtype), None, dscale


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring(cfg: Config, q: jax.Array, k: jax.Array, v: jax.Array, ids: Any, scale: Any) -> jax.Array:
    return _ring_forward(cfg, q, k, v, ids, scale)[0]


def _ring_fwd(cfg: Config, q: jax.Array, k: jax.Array, v: jax.Array, ids: Any, scale: Any) -> tuple:
    out, lse = _ring_forward(cfg, q, k, v, ids, scale)
    return out, (q, k, v, ids, scale, out, lse)  # O(L/c) per device: no score block is kept


_ring.defvjp(_ring_fwd, _ring_backward)


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
) -> jax.Array:
    """Ring attention over the sequence split over mesh ``axis`` (per-device code).

    **Arguments:**

    - `spec`: q's shape spec, then k's and v's: ``'B/d L/c H/t D, B/d L/c K/t D'`` (one spec
      when they are the same). Batch, sequence and width dims must agree; the sequence dim is
      split over exactly ``axis``; the heads dims over the same axes; the width unsplit.
    - `q`, `k`, `v`: this device's blocks, ``(B, L/c, H, D)`` and ``(B, L/c, K, D)``; ``K``
      divides ``H`` (query head ``h`` reads key/value head ``h // (H/K)``).
    - `axis`: the sequence mesh axis, manual in this body (``'c'``).
    - `causal`: mask keys after the query (by original position).
    - `layout`: ``'contiguous'`` (device ``i`` holds chunk ``i`` of ``c``) or ``'balanced'``
      (chunks ``i`` and ``2c - 1 - i`` of ``2c``; see `to_layout`).
    - `segment_ids`: ``None``, or int ids ``(B, L/c)`` in q's layout: attend within a segment.
    - `scale`: the score scale, ``1/sqrt(D)`` by default: a Python float (fixed), or a float
      array of shape ``()``, which may be traced (a learned scale: its gradient comes back;
      when it is the same on every device, each device's part is summed).

    **Returns:** the attention output, q's block shape and dtype.

    **Raises:** ``ValueError`` (or `SpecError` for the spec) naming the broken rule: `axis`
    not manual, specs that disagree, heads not divisible, a balanced sequence not divisible
    by ``2c``, a `scale` that is not a real scalar; ``TypeCheckError`` for a block that does
    not match the spec.

    Examples:
        >>> o = attention.ring('B/d L/c H/t D, B/d L/c K/t D', q, k, v, axis='c')
    """
    return ring_attention(
        spec,
        q,
        k,
        v,
        axis,
        causal=causal,
        layout=layout,
        segment_ids=segment_ids,
        scale=scale,
    )


def ring_attention(
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
    """Ring attention (`ring`), with one more argument: ``segment_skip=False`` (internal: for
    the benchmark and the tests) computes the blocks that only the segment ids mask."""
    checked = prepare("ring", spec, q, k, v, axis, causal, layout, segment_ids)
    refuse_forward_mode(
        "ring",
        (q, k, v, scale),
        "ring attention",
        "its backward is a second ring it defines itself",
    )
    fixed, traced = read_scale("ring", scale, q.shape[-1])
    cfg = make_config(checked, q, k, v, segment_ids, fixed)._replace(
        segment_skip=bool(segment_skip)
    )
    # What travels round the ring varies over its axis once shifted: a loop carry must start so
    # (segment ids made in the body, e.g. jnp.zeros, or K/V replicated over the axis). A traced
    # scale is cast so too: each device's part of its gradient is then summed by the pcast's
    # transpose.
    k, v, segment_ids, traced = (varying(cfg, x) for x in (k, v, segment_ids, traced))
    with jax.named_scope(attention_scope("ring", checked, cfg.c)):
        return _ring(cfg, q, k, v, segment_ids, traced)


def gathered(
    spec: str | bytes,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    axis: str = "c",
    *,
    causal: bool = True,
    layout: str = "contiguous",
    segment_ids: Any = None,
    scale: float | jax.Array | None = None,
) -> jax.Array:
    """Attention with K and V all-gathered over the sequence axis (per-device code).

    Same arguments, rules and result as `ring`. One all-gather of K and one of V (the
    backward pass: reduce-scatters of their gradients); the whole sequence's K/V and this
    device's ``(L/c) x L`` scores are held at once. For short sequences, and to compare.

    Examples:
        >>> o = attention.gathered('B L/c H D, B L/c K D', q, k, v, axis='c', layout='balanced')
    """
    checked = prepare("gathered", spec, q, k, v, axis, causal, layout, segment_ids)
    fixed, traced = read_scale("gathered", scale, q.shape[-1])
    cfg = make_config(checked, q, k, v, segment_ids, fixed)
    with jax.named_scope(attention_scope("gathered", checked, cfg.c)):
        k_all = all_gather(checked.gathered_kv_text, k)
        v_all = all_gather(checked.gathered_kv_text, v)
        ids_all = None
        if segment_ids is not None:
            b, s = checked.q.dims[:2]
            ids_all = all_gather(f"{checked.ids_text} -> {b} {s.shape}", segment_ids)
        length = k_all.shape[1]
        pos = jnp.asarray(stored_positions(length, cfg.c, checked.layout))
        keys = B.Keys(k_all, v_all, pos, ids_all)
        b_, lq, h, d = q.shape
        qs = _queries(cfg, q.reshape(b_, lq, k.shape[2], h // k.shape[2], d), segment_ids)
        factor = score_factor(cfg, traced)  # a traced scale: autodiff gives its gradient
        outs = [B.plain(x, keys, checked.causal, factor) for x in qs]
        return jnp.concatenate(outs, axis=1).reshape(q.shape)
