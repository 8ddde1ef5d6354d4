"""Trace time averaged over where CPython 3.11's data-stack chunk boundary falls.

CPython 3.11 keeps Python frames in 16 KiB chunks; a call that does not fit in the current
chunk maps a new one (``mmap``) and the return that leaves it unmaps it (``munmap``). When a
hot call of JAX's tracer happens to sit at a chunk boundary, every call and return pays two
system calls and fresh page faults: on the transformer step the trace time then varies from
78 to 107 ms with nothing but the depth of the stack above the trace (the hand-written step
too), and a step one frame deeper than another can be several milliseconds slower or faster.
A comparison at one stack depth measures that accident as much as the work.

`aligned_trace_times` traces each variant from under ``k`` padding frames of about 600 bytes
each, for ``k`` in ``range(offsets)`` (32 by default: about 19 KiB, more than a chunk), and
keeps the minimum over repetitions at each offset; the mean over the offsets is the trace
time with the boundary averaged out. ``strace -e mmap,munmap`` shows the mechanism: five
traces of the hand step made 274 such calls at one depth and 4,763 five frames deeper.
"""

from __future__ import annotations

import gc
import random
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

from benchmarks import workloads as wls

__all__ = ["aligned_trace_times", "summarize_aligned"]

_PAD_LOCALS = 64  # locals of one padding frame: with the frame's header, about 600 bytes


def _make_pad() -> Callable[..., Any]:
    """``pad(k, f, args)``: ``f(*args)`` called from ``k`` frames down, each one large."""
    names = ", ".join(f"_{i}" for i in range(_PAD_LOCALS))
    src = (
        "def pad(k, f, args):\n"
        "    if k < 0:\n"
        f"        {names} = range({_PAD_LOCALS})\n"  # never runs: makes the locals exist
        "    return f(*args) if k == 0 else pad(k - 1, f, args)\n"
    )
    scope: dict[str, Any] = {}
    exec(compile(src, "<benchmarks.alignment>", "exec"), scope)
    return scope["pad"]


_pad = _make_pad()


def aligned_trace_times(
    workload: wls.Workload,
    reps: int,
    variants: Sequence[str] = ("shardlib", "hand"),
    offsets: int = 32,
    seed: int = 0,
) -> dict[str, list[float]]:
    """``{variant: [seconds per offset]}``: the minimum CPU time of tracing a fresh step
    from under ``k`` padding frames, for each ``k`` in ``range(offsets)``.

    Variants alternate in random order at each offset; the garbage collector runs before each
    trace and not during it.
    """
    rng = random.Random(seed)
    best = {v: [float("inf")] * offsets for v in variants}
    for v in variants:  # warm-up
        workload.fresh(v).trace(*workload.args)
    was_enabled = gc.isenabled()
    for _ in range(reps):
        for k in range(offsets):
            order = list(variants)
            rng.shuffle(order)
            for v in order:
                step = workload.fresh(v)
                gc.collect()
                gc.disable()
                try:
                    c0 = time.process_time()
                    _pad(k, step.trace, workload.args)
                    dt = time.process_time() - c0
                finally:
                    if was_enabled:
                        gc.enable()
                best[v][k] = min(best[v][k], dt)
    return best


def summarize_aligned(times: dict[str, list[float]]) -> dict[str, Any]:
    """Mean, minimum and maximum over offsets per variant; shardlib / hand of the means."""
    out: dict[str, Any] = {
        v: {
            "mean_s": statistics.fmean(x),
            "min_s": min(x),
            "max_s": max(x),
            "offsets": len(x),
        }
        for v, x in times.items()
    }
    if "shardlib" in out and "hand" in out:
        out["ratio_of_means"] = out["shardlib"]["mean_s"] / out["hand"]["mean_s"]
        out["ratio_of_minimums"] = out["shardlib"]["min_s"] / out["hand"]["min_s"]
    return out
