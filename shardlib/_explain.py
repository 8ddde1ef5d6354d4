"""See the cost before you run: communication, memory and a roofline estimate from a trace.

``explain(f, *args)`` traces ``f`` once (``jax.jit(f).trace``; nothing runs or compiles) and
walks the jaxpr: every collective, with the shardops op and spec that emitted it (read from
the ``shardops.OP[SPEC]`` named scope), the mesh axes, the user's source line, per-device
bytes, and how many times it runs (``lax.scan`` bodies count once per iteration); the values
that ``explicit_activation_checkpointing`` saves for the backward pass (its arguments and, under
its default policy, every value named with ``checkpoint_name``, ``save_for_backward`` marks
included); the per-device bytes of the arguments (parameters, optimizer state); and, given a
hardware model, estimated times.

Walking a jaxpr reads ``eqn.source_info`` (name stack and traceback), which JAX does not
document as public API: that use is confined to `_source_of` and `_name_stack`.
"""

from __future__ import annotations

import functools
import math
import os
import re
from collections import defaultdict
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np
from jax.ad_checkpoint import Saveable

from jax_extra import explicit_activation_checkpointing
from jax_extra._remat import _SAVE_NAME

from ._pytree import keypath_str

__all__ = ["HARDWARE", "CollectiveCall", "ExplainReport", "Hardware", "SavedValue", "explain"]

# jaxpr primitive -> HLO collective kind.
_KINDS = {
    "all_gather": "all-gather",
    "all_gather_invariant": "all-gather",
    "reduce_scatter": "reduce-scatter",
    "psum": "all-reduce",
    "psum_invariant": "all-reduce",
    "pmax": "all-reduce",
    "pmin": "all-reduce",
    "all_to_all": "all-to-all",
    "ppermute": "collective-permute",
}
_SCOPE = re.compile(r"shardops\.(\w+)\[(.*?)\](?=/|$)")
_NAME_PRIMITIVE = "name"  # JAX's primitive behind jax.ad_checkpoint.checkpoint_name
_CHECKPOINT_PRIMITIVES = ("checkpoint", "remat", "remat2")
_JAX_DIR = os.path.dirname(jax.__file__)
_SHARDLIB_DIR = os.path.dirname(__file__)


@dataclass(frozen=True)
class Hardware:
    """A rough hardware model for the roofline estimate (numbers are estimates).

    ``link_bytes_per_s``: bytes per second a device can send (and receive) over the
    interconnect; ``flops_per_s``: peak dense matmul FLOP/s per device.
    """

    name: str
    link_bytes_per_s: float
    flops_per_s: float


HARDWARE: dict[str, Hardware] = {
    # Vendor peak numbers (dense bf16; one direction of the device's interconnect). Real
    # collectives reach a fraction of them: treat every estimate as a lower bound on time.
    "h100": Hardware("NVIDIA H100 SXM (NVLink 4)", 450e9, 989e12),
    "a100": Hardware("NVIDIA A100 SXM (NVLink 3)", 300e9, 312e12),
    "tpu-v5e": Hardware("TPU v5e (ICI)", 200e9, 197e12),
    "tpu-v4": Hardware("TPU v4 (ICI)", 270e9, 275e12),
    "cpu": Hardware("host CPU (simulated devices)", 10e9, 1e11),
}


@dataclass(frozen=True)
class CollectiveCall:
    """One collective in the program (one jaxpr equation)."""

    kind: str  # HLO kind: all-gather, reduce-scatter, all-reduce, all-to-all, ...
    primitive: str
    op: str | None  # the shardops op that emitted it (None: not from shardops)
    spec: str | None
    backward: bool  # emitted by differentiation (a transpose) rather than by the forward code
    axes: tuple[str, ...]
    group: int  # devices taking part in each group
    operand_shape: tuple[int, ...]  # per device
    result_shape: tuple[int, ...]
    dtype: str
    operand_bytes: int
    sent_bytes: int  # per device per call, ring algorithm
    received_bytes: int
    calls: int  # times it runs per call of f (scan trip counts multiplied in)
    location: str
    in_loop: str | None = None  # "scan x4" etc.

    @property
    def total_sent(self) -> int:
        return self.sent_bytes * self.calls

    @property
    def total_received(self) -> int:
        return self.received_bytes * self.calls


