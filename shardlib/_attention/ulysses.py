"""Ulysses attention (DeepSpeed-Ulysses) as per-device shardlib code (JAX).

One all-to-all over the sequence axis ``c`` turns the sequence split of q, K and V into a
head split (each device then holds the whole sequence, in the layout's stored order, for
``H/c`` query heads and their key/value heads); the attention is local, flash-style: a
loop over the (query chunk, key chunk) blocks with something unmasked (`local_pairs`; with
segment ids, a block whose id ranges meet in no row is skipped: `segments_meet`), with the
online softmax of `shardlib._attention.blocks`, and its own backward loop (a
``jax.custom_vjp``); one all-to-all turns the output's head split back into the sequence
split. Autodiff transposes the two all-to-alls: two more in the backward pass.

`ring_ulysses` combines it with the ring: the sequence split over two axes
(``'B L/r/u H D'``), an all-to-all over ``u`` per operand to ``'B L/r H/u D'``, `ring` over
``r``, and the all-to-all back.

The public face is `shardlib.attention` (`ulysses` and `ring_ulysses`); the argument rules
are `ring`'s (`shardlib._attention.common.prepare`) plus the head rule `ulysses_heads_error`.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .._env import rules as _rules
from .._env.context import manual_axis_sizes, mesh_axis_sizes
from .._lang.fixes import manual_axis_error
from .._lang.parsing import ShapeSpec, SpecError
from .._lang.scope_codec import AttentionGridScope
from ..shardops import all_gather, all_to_all
from . import blocks as B
from . import ring as _ring
from .chunks import chunks, kv_repeat, local_pairs
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
from .rules import CheckedCall, ulysses_heads_error

__all__ = ["ring_ulysses", "ulysses"]

F32 = jnp.float32


class _Local(NamedTuple):
    """What the local attention needs besides arrays (hashable: a ``custom_vjp`` static
    argument): the ring's settings (layout, scale, varying axes), the original chunk id of
    each stored chunk of the whole sequence (all ``c`` blocks in device order) and the blocks
    to compute."""

    ring: Config
    ids: tuple[int, ...]
    pairs: tuple[tuple[int, int], ...]

    @property
    def n(self) -> int:
        return len(self.ids)


def _stack(x: jax.Array, n: int) -> jax.Array:
    """``(B, L, ...)`` cut into ``n`` chunks of the sequence: ``(n, B, L/n, ...)``."""
    b, length = x.shape[:2]
    return jnp.moveaxis(x.reshape(b, n, length // n, *x.shape[2:]), 1, 0)


def _unstack(x: jax.Array) -> jax.Array:
    """The inverse of `_stack`: ``(n, B, L/n, ...)`` to ``(B, L, ...)``."""
    x = jnp.moveaxis(x, 0, 1)
    return x.reshape(x.shape[0], x.shape[1] * x.shape[2], *x.shape[3:])


def _chunks(cfg: _Local, q: jax.Array, k: jax.Array, v: jax.Array, ids: Any) -> tuple:
    """The stacked chunks: q ``(n, B, L/n, K, G, D)``, k and v ``(n, B, L/n, K, D)``, the
    positions ``(n, L/n)`` and the segment ids ``(n, B, L/n)`` (or None)."""
    b, length, h, d = q.shape
    kh = k.shape[2]
    qs = _stack(q.reshape(b, length, kh, h // kh, d), cfg.n)
    size = length // cfg.n
    pos = jnp.asarray(np.asarray(cfg.ids, np.int32))[:, None] * size + jnp.arange(size)
    segs = None if ids is None else _stack(ids, cfg.n)
    return qs, _stack(k, cfg.n), _stack(v, cfg.n), pos, segs


def _block(parts: tuple, a: jax.Array, b: jax.Array) -> tuple[B.Queries, B.Keys]:
    """Query chunk ``a`` and key chunk ``b`` (traced indices into the stacked chunks)."""
    qs, ks, vs, pos, segs = parts
    q = B.Queries(qs[a], pos[a], None if segs is None else segs[a])
    return q, B.Keys(ks[b], vs[b], pos[b], None if segs is None else segs[b])


def _forward(cfg: _Local, q: jax.Array, k: jax.Array, v: jax.Array, ids: Any, scale: Any) -> tuple:
    """The output ``(B, L, H, D)`` and the log-sum-exp ``(n, B, K, G, L/n)`` of the local
    attention: one loop step per block of `local_pairs`, a chunk's state updated in place."""
    factor, causal = score_factor(cfg.ring, scale), cfg.ring.checked.causal
    parts = _chunks(cfg, q, k, v, ids)
    first = B.start(B.Queries(parts[0][0], parts[3][0], None), varying_zero(cfg.ring))
    states = B.State(*(jnp.broadcast_to(x, (cfg.n, *x.shape)) for x in first))

    def step(states: B.State, ab: jax.Array) -> tuple:
        a, b = ab[0], ab[1]
        query, keys = _block(parts, a, b)

        def compute(st: B.State) -> B.State:
            return B.forward_block(st, query, keys, causal, factor)

        new = when(
            segments_may_meet(query, keys), compute, lambda st: st, B.State(*(x[a] for x in states))
        )
        return B.State(*(x.at[a].set(y) for x, y in zip(states, new, strict=True))), None

    states, _ = lax.scan(step, states, jnp.asarray(cfg.pairs, jnp.int32))
    out, lse = jax.vmap(lambda st: B.finish(st, q.dtype))(states)
    return _unstack(out).reshape(q.shape), lse


