"""The one HLO reader: instructions, collectives, their bytes, replica groups and ring cost.

``explain`` (to compare its report with XLA's program) and the benchmarks (to count the bytes a
step moves) both read HLO text through this module and `hlo_groups`, its replica-group part;
nothing else in shardlib parses it. It reads what both of XLA's printers write:

- compiled HLO (``jax.jit(f).lower(...).compile().as_text()``): ``%``-prefixed names,
  computation headers with parameter lists, source-location tables first;
- HLO before optimisation (``jax.jit(f).lower(...).as_text(dialect="hlo")``): bare names and
  ``name {`` headers. It keeps the program's dtypes: XLA's CPU backend, for one, widens an f8
  or bf16 collective to f16 or f32 when it compiles.

Bytes per element are the type's bit width over 8, the width being the first number in the
type's name (``f32`` 4, ``bf16`` 2, every float8 type such as ``f8e4m3fn`` 1, ``s4``/``u4``/
``f4e2m1fn`` 0.5, ``s2`` 0.25); ``pred`` (``bool``) is 1 byte and ``token`` 0. An array's bytes
are rounded up to a whole byte, as packed sub-byte storage needs. The same rule reads the dtype
names of jaxprs and numpy (``float8_e4m3fn``, ``int4``, ``bool``).

Replica groups are read by `shardlib._explain.hlo_groups` (every form XLA prints: explicit
lists, iota, mesh), re-exported here: `replica_groups`, `group_size`, `group_axes`,
`groups_attr`.

One instruction may run several collectives: XLA combines all-reduces (and others) into one
instruction with a tuple of operands. A *tuple* all-to-all is not such a combination: it is one
all-to-all whose operands are the blocks sent to each device of its group (`Collective.parts`).
"""

from __future__ import annotations

import dataclasses
import math
import re

from .hlo_groups import group_axes, group_size, groups_attr, replica_groups

__all__ = [
    "COLLECTIVES",
    "Collective",
    "Instruction",
    "Module",
    "array_bytes",
    "collectives",
    "element_bytes",
    "executions",
    "group_axes",
    "group_size",
    "groups_attr",
    "instructions",
    "parse_module",
    "replica_groups",
    "ring_bytes",
    "shape_bytes",
    "strip_tables",
]

COLLECTIVES = (
    "all-gather",
    "all-reduce",
    "reduce-scatter",
    "all-to-all",
    "ragged-all-to-all",
    "collective-permute",
    "collective-broadcast",
)

# -- bytes ------------------------------------------------------------------------------------

_WIDTH = re.compile(r"^(?:bfloat|float|complex|uint|int|bf|s|u|i|f|c)(\d+)")
_NO_DATA = ("token", "opaque")


def element_bytes(dtype: str) -> float:
    """Bytes per element of a dtype named as HLO, jaxprs or numpy name it (see the module
    docstring: bit width / 8, so 4-bit types count 0.5 byte)."""
    if dtype in ("pred", "bool"):
        return 1.0
    if dtype in _NO_DATA:
        return 0.0
    m = _WIDTH.match(dtype)
    if m is None:
        raise ValueError(
            f"element_bytes: unknown dtype {dtype!r}; expected an HLO, jaxpr or numpy dtype name "
            "whose first number is its bit width (f32, bf16, f8e4m3fn, s4, float8_e5m2, pred)"
        )
    return int(m.group(1)) / 8


def array_bytes(dtype: str, shape: tuple[int, ...]) -> int:
    """Bytes of an array of ``shape`` and ``dtype``, rounded up to a whole byte."""
    return math.ceil(math.prod(shape) * element_bytes(dtype))


_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")


def shape_bytes(shape: str) -> int:
    """Bytes of an HLO shape such as ``f32[2,16]{1,0}`` or a tuple of them (layouts ignored)."""
    return sum(
        array_bytes(dtype, tuple(int(d) for d in dims.split(",") if d))
        for dtype, dims in _ARRAY.findall(shape)
    )


# -- instructions and computations ------------------------------------------------------------

