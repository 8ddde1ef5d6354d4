"""Resolving a function's annotations without reading its source.

``typing.get_type_hints`` finds names in the function's module. Names local to the function
that applied the decorator are found in two more places: the function's closure cells
(an annotation evaluated at definition time that names an enclosing local puts it there),
and, for string annotations (``from __future__ import annotations``) which Python does not
keep in the closure, the decorating frame's locals, read once by the decorator when the
first two do not suffice (`shardlib._env.frames.frame_locals`).
"""

from __future__ import annotations

import contextlib
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["closure_names", "resolve_hints", "unresolved"]


def closure_names(f: Callable) -> dict[str, Any]:
    """The names ``f`` closes over, with their current values (empty cells left out)."""
    code = getattr(f, "__code__", None)
    cells = getattr(f, "__closure__", None)
    if code is None or not cells:
        return {}
    out: dict[str, Any] = {}
    for name, cell in zip(code.co_freevars, cells, strict=False):
        with contextlib.suppress(ValueError):  # an empty cell: the name is not assigned yet
            out[name] = cell.cell_contents
    return out


def resolve_hints(
    f: Callable, extra: Mapping[str, Any] | None = None, *, include_extras: bool = False
) -> dict[str, Any]:
    """``f``'s annotations, evaluated in its module, its closure and ``extra`` (in that order
    of precedence: closure, then ``extra``, then module). Raises ``NameError``."""
    inner = f
    while hasattr(inner, "__wrapped__"):
        inner = inner.__wrapped__  # type: ignore[attr-defined]
    localns = {**(extra or {}), **closure_names(inner)}
    return typing.get_type_hints(f, localns=localns or None, include_extras=include_extras)


def unresolved(f: Callable, extra: Mapping[str, Any] | None = None) -> tuple[str, str] | None:
    """``(what, name)`` for the first annotation of ``f`` naming an undefined ``name``.

    ``what`` is ``parameter 'x'`` or ``the return type``; None if all resolve.
    """
    inner = f
    while hasattr(inner, "__wrapped__"):
        inner = inner.__wrapped__  # type: ignore[attr-defined]
    globalns = getattr(inner, "__globals__", {})
    localns = {**(extra or {}), **closure_names(inner)}
    for key, ann in getattr(inner, "__annotations__", {}).items():
        holder = types.SimpleNamespace(__annotations__={key: ann})
        try:
            typing.get_type_hints(holder, globalns, localns)
        except NameError as e:
            what = "the return type" if key == "return" else f"parameter {key!r}"
            return what, getattr(e, "name", None) or str(e)
    return None
