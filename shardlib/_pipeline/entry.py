"""The loss-returning schedules: `one_f_one_b`, `interleaved`, `zb_h1`, `zb_v`, and `pipeline_loss`,
one entry for every schedule (switching schedule is one argument).

The public face is `shardlib.pipeline`; the schedules are `shardlib._pipeline.registry`'s, the
tick tables `shardlib._pipeline.tables`, the loop that runs them `shardlib._pipeline.table_loop`.
Each function's docstring is written here, once; the four table schedules share one signature
(spelled out in each, as the API reference and ``inspect.signature`` read it) and one body,
`run_schedule` of their `Schedule`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from .._env import rules as _rules
from .._env.context import manual_axis_sizes
from ..shardops import axis_index, psum
from .branches import check_loss_fn
from .registry import CIRCULAR, GPIPE, INTERLEAVED, ONE_F_ONE_B, ZB_H1, ZB_V, find, names
from .schedules import circular, gpipe
from .table_loop import run_schedule

__all__ = ["interleaved", "one_f_one_b", "pipeline_loss", "zb_h1", "zb_v"]

LossFn = Callable[[Any, jax.Array, Any], jax.Array]


def one_f_one_b(
    stage_fn: Callable[[Any, jax.Array], jax.Array],
    stage_params: Any,
    microbatches: jax.Array,
    *,
    spec: str | bytes,
    loss_fn: LossFn,
    loss_params: Any = None,
    targets: Any = None,
    axis: str = "p",
) -> jax.Array:
    """The loss of ``m`` microbatches through ``p`` stages, 1F1B's schedule (per-device code).

    Call inside a ``typed_shard_map`` body, as `gpipe`. The ticks are fused: in the steady
    state each stage runs one forward and one backward per tick, stage ``s`` the forward of
    microbatch ``j`` at tick ``j + s`` and its backward at ``j + 2p - 2 - s`` (the last stage
    both in one tick, the loss between them): ``m + 2p - 2`` ticks of one ``lax.scan``,
    whose lockstep critical path is GPipe's ``(m + p - 1)(T_F + T_B)``
    (`pipeline.critical_path`), and a stage holds the residuals of at most ``2 (p - s) - 1``
    microbatches at once, whatever ``m`` is (GPipe's grow with ``m``). The last stage applies
    ``loss_fn`` to each microbatch's output as soon as it has it, so that microbatch's
    backward starts at once. Each forward is a ``jax.vjp`` of ``stage_fn``; its residuals
    (the VJP object's leaves, less the stage weights, which are kept once) wait in a ring of
    slots until the backward; weight gradients are running totals. Every tick sends the
    forward output on and the input cotangent back with two ``shardops.shift`` (typed
    ``collective-permute``); a stage with no forward or no backward at a tick skips that
    work (``lax.switch`` on the table's row). The result is differentiable: ``jax.grad`` of
    a loss built on it returns the gradients the schedule computed (a ``jax.custom_vjp``),
    for `stage_params`, `loss_params`, `microbatches` and the float leaves of `targets` (so
    an embedding before the pipeline trains by plain autodiff). Without a gradient it runs
    the forwards only.

    **Arguments:**

    - `stage_fn`, `stage_params`, `microbatches`, `spec`, `axis`: as for `gpipe`. ``stage_fn``
      must not close over arrays you differentiate (pass them in `stage_params`); wrap it in
      ``jax.checkpoint`` to keep only its input per microbatch (weights gathered inside the
      stage, for FSDP, are residuals otherwise).
    - `loss_fn`: ``loss_fn(loss_params, y, target) -> scalar``, the loss of one microbatch
      from its output block ``y`` (layout `spec`), run on the last stage; it may use
      collectives over the other mesh axes (such as a ``psum`` over ``d``).
    - `loss_params`: any pytree, the head's weights (``None`` for none), replicated over
      `axis`.
    - `targets`: any pytree whose leaves have ``m`` first (``None`` for none), replicated
      over `axis`; ``loss_fn`` gets microbatch ``i``'s slice.

    **Returns:** the sum of ``loss_fn`` over the ``m`` microbatches, a scalar, the same on
    every stage.

    **Raises:** ``ValueError`` as `gpipe` does, and for a ``loss_fn`` that does not return a
    scalar.

    Examples:
        >>> def head(w, y, t):  # the loss of one microbatch, on the last stage
        ...     return jnp.mean((y @ w - t) ** 2)
        >>> loss = pipeline.one_f_one_b(run_my_layers, w, x, spec='B M', loss_fn=head,
        ...                             loss_params=w_head, targets=t)
    """
    return run_schedule(
        ONE_F_ONE_B, stage_fn, stage_params, microbatches, spec=spec, loss_fn=loss_fn,
        loss_params=loss_params, targets=targets, axis=axis,
    )  # fmt: skip


def zb_h1(
    stage_fn: Callable[[Any, jax.Array], jax.Array],
    stage_params: Any,
    microbatches: jax.Array,
    *,
    spec: str | bytes,
    loss_fn: LossFn,
    loss_params: Any = None,
    targets: Any = None,
    axis: str = "p",
) -> jax.Array:
    """The loss of ``m`` microbatches, zero-bubble ZB-H1's schedule (per-device code).

    As `one_f_one_b`, with each backward split in two (Qi et al., 2023): ``B``, the input's
    cotangent, on the critical path and sent upstream at once, and ``W``, the weight
    gradient, which each stage runs in a later tick where it makes no tick longer (at the
    latest ``p - 1`` ticks after its ``B``, so every stage holds at most ``2p - 1 - s``
    microbatches' residuals). With ``T_F = T_B = T_W`` the lockstep critical path is
    ``3 m + 2 (p - 1)`` against 1F1B's ``3 (m + p - 1)`` (`pipeline.critical_path`).

    The split is real: `shardlib._pipeline.split` cuts the stage's backward program in two,
    ``B`` the equations the input's cotangent needs, ``W`` the rest, and ``B`` keeps for
    ``W`` the values ``W`` reads (the cotangents at the weights' uses), so ``B + W`` is one
    backward. A ``lax.scan`` over layers is cut too (two scans). What stays whole: an
    equation both halves need (it runs in ``B``), and a ``while_loop``, ``cond`` or custom
    derivative whose outputs both need (likewise). A stage whose backward has no weight
    half at all runs it whole in ``B``. See the pipeline guide for what a ``stage_fn``
    should look like.

    **Arguments** and **Returns:** as `one_f_one_b`.

    Examples:
        >>> loss = pipeline.zb_h1(run_my_layers, w, x, spec='B M', loss_fn=head,
        ...                       loss_params=w_head, targets=t)
    """
    return run_schedule(
        ZB_H1, stage_fn, stage_params, microbatches, spec=spec, loss_fn=loss_fn,
        loss_params=loss_params, targets=targets, axis=axis,
    )  # fmt: skip


def interleaved(
    stage_fn: Callable[[Any, jax.Array], jax.Array],
    stage_params: Any,
    microbatches: jax.Array,
    *,
    spec: str | bytes,
    loss_fn: LossFn,
    loss_params: Any = None,
    targets: Any = None,
    axis: str = "p",
) -> jax.Array:
    """The loss of ``m`` microbatches, interleaved 1F1B (Megatron's virtual stages).

    Each stage holds ``v`` layer groups, laid out as for `circular` (``'v layers/p ...'``):
    a microbatch goes round the ring of stages ``v`` times forward and ``v`` times back. The
    order is Megatron's: forwards in chunks of ``c`` consecutive microbatches, group by group,
    backwards with the groups reversed; ``c = p`` when ``p`` divides ``m``, otherwise the
    ``m // p`` chunks are as even as can be, the larger first (``c`` between ``p`` and
    ``2 p - 1``). The ticks are fused as `one_f_one_b`'s (forward item ``k`` of the order on
    stage ``s`` at tick ``k + s``, backward item ``k`` at ``k + D - s``): a lockstep critical
    path of ``(m + (p - 1) / v)(T_F + T_B)``, below 1F1B's, and the residuals held stay
    bounded independently of ``m`` (at most ``(v - 1) c + 2 (p - s) - 1`` groups' worth on
    stage ``s``, each ``1 / v`` of a stage). Needs ``m >= p``.

    **Arguments** and **Returns:** as `one_f_one_b`; `stage_params` as for `circular`.

    Examples:
        >>> # w: 'v layers/p M F' (a (L, M, F) stack reshaped to (v, L // v, M, F))
        >>> loss = pipeline.interleaved(run_my_layers, w, x, spec='B M', loss_fn=head)
    """
    return run_schedule(
        INTERLEAVED, stage_fn, stage_params, microbatches, spec=spec, loss_fn=loss_fn,
        loss_params=loss_params, targets=targets, axis=axis,
    )  # fmt: skip


def zb_v(
    stage_fn: Callable[[Any, jax.Array], jax.Array],
    stage_params: Any,
    microbatches: jax.Array,
    *,
    spec: str | bytes,
    loss_fn: LossFn,
    loss_params: Any = None,
    targets: Any = None,
    axis: str = "p",
) -> jax.Array:
    """The loss of ``m`` microbatches, the zero-bubble V schedule (ZB-V; per-device code).

    Each stage holds two layer chunks in a V: stage ``s`` holds layer groups ``s`` and
    ``2p - 1 - s`` of ``2p``. A microbatch runs chunk 0 down the stages, the last stage goes
    straight on with its chunk 1 (no transfer), chunk 1 runs back up to stage 0, where
    ``loss_fn`` takes the output; the backward retraces the V. Forward position ``q`` of
    microbatch ``j`` runs at tick ``2j + q``, backward position ``q`` at ``2j + 2p - 1 + q``:
    a stage's two chunks fall on ticks of opposite parity, so in the steady state every
    stage runs a forward and a backward (input half) per tick and its two outputs go
    opposite ways (two shifts per tick, as 1F1B). Weight halves (``W``, split as `zb_h1`'s)
    fill ticks where they cost nothing, at the latest ``p - 1`` ticks after their ``B``.
    Lockstep critical path (`pipeline.critical_path`, ``T_F = T_B = T_W``): below ZB-H1's
    and 1F1B's; memory flat in ``m`` and spread over the stages (stage 0 holds less than
    1F1B's stage 0: ``pipeline.timeline('zb-v', p, m, 2)`` and explain show the counts).

    **Arguments** and **Returns:** as `one_f_one_b`; `stage_params` has every leaf's two
    chunks first, ``'v layers/p ...'`` with ``v = 2`` in the V's order:
    ``pipeline.to_groups(stack, 2, route='v')`` lays out an ``(L, ...)`` stack so.

    **Raises:** as `one_f_one_b`, and for `stage_params` whose leading dim is not 2.

    Examples:
        >>> # w: 'v layers/p M F' with v = 2, from pipeline.to_groups(stack, 2, route='v')
        >>> loss = pipeline.zb_v(run_my_layers, w, x, spec='B M', loss_fn=head)
    """
    return run_schedule(
        ZB_V, stage_fn, stage_params, microbatches, spec=spec, loss_fn=loss_fn,
        loss_params=loss_params, targets=targets, axis=axis,
    )  # fmt: skip


# The functions that run each schedule: the table schedules' loss, the others' outputs.
_LOSS = {ONE_F_ONE_B: one_f_one_b, INTERLEAVED: interleaved, ZB_H1: zb_h1, ZB_V: zb_v}
_FORWARD = {GPIPE: gpipe, CIRCULAR: circular}


def pipeline_loss(
    stage_fn: Callable[[Any, jax.Array], jax.Array],
    stage_params: Any,
    microbatches: jax.Array,
    *,
    spec: str | bytes,
    loss_fn: LossFn,
    loss_params: Any = None,
    targets: Any = None,
    axis: str = "p",
    schedule: str = "1f1b",
) -> jax.Array:
    """The summed loss of ``m`` microbatches through the stages, under any ``schedule``.

    One call shape for every schedule, so that switching is one argument: ``'gpipe'`` and
    ``'circular'`` run their schedule (``broadcast=False``) and apply ``loss_fn`` to each
    output on the last stage; ``'1f1b'``, ``'interleaved'``, ``'zb-h1'`` and ``'zb-v'`` call
    `one_f_one_b`, `interleaved`, `zb_h1` and `zb_v`. `stage_params` has the layout the
    schedule wants: one group per stage (``'layers/p ...'``) for gpipe, 1f1b and zb-h1,
    ``v`` groups (``'v layers/p ...'``) for circular and interleaved, two in the V's order
    for zb-v (`to_groups` with ``route='v'``).

    **Arguments:** as `one_f_one_b`, and `schedule`, one of ``'gpipe'``, ``'circular'``,
    ``'1f1b'``, ``'interleaved'``, ``'zb-h1'``, ``'zb-v'``.

    **Returns:** the sum of ``loss_fn`` over the microbatches, the same on every stage.

    Examples:
        >>> loss = pipeline.pipeline_loss(run_my_layers, w, x, spec='B M', loss_fn=head,
        ...                               schedule='zb-h1')
    """
    s = find(schedule)
    if s is None:
        raise ValueError(
            f"pipeline_loss: argument `schedule` must be one of {', '.join(names())}, "
            f"got {schedule!r}"
        )
    if s.tabled:
        return _LOSS[s](
            stage_fn, stage_params, microbatches, spec=spec, loss_fn=loss_fn,
            loss_params=loss_params, targets=targets, axis=axis,
        )  # fmt: skip
    run = _FORWARD[s]
    ys = run(stage_fn, stage_params, microbatches, spec=spec, axis=axis, broadcast=False)
    one = jax.tree.map(lambda a: a[0], targets)
    mesh_axis = _rules.one_axis("pipeline_loss", "axis", axis)  # checked by the schedule
    check_loss_fn("pipeline_loss", loss_fn, (loss_params, ys[0], one), mesh_axis)
    losses = lax.map(lambda yt: loss_fn(loss_params, yt[0], yt[1]), (ys, targets))
    total = jnp.sum(losses)
    last = axis_index(axis) == manual_axis_sizes()[axis] - 1
    return psum("", jnp.where(last, total, jnp.zeros_like(total)), axes=axis)
