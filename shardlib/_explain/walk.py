"""Filling an `ExplainReport` from a traced program: the jaxpr walk behind `shardlib.explain`.

Only the equations that run are walked (`shardlib._explain.liveness`: dead code, which JAX drops
when it lowers, is not reported). Every collective equation becomes a `CollectiveCall` (op and
spec read from the
``shardops.OP[SPEC]`` named scope, bytes and ring cost from `shardlib._explain.hlo`; a forward
collective that activation checkpointing runs again in the backward pass, under JAX's
``rematted_computation`` name, is marked ``recomputed``), every layout change outside
``shard_map`` a `LayoutMove` (`shardlib._explain.moves`), ``dot_general`` equations add FLOPs,
and the values ``explicit_activation_checkpointing`` saves become `SavedValue` rows. Source
lines come from `shardlib._env.frames`, the one place that decides which frame is the user's.
A collective XLA may run fewer times than JAX emits it is flagged (`CollectiveCall.xla_may`):
one whose operand is the same at every iteration of its loop (loop-invariant), one of the same
value with the same parameters as an earlier one (duplicate), a re-computation.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.ad_checkpoint import Saveable

from jax_extra import SAVE_FOR_BACKWARD_NAME, explicit_activation_checkpointing

from .._check.pytree import keypath_str
from .._env import programs
from .._env.frames import location_of_traceback, name_stack_of
from .._lang.scope_codec import AttentionScope, MoeLayerScope, OpScope, ScheduleScope
from . import hlo as _hlo
from . import liveness as _liveness
from . import moves as _moves
from . import sections as _sections
from .report import DUPLICATE, LOOP_INVARIANT, RECOMPUTED, CollectiveCall, ExplainReport, SavedValue

__all__ = ["COLLECTIVE_PRIMITIVES", "argument_bytes", "source_of", "walk_program"]

# jaxpr primitive -> HLO collective kind.
_KINDS = {
    "all_gather": "all-gather",
    "all_gather_invariant": "all-gather",
    "reduce_scatter": "reduce-scatter",
    "psum": "all-reduce",
    "psum_invariant": "all-reduce",
    "pmax": "all-reduce",
    "pmin": "all-reduce",
    # JAX's collectives on unreduced and reduced values (a psum of an unreduced argument)
    "unreduced_psum": "all-reduce",
    "unreduced_pmax": "all-reduce",
    "unreduced_pmin": "all-reduce",
    "unreduced_reduce_scatter": "reduce-scatter",
    "all_gather_reduced": "all-gather",
    "all_to_all": "all-to-all",
    "ragged_all_to_all": "ragged-all-to-all",
    "ppermute": "collective-permute",
    # jax.lax.pbroadcast (an int source; a traced one binds pbroadcast_dynamic, JAX 0.12)
    "pbroadcast": "collective-broadcast",
    "pbroadcast_dynamic": "collective-broadcast",
}
# The primitives reported as collectives (``tests/test_primitive_coverage.py`` lists, per JAX
# version, JAX's communicating primitives that are not).
COLLECTIVE_PRIMITIVES = frozenset(_KINDS)
_NAME_PRIMITIVE = "name"  # JAX's primitive behind jax.ad_checkpoint.checkpoint_name
_CHECKPOINT_PRIMITIVES = ("checkpoint", "remat", "remat2")
# JAX's name for the forward code a checkpointed function runs again in its backward pass.
_REMAT_SCOPE = "rematted_computation"


@dataclasses.dataclass(frozen=True)
class _At:
    """Where the walk is: what encloses the equations of the jaxpr being walked."""

    mult: int = 1  # times the jaxpr runs per call of f (scan lengths multiplied)
    prefix: str = ""  # the enclosing equations' name stack
    sizes: Mapping[str, int] = dataclasses.field(default_factory=dict)  # mesh axis sizes
    loop: str | None = None  # "scan x4" etc.
    where: str = "?"  # the enclosing equation's source line
    in_checkpoint: bool = False  # inside a checkpointed call whose saved values are listed
    # The innermost scan body's loop-invariant inputs (its consts; ids of their variables),
    # and how many times a value computed outside that loop is kept: once per outer call.
    invariant: frozenset[int] = frozenset()
    outer_mult: int = 1
    in_shard_map: bool = False


def walk_program(jaxpr: Any, report: ExplainReport, arg_names: Sequence[str] = ()) -> None:
    """Record the collectives, layout moves, FLOPs and saved values of a traced program's
    ``jaxpr``; ``arg_names`` names its inputs (f's arguments, flattened) in the move rows."""
    jaxpr = programs.open_program(jaxpr)
    walker = _Walker(report, _backward_policies(jaxpr), _liveness.live_equations(jaxpr))
    if len(arg_names) == len(jaxpr.invars):
        walker.names = {id(v): n for v, n in zip(jaxpr.invars, arg_names, strict=True)}
    walker.walk(jaxpr, _At())
    report.moves[:] = _moves.link_transposes(report.moves)
    if not _moves.is_one_call(jaxpr):
        report.moves[:] = [dataclasses.replace(m, in_step=True) for m in report.moves]


class _Walker:
    """``saving``: the policies of the checkpointed calls whose backward pass is in the
    program (see `_backward_policies`); a named value outside any checkpoint call is listed
    as saved when one of them saves it."""

    def __init__(self, report: ExplainReport, saving: tuple[Any, ...], live: frozenset[int]):
        self.report = report
        self.saving = saving
        self.live = live  # ids of the equations that run (`shardlib._explain.liveness`)
        self.inv: set[int] = set()  # ids of the innermost loop body's loop-invariant values
        self.seen: set[tuple] = set()  # (primitive, operand ids, params) of the collectives
        self.alias: dict[int, tuple[int, int]] = {}  # id of a body's input -> `_root` of its value
        self.visits = self.visit = 0  # jaxprs walked so far; the one being walked
        self.names: dict[int, str] = {}  # id(var) -> the argument of f it is
        self.consumers: dict[int, tuple[str, int]] = {}  # shard_map inputs of the jaxpr walked
        self.jaxpr: Any = None

    def walk(self, jaxpr: Any, at: _At) -> None:
        outer, outer_visit, outer_jaxpr = self.consumers, self.visit, self.jaxpr
        self.jaxpr = jaxpr  # the jaxpr whose equations are visited (`_sections.tag`)
        self.visits += 1  # a body walked twice (a cached jaxpr called twice): two visits
        self.visit = self.visits
        if not at.in_shard_map:
            self.consumers = _moves.consumers(jaxpr)
        for eqn in jaxpr.eqns:
            if id(eqn) not in self.live:  # dead code: JAX drops it when it lowers
                continue
            self._visit(eqn, at)
            if at.loop is not None and self._invariant(eqn.invars):
                self.inv.update(id(v) for v in eqn.outvars)
        self.consumers, self.visit, self.jaxpr = outer, outer_visit, outer_jaxpr

    def _root(self, v: Any) -> tuple[int, int]:
        """Which value ``v`` is: (visit, id) of the variable that holds it where it is made
        (a call's or a loop's const input: the caller's value)."""
        return self.alias.get(id(v), (self.visit, id(v)))

    def _invariant(self, values: Sequence[Any]) -> bool:
        """Every input is the same at each iteration of the innermost loop (a literal, a const
        of the loop or computed from them only)."""
        return all(hasattr(v, "val") or id(v) in self.inv for v in values)

    def _visit(self, eqn: Any, at: _At) -> None:
        name = eqn.primitive.name
        stack = _join(at.prefix, name_stack_of(eqn))
        # No user line (e.g. inside a custom_jvp rule): use the enclosing call's line.
        loc = source_of(eqn) or at.where
        if ScheduleScope.present(stack) and not ScheduleScope.present(at.prefix):
            self._schedules(name_stack_of(eqn), loc)
        if AttentionScope.present(stack) or MoeLayerScope.present(stack):
            _sections.enter(self.report, stack, at.prefix, at.mult, loc)
        if name in _KINDS:
            invariant = at.loop is not None and self._invariant(eqn.invars[:1])
            row = _collective(eqn, stack, at, loc, invariant)
            row = _sections.tag(row, eqn, self.jaxpr, stack, self.report)
            params = repr(sorted(programs.all_params(eqn).items()))
            key = (name, tuple(self._root(v) for v in eqn.invars), params)
            if key in self.seen:  # XLA's CSE may run the two as one (hoisted out of a loop)
                row = dataclasses.replace(row, xla_may=row.xla_may or DUPLICATE, min_calls=0)
            self.seen.add(key)
            self.report.collectives.append(row)
            return
        if name in _moves.MOVE_PRIMITIVES and not at.in_shard_map:
            self._move(eqn, stack, at, loc)
            return
        if name == "dot_general":
            self.report.flops += float(programs.dot_flops(eqn)) * at.mult
        if (
            name == _NAME_PRIMITIVE
            and not at.in_checkpoint
            and any(_policy_saves(p, eqn) for p in self.saving)
        ):
            # Differentiated code has no checkpoint eqn left in the forward pass, only the
            # named values (the backward pass recomputes from them and the arguments).
            self.report.saved.append(_saved_name(eqn, at.mult, loc))
            self.report.checkpoint_calls = max(self.report.checkpoint_calls, at.mult)
        inner = self._inside(eqn, dataclasses.replace(at, prefix=stack, where=loc))
        outer_inv = self.inv
        if name == "scan":  # a new innermost loop: its consts are what stays the same
            self.inv = set(inner.invariant)
            scan = programs.scan_parts(eqn)
            # Its consts are the caller's values; so are its carries when it runs once (XLA
            # unrolls a one-iteration loop: the body then reads the initial carries).
            n = scan.n_consts + (scan.n_carry if scan.length == 1 else 0)
            for v, w in zip(eqn.invars[:n], scan.body.invars[:n], strict=True):
                self.alias[id(w)] = self._root(v)
        self._subs(eqn, name, inner)
        self.inv = outer_inv if name == "scan" else self.inv

    def _subs(self, eqn: Any, name: str, inner: _At) -> None:
        """Walk ``eqn``'s sub-programs; a ``cond``'s (``lax.switch``'s) FLOPs are its costliest
        branch's: one runs (its collectives are all listed, as the HLO has them)."""
        base, most = self.report.flops, 0.0
        for sub in programs.sub_programs(eqn):
            if len(sub.invars) == len(eqn.invars):  # a call: its inputs are the equation's
                for v, w in zip(eqn.invars, sub.invars, strict=True):
                    if id(v) in self.names:
                        self.names[id(w)] = self.names[id(v)]
                    if name != "scan" and self._invariant([v]):
                        self.inv.add(id(w))
                    if name != "scan":
                        self.alias[id(w)] = self._root(v)
            self.walk(sub, inner)
            if name == "cond":
                most, self.report.flops = max(most, self.report.flops - base), base
        self.report.flops += most

    def _move(self, eqn: Any, stack: str, at: _At, loc: str) -> None:
        """Record a layout change outside ``shard_map`` (`shardlib._explain.moves`)."""
        move = _moves.move_of(
            eqn,
            self.consumers.get(id(eqn.outvars[0])),
            self.names.get(id(eqn.invars[0])),
            calls=at.mult,
            location=loc,
            in_loop=at.loop,
            backward="transpose" in stack,
        )
        if move is not None:
            self.report.moves.append(move)

    def _schedules(self, own_stack: str, loc: str) -> None:
        """Record the pipeline schedules opened in ``own_stack`` (an equation of the jaxpr the
        schedule was called from: its line is the call's), once per schedule and line."""
        for info in _sections.schedules_in(own_stack, loc):
            if info not in self.report.schedules:
                self.report.schedules.append(info)

    def _inside(self, eqn: Any, at: _At) -> _At:
        """Where the sub-jaxprs of ``eqn`` are: its mesh, loop and checkpoint."""
        name = eqn.primitive.name
        if name == "shard_map":
            mesh = programs.optional_param(eqn, "mesh")
            if mesh is not None:
                sizes = dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))
                return dataclasses.replace(at, sizes=sizes, in_shard_map=True)
            return dataclasses.replace(at, in_shard_map=True)
        elif name == "scan":
            scan = programs.scan_parts(eqn)
            length = scan.length
            loop = f"scan x{length}" if at.loop is None else f"{at.loop}, scan x{length}"
            consts = frozenset(id(v) for v in scan.body.invars[: scan.n_consts])
            return dataclasses.replace(
                at, mult=at.mult * length, loop=loop, invariant=consts, outer_mult=at.mult
            )
        elif name == "while":
            self.report.notes.append(
                "a while_loop's trip count is unknown when tracing: its collectives are "
                "counted once"
            )
        elif name in _CHECKPOINT_PRIMITIVES:
            if programs.optional_param(eqn, "differentiated"):
                # In the backward pass it is the recomputation: what it recomputes is not
                # saved. In the forward pass (the primal part of an enclosing checkpoint, as
                # `shardlib.pipeline.circular` makes) its named values are listed as usual.
                backward = "transpose" in at.prefix
                return dataclasses.replace(at, in_checkpoint=backward or at.in_checkpoint)
            if at.in_checkpoint:  # JAX applies the outermost checkpoint's policy inside it
                return at
            saved = _saved_by_checkpoint(eqn, self.report, at)
            return dataclasses.replace(at, in_checkpoint=saved)
        return at