@dataclass(frozen=True)
class SavedValue:
    """A value saved for the backward pass by ``explicit_activation_checkpointing``.

    ``what`` is ``"argument"`` (an argument of the checkpointed call), ``"marked"`` (a value
    marked with ``save_for_backward``) or ``"named"`` (a value named with
    ``jax.ad_checkpoint.checkpoint_name``, which the default policy saves too); ``name`` is
    the checkpoint name of a marked or named value.
    """

    what: str  # "argument", "marked" (save_for_backward) or "named" (checkpoint_name)
    shape: tuple[int, ...]  # per device
    dtype: str
    bytes: int
    calls: int  # how many times it is saved per call of f (layers of a scan)
    location: str
    name: str | None = None  # the checkpoint name (marked and named values)

    @property
    def label(self) -> str:
        """``argument``, ``marked`` or ``named 'NAME'``, as the report prints it."""
        return f"named {self.name!r}" if self.what == "named" else self.what


@dataclass
class ExplainReport:
    """What `explain` found; ``str()`` renders it, ``.short()`` a summary."""

    name: str
    collectives: list[CollectiveCall] = field(default_factory=list)
    saved: list[SavedValue] = field(default_factory=list)
    checkpoint_calls: int = 0  # calls of explicitly checkpointed functions (e.g. layers)
    argument_bytes: list[tuple[str, int]] = field(default_factory=list)  # per device
    flops: float = 0.0  # per device, dot_general only
    hardware: Hardware | None = None
    notes: list[str] = field(default_factory=list)

    # -- totals ---------------------------------------------------------------------------
    def totals_by_axes(self) -> dict[tuple[str, ...], tuple[int, int, int]]:
        """``{axes: (calls, bytes sent, bytes received)}`` per device, per call of f."""
        out: dict[tuple[str, ...], list[int]] = defaultdict(lambda: [0, 0, 0])
        for c in self.collectives:
            t = out[tuple(sorted(c.axes))]  # 'd/t' and 't/d' groups are the same devices
            t[0] += c.calls
            t[1] += c.total_sent
            t[2] += c.total_received
        return {k: (v[0], v[1], v[2]) for k, v in out.items()}

    @property
    def bytes_sent(self) -> int:
        return sum(c.total_sent for c in self.collectives)

    @property
    def bytes_received(self) -> int:
        return sum(c.total_received for c in self.collectives)

    @property
    def saved_bytes(self) -> int:
        return sum(s.bytes * s.calls for s in self.saved)

    def census(self) -> dict[str, int]:
        """``{kind: number of collective instructions}`` (static: a loop body counts once)."""
        out: dict[str, int] = defaultdict(int)
        for c in self.collectives:
            out[c.kind] += 1
        return dict(out)

    # -- estimates ------------------------------------------------------------------------
    def comm_seconds(self) -> float | None:
        if self.hardware is None:
            return None
        return sum(
            max(c.total_sent, c.total_received) / self.hardware.link_bytes_per_s
            for c in self.collectives
        )

    def compute_seconds(self) -> float | None:
        return None if self.hardware is None else self.flops / self.hardware.flops_per_s

    def mfu_ceiling(self) -> tuple[float, float] | None:
        """(with perfect overlap, with no overlap) upper bounds on MFU from communication."""
        comm, comp = self.comm_seconds(), self.compute_seconds()
        if comm is None or comp is None or comp == 0:
            return None
        overlap = comp / max(comp, comm)
        serial = comp / (comp + comm)
        return overlap, serial

    # -- comparing with XLA -----------------------------------------------------------------
    def compare_hlo(self, hlo_text: str) -> HloComparison:
        """Match this report's collectives with the compiled HLO's, by kind and operand bytes.

        Each collective in the report should appear once in the HLO (a loop body once);
        where XLA combined, split or removed collectives the comparison says so.
        """
        hlo = hlo_collectives(hlo_text)
        ours = [(c.kind, c.operand_bytes, c) for c in self.collectives]
        unmatched_hlo = list(hlo)
        unmatched_ours: list[CollectiveCall] = []
        for kind, nbytes, c in ours:
            for i, (hk, hb, _) in enumerate(unmatched_hlo):
                if hk == kind and hb == nbytes:
                    del unmatched_hlo[i]
                    break
            else:
                unmatched_ours.append(c)
        lines = [line for _, _, line in hlo]
        combined = sorted({ln.strip() for ln in lines if lines.count(ln) > 1})
        return HloComparison(unmatched_ours, unmatched_hlo, len(ours), len(hlo), combined)

    # -- rendering --------------------------------------------------------------------------
    def __str__(self) -> str:
        return self.render()

    def render(self, *, max_rows: int | None = None) -> str:
        lines = [f"shardlib.explain: {self.name}", ""]
        lines.append("Communication (per device, per call; ring algorithm; loops multiplied in)")
        rows = []
        for i, c in enumerate(self.collectives):
            rows.append(
                (
                    str(i),
                    _label(c),
                    c.spec if c.spec is not None else "-",
                    c.kind,
                    "/".join(c.axes) + f" ({c.group})",
                    _shape(c.operand_shape) + " " + c.dtype,
                    _bytes(c.sent_bytes),
                    _bytes(c.received_bytes),
                    f"x{c.calls}",
                    _bytes(c.total_sent),
                    c.location,
                )
            )
        head = (
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
        if max_rows is not None and len(rows) > max_rows:
            hidden = len(rows) - max_rows
            rows = rows[:max_rows]
        else:
            hidden = 0
        lines += _table(head, rows, right={6, 7, 8, 9})
        if hidden:
            lines.append(f"... {hidden} more")
        lines.append("")
        lines.append("Totals per mesh axis group")
        trows = [
            ("/".join(k) or "-", str(v[0]), _bytes(v[1]), _bytes(v[2]))
            for k, v in sorted(self.totals_by_axes().items())
        ]
        trows.append(
            (
                "all",
                str(sum(c.calls for c in self.collectives)),
                _bytes(self.bytes_sent),
                _bytes(self.bytes_received),
            )
        )
        lines += _table(("axes", "calls", "sent", "received"), trows, right={1, 2, 3})
        if self.saved:
            lines.append("")
            lines.append(
                "Saved for the backward pass (explicit_activation_checkpointing; per device)"
            )
            srows = [
                (
                    s.label,
                    _shape(s.shape) + " " + s.dtype,
                    _bytes(s.bytes),
                    f"x{s.calls}",
                    _bytes(s.bytes * s.calls),
                    s.location,
                )
                for s in self.saved
            ]
            lines += _table(
                ("saved", "value", "bytes", "calls", "total", "source"), srows, right={2, 3, 4}
            )
            per_call = sum(s.bytes for s in self.saved)
            lines.append(
                f"per checkpointed call: {_bytes(per_call)}; in all "
                f"({self.checkpoint_calls} calls): {_bytes(self.saved_bytes)}"
            )
        if self.argument_bytes:
            lines.append("")
            total = sum(b for _, b in self.argument_bytes)
            lines.append(f"Arguments (parameters, optimizer state...): {_bytes(total)} per device")
            for name, b in self.argument_bytes:
                lines.append(f"  {name}: {_bytes(b)}")
        if self.hardware is not None:
            lines.append("")
            lines += self._roofline_lines()
        for n in self.notes:
            lines.append(f"note: {n}")
        return "\n".join(lines)

    def _roofline_lines(self) -> list[str]:
        hw = self.hardware
        assert hw is not None
        comm, comp = self.comm_seconds() or 0.0, self.compute_seconds() or 0.0
        out = [
            f"Roofline estimate on {hw.name} ({hw.link_bytes_per_s / 1e9:.0f} GB/s per link, "
            f"{hw.flops_per_s / 1e12:.0f} TFLOP/s; estimates, not measurements)",
            f"  matmul FLOPs per device: {self.flops:.3g} -> {_secs(comp)}",
            f"  communication: {_bytes(max(self.bytes_sent, self.bytes_received))} -> "
            f"{_secs(comm)}",
        ]
        by_op: dict[str, float] = defaultdict(float)
        for c in self.collectives:
            key = f"{_label(c)}[{c.spec}]" if c.spec is not None else _label(c)
            by_op[key] += max(c.total_sent, c.total_received) / hw.link_bytes_per_s
        for k, t in sorted(by_op.items(), key=lambda kv: -kv[1])[:8]:
            out.append(f"    {_secs(t):>10}  {k}")
        m = self.mfu_ceiling()
        if m is not None:
            out.append(
                f"  MFU ceiling from communication: {m[0]:.0%} with perfect overlap, "
                f"{m[1]:.0%} with none"
            )
        return out

    def short(self) -> str:
        """A few lines: collectives by kind and axis, bytes, saved residuals."""
        census = ", ".join(f"{k} x{v}" for k, v in sorted(self.census().items()))
        parts = [
            f"{self.name}: {sum(c.calls for c in self.collectives)} collective calls per call "
            f"({len(self.collectives)} in the program: {census}); per device: sent "
            f"{_bytes(self.bytes_sent)}, received "
            f"{_bytes(self.bytes_received)}"
        ]
        for k, v in sorted(self.totals_by_axes().items()):
            parts.append(f"  over {'/'.join(k)}: {v[0]} calls, {_bytes(v[1])} sent")
        if self.saved:
            parts.append(
                f"  saved for backward: {_bytes(self.saved_bytes)} per device "
                f"({_bytes(sum(s.bytes for s in self.saved))} per checkpointed call x "
                f"{self.checkpoint_calls})"
            )
        if self.argument_bytes:
            parts.append(
                f"  arguments: {_bytes(sum(b for _, b in self.argument_bytes))} per device"
            )
        m = self.mfu_ceiling()
        if m is not None and self.hardware is not None:
            parts.append(
                f"  on {self.hardware.name}: MFU ceiling {m[0]:.0%} (overlap) / {m[1]:.0%} (none)"
            )
        return "\n".join(parts)


@dataclass(frozen=True)
class HloComparison:
    """The result of `ExplainReport.compare_hlo`."""

    only_in_report: list[CollectiveCall]
    only_in_hlo: list[tuple[str, int, str]]  # (kind, operand bytes, instruction line)
    n_report: int
    n_hlo: int
    combined: list[str] = field(default_factory=list)  # HLO instructions XLA combined

    @property
    def identical(self) -> bool:
        """Every reported collective is in the HLO (combined or not) and nothing else is."""
        return not self.only_in_report and not self.only_in_hlo

    def __str__(self) -> str:
        notes = [
            f"  XLA combined several collectives into one instruction: {ln[:120]}"
            for ln in self.combined
        ]
        if self.identical:
            return "\n".join([f"all {self.n_report} collectives match the compiled HLO", *notes])
        if not self.only_in_report:
            head = (
                f"all {self.n_report} reported collectives are in the compiled HLO; it also has "
                f"{len(self.only_in_hlo)} that shardlib did not emit: jit's automatic "
                "partitioning of code outside shard_map (e.g. a norm over sharded arrays)"
            )
        else:
            head = (
                f"{self.n_report} collectives in the report, {self.n_hlo} in the compiled HLO: "
                "XLA split or removed some"
            )
        out = [head]
        for c in self.only_in_report:
            out.append(f"  only in report: {c.kind} {c.operand_bytes} B ({c.op}[{c.spec}])")
        for line in dict.fromkeys(line for _, _, line in self.only_in_hlo):
            n = sum(1 for _, _, ln in self.only_in_hlo if ln == line)
            out.append(f"  only in HLO{f' ({n} values)' if n > 1 else ''}: {line.strip()[:110]}")
        return "\n".join(out + notes)


# ---------------------------------------------------------------------------------------------
# Tracing and walking
# ---------------------------------------------------------------------------------------------


def explain(
    f: Any,
    *args: Any,
    hardware: str | Hardware | None = None,
    **kwargs: Any,
) -> ExplainReport:
    """Trace ``f(*args, **kwargs)`` once (nothing runs) and report its communication.

    **Arguments:**


    - `f`: a function using shardlib (a ``typed_shard_map``, or a training step calling one,
      eager or ``jax.jit``-ed).
    - `*args`, `**kwargs`: its arguments: arrays or ``jax.ShapeDtypeStruct`` with shardings.
    - `hardware`: a name from ``HARDWARE`` (``'h100'``, ``'a100'``, ``'tpu-v5e'``,
      ``'tpu-v4'``, ``'cpu'``) or a ``Hardware`` for the roofline estimate (optional).

    **Returns:** an ``ExplainReport``; ``print()`` it for the tables, ``.short()`` for a
    summary, ``.compare_hlo(compiled.as_text())`` to check it against XLA.

    Examples:
        ```python
        report = shardlib.explain(train_step, model, tokens, hardware="h100")
        print(report)
        ```
    """
    if isinstance(hardware, str) and hardware not in HARDWARE:
        raise ValueError(
            f"explain: unknown hardware {hardware!r}; known: {', '.join(HARDWARE)}, or pass "
            "shardlib.Hardware(name, link_bytes_per_s, flops_per_s)"
        )
    hw = HARDWARE[hardware] if isinstance(hardware, str) else hardware
    traced = jax.jit(f).trace(*args, **kwargs)
    closed = traced.jaxpr
    report = ExplainReport(name=getattr(f, "__qualname__", None) or repr(f), hardware=hw)
    saving = _backward_policies(closed.jaxpr)
    _walk(closed.jaxpr, report, mult=1, prefix="", sizes={}, loop=None, saving=saving)
    report.argument_bytes = _argument_bytes(args, kwargs)
    if report.saved and all(s.what != "argument" for s in report.saved):
        report.notes.append(
            "f is differentiated, so only the named values (save_for_backward marks and "
            "checkpoint_name values) are listed; the arguments of each checkpointed call are "
            "saved too (explain the forward function to list them)"
        )
    return report


def _sub_jaxprs(eqn) -> Iterator[Any]:
    for v in eqn.params.values():
        for j in v if isinstance(v, tuple | list) else (v,):
            if hasattr(j, "eqns"):
                yield j
            elif hasattr(j, "jaxpr") and hasattr(j.jaxpr, "eqns"):
                yield j.jaxpr


def _walk(
    jaxpr,
    report: ExplainReport,
    *,
    mult: int,
    prefix: str,
    sizes: dict,
    loop,
    where: str = "?",
    in_checkpoint: bool = False,
    saving: tuple[Any, ...] = (),
) -> None:
    """Record the collectives, FLOPs and saved values of ``jaxpr`` (and its sub-jaxprs).

    ``saving``: the policies of the checkpointed calls whose backward pass is in the program
    (see `_backward_policies`); a named value outside any checkpoint call is listed as saved
    when one of them saves it.
    """
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        stack = _join(prefix, _name_stack(eqn))
        loc = _source_of(eqn)
        if loc == "?":
            loc = where  # e.g. inside a custom_jvp rule: use the enclosing call's line
        if name in _KINDS:
            report.collectives.append(_collective(eqn, name, stack, sizes, mult, loop, loc))
            continue
        if name == "dot_general":
            report.flops += _dot_flops(eqn) * mult
        if (
            name == _NAME_PRIMITIVE
            and not in_checkpoint
            and any(_policy_saves(p, eqn) for p in saving)
        ):
            # Differentiated code has no checkpoint eqn left in the forward pass, only the
            # named values (the backward pass recomputes from them and the arguments).
            report.saved.append(_saved_name(eqn, mult, loc))
            report.checkpoint_calls = max(report.checkpoint_calls, mult)
        sub_mult, sub_sizes, sub_loop, sub_ckpt = mult, sizes, loop, in_checkpoint
        if name == "shard_map":
            mesh = eqn.params.get("mesh")
            if mesh is not None:
                sub_sizes = dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))
        elif name == "scan":
            length = int(eqn.params.get("length", 1))
            sub_mult = mult * length
            sub_loop = f"scan x{length}" if loop is None else f"{loop}, scan x{length}"
        elif name == "while":
            report.notes.append(
                "a while_loop's trip count is unknown when tracing: its collectives are "
                "counted once"
            )
        elif name in _CHECKPOINT_PRIMITIVES:
            if eqn.params.get("differentiated"):
                # The backward pass's recomputation: what it recomputes is not saved.
                sub_ckpt = True
            else:
                sub_ckpt = _saved_by_checkpoint(eqn, report, mult) or in_checkpoint
        for sub in _sub_jaxprs(eqn):
            _walk(
                sub,
                report,
                mult=sub_mult,
                prefix=stack,
                sizes=sub_sizes,
                loop=sub_loop,
                where=loc,
                in_checkpoint=sub_ckpt,
                saving=saving,
            )


