"""The tick tables of the memory-bounded schedules (1F1B, interleaved 1F1B, ZB-H1): pure Python.

A schedule that interleaves forward and backward work is not one formula of the tick, as
GPipe's is; it is a table. Each stage has its work in a fixed order (`_orders`: 1F1B's
warm-up, steady one-forward-one-backward and cool-down; Megatron's interleaved order; ZB-H1's
with each weight gradient ``W`` deferred), and `_simulate` runs it with one unit of work per
stage and tick (``T_F = T_B = T_W``), each unit at the first tick after the one it depends on:

- ``F``: the previous stage's forward of the item (stage 0's first group: none);
- ``B``: the next stage's backward of the item, or on the last stage in the last group its
  own forward (the loss);
- ``W`` (ZB-H1 only, where ``B`` gives only the input's cotangent): its own ``B``.

An item is ``(microbatch, group)``; it sits in three ring buffers of the stage: its input
(from arrival to its forward), its residuals (forward to last use) and its cotangent (arrival
to last use). `_slots` colours the live ranges so each buffer holds as few slots as the
table needs; the devices apply the table (`shardlib._pipeline.one_f_one_b`) and `timeline`
draws it. No JAX here.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

__all__ = [
    "IDLE",
    "KINDS",
    "Action",
    "Table",
    "bubble_fraction",
    "schedule_table",
    "table_timeline",
    "tick_count",
]

# Action kinds, as the devices branch on them (`lax.switch` index).
IDLE, FWD, FWD_LOSS, BWD, BWD_INPUT, WGRAD = range(6)
KINDS = ("idle", "F", "F+loss", "B", "B (input)", "W")
SCHEDULES = ("1f1b", "interleaved", "zb-h1")


@dataclass(frozen=True)
class Action:
    """What one stage does at one tick."""

    kind: int  # one of FWD, FWD_LOSS, BWD, BWD_INPUT, WGRAD
    microbatch: int
    group: int  # the layer group (pass round the ring); 0 without interleaving
    res: int  # residual slot
    inp: int  # input slot (-1: stage 0's first group reads the microbatch itself)
    ct: int  # cotangent slot


@dataclass(frozen=True)
class Table:
    """A whole schedule: ``actions[stage][tick]`` (None: idle) and what arrives when."""

    schedule: str
    p: int
    m: int
    v: int
    actions: tuple[tuple[Action | None, ...], ...]
    recv_fwd: tuple[tuple[int, ...], ...]  # [stage][tick]: input slot an activation enters, -1
    recv_bwd: tuple[tuple[int, ...], ...]  # [stage][tick]: cotangent slot one enters, -1
    slots: tuple[int, int, int]  # ring sizes: inputs, residuals, cotangents

    @property
    def ticks(self) -> int:
        return len(self.actions[0])

    def in_flight(self, stage: int) -> int:
        """Peak items whose residuals the stage holds at once (its activation memory)."""
        return _peak_residuals(self, stage)


def tick_count(schedule: str, p: int, m: int, v: int = 1) -> int:
    """The ticks the schedule's table takes, by its formula (``m >= p``).

    1F1B: ``2 (m + p - 1)``; interleaved: ``2 (v m + p - 1)``; ZB-H1: ``3 m + p - 1``. The
    tables take exactly these for every ``m >= p`` (``tests/test_pipeline_tables.py``); with
    fewer microbatches (1F1B and ZB-H1 only) a table may take longer, so `bubble_fraction`
    counts the table itself.
    """
    if schedule == "1f1b":
        return 2 * (m + p - 1)
    if schedule == "interleaved":
        return 2 * (v * m + p - 1)
    if schedule == "zb-h1":
        return 3 * m + p - 1
    raise ValueError(f"tick_count: `schedule` must be one of {SCHEDULES}, got {schedule!r}")


def bubble_fraction(schedule: str, p: int, m: int, v: int = 1) -> float:
    """The share of the table's ticks a stage idles (every stage idles as many), counted
    from `schedule_table`. For ``m >= p`` it is the formula's: work ``2 v m`` (``3 m`` for
    ZB-H1) of `tick_count` ticks; 1F1B: ``(p-1)/(m+p-1)``; interleaved: ``(p-1)/(v m+p-1)``;
    ZB-H1: ``(p-1)/(3m+p-1)``, a third of 1F1B's idle time at the same activation memory."""
    row = schedule_table(schedule, p, m, v).actions[0]
    return sum(a is None for a in row) / len(row)


