"""``typed_shard_map``: ``jax.shard_map`` with in/out specs read from annotations.

Everything that depends only on ``f`` (its signature, resolved annotations, the in/out
``PartitionSpec`` pytrees, the instrumented body) is computed once, at decoration time, into
a `_Plan`. A call then binds the arguments, checks their global shapes in one fresh
binding scope, moves inputs whose layout ``jax.shard_map`` would refuse (Explicit meshes) to
the annotated layout, and runs ``jax.shard_map``.
"""

from __future__ import annotations

import ast
import functools
import inspect
import math
import re
import textwrap
import types
import typing
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import jax
import typeguard
from jax.core import Tracer
from jax.sharding import AxisType, NamedSharding, PartitionSpec
from typeguard import TypeCheckError

from . import _context
from ._checking import _describe_value, annotation_str, check_value, format_sizes
from ._dataflow import check_body
from ._frames import raised_by_shardlib
from ._parsing import ShapeSpec, SpecError
from ._pending import PendingReductionError, notes_off
from ._pytree import Array, map_annotation
from ._scopes import Scope
from ._types import ArrayType

__all__ = ["typed_shard_map"]


@dataclass(frozen=True)
class _Leaf:
    """One array annotation in a parameter's type: not a pytree node."""

    dtype: Any
    spec: ShapeSpec
    pspec: PartitionSpec  # one entry per dim, as jax.typeof(x).sharding.spec has


@dataclass(frozen=True)
class _Param:
    name: str
    kind: Any  # inspect.Parameter kind
    static: bool
    annotation: Any = None
    leaves: Any = None  # pytree of _Leaf shaped like the annotation
    specs: Any = None  # pytree of PartitionSpec shaped like the annotation
    flat: tuple[_Leaf, ...] = ()  # the leaves, flattened
    treedef: Any = None  # the treedef of `leaves`
    # Mesh axes the function's return annotation splits over -> that annotation, so that a
    # call nested in a shard_map body already manual over one of them is refused clearly.
    out_axes: Mapping[str, str] | None = None


def _leaf_tree(t: Any, what: str) -> Any:
    return map_annotation(
        t, lambda dtype, spec: _Leaf(dtype, spec, spec.partition_spec()), what=what
    )


def _is_leaf(x: Any) -> bool:
    return isinstance(x, _Leaf)


def _specs_of(leaves: Any) -> Any:
    return jax.tree.map(lambda lf: lf.pspec, leaves, is_leaf=_is_leaf)


def _resolve_hints(f: Callable, name: str, namespace: Mapping[str, Any]) -> dict[str, Any]:
    """``f``'s annotations, evaluated; names local to the decorating scope are found too."""
    try:
        return typing.get_type_hints(f)
    except NameError:
        pass
    try:
        return typing.get_type_hints(f, localns=dict(namespace))
    except NameError as e:
        raise TypeError(
            f"typed_shard_map({name}): cannot resolve the annotations: {e}; define the types "
            "they name before decorating"
        ) from None


def _unwrap(f: Callable) -> tuple[Callable, Callable[[Callable], Callable]]:
    """The Python function whose code ``f`` runs, and how to rebuild ``f`` around another.

    A bound method runs its ``__func__`` (with ``self`` bound), a ``functools.partial`` its
    ``func`` (with the bound arguments), a callable object its class's ``__call__``. The
    annotations and source are the function's; ``rebuild(g)`` is ``f`` with ``g`` in place
    of that function (used to put the typeguard-instrumented function back).
    """
    if isinstance(f, types.MethodType):
        inner, rebuild = _unwrap(f.__func__)
        owner = f.__self__
        return inner, lambda g: types.MethodType(rebuild(g), owner)
    if isinstance(f, functools.partial):
        inner, rebuild = _unwrap(f.func)
        args, keywords = f.args, f.keywords
        return inner, lambda g: functools.partial(rebuild(g), *args, **keywords)
    if callable(f) and not inspect.isfunction(f) and not isinstance(f, type):
        call = type(f).__call__
        if inspect.isfunction(call):
            inner, rebuild = _unwrap(call)
            return inner, lambda g: types.MethodType(rebuild(g), f)
    return f, lambda g: g


def _callable_name(f: Any) -> str:
    """How messages name ``f``: ``fn``, ``Model.apply``, ``partial(fn)``, ``Model.__call__``."""
    if isinstance(f, functools.partial):
        return f"partial({_callable_name(f.func)})"
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


