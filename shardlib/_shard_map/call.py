"""Preparing a ``typed_shard_map`` call: check the global arguments, trace, analyse.

`Call` holds what a decorated function needs per call besides its `ShardMapSignature`: the
mesh and the ``jax.shard_map`` keywords. A call binds the arguments, checks their global shapes in
one fresh scope (traced arguments like a call's that passed bind the names it bound, without
checks), moves inputs whose layout ``jax.shard_map`` would refuse (Explicit meshes)
to the annotated layout, checks the traced body's partial sums once per trace key
(`shardlib._analysis.walk.check_body`), explains JAX's refusals, and hands back the
``jax.shard_map`` that the decorated function's wrapper runs.
"""

from __future__ import annotations

import functools
import inspect
import math
import operator
from collections.abc import Callable
from itertools import repeat
from typing import Any

import jax
from jax.core import Tracer
from typeguard import TypeCheckError

from .._analysis.notes import recording
from .._check.checking import annotation_str, check_value, format_sizes
from .._check.format import describe_value
from .._check.pytree import flatten_to
from .._check.scopes import Scope
from .._env import context as _context
from .._env import rules as _rules
from .._lang.parsing import ShapeSpec, SpecError
from .body import checked_body
from .layout import Compared, compared_axes, onto_mesh, refuse_summing, to_layout
from .refusal import (
    check_reduced_gradients,
    check_traced,
    explain_jax_refusal,
    name_operands,
    out_spec_texts,
    replication_hint,
)
from .signature import Param, ShardMapSignature, describe_annotation

__all__ = ["Call", "Calls"]


class Call:
    """A decorated function's calls: its signature, mesh and ``jax.shard_map`` keywords."""

    def __init__(
        self,
        sig: ShardMapSignature,
        mesh: Any | None,
        extra: dict[str, Any],
        manual: frozenset[str] | None,
    ) -> None:
        self.sig = sig
        self.mesh = mesh
        self.extra = extra
        self.manual = manual
        self.extra_key = tuple(sorted((k, repr(v)) for k, v in extra.items()))
        self.statics = [p.name for p in sig.params if p.static]
        params = sig.signature.parameters.values()
        positional = all(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params)
        self.positional = tuple(p.name for p in params) if positional else None
        self.passed: dict[tuple, dict[str, int]] = {}  # see `_checked`

    def prepare(
        self, args: tuple, kwargs: dict[str, Any]
    ) -> tuple[Callable[..., Callable], list[Any], Any]:
        """Bind and check a call's arguments, analyse the body once per trace key, and return
        ``smap`` (``smap()`` is the ``jax.shard_map`` of the body, to run with notes off: the
        program the user wrote), its arguments and the trace key (for `confirm`).

        The caller runs it, so that between the caller and the body JAX sees no shardlib
        frame: on CPython 3.11 every frame on the stack while the body is traced can cost
        trace time (see ``benchmarks/alignment.py``).
        """
        sig, names = self.sig, self.positional
        if not kwargs and names is not None and len(args) == len(names):
            arguments = dict(zip(names, args, strict=True))  # no Signature.bind needed
        else:
            try:
                bound = sig.signature.bind(*args, **kwargs)
            except TypeError as e:
                raise TypeError(f"{sig.name}(): {e}") from None
            bound.apply_defaults()
            arguments = bound.arguments
        m = self.mesh if self.mesh is not None else _context.concrete_mesh()
        # Under jit, jax.set_mesh's mesh is only visible as the abstract mesh.
        target = m if m is not None else _context.abstract_mesh()
        if target is None:
            raise ValueError(
                f"typed_shard_map({sig.name}) needs a mesh: call it inside "
                "`with jax.set_mesh(mesh):` (or the legacy `with mesh:`), or pass mesh=..."
            )
        scope = Scope(owner=sig.name)
        dyn, types, tree = self._checked(arguments, scope, m, target)
        statics = {n: arguments[n] for n in self.statics}
        smap = self._shard_map(m, statics, dict(scope.bindings))
        key = _trace_key(types, tree, statics, target, self.extra_key, sig.inner)
        if key is None or key not in sig.checked:
            self.analyse(smap, dyn, key)
        if sig.in_reduced:
            check_reduced_gradients(smap, dyn, sig, key)
        if types is None and not _context.EAGER_UNREDUCED and sig.typed_specs:
            smap = _under_jit(smap)  # JAX 0.9's eager shard_map refuses unreduced types
        return smap, dyn, key

    def _checked(
        self, arguments: dict[str, Any], scope: Scope, m: Any | None, target: Any
    ) -> tuple[list[Any], tuple | None, Any]:
        """The dynamic arguments checked in ``scope`` and moved to their layout, their types
        (None if eager) and structure. Traced arguments whose structure, types and meshes (all
        the checks read: the scope starts empty) passed, moving nothing, bind those names."""
        sig = self.sig
        dyn = [arguments[p.name] for p in sig.dynamic]
        leaves, tree = jax.tree.flatten(dyn)
        types = _types(leaves)
        passed = None
        if types is not None and all(map(isinstance, leaves, repeat(Tracer))):
            am = jax.sharding.get_abstract_mesh()
            passed = (tree, types, target, am, _context.manual_axis_items())
            names = self.passed.get(passed)
            if names is not None:
                scope.bindings.update(names)
                return dyn, types, tree
        sizes = _context.mesh_axis_sizes(target)
        compared = compared_axes(self.manual, target, sizes)
        out = [
            _prepare(v, p, sig.name, sizes, scope, m, compared)
            for v, p in zip(dyn, sig.dynamic, strict=True)
        ]
        if types is None:  # eager: no trace key, nothing remembered
            return out, None, tree
        moved, moved_tree = jax.tree.flatten(out)
        if moved_tree != tree or any(a is not b for a, b in zip(moved, leaves, strict=True)):
            return out, _types(moved), moved_tree
        if passed is not None:
            if len(self.passed) >= _CHECKED_MAX:
                self.passed.clear()
            self.passed[passed] = dict(scope.bindings)
        return out, types, tree

    def analyse(self, smap: Callable[..., Callable], dyn: list[Any], key: Any) -> None:
        """Analyse the body's partial sums, unless ``key`` was analysed (see `_analyse`)."""
        try:
            _analyse(smap, dyn, self.sig, key)
        except ValueError as e:
            hint = self.replication_error(e)
            if hint is None:
                raise
            raise hint from None

    def confirm(
        self, smap: Callable[..., Callable], dyn: list[Any], key: Any, ops: list[Any]
    ) -> None:
        """After the run trace: if it made other shardops calls than the analysed trace for
        ``key`` (the body read state that changed), analyse the program that ran."""
        if key is None or self.sig.checked.get(key) == tuple(ops):
            return
        self.sig.checked.pop(key, None)
        self.analyse(smap, dyn, key)

    def replication_error(self, e: ValueError) -> ValueError | None:
        """shardlib's explanation of JAX's refusal to return a value as replicated, if ``e``
        is that refusal."""
        return replication_hint(self.sig, e)

    def _shard_map(
        self, m: Any, statics: dict[str, Any], bindings: dict[str, int]
    ) -> Callable[..., Callable]:
        """``smap(**override)``: the ``jax.shard_map`` of the body, with the static values
        and the dim sizes the global arguments bound.

        The body is ``functools.partial(sig.body, statics, bindings)``: a partial adds no
        Python frame.
        """
        sig = self.sig
        body = functools.partial(sig.body, statics, bindings)
        # What inspect would derive from the body's signature, on every call: JAX reads it.
        body.__signature__ = _BODY_SIGNATURE  # type: ignore[attr-defined]

        def smap(wrap: Callable | None = None, **override: Any) -> Callable:
            kw = {**self.extra, **override}
            f = body if wrap is None else functools.partial(wrap, body)
            specs = {"in_specs": sig.in_specs, "out_specs": sig.out_specs}
            return jax.shard_map(f, mesh=m, **{**specs, **kw})

        return smap


