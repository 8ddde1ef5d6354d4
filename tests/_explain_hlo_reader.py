"""An HLO reader of the differential test's own (`tests/test_explain_differential.py`).

It shares no code with `shardlib._explain.hlo`: it reads HLO text (unoptimised, as
``lowered.as_text(dialect="hlo")`` prints it, or compiled) into every collective with its kind,
mesh axes (from its replica groups in any of XLA's forms, or a permute's pairs), operand bytes
per call (from the result shape), the dtype it runs in, and how many times it runs (loop trip
counts: XLA's ``known_trip_count``, else the constant a scan's condition compares its counter
with).
"""

from __future__ import annotations

import dataclasses
import math
import re

import numpy as np

KINDS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
_INS = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_ELEM = re.compile(r"\b(pred|bf16|f16|f32|f64|s8|s16|s32|s64|u8|u16|u32|u64)\[([\d,]*)\]")
_WIDTHS = {"pred": 1, "bf16": 2, "f16": 2, "f32": 4, "f64": 8, "s8": 1, "s16": 2}
_WIDTHS |= {"s32": 4, "s64": 8, "u8": 1, "u16": 2, "u32": 4, "u64": 8}
_CALLED = re.compile(
    r"\b(to_apply|calls|body|condition|true_computation|false_computation)=%?([\w.\-]+)"
)


@dataclasses.dataclass(frozen=True)
class HloCollective:
    """One collective an HLO program runs: its kind, mesh axes, per-device operand bytes per
    call, the dtype it runs in, and how many times it runs per call of the program."""

    kind: str
    axes: tuple[str, ...]
    operand_bytes: int
    dtype: str
    runs: int
    group: int
    moving: bool = True  # a permute with some pair leaving its device


def _computations(text: str) -> tuple[dict[str, list[tuple[str, str]]], str]:
    """``{computation: [(instruction name, right-hand side)]}`` and the entry's name."""
    comps: dict[str, list[tuple[str, str]]] = {}
    entry, current = "", None
    for line in text.splitlines():
        s = line.strip()
        if s.endswith("{") and " = " not in s and not s.startswith("HloModule"):
            words = s.split()
            name = (words[1] if words[0] == "ENTRY" else words[0]).lstrip("%").split("(")[0]
            entry = name if words[0] == "ENTRY" else entry
            current = comps.setdefault(name, [])
        elif s == "}":
            current = None
        elif current is not None and (m := _INS.match(line)):
            current.append((m.group(1), m.group(2)))
    return comps, entry


def _split(rhs: str) -> tuple[str, str, str]:
    """(result shape, opcode, the rest) of an instruction's right-hand side."""
    if rhs.startswith("("):
        depth, end = 0, len(rhs) - 1
        for i, ch in enumerate(rhs):
            depth += (ch == "(") - (ch == ")")
            if depth == 0:
                end = i
                break
        shape, rest = rhs[: end + 1], rhs[end + 1 :].lstrip()
    else:
        shape, _, rest = rhs.partition(" ")
    opcode, _, rest = rest.partition("(")
    return shape, opcode.strip(), rest


def _trip_count(rest: str, comps) -> int:
    """A while loop's trip count: XLA's known_trip_count, else the one integer constant its
    condition compares the counter with (a scan counts from 0)."""
    m = re.search(r'known_trip_count"?\s*:\s*\{\s*"n"\s*:\s*"(\d+)"', rest)
    if m:
        return int(m.group(1))
    cond = re.search(r"\bcondition=%?([\w.\-]+)", rest)
    consts = [
        int(c)
        for _, rhs in comps.get(cond.group(1) if cond else "", [])
        for c in re.findall(r"^s32\[\] constant\((\d+)\)", rhs)
    ]
    assert len(consts) == 1, f"cannot read a trip count from {consts}"
    return consts[0]


