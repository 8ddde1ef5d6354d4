"""Candidate meshes, their axis rules, and the arguments laid out on them (no tracing).

A model offers mesh axes, each carrying some roles (``{'data': ('batch',), 'fsdp': ('batch',
'fsdp'), 'tensor': ('tensor',)}``). A candidate is a non-empty subset of them, in the order
given, with sizes of at least 2 that multiply to the device count; a role no chosen axis
carries is replicated (its rule is None). The arguments' layouts are ``in_specs`` naming roles,
resolved through the candidate's rules.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
from jax.sharding import AbstractMesh, AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from .._check.pytree import keypath_str

__all__ = [
    "abstract_args",
    "check_axes",
    "divisibility",
    "mesh_shapes",
    "rules_of",
    "shape_str",
]

Rules = dict[str, tuple[str, ...] | None]


def check_axes(axes: Mapping[str, Sequence[str]]) -> None:
    """Refuse ``axes=`` that cannot make rules: none, an axis with no roles, or an axis named
    like a role another axis carries too (an axis name always means itself in a spec)."""
    if not axes:
        raise ValueError("plan: axes= is empty; give the mesh axes and the roles each carries")
    for name, carried in axes.items():
        if isinstance(carried, str) or not all(isinstance(r, str) for r in carried):
            raise TypeError(
                f"plan: axes[{name!r}] = {carried!r}, expected a tuple of role names "
                f"(e.g. ('batch', 'fsdp'))"
            )
    for name in axes:
        carriers = [a for a, carried in axes.items() if name in carried]
        if carriers and carriers != [name]:
            raise ValueError(
                f"plan: mesh axis {name!r} is also a role carried by {carriers}; an axis name "
                f"in a spec always means that axis, so rename the axis or let only {name!r} "
                "carry the role"
            )


def mesh_shapes(devices: int, axes: Sequence[str]) -> Iterator[dict[str, int]]:
    """Every mesh over a non-empty ordered subset of ``axes`` whose sizes (each at least 2)
    multiply to ``devices``; one device: the first axis of size 1."""
    if devices == 1:
        yield {axes[0]: 1}
        return
    for k in range(1, len(axes) + 1):
        for names in itertools.combinations(axes, k):
            for sizes in _factorizations(devices, k):
                yield dict(zip(names, sizes, strict=True))


def _factorizations(n: int, k: int) -> Iterator[tuple[int, ...]]:
    """Ordered ``k``-tuples of integers of at least 2 whose product is ``n``."""
    if k == 1:
        if n >= 2:
            yield (n,)
        return
    for f in range(2, n + 1):
        if n % f == 0:
            for rest in _factorizations(n // f, k - 1):
                yield (f, *rest)


def shape_str(mesh: Mapping[str, int]) -> str:
    """``'data=4 x t=2'``: a mesh as the plan's table shows it."""
    return " x ".join(f"{a}={n}" for a, n in mesh.items())


def rules_of(
    mesh: Mapping[str, int], axes: Mapping[str, Sequence[str]], roles: Sequence[str]
) -> Rules:
    """Each role -> the mesh's axes that carry it, in mesh order, or None."""
    every = list(dict.fromkeys([r for carried in axes.values() for r in carried] + list(roles)))
    rules: Rules = {}
    for role in every:
        carried = tuple(a for a in mesh if role in axes[a])
        rules[role] = carried or None
    return rules


def _resolve(entry: Any, rules: Rules, mesh: Mapping[str, int], where: str) -> tuple[str, ...]:
    names = entry if isinstance(entry, tuple) else (entry,)
    out: list[str] = []
    for name in names:
        if name is None:
            continue
        if name in rules:
            out += rules[name] or ()
        elif name in mesh:
            out.append(name)
        else:
            raise ValueError(
                f"plan: in_specs{where} names {name!r}, which is neither a role of axes= or "
                f"roles= ({', '.join(rules)}) nor a mesh axis; add it to roles= if no axis "
                "carries it"
            )
    return tuple(out)


