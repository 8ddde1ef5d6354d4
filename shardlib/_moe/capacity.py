"""Capacity arithmetic, all-to-all bytes and argument rules of the MoE layer (pure Python).

Each rule returns the text of a shardlib error (function, argument, dimension, expected and
actual value, and what to do) or ``None``; the JAX side raises it.
"""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Mapping
from fractions import Fraction
from typing import Any

from .._lang.fixes import manual_axis_error

__all__ = [
    "all_to_all_bytes",
    "as_int",
    "axis_error",
    "capacity",
    "capacity_error",
    "dropless_capacity",
    "exact_fraction",
    "experts_error",
    "factor_error",
    "gate_error",
    "int_error",
    "k_error",
    "shape_error",
]

GATES = ("softmax", "sigmoid")


def int_error(fn: str, arg: str, value: Any, what: str, low: int = 1) -> str | None:
    """``value`` is an integer (a Python or NumPy one, not a bool) ``>= low``."""
    if is_int(value) and operator.index(value) >= low:
        return None
    return f"{fn}: argument `{arg}` ({what}) must be an int >= {low}; got {value!r}{_kind(value)}"


def _kind(value: Any) -> str:
    """`` (float)`` after a value that is no int, so that ``got 2.0`` reads as refused."""
    return "" if is_int(value) else f" ({type(value).__name__})"


def is_int(value: Any) -> bool:
    """A Python or NumPy integer; not a bool (True is not a count; NumPy's bool is no
    ``numbers.Integral``)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def as_int(fn: str, arg: str, value: Any, what: str, low: int = 1) -> int:
    """``value`` as a Python int, or ``ValueError`` naming the function and the argument."""
    bad = int_error(fn, arg, value, what, low)
    if bad:
        raise ValueError(bad)
    return operator.index(value)


def factor_error(fn: str, factor: Any, arg: str = "capacity_factor") -> str | None:
    """The capacity factor is a finite real number > 0 (not a bool)."""
    if isinstance(factor, numbers.Real) and not isinstance(factor, bool):
        value = float(factor)
        if math.isfinite(value) and value > 0:
            return None
    return (
        f"{fn}: argument `{arg}` must be a number > 0 and finite (the slots per "
        f"expert over a balanced router's share, e.g. 1.25); got {factor!r}"
    )


def exact_fraction(value: numbers.Real | float) -> Fraction:
    """A number as the user wrote it, exactly: an int or a rational as itself, a float by its
    shortest decimal repr (``1.1`` is 11/10, not the binary double just above it)."""
    if isinstance(value, numbers.Rational):
        return Fraction(int(value.numerator), int(value.denominator))
    return Fraction(str(value))  # repr of a float (or a NumPy float): its shortest decimal


def capacity(tokens: int, k: int, experts: int, factor: float) -> int:
    """Slots per expert that one device's ``tokens`` may fill: ``ceil(factor * tokens * k / E)``,
    computed exactly with ``factor`` as written (its decimal repr: ``1.1`` is 11/10), so no
    floating-point rounding moves the ceiling (``capacity(25, 2, 5, 1.1)`` is 11).

    **Raises:** ``ValueError`` naming the argument: ``tokens``, ``k``, ``experts`` not ints
    ``>= 1`` (NumPy ints are fine, bools and floats are not), ``k > experts``, a
    ``factor`` that is not a finite number > 0.

    Examples:
        >>> capacity(64, 2, 8, 1.25)
        20
        >>> capacity(25, 2, 5, 1.1)
        11
    """
    fn = "moe.capacity"
    tokens = as_int(fn, "tokens", tokens, "tokens per device")
    k = as_int(fn, "k", k, "experts per token")
    experts = as_int(fn, "experts", experts, "number of experts")
    if k > experts:
        raise ValueError(
            f"{fn}: argument `k` (experts per token) must be at most `experts` ({experts}); got {k}"
        )
    bad = factor_error(fn, factor, "factor")
    if bad:
        raise ValueError(bad)
    f = exact_fraction(factor) * tokens * k / experts
    return -(-f.numerator // f.denominator)  # the exact ceiling


def dropless_capacity(tokens: int) -> int:
    """The capacity that drops nothing: a token picks ``k`` distinct experts, so no expert
    receives more than ``tokens`` of one device's tokens.

    **Raises:** ``ValueError`` when ``tokens`` is not an int ``>= 1``.

    Examples:
        >>> dropless_capacity(64)
        64
    """
    return as_int("moe.dropless_capacity", "tokens", tokens, "tokens per device")


def all_to_all_bytes(experts: int, cap: int, width: int, itemsize: int, e: int) -> int:
    """Bytes one device sends in one dispatch (or combine) all-to-all: its ``(E, C, M)``
    buffer but the ``1/e`` that stays home, ``E * C * M * itemsize * (e - 1) / e``.

    **Raises:** ``ValueError`` naming the argument: any of them not an int ``>= 1`` (NumPy
    ints are fine), or ``experts`` not divisible by ``e``.

    Examples:
        >>> all_to_all_bytes(8, 20, 64, 4, 4)
        30720
    """
    fn = "moe.all_to_all_bytes"
    experts = as_int(fn, "experts", experts, "number of experts")
    cap = as_int(fn, "cap", cap, "slots per expert per device")
    width = as_int(fn, "width", width, "token width M")
    itemsize = as_int(fn, "itemsize", itemsize, "bytes per element")
    e = as_int(fn, "e", e, "size of the expert axis")
    if experts % e:
        raise ValueError(
            f"{fn}: argument `experts` must be divisible by `e` ({e}), as the layer's experts "
            f"are split over the expert axis; got {experts}"
        )
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
    if is_int(k) and 1 <= operator.index(k) <= experts:
        return None
    return (
        f"{fn}: argument `k` (experts per token) must be an int in 1..{experts} (the "
        f"experts, dim -1 of the router logits); got {k!r}{_kind(k)}"
    )


def capacity_error(fn: str, cap: Any, factor: Any) -> str | None:
    """The capacity (given, or from the factor) is at least one token."""
    if cap is not None:
        return int_error(fn, "capacity", cap, "slots per expert per device")
    return factor_error(fn, factor)


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
