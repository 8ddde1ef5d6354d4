"""A sharding picture: every leaf of a pytree (type or value), its layout and its bytes; and
`device_put_checked`, which places a pytree of global arrays in its annotated layout after
checking every leaf's global shape against its annotation and the mesh."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from typeguard import TypeCheckError

from .._env import context as _context
from .._env import rules as _rules
from .._lang.parsing import ShapeSpec
from .format import byte_str, describe_value, format_sizes, name_of, shape_str
from .pytree import flatten_to, is_pytree_dataclass, keypath_str, map_annotation
from .shardings import make_shardings
from .types import dtype_short_name

__all__ = ["ShardingSummary", "device_put_checked", "sharding_summary"]


@dataclass(frozen=True)
class SummaryRow:
    path: str
    annotation: str
    global_shape: tuple[int, ...]
    device_shape: tuple[int, ...]
    dtype: str
    bytes_per_device: int


@dataclass(frozen=True)
class ShardingSummary:
    """The rows of `sharding_summary`; ``str()`` renders them as a table."""

    rows: tuple[SummaryRow, ...]
    mesh_sizes: tuple[tuple[str, int], ...]
    rules: str = ""  # the axis rules in force, as ``batch -> ('d', 't'), tensor -> None``

    @property
    def total_bytes_per_device(self) -> int:
        return sum(r.bytes_per_device for r in self.rows)

    def __str__(self) -> str:
        head = ("leaf", "annotation", "global shape", "per-device shape", "bytes/device")
        body = [
            (
                r.path,
                r.annotation,
                shape_str(r.global_shape),
                shape_str(r.device_shape),
                byte_str(r.bytes_per_device),
            )
            for r in self.rows
        ]
        total = ("total", "", "", "", byte_str(self.total_bytes_per_device))
        cols = list(zip(head, *body, total, strict=True))
        widths = [max(len(c) for c in col) for col in cols]

        def line(cells):
            return "  ".join(
                c.rjust(w) if i == 4 else c.ljust(w)
                for i, (c, w) in enumerate(zip(cells, widths, strict=True))
            ).rstrip()

        mesh = ", ".join(f"{k}={v}" for k, v in self.mesh_sizes) or "no mesh"
        out = [f"mesh: {mesh}"]
        if self.rules:
            out.append(f"axis rules: {self.rules} (a role's mesh axes in parentheses)")
        out += [line(head), "  ".join("-" * w for w in widths)]
        out += [line(b) for b in body]
        out += ["  ".join("-" * w for w in widths), line(total)]
        return "\n".join(out)


@dataclass(frozen=True)
class _Ann:
    dtype: Any
    spec: ShapeSpec  # resolved under the axis rules in force
    written: ShapeSpec | None = None  # as written, when the rules changed it


def sharding_summary(
    tree: Any, *, mesh: Any | None = None, dims: Mapping[str, int] | None = None
) -> ShardingSummary:
    """A table of every leaf: annotation, global shape, per-device shape and bytes per device.

    **Arguments:**

    - `tree`: a pytree *value* (e.g. weights placed with ``make_shardings``; annotations are
      read from its pytree dataclasses) or an annotation *type* (``Weights``,
      ``Array['layers', Layer]``, ``f32['a b/d']``), in which case `dims` gives the sizes.
    - `mesh`: the mesh for per-device shapes of types; default the mesh in force.
    - `dims`: ``{name: size}`` for the names in the annotations (types only).

    **Returns:** a `ShardingSummary`; ``print()`` it for the table, including the total
    bytes per device. Under ``axis_rules``, each role in an annotation is shown with the mesh
    axes it resolves to on the mesh (``M/fsdp(d) F/tensor(t)``, ``B/batch(d/t)`` for a tuple,
    ``E/embed(None)`` for a replicated role), and per-device shapes use those axes.

    Examples:
        >>> print(sharding_summary(Weights, dims={'in': 1024, 'hidden': 4096}, mesh=mesh))
    """
    m = mesh if mesh is not None else _context.concrete_mesh()
    sizes = _context.mesh_axis_sizes(m) if m is not None else {}
    is_type = isinstance(tree, type) or _is_annotation(tree)
    where = f"sharding_summary({name_of(tree) if is_type else type(tree).__name__})"
    rows: list[SummaryRow] = []
    if is_type:
        anns = map_annotation(tree, lambda dt, sp: _Ann(dt, sp), what=name_of(tree))
        for path, a in jax.tree_util.tree_flatten_with_path(anns, is_leaf=_is_ann)[0]:
            a = _resolved(a, where, m)
            shape = _global_shape(a.spec, dims or {}, _keystr(path))
            rows.append(_row(_keystr(path), a, shape, _device_shape(a.spec, shape, sizes), a.dtype))
    else:
        anns = _annotations_of(tree)
        leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
        ann_leaves = (
            jax.tree.leaves(anns, is_leaf=_is_ann) if anns is not None else [None] * len(leaves)
        )
        if len(ann_leaves) != len(leaves):
            ann_leaves = [None] * len(leaves)
        for (path, leaf), a in zip(leaves, ann_leaves, strict=True):
            shape = tuple(np.shape(leaf))
            sh = getattr(leaf, "sharding", None)
            if a is not None:
                a = _resolved(a, where, getattr(sh, "mesh", None) or m)
            if sh is not None and hasattr(sh, "shard_shape"):
                dshape = tuple(sh.shard_shape(shape))
            elif a is not None:
                dshape = _device_shape(a.spec, shape, sizes)
            else:
                dshape = shape
            if a is None:
                a = _Ann(getattr(leaf, "dtype", None), None)  # type: ignore[arg-type]
            rows.append(_row(_keystr(path), a, shape, dshape, getattr(leaf, "dtype", np.float32)))
            if sh is not None and hasattr(sh, "mesh") and not sizes:
                sizes = _context.mesh_axis_sizes(sh.mesh)
    rules = _rules.current()
    return ShardingSummary(tuple(rows), tuple(sizes.items()), str(rules) if rules else "")


def _resolved(a: _Ann, where: str, mesh: Any | None) -> _Ann:
    """``a`` with its spec resolved under the axis rules in force (``a`` itself when none),
    keeping the spec as written for the table."""
    spec = _rules.shape(a.spec, where, mesh)
    return a if spec is a.spec else _Ann(a.dtype, spec, a.spec)


def _shown_spec(a: _Ann) -> str:
    """The annotation's spec as written, each role followed by its mesh axes in parentheses:
    ``'M/fsdp(d) F/tensor(t)'``, ``'B/batch(d/t)'``, ``'E/embed(None)'``."""
    rules = _rules.current()
    if a.written is None or rules is None:
        return str(a.spec)
    dims = []
    for w in a.written.dims:
        parts = [str(w.shape)]
        for name in w.sharding:
            mine = rules.table.get(name, (name,))
            shown = "/".join(mine) if mine else "None"
            parts.append(name if mine == (name,) else f"{name}({shown})")
        dims.append("/".join(parts))
    return " ".join(dims)


def _row(path, a: _Ann, shape, dshape, dtype) -> SummaryRow:
    ann = (
        f"{dtype_short_name(a.dtype)}[{_shown_spec(a)!r}]"
        if a.spec is not None
        else f"{dtype_short_name(dtype)} (unannotated)"
    )
    itemsize = np.dtype(dtype).itemsize
    return SummaryRow(
        path or "(root)",
        ann,
        tuple(shape),
        tuple(dshape),
        dtype_short_name(dtype),
        math.prod(dshape) * itemsize,
    )


def _is_ann(x: Any) -> bool:
    return isinstance(x, _Ann)


def _is_annotation(t: Any) -> bool:
    import typing

    return typing.get_origin(t) is tuple


def _annotations_of(tree: Any) -> Any | None:
    if is_pytree_dataclass(type(tree)):
        try:
            return map_annotation(type(tree), lambda dt, sp: _Ann(dt, sp))
        except TypeError:
            return None
    return None


def _global_shape(spec: ShapeSpec, dims: Mapping[str, int], path: str) -> tuple[int, ...]:
    out = []
    for d in spec.dims:
        if isinstance(d.shape, int):
            out.append(d.shape)
        elif d.shape in dims:
            out.append(int(dims[d.shape]))
        else:
            raise ValueError(
                f"sharding_summary: {path or 'the type'} has dim {d.shape!r} but dims= does not "
                f"give its size (given: {dict(dims) or 'nothing'})"
            )
    return tuple(out)


def _device_shape(spec: ShapeSpec, shape, sizes: Mapping[str, int]) -> tuple[int, ...]:
    out = []
    for d, n in zip(spec.dims, shape, strict=True):
        k = math.prod(sizes.get(a, 1) for a in d.sharding)
        out.append(-(-n // k))
    return tuple(out)


def _keystr(path) -> str:
    """``'layers.w1'``: dotted whatever the key style (seqax's bare keys would run together)."""
    return keypath_str(path)


@dataclass(frozen=True)
class _At:
    spec: ShapeSpec  # resolved under the axis rules in force
    path: str
    written: ShapeSpec  # as written


def device_put_checked(tree: Any, t: Any = None, *, mesh: Any | None = None) -> Any:
    """``jax.device_put(tree, make_shardings(t))``, with every leaf's global shape checked first.

    Each array must have its annotation's rank, sizes that the mesh axes it is split over
    divide, and one size per dim name. A leaf that does not fit raises one error naming the
    field, the dim (such as ``'layers/p'``) and the sizes, for every such leaf; plain
    ``jax.device_put`` would stop at the first with JAX's own message, which names neither.
    Dtypes are left to ``jax.device_put`` (``typed_shard_map`` checks them at the call).

    **Arguments:**

    - `tree`: the global arrays (NumPy or JAX), shaped like `t`.
    - `t`: the annotation: an array type, pytree dataclass, ``Array[...]`` or tuple of those;
      by default ``type(tree)``, for an instance of a pytree dataclass.
    - `mesh`: the mesh to place on; by default the mesh in force (``jax.set_mesh``).

    **Returns:** `tree` placed: every leaf a ``jax.Array`` laid out as its annotation says.

    **Raises:** ``typeguard.TypeCheckError`` listing every leaf that does not fit; the errors
    of `make_shardings` (no mesh, an axis the mesh lacks).

    Examples:
        >>> with jax.set_mesh(jax.make_mesh((4,), ('p',))):
        ...     params = device_put_checked(Stack(w_in, w_out))  # w_in: 'layers/p M F'
    """
    if t is None:
        if not is_pytree_dataclass(type(tree)):
            raise TypeError(
                f"device_put_checked: argument `t` (the annotation) is needed for a "
                f"{type(tree).__name__}; it may be left out only for a pytree_dataclass instance"
            )
        t = type(tree)
    name = name_of(t)
    shardings = make_shardings(t, mesh)
    first = jax.tree.leaves(shardings)
    sizes = _context.mesh_axis_sizes(first[0].mesh) if first else {}
    where = f"device_put_checked({name})"
    ats = map_annotation(
        t,
        lambda dt, sp, path: _At(_rules.shape(sp, where, mesh), path, sp),
        what=name,
        with_path=True,
    )
    treedef = jax.tree.structure(ats, is_leaf=_is_at)
    values = flatten_to(
        treedef,
        tree,
        lambda: (
            f"device_put_checked({name}): argument `tree` must have the structure of "
            f"{name}, got {describe_value(tree)}"
        ),
    )
    reasons: list[str] = []
    names: dict[str, tuple[int, str]] = {}
    for v, at in zip(values, jax.tree.leaves(ats, is_leaf=_is_at), strict=True):
        reasons += _placement_reasons(tuple(np.shape(v)), at, sizes, names)
    if reasons:
        raise TypeCheckError(
            f"device_put_checked({name}): the arrays do not fit their annotations on the mesh "
            f"({format_sizes(sizes)}):\n" + "\n".join(f"  - {r}" for r in reasons)
        )
    return jax.device_put(tree, shardings)


def _is_at(x: Any) -> bool:
    return isinstance(x, _At)


def _placement_reasons(
    shape: tuple[int, ...], at: _At, sizes: Mapping[str, int], names: dict[str, tuple[int, str]]
) -> list[str]:
    """Why an array of global ``shape`` does not fit its annotation (an empty list: it fits)."""
    spec = at.spec
    if len(shape) != len(spec.dims):
        return [f"field {at.path}: expected {len(spec.dims)} dims ({spec}), got shape {shape}"]
    out = []
    for i, (d, n) in enumerate(zip(spec.dims, shape, strict=True)):
        label = f"field {at.path}, dim {i} {str(at.written.dims[i])!r}"
        if at.written is not spec and str(at.written.dims[i]) != str(d):
            label += f" (resolved: {str(d)!r})"
        k = math.prod(sizes.get(a, 1) for a in d.sharding)
        if n % k:
            by = " × ".join(f"{a}={sizes[a]}" for a in d.sharding)
            by = f"{by} = {k}" if len(d.sharding) > 1 else f"the size of mesh axis {by}"
            out.append(
                f"{label}: global size {n} is not divisible by {by}; pad or resize it to a "
                f"multiple of {k}, or use a mesh whose {'/'.join(d.sharding)} divides {n}"
            )
        if isinstance(d.shape, int):
            if n != d.shape:
                out.append(f"{label}: expected size {d.shape}, got {n}")
            continue
        seen = names.setdefault(d.shape, (n, label))
        if seen[0] != n:
            out.append(f"{label}: size {n}, but {d.shape}={seen[0]} at {seen[1]}")
    return out
