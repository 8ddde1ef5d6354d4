"""The memory-bounded schedules (1F1B, interleaved 1F1B, ZB-H1) as per-device code (JAX).

One ``lax.scan`` over the ticks of a `shardlib._pipeline.tables.Table`. At each tick a stage
reads its action from the table (a constant, indexed by stage and tick) and runs one branch
of a ``lax.switch``: a forward (``jax.vjp`` of ``stage_fn``, its residuals, the VJP object's
leaves without the stage weights, stored in a ring slot), a forward and the loss (the last
stage: the cotangent of the output starts the backward), a backward (the VJP object rebuilt
from its slot and applied to the cotangent; the weight gradient added to a running total),
its input half or weight half (ZB-H1), or nothing. Then one ``shardops.shift`` sends the
forward output on and one sends the input cotangent back. The whole pipeline is a
``jax.custom_vjp``: the training run computes the loss and every gradient, and the backward
rule returns them (times the loss's cotangent), so an outer ``jax.value_and_grad`` works; the
primal alone runs the forwards only.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.custom_derivatives import SymbolicZero

from .._env.context import estimates_wanted, manual_axis_sizes, varying_axes
from ..shardops import axis_index, psum, shift
from .branches import check_functions
from .cotangents import float_leaves, leaves_at, reduce_to, target_cotangents, unwrap, with_leaves
from .plan import schedule_scope
from .residuals import keeping, split_vjp, warn_weight_slices
from .schedules import _carry_axes, _check_arguments, _check_stage_output, _group, _groups, _vary
from .tables import BWD, BWD_INPUT, FWD, FWD_LOSS, Table, forward_table, schedule_table

__all__ = ["run_schedule"]


@dataclass(frozen=True)
class _Setup:
    """What every tick needs to know, fixed for one call."""

    fn: str  # the schedule's name, for messages
    stage_fn: Callable
    loss_fn: Callable
    spec: str
    axis: str
    v: int | None  # layer groups (None: the weights are one group, no leading dim)


def run_schedule(
    schedule: str,
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
    """The summed loss of ``m`` microbatches under ``schedule`` ('1f1b', 'interleaved',
    'zb-h1'), differentiable by ``jax.grad`` (see `shardlib.pipeline.one_f_one_b`)."""
    fn = schedule.replace("-", "_").replace("1f1b", "one_f_one_b")
    spec_text, microbatches, axis = _check_arguments(fn, microbatches, spec, axis)
    m, n = microbatches.shape[0], manual_axis_sizes()[axis]
    v = _groups(stage_params) if schedule == "interleaved" else None
    if v is not None and m < n:
        raise ValueError(
            f"interleaved: argument `microbatches` must hold at least as many microbatches as "
            f"stages (axis {axis!r} has {n}), got m={m}; use more microbatches or one_f_one_b"
        )
    zero = jnp.zeros_like(microbatches[0])
    have = varying_axes(zero)
    axes = None if have is None else have | {axis}
    h = _vary(zero, axes)
    one = jax.tree.map(lambda a: a[0], targets)
    group = stage_params if v is None else _group(stage_params, 0)
    stage = (stage_fn, _vary_tree(group, axes), h)
    inputs = (stage_params, loss_params, microbatches, targets)
    check_functions(fn, schedule, axis, stage, (loss_fn, loss_params, h, one), inputs)
    setup = _Setup(fn, stage_fn, loss_fn, spec_text, axis, v)
    train = schedule_table(schedule, n, m, v or 1)
    ahead = forward_table(n, m, v or 1)

    @jax.custom_vjp
    def pipelined(params: Any, lparams: Any, xs: jax.Array, tgt: Any) -> jax.Array:
        return _execute(setup, ahead, params, lparams, xs, tgt, train=False)[0]

    def fwd(params: Any, lparams: Any, xs: jax.Array, tgt: Any) -> tuple[jax.Array, Any]:
        (params, lparams, xs, tgt), perturbed = unwrap((params, lparams, xs, tgt))
        loss, grads = _execute(setup, train, params, lparams, xs, tgt, train=True,
                               target_grads=perturbed[3])  # fmt: skip
        return loss, grads

    def bwd(grads: Any, ct: Any) -> tuple[Any, ...]:
        if isinstance(ct, SymbolicZero):  # the loss is not used: every cotangent is zero
            return (None,) * len(grads)
        if varying_axes(ct) is None:  # check_vma off: the loss's psum over the stage axis
            ct = psum("", ct, axes=axis)  # transposes to a psum, as plain autodiff would do
        return jax.tree.map(lambda g: (g * ct).astype(g.dtype), grads)

    pipelined.defvjp(fwd, bwd, symbolic_zeros=True)
    res = _slot_bytes(setup, stage_params, microbatches) if estimates_wanted() else None
    with jax.named_scope(schedule_scope(schedule.replace("-", "_"), axis, n, m, v or 1, res)):
        return pipelined(stage_params, loss_params, microbatches, targets)


def _slot_bytes(setup: _Setup, params: Any, xs: jax.Array) -> int:
    """Bytes of one residual ring slot per device (one item's residuals, the stage input
    among them, stage weights not), as `_execute` lays the ring out: `explain` multiplies it
    by the items in flight."""
    zero = jnp.zeros_like(xs[0])
    group = _group_of(setup, params, 0)
    axes = _carry_axes(setup.fn, setup.stage_fn, group, zero, setup.axis, setup.spec)
    group = _group_of(setup, _vary_tree(params, axes), 0)
    layout = _Layout.of(setup, group, _vary(zero, axes), axes, train=True)
    return sum(math.prod(a.shape) * a.dtype.itemsize for a in layout.stored)


# ---------------------------------------------------------------------------------------------
# The loop
# ---------------------------------------------------------------------------------------------

_COLUMNS = ("kind", "microbatch", "group", "res", "inp", "ct", "recv_fwd", "recv_bwd")


def _table_array(table: Table) -> np.ndarray:
    """``[stage, tick, column]`` int32: the table as the devices index it (idle: kind 0)."""
    out = np.zeros((table.p, table.ticks, len(_COLUMNS)), np.int32)
    out[..., 4] = -1
    for s, row in enumerate(table.actions):
        for t, a in enumerate(row):
            if a is not None:
                out[s, t, :6] = (a.kind, a.microbatch, a.group, a.res, a.inp, a.ct)
        out[s, :, 6] = table.recv_fwd[s]
        out[s, :, 7] = table.recv_bwd[s]
    return out


def _execute(
    setup: _Setup,
    table: Table,
    params: Any,
    lparams: Any,
    xs: jax.Array,
    tgt: Any,
    *,
    train: bool,
    target_grads: bool = False,
) -> tuple[jax.Array, Any]:
    """Run ``table``; return the loss (summed over microbatches, the same on every stage)
    and, when ``train``, the cotangents of ``(params, lparams, xs, tgt)`` (those of
    ``tgt`` None unless ``target_grads``: zero)."""
    stage = axis_index(setup.axis)
    zero = jnp.zeros_like(xs[0])
    group0 = _group_of(setup, params, 0)
    axes = _carry_axes(setup.fn, setup.stage_fn, group0, zero, setup.axis, setup.spec)
    vparams, vlparams = _vary_tree(params, axes), _vary_tree(lparams, axes)
    layout = _Layout.of(setup, _group_of(setup, vparams, 0), _vary(zero, axes), axes, train)
    loss_axes = _loss_axes(setup, lparams, _vary(zero, axes), tgt)
    dtgt = float_leaves(tgt) if train and target_grads else []
    tick = _Tick(setup, layout, stage, vparams, (lparams, vlparams), xs, tgt, train, axes, dtgt)
    init = layout.init(table, vparams, vlparams, xs, zero, axes, loss_axes)
    if dtgt:  # the targets' cotangents, written on the last stage at each microbatch's loss
        init["dtgt"] = [_vary(jnp.zeros_like(tgt_leaf), _axes_of(tgt_leaf, axes))
                        for tgt_leaf in leaves_at(tgt, dtgt)]  # fmt: skip
    rows = jnp.asarray(_table_array(table))
    carry, _ = lax.scan(lambda c, t: (tick(c, rows[stage, t]), None), init, jnp.arange(table.ticks))
    loss = psum("", carry["loss"], axes=setup.axis)
    if not train:
        return loss, None
    dxs = jnp.where(stage == 0, carry["dxs"], jnp.zeros_like(carry["dxs"]))
    if varying_axes(xs) is not None:  # typed: the same on every stage (without check_vma,
        dxs = psum(f"{xs.shape[0]} {setup.spec}", dxs, axes=setup.axis)  # shard_map sums it)
    grads = (reduce_to(carry["grads"], params), reduce_to(carry["lgrads"], lparams))
    return loss, (*grads, reduce_to(dxs, xs), target_cotangents(tgt, dtgt, carry))


def _group_of(setup: _Setup, params: Any, r: Any) -> Any:
    return params if setup.v is None else _group(params, r)


def _typed_zeros(x: Any) -> jax.Array:
    """Zeros of ``x``'s shape and dtype that vary over the axes ``x`` varies over."""
    return _vary(jnp.zeros(x.shape, x.dtype), varying_axes(x))


