"""The shardlib transformer step compiles to the same collectives as the hand-written one."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from benchmarks import _hlo
from benchmarks import step_vs_hand as bench
from shardlib._explain import hlo as hlo

# ---------------------------------------------------------------------------------------------
# The HLO helpers, on small hand-made module texts.
# ---------------------------------------------------------------------------------------------

_MODULE = """\
HloModule jit_step, is_scheduled=true, entry_computation_layout={(f32[4]{0})->f32[8]{0}}

FileNames
1 "/somewhere/model.py"

FunctionNames
1 "all_gather"

FileLocations
1 {file_name_id=1 function_name_id=1 line=3 end_line=3 column=1 end_column=1}

StackFrames
1 {file_location_id=1 parent_frame_id=1}

%region_0.1 (psum.6: f32[], psum.9: f32[]) -> f32[] {
  %psum.6 = f32[] parameter(0), metadata={op_name="psum"}
  %psum.9 = f32[] parameter(1), metadata={op_name="psum"}
  ROOT %add.30 = f32[] add(%psum.6, %psum.9), metadata={op_name="add" stack_frame_id=1}
}

ENTRY %main.6_spmd (param.1: f32[4]) -> f32[8] {
  %param.1 = f32[4]{0} parameter(0), metadata={op_name="x"}
  %all_gather.3 = f32[8]{0} all-gather(%param.1), channel_id=1, replica_groups={{0,1}}, dimensions={0}, metadata={op_name="jit(step)/all_gather" source_file="/somewhere/model.py" source_line=3}
  %all-reduce-start.1 = (f32[8]{0}, f32[8]{0}) all-reduce-start(%all_gather.3), channel_id=2, replica_groups={{0,1}}, to_apply=%region_0.1
  %all-reduce-done.1 = f32[8]{0} all-reduce-done(%all-reduce-start.1)
  %reduce-scatter.2 = f32[4]{0} reduce-scatter(%all-reduce-done.1), channel_id=3, replica_groups={{0,1}}, dimensions={0}, to_apply=%region_0.1
  ROOT %copy.all-gather = f32[8]{0} all-gather(%reduce-scatter.2), channel_id=4, replica_groups={{0,1}}, dimensions={0}
}
"""


def test_census_counts_opcodes_not_names():
    # Names containing 'all-gather'/'all_gather' and async done halves are not counted.
    assert _hlo.collective_census(_MODULE) == {
        "all-gather": 2,
        "all-reduce": 1,
        "reduce-scatter": 1,
    }


def test_instructions_parse_tuple_shapes():
    ops = dict(hlo.instructions(_MODULE))
    assert ops["all-reduce-start.1"] == "all-reduce-start"
    assert ops["add.30"] == "add"
    assert "1" not in ops  # table entries are not instructions


def test_canonicalize_ignores_names_metadata_and_tables():
    renamed = (
        _MODULE.replace("jit_step", "jit_other")
        .replace("psum.", "p_sum.")
        .replace("all_gather.3", "ag.77")
        .replace("/somewhere/model.py", "/elsewhere/hand.py")
        .replace("line=3", "line=99")
    )
    assert renamed != _MODULE
    a, b = _hlo.canonicalize(_MODULE), _hlo.canonicalize(renamed)
    assert a == b
    assert "metadata" not in a and "FileNames" not in a and "somewhere" not in a
    assert _hlo.first_difference(a, b) == ""


def test_canonicalize_keeps_real_differences():
    changed = _MODULE.replace("dimensions={0}, metadata", "dimensions={1}, metadata")
    a, b = _hlo.canonicalize(_MODULE), _hlo.canonicalize(changed)
    assert a != b
    diff = _hlo.first_difference(a, b)
    assert "dimensions={0}" in diff and "dimensions={1}" in diff


# ---------------------------------------------------------------------------------------------
# The real thing, at tiny size.
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny():
    config, batch = bench.SIZES["tiny"]
    with jax.set_mesh(jax.make_mesh((4, 2), ("d", "t"))):
        args = bench.make_inputs(config, batch)
        structure = bench.compare_structure(config, args)
        outs = {name: jax.device_get(f(*args)) for name, f in structure.compiled.items()}
    return structure, outs


@pytest.mark.slow
def test_collective_census_is_the_same(tiny):
    s, _ = tiny
    assert s.census_shardlib == s.census_hand
    # FSDP gathers weights and reduce-scatters their gradients; TP all-reduces activations.
    for kind in ("all-gather", "reduce-scatter", "all-reduce"):
        assert s.census_shardlib.get(kind, 0) > 0, s.census_shardlib
    assert s.census_shardlib["reduce-scatter"] <= s.census_shardlib["all-gather"]


@pytest.mark.slow
def test_hand_step_computes_the_same_update(tiny):
    _, outs = tiny
    (model_a, loss_a), (model_b, loss_b) = outs["shardlib"], outs["hand"]
    np.testing.assert_allclose(loss_a, loss_b, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(model_a), jax.tree.leaves(model_b), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.slow
def test_main_reports_structure_and_timings(capsys):
    argv = ["--size", "tiny", "--pairs", "2", "--compile-reps", "0", "--warmup", "0"]
    assert bench.main(argv) == 0
    out = capsys.readouterr().out
    assert "census identical: True" in out
    assert "canonicalized compiled HLO identical:" in out
    assert "shardlib / hand: median ratio" in out
