"""Moving a ``typed_shard_map`` argument to the layout ``jax.shard_map`` wants.

On Explicit meshes ``jax.shard_map`` compares each argument's type spec with its
``in_specs`` entry (JAX 0.12 for partial-manual bodies too) and refuses one that differs;
elsewhere it moves the argument itself. `compared_axes` says how it compares on a mesh,
`to_layout` moves an argument it would refuse (and nothing else, so the program is the one a
hand-written ``shard_map`` gives), `onto_mesh` copies a concrete array onto the mesh.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
from jax.core import Tracer
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from .._env import context as _context
from .plan import Leaf

__all__ = ["Compared", "compared_axes", "onto_mesh", "to_layout"]


class Compared(NamedTuple):
    """How ``jax.shard_map`` compares an argument's layout with its ``in_specs`` entry."""

    manual: frozenset[str]  # the axes the body is manual over
    partial: bool  # only the spec's part over ``manual`` is compared (a partial-manual body)


def compared_axes(
    manual: frozenset[str] | None, mesh: Any, sizes: dict[str, int]
) -> Compared | None:
    """How ``jax.shard_map`` compares each argument's type spec with its ``in_specs`` entry
    on ``mesh``; None where it does not compare (it moves the argument itself).

    It compares when every axis the body is manual over (``axis_names``, default all, less
    those an enclosing body is already manual over) is Explicit: the whole spec when every
    mesh axis is manual, and for a partial-manual body the spec's part over the manual
    axes, where this JAX compares that (`_COMPARES_PARTIAL_MANUAL`).
    """
    outer = set(_context.manual_axis_sizes())
    axes = frozenset(sizes if manual is None else manual) - outer
    types = _context.axis_types(mesh)
    if not axes or not all(types.get(a) == AxisType.Explicit for a in axes):
        return None
    partial = axes != frozenset(sizes) - outer
    if partial and not _COMPARES_PARTIAL_MANUAL:
        return None
    return Compared(axes, partial)


def _compares_partial_manual() -> bool:
    """Whether this JAX's ``shard_map`` refuses a partial-manual body's argument whose
    layout over the manual (Explicit) axes is not its ``in_specs`` entry.

    JAX 0.12 does: in ``jax/_src/shard_map.py`` (``shard_map``'s ``wrapped``) the check
    runs when ``all(mesh._name_to_type[a] == AxisType.Explicit for a in axis_names)``, and
    ``if mesh_axis_names_wo_vmap != axis_names:  # partial manual`` it compares
    ``_manual_spec(axis_names, arg_aval.sharding.spec, mesh)`` (the type spec's part over
    the manual axes; a dim split over a non-manual axis before a manual one is refused as
    ``Invalid spec``) with the in_spec. JAX 0.11.0 and older compare only when
    ``mesh_axis_names_wo_vmap == axis_names`` (``# TODO(yashkatariya): Add support for
    partial manual``) and move any other argument inside the ``shard_map``, where the body
    sees the argument's sharding over the other axes: moving it before would change the
    program, so on those versions a partial-manual argument is passed as it is.

    A version check, not a trial call: a ``shard_map`` traced to find out would have to
    run inside the caller's trace, whose mesh it cannot replace.
    """
    return jax.__version_info__[:2] >= (0, 12)


_COMPARES_PARTIAL_MANUAL = _compares_partial_manual()


def _fits(actual: PartitionSpec, leaf: Leaf, c: Compared, sizes: dict[str, int]) -> bool:
    """Whether ``jax.shard_map`` accepts an argument whose type spec is ``actual`` for
    ``leaf``'s ``in_specs`` entry: the comparison of ``jax/_src/shard_map.py`` (JAX 0.12:
    ``if arg_spec != s: raise ValueError("in_specs passed to shard_map: ... does not match
    the specs of the input ...")``, with ``arg_spec = _manual_spec(axis_names, spec, mesh)``
    for a partial-manual body)."""
    want = leaf.pspec
    if getattr(jax.config, "jax_remove_size_one_mesh_axis_from_type", False):
        want = _without_axes(want, sizes)
    if c.partial:
        part = _manual_part(actual, c.manual)
        return part is not None and part == want
    return actual == want


