"""`shardlib.plan` on the three examples (`benchmarks/plan_workloads.py`): the transformer,
the mixture of experts and the pipeline.

At the ``cpu`` sizes on the 8 simulated devices, every candidate the plan ranks is compiled on
a real mesh (`Plan.verify`): its collectives must be the compiled HLO's (`HloComparison.
identical`), and its peak memory estimate within `MEMORY_RATIO` of XLA's total (slow tests:
the fast tier verifies every candidate of `tests/test_plan.py`'s MLP, and the plan guide's
page, docs/guide/plan.md, run in the slow tier, those of a small transformer). Planning for
256 and 1024 devices (abstract meshes: no devices) must complete and rank candidates (the
fast tier plans the MoE step for 256).
"""

from __future__ import annotations

import functools
import math

import pytest

from benchmarks import plan_workloads as pw
from shardlib._explain.report import PEAK_RATIO_BAND

# The estimated peak over XLA's total (`Check.memory_ratio`) at the cpu sizes, every candidate
# of the three examples: within the band around the range measured on every program the tests
# compare (`PEAK_RATIO_MEASURED`; the pipeline's candidates are the highest here, the estimate
# overcounting where XLA reuses buffers across the schedule's loop).
MEMORY_RATIO = PEAK_RATIO_BAND

VERIFY = [
    pytest.param("transformer", marks=pytest.mark.slow),  # 19 candidates, about 2 minutes
    pytest.param("moe", marks=pytest.mark.slow),  # 3 candidates, about 20 s
    pytest.param("pipeline", marks=pytest.mark.slow),  # 4 candidates, about 40 s
]


@functools.cache
def _cpu_plan(name: str):
    return pw.build(name, "cpu").plan(devices=8, hardware="cpu")


@pytest.mark.parametrize("name", VERIFY)
def test_every_candidate_compiles_to_its_prediction(name):
    result = _cpu_plan(name)
    assert result.candidates, [s.reason for s in result.skipped]
    checks = result.verify()
    assert len(checks) == len(result.candidates)
    for check in checks:
        where = f"{name} on {check.candidate.shape}"
        assert check.comparison.identical, f"{where}:\n{check.comparison}"
        assert check.predicted_bytes == check.hlo_bytes, where
        ratio = check.memory_ratio
        assert ratio is not None and MEMORY_RATIO[0] <= ratio <= MEMORY_RATIO[1], (where, ratio)


@pytest.mark.slow
def test_skipped_meshes_say_why():
    """The pipeline refuses meshes without stages (its schedule needs the role) and sizes
    that do not divide; each skip names the reason."""
    result = _cpu_plan("pipeline")
    reasons = {s.shape: s.reason for s in result.skipped}
    assert "not divisible by p=8" in reasons["p=8"]
    assert "stage" in reasons["d=8"]
    assert all("p" in c.mesh for c in result.candidates)


@pytest.mark.parametrize(
    ("name", "devices"),
    [
        # The fast tier plans the MoE step for 256 devices; the rest take 5 to 20 s each.
        pytest.param("transformer", 256, marks=pytest.mark.slow),
        pytest.param("transformer", 1024, marks=pytest.mark.slow),
        ("moe", 256),
        pytest.param("moe", 1024, marks=pytest.mark.slow),
        pytest.param("pipeline", 256, marks=pytest.mark.slow),
        pytest.param("pipeline", 1024, marks=pytest.mark.slow),
    ],
)
def test_plans_for_many_devices(name, devices):
    """The ``wide`` sizes (small models, batches that divide 1024) on abstract meshes."""
    result = pw.build(name, "wide").plan(devices=devices, hardware="h100")
    assert result.candidates, [s.reason for s in result.skipped][:5]
    assert all(c.step_s > 0 and c.compute_s > 0 for c in result.candidates)
    steps = [c.step_s for c in result.candidates if c.fits]
    assert steps == sorted(steps)
    assert result.best is result.candidates[0]
    assert all(math.prod(c.mesh.values()) == devices for c in result.candidates)
    assert all(math.prod(s.mesh.values()) == devices for s in result.skipped)


@pytest.mark.slow
def test_plan_at_scale_page_is_current():
    """docs/guide/plan-at-scale.md holds what `python -m benchmarks.plan_at_scale` generates
    now: one section (the 1B model, sequence 8k, on 1024 devices; about 10 s) generated afresh
    is in the page word for word (the whole page takes about 4 minutes:
    ``python -m benchmarks.plan_at_scale --check``)."""
    from benchmarks import plan_at_scale

    section, _ = plan_at_scale._section("1B-8k", 1024, log=lambda message: None)
    assert "\n".join(section) in plan_at_scale.PAGE.read_text(), (
        "run `python -m benchmarks.plan_at_scale`"
    )
