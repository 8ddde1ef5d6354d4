"""The tick tables of the memory-bounded schedules, checked as schedules and against the cost model.

`check_schedule` replays a table the way the devices run it (`shardlib._pipeline.table_loop`):
at each tick every stage first stores what its neighbours sent at the end of the tick before
(the forward output one stage on, the input cotangent one stage back; interleaved wraps round
the ring) into the ring slot the table names, then runs the tick's parts in order: its forward
``F``, its backward ``B`` (ZB-H1: the input half), its weight gradient ``W`` (ZB-H1), each
reading its input, residual and cotangent slots. It asserts that every slot read holds the
item the work is about, that no slot is overwritten while still needed and each ring is as
small as the table needs, that every piece of work runs exactly once and after what it
depends on (``F`` after the previous stage's ``F`` at an earlier tick, stage 0's next group
after the last stage's previous one; ``B`` after the upstream ``B`` at an earlier tick, or on
the last stage of the last group after its own ``F``, the same tick allowed; ``W`` after its
own ``B``, the same tick allowed).

Sweeps: every ``p`` in 1..5, ``m`` in ``1..3p+1`` (1F1B, ZB-H1) or ``p..3p+1`` with ``v`` in
1..4 (interleaved), and a seeded sample of larger cases. The cost model (`Table.cost`, the
lockstep critical path) for ``p`` in 1..8: 1F1B's is GPipe's for any times, interleaved's
circular's, ZB-H1's ``3m + 2(p - 1)`` and below 1F1B's; the residuals each stage holds, flat
in ``m``. ``m < p`` refused by the drawing functions as by the schedules.
"""

from __future__ import annotations

import dataclasses
import math
import random

import numpy as np
import pytest

from shardlib import pipeline
from shardlib._pipeline.placement import FROM_NEXT, FROM_PREV, place
from shardlib._pipeline.placement import chunks as _chunks
from shardlib._pipeline.tables import (
    BWD,
    BWD_INPUT,
    FWD,
    FWD_LOSS,
    WGRAD,
    Action,
    Table,
    forward_table,
    gpipe_cost,
    schedule_table,
)

FORWARD_KINDS = (FWD, FWD_LOSS)
BACKWARD_KINDS = (BWD, BWD_INPUT)
Item = tuple[int, int]  # (microbatch, group)


def _letter(kind: int) -> str:
    return "F" if kind in FORWARD_KINDS else "W" if kind == WGRAD else "B"


def _in_part(cell: tuple[Action, ...], kinds: tuple[int, ...]) -> Action | None:
    """The cell's one piece of work of ``kinds`` (None: none)."""
    found = [a for a in cell if a.kind in kinds]
    assert len(found) <= 1, cell
    return found[0] if found else None


def _sent_forward(table: Table, src: int, tick: int) -> Item | None:
    """The item whose activation stage ``src`` sends on at the end of ``tick`` (None: none)."""
    a = _in_part(table.actions[src][tick], FORWARD_KINDS)
    if a is None:
        return None
    if src < table.p - 1:
        return (a.microbatch, a.group)
    if a.group + 1 < table.v:  # round the ring to stage 0, the next group
        return (a.microbatch, a.group + 1)
    return None


def _sent_backward(table: Table, src: int, tick: int) -> Item | None:
    """The item whose cotangent stage ``src`` sends back at the end of ``tick`` (None: none)."""
    a = _in_part(table.actions[src][tick], BACKWARD_KINDS)
    if a is None:
        return None
    if src > 0:
        return (a.microbatch, a.group)
    if a.group > 0:  # from stage 0 back round the ring to the last stage, the group before
        return (a.microbatch, a.group - 1)
    return None