_TABLES = ("FileNames", "FunctionNames", "FileLocations", "StackFrames")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([^\s=]+)\s*=\s*(.*)$")
_OPCODE = re.compile(r"([a-z][a-z0-9\-]*)\(")
# '%name (params) -> result {' (compiled) or 'name {' (before optimisation), maybe ENTRY first.
_HEADER = re.compile(r"^\s*(?:ENTRY\s+)?%?([^\s(=]+)\s*(?:\((.*)\)\s*->.*)?\{\s*$")
_COMMENT = re.compile(r"/\*.*?\*/")  # '/*index=5*/' before every fifth operand
_PARTITIONS = re.compile(r"\bnum_partitions=(\d+)")
_REPLICAS = re.compile(r"\breplica_count=(\d+)")


@dataclasses.dataclass(frozen=True)
class Instruction:
    """One parsed HLO instruction line."""

    name: str
    shape: str  # the result shape text, e.g. 'f32[2,16]{1,0}' or '(f32[2], f32[])'
    opcode: str
    operands: tuple[str, ...]  # names of the operand instructions
    attrs: str  # everything after the operand list
    line: str = ""  # the instruction's text


@dataclasses.dataclass(frozen=True)
class Module:
    """An HLO module's computations (name -> instructions, in order), its entry, and its
    device count from the header (None where the header does not say)."""

    computations: dict[str, list[Instruction]]
    entry: str
    num_devices: int | None = None


def strip_tables(text: str) -> str:
    """Drop the source-location tables (each a title line, entries, then a blank line)."""
    out: list[str] = []
    skipping = False
    for line in text.splitlines():
        if line.strip() in _TABLES:
            skipping = True
            continue
        if skipping:
            if not line.strip():
                skipping = False
            continue
        out.append(line)
    return "\n".join(out)


def _split_rhs(rhs: str) -> tuple[str, str, str] | None:
    """``(shape, opcode, rest after 'opcode(')`` of an instruction's right-hand side."""
    rhs = rhs.lstrip()
    if rhs.startswith("("):
        depth = 0
        for i, ch in enumerate(rhs):
            depth += {"(": 1, ")": -1}.get(ch, 0)
            if depth == 0:
                shape, rest = rhs[: i + 1], rhs[i + 1 :]
                break
        else:
            return None
    else:
        parts = rhs.split(" ", 1)
        if len(parts) < 2:
            return None
        shape, rest = parts
    m = _OPCODE.match(rest.lstrip())
    if not m:
        return None
    return shape, m.group(1), rest.lstrip()[m.end() :]


def _split_operands(rest: str) -> tuple[tuple[str, ...], str]:
    """Operand names of ``a, %b), attrs`` (the text just after the opening parenthesis).

    An operand is printed ``%b``, ``b`` or with its shape, ``f32[4]{0} %b``: its name is the
    last word of its comma-separated piece, once the ``/*index=N*/`` comments XLA writes
    before every fifth operand are dropped.
    """
    depth, start, pieces = 1, 0, []
    for i, ch in enumerate(rest):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
            if depth == 0:
                pieces.append(rest[start:i])
                words = [_COMMENT.sub(" ", p).split() for p in pieces]
                names = tuple(w[-1].lstrip("%") for w in words if w)
                return names, rest[i + 1 :]
        elif ch == "," and depth == 1:
            pieces.append(rest[start:i])
            start = i + 1
    return (), rest


def _parse_instruction(line: str) -> Instruction | None:
    m = _INSTRUCTION.match(line)
    if not m or line.lstrip().startswith(("HloModule", "ENTRY")):
        return None
    parts = _split_rhs(m.group(2))
    if parts is None:
        return None
    shape, opcode, rest = parts
    operands, attrs = _split_operands(rest)
    return Instruction(m.group(1), shape, opcode, operands, attrs, line.strip())


def _header_devices(line: str) -> int | None:
    parts, reps = _PARTITIONS.search(line), _REPLICAS.search(line)
    if parts is None and reps is None:
        return None
    return (int(parts.group(1)) if parts else 1) * (int(reps.group(1)) if reps else 1)


