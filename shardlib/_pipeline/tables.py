"""The tick tables of the memory-bounded schedules (1F1B, interleaved, ZB-H1, ZB-V): pure Python.

A schedule that interleaves forward and backward work is not one formula of the tick, as
GPipe's is; it is a table. The devices run it in lockstep (`shardlib._pipeline.table_loop`):
every tick ends with the shifts every stage joins, so a tick lasts as long as its busiest
stage. The tables are therefore *fused*: in one tick a stage may run one forward ``F``, one
backward ``B`` and (ZB-H1) one weight-gradient ``W``, in that order, so that the steady state
gives every stage a forward and a backward at every tick and the lockstep critical path (the
sum over ticks of the busiest stage's work, `Table.cost`) is the asynchronous schedule's:

- 1F1B: the forward of microbatch ``j`` on stage ``s`` at tick ``j + s``, its backward at
  tick ``j + 2p - 2 - s`` (the last stage runs both in one tick, the loss between them):
  ``m + 2p - 2`` ticks whose critical path is GPipe's ``(m + p - 1)(T_F + T_B)``; stage ``s``
  holds at most ``2 (p - s) - 1`` microbatches (``min`` with ``m``), flat in ``m``.
- Interleaved: the items ``(microbatch, group)`` in Megatron's order, forward
  item ``k`` at tick ``k + s``, backward item ``k`` at ``k + D - s`` with ``D`` the least
  delay every item's loss allows: critical path ``(m + (p - 1) / v)(T_F + T_B)``.
- ZB-H1: 1F1B's ``F`` and ``B`` (the input's cotangent only), each ``W`` placed in the
  first tick from its ``B`` on where it makes no tick longer, or at
  its deadline, ``p - 1`` ticks after its ``B`` (memory stays flat): critical path below
  1F1B's when ``T_W > 0``.
- ZB-V: two chunks per stage in a V, ``W`` as ZB-H1's: critical path below ZB-H1's.

Where each piece goes is `shardlib._pipeline.placement`'s; this module lays the pieces out
as the devices index them. An item sits in three ring buffers of the stage: its input (from arrival to its forward),
its residuals (forward to last use) and its cotangent (arrival to last use). `_slots`
colours the live ranges so each buffer holds as few slots as the table needs. No JAX here.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from .arguments import group_count_error, too_few_microbatches
from .placement import FROM_NEXT, FROM_PREV, Placement, dependency, lay_out, loss_here
from .placement import source as _source
from .registry import find, names

__all__ = [
    "IDLE",
    "KINDS",
    "Action",
    "Table",
    "forward_table",
    "gpipe_cost",
    "schedule_table",
    "table_timeline",
]

# Action kinds, as the devices branch on them (`lax.switch` index within the tick's part).
IDLE, FWD, FWD_LOSS, BWD, BWD_INPUT, WGRAD = range(6)
KINDS = ("idle", "F", "F+loss", "B", "B (input)", "W")
_PART = {FWD: 0, FWD_LOSS: 0, BWD: 1, BWD_INPUT: 1, WGRAD: 2}  # a tick's parts, in order


@dataclass(frozen=True)
class Action:
    """One piece of one stage's work at one tick."""

    kind: int  # one of FWD, FWD_LOSS, BWD, BWD_INPUT, WGRAD
    microbatch: int
    group: int  # the layer group (pass round the ring); 0 without interleaving
    res: int  # residual slot
    inp: int  # input slot (-1: stage 0's first group reads the microbatch itself)
    ct: int  # cotangent slot

    @property
    def part(self) -> int:
        """0: the tick's forward, 1: its backward, 2: its weight gradient."""
        return _PART[self.kind]


