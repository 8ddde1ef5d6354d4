"""The axis rules in force, and specs resolved under them on the mesh in force.

``with shardlib.axis_rules(batch='d', tensor='t'):`` puts rules in force (a context variable);
`shape`, `text` and `axes` resolve a parsed shape spec, op-spec text or axis-name arguments
with them (`shardlib._lang.roles`). With no rules in force each returns its argument: one
context-variable read. With rules, the resolution is cached per (spec, rules, mesh axes), so
a check or an op pays a dictionary lookup on the hot path.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import jax

from .._lang.parsing import ShapeSpec, SpecError, as_str
from .._lang.roles import AxisRules, Resolver, make_rules
from . import context as _context

__all__ = ["AxisRules", "axes", "axis_rules", "current", "one_axis", "origin", "shape", "text"]

_RULES: contextvars.ContextVar[AxisRules | None] = contextvars.ContextVar(
    "shardlib_axis_rules", default=None
)


@contextlib.contextmanager
def axis_rules(
    rules: Mapping[str, Any] | Iterable[tuple[str, Any]] | None = None, /, **kwargs: Any
) -> Iterator[AxisRules]:
    """Map the roles named in specs to mesh axes while the ``with`` block runs.

    **Arguments:** `rules` as a mapping or ``(role, mesh axes)`` pairs (as Flax NNX's
    ``sharding_rules`` are written), and/or keywords: ``batch=('d', 'f')`` splits a ``/batch``
    dim over ``d`` then ``f``, ``fsdp='d'`` over ``d``, ``tensor=None`` not at all.

    A name that is an axis of the mesh in force keeps meaning that axis, so specs written
    with mesh axes are unchanged. The rules replace any rules in force outside the block.
    They are part of ``jax.jit``'s cache key: a jitted function called under other rules is
    traced again (under the same rules, its trace is reused).

    Examples:
        >>> with jax.set_mesh(mesh), shardlib.axis_rules(batch='d', fsdp='d', tensor='t'):
        ...     loss = train_step(model, tokens)
    """
    made = make_rules(rules, kwargs)
    outer = _RULES.get()
    if _context.manual_axis_sizes() and (outer is None or outer.rules != made.rules):
        raise SpecError(
            f"axis_rules({made}): entered inside a shard_map body, whose in/out specs were "
            f"resolved when it was called, under {'no rules' if outer is None else outer}; "
            "rules changed between resolving a call and tracing its body would make one "
            "program from two layouts",
            hint="enter axis_rules(...) around the call (outside typed_shard_map and jax.jit)",
        )
    token = _RULES.set(made)
    try:
        # The rules' plain tuple, not `made`: hashed in C, with no `AxisRules.__hash__`
        # callback (see `in_jit_key`).
        with _context.in_jit_key(made.rules):
            yield made
    finally:
        _RULES.reset(token)


def current() -> AxisRules | None:
    """The axis rules in force (``shardlib.axis_rules``), or None when none are.

    ``rules[role]`` is the tuple of mesh axes a role maps to (``()``: replicated), ``role in
    rules`` says whether it has a rule, ``rules.rules`` lists ``(role, axes)`` in order.

    Examples:
        >>> with shardlib.axis_rules(batch=('d', 'f'), tensor=None):
        ...     shardlib.shardtypes.current_axis_rules()['batch']
        ('d', 'f')
    """
    return _RULES.get()


# (rules, mesh axes) -> Resolver. (id(spec), id(rules), id(mesh)) -> (spec, rules, mesh,
# resolved spec): the values keep the keys' objects, so that their ids are not reused meanwhile.
_RESOLVERS: dict[tuple[AxisRules, tuple[str, ...] | None], Resolver] = {}
_SHAPES: dict[tuple[int, int, int], tuple[ShapeSpec, AxisRules, Any, ShapeSpec]] = {}
_TEXTS: dict[tuple[str, int, int], tuple[AxisRules, Any, str]] = {}
_AXES: dict[tuple[Any, int, int], tuple[AxisRules, Any, Any]] = {}
# id(resolved spec) -> (the spec as written, the resolved one), for messages (`origin`).
_ORIGINS: dict[int, tuple[ShapeSpec, ShapeSpec]] = {}


def _mesh() -> Any:
    """The abstract mesh in force (the legacy ``with mesh:``'s when ``jax.set_mesh`` set none;
    None when there is none): the cache keys' mesh."""
    m = jax.sharding.get_abstract_mesh()
    return m if not m.empty else _context.abstract_mesh()


def _names(mesh: Any) -> tuple[str, ...] | None:
    """The axis names of ``mesh`` (an empty abstract mesh: the legacy ``with mesh:``'s)."""
    if mesh is None or getattr(mesh, "empty", False):
        mesh = _context.abstract_mesh()
    return None if mesh is None else tuple(mesh.axis_names)


def _resolver(rules: AxisRules, mesh: Any) -> Resolver:
    key = (rules, _names(mesh))
    hit = _RESOLVERS.get(key)
    if hit is None:
        if len(_RESOLVERS) > 256:
            _RESOLVERS.clear()
        hit = _RESOLVERS[key] = Resolver(rules, key[1])
    return hit