def _join(prefix: str, stack: str) -> str:
    if not prefix:
        return stack
    return f"{prefix}/{stack}" if stack else prefix


def source_of(eqn: Any) -> str | None:
    """``file.py:LINE`` of the user code behind ``eqn`` (``eqn.source_info`` is not documented
    public API), or None."""
    return location_of_traceback(getattr(getattr(eqn, "source_info", None), "traceback", None))


def _aval_bytes(aval: Any) -> int:
    return _hlo.array_bytes(np.dtype(aval.dtype).name, tuple(aval.shape))


def _collective(eqn: Any, stack: str, at: _At, loc: str, invariant: bool) -> CollectiveCall:
    axes = programs.collective_axes(eqn)
    group = int(programs.optional_param(eqn, "axis_size") or 1)
    if at.sizes:
        group = math.prod(at.sizes.get(a, 1) for a in axes)
    aval_in, aval_out = eqn.invars[0].aval, eqn.outvars[0].aval
    n_in = _aval_bytes(aval_in)
    kind = _KINDS[eqn.primitive.name]
    sent = math.ceil(_hlo.ring_bytes(kind, n_in, _aval_bytes(aval_out), group, _moving(eqn)))
    scope = OpScope.innermost(stack)
    op, spec = (scope.op, scope.spec) if scope else (None, None)
    recomputed = _REMAT_SCOPE in stack
    xla_may = None
    if recomputed:
        xla_may = RECOMPUTED
    elif invariant and at.mult > at.outer_mult:
        xla_may = LOOP_INVARIANT
    return CollectiveCall(
        kind=kind,
        primitive=eqn.primitive.name,
        op=op,
        spec=spec,
        backward="transpose" in stack and not recomputed,
        axes=axes,
        group=group,
        operand_shape=tuple(aval_in.shape),
        result_shape=tuple(aval_out.shape),
        dtype=np.dtype(aval_in.dtype).name,
        operand_bytes=n_in,
        sent_bytes=sent,
        received_bytes=sent,
        calls=at.mult,
        location=loc,
        in_loop=at.loop,
        recomputed=recomputed,
        xla_may=xla_may,
        min_calls={LOOP_INVARIANT: at.outer_mult, RECOMPUTED: 0}.get(xla_may or "", at.mult),
    )