@dataclass(frozen=True)
class Table:
    """A whole schedule: ``actions[stage][tick]`` (the tick's work in part order, empty: idle)
    and what arrives when."""

    schedule: str
    p: int
    m: int
    v: int
    actions: tuple[tuple[tuple[Action, ...], ...], ...]
    recv_fwd: tuple[tuple[int, ...], ...]  # [stage][tick]: input slot an activation enters, -1
    recv_bwd: tuple[tuple[int, ...], ...]  # [stage][tick]: cotangent slot one enters, -1
    slots: tuple[int, int, int]  # ring sizes: inputs, residuals, cotangents
    # [stage][tick]: where what enters comes from (`placement.FROM_PREV`, ...), and whether
    # the tick sends its forward output to the stage before and its cotangent to the one
    # after (the V's chunk 1), not the other way round.
    fwd_from: tuple[tuple[int, ...], ...] = ()
    bwd_from: tuple[tuple[int, ...], ...] = ()
    reverse: tuple[tuple[bool, ...], ...] = ()
    route: str = "ring"  # the schedule's route, "ring" or "v" (`placement`)
    split: bool = False  # whether each backward is split into B and W (ZB-H1, ZB-V)

    @property
    def ticks(self) -> int:
        return len(self.actions[0])

    def in_flight(self, stage: int) -> int:
        """Peak items whose residuals the stage holds at once (its activation memory)."""
        return _peak_residuals(self, stage)

    def part(self, stage: int, tick: int, part: int) -> Action | None:
        """The stage's forward (0), backward (1) or weight gradient (2) at ``tick``."""
        return next((a for a in self.actions[stage][tick] if a.part == part), None)

    def cost(self, t_f: float = 1.0, t_b: float = 1.0, t_w: float = 1.0) -> float:
        """The lockstep critical path: the sum over ticks of the busiest stage's work, with a
        stage's whole forward taking ``t_f``, the input half of its backward ``t_b`` and the
        weight half ``t_w`` (a group's ``1 / v`` of them; a ``B`` that is not split costs
        ``t_b + t_w``). Shifts and bookkeeping are not counted."""
        unit = _unit_times(t_f, t_b, t_w)
        busiest = (max(sum(unit[a.kind] for a in row[t]) for row in self.actions)
                   for t in range(self.ticks))  # fmt: skip
        return sum(busiest) / self.v

    def async_cost(self, t_f: float = 1.0, t_b: float = 1.0, t_w: float = 1.0) -> float:
        """The makespan of the same per-stage order run without lockstep: each piece of work
        starts when its stage is free and what it depends on is done (no transfer time)."""
        unit = _unit_times(t_f, t_b, t_w)
        orders = [[a for cell in row for a in cell] for row in self.actions]
        end: dict[tuple[str, int, int, int], float] = {}
        free, nxt = [0.0] * self.p, [0] * self.p
        while any(nxt[s] < len(orders[s]) for s in range(self.p)):
            moved = False
            for s in range(self.p):
                while nxt[s] < len(orders[s]):
                    a = orders[s][nxt[s]]
                    dep = dependency(self.route, _letter(a.kind), s, a.microbatch, a.group,
                                     self.p, self.v)  # fmt: skip
                    if dep is not None and dep not in end:
                        break
                    start = max(free[s], end.get(dep, 0.0) if dep else 0.0)
                    free[s] = start + unit[a.kind] / self.v
                    end[(_letter(a.kind), s, a.microbatch, a.group)] = free[s]
                    nxt[s] += 1
                    moved = True
            if not moved:  # a bug in the table, not a user error
                raise RuntimeError(f"{self.schedule}: the table's order deadlocks")
        return max(free)


def _unit_times(t_f: float, t_b: float, t_w: float) -> dict[int, float]:
    """Each action kind's time: a backward that is not split costs ``t_b + t_w``."""
    return {FWD: t_f, FWD_LOSS: t_f, BWD: t_b + t_w, BWD_INPUT: t_b, WGRAD: t_w}


def gpipe_cost(p: int, m: int, t_f: float = 1.0, t_b: float = 1.0, t_w: float = 1.0) -> float:
    """GPipe's critical path: ``(m + p - 1)(t_f + t_b + t_w)``."""
    return (m + p - 1) * (t_f + t_b + t_w)