def _backward(cfg: _Local, res: tuple, dout: jax.Array) -> tuple:
    """The gradients of q, k, v (and of a traced scale): the blocks of the forward pass again,
    each adding its part to ``dq`` of its query chunk and ``dk``/``dv`` of its key chunk."""
    q, k, v, ids, scale, out, lse = res
    factor, causal = score_factor(cfg.ring, scale), cfg.ring.checked.causal
    parts = _chunks(cfg, q, k, v, ids)
    b, length, h, d = q.shape
    shape = (b, length, k.shape[2], h // k.shape[2], d)
    do = dout.reshape(shape).astype(F32)
    delta = jnp.sum(do * out.reshape(shape).astype(F32), axis=-1)
    dos = jnp.moveaxis(_stack(do, cfg.n), 2, 4)  # n B K G Lc D
    deltas = jnp.moveaxis(_stack(delta, cfg.n), 2, 4)  # n B K G Lc
    like = varying_zero(cfg.ring)
    zeros = tuple(jnp.zeros(x.shape, F32) + like for x in parts[:3])
    with_scale = scale is not None

    def step(grads: tuple, ab: jax.Array) -> tuple:
        a, kb = ab[0], ab[1]
        query, keys = _block(parts, a, kb)

        def compute(g: tuple) -> tuple:
            got = B.backward_block(
                query, keys, dos[a], lse[a], deltas[a], causal, factor, with_scale=with_scale
            )
            return tuple(x + y for x, y in zip(g, got, strict=True))

        g = (grads[0][a], grads[1][kb], grads[2][kb]) + grads[3:]
        g = when(segments_may_meet(query, keys), compute, lambda g: g, g)
        new = (grads[0].at[a].set(g[0]), grads[1].at[kb].set(g[1]), grads[2].at[kb].set(g[2]))
        return new + g[3:], None

    grads = zeros + ((like,) if with_scale else ())
    grads, _ = lax.scan(step, grads, jnp.asarray(cfg.pairs, jnp.int32))
    dq = _unstack(grads[0]).reshape(q.shape).astype(q.dtype)
    dk, dv = _unstack(grads[1]).astype(k.dtype), _unstack(grads[2]).astype(v.dtype)
    dscale = grads[3].astype(scale.dtype) if with_scale else None  # summed by the caller's pcast
    return dq, dk, dv, None, dscale


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _local(
    cfg: _Local, q: jax.Array, k: jax.Array, v: jax.Array, ids: Any, scale: Any
) -> jax.Array:
    return _forward(cfg, q, k, v, ids, scale)[0]


def _local_fwd(
    cfg: _Local, q: jax.Array, k: jax.Array, v: jax.Array, ids: Any, scale: Any
) -> tuple:
    out, lse = _forward(cfg, q, k, v, ids, scale)
    # q, k, v and out are this device's heads over the whole sequence: the size of its
    # sequence blocks (k and v times the kv repeat); the log-sum-exp one f32 per query row
    # and head. No score block is kept.
    return out, (q, k, v, ids, scale, out, lse)


_local.defvjp(_local_fwd, _backward)


# ---------------------------------------------------------------------------------------------
# The all-to-alls: sequence split <-> head split
# ---------------------------------------------------------------------------------------------


def _to_heads(checked: CheckedCall, c: int, q: jax.Array, k: jax.Array, v: jax.Array) -> tuple:
    """One all-to-all of q, K and V (concatenated on the heads) over ``c``: from this
    device's sequence block with every local head to the whole sequence (stored order) with
    its ``1/c`` of the heads. K and V are first repeated if ``c`` does not divide their heads."""
    r = kv_repeat(k.shape[2], c)
    if r > 1:
        k, v = jnp.repeat(k, r, axis=2), jnp.repeat(v, r, axis=2)
    b, lc, h, d = q.shape
    parts = [x.reshape(b, lc, c, x.shape[2] // c, d) for x in (q, k, v)]
    x = jnp.concatenate(parts, axis=3)
    n = x.shape[3]
    bd, s, _, dd = checked.q.dims
    y = all_to_all(f"{bd} {s} {c} {n} {dd} -> {bd} {s.shape} {c}/{checked.axis} {n} {dd}", x)
    y = y.reshape(b, lc * c, n, d)
    hq, hk = h // c, k.shape[2] // c
    return y[:, :, :hq], y[:, :, hq : hq + hk], y[:, :, hq + hk :]


def _to_sequence(checked: CheckedCall, c: int, out: Any) -> jax.Array:
    """The all-to-all back: ``(B, L, H/c, D)`` to this device's ``(B, L/c, H, D)``."""
    b, length, hc, d = out.shape
    bd, s, _, dd = checked.q.dims
    spec = f"{bd} {s.shape} {c}/{checked.axis} {hc} {dd} -> {bd} {s} {c} {hc} {dd}"
    y = all_to_all(spec, out.reshape(b, length, 1, hc, d))
    return y.reshape(b, length // c, c * hc, d)


def _gather_ids(checked: CheckedCall, ids: Any) -> Any:
    """The segment ids of the whole sequence ``(B, L)``, stored order (None stays None)."""
    if ids is None:
        return None
    b, s = checked.q.dims[:2]
    return all_gather(f"{checked.ids_text} -> {b} {s.shape}", ids)


def ulysses(
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
    """Ulysses attention over the sequence split over mesh ``axis`` (per-device code).

    One all-to-all over ``axis`` turns the sequence split of q, K and V (sent together) into
    a head split: each device then holds the whole sequence for ``H/c`` of its query heads
    (and their key/value heads). It attends locally, flash-style (a loop over the score
    blocks with something unmasked by the causal mask, and with segment ids only those whose
    id ranges meet, as in `ring`; the online softmax in f32; its own backward loop), and
    one all-to-all turns the output back into the sequence split. The backward pass is the
    same two all-to-alls, transposed. Saved for the backward pass: this device's q, k, v and
    output for its heads over the whole sequence (the size of its sequence blocks) and the
    log-sum-exp; no score block is kept.

    **Arguments:** as `ring`'s. In addition the query heads this device holds (``H``, or
    ``H/t`` when the heads are split over ``t`` too) must be divisible by ``c``. When the
    key/value heads are not, each is repeated ``c / gcd(K, c)`` times before the
    all-to-all (more bytes; `ulysses_bytes`'s ``kv_repeat``).

    **Returns:** the attention output, q's block shape and dtype.

    **Raises:** as `ring`; and ``ValueError`` when the query heads are not divisible by
    ``c`` (use `ring`, which has no head constraint).

    Examples:
        >>> o = attention.ulysses('B/d L/c H D, B/d L/c K D', q, k, v, axis='c')
    """
    checked = prepare("ulysses", spec, q, k, v, axis, causal, layout, segment_ids)
    c = manual_axis_sizes()[checked.axis]
    bad = ulysses_heads_error("ulysses", checked, q.shape[2], c)
    if bad:
        raise ValueError(bad)
    refuse_forward_mode(
        "ulysses",
        (q, k, v, scale),
        "Ulysses attention",
        "its local attention defines its own backward pass",
    )
    fixed, traced = read_scale("ulysses", scale, q.shape[-1])
    ring = make_config(checked, q, k, v, segment_ids, fixed)
    order = tuple(x for i in range(c) for x in chunks(i, c, checked.layout))
    cfg = _Local(ring, order, tuple(local_pairs(c, checked.layout, checked.causal)))
    with jax.named_scope(attention_scope("ulysses", checked, c)):
        qh, kh, vh = _to_heads(checked, c, q, k, v)
        ids = varying(ring, _gather_ids(checked, segment_ids))
        qh, kh, vh, traced = (varying(ring, x) for x in (qh, kh, vh, traced))
        out = _local(cfg, qh, kh, vh, ids, traced)
        return _to_sequence(checked, c, out)


# ---------------------------------------------------------------------------------------------
# Ring x Ulysses: the sequence over two axes; all-to-all over one, the ring over the other
# ---------------------------------------------------------------------------------------------


def _two_axes(fn: str, ring_axis: Any, ulysses_axis: Any) -> tuple[str, str]:
    manual, mesh = manual_axis_sizes(), mesh_axis_sizes()
    out = []
    for arg, axis, example in (("ring_axis", ring_axis, "r"), ("ulysses_axis", ulysses_axis, "u")):
        axis = _rules.one_axis(fn, arg, axis)
        must = "name a mesh axis the sequence is split over, manual here"
        bad = manual_axis_error(fn, arg, axis, manual, mesh, must=must, example=example)
        if bad:
            raise ValueError(bad)
        out.append(axis)
    if out[0] == out[1]:
        raise ValueError(
            f"{fn}: arguments `ring_axis` and `ulysses_axis` must be two different mesh axes, "
            f"got {out[0]!r} for both; for one axis use attention.ring or attention.ulysses"
        )
    return out[0], out[1]


def _hybrid_specs(fn: str, spec: Any, r: str, u: str, h: int, kh: int) -> tuple[str, str]:
    """The specs of q and of k/v before and after the all-to-all over ``u`` (``'B L/r/u H D'``
    to ``'B L/r H/u D'``), as ``(q -> q', kv -> kv')`` op specs; raises on a broken rule."""
    text = _rules.text(spec, f"{fn}: argument `spec`")
    parts = text.split(",")
    specs = [ShapeSpec.parse(parts[0]), ShapeSpec.parse(parts[-1])]
    for role, x in zip(("q", "k and v"), specs, strict=True):
        ok = len(parts) <= 2 and len(x.dims) == 4 and not x.pending
        if ok and x.dims[1].sharding == (r, u):
            continue
        raise SpecError(
            f"{fn}: argument `spec` must give {role} four dims, batch sequence heads width, the "
            f"sequence split over `ring_axis` then `ulysses_axis` ('B L/{r}/{u} H D'); got "
            f"{str(x)!r}",
            text,
            0,
            len(text),
        )
    n = manual_axis_sizes()[u]
    for arg, x, local in (("q", specs[0], h), ("k", specs[1], kh)):
        if local % n:
            raise ValueError(
                f"{fn}: argument `{arg}` dim {str(x.dims[2])!r} (heads) must be divisible by "
                f"the {n} devices of `ulysses_axis` {u!r}: expected a multiple of {n} heads "
                f"per device, got {local}; use attention.ring over both axes' devices, which "
                "has no head constraint"
            )

    def moved(x: ShapeSpec) -> str:
        b, s, hd, d = x.dims
        return f"{x} -> {b} {s.shape}/{r} {hd}/{u} {d}"

    return moved(specs[0]), moved(specs[1])


def ring_ulysses(
    spec: str | bytes,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    ring_axis: str = "r",
    ulysses_axis: str = "u",
    *,
    causal: bool = True,
    layout: str = "contiguous",
    segment_ids: jax.Array | None = None,
    scale: float | jax.Array | None = None,
) -> jax.Array:
    """Ring attention over ``ring_axis`` with Ulysses over ``ulysses_axis`` (2-D context
    parallelism, per-device code).

    The sequence dim is split over both axes, ring axis first: ``'B L/r/u H D'``. An
    all-to-all over ``u`` (one each for q, k and v) turns the ``u`` part of the sequence split
    into a head split (``'B L/r H/u D'``: each device holds the ``r`` block of the sequence for
    ``1/u`` of its heads); `ring` runs over ``r`` on those; one all-to-all brings the output
    back. Backward: the ring's backward pass and the all-to-alls transposed.

    **Arguments:** as `ring`'s, with two axes. The layout is the ring's: put the sequence
    into it with ``c`` = the size of ``ring_axis`` (``to_layout(x, c=|r|)``), then split it
    over ``r`` then ``u``: the ``|u|`` devices of a ring step share one ring block, so the
    balanced layout balances the ring as it does for `ring` alone. The query and key/value
    heads per device must be divisible by ``|u|`` (no repeat here).

    **Returns:** the attention output, q's block shape and dtype.

    **Raises:** as `ring` (the ring's checks name ``ring``); ``ValueError`` naming
    ``ring_ulysses`` for an axis that is not manual, one axis given twice, or heads not
    divisible; `SpecError` for a sequence dim not split over ``(ring_axis, ulysses_axis)``.

    Examples:
        >>> o = attention.ring_ulysses('B L/r/u H D, B L/r/u K D', q, k, v, 'r', 'u')
    """
    fn = "ring_ulysses"
    r, u = _two_axes(fn, ring_axis, ulysses_axis)
    q_move, kv_move = _hybrid_specs(fn, spec, r, u, q.shape[2], k.shape[2])
    q_in, q_out = (x.strip() for x in q_move.split("->"))
    kv_out = kv_move.split("->")[1].strip()
    with jax.named_scope(AttentionGridScope(fn, r, u).text()):
        qh = all_to_all(q_move, q)
        kh, vh = all_to_all(kv_move, k), all_to_all(kv_move, v)
        ids = segment_ids
        if ids is not None:
            b, s = ShapeSpec.parse(q_in).dims[:2]
            ids = all_gather(f"{b} {s} -> {b} {s.shape}/{r}", ids)
        out = _ring.ring(
            f"{q_out}, {kv_out}",
            qh,
            kh,
            vh,
            r,
            causal=causal,
            layout=layout,
            segment_ids=ids,
            scale=scale,
        )
        return all_to_all(f"{q_out} -> {q_in}", out)
