"""Decoding attention as per-device shardlib code (JAX): one query token per row against a
key/value cache whose sequence may be split over a mesh axis.

Each device attends with its query heads over its chunk of the cache (positions at or past
a row's length masked) and keeps, per row and query head, the f32 online-softmax state of
`shardlib._attention.blocks`: the max ``m``, the sum ``l`` of ``exp(score - m)`` and the
weighted values ``o``. When the cache's sequence is split, one collective over its axis brings
every device's ``(m, l, o)`` to every device (`decode_bytes`), and each combines them locally:
``out = sum_i exp(m_i - M) o_i / sum_i exp(m_i - M) l_i`` with ``M = max_i m_i``. A chunk
with nothing visible has ``m = -inf`` and ``l = o = 0``: it contributes exactly 0.

The collective is a ``psum`` of a ``(c, B, H, D + 2)`` array in which each device fills its
own slot and leaves zeros elsewhere (adding zeros is exact): an all-gather made of an
all-reduce. A plain all-gather would send half the bytes, but JAX types its result as still
varying over the axis (it has no public invariant all-gather), so the output could not be
returned replicated over ``c`` with ``check_vma`` on; a ``pmax`` of the maxes followed by a
``psum`` of the rescaled sums sends fewer bytes for large ``c`` but is two collectives, one
after the other, where a decode step is bound by latency.

The argument rules are `shardlib._attention.rules.check_decode` (pure); the bytes formula
`shardlib._attention.chunks.decode_bytes`. May import: `shardlib._attention.common`,
`rules`, `chunks`, the layers below `shardlib._attention` and the ``shardops`` face.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from .._check.checking import check_block
from .._check.scopes import op_scope
from .._env import rules as _rules
from .._env.context import manual_axis_items, manual_axis_sizes, mesh_axis_sizes
from .._lang.parsing import ShapeSpec
from .._lang.scope_codec import AttentionScope
from ..shardops import axis_index, psum
from .common import read_scale
from .rules import CheckedDecode, axis_error, check_decode, heads_error

__all__ = ["decode"]

F32 = jnp.float32


def _prepare(fn: str, spec: Any, q: Any, k: Any, v: Any, lengths: Any, axis: Any) -> CheckedDecode:
    """Check the arguments of a decode call (`check_decode`, then the blocks); the checked."""
    manual = manual_axis_sizes()
    axis = _rules.one_axis(fn, "axis", axis)
    if axis is not None:
        bad = axis_error(fn, axis, manual, mesh_axis_sizes())
        if bad:
            raise ValueError(bad)
    checked = check_decode(fn, _rules.text(spec, f"{fn}: argument `spec`"), axis)
    scope, items = op_scope(), manual_axis_items()
    check_block(q, checked.q, scope, items, f"{fn}: argument `q`")
    check_block(k, checked.kv, scope, items, f"{fn}: argument `k`")
    check_block(v, checked.kv, scope, items, f"{fn}: argument `v`")
    where = f"{fn}: argument `lengths`"
    check_block(lengths, ShapeSpec.parse(checked.lengths_text), scope, items, where)
    if not jnp.issubdtype(lengths.dtype, jnp.integer):
        raise ValueError(
            f"{where} must be integers (the number of cache positions each row sees), got "
            f"dtype {lengths.dtype}; cast it with .astype(jnp.int32)"
        )
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(
            f"{fn}: arguments `q`, `k` and `v` must have one dtype, got {q.dtype}, {k.dtype} "
            f"and {v.dtype}; cast them with .astype()"
        )
    heads = math.prod(manual.get(a, 1) for a in checked.q_heads.sharding)
    bad = heads_error(fn, checked, q.shape[1], k.shape[2], heads)
    if bad:
        raise ValueError(bad)
    return checked


def _local(q: Any, k: Any, v: Any, lengths: Any, start: Any, factor: Any) -> jax.Array:
    """This device's ``(m, l, o)`` per row and query head, stacked: ``(B, H, D + 2)`` f32
    (``start``: the global position of its first cache slot)."""
    b, h, d = q.shape
    kh = k.shape[2]
    qg = q.reshape(b, kh, h // kh, d)  # query head h reads key/value head h // (H/K)
    s = jnp.einsum("bkgd,bskd->bkgs", qg, k, preferred_element_type=F32) * factor
    keep = (start + jnp.arange(k.shape[1]))[None, :] < lengths[:, None]  # (B, S)
    s = jnp.where(keep[:, None, None, :], s, -jnp.inf)
    m = lax.stop_gradient(jnp.max(s, axis=-1))  # the result does not depend on it
    p = jnp.exp(s - jnp.where(m == -jnp.inf, 0.0, m)[..., None])  # 0 where masked
    total = jnp.sum(p, axis=-1)
    o = jnp.einsum("bkgs,bskd->bkgd", p.astype(v.dtype), v, preferred_element_type=F32)
    state = jnp.concatenate([m[..., None], total[..., None], o], axis=-1)
    return state.reshape(b, h, d + 2)


def _combine(states: jax.Array) -> jax.Array:
    """The output ``(B, H, D)`` f32 of the ``(c, B, H, D + 2)`` states of the ``c`` chunks:
    each rescaled to the greatest max; a chunk with nothing visible weighs 0, and a row that
    sees nothing at all gives 0 (no NaN)."""
    m, total, o = states[..., 0], states[..., 1], states[..., 2:]
    top = lax.stop_gradient(jnp.max(m, axis=0))
    w = jnp.exp(m - jnp.where(top == -jnp.inf, 0.0, top))  # exp(-inf) = 0: no NaN
    total = jnp.sum(w * total, axis=0)
    out = jnp.sum(w[..., None] * o, axis=0)
    return out / jnp.where(total == 0, 1.0, total)[..., None]


def decode(
    spec: str | bytes,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    lengths: jax.Array,
    axis: str | None = None,
    *,
    scale: float | jax.Array | None = None,
) -> jax.Array:
    """Attention of one query token per row over a key/value cache (per-device code).

    The cache's sequence may be split over mesh ``axis`` (device ``i`` holds positions
    ``i * S/c .. (i+1) * S/c - 1``): each device attends over its chunk, then one collective
    over ``axis`` gathers each row's and head's f32 ``(max, sum, weighted values)`` (a
    ``psum`` in which each device fills its own slot: `decode_bytes`; the cache never moves)
    and a local combine gives every device the output. Heads may be split too (``H/t``,
    ``K/t``: each device its own heads, no communication).

    **Arguments:**

    - `spec`: q's shape spec, then the cache's (k's and v's): ``'B/d H/t D, B/d S/c K/t D'``.
      q has one token per row and no sequence dim; batch and width dims must agree; the
      heads dims are split over the same axes; the cache's sequence dim over exactly
      ``axis`` (unsplit when ``axis`` is None); the width unsplit.
    - `q`: this device's queries ``(B, H, D)``; `k`, `v`: its cache chunk ``(B, S/c, K, D)``;
      ``K`` divides ``H`` (query head ``h`` reads key/value head ``h // (H/K)``, nothing is
      repeated).
    - `lengths`: ints ``(B,)`` (spec q's batch dim): row ``b`` sees the cache positions
      ``< lengths[b]`` (global positions). A row of length 0 sees nothing: its output is 0.
      A length outside ``[0, S]`` (``S`` the whole cache) is a bug upstream (a position past
      the cache): that row's output is NaN, never a silently truncated attention.
    - `axis`: the mesh axis the cache's sequence is split over, manual in this body (``'c'``),
      or None (not split: purely local).
    - `scale`: the score scale, ``1/sqrt(D)`` by default: a Python float or a float array of
      shape ``()``.

    **Returns:** the attention output ``(B, H, D)`` in q's dtype, the same on every device of
    ``axis`` (spec ``'B/d H/t D'``).

    **Raises:** `SpecError` naming the broken rule of `spec`; ``ValueError`` for an `axis`
    that is not manual, heads that do not divide, `lengths` that are not integers, or dtypes
    that differ; ``TypeCheckError`` for a block that does not match the spec.

    Examples:
        >>> o = attention.decode('B/d H/t D, B/d S/c K/t D', q, k, v, lengths, axis='c')
    """
    fn = "decode"
    checked = _prepare(fn, spec, q, k, v, lengths, axis)
    fixed, traced = read_scale(fn, scale, q.shape[-1])
    factor = fixed if traced is None else traced.astype(F32)
    d = q.shape[-1]
    if checked.axis is None:
        out = _combine(_local(q, k, v, lengths, 0, factor)[None])
        return _finish(out, lengths, k.shape[1], q.dtype)
    c = manual_axis_sizes()[checked.axis]
    with jax.named_scope(AttentionScope(fn, checked.axis, c, "contiguous").text()):
        start = axis_index(checked.axis) * k.shape[1]
        state = _local(q, k, v, lengths, start, factor)
        mine = (jnp.arange(c) == axis_index(checked.axis))[:, None, None, None]
        slots = jnp.where(mine, state[None], 0.0)  # this device's slot; zeros elsewhere
        states = psum(checked.combine_text(c, d + 2), slots, checked.axis)
        return _finish(_combine(states), lengths, c * k.shape[1], q.dtype)


def _finish(out: jax.Array, lengths: jax.Array, size: int, dtype: Any) -> jax.Array:
    """``out`` in ``dtype``, NaN in the rows whose length is outside ``[0, size]``."""
    bad = (lengths < 0) | (lengths > size)
    return jnp.where(bad[:, None, None], jnp.nan, out).astype(dtype)
