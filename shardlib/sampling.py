"""Sampling the next token when the vocabulary is split over mesh axes, as per-device code.

A decode step's output projection is often tensor-parallel: its logits are ``f32['B/d V/t']``,
rows over ``d`` and the vocabulary over ``t``. Call `sample` **inside** the
``typed_shard_map`` body: each device reduces its block to a few candidates per row and one
all-reduce over ``t`` brings them to every device (`sample_bytes`), which choose the same
token, a global vocabulary id per row, ``i32['B/d']``.

- Greedy (``temperature=0``): the argmax; among equal logits the lowest id, whatever the split.
- ``temperature > 0``: an exact sample of ``softmax(logits / temperature)`` (the Gumbel-max
  trick), restricted to the ``top_k`` greatest logits and then to the ``top_p`` nucleus of
  their tempered softmax. Top-k gathers ``k`` candidates per device (``k * t`` per row);
  top-p without top-k gathers the whole row (the nucleus needs every token's probability).
- Reproducible across meshes: the noise of a (row, token) pair is a function of the key, the
  step, the row's global index and the token's global id only, so the same key and step give
  bit-identical tokens on a 1x8, 4x2 or 2x2x2 mesh, and outside ``shard_map`` (where `sample`
  takes the global logits, spec ``'B V'``).

Example::

    @typed_shard_map
    def next_token(logits: f32[b'B/d V/t'], key: u32[b'2'], step: i32[b'']) -> i32[b'B/d']:
        return sampling.sample('B/d V/t', logits, key, step=step, temperature=0.7, top_k=50)
"""

from __future__ import annotations

from ._sampling.pick import sample
from ._sampling.rules import sample_bytes

__all__ = ["sample", "sample_bytes"]
