"""`shardlib.calibrate`: the fits on synthetic timings, the measured `Hardware` on the 8 CPU
devices, refused arguments, and the cost model's terms it sets (no timing is asserted)."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import shardlib
from shardlib import Hardware
from shardlib._plan.calibrate import (
    CollectiveFit,
    Fit,
    fit_collectives,
    fit_line,
    group_mesh,
    group_sizes,
    hardware_from,
)


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


def _timings(truth: CollectiveFit, groups: tuple[int, ...]) -> tuple[list, ...]:
    """Each kind at two message sizes and each group size, timed as the cost model says."""
    rows = []  # (kind, calls, steps, bytes moved)
    for g in groups:
        for size in (4e3, 4e6):
            rows.append(("all-gather", 2, 2 * (g - 1), 2 * size * (g - 1) / g))
            rows.append(("all-reduce", 1, 2 * (g - 1), 2 * size * (g - 1) / g))
            rows.append(("collective-permute", 1, 1, size))
    kinds, calls, steps, moved = (list(column) for column in zip(*rows, strict=True))
    seconds = [
        c * truth.call_s[k] + s * truth.latency_s[k] + b / truth.bytes_per_s
        for k, c, s, b in zip(kinds, calls, steps, moved, strict=True)
    ]
    return kinds, calls, steps, moved, seconds


def test_fit_collectives_is_exact_in_the_cost_models_form():
    call_s = {"all-gather": 6e-5, "all-reduce": 1.5e-5, "collective-permute": 2.5e-4}
    # A permute runs one step per call whatever its group: its call holds its latency.
    latency_s = {"all-gather": 3e-5, "all-reduce": 1.7e-5, "collective-permute": 0.0}
    truth = CollectiveFit(call_s, latency_s, bytes_per_s=2e9)
    got = fit_collectives(*_timings(truth, (2, 4, 8)))
    assert got.call_s == pytest.approx(call_s, rel=1e-9)
    assert got.latency_s == pytest.approx(latency_s, rel=1e-9, abs=1e-15)
    assert got.bytes_per_s == pytest.approx(2e9, rel=1e-9)
    # At one group size the steps per call are fixed: each call holds its kind's steps.
    got = fit_collectives(*_timings(truth, (8,)))
    assert got.latency_s == dict.fromkeys(call_s, 0.0)
    assert got.call_s["all-reduce"] == pytest.approx(1.5e-5 + 14 * 1.7e-5, rel=1e-9)


def test_fit_collectives_keeps_every_term_nonnegative():
    # Per call alone (no cost per step): the latency per step is 0, not negative.
    call_s = {"all-gather": 1e-4, "all-reduce": 1e-4, "collective-permute": 1e-4}
    got = fit_collectives(*_timings(CollectiveFit(call_s, dict.fromkeys(call_s, 0.0), 1e9), (2, 8)))
    assert got.latency_s == dict.fromkeys(call_s, 0.0) and got.call_s == pytest.approx(call_s)
    assert got.bytes_per_s == pytest.approx(1e9)
    # More bytes took less time: the bandwidth alone, through the origin (relative squares).
    got = fit_collectives(["all-reduce"] * 2, [1, 1], [1, 1], [1e3, 4e3], [4e-6, 2e-6])
    assert (got.call_s, got.latency_s) == ({"all-reduce": 0.0}, {"all-reduce": 0.0})
    rates = (1e3 / 4e-6, 4e3 / 2e-6)  # bytes over seconds: the fit minimises sum (r / bw - 1)^2
    assert got.bytes_per_s == pytest.approx(sum(r * r for r in rates) / sum(rates))


def test_fit_collectives_weighs_each_timing_alike():
    # The largest timing 30% slow: squares of absolute errors would let it bend the fit, the
    # small timings (which the latencies set) predicted up to 3x off; relative squares keep
    # every other timing within 5%.
    three = ("all-gather", "all-reduce", "collective-permute")
    truth = CollectiveFit(dict.fromkeys(three, 2e-5), dict.fromkeys(three, 1e-5), 1e9)
    kinds, calls, steps, moved, seconds = _timings(truth, (2, 4, 8))
    slow = seconds.index(max(seconds))
    seconds[slow] *= 1.3
    got = fit_collectives(kinds, calls, steps, moved, seconds)
    errors = [
        abs((c * got.call_s[k] + s * got.latency_s[k] + b / got.bytes_per_s) / t - 1)
        for k, c, s, b, t in zip(kinds, calls, steps, moved, seconds, strict=True)
    ]
    assert max(e for i, e in enumerate(errors) if i != slow) < 0.05


def test_collectives_are_timed_in_groups_of_consecutive_devices_of_the_axis():
    assert group_sizes(8) == (2, 4, 8) and group_sizes(16) == (2, 4, 16)
    assert group_sizes(2) == (2,) and group_sizes(6) == (2, 3, 6) and group_sizes(7) == (7,)
    assert group_sizes(12) == (2, 4, 12)
    # Each group: consecutive devices of the axis, as the mesh places them.
    mesh = jax.make_mesh((4, 2), ("data", "t"))
    sub = group_mesh(mesh, "data", 2)
    assert dict(sub.shape) == {"rest": 4, "data": 2}
    assert sorted(d.id for d in sub.devices.flat) == sorted(d.id for d in mesh.devices.flat)
    where = {d.id: i for i, d in np.ndenumerate(mesh.devices)}
    for row in sub.devices:  # two neighbours along 'data', 't' the same
        (i, t), (j, u) = where[row[0].id], where[row[1].id]
        assert (j, u) == (i + 1, t) and i % 2 == 0


def test_each_axis_is_timed_at_its_group_sizes_and_fitted(monkeypatch):
    """`calibrate`'s collectives, with every timing replaced by the cost model's seconds for
    what the timed program runs (its kind, read off its jaxpr; its group, off its mesh): the
    fit recovers the latency per step, each kind's call and the bandwidth."""
    from shardlib._plan import calibrate as cal

    call = {"all-gather": 6e-5, "all-reduce": 1.5e-5, "collective-permute": 2.5e-4}
    latency = {"all-gather": 3e-5, "all-reduce": 1.7e-5, "collective-permute": 1e-5}
    bandwidth = 2e9

    def timed(looped, args, repeats, chain=(1, 9)):
        (x,) = args
        text = str(jax.make_jaxpr(looped)(x, jnp.int32(1)))
        kind = next(k for p, k in (("all_gather", "all-gather"), ("psum", "all-reduce"),
                                   ("ppermute", "collective-permute")) if p in text)  # fmt: skip
        g, n = x.sharding.mesh.shape["data"], x.shape[0] // x.sharding.mesh.size
        if kind == "all-gather":  # with its reduce-scatter: two calls, each g - 1 steps
            return 2 * (call[kind] + (g - 1) * latency[kind] + 4 * n * (g - 1) / bandwidth)
        if kind == "all-reduce":
            return call[kind] + 2 * (g - 1) * latency[kind] + 2 * 4 * n * (g - 1) / g / bandwidth
        return call[kind] + latency[kind] + 4 * n / bandwidth

    monkeypatch.setattr(cal, "_per_op", timed)
    got = cal._axis(jax.make_mesh((8,), ("data",)), "data", 1)
    # The permute's one step per call is in its call; the reduce-scatter's figures are the
    # all-gather's (timed together).
    permute = call["collective-permute"] + latency["collective-permute"]
    want_call = {**call, "collective-permute": permute, "reduce-scatter": call["all-gather"]}
    want_latency = {**latency, "collective-permute": 0.0, "reduce-scatter": latency["all-gather"]}
    assert got.call_s == pytest.approx(want_call, rel=1e-6)
    assert got.latency_s == pytest.approx(want_latency, rel=1e-6, abs=1e-12)
    assert got.bytes_per_s == pytest.approx(bandwidth, rel=1e-6)