def _join(prefix: str, stack: str) -> str:
    if not prefix:
        return stack
    return f"{prefix}/{stack}" if stack else prefix


def _name_stack(eqn) -> str:
    """The eqn's name stack as text (``eqn.source_info`` is not documented public API)."""
    try:
        return str(eqn.source_info.name_stack)
    except Exception:  # pragma: no cover - internals changed
        return ""


def _source_of(eqn) -> str:
    """``file.py:LINE`` of the user code behind ``eqn`` (not documented public API)."""
    try:
        frames = eqn.source_info.traceback.frames
    except Exception:  # pragma: no cover - internals changed
        return "?"
    for fr in frames:
        fn = fr.file_name
        if fn.startswith((_JAX_DIR, _SHARDLIB_DIR)) or "/jax_extra/" in fn or "/jaxlib/" in fn:
            continue
        return f"{os.path.basename(fn)}:{fr.line_num}"
    return "?"


def _axes_of(eqn) -> tuple[str, ...]:
    p = eqn.params
    axes = p.get("axis_name", p.get("axes", ()))
    if isinstance(axes, str):
        return (axes,)
    return tuple(a for a in axes if isinstance(a, str))


def _collective(
    eqn, prim: str, stack: str, sizes: dict, mult: int, loop, loc: str
) -> CollectiveCall:
    axes = _axes_of(eqn)
    group = (
        math.prod(sizes.get(a, 1) for a in axes) if sizes else int(eqn.params.get("axis_size", 1))
    )
    aval_in = eqn.invars[0].aval
    aval_out = eqn.outvars[0].aval
    itemsize = np.dtype(aval_in.dtype).itemsize
    n_in = math.prod(aval_in.shape) * itemsize
    kind = _KINDS[prim]
    frac = (group - 1) / group if group > 1 else 0.0
    if kind == "all-gather":
        sent = recv = int(n_in * (group - 1))
    elif kind == "reduce-scatter":
        sent = recv = int(n_in * frac)
    elif kind == "all-reduce":
        sent = recv = int(2 * n_in * frac)
    elif kind == "all-to-all":
        sent = recv = int(n_in * frac)
    else:  # collective-permute
        sent = recv = n_in
    matches = _SCOPE.findall(stack)
    op, spec = matches[-1] if matches else (None, None)
    return CollectiveCall(
        kind=kind,
        primitive=prim,
        op=op,
        spec=spec,
        backward="transpose" in stack,
        axes=axes,
        group=group,
        operand_shape=tuple(aval_in.shape),
        result_shape=tuple(aval_out.shape),
        dtype=np.dtype(aval_in.dtype).name,
        operand_bytes=n_in,
        sent_bytes=sent,
        received_bytes=recv,
        calls=mult,
        location=loc,
        in_loop=loop,
    )


