"""One fused tick of a memory-bounded schedule on one stage, and the rings it works on (JAX).

A tick reads its row of the table (`shardlib._pipeline.tables`), stores what the neighbours
sent at the tick before in the ring slots the row names, then runs up to three parts, each a
``lax.switch`` that only this stage's devices take:

1. the forward: idle, a forward (``jax.vjp`` of the stage, its residuals, the VJP object's
   leaves without the stage weights, stored in a ring slot), or a forward and the loss (the
   last stage: the cotangent of the output goes to the cotangent ring);
2. the backward: idle, the whole backward (the VJP object rebuilt from its slot, applied to
   the cotangent, the weight gradient added to a running total), or its input half
   (ZB-H1, ZB-V, `shardlib._pipeline.split`: the input cotangent, and what the weight half
   needs kept in the cotangent's slot of a fourth ring);
3. the weight half (ZB-H1, ZB-V): the weight gradient from what the input half kept.

At the end of the tick the forward output goes one stage on and the input cotangent one
stage back (ZB-V's chunk 1: the other way round, as the row's direction flag says), two
shifts every stage joins. The stage that computes the loss runs the forward, the loss and
the backward of one microbatch in one tick. Imports the stage
helpers of this package, `shardlib._env.context` and JAX.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .._env.context import manual_axis_sizes, varying_axes
from ..shardops import shift
from .cotangents import leaves_at, with_leaves
from .registry import Schedule
from .residuals import keeping, split_vjp, warn_weight_slices
from .split import split_backward
from .stage import check_stage_output, group_of, vary
from .tables import BWD_INPUT, FWD, FWD_LOSS, WGRAD, Table

__all__ = ["COLUMNS", "HEAD", "PART", "Layout", "Setup", "Tick", "axes_of", "put", "typed_zeros"]

# A row of the devices' table: the receive slots, then (kind, microbatch, group, residual
# slot, input slot, cotangent slot) of the forward part, the backward part, the weight part.
PART = ("kind", "microbatch", "group", "res", "inp", "ct")
HEAD = ("recv_fwd", "recv_bwd", "fwd_from", "bwd_from", "reverse")
COLUMNS = (*HEAD, *(f"{p}.{c}" for p in "fbw" for c in PART))


@dataclass(frozen=True)
class Setup:
    """What every tick needs to know, fixed for one call."""

    schedule: Schedule  # the table schedule run (`shardlib._pipeline.registry`)
    stage_fn: Callable
    loss_fn: Callable
    spec: str
    axis: str
    v: int | None  # layer groups (None: the weights are one group, no leading dim)

    @property
    def fn(self) -> str:
        """The schedule's function, as messages name it (``zb_h1``)."""
        return self.schedule.function

    @property
    def split(self) -> bool:
        """ZB-H1, ZB-V: the backward in an input half and a weight half."""
        return self.schedule.split

    @property
    def route(self) -> str:
        """``"v"``: ZB-V's two chunks per stage (`shardlib._pipeline.placement`)."""
        return self.schedule.route

    def group(self, params: Any, r: Any) -> Any:
        return params if self.v is None else group_of(params, r)


def typed_zeros(x: Any) -> jax.Array:
    """Zeros of ``x``'s shape and dtype that vary over the axes ``x`` varies over."""
    return vary(jnp.zeros(x.shape, x.dtype), varying_axes(x))


def put(buf: jax.Array, slot: jax.Array, value: jax.Array) -> jax.Array:
    """``buf`` with ``value`` in ``slot`` (unchanged where ``slot < 0``)."""
    k = jnp.maximum(slot, 0)
    old = lax.dynamic_index_in_dim(buf, k, keepdims=False)
    return lax.dynamic_update_index_in_dim(buf, jnp.where(slot >= 0, value, old), k, 0)


def _take(buf: jax.Array, slot: jax.Array) -> jax.Array:
    return lax.dynamic_index_in_dim(buf, jnp.maximum(slot, 0), keepdims=False)


def _no_stage(*_: Any) -> Any:
    raise RuntimeError("a forward-only run has no stage to differentiate")


def _backward_of(treedef: Any) -> Callable:
    """``backward(leaves, ct) -> (dgroup, dh)``: the VJP object of ``treedef`` applied."""
    return lambda leaves, ct: jax.tree.unflatten(treedef, leaves)(ct)


