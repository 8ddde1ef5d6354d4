"""Helpers for comparing compiled HLO programs: collective census and canonical text.

Compiled HLO text (``jax.jit(f).trace(...).lower().compile().as_text()``) starts with tables of
source locations (``FileNames``, ``FunctionNames``, ``FileLocations``, ``StackFrames``), and its
instructions carry ``metadata={...}`` with Python function names and line numbers, and ids
derived from JAX op names (``%psum_invariant.74``). Two programs that do the same thing but come
from different Python code differ in all of those; :func:`canonicalize` removes them so that the
remaining text can be compared.

Collectives are counted per instruction line by opcode (``%x = f32[8]{0} all-gather(...)``), not
by substring: names and operands also contain words like ``all_gather`` and async pairs appear
as ``all-gather-start`` / ``all-gather-done`` (counted once, as ``all-gather``).
:func:`collective_traffic` adds bytes per device and executions per step (instructions in loop
bodies count ``known_trip_count`` times). :func:`canonicalize_jaxpr` and
:func:`canonicalize_mlir` do for jaxprs and StableHLO text what :func:`canonicalize` does for
compiled HLO.
"""

from __future__ import annotations

import dataclasses
import re
from collections import Counter
from typing import Any

__all__ = [
    "COLLECTIVES",
    "Collective",
    "canonicalize",
    "canonicalize_jaxpr",
    "canonicalize_mlir",
    "collective_census",
    "collective_traffic",
    "collectives",
    "first_difference",
    "instructions",
    "parse_module",
    "primitive_census",
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

_TABLES = ("FileNames", "FunctionNames", "FileLocations", "StackFrames")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([^\s=]+)\s*=\s*(.*)$")
_OPCODE = re.compile(r"([a-z][a-z0-9\-]*)\(")
_HEADER = re.compile(r"^\s*(?:ENTRY\s+)?%?([^\s(]+)\s*\((.*)\)\s*->.*\{\s*$")


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


def _skip_braced(s: str, i: int) -> int:
    """Index just past the ``}`` matching the ``{`` at ``s[i]`` (quotes respected)."""
    depth = 0
    quote = False
    while i < len(s):
        ch = s[i]
        if quote:
            if ch == "\\":
                i += 1
            elif ch == '"':
                quote = False
        elif ch == '"':
            quote = True
        elif ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return i


def strip_metadata(text: str) -> str:
    """Remove every ``metadata={...}`` attribute (with its leading comma)."""
    out: list[str] = []
    i = 0
    key = "metadata={"
    while True:
        j = text.find(key, i)
        if j < 0:
            out.append(text[i:])
            break
        start = j
        k = start - 1
        while k >= 0 and text[k] == " ":
            k -= 1
        if k >= 0 and text[k] == ",":
            start = k
        out.append(text[i:start])
        i = _skip_braced(text, j + len(key) - 1)
    return "".join(out)


def _opcode(rhs: str) -> str | None:
    """The opcode of an instruction's right-hand side ``<shape> opcode(operands), attrs``."""
    parts = _split_rhs(rhs)
    return parts[1] if parts else None


def instructions(text: str) -> list[tuple[str, str]]:
    """``(name, opcode)`` for every instruction line of an HLO module's text."""
    out = []
    for line in strip_tables(text).splitlines():
        m = _INSTRUCTION.match(line)
        if not m or line.lstrip().startswith(("HloModule", "ENTRY")):
            continue
        op = _opcode(m.group(2))
        if op is not None:
            out.append((m.group(1), op))
    return out


def collective_census(text: str) -> dict[str, int]:
    """How many collectives of each kind the program runs (async start/done pairs count once).

    Only kinds that occur are listed, e.g. ``{'all-gather': 22, 'all-reduce': 9}``.
    """
    counts: Counter[str] = Counter()
    for _, op in instructions(text):
        base = op.removesuffix("-start")
        if op.endswith("-done"):
            continue
        if base in COLLECTIVES:
            counts[base] += 1
    return dict(sorted(counts.items()))


def canonicalize(text: str) -> str:
    """The program without source tables, metadata, module name or value/computation names.

    Names (``%add.30``, ``%region_5.5``, parameters in computation headers) are renamed
    ``%v0, %v1, ...`` in order of first appearance, so two programs with the same
    instructions in the same order have the same canonical text.
    """
    body = strip_metadata(strip_tables(text))
    names: dict[str, str] = {}

    def rename(name: str) -> str:
        if name not in names:
            names[name] = f"v{len(names)}"
        return names[name]

    lines = []
    for line in body.splitlines():
        if not line.strip():
            continue
        if line.startswith("HloModule"):
            line = re.sub(r"^HloModule\s+[^\s,]+", "HloModule m", line)
        elif _HEADER.match(line):  # parameter names appear without '%' in headers
            line = re.sub(
                r"(?<![\w.%\-])([A-Za-z_][\w.\-]*)(?=: )", lambda m: rename(m.group(1)), line
            )
        line = re.sub(r"%([\w.\-]+)", lambda m: "%" + rename(m.group(1)), line)
        lines.append(line.rstrip())
    return "\n".join(lines)


def first_difference(a: str, b: str, context: int = 1) -> str:
    """The first differing line of two texts with a little context, or ``''`` when equal."""
    la, lb = a.splitlines(), b.splitlines()
    for i in range(max(len(la), len(lb))):
        x = la[i] if i < len(la) else "<end>"
        y = lb[i] if i < len(lb) else "<end>"
        if x != y:
            lo = max(0, i - context)
            before = "\n".join("  " + s for s in la[lo:i])
            return f"line {i + 1}:\n{before}\n- {x}\n+ {y}"
    return ""


# ---------------------------------------------------------------------------------------------
# Bytes moved by collectives, per device, per executed step.
# ---------------------------------------------------------------------------------------------

_ITEMSIZE = {
    "pred": 1,
    "s2": 0.25,
    "u2": 0.25,
    "s4": 0.5,
    "u4": 0.5,
    "s8": 1,
    "u8": 1,
    "s16": 2,
    "u16": 2,
    "f16": 2,
    "bf16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
    "c64": 8,
    "c128": 16,
}
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")
_TRIP_COUNT = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"')
_IOTA_GROUPS = re.compile(r"replica_groups=\[(\d+),(\d+)\]<=")
_LIST_GROUPS = re.compile(r"replica_groups=\{\{([0-9,\s]*)\}")
_MESH_GROUPS = re.compile(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}")
_CALLEE = re.compile(
    r"\b(body|condition|calls|to_apply|true_computation|false_computation)=%([\w.\-]+)"
)
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")


def shape_bytes(shape: str) -> int:
    """Bytes of an HLO shape such as ``f32[2,16]{1,0}`` or a tuple of them (layouts ignored).

    ``f8e4m3fn`` and the other 8-bit float types count 1 byte; ``token[]`` counts 0.
    """
    total = 0.0
    for dtype, dims in _ARRAY.findall(shape):
        size = _ITEMSIZE.get(dtype, 1 if dtype.startswith("f8") else 0)
        n = 1
        for d in dims.split(","):
            if d:
                n *= int(d)
        total += size * n
    return int(total)


@dataclasses.dataclass(frozen=True)
class Instruction:
    """One parsed HLO instruction line."""

    name: str
    shape: str  # the result shape text, e.g. 'f32[2,16]{1,0}' or '(f32[2], f32[])'
    opcode: str
    operands: tuple[str, ...]  # names of the operand instructions
    attrs: str  # everything after the operand list


@dataclasses.dataclass(frozen=True)
class Module:
    """An HLO module's computations (name -> instructions, in order) and its entry."""

    computations: dict[str, list[Instruction]]
    entry: str


def _split_rhs(rhs: str) -> tuple[str, str, str] | None:
    """``(shape, opcode, rest after 'opcode(')`` of an instruction's right-hand side."""
    rhs = rhs.lstrip()
    if rhs.startswith("("):
        depth = 0
        for i, ch in enumerate(rhs):
            if ch == "(":
                depth += 1
            elif ch == ")":
                depth -= 1
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
    """Operand names of ``a, %b), attrs`` (text just after the opening parenthesis)."""
    depth = 1
    for i, ch in enumerate(rest):
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
            if depth == 0:
                inside, attrs = rest[:i], rest[i + 1 :]
                return tuple(re.findall(r"%([\w.\-]+)", inside)), attrs
    return tuple(re.findall(r"%([\w.\-]+)", rest)), ""


def parse_module(text: str) -> Module:
    """Parse compiled HLO text into computations of :class:`Instruction` (tables skipped)."""
    comps: dict[str, list[Instruction]] = {}
    entry = ""
    current: list[Instruction] | None = None
    for line in strip_tables(text).splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("HloModule"):
            continue
        header = _HEADER.match(line)
        if header and "=" not in line.split("(", 1)[0]:
            current = comps.setdefault(header.group(1), [])
            if stripped.startswith("ENTRY"):
                entry = header.group(1)
            continue
        if stripped == "}":
            current = None
            continue
        m = _INSTRUCTION.match(line)
        if current is None or not m:
            continue
        parts = _split_rhs(m.group(2))
        if parts is None:
            continue
        shape, opcode, rest = parts
        operands, attrs = _split_operands(rest)
        current.append(Instruction(m.group(1), shape, opcode, operands, attrs))
    return Module(comps, entry)


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
        out.extend((name, 1) for name in re.findall(r"%([\w.\-]+)", group))
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


def _group_size(attrs: str, num_devices: int) -> int:
    """Devices per replica group: ``{{0,1},{2,3}}``, ``[4,2]<=[8]`` (4 groups of 2) or
    ``mesh['a'=4,'b'=2] {'b'}`` (groups along the listed axes); all devices when absent."""
    m = _MESH_GROUPS.search(attrs)
    if m:
        sizes = {k: int(v) for k, v in re.findall(r"'([^']+)'\s*=\s*(\d+)", m.group(1))}
        n = 1
        for axis in re.findall(r"'([^']+)'", m.group(2)):
            n *= sizes.get(axis, 1)
        return n
    m = _IOTA_GROUPS.search(attrs)
    if m:
        return int(m.group(2))
    m = _LIST_GROUPS.search(attrs)
    if m:
        return len([t for t in m.group(1).split(",") if t.strip()])
    return num_devices


def _moving_share(attrs: str) -> float:
    m = re.search(r"source_target_pairs=\{(.*?)\}\}", attrs)
    if not m:
        return 1.0
    pairs = re.findall(r"(\d+),(\d+)", m.group(1))
    if not pairs:
        return 1.0
    return sum(1 for s, t in pairs if s != t) / len(pairs)


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective instruction of a compiled (per-device, SPMD-partitioned) program.

    ``in_bytes``/``out_bytes`` are the operand and result sizes on one device; ``payload`` is
    the larger of the two: the buffer the collective assembles or reduces (the gathered result
    of an all-gather, the unscattered input of a reduce-scatter, the buffer of an all-reduce or
    all-to-all). ``wire`` estimates the bytes one device sends with bandwidth-optimal (ring)
    algorithms over a group of ``group`` devices: all-gather ``out·(g-1)/g``, reduce-scatter
    and all-to-all ``in·(g-1)/g``, all-reduce ``2·in·(g-1)/g``, collective-permute ``in`` times the share of its
    source-target pairs that leave the device (``{0,0}`` moves nothing).
    ``runs`` is how many times it executes per call of the program (loop trip counts).
    """

    kind: str
    computation: str
    in_bytes: int
    out_bytes: int
    group: int
    runs: int
    moving: float = 1.0  # collective-permute: share of source-target pairs with source != target

    @property
    def payload(self) -> int:
        return max(self.in_bytes, self.out_bytes)

    @property
    def wire(self) -> float:
        g = max(self.group, 1)
        share = (g - 1) / g
        if self.kind == "all-gather":
            return self.out_bytes * share
        if self.kind == "all-reduce":
            return 2 * self.in_bytes * share
        if self.kind == "collective-permute":
            return self.in_bytes * self.moving
        if self.kind == "collective-broadcast":
            return float(self.in_bytes)
        return self.in_bytes * share


def collectives(text: str, num_devices: int = 8) -> tuple[list[Collective], int]:
    """Every collective of a compiled HLO module, and the number of loops without a known
    trip count (their bodies were counted once).

    Async pairs count once, with the ``-done`` half's result as the output.
    """
    module = parse_module(text)
    runs, unknown = executions(module)
    shapes = {i.name: i.shape for ins in module.computations.values() for i in ins}
    done_shape = {
        i.operands[0]: i.shape
        for ins in module.computations.values()
        for i in ins
        if i.opcode.endswith("-done") and i.operands
    }
    out = []
    for comp, ins in module.computations.items():
        for i in ins:
            if i.opcode.endswith("-done"):
                continue
            kind = i.opcode.removesuffix("-start")
            if kind not in COLLECTIVES:
                continue
            in_bytes = sum(shape_bytes(shapes.get(o, "")) for o in i.operands)
            result = done_shape.get(i.name, i.shape)
            out.append(
                Collective(
                    kind=kind,
                    computation=comp,
                    in_bytes=in_bytes,
                    out_bytes=shape_bytes(result),
                    group=_group_size(i.attrs, num_devices),
                    runs=runs.get(comp, 0),
                    moving=_moving_share(i.attrs),
                )
            )
    return out, unknown


def collective_traffic(text: str, num_devices: int = 8) -> dict[str, Any]:
    """Per collective kind: instructions, executions per step and bytes per device.

    Returns ``{'kinds': {kind: {...}}, 'total': {...}, 'unknown_trip_counts': n}`` where each
    entry has ``count`` (instructions in the program), ``runs`` (executions per step, loop trip
    counts applied), ``payload_bytes`` (sum of :attr:`Collective.payload` over instructions),
    ``payload_bytes_per_step`` (times ``runs``) and ``wire_bytes_per_step`` (estimated bytes
    sent per device per step, see :class:`Collective`).
    """
    found, unknown = collectives(text, num_devices)
    kinds: dict[str, dict[str, float]] = {}
    keys = ("count", "runs", "payload_bytes", "payload_bytes_per_step", "wire_bytes_per_step")
    total = dict.fromkeys(keys, 0)
    for c in found:
        row = kinds.setdefault(c.kind, dict.fromkeys(keys, 0))
        for target in (row, total):
            target["count"] += 1
            target["runs"] += c.runs
            target["payload_bytes"] += c.payload
            target["payload_bytes_per_step"] += c.payload * c.runs
            target["wire_bytes_per_step"] += c.wire * c.runs
    for row in (*kinds.values(), total):
        row["wire_bytes_per_step"] = int(round(row["wire_bytes_per_step"]))
    return {"kinds": dict(sorted(kinds.items())), "total": total, "unknown_trip_counts": unknown}


# ---------------------------------------------------------------------------------------------
# Canonical jaxpr and StableHLO text.
# ---------------------------------------------------------------------------------------------

_ADDRESS = re.compile(r"0x[0-9a-fA-F]+")
_LOC = re.compile(r"\s*loc\((?:[^()]|\([^()]*\))*\)")


def canonicalize_jaxpr(jaxpr: Any) -> str:
    """A jaxpr printed without source locations or name stacks, object addresses removed.

    The printer already names variables ``a, b, c, ...`` in order of appearance, so two
    jaxprs with the same equations print the same.
    """
    try:
        text = jaxpr.pretty_print(source_info=False, name_stack=False)
    except TypeError:  # pragma: no cover - older printers
        text = str(jaxpr)
    return _ADDRESS.sub("0x", text)


def canonicalize_mlir(text: str) -> str:
    """StableHLO text without ``loc(...)`` attributes, ``#loc`` lines or the module name."""
    lines = []
    for line in text.splitlines():
        if line.startswith("#loc"):
            continue
        line = _LOC.sub("", line)
        line = re.sub(r"^module @[\w.\-]+", "module @m", line)
        if line.strip():
            lines.append(line.rstrip())
    return "\n".join(lines)


def primitive_census(jaxpr_text: str) -> Counter[str]:
    """How often each primitive appears in a printed jaxpr (``x:f32[] = prim[...] y``)."""
    return Counter(re.findall(r"=\s+([a-z_][\w]*)(?=[\[\s])", jaxpr_text))