def _check_callable(f: Any, name: str) -> None:
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
            f"{_describe_value(f)}"
        )


class _Plan:
    """Everything derived from ``f``'s signature, computed once at decoration time.

    ``f`` may be a function, a bound method, a ``functools.partial`` or a callable object:
    its annotations are read from the function it runs (see `_unwrap`). A parameter bound
    by keyword in a partial keeps its value as a default: an array annotation makes it an
    input of the ``shard_map`` like any other; any other annotation (or none) makes it static.
    """

    def __init__(
        self, f: Callable, static_argnames: Iterable[str], namespace: Mapping[str, Any]
    ) -> None:
        self.name = _callable_name(f)
        _check_callable(f, self.name)
        inner, _ = _unwrap(f)
        self.short_name = getattr(inner, "__name__", None) or self.name
        try:
            self.signature = inspect.signature(f)
        except (TypeError, ValueError) as e:
            raise TypeError(
                f"typed_shard_map({self.name}): cannot read the signature: {e}"
            ) from None
        static = {static_argnames} if isinstance(static_argnames, str) else set(static_argnames)
        unknown = static - set(self.signature.parameters)
        if unknown:
            raise ValueError(
                f"typed_shard_map({self.name}): static_argnames names {sorted(unknown)}, but "
                f"{self.name} has no such parameter (it has {list(self.signature.parameters)})"
            )
        hints = _resolve_hints(inner if inner is not f else f, self.name, namespace)
        bound_by_partial = _partial_keywords(f)
        for n in _partial_positional(f):
            if _splits(hints.get(n)):
                raise TypeError(
                    f"typed_shard_map({self.name}): the partial binds parameter {n!r} "
                    f"(annotated {_describe(hints[n])}, which is split) positionally, so it "
                    "would be a constant closed over by the body, whole on every device, "
                    "instead of an input split as annotated; bind it by keyword "
                    f"(functools.partial(..., {n}=value)) to pass it in as an input, or pass "
                    "it when calling"
                )
        self.params: list[_Param] = []
        out_axes = _out_axes(hints)
        for p in self.signature.parameters.values():
            if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                stars = "*" if p.kind == p.VAR_POSITIONAL else "**"
                raise TypeError(
                    f"typed_shard_map({self.name}): parameter {stars}{p.name} is not supported; "
                    "give every array argument its own annotated parameter"
                )
            if p.name in static or (
                p.name in bound_by_partial and not _is_array_annotation(hints.get(p.name))
            ):
                self.params.append(_Param(p.name, p.kind, True))
                continue
            if p.name not in hints:
                method = (
                    "; to run a method, decorate the bound method instead: "
                    "typed_shard_map(obj.method)"
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
            flat, treedef = jax.tree.flatten(leaves, is_leaf=_is_leaf)
            self.params.append(
                _Param(
                    p.name,
                    p.kind,
                    False,
                    hints[p.name],
                    leaves,
                    _specs_of(leaves),
                    tuple(flat),
                    treedef,
                    out_axes,
                )
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
        self.out_text = _describe(hints["return"])
        out_flat, self.out_treedef = jax.tree.flatten(self.out_leaves, is_leaf=_is_leaf)
        self.out_flat = tuple(out_flat)
        self.out_specs = _specs_of(self.out_leaves)
        self.dynamic = [p for p in self.params if not p.static]
        self.in_specs = tuple(p.specs for p in self.dynamic)
        self.dynamic_names = [p.name for p in self.dynamic]
        self.positional_only = [
            p.name for p in self.params if p.kind == inspect.Parameter.POSITIONAL_ONLY
        ]
        # Trace keys (argument types, static values, mesh) whose body passed the partial-sum
        # analysis: a later trace with the same key skips it, as jit skips a cached trace.
        self.checked: set[Any] = set()
        self.body = _explicitly_checked(_instrument(f, namespace, self.name), self)


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
    leaves = jax.tree.leaves(_leaf_tree(t, "a parameter"), is_leaf=_is_leaf)
    return any(lf.spec.mesh_axes() for lf in leaves)


def _out_axes(hints: Mapping[str, Any]) -> dict[str, str]:
    """``{mesh axis: the return annotation}`` for the axes the return annotation splits over."""
    try:
        leaves = jax.tree.leaves(_leaf_tree(hints["return"], "the return type"), is_leaf=_is_leaf)
    except (KeyError, TypeError, ValueError):
        return {}  # reported by _Plan with its own message
    return {
        a: f"the return annotation {annotation_str(lf.dtype, lf.spec)}"
        for lf in leaves
        for a in lf.spec.mesh_axes()
    }


def _instrument(f: Callable, namespace: Mapping[str, Any], name: str) -> Callable:
    """typeguard-instrument the function ``f`` runs (see `_unwrap`), and rebuild ``f``."""
    inner, rebuild = _unwrap(f)
    checked = _instrument_function(inner, namespace, name)
    return f if checked is inner else rebuild(checked)


def _instrument_function(f: Callable, namespace: Mapping[str, Any], name: str) -> Callable:
    """typeguard-instrument ``f`` once (for annotated assignments in its body); else ``f``.

    typeguard cannot instrument functions without source (``exec``, REPL) and skips
    annotations that use names local to the enclosing function; the arguments and the
    result are therefore always checked by `_explicitly_checked` as well.

    A spec written as ``str`` (``f32['batch']``) is read by typeguard as a forward
    reference (``f32[batch]``) and fails when the function runs. When the body has no
    annotated assignments nothing is lost by not instrumenting ``f``, so ``f`` is used as
    is; otherwise the str spec is an error here, at decoration time, with the fix.
    """
    found = _str_specs(f, namespace)
    if found is not None:
        where, written, has_assignments = found
        if not has_assignments:
            return f
        fixed = written.replace("['", "[b'").replace('["', '[b"')
        raise TypeError(
            f"typed_shard_map({name}): {where} writes its spec as a str: {written}. "
            "typeguard, which checks the annotated assignments in the body, reads a str "
            f"inside [...] as a forward reference (f32['batch'] as f32[batch]) and fails "
            f"when the function runs. Write the spec as bytes: {fixed}"
        )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # typeguard's InstrumentationWarning: we fall back
        try:
            checked = typeguard.typechecked(f)
        except Exception:  # source unavailable, syntax typeguard cannot handle, ...
            return f
    code = getattr(checked, "__code__", None)
    if checked is f or code is None or code is getattr(f, "__code__", None):
        return f
    fixed = _fix_closure(f, checked, namespace)
    return fixed if fixed is not None else f


def _str_specs(f: Callable, namespace: Mapping[str, Any]) -> tuple[str, str, bool] | None:
    """The first shardlib annotation in ``f``'s source that writes its spec as a ``str``.

    Returns ``(where, annotation as written, whether the body has annotated assignments)``,
    or None when there is none (or no source to read).
    """
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(f)))
    except (OSError, TypeError, SyntaxError, ValueError):
        return None
    node = next(
        (
            n
            for n in ast.walk(tree)
            if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)
            and n.name == getattr(f, "__name__", None)
        ),
        None,
    )
    if node is None:
        return None
    args = node.args
    annotated: list[tuple[str, ast.expr | None]] = [
        (f"parameter {a.arg!r}", a.annotation)
        for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)
    ]
    annotated.append(("the return type", node.returns))
    assignments = [n for n in _own_nodes(node) if isinstance(n, ast.AnnAssign)]
    for a in assignments:
        target = ast.unparse(a.target)
        annotated.append(
            (f"the annotated assignment to {target!r} (line {a.lineno})", a.annotation)
        )
    scope = {**getattr(f, "__globals__", {}), **namespace}
    for where, ann in annotated:
        for sub in ast.walk(ann) if ann is not None else ():
            if isinstance(sub, ast.Subscript) and _is_str_spec(sub, scope):
                return where, ast.unparse(sub), bool(assignments)
    return None