@dataclass
class Layout:
    """The residuals of one forward, as the ring buffers hold them: the VJP object's leaves
    that are not stage weights (`stored`, their shapes and types), and for every leaf either
    its stored index or the weight leaf it is (``where``); with a split backward, what its
    input half keeps for its weight half (`kept`; empty: no split, B runs the whole)."""

    stored: list[jax.ShapeDtypeStruct]
    where: list[tuple[str, int]]  # ("res", k) or ("param", k), per VJP leaf
    run: Callable = _no_stage  # the stage as differentiated (see `residuals.keeping`)
    treedef: Any = None  # from the loop's own trace of the forward branch
    kept: list[jax.ShapeDtypeStruct] = dataclasses.field(default_factory=list)
    split: bool = False  # whether the backward splits (else the input half runs it whole)
    unsplit: str | None = None  # a split schedule's stage run whole in B: why

    @staticmethod
    def of(setup: Setup, group: Any, h: jax.Array, train: bool, axes: Any = None) -> Layout:
        if not train:
            return Layout([], [])
        found: list[Any] = []
        run, as_given = keeping(setup.stage_fn, group, h)

        def probe(g: Any, h: jax.Array) -> tuple[list[jax.Array], list[jax.Array]]:
            y, vjp = jax.vjp(run, g, h)
            leaves, where = split_vjp(vjp, g)
            found.append(where)
            kept: list[jax.Array] = []
            if setup.split:
                flat, treedef = jax.tree.flatten(vjp)
                # As the backward sees them in the loop: residuals from their ring slots,
                # which vary over the loop's axes (`_ring`); the split's types follow.
                flat = [x if w == "param" else vary(x, axes_of(x, axes))
                        for x, (w, _) in zip(flat, where, strict=True)]  # fmt: skip
                ct = vary(typed_zeros(y), axes)  # as the cotangent ring holds it
                halves, kept, why = _try_split(_backward_of(treedef), flat, ct)
                found.append(why)
            return leaves, kept

        # As jax.eval_shape(probe, ...), keeping the program for the weight-slice check.
        traced = jax.jit(probe).trace(group, h)
        if as_given:  # the stage's own checkpoints chose the residuals
            warn_weight_slices(setup.fn, traced.jaxpr.jaxpr, len(jax.tree.leaves(group)))
        stored, kept = traced.out_info
        why = found[1] if setup.split else None
        split = setup.split and why is None
        return Layout(list(stored), found[0], run, kept=list(kept), split=split, unsplit=why)

    def init(self, table: Table, params: Any, lparams: Any, xs: jax.Array, zero: Any,
             axes: Any, loss_axes: Any) -> dict[str, Any]:  # fmt: skip
        """The loop's first carry: empty rings, zero totals."""
        k_in, k_res, k_ct = table.slots
        block = vary(zero, axes)
        c: dict[str, Any] = {
            "inp": vary(jnp.zeros((k_in, *zero.shape), zero.dtype), axes),
            "from_prev": block,
            "loss": vary(jnp.zeros((), jnp.float32), loss_axes),
        }
        if table.route == "v":
            c.update(from_next=block, own_y=block, own_dh=block)
        if self.where:
            c["res"] = [_ring(k_res, a, axes) for a in self.stored]
            # What the input half keeps, typed exactly as the weight half's program reads it.
            c["kept"] = [_ring(k_ct, a, None) for a in self.kept]
            c["ct"] = vary(jnp.zeros((k_ct, *zero.shape), zero.dtype), axes)
            c["from_next"] = block
            c["grads"] = jax.tree.map(typed_zeros, params)
            c["lgrads"] = jax.tree.map(typed_zeros, lparams)
            c["dxs"] = vary(jnp.zeros_like(xs), axes)
        return c


def _ring(k: int, aval: Any, axes: Any) -> jax.Array:
    """``k`` slots of ``aval``, varying over its own axes and ``axes`` (None: its own)."""
    own = varying_axes(aval)
    wanted = own if axes is None else axes_of(aval, axes)
    return vary(jnp.zeros((k, *aval.shape), aval.dtype), wanted)


def axes_of(aval: Any, axes: Any) -> Any:
    have = varying_axes(aval)
    return None if have is None or axes is None else have | axes