def _under_jit(smap: Callable[..., Callable]) -> Callable[..., Callable]:
    """``smap`` whose ``jax.shard_map`` runs under ``jax.jit``: an eager call on a JAX whose
    eager ``shard_map`` refuses arguments or results typed unreduced or reduced
    (`shardlib._env.context.EAGER_UNREDUCED`)."""
    return lambda *a, **kw: jax.jit(smap(*a, **kw))


_BODY_SIGNATURE = inspect.Signature([inspect.Parameter("args", inspect.Parameter.VAR_POSITIONAL)])


class Calls:
    """A decorated function's `Call` per (axis rules, mesh axes) in force: with rules, a copy
    of the signature whose specs have their roles resolved (`ShardMapSignature.resolved`), its
    own trace keys."""

    def __init__(self, f: Callable, sig: ShardMapSignature, mesh: Any, options: tuple) -> None:
        sig.body = checked_body(f, sig)
        self.f, self.base = f, Call(sig, mesh, *options)
        self.by_rules: dict[tuple[int, tuple[str, ...]], tuple[Any, Call]] = {}

    def get(self) -> Call:
        rules = _rules.current()
        if rules is None:
            return self.base
        base = self.base
        am = _context.abstract_mesh() if base.mesh is None else base.mesh
        key = (id(rules), tuple(am.axis_names) if am is not None else ())
        hit = self.by_rules.get(key)
        if hit is not None and hit[0] is rules:
            return hit[1]
        sig = base.sig.resolved(f"typed_shard_map({base.sig.name})", base.mesh)
        sig.body = checked_body(self.f, sig)
        made = Call(sig, base.mesh, base.extra, base.manual)
        if len(self.by_rules) > 64:
            self.by_rules.clear()
        self.by_rules[key] = (rules, made)
        return made


