"""The structural half of ``python -m benchmarks`` on tiny sizes (no timing assertions).

shardlib and the hand-written ``shard_map`` must compile to the same program: the same
collectives (kinds, counts, bytes), flops, memory and canonical HLO. The byte and loop-count
accounting of :mod:`benchmarks._hlo` is checked on hand-made HLO and against sizes derived from
the model configs; every variant's loss is checked against an unsharded reference.
"""

from __future__ import annotations

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import _hlo, suite
from benchmarks import workloads as wls
from examples import transformer_model as tm
from shardlib._explain import hlo as hlo

# ---------------------------------------------------------------------------------------------
# HLO accounting on hand-made module text.
# ---------------------------------------------------------------------------------------------

_LOOP_MODULE = """\
HloModule jit_step, is_scheduled=true

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%body (p: (s32[], f32[4,8])) -> (s32[], f32[4,8]) {
  %p = (s32[], f32[4,8]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = f32[4,8]{1,0} get-tuple-element(%p), index=1
  %ag = f32[16,8]{1,0} all-gather(%x), channel_id=1, replica_groups=[2,4]<=[8], dimensions={0}
  %rs = f32[4,8]{1,0} reduce-scatter(%ag), channel_id=2, replica_groups=mesh['d'=4,'t'=2] {'d'}, dimensions={0}, to_apply=%add
  ROOT %t = (s32[], f32[4,8]{1,0}) tuple(%i, %rs)
}

%cond (q: (s32[], f32[4,8])) -> pred[] {
  %q = (s32[], f32[4,8]{1,0}) parameter(0)
  %j = s32[] get-tuple-element(%q), index=0
  %n = s32[] constant(3)
  ROOT %lt = pred[] compare(%j, %n), direction=LT
}

ENTRY %main (x: f32[4,8], y: bf16[2,2]) -> (f32[4,8], bf16[2,2]) {
  %x.1 = f32[4,8]{1,0} parameter(0)
  %y.1 = bf16[2,2]{1,0} parameter(1)
  %zero = s32[] constant(0)
  %init = (s32[], f32[4,8]{1,0}) tuple(%zero, %x.1)
  %w = (s32[], f32[4,8]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  %out = f32[4,8]{1,0} get-tuple-element(%w), index=1
  %ar = (f32[4,8]{1,0}, bf16[2,2]{1,0}) all-reduce(%out, %y.1), channel_id=3, replica_groups={{0,1},{2,3},{4,5},{6,7}}, to_apply=%add
  %cp = bf16[2,2]{1,0} collective-permute(%y.1), channel_id=4, source_target_pairs={{0,0},{1,2},{2,1},{3,3}}
  %ags = (f32[4,8]{1,0}, f32[32,8]{1,0}) all-gather-start(%out), channel_id=5, replica_groups={}, dimensions={0}
  %agd = f32[32,8]{1,0} all-gather-done(%ags)
  ROOT %r = (f32[4,8]{1,0}, bf16[2,2]{1,0}) tuple(%out, %cp)
}
"""

F32_4x8 = 4 * 4 * 8
BF16_2x2 = 2 * 2 * 2


def test_shape_bytes_sums_tuples_and_ignores_layouts():
    assert hlo.shape_bytes("f32[4,8]{1,0}") == F32_4x8
    assert hlo.shape_bytes("(f32[4,8]{1,0}, bf16[2,2]{1,0})") == F32_4x8 + BF16_2x2
    assert hlo.shape_bytes("pred[3]") == 3
    assert hlo.shape_bytes("f32[]") == 4
    assert hlo.shape_bytes("token[]") == 0