def check_schedule(table: Table, *, train: bool = True) -> None:
    """Assert that ``table`` is a valid schedule (see the module docstring)."""
    p, m, v, ticks = table.p, table.m, table.v, table.ticks
    where = f"{table.schedule} p={p} m={m} v={v}"
    split = table.schedule == "zb-h1"
    backward_kind = BWD_INPUT if split else BWD
    grids = (table.actions, table.recv_fwd, table.recv_bwd, table.fwd_from, table.bwd_from)
    assert all(len(g) == p and all(len(row) == ticks for row in g) for g in grids), where
    assert not any(any(row) for row in table.reverse), f"{where}: a ring sends nothing back"
    bufs = ("inp", "res", "ct")
    sizes = dict(zip(bufs, table.slots, strict=True))
    held: list[dict[str, dict[int, Item]]] = [{b: {} for b in bufs} for _ in range(p)]
    peak = dict.fromkeys(bufs, 0)  # the most items a ring of one stage holds at once
    at: dict[tuple[str, int, int, int], int] = {}

    def store(s: int, buf: str, slot: int, item: Item, t: int) -> None:
        assert 0 <= slot < sizes[buf], f"{where}: stage {s} tick {t}: {buf} slot {slot}"
        old = held[s][buf].get(slot)
        assert old is None, f"{where}: stage {s} tick {t}: {buf} slot {slot} overwrites {old}"
        held[s][buf][slot] = item
        peak[buf] = max(peak[buf], len(held[s][buf]))

    def read(s: int, buf: str, slot: int, item: Item, t: int, free: bool) -> None:
        got = held[s][buf].get(slot)
        assert got == item, f"{where}: stage {s} tick {t}: {buf} slot {slot} holds {got}, {item}"
        if free:
            del held[s][buf][slot]

    for t in range(ticks):
        for s in range(p):  # arrivals first: what the neighbours sent at the end of tick t - 1
            came = _sent_forward(table, (s - 1) % p, t - 1) if t and (s or v > 1) else None
            slot = table.recv_fwd[s][t]
            assert (slot >= 0) == (came is not None), f"{where}: stage {s} tick {t}: {came}"
            if came is not None:
                assert table.fwd_from[s][t] == FROM_PREV, f"{where}: stage {s} tick {t}"
                store(s, "inp", slot, came, t)
            came = None
            if train and t and (s < p - 1 or v > 1):
                came = _sent_backward(table, (s + 1) % p, t - 1)
            slot = table.recv_bwd[s][t]
            assert (slot >= 0) == (came is not None), f"{where}: stage {s} tick {t}: {came}"
            if came is not None:
                assert table.bwd_from[s][t] == FROM_NEXT, f"{where}: stage {s} tick {t}"
                store(s, "ct", slot, came, t)
        for s in range(p):  # then each stage's parts, in order: F, B, W
            cell = table.actions[s][t]
            parts = [a.part for a in cell]
            assert parts == sorted(set(parts)), f"{where}: stage {s} tick {t}: {cell}"
            for a in cell:
                item = (a.microbatch, a.group)
                assert 0 <= a.microbatch < m and 0 <= a.group < v, f"{where}: {a}"
                key = (_letter(a.kind), s, *item)
                assert key not in at, f"{where}: {key} at ticks {at[key]} and {t}"
                at[key] = t
                if a.part == 0:
                    loss = s == p - 1 and a.group == v - 1
                    assert (a.kind == FWD_LOSS) == loss, f"{where}: stage {s} tick {t}: {a}"
                    if s == 0 and a.group == 0:
                        assert a.inp == -1, f"{where}: {a} reads the microbatch itself"
                    else:
                        read(s, "inp", a.inp, item, t, free=True)
                    if train:
                        store(s, "res", a.res, item, t)
                        if loss:  # the loss's cotangent, for this stage's own backward
                            store(s, "ct", a.ct, item, t)
                    continue
                assert train, f"{where}: a backward in a forward-only table"
                if a.part == 1:
                    assert a.kind == backward_kind, f"{where}: stage {s} tick {t}: {a}"
                else:
                    assert split and a.kind == WGRAD, f"{where}: stage {s} tick {t}: {a}"
                last = a.kind == WGRAD or not split  # the residuals' and cotangent's last use
                read(s, "res", a.res, item, t, free=last)
                read(s, "ct", a.ct, item, t, free=last)

    kinds = ("F", "B", "W") if split else ("F", "B") if train else ("F",)
    assert len(at) == len(kinds) * p * m * v, f"{where}: {len(at)} pieces of work"
    for s in range(p):
        assert not any(held[s].values()), f"{where}: stage {s} ends holding {held[s]}"
    used = ("inp", "res", "ct") if train else ("inp",)
    got = {b: n for b, n in zip(bufs, table.slots, strict=True) if b in used}
    assert got == {b: max(1, peak[b]) for b in used}, f"{where}: rings {table.slots}, {peak}"
    for (kind, s, i, r), t in at.items():  # what each piece waits for
        if kind == "F":
            up = ("F", s - 1, i, r) if s else ("F", p - 1, i, r - 1) if r else None
            assert up is None or at[up] < t, f"{where}: {kind, s, i, r} at {t}, {up}"
        elif kind == "B" and (s, r) == (p - 1, v - 1):  # after its loss, the same tick allowed
            assert at[("F", s, i, r)] <= t, f"{where}: {kind, s, i, r} at {t} before its loss"
        elif kind == "B":
            up = ("B", s + 1, i, r) if s < p - 1 else ("B", 0, i, r + 1)
            assert at[up] < t, f"{where}: {kind, s, i, r} at {t}, {up} at {at[up]}"
        else:
            assert at[("B", s, i, r)] <= t, f"{where}: {kind, s, i, r} at {t} before its B"


