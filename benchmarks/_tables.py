"""Cells shared by the Markdown tables of `benchmarks.report` and `benchmarks.pipeline_bench`."""

from __future__ import annotations

from typing import Any

__all__ = ["mb", "traffic_kind_rows"]


def mb(n: float) -> str:
    """Bytes as megabytes with three decimals."""
    return f"{n / 1e6:.3f}"


def traffic_kind_rows(vs: dict[str, Any], names: list[str]) -> list[tuple[str, list[str]]]:
    """``(kind, cells)`` per collective kind of any variant, in kind order: one cell per
    variant in ``names``, ``'COUNT (RUNS/step) PAYLOAD MB'`` or ``'0'``."""
    kinds = sorted({k for v in vs.values() for k in v["traffic"]["kinds"]})
    rows = []
    for k in kinds:
        cells = []
        for n in names:
            row = vs[n]["traffic"]["kinds"].get(k)
            cells.append(
                "0"
                if row is None
                else f"{row['count']} ({row['runs']}/step) {mb(row['payload_bytes_per_step'])} MB"
            )
        rows.append((k, cells))
    return rows
