"""Attention over a sequence split over a mesh axis (context parallelism), as per-device code.

Call `ring` or `gathered` **inside** a ``typed_shard_map`` body whose queries, keys and values
are split over a sequence axis ``c``: ``q`` ``f32['B L/c H D']``, ``k`` and ``v``
``f32['B L/c K D']`` (``K`` key/value heads, a divisor of the ``H`` query heads: GQA or MQA,
never repeated). The other dims may be split too (``'B/d L/c H/t D'``: batch over ``d``, heads
over ``t``).

- `ring`: the K/V blocks go round the ``c`` devices with `shardops.shift` (``c - 1``
  transfers, each overlapping the block in hand), and each device folds every block into its
  queries' output with the online softmax (flash attention's recurrence, in f32). The
  backward pass is a second ring (``jax.custom_vjp``): K/V go round again and their gradients
  travel with them, home after ``c - 1`` transfers. Saved for the backward pass: q, k, v, the
  output and the log-sum-exp, all O(L/c) per device; no score block is kept.
- `gathered`: all-gather K and V over ``c`` and attend locally (autodiff gives the backward
  pass: a reduce-scatter of dK/dV). Simple; O(L) memory per device.
- Causal masks come from the original positions, so every layout is exact. With
  ``layout='balanced'`` device ``i`` holds chunks ``i`` and ``2c - 1 - i`` of ``2c``; under a
  causal mask every device then computes the same number of score blocks (`score_blocks`;
  blocks that are fully masked are skipped), where the contiguous layout gives device ``i``
  ``i + 1``. `to_layout`, `from_layout` and `positions` put a global sequence (and its
  position ids, for RoPE) into that layout and back.
- ``segment_ids`` (``i32['B L/c']``, in the same layout as ``q``): packed sequences; a query
  sees only keys of its own segment.

Bytes each device sends (one K block plus one V block is ``2 * B * (L/c) * K * D * itemsize``
of its per-device sizes): `ring` sends ``c - 1`` such blocks forward, and ``c - 1`` blocks plus
``c - 1`` f32 gradient blocks backward (`ring_bytes`); `gathered` receives ``c - 1`` blocks
in its all-gathers forward and reduce-scatters ``c - 1`` gradient blocks backward.

Example::

    @typed_shard_map
    def attend(q: f32[b'B/d L/c H D'], k: f32[b'B/d L/c K D'],
               v: f32[b'B/d L/c K D']) -> f32[b'B/d L/c H D']:
        return attention.ring('B/d L/c H D, B/d L/c K D', q, k, v, axis='c')
"""

from __future__ import annotations

from typing import Any

import jax

from ._attention import ring as _ring
from ._attention.layout import from_layout, positions, to_layout
from ._attention.plan import ring_bytes, score_blocks

__all__ = [
    "from_layout",
    "gathered",
    "positions",
    "ring",
    "ring_bytes",
    "score_blocks",
    "to_layout",
]


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
    return _ring.ring(
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
    return _ring.gathered(
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
