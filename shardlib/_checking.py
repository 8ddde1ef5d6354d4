"""Checking values against shape specs: dtype, rank, sizes, bindings and actual sharding.

Checkers collect every *reason* a value does not match; the public entry point assembles
them into one ``typeguard.TypeCheckError`` that names the annotation, each offending dim,
expected vs actual, the mesh axis sizes and the current bindings.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, NamedSharding
from typeguard import TypeCheckError

from . import _context
from ._parsing import ShapeSpec, did_you_mean
from ._scopes import Scope

__all__ = ["check", "check_value", "canonical_layout", "format_layout"]


@dataclass(frozen=True)
class Where:
    """Where a check happens, for messages: e.g. ``argument 'x' of f()``."""

    what: str = "value"

    def __str__(self) -> str:
        return self.what


def _dtype_name(dtype: Any) -> str:
    try:
        return np.dtype(dtype).name
    except TypeError:
        return str(dtype)


def annotation_str(dtype: Any, spec: ShapeSpec) -> str:
    from ._types import dtype_short_name

    return f"{dtype_short_name(dtype)}[{str(spec)!r}]"


def format_sizes(sizes: Mapping[str, int]) -> str:
    return ", ".join(f"{k}={v}" for k, v in sizes.items()) if sizes else "none"


def canonical_layout(
    entries: Iterable[Any], sizes: Mapping[str, int]
) -> tuple[tuple[str, ...], ...]:
    """A PartitionSpec's entries with size-1 axes and trailing replicated dims removed."""
    out: list[tuple[str, ...]] = []
    for e in entries:
        if e is None:
            axes: tuple[str, ...] = ()
        elif isinstance(e, str):
            axes = (e,)
        else:
            try:
                axes = tuple(a for a in e if isinstance(a, str))
            except TypeError:  # P.UNCONSTRAINED and friends
                axes = ()
        out.append(tuple(a for a in axes if sizes.get(a, 0) != 1))
    while out and not out[-1]:
        out.pop()
    return tuple(out)


def format_layout(layout: tuple[tuple[str, ...], ...], ndim: int) -> str:
    entries = []
    for i in range(ndim):
        axes = layout[i] if i < len(layout) else ()
        if not axes:
            entries.append("None")
        elif len(axes) == 1:
            entries.append(repr(axes[0]))
        else:
            entries.append(repr(axes))
    return f"P({', '.join(entries)})"


def _is_array_like(x: Any) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype")


def check_value(
    value: Any,
    dtype: Any,
    spec: ShapeSpec,
    scope: Scope,
    *,
    where: str = "value",
    check_sharding: bool = True,
) -> None:
    """Check ``value`` against ``dtype[spec]`` in ``scope``; bind new names on success.

    Raises ``typeguard.TypeCheckError`` listing every mismatch.
    """
    ann = annotation_str(dtype, spec)
    if not _is_array_like(value):
        raise TypeCheckError(
            f"{where}: expected an array matching {ann}, got {type(value).__name__} {value!r:.80}"
        )
    reasons: list[str] = []
    if dtype is not None and np.dtype(value.dtype) != np.dtype(dtype):
        reasons.append(
            f"dtype: expected {_dtype_name(dtype)}, got {_dtype_name(value.dtype)}"
            " (cast with .astype())"
        )
    shape = tuple(value.shape)
    manual = _context.manual_axis_sizes()
    inside = bool(manual)
    if inside:
        mesh_sizes = _context.mesh_axis_sizes()
    else:
        mesh_sizes = _mesh_sizes_for_value(value)
    new_bindings: dict[str, int] = {}
    if len(shape) != len(spec.dims):
        reasons.append(
            f"rank: expected {len(spec.dims)} dim{'s' if len(spec.dims) != 1 else ''} "
            f"({spec or 'a scalar'}), got shape {shape}"
        )
    else:
        for i, (d, n) in enumerate(zip(spec.dims, shape, strict=True)):
            label = f"dim {i} {str(d)!r}"
            known = manual if inside else mesh_sizes
            unknown = [a for a in d.sharding if known and a not in known]
            if unknown:
                a = unknown[0]
                axes_here = "manual axes of the enclosing shard_map" if inside else "mesh axes"
                reasons.append(
                    f"{label}: {a!r} is not one of the {axes_here} ({format_sizes(known)})"
                    f"{did_you_mean(a, known)}"
                )
                continue
            if inside:
                factor = math.prod(manual.get(a, 1) for a in d.sharding)
                global_n = n * factor
                how = (
                    f"{global_n} (per-device {n} × "
                    + " × ".join(f"{a}={manual[a]}" for a in d.sharding if a in manual)
                    + ")"
                    if factor != 1
                    else str(n)
                )
            else:
                factor = math.prod(mesh_sizes.get(a, 1) for a in d.sharding)
                global_n = n
                how = str(n)
                if factor > 1 and n % factor:
                    reasons.append(
                        f"{label}: size {n} is not divisible by "
                        + " × ".join(f"{a}={mesh_sizes[a]}" for a in d.sharding)
                        + f" = {factor}"
                    )
                    continue
            if isinstance(d.shape, int):
                if global_n != d.shape:
                    reasons.append(f"{label}: expected size {d.shape}, got {how}")
            else:
                bound = scope.bindings.get(d.shape, new_bindings.get(d.shape))
                if bound is None:
                    new_bindings[d.shape] = global_n
                elif bound != global_n:
                    reasons.append(f"{label}: {d.shape} is bound to {bound} here, got {how}")
    if not reasons and check_sharding and not inside:
        r = _sharding_reason(value, spec, ann, where)
        if r:
            reasons.append(r)
    if reasons:
        ctx = f"mesh axes: {format_sizes(mesh_sizes)}"
        if inside:
            ctx += f" (manual: {', '.join(manual)}; shapes above are global = per-device × axes)"
        bindings = {**scope.bindings}
        ctx += f"; bindings: {format_sizes(bindings) if bindings else 'none yet'}"
        body = "\n".join(f"  - {r}" for r in reasons)
        prefix = f"{where} does not match" if where else "does not match"
        raise TypeCheckError(f"{prefix} {ann}:\n{body}\n  ({ctx})")
    scope.bindings.update(new_bindings)