def _types(leaves: list[Any]) -> tuple | None:
    """The arguments' types; None for an eager call (nothing traced) or values JAX cannot type."""
    if not any(map(isinstance, leaves, repeat(Tracer))):
        return None
    if all(map(isinstance, leaves, repeat(Tracer))):  # under jit: what jax.typeof returns
        return tuple(map(_AVAL, leaves))  # for a tracer, without its two calls per leaf
    try:
        return tuple(map(jax.typeof, leaves))
    except Exception:  # pragma: no cover - values JAX cannot type: always check and analyse
        return None


_AVAL = operator.attrgetter("aval")


def _trace_key(
    types: tuple | None, tree: Any, statics: dict[str, Any], mesh: Any, extra: tuple, f: Callable
) -> Any:
    """What a trace of the body depends on, as jit sees it (argument types and structure,
    static values, mesh, ``jax.shard_map`` keywords), and the objects the body's own code
    reads (closure cells, globals); None for an eager call (``types`` None) or unhashable."""
    if types is None:
        return None
    try:
        statics_key = tuple(sorted(statics.items())) if statics else ()
        key = (_reads(f), types, tree, statics_key, mesh, extra, _context.manual_axis_items())
        hash(key)
    except Exception:  # unhashable static values: always analyse
        return None
    return key


def _reads(f: Callable) -> tuple[Any, ...]:
    """The identity of what ``f``'s own code reads besides its arguments: its code, its
    closure cells' contents and the globals it names (a rebound closure or global gives
    another trace key; a mutated object is caught by `Call.confirm`)."""
    f = getattr(f, "__wrapped__", f)
    code = getattr(f, "__code__", None)
    if code is None:
        return (id(f),)
    cells = tuple(id(c.cell_contents) for c in (f.__closure__ or ()) if _filled(c))
    return (code, cells, tuple(map(id, map(f.__globals__.get, code.co_names))))


def _filled(cell: Any) -> bool:
    try:
        cell.cell_contents  # noqa: B018 - an empty cell raises
    except ValueError:
        return False
    return True


_CHECKED_MAX = 256


def _analyse(
    smap: Callable[..., Callable], args: list[Any], sig: ShardMapSignature, key: Any
) -> None:
    """Check the body's partial sums on one trace, once per trace ``key``.

    The ``shard_map`` is traced to a jaxpr, with the notes shardops leave on partial sums
    (`shardlib._analysis.notes`), and its body is analysed by `shardlib._analysis.walk`. The caller then
    runs it as written, with notes off: the program that runs (and that ``jax.grad``
    differentiates) is exactly the hand-written one. The body's Python runs twice on the
    first trace for a ``key`` (argument types, static values, mesh) and once on later ones,
    whose analysis is the one in ``checked``; a compiled call runs neither.

    When JAX itself refuses the body while tracing it with ``check_vma`` on (a forgotten
    reduction often shows up there first, as a type error), the body is traced once more
    with ``check_vma`` off: if the analysis then finds a misused partial sum, that error
    (which names the op and line that made it) is raised instead of JAX's. An op's refusal
    of an operand is raised as it reads with the body's arguments named (`name_operands`).
    """
    checked, fname = sig.checked, sig.name
    if key is not None and key in checked:
        return
    try:
        with recording() as ops:
            closed = jax.make_jaxpr(smap())(*args)
    except TypeCheckError as e:
        raise name_operands(smap, args, sig, e) from None
    except SpecError:
        raise
    except Exception as e:  # JAX's refusal: TypeError, ValueError, its ShardingTypeError...
        explain_jax_refusal(smap, args, fname, e, out_spec_texts(sig), sig.out_specs)
        raise
    check_traced(closed, fname, out_spec_texts(sig))
    if key is not None:
        if len(checked) >= _CHECKED_MAX:
            checked.clear()
        checked[key] = tuple(ops)


def _prepare(
    value: Any,
    p: Param,
    fname: str,
    sizes: dict[str, int],
    scope: Scope,
    mesh: Any,
    compared: Compared | None,
) -> Any:
    """Check the global shape of one argument and move it to its annotated layout where
    ``jax.shard_map`` would refuse its layout (``compared``: see `_compared_axes`)."""
    _check_not_nested(p, fname)
    vals = flatten_to(
        p.treedef,
        value,
        lambda: (
            f"argument {p.name!r} of {fname}(): expected "
            f"{describe_annotation(p.annotation)}, got {describe_value(value)}; pass a value with "
            "the annotated structure"
        ),
    )
    out = []
    where = f"argument {p.name!r} of {fname}()"
    for lf, v in zip(p.flat, vals, strict=True):
        check_value(v, lf.dtype, lf.spec, scope, where=where, check_sharding=False, resolved=True)
        _check_divisible(v, lf.spec, sizes, p.name, fname)
        refuse_summing(v, lf, p.name, fname)
        if compared is not None:
            v = to_layout(v, lf, mesh, compared, sizes)
        elif mesh is not None:
            v = onto_mesh(v, lf, mesh)
        out.append(v)
    return p.treedef.unflatten(out)


def _check_not_nested(p: Param, fname: str) -> None:
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
