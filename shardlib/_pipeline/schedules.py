"""The pipeline schedules, `gpipe` and `circular`, as per-device shardlib code (JAX).

The public face is `shardlib.pipeline` (its docstring is the user's guide); the schedules'
arithmetic is pure Python in `shardlib._pipeline.arithmetic`, the rules their arguments keep in
`shardlib._pipeline.arguments`, the helpers every schedule's loop shares in
`shardlib._pipeline.stage`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
from jax import lax

from .._env.context import estimates_wanted, manual_axis_sizes
from ..shardops import axis_index, psum, shift
from .arguments import microbatch_count_error
from .registry import CIRCULAR, GPIPE
from .residuals import tick_policy
from .scopes import schedule_scope
from .stage import carry_axes, check_arguments, check_stage_output, group_count, group_of, vary

__all__ = ["circular", "gpipe"]

Params = TypeVar("Params")


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
      (tensor or data parallelism inside the stage), but no collective over `axis` (read
      from one trace of ``stage_fn`` per call, nested jaxprs included; refused).
    - `stage_params`: any pytree, this device's stage weights (typically the block of
      stacked layers ``'layers/p ...'``); passed to ``stage_fn`` unchanged at every tick.
    - `microbatches`: the per-device block of all microbatches, shape ``(m, *h.shape)``,
      the same on every stage: replicated over `axis` (annotated ``'m B M'``, not
      ``'m/p B M'``). Values that may differ along `axis` are refused when
      ``typed_shard_map`` analyses the body (with ``check_vma`` on or off).
    - `spec`: the shape spec of one microbatch block, such as ``'B/d M'`` (the layout
      ``stage_fn`` takes and returns, and that each `shardops.shift` checks).
    - `axis`: the stage mesh axis (manual in this ``shard_map``), ``'p'`` by default; not
      an axis `spec` splits the microbatch over.
    - `broadcast`: with ``True`` (the default) the outputs, computed on the last stage, are
      summed over `axis` from a buffer that is zero on the other stages (one all-reduce),
      so every stage returns them: the result is replicated over `axis`. With ``False``
      the last stage returns them and the other stages return zeros (varying over `axis`;
      cheaper when only the last stage computes the loss).

    **Returns:** the stage outputs of all microbatches, shape ``(m, *h.shape)``, in
    microbatch order: microbatch ``i`` after every stage's layers.

    **Raises:** ``ValueError`` naming the broken rule: `axis` not a manual mesh axis,
    microbatches not replicated over it, ``stage_fn`` communicating over it or returning
    anything but one block like its input (sizes global, as in the annotations).

    Examples:
        >>> # w: this stage's 'layers/p M/d F/t' block; x: 'm B/d M' (m microbatches)
        >>> y = pipeline.gpipe(run_my_layers, w, x, spec='B/d M', axis='p')
    """
    fn = GPIPE.function
    spec_text, microbatches, axis = check_arguments(fn, microbatches, spec, axis)
    m, n = microbatches.shape[0], manual_axis_sizes()[axis]
    zero = jnp.zeros_like(microbatches[0])
    axes = carry_axes(fn, stage_fn, stage_params, zero, axis, spec_text)
    params = vary(stage_params, axes)  # the loop's weights (see `carry_axes`)
    res = _tick_bytes(stage_fn, params, vary(zero, axes)) if estimates_wanted() else None
    with jax.named_scope(schedule_scope(GPIPE.scope, axis, n, m, 1, res)):
        return _gpipe(stage_fn, params, microbatches, spec_text, axis, broadcast, axes)


def _gpipe(
    stage_fn: Callable[[Params, jax.Array], jax.Array],
    stage_params: Params,
    microbatches: jax.Array,
    spec_text: str,
    axis: str,
    broadcast: bool,
    loop_axes: frozenset[str] | None,
) -> jax.Array:
    m = microbatches.shape[0]
    n = manual_axis_sizes()[axis]
    stage = axis_index(axis)
    ticks = m + n - 1
    zero = jnp.zeros_like(microbatches[0])

    def tick(state: jax.Array, t: jax.Array) -> tuple[jax.Array, jax.Array]:
        # Stage 0 takes microbatch t; the others take what the previous stage sent.
        fresh = lax.dynamic_index_in_dim(microbatches, jnp.minimum(t, m - 1), keepdims=False)
        h = jnp.where(stage == 0, fresh, state)
        working = (t >= stage) & (t - stage < m)  # False: a bubble tick on this stage
        h = jnp.where(working, h, zero)
        y = stage_fn(stage_params, h)
        return _pass_on(GPIPE.function, y, h, working, spec_text, axis, False, loop_axes)

    _, ys = lax.scan(tick, vary(zero, loop_axes), jnp.arange(ticks))
    # The last stage finishes microbatch i at tick i + n - 1: its outputs are ys[n - 1:].
    return _outputs(ys[n - 1 :], stage, n, spec_text, axis, broadcast)


