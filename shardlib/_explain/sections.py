"""The report's pipeline and context-parallel sections: schedules, cotangents, rings.

Read from the named scopes the schedules and the attention calls run under, during the walk
(`shardlib._explain.walk` calls `tag` for each collective and `enter` for each equation):

- a ``shift`` inside a ``shardlib.pipeline.NAME[...]`` scope that carries a cotangent (a
  transpose of a forward shift, as GPipe's and circular's backward passes are, or a shift
  whose operand a tick's ``lax.switch`` computes in a VJP, as the memory-bounded schedules
  send the input cotangent upstream) is marked ``cotangent`` (``shift (cotangent)`` in the table);
- every ``shardlib.attention.ring[...]`` / ``gathered[...]`` / ``ulysses[...]`` /
  ``decode[...]`` call becomes a `RingCall`: the bytes of its transfers forward and backward,
  and for the ring its steps;
- every ``shardlib.moe.layer[...]`` call a `shardlib._explain.moe_calls.MoeCall`.

The text of the schedules table and of the rings table lives here too (`schedule_lines`,
`ring_lines`), beside `shardlib._explain.render`'s tables.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from .._check.format import byte_str
from .._env import programs
from .._env.frames import name_stack_of
from .._lang.scope_codec import AttentionScope, ScheduleScope
from .._pipeline.cost import path_of
from .._pipeline.registry import find, rules_for, schedule_scoped
from .._pipeline.scopes import ScheduleInfo, parse_schedule_scopes
from . import moe_calls as _moe

__all__ = [
    "BACKWARD_CELLS",
    "RingCall",
    "enter",
    "ring_lines",
    "schedule_lines",
    "schedule_short",
    "schedules_in",
    "tag",
]

_NOT_RING = {
    "gathered": ("all-gather", "reduce-scatter"),
    "ulysses": ("all-to-all",) * 2,
    "decode": ("all-reduce", "all-reduce"),  # the combine; backward: q's gradient summed
}
_HOPS = 8  # equations followed back from a shift's operand to the cond that makes it
_RING_TRANSFERS = {False: 2, True: 4}  # per ring step: K, V forward; K, V, dK, dV backward


@dataclass(frozen=True)
class RingCall:
    """One ``shardlib.attention.ring``, ``gathered``, ``ulysses`` or ``decode`` call in the
    program (per device).

    ``runs``: times the call runs per call of f (layers of a ``scan``). ``forward_bytes`` and
    ``backward_bytes``: bytes one device sends in all its runs (the ring: its ``shift`` rows,
    segment ids included; gathered: its all-gathers forward, its reduce-scatters backward;
    ulysses: its all-to-alls, and its all-gather of the segment ids; decode: the all-reduce of
    its combine, `shardlib._attention.chunks.decode_bytes`, and backward the all-reduce of q's
    gradient).
    ``forward_steps``/``backward_steps``: ring steps per run (K/V transfers; ``c - 1`` each
    way); 0 for ``gathered``, ``ulysses`` and for a pass that is not in the program.
    """

    fn: str  # "ring", "gathered", "ulysses" or "decode"
    axis: str
    c: int
    layout: str
    location: str
    runs: int = 1
    forward_bytes: int = 0
    backward_bytes: int = 0
    forward_transfers: int = 0  # K/V (and dK/dV) shift calls, all runs
    backward_transfers: int = 0

    @property
    def forward_steps(self) -> int:
        return self.forward_transfers // (_RING_TRANSFERS[False] * self.runs)

    @property
    def backward_steps(self) -> int:
        return self.backward_transfers // (_RING_TRANSFERS[True] * self.runs)

    def step_bytes(self, backward: bool) -> int | None:
        """Bytes one device sends per ring step (``None``: no step that way)."""
        steps = self.backward_steps if backward else self.forward_steps
        total = self.backward_bytes if backward else self.forward_bytes
        return total // (steps * self.runs) if steps else None


def enter(report: Any, stack: str, prefix: str, mult: int, loc: str) -> None:
    """Record in ``report`` the attention calls and MoE layers (`shardlib._explain.moe_calls`)
    an equation opens (its ``stack`` has the scope, its enclosing ``prefix`` does not):
    ``mult`` is how many times the call runs."""
    _moe.enter(report.moes, stack, prefix, mult, loc)
    rings: list[RingCall] = report.rings
    for text, scope in AttentionScope.find(stack):
        if text in prefix:
            continue
        i = _find(rings, scope, loc)
        rings[i] = dataclasses.replace(rings[i], runs=max(rings[i].runs, mult))


def tag(row: Any, eqn: Any, jaxpr: Any, stack: str, report: Any) -> Any:
    """``row`` (a `CollectiveCall` of ``eqn``, an equation of ``jaxpr``) marked ``cotangent``
    where a pipeline sends a cotangent with it, and its bytes added to its attention call or
    MoE layer in ``report``."""
    rings: list[RingCall] = report.rings
    _moe.tag(row, stack, report.moes)
    pipelined = row.primitive == "ppermute" and ScheduleScope.present(stack)
    if pipelined and (row.backward or _from_transpose(eqn, jaxpr)):
        row = dataclasses.replace(row, cotangent=True)
    scope = AttentionScope.innermost(stack)
    if scope is not None:
        i = _find(rings, scope, row.location)
        r, back = rings[i], row.backward
        transfers = row.calls if row.op == "shift" and len(row.operand_shape) == 4 else 0
        rings[i] = dataclasses.replace(
            r,
            forward_bytes=r.forward_bytes + (0 if back else row.total_sent),
            backward_bytes=r.backward_bytes + (row.total_sent if back else 0),
            forward_transfers=r.forward_transfers + (0 if back else transfers),
            backward_transfers=r.backward_transfers + (transfers if back else 0),
        )
    return row


def _find(rings: list[RingCall], scope: AttentionScope, loc: str) -> int:
    """The index of the call of ``scope`` at ``loc`` in ``rings`` (appended if new)."""
    fn, axis, c, layout = scope.fn, scope.axis, scope.c, scope.layout
    key = (fn, axis, c, layout, loc)
    for i, r in enumerate(rings):
        if (r.fn, r.axis, r.c, r.layout, r.location) == key:
            return i
    rings.append(RingCall(fn, axis, c, layout, loc))
    return len(rings) - 1


def _from_transpose(eqn: Any, jaxpr: Any) -> bool:
    """The operand of ``eqn`` (a shift) comes out of a ``lax.cond``/``switch`` (a tick's
    action) one of whose branches computes it in a transpose, a VJP applied: a cotangent."""
    made = {id(o): q for q in jaxpr.eqns for o in q.outvars}
    v = eqn.invars[0]
    for _ in range(_HOPS):  # through the conversions around it (pvary, convert_element_type)
        q = made.get(id(v))
        if q is None or not q.invars:
            return False
        if q.primitive.name == "cond":
            k = [id(o) for o in q.outvars].index(id(v))
            return any(_transposed(b, b.outvars[k]) for b in programs.cond_branches(q))
        v = q.invars[0]
    return False


def _transposed(jaxpr: Any, v: Any) -> bool:
    """``v`` is made in ``jaxpr`` by an equation of a transpose (or a few steps after one)."""
    made = {id(o): q for q in jaxpr.eqns for o in q.outvars}
    for _ in range(_HOPS):
        q = made.get(id(v))
        if q is None:
            return False
        if "transpose" in name_stack_of(q):
            return True
        if not q.invars:
            return False
        v = q.invars[0]
    return False


def schedules_in(name_stack: str, location: str) -> list[ScheduleInfo]:
    """The pipeline schedules opened in ``name_stack``, named as `shardlib.pipeline` spells
    them (``zb-h1``, ``1f1b``, ``interleaved``, ``gpipe``, ``circular``), so that a report's
    ``schedule`` can be passed back to ``pipeline.timeline`` or ``pipeline_loss``.

    The named scope carries a Python identifier (``zb_h1``, the `Schedule`'s ``scope``);
    `shardlib._pipeline.registry` gives the name a user writes."""
    return [_Reported.of(info) for info in parse_schedule_scopes(name_stack, location)]


def _fields(info: ScheduleInfo, schedule: str) -> dict[str, Any]:
    out = {f.name: getattr(info, f.name) for f in dataclasses.fields(ScheduleInfo)}
    out["schedule"] = schedule
    return out


@dataclass(frozen=True)
class _Reported(ScheduleInfo):
    """A `ScheduleInfo` whose ``schedule`` is the user-facing name; its tables (ticks, bubble,
    slots in flight) are the ones `ScheduleInfo` computes for the name its scope carries."""

    @classmethod
    def of(cls, info: ScheduleInfo) -> _Reported:
        found = schedule_scoped(info.schedule)
        return cls(**_fields(info, found.name if found is not None else info.schedule))

    def _scoped(self) -> ScheduleInfo:
        found = find(self.schedule)
        return ScheduleInfo(**_fields(self, found.scope if found is not None else self.schedule))

    @property
    def ticks(self) -> int:
        return self._scoped().ticks

    @property
    def bubble_fraction(self) -> float:
        return self._scoped().bubble_fraction

    @property
    def peak_in_flight(self) -> tuple[int, ...]:
        return self._scoped().peak_in_flight


# -- text -----------------------------------------------------------------------------------------


def path_cell(s: ScheduleInfo) -> str:
    """The step in the cost model at ``T_F = T_B = T_W = 1`` (`shardlib.pipeline.critical_path`):
    lockstep / without lockstep / GPipe's, and lockstep over GPipe's. A zero-bubble schedule
    whose stage's backward ran whole in B: at ``T_B = 2, T_W = 0``, what it then costs."""
    found = schedule_scoped(s.schedule) or find(s.schedule)
    name = found.name if found is not None else s.schedule
    times = (1.0, 2.0, 0.0) if s.backward == "whole" else (1.0, 1.0, 1.0)
    path = path_of(name, s.stages, s.microbatches, s.groups, times)
    return (
        f"{path.lockstep:g} / {path.asynchronous:g} / {path.gpipe:g} "
        f"({path.against_gpipe:.2f}x GPipe)"
    )


def schedule_lines(schedules: list[ScheduleInfo], table: Any) -> list[str]:
    """The schedules table (``table``: `shardlib._explain.render`'s table maker)."""
    lines = [
        "Pipeline schedules (shardlib.pipeline; bubble: the share of the step a stage idles; "
        "critical path: the step in units of one stage's forward = input-cotangent half = "
        "weight half, as run in lockstep / without lockstep / GPipe's, see "
        "pipeline.critical_path for measured times; in flight: the most residual slots a "
        "stage holds at once, per stage; in-flight bytes: in flight x slot, per stage, per "
        "device)"
    ]

    def peak(s: ScheduleInfo) -> tuple[str, str]:
        if s.peak_bytes is None or s.slot_bytes is None:
            return "-", "not estimated"
        return byte_str(s.slot_bytes, 1), " / ".join(byte_str(b, 1) for b in s.peak_bytes)

    split = any(s.backward for s in schedules)  # a zero-bubble schedule: its backward column
    rows = [
        (
            s.schedule,
            s.axis,
            str(s.stages),
            str(s.microbatches),
            str(s.groups),
            str(s.ticks),
            f"{s.bubble_fraction:.1%}",
            path_cell(s),
            *([BACKWARD_CELLS.get(s.backward or "", "-")] if split else []),
            " ".join(map(str, s.peak_in_flight)),
            *peak(s),
            s.location,
        )
        for s in schedules
    ]
    head = ("schedule", "axis", "stages p", "microbatches m", "groups v", "ticks", "bubble")
    head += ("critical path", *(["backward"] if split else []), "in flight", "slot")
    lines += table((*head, "in-flight bytes", "source"), rows,
                   right={2, 3, 4, 5, 6, 9 + split, 10 + split})  # fmt: skip
    if any(s.slot_bytes is None for s in schedules):
        lines.append(
            "in-flight bytes not estimated: JAX cannot differentiate the stage (a forward-only "
            "pipeline keeps nothing for a backward)"
        )
    return lines + _backward_notes(schedules) + _slot_notes(schedules)


def schedule_short(s: ScheduleInfo) -> str:
    """The schedule's line of `ExplainReport.short`."""
    return (
        f"  pipeline: {s.schedule} over {s.axis}, p={s.stages} m={s.microbatches} "
        f"v={s.groups}: {s.ticks} ticks, bubble {s.bubble_fraction:.1%}, critical path "
        f"{path_cell(s)}, in flight {max(s.peak_in_flight)} per stage at most"
        + (f", backward {BACKWARD_CELLS[s.backward]}" if s.backward else "")
    )


# The backward column of a zero-bubble schedule's row (`ScheduleInfo.backward`).
BACKWARD_CELLS = {"split": "split in B + W", "whole": "whole in B"}


def _backward_notes(schedules: list[ScheduleInfo]) -> list[str]:
    """What the backward column says, when a row has it (one line)."""
    marked = [s for s in schedules if s.backward]
    if not marked:
        return []
    whole = [f"{s.schedule} at {s.location}" for s in marked if s.backward == "whole"]
    return [
        "backward: zb-h1/zb-v split each stage's backward into B (the input's cotangent) and W "
        "(the weight gradient); whole in B: the split failed (see the UnsplitBackwardWarning) "
        "and B runs the whole backward, its critical path at T_B = 2, T_W = 0"
        + (f" ({', '.join(whole)})" if whole else "")
    ]


def _slot_notes(schedules: list[ScheduleInfo]) -> list[str]:
    """What a slot is, for the schedule families in the table (one line)."""
    estimated = {s.schedule for s in schedules if s.slot_bytes is not None}
    looped = {s for s in estimated if not rules_for(s).tabled}
    ringed = estimated - looped
    kinds = []
    if looped:
        kinds.append(
            f"{'/'.join(sorted(looped))}: one tick's, kept by autodiff of the loop at every "
            "tick, bubble ticks too (the loop also keeps each tick's output block, and its "
            "cotangent backward: not counted)"
        )
    if ringed:
        kinds.append(f"{'/'.join(sorted(ringed))}: one microbatch's, in the schedule's ring")
    if not kinds:
        return []
    return [
        "slot: the residuals kept for the backward (the stage input among them, the stage "
        "weights not: those are kept once); " + "; ".join(kinds)
    ]


def ring_lines(rings: list[RingCall], table: Any) -> list[str]:
    """The context-parallel table: one row per ``attention.ring``/``gathered``/``ulysses``/
    ``decode`` call."""
    lines = [
        "Context parallelism (shardlib.attention; per device: bytes sent, all runs; a ring step "
        "sends K and V forward, K, V, dK and dV backward)"
    ]

    def steps(r: RingCall, backward: bool) -> str:
        n = r.backward_steps if backward else r.forward_steps
        b = r.step_bytes(backward)
        return "-" if b is None else f"{n} x {byte_str(b, 1)}"

    rows = [
        (
            r.fn,
            f"{r.axis} ({r.c})",
            r.layout,
            f"x{r.runs}",
            steps(r, False) if r.fn == "ring" else _NOT_RING[r.fn][0],
            byte_str(r.forward_bytes, 1),
            steps(r, True) if r.fn == "ring" else _NOT_RING[r.fn][1],
            byte_str(r.backward_bytes, 1),
            r.location,
        )
        for r in rings
    ]
    head = ("attention", "axis", "layout", "runs", "forward steps", "forward", "backward steps")
    right: Collection[int] = {3, 4, 5, 6, 7}
    return lines + table((*head, "backward", "source"), rows, right=right)
