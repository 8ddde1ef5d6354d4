"""The pipeline schedules as objects, and the one place that looks them up by name (pure Python).

Each schedule `shardlib.pipeline` runs is one frozen `Schedule`: its name as the user writes
it (``'zb-h1'``), the function that runs it (``zb_h1``) and the named scope it runs under, its
route (the ring or the V), whether its backward splits into an input half B and a weight half
W, the layer groups a stage holds, the microbatches it needs, and whether it runs a tick table
(`shardlib._pipeline.tables`) or one formula of the tick (`shardlib.pipeline.work_items`). The
rest of the package asks a schedule these questions instead of testing its name: a test of a
schedule's name outside this module is a variant this registry forgot. No JAX here.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "CIRCULAR",
    "GPIPE",
    "INTERLEAVED",
    "ONE_F_ONE_B",
    "SCHEDULES",
    "ZB_H1",
    "ZB_V",
    "Schedule",
    "find",
    "names",
    "rules_for",
    "schedule_named",
    "schedule_scoped",
    "unregistered",
]


@dataclass(frozen=True)
class Schedule:
    """One pipeline schedule: what the arithmetic, the argument rules and the loop ask of it.

    Its step: with `tabled`, the tick table `shardlib._pipeline.tables.schedule_table` builds
    for it (its ticks, its bubble and its cost are the table's); otherwise the formula of
    `work_items`, stage ``s`` on item ``t - s`` for ``v * m`` items (``v * m + p - 1``
    ticks, a lockstep critical path of ``(m + (p - 1) / v)(t_f + t_b + t_w)``).
    """

    name: str  # as shardlib.pipeline takes it: 'zb-h1'
    function: str  # the shardlib.pipeline function that runs it, as messages name it: 'zb_h1'
    scope: str  # the NAME of the named scope it runs under (a Python identifier): 'zb_h1'
    tabled: bool = False  # runs a table of fused ticks (F, B, W); else one formula of the tick
    route: str = "ring"  # 'ring' or 'v' (`shardlib._pipeline.placement`)
    split: bool = False  # the backward splits into B (the input's cotangent) and W (weights)
    groups: int | None = 1  # layer groups (chunks) per stage it runs; None: any v >= 1
    needs_m_at_least_p: bool = False  # refuses fewer microbatches than stages
    fallback: str = ""  # with needs_m_at_least_p: the function to use with fewer

    @property
    def default_groups(self) -> int:
        """``v`` where the caller leaves it out: 2 for zb-v (always two chunks in a V), 1 for
        the others (circular and interleaved with one group are gpipe and 1f1b)."""
        return 1 if self.groups is None else self.groups

    @property
    def grouped(self) -> bool:
        """Whether its ``stage_params`` hold the stage's layer groups on a leading dim
        (``'v layers/p ...'``): circular, interleaved, zb-v."""
        return self.groups != 1

    @property
    def letters_passes(self) -> bool:
        """Whether its formula timeline names each cell's pass round the ring (``3b``)."""
        return not self.tabled and self.grouped


GPIPE = Schedule("gpipe", "gpipe", "gpipe")
CIRCULAR = Schedule("circular", "circular", "circular", groups=None, needs_m_at_least_p=True,
                    fallback="gpipe")  # fmt: skip
ONE_F_ONE_B = Schedule("1f1b", "one_f_one_b", "1f1b", tabled=True)
INTERLEAVED = Schedule("interleaved", "interleaved", "interleaved", tabled=True, groups=None,
                       needs_m_at_least_p=True, fallback="one_f_one_b")  # fmt: skip
ZB_H1 = Schedule("zb-h1", "zb_h1", "zb_h1", tabled=True, split=True)
ZB_V = Schedule("zb-v", "zb_v", "zb_v", tabled=True, route="v", split=True, groups=2)

# In the order messages list them.
SCHEDULES = (GPIPE, CIRCULAR, ONE_F_ONE_B, INTERLEAVED, ZB_H1, ZB_V)
_BY_NAME = {s.name: s for s in SCHEDULES}
_BY_SCOPE = {s.scope: s for s in SCHEDULES}


def names(*, tabled: bool | None = None) -> tuple[str, ...]:
    """The schedules' names, in order (``tabled``: only those that run a table, or not)."""
    return tuple(s.name for s in SCHEDULES if tabled is None or s.tabled == tabled)


def find(name: object) -> Schedule | None:
    """The schedule called ``name``, or None."""
    return _BY_NAME.get(name) if isinstance(name, str) else None


def schedule_named(name: object, fn: str) -> Schedule:
    """The schedule called ``name``; a ``ValueError`` naming ``fn`` and the schedules if none."""
    found = find(name)
    if found is None:
        raise ValueError(
            f"{fn}: `schedule` must be one of {', '.join(map(repr, names()))}, got {name!r}"
        )
    return found


def rules_for(name: object) -> Schedule:
    """The schedule called ``name``, or for a name that is none (refused later, once the
    counts are checked) `unregistered`'s, so that the count rules apply to it as they always
    have: `bubble_fraction` and `critical_path` check ``p``, ``m`` and ``v`` before the name."""
    found = find(name)
    return found if found is not None else unregistered(name)


def unregistered(name: object) -> Schedule:
    """A name no schedule has, as a schedule of one formula and one layer group."""
    return Schedule(str(name), str(name), str(name))


def schedule_scoped(scope: str) -> Schedule | None:
    """The schedule whose named scope carries ``scope`` (``'zb_h1'``), or None."""
    return _BY_SCOPE.get(scope)