@dataclass
class Tick:
    """One tick of the loop on this stage, as a function of the carry and its table row."""

    setup: Setup
    layout: Layout
    stage: jax.Array
    params: Any  # varied over the loop's axes: the gradients sum once, after the loop
    lparams: tuple[Any, Any]  # as given (the loss value), and varied (its gradient)
    xs: jax.Array
    tgt: Any
    train: bool
    axes: Any = None
    target_grads: list[int] = dataclasses.field(default_factory=list)  # float target leaves

    def __call__(self, c: dict[str, Any], row: jax.Array) -> dict[str, Any]:
        n, h = len(PART), len(HEAD)
        parts = [[row[h + n * k + j] for j in range(n)] for k in range(3)]
        c = dict(c)
        got_f, got_b = c["from_prev"], c.get("from_next", c["from_prev"])
        if self.setup.route == "v":  # each may come either way, or from the stage itself
            got_f = lax.select_n(row[2], c["from_prev"], c["from_next"], c["own_y"])
            got_b = lax.select_n(row[3], c["from_prev"], c["from_next"], c["own_dh"])
        c["inp"] = put(c["inp"], row[0], got_f)
        if self.train:
            c["ct"] = put(c["ct"], row[1], got_b)
        y = self._forward_part(c, *parts[0])
        dh = None
        if self.train:
            dh = self._backward_part(c, *parts[1])
            if self.layout.split:
                self._weight_part(c, *parts[2])
        self._send(c, y, dh, row[4])
        return c

    def _send(self, c: dict[str, Any], y: jax.Array, dh: Any, reverse: Any) -> None:
        """The tick's end: the forward output to the next stage and the input cotangent to
        the one before (interleaved: round the ring), or (the V's chunk 1, ``reverse``) the
        other way round; the V keeps its own too (its last stage goes on with them)."""
        s = self.setup
        up, down = y, dh
        if s.route == "v":
            dh = typed_zeros(y) if dh is None else dh
            up, down = jnp.where(reverse, dh, y), jnp.where(reverse, y, dh)
            c["own_y"], c["own_dh"] = y, dh
        wrap = s.route == "ring" and s.v is not None
        c["from_prev"] = vary(shift(s.spec, up, s.axis, offset=1, wrap=wrap), self.axes)
        if down is not None:
            c["from_next"] = vary(shift(s.spec, down, s.axis, offset=-1, wrap=wrap), self.axes)

    # -- the forward part ---------------------------------------------------------------------

    def _forward_part(self, c: dict, kind: Any, i: Any, r: Any, rs: Any, inp: Any, cs: Any) -> Any:
        """Run the row's forward (if any) and store what it leaves; return what goes on."""
        fresh = lax.dynamic_index_in_dim(self.xs, i, keepdims=False)
        h = vary(jnp.where(inp < 0, fresh, _take(c["inp"], inp)), self.axes)
        target = jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, i, keepdims=False), self.tgt)
        z: dict[str, Any] = {"y": typed_zeros(h), "loss": typed_zeros(c["loss"])}
        if self.train:
            z["res"] = [typed_zeros(b[0]) for b in c["res"]]
            z["dy"] = typed_zeros(h)
            z["dl"] = jax.tree.map(typed_zeros, c["lgrads"])
            if "dtgt" in c:
                z["dt"] = [typed_zeros(b[0]) for b in c["dtgt"]]
        out = lax.switch(kind, [  # the table's IDLE, FWD, FWD_LOSS
            lambda: z,
            lambda: self._forward(z, r, h, target, loss=False),
            lambda: self._forward(z, r, h, target, loss=True),
        ])  # fmt: skip
        c["loss"] = c["loss"] + out["loss"]
        if self.train:
            at = jnp.where(kind == FWD, rs, jnp.where(kind == FWD_LOSS, rs, -1))
            c["res"] = [put(b, at, x) for b, x in zip(c["res"], out["res"], strict=True)]
            c["ct"] = put(c["ct"], jnp.where(kind == FWD_LOSS, cs, -1), out["dy"])
            c["lgrads"] = jax.tree.map(jnp.add, c["lgrads"], out["dl"])
            if "dtgt" in c:
                at = jnp.where(kind == FWD_LOSS, i, -1)
                c["dtgt"] = [put(b, at, x) for b, x in zip(c["dtgt"], out["dt"], strict=True)]
        return out["y"]

    def _forward(self, zeros: dict, r: Any, h: jax.Array, target: Any, *, loss: bool) -> dict:
        s = self.setup
        group = s.group(self.params, r)
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
        check_stage_output(s.fn, y, h, s.spec)
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
                dl, dy, dt = lvjp(typed_zeros(varied) + 1 / _copies(varied, value))
                out["dy"] = _like(dy, zeros["dy"])
                out["dl"] = jax.tree.map(_like, dl, zeros["dl"])
                if at:
                    out["dt"] = [_like(d, z) for d, z in zip(dt, zeros["dt"], strict=True)]
        return out

    # -- the backward and weight parts ------------------------------------------------------

    def _backward_part(self, c: dict, kind: Any, i: Any, r: Any, rs: Any, _: Any, cs: Any) -> Any:
        """Run the row's backward (if any): the input cotangent, returned to go back, and the
        weight gradient added (whole backward) or what the weight half needs kept."""
        res, ct = [_take(b, rs) for b in c["res"]], _take(c["ct"], cs)
        z = {"dh": typed_zeros(ct), "kept": [typed_zeros(b[0]) for b in c["kept"]]}
        if not self.layout.split:  # split: the weight part alone adds to the totals
            z["dgroup"] = jax.tree.map(typed_zeros, self.setup.group(c["grads"], 0))
        # A table's backwards are all whole (BWD) or all input halves (BWD_INPUT); a
        # stage whose backward does not split runs input halves whole.
        out = lax.switch((kind > 0).astype(jnp.int32), [
            lambda: z,
            lambda: self._backward(z, r, res, ct, half=self.layout.split),
        ])  # fmt: skip
        if "dgroup" in out:
            self._add_grads(c, r, out["dgroup"])
        at = jnp.where(kind == BWD_INPUT, cs, -1)
        c["kept"] = [put(b, at, x) for b, x in zip(c["kept"], out["kept"], strict=True)]
        first = (self.stage == 0) & (r == 0) & (kind > 0)
        c["dxs"] = put(c["dxs"], jnp.where(first, i, -1), out["dh"])
        return out["dh"]

    def _leaves(self, r: Any, res: list) -> list[jax.Array]:
        weights = jax.tree.leaves(self.setup.group(self.params, r))
        return [res[k] if what == "res" else weights[k] for what, k in self.layout.where]

    def _backward(self, zeros: dict, r: Any, res: list, ct: Any, *, half: bool) -> dict:
        leaves, out = self._leaves(r, res), dict(zeros)
        if half:
            # Named as JAX names a VJP's equations, so explain tells the cotangent sent.
            with jax.named_scope("transpose(input half)"):
                dh, kept = _halves(self.layout, leaves, ct).inputs(leaves, ct)
            out["kept"] = [_like(k, z) for k, z in zip(kept, zeros["kept"], strict=True)]
        else:
            dgroup, dh = jax.tree.unflatten(self.layout.treedef, leaves)(ct)
            out["dgroup"] = jax.tree.map(_like, dgroup, zeros["dgroup"])
        out["dh"] = _like(dh, zeros["dh"])
        return out

    def _weight_part(self, c: dict, kind: Any, i: Any, r: Any, rs: Any, _: Any, cs: Any) -> None:
        """Run the row's weight half (if any) and add the weight gradient."""
        res, ct = [_take(b, rs) for b in c["res"]], _take(c["ct"], cs)
        kept = [_take(b, cs) for b in c["kept"]]
        zeros = jax.tree.map(typed_zeros, self.setup.group(c["grads"], 0))

        def weights() -> Any:
            leaves = self._leaves(r, res)
            with jax.named_scope("transpose(weight half)"):
                dgroup = _halves(self.layout, leaves, ct).weights(leaves, ct, kept)
            return jax.tree.map(_like, dgroup, zeros)

        self._add_grads(c, r, lax.cond(kind == WGRAD, weights, lambda: zeros))

    def _add_grads(self, c: dict, r: Any, dgroup: Any) -> None:
        if self.setup.v is None:
            c["grads"] = jax.tree.map(jnp.add, c["grads"], dgroup)
        else:
            c["grads"] = jax.tree.map(lambda g, d: g.at[r].add(d), c["grads"], dgroup)


