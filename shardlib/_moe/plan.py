"""Capacity arithmetic, all-to-all bytes and argument rules of the MoE layer (pure Python).

Each rule returns the text of a shardlib error (function, argument, dimension, expected and
actual value, and what to do) or ``None``; the JAX side raises it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .._lang.fixes import manual_axis_error

__all__ = [
    "MOE_SCOPE_PREFIX",
    "MoeScope",
    "all_to_all_bytes",
    "axis_error",
    "capacity",
    "capacity_error",
    "dropless_capacity",
    "experts_error",
    "gate_error",
    "k_error",
    "moe_scope",
    "parse_moe_scopes",
    "shape_error",
]

GATES = ("softmax", "sigmoid")

# A layer runs under the named scope
# f"{MOE_SCOPE_PREFIX}[axis=A e=SIZE E=EXPERTS C=CAPACITY k=K M=WIDTH itemsize=BYTES]",
# which `shardlib.explain` reads back (`parse_moe_scopes`).
MOE_SCOPE_PREFIX = "shardlib.moe.layer"
_SCOPE = re.compile(
    re.escape(MOE_SCOPE_PREFIX)
    + r"\[axis=(\w+) e=(\d+) E=(\d+) C=(\d+) k=(\d+) M=(\d+) itemsize=(\d+)\]"
)


@dataclass(frozen=True)
class MoeScope:
    """One MoE layer's dispatch, as its scope names it (per device)."""

    axis: str  # the expert mesh axis
    e: int  # its size
    experts: int  # E
    capacity: int  # C, slots per expert per device
    k: int  # experts per token
    width: int  # M, the token width
    itemsize: int  # bytes per element of the tokens

    @property
    def all_to_all_bytes(self) -> int:
        """Bytes one device sends in one dispatch (or combine) all-to-all."""
        return all_to_all_bytes(self.experts, self.capacity, self.width, self.itemsize, self.e)

    def text(self) -> str:
        """The named scope of this layer."""
        return (
            f"{MOE_SCOPE_PREFIX}[axis={self.axis} e={self.e} E={self.experts} "
            f"C={self.capacity} k={self.k} M={self.width} itemsize={self.itemsize}]"
        )


def moe_scope(axis: str, e: int, experts: int, cap: int, k: int, width: int, itemsize: int) -> str:
    """The named scope a layer runs under.

    Examples:
        >>> moe_scope("e", 4, 8, 20, 2, 64, 4)
        'shardlib.moe.layer[axis=e e=4 E=8 C=20 k=2 M=64 itemsize=4]'
    """
    return MoeScope(axis, e, experts, cap, k, width, itemsize).text()


def parse_moe_scopes(name_stack: str) -> list[tuple[str, MoeScope]]:
    """The layers whose scopes appear in ``name_stack``, outermost first, each with the text
    of its scope.

    Examples:
        >>> [s for _, s in parse_moe_scopes("jvp(" + moe_scope("e", 4, 8, 20, 2, 64, 4) + ")")]
        [MoeScope(axis='e', e=4, experts=8, capacity=20, k=2, width=64, itemsize=4)]
    """
    return [
        (m.group(0), MoeScope(m.group(1), *map(int, m.groups()[1:])))
        for m in _SCOPE.finditer(name_stack)
    ]


def capacity(tokens: int, k: int, experts: int, factor: float) -> int:
    """Slots per expert that one device's ``tokens`` may fill: ``ceil(factor * tokens * k / E)``.

    Examples:
        >>> capacity(64, 2, 8, 1.25)
        20
    """
    return math.ceil(factor * tokens * k / experts)


def dropless_capacity(tokens: int) -> int:
    """The capacity that drops nothing: a token picks ``k`` distinct experts, so no expert
    receives more than ``tokens`` of one device's tokens.

    Examples:
        >>> dropless_capacity(64)
        64
    """
    return tokens


def all_to_all_bytes(experts: int, cap: int, width: int, itemsize: int, e: int) -> int:
    """Bytes one device sends in one dispatch (or combine) all-to-all: its ``(E, C, M)``
    buffer but the ``1/e`` that stays home, ``E * C * M * itemsize * (e - 1) / e``.

    Examples:
        >>> all_to_all_bytes(8, 20, 64, 4, 4)
        30720
    """
    return experts * cap * width * itemsize * (e - 1) // e


def axis_error(
    fn: str, arg: str, axis: Any, manual: Mapping[str, int], mesh: Mapping[str, int]
) -> str | None:
    """Why ``axis`` cannot be the expert (or hidden) axis: it must be a manual mesh axis."""
    must = "name a mesh axis that is manual here"
    return manual_axis_error(fn, arg, axis, manual, mesh, must=must, example="e")


def experts_error(fn: str, experts: int, axis: str, e: int) -> str | None:
    """The number of experts must divide evenly over the ``e`` devices of the expert axis."""
    if experts % e == 0:
        return None
    return (
        f"{fn}: argument `router_logits` dim -1 (experts) must be divisible by the size of "
        f"mesh axis {axis!r} ({e}); got {experts} experts: use a multiple of {e} experts or a "
        "smaller expert axis"
    )


def k_error(fn: str, k: Any, experts: int) -> str | None:
    """``k`` is a positive int no larger than the number of experts."""
    if isinstance(k, int) and 1 <= k <= experts:
        return None
    return (
        f"{fn}: argument `k` (experts per token) must be an int in 1..{experts} (the "
        f"experts, dim -1 of the router logits); got {k!r}"
    )


def capacity_error(fn: str, cap: Any, factor: Any) -> str | None:
    """The capacity (given, or from the factor) is at least one token."""
    if cap is not None:
        if isinstance(cap, int) and cap >= 1:
            return None
        return (
            f"{fn}: argument `capacity` (slots per expert per device) must be an int >= 1; "
            f"got {cap!r}"
        )
    if not isinstance(factor, int | float) or factor <= 0:
        return f"{fn}: argument `capacity_factor` must be a number > 0; got {factor!r}"
    return None


def shape_error(fn: str, arg: str, dim: str, expected: int, actual: int, hint: str) -> str | None:
    """One dim of one argument against the size the other arguments give it."""
    if expected == actual:
        return None
    return f"{fn}: argument `{arg}` dim {dim} must be {expected} ({hint}); got {actual}"


def gate_error(fn: str, gate: Any) -> str | None:
    """The gate is one of `GATES`."""
    if gate in GATES:
        return None
    return f"{fn}: argument `gate` must be one of {', '.join(map(repr, GATES))}; got {gate!r}"