def _dot_flops(eqn) -> float:
    (lc, rc), (lb, _rb) = eqn.params["dimension_numbers"]
    lhs, rhs = eqn.invars[0].aval.shape, eqn.invars[1].aval.shape
    contract = math.prod(lhs[i] for i in lc)
    out = math.prod(eqn.outvars[0].aval.shape)
    del rhs, lb
    return 2.0 * out * contract


@functools.cache
def _explicit_policies() -> tuple[Any, ...]:
    """The checkpoint policies of ``explicit_activation_checkpointing`` (each option), read
    from a trace of it so that they follow whatever it uses."""
    out = []
    for only in (False, True):
        f = explicit_activation_checkpointing(only_save_for_backward=only)(lambda x: x)
        for eqn in jax.make_jaxpr(f)(np.float32(0)).jaxpr.eqns:
            if eqn.primitive.name in _CHECKPOINT_PRIMITIVES:
                out.append(eqn.params.get("policy"))
    return tuple(p for p in out if p is not None)


def _policy_saves(policy: Any, eqn) -> bool:
    """Whether checkpoint ``policy`` keeps the value of the ``checkpoint_name`` equation ``eqn``
    in device memory (asked as ``jax.checkpoint`` asks it; an offloaded value is not kept)."""
    if policy is None or eqn.primitive.name != _NAME_PRIMITIVE:
        return False
    try:
        out = policy(eqn.primitive, *(v.aval for v in eqn.invars), **eqn.params)
    except Exception:  # pragma: no cover - a policy that does not take names
        return False
    return out is Saveable or (isinstance(out, bool | np.bool_) and bool(out))


