"""Attention over a sequence split over a mesh axis (context parallelism), as per-device code.

Call `ring`, `gathered` or `ulysses` **inside** a ``typed_shard_map`` body whose queries,
keys and values are split over a sequence axis ``c``: ``q`` ``f32['B L/c H D']``, ``k`` and
``v`` ``f32['B L/c K D']`` (``K`` key/value heads, a divisor of the ``H`` query heads: GQA or
MQA, not repeated but where `ulysses` must). The other dims may be split too (``'B/d L/c H/t D'``: batch over ``d``, heads
over ``t``).

- `ring`: the K/V blocks go round the ``c`` devices with `shardops.shift` (``c - 1``
  transfers, each overlapping the block in hand), and each device folds every block into its
  queries' output with the online softmax (flash attention's recurrence, in f32). The
  backward pass is a second ring (``jax.custom_vjp``): K/V go round again and their gradients
  travel with them, home after ``c - 1`` transfers. Saved for the backward pass: q, k, v, the
  output and the log-sum-exp, all O(L/c) per device; no score block is kept.
- `gathered`: all-gather K and V over ``c`` and attend locally (autodiff gives the backward
  pass: a reduce-scatter of dK/dV). Simple; O(L) memory per device.
- `ulysses` (DeepSpeed-Ulysses): one all-to-all over ``c`` turns the sequence split of q,
  K and V (sent together) into a head split: each device then holds the whole sequence for
  ``H/c`` of its heads and attends locally, flash-style (a loop over the score blocks with
  something unmasked, with the online softmax, and its own backward loop: a
  ``jax.custom_vjp``); one all-to-all brings the output back to the sequence split. The
  backward pass is the two all-to-alls transposed. The query heads per device must be
  divisible by ``c`` (key/value heads that are not are repeated ``c / gcd(K, c)`` times);
  saved for the backward pass: q, k, v and the output of this device's heads over the whole
  sequence (the size of its sequence blocks) and the log-sum-exp; no score block is kept.
- `ring_ulysses`: the sequence split over two axes (``'B L/r/u H D'``): an all-to-all over
  ``u`` turns that part of the split into a head split, `ring` runs over ``r``, an
  all-to-all brings the output back (the layout is the ring's, for ``c = |r|``).
- Causal masks come from the original positions, so every layout is exact. With
  ``layout='balanced'`` device ``i`` holds chunks ``i`` and ``2c - 1 - i`` of ``2c``; under a
  causal mask every device then computes the same number of score blocks (`score_blocks`;
  in `ring`, blocks that are fully masked are skipped), where the contiguous layout gives
  device ``i`` ``i + 1``. `to_layout`, `from_layout` and `positions` put a global sequence
  (and its position ids, for RoPE) into that layout and back.
- ``segment_ids`` (``i32['B L/c']``, in the same layout as ``q``): packed sequences; a query
  sees only keys of its own segment. The ids travel round the ring with their K/V block, and
  `ring` skips (forward and backward) a block whose query chunk and key chunk have segment-id
  ranges ``[min, max]`` that meet in no batch row: they share no segment, so nothing in it
  is visible. For packed sequences (ids non-decreasing along the original sequence) this
  leaves exactly the blocks with something visible; for ids in any other order it is still
  exact, only skips less. `score_blocks` with ``segment_ids=`` counts the blocks each device
  then computes. `ulysses` applies the same rule to the blocks of its local loop. (`gathered`
is one dense attention per chunk: it skips nothing.)

Bytes each device sends (one K block plus one V block is ``2 * B * (L/c) * K * D * itemsize``
of its per-device sizes): `ring` sends ``c - 1`` such blocks forward, and ``c - 1`` blocks plus
``c - 1`` f32 gradient blocks backward (`ring_bytes`); `gathered` receives ``c - 1`` blocks
in its all-gathers forward and reduce-scatters ``c - 1`` gradient blocks backward;
`ulysses` sends ``(c - 1)/c`` of its q, K and V blocks and of its output block forward, and
as much backward (`ulysses_bytes`): at a fixed ``L`` it falls as ``1/c``, where the ring's
stays about the same. With segment ids `ulysses` also all-gathers them (ints, forward only).

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
from ._attention import ulysses as _ulysses
from ._attention.layout import from_layout, positions, to_layout
from ._attention.plan import ring_bytes, score_blocks, ulysses_bytes

__all__ = [
    "from_layout",
    "gathered",
    "positions",
    "ring",
    "ring_bytes",
    "ring_ulysses",
    "score_blocks",
    "to_layout",
    "ulysses",
    "ulysses_bytes",
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
    return _ulysses.ulysses(
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
    return _ulysses.ring_ulysses(
        spec,
        q,
        k,
        v,
        ring_axis,
        ulysses_axis,
        causal=causal,
        layout=layout,
        segment_ids=segment_ids,
        scale=scale,
    )
