"""The loop that runs a table schedule (1F1B, interleaved 1F1B, ZB-H1, ZB-V) on the devices (JAX).

One ``lax.scan`` over the ticks of a `shardlib._pipeline.tables.Table`: at each tick a stage
reads its row of the table (a constant, indexed by stage and tick) and runs it
(`shardlib._pipeline.tick.Tick`: a forward, a backward and a weight half, each only if the
row has one), then sends the forward output on and the input cotangent back. The whole
pipeline is a ``jax.custom_vjp``: the training run computes the loss and every gradient, and
the backward rule returns them (times the loss's cotangent), so an outer
``jax.value_and_grad`` works; the primal alone runs the forwards only.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.custom_derivatives import SymbolicZero

from .._env.context import estimates_wanted, manual_axis_sizes, varying_axes
from ..shardops import axis_index, psum
from .arguments import chunk_count_error, microbatch_count_error
from .branches import Communicated, check_backwards, check_functions, check_loss_axes
from .cotangents import float_leaves, leaves_at, reduce_to, scaled, target_cotangents, unwrap
from .registry import Schedule
from .scopes import schedule_scope
from .stage import carry_axes, check_arguments, group_count, group_of, vary
from .tables import Table, forward_table, schedule_table
from .tick import COLUMNS, HEAD, PART, Layout, Setup, Tick, axes_of
from .unsplit import warn_unsplit

__all__ = ["run_schedule"]


def run_schedule(
    schedule: Schedule,
    stage_fn: Callable,
    stage_params: Any,
    microbatches: Any,
    *,
    spec: str | bytes,
    loss_fn: Callable,
    loss_params: Any,
    targets: Any,
    axis: str,
) -> jax.Array:
    """The summed loss of ``m`` microbatches under ``schedule`` (a tabled one: 1F1B,
    interleaved, ZB-H1, ZB-V), differentiable by ``jax.grad`` (see
    `shardlib.pipeline.one_f_one_b`)."""
    fn = schedule.function
    spec_text, microbatches, axis = check_arguments(fn, microbatches, spec, axis)
    m, n = microbatches.shape[0], manual_axis_sizes()[axis]
    v = _group_count(schedule, stage_params, m, n, axis)
    zero = jnp.zeros_like(microbatches[0])
    have = varying_axes(zero)
    axes = None if have is None else have | {axis}
    h = vary(zero, axes)
    one = jax.tree.map(lambda a: a[0], targets)
    group = stage_params if v is None else group_of(stage_params, 0)
    stage = (stage_fn, vary(group, axes), h)
    inputs = (stage_params, loss_params, microbatches, targets)
    loss = (loss_fn, loss_params, h, one)
    communicated = check_functions(fn, schedule.name, axis, stage, loss, inputs)
    setup = Setup(schedule, stage_fn, loss_fn, spec_text, axis, v)
    train = schedule_table(schedule.name, n, m, v or 1)
    ahead = forward_table(n, m, v or 1, schedule.route)

    @jax.custom_vjp
    def pipelined(params: Any, lparams: Any, xs: jax.Array, tgt: Any) -> jax.Array:
        return _execute(setup, ahead, params, lparams, xs, tgt, train=False)[0]

    def fwd(params: Any, lparams: Any, xs: jax.Array, tgt: Any) -> tuple[jax.Array, Any]:
        (params, lparams, xs, tgt), perturbed = unwrap((params, lparams, xs, tgt))
        loss_, grads = _execute(setup, train, params, lparams, xs, tgt, train=True,
                                target_grads=perturbed[3], communicated=communicated)  # fmt: skip
        return loss_, grads

    def bwd(grads: Any, ct: Any) -> tuple[Any, ...]:
        if isinstance(ct, SymbolicZero):  # the loss is not used: every cotangent is zero
            return (None,) * len(grads)
        if varying_axes(ct) is None:  # check_vma off: the loss's psum over the stage axis
            ct = psum("", ct, axes=axis)  # transposes to a psum, as plain autodiff would do
        return scaled(grads, ct, inputs)

    pipelined.defvjp(fwd, bwd, symbolic_zeros=True)
    res, backward = (
        _slot_bytes(setup, stage_params, microbatches) if estimates_wanted() else (None, None)
    )
    with jax.named_scope(schedule_scope(schedule.scope, axis, n, m, v or 1, res, backward)):
        return pipelined(stage_params, loss_params, microbatches, targets)


def _group_count(schedule: Schedule, params: Any, m: int, n: int, axis: str) -> int | None:
    """``v``, the layer groups per stage of ``params`` (None: one, no leading dim), checked
    against what ``schedule`` takes."""
    v = group_count(params) if schedule.grouped else None
    bad = microbatch_count_error(schedule, axis, n, m) or chunk_count_error(schedule, v)
    if bad:
        raise ValueError(bad)
    return v


def _slot_bytes(setup: Setup, params: Any, xs: jax.Array) -> tuple[int, str | None]:
    """Bytes of one residual ring slot per device (one item's residuals, the stage input
    among them, stage weights not), as `_execute` lays the ring out: `explain` multiplies it
    by the items in flight; and, for ZB-H1 and ZB-V, whether the stage's backward splits
    (``"split"``) or runs whole in B (``"whole"``)."""
    zero = jnp.zeros_like(xs[0])
    group = setup.group(params, 0)
    axes = carry_axes(setup.fn, setup.stage_fn, group, zero, setup.axis, setup.spec)
    group = setup.group(vary(params, axes), 0)
    layout = Layout.of(setup, group, vary(zero, axes), train=True, axes=axes)
    backward = None if not setup.split else "whole" if layout.unsplit else "split"
    return sum(math.prod(a.shape) * a.dtype.itemsize for a in layout.stored), backward


# ---------------------------------------------------------------------------------------------
# The loop
# ---------------------------------------------------------------------------------------------


def _table_array(table: Table) -> np.ndarray:
    """``[stage, tick, column]`` int32: the table as the devices index it (`tick.COLUMNS`:
    the receive slots, then each part's action; an idle part is kind 0, input slot -1)."""
    n, h = len(PART), len(HEAD)
    out = np.zeros((table.p, table.ticks, len(COLUMNS)), np.int32)
    out[..., [h + n * k + 4 for k in range(3)]] = -1
    for s, row in enumerate(table.actions):
        head = (table.recv_fwd, table.recv_bwd, table.fwd_from, table.bwd_from, table.reverse)
        for k, column in enumerate(head):
            out[s, :, k] = column[s]
        for t, cell in enumerate(row):
            for a in cell:
                at = h + n * a.part
                out[s, t, at : at + n] = (a.kind, a.microbatch, a.group, a.res, a.inp, a.ct)
    return out


def _execute(
    setup: Setup,
    table: Table,
    params: Any,
    lparams: Any,
    xs: jax.Array,
    tgt: Any,
    *,
    train: bool,
    target_grads: bool = False,
    communicated: Communicated | None = None,
) -> tuple[jax.Array, Any]:
    """Run ``table``; return the loss (summed over microbatches, the same on every stage)
    and, when ``train``, the gradients of ``(params, lparams, xs, tgt)`` (those of ``tgt``
    None unless ``target_grads``: zero), summed over the axes their primals do not vary over
    but those the loss varies over (`cotangents.scaled` sums over those). ``communicated``:
    the axes the stage and loss communicate over (`branches.check_loss_axes`)."""
    stage = axis_index(setup.axis)
    zero = jnp.zeros_like(xs[0])
    group0 = setup.group(params, 0)
    axes = carry_axes(setup.fn, setup.stage_fn, group0, zero, setup.axis, setup.spec)
    vparams, vlparams = vary(params, axes), vary(lparams, axes)
    loss_axes = _loss_axes(setup, lparams, vary(zero, axes), tgt)
    keep = frozenset()
    if train:
        keep = _check_backwards(setup, (vparams, vlparams, vary(zero, axes), tgt),
                                loss_axes, communicated or {})  # fmt: skip
    layout = Layout.of(setup, setup.group(vparams, 0), vary(zero, axes), train, axes)
    if layout.unsplit:  # ZB-H1, ZB-V: the stage's backward runs whole in B
        warn_unsplit(setup.schedule, layout.unsplit, table.p, xs.shape[0], setup.v or 1)
    dtgt = float_leaves(tgt) if train and target_grads else []
    tick = Tick(setup, layout, stage, vparams, (lparams, vlparams), xs, tgt, train, axes, dtgt)
    init = layout.init(table, vparams, vlparams, xs, zero, axes, loss_axes)
    if dtgt:  # the targets' cotangents, written on the last stage at each microbatch's loss
        init["dtgt"] = [vary(jnp.zeros_like(tgt_leaf), axes_of(tgt_leaf, axes))
                        for tgt_leaf in leaves_at(tgt, dtgt)]  # fmt: skip
    rows = jnp.asarray(_table_array(table))
    carry, _ = lax.scan(lambda c, t: (tick(c, rows[stage, t]), None), init, jnp.arange(table.ticks))
    loss = psum("", carry["loss"], axes=setup.axis)
    if not train:
        return loss, None
    dxs = jnp.where(stage == 0, carry["dxs"], jnp.zeros_like(carry["dxs"]))
    if varying_axes(xs) is not None:  # typed: the same on every stage (without check_vma,
        dxs = psum(f"{xs.shape[0]} {setup.spec}", dxs, axes=setup.axis)  # shard_map sums it)
    grads = (reduce_to(carry["grads"], params, keep), reduce_to(carry["lgrads"], lparams, keep))
    dtgt_ = target_cotangents(tgt, dtgt, carry, keep)
    return loss, (*grads, reduce_to(dxs, xs, keep), dtgt_)


def _check_backwards(
    setup: Setup, args: tuple[Any, Any, jax.Array, Any], loss_axes: Any, forward: Communicated
) -> frozenset[str]:
    """Check the backward programs of the stage and the loss as the loop runs them (``args``:
    the weights and head weights varied over the loop's axes, a block, the targets), then the
    axes the loss varies over besides the stage axis (``loss_axes``) against what the
    programs communicate over (``forward``: the forward programs'); return those axes."""
    vparams, vlparams, h, tgt = args
    one = jax.tree.map(lambda a: a[0], tgt)
    stage = (setup.stage_fn, setup.group(vparams, 0), h)
    found = check_backwards(setup.fn, setup.axis, stage, (setup.loss_fn, vlparams, h, one))
    keep = frozenset() if loss_axes is None else loss_axes - {setup.axis}
    check_loss_axes(setup.fn, keep, found | forward)
    return keep


def _loss_axes(setup: Setup, lparams: Any, zero: jax.Array, tgt: Any) -> frozenset[str] | None:
    """The axes the running loss varies over: the stage axis and what ``loss_fn`` leaves."""
    one = jax.tree.map(lambda a: a[0], tgt)
    out = jax.eval_shape(setup.loss_fn, lparams, zero, one)
    if not (hasattr(out, "shape") and out.shape == ()):
        raise ValueError(
            f"{setup.fn}: `loss_fn(loss_params, y, target)` must return a scalar (the loss of "
            f"one microbatch), got {out}"
        )
    have = varying_axes(out)
    return None if have is None else have | {setup.axis}
