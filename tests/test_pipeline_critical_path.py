"""`shardlib.pipeline.critical_path`: the step of each schedule in the cost model (pure Python).

The values against the formulas of the docs and against the tables' own `Table.cost` (as the
devices run them, in lockstep) and `Table.async_cost` (the same order without lockstep):
GPipe ``(m + p - 1)(t_f + t_b + t_w)``; circular and interleaved ``(m + (p - 1) / v)`` times
the same; 1F1B GPipe's; ZB-H1 ``3m + 2(p - 1)`` at unit times, below 1F1B's for ``t_w > 0``;
``against_gpipe`` the lockstep over GPipe's. The refusals name ``critical_path`` and the
argument. The explain table's cell is in ``tests/test_explain_schedules.py``.
"""

from __future__ import annotations

import numpy as np
import pytest

from shardlib import pipeline
from shardlib._pipeline.tables import gpipe_cost, schedule_table
from shardlib.pipeline import CriticalPath, critical_path

# (t_f, t_b, t_w): equal, asymmetric, a free weight half; binary fractions, so sums are exact.
TIMES = [(1, 1, 1), (1, 2, 1), (2, 1, 3), (1, 1, 0), (0.5, 3, 0.25)]


def test_exported() -> None:
    assert "critical_path" in pipeline.__all__ and "CriticalPath" in pipeline.__all__
    path = critical_path("1f1b", 4, 8)
    assert isinstance(path, CriticalPath)
    assert (path.lockstep, path.asynchronous, path.gpipe) == (33.0, 33.0, 33.0)


def test_the_docstrings_examples() -> None:
    assert critical_path("1f1b", 4, 8).against_gpipe == 1.0
    assert critical_path("zb-h1", 4, 8) == CriticalPath(
        lockstep=30.0, asynchronous=29.0, gpipe=33.0
    )


@pytest.mark.parametrize("p", range(1, 7))
def test_values_against_the_formulas_and_the_tables(p: int) -> None:
    """Every schedule, m in 1..2p+1 (m >= p for circular and interleaved), v in 1..3 where
    it takes several groups, the times of `TIMES` passed by keyword."""
    for m in range(1, 2 * p + 2):
        for times in TIMES:
            t_f, t_b, t_w = times
            kw = {"t_f": t_f, "t_b": t_b, "t_w": t_w}
            gpipe = (m + p - 1) * sum(times)
            assert gpipe == gpipe_cost(p, m, *times)
            assert critical_path("gpipe", p, m, **kw) == CriticalPath(gpipe, gpipe, gpipe)
            one = critical_path("1f1b", p, m, **kw)
            assert one == CriticalPath(gpipe, gpipe, gpipe), (p, m, times)
            zb = critical_path("zb-h1", p, m, **kw)
            table = schedule_table("zb-h1", p, m)
            assert (zb.lockstep, zb.asynchronous) == (table.cost(*times), table.async_cost(*times))
            assert zb.gpipe == gpipe and zb.asynchronous <= zb.lockstep <= one.lockstep
            if times == (1, 1, 1):
                assert zb.lockstep == 3 * m + 2 * (p - 1), (p, m)
            if t_w > 0 and p > 1:
                assert zb.lockstep < one.lockstep, (p, m, times)
            if m < p:
                continue
            for v in range(1, 4):
                loop = (m + (p - 1) / v) * sum(times)
                circ = critical_path("circular", p, m, v, **kw)
                assert circ == CriticalPath(loop, loop, gpipe), (p, m, v, times)
                inter = critical_path("interleaved", p, m, v, **kw)
                assert inter.lockstep == pytest.approx(loop) and inter.gpipe == gpipe
                assert inter.asynchronous == pytest.approx(loop)
                assert inter.against_gpipe == pytest.approx(loop / gpipe)


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1", "interleaved"])
def test_bubble_fraction_is_one_less_the_work_over_the_lockstep_path(schedule: str) -> None:
    for p in range(1, 6):
        for m in range(p, 2 * p + 2):
            for v in range(1, 4) if schedule == "interleaved" else [1]:
                path = critical_path(schedule, p, m, v)
                got = pipeline.bubble_fraction(schedule, p, m, v)
                assert got == pytest.approx(1 - 3 * m / path.lockstep), (schedule, p, m, v)