@functools.cache
def schedule_table(schedule: str, p: int, m: int, v: int = 1) -> Table:
    """The tick table of ``schedule`` for ``p`` stages, ``m`` microbatches, ``v`` groups."""
    s = find(schedule)
    if s is None or not s.tabled:
        tabled = names(tabled=True)
        raise ValueError(f"schedule_table: `schedule` must be one of {tabled}, got {schedule!r}")
    bad = group_count_error("schedule_table", s, v)
    if bad:
        raise ValueError(bad)
    bad = too_few_microbatches("schedule_table", s, p, m)
    if bad is not None:
        raise ValueError(bad)
    done = lay_out(s.route, p, m, v, backward=True, split=s.split)
    return _assign_slots(s.name, p, m, v, done, route=s.route, split=s.split)


@functools.cache
def forward_table(p: int, m: int, v: int = 1, route: str = "ring") -> Table:
    """Forwards only (no gradient wanted), on the ``route`` of the training table: its
    forwards at the same ticks; the stage of the loss computes it."""
    name = "forward-v" if route == "v" else "forward"
    done = lay_out(route, p, m, v, backward=False, split=False)
    return _assign_slots(name, p, m, v, done, route=route, split=False, backward=False)


def _letter(kind: int) -> str:
    return "F" if kind in (FWD, FWD_LOSS) else "W" if kind == WGRAD else "B"


def _assign_slots(schedule: str, p: int, m: int, v: int, done: Placement, *, route: str,
                  split: bool, backward: bool = True) -> Table:  # fmt: skip
    ticks = max(done.values()) + 1
    cells: list[list[list[Action]]] = [[[] for _ in range(ticks)] for _ in range(p)]
    recv = {k: [[-1] * ticks for _ in range(p)] for k in "FB"}
    came = {
        "F": [[FROM_PREV] * ticks for _ in range(p)],
        "B": [[FROM_NEXT] * ticks for _ in range(p)],
    }
    sizes = [1, 1, 1]
    for s in range(p):
        work = _stage_work(p, m, v, s, done, route=route, split=split, backward=backward)
        for k, used in enumerate(work.rings):
            sizes[k] = max(sizes[k], 1 + max(used.values(), default=0))
        for tick, action in work.actions:
            cells[s][tick].append(action)
        for kind, tick, slot, src in work.arrivals:
            recv[kind][s][tick], came[kind][s][tick] = slot, src
    acts = tuple(tuple(tuple(sorted(c, key=lambda a: a.part)) for c in row) for row in cells)
    rows = lambda grid: tuple(map(tuple, grid))  # noqa: E731
    return Table(
        schedule, p, m, v, acts, rows(recv["F"]), rows(recv["B"]), (sizes[0], sizes[1], sizes[2]),
        rows(came["F"]), rows(came["B"]),
        tuple(_directions(schedule, route, row) for row in acts), route, split,
    )  # fmt: skip


@dataclass
class _StageWork:
    """One stage's part of a table: its actions by tick, what arrives when (kind, tick,
    slot, source), and its three rings' slots by item."""

    actions: list[tuple[int, Action]]
    arrivals: list[tuple[str, int, int, int]]
    rings: tuple[dict[tuple[int, int], int], ...]


def _stage_work(p: int, m: int, v: int, s: int, done: Placement, *, route: str, split: bool,
                backward: bool) -> _StageWork:  # fmt: skip
    forward_only = not backward
    items = [(i, r) for i in range(m) for r in range(v)]
    f_at = {it: done[("F", s, *it)] for it in items}
    b_at = f_at if forward_only else {it: done[("B", s, *it)] for it in items}
    last = {it: done[("W", s, *it)] for it in items} if split else b_at
    came_f = {it: _came(done, route, "F", s, it, p, v) for it in items}
    came_b = {it: None if forward_only else _came(done, route, "B", s, it, p, v) for it in items}
    inp = _slots({it: (c[0], f_at[it]) for it, c in came_f.items() if c is not None})
    res = _slots({it: (f_at[it], last[it]) for it in items})
    ct = _slots({it: (f_at[it] if c is None else c[0], last[it]) for it, c in came_b.items()})
    actions: list[tuple[int, Action]] = []
    arrivals: list[tuple[str, int, int, int]] = []
    for it in items:
        i, r = it
        kind = FWD_LOSS if loss_here(route, s, r, p, v) else FWD
        actions.append((f_at[it], Action(kind, i, r, res[it], inp.get(it, -1), ct[it])))
        if (got := came_f[it]) is not None:
            arrivals.append(("F", got[0], inp[it], got[1]))
        if forward_only:
            continue
        kind = BWD_INPUT if split else BWD
        actions.append((b_at[it], Action(kind, i, r, res[it], -1, ct[it])))
        if split:
            actions.append((last[it], Action(WGRAD, i, r, res[it], -1, ct[it])))
        if (got := came_b[it]) is not None:
            arrivals.append(("B", got[0], ct[it], got[1]))
    return _StageWork(actions, arrivals, (inp, res, ct))


