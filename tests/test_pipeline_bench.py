"""The pipeline part of ``python -m benchmarks`` at a tiny size (no timing assertions).

The GPipe training step written with shardlib (``typed_shard_map`` + ``pipeline.gpipe``) and by
hand (``jax.shard_map`` + ``lax.ppermute``) must compile to the same program; those two and the
GSPMD (MaxText-style) step must all give the loss and updated weights of the same step on
unsharded arrays (every layer in order on every microbatch, no mesh).

The memory-bounded schedules' part (:mod:`benchmarks.pipeline_schedules`), read from one run
of the command line: compiled temp bytes flat in ``m`` for 1F1B, interleaved and ZB-H1 and
growing for GPipe; each schedule's loop running its formula's ticks, one loop for the new
schedules whatever ``m``, the collective-permutes per tick the schedule implies; and every
schedule's loss equal to the unsharded step's.
"""

from __future__ import annotations

import dataclasses
import json

import jax
import numpy as np
import pytest

from benchmarks import _pipeline as pp
from benchmarks import pipeline_bench, pipeline_idle, suite
from benchmarks import pipeline_schedules as ps
from benchmarks.structure import compare_structure

pytestmark = pytest.mark.slow  # benchmark runs: `pytest --runslow`
CONFIG = pipeline_bench.SIZES["tiny"]["config"]
CONFIG_SCHEDULES = ps.SIZES["tiny"]["config"]
LR = 0.1


@pytest.fixture(scope="module")
def compared():
    with jax.set_mesh(pipeline_bench.make_mesh()):
        w = pipeline_bench.build(CONFIG, seed=3)
        return compare_structure(w)


def test_shardlib_and_hand_compile_to_the_same_program(compared):
    same = compared["same"]
    assert same["hlo"], same["hlo_first_difference"]
    assert same["census"] and same["cost"] and same["memory"]
    v = compared["variants"]
    # one collective-permute per tick forward and one back (scan trip count m + p - 1)
    ticks = CONFIG.microbatches + pipeline_bench.MESH_SHAPE[0] - 1
    permute = v["shardlib"]["traffic"]["kinds"]["collective-permute"]
    assert permute["count"] == 2 and permute["runs"] == 2 * ticks
    assert "shard_map" not in v["auto"]["_texts"]["jaxpr"]  # GSPMD: no shard_map
    assert "collective-permute" in v["auto"]["census"]  # the roll became the transfer


def test_every_variant_computes_the_unsharded_step(compared):
    s, x, target = pp.init(CONFIG, jax.random.key(3))
    ref_params, ref_loss = pp.reference_step(s, x, target, LR)
    for variant, (params, loss) in compared["outputs"].items():
        np.testing.assert_allclose(loss, ref_loss, rtol=1e-5, err_msg=variant)
        for name in ("w_in", "w_out"):
            np.testing.assert_allclose(
                getattr(params, name),
                getattr(ref_params, name),
                rtol=1e-5,
                atol=1e-6,
                err_msg=f"{variant}: {name}",
            )
    # the step really changed the weights (a gradient of zero would pass the above too)
    delta = np.abs(np.asarray(ref_params.w_in) - np.asarray(s.w_in)).max()
    assert delta > 1e-4


@pytest.fixture(scope="module")
def cli(tmp_path_factory):
    """``python -m benchmarks --size tiny --only pipeline``: results.json and results.md."""
    out = tmp_path_factory.mktemp("pipeline_bench")
    argv = ["--size", "tiny", "--only", "pipeline", "--pairs", "2", "--warmup", "1"]
    argv += ["--compile-reps", "1", "--out", str(out)]
    assert suite.main(argv) == 0
    return json.loads((out / "results.json").read_text()), (out / "results.md").read_text()


