"""`ShardMapSignature`: what a ``typed_shard_map``'s annotations say, read once at decoration time.

From ``f``'s signature and resolved annotations: which parameters are inputs of the
``shard_map`` (with their ``PartitionSpec`` pytrees) and which are static, the out specs,
and how messages name ``f`` (a function, bound method, ``functools.partial`` or callable
object). It is ``f``'s signature seen as a ``shard_map``'s (held as ``sig`` by its users;
``typed_shard_map(f).__shardlib_signature__``), not a plan: that word is `shardlib.plan`'s,
the layout planner.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from types import FrameType
from typing import Any

import jax
from jax.sharding import PartitionSpec

from .._check.checking import annotation_str
from .._check.format import describe_value
from .._check.pytree import map_annotation
from .._env import frames as _frames
from .._env import rules as _rules
from .._env.annotations import resolve_hints, unresolved
from .._lang.parsing import ShapeSpec

__all__ = [
    "Leaf",
    "Param",
    "ShardMapSignature",
    "callable_name",
    "check_callable",
    "describe_annotation",
]


@dataclass(frozen=True)
class Leaf:
    """One array annotation in a parameter's type: not a pytree node."""

    dtype: Any
    spec: ShapeSpec
    pspec: PartitionSpec  # one entry per dim, as jax.typeof(x).sharding.spec has


@dataclass(frozen=True)
class Param:
    name: str
    kind: Any  # inspect.Parameter kind
    static: bool
    annotation: Any = None
    leaves: Any = None  # pytree of Leaf shaped like the annotation
    specs: Any = None  # pytree of PartitionSpec shaped like the annotation
    flat: tuple[Leaf, ...] = ()  # the leaves, flattened
    treedef: Any = None  # the treedef of `leaves`
    # Mesh axes the function's return annotation splits over -> that annotation, so that a
    # call nested in a shard_map body already manual over one of them is refused clearly.
    out_axes: Mapping[str, str] | None = None


def _leaf_tree(t: Any, what: str) -> Any:
    return map_annotation(
        t, lambda dtype, spec: Leaf(dtype, spec, spec.partition_spec()), what=what
    )


def is_leaf(x: Any) -> bool:
    return isinstance(x, Leaf)


def _specs_of(leaves: Any) -> Any:
    return jax.tree.map(lambda lf: lf.pspec, leaves, is_leaf=is_leaf)


def _resolve(f: Callable, name: str, decorating: FrameType | None) -> dict[str, Any]:
    """``f``'s annotations, evaluated; names local to the decorating scope are found too."""
    try:
        return resolve_hints(f)
    except NameError:
        pass
    names = _frames.frame_locals(decorating)
    try:
        return resolve_hints(f, names)
    except NameError:
        what, missing = unresolved(f, names) or ("an annotation", "?")
        raise TypeError(
            f"typed_shard_map({name}): cannot resolve the annotation of {what}: name "
            f"{missing!r} is not defined; define it before decorating"
        ) from None


def _unwrap(f: Callable) -> Callable:
    """The Python function whose code and annotations ``f`` runs.

    A bound method runs its ``__func__`` (with ``self`` bound), a ``functools.partial`` its
    ``func`` (with the bound arguments), a callable object its class's ``__call__``.
    """
    if isinstance(f, types.MethodType):
        return _unwrap(f.__func__)
    if isinstance(f, functools.partial):
        return _unwrap(f.func)
    if callable(f) and not inspect.isfunction(f) and not isinstance(f, type):
        call = type(f).__call__
        if inspect.isfunction(call):
            return _unwrap(call)
    return f


def callable_name(f: Any) -> str:
    """How messages name ``f``: ``fn``, ``Model.apply``, ``partial(fn)``, ``Model.__call__``."""
    if isinstance(f, functools.partial):
        return f"partial({callable_name(f.func)})"
    name = getattr(f, "__qualname__", None)
    if isinstance(name, str) and not isinstance(f, type):
        return name
    if callable(f) and not isinstance(f, type):
        call = type(f).__call__
        if inspect.isfunction(call):
            return call.__qualname__
    return getattr(f, "__qualname__", None) or repr(f)


def _partial_keywords(f: Any) -> set[str]:
    """Names bound by keyword in ``functools.partial`` layers of ``f``."""
    out: set[str] = set()
    while isinstance(f, functools.partial | types.MethodType):
        if isinstance(f, functools.partial):
            out |= set(f.keywords)
            f = f.func
        else:
            f = f.__func__
    return out


def _partial_positional(f: Any) -> list[str]:
    """Names of the parameters that ``functools.partial`` layers of ``f`` bind positionally."""
    names: list[str] = []
    while isinstance(f, functools.partial):
        try:
            params = list(inspect.signature(f.func).parameters.values())
        except (TypeError, ValueError):
            break
        positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        names += [p.name for p in positional[: len(f.args)]]
        f = f.func
    return names


