"""Pipeline schedules written as plain per-device shardlib code.

Call these **inside** a ``typed_shard_map`` body whose stacked layer weights are split over a
stage axis, ``f32['layers/p M F']``: each device along ``p`` holds one stage's layers, runs
its stage on the microbatch in front of it, and hands the result to the next stage with
`shardops.shift`. Every transfer is a typed ``collective-permute``; the loop over ticks is a
``lax.scan`` (compile time does not grow with the number of microbatches), and the backward
pass is JAX's autodiff of that loop.

- `gpipe`: GPipe, all microbatches forward through all stages; ``jax.grad`` gives the
  backward pass in reverse.
- `circular`: the circular (interleaved) schedule: each stage holds ``v`` non-adjacent layer
  groups and every microbatch goes round the ring of stages ``v`` times.
- `one_f_one_b`, `interleaved`, `zb_h1`, `zb_v`: the memory-bounded schedules, which return
  the loss (a ``loss_fn`` run on the stage that ends the model) and run forward and backward
  work in one loop of fused ticks (a forward and a backward per stage and tick in the steady
  state, so the step's lockstep critical path is GPipe's or less): 1F1B, interleaved 1F1B
  (``v`` groups per stage), zero-bubble ZB-H1 and ZB-V (two chunks per stage in a V), the
  last two with each backward split into the input's cotangent and the weight gradient, one
  backward's work in all. Each forward is a ``jax.vjp`` of the stage, its residuals wait in
  a ring of slots bounded independently of ``m``; the pipeline is a ``jax.custom_vjp``, so
  ``jax.value_and_grad`` of a loss built on it returns the gradients the schedule computed.
- `pipeline_loss`: one call shape for all six (``schedule='gpipe' | 'circular' | '1f1b' |
  'interleaved' | 'zb-h1' | 'zb-v'``), so switching schedule is one argument.
- `bubble_fraction` (and `gpipe_bubble_fraction`, `circular_bubble_fraction`): the share of
  the step a stage idles (for the memory-bounded schedules, from the table they run).
- `critical_path`: the step in units of a stage's forward, backward and weight-gradient
  times, as the devices run it in lockstep, without lockstep, and GPipe's.
- `timeline`, `work_items`: what each stage works on at each tick (text; list for gpipe and
  circular). These refuse what the schedules refuse: ``m < p`` for circular and
  interleaved.
- `to_groups`, `from_groups`: move stacked layer weights (and the optimizer moments that
  mirror them) between the layouts, ``(L, ...)`` as ``'layers/p ...'`` for gpipe, 1f1b
  and zb-h1 and ``(v, L / v, ...)`` as ``'v layers/p ...'`` for circular and interleaved
  (and, with ``route='v'``, for zb-v)
  (model order group-major), resharded so a trained or restored state switches schedule.
- `UnsplitBackwardWarning`: warned when ZB-H1 or ZB-V runs a stage's backward whole in its
  input half (the split into B and W failed): right values, 1F1B's critical path.

Each schedule runs under a named scope ``shardlib.pipeline.NAME[axis=.. p=.. m=.. v=..]``, which
`shardlib.explain` reads to report the schedule and its bubble fraction.

Example (a 4-stage MLP stack; ``x`` is ``m`` microbatches of ``B`` rows each)::

    @typed_shard_map
    def forward(w: f32[b'layers/p M M'], x: f32[b'm B M']) -> f32[b'm B M']:
        def stage(w, h):  # this device's layers, in order
            h, _ = lax.scan(lambda h, wi: (jnp.tanh(h @ wi), None), h, w)
            return h

        return pipeline.gpipe(stage, w, x, spec='B M', axis='p')
"""

from __future__ import annotations

from ._pipeline.arithmetic import (
    bubble_fraction,
    circular_bubble_fraction,
    gpipe_bubble_fraction,
    timeline,
    work_items,
)
from ._pipeline.cost import CriticalPath, critical_path
from ._pipeline.entry import interleaved, one_f_one_b, pipeline_loss, zb_h1, zb_v
from ._pipeline.layout import from_groups, to_groups
from ._pipeline.schedules import circular, gpipe
from ._pipeline.unsplit import UnsplitBackwardWarning

__all__ = [
    "CriticalPath",
    "UnsplitBackwardWarning",
    "bubble_fraction",
    "circular",
    "circular_bubble_fraction",
    "critical_path",
    "from_groups",
    "gpipe",
    "gpipe_bubble_fraction",
    "interleaved",
    "one_f_one_b",
    "pipeline_loss",
    "timeline",
    "to_groups",
    "work_items",
    "zb_h1",
    "zb_v",
]