def parse_module(text: str) -> Module:
    """Parse HLO module text (compiled or not) into computations of `Instruction`."""
    comps: dict[str, list[Instruction]] = {}
    entry, devices = "", None
    current: list[Instruction] | None = None
    for line in strip_tables(text).splitlines():
        stripped = line.strip()
        if stripped.startswith("HloModule"):
            devices = _header_devices(stripped)
            continue
        header = _HEADER.match(line)
        if header and "=" not in line.split("(", 1)[0].split("{", 1)[0]:
            current = comps.setdefault(header.group(1), [])
            if stripped.startswith("ENTRY"):
                entry = header.group(1)
            continue
        if stripped == "}":
            current = None
            continue
        ins = _parse_instruction(line) if current is not None else None
        if ins is not None and current is not None:
            current.append(ins)
    return Module(comps, entry, devices)


def instructions(text: str) -> list[tuple[str, str]]:
    """``(name, opcode)`` for every instruction line of an HLO module's text."""
    out = []
    for line in strip_tables(text).splitlines():
        ins = _parse_instruction(line)
        if ins is not None:
            out.append((ins.name, ins.opcode))
    return out


# -- how often each computation runs ----------------------------------------------------------

_TRIP_COUNT = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"')
_CALLEE = re.compile(
    r"\b(body|condition|calls|to_apply|true_computation|false_computation)=%?([\w.\-]+)"
)
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")


def _callees(ins: Instruction) -> list[tuple[str, int | None]]:
    """Computations ``ins`` runs and how often per execution (None: a loop body whose trip
    count is unknown)."""
    out: list[tuple[str, int | None]] = []
    trip = _TRIP_COUNT.search(ins.attrs)
    for key, name in _CALLEE.findall(ins.attrs):
        if ins.opcode == "while" and key == "body":
            out.append((name, int(trip.group(1)) if trip else None))
        elif ins.opcode == "while":  # the condition runs once more than the body; no collectives
            out.append((name, int(trip.group(1)) + 1 if trip else 1))
        else:
            out.append((name, 1))
    for group in _BRANCHES.findall(ins.attrs):  # at most one branch runs: count each once
        out.extend((name, 1) for name in re.findall(r"%?([\w.\-]+)", group))
    return out


def executions(module: Module) -> tuple[dict[str, int], int]:
    """How often each computation runs per execution of the entry, and how many loops had no
    known trip count (their bodies were counted as running once)."""
    runs: dict[str, int] = {}
    unknown = 0

    def visit(comp: str, times: int, depth: int) -> None:
        nonlocal unknown
        if depth > 64 or comp not in module.computations:
            return
        runs[comp] = runs.get(comp, 0) + times
        for ins in module.computations[comp]:
            for callee, k in _callees(ins):
                if k is None:
                    unknown += 1
                    k = 1
                visit(callee, times * k, depth + 1)

    visit(module.entry, 1, 0)
    return runs, unknown


# -- ring cost ------------------------------------------------------------------------------


def _moving_share(attrs: str) -> float:
    """A collective-permute: 1 if some source-target pair leaves its device (the busiest
    device sends one block: fixed points and devices outside the pairs do not lower the
    maximum), 0 if every pair is a fixed point."""
    m = re.search(r"source_target_pairs=\{(.*?)\}\}", attrs)
    pairs = re.findall(r"(\d+),(\d+)", m.group(1)) if m else []
    return 1.0 if not pairs or any(s != t for s, t in pairs) else 0.0


def ring_bytes(kind: str, in_bytes: float, out_bytes: float, group: int, moving=1.0) -> float:
    """Bytes one device sends (and receives) in one collective with bandwidth-optimal (ring)
    algorithms over ``group`` devices: all-gather ``out·(g-1)/g``; reduce-scatter, all-to-all
    ``in·(g-1)/g``; all-reduce ``2·in·(g-1)/g``; collective-permute ``in`` times ``moving``
    (1 when any pair leaves its device: the busiest device's bytes); collective-broadcast
    ``in``. Every number is the busiest device's."""
    g = max(group, 1)
    if kind == "all-gather":
        return out_bytes * (g - 1) / g
    if kind == "all-reduce":
        return 2 * in_bytes * (g - 1) / g
    if kind == "collective-permute":
        return in_bytes * moving
    if kind == "collective-broadcast":
        return float(in_bytes)
    return in_bytes * (g - 1) / g


