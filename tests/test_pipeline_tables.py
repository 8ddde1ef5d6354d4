"""The tick tables of the memory-bounded schedules, checked as schedules.

`check_schedule` replays a table the way the devices run it (`shardlib._pipeline.one_f_one_b`):
at each tick every stage first stores what its neighbours sent at the tick before (the
forward output one stage on, the input cotangent one stage back; interleaved wraps round the
ring) into the ring slot the table names, then does its one action, reading its input,
residual and cotangent slots. It asserts that every item (microbatch, group) goes forward
through every stage in ring order and backward in the reverse order after its forward, that
each stage does one thing per tick and every piece of work exactly once, that every slot
read holds the item the action is about and no slot is overwritten while still needed.

Sweeps: every ``p`` in 1..5, ``m`` in ``p..3p+1``, ``v`` in 1..4 (interleaved), and a seeded
sample of larger cases; the documented tick counts and bubble fractions against the tables;
``m < p`` refused by the drawing functions as by the schedules.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from shardlib import pipeline
from shardlib._pipeline.tables import (
    BWD,
    BWD_INPUT,
    FWD,
    FWD_LOSS,
    WGRAD,
    Table,
    forward_table,
    schedule_table,
    tick_count,
)

FORWARD_KINDS = (FWD, FWD_LOSS)
BACKWARD_KINDS = (BWD, BWD_INPUT)


def _letter(kind: int) -> str:
    return "F" if kind in FORWARD_KINDS else "W" if kind == WGRAD else "B"


def _sent_forward(table: Table, src: int, tick: int) -> tuple[int, int] | None:
    """The item whose activation stage ``src`` sends on after ``tick`` (None: none)."""
    a = table.actions[src][tick]
    if a is None or a.kind not in FORWARD_KINDS:
        return None
    if src < table.p - 1:
        return (a.microbatch, a.group)
    if a.group + 1 < table.v:  # round the ring to stage 0, the next group
        return (a.microbatch, a.group + 1)
    return None


def _sent_backward(table: Table, src: int, tick: int) -> tuple[int, int] | None:
    """The item whose cotangent stage ``src`` sends back after ``tick`` (None: none)."""
    a = table.actions[src][tick]
    if a is None or a.kind not in BACKWARD_KINDS:
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
    assert len(table.actions) == p and all(len(row) == ticks for row in table.actions), where
    sizes: dict[str, int] = dict(zip(("inp", "res", "ct"), table.slots, strict=True))
    held: list[dict[str, dict[int, tuple[int, int]]]] = [
        {"inp": {}, "res": {}, "ct": {}} for _ in range(p)
    ]
    at: dict[tuple[str, int, int, int], int] = {}

    def store(s: int, buf: str, slot: int, item: tuple[int, int], t: int) -> None:
        assert 0 <= slot < sizes[buf], f"{where}: stage {s} tick {t}: {buf} slot {slot}"
        old = held[s][buf].get(slot)
        assert old is None, f"{where}: stage {s} tick {t}: {buf} slot {slot} overwrites {old}"
        held[s][buf][slot] = item

    def read(s: int, buf: str, slot: int, item: tuple[int, int], t: int, free: bool) -> None:
        got = held[s][buf].get(slot)
        assert got == item, f"{where}: stage {s} tick {t}: {buf} slot {slot} holds {got}, {item}"
        if free:
            del held[s][buf][slot]

    for t in range(ticks):
        for s in range(p):  # arrivals first: what the neighbours sent after tick t - 1
            came = _sent_forward(table, (s - 1) % p, t - 1) if t and (s or v > 1) else None
            slot = table.recv_fwd[s][t]
            assert (slot >= 0) == (came is not None), f"{where}: stage {s} tick {t}: {came}"
            if came is not None:
                store(s, "inp", slot, came, t)
            came = None
            if train and t and (s < p - 1 or v > 1):
                came = _sent_backward(table, (s + 1) % p, t - 1)
            slot = table.recv_bwd[s][t]
            assert (slot >= 0) == (came is not None), f"{where}: stage {s} tick {t}: {came}"
            if came is not None:
                store(s, "ct", slot, came, t)
        for s in range(p):
            a = table.actions[s][t]
            if a is None:
                continue
            item = (a.microbatch, a.group)
            assert 0 <= a.microbatch < m and 0 <= a.group < v, f"{where}: {a}"
            key = (_letter(a.kind), s, *item)
            assert key not in at, f"{where}: {key} at ticks {at[key]} and {t}"
            at[key] = t
            if a.kind in FORWARD_KINDS:
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
            else:
                assert train, f"{where}: a backward in a forward-only table"
                assert a.kind in ((BWD_INPUT, WGRAD) if split else (BWD,)), f"{where}: {a}"
                last = a.kind == WGRAD or not split
                read(s, "res", a.res, item, t, free=last)
                read(s, "ct", a.ct, item, t, free=last)

    kinds = ("F", "B", "W") if split else ("F", "B") if train else ("F",)
    assert len(at) == len(kinds) * p * m * v, f"{where}: {len(at)} actions"
    for s in range(p):
        assert not any(held[s].values()), f"{where}: stage {s} ends holding {held[s]}"
    ring = [(s, r) for r in range(v) for s in range(p)]  # an item's forward path
    for i in range(m):
        f_ticks = [at[("F", s, i, r)] for s, r in ring]
        assert f_ticks == sorted(set(f_ticks)), f"{where}: microbatch {i} forward {f_ticks}"
        if not train:
            continue
        b_ticks = [at[("B", s, i, r)] for s, r in reversed(ring)]
        assert b_ticks == sorted(set(b_ticks)), f"{where}: microbatch {i} backward {b_ticks}"
        assert f_ticks[-1] < b_ticks[0], f"{where}: microbatch {i} backward before its loss"
        if split:
            assert all(at[("B", s, i, r)] < at[("W", s, i, r)] for s, r in ring), where


SWEEP = [
    (schedule, p, m, v)
    for p in range(1, 6)
    for m in range(p, 3 * p + 2)
    for schedule, vs in (("1f1b", [1]), ("zb-h1", [1]), ("interleaved", range(1, 5)))
    for v in vs
]


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
    """p in 1..5, m in p..3p+1, v in 1..4 (interleaved): the training table and the
    forward-only table finish, are valid schedules, and take the documented ticks."""
    for schedule, p_, m, v in SWEEP:
        if p_ != p:
            continue
        table = schedule_table(schedule, p, m, v)
        check_schedule(table)
        assert table.ticks == tick_count(schedule, p, m, v), (schedule, p, m, v)
        for s in range(p):  # the documented bound on the residuals a stage holds
            assert table.in_flight(s) <= _held_bound(schedule, p, m, v, s), (schedule, p, m, v)
        check_schedule(forward_table(p, m, v), train=False)


def _held_bound(schedule: str, p: int, m: int, v: int, s: int) -> int:
    """The docs' bound: 1F1B ``p - s``, ZB-H1 ``p``, interleaved ``(v - 1) c + 2 (p - s - 1)
    + 1`` items (``c = ceil(m / floor(m / p))``, ``p`` when ``p`` divides ``m``)."""
    if schedule == "1f1b":
        return p - s
    if schedule == "zb-h1":
        return p
    c = -(-m // (m // p))
    return (v - 1) * c + 2 * (p - s - 1) + 1


@pytest.mark.parametrize(("schedule", "p", "m", "v"), SAMPLE)
def test_sampled_larger_tables_are_valid_schedules(schedule: str, p: int, m: int, v: int):
    table = schedule_table(schedule, p, m, v)
    check_schedule(table)
    assert table.ticks == tick_count(schedule, p, m, v)


@pytest.mark.parametrize(("p", "m", "v"), [(4, 5, 3), (4, 5, 4), (5, 7, 2), (4, 9, 3)])
def test_interleaved_with_m_not_a_multiple_of_p_finishes(p: int, m: int, v: int) -> None:
    """Megatron's order with a short last chunk deadlocked here ("the schedule does not
    finish"); the table now runs in the documented 2 (v m + p - 1) ticks."""
    table = schedule_table("interleaved", p, m, v)
    check_schedule(table)
    assert table.ticks == 2 * (v * m + p - 1)
    picture = pipeline.timeline("interleaved", p, m, v).splitlines()
    assert len(picture) == p + 1 and len(picture[0].split()) == table.ticks + 1


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
@pytest.mark.parametrize("p", [2, 3, 4, 5])
def test_fewer_microbatches_than_stages_run_with_more_idle_ticks(schedule: str, p: int):
    """1F1B and ZB-H1 accept m < p (the docs say so): valid tables, idling more than the
    formula of m >= p would say, and bubble_fraction counts the table."""
    for m in range(1, p):
        table = schedule_table(schedule, p, m)
        check_schedule(table)
        idle = sum(a is None for a in table.actions[0])
        assert pipeline.bubble_fraction(schedule, p, m) == idle / table.ticks
        assert table.ticks >= tick_count(schedule, p, m)