def _try_split(backward: Callable, leaves: list, ct: Any) -> tuple[Any, list[jax.Array], Any]:
    """The split of ``backward``, what its input half keeps, and None (no split: None, [] and
    why). A backward whose halves JAX's varying-axis types refuse to run apart (the
    interpreter replays equations one by one, without the casts JAX's own tracing would
    insert) runs whole in the input half instead: the schedule stays right, its W costs
    nothing and its B a whole backward. The input half is traced here, so a type error shows
    now, not in the loop."""
    why: list[str] = []
    try:
        halves = split_backward(backward, leaves, ct, why)
        if halves is None:
            return None, [], why[0] if why else "its backward has no weight half of its own"
        return halves, list(halves.inputs(leaves, ct)[1]), None
    except ValueError as e:
        if "varying manual axes" not in str(e):
            raise
        typed = (
            "JAX's varying-axis types (check_vma=True) refuse its halves run apart: the "
            "split replays its equations without the casts JAX's own tracing inserts"
        )
        return None, [], typed


def _halves(layout: Layout, leaves: list, ct: Any) -> Any:
    """The split of the stage's backward (`shardlib._pipeline.split`), traced again here."""
    halves = split_backward(_backward_of(layout.treedef), leaves, ct)
    if halves is None or len(halves.kept_avals) != len(layout.kept):
        raise RuntimeError("the stage's backward splits differently between two traces")
    return halves


def _copies(varied: jax.Array, value: jax.Array) -> int:
    """How many devices hold the same loss ``value`` that ``varied`` (the loss from the varied
    head weights) counts once each: the sizes of the axes only ``varied`` varies over. The
    backward is seeded with one over that, so the summed gradient counts the loss once."""
    extra = (varying_axes(varied) or frozenset()) - (varying_axes(value) or frozenset())
    sizes = manual_axis_sizes()
    return int(np.prod([sizes[a] for a in extra])) if extra else 1


def _like(x: Any, like: jax.Array) -> jax.Array:
    """``x`` made to vary over the axes ``like`` varies over (the branches' common type)."""
    return vary(jnp.asarray(x, like.dtype), varying_axes(like))
