"""A whole train state on a mesh: ``state_shardings`` and ``restore_target``.

A train state (model, optimizer state, step) is a pytree in which the annotated parts are
pytree dataclasses. Each leaf under an annotated field takes that field's layout when it has
the field's rank (optimizer moments mirror the weights, so they get the weights' layout).
Every other leaf (optax's ``count``, the step, a factored statistic, a bare stacked layer)
keeps the layout it carries, if any (``jax.eval_shape`` under a mesh gives one to what the
program lays out), where the mesh has its axes and they divide its dims, and is replicated
otherwise. The mesh is a concrete
``jax.sharding.Mesh``: restore targets place blocks on its devices.
"""

from __future__ import annotations

import math
import typing
from typing import Any

import jax
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec
from jax.tree_util import GetAttrKey, SequenceKey

from .._env import context as _context
from .._env import rules as _rules
from .._lang.parsing import did_you_mean
from .pytree import StackedType, field_types, is_pytree_dataclass, keypath_str
from .types import is_array_type

__all__ = ["restore_target", "state_shardings"]


def state_shardings(state: Any, mesh: Mesh | None = None) -> Any:
    """The ``NamedSharding`` of every leaf of a train state on ``mesh``, from the annotations.

    ``state`` is any pytree of arrays or ``jax.ShapeDtypeStruct``s (``jax.eval_shape`` of the
    init function gives one). A leaf under a field of a `pytree_dataclass` takes that field's
    layout, so a model's weights and the optimizer moments that mirror them (optax's ``mu``
    and ``nu`` hold the model's dataclass) are split as the annotations say. A leaf that no
    annotation covers (optax's ``count``, a step counter, a bare stacked layer whose weights
    have one more dim than their fields), or whose rank differs from its field's or whose size
    is 1 where the field is split (a factored statistic), keeps the layout it carries (as
    ``jax.eval_shape`` under a mesh gives it) if the mesh has its axes and they divide its
    dims, and is replicated otherwise.

    **Arguments:**

    - `state`: the train state, e.g. ``{"model": m, "opt_state": s, "step": n}``.
    - `mesh`: a concrete ``jax.sharding.Mesh``; default: the one of ``jax.set_mesh``.

    **Returns:** ``state``'s structure with a ``NamedSharding`` on ``mesh`` at every leaf.

    **Raises:** ``ValueError`` for an ``AbstractMesh`` or no mesh, and, listing every such
    leaf, for a leaf of its field's rank whose split dims do not divide over the mesh axes or
    whose annotation names axes the mesh lacks (roles, with no ``shardlib.axis_rules`` in
    force to map them: the message says so).

    Examples:
        >>> state = jax.device_put(state, state_shardings(state, new_mesh))  # move a state
    """
    return _Walk("state_shardings", _concrete_mesh("state_shardings", mesh)).run(state)


def restore_target(state: Any, mesh: Mesh | None = None) -> Any:
    """The restore target of a train state on ``mesh``: ``jax.ShapeDtypeStruct``s with shardings.

    The shapes and dtypes are ``state``'s, the shardings `state_shardings`'s. Give it
    ``jax.eval_shape`` of the init function (nothing is computed), and Orbax reads each
    device's blocks of the checkpoint straight into place, whatever mesh it was saved on.

    **Arguments:**

    - `state`: a pytree of ``jax.ShapeDtypeStruct``s (or arrays) shaped like the train state.
    - `mesh`: a concrete ``jax.sharding.Mesh``; default: the one of ``jax.set_mesh``.

    **Returns:** ``state``'s structure with a ``jax.ShapeDtypeStruct`` at every leaf.

    **Raises:** as `state_shardings`. Annotations written in roles (``'M/fsdp'``) resolve
    under the axis rules in force: call it inside the model's ``shardlib.axis_rules(...)``;
    without rules, the error names every role it could not place.

    Examples:
        >>> target = restore_target(jax.eval_shape(init_state, key), mesh)
        >>> state = ocp.StandardCheckpointer().restore(path, target)
    """
    shardings = _Walk("restore_target", _concrete_mesh("restore_target", mesh)).run(state)
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(
            x.shape, x.dtype, sharding=s, weak_type=getattr(x, "weak_type", False)
        ),
        state,
        shardings,
    )


