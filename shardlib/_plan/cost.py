"""Predicted step time and memory of a candidate, from its `ExplainReport` and a `Hardware`.

The model, stated once (docs/guide/plan.md says the same):

- **compute**: the report's matmul FLOPs per device (``dot_general``, scan trip counts
  multiplied in) at the hardware's peak FLOP/s;
- **communication**: each collective's bytes per device (the busier of sent and received,
  ring algorithm, calls multiplied in) at the bandwidth of its axes: the fast link when its
  devices lie within one node, the link between nodes otherwise, or the measured bandwidth
  given for its axes; layout moves outside ``shard_map`` at the slowest link;
- **overlap**: ``step = compute + comm - overlap * min(compute, comm)``: 0 runs them in turn
  (the default), 1 hides the shorter completely;
- **memory**: the report's estimated peak per device (`MemoryEstimate.peak`), against the
  budget.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass

from .._explain.hardware import Hardware, axis_bandwidth
from .._explain.report import ExplainReport

__all__ = ["Costs", "costs"]


@dataclass(frozen=True)
class Costs:
    """Predicted seconds and bytes of one step on one device."""

    compute_s: float
    comm_s: float
    step_s: float
    bytes_sent: int  # per device per step, collectives and layout moves
    comm_by: dict[str, float]  # "all-gather over fsdp" -> seconds
    memory_bytes: int | None


def costs(
    report: ExplainReport,
    hw: Hardware,
    mesh: Mapping[str, int],
    overlap: float,
    measured: Mapping[str, float] | None,
) -> Costs:
    """The `Costs` of ``report`` (traced on ``mesh``) on ``hw``."""
    by: dict[str, float] = defaultdict(float)
    for c in report.collectives:
        axes = tuple(a for a in c.axes if a in mesh)
        moved = max(c.total_sent, c.total_received)
        by[f"{c.kind} over {'x'.join(axes) or '-'}"] += moved / axis_bandwidth(
            hw, mesh, axes, measured
        )
    if report.moved_bytes:
        slowest = hw.bandwidth(math.prod(mesh.values()))
        by["layout moves"] += report.moved_bytes / slowest
    comm = sum(by.values())
    compute = report.flops / hw.flops_per_s
    step = compute + comm - overlap * min(compute, comm)
    sent = max(report.bytes_sent, report.bytes_received) + report.moved_bytes
    return Costs(compute, comm, step, sent, dict(by), report.memory.peak)