SWEEP = [
    (schedule, p, m, v)
    for p in range(1, 6)
    for schedule, vs, first in (("1f1b", [1], 1), ("zb-h1", [1], 1), ("interleaved", range(1, 5), p))
    for m in range(first, 3 * p + 2)
    for v in vs
]  # fmt: skip


def _sample(seed: int, n: int) -> list[tuple[str, int, int, int]]:
    """``n`` seeded cases beyond the sweep: p in 6..9, m in p..4p+3, v in 1..5."""
    rng, out = random.Random(seed), set()
    while len(out) < n:
        schedule = rng.choice(["1f1b", "zb-h1", "interleaved", "interleaved"])
        p = rng.randint(6, 9)
        m = rng.randint(p, 4 * p + 3)
        out.add((schedule, p, m, rng.randint(1, 5) if schedule == "interleaved" else 1))
    return sorted(out)


SAMPLE = _sample(38, 24)


@pytest.mark.parametrize("p", range(1, 6))
def test_every_table_of_the_sweep_is_a_valid_schedule(p: int) -> None:
    """p in 1..5, m in 1..3p+1 (1F1B, ZB-H1; m < p too) or p..3p+1 and v in 1..4
    (interleaved): the training table and the forward-only table are valid schedules."""
    for schedule, p_, m, v in SWEEP:
        if p_ != p:
            continue
        check_schedule(schedule_table(schedule, p, m, v))
        check_schedule(forward_table(p, m, v), train=False)


@pytest.mark.parametrize(("schedule", "p", "m", "v"), SAMPLE)
def test_sampled_larger_tables_are_valid_schedules(schedule: str, p: int, m: int, v: int):
    check_schedule(schedule_table(schedule, p, m, v))


# -- the cost model: Table.cost, the lockstep critical path -------------------------------------

# (t_f, t_b, t_w): equal, asymmetric, a free weight half; binary fractions, so sums are exact.
TIMES = [(1, 1, 1), (1, 2, 1), (2, 1, 3), (1, 1, 0), (0.5, 3, 0.25), (3, 1, 1)]