def _own_nodes(fn: ast.AST) -> Iterable[ast.AST]:
    """The nodes of ``fn``'s body, not descending into nested functions or classes."""
    todo = list(ast.iter_child_nodes(fn))
    while todo:
        n = todo.pop()
        yield n
        if not isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef | ast.Lambda):
            todo.extend(ast.iter_child_nodes(n))


def _is_str_spec(sub: ast.Subscript, scope: Mapping[str, Any]) -> bool:
    """Whether ``sub`` is ``f32['...']`` or ``Array['...', T]`` with a str spec."""
    value = sub.value
    dotted: list[str] = []
    while isinstance(value, ast.Attribute):
        dotted.insert(0, value.attr)
        value = value.value
    if not isinstance(value, ast.Name) or value.id not in scope:
        return False
    obj: Any = scope[value.id]
    for attr in dotted:
        obj = getattr(obj, attr, None)
    spec = sub.slice
    if obj is Array and isinstance(spec, ast.Tuple) and spec.elts:
        spec = spec.elts[0]
    elif not (isinstance(obj, type) and issubclass(obj, ArrayType)):
        return False
    return isinstance(spec, ast.Constant) and isinstance(spec.value, str)


def _fix_closure(f: Any, checked: Any, namespace: Mapping[str, Any]) -> Any | None:
    """Give the instrumented code the values of the names its annotations use.

    typeguard's instrumented code refers to the annotation expressions. When those use names
    local to the scope that decorated ``f`` (``X = f32[b'a/d']`` in a function), typeguard
    looks for them in the frame that called ``typechecked`` (ours, not the user's), does not
    find them, and silently skips the check. We rebuild the closure from the decorating
    scope's names; None when a name cannot be found (the caller falls back).
    """
    new_free = checked.__code__.co_freevars
    old_free = f.__code__.co_freevars
    if new_free == old_free:
        return checked
    cells = []
    for key in new_free:
        if key in old_free:
            cells.append(f.__closure__[old_free.index(key)])
        elif key in namespace:
            cells.append(types.CellType(namespace[key]))
        else:
            return None
    fixed = types.FunctionType(
        checked.__code__, checked.__globals__, checked.__name__, checked.__defaults__, tuple(cells)
    )
    fixed.__kwdefaults__ = checked.__kwdefaults__
    fixed.__qualname__ = checked.__qualname__
    fixed.__module__ = checked.__module__
    fixed.__doc__ = checked.__doc__
    fixed.__annotations__ = checked.__annotations__
    return fixed