def _idle_share_of_the_picture(schedule: str, p: int, m: int, v: int) -> list[float]:
    """Per stage, the idle cells of `pipeline.timeline`'s picture over its ticks."""
    lines = pipeline.timeline(schedule, p, m, v).splitlines()
    ticks = len(lines[0].split()) - 1
    return [line.split()[2:].count(".") / ticks for line in lines[1:]]


@pytest.mark.parametrize("schedule", ["gpipe", "circular", "1f1b", "interleaved", "zb-h1"])
def test_bubble_fraction_is_the_idle_share_of_the_timeline(schedule: str) -> None:
    """For every m >= p (a multiple of p or not): `bubble_fraction` equals every stage's
    idle cells over the ticks of the drawn table, and the documented formula."""
    for p in range(1, 6):
        for m in range(p, 3 * p + 2):
            for v in range(1, 4) if schedule in ("circular", "interleaved") else [1]:
                got = pipeline.bubble_fraction(schedule, p, m, v)
                for share in _idle_share_of_the_picture(schedule, p, m, v):
                    assert got == pytest.approx(share), (schedule, p, m, v)
                work = {"zb-h1": 3 * m, "gpipe": m, "1f1b": m}.get(schedule, v * m)
                formula = (p - 1) / (work + p - 1)  # the table in the docs
                assert got == pytest.approx(formula), (schedule, p, m, v)