@pytest.mark.parametrize("p", range(1, 9))
def test_1f1b_is_gpipes_critical_path_in_flat_memory(p: int) -> None:
    """m in 1..3p+1 and 8p: F of microbatch j on stage s at tick j + s, B at j + 2p - 2 - s,
    m + 2p - 2 ticks; the lockstep critical path is GPipe's (m + p - 1)(t_f + t_b + t_w)
    exactly for any times, and the asynchronous one the same; stage s holds
    min(m, 2(p - s) - 1) microbatches."""
    for m in [*range(1, 3 * p + 2), 8 * p]:
        table = schedule_table("1f1b", p, m)
        assert table.ticks == m + 2 * p - 2, (p, m)
        for s in range(p):
            for j in range(m):
                f, b = table.part(s, j + s, 0), table.part(s, j + 2 * p - 2 - s, 1)
                assert f is not None and (f.kind, f.microbatch) == (
                    FWD_LOSS if s == p - 1 else FWD, j), (p, m, s, j)  # fmt: skip
                assert b is not None and (b.kind, b.microbatch) == (BWD, j), (p, m, s, j)
        for times in TIMES:
            assert table.cost(*times) == gpipe_cost(p, m, *times), (p, m, times)
            assert table.async_cost(*times) == table.cost(*times), (p, m, times)
        assert [table.in_flight(s) for s in range(p)] == [
            min(m, 2 * (p - s) - 1) for s in range(p)
        ], (p, m)


def _interleaved_bound(p: int, m: int, v: int, s: int) -> int:
    """The items (microbatch, group) stage ``s`` holds at most: ``(v - 1) c + 2 (p - s) - 1``
    with ``c`` the first chunk (``p`` when ``p`` divides ``m``), and no more than all ``v m``."""
    return min(v * m, (v - 1) * _chunks(p, m)[0] + 2 * (p - s) - 1)


@pytest.mark.slow
@pytest.mark.parametrize("p", range(1, 9))
def test_interleaved_is_circulars_critical_path(p: int) -> None:
    """m in p..3p+1, v in 1..4: forward item k (Megatron's order) on stage s at tick k + s,
    backward item k at k + D - s (one D); the lockstep critical path is circular's
    (m + (p - 1) / v)(t_f + t_b + t_w), as asynchronous, never above 1F1B's, and stage s
    holds at most min(v m, (v - 1) c + 2 (p - s) - 1) items, whatever m is."""
    from shardlib._pipeline.placement import _orders

    for m in range(p, 3 * p + 2):
        one = schedule_table("1f1b", p, m)
        for v in range(1, 5):
            where = (p, m, v)
            table = schedule_table("interleaved", p, m, v)
            fwd, bwd = _orders(p, m, v)
            delay = {t - k for k, (i, r) in enumerate(bwd) for s in range(p)
                     for t in [_tick_of(table, "B", s, i, r) + s]}  # fmt: skip
            assert len(delay) == 1, where
            assert all(_tick_of(table, "F", s, i, r) == k + s
                       for k, (i, r) in enumerate(fwd) for s in range(p)), where  # fmt: skip
            for times in TIMES:
                want = (m + (p - 1) / v) * sum(times)
                assert table.cost(*times) == pytest.approx(want), (where, times)
                assert table.async_cost(*times) == pytest.approx(want), (where, times)
                assert table.cost(*times) <= one.cost(*times) + 1e-9, (where, times)
            for s in range(p):
                assert table.in_flight(s) <= _interleaved_bound(p, m, v, s), (where, s)


def _tick_of(table: Table, kind: str, s: int, i: int, r: int) -> int:
    (t,) = [t for t, cell in enumerate(table.actions[s]) for a in cell
            if (_letter(a.kind), a.microbatch, a.group) == (kind, i, r)]  # fmt: skip
    return t


@pytest.mark.parametrize("p", range(1, 9))
def test_zb_h1_critical_path_and_memory(p: int) -> None:
    """m in 1..3p+1 and 8p: 1F1B's F and B at 1F1B's ticks, each W from its B's tick to p - 1
    ticks after it; the lockstep critical path 3m + 2(p - 1) at equal times, 1F1B's when
    t_w = 0 (the weight halves cost nothing), never above it; stage s holds at most
    min(m, 2p - 1 - s) microbatches."""
    for m in [*range(1, 3 * p + 2), 8 * p]:
        table, one = schedule_table("zb-h1", p, m), schedule_table("1f1b", p, m)
        done, ones = place("zb-h1", p, m, 1), place("1f1b", p, m, 1)
        assert {k: t for k, t in done.items() if k[0] != "W"} == ones, (p, m)
        for (kind, s, i, r), t in done.items():
            if kind == "W":
                assert 0 <= t - done[("B", s, i, r)] <= p - 1, (p, m, s, i)
        assert table.cost() == 3 * m + 2 * (p - 1), (p, m)
        for times in TIMES:
            assert table.cost(*times) <= one.cost(*times), (p, m, times)
            if times[2] == 0:
                assert table.cost(*times) == one.cost(*times), (p, m, times)
        for s in range(p):
            assert table.in_flight(s) <= min(m, 2 * p - 1 - s), (p, m, s)