def test_collectives_bytes_groups_and_loop_counts():
    found, unknown = _hlo.collectives(_LOOP_MODULE, num_devices=8)
    assert unknown == 0
    by_kind = {c.kind: c for c in found}
    assert sorted(by_kind) == [
        "all-gather",
        "all-reduce",
        "collective-permute",
        "reduce-scatter",
    ]
    assert len(found) == 5  # two all-gathers: the loop's and the async one
    gathers = sorted((c for c in found if c.kind == "all-gather"), key=lambda c: c.runs)
    # the async pair counts once, its output is the -done's result; replica_groups={}: all 8
    assert (gathers[0].in_bytes, gathers[0].out_bytes, gathers[0].group, gathers[0].runs) == (
        F32_4x8,
        8 * F32_4x8,
        8,
        1,
    )
    # inside the loop body: runs = the known trip count; iota groups [2,4] are 2 groups of 4
    assert (gathers[1].in_bytes, gathers[1].out_bytes, gathers[1].group, gathers[1].runs) == (
        F32_4x8,
        4 * F32_4x8,
        4,
        3,
    )
    rs = by_kind["reduce-scatter"]
    assert (rs.in_bytes, rs.out_bytes, rs.group, rs.runs) == (4 * F32_4x8, F32_4x8, 4, 3)
    ar = by_kind["all-reduce"]
    assert (ar.in_bytes, ar.out_bytes, ar.group, ar.runs) == (
        F32_4x8 + BF16_2x2,
        F32_4x8 + BF16_2x2,
        2,
        1,
    )
    cp = by_kind["collective-permute"]
    assert cp.wire == pytest.approx(BF16_2x2)  # some pairs leave: the busiest device, one block
    assert ar.wire == pytest.approx(2 * ar.in_bytes * (2 - 1) / 2)
    assert gathers[1].wire == pytest.approx(4 * F32_4x8 * 3 / 4)
    assert rs.wire == pytest.approx(4 * F32_4x8 * 3 / 4)


def test_traffic_totals_are_the_sums_over_collectives():
    found, _ = _hlo.collectives(_LOOP_MODULE)
    t = _hlo.collective_traffic(_LOOP_MODULE)
    assert t["total"]["count"] == len(found)
    assert t["total"]["runs"] == sum(c.runs for c in found)
    assert t["total"]["payload_bytes_per_step"] == sum(c.payload * c.runs for c in found)
    assert t["total"]["wire_bytes_per_step"] == round(sum(c.wire * c.runs for c in found))
    assert t["kinds"]["all-gather"]["count"] == 2
    assert t["kinds"]["all-gather"]["runs"] == 1 + 3
    # the census (static instruction counts) agrees with the traffic table
    assert _hlo.collective_census(_LOOP_MODULE) == {
        k: int(v["count"]) for k, v in t["kinds"].items()
    }


def test_unknown_trip_count_is_reported():
    text = _LOOP_MODULE.replace(', backend_config={"known_trip_count":{"n":"3"}}', "")
    found, unknown = _hlo.collectives(text)
    assert unknown == 1
    assert {c.runs for c in found if c.computation == "body"} == {1}


def test_canonicalize_mlir_drops_locations_and_module_name():
    a = 'module @jit_f attributes {x = 1} {\n  %0 = stablehlo.add %a, %b : tensor<f32> loc(#loc3)\n}\n#loc3 = loc("f.py":1:2)'
    b = 'module @jit_g attributes {x = 1} {\n  %0 = stablehlo.add %a, %b : tensor<f32> loc("g.py":9:9)\n}'
    assert _hlo.canonicalize_mlir(a) == _hlo.canonicalize_mlir(b)
    c = b.replace("add", "multiply")
    assert _hlo.canonicalize_mlir(a) != _hlo.canonicalize_mlir(c)


def test_canonicalize_jaxpr_ignores_python_names_not_ops():
    def f(x, y):
        first = jnp.sin(x)
        return first * y

    def g(a, b):
        other = jnp.sin(a)
        return other * b

    def h(a, b):
        return jnp.cos(a) * b

    x = jnp.ones(3)
    jf, jg, jh = (_hlo.canonicalize_jaxpr(jax.make_jaxpr(fn)(x, x)) for fn in (f, g, h))
    assert jf == jg
    assert jf != jh
    assert _hlo.primitive_census(jf) == {"sin": 1, "mul": 1}
    assert _hlo.primitive_census(jh) == {"cos": 1, "mul": 1}