def test_the_reviewers_interleaved_case_takes_30_ticks() -> None:
    """p = 4, m = 6, v = 2: 2 (v m + p - 1) = 30 ticks, 6 of them idle on every stage."""
    assert schedule_table("interleaved", 4, 6, 2).ticks == 30
    assert _idle_share_of_the_picture("interleaved", 4, 6, 2) == [6 / 30] * 4
    assert pipeline.bubble_fraction("interleaved", 4, 6, 2) == pytest.approx(6 / 30)


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


def test_previously_deadlocked_interleaved_case_matches_plain_autodiff() -> None:
    """p = 4, m = 5, v = 3 end to end (`pipeline_loss(schedule='interleaved')`, jitted, with
    its gradients) against plain autodiff of all layers in order, and the forwards-only run."""
    import tests.test_pipeline_1f1b as t1f1b
    from tests._mesh_util import make_mesh

    t1f1b._check(make_mesh((4,), ("p",)), "interleaved", 5, tp=False, seed=38, v=3)
    assert np.isfinite(pipeline.bubble_fraction("interleaved", 4, 5, 3))


def test_the_checker_catches_a_broken_table() -> None:
    """`check_schedule` is not vacuous: a swapped slot, a moved action, a dropped arrival."""
    import dataclasses

    good = schedule_table("interleaved", 2, 3, 2)
    check_schedule(good)
    rows = [list(r) for r in good.actions]
    t, b = next((t, a) for t, a in enumerate(rows[1]) if a is not None and a.kind == BWD)
    rows[1][t] = dataclasses.replace(b, res=b.res + 1)
    broken = [dataclasses.replace(good, actions=tuple(map(tuple, rows)))]
    rows = [list(r) for r in good.actions]
    first_b = next(t for t, a in enumerate(rows[0]) if a is not None and a.kind == BWD)
    rows[0][first_b - 1], rows[0][first_b] = rows[0][first_b], None  # a backward too early
    broken.append(dataclasses.replace(good, actions=tuple(map(tuple, rows))))
    recv = [list(r) for r in good.recv_fwd]
    recv[1][next(t for t, k in enumerate(recv[1]) if k >= 0)] = -1
    broken.append(dataclasses.replace(good, recv_fwd=tuple(map(tuple, recv))))
    for table in broken:
        with pytest.raises(AssertionError):
            check_schedule(table)