@pytest.mark.parametrize("k", [1, 2, 8])
@pytest.mark.parametrize("p", [2, 4, 8])
def test_zb_h1_is_cheaper_than_1f1b(p: int, k: int) -> None:
    """The issue's grid, m in {p, 2p, 8p}: ZB-H1's lockstep critical path below 1F1B's for
    every t_w > 0, as the weight halves fill ticks that a backward elsewhere makes long."""
    m = k * p
    zb, one = schedule_table("zb-h1", p, m), schedule_table("1f1b", p, m)
    for times in TIMES:
        if times[2] > 0:
            assert zb.cost(*times) < one.cost(*times), (p, m, times)


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1", "interleaved"])
@pytest.mark.parametrize("p", range(1, 9))
def test_memory_is_flat_in_microbatches(schedule: str, p: int) -> None:
    """m = 2p and m = 32p: the same residuals in flight on every stage and the same rings."""
    for v in range(1, 5) if schedule == "interleaved" else [1]:
        small, large = schedule_table(schedule, p, 2 * p, v), schedule_table(schedule, p, 32 * p, v)
        assert small.slots == large.slots, (schedule, p, v)
        assert [small.in_flight(s) for s in range(p)] == [large.in_flight(s) for s in range(p)]


@pytest.mark.parametrize(("p", "m", "v"), [(4, 5, 3), (4, 5, 4), (5, 7, 2), (4, 9, 3)])
def test_interleaved_with_m_not_a_multiple_of_p_finishes(p: int, m: int, v: int) -> None:
    """Megatron's order with a short last chunk deadlocked here ("the schedule does not
    finish"); the table is valid, at circular's critical path, and drawn whole."""
    table = schedule_table("interleaved", p, m, v)
    check_schedule(table)
    assert table.cost() == pytest.approx(3 * (m + (p - 1) / v))
    picture = pipeline.timeline("interleaved", p, m, v).splitlines()
    assert len(picture) == p + 1 and len(picture[0].split()) == table.ticks + 1


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
@pytest.mark.parametrize("p", [2, 3, 4, 5])
def test_fewer_microbatches_than_stages_run(schedule: str, p: int) -> None:
    """1F1B and ZB-H1 accept m < p (the docs say so): valid tables, 1F1B in m + 2p - 2 ticks
    at GPipe's critical path, ZB-H1 at 3m + 2(p - 1), and bubble_fraction is one less the
    work over that path."""
    for m in range(1, p):
        table = schedule_table(schedule, p, m)
        check_schedule(table)
        cost = table.cost()
        assert cost == (gpipe_cost(p, m) if schedule == "1f1b" else 3 * m + 2 * (p - 1))
        assert pipeline.bubble_fraction(schedule, p, m) == pytest.approx((cost - 3 * m) / cost)
        if schedule == "1f1b":
            assert table.ticks == m + 2 * p - 2


def _idle_share_of_the_picture(schedule: str, p: int, m: int, v: int) -> list[float]:
    """Per stage, the idle cells of `pipeline.timeline`'s picture over its ticks."""
    lines = pipeline.timeline(schedule, p, m, v).splitlines()
    ticks = len(lines[0].split()) - 1
    return [line.split()[2:].count(".") / ticks for line in lines[1:]]