def _explicitly_checked(f: Callable, plan: _Plan) -> Callable:
    """Check ``f``'s arguments and result against the plan's annotations on every call.

    All checks of one call share one fresh scope, entered in this frame; the ``shardops`` in
    the body find it. (When typeguard instrumented ``f`` with checks of its own, the body's
    ``shardops`` use ``f``'s per-call typeguard scope instead, bound from the same
    annotations.) This is the only check for functions typeguard cannot instrument.
    """
    sig = plan.signature
    dynamic = plan.dynamic
    name = plan.name

    @functools.wraps(f)
    def body(*args: Any, **kwargs: Any) -> Any:
        bound = sig.bind(*args, **kwargs)
        with Scope(owner=name) as s:
            for p in dynamic:
                what = f"argument {p.name!r}"
                _check_tree(bound.arguments[p.name], p.flat, p.treedef, s, what, name)
            try:
                out = f(*args, **kwargs)
            except TypeCheckError as e:  # e.g. from a shardops call: say whose body it was
                _name_function(e, plan.short_name, name)
                raise
            _check_tree(out, plan.out_flat, plan.out_treedef, s, "the return value", name)
        return out

    return body


def _name_function(e: TypeCheckError, short_name: str, name: str) -> None:
    """Say in ``e``'s message that it was raised in the body of ``name``.

    An error from a shardops call gets the prefix ``in name(): ``. An error that already
    names where it happened (typeguard's ``argument "y" ...`` path, or ``in other(): ``
    from a checked function called in the body) keeps its start, which names the argument
    of *that* function, and gets a last line naming the body instead.
    """
    if f"{short_name}()" in str(e) or not e.args or not isinstance(e.args[0], str):
        return
    msg = e.args[0]
    if getattr(e, "_path", None) or msg.startswith("in "):
        e.args = (f"{msg}\n  (raised in the body of {name}())", *e.args[1:])
    else:
        e.args = (f"in {name}(): {msg}", *e.args[1:])