def check_callable(f: Any, name: str) -> None:
    """Refuse, at decoration time, what typed_shard_map cannot run as a per-device body."""
    if isinstance(f, type):
        raise TypeError(
            f"typed_shard_map({name}): got the class {name}, expected a function (a plain "
            "function, a bound method, a functools.partial or an object with __call__); "
            f"decorate a method of it, or an instance whose class defines __call__"
        )
    if not callable(f):
        raise TypeError(
            f"typed_shard_map({name}): expected a function to run per device, got "
            f"{describe_value(f)}"
        )


def _is_array_annotation(t: Any) -> bool:
    """Whether ``t`` describes arrays (an array type, pytree dataclass, tuple of them...)."""
    if t is None:
        return False
    try:
        _leaf_tree(t, "a parameter")
    except (TypeError, ValueError):
        return False
    return True


def _splits(t: Any) -> bool:
    """Whether the annotation ``t`` describes arrays and splits one of them over a mesh axis."""
    if not _is_array_annotation(t):
        return False
    leaves = jax.tree.leaves(_leaf_tree(t, "a parameter"), is_leaf=is_leaf)
    return any(lf.spec.mesh_axes() for lf in leaves)


def _out_axes(hints: Mapping[str, Any]) -> dict[str, str]:
    """``{mesh axis: the return annotation}`` for the axes the return annotation splits over."""
    try:
        leaves = jax.tree.leaves(_leaf_tree(hints["return"], "the return type"), is_leaf=is_leaf)
    except (KeyError, TypeError, ValueError):
        return {}  # reported by ShardMapSignature with its own message
    return {
        a: f"the return annotation {annotation_str(lf.dtype, lf.spec)}"
        for lf in leaves
        for a in lf.spec.mesh_axes()
    }


def describe_annotation(t: Any) -> str:
    """An annotation as written: ``f32['a/d']``, ``tuple[f32['a'], Weights]``."""
    origin = typing.get_origin(t)
    if origin is not None:
        name = getattr(origin, "__qualname__", None) or repr(origin)
        args = ", ".join(
            "..." if a is Ellipsis else describe_annotation(a) for a in typing.get_args(t)
        )
        return f"{name}[{args}]"
    return getattr(t, "__qualname__", None) or repr(t)