def _operands_per_collective(kind: str, group: int, n_operands: int) -> int:
    """How many consecutive operands of a collective instruction form one collective: ``group``
    for a tuple all-to-all (XLA's verifier gives it one operand per device of its group; a
    multiple of that is read as that many all-to-alls), else 1. An array all-to-all (with a
    split dimension) has one operand."""
    if kind != "all-to-all" or group < 2 or n_operands % group:
        return 1
    return group


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective instruction of an HLO program (per device, once SPMD-partitioned).

    ``in_bytes``/``out_bytes`` are the operand and result sizes on one device
    (``operand_bytes`` per operand: a combined collective has several); ``payload`` is the
    larger of the two: the buffer the collective assembles or reduces. ``wire`` is
    `ring_bytes`. ``runs`` is how many times it executes per call of the program (loop trip
    counts); ``line`` is its instruction text. ``parts`` splits the instruction into the
    collectives it runs (see there).
    """

    kind: str
    computation: str
    in_bytes: int
    out_bytes: int
    group: int
    runs: int
    moving: float = 1.0  # collective-permute: 1 if some source-target pair leaves its device
    operand_bytes: tuple[int, ...] = ()
    line: str = ""
    operands_per_collective: int = 1  # a tuple all-to-all: one operand per device of a group
    num_devices: int = 1  # the module's devices: the group where the instruction names none

    @property
    def groups(self) -> tuple[tuple[int, ...], ...]:
        """Its replica groups (`replica_groups`), read from its line when asked; a
        collective-permute has none (its pairs say who sends to whom): ``()``."""
        if self.kind == "collective-permute":
            return ()
        return replica_groups(self.line, self.num_devices)

    @property
    def parts(self) -> tuple[int, ...]:
        """Operand bytes of each collective this instruction runs.

        An instruction with several operands is usually several collectives that XLA combined
        (an all-reduce of a tuple): one part per operand. A *tuple* all-to-all (no
        ``dimensions=``, as XLA's CPU backend compiles all-to-alls) is one all-to-all whose
        operands are the blocks it sends to the devices of its group, one each: its ``group``
        operands make one part.
        """
        k = max(self.operands_per_collective, 1)
        ops = self.operand_bytes
        return tuple(sum(ops[i : i + k]) for i in range(0, len(ops), k))

    @property
    def payload(self) -> int:
        return max(self.in_bytes, self.out_bytes)

    @property
    def wire(self) -> float:
        return ring_bytes(self.kind, self.in_bytes, self.out_bytes, self.group, self.moving)


def collectives(text: str, num_devices: int | None = None) -> tuple[list[Collective], int]:
    """Every collective of an HLO module, and the number of loops without a known trip count
    (their bodies were counted once).

    Async ``-start``/``-done`` pairs count once, with the ``-done`` half's result as the
    output. ``num_devices`` (for groups written ``{}`` or not at all) defaults to the module
    header's device count, else 1.
    """
    module = parse_module(text)
    devices = num_devices or module.num_devices or 1
    runs, unknown = executions(module)
    every = [i for ins in module.computations.values() for i in ins]
    shapes = {i.name: i.shape for i in every}
    done_shape = {
        i.operands[0]: i.shape for i in every if i.opcode.endswith("-done") and i.operands
    }
    out = []
    for comp, ins in module.computations.items():
        for i in ins:
            kind = i.opcode.removesuffix("-start")
            if i.opcode.endswith("-done") or kind not in COLLECTIVES:
                continue
            per_operand = tuple(shape_bytes(shapes.get(o, "")) for o in i.operands)
            group = group_size(i.attrs, devices)
            out.append(
                Collective(
                    kind=kind,
                    computation=comp,
                    in_bytes=sum(per_operand),
                    out_bytes=shape_bytes(done_shape.get(i.name, i.shape)),
                    group=group,
                    runs=runs.get(comp, 0),
                    moving=_moving_share(i.attrs),
                    operand_bytes=per_operand,
                    line=i.line,
                    operands_per_collective=_operands_per_collective(kind, group, len(i.operands)),
                    num_devices=devices,
                )
            )
    return out, unknown
