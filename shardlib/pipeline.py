"""Pipeline schedules written as plain per-device shardlib code.

Call these **inside** a ``typed_shard_map`` body whose stacked layer weights are split over a
stage axis, ``f32['layers/p M F']``: each device along ``p`` holds one stage's layers, runs
its stage on the microbatch in front of it, and hands the result to the next stage with
`shardops.shift`. Every transfer is a typed ``collective-permute``; the loop over ticks is a
``lax.scan`` (compile time does not grow with the number of microbatches), and the backward
pass is JAX's autodiff of that loop.

- `gpipe`: GPipe, all microbatches forward through all stages; ``jax.grad`` gives the
  backward pass in reverse.
- `gpipe_bubble_fraction`: the share of ticks a stage idles in GPipe, ``(p-1)/(m+p-1)``.

Example (a 4-stage MLP stack; ``x`` is ``m`` microbatches of ``B`` rows each)::

    @typed_shard_map
    def forward(w: f32[b'layers/p M M'], x: f32[b'm B M']) -> f32[b'm B M']:
        def stage(w, h):  # this device's layers, in order
            h, _ = lax.scan(lambda h, wi: (jnp.tanh(h @ wi), None), h, w)
            return h

        return pipeline.gpipe(stage, w, x, spec='B M', axis='p')
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
from jax import lax

from . import shardops
from ._context import varying_axes

__all__ = ["gpipe", "gpipe_bubble_fraction"]

Params = TypeVar("Params")


def gpipe_bubble_fraction(p: int, m: int) -> float:
    """The fraction of GPipe's ticks in which a stage is idle: ``(p - 1) / (m + p - 1)``.

    GPipe runs ``m + p - 1`` ticks; each of the ``p`` stages works on ``m`` of them (one per
    microbatch) and idles on the other ``p - 1``, the bubble.

    **Arguments:** `p` the number of stages (>= 1); `m` the number of microbatches (>= 1).

    **Returns:** a float in ``[0, 1)``; ``0.0`` for one stage.

    Examples:
        >>> gpipe_bubble_fraction(4, 8)  # 3 idle ticks out of 11
        0.2727272727272727
    """
    for name, value in (("p", p), ("m", m)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(
                f"gpipe_bubble_fraction: argument `{name}` must be a positive int "
                f"(number of {'stages' if name == 'p' else 'microbatches'}), got {value!r}"
            )
    return (p - 1) / (m + p - 1)


def gpipe(
    stage_fn: Callable[[Params, jax.Array], jax.Array],
    stage_params: Params,
    microbatches: jax.Array,
    *,
    spec: str | bytes,
    axis: str = "p",
    broadcast: bool = True,
) -> jax.Array:
    """Run ``m`` microbatches through ``p`` pipeline stages, GPipe's schedule (per-device code).

    Call inside a ``typed_shard_map`` body; the ``p`` devices along mesh ``axis`` are the
    stages, in order. The loop runs ``T = m + p - 1`` ticks under ``lax.scan``. At tick
    ``t`` stage 0 takes microbatch ``t`` (while ``t < m``), every stage applies
    ``stage_fn`` to the block in front of it, and each stage passes its output to the next
    with ``shardops.shift(spec, y, axis, offset=1, wrap=False)`` (one
    ``collective-permute`` per tick). Stage ``s`` works on microbatch ``t - s`` at tick
    ``t``; the other ticks are the bubble (`gpipe_bubble_fraction`). Bubble values never
    reach the results or the gradients: in a bubble tick ``stage_fn`` runs on zeros and its
    output is replaced by zeros with ``jnp.where`` (and a bubble output only ever flows into
    later bubble ticks; the last stage's collected ticks are all real). Their cotangents are
    exactly zero, so ``stage_fn``'s gradient need only be finite at a zero input, as it is
    for the usual layers. The backward pass is ``jax.grad`` of the scan: the reverse
    schedule, each transfer's transpose being the shift back. Wrap ``stage_fn`` in
    ``jax.checkpoint`` to keep only each tick's stage input for the backward pass.

    **Arguments:**

    - `stage_fn`: ``stage_fn(stage_params, h) -> h'``, this device's stage applied to one
      microbatch block ``h`` (layout ``spec``); the output has ``h``'s shape and dtype, as
      the next stage takes it as input. It may use any shardops over other mesh axes
      (tensor or data parallelism inside the stage), but not over `axis`.
    - `stage_params`: any pytree, this device's stage weights (typically the block of
      stacked layers ``'layers/p ...'``); passed to ``stage_fn`` unchanged at every tick.
    - `microbatches`: the per-device block of all microbatches, shape ``(m, *h.shape)``,
      the same on every stage (replicated over `axis`).
    - `spec`: the shape spec of one microbatch block, such as ``'B/d M'`` (the layout
      ``stage_fn`` takes and returns, and that each `shardops.shift` checks).
    - `axis`: the stage mesh axis (manual in this ``shard_map``), ``'p'`` by default.
    - `broadcast`: with ``True`` (the default) the outputs, computed on the last stage, are
      summed over `axis` from a buffer that is zero on the other stages (one all-reduce),
      so every stage returns them: the result is replicated over `axis`. With ``False``
      the last stage returns them and the other stages return zeros (varying over `axis`;
      cheaper when only the last stage computes the loss).

    **Returns:** the stage outputs of all microbatches, shape ``(m, *h.shape)``, in
    microbatch order: microbatch ``i`` after every stage's layers.

    Examples:
        >>> # w: this stage's 'layers/p M/d F/t' block; x: 'm B/d M' (m microbatches)
        >>> y = pipeline.gpipe(run_my_layers, w, x, spec='B/d M', axis='p')
    """
    _check_microbatches(microbatches)
    m = microbatches.shape[0]
    n = shardops.axis_size(axis)
    stage = shardops.axis_index(axis)
    ticks = m + n - 1
    spec_text = spec.decode() if isinstance(spec, bytes) else spec

    zero = jnp.zeros_like(microbatches[0])
    carry_axes = _carry_axes(stage_fn, stage_params, zero, axis)

    def tick(state: jax.Array, t: jax.Array) -> tuple[jax.Array, jax.Array]:
        # Stage 0 takes microbatch t; the others take what the previous stage sent.
        fresh = lax.dynamic_index_in_dim(microbatches, jnp.minimum(t, m - 1), keepdims=False)
        h = jnp.where(stage == 0, fresh, state)
        working = (t >= stage) & (t - stage < m)  # False: a bubble tick on this stage
        h = jnp.where(working, h, zero)
        y = stage_fn(stage_params, h)
        _check_stage_output(y, h)
        y = jnp.where(working, y, jnp.zeros_like(y))
        sent = shardops.shift(spec_text, y, axis, offset=1, wrap=False)
        return _vary(sent, carry_axes), y

    _, ys = lax.scan(tick, _vary(zero, carry_axes), jnp.arange(ticks))
    # The last stage finishes microbatch i at tick i + n - 1: its outputs are ys[n - 1:].
    out = jnp.where(stage == n - 1, ys[n - 1 :], jnp.zeros_like(ys[n - 1 :]))
    if broadcast:
        out = shardops.psum(f"{m} {spec_text}", out, axes=axis)
    return out


def _check_microbatches(microbatches: Any) -> None:
    shape = getattr(microbatches, "shape", None)
    if shape is None or len(shape) < 1 or shape[0] < 1:
        raise ValueError(
            "gpipe: argument `microbatches` must be an array of shape (m, *microbatch) with "
            f"m >= 1 microbatches along its first dim, got shape {shape}"
        )


def _check_stage_output(y: Any, h: jax.Array) -> None:
    shape, dtype = getattr(y, "shape", None), getattr(y, "dtype", None)
    if shape != h.shape or dtype != h.dtype:
        raise ValueError(
            f"gpipe: `stage_fn` must return a block of its input's shape and dtype (it is the "
            f"next stage's input): expected {h.dtype}{list(h.shape)}, got "
            f"{dtype}{list(shape) if shape is not None else type(y).__name__}"
        )


def _carry_axes(
    stage_fn: Callable[[Any, jax.Array], jax.Array], params: Any, zero: jax.Array, axis: str
) -> frozenset[str] | None:
    """The manual axes the scan carry varies over; None without ``check_vma``.

    Under ``check_vma`` a scan carry keeps its type. A stage's output varies over the stage
    axis (each stage has its own weights) and over what ``stage_fn`` leaves varying, which
    may depend on what its input varies over: grow the set until a stage output varies over
    no axis outside it (a few traces of ``stage_fn``'s shapes, no computation).
    """
    have = varying_axes(zero)
    if have is None:
        return None
    axes = have | {axis}
    while True:
        out = jax.eval_shape(stage_fn, params, _vary(zero, axes))
        more = varying_axes(out) if isinstance(out, jax.ShapeDtypeStruct) else None
        if more is None or more <= axes:
            return axes
        axes = axes | more


def _vary(x: jax.Array, axes: frozenset[str] | None) -> jax.Array:
    """``x`` made to vary over ``axes`` too (``lax.pcast``); ``x`` without ``check_vma``."""
    have = varying_axes(x)
    if axes is None or have is None:
        return x
    missing = tuple(sorted(axes - have))
    return lax.pcast(x, missing, to="varying") if missing else x
