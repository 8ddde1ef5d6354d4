"""Pytree dataclasses, stacked types (``Array['layers', T]``) and specs derived from types."""

from __future__ import annotations

import dataclasses
import functools
import typing
from collections.abc import Callable
from typing import Any, TypeVar

import jax
from jax.sharding import NamedSharding, PartitionSpec

from . import _context
from ._parsing import ShapeSpec, did_you_mean
from ._types import ArrayType, array_type, is_array_type

__all__ = [
    "Array",
    "StackedType",
    "field_types",
    "is_fully_sharded",
    "is_pytree_dataclass",
    "make_partition_specs",
    "make_shardings",
    "map_annotation",
    "pytree_dataclass",
]

_T = TypeVar("_T")
_PYTREE_MARK = "__shardlib_pytree_dataclass__"


def pytree_dataclass(cls: type[_T]) -> type[_T]:
    """Make ``cls`` a frozen dataclass registered as a JAX pytree (with keys).

    Fields are annotated with array types (``f32['in hidden/d']``), nested pytree
    dataclasses or stacked types (``Array['layers', Layer]``). Every field is a pytree child.

    Examples:
        >>> @pytree_dataclass
        ... class Weights:
        ...     w1: f32['in hidden/d']
        ...     w2: f32['hidden out/d']
        >>> make_partition_specs(Weights)
        Weights(w1=P(None, 'd'), w2=P(None, 'd'))
    """
    dc = dataclasses.dataclass(frozen=True)(cls)
    names = [f.name for f in dataclasses.fields(typing.cast(Any, dc))]
    jax.tree_util.register_dataclass(dc, data_fields=names, meta_fields=[])
    setattr(dc, _PYTREE_MARK, True)
    return dc


def is_pytree_dataclass(t: Any) -> bool:
    return isinstance(t, type) and t.__dict__.get(_PYTREE_MARK, False)


@functools.cache
def field_types(cls: type) -> tuple[tuple[str, Any], ...]:
    """``(name, resolved annotation)`` for each field of a pytree dataclass (resolved once)."""
    try:
        hints = typing.get_type_hints(cls)
    except NameError as e:
        raise TypeError(
            f"cannot resolve the field annotations of {cls.__qualname__}: {e}; define the "
            "types it names before using it"
        ) from None
    return tuple((f.name, hints.get(f.name, Any)) for f in dataclasses.fields(cls))


class StackedType:
    """``Array['layers', Cls]``: every field of ``Cls`` gets the ``prefix`` dims in front."""

    prefix: typing.ClassVar[ShapeSpec]
    inner: typing.ClassVar[type]


class _ArrayMeta(type):
    def __getitem__(cls, item: tuple[str | bytes, Any]) -> Any:
        if not isinstance(item, tuple) or len(item) != 2:
            raise TypeError(
                "Array takes a spec and a type: Array['layers', Layer] or Array['layers', "
                f"f32['a b']], got Array[{item!r}]"
            )
        spec, inner = item
        return stacked(ShapeSpec.parse(spec), inner)


class Array(metaclass=_ArrayMeta):
    """Prepend dims to an array type or to every field of a pytree dataclass.

    ``Array['layers', f32['a b/d']]`` is ``f32['layers a b/d']``; ``Array['layers', Layer]``
    is ``Layer`` with ``layers`` in front of every field, the type of weights stacked for
    ``lax.scan``.

    Examples:
        >>> make_partition_specs(Array['layers', Layer])  # Layer(w=f32['in out/d'])
        Layer(w=P(None, None, 'd'))
    """


@functools.cache
def stacked(prefix: ShapeSpec, inner: Any) -> Any:
    if is_array_type(inner):
        return array_type(inner.short_name, ShapeSpec(prefix.dims + inner.spec.dims))
    if isinstance(inner, type) and issubclass(inner, StackedType):
        return stacked(ShapeSpec(prefix.dims + inner.prefix.dims), inner.inner)
    if is_pytree_dataclass(inner):
        return type(
            f"Array[{str(prefix)!r}, {inner.__qualname__}]",
            (StackedType,),
            {"prefix": prefix, "inner": inner, "__module__": "shardlib.shardtypes"},
        )
    raise TypeError(
        f"Array[{str(prefix)!r}, ...] needs an array type such as f32['a b'] or a "
        f"pytree_dataclass, got {inner!r}"
    )


def _tuple_args(t: Any) -> tuple[Any, ...] | None:
    if typing.get_origin(t) is tuple:
        args = typing.get_args(t)
        if len(args) == 2 and args[1] is Ellipsis:
            raise TypeError(
                f"{t!r}: variable-length tuples have no fixed layout; list each element type"
            )
        return args
    return None


