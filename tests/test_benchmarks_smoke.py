"""The benchmark scripts run (tiny repeat counts; no timing assertions)."""

import importlib
import pathlib
import sys

import pytest

ROOT = str(pathlib.Path(__file__).resolve().parent.parent)


def _load(name: str):
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    return importlib.import_module(f"benchmarks.{name}")


def test_checking_cost_runs():
    import io

    from typeguard import TypeCheckError

    bench = _load("checking_cost")
    out = io.StringIO()
    results = bench.main(calls=5, trace_reps=2, out=out)
    text = out.getvalue()
    assert "## Eager cost of checking one argument" in text
    assert "## Trace-time overhead" in text
    assert set(results["eager_us"]) == {
        "unannotated",
        "jax.Array",
        "shardlib",
        "shardlib.typechecked",
    }
    assert set(results["trace_ms"]) == {"Explicit", "Auto"}
    for row in results["trace_ms"].values():
        assert row["unannotated"] > 0 and row["typechecked"] > 0
    # the measured functions really check
    with pytest.raises(TypeCheckError, match="dtype: expected float32, got int32"):
        bench.annotated_shardlib(bench.jnp.zeros((8, 4), bench.jnp.int32))


@pytest.mark.slow
def test_roles_cost_runs():
    import io

    import jax
    from typeguard import TypeCheckError

    import shardlib

    bench = _load("roles_cost")
    out = io.StringIO()
    results = bench.main(calls=100, reps=2, out=out)
    assert "## Axis roles against mesh axes" in out.getvalue()
    assert results["eager"]["roles_us"] > 0 and results["trace"]["axes_ms"] > 0
    rows = bench.targets(results)
    assert len(rows) == 2 and all(isinstance(r["met"], bool) for r in rows)
    # the function measured with roles really resolves them and checks the layout
    mesh = jax.make_mesh((8,), ("d",))
    with jax.set_mesh(mesh), shardlib.axis_rules(rows="d"):
        x = jax.device_put(bench.jnp.zeros((64, 32), bench.jnp.float32), jax.P(None, "d"))
        with pytest.raises(TypeCheckError, match=r"batch/rows.*batch/d"):
            bench.with_roles(x)


@pytest.mark.slow
def test_overlap_bench_runs(tmp_path):
    """`python -m benchmarks --only overlap` at the tiny size: the section, its claims met
    (no all-gather or reduce-scatter over t with overlap, the same loss and gradients)."""
    import json

    suite = _load("suite")
    argv = ["--size", "tiny", "--only", "overlap", "--pairs", "2", "--warmup", "1"]
    assert suite.main([*argv, "--out", str(tmp_path)]) == 0
    rec = json.loads((tmp_path / "results.json").read_text())["overlap"]
    assert set(rec["variants"]) == {"plain", "ring", "bidirectional"}
    assert set(rec["steps"]["ratios"]) == {"ring/plain", "bidirectional/plain", "plain'/plain"}
    kinds = {n: v["traffic"]["kinds"] for n, v in rec["variants"].items()}
    assert "collective-permute" not in kinds["plain"]
    bidirectional = kinds["bidirectional"]["collective-permute"]["runs"]
    assert bidirectional == 2 * kinds["ring"]["collective-permute"]["runs"] > 0
    results = json.loads((tmp_path / "results.json").read_text())
    met = {t["target"]: t["met"] for t in results["targets"] if t["target"].startswith("overlap")}
    assert len(met) == 6 and all(v for k, v in met.items() if "step time" not in k), met
    md = (tmp_path / "results.md").read_text()
    assert "## Collective matmuls in the transformer step (`overlap`)" in md
    assert "cannot show the speedup" in md and "No GPU was available" in md


@pytest.mark.slow
def test_plan_bench_runs(tmp_path):
    """`python -m benchmarks --only plan` at the tiny size: planning time, every candidate of
    the MoE and the pipeline compiled against its prediction, the ranking against step time."""
    import json

    suite = _load("suite")
    argv = ["--size", "tiny", "--only", "plan", "--pairs", "4", "--warmup", "1"]
    assert suite.main([*argv, "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    rec = results["plan"]
    assert rec["planning"]["ranked"] > 0 and set(rec["verified"]) == {"moe", "pipeline"}
    assert all(
        c["identical"] and c["bytes_match"] for v in rec["verified"].values() for c in v["checks"]
    )
    assert len(rec["ranking"]["rows"]) == len(rec["verified"]["pipeline"]["checks"])
    met = {t["target"]: t["met"] for t in results["targets"] if t["target"].startswith("plan")}
    assert len(met) == 4 and all(v for v in met.values() if v is not None), met
    assert "## Planning layouts (`plan`)" in (tmp_path / "results.md").read_text()


@pytest.mark.slow
def test_decode_bench_runs(tmp_path):
    """`python -m benchmarks --only decode` at the tiny size: the typed decode step against the
    hand-written shard_map one, every claim but step time met (identical collectives, the same
    logits, cache bytes split c·t ways, the combine's bytes formula = explain = HLO)."""
    import json

    suite = _load("suite")
    argv = ["--size", "tiny", "--only", "decode", "--pairs", "2", "--warmup", "1"]
    assert suite.main([*argv, "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    (mesh,) = results["decode"]["meshes"].values()
    st = mesh["structure"]
    assert st["typed"]["census"] == st["hand"]["census"] and st["typed"]["census"]["all-reduce"]
    assert mesh["cache_bytes"]["exact"] and mesh["differences"]["logits"] <= 1e-5
    comb = mesh["combine"]
    assert comb["formula"] == comb["explain"] > 0 and len(comb["hlo_typed"]) == comb["layers"]
    met = {t["target"]: t["met"] for t in results["targets"] if t["target"].startswith("decode")}
    assert len(met) == 5 and all(v for k, v in met.items() if "step time" not in k), met
    md = (tmp_path / "results.md").read_text()
    assert "## Decoding: the typed decode step vs a hand-written shard_map (`decode`)" in md
