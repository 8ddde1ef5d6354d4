"""Checking values against shape specs: dtype, rank, sizes, bindings and actual sharding.

Checkers collect every *reason* a value does not match; the public entry point assembles
them into one ``typeguard.TypeCheckError`` that names the annotation, each offending dim,
expected vs actual, the mesh axis sizes and the current bindings.

``check_value`` is on the eager hot path (every call of a typechecked function), so the
part of a check that does not depend on the binding scope is cached per (annotation,
dtype, shape, sharding, context) for concrete arrays: a repeated call only compares the dim
sizes with the scope's bindings.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.core import Tracer
from jax.sharding import AxisType, NamedSharding
from typeguard import TypeCheckError

from . import _context
from ._parsing import ShapeSpec, did_you_mean, parse_annotation_spec
from ._scopes import Scope

__all__ = ["check", "check_value", "canonical_layout", "format_layout"]

_Tracer = Tracer
_get_abstract_mesh = jax.sharding.get_abstract_mesh


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
    """``f32['a b']``, or ``spec 'a b'`` when no dtype is checked."""
    from ._types import dtype_short_name

    if dtype is None:
        return f"spec {str(spec)!r}"
    return f"{dtype_short_name(dtype)}[{str(spec)!r}]"


def format_sizes(sizes: Mapping[str, int]) -> str:
    return ", ".join(f"{k}={v}" for k, v in sizes.items()) if sizes else "none"


def _format_factor(axes: Iterable[str], sizes: Mapping[str, int]) -> str:
    """``'d=8'`` for one axis, ``'t=2 × d=4 = 8'`` for several."""
    parts = [f"{a}={sizes[a]}" for a in axes if a in sizes]
    if len(parts) == 1:
        return f"the size of mesh axis {parts[0]}"
    total = math.prod(sizes[a] for a in axes if a in sizes)
    return f"{' × '.join(parts)} = {total}"


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
    for i in range(max(ndim, len(layout))):
        axes = layout[i] if i < len(layout) else ()
        if not axes:
            entries.append("None")
        elif len(axes) == 1:
            entries.append(repr(axes[0]))
        else:
            entries.append(repr(axes))
    return f"P({', '.join(entries)})"


def _short_value(x: Any) -> str:
    """``f32[8, 2]`` for an array, else the type name."""
    if _is_array_like(x):
        from ._types import dtype_short_name

        return f"{dtype_short_name(x.dtype)}{list(x.shape)}"
    return type(x).__name__


def _describe_value(value: Any) -> str:
    """A one-line description of a value that is not an array, for messages."""
    kind = type(value).__name__
    if isinstance(value, tuple | list | dict):
        n = len(value)
        items = list(value.values() if isinstance(value, dict) else value)
        shown = ", ".join(_short_value(v) for v in items[:4]) + (", ..." if n > 4 else "")
        return f"{kind} of {n} item{'s' if n != 1 else ''}" + (f" ({shown})" if n else "")
    text = " ".join(repr(value).split())
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{kind} {text}"


def _is_array_like(x: Any) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype")


# Scope-independent results of checks of concrete (JAX or NumPy) arrays that passed:
# key -> (spec, {dim name: global size}). The spec is kept so that its id stays unique.
_FAST: dict[tuple, tuple[ShapeSpec, dict[str, int]]] = {}
_FAST_MAX = 4096
_CACHEABLE = (jax.Array, np.ndarray)


def check_value(
    value: Any,
    dtype: Any,
    spec: ShapeSpec,
    scope: Scope,
    *,
    where: str = "value",
    check_sharding: bool = True,
    describe: Callable[[], str] | None = None,
) -> None:
    """Check ``value`` against ``dtype[spec]`` in ``scope``; bind new names on success.

    ``where`` starts the message (``''`` when the caller adds its own context, as typeguard
    does); ``describe()`` names the value in errors raised later, at compile time (layout
    checks on Auto meshes under ``jit``), when the caller's context is gone.

    Raises ``typeguard.TypeCheckError`` listing every mismatch.
    """
    key = None
    if not isinstance(value, _Tracer) and isinstance(value, _CACHEABLE):
        sh = getattr(value, "sharding", None)
        # A NamedSharding carries its mesh; other layouts (single-device arrays, NumPy arrays)
        # are compared with the mesh in force, so that mesh is part of the key.
        context = None if isinstance(sh, NamedSharding) else _context.concrete_mesh()
        key = (
            id(spec),
            dtype,
            value.dtype,
            value.shape,
            sh,
            check_sharding,
            _get_abstract_mesh(),
            context,
        )
        hit = _FAST.get(key)
        if hit is not None and hit[0] is spec:
            names = hit[1]
            bindings = scope.bindings
            for name, n in names.items():
                if bindings.get(name, n) != n:
                    break  # a binding conflict: the slow path explains it
            else:
                bindings.update(names)
                return
    names = _check_slow(value, dtype, spec, scope, where, check_sharding, describe)
    if key is not None:
        if len(_FAST) >= _FAST_MAX:
            _FAST.clear()
        _FAST[key] = (spec, names)


def _check_slow(
    value: Any,
    dtype: Any,
    spec: ShapeSpec,
    scope: Scope,
    where: str,
    check_sharding: bool,
    describe: Callable[[], str] | None,
) -> dict[str, int]:
    """The full check; returns ``{dim name: global size}`` for the named dims."""
    if not _is_array_like(value):
        prefix = f"{where}: expected" if where else "expected"
        raise TypeCheckError(
            f"{prefix} an array matching {annotation_str(dtype, spec)}, got "
            f"{_describe_value(value)}"
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
    mesh_sizes = _context.mesh_axis_sizes() if inside else _mesh_sizes_for_value(value)
    names: dict[str, int] = {}
    bindings = scope.bindings
    if len(shape) != len(spec.dims):
        n_dims = len(spec.dims)
        reasons.append(
            f"rank: expected {n_dims} dim{'s' if n_dims != 1 else ''} "
            f"({str(spec) or 'a scalar'}), got {len(shape)}: shape {shape}"
        )
    else:
        known = manual if inside else mesh_sizes
        for i, (d, n) in enumerate(zip(spec.dims, shape, strict=True)):
            # Messages (label, how) are built only on a mismatch: this loop runs on every
            # traced check.
            if d.sharding and known and any(a not in known for a in d.sharding):
                a = next(a for a in d.sharding if a not in known)
                label = _label(i, d)
                if inside:
                    reasons.append(
                        f"{label}: mesh axis {a!r} is not one of the manual axes of the "
                        f"enclosing shard_map ({format_sizes(manual)}); inside shard_map "
                        f"only manual axes can split a dim{did_you_mean(a, manual)}"
                    )
                else:
                    reasons.append(
                        f"{label}: mesh axis {a!r} is not an axis of the mesh "
                        f"({format_sizes(known)}){did_you_mean(a, known)}"
                    )
                continue
            if inside:
                factor = math.prod(manual[a] for a in d.sharding) if d.sharding else 1
                global_n = n * factor
            else:
                factor = math.prod(mesh_sizes.get(a, 1) for a in d.sharding) if d.sharding else 1
                global_n = n
                if factor > 1 and n % factor:
                    reasons.append(
                        f"{_label(i, d)}: size {n} is not divisible by "
                        f"{_format_factor(d.sharding, mesh_sizes)}"
                    )
                    continue
            if isinstance(d.shape, int):
                if global_n != d.shape:
                    reasons.append(
                        f"{_label(i, d)}: expected size {d.shape}, got "
                        f"{_how(n, global_n, d, manual, inside)}"
                    )
                continue
            bound = bindings.get(d.shape)
            if bound is not None:
                if bound != global_n:
                    reasons.append(
                        f"{_label(i, d)}: expected size {bound} ({d.shape}={bound} is already "
                        f"bound), got {_how(n, global_n, d, manual, inside)}"
                    )
            else:
                first = names.get(d.shape)
                if first is not None and first != global_n:
                    reasons.append(
                        f"{_label(i, d)}: expected size {first} ({d.shape}={first} from an "
                        f"earlier dim of this value), got {_how(n, global_n, d, manual, inside)}"
                    )
                    continue
            names.setdefault(d.shape, global_n)
    if not reasons and check_sharding and not inside:
        r = _sharding_reason(value, spec, dtype, where, describe)
        if r:
            reasons.append(r)
    if reasons:
        ctx = f"mesh axes: {format_sizes(mesh_sizes)}"
        if inside:
            ctx += (
                f"; inside shard_map, manual axes: {', '.join(manual)} (sizes above are "
                "global: per-device size × manual axis sizes)"
            )
        ctx += f"; bindings: {format_sizes(bindings) if bindings else 'none yet'}"
        body = "\n".join(f"  - {r}" for r in reasons)
        prefix = f"{where} does not match" if where else "does not match"
        raise TypeCheckError(f"{prefix} {annotation_str(dtype, spec)}:\n{body}\n  ({ctx})")
    bindings.update(names)
    return names


def _label(i: int, d: Any) -> str:
    return f"dim {i} {str(d)!r}"


def _how(n: int, global_n: int, d: Any, manual: Mapping[str, int], inside: bool) -> str:
    """How a global size was found: ``'8 (per-device 2 × d=4)'`` inside shard_map."""
    if not inside or global_n == n:
        return str(n)
    return (
        f"{global_n} (per-device {n} × " + " × ".join(f"{a}={manual[a]}" for a in d.sharding) + ")"
    )


def _mesh_sizes_for_value(value: Any) -> dict[str, int]:
    if not isinstance(value, _Tracer):
        sh = getattr(value, "sharding", None)
        if isinstance(sh, NamedSharding):
            return _context.mesh_axis_sizes(sh.mesh)
    else:
        try:
            s = jax.typeof(value).sharding
            if isinstance(s, NamedSharding) and not s.mesh.empty:
                return _context.mesh_axis_sizes(s.mesh)
        except Exception:
            pass
    return _context.mesh_axis_sizes()


def _drop_dims(entries: Iterable[Any], batch_dims: tuple[int, ...], ndim: int) -> list[Any]:
    """PartitionSpec entries of a vmapped value with the batch dims removed (see unwrap_tracer)."""
    out = list(entries)
    out += [None] * (ndim + len(batch_dims) - len(out))
    for bd in reversed(batch_dims):
        del out[bd]
    return out


def _sharding_reason(
    value: Any, spec: ShapeSpec, dtype: Any, where: str, describe: Callable[[], str] | None
) -> str | None:
    """Compare the value's actual layout with the annotation's (outside shard_map)."""
    if isinstance(value, _Tracer):
        return _tracer_sharding_reason(value, spec, dtype, where, describe)
    return _concrete_sharding_reason(getattr(value, "sharding", None), spec, ())


def _concrete_sharding_reason(sh: Any, spec: ShapeSpec, batch_dims: tuple[int, ...]) -> str | None:
    """The layout reason for a concrete array's sharding ``sh`` (None when it matches)."""
    if sh is None:  # numpy arrays and other host values have no layout to check
        return None
    ndim = len(spec.dims)
    if isinstance(sh, NamedSharding):
        sizes = _context.mesh_axis_sizes(sh.mesh)
        actual = canonical_layout(_drop_dims(sh.spec, batch_dims, ndim), sizes)
    else:
        mesh = _context.concrete_mesh()
        if mesh is None:
            return None  # a single-device value and no mesh in force: nothing to compare
        sizes = _context.mesh_axis_sizes(mesh)
        if sh.is_fully_replicated:
            actual = ()
        elif batch_dims:
            return None  # a layout we cannot map back through vmap
        else:
            try:
                if sh.is_equivalent_to(NamedSharding(mesh, spec.partition_spec()), ndim):
                    return None
            except Exception:
                pass
            return _layout_message(spec, None, sizes, str(sh))
    if canonical_layout(spec.partition_entries(), sizes) != actual:
        return _layout_message(spec, actual, sizes)
    return None