def map_annotation(
    t: Any, leaf: Callable[..., Any], *, what: str = "type", with_path: bool = False
) -> Any:
    """Build a pytree shaped like annotation ``t`` with ``leaf(dtype, spec)`` at each array.

    Pytree dataclasses become instances of themselves; ``Array['l', Cls]`` instances of
    ``Cls``; ``tuple[...]`` tuples. With ``with_path=True`` the leaf also gets the path of
    the array in ``t`` (``'Model.layers.w'``), for messages.
    """
    return _map(t, leaf, ShapeSpec(()), what, with_path)


def _map(t: Any, leaf, prefix: ShapeSpec, what: str, with_path: bool = False) -> Any:
    if is_array_type(t):
        spec = ShapeSpec(prefix.dims + t.spec.dims) if prefix.dims else t.spec
        return leaf(t.dtype, spec, what) if with_path else leaf(t.dtype, spec)
    if isinstance(t, type) and issubclass(t, StackedType):
        return _map(t.inner, leaf, ShapeSpec(prefix.dims + t.prefix.dims), what, with_path)
    if is_pytree_dataclass(t):
        obj = object.__new__(t)
        for name, ft in field_types(t):
            object.__setattr__(obj, name, _map(ft, leaf, prefix, f"{what}.{name}", with_path))
        return obj
    args = _tuple_args(t)
    if args is not None:
        return tuple(_map(a, leaf, prefix, f"{what}[{i}]", with_path) for i, a in enumerate(args))
    if isinstance(t, type) and issubclass(t, ArrayType):
        raise TypeError(f"{what}: {t!r} has no shape spec; write e.g. {t!r}['batch len']")
    raise TypeError(
        f"{what}: {t!r} is not an array type (f32['a b']), a pytree_dataclass, "
        "Array['layers', T] or a tuple of those"
    )


def make_partition_specs(t: Any) -> Any:
    """The ``PartitionSpec`` pytree of annotation ``t``.

    **Arguments:** `t`: an array type, pytree dataclass, ``Array[...]`` or tuple of those.

    **Returns:** the same structure with a ``PartitionSpec`` at every array.

    Examples:
        >>> make_partition_specs(f32['batch/d len'])
        P('d', None)
    """
    return map_annotation(t, lambda dtype, spec: spec.partition_spec(), what=_name(t))


def make_shardings(t: Any, mesh: Any | None = None) -> Any:
    """The ``NamedSharding`` pytree of annotation ``t`` on ``mesh`` (default: the mesh in force).

    The mesh comes from ``jax.set_mesh(mesh)`` or the legacy ``with mesh:``.

    Examples:
        >>> with jax.set_mesh(mesh):
        ...     w = jax.tree.map(jax.device_put, w, make_shardings(Weights))
    """
    if mesh is None:
        mesh = _context.concrete_mesh()
    if mesh is None:
        raise ValueError(
            f"make_shardings({_name(t)}) needs a mesh: call it inside `with jax.set_mesh(mesh):` "
            "(or the legacy `with mesh:`), or pass mesh=..."
        )
    sizes = _context.mesh_axis_sizes(mesh)

    def leaf(dtype, spec: ShapeSpec, path: str):
        for a in spec.mesh_axes():
            if a not in sizes:
                at = f"{path}: " if path != _name(t) else ""
                raise ValueError(
                    f"make_shardings({_name(t)}): {at}spec {str(spec)!r} uses mesh axis {a!r}, "
                    "which the mesh does not have (mesh axes: "
                    + ", ".join(f"{k}={n}" for k, n in sizes.items())
                    + f"){did_you_mean(a, sizes)}"
                )
        return NamedSharding(mesh, spec.partition_spec())

    return map_annotation(t, leaf, what=_name(t), with_path=True)


def is_fully_sharded(spec: Any) -> bool:
    """Whether ``spec`` shards over every mesh axis (of size > 1).

    Inside a ``shard_map`` body the axes are its manual axes; outside, the mesh in force.
    ``spec`` is a ``PartitionSpec``, a shape spec string or an array type.

    Examples:
        >>> is_fully_sharded('a/d b/t')  # on a ('d', 't') mesh
        True
    """
    if is_array_type(spec):
        entries = spec.spec.partition_entries()
    elif isinstance(spec, str | bytes):
        entries = ShapeSpec.parse(spec).partition_entries()
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


def _name(t: Any) -> str:
    return getattr(t, "__qualname__", None) or repr(t)