def test_parse_residuals():
    text = (
        "f32[] from a literal\n"
        "f32[2,4] from the argument m.layers.ln1\n"
        "bf16[2,16,32] output of scan from /x.py:1:2 (loss)\n"
        "bool[8] output of eq from /x.py:3:4 (loss)\n"
        "f8_e4m3fn[4,2] output of mul from /x.py:5:6 (loss)\n"
    )
    rows = suite.parse_residuals(text)
    assert [(r["kind"], r["bytes"]) for r in rows] == [
        ("constant", 4),
        ("argument", 4 * 2 * 4),
        ("activation", 2 * 2 * 16 * 32),
        ("activation", 8),
        ("activation", 8),  # float8: 1 byte per element (shardlib._explain.hlo.element_bytes)
    ]


# ---------------------------------------------------------------------------------------------
# The real workloads at tiny size.
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mesh():
    return suite.make_mesh()


@pytest.fixture(scope="module", params=wls.NAMES)
def compared(request, mesh):
    with jax.set_mesh(mesh):
        w = wls.build(request.param, "tiny")
        return w, suite.compare_structure(w)


def _mlp_reference_loss(w, x, y) -> float:
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    w1, w2, w3 = (np.asarray(a, np.float64) for a in (w.w1, w.w2, w.w3))
    h = np.maximum(np.maximum(x @ w1, 0) @ w2, 0)
    return float(np.mean((h @ w3 - y) ** 2))


@pytest.mark.slow
def test_shardlib_and_hand_compile_to_the_same_program(compared):
    w, s = compared
    same = s["same"]
    a, b = s["variants"]["shardlib"], s["variants"]["hand"]
    assert a["census"] == b["census"] and a["census"], (a["census"], b["census"])
    assert a["traffic"] == b["traffic"]
    assert a["cost"] == b["cost"] and a["cost"].get("flops", 0) > 0
    assert a["memory"] == b["memory"] and a["memory"]["temp_size_in_bytes"] > 0
    assert same["hlo"], same["hlo_first_difference"]
    assert same["lowered"], same["lowered_first_difference"]
    if w.name == "transformer":
        # shardlib's pmax is differentiable (a custom_jvp around lax.pmax): the jaxprs may
        # differ by such wrappers only, never by a collective or an arithmetic primitive.
        assert same["jaxpr_same_up_to_wrappers"], (
            same["jaxpr_primitives_only_in_shardlib"],
            same["jaxpr_primitives_only_in_hand"],
        )
    else:
        assert same["jaxpr"], same["jaxpr_first_difference"]


@pytest.mark.slow
def test_every_variant_computes_the_reference_loss_and_update(compared):
    w, s = compared
    if w.name == "transformer":
        model, tokens, _ = w.args
        config = wls.SIZES["tiny"]["transformer"][0]
        ref = float(tm.reference_loss(jax.device_get(model), jax.device_get(tokens), config))
    else:
        params, x, y, _ = jax.device_get(w.args)
        ref = _mlp_reference_loss(params, x, y)
    for v in wls.VARIANTS:
        np.testing.assert_allclose(s["losses"][v], ref, rtol=2e-5, err_msg=v)
    # the same program gives bit-identical updates; auto is the same math, partitioned otherwise
    assert s["max_abs_diff_params"]["hand"] == 0.0
    assert s["max_abs_diff_params"]["auto"] < 1e-5
    before = jax.tree.leaves(jax.device_get(w.args[0]))
    after = jax.tree.leaves(s["outputs"]["shardlib"][0])
    assert any(not np.array_equal(p, q) for p, q in zip(before, after, strict=True))


def _weight_bytes(params) -> int:
    return sum(4 * math.prod(a.shape) for a in jax.tree.leaves(params))


