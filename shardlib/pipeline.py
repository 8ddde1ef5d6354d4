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
- `gpipe_bubble_fraction`, `circular_bubble_fraction`: the share of ticks a stage idles,
  ``(p-1)/(m+p-1)`` and ``(p-1)/(v*m+p-1)``.
- `timeline`, `work_items`: which microbatch each stage works on at each tick (text, list).

Each schedule runs under a named scope ``shardlib.pipeline.NAME[axis=.. p=.. m=.. v=..]``, which
`shardlib.explain` reads to report the schedule and its bubble fraction.

Why no 1F1B: 1F1B interleaves each microbatch's backward pass with later microbatches'
forward passes to hold fewer activations. Under JAX the backward pass is what ``jax.grad``
derives from the whole forward program, after the forward program has been traced, so a
schedule written as forward code cannot place backward work between forward ticks; doing so
means writing the backward pass by hand (``jax.vjp`` per tick inside one loop, gradients
accumulated manually), which gives up autodiff for the whole model. Activation memory is
bounded instead by ``jax.checkpoint`` on the stage (one input block per tick is kept).

Example (a 4-stage MLP stack; ``x`` is ``m`` microbatches of ``B`` rows each)::

    @typed_shard_map
    def forward(w: f32[b'layers/p M M'], x: f32[b'm B M']) -> f32[b'm B M']:
        def stage(w, h):  # this device's layers, in order
            h, _ = lax.scan(lambda h, wi: (jnp.tanh(h @ wi), None), h, w)
            return h

        return pipeline.gpipe(stage, w, x, spec='B M', axis='p')
"""

from __future__ import annotations

from ._pipeline.plan import (
    circular_bubble_fraction,
    gpipe_bubble_fraction,
    timeline,
    work_items,
)
from ._pipeline.schedules import circular, gpipe

__all__ = [
    "circular",
    "circular_bubble_fraction",
    "gpipe",
    "gpipe_bubble_fraction",
    "timeline",
    "work_items",
]
