"""The cost model of the pipeline schedules: critical paths in units of T_F, T_B, T_W (pure Python).

A schedule runs in lockstep on the devices: every tick ends with transfers every stage joins,
so a tick lasts as long as its busiest stage, and the step is the sum over ticks of the
busiest stage's work (`shardlib._pipeline.tables.Table.cost`). `critical_path` gives that
next to the same per-stage order run without lockstep (each piece of work as soon as its
stage is free and its input has come, no transfer time) and next to GPipe at the same ``p``
and ``m``, for per-unit times a user measures or assumes: ``t_f`` a stage's forward (all its
layers), ``t_b`` the input half of its backward, ``t_w`` the weight half (the whole backward
is ``t_b + t_w``; the default 1 : 1 : 1 is the zero-bubble paper's). No JAX here.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

from .arguments import check_counts, check_enough, group_count_error
from .registry import Schedule, rules_for, schedule_named
from .tables import gpipe_cost, schedule_table

__all__ = ["CriticalPath", "cost_of", "critical_path", "path_of"]


@dataclass(frozen=True)
class CriticalPath:
    """One schedule's step in the cost model's units (see `critical_path`)."""

    lockstep: float  # as the devices run it: the sum over ticks of the busiest stage's work
    asynchronous: float  # the same order without lockstep (the schedule's ideal)
    gpipe: float  # GPipe's at the same p and m: (m + p - 1)(t_f + t_b + t_w)

    @property
    def against_gpipe(self) -> float:
        """``lockstep / gpipe``: above 1, the schedule's ticks cost more than GPipe's."""
        return self.lockstep / self.gpipe


def critical_path(
    schedule: str, p: int, m: int, v: int | None = None, *, t_f: float = 1.0, t_b: float = 1.0,
    t_w: float = 1.0,
) -> CriticalPath:  # fmt: skip
    """The step of ``schedule`` in the cost model: lockstep, without lockstep, and GPipe's.

    The devices run every schedule in lockstep ticks, each as long as its busiest stage. A
    stage's forward takes ``t_f``, the input half of its backward ``t_b``, the weight half
    ``t_w`` (measure them, or keep the 1 : 1 : 1 of the zero-bubble paper). GPipe:
    ``(m + p - 1)(t_f + t_b + t_w)``; circular: ``(m + (p - 1) / v)`` times the same; 1F1B:
    GPipe's (its fused ticks give each stage a forward and a backward at once); interleaved:
    circular's; ZB-H1 and ZB-V: below 1F1B's whenever ``t_w > 0`` (weight halves fill the
    ticks a backward elsewhere makes long), a few units above the same order run without
    lockstep (``asynchronous``).

    **Arguments:** `schedule` as for `timeline`; `p`, `m`, `v` as for `bubble_fraction` (`v`
    None: 2 for ``'zb-v'``, else 1);
    `t_f`, `t_b`, `t_w` non-negative times (any unit; the result is in the same unit).

    **Returns:** a `CriticalPath` (``lockstep``, ``asynchronous``, ``gpipe``,
    ``against_gpipe``).

    **Raises:** ``ValueError`` as `bubble_fraction` does, and for a negative time.

    Examples:
        >>> critical_path('1f1b', 4, 8).against_gpipe
        1.0
        >>> critical_path('zb-h1', 4, 8)
        CriticalPath(lockstep=30.0, asynchronous=29.0, gpipe=33.0)
    """
    rules = rules_for(schedule)  # the name is refused after the counts, as it always was
    v = rules.default_groups if v is None else v
    p, m, v = check_counts("critical_path", p=p, m=m, v=v)
    check_enough("critical_path", rules, p, m)
    for name, t in (("t_f", t_f), ("t_b", t_b), ("t_w", t_w)):
        if isinstance(t, bool) or not isinstance(t, numbers.Real) or not 0 <= t < math.inf:
            raise ValueError(
                f"critical_path: argument `{name}` must be a finite time >= 0, got {t!r}"
            )
    if t_f + t_b + t_w <= 0:
        raise ValueError(
            f"critical_path: arguments `t_f`, `t_b`, `t_w` must not all be 0, got "
            f"{t_f!r}, {t_b!r}, {t_w!r}"
        )
    s = schedule_named(schedule, "critical_path")
    bad = group_count_error("critical_path", s, v)
    if bad:
        raise ValueError(bad)
    return cost_of(s, p, m, v, (float(t_f), float(t_b), float(t_w)))


def path_of(
    schedule: str, p: int, m: int, v: int, times: tuple[float, float, float]
) -> CriticalPath:
    """`critical_path` of checked arguments (``schedule`` by name, ``times``: ``t_f, t_b,
    t_w``)."""
    return cost_of(schedule_named(schedule, "path_of"), p, m, v, times)


def cost_of(
    schedule: Schedule, p: int, m: int, v: int, times: tuple[float, float, float]
) -> CriticalPath:
    """`critical_path` of checked arguments: a tabled schedule's from its table, a formula
    schedule's ``(m + (p - 1) / v)(t_f + t_b + t_w)`` (GPipe's with ``v = 1``)."""
    gpipe = gpipe_cost(p, m, *times)
    if schedule.tabled:
        table = schedule_table(schedule.name, p, m, v)
        return CriticalPath(table.cost(*times), table.async_cost(*times), gpipe)
    if schedule.grouped:
        loop = (m + (p - 1) / v) * sum(times)
        return CriticalPath(loop, loop, gpipe)
    return CriticalPath(gpipe, gpipe, gpipe)