def _backward_policies(jaxpr) -> tuple[Any, ...]:
    """The policies of the checkpointed calls whose backward pass (a ``differentiated``
    checkpoint equation) is in ``jaxpr``: f is differentiated, and these say which of the named
    values of its forward pass were saved."""
    out: list[Any] = []
    for e in _iter_eqns(jaxpr):
        if e.primitive.name in _CHECKPOINT_PRIMITIVES and e.params.get("differentiated"):
            p = e.params.get("policy")
            if p is not None and p not in out:
                out.append(p)
    return tuple(out)


def _saved_by_checkpoint(eqn, report: ExplainReport, mult: int) -> bool:
    """Arguments and saved named values of one explicitly checkpointed call.

    A call is explicitly checkpointed when its policy is one of
    ``explicit_activation_checkpointing``'s or saves a named value of its body. The named
    values listed are those the policy saves: under the default policy every value named with
    ``checkpoint_name`` (``save_for_backward`` marks included), under
    ``only_save_for_backward=True`` the marks only. Returns whether ``eqn`` was such a call.
    """
    policy = eqn.params.get("policy")
    if policy is None:
        return False
    names: list[Any] = []
    seen: set[int] = set()
    for sub in _sub_jaxprs(eqn):
        for inner in _iter_eqns(sub):
            if id(inner) not in seen:
                seen.add(id(inner))
                if _policy_saves(policy, inner):
                    names.append(inner)
    if not names and policy not in _explicit_policies():
        return False
    report.checkpoint_calls += mult
    loc = _source_of(eqn)
    for v in eqn.invars:
        aval = v.aval
        if not hasattr(aval, "shape"):
            continue
        report.saved.append(_saved("argument", aval, mult, loc))
    for inner in names:
        report.saved.append(_saved_name(inner, mult, _source_of(inner)))
    return True


