"""explain's report against the HLO of random typed programs (issue 29).

Each seed of `tests/_explain_random.py` is a typed program (all_gather, psum_scatter,
psum/pmean, all_to_all, einsum_unreduced + a reduction, reshard, shift/ppermute; some in a
``scan`` or ``fori_loop``; the loss, its grad or its value_and_grad; meshes (8,), (4, 2),
(2, 2, 2); f32 and bf16). The report must equal the unoptimised HLO (what JAX emits, dead code
gone) exactly: calls, operand bytes and bytes sent per collective kind and mesh axis group, read
by the test's own HLO reader. Against the compiled HLO (a subset: compiling is slow) each
(kind, axes, bytes) must run between the fewest times the report's flags allow (loop-invariant
rows hoisted, duplicates and re-computations merged) and the report's count, bf16 counted as
the f32 XLA:CPU runs it in.
"""

from __future__ import annotations

import re

import jax
import pytest

import shardlib
from shardlib._env import programs
from shardlib._explain import liveness
from tests import _explain_random as R

FAST_SEEDS = range(15)
SLOW_SEEDS = range(15, 135)  # 120 more programs


def _check(seed: int, compiled: bool) -> list[str]:
    """The differences between the report of program ``seed`` and its HLO (empty: none)."""
    p = R.random_program(seed)
    with jax.set_mesh(p.mesh):
        report = shardlib.explain(p.f, *p.args)
        lowered = jax.jit(p.f).lower(*p.args)
        ours = R.report_totals(report)
        theirs = R.hlo_totals(R.hlo_collectives(R.unoptimised_text(lowered), p.mesh))
        out = [
            f"seed {seed} {p.mode} {p.dtype} {p.steps}: {key} report {ours.get(key)} "
            f"unoptimised HLO {theirs.get(key)}"
            for key in sorted(set(ours) | set(theirs))
            if ours.get(key) != theirs.get(key)
        ]
        if compiled:
            found = R.hlo_collectives(R.compiled_text(lowered), p.mesh)
            out += [f"seed {seed} compiled: {d}" for d in R.compiled_differences(report, found)]
    return out


def _run(seeds, compile_every: int) -> list[str]:
    return [d for i, s in enumerate(seeds) for d in _check(s, i % compile_every == 0)]


@pytest.mark.slow
def test_random_programs_match_their_hlo():
    differences = _run(FAST_SEEDS, compile_every=3)
    assert not differences, "\n".join(differences)


@pytest.mark.slow
def test_many_random_programs_match_their_hlo():
    differences = _run(SLOW_SEEDS, compile_every=4)
    assert not differences, "\n".join(differences)


def test_the_generator_covers_the_ops_loops_modes_meshes_and_dtypes():
    programs = [R.random_program(s) for s in [*FAST_SEEDS, *SLOW_SEEDS]]
    steps = " ".join(s for p in programs for s in p.steps)
    for op in ("all_gather", "psum_scatter", "psum", "pmean", "all_to_all", "einsum", "reshard"):
        assert op in steps, op
    for what in ("shift", "ppermute", "scan x", "fori_loop x"):
        assert what in steps, what
    assert {p.mode for p in programs} == {"loss", "grad", "value_and_grad"}
    assert {p.mesh.devices.shape for p in programs} == set(R.MESHES)
    assert {p.dtype for p in programs} == {"float32", "bfloat16"}
    assert re.search(r"ppermute [^\]]*\((\d+), \1\)", steps), "no permute with a fixed point"


@pytest.mark.slow
def test_without_dead_code_removal_the_reports_differ(monkeypatch):
    """Switch the liveness pass off (every equation live): the reports list the forward
    psum that a grad drops, and the differential test sees it."""

    def everything(jaxpr):
        live: set[int] = set()
        stack = [jaxpr]
        while stack:
            j = stack.pop()
            for e in j.eqns:
                live.add(id(e))
                stack += programs.sub_programs(e)
        return frozenset(live)

    monkeypatch.setattr(liveness, "live_equations", everything)
    differences = _run(FAST_SEEDS, compile_every=len(FAST_SEEDS) + 1)
    assert any("grad" in d and "all-reduce" in d for d in differences), differences