def test_times_in_any_unit() -> None:
    """Scaling every time scales every number; ints are accepted, floats come back; a zero
    weight half makes ZB-H1 1F1B's; the defaults are 1 : 1 : 1."""
    base = critical_path("zb-h1", 4, 8)
    scaled = critical_path("zb-h1", 4, 8, t_f=2.5, t_b=2.5, t_w=2.5)
    assert scaled == CriticalPath(2.5 * base.lockstep, 2.5 * base.asynchronous, 2.5 * base.gpipe)
    assert scaled.against_gpipe == pytest.approx(base.against_gpipe)
    assert base == critical_path("zb-h1", 4, 8, t_f=1, t_b=1, t_w=1)
    assert all(isinstance(x, float) for x in (base.lockstep, base.asynchronous, base.gpipe))
    free = critical_path("zb-h1", 4, 8, t_w=0)
    assert free.lockstep == critical_path("1f1b", 4, 8, t_w=0).lockstep == 22


@pytest.mark.parametrize(
    ("call", "argument"),
    [
        (lambda: critical_path("pipedream", 4, 8), "`schedule` must be one of"),
        (lambda: critical_path("1F1B", 4, 8), "`schedule` must be one of"),
        (lambda: critical_path("1f1b", 4, 8, 2), "the 1f1b schedule has one layer group per "
         "stage, got v=2"),
        (lambda: critical_path("zb-h1", 4, 8, v=3), "the zb-h1 schedule has one layer group per "
         "stage, got v=3"),
        (lambda: critical_path("gpipe", 4, 8, 2), "the gpipe schedule has one layer group per "
         "stage, got v=2"),
        (lambda: critical_path("interleaved", 4, 3, 2), "argument `m` must be at least `p` for "
         "the interleaved schedule"),
        (lambda: critical_path("circular", 4, 2, 2), "argument `m` must be at least `p` for the "
         "circular schedule"),
        (lambda: critical_path("1f1b", 4, 8, t_f=-1), "argument `t_f` must be a finite time >= 0, got -1"),
        (lambda: critical_path("1f1b", 4, 8, t_b=-0.5), "argument `t_b` must be a finite time >= 0"),
        (lambda: critical_path("zb-h1", 4, 8, t_w=-1), "argument `t_w` must be a finite time >= 0"),
        (lambda: critical_path("1f1b", 4, 8, t_f="1"), "argument `t_f` must be a finite time >= 0, "
         "got '1'"),
        (lambda: critical_path("1f1b", 4, 8, t_w=None), "argument `t_w` must be a finite time >= 0, "
         "got None"),
        (lambda: critical_path("1f1b", 4, 8, t_b=float("nan")), "argument `t_b` must be a finite time"),
        (lambda: critical_path("1f1b", 4, 8, t_f=float("inf")), "argument `t_f` must be a "
         "finite time"),
        (lambda: critical_path("1f1b", 4, 8, t_w=True), "argument `t_w` must be a finite time"),
        (lambda: critical_path("1f1b", 4, 8, t_f=0, t_b=0, t_w=0), "arguments `t_f`, `t_b`, "
         "`t_w` must not all be 0"),
        (lambda: critical_path("1f1b", 0, 8), "argument `p` must be a positive int"),
        (lambda: critical_path("1f1b", 4, 0), "argument `m` must be a positive int"),
        (lambda: critical_path("interleaved", 4, 8, 0), "argument `v` must be a positive int"),
    ],
)  # fmt: skip
def test_refusals_name_the_function_and_the_argument(call, argument: str) -> None:
    with pytest.raises(ValueError) as err:
        call()
    assert str(err.value).startswith(f"critical_path: {argument}"), str(err.value)


def test_numpy_times_are_times() -> None:
    """Times measured with NumPy (``np.float32``, ``np.int64``) are accepted as plain ones."""
    want = critical_path("zb-h1", 4, 8, t_f=1.0, t_b=2.0, t_w=1.0)
    assert critical_path("zb-h1", 4, 8, t_f=np.float32(1), t_b=np.int64(2), t_w=1) == want
