"""What runtime checking costs: eager per-call overhead and trace-time overhead.

Run from the repository root: ``python benchmarks/checking_cost.py [--calls 2000]
[--trace-reps 30]`` (or ``python -m benchmarks.checking_cost``).
Sets up 8 simulated CPU devices itself (before JAX is imported).

(a) Eager: median time of one call of an identity-like function whose one argument is

    * unannotated,
    * annotated ``jax.Array`` under ``typeguard.typechecked`` (typeguard's own cost), and
    * annotated ``f32[b'batch/d len']`` (typeguard + shardlib: dtype, shape, bindings and the
      array's actual sharding on a mesh ``d=8``),
    * annotated ``f32[Array, b'batch/d len']`` under ``shardlib.typechecked`` (the same checks
      without typeguard's instrumentation),

  called many times, interleaved in rotating order.

(b) Trace time: median time of ``jax.jit(f).trace(*args)`` for a function with 9 annotated
  arguments, 2 ``check`` calls in its body and an annotated result, against the same body
  unannotated; each trace uses a fresh function object (no tracing cache), the two
  alternate, on an Explicit and on an Auto mesh.
"""

import os
import sys

if not __package__:  # run as a script: make the repository root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

if "jax" not in sys.modules:  # only effective before JAX is imported
    _flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in _flags:
        os.environ["XLA_FLAGS"] = f"{_flags} --xla_force_host_platform_device_count=8".strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import gc  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable, Sequence  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from typeguard import typechecked  # noqa: E402

from shardlib.shardtypes import Array, check, f32, register_with_typeguard  # noqa: E402
from shardlib.shardtypes import typechecked as shardlib_typechecked  # noqa: E402

register_with_typeguard()


# ------------------------------------------------------------------ (a) eager, one argument


def unannotated(x):
    return x


@typechecked
def annotated_jax_array(x: jax.Array):
    return x


@typechecked
def annotated_shardlib(x: f32[b"batch/d len"]):
    return x


@shardlib_typechecked
def shardlib_checked(x: f32[Array, b"batch/d len"]):
    return x


# ------------------------------------------------------------------ (b) tracing, 12 checks


def step_unannotated(a, b, c, d, e, f, g, h, w):
    s = a + b + c + d + e + f + g + h
    y = s @ w
    return jnp.tanh(y)


@typechecked
def step_annotated(
    a: f32[b"batch/d len"],
    b: f32[b"batch/d len"],
    c: f32[b"batch/d len"],
    d: f32[b"batch/d len"],
    e: f32[b"batch/d len"],
    f: f32[b"batch/d len"],
    g: f32[b"batch/d len"],
    h: f32[b"batch/d len"],
    w: f32[b"len hidden"],
) -> f32[b"batch/d hidden"]:
    s = a + b + c + d + e + f + g + h
    check(jnp.float32, "batch/d len", s)
    y = s @ w
    check(jnp.float32, "batch/d hidden", y)
    return jnp.tanh(y)


def _time_eager(fns: Sequence[Callable], x: Any, calls: int) -> list[list[float]]:
    """Per-call times (µs) of each of ``fns``, interleaved in rotating order."""
    times: list[list[float]] = [[] for _ in fns]
    clock = time.perf_counter_ns
    order = list(range(len(fns)))
    for f in fns:  # warm up (fills shardlib's per-shape cache, typeguard's imports)
        for _ in range(20):
            f(x)
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        for i in range(calls):
            k = i % len(order)
            for j in order[k:] + order[:k]:
                f = fns[j]
                t0 = clock()
                f(x)
                times[j].append((clock() - t0) / 1e3)
    finally:
        if gc_was_enabled:
            gc.enable()
    return times


def _time_traces(fns: Sequence[Callable], args: Sequence[Any], reps: int) -> list[list[float]]:
    """Times (ms) of ``jax.jit(fresh wrapper of f).trace(*args)``, alternating."""
    times: list[list[float]] = [[] for _ in fns]

    def fresh(f: Callable) -> Callable:
        return lambda *a: f(*a)  # a new function object: jit's trace cache cannot hit

    for f in fns:  # warm up
        jax.jit(fresh(f)).trace(*args)
    for i in range(reps):
        order = range(len(fns)) if i % 2 == 0 else reversed(range(len(fns)))
        for j in order:
            traced = jax.jit(fresh(fns[j]))
            t0 = time.perf_counter()
            traced.trace(*args)
            times[j].append((time.perf_counter() - t0) * 1e3)
    return times