def _iter_eqns(jaxpr) -> Iterator[Any]:
    for e in jaxpr.eqns:
        yield e
        for sub in _sub_jaxprs(e):
            yield from _iter_eqns(sub)


def _saved(what: str, aval, mult: int, loc: str, name: str | None = None) -> SavedValue:
    itemsize = np.dtype(aval.dtype).itemsize
    return SavedValue(
        what=what,
        shape=tuple(aval.shape),
        dtype=np.dtype(aval.dtype).name,
        bytes=math.prod(aval.shape) * itemsize,
        calls=mult,
        location=loc,
        name=name,
    )


def _saved_name(eqn, mult: int, loc: str) -> SavedValue:
    """The value of a ``checkpoint_name`` equation: ``marked`` if ``save_for_backward`` made it."""
    name = eqn.params.get("name")
    what = "marked" if name == _SAVE_NAME else "named"
    return _saved(what, eqn.outvars[0].aval, mult, loc, name=name)


def _argument_bytes(args: tuple, kwargs: dict) -> list[tuple[str, int]]:
    out = []
    tree = {"args": args, "kwargs": kwargs} if kwargs else args
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        shape = getattr(leaf, "shape", None)
        dtype = getattr(leaf, "dtype", None)
        if shape is None or dtype is None:
            continue
        sh = getattr(leaf, "sharding", None)
        local = tuple(sh.shard_shape(tuple(shape))) if sh is not None else tuple(shape)
        # keypath_str: '[0].layers.w' (keystr would run seqax-style keys together).
        out.append((keypath_str(path), math.prod(local) * np.dtype(dtype).itemsize))
    return out