def too_few_microbatches(fn: str, schedule: str, p: int, m: int) -> str | None:
    """Why ``schedule`` cannot run ``m`` microbatches on ``p`` stages, or None: circular and
    interleaved send a microbatch's output of one layer group back to stage 0 for the next,
    ``p`` ticks after it left, so they need ``m >= p``, as `shardlib.pipeline.circular` and
    `shardlib.pipeline.interleaved` say (here for ``fn``'s arguments ``p`` and ``m``)."""
    if schedule not in ("circular", "interleaved") or m >= p:
        return None
    other = "gpipe" if schedule == "circular" else "one_f_one_b"
    return (
        f"{fn}: argument `m` must be at least `p` for the {schedule} schedule (at least as "
        f"many microbatches as stages, p={p}), got m={m}; use more microbatches or {other}"
    )


@functools.cache
def schedule_table(schedule: str, p: int, m: int, v: int = 1) -> Table:
    """The tick table of ``schedule`` for ``p`` stages, ``m`` microbatches, ``v`` groups."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule_table: `schedule` must be one of {SCHEDULES}, got {schedule!r}")
    if schedule != "interleaved" and v != 1:
        raise ValueError(f"{schedule}: one layer group per stage, got v={v}")
    bad = too_few_microbatches("schedule_table", schedule, p, m)
    if bad is not None:
        raise ValueError(bad)
    done = _simulate(schedule, p, m, v)
    return _assign_slots(schedule, p, m, v, done)


@functools.cache
def forward_table(p: int, m: int, v: int = 1) -> Table:
    """Forwards only (no gradient wanted): each stage runs its items in schedule order as
    soon as their input has arrived; the last stage computes the loss."""
    return _assign_slots("forward", p, m, v, _simulate("forward", p, m, v))


def _orders(schedule: str, p: int, m: int, v: int) -> list[list[tuple[str, int, int]]]:
    """Each stage's work in the order it runs it: ``(kind, microbatch, group)``.

    1F1B: ``p - s`` forwards (warm-up), then backward ``k`` and forward ``k + p - s`` in
    turn, then the last backwards; stage ``s`` holds at most ``p - s`` items. ZB-H1: the
    same, with the weight gradient of item ``k - s`` after backward ``k`` (the last ``s``
    weight gradients close the stage's list), so every stage holds at most ``p`` items,
    1F1B's peak (Qi et al.'s ZB-H1 with ``T_F = T_B = T_W``). Interleaved: Megatron's order
    (forwards by chunks of microbatches, group by group; backwards with the groups
    reversed; `_chunks`) after a warm-up of ``(v - 1) c + 2 (p - s - 1) + 1`` forwards,
    ``c`` the first chunk's size (``p`` when ``p`` divides ``m``)."""
    chunks = _chunks(p, m)
    fwd = _by_chunks(chunks, range(v))
    bwd = _by_chunks(chunks, range(v - 1, -1, -1))
    if schedule == "forward":
        return [[("F", i, r) for i, r in fwd] for _ in range(p)]
    out = []
    for s in range(p):
        if schedule == "interleaved":
            warm = min((v - 1) * chunks[0] + 2 * (p - s - 1) + 1, m * v)
        else:
            warm = min(p - s, m)
        lag = s if schedule == "zb-h1" else None  # W of item k - s after B of item k
        ops = [("F", i, r) for i, r in fwd[:warm]]
        for k, (i, r) in enumerate(bwd):
            ops.append(("B", i, r))
            if lag is not None and k >= lag:
                ops.append(("W", *bwd[k - lag]))
            if warm + k < len(fwd):
                ops.append(("F", *fwd[warm + k]))
        if lag is not None:
            ops += [("W", *item) for item in bwd[max(0, len(bwd) - lag) :]]
        out.append(ops)
    return out


