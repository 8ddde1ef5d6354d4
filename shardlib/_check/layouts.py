"""Checking a value's actual layout (its sharding) against a spec's, outside ``shard_map``.

A spec's layout is its PartitionSpec; a value's is its ``NamedSharding`` (concrete arrays),
its type (Explicit mesh axes under ``jit``), or, for Auto axes under ``jit``, the layout XLA
picks, checked when the program is compiled. Layouts are compared in canonical form: size-1
axes and trailing replicated dims dropped.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import jax
from jax.core import Tracer
from jax.sharding import AxisType, NamedSharding
from typeguard import TypeCheckError

from .._env import context as _context
from .._lang.parsing import ShapeSpec
from .format import annotation_str, format_sizes

__all__ = ["canonical_layout", "format_layout", "mesh_sizes_for_value", "sharding_reason"]

_Tracer = Tracer


def canonical_layout(
    entries: Iterable[Any], sizes: Mapping[str, int]
) -> tuple[tuple[str, ...], ...]:
    """A PartitionSpec's entries with size-1 axes and trailing replicated dims removed."""
    out: list[tuple[str, ...]] = []
    for e in _context.spec_entries(entries):
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


def mesh_sizes_for_value(value: Any) -> dict[str, int]:
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
    out = list(_context.spec_entries(entries))
    out += [None] * (ndim + len(batch_dims) - len(out))
    for bd in reversed(batch_dims):
        del out[bd]
    return out


def sharding_reason(
    value: Any, spec: ShapeSpec, dtype: Any, where: str, describe: Callable[[], str] | None
) -> str | None:
    """Compare the value's actual layout with the annotation's (outside shard_map)."""
    if isinstance(value, _Tracer):
        return _tracer_sharding_reason(value, spec, dtype, where, describe)
    return _concrete_sharding_reason(getattr(value, "sharding", None), spec, ())


def _concrete_sharding_reason(sh: Any, spec: ShapeSpec, batch_dims: tuple[int, ...]) -> str | None:
    """The layout reason for a concrete array's sharding ``sh`` (None when it matches)."""
    if (spec.pending or spec.reduced) and not isinstance(sh, NamedSharding):
        return clause_reason(None, spec)  # a host or one-device value: no such JAX type
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
    if isinstance(sh, NamedSharding):
        return clause_reason(sh.spec, spec)
    return None


def clause_reason(pspec: Any, spec: ShapeSpec) -> str | None:
    """Where the JAX type's ``unreduced``/``reduced`` axes (``pspec``'s fields) differ from the
    annotation's clause (``{+t}``, ``{=t}``), the reason; else None."""
    unreduced = frozenset(getattr(pspec, "unreduced", None) or ())
    reduced = frozenset(getattr(pspec, "reduced", None) or ())
    if unreduced == frozenset(spec.pending) and reduced == frozenset(spec.reduced):
        return None
    want = str(ShapeSpec((), spec.pending, spec.reduced)) if spec.pending or spec.reduced else ""
    got = str(ShapeSpec((), tuple(sorted(unreduced)), tuple(sorted(reduced))))
    if not unreduced and not reduced:
        got = "no clause (reduced and summed: an ordinary array)"
    if unreduced - frozenset(spec.pending):
        fix = (
            "reduce it first (shardops.psum in a typed_shard_map, or jax.reshard to a spec "
            "without unreduced), or annotate it with that clause"
        )
    else:
        fix = (
            "give it that type (return it from a typed_shard_map annotated so, or "
            "jax.reshard / jax.device_put it to a PartitionSpec with those fields), or drop "
            "the clause from the annotation"
        )
    return (
        f"type: the annotation's clause is {want or 'empty (an ordinary array)'!r} but the "
        f"array's JAX type is unreduced over {sorted(unreduced)} and reduced over "
        f"{sorted(reduced)} ({got}); {fix}"
    )


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
            return clause_reason(aval_sharding.spec, spec)  # type: ignore[union-attr]
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
