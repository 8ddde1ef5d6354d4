"""``typed_shard_map``: ``jax.shard_map`` with in/out specs read from annotations."""

from __future__ import annotations

import functools
import inspect
import math
import typing
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import jax
import typeguard
from jax.sharding import AxisType, NamedSharding
from typeguard import TypeCheckError

from . import _context
from ._checking import canonical_layout, check_value
from ._parsing import ShapeSpec
from ._pytree import map_annotation
from ._scopes import Scope

__all__ = ["typed_shard_map"]


@dataclass(frozen=True)
class _Leaf:
    """One array annotation in a parameter's type: not a pytree node."""

    dtype: Any
    spec: ShapeSpec


@dataclass(frozen=True)
class _Param:
    name: str
    kind: Any  # inspect.Parameter kind
    static: bool
    annotation: Any = None
    leaves: Any = None  # pytree of _Leaf shaped like the annotation
    specs: Any = None  # pytree of PartitionSpec shaped like the annotation


def _leaf_tree(t: Any, what: str) -> Any:
    return map_annotation(t, lambda dtype, spec: _Leaf(dtype, spec), what=what)


def _is_leaf(x: Any) -> bool:
    return isinstance(x, _Leaf)


def _specs_of(leaves: Any) -> Any:
    return jax.tree.map(lambda lf: lf.spec.partition_spec(), leaves, is_leaf=_is_leaf)


class _Plan:
    """Everything derived from ``f``'s signature, computed once at decoration time."""

    def __init__(self, f: Callable, static_argnames: Iterable[str]):
        self.name = getattr(f, "__qualname__", repr(f))
        self.signature = inspect.signature(f)
        static = set(static_argnames)
        unknown = static - set(self.signature.parameters)
        if unknown:
            raise ValueError(
                f"typed_shard_map({self.name}): static_argnames names {sorted(unknown)}, which "
                f"{self.name} has no parameters called (it has {list(self.signature.parameters)})"
            )
        try:
            hints = typing.get_type_hints(f)
        except NameError as e:
            raise TypeError(
                f"typed_shard_map({self.name}): cannot resolve the annotations: {e}"
            ) from None
        self.params: list[_Param] = []
        for p in self.signature.parameters.values():
            if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                raise TypeError(
                    f"typed_shard_map({self.name}): parameter *{p.name} is not supported; "
                    "give every array argument its own annotated parameter"
                )
            if p.name in static:
                self.params.append(_Param(p.name, p.kind, True))
                continue
            if p.name not in hints:
                raise TypeError(
                    f"typed_shard_map({self.name}): parameter {p.name!r} has no annotation; "
                    f"annotate it with an array type such as f32[b'batch/d len'] or a "
                    f"pytree_dataclass, or mark it static_argnames=({p.name!r},)"
                )
            try:
                leaves = _leaf_tree(hints[p.name], f"parameter {p.name!r}")
            except TypeError as e:
                raise TypeError(
                    f"typed_shard_map({self.name}): {e}; or mark it static_argnames=({p.name!r},)"
                ) from None
            self.params.append(
                _Param(p.name, p.kind, False, hints[p.name], leaves, _specs_of(leaves))
            )
        if "return" not in hints:
            raise TypeError(
                f"typed_shard_map({self.name}): annotate the return type (e.g. "
                "-> f32[b'batch/d']) so the out_specs can be read from it"
            )
        try:
            self.out_leaves = _leaf_tree(hints["return"], "the return type")
        except TypeError as e:
            raise TypeError(f"typed_shard_map({self.name}): {e}") from None
        self.out_annotation = hints["return"]
        self.out_specs = _specs_of(self.out_leaves)
        self.in_specs = tuple(p.specs for p in self.params if not p.static)
        self.dynamic_names = [p.name for p in self.params if not p.static]
        self.body = _instrument(f, self.name)


