"""`shardlib.plan`: candidate meshes, their rules, the cost model, the ranking, the refusals,
and the check of a plan against the programs XLA compiles for it.

The model here is a small FSDP + tensor-parallel MLP written in roles (``batch``, ``fsdp``,
``tensor``); the three examples' plans are checked in ``tests/test_plan_examples.py``.
"""

from __future__ import annotations

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import shardlib
import shardlib.shardops as shardops
from shardlib import Hardware
from shardlib._explain.hardware import axis_bandwidth
from shardlib._explain.report import PEAK_RATIO_BAND
from shardlib._plan import meshes
from shardlib.shardtypes import Array, f32, make_partition_specs, pytree_dataclass, typed_shard_map

B, M, F = 16, 32, 64
AXES = {"data": ("batch",), "d": ("batch", "fsdp"), "t": ("tensor",)}


@pytree_dataclass
class W:
    w1: f32[Array, b"M/fsdp F/tensor"]
    w2: f32[Array, b"F/tensor M/fsdp"]


@typed_shard_map
def _loss(x: f32[Array, b"B/batch M"], w: W) -> f32[Array, b""]:
    w1 = shardops.all_gather("M/fsdp F/tensor -> M F/tensor", w.w1)
    h = jax.nn.relu(shardops.einsum("B/batch M, M F/tensor -> B/batch F/tensor", x, w1))
    w2 = shardops.all_gather("F/tensor M/fsdp -> F/tensor M", w.w2)
    y = shardops.einsum("B/batch F/tensor, F/tensor M -> B/batch M", h, w2)
    return shardops.psum("", jnp.sum(y * y), "batch") / B


def step(w: W, x: jax.Array) -> tuple[jax.Array, W]:
    return jax.value_and_grad(lambda w: _loss(x, w))(w)


def reference(w: W, x: jax.Array) -> jax.Array:
    y = jax.nn.relu(x @ w.w1) @ w.w2
    return jnp.sum(y * y) / B


def _shapes(m: int, f: int) -> W:
    """A ``W`` of ``jax.ShapeDtypeStruct`` (shapes only)."""
    return jax.eval_shape(lambda: W(jnp.zeros((m, f)), jnp.zeros((f, m))))


ARGS = (_shapes(M, F), jax.ShapeDtypeStruct((B, M), jnp.float32))
SPECS = (make_partition_specs(W), P("batch", None))


def _plan(**kw):
    kw.setdefault("devices", 8)
    return shardlib.plan(step, *ARGS, axes=AXES, in_specs=SPECS, **kw)


# -- candidate meshes and rules -------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 8, 12, 64])
def test_meshes_are_every_factorization_over_ordered_subsets(n):
    """Brute force: every assignment of sizes >= 2 to a subset of the axes (in order) whose
    product is n, each once."""
    names = list(AXES)
    want = set()
    for k in range(1, len(names) + 1):
        for sub in itertools.combinations(names, k):
            for sizes in itertools.product(range(2, n + 1), repeat=k):
                if math.prod(sizes) == n:
                    want.add(tuple(zip(sub, sizes, strict=True)))
    got = [tuple(m.items()) for m in meshes.mesh_shapes(n, names)]
    assert len(got) == len(set(got))
    assert set(got) == (want if n > 1 else {(("data", 1),)})


def test_rules_give_each_role_its_axes_in_mesh_order_or_none():
    rules = meshes.rules_of({"data": 2, "d": 4}, AXES, ("seq",))
    assert rules == {"batch": ("data", "d"), "fsdp": ("d",), "tensor": None, "seq": None}
    assert meshes.rules_of({"t": 8}, AXES, ())["batch"] is None


def test_specs_resolve_through_the_rules():
    rules = meshes.rules_of({"data": 2, "d": 2, "t": 2}, AXES, ())
    mesh = {"data": 2, "d": 2, "t": 2}
    assert meshes.resolve_spec(P("batch", None), rules, mesh, "x") == P(("data", "d"), None)
    assert meshes.resolve_spec(P(("tensor", "fsdp")), rules, mesh, "x") == P(("t", "d"))
    assert meshes.resolve_spec(P("t"), rules, mesh, "x") == P("t")  # a mesh axis: itself


# -- the hardware's links ---------------------------------------------------------------------


def test_a_collective_inside_a_node_runs_on_the_fast_link_else_between_nodes():
    hw = Hardware("toy", 100.0, 1.0, node_size=8, inter_node_bytes_per_s=10.0)
    mesh = {"data": 16, "t": 8}  # t varies fastest: one node per data index
    assert axis_bandwidth(hw, mesh, ("t",)) == 100.0
    assert axis_bandwidth(hw, mesh, ("data",)) == 10.0
    assert axis_bandwidth(hw, {"data": 4, "t": 2}, ("data",)) == 100.0  # 8 devices: one node
    assert axis_bandwidth(hw, mesh, ("data", "t")) == 10.0
    assert axis_bandwidth(hw, mesh, ("data",), {"data": 40.0}) == 40.0  # measured
    assert axis_bandwidth(Hardware("flat", 5.0, 1.0), mesh, ("data",)) == 5.0


