"""The named scope a pipeline schedule runs under, and what `shardlib.explain` reads back
from it (`ScheduleInfo`: the schedule, its sizes, its ring slot's bytes, whether a zero-bubble
schedule split the stage's backward). Pure Python, no JAX: the tables come from
`shardlib._pipeline.tables`. `shardlib._pipeline.plan` re-exports these names.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .tables import Table, schedule_table
from .tables import bubble_fraction as _tabled_bubble

__all__ = ["SCHEDULE_SCOPE_PREFIX", "ScheduleInfo", "parse_schedule_scopes", "schedule_scope"]

# A schedule runs under the named scope f"{SCHEDULE_SCOPE_PREFIX}NAME[axis=A p=P m=M v=V
# res_bytes=N backward=K]" (N: the bytes of one residual slot per device: a ring slot of the
# table schedules, one tick's residuals of gpipe and circular; K, for ZB-H1 and ZB-V: "split"
# when the stage's backward was split into B and W, "whole" when it ran whole in B), which
# `shardlib.explain` reads back (`parse_schedule_scopes`; without res_bytes, the slot is not
# estimated; without backward, the split was not looked at).
SCHEDULE_SCOPE_PREFIX = "shardlib.pipeline."
_SCOPE = re.compile(
    re.escape(SCHEDULE_SCOPE_PREFIX)
    + r"(\w+)\[axis=(\w+) p=(\d+) m=(\d+) v=(\d+)(?: res_bytes=(\d+))?"
    + r"(?: backward=(split|whole))?\]"
)


@dataclass(frozen=True)
class ScheduleInfo:
    """One pipeline schedule in a program, as `shardlib.explain` reports it."""

    schedule: str  # as the scope names it: "gpipe", "circular", "1f1b", "zb_h1", "interleaved"
    # (explain reports the name shardlib.pipeline takes: "zb-h1")
    axis: str  # the stage mesh axis
    stages: int  # p
    microbatches: int  # m
    groups: int  # v, layer groups per stage (1 for gpipe)
    location: str = "?"  # the user's line that called the schedule
    # Bytes of one residual slot per device, the stage input among them: one item's residuals
    # in the ring of the table schedules; for gpipe and circular, what autodiff of the loop
    # keeps of one tick (bubble ticks too). None where not estimated.
    slot_bytes: int | None = None
    # ZB-H1 and ZB-V: "split" (the stage's backward in B and W) or "whole" (run whole in B:
    # `shardlib._pipeline.split` could not cut it); None for the others, or not looked at.
    backward: str | None = None

    @property
    def ticks(self) -> int:
        """Iterations of the schedule's loop: ``v * m + p - 1`` for gpipe and circular, the
        table's length for the others (`shardlib._pipeline.tables.schedule_table`)."""
        if self.schedule in _TABLED:
            return len(_table(self).actions[0])
        return self.groups * self.microbatches + self.stages - 1

    @property
    def bubble_fraction(self) -> float:
        """The share of the step each stage idles: ``(p - 1) / (v * m + p - 1)`` for gpipe and
        circular, from the table's lockstep critical path for the others."""
        if self.schedule in _TABLED:
            return _tabled_bubble(_TABLED[self.schedule], self.stages, self.microbatches,
                                  self.groups)  # fmt: skip
        return (self.stages - 1) / self.ticks

    @property
    def peak_in_flight(self) -> tuple[int, ...]:
        """Per stage, the most residual slots it holds at once: for gpipe and circular every
        tick's (``v * m + p - 1``: autodiff of the loop keeps each tick's, bubble ticks too),
        for the others the table's count of items (microbatch, group) in flight."""
        if self.schedule in _TABLED:
            return tuple(_table(self).in_flight(s) for s in range(self.stages))
        return (self.ticks,) * self.stages

    @property
    def peak_bytes(self) -> tuple[int, ...] | None:
        """Per stage, the bytes of its peak in flight: ``peak_in_flight * slot_bytes``."""
        if self.slot_bytes is None:
            return None
        return tuple(n * self.slot_bytes for n in self.peak_in_flight)


# The loss-returning schedules, by the name their scope carries.
_TABLED = {"1f1b": "1f1b", "zb_h1": "zb-h1", "interleaved": "interleaved", "zb_v": "zb-v"}


def _table(info: ScheduleInfo) -> Table:
    return schedule_table(_TABLED[info.schedule], info.stages, info.microbatches, info.groups)


def schedule_scope(
    schedule: str, axis: str, p: int, m: int, v: int, res_bytes: int | None = None,
    backward: str | None = None,
) -> str:  # fmt: skip
    """The named scope a schedule runs under (``res_bytes``: one residual slot's bytes;
    ``backward``: ``"split"`` or ``"whole"``, see `ScheduleInfo`)."""
    tail = "" if res_bytes is None else f" res_bytes={res_bytes}"
    tail += "" if backward is None else f" backward={backward}"
    return f"{SCHEDULE_SCOPE_PREFIX}{schedule}[axis={axis} p={p} m={m} v={v}{tail}]"


def parse_schedule_scopes(name_stack: str, location: str = "?") -> list[ScheduleInfo]:
    """The schedules whose scopes appear in a ``name_stack``, outermost first."""
    return [
        ScheduleInfo(name, axis, int(p), int(m), int(v), location, int(b) if b else None, k or None)
        for name, axis, p, m, v, b, k in _SCOPE.findall(name_stack)
    ]
