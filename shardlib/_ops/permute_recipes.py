"""The recipes of the point-to-point ops, ``ppermute`` and ``shift`` (pure Python, no JAX).

Both keep the layout, so their spec is one shape spec (``'B/d M'``) that describes the value
before and after, like an all-reduce's; the pending axes of a partial sum pass through (a
permutation is linear). What can be checked without the mesh is checked here, once per
spec, axis and permutation; the indices against the axis size are checked when the op runs
(`check_pairs`), where the manual axes are known.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Mapping
from dataclasses import dataclass

from .._lang.op_spec import OpSpec
from .._lang.parsing import ShapeSpec, SpecError, as_str, is_identifier, refuse_reduced
from .recipe import Recipe

__all__ = ["PermuteRecipe", "ShiftRecipe", "check_pairs", "ppermute_recipe", "shift_recipe"]

Pairs = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class PermuteRecipe(Recipe):
    """``ppermute(spec, x, axis, perm)``: ``perm`` holds (source, destination) index pairs."""

    axis: str
    perm: Pairs

    def pairs(self, size: int) -> Pairs:
        """The (source, destination) pairs on an axis of ``size`` devices."""
        return self.perm

    def what(self) -> str:
        """How messages name the permutation: ``"perm=[(0, 1), (1, 0)]"``."""
        return f"perm={list(self.perm)}"


@dataclass(frozen=True)
class ShiftRecipe(PermuteRecipe):
    """``shift(spec, x, axis, offset, wrap)``: the pairs depend on the axis size."""

    offset: int
    wrap: bool

    def pairs(self, size: int) -> Pairs:
        if self.wrap:
            return tuple((i, (i + self.offset) % size) for i in range(size))
        return tuple((i, i + self.offset) for i in range(size) if 0 <= i + self.offset < size)

    def what(self) -> str:
        return f"offset={self.offset}, wrap={self.wrap}"


def _shape(op: str, text: str) -> OpSpec:
    """The op spec of a layout-keeping op: input and output are the one shape spec."""
    if "->" in text:
        raise SpecError(
            f"{op}: the spec is one shape spec, not 'a -> b': {op} keeps the layout, so the "
            "value before and after has the same spec",
            text,
            text.index("->"),
            width=2,
            hint=f"write the layout once, e.g. {op}('B/d M', x, ...)",
        )
    try:
        shape = ShapeSpec.parse(text)
        refuse_reduced(shape, text)
    except SpecError as e:
        raise e.with_context(op) from None
    return OpSpec(text, (shape,), shape, (None,))


def _axis(op: str, text: str, axis: object) -> str:
    """The one mesh axis ``axis`` names (a str such as ``'p'``)."""
    if not isinstance(axis, str):
        raise TypeError(
            f"{op}({text!r}): axis={axis!r} must name one mesh axis as a str such as 'p', got "
            f"{type(axis).__name__}"
        )
    if not is_identifier(axis):
        raise SpecError(
            f"{op}({text!r}): axis={axis!r} is not one mesh axis name; {op} permutes along one "
            "mesh axis (for several, call it once per axis)",
            axis,
        )
    return axis


def _pair(op: str, text: str, axis: str, k: int, pair: object) -> tuple[int, int]:
    """Entry ``k`` of a permutation as ``(source, destination)`` ints."""
    try:
        src, dst = pair  # type: ignore[misc]  # checked below
        if isinstance(src, bool) or isinstance(dst, bool):
            raise TypeError
        return operator.index(src), operator.index(dst)
    except (TypeError, ValueError):
        raise TypeError(
            f"{op}({text!r}) along {axis!r}: perm[{k}] = {pair!r} is not a (source index, "
            "destination index) pair of ints; perm is a list such as [(0, 1), (1, 0)]"
        ) from None


def _perm(op: str, text: str, axis: str, perm: object) -> Pairs:
    """``perm`` as a tuple of int pairs, each source and each destination at most once."""
    if isinstance(perm, str | bytes) or not hasattr(perm, "__iter__"):
        raise TypeError(
            f"{op}({text!r}) along {axis!r}: perm={perm!r} must be a list of (source index, "
            f"destination index) pairs such as [(0, 1), (1, 0)], got {type(perm).__name__}"
        )
    pairs = tuple(_pair(op, text, axis, k, p) for k, p in enumerate(perm))  # type: ignore[arg-type]
    for end, which in ((0, "source"), (1, "destination")):
        seen: dict[int, tuple[int, int]] = {}
        for p in pairs:
            if p[end] in seen:
                raise ValueError(
                    f"{op}({text!r}) along {axis!r}: perm has {which} {p[end]} twice, in "
                    f"{seen[p[end]]} and {p}; each device sends at most once and receives at "
                    "most once"
                )
            seen[p[end]] = p
    return pairs


def ppermute_recipe(spec: str | bytes, axis: object, perm: object) -> PermuteRecipe:
    """The recipe of ``ppermute(spec, x, axis, perm)``."""
    text = as_str(spec)
    name = _axis("ppermute", text, axis)
    return _ppermute_recipe(text, name, _perm("ppermute", text, name, perm))


@functools.lru_cache(maxsize=1024)
def _ppermute_recipe(text: str, axis: str, perm: Pairs) -> PermuteRecipe:
    ops = _shape("ppermute", text)
    return PermuteRecipe(ops, axis, perm, op="ppermute", needs=(axis,), why=_WHY)


def shift_recipe(spec: str | bytes, axis: object, offset: object, wrap: object) -> ShiftRecipe:
    """The recipe of ``shift(spec, x, axis, offset, wrap)``."""
    text = as_str(spec)
    name = _axis("shift", text, axis)
    if isinstance(offset, bool) or not hasattr(offset, "__index__"):
        raise TypeError(f"shift({text!r}): offset={offset!r} must be an int, such as 1 or -1")
    if not isinstance(wrap, bool):
        raise TypeError(f"shift({text!r}): wrap={wrap!r} must be True or False")
    return _shift_recipe(text, name, operator.index(offset), wrap)  # type: ignore[arg-type]


@functools.lru_cache(maxsize=1024)
def _shift_recipe(text: str, axis: str, offset: int, wrap: bool) -> ShiftRecipe:
    ops = _shape("shift", text)
    return ShiftRecipe(ops, axis, (), offset, wrap, op="shift", needs=(axis,), why=_WHY)


_WHY = "a permutation keeps the pending axes of its input"


def check_pairs(recipe: PermuteRecipe, manual: Mapping[str, int]) -> Pairs:
    """``recipe``'s pairs on the current mesh, after checking each index is on the axis."""
    size = manual[recipe.axis]
    pairs = recipe.pairs(size)
    for p in pairs:
        bad = [i for i in p if not 0 <= i < size]
        if bad:
            raise ValueError(
                f"{recipe.op}({recipe.text!r}): the pair {p} in {recipe.what()} names device {bad[0]} "
                f"along mesh axis {recipe.axis!r}, which has {size} devices; indices must be in "
                f"0..{size - 1}"
            )
    return pairs
