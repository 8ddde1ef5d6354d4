"""The arithmetic of context-parallel attention (no JAX).

A sequence of ``L`` positions split over ``c`` devices is cut into chunks. In the
**contiguous** layout device ``i`` holds chunk ``i`` of ``c`` (positions
``i * L/c .. (i+1) * L/c - 1``). In the **balanced** layout the sequence is cut into ``2c``
chunks and device ``i`` holds chunks ``i`` and ``2c - 1 - i``, one early and one late, so
that under a causal mask every device has the same number of (query chunk, key chunk)
pairs with something unmasked (`score_blocks`). `chunks` and `block_needed` are the rule the
devices apply (written with ``+``, ``-``, ``>=`` only, so they take traced ints too), and
with segment ids `segments_meet` (on per-chunk id ranges: NumPy or traced arrays);
`stored_positions` says which original position each stored slot holds. The bytes each
variant sends (`ring_bytes`, `ulysses_bytes`; decoding's combine: `decode_bytes`) and
Ulysses' head repeat and local blocks (`kv_repeat`, `local_pairs`) are here too; the
argument rules are `shardlib._attention.rules`.
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np

__all__ = [
    "LAYOUTS",
    "block_needed",
    "block_pairs",
    "chunk_count",
    "chunk_ranges",
    "chunks",
    "decode_bytes",
    "kv_repeat",
    "local_pairs",
    "ring_bytes",
    "score_blocks",
    "segments_meet",
    "stored_positions",
    "ulysses_bytes",
]

LAYOUTS = ("contiguous", "balanced")


# ---------------------------------------------------------------------------------------------
# The layouts: which chunks a device holds, which score blocks it computes
# ---------------------------------------------------------------------------------------------


def chunk_count(c: int, layout: str) -> int:
    """How many chunks the sequence is cut into: ``c`` (contiguous) or ``2c`` (balanced)."""
    return 2 * c if layout == "balanced" else c


def chunks(device: Any, c: int, layout: str) -> tuple[Any, ...]:
    """The chunk ids device ``device`` holds, in storage order (ints or traced ints)."""
    if layout == "balanced":
        return (device, 2 * c - 1 - device)
    return (device,)


def block_needed(q_chunk: Any, k_chunk: Any, causal: bool) -> Any:
    """Whether query chunk ``q_chunk`` sees anything of key chunk ``k_chunk``: always
    without a causal mask; with one, when the keys do not all come later."""
    return True if not causal else q_chunk >= k_chunk


def block_pairs(me: Any, src: Any, c: int, layout: str, causal: bool) -> list[tuple[int, int, Any]]:
    """``(query chunk, key chunk, needed)`` for device ``me``'s queries against the block of
    device ``src``: the indices of the chunks in the two blocks, and whether to compute
    them (`block_needed`; a traced bool when ``me`` or ``src`` is traced)."""
    return [
        (a, b, block_needed(qc, kc, causal))
        for a, qc in enumerate(chunks(me, c, layout))
        for b, kc in enumerate(chunks(src, c, layout))
    ]


def segments_meet(q_lo: Any, q_hi: Any, k_lo: Any, k_hi: Any) -> Any:
    """Whether a query chunk may see a key chunk by their segment ids: ``q_lo``/``q_hi`` are
    the least and greatest id of the query chunk per batch row, ``k_lo``/``k_hi`` the key
    chunk's (arrays of shape ``(B,)``: NumPy, or traced JAX arrays on a device). True when
    the two ranges intersect in some batch row. Ranges that do not intersect share no id, so
    no query sees a key: a block ruled out here is empty in every row whatever the order of
    the ids; for packed sequences (ids non-decreasing along the original sequence) the rule
    is also exact: together with `block_needed`, a block it keeps has a visible key."""
    return ((q_lo <= k_hi) & (k_lo <= q_hi)).any()


def chunk_ranges(segment_ids: Any, n: int) -> tuple[Any, Any]:
    """The least and greatest segment id of each of ``n`` equal chunks of the sequence, per
    batch row: two NumPy arrays ``(n, B)`` (``segment_ids``: global ``(B, L)`` or ``(L,)``
    ids in the original order)."""
    ids = np.asarray(segment_ids)
    if ids.ndim == 1:
        ids = ids[None]
    if ids.ndim != 2 or ids.shape[1] % n:
        raise ValueError(
            f"score_blocks: argument `segment_ids` must be (B, L) or (L,) ids with L divisible "
            f"by the {n} chunks of the layout, got shape {np.shape(segment_ids)}"
        )
    parts = ids.reshape(ids.shape[0], n, -1)
    return parts.min(axis=2).T, parts.max(axis=2).T


def score_blocks(c: int, layout: str, causal: bool = True, segment_ids: Any = None) -> list[int]:
    """Per device, how many (query chunk, key chunk) score blocks the ring computes (the
    others are fully masked and skipped). Balanced and causal: ``2c + 1`` on every device
    (chunks of ``L/2c``); contiguous and causal: ``i + 1`` on device ``i`` (chunks of ``L/c``).

    With ``segment_ids`` (the global ids, ``(B, L)`` or ``(L,)``, in the **original** order,
    not the layout's), a block whose query and key chunks share no segment range in any
    batch row is skipped too (`segments_meet`). The count takes all ``B`` rows together: a
    device that holds only some rows (batch split over another mesh axis) may skip more.

    Examples:
        >>> attention.score_blocks(4, 'balanced')
        [9, 9, 9, 9]
        >>> attention.score_blocks(4, 'contiguous', segment_ids=np.repeat(np.arange(4), 16))
        [1, 1, 1, 1]
    """
    ranges = None if segment_ids is None else chunk_ranges(segment_ids, chunk_count(c, layout))

    def computed(me: int, src: int) -> int:
        n = 0
        for qc, kc in itertools.product(chunks(me, c, layout), chunks(src, c, layout)):
            needed = bool(block_needed(qc, kc, causal))
            if needed and ranges is not None:
                lo, hi = ranges
                needed = bool(segments_meet(lo[qc], hi[qc], lo[kc], hi[kc]))
            n += needed
        return n

    return [sum(computed(i, src) for src in range(c)) for i in range(c)]


def stored_positions(length: int, c: int, layout: str) -> list[int]:
    """The original position of each stored slot: the global order of a sequence laid out
    over ``c`` devices (device ``i``'s block is slots ``i * L/c ..``)."""
    n = chunk_count(c, layout)
    if length % n:
        what = "2*c" if layout == "balanced" else "c"
        raise ValueError(
            f"the {layout} layout cuts the sequence into {what} = {n} chunks: expected a "
            f"sequence length divisible by {n}, got {length}"
        )
    size = length // n
    return [
        chunk * size + j for i in range(c) for chunk in chunks(i, c, layout) for j in range(size)
    ]


def ring_bytes(block_bytes: int, grad_block_bytes: int, c: int) -> tuple[int, int]:
    """Bytes each device sends in the ring, ``(forward, backward)``: ``c - 1`` K/V blocks
    forward; ``c - 1`` K/V blocks and ``c - 1`` dK/dV blocks backward (``block_bytes`` is
    one K block plus one V block, ``grad_block_bytes`` their f32 gradients).

    Examples:
        >>> attention.ring_bytes(2 * 4 * 1024 * 8 * 128 * 2, 2 * 4 * 1024 * 8 * 128 * 4, c=8)
        (117440512, 352321536)
    """
    return (c - 1) * block_bytes, (c - 1) * (block_bytes + grad_block_bytes)


# ---------------------------------------------------------------------------------------------
# Ulysses: the head split, the local blocks, the bytes
# ---------------------------------------------------------------------------------------------


def kv_repeat(k_local: int, c: int) -> int:
    """How many times Ulysses repeats each key/value head so that ``c`` devices can share
    them: 1 when ``c`` divides the ``k_local`` heads, else ``c / gcd(k_local, c)`` (then each
    device's query heads read exactly its own copies)."""
    return c // int(np.gcd(k_local, c))


def local_pairs(c: int, layout: str, causal: bool) -> list[tuple[int, int]]:
    """The (query chunk, key chunk) pairs, by their index in the stored sequence (all of
    ``c`` devices' blocks in device order), that have something unmasked (`block_needed` on
    their original chunk ids): what Ulysses's local attention computes."""
    ids = [x for i in range(c) for x in chunks(i, c, layout)]
    n = len(ids)
    return [(a, b) for a in range(n) for b in range(n) if block_needed(ids[a], ids[b], causal)]


def ulysses_bytes(
    q_block_bytes: int, kv_block_bytes: int, c: int, kv_repeat: int = 1
) -> tuple[int, int]:
    """Bytes each device sends in Ulysses's all-to-alls, ``(forward, backward)``. Forward:
    one all-to-all of q, K and V (``q_block_bytes`` is one device's q block, ``kv_block_bytes``
    one K block plus one V block, ``kv_repeat`` the repeat of `kv_repeat`) and one of the
    output (q's size); each keeps ``1/c`` of its block and sends the rest. Backward: the same
    two all-to-alls on the gradients (in q's dtype), the other way.

    Examples:
        >>> attention.ulysses_bytes(2 * 1024 * 32 * 128 * 2, 2 * 1024 * 8 * 128 * 2, c=8)
        (33030144, 33030144)
    """
    moved = (2 * q_block_bytes + kv_repeat * kv_block_bytes) * (c - 1) // c
    return moved, moved


# ---------------------------------------------------------------------------------------------
# Decoding: the combine's bytes
# ---------------------------------------------------------------------------------------------


def decode_bytes(batch: int, heads: int, width: int, c: int) -> int:
    """Bytes each device sends in one `decode` call's combine (per layer and token): the f32
    ``(max, sum, weighted values)`` of each row and query head, ``batch * heads * (width + 2)``
    floats, in one slot per device of the cache's sequence axis (``c`` slots), all-reduced
    over its ``c`` devices: ``2 * (c - 1) / c`` of the ``c`` slots with the ring algorithm,
    ``2 * (c - 1)`` times one device's state. ``batch`` and ``heads`` are per device (q's
    block), ``width`` the head width ``D``. 0 when the cache is not split (``c = 1``).
    Independent of the cache's length: the cache never moves. (Differentiated, which
    decoding does not need: the all-reduce's transpose sends nothing, and q's gradient,
    q being the same on every device of the axis, is summed over it: one all-reduce of q's
    block.)

    Examples:
        >>> attention.decode_bytes(batch=8, heads=4, width=128, c=8)
        232960
    """
    return 2 * (c - 1) * batch * heads * (width + 2) * 4
