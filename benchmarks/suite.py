"""The benchmark suite behind ``python -m benchmarks``: shardlib vs hand-written vs auto-sharded.

Measures, for each workload of :mod:`benchmarks.workloads` on a ``(4, 2)`` mesh of simulated
CPU devices with Auto axes:

1. structure (deterministic, :mod:`benchmarks.structure`): collectives per kind (instructions,
   executions per step, bytes per device), ``cost_analysis()``, ``memory_analysis()``, and
   whether the canonical jaxpr, StableHLO and compiled HLO of ``shardlib`` and ``hand`` are
   identical;
2. trace / lower / compile times on fresh closures (variants interleaved in random order), and
   shardlib's own self-time per trace (:mod:`benchmarks.measures`);
3. step time: interleaved single steps, median per-pair ratio with a bootstrap 95% interval,
   beside a hand/hand control (:mod:`benchmarks.measures`);
4. eager checking cost per argument (:mod:`benchmarks.checking_cost`);
5. saved residuals of the transformer step under three remat policies
   (:mod:`benchmarks.structure`);
6. a GPipe pipeline step on a ``(2, 4)`` mesh ``('p', 'd')``: shardlib vs hand vs GSPMD, and
   compile time by number of microbatches (:mod:`benchmarks.pipeline_bench`);
7. context-parallel attention on a 1-D mesh ``('c',)``: ring vs all-gather vs XLA's own
   partitioning, temp memory, bytes against the formula and the HLO, step time
   (:mod:`benchmarks.attention_bench`);
8. a mixture-of-experts layer on meshes ``(2, 4)`` ``('d', 'e')`` and ``(8,)`` ``('e',)``:
   shardlib.moe vs XLA's own partitioning, all-to-all bytes against the formula and the HLO,
   temp memory, step time (:mod:`benchmarks.moe_bench`);
9. the transformer step on a ``(2, 4)`` mesh ``('d', 't')`` plain vs collective matmuls
   (``Config.overlap``): collectives per kind, explain's bytes, step time
   (:mod:`benchmarks.overlap_bench`);
10. ``shardlib.plan`` on the three examples: planning time for 1024 devices, every 8-device
    candidate compiled against its prediction, predicted vs measured step-time ranking
    (:mod:`benchmarks.plan_bench`);
11. the typed decode step of ``examples/decoding.py`` on meshes ``('d', 'c', 't')`` against a
    hand-written ``jax.shard_map`` one: compiled HLO, cache bytes per device, the combine's
    bytes (formula, explain, HLO), step time (:mod:`benchmarks.decode_bench`).

:mod:`benchmarks.report` checks the targets and writes the Markdown. This module runs it all
from the command line. Import it only after XLA_FLAGS asks for 8 host devices (``__main__``
does that).
"""

from __future__ import annotations

import argparse
import datetime
import io
import json
import math
import os
import platform
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType

from benchmarks import (
    attention_bench,
    checking_cost,
    context_strategies,
    context_weights,
    decode_bench,
    moe_bench,
    overlap_bench,
    pipeline_bench,
    plan_bench,
    roles_cost,
)
from benchmarks import workloads as wls
from benchmarks.alignment import aligned_trace_times, offsets_per_chunk, summarize_aligned
from benchmarks.measures import (
    sampled_self_times,
    self_times,
    stage_times,
    step_times,
    summarize_stages,
    trace_work,
)
from benchmarks.report import TARGETS, evaluate_targets, render_markdown
from benchmarks.structure import compare_structure, fsdp_batch_sweep, parse_residuals, remat_report

