"""The attention part of ``python -m benchmarks`` at a tiny size: its deterministic numbers.

Issue 25's numbers, read from compiled programs (no timing assertions): the ring's per-device
temp memory at most 1/4 of the all-gather variant's at c = 8 and flat in c at fixed L/c; the
ring's bytes per device equal to `attention.ring_bytes` and to the compiled HLO; the XLA-
partitioned global attention computes the same gradients; with packed sequences the ring
computes fewer score blocks and the same gradients; the CLI's ``--only attention`` writes the
section.
"""

from __future__ import annotations

import json

import pytest

from benchmarks import attention_bench as ab
from benchmarks import suite

pytestmark = pytest.mark.slow  # benchmark runs: `pytest --runslow`
TINY = ab.SIZES["tiny"]


def test_ring_temp_memory_is_a_fraction_of_gathered_and_flat_in_c():
    m = ab.memory_check(TINY["memory"], c=8)
    assert m["ring"] * 4 <= m["gathered"], m
    assert m["flat_change"] <= ab.TARGETS["flat_tolerance"], m


@pytest.mark.parametrize("c", [2, 4, 8])
def test_ring_bytes_equal_the_formula_and_the_compiled_hlo(c):
    (b,) = ab.bytes_check(TINY["step"], (c,))
    assert b["only_permutes"] and b["unknown_trip_counts"] == 0, b
    assert b["hlo_forward"] == b["formula_forward"] > 0, b
    assert b["hlo_total"] == b["formula_total"] > b["formula_forward"], b


def test_cli_writes_the_attention_section(tmp_path):
    argv = ["--size", "tiny", "--only", "attention", "--pairs", "2", "--warmup", "1"]
    assert suite.main([*argv, "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    rec = results["attention"]
    assert set(rec) >= {"memory", "bytes", "variants", "steps"}
    assert set(rec["steps"]["ratios"]) == {"ring/xla", "xla'/xla", "gathered/xla"}
    assert rec["max_grad_rel_diff_ring_xla"] < 1e-5
    # the ring moves K/V by collective-permutes only; XLA partitions the global attention
    # with collectives of its own choosing
    kinds = {n: set(v["traffic"]["kinds"]) for n, v in rec["variants"].items()}
    assert kinds["ring"] == {"collective-permute"} and kinds["xla"]
    met = {t["target"]: t["met"] for t in results["targets"]}
    assert all(v for k, v in met.items() if "step time" not in k), met
    # packed sequences: the ring skips the blocks whose segments cannot meet, same gradients
    packed = rec["packed"]
    assert sum(packed["blocks_skip"]) < sum(packed["blocks_full"]), packed
    assert packed["max_grad_rel_diff"] < 1e-5, packed
    assert set(packed["steps"]["ratios"]) == {"skip/full", "full'/full"}
    assert any("packed sequences, step time" in k for k in met), met
    md = (tmp_path / "results.md").read_text()
    assert "## Context-parallel attention (`attention`)" in md and "| ring / xla |" in md
    assert "| skip/full |" in md


def test_every_strategy_sends_the_formula_s_bytes_and_explain_says_so():
    """ring, gathered, ulysses at c = 2, 4, 8 and ring_ulysses at 4, 8 (tiny size): bytes
    formula = explain = compiled HLO (less the K/V block XLA sends once for a ring of two)."""
    from benchmarks import context_strategies

    rec = context_strategies.run("tiny", log=lambda _: None)
    assert {(r["strategy"], r["c"]) for r in rec["rows"]} == {
        *((s, c) for s in ("ring", "gathered", "ulysses") for c in (2, 4, 8)),
        ("ring_ulysses", 4),
        ("ring_ulysses", 8),
    }
    for row in context_strategies.targets(rec):
        assert row["met"], row
    ulysses = {r["c"]: r for r in rec["rows"] if r["strategy"] == "ulysses"}
    assert ulysses[8]["hlo"] < ulysses[4]["hlo"] < ulysses[2]["hlo"]  # falls as c grows
    assert ulysses[8]["kinds"] == ["all-to-all"]


def test_the_model_s_weights_over_d_x_c_take_1_over_c_of_the_bytes():
    from benchmarks import context_weights

    rec = context_weights.run("tiny", log=lambda _: None)
    assert [r["c"] for r in rec["rows"]] == [2, 4, 8]
    for row in context_weights.targets(rec):
        assert row["met"], row
