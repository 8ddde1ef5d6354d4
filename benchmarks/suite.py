"""The benchmark suite behind ``python -m benchmarks``: shardlib vs hand-written vs auto-sharded.

Measures, for each workload of :mod:`benchmarks.workloads` on a ``(4, 2)`` mesh of simulated
CPU devices with Auto axes:

1. structure (deterministic): collectives per kind (instructions, executions per step, bytes
   per device), ``cost_analysis()``, ``memory_analysis()``, and whether the canonical jaxpr,
   StableHLO and compiled HLO of ``shardlib`` and ``hand`` are identical;
2. trace / lower / compile times on fresh closures (variants interleaved in random order), and
   shardlib's own self-time per trace (cProfile);
3. step time: interleaved single steps, median per-pair ratio with a bootstrap 95% interval,
   beside a hand/hand control;
4. eager checking cost per argument (:mod:`benchmarks.checking_cost`);
5. saved residuals of the transformer step under three remat policies.

Import this module only after XLA_FLAGS asks for 8 host devices (``__main__`` does that).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import dataclasses
import datetime
import functools
import gc
import io
import json
import math
import os
import platform
import pstats
import random
import re
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from benchmarks import _hlo, checking_cost
from benchmarks import _transformer as tr
from benchmarks import workloads as wls
from examples import transformer_model as tm

__all__ = [
    "TARGETS",
    "compare_structure",
    "environment",
    "main",
    "make_mesh",
    "remat_report",
    "render_markdown",
    "run",
    "sampled_self_times",
    "self_times",
    "stage_times",
    "step_times",
]

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "benchmarks" / "results"
MESH_SHAPE = (4, 2)

# Targets the run must show (see docs/performance.md).
TARGETS = {
    "step_ratio_tolerance": 0.03,  # |median shardlib/hand - 1| <= 0.03
    "step_ci": (0.95, 1.05),  # the 95% interval inside this range
    "extra_trace_share_of_compile": 0.03,  # (shardlib - hand) trace+lower <= 3% of compile
    "self_time_ms": 5.0,  # shardlib/ self-time per traced step
    "check_us": 5.0,  # eager checked argument over an unannotated call
}


def make_mesh() -> jax.sharding.Mesh:
    """The ``(4, 2)`` mesh ``('d', 't')`` with Auto axes (needs 8 devices)."""
    return jax.make_mesh(MESH_SHAPE, ("d", "t"), axis_types=(AxisType.Auto,) * 2)


# ---------------------------------------------------------------------------------------------
# Environment.
# ---------------------------------------------------------------------------------------------


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _version(module: str) -> str:
    try:
        from importlib.metadata import version

        return version(module)
    except Exception:
        return "unknown"


def load_average() -> tuple[float, float, float]:
    try:
        return os.getloadavg()
    except OSError:  # pragma: no cover - not on Linux
        return (math.nan, math.nan, math.nan)


def environment() -> dict[str, Any]:
    return {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "devices": jax.device_count(),
        "platform": jax.devices()[0].platform,
        "python": platform.python_version(),
        "jax": jax.__version__,
        "jaxlib": _version("jaxlib"),
        "typeguard": _version("typeguard"),
        "numpy": np.__version__,
        "load_average": list(load_average()),
    }


# ---------------------------------------------------------------------------------------------
# 1. Structure.
# ---------------------------------------------------------------------------------------------

_COST_KEYS = ("flops", "bytes accessed", "transcendentals")
_MEMORY_KEYS = (
    "argument_size_in_bytes",
    "output_size_in_bytes",
    "alias_size_in_bytes",
    "temp_size_in_bytes",
)
# Primitives that only wrap other equations (their contents are compared anyway).
_WRAPPERS = {"custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr", "pjit", "jit"}


def _cost(compiled: Any) -> dict[str, float]:
    cost = compiled.cost_analysis()
    if isinstance(cost, list | tuple):  # older JAX: one dict per device program
        cost = cost[0] if cost else {}
    cost = cost or {}
    return {k: float(cost[k]) for k in _COST_KEYS if k in cost}


def _memory(compiled: Any) -> dict[str, int]:
    mem = compiled.memory_analysis()
    return {k: int(getattr(mem, k)) for k in _MEMORY_KEYS if mem is not None and hasattr(mem, k)}


def analyse(traced: Any, lowered: Any, compiled: Any) -> dict[str, Any]:
    """The deterministic facts about one compiled step (texts under ``'_texts'``)."""
    hlo = compiled.as_text()
    return {
        "census": _hlo.collective_census(hlo),
        "traffic": _hlo.collective_traffic(hlo, jax.device_count()),
        "cost": _cost(compiled),
        "memory": _memory(compiled),
        "_texts": {
            "jaxpr": _hlo.canonicalize_jaxpr(traced.jaxpr),
            "lowered": _hlo.canonicalize_mlir(lowered.as_text()),
            "hlo": _hlo.canonicalize(hlo),
        },
    }


def _max_abs_diff(a: Any, b: Any) -> float:
    leaves = zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in leaves)


def compare_structure(workload: wls.Workload) -> dict[str, Any]:
    """Compile every variant once; compare shardlib with hand (and report auto beside them).

    Returns ``{'variants': {name: analysis}, 'same': {...}, 'outputs': {...}}`` where
    ``same`` holds the shardlib-vs-hand equalities and first differences.
    """
    variants: dict[str, Any] = {}
    outputs: dict[str, Any] = {}
    for v in wls.VARIANTS:
        step = workload.fresh(v)
        traced = step.trace(*workload.args)
        lowered = traced.lower()
        compiled = lowered.compile()
        variants[v] = analyse(traced, lowered, compiled)
        outputs[v] = jax.device_get(compiled(*workload.args))
    a, b = variants["shardlib"], variants["hand"]
    same: dict[str, Any] = {
        "census": a["census"] == b["census"] and a["traffic"] == b["traffic"],
        "cost": a["cost"] == b["cost"],
        "memory": a["memory"] == b["memory"],
    }
    for key in ("jaxpr", "lowered", "hlo"):
        ta, tb = a["_texts"][key], b["_texts"][key]
        same[key] = ta == tb
        same[f"{key}_first_difference"] = _hlo.first_difference(ta, tb)
    pa = _hlo.primitive_census(a["_texts"]["jaxpr"])
    pb = _hlo.primitive_census(b["_texts"]["jaxpr"])
    same["jaxpr_primitives_only_in_shardlib"] = dict(pa - pb)
    same["jaxpr_primitives_only_in_hand"] = dict(pb - pa)
    same["jaxpr_same_up_to_wrappers"] = all(k in _WRAPPERS for k in {**(pa - pb), **(pb - pa)})
    losses = {v: float(outputs[v][1]) for v in wls.VARIANTS}
    return {
        "variants": variants,
        "same": same,
        "outputs": outputs,
        "losses": losses,
        "max_abs_diff_params": {
            "hand": _max_abs_diff(outputs["shardlib"][0], outputs["hand"][0]),
            "auto": _max_abs_diff(outputs["shardlib"][0], outputs["auto"][0]),
        },
    }


def fsdp_batch_sweep(batches: Sequence[int], seed: int = 0) -> list[dict[str, Any]]:
    """Bytes per device per step of the FSDP MLP (shardlib vs auto) as the batch grows."""
    base = wls.SIZES["full"]["mlp"]
    rows = []
    for n in batches:
        w = wls.fsdp_mlp(dataclasses.replace(base, batch=n), seed)
        row: dict[str, Any] = {"batch": n}
        for v in ("shardlib", "auto"):
            text = w.fresh(v).trace(*w.args).lower().compile().as_text()
            row[v] = _hlo.collective_traffic(text, jax.device_count())["total"]
        rows.append(row)
    return rows


# ---------------------------------------------------------------------------------------------
# 2. Trace / lower / compile times and self-time.
# ---------------------------------------------------------------------------------------------


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


def sampled_self_times(
    workload: wls.Workload, reps: int, variant: str = "shardlib", interval: float = 2e-4
) -> dict[str, float]:
    """Self-time per trace estimated by sampling instead of instrumenting (no per-call cost).

    A second thread records, every ``interval`` seconds while a trace runs, which file the
    main thread's innermost Python frame belongs to; each bucket's share of the samples times
    the unprofiled trace time (this thread's CPU time) estimates its self-time. Time in C
    functions counts for the Python function that called them.
    """
    main = threading.get_ident()
    counts: dict[str, int] = {}
    active = threading.Event()
    stop = threading.Event()

    def sampler() -> None:
        while not stop.is_set():
            if active.is_set():
                frame = sys._current_frames().get(main)
                if frame is not None:
                    b = _bucket(frame.f_code.co_filename)
                    counts[b] = counts.get(b, 0) + 1
            time.sleep(interval)

    workload.fresh(variant).trace(*workload.args)  # warm-up
    old_switch = sys.getswitchinterval()
    sys.setswitchinterval(interval / 2)  # let the sampler in often
    thread = threading.Thread(target=sampler, daemon=True)
    thread.start()
    total = 0.0
    try:
        for _ in range(reps):
            step = workload.fresh(variant)
            active.set()
            t0 = time.thread_time()
            step.trace(*workload.args)
            total += time.thread_time() - t0
            active.clear()
    finally:
        stop.set()
        thread.join()
        sys.setswitchinterval(old_switch)
    n = sum(counts.values())
    per_trace_ms = 1e3 * total / reps
    out = {k: per_trace_ms * c / n for k, c in sorted(counts.items())} if n else {}
    out["total"] = per_trace_ms
    out["samples"] = float(n)
    return out


# ---------------------------------------------------------------------------------------------
# 3. Step time.
# ---------------------------------------------------------------------------------------------


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

    def timed(name: str) -> float:
        f = steps[name]
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        return time.perf_counter() - t0

    rng = random.Random(seed)
    times: dict[str, list[float]] = {k: [] for k in steps}
    ratios: dict[str, list[float]] = {f"{a}/{b}": [] for a, b in COMPARISONS}
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        for i in range(pairs):
            order = list(COMPARISONS)
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


# ---------------------------------------------------------------------------------------------
# 5. Remat: saved residuals of the transformer step.
# ---------------------------------------------------------------------------------------------

_RESIDUAL = re.compile(r"^\s*([a-z]+[0-9]*)\[([0-9,\s]*)\](?:\{[^}]*\})?\s+(.*)$")
_ITEMSIZE = {"bool": 1, "pred": 1, "i8": 1, "u8": 1, "bf16": 2, "f16": 2, "i16": 2, "u16": 2}


def parse_residuals(text: str) -> list[dict[str, Any]]:
    """Parse ``jax.ad_checkpoint.print_saved_residuals`` output into shape/bytes/source rows."""
    rows = []
    for line in text.splitlines():
        m = _RESIDUAL.match(line)
        if not m:
            continue
        dtype, dims, source = m.groups()
        shape = tuple(int(d) for d in dims.replace(" ", "").split(",") if d)
        size = _ITEMSIZE.get(dtype, 8 if dtype.endswith("64") else 4)
        if source.startswith("from the argument"):
            kind = "argument"
        elif source.startswith(("from a literal", "from a constant")):
            kind = "constant"
        else:
            kind = "activation"
        rows.append(
            {
                "dtype": dtype,
                "shape": shape,
                "bytes": size * math.prod(shape),
                "kind": kind,
                "source": source,
            }
        )
    return rows


def _residual_text(f: Callable[..., Any], *args: Any) -> str:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        jax.ad_checkpoint.print_saved_residuals(f, *args)
    return buf.getvalue()


def per_device_residuals(config: Any, tokens: Any, model: Any, policy: str) -> list[dict]:
    """Residuals of the hand-written per-device loss, listed inside ``shard_map`` (so the
    shapes are per device)."""
    found: list[str] = []

    def probe(tokens, model):
        found.append(_residual_text(lambda m: tr.hand_loss_body(config, tokens, m, policy), model))
        return jax.numpy.zeros(())

    smap = jax.shard_map(
        probe, in_specs=(tr.TOKENS_SPEC, tr.MODEL_SPECS), out_specs=P(), check_vma=False
    )
    jax.jit(smap).trace(tokens, model)
    return parse_residuals(found[0])


def remat_report(size: str = "full", seed: int = 0, compile_steps: bool = True) -> dict[str, Any]:
    """Saved residuals per device under each remat policy (hand-written step), and shardlib's
    residuals compared with the hand-written step's under the same (explicit) policy."""
    config, batch = wls.SIZES[size]["transformer"]
    model, tokens, lr = wls.transformer_inputs(config, batch, seed)
    rows: dict[str, Any] = {}
    for policy in tr.POLICIES:
        res = per_device_residuals(config, tokens, model, policy)
        row: dict[str, Any] = {
            kind: {
                "count": sum(1 for r in res if r["kind"] == kind),
                "bytes": sum(r["bytes"] for r in res if r["kind"] == kind),
            }
            for kind in ("activation", "argument", "constant")
        }
        # Residuals the layer loop saves (stacked over layers by lax.scan) vs the rest.
        in_scan = [r for r in res if r["kind"] == "activation" and "output of scan" in r["source"]]
        row["layer_scan"] = {"count": len(in_scan), "bytes": sum(r["bytes"] for r in in_scan)}
        if compile_steps:
            loss = functools.partial(tr.hand_loss, policy=policy)
            step = jax.jit(wls.transformer_step(loss, config))
            row["memory"] = _memory(step.trace(model, tokens, lr).lower().compile())
        rows[policy] = row

    def global_shapes(loss: Callable[..., Any]) -> list[str]:
        text = _residual_text(lambda m: loss(config, tokens, m), model)
        return sorted(f"{r['dtype']}{list(r['shape'])}" for r in parse_residuals(text))

    out: dict[str, Any] = {
        "policies": rows,
        "shardlib_residuals_match_hand_explicit": global_shapes(tm.loss)
        == global_shapes(tr.hand_loss),
    }
    if compile_steps:
        step = jax.jit(wls.transformer_step(tm.loss, config))
        out["shardlib_memory"] = _memory(step.trace(model, tokens, lr).lower().compile())
    return out


# ---------------------------------------------------------------------------------------------
# Running and reporting.
# ---------------------------------------------------------------------------------------------


def _strip_private(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: _strip_private(v) for k, v in x.items() if not str(k).startswith("_")}
    if isinstance(x, list | tuple):
        return [_strip_private(v) for v in x]
    if isinstance(x, np.generic):
        return x.item()
    return x


def run(opts: argparse.Namespace, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run everything ``opts`` asks for and return the results (JSON-serialisable)."""
    t_start = time.perf_counter()
    env = environment()
    results: dict[str, Any] = {
        "environment": env,
        "settings": {
            k: getattr(opts, k)
            for k in ("size", "pairs", "compile_reps", "profile_reps", "seed", "workloads")
        },
        "mesh": {"shape": list(MESH_SHAPE), "axes": ["d", "t"], "axis_types": "Auto"},
        "workloads": {},
    }
    skip = set(opts.skip)
    with jax.set_mesh(make_mesh()):
        for name in opts.workloads:
            w = wls.build(name, opts.size, opts.seed)
            rec: dict[str, Any] = {"title": w.title, "description": w.description, "shape": w.shape}
            log(f"[{name}] structure")
            s = compare_structure(w)
            rec["structure"] = {k: v for k, v in s.items() if k != "outputs"}
            if "stages" not in skip:
                log(f"[{name}] trace/lower/compile x{opts.compile_reps}")
                times = stage_times(w, opts.compile_reps, opts.seed)
                rec["stages"] = {"raw_s": times, "summary": summarize_stages(times)}
            if "profile" not in skip:
                log(f"[{name}] self-time profile x{opts.profile_reps}")
                rec["self_time_ms"] = self_times(w, opts.profile_reps)
                rec["sampled_self_time_ms"] = sampled_self_times(w, 4 * opts.profile_reps)
            if "steps" not in skip:
                log(f"[{name}] step time, {opts.pairs} pairs")
                rec["steps"] = step_times(w, opts.pairs, opts.warmup, opts.seed)
            results["workloads"][name] = rec
        if "sweep" not in skip and "fsdp_mlp" in opts.workloads:
            log("[fsdp_mlp] batch sweep")
            results["fsdp_batch_sweep"] = fsdp_batch_sweep(opts.sweep_batches, opts.seed)
        if "remat" not in skip:
            log("[transformer] remat")
            results["remat"] = remat_report(opts.size, opts.seed)
    if "checking" not in skip:
        log("checking cost")
        buf = io.StringIO()
        results["checking"] = checking_cost.main(
            calls=opts.checking_calls, trace_reps=opts.checking_trace_reps, out=buf
        )
        results["checking"]["report"] = buf.getvalue()
    env["load_average_end"] = list(load_average())
    results["runtime_s"] = time.perf_counter() - t_start
    results["targets"] = evaluate_targets(results)
    return _strip_private(results)


def evaluate_targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Each target with the measured value and whether it is met (None: not measured)."""
    rows: list[dict[str, Any]] = []

    def add(target: str, measured: str, met: bool | None) -> None:
        rows.append({"target": target, "measured": measured, "met": met})

    tol = TARGETS["step_ratio_tolerance"]
    lo_ok, hi_ok = TARGETS["step_ci"]
    for name, rec in results["workloads"].items():
        s = rec["structure"]["same"]
        add(
            f"{name}: identical collective census, flops, memory (shardlib vs hand)",
            f"census {_yn(s['census'])}, cost {_yn(s['cost'])}, memory {_yn(s['memory'])}",
            s["census"] and s["cost"] and s["memory"],
        )
        add(
            f"{name}: identical canonical compiled HLO",
            f"HLO {_yn(s['hlo'])} (StableHLO {_yn(s['lowered'])}, jaxpr {_yn(s['jaxpr'])})",
            s["hlo"],
        )
        if "steps" in rec:
            r = rec["steps"]["ratios"]["shardlib/hand"]
            c = rec["steps"]["ratios"]["hand'/hand"]
            ok = abs(r["median"] - 1) <= tol and lo_ok <= r["ci95"][0] and r["ci95"][1] <= hi_ok
            add(
                f"{name}: step time shardlib/hand 1.00 ± {tol:.2f}, 95% CI in "
                f"[{lo_ok:.2f}, {hi_ok:.2f}]",
                f"{r['median']:.3f} [{r['ci95'][0]:.3f}, {r['ci95'][1]:.3f}] (control "
                f"{c['median']:.3f} [{c['ci95'][0]:.3f}, {c['ci95'][1]:.3f}])",
                ok,
            )
        if "stages" in rec:
            share = rec["stages"]["summary"]["extra_share_of_compile"]
            add(
                f"{name}: shardlib's extra trace+lower ≤ "
                f"{100 * TARGETS['extra_trace_share_of_compile']:.0f}% of compile",
                f"{100 * share:+.2f}%",
                share <= TARGETS["extra_trace_share_of_compile"],
            )
        if "self_time_ms" in rec:
            ms = rec["self_time_ms"]["shardlib"].get("shardlib", 0.0)
            measured = f"{ms:.2f} ms (cProfile, thread CPU time)"
            if "sampled_self_time_ms" in rec:
                sampled = rec["sampled_self_time_ms"].get("shardlib", 0.0)
                measured += f"; {sampled:.2f} ms by sampling"
            if "stages" in rec:
                summ = rec["stages"]["summary"]
                diff = summ["shardlib"]["trace_cpu_min_s"] - summ["hand"]["trace_cpu_min_s"]
                measured += f"; unprofiled trace CPU time shardlib − hand {1e3 * diff:+.1f} ms"
            add(
                f"{name}: shardlib self-time ≤ {TARGETS['self_time_ms']:.0f} ms per trace",
                measured,
                ms <= TARGETS["self_time_ms"],
            )
        ta = rec["structure"]["variants"]["shardlib"]["traffic"]["total"]
        tb = rec["structure"]["variants"]["auto"]["traffic"]["total"]
        add(
            f"{name}: bytes per device per step, shardlib ≤ auto",
            f"wire {_mb(ta['wire_bytes_per_step'])} vs {_mb(tb['wire_bytes_per_step'])} MB; "
            f"payload {_mb(ta['payload_bytes_per_step'])} vs "
            f"{_mb(tb['payload_bytes_per_step'])} MB",
            ta["wire_bytes_per_step"] <= tb["wire_bytes_per_step"]
            and ta["payload_bytes_per_step"] <= tb["payload_bytes_per_step"],
        )
    if "checking" in results:
        e = results["checking"]["eager_us"]
        extra = e["shardlib"] - e["unannotated"]
        add(
            f"eager check of one typed argument ≤ {TARGETS['check_us']:.0f} µs over unannotated",
            f"{extra:+.2f} µs (median)",
            extra <= TARGETS["check_us"],
        )
    return rows


def _yn(b: bool) -> str:
    return "identical" if b else "differs"


def _mb(n: float) -> str:
    return f"{n / 1e6:.3f}"


def _fmt_int(n: float) -> str:
    return f"{int(n):,}"


def render_markdown(results: dict[str, Any]) -> str:
    """The report: environment, targets, then one section per measurement."""
    env = results["environment"]
    out: list[str] = []
    w = out.append
    load = env["load_average"]
    load_end = env.get("load_average_end", [math.nan] * 3)
    w("# shardlib vs hand-written shard_map vs auto-sharding")
    w("")
    w(
        f"{env['date']}; {env['cpu']}, {env['cores']} cores, {env['devices']} simulated "
        f"{env['platform']} devices, mesh (4, 2) ('d', 't') with Auto axes; Python "
        f"{env['python']}, JAX {env['jax']} (jaxlib {env['jaxlib']}), typeguard "
        f"{env['typeguard']}. Load average (1/5/15 min) at start {load[0]:.2f} / {load[1]:.2f} / "
        f"{load[2]:.2f}, at end {load_end[0]:.2f} / {load_end[1]:.2f} / {load_end[2]:.2f}. "
        f"Settings: {results['settings']}. Run time {results.get('runtime_s', 0):.0f} s."
    )
    w("")
    w("## Targets")
    w("")
    w("| target | measured | met |")
    w("|---|---|:-:|")
    for t in results.get("targets", []):
        met = "n/a" if t["met"] is None else ("yes" if t["met"] else "**no**")
        w(f"| {t['target']} | {t['measured']} | {met} |")
    w("")
    for name, rec in results["workloads"].items():
        w(f"## {rec['title']} (`{name}`)")
        w("")
        w(f"{rec['description']}. Sizes: {rec['shape']}.")
        w("")
        _structure_table(rec["structure"], w)
        if "stages" in rec:
            _stage_table(rec, w)
        if "steps" in rec:
            _step_table(rec["steps"], w)
    if "fsdp_batch_sweep" in results:
        w("## FSDP MLP: bytes per device per step as the batch grows")
        w("")
        w("| batch | shardlib wire MB | auto wire MB | shardlib payload MB | auto payload MB |")
        w("|---:|---:|---:|---:|---:|")
        for row in results["fsdp_batch_sweep"]:
            a, b = row["shardlib"], row["auto"]
            w(
                f"| {row['batch']} | {_mb(a['wire_bytes_per_step'])} | "
                f"{_mb(b['wire_bytes_per_step'])} | {_mb(a['payload_bytes_per_step'])} | "
                f"{_mb(b['payload_bytes_per_step'])} |"
            )
        w("")
    if "remat" in results:
        _remat_table(results["remat"], w)
    if "checking" in results:
        w("## Checking cost")
        w("")
        w("```text")
        w(results["checking"]["report"].rstrip())
        w("```")
        w("")
    w("## Definitions")
    w("")
    for line in DEFINITIONS:
        w(f"- {line}")
    w("")
    return "\n".join(out) + "\n"


DEFINITIONS = (
    "Collectives are read from the compiled (SPMD-partitioned, per-device) HLO: instructions "
    "per kind, async start/done pairs once; *runs/step* multiplies instructions inside loops "
    "by the loop's known trip count.",
    "*Payload* of one collective = the larger of its operand and result sizes on one device "
    "(the gathered result of an all-gather, the unscattered input of a reduce-scatter, the "
    "buffer of an all-reduce or all-to-all). *Wire* = estimated bytes one device sends with "
    "ring algorithms over a group of g devices: all-gather out·(g-1)/g, reduce-scatter and "
    "all-to-all in·(g-1)/g, all-reduce 2·in·(g-1)/g, collective-permute in (pairs that leave "
    "the device). Both are summed over one step.",
    "flops and bytes accessed: `compiled.cost_analysis()`; argument/output/alias/temp bytes: "
    "`compiled.memory_analysis()` (per device).",
    "Canonical texts: jaxpr printed without source info or name stacks (variables are named "
    "in order of appearance), object addresses removed; StableHLO without `loc(...)` and the "
    "module name; compiled HLO without source tables, `metadata={...}` and with every "
    "instruction/computation name renamed in order of first appearance.",
    "Trace/lower/compile: a fresh jitted closure per measurement, variants in random order, "
    "garbage collected before and not during; minimum over repetitions.",
    "Step time: single steps with `block_until_ready`, pairs run A,B then B,A alternately; "
    "ratio = median of per-pair ratios, 95% percentile bootstrap interval (2000 resamples); "
    "`hand'` is a second, separately compiled copy of the hand step (the A/A control).",
)


def _structure_table(s: dict[str, Any], w: Callable[[str], None]) -> None:
    vs = s["variants"]
    names = list(vs)
    w("Structure of the compiled step (per device; see Definitions at the end):")
    w("")
    w("| | " + " | ".join(names) + " |")
    w("|---|" + "---:|" * len(names))
    kinds = sorted({k for v in vs.values() for k in v["traffic"]["kinds"]})
    for k in kinds:
        cells = []
        for n in names:
            row = vs[n]["traffic"]["kinds"].get(k)
            cells.append(
                "0"
                if row is None
                else f"{row['count']} ({row['runs']}/step) {_mb(row['payload_bytes_per_step'])} MB"
            )
        w(f"| {k}: instructions (runs/step) payload/step | " + " | ".join(cells) + " |")
    for label, key in (
        ("collective payload MB/step", "payload_bytes_per_step"),
        ("collective wire MB/step (est.)", "wire_bytes_per_step"),
    ):
        w(f"| {label} | " + " | ".join(_mb(vs[n]["traffic"]["total"][key]) for n in names) + " |")
    for key in _COST_KEYS:
        if all(key in vs[n]["cost"] for n in names):
            w(
                f"| cost_analysis {key} | "
                + " | ".join(_fmt_int(vs[n]["cost"][key]) for n in names)
                + " |"
            )
    for key in _MEMORY_KEYS:
        if all(key in vs[n]["memory"] for n in names):
            label = key.removesuffix("_size_in_bytes")
            w(
                f"| memory_analysis {label} bytes | "
                + " | ".join(_fmt_int(vs[n]["memory"][key]) for n in names)
                + " |"
            )
    w("| loss (first step) | " + " | ".join(f"{s['losses'][n]:.6f}" for n in names) + " |")
    w("")
    same = s["same"]
    jaxpr_note = ""
    if not same["jaxpr"]:
        only_s = same["jaxpr_primitives_only_in_shardlib"]
        only_h = same["jaxpr_primitives_only_in_hand"]
        jaxpr_note = (
            f" (primitives only in shardlib: {only_s or 'none'}; only in hand: {only_h or 'none'})"
        )
    d = s["max_abs_diff_params"]
    w(
        f"shardlib vs hand: census {_yn(same['census'])}, cost {_yn(same['cost'])}, memory "
        f"{_yn(same['memory'])}; canonical jaxpr {_yn(same['jaxpr'])}{jaxpr_note}, StableHLO "
        f"{_yn(same['lowered'])}, compiled HLO {_yn(same['hlo'])}. Updated weights: max |shardlib - "
        f"hand| = {d['hand']:.1e}, max |shardlib - auto| = {d['auto']:.1e}."
    )
    w("")


def _stage_table(rec: dict[str, Any], w: Callable[[str], None]) -> None:
    summ = rec["stages"]["summary"]
    names = [n for n in wls.VARIANTS if n in summ]
    reps = len(rec["stages"]["raw_s"][names[0]]["trace"])
    w(
        f"Trace / lower / compile, ms (minimum of {reps} fresh closures per variant, in random "
        "order; wall clock, CPU time of this process in parentheses):"
    )
    w("")
    w("| stage | " + " | ".join(names) + " | shardlib/hand (ratio of minimums) |")
    w("|---|" + "---:|" * (len(names) + 1))
    ratio = summ["ratio_of_minimums"]
    for stage in STAGES:
        w(
            f"| {stage} | "
            + " | ".join(
                f"{1e3 * summ[n][f'{stage}_min_s']:.1f} ({1e3 * summ[n][f'{stage}_cpu_min_s']:.1f})"
                for n in names
            )
            + f" | {ratio[stage]:.3f} ({ratio[f'{stage}_cpu']:.3f}) |"
        )
    w("")
    line = (
        f"shardlib's extra trace+lower time: {1e3 * summ['extra_trace_lower_s']:+.1f} ms wall = "
        f"{100 * summ['extra_share_of_compile']:+.2f}% of the hand step's compile time "
        f"(CPU time: {1e3 * summ['extra_trace_lower_cpu_s']:+.1f} ms = "
        f"{100 * summ['extra_share_of_compile_cpu']:+.2f}%)."
    )
    if "self_time_ms" in rec:
        st = rec["self_time_ms"]
        sl, hd = st["shardlib"], st["hand"]
        line += (
            f" cProfile self-time per trace (thread CPU time): shardlib/ "
            f"{sl.get('shardlib', 0):.2f} ms, typeguard {sl.get('typeguard', 0):.2f} ms, "
            f"jax_extra {sl.get('jax_extra', 0):.2f} ms, of {sl['total']:.1f} ms in all under "
            f"the profiler (the hand step's trace: {hd['total']:.1f} ms)."
        )
    if "sampled_self_time_ms" in rec:
        sm = rec["sampled_self_time_ms"]
        line += (
            f" Sampled instead ({sm['samples']:.0f} samples, unprofiled trace "
            f"{sm['total']:.1f} ms CPU): shardlib/ {sm.get('shardlib', 0):.2f} ms, typeguard "
            f"{sm.get('typeguard', 0):.2f} ms per trace."
        )
    w(line)
    w("")


def _step_table(st: dict[str, Any], w: Callable[[str], None]) -> None:
    med = st["median_ms"]
    w(
        f"Step time ({st['pairs']} interleaved pairs per comparison; `hand'` is a second, "
        "separately compiled hand step):"
    )
    w("")
    w("| | median step ms | ratio to hand (median of pairs) | 95% bootstrap CI |")
    w("|---|---:|---:|---|")
    for a, b in COMPARISONS:
        r = st["ratios"][f"{a}/{b}"]
        w(
            f"| {a} / {b} | {med[a]:.2f} / {med[b]:.2f} | {r['median']:.4f} | "
            f"[{r['ci95'][0]:.4f}, {r['ci95'][1]:.4f}] |"
        )
    w("")


def _remat_table(r: dict[str, Any], w: Callable[[str], None]) -> None:
    w("## Remat: what the transformer step saves for the backward pass (per device)")
    w("")
    w(
        "| policy | saved activations | bytes | of which from the layer scan | weight arguments "
        "kept (already resident) | temp bytes (compiled step) |"
    )
    w("|---|---:|---:|---:|---:|---:|")
    labels = {
        "explicit": "explicit_activation_checkpointing (save_only_these_names)",
        "none": "no remat",
        "nothing_saveable": "jax.checkpoint_policies.nothing_saveable",
    }
    for policy, row in r["policies"].items():
        temp = row.get("memory", {}).get("temp_size_in_bytes")
        w(
            f"| {labels.get(policy, policy)} | {row['activation']['count']} | "
            f"{_fmt_int(row['activation']['bytes'])} | {_fmt_int(row['layer_scan']['bytes'])} | "
            f"{_fmt_int(row['argument']['bytes'])} | "
            f"{'' if temp is None else _fmt_int(temp)} |"
        )
    w("")
    sm = r.get("shardlib_memory", {}).get("temp_size_in_bytes")
    w(
        "shardlib's step (explicit_activation_checkpointing) saves the same residuals as the "
        f"hand-written explicit policy: {'yes' if r['shardlib_residuals_match_hand_explicit'] else 'no'}"
        + (f"; its compiled temp bytes: {_fmt_int(sm)}." if sm is not None else ".")
    )
    w("")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="shardlib vs hand-written shard_map vs auto-sharding on 8 CPU devices",
    )
    p.add_argument("--out", default=str(DEFAULT_OUT), help="directory for results.md/.json")
    p.add_argument("--size", choices=["tiny", "full"], default="full")
    p.add_argument("--pairs", type=int, default=120, help="interleaved step pairs (>= 2)")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps of each variant first")
    p.add_argument("--compile-reps", type=int, default=8, help="fresh compiles per variant")
    p.add_argument("--profile-reps", type=int, default=5, help="profiled traces per variant")
    p.add_argument("--checking-calls", type=int, default=2000)
    p.add_argument("--checking-trace-reps", type=int, default=30)
    p.add_argument("--sweep-batches", type=int, nargs="*", default=[64, 256, 1024, 4096, 16384])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workloads", nargs="+", choices=list(wls.NAMES), default=list(wls.NAMES))
    p.add_argument(
        "--skip",
        nargs="*",
        default=[],
        choices=["stages", "profile", "steps", "sweep", "remat", "checking"],
        help="parts to leave out",
    )
    opts = p.parse_args(argv)
    if opts.pairs < 2:
        p.error("--pairs must be at least 2")
    if opts.compile_reps < 1 or opts.profile_reps < 1:
        p.error("--compile-reps and --profile-reps must be at least 1")
    return opts


def main(argv: Sequence[str] | None = None) -> int:
    opts = parse_args(argv)
    if jax.device_count() < 8:
        print(
            f"need 8 devices, have {jax.device_count()}: run as `python -m benchmarks` (it sets "
            "XLA_FLAGS=--xla_force_host_platform_device_count=8 before importing JAX)",
            file=sys.stderr,
        )
        return 2

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    results = run(opts, log)
    os.makedirs(opts.out, exist_ok=True)
    md = render_markdown(results)
    with open(os.path.join(opts.out, "results.md"), "w") as f:
        f.write(md)
    with open(os.path.join(opts.out, "results.json"), "w") as f:
        json.dump(results, f, indent=1, sort_keys=True, default=str)
    print(md)
    log(f"wrote {os.path.join(opts.out, 'results.md')} and results.json")
    return 0
