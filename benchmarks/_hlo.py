"""Comparing compiled HLO programs: collective census and traffic, canonical texts.

Reading HLO (instructions, collectives, bytes, replica groups, ring cost) is
:mod:`shardlib._explain.hlo`'s job, shared with ``shardlib.explain``; this module adds what only the
benchmarks need. :func:`collective_census` counts collectives per kind (async start/done pairs
once); :func:`collective_traffic` adds bytes per device and executions per step (instructions in
loop bodies count ``known_trip_count`` times).

Compiled HLO text starts with tables of source locations, and its instructions carry
``metadata={...}`` with Python function names and line numbers, and ids derived from JAX op
names (``%psum_invariant.74``). Two programs that do the same thing but come from different
Python code differ in all of those; :func:`canonicalize` removes them so that the remaining text
can be compared. :func:`canonicalize_jaxpr` and :func:`canonicalize_mlir` do the same for jaxprs
and StableHLO text.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Any

from shardlib._explain.hlo import Collective, collectives, strip_tables

__all__ = [
    "Collective",
    "canonicalize",
    "canonicalize_jaxpr",
    "canonicalize_mlir",
    "collective_census",
    "collective_traffic",
    "collectives",
    "first_difference",
    "primitive_census",
    "strip_metadata",
]

_HEADER = re.compile(r"^\s*(?:ENTRY\s+)?%?([^\s(]+)\s*\((.*)\)\s*->.*\{\s*$")


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


def collective_census(text: str) -> dict[str, int]:
    """How many collectives of each kind the program runs (async start/done pairs count once).

    Only kinds that occur are listed, e.g. ``{'all-gather': 22, 'all-reduce': 9}``.
    """
    counts = Counter(c.kind for c in collectives(text)[0])
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


def collective_traffic(text: str, num_devices: int | None = None) -> dict[str, Any]:
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
