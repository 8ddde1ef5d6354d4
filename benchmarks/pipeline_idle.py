"""What an idle tick of the memory-bounded schedules costs, measured apart from the work.

Part of the pipeline part of ``python -m benchmarks`` (:mod:`benchmarks.pipeline_bench` runs
it; ``--skip idle`` leaves it out). A tick whose stage has nothing to do takes the empty
branch of the tick's ``lax.switch``: no stage compute, but the tick still reads and writes its
ring slots and sends two blocks (``shardops.shift``: the activation on, the cotangent back),
zeros when there is nothing to send, because a collective-permute is a rendezvous every
stage must join. This measures that remaining cost.

For each of ``1f1b``, ``interleaved``, ``zb-h1`` and ``zb-v`` it compiles the suite's training step
(:func:`benchmarks.pipeline_schedules.sgd_step`) twice: as is, and with the schedule's tick
table replaced by one of the same length and ring sizes in which every stage idles at every
tick (the loop, the switch, the slot reads and writes and the two shifts run; no branch
computes). Interleaved pairs (`benchmarks.measures.paired_step_times`) give

- ``idle tick``: the all-idle step's time over its ticks, the cost of one tick in which
  nothing is computed;
- ``tick``: the real step's time over its ticks, a working tick on average;
- ``bubble share``: the ticks in which stage 0 has no work at all (fused ticks: a tick with
  a forward or a backward counts as working) times the idle tick's cost, over the real
  step's time: what those ticks' own bookkeeping costs a step on devices that run in
  parallel.

The step outside the loop (the SGD update, the loss's reductions) is in both, so ``idle
tick`` is an upper bound.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import Any
from unittest import mock

import jax

from benchmarks import _pipeline as pp
from benchmarks import pipeline_schedules as ps
from benchmarks.measures import paired_step_times
from shardlib import pipeline
from shardlib._pipeline import table_loop
from shardlib._pipeline.tables import Table, schedule_table

__all__ = ["SCHEDULES", "idle_table", "render", "run"]

SCHEDULES = ("1f1b", "interleaved", "zb-h1", "zb-v")


def idle_table(table: Table) -> Table:
    """``table`` with every stage idle at every tick (same length, same ring sizes)."""
    ticks = range(table.ticks)
    return dataclasses.replace(
        table,
        actions=tuple(tuple(() for _ in ticks) for _ in range(table.p)),
        recv_fwd=tuple(tuple(-1 for _ in ticks) for _ in range(table.p)),
        recv_bwd=tuple(tuple(-1 for _ in ticks) for _ in range(table.p)),
    )


def _compiled(schedule: str, args: tuple[Any, ...], *, idle: bool) -> Any:
    """The compiled training step, its tick table made all-idle when ``idle``."""
    real = table_loop.schedule_table
    table = mock.patch.object(table_loop, "schedule_table", lambda *a: idle_table(real(*a)))
    with table if idle else contextlib.nullcontext():
        return jax.jit(ps.sgd_step(schedule)).lower(*args).compile()


def run(
    size: str = "full",
    *,
    pairs: int = 60,
    warmup: int = 3,
    seed: int = 0,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Idle and real step times of each schedule at the suite's step-time ``m``."""
    sizes = ps.SIZES[size]
    c: pp.PipelineConfig = sizes["config"]
    p = ps.MESH_SHAPE[0]
    m = sizes["step_per_stage"] * p
    log(f"[pipeline] idle ticks: {', '.join(SCHEDULES)} at m = {m}, {pairs} pairs")
    steps: dict[str, tuple[Any, tuple[Any, ...]]] = {}
    with jax.set_mesh(ps.make_mesh()):
        for schedule in SCHEDULES:
            args = ps.inputs(schedule, c, m, seed)
            for idle in (False, True):
                f = _compiled(schedule, args, idle=idle)
                for _ in range(warmup):
                    jax.block_until_ready(f(*args))
                steps[schedule + (" idle" if idle else "")] = (f, args)
        pairs_of = [(f"{s} idle", s) for s in SCHEDULES]
        timed = paired_step_times(steps, pairs_of, pairs, seed)
    rows = []
    for schedule in SCHEDULES:
        v = ps.V if schedule in ps.GROUPED else 1
        ticks = ps.tick_formula(schedule, p, m, v)
        bubble = pipeline.bubble_fraction(schedule, p, m, v)
        step_ms = timed["median_ms"][schedule]
        idle_ms = timed["median_ms"][f"{schedule} idle"]
        rows.append(
            {
                "schedule": schedule,
                "ticks": ticks,
                "bubble": bubble,
                "step_ms": step_ms,
                "idle_step_ms": idle_ms,
                "idle_over_real": timed["ratios"][f"{schedule} idle/{schedule}"],
                "tick_ms": step_ms / ticks,
                "idle_tick_ms": idle_ms / ticks,
                "bubble_share": _idle_ticks(schedule, p, m, v) * (idle_ms / ticks) / step_ms,
            }
        )
    return {"microbatches": m, "pairs": pairs, "rows": rows}


def _idle_ticks(schedule: str, p: int, m: int, v: int) -> int:
    """The ticks in which stage 0 has no work at all (fused ticks: a tick with a forward
    or a backward is not idle, though it may be shorter than the busiest stage's)."""
    return sum(not cell for cell in schedule_table(schedule, p, m, v).actions[0])


def render(rec: dict[str, Any], w: Callable[[str], None]) -> None:
    """The idle-tick table (markdown)."""
    w(f"Idle ticks at m = {rec['microbatches']} ({rec['pairs']} interleaved pairs):\n")
    w("| schedule | ticks | bubble | step ms | all-idle step ms (ratio, 95% CI) "
      "| tick ms | idle tick ms | bubble share of the step |")  # fmt: skip
    w("|---|---:|---:|---:|---|---:|---:|---:|")
    for r in rec["rows"]:
        q = r["idle_over_real"]
        w(
            f"| {r['schedule']} | {r['ticks']} | {r['bubble']:.3f} | {r['step_ms']:.2f} | "
            f"{r['idle_step_ms']:.2f} ({q['median']:.3f}, [{q['ci95'][0]:.3f}, "
            f"{q['ci95'][1]:.3f}]) | {r['tick_ms']:.3f} | {r['idle_tick_ms']:.3f} | "
            f"{r['bubble_share']:.1%} |"
        )
    w("")