def circular(
    stage_fn: Callable[[Params, jax.Array], jax.Array],
    stage_params: Params,
    microbatches: jax.Array,
    *,
    spec: str | bytes,
    axis: str = "p",
    broadcast: bool = True,
    policy: Callable[..., bool] | None = None,
) -> jax.Array:
    """Run ``m`` microbatches ``v`` times round a ring of ``p`` stages (per-device code).

    The circular (interleaved) schedule, as MaxText's circular pipeline: the model's ``L``
    layers are cut into ``v * p`` groups of ``k = L / (v * p)`` consecutive layers, and stage
    ``s`` holds groups ``s, s + p, s + 2p, ...``: ``v`` non-adjacent groups. A microbatch
    goes through stages ``0 .. p-1`` with their first group (pass ``a``), comes back to stage
    0 (a wrap-around transfer) and goes round again with the second group, ``v`` times. Stage
    ``s`` works at tick ``t`` on item ``k = t - s`` (microbatch ``k % m``, pass ``k // m``)
    for ``0 <= k < v * m``: ``v * m + p - 1`` ticks under ``lax.scan``, of which each stage
    idles ``p - 1`` (`circular_bubble_fraction`), ``v`` times fewer than GPipe in proportion.
    Needs ``m >= p``: a microbatch's result comes back to stage 0 ``p`` ticks after it left,
    and waits in a buffer of ``m`` blocks until its next pass. Bubble ticks never reach the
    results or the gradients (as in `gpipe`); the backward pass is ``jax.grad`` of the scan.

    **Arguments:**

    - `stage_fn`: ``stage_fn(group_params, h) -> h'``, one layer group applied to one
      microbatch block (layout `spec`), as for `gpipe`.
    - `stage_params`: a pytree whose every leaf has a leading dim of size ``v``: this
      device's ``v`` layer groups, the pass index first. Stacked layers ``(L, ...)`` in model
      order, reshaped to ``(v, L / v, ...)`` and split over ``p`` on their second dim
      (``f32['v layers/p M F']``), give every stage exactly its groups in pass order.
    - `microbatches`, `spec`, `axis`, `broadcast`: as for `gpipe`.
    - `policy`: what the backward pass keeps of each tick's stage, a ``jax.checkpoint``
      policy such as ``jax.checkpoint_policies.nothing_saveable`` (recompute the stage from
      its input). Each tick runs under ``jax.checkpoint`` so that the backward pass slices
      the tick's layer group again from the weights instead of keeping a copy per tick;
      JAX lets that outer checkpoint's policy decide for everything inside it, so a
      ``jax.checkpoint`` inside ``stage_fn`` has no say. Default: the policy of a
      ``stage_fn`` decorated with `jax_extra.explicit_activation_checkpointing`, else keep
      every value (as plain autodiff); weight slices are never kept.

    **Returns:** the outputs of all microbatches after all ``L`` layers, shape
    ``(m, *h.shape)``, in microbatch order.

    **Raises:** ``ValueError`` as `gpipe` does, and for ``m < p`` or leaves of
    `stage_params` whose leading dims differ.

    Examples:
        >>> # w: 'v layers/p M F' (a (L, M, F) stack reshaped to (v, L // v, M, F))
        >>> y = pipeline.circular(run_my_layers, w, x, spec='B M', axis='p')
    """
    fn = CIRCULAR.function
    spec_text, microbatches, axis = check_arguments(fn, microbatches, spec, axis)
    v = group_count(stage_params)
    m, n = microbatches.shape[0], manual_axis_sizes()[axis]
    bad = microbatch_count_error(CIRCULAR, axis, n, m)
    if bad:
        raise ValueError(bad)
    zero = jnp.zeros_like(microbatches[0])
    axes = carry_axes(fn, stage_fn, group_of(stage_params, 0), zero, axis, spec_text)
    params, run_group = vary(stage_params, axes), _recomputing_group(stage_fn, policy)
    res = None
    if estimates_wanted():  # explain's trace: the bytes its table prints
        res = _tick_bytes(lambda w, h, r: run_group(w, r, h), params, vary(zero, axes), v - 1)
    with jax.named_scope(schedule_scope(CIRCULAR.scope, axis, n, m, v, res)):
        return _circular(run_group, params, microbatches, spec_text, axis, broadcast, v, axes)