def _trace_args(mesh: Any) -> list[Any]:
    xs = [
        jax.device_put(jnp.full((64, 32), float(i), jnp.float32), NamedSharding(mesh, P("d")))
        for i in range(8)
    ]
    w = jax.device_put(jnp.ones((32, 16), jnp.float32), NamedSharding(mesh, P()))
    return [*xs, w]


def main(calls: int = 2000, trace_reps: int = 30, out: Any = None) -> dict[str, Any]:
    """Run both measurements, print markdown tables and return the numbers."""
    out = out if out is not None else sys.stdout
    results: dict[str, Any] = {"devices": jax.device_count(), "calls": calls}
    results["eager_us"] = _eager_section(calls, out)
    results["trace_ms"] = _trace_section(trace_reps, out)
    return results


def _eager_section(calls: int, out: Any) -> dict[str, float]:
    """Median µs per eager call of each function, printed as a table."""
    mesh = jax.make_mesh((8,), ("d",), axis_types=(AxisType.Explicit,))
    with jax.set_mesh(mesh):
        x = jax.device_put(jnp.zeros((64, 32), jnp.float32), NamedSharding(mesh, P("d")))
        fns = [unannotated, annotated_jax_array, annotated_shardlib, shardlib_checked]
        times = _time_eager(fns, x, calls)
    med = [statistics.median(t) for t in times]
    print("## Eager cost of checking one argument", file=out)
    print(file=out)
    print(
        f"{calls} calls each, interleaved; median µs per call; mesh d=8 (Explicit), "
        "x: f32[64, 32] sharded P('d').",
        file=out,
    )
    print(file=out)
    print("| function | median µs/call | over unannotated | ratio |", file=out)
    print("|---|---:|---:|---:|", file=out)
    labels = [
        "unannotated `f(x)`",
        "typechecked, `x: jax.Array`",
        "typechecked, `x: f32[b'batch/d len']`",
        "shardlib.typechecked, `x: f32[Array, b'batch/d len']`",
    ]
    for label, m in zip(labels, med, strict=True):
        print(f"| {label} | {m:.2f} | {m - med[0]:+.2f} | {m / med[0]:.1f}× |", file=out)
    print(file=out)
    print(
        f"shardlib's own share (f32[...] minus jax.Array): {med[2] - med[1]:+.2f} µs per "
        "checked argument",
        file=out,
    )
    print(file=out)
    return dict(
        zip(["unannotated", "jax.Array", "shardlib", "shardlib.typechecked"], med, strict=True)
    )


def _trace_section(trace_reps: int, out: Any) -> dict[str, dict[str, float]]:
    """Trace times with and without annotations on both mesh axis types, printed."""
    rows = []
    for kind in (AxisType.Explicit, AxisType.Auto):
        m = jax.make_mesh((8,), ("d",), axis_types=(kind,))
        with jax.set_mesh(m):
            args = _trace_args(m)
            t_plain, t_checked = _time_traces([step_unannotated, step_annotated], args, trace_reps)
        mp, mc = statistics.median(t_plain), statistics.median(t_checked)
        paired = statistics.median(c / p for p, c in zip(t_plain, t_checked, strict=True))
        rows.append((str(kind).split(".")[-1], mp, mc, mc / mp, paired))
    print("## Trace-time overhead", file=out)
    print(file=out)
    print(
        f"`jax.jit(f).trace(*args)` with a fresh function each time, {trace_reps} alternating "
        "repetitions; 9 annotated arguments + 2 `check` calls + annotated result (12 checks).",
        file=out,
    )
    print(file=out)
    print(
        "| mesh axes | unannotated ms | typechecked ms | ratio of medians | median paired ratio |",
        file=out,
    )
    print("|---|---:|---:|---:|---:|", file=out)
    for kind, mp, mc, ratio, paired in rows:
        print(f"| {kind} | {mp:.2f} | {mc:.2f} | {ratio:.2f}× | {paired:.2f}× |", file=out)
    return {
        r[0]: {"unannotated": r[1], "typechecked": r[2], "ratio": r[3], "paired_ratio": r[4]}
        for r in rows
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000, help="eager calls per function")
    parser.add_argument("--trace-reps", type=int, default=30, help="traces per function")
    a = parser.parse_args()
    main(calls=a.calls, trace_reps=a.trace_reps)
