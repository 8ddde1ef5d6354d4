"""`shardlib.plan(..., strategies=)` (issue 53, item 5): the choices a step exposes as keyword
arguments searched with the meshes, memory first, each distinct program priced once.

The model is `tests/test_plan.py`'s MLP with three choices: ``remat`` (the loss under
``jax.checkpoint``), ``variant`` (the loss reduced over ``batch`` by a ``psum``, or its rows
gathered with an ``all_gather``: the same program on a mesh without a batch axis), and ``k``
(the width of an extra local matmul: the same primitives in the same order, other shapes).
Abstract traces, except one compile of each strategy (`Plan.verify`).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import shardlib
import shardlib.shardops as shardops
from shardlib._plan import strategies as _strategies
from shardlib._plan.result import Candidate
from shardlib.shardtypes import Array, f32, typed_shard_map
from tests.test_plan import ARGS, AXES, SPECS, B, W

MESHES = [{"data": 2, "t": 4}, {"t": 8}, {"d": 4, "t": 2}]  # t=8: no axis carries batch
CHOICES = {"remat": (False, True), "variant": ("psum", "gather"), "k": (4, 8)}


@functools.cache
def _loss(variant: str, k: int):
    """The MLP's loss, reduced over ``batch`` by ``variant``, plus ``0 *`` a local matmul of
    width ``k`` (its FLOPs count; its value does not). check_vma off: the gathered rows are
    typed varying, and both variants must be alike where ``batch`` has no axis."""

    @functools.partial(typed_shard_map, check_vma=False)
    def loss(x: f32[Array, b"B/batch M"], w: W) -> f32[Array, b""]:
        w1 = shardops.all_gather("M/fsdp F/tensor -> M F/tensor", w.w1)
        h = jax.nn.relu(shardops.einsum("B/batch M, M F/tensor -> B/batch F/tensor", x, w1))
        w2 = shardops.all_gather("F/tensor M/fsdp -> F/tensor M", w.w2)
        y = shardops.einsum("B/batch F/tensor, F/tensor M -> B/batch M", h, w2)
        extra = 0.0 * jnp.sum(h[:, :k] @ h[:, :k].T)
        rows = jnp.sum(y * y, axis=1) + extra
        if variant == "psum":
            return shardops.psum("", jnp.sum(rows), "batch") / B
        return jnp.sum(shardops.all_gather("B/batch -> B", rows)) / B

    return loss


TRACES = [0]  # how many times a step's body ran (a trace)


def step(w: W, x: jax.Array, *, remat: bool = False, variant: str = "psum", k: int = 4):
    TRACES[0] += 1
    f = functools.partial(_loss(variant, k), x)
    return jax.value_and_grad(jax.checkpoint(f) if remat else f)(w)


def _plan(f=step, **kw):
    kw.setdefault("mesh_shapes", MESHES)
    kw.setdefault("hardware", "h100")
    return shardlib.plan(f, *ARGS, axes=AXES, in_specs=SPECS, **kw)


@functools.cache
def _searched():
    return _plan(strategies=CHOICES)


def _costs(c: Candidate) -> tuple:
    return (c.step_s, c.compute_s, c.comm_s, c.bytes_sent, c.memory_bytes, c.fits, c.costs)


def _key(mesh: dict, strategy: dict) -> tuple:
    return tuple(mesh.items()), tuple(strategy.items())


# -- the product, priced as separate plans would price it ---------------------------------------


def test_every_combination_on_every_mesh_is_a_candidate_or_merged_into_one():
    result = _searched()
    combos = [dict(zip(CHOICES, v, strict=True)) for v in itertools.product(*CHOICES.values())]
    assert _strategies.combinations(step, 2, CHOICES) == combos  # the last name fastest
    seen = [_key(c.mesh, s) for c in result.candidates for s in (c.strategy, *c.equivalent)]
    assert sorted(seen) == sorted(_key(m, s) for m in MESHES for s in combos)
    assert not result.skipped and result.strategies == {k: tuple(v) for k, v in CHOICES.items()}


def test_each_candidate_costs_exactly_what_a_plan_of_its_strategy_alone_costs():
    """Every (mesh, strategy), the merged ones included, against ``plan`` of
    ``functools.partial(step, **strategy)`` on that mesh alone: the same numbers, exactly. A
    merge of two different programs (``k=4`` and ``k=8`` have the same primitives in the same
    order) fails here."""
    for c in _searched().candidates:
        for strategy in (c.strategy, *c.equivalent):
            alone = _plan(functools.partial(step, **strategy), mesh_shapes=[c.mesh]).best
            assert _costs(alone) == _costs(c), (c.shape, strategy)
            assert alone.rules == c.rules and alone.strategy == {}


def test_strategies_with_the_same_program_on_a_mesh_are_one_candidate():
    """Without a batch axis (``t=8``) the psum and the gather are no-ops: one program, one
    row, the other variant listed as equivalent; with one they are two rows."""
    result = _searched()
    by_mesh = {}
    for c in result.candidates:
        by_mesh.setdefault(c.shape, []).append(c)
    assert {s: len(cs) for s, cs in by_mesh.items()} == {
        "data=2 x t=4": 8,
        "t=8": 4,
        "d=4 x t=2": 8,
    }
    for c in by_mesh["t=8"]:
        assert c.strategy["variant"] == "psum"
        assert c.equivalent == (c.strategy | {"variant": "gather"},)
    assert all(not c.equivalent for s in ("data=2 x t=4", "d=4 x t=2") for c in by_mesh[s])
    text = result.markdown()
    assert "(same program: remat=False, variant='gather', k=4)" in text
    assert "4 more strategies traced to a ranked program" in text


def test_values_the_printed_program_hides_still_tell_programs_apart():
    """A constant array is printed ``[...]`` in a jaxpr, and a scalar by its value: programs
    differing only there are two candidates (the same outline, other fingerprints)."""

    def scaled(w, x, *, scale, factor):
        loss, grads = step(w, x)
        return loss * jnp.sum(jnp.asarray(np.full((3,), scale, np.float32))) * factor, grads

    result = _plan(
        scaled, mesh_shapes=[{"t": 8}], strategies={"scale": (0.5, 2.0), "factor": (1.5, 3.0)}
    )
    assert len(result.candidates) == 4 and not any(c.equivalent for c in result.candidates)

    def plain(x, *, scale, factor):
        return jnp.sum(x * jnp.asarray(np.full((3,), scale, np.float32))) * factor

    x = jnp.ones(3)
    combos = _strategies.combinations(plain, 1, {"scale": (0.5, 2.0), "factor": (1.5, 3.0)})
    jaxprs = [jax.make_jaxpr(functools.partial(plain, **s))(x) for s in combos]
    assert len({_strategies.outline(j) for j in jaxprs}) == 1
    assert len({_strategies.fingerprint(j) for j in jaxprs}) == 4
    again = jax.make_jaxpr(functools.partial(plain, scale=0.5, factor=1.5))(x)
    assert _strategies.fingerprint(again) == _strategies.fingerprint(jaxprs[0])


def test_a_keyword_the_step_ignores_merges_every_value():
    def ignoring(w, x, *, note):
        return step(w, x)

    result = _plan(ignoring, strategies={"note": ("a", "b", "c")})
    assert len(result.candidates) == len(MESHES)
    for c in result.candidates:
        assert c.strategy == {"note": "a"} and c.equivalent == ({"note": "b"}, {"note": "c"})
    small = result.candidates[0].scaled_to(4)  # a merged candidate still traces again
    assert small.strategy == {"note": "a"} and small.equivalent == ()


# -- traced once, memory first ----------------------------------------------------------------


def test_each_mesh_and_strategy_is_traced_once_whatever_the_overlap():
    """explain, the roofline and the program comparison share one trace per (mesh, strategy)
    (JAX's trace cache, one bound step per strategy); the cost model's overlap prices it."""
    for overlap in (0.0, 1.0):
        TRACES[0] = 0
        _plan(strategies=CHOICES, overlap=overlap)
        assert TRACES[0] == len(MESHES) * 8


# The arguments' bytes per device (f32): w1 and w2 (M x F = 32 x 64 each, 8 KiB) split over the
# mesh's fsdp and tensor axes, x (B x M = 16 x 32, 2 KiB) over its batch axes.
ARG_BYTES = {
    "data=8": 16 * 1024 + 2048 // 8,  # weights whole, x over 8
    "data=2 x t=4": 16 * 1024 // 4 + 2048 // 2,
    "t=8": 16 * 1024 // 8 + 2048,
    "d=4 x t=2": 16 * 1024 // 8 + 2048 // 4,
}


def test_a_mesh_whose_arguments_alone_exceed_the_budget_is_skipped_untraced():
    meshes = [{"data": 8}, *MESHES]
    budget = 6 * 1024  # between data=8's 16.25 KiB and the others' 2.5 to 5 KiB
    TRACES[0] = 0
    result = _plan(mesh_shapes=meshes, memory_budget=budget, strategies={"remat": (False, True)})
    assert TRACES[0] == 2 * len(MESHES)  # data=8: not traced
    assert [(s.shape, s.reason, s.strategy) for s in result.skipped] == [
        (
            "data=8",
            "the arguments alone take 16.2 KiB per device, over the memory budget of 6.0 KiB "
            "(not traced)",
            {},
        )
    ]
    assert {c.shape for c in result.candidates} == {"data=2 x t=4", "t=8", "d=4 x t=2"}
    for c in result.candidates:
        assert sum(b for _, b in c.report.argument_bytes) == ARG_BYTES[c.shape] <= budget
    assert "| data=8 | every | the arguments alone take 16.2 KiB" in result.markdown()


def test_when_no_mesh_s_arguments_fit_every_mesh_is_traced_and_ranked_by_how_far_over():
    TRACES[0] = 0
    result = _plan(memory_budget=1024)
    assert TRACES[0] == len(MESHES) and not result.skipped
    assert result.warnings and "ranked by how far over" in result.warnings[0]


def test_skips_are_listed_in_mesh_order_whether_before_or_during_tracing():
    def refusing(w, x, *, remat):
        if jax.sharding.get_abstract_mesh().shape.get("t") == 8:
            raise ValueError("this model refuses t=8")
        return step(w, x, remat=remat)

    meshes = [{"t": 8}, {"data": 8}, {"d": 4, "t": 2}]
    result = _plan(
        refusing, mesh_shapes=meshes, memory_budget=6 * 1024, strategies={"remat": (False, True)}
    )
    assert [(s.shape, s.strategy, s.reason[:24]) for s in result.skipped] == [
        ("t=8", {"remat": False}, "ValueError: this model r"),
        ("t=8", {"remat": True}, "ValueError: this model r"),
        ("data=8", {}, "the arguments alone take"),
    ]
    text = result.markdown()
    assert "| t=8 | remat=False | ValueError: this model refuses t=8 |" in text


def test_the_order_of_meshes_and_values_changes_no_result():
    meshes = [{"data": 8}, *MESHES]
    kw = dict(memory_budget=6 * 1024)
    forward = _plan(mesh_shapes=meshes, strategies={"variant": ("psum", "gather")}, **kw)
    backward = _plan(mesh_shapes=meshes[::-1], strategies={"variant": ("gather", "psum")}, **kw)

    def rows(result):
        out = {}
        for c in result.candidates:
            same = frozenset(tuple(s.items()) for s in (c.strategy, *c.equivalent))
            out[(c.shape, same)] = _costs(c)
        return out, sorted((s.shape, s.reason) for s in result.skipped)

    assert rows(forward) == rows(backward)


# -- what the user is told, and refused ----------------------------------------------------------


def test_best_says_what_to_pass_and_scales_with_its_strategy():
    result = _plan(mesh_shapes=[{"d": 4, "t": 2}], strategies={"remat": (True,), "k": (8,)})
    best = result.best
    assert best.strategy == {"remat": True, "k": 8}
    small = best.scaled_to(4)
    assert small.mesh == {"d": 2, "t": 2} and small.strategy == best.strategy
    alone = _plan(functools.partial(step, remat=True, k=8), mesh_shapes=[small.mesh]).best
    assert _costs(small) == _costs(alone)
    text = result.markdown()
    assert "| rank | mesh | strategy | step |" in text and "| d=4 x t=2 | remat=True, k=8 |" in text
    assert "Top layout's strategy (step(*args, **strategy)): {'remat': True, 'k': 8}" in text
    assert "strategy" not in _plan(mesh_shapes=[{"t": 8}]).markdown()


def test_the_tracer_is_not_part_of_the_candidate_s_public_surface():
    c = _plan(mesh_shapes=[{"t": 8}]).best
    names = set(inspect.signature(Candidate).parameters)
    assert not {n for n in names if "tracer" in n}
    assert {"strategy", "equivalent"} <= names
    assert "tracer" not in repr(c) and not hasattr(c, "tracer")
    assert c.scaled_to(4).mesh == {"t": 4}


@functools.cache
def _columns(k: int):
    """The MLP's loss over the first ``k`` columns of its output, reduced over ``batch`` by a
    psum of ``k`` values: ``k`` sets the psum's bytes."""

    @typed_shard_map
    def loss(x: f32[Array, b"B/batch M"], w: W) -> f32[Array, b""]:
        w1 = shardops.all_gather("M/fsdp F/tensor -> M F/tensor", w.w1)
        h = jax.nn.relu(shardops.einsum("B/batch M, M F/tensor -> B/batch F/tensor", x, w1))
        w2 = shardops.all_gather("F/tensor M/fsdp -> F/tensor M", w.w2)
        y = shardops.einsum("B/batch F/tensor, F/tensor M -> B/batch M", h, w2)
        return jnp.sum(shardops.psum("K", jnp.sum(y[:, :k] ** 2, axis=0), "batch")) / B

    return loss


def columns(w: W, x: jax.Array, *, k: int = 4):
    return jax.value_and_grad(functools.partial(_columns(k), x))(w)


def test_verify_compiles_each_candidate_with_its_strategy():
    """Each candidate's report matches the HLO of its own strategy (``k=16``: a psum of 16
    values, where the step's default sends 4)."""
    result = _plan(columns, mesh_shapes=[{"data": 2, "t": 4}], strategies={"k": (16, 4)})
    checks = result.verify()
    assert len(checks) == 2
    for ch in checks:
        assert ch.comparison.identical, (ch.candidate.strategy, str(ch.comparison))
        assert ch.predicted_bytes == ch.hlo_bytes > 0
    assert checks[0].hlo_bytes != checks[1].hlo_bytes


def _positional(w, x, remat=False):
    return step(w, x, remat=remat)


def _only(w, x, /, remat=False):
    return step(w, x, remat=remat)


def _positional_only(w, x, remat, /):
    return step(w, x, remat=remat)


BAD_STRATEGIES = [
    (step, [("remat", (False, True))], "strategies=[('remat', (False, True))] must map"),
    (step, {"remat": True}, "strategies['remat'] = True must be a sequence"),
    (step, {"variant": "psum"}, "strategies['variant'] = 'psum' must be a sequence"),
    (step, {"remat": {False, True}}, "must be a sequence (a tuple or a list, in the order"),
    (step, {"remat": ()}, "strategies['remat'] is empty"),
    (step, {"k": (4, 8, 4)}, "gives 4 more than once"),
    (step, {"context": ("ring",)}, "which step does not take as a keyword argument"),
    (step, {1: (2,)}, "strategies names 1; each name must be a keyword argument"),
    (step, {"x": (1,)}, "already gets as its positional argument 1 of *args"),
    (_positional_only, {"remat": (True,)}, "a positional-only parameter of"),
]


def test_bad_strategies_are_refused_naming_plan_and_strategies():
    for f, strategies, words in BAD_STRATEGIES:
        with pytest.raises((TypeError, ValueError)) as e:
            _plan(f, strategies=strategies)
        text = str(e.value)
        assert text.startswith("plan: ") and "strategies" in text and words in text, text


def test_a_keyword_the_step_takes_positionally_after_the_arguments_is_accepted():
    assert _plan(_positional, strategies={"remat": (True,)}).best.strategy == {"remat": True}
    assert _plan(_only, strategies={"remat": (True,)}).best.strategy == {"remat": True}

    def anything(w, x, **kw):
        return step(w, x, **kw)

    assert _plan(anything, strategies={"k": (8,)}).best.strategy == {"k": 8}


# -- the transformer example: context parallelism's attention as a strategy --------------------


def test_the_transformer_s_context_strategy_merges_where_no_axis_splits_the_sequence():
    from benchmarks import plan_workloads as pw
    from examples import transformer_model as tm

    config, batch, _ = pw.TRANSFORMER_SIZES["cpu"]
    w = pw.transformer(config, batch)

    def train(model, tokens, *, context):
        return tm.loss_and_grad(dataclasses.replace(config, context=context), model, tokens)

    result = shardlib.plan(
        train,
        *w.args,
        axes=w.axes,
        in_specs=w.in_specs,
        roles=w.roles,
        mesh_shapes=[{"data": 4, "t": 2}, {"d": 2, "c": 2, "t": 2}],
        hardware="h100",
        strategies={"context": ("ring", "gathered")},
    )
    rows = {(c.shape, c.strategy["context"]): c for c in result.candidates}
    assert set(rows) == {
        ("data=4 x t=2", "ring"),
        ("d=2 x c=2 x t=2", "ring"),
        ("d=2 x c=2 x t=2", "gathered"),
    }
    assert rows["data=4 x t=2", "ring"].equivalent == ({"context": "gathered"},)
    ring, gathered = rows["d=2 x c=2 x t=2", "ring"], rows["d=2 x c=2 x t=2", "gathered"]
    assert [r.fn for r in ring.report.rings] == ["ring"]
    assert [r.fn for r in gathered.report.rings] == ["gathered"]
    assert ring.bytes_sent != gathered.bytes_sent