def _concrete_mesh(fn: str, mesh: Any) -> Mesh:
    """``mesh``, or the concrete mesh in force; an ``AbstractMesh`` or none is an error."""
    if mesh is None:
        mesh = _context.concrete_mesh()
        if mesh is None:
            raise ValueError(
                f"{fn}(state) needs a concrete mesh: pass mesh=jax.make_mesh(...), or call it "
                "under `with jax.set_mesh(mesh):` outside jax.jit (under jit only the abstract "
                "mesh is known, and shardings for Orbax or jax.device_put need devices)"
            )
    if isinstance(mesh, AbstractMesh):
        raise ValueError(
            f"{fn}(state, mesh=...) needs a concrete jax.sharding.Mesh, got an AbstractMesh "
            f"{dict(mesh.shape)}: an AbstractMesh has no devices, so Orbax cannot place blocks "
            "on it (it fails with '_device_assignment is not implemented'); pass the Mesh from "
            "jax.make_mesh(...)"
        )
    if not isinstance(mesh, Mesh):
        raise TypeError(
            f"{fn}(state, mesh=...) takes a jax.sharding.Mesh, got {type(mesh).__name__}: {mesh!r}"
        )
    return mesh


def _names(names: list[str]) -> str:
    """``'fsdp'``, ``'fsdp' and 'tensor'``, ``'a', 'b' and 'c'``."""
    quoted = [repr(n) for n in names]
    return quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} and {quoted[-1]}"


def _is_array_like(x: Any) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype")


def _path_str(path: tuple[Any, ...]) -> str:
    """``state['model'].embed``: the argument's name, then the key path."""
    text = keypath_str(path)
    return f"state.{text}" if path and isinstance(path[0], GetAttrKey) else f"state{text}"


