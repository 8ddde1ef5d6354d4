"""`shardlib.explain`'s report as text: tables, totals, roofline, summary.

Pure formatting of an `ExplainReport` (and of an `HloComparison`); nothing here computes a
number the report does not hold.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection, Sequence

from .._check.format import byte_str, shape_str
from . import moe_calls as _moe
from . import report as _report
from . import sections as _sections
from .moves import LayoutMove
from .report import CollectiveCall, ExplainReport, HloComparison, MemoryEstimate

__all__ = ["comparison", "render", "short"]

_COLLECTIVE_HEAD = (
    "#",
    "op",
    "spec",
    "kind",
    "axes",
    "operand",
    "sent",
    "recv",
    "calls",
    "total sent",
    "source",
)


def render(report: ExplainReport, *, max_rows: int | None = None) -> str:
    """The full report: collectives, totals per axis group, saved values, arguments, roofline
    and notes."""
    lines = [f"shardlib.explain: {report.name}", ""]
    lines.append("Communication (per device, per call; ring algorithm; loops multiplied in)")
    lines += _collective_lines(report.collectives, max_rows)
    lines.append("")
    lines.append("Totals per mesh axis group")
    lines += _totals_lines(report)
    if report.moves:
        lines.append("")
        lines += _move_lines(report.moves)
    if report.schedules:
        lines.append("")
        lines += _sections.schedule_lines(report.schedules, _table)
    if report.rings:
        lines.append("")
        lines += _sections.ring_lines(report.rings, _table)
    if report.moes:
        lines.append("")
        lines += _moe.moe_lines(report.moes, _table)
    if report.saved:
        lines.append("")
        lines += _saved_lines(report)
    if report.argument_bytes:
        lines.append("")
        total = sum(b for _, b in report.argument_bytes)
        lines.append(f"Arguments (parameters, optimizer state...): {byte_str(total, 1)} per device")
        lines += [f"  {name}: {byte_str(b, 1)}" for name, b in report.argument_bytes]
    lines.append("")
    lines += _memory_lines(report.memory, report.saved_bytes)
    if report.hardware is not None:
        lines.append("")
        lines += _roofline_lines(report)
    lines += [f"warning: {w}" for w in move_warnings(report)]
    lines += [f"note: {n}" for n in report.notes]
    return "\n".join(lines)


def _move_lines(moves: Sequence[LayoutMove]) -> list[str]:
    lines = [
        "Layout moves outside shard_map (per device, per call: what a device lacks of its new "
        "block; XLA moves it with all-to-all / all-gather / collective-permute)"
    ]
    rows = [
        (
            str(i),
            m.label,
            m.src,
            m.dst,
            shape_str(m.shape) + " " + m.dtype,
            ", ".join(m.kinds) or "none (local slice)",
            byte_str(m.received_bytes, 1),
            f"x{m.calls}",
            byte_str(m.total_received, 1),
            m.location,
        )
        for i, m in enumerate(moves)
    ]
    head = ("#", "value", "from", "to", "global", "needs", "recv", "calls", "total recv")
    return lines + _table((*head, "source"), rows, right={6, 7, 8})


def move_warnings(report: ExplainReport) -> list[str]:
    """One line per move into a ``shard_map`` that sends bytes inside a step (f does more
    than that one call): it costs every call; the line says how to avoid it."""
    out = []
    for m in report.moves:
        if not m.in_step or m.backward or m.into is None or not m.received_bytes:
            continue
        what = (
            f"argument {m.argument!r}: pass it in the annotated layout (place it once with "
            "make_shardings) or annotate the layout it arrives in"
            if m.argument
            else "a value computed in the step: produce it in the annotated layout"
        )
        out.append(
            f"{m.into}() input {m.input_index} is moved on every call of {report.name}, "
            f"{m.src} -> {m.dst} ({byte_str(m.total_received, 1)} received per device"
            f"{', and back for its gradient' if _has_transpose(report, m) else ''}; "
            f"{m.location}); it is {what}"
        )
    return out


def _has_transpose(report: ExplainReport, m: LayoutMove) -> bool:
    return any(
        b.backward and (b.into, b.input_index, b.src) == (m.into, m.input_index, m.dst)
        for b in report.moves
    )


def _memory_lines(mem: MemoryEstimate, saved: int) -> list[str]:
    xla = mem.xla
    head = "Memory per device (estimated from the types"
    head += "; XLA's memory_analysis beside it)" if xla else ")"

    def num(n: int | None) -> str:
        return byte_str(n, 1) if n is not None else "not estimated"

    rows = [
        ["arguments", num(mem.arguments), xla and byte_str(xla.arguments, 1), ""],
        ["results", num(mem.outputs), xla and byte_str(xla.outputs, 1), ""],
        ["peak", num(mem.peak), xla and byte_str(xla.total, 1), ""],
    ]
    if xla:
        rows[2][3] = "XLA: arguments + results - aliased + temporaries"
    if mem.gathered:
        where = f", {mem.gathered_location}" if mem.gathered_location else ""
        scan = " (one iteration of a scan)" if mem.gathered_in_scan else ""
        note = f"all_gather results live together{scan}{where}"
        rows.append(["  gathered at once", num(mem.gathered), "", note])
    if saved:
        rows.append(["  saved for backward", num(saved), "", "the table above, all calls"])
    keep = [k for k in (0, 1, 2, 3) if (k != 2 or xla) and (k != 3 or any(r[3] for r in rows))]
    table = _table(
        tuple(("", "estimate", "XLA", "")[k] for k in keep),
        [tuple(r[k] or "" for k in keep) for r in rows],
        right={1, 2} if xla else {1},
    )
    lines = [head, *table]
    low, high = _report.PEAK_RATIO_MEASURED
    lines.append(
        "estimate: every traced value kept from the equation that makes it to its last use, "
        "in trace order (XLA fuses, reorders and adds scratch buffers: on the programs the tests "
        f"compare, on XLA:CPU, the estimate came out {low:.2f} to {high:.2f} times XLA's peak)"
        + ("" if xla else "; pass compiled=jax.jit(f).lower(...).compile() for XLA's numbers")
    )
    return lines + [f"memory: {c}" for c in mem.caveats]


def _collective_lines(collectives: Sequence[CollectiveCall], max_rows: int | None) -> list[str]:
    rows = [
        (
            str(i),
            _label(c),
            c.spec if c.spec is not None else "-",
            c.kind,
            "/".join(c.axes) + f" ({c.group})",
            shape_str(c.operand_shape) + " " + c.dtype,
            byte_str(c.sent_bytes, 1),
            byte_str(c.received_bytes, 1),
            f"x{c.calls}",
            byte_str(c.total_sent, 1),
            c.location,
        )
        for i, c in enumerate(collectives)
    ]
    hidden = 0
    if max_rows is not None and len(rows) > max_rows:
        hidden = len(rows) - max_rows
        rows = rows[:max_rows]
    lines = _table(_COLLECTIVE_HEAD, rows, right={6, 7, 8, 9})
    if hidden:
        lines.append(f"... {hidden} more")
    return lines + _flag_lines(collectives)


def _totals_lines(report: ExplainReport) -> list[str]:
    rows = [
        ("/".join(k) or "-", str(v[0]), byte_str(v[1], 1), byte_str(v[2], 1))
        for k, v in sorted(report.totals_by_axes().items())
    ]
    calls = sum(c.calls for c in report.collectives)
    rows.append(
        ("all", str(calls), byte_str(report.bytes_sent, 1), byte_str(report.bytes_received, 1))
    )
    return _table(("axes", "calls", "sent", "received"), rows, right={1, 2, 3})


def _saved_lines(report: ExplainReport) -> list[str]:
    lines = ["Saved for the backward pass (explicit_activation_checkpointing; per device)"]
    rows = [
        (
            s.label,
            shape_str(s.shape) + " " + s.dtype,
            byte_str(s.bytes, 1),
            f"x{s.calls}",
            byte_str(s.total, 1),
            s.location,
        )
        for s in report.saved
    ]
    lines += _table(("saved", "value", "bytes", "calls", "total", "source"), rows, right={2, 3, 4})
    each, once = report.saved_per_call
    kept_once = f" (+ {byte_str(once, 1)} kept once: the same at every call)" if once else ""
    lines.append(
        f"per checkpointed call: {byte_str(each, 1)}{kept_once}; in all "
        f"({report.checkpoint_calls} calls): {byte_str(report.saved_bytes, 1)}"
    )
    return lines


def _roofline_lines(report: ExplainReport) -> list[str]:
    hw = report.hardware
    if hw is None:
        return []
    comm, comp = report.comm_seconds() or 0.0, report.compute_seconds() or 0.0
    out = [
        f"Roofline estimate on {hw.name} ({hw.link_bytes_per_s / 1e9:.0f} GB/s per "
        f"{'torus axis' if hw.torus_axes else 'link'}, "
        f"{hw.flops_per_s / 1e12:.0f} TFLOP/s; estimates, not measurements)",
        f"  matmul FLOPs per device: {report.flops:.3g} -> {_secs(comp)}",
        f"  communication: "
        f"{byte_str(max(report.bytes_sent, report.bytes_received) + report.moved_bytes, 1)} -> "
        f"{_secs(comm)}",
    ]
    by_op: dict[str, float] = defaultdict(float)
    for c in report.collectives:
        key = f"{_label(c)}[{c.spec}]" if c.spec is not None else _label(c)
        by_op[key] += max(c.total_sent, c.total_received) / hw.link_bytes_per_s
    for m in report.moves:
        by_op[f"layout move: {m.label}"] += m.total_received / hw.link_bytes_per_s
    for k, t in sorted(by_op.items(), key=lambda kv: -kv[1])[:8]:
        out.append(f"    {_secs(t):>10}  {k}")
    m = report.mfu_ceiling()
    if m is not None:
        out.append(
            f"  MFU ceiling from communication: {m[0]:.0%} with perfect overlap, "
            f"{m[1]:.0%} with none"
        )
    return out


def short(report: ExplainReport) -> str:
    """A few lines: collectives by kind and axis, bytes, saved residuals."""
    census = ", ".join(f"{k} x{v}" for k, v in sorted(report.census().items()))
    parts = [
        f"{report.name}: {sum(c.calls for c in report.collectives)} collective calls per call "
        f"({len(report.collectives)} in the program: {census}); per device: sent "
        f"{byte_str(report.bytes_sent, 1)}, received "
        f"{byte_str(report.bytes_received, 1)}"
        if report.collectives
        else f"{report.name}: no collectives in the program"
    ]
    for k, v in sorted(report.totals_by_axes().items()):
        parts.append(f"  over {'/'.join(k)}: {v[0]} calls, {byte_str(v[1], 1)} sent")
    costly = [m for m in report.moves if m.received_bytes]  # not the local slices
    if costly:
        parts.append(
            f"  layout moves outside shard_map: {len(costly)}, "
            f"{byte_str(report.moved_bytes, 1)} received per device: "
            + "; ".join(f"{m.label} {m.src} -> {m.dst}" for m in costly[:3])
            + (" ..." if len(costly) > 3 else "")
        )
    if report.saved:
        parts.append(
            f"  saved for backward: {byte_str(report.saved_bytes, 1)} per device "
            f"({byte_str(report.saved_per_call[0], 1)} per checkpointed call x "
            f"{report.checkpoint_calls}"
            + (
                f" + {byte_str(report.saved_per_call[1], 1)} once)"
                if report.saved_per_call[1]
                else ")"
            )
        )
    parts += [_sections.schedule_short(s) for s in report.schedules]
    parts += _moe.short_lines(report.moes) + [
        f"  attention.{r.fn} over {r.axis} (c={r.c}, {r.layout}) x{r.runs}: sent "
        f"{byte_str(r.forward_bytes, 1)} forward, {byte_str(r.backward_bytes, 1)} backward"
        for r in report.rings
    ]
    if report.argument_bytes:
        parts.append(
            f"  arguments: {byte_str(sum(b for _, b in report.argument_bytes), 1)} per device"
        )
    mem = report.memory
    if mem.peak is not None:
        xla = f" (XLA: {byte_str(mem.xla.total, 1)})" if mem.xla else ""
        parts.append(
            f"  memory peak (estimate): {byte_str(mem.peak, 1)} per device{xla}, gathered at "
            f"once {byte_str(mem.gathered, 1)}"
        )
    m = report.mfu_ceiling()
    if m is not None and report.hardware is not None:
        parts.append(
            f"  on {report.hardware.name}: MFU ceiling {m[0]:.0%} (overlap) / {m[1]:.0%} (none)"
        )
    parts += [f"  warning: {w}" for w in move_warnings(report)]
    return "\n".join(parts)


def comparison(cmp: HloComparison) -> str:
    """What `ExplainReport.compare_hlo` found, in a few lines."""
    notes = [
        f"  XLA combined several collectives into one instruction: {ln[:120]}"
        for ln in cmp.combined
    ]
    notes += _xla_lines(cmp)
    moved = [f"  layout move ({label}): {line.strip()[:110]}" for label, line in cmp.moves]
    also = (
        f" (and {len(cmp.moves)} from the report's layout moves outside shard_map)"
        if cmp.moves
        else ""
    )
    if cmp.merged:
        also += f" ({len(cmp.merged)} merged by XLA with another row, as their rows say it may)"
    if cmp.identical:
        return "\n".join(
            [f"all {cmp.n_report} collectives match the compiled HLO{also}", *moved, *notes]
        )
    if not cmp.only_in_report:
        head = (
            f"all {cmp.n_report} reported collectives are in the compiled HLO; it also has "
            f"{len(cmp.only_in_hlo)} that shardlib did not emit: jit's automatic "
            "partitioning of code outside shard_map (e.g. a norm over sharded arrays)" + also
        )
    else:
        head = (
            f"{cmp.n_report} collectives in the report, {cmp.n_hlo} in the compiled HLO: "
            "XLA split or removed some"
        )
    out = [head]
    for c in cmp.only_in_report:
        out.append(f"  only in report: {c.kind} {c.operand_bytes} B ({c.op}[{c.spec}])")
    for line in dict.fromkeys(line for _, _, line in cmp.only_in_hlo):
        n = sum(1 for _, _, ln in cmp.only_in_hlo if ln == line)
        out.append(f"  only in HLO{f' ({n} values)' if n > 1 else ''}: {line.strip()[:110]}")
    return "\n".join(out + moved + notes)


def _xla_lines(cmp: HloComparison) -> list[str]:
    """The rows XLA merged (as their flag said it may) and the bf16 rows the backend widened."""
    out = [
        f"  merged by XLA ({(c.xla_may or '').split(':')[0]}): {c.kind} {c.operand_bytes} B, "
        f"{_label(c)}[{c.spec}]"
        for c in cmp.merged
    ]
    out += [
        f"  never runs (a loop of 0 iterations, which XLA drops): {c.kind} {c.operand_bytes} B, "
        f"{_label(c)}[{c.spec}]"
        for c in cmp.never_run
    ]
    if cmp.widened:
        out.append(
            f"  {len(cmp.widened)} {'/'.join(sorted({c.dtype for c in cmp.widened}))} "
            "collectives run at twice the report's bytes: XLA:CPU compiles them as f32 (the "
            "backend, not the report; other backends keep the dtype)"
        )
    return out


def _flag_lines(collectives: Sequence[CollectiveCall]) -> list[str]:
    """One line per kind of flag, naming the rows: what XLA may do to them when it compiles."""
    flags: dict[str, list[int]] = defaultdict(list)
    for i, c in enumerate(collectives):
        if c.xla_may is not None:
            flags[c.xla_may].append(i)
    return [
        f"rows {', '.join(map(str, rows))}: {flag}" if len(rows) > 1 else f"row {rows[0]}: {flag}"
        for flag, rows in flags.items()
    ]


# -- formatting helpers -------------------------------------------------------------------------


def _label(c: CollectiveCall) -> str:
    if c.op is None:
        # Not written by the user: e.g. the transpose of the pvary that JAX inserts (with
        # check_vma=True) where a replicated value meets a varying one.
        return f"{c.primitive} (implicit{', grad' if c.backward else ''})"
    if c.cotangent:  # a pipeline's stage transfer of a cotangent (`shardlib._explain.sections`)
        return c.op + " (cotangent)"
    if c.recomputed:  # activation checkpointing runs the forward op again, in the backward pass
        return c.op + " (re-computation)"
    return c.op + (" (grad)" if c.backward else "")


def _secs(t: float) -> str:
    if t >= 1:
        return f"{t:.2f} s"
    if t >= 1e-3:
        return f"{t * 1e3:.2f} ms"
    if t >= 1e-6:
        return f"{t * 1e6:.2f} µs"
    return f"{t * 1e9:.2f} ns"


def _table(head, rows, right: Collection[int] = ()) -> list[str]:
    cols = list(zip(head, *rows, strict=True)) if rows else [(h,) for h in head]
    widths = [max(len(str(c)) for c in col) for col in cols]

    def line(cells):
        return "  ".join(
            str(c).rjust(w) if i in right else str(c).ljust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ).rstrip()

    return [line(head), "  ".join("-" * w for w in widths), *(line(r) for r in rows)]


_report.RENDERERS.update(render=render, short=short, comparison=comparison)
