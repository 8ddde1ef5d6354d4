"""How messages write things: dtypes, shapes, values, mesh sizes, annotations, names.

One place for each so that every message writes a shape, a value or a function's name the
same way.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import numpy as np
from typeguard import TypeCheckError

from .._env import rules as _rules
from .._lang.parsing import ShapeSpec
from .types import dtype_short_name

__all__ = [
    "annotation_str",
    "describe_value",
    "dtype_name",
    "format_sizes",
    "is_array_like",
    "mismatch",
    "name_of",
    "naming_operands",
    "operand_name",
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


# While a failing typed_shard_map body is traced once more to name its operands: id(leaf) ->
# (the leaf, ``"w.wo, annotated f32['H D/t M']"``). None otherwise (every other trace).
_NAMES: contextvars.ContextVar[dict[int, tuple[Any, str]] | None] = contextvars.ContextVar(
    "shardlib_operand_names", default=None
)


@contextlib.contextmanager
def naming_operands(table: dict[int, tuple[Any, str]]) -> Iterator[None]:
    """Within: `operand_name` finds the values in ``table`` (set on the error path only)."""
    token = _NAMES.set(table)
    try:
        yield
    finally:
        _NAMES.reset(token)


def operand_name(value: Any) -> str | None:
    """Where ``value`` came from (``"w.wo, annotated f32['H D/t M']"``) if it is an argument
    of the typed_shard_map body being named, else None. Called only to write an error."""
    table = _NAMES.get()
    hit = table.get(id(value)) if table else None
    return hit[1] if hit is not None and hit[0] is value else None


def layout_hint(
    spec: ShapeSpec, shape: tuple[int, ...], manual: Mapping[str, int], bindings: Mapping[str, int]
) -> str | None:
    """What likely happened when a per-device block inside ``shard_map`` does not match
    ``spec``: a dim whose global size is the expected one divided by a manual axis size is
    still split over that axis (gather it first), one multiplied by the size of an axis its
    dim names is not split over it (a misplaced ``/t``). None when no dim reads that way.
    Called only to write an error."""
    if len(shape) != len(spec.dims):
        return None
    split: list[tuple[int, str]] = []  # (dim, axis): split over axis, spec does not say so
    whole: list[tuple[int, str]] = []  # (dim, axis): spec says split over axis, it is not
    for i, (d, n) in enumerate(zip(spec.dims, shape, strict=True)):
        factor = 1
        for a in d.sharding:
            factor *= manual.get(a, 1)
        expected = d.shape if isinstance(d.shape, int) else bindings.get(d.shape)
        got = n * factor
        if expected is None or got == expected:
            continue
        split += [(i, a) for a, k in manual.items() if a not in d.sharding and got * k == expected]
        whole += [(i, a) for a in d.sharding if got == expected * manual.get(a, 0)]
    dims = [str(d) for d in spec.dims]
    for i, a in whole:
        j = next((j for j, b in split if b == a), None)
        if j is not None:
            fixed = list(dims)
            fixed[i] = str(type(spec.dims[i])(spec.dims[i].shape, _drop(spec.dims[i].sharding, a)))
            fixed[j] = f"{dims[j]}/{a}"
            return (
                f"the /{a} looks misplaced: the value is split over {a!r} on dim {j} "
                f"{dims[j]!r}, not on dim {i} {dims[i]!r}; write {' '.join(fixed)!r} (or "
                f"move the split with shardops.all_to_all('{' '.join(fixed)} -> "
                f"{' '.join(dims)}', x))"
            )
    if split:
        j = split[0][0]
        used = {b for d in spec.dims for b in d.sharding}
        here = [b for k, b in split if k == j]
        a, *others = [b for b in here if b not in used] or here  # a free axis, most likely
        also = "".join(f" (or {b!r})" for b in others)
        fixed = list(dims)
        fixed[j] = f"{dims[j]}/{a}"
        was = " ".join(fixed)
        return (
            f"dim {j} {dims[j]!r} is {shape[j]} per device, {manual[a]} times smaller than "
            f"expected: the value is likely still split over {a!r}{also} on that dim; gather it "
            f"first, shardops.all_gather('{was} -> {' '.join(dims)}', x), or write {was!r} in "
            "the spec if it should stay split"
        )
    if whole:
        i, a = whole[0]
        fixed = list(dims)
        fixed[i] = str(type(spec.dims[i])(spec.dims[i].shape, _drop(spec.dims[i].sharding, a)))
        change = f"'{' '.join(fixed)} -> {' '.join(dims)}', x)"
        return (
            f"dim {i} {dims[i]!r} is {shape[i]} per device, {manual[a]} times larger than the "
            f"spec says: the value is not split over {a!r} there (already gathered, or is the "
            f"/{a} on the wrong dim?); write {' '.join(fixed)!r}, or take this device's part "
            f"first, shardops.reshard({change}; or, if it is a partial sum over {a!r} (e.g. from "
            f"einsum_unreduced), reduce-scatter it: shardops.psum_scatter({change}"
        )
    return None


def _drop(axes: tuple[str, ...], a: str) -> tuple[str, ...]:
    return tuple(b for b in axes if b != a)


def mismatch(where, dtype, spec, reasons, manual, mesh_sizes, bindings, hint) -> TypeCheckError:  # noqa: PLR0913
    """The one error listing every reason, with the mesh sizes and the bindings."""
    ctx = f"mesh axes: {format_sizes(mesh_sizes)}"
    if manual:
        ctx += (
            f"; inside shard_map, manual axes: {', '.join(manual)} (sizes above are "
            "global: per-device size × manual axis sizes)"
        )
    ctx += f"; bindings: {format_sizes(bindings) if bindings else 'none yet'}"
    written = _rules.origin(spec)
    if written is not None:  # a dim's reasons name it as written (its roles), then as resolved
        labels = [
            (f"dim {i} {str(d)!r}:", f"dim {i} {str(w)!r} (resolved: {str(d)!r}):")
            for i, (w, d) in enumerate(zip(written.dims, spec.dims, strict=True))
            if str(w) != str(d)
        ]
        reasons = [
            next((new + r[len(old) :] for old, new in labels if r.startswith(old)), r)
            for r in reasons
        ]
    body = "\n".join(f"  - {r}" for r in reasons)
    prefix = f"{where} does not match" if where else "does not match"
    likely = f"\n  Likely: {hint}" if hint else ""
    expected = annotation_str(dtype, spec)
    if written is not None:
        expected = (
            f"{annotation_str(dtype, written)} (under the axis rules in force "
            f"{expected}: {_rules.roles_note(written)})"
        )
    return TypeCheckError(f"{prefix} {expected}:\n{body}{likely}\n  ({ctx})")