def test_presets_name_their_sources_and_memory():
    for name, hw in shardlib.HARDWARE.items():
        assert hw.source, name
        if name != "cpu":
            assert hw.memory_bytes and hw.node_size and hw.inter_node_bytes_per_s, name


# -- the cost model and the ranking ---------------------------------------------------------


def test_times_follow_the_stated_model():
    hw = Hardware("toy", 1e9, 1e12, memory_bytes=1e9, node_size=2, inter_node_bytes_per_s=1e8)
    result = _plan(hardware=hw, overlap=0.5)
    assert result.candidates and not result.skipped
    for c in result.candidates:
        comm = sum(
            max(r.total_sent, r.total_received) / axis_bandwidth(hw, c.mesh, r.axes)
            for r in c.report.collectives
        )
        compute = c.report.flops / 1e12
        assert c.comm_s == pytest.approx(comm) and c.compute_s == pytest.approx(compute)
        # Overlap per phase: the backward pass (x is not differentiated: dh, dW2, dW1) is 3
        # of the 5 matmuls; its collectives are the transposes (the gradient reductions).
        back = sum(
            max(r.total_sent, r.total_received) / axis_bandwidth(hw, c.mesh, r.axes)
            for r in c.report.collectives
            if r.backward or r.recomputed
        )
        phases = {"forward": (0.4 * compute, comm - back), "backward": (0.6 * compute, back)}
        for p, want in phases.items():
            assert c.costs.phases[p] == pytest.approx(want)
        assert c.step_s == pytest.approx(sum(a + b - 0.5 * min(a, b) for a, b in phases.values()))
        assert c.memory_bytes == c.report.memory.peak and c.fits is True
    steps = [c.step_s for c in result.candidates]
    assert steps == sorted(steps)
    assert result.best is result.candidates[0]


def test_layouts_over_the_budget_rank_last():
    """A budget just under the fastest layout's memory sends it below every layout that fits."""
    free = _plan(hardware="cpu")
    fastest = free.best
    budget = fastest.memory_bytes - 1
    tight = _plan(hardware="cpu", memory_budget=budget)
    fits = [bool(c.fits) for c in tight.candidates]
    assert fits == sorted(fits, reverse=True) and True in fits and False in fits
    assert all((c.memory_bytes <= budget) == c.fits for c in tight.candidates)
    assert tight.best.shape != fastest.shape and tight.best.fits
    assert "**no**" in tight.markdown()


def test_the_table_lists_every_candidate_and_every_skip_with_its_reason():
    result = _plan(devices=32, hardware="h100")
    text = result.markdown()
    for c in result.candidates:
        assert f"| {c.shape} |" in text
    assert any("not divisible" in s.reason for s in result.skipped)
    for s in result.skipped:
        assert f"| {s.shape} | {s.reason} |" in text
    # The batch (16) cannot be split 32 ways: the skip names the argument and the sizes.
    assert any(
        s.reason == "argument [1] dim 0 (size 16) is not divisible by data=32 = 32"
        for s in result.skipped
    )
    assert "Top layout's rules (for shardlib.axis_rules)" in text


@pytest.mark.slow
def test_plans_for_1024_devices_without_devices():
    big = (_shapes(1024, 4096), jax.ShapeDtypeStruct((2048, 1024), jnp.float32))
    result = shardlib.plan(step, *big, axes=AXES, in_specs=SPECS, devices=1024)
    assert len(result.candidates) > 20
    assert all(math.prod(c.mesh.values()) == 1024 for c in result.candidates)
    assert len(jax.devices()) < 1024


# -- refusals -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kw, words",
    [
        (dict(axes={}), "axes= is empty"),
        (dict(axes={"d": "batch"}), "expected a tuple of role names"),
        (dict(axes={"fsdp": ("fsdp",), "d": ("batch", "fsdp")}), "also a role carried by"),
        (dict(devices=None), "give exactly one of devices="),
        (dict(mesh_shapes=[{"d": 8}]), "give exactly one of devices="),
        (dict(devices=0), "must be a positive int"),
        (dict(hardware="tpu-v9"), "unknown hardware 'tpu-v9'"),
        (dict(overlap=2.0), "overlap=2.0 must be between 0"),
        (dict(in_specs=(P(),)), "one entry per argument (2), got a tuple of 1"),
        (dict(in_specs=(None, P("btach"))), "names 'btach', which is neither a role"),
    ],
)
def test_refusals_name_the_argument_and_the_fix(kw, words):
    args = dict(axes=AXES, in_specs=SPECS, devices=8) | kw
    with pytest.raises((ValueError, TypeError)) as e:
        shardlib.plan(step, *ARGS, **args)
    assert words in str(e.value) and str(e.value).startswith("plan:")