@pytest.mark.parametrize("schedule", ["gpipe", "circular", "1f1b", "interleaved", "zb-h1"])
def test_bubble_fraction_is_the_documented_formula(schedule: str) -> None:
    """For every m >= p (a multiple of p or not): `bubble_fraction` is the formula of the
    docs; for gpipe and circular the idle cells of every stage's row of the picture over
    its ticks, for the tables one less the work 3m over the lockstep critical path."""
    for p in range(1, 6):
        for m in range(p, 3 * p + 2):
            for v in range(1, 4) if schedule in ("circular", "interleaved") else [1]:
                got = pipeline.bubble_fraction(schedule, p, m, v)
                if schedule in ("gpipe", "circular"):
                    for share in _idle_share_of_the_picture(schedule, p, m, v):
                        assert got == pytest.approx(share), (schedule, p, m, v)
                else:
                    cost = schedule_table(schedule, p, m, v).cost()
                    assert got == pytest.approx((cost - 3 * m) / cost), (schedule, p, m, v)
                if schedule == "zb-h1":
                    formula = 2 * (p - 1) / (3 * m + 2 * (p - 1))
                else:
                    formula = (p - 1) / (v * m + p - 1)  # gpipe and 1f1b: v = 1
                assert got == pytest.approx(formula), (schedule, p, m, v)


def test_the_reviewers_interleaved_case() -> None:
    """p = 4, m = 6, v = 2 (one chunk of 6): critical path (6 + 3/2) x 3 = 22.5 units, of
    which each stage idles 4.5, the 20% of circular at the same sizes."""
    table = schedule_table("interleaved", 4, 6, 2)
    check_schedule(table)
    assert table.cost() == pytest.approx(22.5)
    assert pipeline.bubble_fraction("interleaved", 4, 6, 2) == pytest.approx(0.2)
    assert pipeline.circular_bubble_fraction(4, 6, 2) == pytest.approx(0.2)


def test_table_part_and_action_part() -> None:
    """`Table.part` picks a tick's forward (0), backward (1) or weight gradient (2); a cell
    lists its work in that order; `Action.part` says which."""
    table = schedule_table("zb-h1", 2, 2)  # stage 1, tick 2: F1 B1 W0
    assert [(a.part, _letter(a.kind), a.microbatch) for a in table.actions[1][2]] == [
        (0, "F", 1), (1, "B", 1), (2, "W", 0)]  # fmt: skip
    f, b, w = (table.part(1, 2, k) for k in range(3))
    assert f is not None and b is not None and w is not None
    assert (f.kind, b.kind, w.kind) == (FWD_LOSS, BWD_INPUT, WGRAD)
    assert table.actions[1][0] == () and table.part(1, 0, 0) is None
    assert table.part(0, 0, 1) is None and table.part(0, 0, 2) is None


@pytest.mark.parametrize(
    ("call", "fn", "schedule", "other"),
    [
        (lambda: pipeline.timeline("circular", p=4, m=3, v=2), "timeline", "circular", "gpipe"),
        (lambda: pipeline.timeline("circular", 4, 3), "timeline", "circular", "gpipe"),
        (lambda: pipeline.bubble_fraction("circular", 4, 3, 2), "bubble_fraction", "circular",
         "gpipe"),
        (lambda: pipeline.circular_bubble_fraction(4, 3, 2), "circular_bubble_fraction",
         "circular", "gpipe"),
        (lambda: pipeline.work_items(4, 3, 2), "work_items", "circular", "gpipe"),
        (lambda: pipeline.timeline("interleaved", 4, 3, 2), "timeline", "interleaved",
         "one_f_one_b"),
        (lambda: pipeline.bubble_fraction("interleaved", 4, 2, 3), "bubble_fraction",
         "interleaved", "one_f_one_b"),
        (lambda: pipeline.critical_path("interleaved", 4, 3, 2), "critical_path",
         "interleaved", "one_f_one_b"),
        (lambda: pipeline.critical_path("circular", 4, 3, 2), "critical_path", "circular",
         "gpipe"),
    ],
)  # fmt: skip
def test_fewer_microbatches_than_stages_refused_as_the_schedules_do(call, fn, schedule, other):
    """circular() and interleaved() refuse m < p; so do the functions that draw them, with
    the function, the argument, the rule and the value in one sentence."""
    with pytest.raises(ValueError) as err:
        call()
    text = str(err.value)
    assert text.startswith(f"{fn}: argument `m` must be at least `p` for the {schedule}")
    assert "got m=" in text and f"use more microbatches or {other}" in text


