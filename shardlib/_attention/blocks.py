"""The block math of flash-style attention, on one device's blocks (JAX, no communication).

Queries are grouped by their key/value head, ``q`` ``(B, Lq, K, G, D)`` with ``H = K * G``
(head ``h`` reads key/value head ``h // G``), so K and V are never repeated. The running
state of the online softmax, per query row, is ``m`` (the running max) and ``total`` (the sum
of ``exp(score - m)``), both ``(B, K, G, Lq)``, and ``acc`` ``(B, K, G, Lq, D)``; all f32.
Masks come from the original positions of the rows and columns (and their segment ids), so
they are exact in any layout.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

__all__ = [
    "Keys",
    "Queries",
    "State",
    "backward_block",
    "finish",
    "forward_block",
    "plain",
    "start",
    "unscaled",
]

F32 = jnp.float32


class Queries(NamedTuple):
    """One chunk of queries: values ``(B, Lq, K, G, D)``, positions ``(Lq,)``, segment ids
    ``(B, Lq)`` or None."""

    x: jax.Array
    pos: jax.Array
    seg: jax.Array | None


class Keys(NamedTuple):
    """One chunk of keys and values ``(B, Lk, K, D)``, positions ``(Lk,)``, segment ids."""

    k: jax.Array
    v: jax.Array
    pos: jax.Array
    seg: jax.Array | None


class State(NamedTuple):
    """The online-softmax state of one query chunk (f32)."""

    m: jax.Array
    total: jax.Array
    acc: jax.Array


def mask(q: Queries, kv: Keys, causal: bool) -> jax.Array | None:
    """``(B or 1, 1, 1, Lq, Lk)``: which scores are kept (None: all)."""
    keep = None
    if causal:
        keep = (q.pos[:, None] >= kv.pos[None, :])[None, None, None]
    if q.seg is not None and kv.seg is not None:
        same = (q.seg[:, :, None] == kv.seg[:, None, :])[:, None, None]
        keep = same if keep is None else keep & same
    return keep


def scores(q: Queries, kv: Keys, scale: Any) -> jax.Array:
    """``(B, K, G, Lq, Lk)`` f32 scores (``scale``: a float or an f32 array of shape ())."""
    return unscaled(q, kv) * scale


def unscaled(q: Queries, kv: Keys) -> jax.Array:
    """``(B, K, G, Lq, Lk)`` f32 dot products ``q . k``, before the scale."""
    return jnp.einsum("bqkgd,bskd->bkgqs", q.x, kv.k, preferred_element_type=F32)


def start(q: Queries, like: jax.Array) -> State:
    """The empty state of a query chunk; ``like`` is any f32 value of the right varying
    axes (so that loops over the state keep one type)."""
    b, lq, k, g, d = q.x.shape
    zero = jnp.zeros((b, k, g, lq), F32) + like
    return State(zero - jnp.inf, zero, jnp.zeros((b, k, g, lq, d), F32) + like)


def forward_block(state: State, q: Queries, kv: Keys, causal: bool, scale: Any) -> State:
    """``state`` updated with one key/value chunk (the flash-attention recurrence)."""
    s = scores(q, kv, scale)
    keep = mask(q, kv, causal)
    if keep is not None:
        s = jnp.where(keep, s, -jnp.inf)
    m = jnp.maximum(state.m, jnp.max(s, axis=-1))
    safe = jnp.where(m == -jnp.inf, 0.0, m)  # a row with nothing kept yet
    p = jnp.exp(s - safe[..., None])
    fix = jnp.exp(state.m - safe)
    total = state.total * fix + jnp.sum(p, axis=-1)
    pv = jnp.einsum("bkgqs,bskd->bkgqd", p.astype(kv.v.dtype), kv.v, preferred_element_type=F32)
    return State(m, total, state.acc * fix[..., None] + pv)


def finish(state: State, dtype: Any) -> tuple[jax.Array, jax.Array]:
    """The output ``(B, Lq, K, G, D)`` in ``dtype`` and the f32 log-sum-exp ``(B, K, G, Lq)``."""
    total = jnp.where(state.total == 0, 1.0, state.total)  # a row that saw nothing: output 0
    out = state.acc / total[..., None]
    lse = jnp.where(state.total == 0, -jnp.inf, state.m + jnp.log(total))
    return jnp.moveaxis(out, 3, 1).astype(dtype), lse


def backward_block(
    q: Queries,
    kv: Keys,
    do: jax.Array,
    lse: jax.Array,
    delta: jax.Array,
    causal: bool,
    scale: Any,
    with_scale: bool = False,
) -> tuple[jax.Array, ...]:
    """``(dq, dk, dv)`` of one (query chunk, key chunk) block, f32: ``do`` is the output's
    cotangent ``(B, K, G, Lq, D)``, ``lse`` the forward log-sum-exp and ``delta`` the row
    sums of ``do * out``, both ``(B, K, G, Lq)``. With ``with_scale``, ``(dq, dk, dv,
    dscale)``: ``dscale`` (f32, shape ()) is this block's part of the scale's gradient."""
    raw = unscaled(q, kv)
    s = raw * scale
    p = jnp.exp(s - jnp.where(lse == -jnp.inf, 0.0, lse)[..., None])
    keep = mask(q, kv, causal)
    if keep is not None:
        p = jnp.where(keep, p, 0.0)
    v = kv.v.astype(F32)
    dv = jnp.einsum("bkgqs,bkgqd->bskd", p, do)
    dp = jnp.einsum("bkgqd,bskd->bkgqs", do, v)
    d_scores = p * (dp - delta[..., None])  # the gradient of the scaled scores
    ds = d_scores * scale
    dq = jnp.einsum("bkgqs,bskd->bqkgd", ds, kv.k.astype(F32))
    dk = jnp.einsum("bkgqs,bqkgd->bskd", ds, q.x.astype(F32))
    if with_scale:
        return dq, dk, dv, jnp.sum(d_scores * raw)
    return dq, dk, dv


def plain(q: Queries, kv: Keys, causal: bool, scale: Any) -> jax.Array:
    """Softmax attention of one query chunk over all of ``kv`` at once, for autodiff (the
    all-gather variant): ``(B, Lq, K, G, D)`` in q's dtype."""
    s = scores(q, kv, scale)
    keep = mask(q, kv, causal)
    if keep is not None:
        s = jnp.where(keep, s, -jnp.inf)
    m = lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True))
    p = jnp.exp(s - jnp.where(m == -jnp.inf, 0.0, m))
    total = jnp.sum(p, axis=-1, keepdims=True)
    p = p / jnp.where(total == 0, 1.0, total)
    out = jnp.einsum("bkgqs,bskd->bqkgd", p, kv.v.astype(F32))
    return out.astype(q.x.dtype)