def shape(spec: ShapeSpec, where: str = "spec", mesh: Any | None = None) -> ShapeSpec:
    """``spec`` with its roles resolved under the rules in force (``spec`` when none), on
    ``mesh`` (default: the mesh in force)."""
    rules = _RULES.get()
    if rules is None:
        return spec
    if mesh is None:
        mesh = _mesh()
    key = (id(spec), id(rules), id(mesh))
    hit = _SHAPES.get(key)
    if hit is not None and hit[0] is spec and hit[1] is rules and hit[2] is mesh:
        return hit[3]
    out = _resolver(rules, mesh).shape(spec, where)
    if len(_SHAPES) > 4096:
        _SHAPES.clear()
        _ORIGINS.clear()
    _SHAPES[key] = (spec, rules, mesh, out)
    if out is not spec:
        _ORIGINS[id(out)] = (spec, out)
    return out


def origin(spec: ShapeSpec) -> ShapeSpec | None:
    """The spec as written that resolved to ``spec`` under rules, or None."""
    hit = _ORIGINS.get(id(spec))
    return hit[0] if hit is not None and hit[1] is spec else None


def roles_note(written: ShapeSpec) -> str:
    """``"role 'fsdp' -> mesh axis 'd', role 'tensor' -> None (replicated)"`` for the roles in
    ``written`` under the rules in force ('' when none)."""
    rules = _RULES.get()
    if rules is None:
        return ""
    names = _names(None)
    seen: list[str] = []
    for n in (*(a for d in written.dims for a in d.sharding), *written.pending):
        if n in rules and (names is None or n not in names) and n not in seen:
            seen.append(n)
    return ", ".join(f"role {n!r} -> {_axes_words(rules[n])}" for n in seen)


def _axes_words(axes: tuple[str, ...]) -> str:
    if not axes:
        return "None (replicated)"
    return f"mesh axis {axes[0]!r}" if len(axes) == 1 else f"mesh axes {axes!r}"


def role_hint(name: str) -> str:
    """For a name that is no mesh axis, with no axis rules in force: how to use it as a role
    (``''`` when rules are in force: their resolution said what is wrong)."""
    if _RULES.get() is not None or name in (_names(None) or ()):
        return ""  # rules said what is wrong / a mesh axis, just not usable here
    return (
        f"; if {name!r} is a role (a logical axis), put axis rules in force around the call: "
        f"with shardlib.axis_rules({name}=<mesh axes>)"
    )


def text(spec: str | bytes, where: str = "spec") -> str:
    """Op-spec text with its roles resolved under the rules in force on the mesh in force.

    ``where`` names the caller in messages: an op's name (``'all_gather'``: messages start
    ``all_gather('spec'):``) or a phrase (``'gpipe: argument `spec`'``).
    """
    s = spec if isinstance(spec, str) else as_str(spec)
    rules = _RULES.get()
    if rules is None:
        return s
    mesh = _mesh()
    key = (s, id(rules), id(mesh))
    hit = _TEXTS.get(key)
    if hit is not None and hit[0] is rules and hit[1] is mesh:
        return hit[2]
    if len(_TEXTS) > 4096:
        _TEXTS.clear()
    label = where if " " in where else f"{where}({s!r})"
    out = _resolver(rules, mesh).text(s, label)
    _TEXTS[key] = (rules, mesh, out)
    return out


def axes(value: Any, where: str = "axes") -> Any:
    """An axis-name argument (``'tensor'``, ``'d/t'``, ``('batch', 'c')``) resolved; other
    values unchanged (the op's own parser judges them). A tuple when anything changed."""
    rules = _RULES.get()
    if rules is None:
        return value
    mesh = _mesh()
    try:
        key = (value, id(rules), id(mesh))
        hit = _AXES.get(key)
    except TypeError:  # unhashable (a list): not cached
        key, hit = None, None
    if hit is not None and hit[0] is rules and hit[1] is mesh:
        return hit[2]
    if isinstance(value, str):
        names = tuple(p for p in value.replace("/", " ").split() if p)
    elif isinstance(value, tuple | list) and all(isinstance(p, str) for p in value):
        names = tuple(value)
    else:
        return value
    if not names:
        return value
    out = _resolver(rules, mesh).axes(names, where)
    out = value if out == names else out
    if key is not None:
        if len(_AXES) > 4096:
            _AXES.clear()
        _AXES[key] = (rules, mesh, out)
    return out


def one_axis(fn: str, arg: str, axis: Any) -> Any:
    """``axis`` (a mesh axis or a role) as the one mesh axis that ``fn``'s argument ``arg``
    names (stage axis, ring axis, the axis a permutation moves along); other values as given
    (``fn`` judges them)."""
    out = axes(axis, f"{fn}: argument `{arg}`")
    if not isinstance(out, tuple) or out == axis:
        return out
    if len(out) == 1:
        return out[0]
    rules = _RULES.get()
    became = f"{len(out)} mesh axes {out!r}" if out else "no mesh axis (None: replicated)"
    raise SpecError(
        f"{fn}: argument `{arg}` is {axis!r}, which the axis rules in force ({rules}) resolve "
        f"to {became}; {fn} needs exactly one mesh axis there",
        hint=f"map {axis!r} to one mesh axis in axis_rules(...), or name a mesh axis",
    )
