"""Checking values against shape specs: dtype, rank, sizes, bindings (and, via
`shardlib._check.layouts`, the actual sharding).

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
import weakref
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import jax
import numpy as np
from jax.core import Tracer
from jax.sharding import NamedSharding
from typeguard import TypeCheckError

from .._env import context as _context
from .._env import rules as _rules
from .._lang.parsing import DimSpec, ShapeSpec, did_you_mean, parse_annotation_spec
from . import types
from .format import annotation_str, dtype_name, format_sizes, is_array_like
from .format import describe_value as _describe_value
from .format import layout_hint as _layout_hint
from .format import mismatch as _mismatch
from .format import operand_name as _operand_name
from .layouts import canonical_layout, format_layout, mesh_sizes_for_value, sharding_reason
from .scopes import Scope

__all__ = [
    "annotation_str",
    "canonical_layout",
    "check",
    "check_block",
    "check_value",
    "format_layout",
    "format_sizes",
    "TRACER_TYPES",
    "bind_sizes",
]

_Tracer = Tracer
_get_abstract_mesh = jax.sharding.get_abstract_mesh


def _format_factor(axes: Iterable[str], sizes: Mapping[str, int]) -> str:
    """``'d=8'`` for one axis, ``'t=2 × d=4 = 8'`` for several."""
    parts = [f"{a}={sizes[a]}" for a in axes if a in sizes]
    if len(parts) == 1:
        return f"the size of mesh axis {parts[0]}"
    total = math.prod(sizes[a] for a in axes if a in sizes)
    return f"{' × '.join(parts)} = {total}"


# Scope-independent results of checks of concrete (JAX or NumPy) arrays that passed:
# key -> (spec, {dim name: global size}). The spec is kept so that its id stays unique.
_FAST: dict[tuple, tuple[ShapeSpec, dict[str, int]]] = {}
_FAST_MAX = 4096
_CACHEABLE = (jax.Array, np.ndarray)
# The last passing check of each concrete jax array, by identity: id(value) -> (weak
# reference to the value, spec, dtype, check_sharding, abstract mesh, names). All are
# compared by identity (the abstract mesh in force is an interned object), so a reused id
# cannot match; a jax.Array is immutable, so while the reference is alive the same object
# checked against the same spec in the same context gives the same answer. One entry per
# array: an array checked against two specs in turn takes the `_FAST` path.
_SEEN: dict[int, tuple[weakref.ref, ShapeSpec, Any, bool, Any, dict[str, int]]] = {}
_CONCRETE_TYPES: set[type] = set()  # the classes of concrete jax arrays seen so far
TRACER_TYPES: set[type] = set()  # the tracer classes seen so far


def _is_concrete_jax_array(value: Any) -> bool:
    t = type(value)
    if t in _CONCRETE_TYPES:
        return True
    if t in TRACER_TYPES:  # most checks while tracing: no isinstance against jax.Array
        return False
    if isinstance(value, _Tracer):
        TRACER_TYPES.add(t)
        return False
    if isinstance(value, jax.Array):
        _CONCRETE_TYPES.add(t)
        return True
    return False


def check_value(
    value: Any,
    dtype: Any,
    spec: ShapeSpec,
    scope: Scope,
    *,
    where: str = "value",
    check_sharding: bool = True,
    describe: Callable[[], str] | None = None,
    resolved: bool = False,
) -> dict[str, int] | None:
    """Check ``value`` against ``dtype[spec]`` in ``scope``; bind new names on success and
    return them (``{dim name: global size}``; None when an identity match passed it).

    ``where`` starts the message (``''`` when the caller adds its own context, as typeguard
    does); ``describe()`` names the value in errors raised later, at compile time (layout
    checks on Auto meshes under ``jit``), when the caller's context is gone.

    ``resolved``: ``spec`` names mesh axes only (its roles resolved by the caller).

    Raises ``typeguard.TypeCheckError`` listing every mismatch.
    """
    if not resolved:
        spec = _rules.shape(spec, where or "value")
    if type(value) in TRACER_TYPES:  # most checks while tracing: never seen by identity
        key = _tracer_key(value, dtype, spec, check_sharding)
    elif seen_before(value, dtype, spec, scope, check_sharding):
        return None
    else:
        key = _fast_key(value, dtype, spec, check_sharding)
    if key is not None:
        hit = _FAST.get(key)
        if hit is not None and hit[0] is spec:
            names = hit[1]  # bound already, to these sizes (most checks), or bound now
            if names.items() <= scope.bindings.items() or bind_sizes(scope.bindings, names):
                return names
    names = _check_slow(value, dtype, spec, scope, where, check_sharding, describe)
    if key is not None:
        if len(_FAST) >= _FAST_MAX:
            _FAST.clear()
        _FAST[key] = (spec, names)
        # Remembered by identity only when no context outside the key can change the result.
        if key[-1] is None and _is_concrete_jax_array(value):
            if len(_SEEN) >= _FAST_MAX:
                _SEEN.clear()
            _SEEN[id(value)] = (
                weakref.ref(value),
                spec,
                dtype,
                check_sharding,
                _get_abstract_mesh(),
                names,
            )
    return names


def seen_before(
    value: Any, dtype: Any, spec: ShapeSpec, scope: Scope, check_sharding: bool = True
) -> bool:
    """Whether this very array (by identity) passed this check before; then bind its names.

    The cheapest check there is (no attribute of the array is read): `check_value` tries it
    first, and callers that would otherwise build arguments for `check_value` try it alone.
    """
    names = _seen_names(value, dtype, spec, check_sharding, _get_abstract_mesh())
    return names is not None and bind_sizes(scope.bindings, names)


def seen_prefix(values: tuple, arrays: tuple, bindings: dict[str, int]) -> int:
    """How many of ``values``, from the first, `seen_before` their checks; their names bound.

    ``arrays`` holds ``(label, dtype, spec)`` per value (sharding checked): the checks of a
    ``typechecked`` call's arguments, tried in one call on each call of the function.
    """
    mesh = _get_abstract_mesh()
    n = 0
    for (_, dtype, spec), value in zip(arrays, values, strict=False):
        names = _seen_names(value, dtype, spec, True, mesh)
        if names is None or not bind_sizes(bindings, names):
            break
        n += 1
    return n


def _seen_names(
    value: Any, dtype: Any, spec: ShapeSpec, check_sharding: bool, mesh: Any
) -> dict[str, int] | None:
    """The names a passing check of this very array against this check bound, from `_SEEN`;
    None if it has no such entry."""
    hit = _SEEN.get(id(value))
    if (
        hit is None
        or hit[0]() is not value
        or hit[1] is not spec
        or hit[2] is not dtype
        or hit[3] is not check_sharding
        or hit[4] is not mesh
    ):
        return None
    return hit[5]


def bind_sizes(bindings: dict[str, int], names: Mapping[str, int]) -> bool:
    """Bind ``names`` unless one conflicts (then False: the slow path explains it)."""
    if not bindings:  # a fresh scope: nothing to conflict with
        bindings.update(names)
        return True
    if names.items() <= bindings.items():  # all bound already, to these sizes (most checks)
        return True
    for name, n in names.items():
        if bindings.get(name, n) != n:
            return False
    bindings.update(names)
    return True


def _fast_key(value: Any, dtype: Any, spec: ShapeSpec, check_sharding: bool) -> tuple | None:
    """What a passing check of ``value`` depends on besides the bindings; None: not cached.

    Concrete arrays: their dtype, shape and layout and the meshes in force. Traced per-device
    blocks inside a ``shard_map`` body (most checks while tracing): their dtype and shape and
    the manual axis sizes, since no layout is checked there. Traced global values whose
    layout is not checked (``typed_shard_map``'s arguments under ``jit``): their type, which
    carries the mesh the sizes are divided by, and the mesh in force. Other tracers are not
    cached.
    """
    if type(value) in TRACER_TYPES:
        return _tracer_key(value, dtype, spec, check_sharding)
    if isinstance(value, _Tracer):
        TRACER_TYPES.add(type(value))
        return _tracer_key(value, dtype, spec, check_sharding)
    if not isinstance(value, _CACHEABLE):
        return None
    sh = getattr(value, "sharding", None)
    # A NamedSharding carries its mesh; other layouts (single-device arrays, NumPy arrays)
    # are compared with the mesh in force, so that mesh is part of the key, unless the spec
    # splits nothing (then no mesh can make such a value mismatch).
    if isinstance(sh, NamedSharding) or not spec.mesh_axes():
        context = None
    else:
        context = _context.concrete_mesh()
    return (
        id(spec),
        dtype,
        value.dtype,
        value.shape,
        sh,
        check_sharding,
        _get_abstract_mesh(),
        context,
    )


def _tracer_key(value: Any, dtype: Any, spec: ShapeSpec, check_sharding: bool) -> tuple | None:
    """`_fast_key` of a tracer (see there)."""
    manual = _context.manual_axis_items()
    if manual:
        aval = value.aval  # the key `check_block` looks up
        return (id(spec), dtype, aval.dtype, aval.shape, manual)
    if check_sharding:
        return None
    try:
        aval = jax.typeof(value)
    except TypeError:  # pragma: no cover - a tracer JAX cannot type
        return None
    return (id(spec), dtype, aval, _get_abstract_mesh())


def check_block(
    value: Any,
    spec: ShapeSpec,
    scope: Scope,
    manual: tuple[tuple[str, int], ...],
    where: str,
    dtype: Any = None,
) -> dict[str, int] | None:
    """``check_value(value, dtype, spec, scope, where=where, check_sharding=False)`` for a
    per-device block inside a ``shard_map`` body whose manual axes are ``manual``
    (`shardlib._env.context.manual_axis_items`, read once by the caller): the check of every
    ``shardops`` operand and result, and of a body's return value (no layout is checked
    inside a body, so ``check_sharding`` does not matter there). A traced block whose shape passed this check before
    with these manual axis sizes is looked up in `_FAST` (the key `_fast_key` gives it)
    without reading the context again; anything else takes `check_value`. ``spec`` names mesh
    axes only: every caller resolved its roles (op specs, a typed_shard_map's resolved signature).
    """
    if manual and type(value) in TRACER_TYPES:
        # A tracer's ``shape`` and ``dtype`` are properties that read its ``aval``: one
        # attribute read instead of two Python calls (this runs on every op's every operand).
        aval = value.aval
        hit = _FAST.get((id(spec), dtype, aval.dtype, aval.shape, manual))
        if hit is not None and hit[0] is spec:
            names = hit[1]  # bound already, to these sizes (most checks), or bound now
            if names.items() <= scope.bindings.items() or bind_sizes(scope.bindings, names):
                return names
    return check_value(value, dtype, spec, scope, where=where, check_sharding=False, resolved=True)


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
    if not is_array_like(value):
        prefix = f"{where}: expected" if where else "expected"
        raise TypeCheckError(
            f"{prefix} an array matching {annotation_str(dtype, spec)}, got "
            f"{_describe_value(value)}"
        )
    reasons: list[str] = []
    if dtype is not None and np.dtype(value.dtype) != np.dtype(dtype):
        reasons.append(
            f"dtype: expected {dtype_name(dtype)}, got {dtype_name(value.dtype)}"
            " (cast with .astype())"
        )
    shape = tuple(value.shape)
    manual = _context.manual_axis_sizes()
    inside = bool(manual)
    mesh_sizes = _context.mesh_axis_sizes() if inside else mesh_sizes_for_value(value)
    names: dict[str, int] = {}
    bindings = scope.bindings
    if len(shape) != len(spec.dims):
        n_dims = len(spec.dims)
        reasons.append(
            f"rank: expected {n_dims} dim{'s' if n_dims != 1 else ''} "
            f"({str(spec) or 'a scalar'}), got {len(shape)}: shape {shape}"
        )
    else:
        names = _dim_reasons(spec, shape, manual, mesh_sizes, bindings, reasons)
    if not reasons and check_sharding and not inside:
        r = sharding_reason(value, spec, dtype, where, describe)
        if r:
            reasons.append(r)
    if reasons:
        hint = _layout_hint(spec, shape, manual, bindings) if inside else None
        named = _operand_name(value)
        where = f"{where} ({named})" if named else where
        raise _mismatch(where, dtype, spec, reasons, manual, mesh_sizes, bindings, hint)
    bindings.update(names)
    return names


def _dim_reasons(
    spec: ShapeSpec,
    shape: tuple[int, ...],
    manual: Mapping[str, int],
    mesh_sizes: Mapping[str, int],
    bindings: Mapping[str, int],
    reasons: list[str],
) -> dict[str, int]:
    """Append why each dim does not match to ``reasons``; ``{name: global size}`` of the rest.

    Runs on every traced check: one loop, and messages are built only on a mismatch.
    """
    inside = bool(manual)
    known = manual if inside else mesh_sizes
    names: dict[str, int] = {}
    for i, (d, n) in enumerate(zip(spec.dims, shape, strict=True)):
        if d.sharding and known and any(a not in known for a in d.sharding):
            reasons.append(_unknown_axis(i, d, known, inside))
            continue
        if inside:
            global_n = n * (math.prod(manual[a] for a in d.sharding) if d.sharding else 1)
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
                how = _how(n, global_n, d, manual)
                reasons.append(f"{_label(i, d)}: expected size {d.shape}, got {how}")
            continue
        bound = bindings.get(d.shape)
        if bound is not None:
            if bound != global_n:
                reasons.append(
                    f"{_label(i, d)}: expected size {bound} ({d.shape}={bound} is already "
                    f"bound), got {_how(n, global_n, d, manual)}"
                )
        else:
            first = names.get(d.shape)
            if first is not None and first != global_n:
                reasons.append(
                    f"{_label(i, d)}: expected size {first} ({d.shape}={first} from an "
                    f"earlier dim of this value), got {_how(n, global_n, d, manual)}"
                )
                continue
        names.setdefault(d.shape, global_n)
    return names


def _unknown_axis(i: int, d: DimSpec, known: Mapping[str, int], inside: bool) -> str:
    a = next(a for a in d.sharding if a not in known)
    if inside:
        return (
            f"{_label(i, d)}: mesh axis {a!r} is not one of the manual axes of the "
            f"enclosing shard_map ({format_sizes(known)}); inside shard_map "
            f"only manual axes can split a dim{did_you_mean(a, known)}{_rules.role_hint(a)}"
        )
    return (
        f"{_label(i, d)}: mesh axis {a!r} is not an axis of the mesh "
        f"({format_sizes(known)}){did_you_mean(a, known)}{_rules.role_hint(a)}"
    )


def _how(n: int, global_n: int, d: DimSpec, manual: Mapping[str, int]) -> str:
    """How a global size was found: ``'8 (per-device 2 × d=4)'`` inside shard_map."""
    if not manual or global_n == n:
        return str(n)
    per = " × ".join(f"{a}={manual[a]}" for a in d.sharding)
    return f"{global_n} (per-device {n} × {per})"


def _label(i: int, d: Any) -> str:
    return f"dim {i} {str(d)!r}"


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
    from .scopes import current_scope

    shown = str(spec) if isinstance(spec, ShapeSpec) else spec
    parsed = parse_annotation_spec(spec, what=f"check({shown!r})")
    check_value(value, dtype, parsed, current_scope(), where="value")


types.HOOKS["check_value"] = check_value  # isinstance(x, f32['a b']) checks with it
