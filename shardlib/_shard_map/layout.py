"""Moving a ``typed_shard_map`` argument to the layout ``jax.shard_map`` wants.

On Explicit meshes ``jax.shard_map`` compares each argument's type spec with its
``in_specs`` entry (JAX 0.12 for partial-manual bodies too) and refuses one that differs;
elsewhere it moves the argument itself. `compared_axes` says how it compares on a mesh,
`to_layout` moves an argument it would refuse (and nothing else, so the program is the one a
hand-written ``shard_map`` gives), `onto_mesh` copies a concrete array onto the mesh.

A move never communicates: `refuse_summing` refuses an argument whose JAX type is unreduced
(a partial sum) over an axis its annotation's clause does not type it unreduced over, which
only a sum on the way in could make what the annotation says (JAX all-reduces it under
``jit``, refuses it eagerly, and aborts inside XLA for some).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
from jax.core import Tracer
from jax.sharding import AxisType, NamedSharding, PartitionSpec
from typeguard import TypeCheckError

from .._check.format import annotation_str
from .._env import context as _context
from .._lang.parsing import ShapeSpec
from .signature import Leaf

__all__ = ["Compared", "compared_axes", "onto_mesh", "refuse_summing", "to_layout"]


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
    target = NamedSharding(mesh, leaf.pspec)
    if not _context.EAGER_UNREDUCED and leaf.spec.pending:
        # JAX 0.9 device_puts nothing to an unreduced sharding; its eager reshard does.
        if v.sharding.device_set != set(mesh.devices.flat):
            v = jax.device_put(v, NamedSharding(mesh, PartitionSpec()))
        return jax.reshard(v, target)
    # Concrete values may live on devices outside the mesh (one committed device): copy them.
    return jax.device_put(v, target)


def onto_mesh(v: Any, leaf: Leaf, mesh: Any) -> Any:
    """Copy a concrete array committed to devices outside ``mesh`` onto it (eager only)."""
    if not isinstance(v, jax.Array) or isinstance(v, Tracer):
        return v
    if not v.committed or v.sharding.device_set == set(mesh.devices.flat):
        return v
    return jax.device_put(v, NamedSharding(mesh, leaf.pspec))


def refuse_summing(v: Any, leaf: Leaf, pname: str, fname: str) -> None:
    """Refuse argument ``pname`` of ``fname`` if its JAX type is unreduced over a mesh axis
    that ``leaf``'s clause does not type it unreduced over (``{+t}``): taking it as annotated
    (an ordinary array, a ``{=t}`` one, a partial sum over other axes) needs its sum.

    The other differences are moves without communication, left to `to_layout`: a value
    that is the same on every device (ordinary or reduced) passed for ``{+t}`` becomes JAX's
    unreduced type (one device keeps it, the others hold zeros), a reduced one passed for
    an ordinary argument is one, and an ordinary one passed for ``{=t}`` becomes reduced.
    Axes an enclosing ``shard_map`` is manual over are its body's business.
    """
    unreduced, reduced = _context.type_clause(v)
    if not unreduced:  # (nearly every call)
        return
    extra = unreduced - frozenset(leaf.spec.pending) - frozenset(_context.manual_axis_sizes())
    if extra:
        raise TypeCheckError(_summing_message(v, leaf, pname, fname, unreduced, reduced, extra))


def _summing_message(
    v: Any,
    leaf: Leaf,
    pname: str,
    fname: str,
    unreduced: frozenset[str],
    reduced: frozenset[str],
    extra: frozenset[str],
) -> str:
    spec = leaf.spec
    axes = sorted(extra)
    names = ", ".join(map(repr, axes))
    over = f"mesh axis {names}" if len(axes) == 1 else f"mesh axes {names}"
    got = _clause(tuple(sorted(unreduced)), tuple(sorted(reduced)))
    try:
        jax_type = f" {jax.typeof(v)}"
    except Exception:  # pragma: no cover - typed above, or its sharding read
        jax_type = ""
    said = [a for a in axes if a in spec.reduced]
    if said:
        says = (
            f"which the annotation's clause {_clause(spec.pending, spec.reduced)} contradicts "
            f"('={said[0]}': the same on every device of {said[0]!r}, which a partial sum is "
            "only once summed)"
        )
    elif spec.pending or spec.reduced:
        says = f"which the annotation's clause {_clause(spec.pending, spec.reduced)} does not say"
    else:
        says = "which the annotation (no clause: an ordinary array) does not say"
    target = _context.spec_text(ShapeSpec(spec.dims, (), spec.reduced).partition_spec())
    fix = (
        f"reduce it first (jax.reshard({pname}, {target}), or shardops.psum over {names} in "
        "the typed_shard_map that made it)"
    )
    taking = _taking(spec, axes)
    if taking is not None:
        fix += (
            f", or annotate it {annotation_str(leaf.dtype, taking)} to take the partial sum as "
            "it is"
        )
    return (
        f"argument {pname!r} of {fname}() is annotated {annotation_str(leaf.dtype, spec)} but "
        f"the array's JAX type{jax_type} is unreduced over {over} (clause {got}: a partial sum "
        f"still owing a sum over {names}), {says}: taking it as annotated would sum it on the "
        f"way in, an all-reduce shardlib never inserts implicitly; {fix}"
    )


def _clause(pending: tuple[str, ...], reduced: tuple[str, ...]) -> str:
    """``'{+t=d}'``."""
    return repr(str(ShapeSpec((), pending, reduced)))


def _taking(spec: ShapeSpec, axes: list[str]) -> ShapeSpec | None:
    """``spec`` typed unreduced over ``axes`` too (and no longer reduced over them); None
    where a dim is split over one of them (no value is both split and unreduced over an
    axis: only a reduce-scatter makes it what the annotation says)."""
    if any(a in spec.mesh_axes() for a in axes):
        return None
    pending = spec.pending + tuple(a for a in axes if a not in spec.pending)
    return ShapeSpec(spec.dims, pending, tuple(a for a in spec.reduced if a not in axes))
