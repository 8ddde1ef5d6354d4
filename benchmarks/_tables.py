"""Cells and tables shared by the Markdown of `benchmarks.report`, `benchmarks.pipeline_bench`,
`benchmarks.attention_bench` and `benchmarks.moe_bench`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["mb", "side_by_side", "traffic_kind_rows"]


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


def side_by_side(
    rec: dict[str, Any], w: Callable[[str], None], names: list[str], title: str, grad_key: str
) -> None:
    """The per-device table of a part that runs shardlib variants beside XLA's partitioning
    (``names``, the last one the baseline ``xla``): collectives by kind, payload and wire
    bytes, temp bytes, median step time; the gradients' largest difference (``rec[grad_key]``);
    then the step-time ratios of each variant, and of a second baseline step, to the baseline.
    """
    vs = rec["variants"]
    w(title)
    w("")
    w("| | " + " | ".join(names) + " |")
    w("|---|" + "---:|" * len(names))
    for k in sorted({k for n in names for k in vs[n]["traffic"]["kinds"]}):
        rows = [vs[n]["traffic"]["kinds"].get(k) for n in names]
        cells = [
            "0" if r is None else f"{r['runs']}/step, {mb(r['payload_bytes_per_step'])} MB"
            for r in rows
        ]
        w(f"| {k} | " + " | ".join(cells) + " |")
    for label, key in (
        ("payload MB", "payload_bytes_per_step"),
        ("wire MB", "wire_bytes_per_step"),
    ):
        totals = [mb(vs[n]["traffic"]["total"][key]) for n in names]
        w(f"| collective {label}/step | " + " | ".join(totals) + " |")
    w("| temp bytes | " + " | ".join(f"{vs[n]['temp_bytes']:,}" for n in names) + " |")
    if "steps" in rec:
        med = rec["steps"]["median_ms"]
        w("| median step ms | " + " | ".join(f"{med[n]:.2f}" for n in names) + " |")
    w("")
    base = names[-1]
    w(f"max |{names[0]} − {base}| / max |{base}| over the gradients: {rec[grad_key]:.1e}.")
    w("")
    if "steps" in rec:
        _step_ratios(rec["steps"], w, names)


def _step_ratios(st: dict[str, Any], w: Callable[[str], None], names: list[str]) -> None:
    base = names[-1]
    w(
        f"Step time ({st['pairs']} interleaved pairs per comparison; `{base}'` is a second "
        f"{base} step):"
    )
    w("")
    w("| | median step ms | ratio (median of pairs) | 95% bootstrap CI |")
    w("|---|---:|---:|---|")
    for key in (f"{names[0]}/{base}", f"{base}'/{base}", *(f"{n}/{base}" for n in names[1:-1])):
        r = st["ratios"][key]
        a, b = key.split("/")
        w(
            f"| {a} / {b} | {st['median_ms'][a]:.2f} / {st['median_ms'][b]:.2f} | "
            f"{r['median']:.4f} | [{r['ci95'][0]:.4f}, {r['ci95'][1]:.4f}] |"
        )
    w("")


def row(target: str, measured: str, met: bool | None) -> dict[str, Any]:
    """One row of the report's targets table (``met``: None when not measured)."""
    return {"target": target, "measured": measured, "met": met}