def test_the_numbers_the_docs_give() -> None:
    """docs/guide/pipeline.md: the chunks of m = 6 and m = 9 on p = 4; ZB-H1 at p = 4,
    m = 8 (W of microbatch k after B of k + s, s + 1 Ws after the last B, idle only before
    the first B); 1F1B with m < p in 2 (m + p - 1) ticks, ZB-H1 with p = 4, m = 2 in 11."""
    from shardlib._pipeline.tables import _chunks

    assert _chunks(4, 6) == [6] and _chunks(4, 9) == [5, 4] and _chunks(4, 8) == [4, 4]
    table = schedule_table("zb-h1", 4, 8)
    for s, row in enumerate(table.actions):
        cells = [(_letter(a.kind), a.microbatch) if a else None for a in row]
        work = [c for c in cells if c is not None]
        for k in range(8 - s):
            assert work.index(("W", k)) == work.index(("B", k + s)) + 1, (s, k)
        last_b = max(t for t, c in enumerate(cells) if c and c[0] == "B")
        assert cells[last_b + 1 :] == [("W", k) for k in range(7 - s, 8)]
        first_b = min(t for t, c in enumerate(cells) if c and c[0] == "B")
        assert cells[:first_b].count(None) == 3 and None not in cells[first_b:]
        assert last_b == 25 - s
    for p in range(2, 6):
        for m in range(1, p):
            assert schedule_table("1f1b", p, m).ticks == 2 * (m + p - 1)
    assert schedule_table("zb-h1", 4, 2).ticks == 11


def test_numpy_integer_counts_are_accepted_as_to_groups_accepts_them() -> None:
    """``p``, ``m`` and ``v`` may be NumPy integers (a config read with NumPy); the results
    equal those of Python ints. Floats and bools stay refused."""
    for schedule, v in (("gpipe", 1), ("1f1b", 1), ("zb-h1", 1), ("circular", 2),
                        ("interleaved", 2)):  # fmt: skip
        want = pipeline.bubble_fraction(schedule, 4, 8, v)
        assert pipeline.bubble_fraction(schedule, np.int64(4), np.int32(8), np.int64(v)) == want
        drawn = pipeline.timeline(schedule, p=np.int64(4), m=np.int64(8), v=np.int32(v))
        assert drawn == pipeline.timeline(schedule, p=4, m=8, v=v)
    assert pipeline.work_items(np.int64(2), np.int64(3)) == pipeline.work_items(2, 3)
    for bad in (4.0, True, np.float32(4)):
        with pytest.raises(ValueError, match="argument `p` must be a positive int"):
            pipeline.bubble_fraction("1f1b", bad, 8)