def _instrument(f: Callable, name: str) -> Callable:
    """typeguard-instrument ``f`` once; fall back to explicit checks when it cannot."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            checked = typeguard.typechecked(f)
        except Exception:  # source unavailable, syntax typeguard cannot handle, ...
            checked = f
    instrumented = checked is not f and getattr(checked, "__code__", None) is not getattr(
        f, "__code__", None
    )
    del caught
    return checked if instrumented else _explicitly_checked(f, name)


def _explicitly_checked(f: Callable, name: str) -> Callable:
    """For functions typeguard cannot instrument (no source): check args and result here."""
    hints = typing.get_type_hints(f)
    sig = inspect.signature(f)

    @functools.wraps(f)
    def body(*args, **kwargs):
        bound = sig.bind(*args, **kwargs)
        with Scope(owner=name) as s:
            for pname, value in bound.arguments.items():
                if pname in hints:
                    _check_tree(value, _leaf_tree(hints[pname], pname), s, f"argument {pname!r}", name)
            out = f(*args, **kwargs)
            _check_tree(out, _leaf_tree(hints["return"], "return"), s, "the return value", name)
        return out

    return body


def _check_tree(value, leaves, s: Scope, what: str, fname: str, check_sharding=True) -> None:
    flat, treedef = jax.tree.flatten(leaves, is_leaf=_is_leaf)
    try:
        vals = treedef.flatten_up_to(value)
    except (ValueError, TypeError) as e:
        raise TypeCheckError(
            f"{what} of {fname}() does not have the annotated structure {treedef}: {e}"
        ) from None
    for lf, v in zip(flat, vals, strict=True):
        check_value(v, lf.dtype, lf.spec, s, where=f"{what} of {fname}()", check_sharding=check_sharding)


def typed_shard_map(
    f: Callable | None = None,
    *,
    mesh: Any | None = None,
    static_argnames: Iterable[str] = (),
    check_vma: bool | None = None,
    check_rep: bool | None = None,
    axis_names: Any = None,
    **shard_map_kwargs: Any,
) -> Any:
    """Run ``f`` per device with ``jax.shard_map``, reading in/out specs from annotations.

    **Arguments:**
    - `f`: the per-device function. Every non-static parameter and the return value are
      annotated with array types (``f32[b'batch/d len']``), pytree dataclasses,
      ``Array['layers', T]`` or tuples of those.
    - `mesh`: the mesh; default the one from ``jax.set_mesh`` or the legacy ``with mesh:``.
    - `static_argnames`: parameters passed through as Python values (closed over).
    - `check_vma` (alias `check_rep`), `axis_names`: passed to ``jax.shard_map``.

    **Returns:** a function taking global arrays and returning global arrays. Inputs in
    another layout are resharded to the annotated one on Explicit meshes.

    Inside ``f`` the annotations are checked against per-device blocks (times the manual axis
    sizes), with a fresh binding scope per call shared with the ``shardops`` in the body.

    Example:
        >>> @typed_shard_map
        ... def matvec(x: f32[b'batch/d in'], w: f32[b'in out']) -> f32[b'batch/d out']:
        ...     return shardops.einsum_unreduced('batch/d in, in out -> batch/d out', x, w)
    """
    if f is None:
        return functools.partial(
            typed_shard_map,
            mesh=mesh,
            static_argnames=static_argnames,
            check_vma=check_vma,
            check_rep=check_rep,
            axis_names=axis_names,
            **shard_map_kwargs,
        )
    if check_rep is not None:
        if check_vma is not None and check_vma != check_rep:
            raise ValueError(
                f"typed_shard_map({getattr(f, '__qualname__', f)}): check_rep={check_rep} and "
                f"check_vma={check_vma} disagree; check_rep is the old name of check_vma, "
                "pass only check_vma"
            )
        check_vma = check_rep
    plan = _Plan(f, static_argnames)
    extra = dict(shard_map_kwargs)
    if check_vma is not None:
        extra["check_vma"] = check_vma
    if axis_names is not None:
        extra["axis_names"] = set(axis_names)

    @functools.wraps(f)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            bound = plan.signature.bind(*args, **kwargs)
        except TypeError as e:
            raise TypeError(f"{plan.name}(): {e}") from None
        bound.apply_defaults()
        static_vals = {p.name: bound.arguments[p.name] for p in plan.params if p.static}
        dyn = [bound.arguments[n] for n in plan.dynamic_names]
        m = mesh if mesh is not None else _context.concrete_mesh()
        if m is None and _context.abstract_mesh() is None:
            raise ValueError(
                f"typed_shard_map({plan.name}) needs a mesh: call it inside "
                "`with jax.set_mesh(mesh):` (or the legacy `with mesh:`), or pass mesh=..."
            )
        sizes = _context.mesh_axis_sizes(m) if m is not None else _context.mesh_axis_sizes()
        dyn = [_prepare(v, p, plan.name, m, sizes) for v, p in zip(dyn, _dyn(plan), strict=True)]

        def body(*dyn_vals: Any) -> Any:
            kw = dict(static_vals)
            kw.update(zip(plan.dynamic_names, dyn_vals, strict=True))
            pos = [kw.pop(p.name) for p in plan.params if p.kind == inspect.Parameter.POSITIONAL_ONLY]
            return plan.body(*pos, **kw)

        smap = jax.shard_map(
            body, mesh=m, in_specs=plan.in_specs, out_specs=plan.out_specs, **extra
        )
        return smap(*dyn)

    wrapper.__shardlib_plan__ = plan  # type: ignore[attr-defined]
    return wrapper


def _dyn(plan: _Plan) -> list[_Param]:
    return [p for p in plan.params if not p.static]


def _prepare(value: Any, p: _Param, fname: str, mesh: Any, sizes: dict[str, int]) -> Any:
    """Check the global shape of one argument and move it to its annotated layout."""
    flat, treedef = jax.tree.flatten(p.leaves, is_leaf=_is_leaf)
    try:
        vals = treedef.flatten_up_to(value)
    except (ValueError, TypeError):
        raise TypeCheckError(
            f"argument {p.name!r} of {fname}(): expected {_describe(p.annotation)}, got "
            f"{type(value).__name__}"
        ) from None
    s = Scope(owner=fname)
    out = []
    for lf, v in zip(flat, vals, strict=True):
        check_value(v, lf.dtype, lf.spec, s, where=f"argument {p.name!r} of {fname}()",
                    check_sharding=False)
        _check_divisible(v, lf.spec, sizes, p.name, fname)
        out.append(_to_layout(v, lf.spec, mesh, sizes))
    return treedef.unflatten(out)


def _describe(t: Any) -> str:
    return getattr(t, "__qualname__", None) or repr(t)


def _check_divisible(v: Any, spec: ShapeSpec, sizes: dict[str, int], pname: str, fname: str):
    for i, (d, n) in enumerate(zip(spec.dims, v.shape, strict=True)):
        if not d.sharding:
            continue
        missing = [a for a in d.sharding if a not in sizes]
        if missing:
            raise TypeCheckError(
                f"argument {pname!r} of {fname}(): dim {i} {str(d)!r} is split over mesh axis "
                f"{missing[0]!r}, which the mesh does not have (axes: "
                + ", ".join(f"{k}={n_}" for k, n_ in sizes.items())
                + ")"
            )
        k = math.prod(sizes[a] for a in d.sharding)
        if n % k:
            raise TypeCheckError(
                f"argument {pname!r} of {fname}(): dim {i} {str(d)!r} has global size {n}, which "
                "is not divisible by "
                + " × ".join(f"{a}={sizes[a]}" for a in d.sharding)
                + f" = {k}; pad or resize it to a multiple of {k}"
            )


def _to_layout(v: Any, spec: ShapeSpec, mesh: Any, sizes: dict[str, int]) -> Any:
    """Reshard ``v`` to ``spec`` where the mesh axes are Explicit (shard_map would refuse)."""
    try:
        aval_sharding = jax.typeof(v).sharding
    except Exception:
        return v
    am = getattr(aval_sharding, "mesh", None)
    if am is None or am.empty:
        if mesh is None or not hasattr(v, "sharding") or isinstance(v, jax.core.Tracer):
            return v
        # An eager array placed without a mesh (e.g. numpy or single-device): put it there.
        types = _context.axis_types(mesh)
        if any(t == AxisType.Explicit for t in types.values()):
            return jax.device_put(v, NamedSharding(mesh, spec.partition_spec()))
        return v
    types = _context.axis_types(am)
    if not any(t == AxisType.Explicit for t in types.values()):
        return v
    actual = canonical_layout(aval_sharding.spec, sizes)
    if actual == canonical_layout(spec.partition_entries(), sizes):
        return v
    target = NamedSharding(mesh, spec.partition_spec()) if mesh is not None else spec.partition_spec()
    return jax.reshard(v, target)