def _layout_message(spec, actual, sizes, actual_text=None) -> str:
    ndim = len(spec.dims)
    exp = format_layout(canonical_layout(spec.partition_entries(), sizes), ndim)
    act = actual_text if actual_text is not None else format_layout(actual, ndim)
    return (
        f"layout: the annotation wants {exp} but the array is laid out as {act} "
        f"on mesh ({format_sizes(sizes)}); move it with "
        f"jax.device_put(x, NamedSharding(mesh, {exp})) or jax.reshard"
    )


def _tracer_sharding_reason(
    value: Any, spec: ShapeSpec, dtype: Any, where: str, describe: Callable[[], str] | None
) -> str | None:
    try:
        aval_sharding = jax.typeof(value).sharding
    except Exception:
        aval_sharding = None
    am = getattr(aval_sharding, "mesh", None)
    if am is not None and not am.empty:
        types = _context.axis_types(am)
        if all(t == AxisType.Explicit for t in types.values()):
            # Explicit axes: the layout is part of the type.
            sizes = _context.mesh_axis_sizes(am)
            actual = canonical_layout(aval_sharding.spec, sizes)  # type: ignore[union-attr]
            if actual != canonical_layout(spec.partition_entries(), sizes):
                return _layout_message(spec, actual, sizes)
            return None
    unwrapped = _context.unwrap_tracer(value)
    if unwrapped is None:
        return None  # e.g. a ragged vmap: shapes were checked, the layout cannot be
    base, batch_dims = unwrapped
    if not isinstance(base, _Tracer):
        # grad/vmap of an eager call: the concrete array underneath has the layout.
        return _concrete_sharding_reason(getattr(base, "sharding", None), spec, batch_dims)
    # Auto axes under jit: the layout is chosen by the compiler, so ask it.
    what = describe() if describe is not None else (where or "a value")
    _defer_sharding_check(base, batch_dims, spec, dtype, what)
    return None