def _moving(eqn: Any) -> float:
    """A ppermute: 1 if some device sends its block to another (the busiest device sends and
    receives one block, whatever the fixed points), 0 if every pair is a fixed point; 1 for
    the other collectives (as the HLO reader counts a collective-permute)."""
    pairs = programs.optional_param(eqn, "perm")
    if pairs is None:
        return 1.0
    return 1.0 if any(s != d for s, d in pairs) else 0.0


# -- saved values -------------------------------------------------------------------------------


@functools.cache
def _explicit_policies() -> tuple[Any, ...]:
    """The checkpoint policies of ``explicit_activation_checkpointing`` (each option), read
    from a trace of it so that they follow whatever it uses."""
    out = []
    for only in (False, True):
        f = explicit_activation_checkpointing(only_save_for_backward=only)(lambda x: x)
        for eqn in jax.make_jaxpr(f)(np.float32(0)).jaxpr.eqns:
            if eqn.primitive.name in _CHECKPOINT_PRIMITIVES:
                out.append(programs.optional_param(eqn, "policy"))
    return tuple(p for p in out if p is not None)


def _policy_saves(policy: Any, eqn: Any) -> bool:
    """Whether checkpoint ``policy`` keeps the value of the ``checkpoint_name`` equation ``eqn``
    in device memory (asked as ``jax.checkpoint`` asks it; an offloaded value is not kept)."""
    if policy is None or eqn.primitive.name != _NAME_PRIMITIVE:
        return False
    try:
        out = policy(eqn.primitive, *(v.aval for v in eqn.invars), **programs.all_params(eqn))
    except Exception:  # pragma: no cover - a policy that does not take names
        return False
    return out is Saveable or (isinstance(out, bool | np.bool_) and bool(out))


