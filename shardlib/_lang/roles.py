"""Axis roles: logical names after ``/`` in a spec, mapped to mesh axes by rules (no JAX).

A spec such as ``'B/batch M/fsdp F/tensor'`` names *roles* where it would name mesh axes.
`AxisRules` maps each role to zero, one or several mesh axes (``None``: replicated; a tuple:
split over several, in order). `Resolver` applies one set of rules on one mesh (its axis
names): a name that is a mesh axis keeps meaning that axis; a role with a rule becomes the
rule's axes; anything else is refused with a did-you-mean. It rewrites parsed shape specs
(annotations), op-spec text (``shardops``) and axis-name arguments (``axes='tensor'``), and
refuses two dims of one spec that end up on the same mesh axis, naming both roles.

Pure Python: the mesh is given as its axis names (``None``: no mesh known, rules only).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, cast

from .fixes import did_you_mean
from .parsing import DimSpec, ShapeSpec, SpecError, is_identifier

__all__ = ["AxisRules", "Resolver", "make_rules"]

Axes = tuple[str, ...]


@dataclass(frozen=True)
class AxisRules:
    """Roles -> mesh axes, in the order given. ``()`` means replicated (a rule of ``None``)."""

    rules: tuple[tuple[str, Axes], ...]
    table: dict[str, Axes] = field(default_factory=dict, compare=False, repr=False, hash=False)

    def __post_init__(self) -> None:
        self.table.update(self.rules)
        object.__setattr__(self, "_hash", hash(self.rules))

    def __hash__(self) -> int:  # computed once: rules are dictionary keys on the hot path
        return self._hash  # type: ignore[attr-defined]

    def __str__(self) -> str:
        return ", ".join(f"{role} -> {shown_axes(axes)}" for role, axes in self.rules)

    def __contains__(self, role: object) -> bool:
        return role in self.table

    def __getitem__(self, role: str) -> Axes:
        return self.table[role]


def shown_axes(axes: Axes) -> str:
    """``('d', 'f')`` as ``"('d', 'f')"``, ``('d',)`` as ``"'d'"``, ``()`` as ``'None'``."""
    if not axes:
        return "None"
    return repr(axes[0]) if len(axes) == 1 else repr(axes)


def make_rules(
    pairs: Mapping[str, Any] | Iterable[tuple[str, Any]] | None,
    kwargs: Mapping[str, object],
    fn: str = "axis_rules",
) -> AxisRules:
    """`AxisRules` from ``pairs`` (a mapping or ``(role, axes)`` pairs, as Flax NNX writes
    them) and keyword rules; TypeError/ValueError naming the rule at fault."""
    items: list[tuple[str, object]] = []
    if pairs is not None:
        if isinstance(pairs, Mapping):
            items.extend(cast("Mapping[str, Any]", pairs).items())
        else:
            for k, pair in enumerate(pairs):
                if not (isinstance(pair, tuple | list) and len(pair) == 2):
                    raise TypeError(
                        f"{fn}: rule {k} is {pair!r}; write each rule as a (role, mesh axes) "
                        "pair such as ('batch', 'd'), ('batch', ('d', 'f')) or ('embed', None)"
                    )
                items.append((pair[0], pair[1]))
    items.extend(kwargs.items())
    out: list[tuple[str, Axes]] = []
    seen: set[str] = set()
    for role, target in items:
        if not isinstance(role, str) or not is_identifier(role):
            raise ValueError(f"{fn}: {role!r} is not a role name (a Python identifier)")
        if role in seen:
            raise ValueError(f"{fn}: role {role!r} has two rules; give each role one rule")
        seen.add(role)
        out.append((role, _target(fn, role, target)))
    # Equal rules are one object: the caches downstream key on its identity, so a `with
    # axis_rules(...)` entered anew for every call still finds what the last one resolved.
    key = tuple(out)
    hit = _INTERNED.get(key)
    if hit is None:
        if len(_INTERNED) > 256:
            _INTERNED.clear()
        hit = _INTERNED[key] = AxisRules(key)
    return hit


_INTERNED: dict[tuple[tuple[str, Axes], ...], AxisRules] = {}


def _target(fn: str, role: str, target: object) -> Axes:
    if target is None:
        return ()
    axes = (target,) if isinstance(target, str) else target
    if not isinstance(axes, tuple | list) or not all(isinstance(a, str) for a in axes):
        raise TypeError(
            f"{fn}: the rule for role {role!r} is {target!r}; map a role to a mesh axis name "
            "('d'), a tuple of them (('d', 'f'): split over both, in order) or None (replicated)"
        )
    for a in axes:
        if not is_identifier(a):
            raise ValueError(f"{fn}: the rule for role {role!r} names {a!r}, not a mesh axis name")
    if len(set(axes)) != len(axes):
        raise ValueError(f"{fn}: the rule for role {role!r} names a mesh axis twice: {target!r}")
    return tuple(axes)


_NAME = re.compile(r"([/+])([A-Za-z_][A-Za-z0-9_]*)")
_CLAUSE = re.compile(r"\{[^{}]*\}")
_EMPTY_CLAUSE = re.compile(r"\s*\{\s*\}")


class Resolver:
    """One set of rules on one mesh (``mesh``: its axis names, or None when none is known).

    Built once per (rules, mesh) and cached by the caller; checks the rules against the mesh
    when built (a rule naming an axis the mesh lacks, a rule for a mesh axis's own name).
    """

    def __init__(self, rules: AxisRules, mesh: Axes | None) -> None:
        self.rules = rules
        self.mesh = mesh
        if mesh is not None:
            for role, axes in rules.rules:
                if role in mesh and axes != (role,):
                    raise SpecError(
                        f"axis_rules: the rule {role} -> {shown_axes(axes)} never applies: "
                        f"{role!r} is an axis of the mesh in force (axes {', '.join(mesh)}), and "
                        "a mesh axis always means itself",
                        hint=f"rename the role (e.g. {role}_role) in the specs and the rules, or "
                        f"drop the rule for {role!r}",
                    )
                for a in axes:
                    if a not in mesh:
                        raise SpecError(
                            f"axis_rules: the rule {role} -> {shown_axes(axes)} names mesh axis "
                            f"{a!r}, which the mesh in force does not have (its axes: "
                            f"{', '.join(mesh)}){did_you_mean(a, mesh)}",
                            hint="use rules written for this mesh, or fix the axis name",
                        )

    def name(self, name: str, where: str, text: str = "") -> Axes:
        """The mesh axes ``name`` (a mesh axis or a role) stands for."""
        if self.mesh is not None and name in self.mesh:
            return (name,)
        hit = self.rules.table.get(name)
        if hit is not None:
            return hit
        if self.mesh is None:
            return (name,)  # no mesh known: left for the check against a mesh to judge
        known = (*self.mesh, *self.rules.table)
        raise SpecError(
            f"{where}: {name!r} is neither an axis of the mesh in force (axes "
            f"{', '.join(self.mesh)}) nor a role of the axis rules in force ({self.rules})"
            f"{did_you_mean(name, known)}",
            text,
            hint=f"add a rule for {name!r} to axis_rules(...), or name a mesh axis",
        )

    def shape(self, spec: ShapeSpec, where: str) -> ShapeSpec:
        """``spec`` with every role replaced by its mesh axes (``spec`` itself if none)."""
        names = {a for d in spec.dims for a in d.sharding} | set(spec.pending) | set(spec.reduced)
        if self.mesh is not None and names <= set(self.mesh):
            return spec
        if self.mesh is None and not names & self.rules.table.keys():
            return spec
        text = str(spec)
        dims = []
        owner: dict[str, tuple[int, DimSpec, str]] = {}
        for i, d in enumerate(spec.dims):
            axes: list[str] = []
            for role in d.sharding:
                for a in self.name(role, where, text):
                    if a in owner:
                        raise _twice(where, text, a, owner[a], (i, d, role))
                    owner[a] = (i, d, role)
                    axes.append(a)
            dims.append(DimSpec(d.shape, tuple(axes), span=d.span))
        pending = tuple(a for role in spec.pending for a in self.name(role, where, text))
        reduced = tuple(a for role in spec.reduced for a in self.name(role, where, text))
        return ShapeSpec(
            tuple(dims), pending, reduced, span=spec.span, pending_span=spec.pending_span
        )

    def text(self, text: str, where: str) -> str:
        """Op-spec text with every role replaced by its mesh axes (``text`` itself if none).

        ``'M/fsdp F/tensor -> M F/tensor'`` becomes ``'M/d F/t -> M F/t'``; a role that is
        replicated disappears (``'M/fsdp'`` -> ``'M'``, ``'{+tensor}'`` -> nothing).
        """
        names = [m.group(2) for m in _NAME.finditer(text)]
        if self.mesh is not None:
            if all(n in self.mesh for n in names):
                return text
        elif not any(n in self.rules for n in names):
            return text
        for part in re.split(r",|->", text):
            self._distinct(part, where, text)

        def sub(m: re.Match[str]) -> str:
            return "".join(m.group(1) + a for a in self.name(m.group(2), where, text))

        return _EMPTY_CLAUSE.sub("", _NAME.sub(sub, text))

    def _distinct(self, part: str, where: str, text: str) -> None:
        """Two dims of one shape spec in ``part`` resolving to one mesh axis: refused."""
        part = _CLAUSE.sub("", part)
        owner: dict[str, tuple[int, DimSpec, str]] = {}
        for i, tok in enumerate(part.replace("(", " ").replace(")", " ").split()):
            tok = tok.strip("[]")
            size, *roles = tok.split("/")
            d = DimSpec(size, tuple(roles))
            for role in roles:
                for a in self.name(role, where, text):
                    if a in owner:
                        raise _twice(where, text, a, owner[a], (i, d, role))
                    owner[a] = (i, d, role)

    def axes(self, names: Axes, where: str) -> Axes:
        """Axis-name arguments (``axes=('batch',)``) resolved, in order."""
        out: list[str] = []
        for n in names:
            for a in self.name(n, where):
                if a in out:
                    raise SpecError(
                        f"{where}: the axes {names!r} resolve to mesh axis {a!r} twice under "
                        f"the axis rules in force ({self.rules})",
                        hint="name each mesh axis once",
                    )
                out.append(a)
        return tuple(out)


def _twice(
    where: str,
    text: str,
    axis: str,
    first: tuple[int, DimSpec, str],
    second: tuple[int, DimSpec, str],
) -> SpecError:
    (i, d1, r1), (j, d2, r2) = first, second
    if i == j:
        what = f"dim {i} {str(d1)!r} resolves to mesh axis {axis!r} twice (roles {r1!r} and {r2!r})"
    else:
        what = (
            f"dims {i} {str(d1)!r} (role {r1!r}) and {j} {str(d2)!r} (role {r2!r}) both resolve "
            f"to mesh axis {axis!r}"
        )
    return SpecError(
        f"{where}: {what} under the axis rules in force; one array cannot be split over a "
        "mesh axis twice",
        text,
        hint=f"map {r1!r} and {r2!r} to different mesh axes (or one of them to None)",
    )
