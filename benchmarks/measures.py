"""Timings of the benchmark steps: trace / lower / compile, shardlib's self-time, step time.

Variants are interleaved in random order; the garbage collector runs before each timed region
and not during it. Self-time is measured twice: by cProfile (thread CPU time, an upper bound)
and by sampling the main thread's innermost frame (no per-call cost). Beside the timed trace,
`trace_work` counts the Python bytecodes a trace executes: the same every run to a few
bytecodes, so it shows a change of a fraction of a percent that the timings on a shared
machine cannot. Step time is the median of per-pair ratios with a bootstrap 95% interval,
beside a hand/hand control.
"""

from __future__ import annotations

import cProfile
import gc
import os
import pstats
import random
import signal
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

from benchmarks import workloads as wls

__all__ = [
    "COMPARISONS",
    "STAGES",
    "bootstrap_median",
    "paired_step_times",
    "sampled_self_times",
    "self_times",
    "stage_times",
    "step_times",
    "summarize_stages",
    "trace_work",
]

ROOT = Path(__file__).resolve().parent.parent

STAGES = ("trace", "lower", "compile")


def stage_times(
    workload: wls.Workload, reps: int, seed: int = 0, variants: Sequence[str] = wls.VARIANTS
) -> dict[str, dict[str, list[float]]]:
    """Seconds to trace, lower and compile fresh steps; variants in random order per rep.

    Each stage is timed by the wall clock (``trace``, ...) and by this process's CPU time
    (``trace_cpu``, ...), which other processes on a busy machine inflate much less. The garbage
    collector runs before each step and not during it.
    """
    rng = random.Random(seed)
    out: dict[str, dict[str, list[float]]] = {
        v: {k: [] for s in STAGES for k in (s, f"{s}_cpu")} for v in variants
    }
    for v in variants:  # warm-up: JAX's one-time imports and caches of jnp helpers
        workload.fresh(v).trace(*workload.args).lower()
    wall, cpu = time.perf_counter, time.process_time
    was_enabled = gc.isenabled()
    for _ in range(reps):
        order = list(variants)
        rng.shuffle(order)
        for v in order:
            step = workload.fresh(v)
            gc.collect()  # then no collection inside the timed stages: garbage left by the
            gc.disable()  # previous variant would otherwise be collected on this one's clock
            try:
                t0, c0 = wall(), cpu()
                traced = step.trace(*workload.args)
                t1, c1 = wall(), cpu()
                lowered = traced.lower()
                t2, c2 = wall(), cpu()
                lowered.compile()
                t3, c3 = wall(), cpu()
            finally:
                if was_enabled:
                    gc.enable()
            rec = out[v]
            for stage, dt, dc in (
                ("trace", t1 - t0, c1 - c0),
                ("lower", t2 - t1, c2 - c1),
                ("compile", t3 - t2, c3 - c2),
            ):
                rec[stage].append(dt)
                rec[f"{stage}_cpu"].append(dc)
    return out


def summarize_stages(times: dict[str, dict[str, list[float]]]) -> dict[str, Any]:
    """Minimum and median per stage, ratios of minimums, shardlib's extra trace+lower time
    (wall clock and CPU time) as a share of the hand step's compile time."""
    summary: dict[str, Any] = {}
    for v, rec in times.items():
        row: dict[str, float] = {}
        for k, x in rec.items():
            row[f"{k}_min_s"] = min(x)
            row[f"{k}_median_s"] = statistics.median(x)
        for suffix in ("", "_cpu"):
            tl = [a + b for a, b in zip(rec[f"trace{suffix}"], rec[f"lower{suffix}"], strict=True)]
            row[f"trace_lower{suffix}_min_s"] = min(tl)
        summary[v] = row
    if "shardlib" in summary and "hand" in summary:
        a, b = summary["shardlib"], summary["hand"]
        summary["ratio_of_minimums"] = {
            k: a[f"{k}_min_s"] / b[f"{k}_min_s"] for k in (*STAGES, *(f"{s}_cpu" for s in STAGES))
        }
        for suffix in ("", "_cpu"):
            extra = a[f"trace_lower{suffix}_min_s"] - b[f"trace_lower{suffix}_min_s"]
            summary[f"extra_trace_lower{suffix}_s"] = extra
            summary[f"extra_share_of_compile{suffix}"] = extra / b[f"compile{suffix}_min_s"]
    return summary