def _backward_policies(jaxpr: Any) -> tuple[Any, ...]:
    """The policies of the checkpointed calls whose backward pass (a ``differentiated``
    checkpoint equation) is in ``jaxpr``: f is differentiated, and these say which of the named
    values of its forward pass were saved."""
    out: list[Any] = []
    for e in programs.iter_eqns(jaxpr):
        if e.primitive.name in _CHECKPOINT_PRIMITIVES and programs.optional_param(
            e, "differentiated"
        ):
            p = programs.optional_param(e, "policy")
            if p is not None and p not in out:
                out.append(p)
    return tuple(out)


def _saved_by_checkpoint(eqn: Any, report: ExplainReport, at: _At) -> bool:
    """Arguments and saved named values of one explicitly checkpointed call.

    A call is explicitly checkpointed when its policy is one of
    ``explicit_activation_checkpointing``'s or saves a named value of its body. The named
    values listed are those the policy saves: under the default policy every value named with
    ``checkpoint_name`` (``save_for_backward`` marks included), under
    ``only_save_for_backward=True`` the marks only. An argument that is the same at every
    iteration of the enclosing loop (a const of the scan, such as a stage's weights) is kept
    once, not once per iteration. Returns whether ``eqn`` was such a call.
    """
    mult = at.mult
    policy = programs.optional_param(eqn, "policy")
    if policy is None:
        return False
    inner = {id(e): e for sub in programs.sub_programs(eqn) for e in programs.iter_eqns(sub)}
    names = [e for e in inner.values() if _policy_saves(policy, e)]
    if not names and policy not in _explicit_policies():
        return False
    report.checkpoint_calls += mult
    loc = source_of(eqn) or at.where
    for v in eqn.invars:
        if hasattr(v.aval, "shape"):
            once = id(v) in at.invariant
            saved = _saved("argument", v.aval, at.outer_mult if once else mult, loc)
            report.saved.append(dataclasses.replace(saved, once=once))
    for e in names:
        report.saved.append(_saved_name(e, mult, source_of(e) or at.where))
    return True