def _vary_tree(tree: Any, axes: frozenset[str] | None) -> Any:
    return jax.tree.map(lambda x: _vary(x, axes), tree)


def _loss_axes(setup: _Setup, lparams: Any, zero: jax.Array, tgt: Any) -> frozenset[str] | None:
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


def _put(buf: jax.Array, slot: jax.Array, value: jax.Array) -> jax.Array:
    """``buf`` with ``value`` in ``slot`` (unchanged where ``slot < 0``)."""
    k = jnp.maximum(slot, 0)
    old = lax.dynamic_index_in_dim(buf, k, keepdims=False)
    return lax.dynamic_update_index_in_dim(buf, jnp.where(slot >= 0, value, old), k, 0)


def _take(buf: jax.Array, slot: jax.Array) -> jax.Array:
    return lax.dynamic_index_in_dim(buf, jnp.maximum(slot, 0), keepdims=False)


def _no_stage(*_: Any) -> Any:
    raise RuntimeError("a forward-only run has no stage to differentiate")


@dataclass
class _Layout:
    """The residuals of one forward, as the ring buffers hold them: the VJP object's leaves
    that are not stage weights (`stored`, their shapes and types), and for every leaf either
    its stored index or the weight leaf it is (``where``)."""

    stored: list[jax.ShapeDtypeStruct]
    where: list[tuple[str, int]]  # ("res", k) or ("param", k), per VJP leaf
    run: Callable = _no_stage  # the stage as differentiated (see `residuals.keeping`)
    treedef: Any = None  # from the loop's own trace of the forward branch

    @staticmethod
    def of(setup: _Setup, group: Any, h: jax.Array, axes: Any, train: bool) -> _Layout:
        if not train:
            return _Layout([], [])
        found: list[Any] = []
        run, as_given = keeping(setup.stage_fn, group, h)

        def probe(g: Any, h: jax.Array) -> list[jax.Array]:
            _, vjp = jax.vjp(run, g, h)
            leaves, where = split_vjp(vjp, g)
            found.append(where)
            return leaves

        # As jax.eval_shape(probe, ...), keeping the program for the weight-slice check.
        traced = jax.jit(probe).trace(group, h)
        if as_given:  # the stage's own checkpoints chose the residuals
            warn_weight_slices(setup.fn, traced.jaxpr.jaxpr, len(jax.tree.leaves(group)))
        return _Layout(list(traced.out_info), found[0], run)

    def init(self, table: Table, params: Any, lparams: Any, xs: jax.Array, zero: Any,
             axes: Any, loss_axes: Any) -> dict[str, Any]:  # fmt: skip
        """The loop's first carry: empty rings, zero totals."""
        k_in, k_res, k_ct = table.slots
        block = _vary(zero, axes)
        c: dict[str, Any] = {
            "inp": _vary(jnp.zeros((k_in, *zero.shape), zero.dtype), axes),
            "got_f": block,
            "loss": _vary(jnp.zeros((), jnp.float32), loss_axes),
        }
        if self.where:
            c["res"] = [_vary(jnp.zeros((k_res, *a.shape), a.dtype), _axes_of(a, axes))
                        for a in self.stored]  # fmt: skip
            c["ct"] = _vary(jnp.zeros((k_ct, *zero.shape), zero.dtype), axes)
            c["got_b"] = block
            c["grads"] = jax.tree.map(_typed_zeros, params)
            c["lgrads"] = jax.tree.map(_typed_zeros, lparams)
            c["dxs"] = _vary(jnp.zeros_like(xs), axes)
        return c