class _Shown:
    """A placeholder whose repr is the given text (to print a treedef with annotations)."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


def _structure_text(flat: tuple[_Leaf, ...], treedef: Any) -> str:
    """The annotated structure, e.g. ``(f32['a/d'], f32['b'])``."""
    try:
        shown = [_Shown(annotation_str(lf.dtype, lf.spec)) for lf in flat]
        return repr(treedef.unflatten(shown))
    except Exception:  # a node type that will not hold placeholders: JAX's own text
        return str(treedef)


def _check_tree(
    value: Any, flat: tuple[_Leaf, ...], treedef: Any, s: Scope, what: str, fname: str
) -> None:
    try:
        vals = treedef.flatten_up_to(value)
    except (ValueError, TypeError):
        raise TypeCheckError(
            f"{what} of {fname}() does not have the annotated structure: expected "
            f"{_structure_text(flat, treedef)}, got {_describe_value(value)}"
        ) from None
    for lf, v in zip(flat, vals, strict=True):
        check_value(v, lf.dtype, lf.spec, s, where=f"{what} of {fname}()")


def typed_shard_map(
    f: Callable | None = None,
    *,
    mesh: Any | None = None,
    static_argnames: str | Iterable[str] = (),
    check_vma: bool | None = None,
    check_rep: bool | None = None,
    axis_names: str | Iterable[str] | None = None,
    **shard_map_kwargs: Any,
) -> Any:
    """Run ``f`` per device with ``jax.shard_map``, reading in/out specs from annotations.

    **Arguments:**

    - `f`: the per-device function: a function, a bound method (``model.apply``), a
      ``functools.partial`` or an object with ``__call__``. Every non-static parameter and
      the return value are annotated with array types (``f32[b'batch/d len']``), pytree
      dataclasses, ``Array['layers', T]`` or tuples of those. A parameter a partial binds by
      keyword stays an input if it is annotated as an array, and is static otherwise.
    - `mesh`: a ``jax.sharding.Mesh``; default the one from ``jax.set_mesh`` or the legacy
      ``with mesh:``.
    - `static_argnames`: parameters passed through as Python values (closed over).
    - `check_vma` (alias `check_rep`), `axis_names`: passed to ``jax.shard_map``.

    **Returns:** a function taking global arrays (or NumPy arrays) and returning global
    arrays, eagerly or under ``jax.jit``. Global shapes are checked first (dtype, names,
    divisibility by the mesh axes). On meshes whose axes are all Explicit (``jax.make_mesh``'s
    default) an input in another layout is resharded to the annotated one; an input already
    in it is passed as is, so the program is the one a hand-written ``jax.shard_map`` gives.

    Inside ``f`` the annotations are checked against per-device blocks (times the manual axis
    sizes), with a fresh binding scope per call shared with the ``shardops`` in the body.

    **Raises:** ``TypeError`` at decoration time for a parameter without an array annotation
    (unless static), ``*args``/``**kwargs``, a missing return annotation, a ``mesh`` that is
    not a mesh, a class or non-callable ``f``, or a partial binding a split array positionally;
    ``ValueError`` for a call nested in a ``shard_map`` body already manual over an axis its
    annotations split over;
    ``typeguard.TypeCheckError`` for a value that does not match its annotation; ``ValueError``
    when no mesh is in force.

    Examples:
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
    fname = _callable_name(f)
    _check_callable(f, fname)
    _check_mesh(fname, mesh)
    _check_shard_map_kwargs(fname, shard_map_kwargs)
    if check_rep is not None:
        if check_vma is not None and check_vma != check_rep:
            raise ValueError(
                f"typed_shard_map({fname}): check_rep={check_rep} and check_vma={check_vma} "
                "disagree; check_rep is the old name of check_vma, pass only check_vma"
            )
        check_vma = check_rep
    # The scope that applies the decorator: typeguard and typing need it to resolve names
    # used in annotations that are local to it (functools.partial adds no Python frame).
    caller = inspect.currentframe()
    namespace = dict(caller.f_back.f_locals) if caller and caller.f_back else {}
    del caller
    plan = _Plan(f, static_argnames, namespace)
    del namespace
    extra = dict(shard_map_kwargs)
    if check_vma is not None:
        extra["check_vma"] = check_vma
    manual: frozenset[str] | None = None
    if axis_names is not None:
        manual = frozenset((axis_names,) if isinstance(axis_names, str) else axis_names)
        extra["axis_names"] = set(manual)

    @functools.wraps(f)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            bound = plan.signature.bind(*args, **kwargs)
        except TypeError as e:
            raise TypeError(f"{plan.name}(): {e}") from None
        bound.apply_defaults()
        arguments = bound.arguments
        m = mesh if mesh is not None else _context.concrete_mesh()
        # Under jit, jax.set_mesh's mesh is only visible as the abstract mesh.
        target = m if m is not None else _context.abstract_mesh()
        if target is None:
            raise ValueError(
                f"typed_shard_map({plan.name}) needs a mesh: call it inside "
                "`with jax.set_mesh(mesh):` (or the legacy `with mesh:`), or pass mesh=..."
            )
        sizes = _context.mesh_axis_sizes(target)
        types_ = _context.axis_types(target)
        # jax.shard_map insists that inputs already have the in_specs layout exactly when all
        # mesh axes are manual and Explicit; elsewhere it moves them itself.
        must_match = (manual is None or manual >= set(sizes)) and all(
            t == AxisType.Explicit for t in types_.values()
        )
        scope = Scope(owner=plan.name)
        dyn = [
            _prepare(arguments[p.name], p, plan.name, sizes, scope, m, must_match)
            for p in plan.dynamic
        ]
        static_vals = {p.name: arguments[p.name] for p in plan.params if p.static}

        def body(*dyn_vals: Any) -> Any:
            kw = dict(static_vals)
            kw.update(zip(plan.dynamic_names, dyn_vals, strict=True))
            pos = [kw.pop(n) for n in plan.positional_only]
            return plan.body(*pos, **kw)

        body.__name__ = plan.short_name  # JAX's own errors then name the user's function
        body.__qualname__ = plan.name

        def smap(**override: Any) -> Callable:
            kw = {**extra, **override}
            return jax.shard_map(
                body, mesh=m, in_specs=plan.in_specs, out_specs=plan.out_specs, **kw
            )

        try:
            key = _trace_key(dyn, static_vals, target, extra)
            return _run_checked(smap, dyn, plan.name, plan.checked, key)
        except ValueError as e:
            if "require replication" not in str(e):
                raise
            raise ValueError(
                _REPLICATION_HINT.format(name=plan.name, ann=plan.out_text, e=e)
            ) from None

    wrapper.__shardlib_plan__ = plan  # type: ignore[attr-defined]
    return wrapper