def _came(done: Placement, route: str, kind: str, s: int, it: tuple[int, int], p: int,
          v: int) -> tuple[int, int] | None:  # fmt: skip
    """The tick an item's input (``kind`` F) or cotangent (B) arrives at stage ``s`` (the
    tick after the piece that makes it) and from where; None: the stage makes it itself
    (stage 0's microbatches, the loss's cotangent)."""
    found = _source(route, kind, s, *it, p, v)
    return None if found is None else (done[found[0]] + 1, found[1])


def _directions(schedule: str, route: str, row: tuple[tuple[Action, ...], ...]
                ) -> tuple[bool, ...]:  # fmt: skip
    """Per tick, whether the stage sends its forward output to the stage before and its
    cotangent to the stage after: the V's chunk 1 (its forward output goes back up the V,
    its cotangent down). `placement` puts a stage's two chunks on ticks of opposite
    parity, so no tick has one of each; an order that did would be a bug."""
    if route != "v":
        return (False,) * len(row)
    out = []
    for cell in row:
        groups = {a.group for a in cell if a.part < 2}
        if len(groups) > 1:
            raise RuntimeError(f"{schedule}: a tick sends two blocks the same way: {cell}")
        out.append(groups == {1})
    return tuple(out)


def _slots(live: dict[tuple[int, int], tuple[int, int]]) -> dict[tuple[int, int], int]:
    """Ring slots for items live over ``[start, end]`` ticks: a slot is reused only after
    its last item's end (strictly before the next start), fewest slots first."""
    free_at: list[int] = []
    out: dict[tuple[int, int], int] = {}
    for it, (start, end) in sorted(live.items(), key=lambda kv: kv[1]):
        for k, busy_until in enumerate(free_at):
            if busy_until < start:
                free_at[k] = end
                out[it] = k
                break
        else:
            out[it] = len(free_at)
            free_at.append(end)
    return out


def _peak_residuals(table: Table, stage: int) -> int:
    held: set[tuple[int, int]] = set()
    peak = 0
    last = WGRAD if table.split else BWD
    for cell in table.actions[stage]:
        for a in cell:
            if a.kind in (FWD, FWD_LOSS):
                held.add((a.microbatch, a.group))
        peak = max(peak, len(held))
        for a in cell:
            if a.kind == last:
                held.discard((a.microbatch, a.group))
    return peak


def table_timeline(table: Table) -> str:
    """The table as text: a cell is the tick's work, ``F3`` (forward of microbatch 3),
    ``F3B1`` (and the backward of microbatch 1), ``B1W0`` (ZB-H1's weight gradient);
    interleaved adds the group letter (``F3b``); ``.`` idle. Rows are stages, columns ticks."""
    cells = [["".join(_cell(a, table.v) for a in c) or "." for c in row] for row in table.actions]
    width = 1 + max(max(len(c) for c in row) for row in cells)
    width = max(width, 1 + len(str(table.ticks - 1)))
    head = f"stage {table.p - 1}"
    lines = [f"{'tick':<{len(head)}}" + "".join(f"{t:>{width}}" for t in range(table.ticks))]
    for s, row in enumerate(cells):
        lines.append(f"{f'stage {s}':<{len(head)}}" + "".join(f"{c:>{width}}" for c in row))
    return "\n".join(line.rstrip() for line in lines)


def _cell(a: Action, v: int) -> str:
    group = chr(ord("a") + a.group) if v > 1 else ""
    return f"{_letter(a.kind)}{a.microbatch}{group}"