class _Walk:
    """One walk over a state: the sharding of each leaf, and the leaves that do not fit."""

    def __init__(self, fn: str, mesh: Mesh) -> None:
        self.fn = fn
        self.mesh = mesh
        self.sizes = dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))
        self.replicated = NamedSharding(mesh, PartitionSpec())
        self.problems: list[str] = []
        self.unknown: dict[str, None] = {}  # names the annotations split over, not mesh axes

    def run(self, state: Any) -> Any:
        out = self.node(state, None, ())
        if self.problems:
            sizes = ", ".join(f"{a}={n}" for a, n in self.sizes.items())
            n = len(self.problems)
            what = "1 leaf of the state does not" if n == 1 else f"{n} leaves of the state do not"
            raise ValueError(
                f"{self.fn}: {what} fit the mesh ({sizes}); {self.fix()}:\n"
                + "\n".join(f"  - {p}" for p in self.problems)
            )
        return out

    def fix(self) -> str:
        """What to do: with names that are no mesh axes and no axis rules in force, the
        model is written in roles (``'M/fsdp'``), so the rules must be in force."""
        if not self.unknown or _rules.current() is not None:
            return (
                "use a mesh that has the annotated axes and whose sizes divide the split dims, "
                "or change the annotations"
            )
        if len(self.unknown) == 1:
            are, look = "is not a mesh axis", "it looks like a role (a logical axis)"
        else:
            are, look = "are not mesh axes", "they look like roles (logical axes)"
        rules = ", ".join(f"{a}=<mesh axes>" for a in self.unknown)
        return (
            f"{_names(list(self.unknown))} {are} and no axis rules are in force, so {look}: "
            f"call {self.fn} with the axis rules the model runs under in force, `with "
            f"shardlib.axis_rules({rules}):`, or use a mesh that has these axes"
        )

    def node(self, x: Any, ann: Any, path: tuple[Any, ...]) -> Any:
        """The shardings of subtree ``x``, whose annotation (None: none) is ``ann``."""
        if x is None:
            return None
        if _is_array_like(x):
            return self.leaf(x, ann if is_array_type(ann) else None, path)
        keyed, treedef = jax.tree_util.tree_flatten_with_path(x, is_leaf=lambda c: c is not x)
        if treedef.num_nodes == 1 and treedef.num_leaves == 1:  # a leaf that is not an array
            raise TypeError(
                f"{self.fn}: {_path_str(path)} is {x!r} ({type(x).__name__}), not an array or "
                "a jax.ShapeDtypeStruct; pass the state, or jax.eval_shape of its init function"
            )
        children = _child_annotations(x, ann)
        out = [
            self.node(c, children(k), (*path, k))
            for (k,), c in keyed  # one level: each path is a single key
        ]
        return treedef.unflatten(out)

    def leaf(self, x: Any, ann: Any, path: tuple[Any, ...]) -> NamedSharding:
        """The annotation's layout if ``x`` mirrors it, else the layout ``x`` has (`own`)."""
        if ann is None:
            return self.own(x)
        spec = _rules.shape(ann.spec, f"{self.fn}: the annotation at {_path_str(path)}", self.mesh)
        missing = list(dict.fromkeys(a for a in spec.mesh_axes() if a not in self.sizes))
        if missing:
            self.unknown.update(dict.fromkeys(missing))
            hints = "".join(did_you_mean(a, self.sizes) for a in missing)
            self.problems.append(
                f"{_path_str(path)}: annotation {str(spec)!r} splits dims over {_names(missing)}, "
                f"not {'an axis' if len(missing) == 1 else 'axes'} of the mesh{hints}"
            )
            return self.replicated
        shape = tuple(x.shape)
        splits = [math.prod(self.sizes[a] for a in d.sharding) for d in spec.dims]
        if len(shape) != len(splits) or any(n == 1 < k for n, k in zip(shape, splits, strict=True)):
            return self.own(x)  # a statistic of another shape, not a mirror of the field
        for i, (n, k, d) in enumerate(zip(shape, splits, spec.dims, strict=True)):
            if n % k:
                axes = "*".join(f"{a}={self.sizes[a]}" for a in d.sharding)
                self.problems.append(
                    f"{_path_str(path)}: shape {list(shape)}, annotation {str(spec)!r}: dim "
                    f"{i} ({d.shape}, size {n}) is split over {axes}, which does not divide {n}"
                )
                return self.replicated
        return NamedSharding(self.mesh, spec.partition_spec())

    def own(self, x: Any) -> NamedSharding:
        """The layout ``x`` carries (``jax.eval_shape`` under a mesh gives one to the leaves
        the program lays out, such as a bare stacked layer's weights or a statistic it splits;
        optax's ``count`` and a step counter carry none) moved onto the mesh, when the mesh
        has its axes and they divide its dims; else replicated."""
        sh = getattr(x, "sharding", None)
        if not isinstance(sh, NamedSharding):
            return self.replicated
        entries = _context.spec_entries(sh.spec)
        entries += (None,) * (len(x.shape) - len(entries))
        for n, entry in zip(x.shape, entries, strict=False):
            axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
            if any(a not in self.sizes for a in axes) or n % math.prod(self.sizes[a] for a in axes):
                return self.replicated
        return NamedSharding(self.mesh, sh.spec)


def _child_annotations(x: Any, ann: Any) -> Any:
    """``key -> annotation`` for the children of ``x`` (annotated ``ann``, None: none)."""
    cls = ann if _is_class_annotation(ann) and isinstance(x, ann) else None
    if cls is None and is_pytree_dataclass(type(x)):
        cls = type(x)  # an annotated part of an unannotated container: the model, Adam's mu
    if cls is not None:
        fields = dict(field_types(cls))
        return lambda k: fields.get(k.name) if isinstance(k, GetAttrKey) else None
    args = typing.get_args(ann) if typing.get_origin(ann) is tuple else ()
    if isinstance(x, tuple) and len(args) == len(x) and Ellipsis not in args:
        return lambda k: args[k.idx] if isinstance(k, SequenceKey) else None
    return lambda k: None


def _is_class_annotation(ann: Any) -> bool:
    return isinstance(ann, type) and (issubclass(ann, StackedType) or is_pytree_dataclass(ann))