def resolve_spec(spec: P | None, rules: Rules, mesh: Mapping[str, int], where: str) -> P:
    """``spec`` (naming roles) as a PartitionSpec of the mesh's axes under ``rules``."""
    if spec is None:
        return P()
    entries = [_resolve(e, rules, mesh, where) for e in spec]
    return P(*[None if not e else e[0] if len(e) == 1 else e for e in entries])


def _map(args: tuple, in_specs: Any, fn: Callable[[str, Any, P | None], Any]) -> tuple:
    """``args`` with every leaf replaced by ``fn(path, leaf, spec)``, its spec taken from the
    prefix tree ``in_specs`` (one entry per argument; None: replicated)."""
    specs = (None,) * len(args) if in_specs is None else in_specs
    if not isinstance(specs, tuple) or len(specs) != len(args):
        got = f"a tuple of {len(specs)}" if isinstance(specs, tuple) else type(specs).__name__
        raise ValueError(
            f"plan: in_specs must be a tuple with one entry per argument ({len(args)}), got {got}"
        )

    def spread(i: int) -> Callable[..., Any]:
        def at(spath: Any, spec: P | None, sub: Any) -> Any:
            def leaf(lpath: Any, x: Any) -> Any:
                return fn(_path(i, tuple(spath) + tuple(lpath)), x, spec)

            return jax.tree_util.tree_map_with_path(leaf, sub)

        return at

    is_spec = lambda x: x is None or isinstance(x, P)  # noqa: E731
    return tuple(
        jax.tree_util.tree_map_with_path(spread(i), spec, arg, is_leaf=is_spec)
        for i, (arg, spec) in enumerate(zip(args, specs, strict=True))
    )


def _path(i: int, keys: tuple[Any, ...]) -> str:
    """``'[0].layers.w_q'``: argument ``i`` and the key path inside it."""
    rest = keypath_str(keys)
    return f"[{i}]" + ("" if not rest or rest.startswith("[") else ".") + rest


def divisibility(args: tuple, in_specs: Any, rules: Rules, mesh: Mapping[str, int]) -> str | None:
    """Why the arguments cannot be laid out on ``mesh`` (the first dim its axes do not
    divide), or None."""
    found: list[str] = []

    def check(path: str, leaf: Any, spec: P | None) -> None:
        if found or not hasattr(leaf, "shape") or spec is None:
            return
        for dim, entry in enumerate(resolve_spec(spec, rules, mesh, path)):
            names = () if entry is None else entry if isinstance(entry, tuple) else (entry,)
            ways = math.prod(mesh[a] for a in names)
            if names and (dim >= len(leaf.shape) or leaf.shape[dim] % ways):
                size = leaf.shape[dim] if dim < len(leaf.shape) else "missing"
                found.append(
                    f"argument {path} dim {dim} (size {size}) is not divisible by "
                    f"{' x '.join(f'{a}={mesh[a]}' for a in names)} = {ways}"
                )
                return

    _map(args, in_specs, check)
    return found[0] if found else None


def abstract_mesh(mesh: Mapping[str, int]) -> AbstractMesh:
    """The candidate as a `jax.sharding.AbstractMesh` with Explicit axes."""
    return AbstractMesh(
        tuple(mesh.values()), tuple(mesh), axis_types=(AxisType.Explicit,) * len(mesh)
    )


def abstract_args(args: tuple, in_specs: Any, rules: Rules, mesh: Any) -> tuple:
    """``args`` with every array leaf a ``jax.ShapeDtypeStruct`` placed by its resolved spec on
    ``mesh`` (abstract or concrete); other leaves (Python scalars) as they are."""
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))

    def place(path: str, leaf: Any, spec: P | None) -> Any:
        if not hasattr(leaf, "shape"):
            return leaf
        sharding = NamedSharding(mesh, resolve_spec(spec, rules, sizes, path))
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)

    return _map(args, in_specs, place)