def _bucket(filename: str) -> str:
    path = os.path.realpath(filename) if filename and filename[0] not in "<~" else filename
    for name in ("shardlib", "jax_extra", "examples", "benchmarks"):
        if path.startswith(str(ROOT / name) + os.sep):
            return name
    if f"{os.sep}typeguard{os.sep}" in path:
        return "typeguard"
    if f"{os.sep}jax{os.sep}" in path or f"{os.sep}jaxlib{os.sep}" in path:
        return "jax"
    return "other"


def self_times(
    workload: wls.Workload, reps: int, variants: Sequence[str] = ("shardlib", "hand")
) -> dict[str, dict[str, float]]:
    """Milliseconds of cProfile self-time (tottime) per trace, by where the code lives.

    The profiler's clock is this thread's CPU time, so other processes on a busy machine do
    not inflate it; its per-call overhead still does (Python-heavy code most), so these are
    upper bounds.
    """
    out = {}
    for v in variants:
        workload.fresh(v).trace(*workload.args)  # warm-up
        prof = cProfile.Profile(time.thread_time)  # CPU time: other processes do not count
        for _ in range(reps):
            step = workload.fresh(v)
            prof.enable()
            step.trace(*workload.args)
            prof.disable()
        stats = pstats.Stats(prof)
        buckets: dict[str, float] = {}
        for (filename, _line, _fn), row in stats.stats.items():  # type: ignore[attr-defined]
            tottime = row[2]
            b = _bucket(filename)
            buckets[b] = buckets.get(b, 0.0) + tottime
        total = sum(buckets.values())
        out[v] = {k: 1e3 * s / reps for k, s in sorted(buckets.items())}
        out[v]["total"] = 1e3 * total / reps
    return out


def trace_work(
    workload: wls.Workload, variants: Sequence[str] = ("shardlib", "hand")
) -> dict[str, dict[str, int]]:
    """Python bytecodes and Python calls one trace of each variant executes, in all and by
    where the code lives (`_bucket`), counted with ``sys.settrace`` (``f_trace_opcodes``)
    after a warm-up, the garbage collector off. A second run gives the same counts to a few
    bytecodes in hundreds of thousands. It leaves out the time C code takes and the
    data-stack chunk crossings (`benchmarks.alignment`), so it complements the timed trace
    rather than replacing it.
    """
    out: dict[str, dict[str, int]] = {}
    for v in variants:
        workload.fresh(v).trace(*workload.args)  # warm-up: caches filled as in the timing
        # Python 3.12's first settrace run may deliver no opcode events (the code objects
        # are instrumented for them lazily): a counting warm-up, then the count.
        _count_trace(workload.fresh(v), workload.args)
        ops, calls = _count_trace(workload.fresh(v), workload.args)
        rec: dict[str, int] = {"bytecodes": sum(ops.values()), "calls": sum(calls.values())}
        for name, n in ops.items():
            key = f"bytecodes_{_bucket(name)}"
            rec[key] = rec.get(key, 0) + n
        out[v] = rec
    return out


def _count_trace(step: Any, args: tuple[Any, ...]) -> tuple[dict[str, int], dict[str, int]]:
    """``({file: bytecodes}, {file: calls})`` of ``step.trace(*args)``."""
    ops: dict[str, int] = {}
    calls: dict[str, int] = {}

    def tracer(frame: Any, event: str, _arg: Any) -> Any:
        name = frame.f_code.co_filename
        if event == "opcode":
            ops[name] = ops.get(name, 0) + 1
        elif event == "call":
            frame.f_trace_opcodes = True
            calls[name] = calls.get(name, 0) + 1
        return tracer

    was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    sys.settrace(tracer)
    try:
        step.trace(*args)
    finally:
        sys.settrace(None)
        if was_enabled:
            gc.enable()
    return ops, calls


