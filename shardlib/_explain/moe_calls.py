"""The report's mixture-of-experts section: the two all-to-alls of each MoE layer, and its load.

`shardlib.moe.layer` runs under a `shardlib._lang.scope_codec.MoeLayerScope` (expert axis
and its size, experts ``E``, capacity ``C``, ``k``, token width ``M``, itemsize). During the walk
(`shardlib._explain.sections.enter` and ``tag``), every layer call becomes a `MoeCall`: how many
times it runs (the layers of a ``scan``) and the bytes of the all-to-alls in its scope, forward
(dispatch, combine) and backward (their transposes), to hold against the capacity arithmetic
(`shardlib._moe.capacity.all_to_all_bytes`). The expert load is run-time data: `load_lines` draws
the histogram of a `shardlib.moe.Stats.load` the user passes (`ExplainReport.expert_load`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._check.format import byte_str
from .._lang.scope_codec import MoeLayerScope
from .._moe.capacity import all_to_all_bytes

__all__ = ["MoeCall", "enter", "load_lines", "moe_lines", "short_lines", "tag"]

_BAR = 40  # characters of the longest bar of the load histogram


@dataclass(frozen=True)
class MoeCall:
    """One ``shardlib.moe.layer`` call in the program (per device).

    ``runs``: times the layer runs per call of f (layers of a ``scan``). ``forward_bytes`` and
    ``backward_bytes``: bytes one device sends in the layer's all-to-alls over its expert axis,
    all runs (forward: dispatch and combine; backward: their transposes); ``forward_calls`` and
    ``backward_calls`` count those all-to-alls (2 per run each way, 0 for a pass not in the
    program).
    """

    scope: MoeLayerScope  # axis, e, experts, capacity, k, width, itemsize
    location: str
    runs: int = 1
    forward_bytes: int = 0
    backward_bytes: int = 0
    forward_calls: int = 0
    backward_calls: int = 0

    @property
    def formula_bytes(self) -> int:
        """One all-to-all's bytes by the capacity arithmetic (`shardlib.moe.all_to_all_bytes`)."""
        s = self.scope
        return all_to_all_bytes(s.experts, s.capacity, s.width, s.itemsize, s.e)

    @property
    def matches_formula(self) -> bool:
        """Every all-to-all found sends the formula's bytes, two per run in each pass present."""
        return all(
            calls in (0, 2 * self.runs) and sent == calls * self.formula_bytes
            for calls, sent in (
                (self.forward_calls, self.forward_bytes),
                (self.backward_calls, self.backward_bytes),
            )
        )


def enter(calls: list[MoeCall], stack: str, prefix: str, mult: int, loc: str) -> None:
    """Record the MoE layers an equation opens (its ``stack`` has the scope, its enclosing
    ``prefix`` does not): ``mult`` is how many times the layer runs."""
    for text, scope in MoeLayerScope.find(stack):
        if text in prefix:
            continue
        i = _find(calls, scope, loc)
        calls[i] = dataclasses.replace(calls[i], runs=max(calls[i].runs, mult))


def tag(row: Any, stack: str, calls: list[MoeCall]) -> None:
    """Add ``row`` (a `CollectiveCall`) to its MoE layer where it is an all-to-all over the
    layer's expert axis inside the layer's scope."""
    scopes = MoeLayerScope.find(stack)
    if not scopes or row.kind != "all-to-all" or row.axes != (scopes[-1][1].axis,):
        return
    i = _find(calls, scopes[-1][1], row.location)
    c, back = calls[i], row.backward
    calls[i] = dataclasses.replace(
        c,
        forward_bytes=c.forward_bytes + (0 if back else row.total_sent),
        backward_bytes=c.backward_bytes + (row.total_sent if back else 0),
        forward_calls=c.forward_calls + (0 if back else row.calls),
        backward_calls=c.backward_calls + (row.calls if back else 0),
    )


def _find(calls: list[MoeCall], scope: MoeLayerScope, loc: str) -> int:
    """The index of the call of ``scope`` at ``loc`` in ``calls`` (appended if new)."""
    for i, c in enumerate(calls):
        if (c.scope, c.location) == (scope, loc):
            return i
    calls.append(MoeCall(scope, loc))
    return len(calls) - 1