def _manual_part(spec: PartitionSpec, manual: frozenset[str]) -> PartitionSpec | None:
    """``spec``'s part over the ``manual`` axes, as JAX's ``_manual_spec`` computes it; None
    where JAX refuses the spec (a dim split over a manual axis inside a non-manual one)."""
    parts: list[Any] = []
    for s in spec.partitions:  # not *spec: JAX refuses it with unreduced or reduced axes
        if isinstance(s, tuple):
            kept = [a if a in manual else None for a in s]
            while kept and kept[-1] is None:
                kept.pop()
            if None in kept:
                return None
            parts.append(tuple(kept) or None)
        else:
            parts.append(s if s in manual else None)
    return _with(spec, parts, manual)


def _without_axes(spec: PartitionSpec, sizes: dict[str, int]) -> PartitionSpec:
    """``spec`` without the mesh axes of size 1 (JAX's ``remove_size_one_mesh_axis_from_spec``,
    applied to ``in_specs`` and types under ``jax_remove_size_one_mesh_axis_from_type``)."""
    ones = {a for a, n in sizes.items() if n == 1}
    if not ones:
        return spec
    parts = [
        tuple(a for a in s if a not in ones) if isinstance(s, tuple) else (None if s in ones else s)
        for s in spec.partitions
    ]
    return _with(spec, parts, frozenset(sizes) - ones)


def _with(spec: PartitionSpec, parts: list[Any], axes: set[str] | frozenset[str]) -> PartitionSpec:
    """``spec`` with dims ``parts`` and its unreduced and reduced axes limited to ``axes``."""
    unreduced = frozenset(spec.unreduced) & axes
    kw: dict[str, Any] = {}
    if not unreduced and getattr(spec, "unreduced_kind", None) is not None:
        kw["unreduced_kind"] = None  # as JAX 0.12: no kind without unreduced axes
    return spec.update(
        partitions=tuple(parts), unreduced=unreduced, reduced=frozenset(spec.reduced) & axes, **kw
    )


def to_layout(
    v: Any, leaf: Leaf, mesh: Any | None, compared: Compared, sizes: dict[str, int]
) -> Any:
    """Reshard ``v`` to ``leaf``'s layout unless ``jax.shard_map`` accepts its type spec.

    Only used where ``jax.shard_map`` compares the input's type spec with ``in_specs``
    (the manual axes all Explicit, see `compared_axes`); the comparison is the same as its
    own (`_fits`), so an input it accepts is passed through untouched and the program is the
    one a hand-written ``shard_map`` gives. Host values (NumPy) and arrays placed without a
    mesh have an empty-mesh type and are moved onto the mesh.
    """
    try:
        actual = jax.typeof(v).sharding.spec
    except Exception:  # not an array JAX knows: leave it to shard_map's own error
        return v
    if _fits(actual, leaf, compared, sizes):
        return v
    if mesh is None:  # only under jit inside jax.set_mesh, where a PartitionSpec means its mesh
        return jax.reshard(v, leaf.pspec)
    if isinstance(v, Tracer):
        return jax.reshard(v, NamedSharding(mesh, leaf.pspec))
    # Concrete values may live on devices outside the mesh (one committed device): copy them.
    return jax.device_put(v, NamedSharding(mesh, leaf.pspec))


def onto_mesh(v: Any, leaf: Leaf, mesh: Any) -> Any:
    """Copy a concrete array committed to devices outside ``mesh`` onto it (eager only)."""
    if not isinstance(v, jax.Array) or isinstance(v, Tracer):
        return v
    if not v.committed or v.sharding.device_set == set(mesh.devices.flat):
        return v
    return jax.device_put(v, NamedSharding(mesh, leaf.pspec))