def test_gpipe_with_fewer_microbatches_still_draws() -> None:
    """GPipe (work_items with v = 1, timeline 'gpipe') works with any m >= 1."""
    assert pipeline.work_items(4, 2) == [
        [(0, 0), (1, 0), None, None, None],
        [None, (0, 0), (1, 0), None, None],
        [None, None, (0, 0), (1, 0), None],
        [None, None, None, (0, 0), (1, 0)],
    ]
    assert pipeline.bubble_fraction("gpipe", 4, 2) == pytest.approx(3 / 5)


def test_one_group_schedules_refuse_v_in_bubble_fraction() -> None:
    with pytest.raises(ValueError, match="bubble_fraction: the 1f1b schedule has one layer"):
        pipeline.bubble_fraction("1f1b", 4, 8, 2)


@pytest.mark.slow
def test_previously_deadlocked_interleaved_case_matches_plain_autodiff() -> None:
    """p = 4, m = 5, v = 3 end to end (`pipeline_loss(schedule='interleaved')`, jitted, with
    its gradients) against plain autodiff of all layers in order, and the forwards-only run."""
    import tests.test_pipeline_1f1b as t1f1b
    from tests._mesh_util import make_mesh

    t1f1b._check(make_mesh((4,), ("p",)), "interleaved", 5, tp=False, seed=38, v=3)
    assert np.isfinite(pipeline.bubble_fraction("interleaved", 4, 5, 3))


def _replace_cell(table: Table, s: int, t: int, cell: tuple[Action, ...]) -> Table:
    rows = [list(r) for r in table.actions]
    rows[s][t] = tuple(cell)
    return dataclasses.replace(table, actions=tuple(map(tuple, rows)))


def _first(table: Table, s: int, kind: int) -> tuple[int, Action]:
    return next((t, a) for t, c in enumerate(table.actions[s]) for a in c if a.kind == kind)


def test_the_checker_catches_a_broken_table() -> None:
    """`check_schedule` is not vacuous: a swapped slot, a backward one tick early, a dropped
    arrival, the loss's backward before its forward in one tick, a W before its B, a ring one
    slot too large, two forwards in one tick."""
    good = schedule_table("interleaved", 2, 3, 2)
    check_schedule(good)
    broken = []
    t, b = _first(good, 1, BWD)
    swapped = tuple(
        dataclasses.replace(a, res=a.res + 1) if a == b else a for a in good.actions[1][t]
    )
    broken.append(_replace_cell(good, 1, t, swapped))
    t, b = _first(good, 0, BWD)  # stage 0's first backward, one tick before its cotangent
    early = _replace_cell(good, 0, t, tuple(a for a in good.actions[0][t] if a != b))
    broken.append(_replace_cell(early, 0, t - 1, (*good.actions[0][t - 1], b)))
    recv = [list(r) for r in good.recv_fwd]
    recv[1][next(t for t, k in enumerate(recv[1]) if k >= 0)] = -1
    broken.append(dataclasses.replace(good, recv_fwd=tuple(map(tuple, recv))))
    one = schedule_table("1f1b", 2, 2)  # stage 1, tick 1: F0 then B0, the loss between
    check_schedule(one)
    broken.append(_replace_cell(one, 1, 1, one.actions[1][1][::-1]))
    broken.append(dataclasses.replace(one, slots=(one.slots[0], one.slots[1] + 1, one.slots[2])))
    t, f = _first(one, 0, FWD)
    broken.append(_replace_cell(one, 0, t, (f, dataclasses.replace(f, microbatch=1))))
    zb = schedule_table("zb-h1", 2, 2)  # stage 0, tick 2: B0 W0; move W0 to tick 1
    check_schedule(zb)
    t, w = _first(zb, 0, WGRAD)
    moved = _replace_cell(zb, 0, t, tuple(a for a in zb.actions[0][t] if a != w))
    broken.append(_replace_cell(moved, 0, t - 1, (*zb.actions[0][t - 1], w)))
    for table in broken:
        with pytest.raises(AssertionError):
            check_schedule(table)