def _trace_key(dyn: list[Any], statics: dict[str, Any], mesh: Any, extra: dict) -> Any:
    """What a trace of the body depends on, as jit sees it; None when it cannot be hashed."""
    try:
        key = (
            tuple(jax.typeof(v) for v in jax.tree.leaves(dyn)),
            jax.tree.structure(dyn),
            tuple(sorted(statics.items())),
            mesh,
            tuple(sorted((k, repr(v)) for k, v in extra.items())),
            tuple(sorted(_context.manual_axis_sizes().items())),
        )
        hash(key)
    except Exception:  # unhashable static values, values JAX cannot type: always analyse
        return None
    return key


_CHECKED_MAX = 256


def _run_checked(
    smap: Callable[..., Callable],
    args: list[Any],
    fname: str,
    checked: set[Any] | None = None,
    key: Any = None,
) -> Any:
    """Check the body's partial sums on one trace, then run the program the user wrote.

    The ``shard_map`` is first traced to a jaxpr, with the notes shardops leave on partial
    sums (`shardlib._pending`), and its body is analysed by `shardlib._dataflow`. Then it is
    called as written, with notes off: the program that runs (and that ``jax.grad``
    differentiates) is exactly the hand-written one. The body's Python runs twice on the
    first trace for a ``key`` (argument types, static values, mesh) and once on later ones,
    whose analysis is the one in ``checked``; a compiled call runs neither.

    When JAX itself refuses the body while tracing it with ``check_vma`` on (a forgotten
    reduction often shows up there first, as a type error), the body is traced once more
    with ``check_vma`` off: if the analysis then finds a misused partial sum, that error
    (which names the op and line that made it) is raised instead of JAX's.
    """
    if checked is None or key is None or key not in checked:
        try:
            closed = jax.make_jaxpr(smap())(*args)
        except (TypeCheckError, SpecError):
            raise
        except (TypeError, ValueError) as e:
            _explain_jax_refusal(smap, args, fname, e)
            raise
        _check_traced(closed, fname)
        if checked is not None and key is not None:
            if len(checked) >= _CHECKED_MAX:
                checked.clear()
            checked.add(key)
    with notes_off():
        return smap()(*args)


def _check_traced(closed: Any, fname: str) -> None:
    for eqn in closed.jaxpr.eqns:
        if eqn.primitive.name == "shard_map":
            check_body(eqn.params["jaxpr"], _in_axes(eqn.params), fname)


def _explain_jax_refusal(smap: Callable[..., Callable], args: list[Any], fname: str, e: Exception):
    """Raise the partial-sum error behind JAX's refusal ``e``, if there is one."""
    try:
        closed = jax.make_jaxpr(smap(check_vma=False))(*args)
    except Exception as other:  # the body fails without check_vma too
        same = type(other) is type(e) and str(other) == str(e)
        if not same and (
            isinstance(other, TypeCheckError | SpecError) or raised_by_shardlib(other)
        ):
            raise other.with_traceback(None) from e  # shardlib's error further on says more
        return
    try:
        _check_traced(closed, fname)
    except (PendingReductionError, SpecError) as mine:
        raise mine.with_traceback(None) from e
    carry = _SCAN_CARRY.search(str(e))
    if isinstance(e, TypeError) and carry:
        name, in_type, out_type = carry.groups()
        fix = _PCAST.search(str(e))
        axes = fix.group(1) if fix else "AXES"
        raise TypeError(
            f"in {fname}(): the loop carry {name!r} of a lax.scan/fori_loop/while_loop in the "
            f"body starts as {in_type} and the loop body returns it as {out_type}: with "
            "check_vma on, JAX types a value by the mesh axes it may vary over, and the body "
            "makes the carry vary over more (shardops.all_gather results count as varying "
            "although every device holds the same block). Fix: start it varying, "
            f"`{name} = jax.lax.pcast({name}, {axes}, to='varying')` before the loop, or pass "
            f"check_vma=False to typed_shard_map.\n\nJAX's message: {e}"
        ) from None


