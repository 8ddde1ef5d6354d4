"""Attention over a sequence split over a mesh axis (context parallelism), and decoding
against a split cache, as per-device code.

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

Decoding: `decode` attends with one query token per row (``q`` ``f32['B/d H/t D']``) over
a key/value cache ``f32['B/d S/c K/t D']`` whose sequence may be split over ``c`` (device
``i`` holds positions ``i * S/c`` on; ``axis=None``: not split), with per-row lengths
``i32['B/d']`` (row ``b`` sees positions ``< lengths[b]``; GQA/MQA as above). Each device
attends over its chunk and keeps each row's and head's f32 softmax state (max, sum, weighted
values), ``B * H * (D + 2)`` floats; one all-reduce over ``c`` of a ``c``-slot array in which
each device fills its own slot (`decode_bytes`: ``2 (c - 1)`` states per device, whatever
the cache's length; the cache never moves) and a local combine give the output,
``'B/d H/t D'`` on every device of ``c``. A chunk with nothing visible
contributes exactly 0; a row of length 0 gives 0; a length outside ``[0, S]`` gives NaN in
its row (a position past the cache is a bug upstream, never silently truncated).

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

    @typed_shard_map
    def step(q: f32[b'B/d H D'], k: f32[b'B/d S/c K D'], v: f32[b'B/d S/c K D'],
             lengths: i32[b'B/d']) -> f32[b'B/d H D']:
        return attention.decode('B/d H D, B/d S/c K D', q, k, v, lengths, axis='c')
"""

from __future__ import annotations

from ._attention.chunks import decode_bytes, ring_bytes, score_blocks, ulysses_bytes
from ._attention.decode import decode
from ._attention.layout import from_layout, positions, to_layout
from ._attention.ring import gathered, ring
from ._attention.ulysses import ring_ulysses, ulysses

__all__ = [
    "decode",
    "decode_bytes",
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