@pytest.mark.slow
def test_bytes_moved_match_the_parallelisation_plan(compared):
    w, s = compared
    t = s["variants"]["shardlib"]["traffic"]
    kinds = t["kinds"]
    assert t["unknown_trip_counts"] == 0
    if w.name == "fsdp_mlp":
        # every weight is gathered once (forward) and its gradient reduce-scattered once
        full = _weight_bytes(w.args[0])
        assert kinds["all-gather"]["payload_bytes_per_step"] == full
        assert kinds["reduce-scatter"]["payload_bytes_per_step"] == full
        assert kinds["all-reduce"]["payload_bytes_per_step"] == 4  # the loss
    elif w.name == "data_parallel":
        # one pmean of all gradients plus the loss; nothing else
        assert set(kinds) == {"all-reduce"}
        assert kinds["all-reduce"]["payload_bytes_per_step"] == _weight_bytes(w.args[0]) + 4
    else:
        # 9 weight gathers per layer in the forward pass and again in the backward recompute,
        # plus embedding, final norm and unembedding; one reduce-scatter per weight gradient
        n = wls.SIZES["tiny"]["transformer"][0].n_layers
        assert kinds["all-gather"]["runs"] == 2 * 9 * n + 3
        assert kinds["reduce-scatter"]["runs"] == 9 * n + 3


@pytest.mark.slow
def test_auto_variant_uses_no_shard_map(compared):
    _, s = compared
    assert "shard_map" not in s["variants"]["auto"]["_texts"]["jaxpr"]
    assert "shard_map" in s["variants"]["hand"]["_texts"]["jaxpr"]


