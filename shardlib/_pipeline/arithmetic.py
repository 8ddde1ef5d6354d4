"""The arithmetic of the pipeline schedules: bubble fractions, timelines, work items (pure Python).

`work_items` is the rule `shardlib.pipeline`'s gpipe and circular apply on the devices,
`timeline` draws it (and the tables of the others, `shardlib._pipeline.tables`), and
`bubble_fraction` counts the idle share of the step, the one count `shardlib.explain` reports
too (`idle_share`). Public names are re-exported by `shardlib.pipeline`. Every schedule is
asked through `shardlib._pipeline.registry`; the rules the counts keep are
`shardlib._pipeline.arguments`'. No JAX here.
"""

from __future__ import annotations

from .arguments import check_counts, check_enough, group_count_error
from .registry import CIRCULAR, Schedule, rules_for, schedule_named
from .tables import schedule_table, table_timeline

__all__ = [
    "bubble_fraction",
    "circular_bubble_fraction",
    "gpipe_bubble_fraction",
    "idle_share",
    "tick_count",
    "timeline",
    "work_items",
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
    p, m = check_counts("gpipe_bubble_fraction", p=p, m=m)
    return (p - 1) / (m + p - 1)


def circular_bubble_fraction(p: int, m: int, v: int) -> float:
    """The fraction of the circular schedule's ticks in which a stage is idle.

    ``(p - 1) / (v * m + p - 1)``: the schedule runs ``v * m + p - 1`` ticks, each stage works
    on ``v * m`` of them (each microbatch once per layer group it holds) and idles ``p - 1``.
    With ``v = 1`` it is GPipe's.

    **Arguments:** `p` stages, `m` microbatches (``m >= p``, as `circular` needs), `v`
    layer groups per stage (all >= 1).

    **Returns:** a float in ``[0, 1)``.

    **Raises:** ``ValueError`` for ``m < p``, which `circular` refuses.

    Examples:
        >>> circular_bubble_fraction(4, 8, 2)  # 3 idle ticks out of 19
        0.15789473684210525
    """
    p, m, v = check_counts("circular_bubble_fraction", p=p, m=m, v=v)
    check_enough("circular_bubble_fraction", CIRCULAR, p, m)
    return (p - 1) / (v * m + p - 1)


def timeline(schedule: str, p: int, m: int, v: int | None = None) -> str:
    """What each stage works on at each tick, as a text table (bubbles ``.``).

    Rows are stages, columns ticks. For ``'gpipe'`` and ``'circular'`` a cell is the
    microbatch index of the forward (``jax.grad`` runs the picture backwards), with a letter
    for the pass round the ring in the circular schedule (``a`` the first layer group...).
    For the others a cell is the tick's work, fused: ``F3`` (forward of microbatch 3), ``B3``
    (its backward; zero bubble: the input cotangent), ``W3`` (the weight gradient), or several
    at once (``F4B0``, ``F5B1W0``), with the group letter where a stage holds several (``F3b``).

    **Arguments:** `schedule` one of ``'gpipe'``, ``'circular'``, ``'1f1b'``,
    ``'interleaved'``, ``'zb-h1'``, ``'zb-v'``; `p` stages; `m` microbatches; `v` layer groups
    per stage (None: 2 for ``'zb-v'``, which always has two chunks, else 1).

    **Returns:** the table, one line per stage after a header of tick numbers.

    **Raises:** ``ValueError`` for what the schedule itself refuses: ``m < p`` for
    ``'circular'`` and ``'interleaved'``, ``v != 2`` for zb-v, ``v > 1`` for the others.
    Examples:
        >>> print(timeline('gpipe', 2, 3))
        tick     0  1  2  3
        stage 0  0  1  2  .
        stage 1  .  0  1  2
        >>> print(timeline('1f1b', 2, 2))
        tick       0    1    2    3
        stage 0   F0   F1   B0   B1
        stage 1    . F0B0 F1B1    .
    """
    s = schedule_named(schedule, "timeline")
    p, m, v = check_counts("timeline", p=p, m=m, v=s.default_groups if v is None else v)
    bad = group_count_error("timeline", s, v)
    if bad:
        raise ValueError(bad)
    check_enough("timeline", s, p, m)
    if s.tabled:
        return table_timeline(schedule_table(s.name, p, m, v))
    rows = _items(p, m, v)
    ticks = len(rows[0])
    cell = 2 + max(len(str(ticks - 1)), len(str(m - 1)) + s.letters_passes)

    def label(item: tuple[int, int] | None) -> str:
        if item is None:
            return "."
        mb, r = item
        return f"{mb}{chr(ord('a') + r)}" if s.letters_passes else str(mb)

    width = len(f"stage {p - 1}")
    lines = [f"{'tick':<{width}}" + "".join(f"{t:>{cell}}" for t in range(ticks))]
    for k, row in enumerate(rows):
        lines.append(f"{f'stage {k}':<{width}}" + "".join(f"{label(i):>{cell}}" for i in row))
    return "\n".join(line.rstrip() for line in lines)


def bubble_fraction(schedule: str, p: int, m: int, v: int | None = None) -> float:
    """The share of the step a stage idles under ``schedule`` (at ``T_F = T_B = T_W``, see
    `critical_path`): ``gpipe`` and ``1f1b`` ``(p-1)/(m+p-1)``; ``circular`` and
    ``interleaved`` ``(p-1)/(v m+p-1)``; ``zb-h1`` less than 1F1B (``2 (p-1)/(3 m+2 (p-1))``
    for ``m >= p``): one less the stage's work over the lockstep critical path.

    **Arguments:** `schedule` as for `timeline`; `p`, `m`, `v` (all >= 1; `v` as `timeline`'s).

    **Returns:** a float in ``[0, 1)``.

    **Raises:** ``ValueError`` as `timeline` does (``m < p`` for ``'circular'`` and
    ``'interleaved'``, which refuse it).

    Examples:
        >>> bubble_fraction('zb-h1', 4, 8)  # 6 idle units of 30
        0.2
    """
    rules = rules_for(schedule)  # the name is refused after the counts, as it always was
    v = rules.default_groups if v is None else v
    p, m, v = check_counts("bubble_fraction", p=p, m=m, v=v)
    check_enough("bubble_fraction", rules, p, m)
    bad = group_count_error("bubble_fraction", rules, v)
    if bad:
        raise ValueError(bad)
    return idle_share(schedule_named(schedule, "bubble_fraction"), p, m, v)


def idle_share(schedule: Schedule, p: int, m: int, v: int) -> float:
    """`bubble_fraction` of checked arguments: ``(p - 1) / (v m + p - 1)`` for a schedule of
    one formula, for a tabled one one less the stage's work ``m (T_F + T_B + T_W)`` over its
    table's lockstep critical path (`shardlib._pipeline.tables.Table.cost`)."""
    if schedule.tabled:
        cost = schedule_table(schedule.name, p, m, v).cost()
        return (cost - 3 * m) / cost
    return (p - 1) / tick_count(schedule, p, m, v)


def tick_count(schedule: Schedule, p: int, m: int, v: int) -> int:
    """Iterations of the schedule's loop: ``v * m + p - 1`` for a schedule of one formula,
    its table's length for the others."""
    if schedule.tabled:
        return schedule_table(schedule.name, p, m, v).ticks
    return v * m + p - 1


def work_items(p: int, m: int, v: int = 1) -> list[list[tuple[int, int] | None]]:
    """``[stage][tick]``: the (microbatch, pass) a stage works on, or None in a bubble tick.

    Stage ``s`` at tick ``t`` works on item ``k = t - s`` when ``0 <= k < v * m``: microbatch
    ``k % m`` in pass ``k // m`` (GPipe is ``v = 1``). This is the rule `gpipe` and `circular`
    apply on the devices.

    **Arguments:** `p` stages, `m` microbatches, `v` layer groups per stage (all >= 1;
    ``m >= p`` when ``v > 1``, as `circular` needs).

    **Returns:** a list of ``p`` rows of ``v * m + p - 1`` entries.

    **Raises:** ``ValueError`` for ``v > 1`` with ``m < p``: `circular` refuses it (pass
    ``v`` of microbatch ``i`` would start on stage 0 before its pass ``v - 1`` has left the
    last stage).

    Examples:
        >>> work_items(2, 2)  # GPipe, 2 stages, 2 microbatches
        [[(0, 0), (1, 0), None], [None, (0, 0), (1, 0)]]
    """
    p, m, v = check_counts("work_items", p=p, m=m, v=v)
    if v > 1:
        check_enough("work_items", CIRCULAR, p, m)
    return _items(p, m, v)


def _items(p: int, m: int, v: int) -> list[list[tuple[int, int] | None]]:
    ticks = v * m + p - 1
    return [
        [((t - s) % m, (t - s) // m) if 0 <= t - s < v * m else None for t in range(ticks)]
        for s in range(p)
    ]