__all__ = [
    "MESH_SHAPE",
    "TARGETS",
    "compare_structure",
    "environment",
    "main",
    "make_mesh",
    "parse_residuals",
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
# Parts of the run --skip names; --only names the first eleven (the last four are parts of each
# workload, of the pipeline (its compile sweep and idle ticks) and of the attention and MoE
# parts: those have steps only).
PARTS = (
    "workloads",
    "sweep",
    "remat",
    "checking",
    "pipeline",
    "attention",
    "moe",
    "overlap",
    "plan",
    "roles",
    "decode",
    "stages",
    "idle",
    "profile",
    "steps",
)
TOP_PARTS = PARTS[:11]
# The parts :func:`run` calls alike, each with ``run(size, pairs=, warmup=, seed=, skip=, log=)``.
STEP_PARTS: dict[str, Any] = {
    "attention": attention_bench,
    "moe": moe_bench,
    "overlap": overlap_bench,
    "plan": plan_bench,
    "decode": decode_bench,
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


def _strip_private(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: _strip_private(v) for k, v in x.items() if not str(k).startswith("_")}
    if isinstance(x, list | tuple):
        return [_strip_private(v) for v in x]
    if isinstance(x, np.generic):
        return x.item()
    return x


def _measure_workload(
    name: str, opts: argparse.Namespace, skip: set[str], log: Callable[[str], None]
) -> dict[str, Any]:
    """Structure, stage times, trace over stack alignments, self-time, step time of one
    workload (inside ``jax.set_mesh``)."""
    w = wls.build(name, opts.size, opts.seed)
    rec: dict[str, Any] = {"title": w.title, "description": w.description, "shape": w.shape}
    log(f"[{name}] structure")
    s = compare_structure(w)
    rec["structure"] = {k: v for k, v in s.items() if k != "outputs"}
    if "stages" not in skip:
        log(f"[{name}] trace/lower/compile x{opts.compile_reps}")
        times = stage_times(w, opts.compile_reps, opts.seed)
        rec["stages"] = {"raw_s": times, "summary": summarize_stages(times)}
        # Every position of the chunk boundary for the short traces; every 4th for a trace
        # over 40 ms, whose crossings weigh less against its work (`aligned_trace_times`).
        stride = 4 if min(times["hand"]["trace_cpu"]) > 0.04 else 1
        offsets = offsets_per_chunk() // stride if opts.size == "full" else 4
        log(f"[{name}] trace over {offsets} stack alignments (stride {stride})")
        aligned = aligned_trace_times(
            w, max(1, opts.compile_reps // 4), offsets=offsets, seed=opts.seed, stride=stride
        )
        rec["aligned_trace"] = {"raw_s": aligned, "summary": summarize_aligned(aligned)}
    if "profile" not in skip:
        log(f"[{name}] self-time profile x{opts.profile_reps}")
        rec["self_time_ms"] = self_times(w, opts.profile_reps)
        rec["sampled_self_time_ms"] = sampled_self_times(w, 4 * opts.profile_reps)
        rec["trace_work"] = trace_work(w)
    if "steps" not in skip:
        log(f"[{name}] step time, {opts.pairs} pairs")
        rec["steps"] = step_times(w, opts.pairs, opts.warmup, opts.seed)
    return rec


def run(opts: argparse.Namespace, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run everything ``opts`` asks for and return the results (JSON-serialisable)."""
    t_start = time.perf_counter()
    env = environment()
    results: dict[str, Any] = {
        "environment": env,
        "settings": {
            k: getattr(opts, k)
            for k in ("size", "pairs", "compile_reps", "profile_reps", "seed", "workloads", "skip")
        },
        "mesh": {"shape": list(MESH_SHAPE), "axes": ["d", "t"], "axis_types": "Auto"},
        "workloads": {},
    }
    skip = set(opts.skip)
    with jax.set_mesh(make_mesh()):
        for name in [] if "workloads" in skip else opts.workloads:
            results["workloads"][name] = _measure_workload(name, opts, skip, log)
        if "sweep" not in skip and "fsdp_mlp" in opts.workloads:
            log("[fsdp_mlp] batch sweep")
            results["fsdp_batch_sweep"] = fsdp_batch_sweep(opts.sweep_batches, opts.seed)
        if "remat" not in skip:
            log("[transformer] remat")
            results["remat"] = remat_report(opts.size, opts.seed)
    if "pipeline" not in skip:
        results["pipeline"] = pipeline_bench.run(
            opts.size,
            pairs=opts.pairs,
            warmup=opts.warmup,
            compile_reps=opts.compile_reps,
            seed=opts.seed,
            skip=skip,
            log=log,
        )
    for part in (p for p in STEP_PARTS if p not in skip):  # the parts with steps only
        results[part] = STEP_PARTS[part].run(
            opts.size, pairs=opts.pairs, warmup=opts.warmup, seed=opts.seed, skip=skip, log=log
        )
    if "attention" in results:  # issue 41: the strategies side by side, weights over d x c
        log("[attention] context strategies: bytes and memory")
        results["attention"]["strategies"] = context_strategies.run(opts.size, log=log)
        log("[attention] the headline model's weights over d x c")
        results["attention"]["weights"] = context_weights.run(opts.size, log=log)
    if "checking" not in skip:
        log("checking cost")
        buf = io.StringIO()
        results["checking"] = checking_cost.main(
            calls=opts.checking_calls, trace_reps=opts.checking_trace_reps, out=buf
        )
        results["checking"]["report"] = buf.getvalue()
    if "roles" not in skip:
        log("axis roles against mesh axes")
        buf = io.StringIO()
        results["roles"] = roles_cost.main(
            calls=opts.checking_calls, reps=opts.checking_trace_reps, out=buf
        )
        results["roles"]["report"] = buf.getvalue()
    env["load_average_end"] = list(load_average())
    results["runtime_s"] = time.perf_counter() - t_start
    results["targets"] = evaluate_targets(results)
    return _strip_private(results)


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
    p.add_argument("--skip", nargs="*", default=[], choices=PARTS, help="parts to leave out")
    p.add_argument(
        "--only",
        nargs="+",
        default=None,
        choices=TOP_PARTS,
        help="run only these parts, e.g. `--only pipeline` (--skip still applies within them)",
    )
    opts = p.parse_args(argv)
    if opts.only is not None:
        opts.skip = sorted(set(opts.skip) | (set(TOP_PARTS) - set(opts.only)))
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