class ShardMapSignature:
    """Everything derived from ``f``'s signature, computed once at decoration time.

    ``f`` may be a function, a bound method, a ``functools.partial`` or a callable object:
    its annotations are read from the function it runs (see `_unwrap`). A parameter bound
    by keyword in a partial keeps its value as a default: an array annotation makes it an
    input of the ``shard_map`` like any other; any other annotation (or none) makes it static.
    ``body`` (the checked per-device function) is set by ``typed_shard_map``.
    """

    body: Callable[..., Any]

    def __init__(
        self, f: Callable, static_argnames: str | Iterable[str], decorating: FrameType | None
    ) -> None:
        self.name = callable_name(f)
        check_callable(f, self.name)
        inner = _unwrap(f)
        self.inner = inner  # the function that runs (its closure and globals: trace keys)
        self.short_name = getattr(inner, "__name__", None) or self.name
        self.signature = self._signature(f)
        static = self._static(static_argnames)
        hints = _resolve(inner, self.name, decorating)
        self._refuse_positional_partials(f, hints)
        bound_by_partial = _partial_keywords(f)
        out_axes = _out_axes(hints)
        self.params: list[Param] = []
        for p in self.signature.parameters.values():
            keyword_static = p.name in bound_by_partial and not _is_array_annotation(
                hints.get(p.name)
            )
            if p.name in static or keyword_static:
                self.params.append(Param(p.name, p.kind, True))
            else:
                self.params.append(self._param(p, hints, out_axes))
        self._read_return(hints)
        self.dynamic = [p for p in self.params if not p.static]
        self.in_specs = tuple(p.specs for p in self.dynamic)
        self.dynamic_names = [p.name for p in self.dynamic]
        self.positional_only = [
            p.name for p in self.params if p.kind == inspect.Parameter.POSITIONAL_ONLY
        ]
        # Trace keys (argument types, static values, mesh, the body's closure) whose body
        # passed the partial-sum analysis, with the shardops ops that trace made: a later
        # trace with the same key skips the analysis if it makes the same ops.
        self.checked: dict[Any, tuple[Any, ...]] = {}
        # Trace keys whose gradient passed `refusal.check_reduced_gradients`.
        self.grads_checked: set[Any] = set()
        self.in_reduced = any(lf.spec.reduced for p in self.dynamic for lf in p.flat)

    @property
    def typed_specs(self) -> bool:
        """Whether some argument or result is annotated unreduced or reduced (an
        ``in_specs``/``out_specs`` entry with ``unreduced`` or ``reduced`` axes)."""
        leaves = [lf for p in self.dynamic for lf in p.flat] + list(self.out_flat)
        return any(lf.spec.pending or lf.spec.reduced for lf in leaves)

    @property
    def out_typed(self) -> bool:
        """Whether the body's results are checked against JAX's types: some output is
        annotated unreduced (``{+t}``, cast to that type), or some argument reduced
        (``{=t}``, a type that results computed from it keep)."""
        return self.in_reduced or any(lf.spec.pending for lf in self.out_flat)

    def resolved(self, where: str, mesh: Any | None = None) -> ShardMapSignature:
        """This signature with the roles in its specs resolved under the axis rules in force (a
        copy with its own trace keys; ``body`` is set by the caller)."""

        def leaf(lf: Leaf) -> Leaf:
            spec = _rules.shape(lf.spec, where, mesh)
            return lf if spec is lf.spec else Leaf(lf.dtype, spec, spec.partition_spec())

        def tree(leaves: Any) -> Any:
            return jax.tree.map(leaf, leaves, is_leaf=is_leaf)

        new = copy.copy(self)
        new.params = []
        for p in self.params:
            if not p.static:
                leaves = tree(p.leaves)
                p = dataclasses.replace(
                    p, leaves=leaves, specs=_specs_of(leaves), flat=tuple(map(leaf, p.flat))
                )
            new.params.append(p)
        new.dynamic = [p for p in new.params if not p.static]
        new.in_specs = tuple(p.specs for p in new.dynamic)
        new.out_leaves = tree(self.out_leaves)
        new.out_flat = tuple(map(leaf, self.out_flat))
        new.out_specs = _specs_of(new.out_leaves)
        new.checked = {}
        new.grads_checked = set()
        new.in_reduced = any(lf.spec.reduced for p in new.dynamic for lf in p.flat)
        return new

    def _signature(self, f: Callable) -> inspect.Signature:
        try:
            return inspect.signature(f)
        except (TypeError, ValueError) as e:
            raise TypeError(
                f"typed_shard_map({self.name}): cannot read the signature: {e}"
            ) from None

    def _static(self, static_argnames: str | Iterable[str]) -> set[str]:
        static = {static_argnames} if isinstance(static_argnames, str) else set(static_argnames)
        unknown = static - set(self.signature.parameters)
        if unknown:
            raise ValueError(
                f"typed_shard_map({self.name}): static_argnames names {sorted(unknown)}, but "
                f"{self.name} has no such parameter (it has {list(self.signature.parameters)})"
            )
        return static

    def _refuse_positional_partials(self, f: Callable, hints: Mapping[str, Any]) -> None:
        for n in _partial_positional(f):
            if _splits(hints.get(n)):
                raise TypeError(
                    f"typed_shard_map({self.name}): the partial binds parameter {n!r} "
                    f"(annotated {describe_annotation(hints[n])}, which is split) "
                    "positionally, so it would be a constant closed over by the body, whole "
                    "on every device, instead of an input split as annotated; bind it by "
                    f"keyword (functools.partial(..., {n}=value)) to pass it in as an input, "
                    "or pass it when calling"
                )

    def _param(
        self, p: inspect.Parameter, hints: Mapping[str, Any], out_axes: Mapping[str, str]
    ) -> Param:
        """The input parameter ``p``: its annotation as a pytree of leaves and specs."""
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            stars = "*" if p.kind == p.VAR_POSITIONAL else "**"
            raise TypeError(
                f"typed_shard_map({self.name}): parameter {stars}{p.name} is not supported; "
                "give every array argument its own annotated parameter"
            )
        if p.name not in hints:
            method = (
                "; to run a method, decorate the bound method instead: typed_shard_map(obj.method)"
                if p.name == "self" and next(iter(self.signature.parameters)) == "self"
                else ""
            )
            raise TypeError(
                f"typed_shard_map({self.name}): parameter {p.name!r} has no annotation; "
                f"annotate it with an array type such as f32[b'batch/d len'] or a "
                f"pytree_dataclass, or mark it static_argnames=({p.name!r},){method}"
            )
        try:
            leaves = _leaf_tree(hints[p.name], f"parameter {p.name!r}")
        except TypeError as e:
            raise TypeError(
                f"typed_shard_map({self.name}): {e}; or mark it static_argnames=({p.name!r},)"
            ) from None
        flat, treedef = jax.tree.flatten(leaves, is_leaf=is_leaf)
        ann = hints[p.name]
        return Param(
            p.name, p.kind, False, ann, leaves, _specs_of(leaves), tuple(flat), treedef, out_axes
        )

    def _read_return(self, hints: Mapping[str, Any]) -> None:
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
        self.out_text = describe_annotation(hints["return"])
        out_flat, self.out_treedef = jax.tree.flatten(self.out_leaves, is_leaf=is_leaf)
        self.out_flat = tuple(out_flat)
        self.out_specs = _specs_of(self.out_leaves)
