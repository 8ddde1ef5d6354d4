"""The named scope a pipeline schedule runs under, and what `shardlib.explain` reads back
from it (`ScheduleInfo`: the schedule, its sizes, its ring slot's bytes, whether a zero-bubble
schedule split the stage's backward). Pure Python, no JAX: the tables come from
`shardlib._pipeline.tables`, the schedules from `shardlib._pipeline.registry`.
"""

from __future__ import annotations

from dataclasses import dataclass

from .._lang.scope_codec import ScheduleScope
from .arithmetic import idle_share, tick_count
from .registry import Schedule, schedule_scoped, unregistered
from .tables import Table, schedule_table

__all__ = ["ScheduleInfo", "parse_schedule_scopes", "schedule_scope"]

# A schedule runs under the named scope of a `shardlib._lang.scope_codec.ScheduleScope`
# (``res_bytes``: the bytes of one residual slot per device: a ring slot of the table
# schedules, one tick's residuals of gpipe and circular; ``backward``, for ZB-H1 and ZB-V:
# "split" when the stage's backward was split into B and W, "whole" when it ran whole in B),
# which `shardlib.explain` reads back (`parse_schedule_scopes`; without res_bytes, the slot is
# not estimated; without backward, the split was not looked at).


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
        return tick_count(_schedule(self), self.stages, self.microbatches, self.groups)

    @property
    def bubble_fraction(self) -> float:
        """The share of the step each stage idles: ``(p - 1) / (v * m + p - 1)`` for gpipe and
        circular, from the table's lockstep critical path for the others."""
        return idle_share(_schedule(self), self.stages, self.microbatches, self.groups)

    @property
    def peak_in_flight(self) -> tuple[int, ...]:
        """Per stage, the most residual slots it holds at once: for gpipe and circular every
        tick's (``v * m + p - 1``: autodiff of the loop keeps each tick's, bubble ticks too),
        for the others the table's count of items (microbatch, group) in flight."""
        if _schedule(self).tabled:
            return tuple(_table(self).in_flight(s) for s in range(self.stages))
        return (self.ticks,) * self.stages

    @property
    def peak_bytes(self) -> tuple[int, ...] | None:
        """Per stage, the bytes of its peak in flight: ``peak_in_flight * slot_bytes``."""
        if self.slot_bytes is None:
            return None
        return tuple(n * self.slot_bytes for n in self.peak_in_flight)


def _schedule(info: ScheduleInfo) -> Schedule:
    """The schedule whose scope ``info`` read (`shardlib._pipeline.registry`); a name that
    is none counts as a schedule of one formula."""
    found = schedule_scoped(info.schedule)
    return found if found is not None else unregistered(info.schedule)


def _table(info: ScheduleInfo) -> Table:
    name = _schedule(info).name
    return schedule_table(name, info.stages, info.microbatches, info.groups)


def schedule_scope(
    schedule: str, axis: str, p: int, m: int, v: int, res_bytes: int | None = None,
    backward: str | None = None,
) -> str:  # fmt: skip
    """The named scope a schedule runs under (``res_bytes``: one residual slot's bytes;
    ``backward``: ``"split"`` or ``"whole"``, see `ScheduleInfo`)."""
    return ScheduleScope(schedule, axis, p, m, v, res_bytes, backward).text()


def parse_schedule_scopes(name_stack: str, location: str = "?") -> list[ScheduleInfo]:
    """The schedules whose scopes appear in a ``name_stack``, outermost first."""
    return [
        ScheduleInfo(s.name, s.axis, s.p, s.m, s.v, location, s.res_bytes, s.backward)
        for _, s in ScheduleScope.find(name_stack)
    ]