def _runs(comps, entry: str) -> dict[str, int]:
    """How many times each computation runs per call of the entry."""
    runs: dict[str, int] = {}

    def visit(name: str, times: int) -> None:
        runs[name] = runs.get(name, 0) + times
        for _, rhs in comps.get(name, []):
            _, opcode, rest = _split(rhs)
            for key, callee in _CALLED.findall(rest):
                k = _trip_count(rest, comps) if opcode == "while" and key == "body" else 1
                visit(callee, times * k)
            for group in re.findall(r"branch_computations=\{([^}]*)\}", rest):
                for callee in re.findall(r"[\w.\-]+", group):
                    visit(callee, times)

    visit(entry, 1)
    return runs


def _mesh_form_groups(sizes: str, device_ids: str | None, refs: str) -> list[list[int]]:
    """The groups of ``mesh[<sizes>](, device_ids=(..))? {<refs>}`` (JAX >= 0.11 in shard_map;
    XLA's partitioner), read by coordinates: a listed sub-axis ``'a':(pre)k`` is the digit
    ``(i // (n // (pre*k))) % k`` of axis ``a``'s index ``i`` (size ``n``), a whole axis is
    the index. Devices sharing every other digit form a group; a device's rank in it is the
    mixed-radix number of its listed digits, the first listed the most significant; groups
    come in the order of their first device's position on the mesh."""
    axes = [(a, int(n)) for a, n in re.findall(r"'([^']+)'=(\d+)", sizes)]
    shape = [n for _, n in axes]
    total = math.prod(shape)
    if device_ids is None:
        at = list(range(total))  # the device at each mesh position (row-major)
    elif "[" in device_ids:  # ([reshape]T(perm)), maybe after '[dims]<='
        m = re.search(r"\[([\d,]+)\](?:T\(([\d,]+)\))?\s*$", device_ids)
        assert m, device_ids
        ids = np.arange(total).reshape([int(d) for d in m.group(1).split(",")])
        if m.group(2):
            ids = ids.transpose([int(d) for d in m.group(2).split(",")])
        at = ids.reshape(-1).tolist()
    else:
        at = [int(d) for d in re.findall(r"\d+", device_ids)]
    names = [a for a, _ in axes]
    digits = []  # (axis position, stride, radix) of each listed (sub-)axis
    for a, pre, k in re.findall(r"'([^']+)'(?::\((\d+)\)(\d+))?", refs):
        n = shape[names.index(a)]
        pre_, k_ = (int(pre), int(k)) if k else (1, n)
        digits.append((names.index(a), n // (pre_ * k_), k_))
    groups: dict[tuple, list[tuple[int, int, int]]] = {}
    for position in range(total):
        coords = list(np.unravel_index(position, shape))
        rank = 0
        for axis, stride, radix in digits:
            digit = (coords[axis] // stride) % radix
            rank = rank * radix + digit
            coords[axis] -= digit * stride  # what is left is the group's key
        groups.setdefault(tuple(coords), []).append((rank, position, at[position]))
    ordered = sorted(groups.values(), key=lambda g: min(p for _, p, _ in g))
    return [[d for _, _, d in sorted(g)] for g in ordered]


def _groups(rest: str) -> list[list[int]]:
    """The replica groups (lists of logical device ids) of a collective's attributes: lists
    (``{{0,1},{2,3}}``), iota (``[2,4]<=[4,2]T(1,0)``) or mesh (``mesh['d'=4,'t'=2] {'t'}``)."""
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", rest)
    if m:
        ids = np.arange(math.prod(int(d) for d in m.group(3).split(",")))
        ids = ids.reshape([int(d) for d in m.group(3).split(",")])
        if m.group(4):
            ids = ids.transpose([int(d) for d in m.group(4).split(",")])
        return ids.reshape(int(m.group(1)), int(m.group(2))).tolist()
    device_ids = r"(?:, device_ids=\(((?:[^()]|\([^()]*\))*)\))?"  # (0,2,1,3) or ([2,4]T(1,0))
    m = re.search(r"replica_groups=mesh\[([^\]]*)\]" + device_ids + r" \{([^}]*)\}", rest)
    if m:
        return _mesh_form_groups(m.group(1), m.group(2), m.group(3))
    m = re.search(r"replica_groups=\{(.*?)\}\}", rest)
    assert m, f"no replica groups I can read in {rest[:200]}"
    return [
        [int(d) for d in g.split(",") if d.strip()] for g in re.findall(r"\{([\d,\s]*)", m.group(1))
    ]


def _axes_of(devices: list[int], mesh) -> tuple[str, ...]:
    """The mesh axes along which ``devices`` (logical ids, row-major over the mesh) differ."""
    coords = np.array([np.unravel_index(d, mesh.devices.shape) for d in devices])
    return tuple(sorted(a for i, a in enumerate(mesh.axis_names) if len(set(coords[:, i])) > 1))


def _elements(shape: str) -> list[tuple[str, int]]:
    """(dtype, bytes) of each array of an HLO shape (a tuple has several)."""
    return [
        (dt, _WIDTHS[dt] * math.prod(int(d) for d in dims.split(",") if d))
        for dt, dims in _ELEM.findall(shape.split("{")[0] if not shape.startswith("(") else shape)
    ]


def _one_instruction(rhs: str, runs: int, mesh) -> list[HloCollective]:
    shape, opcode, rest = _split(rhs)
    assert not opcode.endswith(("-start", "-done")), f"async collectives are not read: {opcode}"
    if opcode == "collective-permute":
        pairs = [tuple(map(int, p)) for p in re.findall(r"\{(\d+),(\d+)\}", rest)]
        moving = [p for p in pairs if p[0] != p[1]]
        axes = tuple(sorted({a for p in moving for a in _axes_of(list(p), mesh)}))
        group = math.prod(mesh.shape[a] for a in axes)
        return [
            HloCollective(opcode, axes, b, dt, runs, group, bool(moving))
            for dt, b in _elements(shape)
        ]
    groups = _groups(rest)
    axes, group = _axes_of(groups[0], mesh), len(groups[0])
    elems = _elements(shape)
    if opcode == "all-to-all" and "dimensions=" not in rest:  # a tuple all-to-all
        chunks = [elems[i : i + group] for i in range(0, len(elems), group)]
        elems = [(c[0][0], sum(b for _, b in c)) for c in chunks]
    scale = {"all-gather": 1 / group, "reduce-scatter": group}.get(opcode, 1)
    return [HloCollective(opcode, axes, round(b * scale), dt, runs, group) for dt, b in elems]


def unoptimised_text(lowered) -> str:
    """The HLO JAX emits for ``lowered`` (``jax.jit(f).lower(...)``), before XLA optimises it."""
    text = lowered.as_text(dialect="hlo")
    assert isinstance(text, str)
    return text


def compiled_text(lowered) -> str:
    """The HLO XLA compiles ``lowered`` to."""
    text = lowered.compile().as_text()
    assert isinstance(text, str)
    return text


def hlo_collectives(text: str, mesh) -> list[HloCollective]:
    """Every collective of an HLO module's text (unoptimised or compiled) on ``mesh``."""
    comps, entry = _computations(text)
    runs = _runs(comps, entry)
    out = []
    for comp, instructions in comps.items():
        for _, rhs in instructions:
            if _split(rhs)[1] in KINDS and runs.get(comp, 0):
                out += _one_instruction(rhs, runs[comp], mesh)
    return out


def sent_bytes(kind: str, operand: int, group: int, moving: bool = True) -> int:
    """Bytes the busiest device sends in one collective (ring algorithms), rounded up."""
    g = max(group, 1)
    share = {
        "all-gather": g - 1,
        "all-reduce": 2 * (g - 1) / g,
        "collective-permute": 1 if moving else 0,
    }.get(kind, (g - 1) / g)
    return math.ceil(operand * share)