def sampled_self_times(
    workload: wls.Workload, reps: int, variant: str = "shardlib", interval: float = 5e-4
) -> dict[str, float]:
    """Self-time per trace estimated by sampling instead of instrumenting (no per-call cost).

    An interval timer (``signal.setitimer(ITIMER_REAL)``: high resolution, where the CPU-time
    timers tick only every few milliseconds) interrupts the process every ``interval`` seconds
    while a trace runs; the handler, which runs in the main thread, records which file the
    interrupted innermost Python frame belongs to. Each bucket's share of the samples times
    the unprofiled trace time (the minimum thread CPU time of three traces without the timer)
    estimates its self-time. Time in C functions counts for the Python frame the handler
    finds, which is where CPython next checks for signals: often the caller, but a Python
    function that C code calls back into takes the C time before it (a rules object's
    ``__hash__`` called from JAX's C++ once took 2.2 ms of a transformer trace). (A sampling
    thread reading ``sys._current_frames()`` crashed CPython 3.11 now and then; the handler
    reads only its own thread's frame.)
    """
    counts: dict[str, int] = {}

    def on_sample(_signum: int, frame: Any) -> None:
        if frame is not None:
            b = _bucket(frame.f_code.co_filename)
            counts[b] = counts.get(b, 0) + 1

    workload.fresh(variant).trace(*workload.args)  # warm-up
    plain = []  # unsampled traces: the handler's own cost must not count
    for _ in range(3):
        step = workload.fresh(variant)
        t0 = time.thread_time()
        step.trace(*workload.args)
        plain.append(time.thread_time() - t0)
    previous = signal.signal(signal.SIGALRM, on_sample)
    try:
        for _ in range(reps):
            step = workload.fresh(variant)
            signal.setitimer(signal.ITIMER_REAL, interval, interval)
            step.trace(*workload.args)
            signal.setitimer(signal.ITIMER_REAL, 0.0)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0.0)
        signal.signal(signal.SIGALRM, previous)
    counts.pop("benchmarks", None)  # the handler itself, when a signal lands in it
    n = sum(counts.values())
    per_trace_ms = 1e3 * min(plain)
    out = {k: per_trace_ms * c / n for k, c in sorted(counts.items())} if n else {}
    out["total"] = per_trace_ms
    out["samples"] = float(n)
    return out


def bootstrap_median(ratios: Sequence[float], n: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95% percentile-bootstrap interval of the median."""
    rng = np.random.default_rng(seed)
    r = np.asarray(ratios, dtype=np.float64)
    meds = np.median(rng.choice(r, size=(n, len(r)), replace=True), axis=1)
    return float(np.percentile(meds, 2.5)), float(np.percentile(meds, 97.5))


COMPARISONS = (("shardlib", "hand"), ("hand'", "hand"), ("auto", "hand"))


def step_times(
    workload: wls.Workload, pairs: int, warmup: int = 5, seed: int = 0
) -> dict[str, Any]:
    """Interleaved single steps: per-pair ratios A/B (order A,B then B,A), bootstrap CIs.

    ``hand'`` is a second, separately compiled copy of the hand step (the A/A control).
    Each iteration runs one pair of every comparison, in random order.
    """
    args = workload.args
    steps = {
        "shardlib": workload.fresh("shardlib"),
        "hand": workload.fresh("hand"),
        "hand'": workload.fresh("hand"),
        "auto": workload.fresh("auto"),
    }
    for f in steps.values():
        for _ in range(max(warmup, 1)):
            jax.block_until_ready(f(*args))
    return paired_step_times({k: (f, args) for k, f in steps.items()}, COMPARISONS, pairs, seed)


def paired_step_times(
    steps: Mapping[str, tuple[Callable[..., Any], tuple[Any, ...]]],
    comparisons: Sequence[tuple[str, str]],
    pairs: int,
    seed: int = 0,
) -> dict[str, Any]:
    """Interleaved single steps of ``steps`` (name: ``(f, args)``, compiled and warm).

    Each of ``pairs`` iterations times one pair of every comparison ``(A, B)``, the
    comparisons in random order, A first on even iterations and B first on odd ones, with the
    garbage collector off. Returns the pairs, each step's median ms and, per ``"A/B"``, the
    median of the per-pair ratios and its bootstrap 95% interval.
    """

    def timed(name: str) -> float:
        f, args = steps[name]
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        return time.perf_counter() - t0

    rng = random.Random(seed)
    times: dict[str, list[float]] = {k: [] for k in steps}
    ratios: dict[str, list[float]] = {f"{a}/{b}": [] for a, b in comparisons}
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        for i in range(pairs):
            order = list(comparisons)
            rng.shuffle(order)
            for a, b in order:
                if i % 2 == 0:
                    ta = timed(a)
                    tb = timed(b)
                else:
                    tb = timed(b)
                    ta = timed(a)
                times[a].append(ta)
                times[b].append(tb)
                ratios[f"{a}/{b}"].append(ta / tb)
    finally:
        if was_enabled:
            gc.enable()
    out: dict[str, Any] = {
        "pairs": pairs,
        "median_ms": {k: 1e3 * statistics.median(t) for k, t in times.items()},
        "ratios": {},
    }
    for key, r in ratios.items():
        lo, hi = bootstrap_median(r, seed=seed)
        out["ratios"][key] = {"median": statistics.median(r), "ci95": [lo, hi]}
    return out