def _in_axes(params: Mapping[str, Any]) -> list[frozenset[str]]:
    """For each body input of a ``shard_map`` equation, the mesh axes it is split over."""
    if "in_specs" in params:
        return [
            frozenset(
                a for entry in spec for a in ((entry,) if isinstance(entry, str) else (entry or ()))
            )
            for spec in params["in_specs"]
        ]
    return [frozenset(a for axes in names.values() for a in axes) for names in params["in_names"]]


_SCAN_CARRY = re.compile(
    r"input carry (\S+) has type (\S+) but the corresponding output carry component has "
    r"type (\S+),"
)
_PCAST = re.compile(r"pcast\(\.\.\., (\([^)]*\)), to='varying'\)")

_REPLICATION_HINT = """typed_shard_map({name}): the return annotation {ann} says the result is \
replicated over a mesh axis, and JAX cannot prove it is: with check_vma on, a value computed \
from split inputs stays 'varying' over their axes until psum/pmean/pmax (or psum_scatter) makes \
it invariant, and lax.all_gather results stay varying. Reduce the value, return it split \
(gathering outside), or pass check_vma=False to typed_shard_map.

JAX's message: {e}"""


def _check_mesh(fname: str, mesh: Any) -> None:
    """Refuse, at decoration time, a ``mesh=`` that is not a mesh (``mesh='d'``)."""
    if mesh is None or isinstance(mesh, jax.sharding.Mesh | jax.sharding.AbstractMesh):
        return
    hint = (
        f"; to run the body manual over mesh axis {mesh!r} only, pass axis_names={mesh!r} "
        "(and the mesh through jax.set_mesh or mesh=)"
        if isinstance(mesh, str)
        else ""
    )
    raise TypeError(
        f"typed_shard_map({fname}): mesh must be a jax.sharding.Mesh such as "
        "jax.make_mesh((8,), ('d',)) (or left out, to use the one from jax.set_mesh), got "
        f"{_describe_value(mesh)}{hint}"
    )


def _check_shard_map_kwargs(fname: str, kwargs: Mapping[str, Any]) -> None:
    """Reject, at decoration time, keywords ``jax.shard_map`` would refuse at call time."""
    for k in ("in_specs", "out_specs"):
        if k in kwargs:
            raise TypeError(
                f"typed_shard_map({fname}): do not pass {k}; it is read from {fname}'s "
                "annotations (use jax.shard_map directly to give specs by hand)"
            )
    try:
        accepted = set(inspect.signature(jax.shard_map).parameters)
    except (TypeError, ValueError):  # pragma: no cover - not introspectable: let JAX decide
        return
    unknown = sorted(set(kwargs) - accepted)
    if unknown:
        raise TypeError(
            f"typed_shard_map({fname}): unexpected keyword argument(s) {unknown}; it takes "
            "mesh, static_argnames, check_vma (or check_rep), axis_names"
        )


def _prepare(
    value: Any,
    p: _Param,
    fname: str,
    sizes: dict[str, int],
    scope: Scope,
    mesh: Any | None,
    must_match: bool,
) -> Any:
    """Check the global shape of one argument and move it to its annotated layout."""
    _check_not_nested(p, fname)
    try:
        vals = p.treedef.flatten_up_to(value)
    except (ValueError, TypeError):
        raise TypeCheckError(
            f"argument {p.name!r} of {fname}(): expected {_describe(p.annotation)}, got "
            f"{_describe_value(value)}; pass a value with the annotated structure"
        ) from None
    out = []
    for lf, v in zip(p.flat, vals, strict=True):
        check_value(
            v,
            lf.dtype,
            lf.spec,
            scope,
            where=f"argument {p.name!r} of {fname}()",
            check_sharding=False,
        )
        _check_divisible(v, lf.spec, sizes, p.name, fname)
        if must_match:
            v = _to_layout(v, lf, mesh)
        elif mesh is not None:
            v = _onto_mesh(v, lf, mesh)
        out.append(v)
    return p.treedef.unflatten(out)


