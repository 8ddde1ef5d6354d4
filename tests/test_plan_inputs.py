"""`shardlib.plan`'s inputs (issue 53, item 7) and a planned layout at a smaller size (item 6).

Every bad number is refused with a message naming the function and the argument; a plan
where nothing fits says so before its table; an axis the step never uses is flagged and
ranked after the others; ``Candidate.scaled_to`` runs the top layout of a 256-device plan on
the 8 CPU devices. The model is `tests/test_plan.py`'s MLP (abstract traces, no compiles,
except the one scaled run).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import shardlib
from shardlib import Hardware
from shardlib._plan.result import scaled_mesh
from tests.test_plan import ARGS, AXES, SPECS, W, _shapes, reference, step


def _plan(**kw):
    kw.setdefault("devices", 8)
    return shardlib.plan(step, *ARGS, axes=AXES, in_specs=SPECS, **kw)


# -- refusals ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kw, words",
    [
        (dict(memory_budget=0), "memory_budget=0 must be a positive, finite number"),
        (dict(memory_budget=-1), "memory_budget=-1 must be"),
        (dict(memory_budget=float("nan")), "memory_budget=nan must be"),
        (dict(memory_budget=float("inf")), "memory_budget=inf must be"),
        (dict(memory_budget="1GB"), "memory_budget='1GB' must be"),
        (dict(bandwidths={"d": 0.0}), "bandwidths {'d': 0.0}: each must be a positive"),
        (dict(bandwidths={"d": -5e9}), "bandwidths {'d': -5000000000.0}: each must be"),
        (dict(bandwidths={"d": float("nan")}), "bandwidths {'d': nan}: each must be"),
        (dict(bandwidths={"x": 1e9}), "bandwidths names ['x'], not axes of axes="),
        (dict(bandwidths=[("d", 1e9)]), "bandwidths=[('d', 1000000000.0)] must map"),
        (dict(overlap=float("nan")), "overlap=nan must be between 0"),
    ],
)
def test_bad_numbers_are_refused_naming_the_argument(kw, words):
    with pytest.raises((ValueError, TypeError)) as e:
        _plan(**kw)
    assert str(e.value).startswith("plan: ") and words in str(e.value), str(e.value)


@pytest.mark.parametrize(
    "field, value",
    [
        ("flops_per_s", 0.0),
        ("flops_per_s", float("nan")),
        ("link_bytes_per_s", -1.0),
        ("link_bytes_per_s", float("inf")),
        ("memory_bytes", 0),
        ("node_size", 0),
        ("node_size", 2.5),
        ("inter_node_bytes_per_s", 0.0),
        ("hbm_bytes_per_s", -2e12),
        ("collective_latency_s", -1e-6),
        ("collective_latency_s", float("nan")),
        ("torus_axes", 0),
        ("torus_axes", 1.5),
    ],
)
def test_hardware_refuses_non_positive_numbers(field, value):
    """Before: ``flops_per_s=0.0`` raised a bare ZeroDivisionError in the cost model."""
    kw: dict[str, Any] = dict(name="toy", link_bytes_per_s=1e9, flops_per_s=1e12)
    with pytest.raises(ValueError) as e:
        Hardware(**(kw | {field: value}))
    assert str(e.value).startswith("Hardware('toy'): ") and f"{field}={value!r}" in str(e.value)


def test_hardware_takes_zero_latency_and_optional_fields():
    hw = Hardware("toy", 1e9, 1e12, collective_latency_s=0.0, hbm_bytes_per_s=None)
    assert hw.collective_latency_s == 0.0 and hw.hbm_bytes_per_s is None


# -- nothing fits; an axis the step never uses --------------------------------------------------


def test_a_plan_where_nothing_fits_says_so_first_and_ranks_by_how_far_over():
    few = [{"data": 8}, {"d": 8}, {"d": 4, "t": 2}, {"data": 2, "t": 4}]
    result = _plan(hardware="cpu", memory_budget=1024, mesh_shapes=few, devices=None)
    assert all(c.fits is False for c in result.candidates)
    text = result.markdown()
    assert text.startswith("**Warning: no candidate fits the memory budget of 1.0 KiB")
    assert result.warnings and "ranked by how far over the budget" in result.warnings[0]
    memory = [c.memory_bytes for c in result.candidates]
    assert memory == sorted(memory)
    roomy = _plan(hardware="cpu", mesh_shapes=few, devices=None)
    assert not roomy.warnings and not roomy.markdown().startswith("**Warning")


def test_an_axis_whose_roles_the_step_never_names_is_flagged_and_ranked_after():
    """``x`` carries a role no spec names: its layouts replicate everything over it and have
    no communication, so they used to rank first."""
    axes = AXES | {"x": ("expert",)}
    meshes = [{"x": 8}, {"d": 4, "x": 2}, {"d": 8}, {"d": 2, "t": 4}]
    result = shardlib.plan(step, *ARGS, axes=axes, in_specs=SPECS, mesh_shapes=meshes)
    idle = [c for c in result.candidates if c.idle]
    assert len(idle) == 2 and all(c.idle == ("x",) for c in idle)
    assert all("x" in c.mesh for c in idle)
    assert all(not c.idle for c in result.candidates[: len(result.candidates) - len(idle)])
    assert any("mesh axis 'x' splits no argument" in w for w in result.warnings)
    assert "**Warning: mesh axis 'x'" in result.markdown() and "(idle: x)" in result.markdown()


# -- a planned layout at a smaller size ---------------------------------------------------------


@pytest.mark.parametrize(
    "mesh, devices, want",
    [
        ({"data": 256, "t": 4}, 8, {"data": 2, "t": 4}),
        ({"data": 64, "d": 2, "t": 8}, 8, {"data": 2, "d": 2, "t": 2}),
        ({"d": 12, "t": 2}, 6, {"d": 3, "t": 2}),
        ({"d": 8}, 8, {"d": 8}),
        ({"d": 8}, 1, {"d": 1}),
    ],
)
def test_scaled_mesh_divides_the_largest_axes_first(mesh, devices, want):
    got = scaled_mesh(mesh, devices)
    assert got == want and list(got) == list(mesh) and math.prod(got.values()) == devices


@pytest.mark.parametrize("devices, words", [(3, "must divide the 8 devices"), (0, "positive")])
def test_scaled_to_refuses_a_count_that_does_not_divide(devices, words):
    with pytest.raises(ValueError, match=words):
        scaled_mesh({"d": 4, "t": 2}, devices)


BIG = (_shapes(32, 256), jax.ShapeDtypeStruct((512, 32), jnp.float32))
BIG_SHAPES = [{"data": 64, "t": 4}, {"d": 128, "t": 2}, {"data": 32, "d": 8}]


def _scaled_best():
    result = shardlib.plan(
        step, *BIG, axes=AXES, in_specs=SPECS, mesh_shapes=BIG_SHAPES, hardware="h100"
    )
    return result.best, result.best.scaled_to(8)


def test_the_top_layout_of_a_256_device_plan_scales_to_8_devices():
    """``best.scaled_to(8)``: the same axes and rules, traced again at 8 devices (abstract);
    its ``make_mesh()`` takes the 8 devices here."""
    best, small = _scaled_best()
    assert list(small.mesh) == list(best.mesh) and small.rules == best.rules
    assert small.mesh == scaled_mesh(best.mesh, 8) and small.step_s > 0
    assert small.make_mesh().devices.size == 8


@pytest.mark.slow
def test_the_scaled_top_layout_runs_on_8_devices():
    """The scaled layout's mesh runs the step, which equals the plain jax.numpy one (about
    6 s: one compile)."""
    _, small = _scaled_best()
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    w = W(jax.random.normal(k1, (32, 256)) / 6, jax.random.normal(k2, (256, 32)) / 16)
    x = jax.random.normal(k3, (512, 32))
    mesh = small.make_mesh()
    with jax.set_mesh(mesh), shardlib.axis_rules(small.rules):
        placed = jax.tree.map(
            lambda a, s: jax.device_put(a, s.sharding), (w, x), small.concrete_args(mesh)
        )
        loss, _ = jax.jit(step)(*placed)
    # reference() divides by the test module's B; so does _loss: the same scale either way.
    np.testing.assert_allclose(loss, reference(w, x), rtol=1e-4)


def test_scaled_to_refuses_a_count_that_does_not_divide_the_candidates():
    best = _plan(mesh_shapes=[{"d": 8}], devices=None, hardware="cpu").best
    with pytest.raises(ValueError, match=r"devices=3 must divide the 8 devices of d=8"):
        best.scaled_to(3)