def test_remat_residuals(mesh):
    config, batch = wls.SIZES["tiny"]["transformer"]
    with jax.set_mesh(mesh):
        r = suite.remat_report("tiny", compile_steps=False)
    assert r["shardlib_residuals_match_hand_explicit"]
    p = r["policies"]
    act = {k: v["activation"]["bytes"] for k, v in p.items()}
    assert act["none"] > act["explicit"] > act["nothing_saveable"]
    # explicit saves, per layer and device, the attention output (B/d L K/t G D) and the
    # residual stream after attention (B/d L M) on top of what nothing_saveable keeps
    d, t = suite.MESH_SHAPE
    per_layer = (
        (batch // d)
        * config.seq_len
        * ((config.n_kv_heads // t) * config.group * config.d_head + config.d_model)
    )
    assert act["explicit"] - act["nothing_saveable"] == 4 * config.n_layers * per_layer
    # with remat the sharded weight slices are residuals by reference; without, the gathered
    # weights are saved instead
    assert p["explicit"]["argument"]["bytes"] > 0
    assert p["none"]["argument"]["bytes"] == 0


@pytest.mark.slow
def test_cli_writes_markdown_and_json(tmp_path):
    argv = [
        "--size",
        "tiny",
        "--workloads",
        "data_parallel",
        "--pairs",
        "2",
        "--warmup",
        "1",
        "--compile-reps",
        "1",
        "--profile-reps",
        "1",
        "--skip",
        "remat",
        "checking",
        "sweep",
        "pipeline",
        "attention",
        "moe",
        "overlap",
        "roles",
        "--out",
        str(tmp_path),
    ]
    assert suite.main(argv) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    md = (tmp_path / "results.md").read_text()
    assert "pipeline" not in results  # skipped (tests/test_pipeline_bench.py runs it)
    assert "attention" not in results  # skipped (tests/test_attention_bench.py runs it)
    assert "moe" not in results  # skipped (tests/test_moe_bench.py runs it)
    assert "overlap" not in results  # skipped (tests/test_benchmarks_smoke.py runs it)
    assert "roles" not in results  # skipped (tests/test_benchmarks_smoke.py runs it)
    rec = results["workloads"]["data_parallel"]
    assert set(rec["steps"]["ratios"]) == {"shardlib/hand", "hand'/hand", "auto/hand"}
    assert rec["self_time_ms"]["shardlib"]["shardlib"] > 0
    # The hand-written step uses no shardlib op; its parameters are still pytree_dataclasses,
    # whose seqax-compatible keys flatten through shardlib's Python callbacks.
    hand_shardlib = rec["self_time_ms"]["hand"].get("shardlib", 0.0)
    assert hand_shardlib < 0.5 * rec["self_time_ms"]["shardlib"]["shardlib"]
    targets = {t["target"]: t["met"] for t in results["targets"]}
    assert targets["data_parallel: identical canonical compiled HLO"] is True
    assert "## Targets" in md and "| shardlib / hand |" in md


def test_alignment_pads_the_stack_and_averages_over_offsets() -> None:
    """`benchmarks.alignment`: ``_pad(k, f, args)`` calls ``f`` from ``k`` frames deeper, the
    default offsets span one 16 KiB data-stack chunk in steps of one small frame (so every
    position of the chunk boundary is sampled evenly), and the summary is the mean / minimum /
    maximum over offsets with shardlib / hand ratios."""
    import sys

    from benchmarks import alignment

    def depth() -> int:
        f, n = sys._getframe(1), 0
        while f is not None:
            f, n = f.f_back, n + 1
        return n

    depths = [alignment._pad(k, depth, ()) for k in range(4)]
    assert [d - depths[0] for d in depths] == [0, 1, 2, 3]
    step = alignment.frame_bytes(alignment._pad.__code__)
    assert step <= 256  # fine enough to follow the crossings' jagged profile
    span = alignment.offsets_per_chunk() * step
    assert abs(span - alignment.CHUNK_BYTES) <= step / 2
    s = alignment.summarize_aligned({"shardlib": [2.0, 4.0], "hand": [1.0, 3.0]})
    assert s["shardlib"] == {"mean_s": 3.0, "min_s": 2.0, "max_s": 4.0, "offsets": 2}
    assert s["ratio_of_means"] == 1.5 and s["ratio_of_minimums"] == 2.0


@pytest.mark.slow
def test_trace_work_counts_are_repeatable_and_land_where_the_code_lives(mesh) -> None:
    """`measures.trace_work`: the same counts on a second run to within 0.1% (so a difference
    of a fraction of a percent is real), shardlib's bytecodes counted for the shardlib step and fewer than
    half as many for the hand-written one, and the trace-ratio row shows the bytecode difference."""
    from benchmarks import measures, report
    from benchmarks.alignment import summarize_aligned

    with jax.set_mesh(mesh):
        w = wls.build("data_parallel", "tiny")
        first = measures.trace_work(w)
        again = measures.trace_work(w)
    for v in first:  # repeatable to a few bytecodes (a JAX cache can differ by one call)
        assert abs(first[v]["bytecodes"] - again[v]["bytecodes"]) <= 1e-3 * first[v]["bytecodes"]
    sl, hd = first["shardlib"], first["hand"]
    assert sl["bytecodes_shardlib"] > 1000 and sl["bytecodes"] > hd["bytecodes"] > 10_000
    # The hand step runs no shardlib op; its pytree_dataclass weights flatten through
    # shardlib's Python callbacks (seqax-compatible keys), and that is all.
    assert hd.get("bytecodes_shardlib", 0) < 0.5 * sl["bytecodes_shardlib"]
    assert sum(v for k, v in sl.items() if k.startswith("bytecodes_")) == sl["bytecodes"]
    rec = {
        "stages": {
            "summary": {"shardlib": {"trace_cpu_min_s": 1.0}, "hand": {"trace_cpu_min_s": 1.0}}
        },
        "aligned_trace": {"summary": summarize_aligned({"shardlib": [1.0], "hand": [1.0]})},
        "trace_work": first,
    }
    row = report._trace_ratio_target("data_parallel", rec)
    ratio = sl["bytecodes"] / hd["bytecodes"]
    assert f"Python bytecodes per trace {100 * (ratio - 1):+.1f}%" in str(row)