# -- text -----------------------------------------------------------------------------------------


def moe_lines(calls: list[MoeCall], table: Any) -> list[str]:
    """The MoE table: one row per ``moe.layer`` call (``table``: the report's table maker)."""
    lines = [
        "Mixture of experts (shardlib.moe; per device: bytes sent, all runs; per run, forward: "
        "dispatch and combine all-to-alls, backward: their transposes; formula: one all-to-all, "
        "moe.all_to_all_bytes(E, C, M, itemsize, e))"
    ]

    def way(c: MoeCall, backward: bool) -> str:
        n = c.backward_calls if backward else c.forward_calls
        sent = c.backward_bytes if backward else c.forward_bytes
        return "-" if not n else f"{n // c.runs} x {byte_str(sent // n, 1)} = {byte_str(sent, 1)}"

    rows = [
        (
            f"{c.scope.axis} ({c.scope.e})",
            str(c.scope.experts),
            str(c.scope.capacity),
            str(c.scope.k),
            f"x{c.runs}",
            way(c, False),
            way(c, True),
            byte_str(c.formula_bytes, 1),
            "yes" if c.matches_formula else "NO",
            c.location,
        )
        for c in calls
    ]
    head = ("axis", "experts E", "capacity C", "k", "runs", "forward", "backward", "formula")
    return lines + table((*head, "= formula", "source"), rows, right={1, 2, 3, 4, 5, 6, 7})


def short_lines(calls: list[MoeCall]) -> list[str]:
    """One line per MoE layer for `ExplainReport.short`."""
    return [
        f"  moe.layer over {c.scope.axis} (E={c.scope.experts}, C={c.scope.capacity}) "
        f"x{c.runs}: all-to-alls {byte_str(c.forward_bytes, 1)} forward, "
        f"{byte_str(c.backward_bytes, 1)} backward"
        for c in calls
    ]


def load_lines(calls: list[MoeCall], load: Any) -> list[str]:
    """The histogram of an expert load (``moe.Stats.load``: pairs routed to each expert; any
    leading dims, devices or layers, summed), with its share per device of the expert axis."""
    fn = "ExplainReport.expert_load"
    arr = np.asarray(load)
    experts = sorted({c.scope.experts for c in calls})
    if arr.ndim == 0 or (experts and arr.shape[-1] not in experts):
        want = " or ".join(map(str, experts)) or "the number of experts"
        got = arr.shape[-1] if arr.ndim else "a scalar"
        raise ValueError(
            f"{fn}: argument `load` dim -1 (experts) must be {want} (the experts of the "
            f"report's MoE layers); got {got}: pass moe.Stats.load (shape (E,), or (..., E))"
        )
    if not np.issubdtype(arr.dtype, np.integer) or (arr < 0).any():
        raise ValueError(
            f"{fn}: argument `load` must hold counts (integers >= 0, moe.Stats.load); got "
            f"dtype {arr.dtype}, min {arr.min()}"
        )
    per = arr.reshape(-1, arr.shape[-1]).sum(axis=0)
    total, top = int(per.sum()), int(per.max())
    lines = [f"Expert load ((token, choice) pairs routed to each expert, before drops; {total})"]
    for j, n in enumerate(per.tolist()):
        bar = "#" * (round(_BAR * n / top) if top else 0)
        lines.append(f"  expert {j:>3}  {n:>8}  {n / max(total, 1):6.1%}  {bar}")
    mean = total / len(per)
    lines.append(f"  max / mean: {top / mean if mean else 0.0:.2f} (1.00: even)")
    sizes = {(c.scope.axis, c.scope.e) for c in calls if c.scope.experts == len(per)}
    for axis, e in sorted(sizes):
        dev = per.reshape(e, -1).sum(axis=1).tolist()
        cells = ", ".join(f"{d}: {n}" for d, n in enumerate(dev))
        lines.append(f"  per device of {axis} (experts {len(per) // e} each): {cells}")
    return lines