ONE_F_ONE_B_4_8 = """\
tick       0    1    2    3    4    5    6    7    8    9   10   11   12   13
stage 0   F0   F1   F2   F3   F4   F5 F6B0 F7B1   B2   B3   B4   B5   B6   B7
stage 1    .   F0   F1   F2   F3 F4B0 F5B1 F6B2 F7B3   B4   B5   B6   B7    .
stage 2    .    .   F0   F1 F2B0 F3B1 F4B2 F5B3 F6B4 F7B5   B6   B7    .    .
stage 3    .    .    . F0B0 F1B1 F2B2 F3B3 F4B4 F5B5 F6B6 F7B7    .    .    ."""


def test_the_numbers_the_docs_give() -> None:
    """docs/guide/pipeline.md: the chunks of m = 6 and m = 9 on p = 4; 1F1B at p = 4, m = 8
    (the picture; 7, 5, 3, 1 in flight); ZB-H1 there (every stage's first W at tick 6, when
    stage 3's is due, p - 1 ticks after its B, then one a tick; the last three in the ticks
    after the stage's last B; 30 units against 1F1B's 33, 29 without lockstep; 7, 6, 5, 4 in
    flight); 1F1B with m < p in m + 2p - 2 ticks."""
    assert _chunks(4, 6) == [6] and _chunks(4, 9) == [5, 4] and _chunks(4, 8) == [4, 4]
    assert pipeline.timeline("1f1b", 4, 8) == ONE_F_ONE_B_4_8
    one = schedule_table("1f1b", 4, 8)
    assert [one.in_flight(s) for s in range(4)] == [7, 5, 3, 1]
    table = schedule_table("zb-h1", 4, 8)
    for s in range(4):
        ws = {a.microbatch: t for t, c in enumerate(table.actions[s]) for a in c if a.kind == WGRAD}
        bs = {a.microbatch: t for t, c in enumerate(table.actions[s]) for a in c if a.kind != WGRAD
              and a.kind in BACKWARD_KINDS}  # fmt: skip
        assert [ws[k] for k in range(5)] == [6, 7, 8, 9, 10], s
        last_b = max(bs.values())
        assert [ws[k] for k in range(5, 8)] == [last_b + 1, last_b + 2, last_b + 3], s
    assert (table.cost(), table.async_cost(), one.cost()) == (30, 29, 33)
    assert [table.in_flight(s) for s in range(4)] == [7, 6, 5, 4]
    for p in range(2, 6):
        for m in range(1, p):
            assert schedule_table("1f1b", p, m).ticks == m + 2 * p - 2


def test_numpy_integer_counts_are_accepted_as_to_groups_accepts_them() -> None:
    """``p``, ``m`` and ``v`` may be NumPy integers (a config read with NumPy); the results
    equal those of Python ints. Floats and bools stay refused."""
    for schedule, v in (("gpipe", 1), ("1f1b", 1), ("zb-h1", 1), ("circular", 2),
                        ("interleaved", 2)):  # fmt: skip
        want = pipeline.bubble_fraction(schedule, 4, 8, v)
        assert pipeline.bubble_fraction(schedule, np.int64(4), np.int32(8), np.int64(v)) == want
        drawn = pipeline.timeline(schedule, p=np.int64(4), m=np.int64(8), v=np.int32(v))
        assert drawn == pipeline.timeline(schedule, p=4, m=8, v=v)
        path = pipeline.critical_path(schedule, np.int64(4), np.int32(8), np.int64(v))
        assert path == pipeline.critical_path(schedule, 4, 8, v)
    assert pipeline.work_items(np.int64(2), np.int64(3)) == pipeline.work_items(2, 3)
    for bad in (4.0, True, np.float32(4)):
        with pytest.raises(ValueError, match="argument `p` must be a positive int"):
            pipeline.bubble_fraction("1f1b", bad, 8)
        with pytest.raises(ValueError, match="critical_path: argument `p` must be a positive"):
            pipeline.critical_path("1f1b", bad, 8)
    assert math.isfinite(pipeline.critical_path("zb-h1", np.int64(2), 2).lockstep)