def _axes_of(aval: Any, axes: Any) -> Any:
    have = varying_axes(aval)
    return None if have is None or axes is None else have | axes


@dataclass
class _Tick:
    """One tick of the loop on this stage, as a function of the carry and its table row."""

    setup: _Setup
    layout: _Layout
    stage: jax.Array
    params: Any  # varied over the loop's axes: the gradients sum once, after the loop
    lparams: tuple[Any, Any]  # as given (the loss value), and varied (its gradient)
    xs: jax.Array
    tgt: Any
    train: bool
    axes: Any = None
    target_grads: list[int] = dataclasses.field(default_factory=list)  # float target leaves

    def __call__(self, c: dict[str, Any], row: jax.Array) -> dict[str, Any]:
        kind, i, r, rs, inp, cs, rf, rb = (row[k] for k in range(len(_COLUMNS)))
        c = dict(c)
        c["inp"] = _put(c["inp"], rf, c["got_f"])
        if self.train:
            c["ct"] = _put(c["ct"], rb, c["got_b"])
        fresh = lax.dynamic_index_in_dim(self.xs, i, keepdims=False)
        h = _vary(jnp.where(inp < 0, fresh, _take(c["inp"], inp)), self.axes)
        target = jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, i, keepdims=False), self.tgt)
        ct = _take(c["ct"], cs) if self.train else None
        res = [_take(b, rs) for b in c["res"]] if self.train else []
        zeros = self._zeros(h, c)
        branches = [
            lambda: zeros,
            lambda: self._forward(zeros, r, h, target, loss=False),
            lambda: self._forward(zeros, r, h, target, loss=True),
        ]
        if self.train:
            branches += [
                lambda: self._backward(zeros, r, res, ct, inputs=True, weights=True),
                lambda: self._backward(zeros, r, res, ct, inputs=True, weights=False),
                lambda: self._backward(zeros, r, res, ct, inputs=False, weights=True),
            ]
        out = lax.switch(kind, branches)
        return self._update(c, out, kind, i, r, rs, cs)

    def _zeros(self, h: jax.Array, c: dict[str, Any]) -> dict[str, Any]:
        z: dict[str, Any] = {"y": _typed_zeros(h), "loss": _typed_zeros(c["loss"])}
        if self.train:
            z["res"] = [_typed_zeros(b[0]) for b in c["res"]]
            z["dy"] = _typed_zeros(h)
            z["dh"] = _typed_zeros(h)
            z["dgroup"] = jax.tree.map(_typed_zeros, _group_of(self.setup, c["grads"], 0))
            z["dl"] = jax.tree.map(_typed_zeros, c["lgrads"])
            if "dtgt" in c:
                z["dt"] = [_typed_zeros(b[0]) for b in c["dtgt"]]
        return z

    def _forward(self, zeros: dict, r: Any, h: jax.Array, target: Any, *, loss: bool) -> dict:
        s = self.setup
        group = _group_of(s, self.params, r)
        out = dict(zeros)
        if self.train:
            y, vjp = jax.vjp(self.layout.run, group, h)
            stored, where = split_vjp(vjp, group)
            if where != self.layout.where or len(stored) != len(zeros["res"]):
                raise RuntimeError(f"{s.fn}: stage_fn's residuals differ between two traces")
            self.layout.treedef = jax.tree.structure(vjp)
            out["res"] = [_like(a, z) for a, z in zip(stored, zeros["res"], strict=True)]
        else:
            y = s.stage_fn(group, h)
        _check_stage_output(s.fn, y, h, s.spec)
        out["y"] = _like(y, zeros["y"])
        if loss:
            out["y"] = zeros["y"]  # the last stage sends nothing on
            # The value from the head's weights as given (the same over the axes they do not
            # vary over), the gradient from the varied ones (summed over those axes once).
            value = s.loss_fn(self.lparams[0], y, target)
            out["loss"] = _like(value, zeros["loss"])
            if self.train:
                at = self.target_grads

                def head(lp: Any, y: jax.Array, t: list[Any]) -> jax.Array:
                    return s.loss_fn(lp, y, with_leaves(target, at, t))

                varied, lvjp = jax.vjp(head, self.lparams[1], y, leaves_at(target, at))
                dl, dy, dt = lvjp(_typed_zeros(varied) + 1 / _copies(varied, value))
                out["dy"] = _like(dy, zeros["dy"])
                out["dl"] = jax.tree.map(_like, dl, zeros["dl"])
                if at:
                    out["dt"] = [_like(d, z) for d, z in zip(dt, zeros["dt"], strict=True)]
        return out

    def _backward(
        self, zeros: dict, r: Any, res: list, ct: Any, *, inputs: bool, weights: bool
    ) -> dict:
        group = _group_of(self.setup, self.params, r)
        weight_leaves = jax.tree.leaves(group)
        leaves = [res[k] if what == "res" else weight_leaves[k] for what, k in self.layout.where]
        vjp = jax.tree.unflatten(self.layout.treedef, leaves)
        dgroup, dh = vjp(ct)
        out = dict(zeros)
        if inputs:
            out["dh"] = _like(dh, zeros["dh"])
        if weights:
            out["dgroup"] = jax.tree.map(_like, dgroup, zeros["dgroup"])
        return out

    def _update(
        self, c: dict[str, Any], out: dict, kind: Any, i: Any, r: Any, rs: Any, cs: Any
    ) -> dict[str, Any]:
        """The carry after the tick's work: slots written, totals added, blocks sent."""
        s = self.setup
        is_f = (kind == FWD) | (kind == FWD_LOSS)
        c["loss"] = c["loss"] + out["loss"]
        wrap = s.v is not None
        c["got_f"] = _vary(shift(s.spec, out["y"], s.axis, offset=1, wrap=wrap), self.axes)
        if not self.train:
            return c
        c["res"] = [
            _put(b, jnp.where(is_f, rs, -1), x) for b, x in zip(c["res"], out["res"], strict=True)
        ]
        c["ct"] = _put(c["ct"], jnp.where(kind == FWD_LOSS, cs, -1), out["dy"])
        c["lgrads"] = jax.tree.map(jnp.add, c["lgrads"], out["dl"])
        if s.v is None:
            c["grads"] = jax.tree.map(jnp.add, c["grads"], out["dgroup"])
        else:
            c["grads"] = jax.tree.map(lambda g, d: g.at[r].add(d), c["grads"], out["dgroup"])
        if "dtgt" in c:
            at = jnp.where(kind == FWD_LOSS, i, -1)
            c["dtgt"] = [_put(b, at, x) for b, x in zip(c["dtgt"], out["dt"], strict=True)]
        first = (self.stage == 0) & (r == 0) & ((kind == BWD) | (kind == BWD_INPUT))
        c["dxs"] = _put(c["dxs"], jnp.where(first, i, -1), out["dh"])
        c["got_b"] = _vary(shift(s.spec, out["dh"], s.axis, offset=-1, wrap=wrap), self.axes)
        return c


def _copies(varied: jax.Array, value: jax.Array) -> int:
    """How many devices hold the same loss ``value`` that ``varied`` (the loss from the varied
    head weights) counts once each: the sizes of the axes only ``varied`` varies over. The
    backward is seeded with one over that, so the summed gradient counts the loss once."""
    extra = (varying_axes(varied) or frozenset()) - (varying_axes(value) or frozenset())
    sizes = manual_axis_sizes()
    return int(np.prod([sizes[a] for a in extra])) if extra else 1


def _like(x: Any, like: jax.Array) -> jax.Array:
    """``x`` made to vary over the axes ``like`` varies over (the branches' common type)."""
    return _vary(jnp.asarray(x, like.dtype), varying_axes(like))