def _chunks(p: int, m: int) -> list[int]:
    """The sizes of the runs of consecutive microbatches the interleaved order takes group
    by group: ``m // p`` chunks (one if ``m < p``), as even as can be, the larger first.

    Megatron's chunks of ``p`` when ``p`` divides ``m``. Otherwise no chunk may be smaller
    than ``p`` (a microbatch's next group on stage 0 waits for its previous one to come
    round the ring of ``p`` stages) nor larger than the first (the warm-up, sized by the
    first chunk, must cover the forwards that a later chunk's first backwards wait for):
    Megatron's order with a short last chunk deadlocks. With these sizes every table runs
    in ``2 (v m + p - 1)`` ticks."""
    n = max(1, m // p)
    return [m // n + (k < m % n) for k in range(n)]


def _by_chunks(chunks: list[int], groups: range) -> list[tuple[int, int]]:
    """Items ``(microbatch, group)`` chunk by chunk, each chunk's items group by group."""
    out: list[tuple[int, int]] = []
    start = 0
    for size in chunks:
        out += [(i, r) for r in groups for i in range(start, start + size)]
        start += size
    return out


def _simulate(schedule: str, p: int, m: int, v: int) -> dict[tuple[str, int, int, int], int]:
    """``{(kind, stage, microbatch, group): tick}``: each stage runs its `_orders` list, an
    item at the first tick its dependency finished before (one unit of work per tick)."""
    orders = _orders(schedule, p, m, v)
    done: dict[tuple[str, int, int, int], int] = {}
    nxt = [0] * p
    t = 0
    while any(nxt[s] < len(orders[s]) for s in range(p)):
        for s in range(p):
            if nxt[s] < len(orders[s]):
                kind, i, r = orders[s][nxt[s]]
                dep = _dependency(kind, s, i, r, p, v)
                if dep is None or (dep in done and done[dep] < t):
                    done[(kind, s, i, r)] = t
                    nxt[s] += 1
        t += 1
        if t > 8 * (m * v + p) + 8:  # a bug in the orders, not a user error
            raise RuntimeError(f"{schedule}: the schedule does not finish (p={p} m={m} v={v})")
    return done


def _dependency(
    kind: str, s: int, i: int, r: int, p: int, v: int
) -> tuple[str, int, int, int] | None:
    """What must have finished (at an earlier tick) before ``kind`` of item (i, r) on s."""
    if kind == "F":
        if s > 0:
            return ("F", s - 1, i, r)
        return None if r == 0 else ("F", p - 1, i, r - 1)
    if kind == "W":
        return ("B", s, i, r)
    if s == p - 1 and r == v - 1:  # the loss: right after this stage's own forward
        return ("F", s, i, r)
    return ("B", s + 1, i, r) if s < p - 1 else ("B", 0, i, r + 1)


def _assign_slots(schedule: str, p: int, m: int, v: int, done: dict) -> Table:
    ticks = max(done.values()) + 1
    split = schedule == "zb-h1"
    acts: list[list[Action | None]] = [[None] * ticks for _ in range(p)]
    recv_f = [[-1] * ticks for _ in range(p)]
    recv_b = [[-1] * ticks for _ in range(p)]
    sizes = [1, 1, 1]
    for s in range(p):
        items = [(i, r) for i in range(m) for r in range(v)]
        f_at = {it: done[("F", s, *it)] for it in items}
        if schedule == "forward":
            last_use = b_at = f_at
        else:
            last_use = {it: done[("W" if split else "B", s, *it)] for it in items}
            b_at = {it: done[("B", s, *it)] for it in items}
        loss_here = {it: s == p - 1 and it[1] == v - 1 for it in items}
        arrive_f = {it: _arrival_f(done, s, it, p) for it in items}
        arrive_b = {
            it: f_at[it] if loss_here[it] or schedule == "forward" else _arrival_b(done, s, it, p)
            for it in items
        }
        inp = _slots({it: (a, f_at[it]) for it, a in arrive_f.items() if a is not None})
        res = _slots({it: (f_at[it], last_use[it]) for it in items})
        ct = _slots({it: (arrive_b[it], last_use[it]) for it in items})
        for k, used in enumerate((inp, res, ct)):
            sizes[k] = max(sizes[k], 1 + max(used.values(), default=0))
        for it in items:
            i, r = it
            a = Action(FWD_LOSS if loss_here[it] else FWD, i, r, res[it], inp.get(it, -1), ct[it])
            acts[s][f_at[it]] = a
            if arrive_f[it] is not None:
                recv_f[s][arrive_f[it]] = inp[it]
            if schedule == "forward":
                continue
            kind = BWD_INPUT if split else BWD
            acts[s][b_at[it]] = Action(kind, i, r, res[it], -1, ct[it])
            if split:
                acts[s][last_use[it]] = Action(WGRAD, i, r, res[it], -1, ct[it])
            if not loss_here[it]:
                recv_b[s][arrive_b[it]] = ct[it]
    return Table(
        schedule,
        p,
        m,
        v,
        tuple(map(tuple, acts)),
        tuple(map(tuple, recv_f)),
        tuple(map(tuple, recv_b)),
        (sizes[0], sizes[1], sizes[2]),
    )


def _arrival_f(done: dict, s: int, it: tuple[int, int], p: int) -> int | None:
    """The tick the item's input arrives at stage ``s`` (None: stage 0 reads microbatches)."""
    i, r = it
    if s > 0:
        return done[("F", s - 1, i, r)] + 1
    return None if r == 0 else done[("F", p - 1, i, r - 1)] + 1


def _arrival_b(done: dict, s: int, it: tuple[int, int], p: int) -> int:
    i, r = it
    up = ("B", s + 1, i, r) if s < p - 1 else ("B", 0, i, r + 1)
    return done[up] + 1


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
    held, peak = set(), 0
    for a in table.actions[stage]:
        if a is None:
            continue
        item = (a.microbatch, a.group)
        if a.kind in (FWD, FWD_LOSS):
            held.add(item)
        peak = max(peak, len(held))
        if a.kind == (WGRAD if table.schedule == "zb-h1" else BWD):
            held.discard(item)
    return peak


def table_timeline(table: Table) -> str:
    """The table as text: a cell is ``F3``, ``B3``, ``W3`` (microbatch 3; interleaved adds the
    group letter, ``F3b``), ``.`` idle; rows are stages, columns ticks."""
    cells = [[_cell(a, table.v) for a in row] for row in table.actions]
    width = 1 + max(max(len(c) for c in row) for row in cells)
    width = max(width, 1 + len(str(table.ticks - 1)))
    head = f"stage {table.p - 1}"
    lines = [f"{'tick':<{len(head)}}" + "".join(f"{t:>{width}}" for t in range(table.ticks))]
    for s, row in enumerate(cells):
        lines.append(f"{f'stage {s}':<{len(head)}}" + "".join(f"{c:>{width}}" for c in row))
    return "\n".join(line.rstrip() for line in lines)


def _cell(a: Action | None, v: int) -> str:
    if a is None:
        return "."
    letter = "F" if a.kind in (FWD, FWD_LOSS) else "W" if a.kind == WGRAD else "B"
    group = chr(ord("a") + a.group) if v > 1 else ""
    return f"{letter}{a.microbatch}{group}"