def _circular(
    run_group: Callable[[Params, jax.Array, jax.Array], jax.Array],
    stage_params: Params,
    microbatches: jax.Array,
    spec_text: str,
    axis: str,
    broadcast: bool,
    v: int,
    loop_axes: frozenset[str] | None,
) -> jax.Array:
    m, n = microbatches.shape[0], manual_axis_sizes()[axis]
    stage = axis_index(axis)
    zero = jnp.zeros_like(microbatches[0])

    def tick(carry: tuple[jax.Array, jax.Array], t: jax.Array) -> tuple[Any, jax.Array]:
        state, waiting = carry
        # What arrived at stage 0 left the last stage at tick t - 1: item t - n. Unless it
        # has had its last pass, it waits in slot (t - n) % m for its next one.
        back = t - n
        slot = jnp.mod(back, m)
        keep = (stage == 0) & (back >= 0) & (back < (v - 1) * m)
        old = lax.dynamic_index_in_dim(waiting, slot, keepdims=False)
        waiting = lax.dynamic_update_index_in_dim(waiting, jnp.where(keep, state, old), slot, 0)
        k = t - stage  # the item this stage works on
        working = (k >= 0) & (k < v * m)
        fresh = lax.dynamic_index_in_dim(waiting, jnp.mod(t, m), keepdims=False)
        h = jnp.where(working, jnp.where(stage == 0, fresh, state), zero)
        y = run_group(stage_params, jnp.clip(k // m, 0, v - 1), h)
        sent, y = _pass_on(CIRCULAR.function, y, h, working, spec_text, axis, True, loop_axes)
        return (sent, waiting), y

    init = (vary(zero, loop_axes), vary(microbatches, loop_axes))
    _, ys = lax.scan(tick, init, jnp.arange(v * m + n - 1))
    # The last stage finishes microbatch i's last pass at tick (v - 1) * m + i + n - 1.
    return _outputs(ys[(v - 1) * m + n - 1 :], stage, n, spec_text, axis, broadcast)


def _pass_on(
    fn: str,
    y: jax.Array,
    h: jax.Array,
    working: jax.Array,
    spec_text: str,
    axis: str,
    wrap: bool,
    loop_axes: frozenset[str] | None,
) -> tuple[jax.Array, jax.Array]:
    """A tick's end on this stage: its output ``y`` checked against its input ``h``, zeros
    in a bubble tick, and sent one stage on (the last stage's to stage 0 if ``wrap``).
    Returns what this stage sends (it arrives at the next stage) and the output kept."""
    check_stage_output(fn, y, h, spec_text)
    y = jnp.where(working, y, jnp.zeros_like(y))
    sent = shift(spec_text, y, axis, offset=1, wrap=wrap)
    return vary(sent, loop_axes), y


def _outputs(
    done: jax.Array, stage: jax.Array, n: int, spec_text: str, axis: str, broadcast: bool
) -> jax.Array:
    """The schedule's result from ``done``, the ``m`` outputs kept at the ticks the last stage
    finished them: zeros on the other stages, or with ``broadcast`` summed over ``axis`` so
    that every stage returns them."""
    out = jnp.where(stage == n - 1, done, jnp.zeros_like(done))
    if broadcast:
        out = psum(f"{done.shape[0]} {spec_text}", out, axes=axis)
    return out


def _recomputing_group(
    stage_fn: Callable[[Any, jax.Array], jax.Array], policy: Callable[..., bool] | None
) -> Callable:
    """``run(params, r, h) = stage_fn(group r of params, h)``, under ``jax.checkpoint``.

    The group a tick uses changes with the tick, so plain autodiff of the loop would keep one
    copy of a group's weights per tick for the backward pass (``v * m + p - 1`` copies).
    Under this checkpoint the backward pass keeps ``params`` once (the same at every tick)
    and slices the group again; which other values it keeps is `tick_policy`'s choice. JAX
    applies the outermost checkpoint's policy to everything inside it, so a
    ``jax.checkpoint`` inside ``stage_fn`` does not choose: ``policy=`` does.
    """

    def run(params: Any, r: jax.Array, h: jax.Array) -> jax.Array:
        return stage_fn(group_of(params, r), h)

    return jax.checkpoint(run, policy=tick_policy(stage_fn, policy))


def _tick_bytes(run: Callable, params: Any, h: jax.Array, *other: Any) -> int | None:
    """Bytes per device that autodiff of a schedule's loop keeps per tick for the stage
    ``run(params, h, *other)`` (``other``: ints that change per tick), read from JAX itself:
    the residuals of a loop of three ticks less those of two. What the loop computes from
    ``params`` alone (the weights, their slices) JAX's scan keeps once, not per tick. None
    when JAX cannot differentiate the stage (a forward-only pipeline may run one)."""

    def kept(ticks: int) -> int:
        def loop(w: Any, h: jax.Array) -> jax.Array:
            xs = (jnp.broadcast_to(h, (ticks, *h.shape)), *(jnp.full(ticks, k) for k in other))
            return lax.scan(lambda _, x: (None, run(w, *x)), None, xs)[1]

        res = jax.eval_shape(lambda w, h: jax.tree.leaves(jax.vjp(loop, w, h)[1]), params, h)
        return sum(math.prod(a.shape) * a.dtype.itemsize for a in res)

    try:
        return kept(3) - kept(2)
    except (TypeError, ValueError, NotImplementedError):  # no JVP rule in the stage
        return None
