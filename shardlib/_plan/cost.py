"""Predicted step time and memory of a candidate, from its `ExplainReport` and a `Hardware`.

The model, stated once (docs/guide/plan.md says the same, with the formulas):

- **compute** (`shardlib._plan.roofline`): each matmul (``dot_general``, scan trip counts
  multiplied in) at ``max(FLOPs / peak, bytes / HBM bandwidth)`` (the roofline; FLOPs alone
  when the hardware gives no ``hbm_bytes_per_s``);
- **communication** (alpha-beta): each collective's ``calls * (steps * latency + bytes /
  bandwidth)``: its bytes per device (the busier of sent and received, ring algorithm) at the
  bandwidth of its axes (the fast link when its devices lie within one node, on a TPU torus
  times the physical axes the group occupies; the link between nodes otherwise; or the
  measured bandwidth given for its axes, ``plan(bandwidths=)`` first, then the hardware's
  ``axis_bytes_per_s``: `shardlib._explain.hardware.axis_bandwidth`), plus the hardware's
  ``collective_latency_s`` (or the largest ``axis_latency_s`` of its axes, when every one is
  measured; or its kind's ``collective_latency_by_kind_s`` where that is smaller) per step
  of the ring (``group - 1`` steps; an all-reduce ``2 (group - 1)``; a permute 1), and a
  cost once per call (``collective_call_by_kind_s`` of its kind, else
  ``collective_call_s``: 0 on every preset); layout moves outside ``shard_map`` at the
  slowest link, one step and one call each;
- **overhead** (0 unless the hardware sets it: `shardlib.calibrate` does, no preset does):
  ``op_overhead_s`` per kernel-launching equation of the traced program run (trip counts
  multiplied in; `shardlib._plan.roofline` says which, an elementwise chain XLA fuses
  counting once), and the bytes per device each such equation but a matmul moves (a fused
  chain: its inputs and its last result) at ``elementwise_bytes_per_s``;
  counted with compute, in the equation's phase. On a CPU these, not the matmuls, set the
  differences between layouts; on an accelerator XLA fuses most of those equations, and its
  matmuls dominate;
- **phases**: the forward phase is the forward's matmuls and collectives, the backward phase
  the matmuls made by differentiation and the collectives of the backward pass (transposes:
  the gradient reductions among them; collectives recomputed by remat);
- **overlap**, per phase: ``step = sum over phases of compute_p + comm_p - overlap *
  min(compute_p, comm_p)``: 0 runs them in turn (the default), 1 hides the shorter of each
  phase, as "How to Scale Your Model" counts it (the gradient all-reduce hides behind the
  backward pass only);
- **memory**: the report's estimated peak per device (`MemoryEstimate.peak`), against the
  budget.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass

from .._explain.hardware import Hardware, axis_bandwidth
from .._explain.report import CollectiveCall, ExplainReport
from .roofline import PHASES, Matmuls

__all__ = ["Costs", "PHASES", "costs", "ring_steps"]


@dataclass(frozen=True)
class Costs:
    """Predicted seconds and bytes of one step on one device."""

    compute_s: float
    comm_s: float
    step_s: float
    bytes_sent: int  # per device per step, collectives and layout moves
    comm_by: dict[str, float]  # "all-gather over fsdp" -> seconds
    memory_bytes: int | None
    # phase ('forward', 'backward') -> (compute seconds, communication seconds)
    phases: dict[str, tuple[float, float]]
    hbm_bound_s: float = 0.0  # compute seconds of matmuls whose bytes bind (the roofline)

    @property
    def memory_bound(self) -> bool:
        """Whether most of the compute time is matmuls bound by memory bandwidth."""
        return self.hbm_bound_s > 0.5 * self.compute_s > 0


def ring_steps(kind: str, group: int) -> int:
    """Steps of the ring algorithm for a collective of ``kind`` over ``group`` devices."""
    if group <= 1:
        return 0
    if kind == "collective-permute":
        return 1
    return 2 * (group - 1) if kind == "all-reduce" else group - 1


def costs(
    report: ExplainReport,
    matmuls: Matmuls,
    hw: Hardware,
    mesh: Mapping[str, int],
    overlap: float,
    measured: Mapping[str, float] | None,
) -> Costs:
    """The `Costs` of ``report`` and its ``matmuls`` (traced on ``mesh``) on ``hw``."""
    by: dict[str, float] = defaultdict(float)
    comm = dict.fromkeys(PHASES, 0.0)
    for c in report.collectives:
        axes = tuple(a for a in c.axes if a in mesh)
        seconds = _seconds(c, hw, mesh, axes, measured)
        by[f"{c.kind} over {'x'.join(axes) or '-'}"] += seconds
        comm[PHASES[c.backward or c.recomputed]] += seconds
    slowest = hw.bandwidth(math.prod(mesh.values()))
    for m in report.moves:
        alpha = hw.collective_latency_s + hw.collective_call_s
        seconds = m.total_received / slowest + alpha * m.calls * len(m.kinds)
        if not seconds:
            continue
        by["layout moves"] += seconds
        comm[PHASES[m.backward]] += seconds
    phases = {p: (matmuls.phase_s(p), comm[p]) for p in PHASES}
    step = sum(a + b - overlap * min(a, b) for a, b in phases.values())
    sent = max(report.bytes_sent, report.bytes_received) + report.moved_bytes
    return Costs(
        compute_s=sum(matmuls.phase_s(p) for p in PHASES),
        comm_s=sum(comm.values()),
        step_s=step,
        bytes_sent=sent,
        comm_by=dict(by),
        memory_bytes=report.memory.peak,
        phases=phases,
        hbm_bound_s=sum(matmuls.hbm_bound_s.values()),
    )


def _seconds(
    c: CollectiveCall,
    hw: Hardware,
    mesh: Mapping[str, int],
    axes: tuple[str, ...],
    measured: Mapping[str, float] | None,
) -> float:
    """One collective's seconds per step: alpha-beta, calls multiplied in."""
    moved = max(c.total_sent, c.total_received)
    per_axis = hw.axis_latency_s or {}
    alpha = (
        max(per_axis[a] for a in axes)
        if axes and all(a in per_axis for a in axes)
        else hw.collective_latency_s
    )
    kind_alpha = (hw.collective_latency_by_kind_s or {}).get(c.kind)
    alpha = alpha if kind_alpha is None else min(alpha, kind_alpha)
    steps = ring_steps(c.kind, c.group)
    call = (hw.collective_call_by_kind_s or {}).get(c.kind, hw.collective_call_s)
    latency = (alpha * steps + (call if steps else 0.0)) * c.calls
    if hw.axis_bytes_per_s:
        measured = {**hw.axis_bytes_per_s, **(measured or {})}
    return moved / axis_bandwidth(hw, mesh, axes, measured) + latency
