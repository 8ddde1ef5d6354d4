"""The MoE part of ``python -m benchmarks`` at a tiny size: its deterministic numbers.

Issue 26's numbers, read from compiled programs (no timing assertions): the layer's all-to-all
bytes per device, forward and forward + backward, equal to the formula (two all-to-alls per
pass, each moving the ``(E, C, M)`` buffer but its ``1/e`` that stays home) and to the compiled
HLO, on a ``(2, 4)`` ``d x e`` mesh and an ``(8,)`` ``e`` mesh, capacity and dropless; the
XLA-partitioned global formulation computes the same gradients; the CLI's ``--only moe``
writes the section.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import moe_bench as mb
from benchmarks import suite
from shardlib import moe

pytestmark = pytest.mark.slow  # benchmark runs: `pytest --runslow`
TINY = mb.SIZES["tiny"]


@pytest.mark.parametrize("variant", ["moe", "dropless"])
def test_all_to_all_bytes_equal_the_formula_and_the_compiled_hlo(variant):
    rows = mb.bytes_check(TINY, variant)
    assert [b["mesh"] for b in rows] == list(mb.MESHES)
    for b in rows:
        one = b["buffer_bytes"] * (b["e"] - 1) // b["e"]
        assert b["formula_forward"] == 2 * one and b["formula_total"] == 4 * one, b
        assert b["hlo_forward"] == b["formula_forward"] > 0, b
        assert b["hlo_total"] == b["formula_total"], b
        assert b["a2a_runs"] == [2, 4] and b["a2a_groups"] == [b["e"]], b
        assert b["unknown_trip_counts"] == 0, b


def test_global_formulation_is_the_dense_moe_with_nothing_dropped():
    """With a capacity no pair can exceed, the one-hot formulation is plain top-k MoE."""
    rng = np.random.default_rng(1)
    s = TINY
    x = rng.standard_normal((s.b, s.length, s.m)).astype(np.float32)
    wr = rng.standard_normal((s.m, s.e)).astype(np.float32)
    wi = (rng.standard_normal((s.e, s.m, s.f)) * 0.3).astype(np.float32)
    wo = (rng.standard_normal((s.e, s.f, s.m)) * 0.3).astype(np.float32)
    groups = 8
    got = mb.global_moe(x, wr, wi, wo, k=2, cap=s.b * s.length // groups, groups=groups)
    t = x.reshape(-1, s.m)
    top, ids = jax.lax.top_k(jax.nn.softmax(t @ wr), 2)
    g = top / top.sum(-1, keepdims=True)
    every = jnp.einsum("tef,efm->tem", jax.nn.gelu(jnp.einsum("tm,emf->tef", t, wi)), wo)
    want = jnp.einsum("tk,tkm->tm", g, jnp.take_along_axis(every, ids[..., None], axis=1))
    np.testing.assert_allclose(got.reshape(-1, s.m), want, rtol=1e-5, atol=1e-5)
    assert moe.capacity(s.b * s.length // groups, 2, s.e, 1.25) < s.b * s.length // groups


def test_cli_writes_the_moe_section(tmp_path):
    argv = ["--size", "tiny", "--only", "moe", "--pairs", "2", "--warmup", "1"]
    assert suite.main([*argv, "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert set(results) >= {"moe"} and "attention" not in results
    rec = results["moe"]
    assert set(rec) >= {"bytes", "bytes_dropless", "variants", "steps"}
    assert set(rec["steps"]["ratios"]) == {"moe/xla", "xla'/xla", "dropless/xla"}
    assert rec["max_grad_rel_diff_moe_xla"] < 1e-5  # the same global math
    kinds = {n: set(v["traffic"]["kinds"]) for n, v in rec["variants"].items()}
    assert "all-to-all" in kinds["moe"] and kinds["xla"]
    met = {t["target"]: t["met"] for t in results["targets"]}
    assert all(v for k, v in met.items() if "step time" not in k and k.startswith("moe")), met
    md = (tmp_path / "results.md").read_text()
    assert "## Mixture of experts (`moe`)" in md and "| moe / xla |" in md
