"""Trace time averaged over where CPython's data-stack chunk boundary falls.

CPython 3.11 and 3.12 keep Python frames in 16 KiB chunks; a call that does not fit in the
current chunk maps a new one (``mmap``) and the return that leaves it unmaps it (``munmap``).
When a hot call of JAX's tracer happens to sit at a chunk boundary, every call and return pays
two system calls and fresh page faults: on the transformer step the trace time then varies
from 78 to 107 ms with nothing but the depth of the stack above the trace (the hand-written
step too), and a step one frame deeper than another can be several milliseconds slower or
faster. A comparison at one stack depth measures that accident as much as the work.

`aligned_trace_times` traces each variant from under ``k`` padding frames for ``k`` in
``range(offsets)`` and keeps the minimum over repetitions at each offset; the mean over the
offsets is the trace time with the boundary averaged out. The padding frames are small (136
bytes on CPython 3.11: `frame_bytes`) and the default number of offsets, `offsets_per_chunk`,
spans one chunk, so the offsets sample every position of the boundary evenly, 136 bytes apart.

Why small frames: the number of chunk crossings in one trace is a jagged function of the
starting position (``strace -e mmap,munmap`` on the data-parallel step, per position: 0 for a
sixth of the chunk, up to about 500 elsewhere, changing by 100 between neighbouring
positions). Sampled 1,120 bytes apart over 2.2 chunks (32 frames of 64 locals, the earlier
method) its mean came out at 109.5 crossings per shardlib trace against 99.5 for the hand
step (+10%, about 1% of the trace time); sampled 136 bytes apart over one chunk, at 114.7
against 112.9 (+1.6%). The coarse grid's error was as large as the effect being measured.
"""

from __future__ import annotations

import gc
import random
import statistics
import time
from collections.abc import Callable, Sequence
from types import CodeType
from typing import Any

from benchmarks import workloads as wls

__all__ = ["aligned_trace_times", "frame_bytes", "offsets_per_chunk", "summarize_aligned"]

CHUNK_BYTES = 16 * 1024  # CPython's data-stack chunk (DATA_STACK_CHUNK_SIZE, 3.11 and 3.12)
# Words of a frame's header before its locals (FRAME_SPECIALS_SIZE: 9 on 3.11 and 3.12; the
# 3.11 value is confirmed by the period of the crossings above, 120 frames of 136 bytes).
_FRAME_HEADER_WORDS = 9


def frame_bytes(code: CodeType) -> int:
    """Bytes one call of ``code`` takes on CPython's data stack: its locals, cells and free
    variables, its evaluation stack and the frame header, one word each."""
    n = code.co_nlocals + len(code.co_cellvars) + len(code.co_freevars) + code.co_stacksize
    return 8 * (n + _FRAME_HEADER_WORDS)


def _pad(k: int, f: Callable[..., Any], args: tuple[Any, ...]) -> Any:
    """``f(*args)`` called from ``k`` frames of `_pad` down."""
    return f(*args) if k == 0 else _pad(k - 1, f, args)


def offsets_per_chunk() -> int:
    """How many `_pad` frames fill one data-stack chunk (120 on CPython 3.11)."""
    return round(CHUNK_BYTES / frame_bytes(_pad.__code__))


def aligned_trace_times(
    workload: wls.Workload,
    reps: int,
    variants: Sequence[str] = ("shardlib", "hand"),
    offsets: int | None = None,
    seed: int = 0,
    stride: int = 1,
) -> dict[str, list[float]]:
    """``{variant: [seconds per offset]}``: the minimum CPU time of tracing a fresh step
    from under ``stride * i`` padding frames, for each ``i`` in ``range(offsets)`` (by
    default ``offsets_per_chunk() // stride`` offsets: one chunk, every ``stride``-th position).

    A coarser stride costs accuracy in the crossings, not in the work: on the data-parallel
    step (about 113 crossings per trace on average) the mean over every 2nd position misses
    the mean over all by up to 3 crossings, over every 4th by up to 12 (at roughly 15 µs
    each: 0.2% of the 90 ms transformer trace, 2% of the 10 ms data-parallel one).

    Variants alternate in random order at each offset; the garbage collector runs before each
    trace and not during it.
    """
    if offsets is None:
        offsets = offsets_per_chunk() // stride
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
                    _pad(stride * k, step.trace, workload.args)
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
