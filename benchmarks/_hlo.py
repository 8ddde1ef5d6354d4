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
"""

from __future__ import annotations

import re
from collections import Counter

__all__ = [
    "COLLECTIVES",
    "canonicalize",
    "collective_census",
    "first_difference",
    "instructions",
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
    rhs = rhs.lstrip()
    if rhs.startswith("("):  # tuple shape: skip the balanced parentheses
        depth = 0
        for i, ch in enumerate(rhs):
            if ch == "(":
                depth += 1
            elif ch == ")":
                depth -= 1
                if depth == 0:
                    rest = rhs[i + 1 :]
                    break
        else:
            return None
    else:
        parts = rhs.split(" ", 1)
        if len(parts) < 2:
            return None
        rest = parts[1]
    m = _OPCODE.match(rest.lstrip())
    return m.group(1) if m else None


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
