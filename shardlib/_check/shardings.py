"""Sharding specs derived from annotations: ``make_partition_specs``, ``make_shardings``."""

from __future__ import annotations

from typing import Any

from jax.sharding import NamedSharding, PartitionSpec

from .._env import context as _context
from .._env import rules as _rules
from .._lang.parsing import ShapeSpec, did_you_mean
from .format import name_of
from .pytree import map_annotation
from .types import is_array_type

__all__ = ["is_fully_sharded", "make_partition_specs", "make_shardings"]


def make_partition_specs(t: Any) -> Any:
    """The ``PartitionSpec`` pytree of annotation ``t``.

    **Arguments:** `t`: an array type, pytree dataclass, ``Array[...]`` or tuple of those.

    **Returns:** the same structure with a ``PartitionSpec`` at every array.

    Examples:
        >>> make_partition_specs(f32['batch/d len'])
        P('d', None)
    """
    what = f"make_partition_specs({name_of(t)})"
    return map_annotation(
        t, lambda dtype, spec: _rules.shape(spec, what).partition_spec(), what=name_of(t)
    )


def make_shardings(t: Any, mesh: Any | None = None) -> Any:
    """The ``NamedSharding`` pytree of annotation ``t`` on ``mesh`` (default: the mesh in force).

    The mesh comes from ``jax.set_mesh(mesh)`` or the legacy ``with mesh:``. Under ``jax.jit``,
    where ``jax.set_mesh``'s mesh is only known abstractly, the shardings are on the abstract
    mesh (fine for ``lax.with_sharding_constraint`` and ``jax.sharding.reshard``), so seqax's
    ``jax.tree.map(lax.with_sharding_constraint, arrays, make_shardings(Model))`` works in a
    jitted init.

    Examples:
        >>> with jax.set_mesh(mesh):
        ...     w = jax.tree.map(jax.device_put, w, make_shardings(Weights))
    """
    if mesh is None:
        mesh = _context.concrete_mesh()
    if mesh is None:
        mesh = _context.abstract_mesh()
    if mesh is None:
        raise ValueError(
            f"make_shardings({name_of(t)}) needs a mesh: call it inside `with jax.set_mesh(mesh):` "
            "(or the legacy `with mesh:`), or pass mesh=..."
        )
    sizes = _context.mesh_axis_sizes(mesh)

    def leaf(dtype, spec: ShapeSpec, path: str):
        spec = _rules.shape(
            spec, f"make_shardings({name_of(t)}){' at ' + path if path else ''}", mesh
        )
        for a in spec.mesh_axes():
            if a not in sizes:
                at = f"{path}: " if path != name_of(t) else ""
                raise ValueError(
                    f"make_shardings({name_of(t)}): {at}spec {str(spec)!r} uses mesh axis {a!r}, "
                    "which the mesh does not have (mesh axes: "
                    + ", ".join(f"{k}={n}" for k, n in sizes.items())
                    + f"){did_you_mean(a, sizes)}{_rules.role_hint(a)}"
                )
        return NamedSharding(mesh, spec.partition_spec())

    return map_annotation(t, leaf, what=name_of(t), with_path=True)


def is_fully_sharded(spec: Any) -> bool:
    """Whether ``spec`` shards over every mesh axis (of size > 1).

    Inside a ``shard_map`` body the axes are its manual axes; outside, the mesh in force.
    ``spec`` is a ``PartitionSpec``, a shape spec string or an array type.

    Examples:
        >>> is_fully_sharded('a/d b/t')  # on a ('d', 't') mesh
        True
    """
    if is_array_type(spec):
        entries = _rules.shape(spec.spec, "is_fully_sharded").partition_entries()
    elif isinstance(spec, str | bytes):
        entries = _rules.shape(ShapeSpec.parse(spec), "is_fully_sharded").partition_entries()
    elif isinstance(spec, PartitionSpec):
        entries = tuple(spec)
    else:
        raise TypeError(
            f"is_fully_sharded takes a PartitionSpec, shape spec or array type, got {spec!r}"
        )
    used: set[str] = set()
    for e in entries:
        if isinstance(e, str):
            used.add(e)
        elif isinstance(e, tuple):
            used.update(a for a in e if isinstance(a, str))
    axes = _context.manual_axis_sizes() or _context.mesh_axis_sizes()
    if not axes:
        raise ValueError(
            "is_fully_sharded needs a mesh: call it inside a shard_map body or under "
            "`with jax.set_mesh(mesh):`"
        )
    return all(a in used for a, n in axes.items() if n > 1)