def _check_not_nested(p: _Param, fname: str) -> None:
    """Refuse a call inside a shard_map body already manual over an axis ``fname`` splits over.

    There each device holds its block already; JAX cannot split it again over that axis (and
    the sizes seen there are per-device sizes, so the shape checks would say nonsense).
    """
    manual = _context.manual_axis_sizes()
    if not manual:
        return
    uses = {
        a: f"argument {p.name!r} is annotated {annotation_str(lf.dtype, lf.spec)}"
        for lf in p.flat
        for a in lf.spec.mesh_axes()
    }
    for a, where in (p.out_axes or {}).items():
        uses.setdefault(a, where)
    clash = [a for a in uses if a in manual]
    if not clash:
        return
    a = clash[0]
    raise ValueError(
        f"typed_shard_map({fname}) is called inside a shard_map body that is already manual "
        f"over mesh axis {a!r} (manual axes: {format_sizes(manual)}), and {uses[a]}, which "
        f"splits over {a!r}: a nested typed_shard_map over {a!r} again is impossible (each "
        f"device already holds its block); call {fname}() outside the body, call the "
        "undecorated function in the body, or annotate it over the other mesh axes only"
    )


def _describe(t: Any) -> str:
    """An annotation as written: ``f32['a/d']``, ``tuple[f32['a'], Weights]``."""
    origin = typing.get_origin(t)
    if origin is not None:
        name = getattr(origin, "__qualname__", None) or repr(origin)
        args = ", ".join("..." if a is Ellipsis else _describe(a) for a in typing.get_args(t))
        return f"{name}[{args}]"
    return getattr(t, "__qualname__", None) or repr(t)


def _check_divisible(v: Any, spec: ShapeSpec, sizes: dict[str, int], pname: str, fname: str):
    for i, (d, n) in enumerate(zip(spec.dims, v.shape, strict=True)):
        if not d.sharding:
            continue
        missing = [a for a in d.sharding if a not in sizes]
        if missing:
            raise TypeCheckError(
                f"argument {pname!r} of {fname}(): dim {i} {str(d)!r} is split over mesh axis "
                f"{missing[0]!r}, which the mesh does not have (axes: {format_sizes(sizes)})"
            )
        k = math.prod(sizes[a] for a in d.sharding)
        if n % k:
            raise TypeCheckError(
                f"argument {pname!r} of {fname}(): dim {i} {str(d)!r} has global size {n}, which "
                "is not divisible by "
                + " × ".join(f"{a}={sizes[a]}" for a in d.sharding)
                + f" = {k}; pad or resize it to a multiple of {k}"
            )


def _to_layout(v: Any, leaf: _Leaf, mesh: Any | None) -> Any:
    """Reshard ``v`` to ``leaf``'s layout unless its type already has exactly that spec.

    Only used where ``jax.shard_map`` compares the input's type spec with ``in_specs``
    (all axes manual and Explicit); the comparison is the same as its own, so an input
    already in the annotated layout is passed through untouched and the program is the one
    a hand-written ``shard_map`` gives. Host values (NumPy) and arrays placed without a mesh
    have an empty-mesh type and are moved onto the mesh.
    """
    try:
        actual = jax.typeof(v).sharding.spec
    except Exception:  # not an array JAX knows: leave it to shard_map's own error
        return v
    if actual == leaf.pspec:
        return v
    if mesh is None:  # only under jit inside jax.set_mesh, where a PartitionSpec means its mesh
        return jax.reshard(v, leaf.pspec)
    if isinstance(v, Tracer):
        return jax.reshard(v, NamedSharding(mesh, leaf.pspec))
    # Concrete values may live on devices outside the mesh (one committed device): copy them.
    return jax.device_put(v, NamedSharding(mesh, leaf.pspec))


def _onto_mesh(v: Any, leaf: _Leaf, mesh: Any) -> Any:
    """Copy a concrete array committed to devices outside ``mesh`` onto it (eager only)."""
    if not isinstance(v, jax.Array) or isinstance(v, Tracer):
        return v
    if not v.committed or v.sharding.device_set == set(mesh.devices.flat):
        return v
    return jax.device_put(v, NamedSharding(mesh, leaf.pspec))