def _saved(what: str, aval: Any, mult: int, loc: str, name: str | None = None) -> SavedValue:
    return SavedValue(
        what=what,
        shape=tuple(aval.shape),
        dtype=np.dtype(aval.dtype).name,
        bytes=_aval_bytes(aval),
        calls=mult,
        location=loc,
        name=name,
    )


def _saved_name(eqn: Any, mult: int, loc: str) -> SavedValue:
    """The value of a ``checkpoint_name`` equation: ``marked`` if ``save_for_backward`` made it."""
    name = programs.optional_param(eqn, "name")
    what = "marked" if name == SAVE_FOR_BACKWARD_NAME else "named"
    return _saved(what, eqn.outvars[0].aval, mult, loc, name=name)


def argument_bytes(args: tuple, kwargs: dict) -> list[tuple[str, int]]:
    """``(path, bytes per device)`` of every array among the arguments."""
    out = []
    tree = {"args": args, "kwargs": kwargs} if kwargs else args
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        shape = getattr(leaf, "shape", None)
        dtype = getattr(leaf, "dtype", None)
        if shape is None or dtype is None:
            continue
        sh = getattr(leaf, "sharding", None)
        local = tuple(sh.shard_shape(tuple(shape))) if sh is not None else tuple(shape)
        # keypath_str: '[0].layers.w' (keystr would run seqax-style keys together).
        out.append((keypath_str(path), _hlo.array_bytes(np.dtype(dtype).name, local)))
    return out