def _defer_sharding_check(
    base: Any, batch_dims: tuple[int, ...], spec: ShapeSpec, dtype: Any, what: str
) -> None:
    """Check the layout XLA picks for ``base`` when the program is compiled."""
    mesh = _context.concrete_mesh()
    ndim = len(spec.dims)

    def fail(reason: str) -> TypeCheckError:
        return TypeCheckError(
            f"{what} does not match {annotation_str(dtype, spec)}:\n  - {reason}\n  (checked "
            "at compile time: the mesh axes are Auto, so XLA chooses the layout)"
        )

    def callback(sharding: Any) -> None:
        if isinstance(sharding, NamedSharding):
            sizes = _context.mesh_axis_sizes(sharding.mesh)
            actual = canonical_layout(_drop_dims(sharding.spec, batch_dims, ndim), sizes)
            if actual != canonical_layout(spec.partition_entries(), sizes):
                raise fail(_layout_message(spec, actual, sizes))
            return
        if mesh is None:
            return
        sizes = _context.mesh_axis_sizes(mesh)
        if sharding.is_fully_replicated:
            ok = not canonical_layout(spec.partition_entries(), sizes)
        elif batch_dims:
            return  # a layout we cannot map back through vmap
        else:
            ok = sharding.is_equivalent_to(NamedSharding(mesh, spec.partition_spec()), ndim)
        if not ok:
            raise fail(_layout_message(spec, None, sizes, str(sharding)))

    try:
        jax.debug.inspect_array_sharding(base, callback=callback)
    except TypeCheckError:
        raise
    except Exception:  # pragma: no cover - a trace that cannot stage it; shapes were checked
        pass


def check(dtype: Any, spec: str | bytes | ShapeSpec, value: Any) -> None:
    """Check ``value`` against ``dtype`` and ``spec`` in the current scope.

    The current scope is the innermost ``with Scope():``/``@scope`` or call of a
    typechecked function; outside all of them each ``check`` has a scope of its own.

    **Arguments:**

    - `dtype`: a NumPy/JAX dtype (e.g. ``jnp.float32``) or ``None`` to skip the dtype check.
    - `spec`: a shape spec such as ``'batch/d len'``.
    - `value`: the array.

    **Raises:** ``typeguard.TypeCheckError`` naming every mismatch; `SpecError` for a
    malformed spec (or one with a ``{+t}`` clause: a checked value is a reduced value).

    Examples:
        >>> check(jnp.float32, 'batch len', jnp.zeros((2, 3)))
    """
    from ._scopes import current_scope

    shown = str(spec) if isinstance(spec, ShapeSpec) else spec
    parsed = parse_annotation_spec(spec, what=f"check({shown!r})")
    check_value(value, dtype, parsed, current_scope(), where="value")