# ---------------------------------------------------------------------------------------------
# Compiled HLO
# ---------------------------------------------------------------------------------------------

_HLO_LINE = re.compile(
    r"=\s*(?P<shape>\(.*?\)|\S+)\s+(?P<kind>all-gather|reduce-scatter|all-reduce|all-to-all|"
    r"collective-permute)(?P<start>-start)?\("
)
_HLO_SHAPE = re.compile(r"(\w+)\[([\d,]*)\]")
_HLO_GROUPS = re.compile(r"replica_groups=(?:\{\{(?P<first>[\d,]*)\}|\[\d+,(?P<size>\d+)\])")
_HLO_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
    "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
}  # fmt: skip


def hlo_collectives(text: str) -> list[tuple[str, int, str]]:
    """``(kind, operand bytes per device, line)`` for each collective in compiled HLO text.

    Operand bytes come from the result shape and the replica group size (compiled HLO does
    not print operand shapes): an all-gather's operand is its result / group, a
    reduce-scatter's is its result x group. ``-start``/``-done`` pairs count once; a combined
    collective (a tuple result) gives one entry per element.
    """
    out = []
    for line in text.splitlines():
        m = _HLO_LINE.search(line)
        if not m:
            continue
        g = _HLO_GROUPS.search(line)
        if g is None:
            group = 1
        elif g.group("first") is not None:
            group = len([x for x in g.group("first").split(",") if x])
        else:
            group = int(g.group("size"))
        kind = m.group("kind")
        shapes = _HLO_SHAPE.findall(m.group("shape"))
        if m.group("start") and kind != "all-reduce" and len(shapes) > 1:
            shapes = shapes[-1:]  # async start: (operand, result) tuple -> the result
        for dtype, dims in shapes:
            n = math.prod(int(d) for d in dims.split(",") if d) * _HLO_BYTES.get(dtype, 4)
            if kind == "all-gather":
                n //= max(group, 1)
            elif kind == "reduce-scatter":
                n *= group
            out.append((kind, n, line))
    return out


# ---------------------------------------------------------------------------------------------
# Formatting helpers
# ---------------------------------------------------------------------------------------------


def _label(c: CollectiveCall) -> str:
    if c.op is None:
        # Not written by the user: e.g. the transpose of the pvary that JAX inserts (with
        # check_vma=True) where a replicated value meets a varying one.
        return f"{c.primitive} (implicit{', grad' if c.backward else ''})"
    return c.op + (" (grad)" if c.backward else "")


def _shape(s: tuple[int, ...]) -> str:
    return "[" + ",".join(str(n) for n in s) + "]"


def _bytes(n: float) -> str:
    for unit, k in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= k:
            return f"{n / k:.1f} {unit}"
    return f"{int(n)} B"


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