def test_a_mesh_shape_outside_the_axes_is_refused():
    with pytest.raises(ValueError, match=r"names axes \['x'\] not in axes="):
        shardlib.plan(step, *ARGS, axes=AXES, in_specs=SPECS, mesh_shapes=[{"x": 8}])


def test_a_trace_that_fails_is_skipped_with_its_error():
    def bad(w, x):
        if jax.sharding.get_abstract_mesh().shape.get("t", 1) == 4:
            raise ValueError("this model refuses t=4\nsecond line")
        return step(w, x)

    result = shardlib.plan(bad, *ARGS, axes=AXES, in_specs=SPECS, devices=8)
    reasons = {s.shape: s.reason for s in result.skipped}
    assert reasons["data=2 x t=4"] == "ValueError: this model refuses t=4"


def test_a_step_that_fails_everywhere_raises_its_error():
    """A bug in the step (here a missing argument) fails every trace: not an empty plan."""

    def broken(w, x):
        return shardops.psum("", jnp.sum(x))  # type: ignore[call-arg]

    with pytest.raises(ValueError, match="failed to trace on every candidate mesh") as e:
        shardlib.plan(broken, *ARGS, axes=AXES, in_specs=SPECS, devices=8)
    assert "TypeError: psum() missing 1 required positional argument" in str(e.value)
    assert isinstance(e.value.__cause__, TypeError)


# -- checked against what compiles ---------------------------------------------------------------


def test_every_candidate_compiles_to_the_predicted_collectives():
    """On the 8 CPU devices: each candidate's report pairs every collective with the compiled
    HLO's, and its memory estimate is within the bounds the guide states."""
    result = _plan(hardware="cpu")
    checks = result.verify()
    assert len(checks) == len(result.candidates) == 10
    for ch in checks:
        assert ch.comparison.identical, (ch.candidate.shape, str(ch.comparison))
        assert ch.predicted_bytes == ch.hlo_bytes > 0
        low, high = PEAK_RATIO_BAND
        assert ch.memory_ratio is not None and low <= ch.memory_ratio <= high


@pytest.mark.slow
def test_the_top_layout_runs_and_equals_the_unsharded_reference():
    """The best candidate's mesh and rules run the step: the loss and the gradients equal the
    plain jax.numpy ones."""
    best = _plan(hardware="cpu").best
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    w = W(jax.random.normal(k1, (M, F)) / 6, jax.random.normal(k2, (F, M)) / 8)
    x = jax.random.normal(k3, (B, M))
    mesh = best.make_mesh()
    with jax.set_mesh(mesh), shardlib.axis_rules(best.rules):
        placed = jax.tree.map(
            lambda a, s: jax.device_put(a, s.sharding), (w, x), best.concrete_args(mesh)
        )
        loss, grads = jax.jit(step)(*placed)
    want, want_g = jax.value_and_grad(reference)(w, x)
    np.testing.assert_allclose(loss, want, rtol=1e-5)
    for g, h in zip(jax.tree.leaves(grads), jax.tree.leaves(want_g), strict=True):
        np.testing.assert_allclose(g, h, rtol=1e-4, atol=1e-6)


def test_a_switch_counts_its_costliest_branch_not_every_branch():
    """A device runs one branch of a ``lax.switch`` (the table-driven pipeline schedules pick
    forward, backward or idle per tick this way): its FLOPs are the costliest branch's."""
    a = jax.ShapeDtypeStruct((8, 16), jnp.float32)

    def f(i, x):
        branches = [lambda x: x @ x.T @ x, lambda x: x[:, :4] @ jnp.ones((4, 16)), lambda x: x]
        return jax.lax.switch(i, branches, x)

    report = shardlib.explain(f, jax.ShapeDtypeStruct((), jnp.int32), a)
    # x @ x.T: 2 * 8 * 16 * 8; (8x8) @ x: 2 * 8 * 8 * 16: the first branch, 4096 FLOPs (the
    # second has 1024: their sum would be 5120).
    assert report.flops == 2 * 8 * 16 * 8 + 2 * 8 * 8 * 16


def test_a_gather_on_auto_axes_inside_an_explicit_program_is_counted_whole():
    """JAX runs ``x.at[order].get`` (the balanced layout's reorder) on Auto axes inside an
    Explicit program: the estimate still has a peak (those values counted whole, an upper
    bound), with a caveat naming the line, where it used to have none."""
    from shardlib import attention

    mesh = jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Explicit,))
    x = jax.ShapeDtypeStruct((8, 64), jnp.float32, sharding=jax.NamedSharding(mesh, P("d")))
    with jax.set_mesh(mesh):
        memory = shardlib.explain(lambda x: attention.to_layout(x, 4) * 2, x).memory
    assert memory.peak is not None and memory.peak >= 8 * 64 * 4  # the gather, whole
    assert any("counted whole" in c for c in memory.caveats)
