"""The arithmetic of pipeline schedules: which item each stage works on at each tick.

Pure Python, no JAX: `work_items` is the rule `shardlib.pipeline`'s schedules apply on the
devices, `timeline` draws it, and the bubble fractions count its idle ticks. Public names are
re-exported by `shardlib.pipeline`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = [
    "SCHEDULE_SCOPE_PREFIX",
    "ScheduleInfo",
    "circular_bubble_fraction",
    "gpipe_bubble_fraction",
    "parse_schedule_scopes",
    "schedule_scope",
    "timeline",
    "work_items",
]

# A schedule runs under the named scope f"{SCHEDULE_SCOPE_PREFIX}NAME[axis=A p=P m=M v=V]",
# which `shardlib.explain` reads back (`parse_schedule_scopes`).
SCHEDULE_SCOPE_PREFIX = "shardlib.pipeline."
_SCOPE = re.compile(
    re.escape(SCHEDULE_SCOPE_PREFIX) + r"(\w+)\[axis=(\w+) p=(\d+) m=(\d+) v=(\d+)\]"
)


@dataclass(frozen=True)
class ScheduleInfo:
    """One pipeline schedule in a program, as `shardlib.explain` reports it."""

    schedule: str  # "gpipe" or "circular"
    axis: str  # the stage mesh axis
    stages: int  # p
    microbatches: int  # m
    groups: int  # v, layer groups per stage (1 for gpipe)
    location: str = "?"  # the user's line that called the schedule

    @property
    def ticks(self) -> int:
        """``v * m + p - 1``: iterations of the schedule's loop."""
        return self.groups * self.microbatches + self.stages - 1

    @property
    def bubble_fraction(self) -> float:
        """The share of ticks each stage idles, ``(p - 1) / (v * m + p - 1)``."""
        return (self.stages - 1) / self.ticks


def schedule_scope(schedule: str, axis: str, p: int, m: int, v: int) -> str:
    """The named scope a schedule runs under."""
    return f"{SCHEDULE_SCOPE_PREFIX}{schedule}[axis={axis} p={p} m={m} v={v}]"


def parse_schedule_scopes(name_stack: str, location: str = "?") -> list[ScheduleInfo]:
    """The schedules whose scopes appear in a ``name_stack``, outermost first."""
    return [
        ScheduleInfo(name, axis, int(p), int(m), int(v), location)
        for name, axis, p, m, v in _SCOPE.findall(name_stack)
    ]


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
    _check_counts("gpipe_bubble_fraction", p=p, m=m)
    return (p - 1) / (m + p - 1)


def circular_bubble_fraction(p: int, m: int, v: int) -> float:
    """The fraction of the circular schedule's ticks in which a stage is idle.

    ``(p - 1) / (v * m + p - 1)``: the schedule runs ``v * m + p - 1`` ticks, each stage works
    on ``v * m`` of them (each microbatch once per layer group it holds) and idles ``p - 1``.
    With ``v = 1`` it is GPipe's.

    **Arguments:** `p` stages, `m` microbatches, `v` layer groups per stage (all >= 1).

    **Returns:** a float in ``[0, 1)``.

    Examples:
        >>> circular_bubble_fraction(4, 8, 2)  # 3 idle ticks out of 19
        0.15789473684210525
    """
    _check_counts("circular_bubble_fraction", p=p, m=m, v=v)
    return (p - 1) / (v * m + p - 1)


def timeline(schedule: str, p: int, m: int, v: int = 1) -> str:
    """Which microbatch each stage works on at each tick, as a text table (bubbles ``.``).

    Rows are stages, columns ticks. A cell is the microbatch index; in the circular schedule
    a letter after it names the pass round the ring (``a`` the first layer group, ``b`` the
    second...). It is the schedule `gpipe` and `circular` run (same formula, here in Python).

    **Arguments:** `schedule` ``'gpipe'`` or ``'circular'``; `p` stages; `m` microbatches;
    `v` layer groups per stage (circular only; ``1`` for gpipe).

    **Returns:** the table, one line per stage after a header of tick numbers.

    Examples:
        >>> print(timeline('gpipe', 2, 3))
        tick     0  1  2  3
        stage 0  0  1  2  .
        stage 1  .  0  1  2
    """
    if schedule not in ("gpipe", "circular"):
        raise ValueError(f"timeline: `schedule` must be 'gpipe' or 'circular', got {schedule!r}")
    _check_counts("timeline", p=p, m=m, v=v)
    if schedule == "gpipe" and v != 1:
        raise ValueError(f"timeline: the gpipe schedule has one layer group per stage, got v={v}")
    rows = work_items(p, m, v)
    ticks = len(rows[0])
    cell = 2 + max(len(str(ticks - 1)), len(str(m - 1)) + (schedule == "circular"))

    def label(item: tuple[int, int] | None) -> str:
        if item is None:
            return "."
        mb, r = item
        return f"{mb}{chr(ord('a') + r)}" if schedule == "circular" else str(mb)

    width = len(f"stage {p - 1}")
    lines = [f"{'tick':<{width}}" + "".join(f"{t:>{cell}}" for t in range(ticks))]
    for s, row in enumerate(rows):
        lines.append(f"{f'stage {s}':<{width}}" + "".join(f"{label(i):>{cell}}" for i in row))
    return "\n".join(line.rstrip() for line in lines)


def work_items(p: int, m: int, v: int = 1) -> list[list[tuple[int, int] | None]]:
    """``[stage][tick]``: the (microbatch, pass) a stage works on, or None in a bubble tick.

    Stage ``s`` at tick ``t`` works on item ``k = t - s`` when ``0 <= k < v * m``: microbatch
    ``k % m`` in pass ``k // m`` (GPipe is ``v = 1``). This is the rule `gpipe` and `circular`
    apply on the devices.

    **Arguments:** `p` stages, `m` microbatches, `v` layer groups per stage (all >= 1).

    **Returns:** a list of ``p`` rows of ``v * m + p - 1`` entries.

    Examples:
        >>> work_items(2, 2)  # GPipe, 2 stages, 2 microbatches
        [[(0, 0), (1, 0), None], [None, (0, 0), (1, 0)]]
    """
    _check_counts("work_items", p=p, m=m, v=v)
    ticks = v * m + p - 1
    return [
        [((t - s) % m, (t - s) // m) if 0 <= t - s < v * m else None for t in range(ticks)]
        for s in range(p)
    ]


def _check_counts(fn: str, **counts: int) -> None:
    what = {"p": "stages", "m": "microbatches", "v": "layer groups per stage"}
    for name, value in counts.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(
                f"{fn}: argument `{name}` must be a positive int (number of {what[name]}), "
                f"got {value!r}"
            )