MALFORMED_TIMINGS = [
    ([1.0, 2.0], [1.0], "two sequences of one length"),
    ([1.0, 1.0], [1.0, 2.0], "two distinct sizes"),
    ([1.0, 2.0], [1.0, 0.0], "seconds finite and > 0"),
    ([1.0, math.nan], [1.0, 2.0], "sizes must be finite"),
]


def test_fits_refuse_malformed_timings():
    for xs, seconds, words in MALFORMED_TIMINGS:
        with pytest.raises(ValueError, match=f"^calibrate \\(x\\): .*{words}"):
            fit_line(xs, seconds, "calibrate (x)")
    with pytest.raises(ValueError, match=r"^calibrate \(c\): kinds must be one collective kind"):
        fit_collectives(["all-reduce"], [1, 1], [1, 1], [1.0, 2.0], [1.0, 2.0], "calibrate (c)")


def test_hardware_from_keeps_each_axis_and_the_slowest_as_the_links():
    axes = {
        "a": CollectiveFit({"all-reduce": 2e-4, "all-gather": 1e-6}, {"all-reduce": 1e-5}, 2e9),
        "b": CollectiveFit(
            {"all-reduce": 1e-4, "collective-permute": 3e-4},
            {"all-reduce": 2e-5, "collective-permute": 3e-5},
            1e9,
        ),
    }
    hw = hardware_from("toy", Fit(1e-4, 1e10), Fit(1e-6, 5e9), Fit(2e-6, 7e9), axes)
    assert (hw.flops_per_s, hw.hbm_bytes_per_s, hw.elementwise_bytes_per_s) == (1e10, 5e9, 7e9)
    assert hw.op_overhead_s == 2e-6
    assert (hw.link_bytes_per_s, hw.collective_latency_s, hw.collective_call_s) == (
        1e9,
        3e-5,
        3e-4,
    )
    assert hw.axis_bytes_per_s == {"a": 2e9, "b": 1e9}
    assert hw.axis_latency_s == {"a": 1e-5, "b": 3e-5}
    assert hw.collective_latency_by_kind_s == {
        "all-gather": 0.0,
        "all-reduce": 2e-5,
        "collective-permute": 3e-5,
    }
    assert hw.collective_call_by_kind_s == {
        "all-gather": 1e-6,
        "all-reduce": 2e-4,
        "collective-permute": 3e-4,
    }


