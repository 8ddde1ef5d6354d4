"""How messages write things: dtypes, shapes, values, mesh sizes, annotations, names.

One place for each so that every message writes a shape, a value or a function's name the
same way.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from .._lang.parsing import ShapeSpec
from .types import dtype_short_name

__all__ = [
    "annotation_str",
    "describe_value",
    "dtype_name",
    "format_sizes",
    "is_array_like",
    "name_of",
    "shape_str",
    "short_value",
]


def name_of(t: Any) -> str:
    """``'Model.apply'``: a function's or class's qualified name, else its repr."""
    return getattr(t, "__qualname__", None) or repr(t)


def dtype_name(dtype: Any) -> str:
    """``'float32'``: NumPy's name of ``dtype``."""
    try:
        return np.dtype(dtype).name
    except TypeError:
        return str(dtype)


def shape_str(shape: Iterable[int]) -> str:
    """``'[8, 2]'``."""
    return "[" + ", ".join(str(n) for n in shape) + "]"


def byte_str(n: float, digits: int = 2) -> str:
    """``'1.50 KiB'``: a byte count in the largest binary unit it reaches."""
    for unit, k in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= k:
            return f"{n / k:.{digits}f} {unit}"
    return f"{int(n)} B"


def format_sizes(sizes: Mapping[str, int]) -> str:
    """``'d=2, t=4'`` (``'none'`` when empty)."""
    return ", ".join(f"{k}={v}" for k, v in sizes.items()) if sizes else "none"


def annotation_str(dtype: Any, spec: ShapeSpec) -> str:
    """``f32['a b']``, or ``spec 'a b'`` when no dtype is checked."""
    if dtype is None:
        return f"spec {str(spec)!r}"
    return f"{dtype_short_name(dtype)}[{str(spec)!r}]"


def is_array_like(x: Any) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype")


def short_value(x: Any) -> str:
    """``f32[8, 2]`` for an array, else the type name."""
    if is_array_like(x):
        return f"{dtype_short_name(x.dtype)}{shape_str(x.shape)}"
    return type(x).__name__


def describe_value(value: Any) -> str:
    """A one-line description of a value that is not an array, for messages."""
    kind = type(value).__name__
    if isinstance(value, tuple | list | dict):
        n = len(value)
        items = list(value.values() if isinstance(value, dict) else value)
        shown = ", ".join(short_value(v) for v in items[:4]) + (", ..." if n > 4 else "")
        return f"{kind} of {n} item{'s' if n != 1 else ''}" + (f" ({shown})" if n else "")
    text = " ".join(repr(value).split())
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{kind} {text}"