def test_cli_only_pipeline_writes_its_section(cli):
    results, md = cli
    assert results["workloads"] == {} and "checking" not in results and "remat" not in results
    rec = results["pipeline"]
    assert set(rec["structure"]["variants"]) == {"shardlib", "hand", "gspmd"}
    assert set(rec["steps"]["ratios"]) == {"shardlib/hand", "hand'/hand", "gspmd/hand"}
    ms = [r["microbatches"] for r in rec["compile_vs_microbatches"]]
    assert ms == list(pipeline_bench.SIZES["tiny"]["compile_microbatches"])
    assert all(r["compile_min_s"] > 0 for r in rec["compile_vs_microbatches"])
    rows = [t for t in results["targets"] if t["target"].startswith("pipeline:")]
    # GPipe's 3, temp bytes per schedule, loops, a critical path per memory-bounded
    # schedule, a step time per memory-bounded schedule against GPipe and zb-h1, zb-v / 1f1b.
    paths = [t for t in rows if "critical path" in t["target"]]
    assert len(paths) == len(ps.NEW) and all(t["met"] is True for t in paths)
    assert len(rows) == 3 + len(ps.SCHEDULES) + 1 + 2 * len(ps.NEW) + 2 and rows[0]["met"] is True
    assert "## GPipe pipeline (`pipeline`)" in md and "| gspmd / hand |" in md
    assert "### Memory-bounded schedules against GPipe" in md and "| zb-h1 / gpipe |" in md
    steps = rec["schedules"]["steps"]
    assert set(steps["ratios"]) == {
        "1f1b/gpipe",
        "interleaved/gpipe",
        "zb-h1/gpipe",
        "zb-v/gpipe",
        "zb-h1/1f1b",
        "zb-v/1f1b",
        "gpipe'/gpipe",
    }
    idle = rec["idle"]
    assert [r["schedule"] for r in idle["rows"]] == list(pipeline_idle.SCHEDULES)
    # Fused ticks: stage 0 of 1F1B, interleaved and ZB-H1 has no empty tick once m >= 2p - 2
    # (the tiny size's m = 2p), so their bubble share may be 0.
    assert all(r["idle_step_ms"] > 0 and 0 <= r["bubble_share"] < 1 for r in idle["rows"])
    assert "| schedule | ticks | bubble | step ms | all-idle step ms" in md


def test_the_all_idle_step_computes_nothing():
    """The idle-tick measurement's step really idles: loss 0, weights unchanged (the real
    step's loss is not 0 and it changes them), with the table's length and rings kept."""
    from shardlib._pipeline.tables import schedule_table

    table = schedule_table("1f1b", 4, 8, 1)
    idle = pipeline_idle.idle_table(table)
    assert (idle.ticks, idle.slots) == (table.ticks, table.slots)
    c = ps.SIZES["tiny"]["config"]
    with jax.set_mesh(ps.make_mesh()):
        args = ps.inputs("1f1b", c, 8)
        (new, loss), (moved, real) = (
            pipeline_idle._compiled("1f1b", args, idle=idle)(*args) for idle in (True, False)
        )
    assert float(loss) == 0.0 and float(real) > 0
    np.testing.assert_array_equal(new.w_in, args[0].w_in)
    assert np.abs(np.asarray(moved.w_in) - np.asarray(args[0].w_in)).max() > 0


def test_schedules_temp_bytes_flat_in_microbatches_gpipe_grows(cli):
    """p = 4, m = 2p and 8p: the memory-bounded schedules within 10%, GPipe more than 2x."""
    sweep = cli[0]["pipeline"]["schedules"]["structure"]
    p = ps.MESH_SHAPE[0]
    per_stage = ps.SIZES["tiny"]["per_stage"]
    for schedule in ps.SCHEDULES:
        assert [r["microbatches"] for r in sweep[schedule]] == [k * p for k in per_stage]
    for schedule in ps.NEW:
        assert max(ps.flatness(sweep[schedule])) <= ps.TARGETS["flat"], sweep[schedule]
    assert ps.flatness(sweep["gpipe"])[-1] > 2, sweep["gpipe"]
    assert ps.linear(sweep["gpipe"])
    # already at m = 2p every new schedule keeps less than GPipe
    assert all(sweep[s][0]["temp_bytes"] < sweep["gpipe"][0]["temp_bytes"] for s in ps.NEW)


def test_schedules_ticks_loops_and_permutes(cli):
    """The loop's trip count is the tick formula (and pipeline.timeline's); one loop for the
    new schedules whatever m, sending two collective-permutes per tick; GPipe one per tick in
    each of its forward and transposed loops."""
    sweep = cli[0]["pipeline"]["schedules"]["structure"]
    p = ps.MESH_SHAPE[0]
    for schedule, rows in sweep.items():
        assert ps.loops_ok(schedule, rows), rows
        for r in rows:
            ticks = ps.tick_formula(schedule, p, r["microbatches"])
            assert r["ticks_hlo"] == r["ticks_timeline"] == ticks
            assert r["permute_instructions"] == 2
            if schedule == "gpipe":  # the scan, its transpose; the loss's map, its transpose
                assert r["trip_counts"] == [ticks, ticks, r["microbatches"], r["microbatches"]]
                assert r["permute_runs"] == 2 * ticks
            else:
                assert r["trip_counts"] == [ticks] and r["permute_runs"] == 2 * ticks


def test_every_schedule_computes_the_unsharded_loss(cli):
    """The step-time part's steps: each schedule's loss is the unsharded step's (seed 0)."""
    steps = cli[0]["pipeline"]["schedules"]["steps"]
    c = dataclasses.replace(CONFIG_SCHEDULES, microbatches=steps["microbatches"])
    _, ref_loss = pp.reference_step(*pp.init(c, jax.random.key(0)), LR)
    for name, loss in steps["losses"].items():
        np.testing.assert_allclose(loss, ref_loss, rtol=1e-5, err_msg=name)
