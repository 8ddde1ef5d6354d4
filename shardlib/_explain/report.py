"""What `shardlib.explain` reports: collectives, moves, saved values, memory, totals.

The records (`CollectiveCall`, `SavedValue`, `MemoryEstimate`; `LayoutMove` comes from
`shardlib._explain.moves`), the report holding them with its totals and roofline estimates
(`ExplainReport`; the hardware models behind its estimates, `Hardware` and `HARDWARE`, live in
`shardlib._explain.hardware`), and the comparison of a report with XLA's program
(`HloComparison`). Rendering as text lives in `shardlib._explain.render`; filling a report from a trace in `shardlib._explain.walk`, its
memory estimate in `shardlib._explain.memory`.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .._pipeline.scopes import ScheduleInfo
from . import hlo as _hlo
from . import moves as _moves
from .hardware import HARDWARE, Hardware
from .moe_calls import MoeCall, load_lines
from .moves import LayoutMove
from .sections import RingCall

# The text forms, set by `shardlib._explain.render` (which builds on this module, so this
# one does not import it): "render", "short", "comparison". Importing shardlib imports it.
RENDERERS: dict[str, Callable[..., str]] = {}

__all__ = [
    "DUPLICATE",
    "HARDWARE",
    "LOOP_INVARIANT",
    "RECOMPUTED",
    "CollectiveCall",
    "ExplainReport",
    "Hardware",
    "HloComparison",
    "LayoutMove",
    "MemoryEstimate",
    "PEAK_RATIO_BAND",
    "PEAK_RATIO_MEASURED",
    "RingCall",
    "SavedValue",
    "XlaMemory",
]


# The XLA transformations a report row may undergo (`CollectiveCall.xla_may`): the report
# describes the program JAX emits; the compiled one may run these rows fewer times.
LOOP_INVARIANT = (
    "loop-invariant: XLA may run it once (its operand is the same at every iteration: XLA may "
    "hoist it out of the loop, and merge it with the same collective there)"
)
DUPLICATE = (
    "duplicate: the same collective of the same value as an earlier row; XLA may run the two "
    "as one (common subexpression elimination)"
)
RECOMPUTED = (
    "re-computation: XLA may merge it with the forward op's run (the same collective of the "
    "same operand, e.g. a weight gathered again)"
)


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
    # The busiest device's bytes per call, ring algorithm (`shardlib._explain.hlo.ring_bytes`),
    # rounded up to a whole byte.
    sent_bytes: int
    received_bytes: int
    calls: int  # times it runs per call of f (scan trip counts multiplied in)
    location: str
    in_loop: str | None = None  # "scan x4" etc.
    # Run again in the backward pass by activation checkpointing (a forward op re-computed,
    # not a transpose; `backward` is False).
    recomputed: bool = False
    # What XLA may do to it when it compiles (`LOOP_INVARIANT`, `RECOMPUTED`; None: nothing
    # known), and the fewest times the compiled program may then run it per call of f.
    xla_may: str | None = None
    min_calls: int | None = None
    # A pipeline's stage transfer of a cotangent (`shardlib._explain.sections.tag`).
    cotangent: bool = False

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
    once: bool = False  # the same at every iteration of the enclosing loop: kept once

    @property
    def total(self) -> int:
        """Bytes kept for all calls: ``bytes * calls``."""
        return self.bytes * self.calls

    @property
    def label(self) -> str:
        """``argument``, ``marked`` or ``named 'NAME'``, as the report prints it."""
        return f"named {self.name!r}" if self.what == "named" else self.what


@dataclass(frozen=True)
class XlaMemory:
    """XLA's ``compiled.memory_analysis()`` per device: arguments, results, the bytes results
    share with (donated) arguments, and temporaries; ``total`` is their peak sum."""

    arguments: int
    outputs: int
    aliased: int
    temporaries: int

    @property
    def total(self) -> int:
        return self.arguments + self.outputs - self.aliased + self.temporaries


# `MemoryEstimate.peak` over XLA's total (arguments + results - aliased + temporaries) as
# measured on XLA:CPU on every program the tests compare with `memory_analysis()`: the FSDP
# MLP and the transformer of tests/test_explain_memory.py, every candidate `Plan.verify`
# compiles in tests/test_plan.py and tests/test_plan_examples.py (JAX 0.10.2 and 0.12). The
# report and the guides quote it. The tests (and benchmarks/plan_bench.py) hold the ratio
# within `PEAK_RATIO_BAND`: the measured range with room for other XLA versions.
PEAK_RATIO_MEASURED = (0.47, 1.76)
PEAK_RATIO_BAND = (0.4, 2.0)


@dataclass(frozen=True)
class MemoryEstimate:
    """Per-device memory implied by the types (`shardlib._explain.memory`): an estimate.

    ``arguments`` and ``outputs`` are the blocks the layouts give f's arguments and results;
    ``peak`` is the most bytes live at once if every value of the trace were kept from the
    equation that makes it to its last use, in trace order (XLA fuses, reorders and adds
    scratch buffers); ``gathered`` the most ``all_gather`` results live at once (in a scan,
    one iteration's: its body runs one iteration, one layer of a layer stack, at a time;
    ``gathered_in_scan`` says whether that most includes a scan body's). None where the types
    do not say (``caveats`` says why). ``xla``: XLA's own numbers, when a compiled program was
    given.
    """

    arguments: int
    outputs: int | None
    peak: int | None
    gathered: int
    gathered_location: str | None = None
    caveats: tuple[str, ...] = ()
    xla: XlaMemory | None = None
    gathered_in_scan: bool = False


@dataclass
class ExplainReport:
    """What `explain` found; ``str()`` renders it, ``.short()`` a summary (its fields are
    listed in the guide, docs/guide/explain.md, "The report's fields")."""

    name: str
    collectives: list[CollectiveCall] = field(default_factory=list)
    saved: list[SavedValue] = field(default_factory=list)
    checkpoint_calls: int = 0  # calls of explicitly checkpointed functions (e.g. layers)
    argument_bytes: list[tuple[str, int]] = field(default_factory=list)  # per device
    flops: float = 0.0  # per device, dot_general only
    hardware: Hardware | None = None
    notes: list[str] = field(default_factory=list)
    schedules: list[ScheduleInfo] = field(default_factory=list)  # shardlib.pipeline schedules
    moves: list[LayoutMove] = field(default_factory=list)  # layout moves outside shard_map
    rings: list[RingCall] = field(default_factory=list)  # shardlib.attention calls
    moes: list[MoeCall] = field(default_factory=list)  # shardlib.moe.layer calls
    # Per-device memory implied by the types; `explain` always estimates it (keyword-only, as
    # it follows fields with defaults).
    memory: MemoryEstimate = field(kw_only=True)

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
    def moved_bytes(self) -> int:
        """Bytes one device receives in layout moves per call of f (`LayoutMove`)."""
        return sum(m.total_received for m in self.moves)

    @property
    def saved_bytes(self) -> int:
        return sum(s.total for s in self.saved)

    @property
    def saved_per_call(self) -> tuple[int, int]:
        """(bytes kept per checkpointed call, bytes kept once for all of them)."""
        each = sum(s.bytes for s in self.saved if not s.once)
        return each, sum(s.bytes for s in self.saved if s.once)

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
        ) + (self.moved_bytes / self.hardware.link_bytes_per_s)

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
    def compare_hlo(self, hlo_text: str | None) -> HloComparison:
        """Match this report's collectives with the HLO's, by kind, group size and operand
        bytes.

        ``hlo_text`` is compiled HLO (``compiled.as_text()``) or HLO before optimisation
        (``lowered.as_text(dialect="hlo")``, which keeps the program's dtypes where a backend
        widens them). Each collective in the report should appear once in the HLO (a loop body
        once); where XLA combined, split or removed collectives the comparison says so. A tuple
        all-to-all (one operand per device of its group, as XLA's CPU backend writes them) is
        one all-to-all, not a combination. A flagged row (``xla_may``) that XLA ran together
        with a row of the same op, spec and size is ``merged``; a bf16/f16 row XLA:CPU ran as
        f32 is paired at twice its bytes (``widened``). The HLO's collectives left over of the
        kinds XLA moves layouts with are paired with the report's layout moves (``moves``), so that
        only what neither explains is listed as XLA's own (``only_in_hlo``).

        ``hlo_text`` may be typed ``str | None``, as JAX types ``compiled.as_text()``; a
        ``None`` (a program that cannot print itself) raises ``ValueError``.
        """
        if hlo_text is None:
            raise ValueError(
                "ExplainReport.compare_hlo: hlo_text is None, expected the program's HLO text; "
                "compiled.as_text() gives None where the backend cannot print the compiled "
                "program: pass jax.jit(f).lower(*args).as_text(dialect='hlo') instead"
            )
        if not isinstance(hlo_text, str):
            raise TypeError(
                f"ExplainReport.compare_hlo: hlo_text must be HLO text (str), got "
                f"{type(hlo_text).__name__}; pass compiled.as_text() "
                "(compiled = jax.jit(f).lower(*args).compile())"
            )
        return _compare(self.collectives, hlo_text, self.moves)

    # -- rendering (shardlib._explain.render) ------------------------------------------------
    def __str__(self) -> str:
        return self.render()

    def render(self, *, max_rows: int | None = None) -> str:
        """The full report as text: collectives, totals, saved values, arguments, roofline;
        ``max_rows`` limits the collectives table."""
        return RENDERERS["render"](self, max_rows=max_rows)

    def short(self) -> str:
        """A few lines: collectives by kind and axis, bytes, saved residuals."""
        return RENDERERS["short"](self)

    def expert_load(self, load: Any) -> str:
        """The histogram of an expert load the program computed (``moe.Stats.load``, pairs
        routed to each expert; leading dims, devices or layers, summed), with the load per
        device of each MoE layer's expert axis. The load is run-time data, so ``explain``
        cannot see it: pass it here."""
        return "\n".join(load_lines(self.moes, load))


@dataclass(frozen=True)
class HloComparison:
    """The result of `ExplainReport.compare_hlo`."""

    only_in_report: list[CollectiveCall]
    only_in_hlo: list[tuple[str, int, str]]  # (kind, operand bytes, instruction line)
    n_report: int
    n_hlo: int  # collectives in the HLO: one per part of an instruction (`_hlo.Collective.parts`)
    combined: list[str] = field(default_factory=list)  # HLO instructions XLA combined
    moves: list[tuple[str, str]] = field(default_factory=list)  # (layout move, HLO line)
    # Rows flagged `xla_may` that XLA did merge with a matched row of the same op and spec.
    merged: list[CollectiveCall] = field(default_factory=list)
    # bf16 (or f16) rows the HLO runs at twice their bytes: XLA:CPU compiles them as f32.
    widened: list[CollectiveCall] = field(default_factory=list)
    # Rows that run 0 times (in a loop of zero iterations) that the HLO does not have: XLA
    # drops such loops.
    never_run: list[CollectiveCall] = field(default_factory=list)

    @property
    def identical(self) -> bool:
        """Nothing is unexplained: every reported collective is in the HLO (combined, widened
        by the backend, merged by XLA as its row's ``xla_may`` says, or never run: in a loop of
        zero iterations, ``never_run``) and nothing else is but the collectives of the
        report's layout moves (``moves``)."""
        return not self.only_in_report and not self.only_in_hlo

    def __str__(self) -> str:
        return RENDERERS["comparison"](self)


_WIDENED = ("bfloat16", "float16")  # dtypes XLA:CPU runs collectives of in f32


def _compare(ours: list[CollectiveCall], hlo_text: str, moves: list[LayoutMove]) -> HloComparison:
    """Pair each reported collective with an unpaired collective of the HLO of the same kind,
    group size and operand bytes.

    The HLO's collectives are the parts of its instructions (`shardlib._explain.hlo.Collective.parts`):
    each operand of a combined instruction, and each tuple all-to-all whole (its operands are
    the blocks one all-to-all sends to the devices of its group). An instruction with several
    parts is one XLA combined. A bf16/f16 row left over is paired at twice its bytes (XLA:CPU
    compiles such collectives as f32: ``widened``); a row flagged ``xla_may`` left over is
    ``merged`` when a row of the same op, spec and size was paired (XLA ran both as one).
    Unflagged rows are paired first, so that the instruction XLA kept of a merged pair goes
    to the row that must be there; a row that runs 0 times (``calls == 0``: in a loop of zero
    iterations, which XLA drops) left over is ``never_run``.
    """
    found, _ = _hlo.collectives(hlo_text)
    hlo = [(c.kind, _group(c), b, c.line) for c in found for b in c.parts]
    unmatched: list[tuple[str, int, int, str]] = list(hlo)
    paired: list[CollectiveCall] = []
    # Unflagged rows first: where XLA merged a flagged row with another of the same key, the
    # instruction left is the other row's, and the flagged row is the one it ran together.
    order = {id(c): i for i, c in enumerate(ours)}
    # Rows that never run (in a loop of zero iterations, which XLA drops) come last.
    left = _pair([c for c in ours if c.xla_may is None and c.calls], unmatched, paired, 1)
    left += _pair([c for c in ours if c.xla_may is not None and c.calls], unmatched, paired, 1)
    left += _pair([c for c in ours if not c.calls], unmatched, paired, 1)
    left.sort(key=lambda c: order[id(c)])
    narrow = [c for c in left if c.dtype in _WIDENED]
    still = {id(c) for c in _pair(narrow, unmatched, paired, 2)}
    widened = [c for c in narrow if id(c) not in still]
    left = [c for c in left if c.dtype not in _WIDENED or id(c) in still]
    keys = {_same(c) for c in paired}
    merged = [c for c in left if c.xla_may is not None and _same(c) in keys]
    never_run = [c for c in left if not c.calls and id(c) not in {id(m) for m in merged}]
    gone = {id(c) for c in merged + never_run}
    left = [c for c in left if id(c) not in gone]
    combined = sorted({c.line.strip() for c in found if len(c.parts) > 1})
    by_moves, unmatched = _moves.attribute(moves, unmatched)
    only_in_hlo = [(kind, b, line) for kind, _, b, line in unmatched]
    return HloComparison(
        left, only_in_hlo, len(ours), len(hlo), combined, by_moves, merged, widened, never_run
    )


def _group(c: Any) -> int:
    """The group a collective is paired by: a collective-permute has none (the HLO names its
    source-target pairs, over all devices; the report its mesh axis), so 0."""
    return 0 if c.kind == "collective-permute" else c.group


def _pair(
    ours: list[CollectiveCall], unmatched: list, paired: list[CollectiveCall], scale: int
) -> list[CollectiveCall]:
    """Pair rows with HLO collectives of the same kind, group and ``scale`` x operand bytes
    (removing them from ``unmatched``, adding the rows to ``paired``); return the rest."""
    rest = []
    for c in ours:
        key = (c.kind, _group(c), c.operand_bytes * scale)
        i = next((i for i, h in enumerate(unmatched) if h[:3] == key), None)
        if i is None:
            rest.append(c)
        else:
            del unmatched[i]
            paired.append(c)
    return rest


def _same(c: CollectiveCall) -> tuple:
    """What makes two rows the same collective of the same value for XLA's merging."""
    return (c.op, c.spec, c.kind, c.axes, c.operand_bytes, c.dtype)