def _mesh_sizes_for_value(value: Any) -> dict[str, int]:
    sh = getattr(value, "sharding", None) if not isinstance(value, jax.core.Tracer) else None
    if isinstance(sh, NamedSharding):
        return _context.mesh_axis_sizes(sh.mesh)
    if isinstance(value, jax.core.Tracer):
        try:
            s = jax.typeof(value).sharding
            if isinstance(s, NamedSharding) and not s.mesh.empty:
                return _context.mesh_axis_sizes(s.mesh)
        except Exception:
            pass
    return _context.mesh_axis_sizes()


def _sharding_reason(value: Any, spec: ShapeSpec, ann: str, where: str) -> str | None:
    """Compare the value's actual layout with the annotation's (outside shard_map)."""
    ndim = len(spec.dims)
    if isinstance(value, jax.core.Tracer):
        return _tracer_sharding_reason(value, spec, ann, where)
    sh = getattr(value, "sharding", None)
    if sh is None:  # numpy arrays and other host values have no layout to check
        return None
    if isinstance(sh, NamedSharding):
        sizes = _context.mesh_axis_sizes(sh.mesh)
        actual = canonical_layout(sh.spec, sizes)
    else:
        mesh = _context.concrete_mesh()
        if mesh is None:
            return None  # a single-device value and no mesh in force: nothing to compare
        sizes = _context.mesh_axis_sizes(mesh)
        if sh.is_fully_replicated:
            actual = ()
        else:
            try:
                if sh.is_equivalent_to(NamedSharding(mesh, spec.partition_spec()), ndim):
                    return None
            except Exception:
                pass
            return _layout_message(ann, spec, None, sizes, ndim, str(sh))
    expected = canonical_layout(spec.partition_entries(), sizes)
    if expected != actual:
        return _layout_message(ann, spec, actual, sizes, ndim)
    return None


def _layout_message(ann, spec, actual, sizes, ndim, actual_text=None) -> str:
    exp = format_layout(canonical_layout(spec.partition_entries(), sizes), ndim)
    act = actual_text if actual_text is not None else format_layout(actual, ndim)
    return (
        f"layout: the annotation wants {exp} but the array is laid out as {act} "
        f"on mesh ({format_sizes(sizes)}); move it with "
        f"jax.device_put(x, NamedSharding(mesh, {exp})) or jax.reshard"
    )


def _tracer_sharding_reason(value: Any, spec: ShapeSpec, ann: str, where: str) -> str | None:
    try:
        aval_sharding = jax.typeof(value).sharding
    except Exception:
        return None
    am = getattr(aval_sharding, "mesh", None)
    if am is not None and not am.empty:
        types = _context.axis_types(am)
        if all(t == AxisType.Explicit for t in types.values()):
            sizes = _context.mesh_axis_sizes(am)
            actual = canonical_layout(aval_sharding.spec, sizes)
            expected = canonical_layout(spec.partition_entries(), sizes)
            if actual != expected:
                return _layout_message(ann, spec, actual, sizes, len(spec.dims))
            return None
    # Auto axes (or no mesh in the type): the layout is chosen by the compiler, so ask it.
    _defer_sharding_check(value, spec, ann, where)
    return None


def _defer_sharding_check(value: Any, spec: ShapeSpec, ann: str, where: str) -> None:
    mesh = _context.concrete_mesh()
    ndim = len(spec.dims)

    def callback(sharding: Any) -> None:
        if isinstance(sharding, NamedSharding):
            sizes = _context.mesh_axis_sizes(sharding.mesh)
            actual = canonical_layout(sharding.spec, sizes)
            if actual != canonical_layout(spec.partition_entries(), sizes):
                raise TypeCheckError(
                    f"{where} does not match {ann}:\n  - "
                    + _layout_message(ann, spec, actual, sizes, ndim)
                    + "\n  (checked at compile time: the mesh axes are Auto)"
                )
            return
        if mesh is None:
            return
        ok = (
            sharding.is_fully_replicated
            if not spec.mesh_axes()
            else sharding.is_equivalent_to(NamedSharding(mesh, spec.partition_spec()), ndim)
        )
        if not ok:
            sizes = _context.mesh_axis_sizes(mesh)
            raise TypeCheckError(
                f"{where} does not match {ann}:\n  - "
                + _layout_message(ann, spec, None, sizes, ndim, str(sharding))
                + "\n  (checked at compile time: the mesh axes are Auto)"
            )

    try:
        jax.debug.inspect_array_sharding(value, callback=callback)
    except Exception:  # e.g. under vmap: no layout to inspect; shapes were still checked
        pass


def check(dtype: Any, spec: str | bytes | ShapeSpec, value: Any) -> None:
    """Check ``value`` against ``dtype`` and ``spec`` in the current scope.

    **Arguments:**
    - `dtype`: a NumPy/JAX dtype (e.g. ``jnp.float32``) or ``None`` to skip the dtype check.
    - `spec`: a shape spec such as ``'batch/d len'``.
    - `value`: the array.

    **Raises:** ``typeguard.TypeCheckError`` naming every mismatch.

    Example:
        >>> check(jnp.float32, 'batch len', jnp.zeros((2, 3)))
    """
    from ._scopes import current_scope

    check_value(value, dtype, ShapeSpec.parse(spec), current_scope(), where="value")