BAD_CALIBRATED_FIELDS = [
    ("op_overhead_s", -1e-6),
    ("collective_call_s", math.inf),
    ("elementwise_bytes_per_s", 0.0),
    ("axis_bytes_per_s", {"d": 0.0}),
    ("axis_latency_s", {"d": -1.0}),
    ("axis_bytes_per_s", [("d", 1e9)]),
    ("collective_call_by_kind_s", {"all-reduce": math.nan}),
    ("collective_latency_by_kind_s", {"all-reduce": -1e-6}),
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
    figures = [hw.flops_per_s, hw.hbm_bytes_per_s, hw.link_bytes_per_s, hw.elementwise_bytes_per_s]
    assert all(math.isfinite(x) and x > 0 for x in figures), hw
    assert math.isfinite(hw.op_overhead_s) and hw.op_overhead_s >= 0  # an intercept: may be 0
    assert set(hw.collective_call_by_kind_s or {}) == {
        "all-gather",
        "reduce-scatter",
        "all-reduce",
        "collective-permute",
    }
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
    # A cost per call: once per collective run, whatever its steps; its kind's when given.
    called = _plan_summed(dataclasses.replace(flat, collective_call_s=1e-3))
    assert called.comm_s == pytest.approx(base.comm_s + 1e-3)
    kinds = {"all-reduce": 5e-3, "all-gather": 1.0}
    by_kind = dataclasses.replace(flat, collective_call_s=1e-3, collective_call_by_kind_s=kinds)
    assert _plan_summed(by_kind).comm_s == pytest.approx(base.comm_s + 5e-3)
    # A latency per step by kind: the smaller of it and the axis's.
    kinds = {"all-reduce": 1e-4, "all-gather": 1.0}
    fast = dataclasses.replace(slow, collective_latency_by_kind_s=kinds)
    assert _plan_summed(fast).comm_s == pytest.approx(7168 / 1e8 + 14e-4)
    kinds = {"all-reduce": 1.0}
    assert _plan_summed(dataclasses.replace(slow, collective_latency_by_kind_s=kinds)).comm_s == (
        pytest.approx(7168 / 1e8 + 14e-3)
    )


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
