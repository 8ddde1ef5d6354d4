"""Mixture of experts with expert parallelism, as per-device code.

Call `layer` **inside** a ``typed_shard_map`` body whose expert weights are split over an
expert axis ``e``: ``w_in`` ``f32['E/e M F']`` and ``w_out`` ``f32['E/e F M']`` (or ``F/t``
with ``hidden_axis='t'``), the router ``w_router`` ``f32['M E']``, and tokens ``x`` this
device's block (``f32['B/d/e L M']`` usually: the batch split over the expert axis too, so
that every device routes different tokens).

- `route`: top-k gates (softmax or sigmoid, optionally renormalised to sum to 1), the expert
  ids, the Switch/GShard load-balancing loss ``E * sum_e f_e * P_e`` and the router z-loss
  ``mean(logsumexp(logits) ** 2)``; over this device's tokens, or over every token of the
  mesh ``axes`` named.
- `layer` (the default path, capacity-based): each device gives every expert ``C`` slots,
  ``C = ceil(capacity_factor * T * k / E)`` for its ``T`` tokens (or ``capacity=``); slots are
  filled by the rule of `assign` (all first choices in token order, then all second choices,
  ...), and a (token, choice) pair that finds its expert full is dropped (counted in
  ``Stats.dropped``; a token whose every choice dropped comes back as zeros: add the
  residual). One `shardops.all_to_all` ``'E C/e M -> E/e C M'`` sends the slots to the
  experts' devices, one batched matmul each way runs the ``E/e`` local experts, and the
  reverse all-to-all ``'E/e C M -> E C/e M'`` brings the outputs home, summed with the gates.
  Shapes are static; each all-to-all moves ``all_to_all_bytes(E, C, M, itemsize, e)`` per
  device, and the backward pass runs the two reverse all-to-alls.
- Dropless: ``dropless=True`` sets ``C = T`` (`dropless_capacity`): a token picks ``k``
  distinct experts, so no expert gets more than ``T`` pairs from one device, and nothing is
  dropped, at ``E / (k * capacity_factor)`` times the bytes and FLOPs of the capacity path.
  Accelerators avoid the padding with ``jax.lax.ragged_all_to_all``, which XLA:CPU does not
  implement; shardlib does not offer that path.

Example::

    @typed_shard_map
    def ffn(x: f32[b'B/d/e L M'], wr: f32[b'M E'], w_in: f32[b'E/e M F'],
            w_out: f32[b'E/e F M']) -> f32[b'B/d/e L M']:
        y, stats = moe.layer(x, wr, w_in, w_out, k=2, axis='e')
        return y
"""

from __future__ import annotations

from ._moe.capacity import all_to_all_bytes, capacity, dropless_capacity
from ._moe.dispatch import Slots, Stats, assign, combine, dispatch, expert_ffn, layer
from ._moe.router import Routing, route

__all__ = [
    "Routing",
    "Slots",
    "Stats",
    "all_to_all_bytes",
    "assign",
    "capacity",
    "combine",
    "dispatch",
    "dropless_capacity",
    "expert_ffn",
    "layer",
    "route",
]
