"""`shardlib.calibrate`: the fits on synthetic timings, the measured `Hardware` on the 8 CPU
devices, refused arguments, and the cost model's terms it sets (no timing is asserted)."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import shardlib
from shardlib import Hardware
from shardlib._plan.calibrate import CollectiveFit, Fit, fit_collectives, fit_line, hardware_from


def test_fit_line_is_exact_on_a_line():
    xs = [1e3, 4e3, 16e3]
    fit = fit_line(xs, [2e-4 + x / 5e9 for x in xs])
    assert fit.overhead == pytest.approx(2e-4, rel=1e-9)
    assert fit.rate == pytest.approx(5e9, rel=1e-9)


def test_fit_line_refits_noise_through_the_origin():
    # A negative intercept: through the origin.
    fit = fit_line([1.0, 2.0, 3.0], [0.09, 0.2, 0.31])
    assert fit.overhead == 0.0 and fit.rate == pytest.approx(14 / (0.09 + 0.4 + 0.93))
    # Times that shrink: the largest size over its time.
    assert fit_line([1.0, 2.0, 4.0], [3.0, 2.0, 1.0]) == Fit(0.0, 4.0)


def test_fit_collectives_is_exact_in_the_cost_models_form():
    calls = [2, 2, 1, 1, 1, 1]
    steps = [14, 14, 14, 14, 1, 1]
    moved = [7e3, 7e6, 7e3, 7e6, 4e3, 4e6]
    truth = CollectiveFit(call_s=1.5e-4, latency_s=3e-6, bytes_per_s=2e9)
    seconds = [
        c * truth.call_s + s * truth.latency_s + b / truth.bytes_per_s
        for c, s, b in zip(calls, steps, moved, strict=True)
    ]
    got = fit_collectives(calls, steps, moved, seconds)
    assert (got.call_s, got.latency_s, got.bytes_per_s) == pytest.approx(
        (truth.call_s, truth.latency_s, truth.bytes_per_s), rel=1e-9
    )


def test_fit_collectives_keeps_every_term_nonnegative():
    # Per call alone (no cost per step): the latency per step is 0, not negative.
    calls, steps, moved = [2, 2, 1, 1], [14, 14, 1, 1], [1e3, 1e6, 1e3, 1e6]
    seconds = [c * 1e-4 + b / 1e9 for c, b in zip(calls, moved, strict=True)]
    got = fit_collectives(calls, steps, moved, seconds)
    assert got.latency_s == 0.0 and got.call_s == pytest.approx(1e-4)
    assert got.bytes_per_s == pytest.approx(1e9)
    # More bytes took less time: the bandwidth alone, through the origin.
    got = fit_collectives([1, 1], [1, 1], [1e3, 4e3], [4e-6, 2e-6])
    assert (got.call_s, got.latency_s) == (0.0, 0.0)
    assert got.bytes_per_s == pytest.approx((1e6 + 16e6) / (4e-3 + 8e-3))


MALFORMED_TIMINGS = [
    ([1.0, 2.0], [1.0], "two sequences of one length"),
    ([1.0, 1.0], [1.0, 2.0], "two distinct sizes"),
    ([1.0, 2.0], [1.0, 0.0], "seconds finite and > 0"),
    ([1.0, math.nan], [1.0, 2.0], "sizes must be finite"),
]


def test_fit_line_refuses_malformed_timings():
    for xs, seconds, words in MALFORMED_TIMINGS:
        with pytest.raises(ValueError, match=f"^calibrate \\(x\\): .*{words}"):
            fit_line(xs, seconds, "calibrate (x)")


def test_hardware_from_keeps_each_axis_and_the_slowest_as_the_links():
    axes = {"a": CollectiveFit(2e-4, 1e-5, 2e9), "b": CollectiveFit(1e-4, 3e-5, 1e9)}
    hw = hardware_from("toy", Fit(1e-4, 1e10), Fit(1e-6, 5e9), 1e-6, axes)
    assert (hw.flops_per_s, hw.hbm_bytes_per_s, hw.elementwise_bytes_per_s) == (1e10, 5e9, 5e9)
    assert hw.op_overhead_s == 1e-6
    assert (hw.link_bytes_per_s, hw.collective_latency_s, hw.collective_call_s) == (
        1e9,
        3e-5,
        2e-4,
    )
    assert hw.axis_bytes_per_s == {"a": 2e9, "b": 1e9}
    assert hw.axis_latency_s == {"a": 1e-5, "b": 3e-5}


BAD_CALIBRATED_FIELDS = [
    ("op_overhead_s", -1e-6),
    ("collective_call_s", math.inf),
    ("elementwise_bytes_per_s", 0.0),
    ("axis_bytes_per_s", {"d": 0.0}),
    ("axis_latency_s", {"d": -1.0}),
    ("axis_bytes_per_s", [("d", 1e9)]),
]


def test_hardware_refuses_bad_calibrated_fields():
    for field, value in BAD_CALIBRATED_FIELDS:
        with pytest.raises(ValueError, match=rf"^Hardware\('toy'\): {field}="):
            Hardware("toy", 1e9, 1e12, **{field: value})


BAD_CALIBRATE_ARGUMENTS = [
    ({"mesh": {"d": 16}}, ValueError, r"mesh=\{'d': 16\} needs 16 devices; 8 are present"),
    ({"mesh": {}}, ValueError, r"mesh=\{\} names no axis"),
    ({"mesh": {"d": 1}}, ValueError, r"mesh=\{'d': 1\} has no axis of more than one device"),
    ({"mesh": {"d": 2.0}}, TypeError, r"mesh=\{'d': 2.0\} must be a jax.sharding.Mesh"),
    ({"mesh": [8]}, TypeError, r"mesh=\[8\] must be a jax.sharding.Mesh"),
    ({"repeats": 0}, ValueError, r"repeats=0 must be an int >= 1"),
    ({"repeats": True}, ValueError, r"repeats=True must be an int >= 1"),
]


def test_calibrate_refuses_bad_arguments():
    for kwargs, error, words in BAD_CALIBRATE_ARGUMENTS:
        with pytest.raises(error, match=f"^calibrate: {words}"):
            shardlib.calibrate(**kwargs)


@pytest.fixture(scope="module")
def calibrated() -> Hardware:
    return shardlib.calibrate({"data": 4, "t": 2}, repeats=1)


def test_calibrate_measures_each_axis_on_the_cpu_devices(calibrated):
    hw = calibrated
    figures = [hw.flops_per_s, hw.hbm_bytes_per_s, hw.link_bytes_per_s, hw.op_overhead_s]
    assert all(math.isfinite(x) and x > 0 for x in figures), hw
    assert set(hw.axis_bytes_per_s or {}) == set(hw.axis_latency_s or {}) == {"data", "t"}
    assert all(math.isfinite(b) and b > 0 for b in (hw.axis_bytes_per_s or {}).values())
    assert all(math.isfinite(a) and a >= 0 for a in (hw.axis_latency_s or {}).values())
    assert hw.link_bytes_per_s == min((hw.axis_bytes_per_s or {}).values())
    assert "shardlib.calibrate" in hw.source and "data=4 x t=2" in hw.source


def _step(w: jax.Array, x: jax.Array) -> jax.Array:
    return jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w) ** 2))(w)


_AXES = {"data": ("batch",), "t": ("model",)}
_ARGS = (jax.ShapeDtypeStruct((32, 64), jnp.float32), jax.ShapeDtypeStruct((16, 32), jnp.float32))
_SPECS = (P(None, "model"), P("batch", None))


def _plan(hw: Hardware, **kw) -> shardlib.Plan:
    return shardlib.plan(_step, *_ARGS, axes=_AXES, in_specs=_SPECS, hardware=hw, **kw)


def test_a_plan_runs_on_the_calibrated_hardware(calibrated):
    result = _plan(calibrated, devices=8)
    assert result.candidates and all(c.step_s > 0 for c in result.candidates)
    assert all(math.isfinite(c.step_s) for c in result.candidates)


def test_op_overhead_and_elementwise_bytes_are_counted_with_compute():
    flat = Hardware("flat", 1e9, 1e12)
    base = _plan(flat, mesh_shapes=[{"data": 8}]).candidates[0]
    ops = _plan(dataclasses.replace(flat, op_overhead_s=1e-3), mesh_shapes=[{"data": 8}])
    extra = ops.candidates[0].compute_s - base.compute_s
    # Every equation costs 1 ms: a whole number of them, at least the two matmuls and tanh.
    assert extra >= 3e-3 and extra / 1e-3 == pytest.approx(round(extra / 1e-3))
    assert ops.candidates[0].step_s - base.step_s == pytest.approx(extra)  # in the step too
    elem = _plan(dataclasses.replace(flat, elementwise_bytes_per_s=1.0), mesh_shapes=[{"data": 8}])
    # tanh of the (2, 64) block alone reads and writes 2 * 2 * 64 * 4 bytes, at 1 B/s.
    assert elem.candidates[0].compute_s - base.compute_s >= 1024


def _summed(x: jax.Array) -> jax.Array:
    """A psum over ``data`` inside ``shard_map`` (on the plan's abstract mesh)."""
    body = jax.shard_map(lambda v: jax.lax.psum(v, "data"), in_specs=P("data"), out_specs=P())
    return body(x)


def _plan_summed(hw: Hardware, **kw) -> shardlib.Candidate:
    x = jax.ShapeDtypeStruct((8 * 1024,), jnp.float32)
    result = shardlib.plan(
        _summed,
        x,
        axes={"data": ("batch",)},
        in_specs=(P("batch"),),
        mesh_shapes=[{"data": 8}],
        hardware=hw,
        **kw,
    )
    return result.candidates[0]


def test_measured_axis_figures_price_the_collectives_over_that_axis():
    flat = Hardware("flat", 1e9, 1e12)
    base = _plan_summed(flat)
    assert base.comm_s > 0
    slow = dataclasses.replace(flat, axis_bytes_per_s={"data": 1e8}, axis_latency_s={"data": 1e-3})
    priced = _plan_summed(slow)
    # 2 x 1024 x 4 x 7/8 bytes at 1e8 B/s, and 14 ring steps at 1 ms.
    assert priced.comm_s == pytest.approx(7168 / 1e8 + 14e-3)
    # plan(bandwidths=) overrides the hardware's measured axis.
    assert _plan_summed(slow, bandwidths={"data": 1e9}).comm_s == pytest.approx(7168 / 1e9 + 14e-3)
    # An axis the hardware did not measure keeps the links and the latency.
    other = dataclasses.replace(flat, axis_bytes_per_s={"t": 1e8}, axis_latency_s={"t": 1.0})
    assert _plan_summed(other).comm_s == base.comm_s
    # A cost per call: once per collective run, whatever its steps.
    called = _plan_summed(dataclasses.replace(flat, collective_call_s=1e-3))
    assert called.comm_s == pytest.approx(base.comm_s + 1e-3)


def test_only_equations_that_launch_a_kernel_pay_the_op_overhead():
    from shardlib._plan.roofline import matmuls

    def step(x: jax.Array) -> jax.Array:  # reshape, broadcast, convert: no kernel; add: one
        y = jnp.broadcast_to(x.reshape(4, 2), (3, 4, 2)).astype(jnp.float16)
        return y + jnp.float16(1)

    hw = Hardware("toy", 1e9, 1e12, op_overhead_s=1.0)
    counted = matmuls(step, (jax.ShapeDtypeStruct((8,), jnp.float32),), hw)
    assert counted.ops == {"forward": 1, "backward": 0}
    assert counted.overhead_s == {"forward": 1.0, "backward": 0.0}


def test_an_elementwise_chain_is_one_kernel_reading_its_inputs_once():
    """XLA fuses an elementwise operation into its readers' kernel when only elementwise
    operations or reductions read it and it is not a result: ``u * 2 + y`` into the tanh's
    kernel (which the matmul reads: a kernel), ``x * 3`` into the sum's; ``u`` is a result,
    so its add is a kernel although only elementwise operations read it. A fused kernel
    reads the chain's inputs once and writes its last result."""
    from shardlib._plan.roofline import matmuls

    def step(x: jax.Array, y: jax.Array) -> tuple[jax.Array, ...]:
        u = x + 1.0
        t = jnp.tanh(u * 2.0 + y)
        return u, (x * 3.0).sum(), t @ y.T

    n = 16 * 16 * 4  # bytes of one (16, 16) f32 array
    args = (jax.ShapeDtypeStruct((16, 16), jnp.float32),) * 2
    counted = matmuls(step, args, Hardware("toy", 1e9, 1e12, op_overhead_s=1.0))
    # u's add, tanh's kernel, the sum's, the transpose and the matmul.
    assert counted.ops["forward"] == 5 and counted.overhead_s["forward"] == 5.0
    moved = matmuls(step, args, Hardware("toy", 1e9, 1e12, elementwise_bytes_per_s=1.0))
    # u: x read, u written (2 n); tanh's kernel: u and y read, its result written (3 n); the
    # sum's kernel: x read (n), one float written (4); the transpose: y read and written (2 n).
    assert moved.overhead_s["forward"] == 2 * n + 3 * n + n + 4 + 2 * n
