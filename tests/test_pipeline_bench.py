"""The pipeline part of ``python -m benchmarks`` at a tiny size (no timing assertions).

The GPipe training step written with shardlib (``typed_shard_map`` + ``pipeline.gpipe``) and by
hand (``jax.shard_map`` + ``lax.ppermute``) must compile to the same program; those two and the
GSPMD (MaxText-style) step must all give the loss and updated weights of the same step on
unsharded arrays (every layer in order on every microbatch, no mesh).
"""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

from benchmarks import _pipeline as pp
from benchmarks import pipeline_bench, suite
from benchmarks.structure import compare_structure

pytestmark = pytest.mark.slow  # benchmark runs: `pytest --runslow`
CONFIG = pipeline_bench.SIZES["tiny"]["config"]
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


def test_cli_only_pipeline_writes_its_section(tmp_path):
    argv = ["--size", "tiny", "--only", "pipeline", "--pairs", "2", "--warmup", "1"]
    argv += ["--compile-reps", "1", "--out", str(tmp_path)]
    assert suite.main(argv) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    md = (tmp_path / "results.md").read_text()
    assert results["workloads"] == {} and "checking" not in results and "remat" not in results
    rec = results["pipeline"]
    assert set(rec["structure"]["variants"]) == {"shardlib", "hand", "gspmd"}
    assert set(rec["steps"]["ratios"]) == {"shardlib/hand", "hand'/hand", "gspmd/hand"}
    ms = [r["microbatches"] for r in rec["compile_vs_microbatches"]]
    assert ms == list(pipeline_bench.SIZES["tiny"]["compile_microbatches"])
    assert all(r["compile_min_s"] > 0 for r in rec["compile_vs_microbatches"])
    rows = [t for t in results["targets"] if t["target"].startswith("pipeline:")]
    assert len(rows) == 3 and rows[0]["met"] is True
    assert "## GPipe pipeline (`pipeline`)" in md and "| gspmd / hand |" in md
