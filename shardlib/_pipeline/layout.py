"""Moving stacked layer weights between the pipeline's two layouts (JAX): `to_groups` and
`from_groups`.

gpipe, 1f1b and zb-h1 take a stack ``(L, ...)`` split on dim 0 (``'layers/p ...'``); circular
and interleaved take ``(v, L / v, ...)`` split on dim 1 (``'v layers/p ...'``), in model order
group-major: layer ``r * (L / v) + j`` is ``[r, j]``. The public face is `shardlib.pipeline`.
"""

from __future__ import annotations

import math
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import Tracer
from jax.sharding import NamedSharding, PartitionSpec

from .._env.context import spec_entries

__all__ = ["from_groups", "to_groups"]

T = TypeVar("T")

_TO, _FROM = "pipeline.to_groups", "pipeline.from_groups"


def to_groups(
    tree: T, v: int | None = None, *, route: str = "ring", stages: int | None = None
) -> T:
    """Regroup stacked layer weights ``(L, ...)`` into ``v`` layer groups ``(v, L / v, ...)``.

    The one-group layout of gpipe, 1f1b and zb-h1 (``'layers/p ...'``) becomes the layout of
    circular and interleaved (``'v layers/p ...'``), in model order: layer ``r * (L / v) + j``
    becomes ``[r, j]`` (group ``r``; ``j``'s block over ``p`` is its stage). Every array leaf
    of `tree` is regrouped; apply it to the stacked layers (and to the optimizer moments that
    mirror them), not to a whole train state with scalars in it.

    A global ``jax.Array`` with a ``NamedSharding`` comes back laid out as the grouped
    annotation gives: a leading ``None`` in its PartitionSpec, the axes of its old dim 0 on dim
    1 and its other dims unchanged (``P('p', 'd')`` becomes ``P(None, 'p', 'd')``). All such
    leaves are regrouped in one ``jax.jit`` with those ``out_shardings``: layers move between
    the stages (stage ``s`` held layers ``s*L/p ..``, it now holds ``v`` non-adjacent blocks).
    Numpy arrays and single-device arrays are reshaped; under ``jit`` (traced values) each leaf
    is reshaped, with the grouped layout as ``out_sharding`` where its type has Explicit mesh
    axes. The values are exact (no arithmetic).

    **Arguments:**

    - `tree`: any pytree (a dict, a ``pytree_dataclass``, a ``Stacked[...]`` layer tree) of
      global arrays whose dim 0 is the layer dim ``L``.
    - `v`: the number of layer groups per stage, a positive int dividing ``L``; when dim 0 is
      split over mesh axes of ``p`` devices in all, ``L / v`` must divide by ``p``. Required
      for ``route='ring'``; for ``route='v'`` it is 2 (zb-v's two chunks) and may be left out.
    - `route`: ``'ring'`` (circular, interleaved: stage ``s`` holds groups ``s, s + p, ...``)
      or ``'v'`` (zb-v, ``v = 2``: stage ``s`` holds groups ``s`` and ``2p - 1 - s`` of the
      ``2p`` groups of ``L / (2p)`` layers, so ``[1]`` holds the second half of the model
      with its stage blocks in reverse order).
    - `stages`: ``p``, for ``route='v'`` when dim 0 is not split over mesh axes (numpy
      arrays); otherwise read from the split.

    **Returns:** `tree` with every leaf ``(L, ...)`` reshaped to ``(v, L / v, ...)``.

    **Raises:** ``ValueError`` naming the leaf (its path), the dim and the sizes: `v` not a
    positive int, ``L`` not a multiple of `v`, ``L / v`` not a multiple of ``p``, a scalar
    leaf.

    Examples:
        >>> # params: Stack with fields 'layers/p M F', trained (or restored) for '1f1b'
        >>> groups = pipeline.to_groups(params, 2)  # now 'v layers/p M F', for 'interleaved'
        >>> params = pipeline.from_groups(groups)  # and back, exactly
    """
    if v is None and route == "v":
        v = 2
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
        raise ValueError(
            f"{_TO}: argument `v` must be a positive int (the number of layer groups per "
            f"stage, dividing the layer count L of dim 0), got {v!r}"
        )
    if route == "v":
        if v != 2:
            raise ValueError(
                f"{_TO}: route='v' takes two layer chunks per stage, so argument `v` must be 2 "
                f"(or left out), got v={v}"
            )
        return _v_order(_TO, _regroup(tree, 2), stages)
    if route != "ring":
        raise ValueError(f"{_TO}: argument `route` must be 'ring' or 'v', got {route!r}")
    return _regroup(tree, int(v))


def from_groups(tree: T, *, route: str = "ring", stages: int | None = None) -> T:
    """Merge layer groups ``(v, L / v, ...)`` back into the stack ``(L, ...)``: `to_groups`'
    inverse.

    The layout of circular and interleaved (``'v layers/p ...'``) becomes the one-group layout
    of gpipe, 1f1b and zb-h1 (``'layers/p ...'``), in model order: ``[r, j]`` becomes layer
    ``r * (L / v) + j``. A global ``jax.Array`` with a ``NamedSharding`` comes back with the
    axes of its dim 1 on dim 0 (``P(None, 'p', 'd')`` becomes ``P('p', 'd')``; any axes of
    dim 0 go first), regrouped in one ``jax.jit`` with those ``out_shardings``; other leaves
    are reshaped, as in `to_groups`. Use it to save a grouped state in the one-group layout, or
    to compare the gradients of a grouped schedule with those of another.

    **Arguments:**

    - `tree`: any pytree of global arrays of rank 2 or more, dim 0 the groups and dim 1 the
      layers of each group.
    - `route`, `stages`: as `to_groups` was given them (``'v'``: zb-v's order undone).

    **Returns:** `tree` with every leaf ``(v, K, ...)`` reshaped to ``(v * K, ...)``.

    **Raises:** ``ValueError`` naming the leaf (its path) if one has rank 0 or 1.

    Examples:
        >>> stack = pipeline.from_groups(pipeline.to_groups(stack, 2))  # the same values
    """
    if route == "v":
        return _regroup(_v_order(_FROM, tree, stages), None)
    if route != "ring":
        raise ValueError(f"{_FROM}: argument `route` must be 'ring' or 'v', got {route!r}")
    return _regroup(tree, None)


def _v_order(fn: str, tree: T, stages: int | None) -> T:
    """The grouped ``(2, L / 2, ...)`` leaves with ``[1]``'s ``p`` blocks of ``L / (2p)``
    layers in reverse order (its own inverse), so that stage ``s`` holds groups ``s`` and
    ``2p - 1 - s``: zb-v's V."""

    def count(leaf: Any) -> int:
        shape = tuple(getattr(leaf, "shape", ()))
        p = stages if stages is not None else _split_over_dim(leaf, 1)
        if len(shape) < 2 or shape[0] != 2 or shape[1] % p:
            raise ValueError(
                f"{fn}: argument `tree` leaf of {shape[1] * 2 if len(shape) > 1 else shape} "
                f"layers cannot be laid out as a V on p={p} stages: expected the layer "
                f"count a multiple of 2p = {2 * p}; pass `stages=` when the layers are not "
                "split over the stage axis"
            )
        return p

    counts = jax.tree.map(count, tree)
    placed = [isinstance(x, jax.Array) and not isinstance(x, Tracer)  # a tracer has no .sharding
              and isinstance(x.sharding, NamedSharding) for x in jax.tree.leaves(tree)]  # fmt: skip
    if any(placed):
        shardings = jax.tree.map(lambda x: x.sharding, tree)
        run = jax.jit(lambda t: jax.tree.map(_flip_second, t, counts), out_shardings=shardings)
        return run(tree)
    return jax.tree.map(_flip_second, tree, counts)


def _flip_second(x: Any, p: int) -> Any:
    """``x`` ``(2, L / 2, ...)`` with ``x[1]``'s ``p`` blocks in reverse order."""
    shape = tuple(x.shape)
    blocks = (2, p, shape[1] // p, *shape[2:])
    if isinstance(x, np.ndarray):
        split = np.reshape(x, blocks)
        return np.reshape(np.concatenate([split[:1], split[1:, ::-1]]), shape)
    split = _reshape(x, blocks, None, keep=True)
    both = jnp.concatenate([split[:1], jnp.flip(split[1:], axis=1)], axis=0)
    return _reshape(both, shape, None, keep=True)


def _split_over_dim(leaf: Any, dim: int) -> int:
    """The devices dim ``dim`` of ``leaf`` is split over (1: not split, or not known)."""
    try:
        sharding = jax.typeof(leaf).sharding if isinstance(leaf, Tracer) else leaf.sharding
    except AttributeError:
        return 1
    if not isinstance(sharding, NamedSharding) or len(sharding.spec) <= dim:
        return 1
    sizes = dict(zip(sharding.mesh.axis_names, sharding.mesh.axis_sizes, strict=True))
    return math.prod(sizes[a] for a in _axes(sharding.spec[dim]))


def _regroup(tree: T, v: int | None) -> T:
    """`to_groups` (``v`` an int) or `from_groups` (``v`` None) of every leaf of ``tree``."""
    fn = _TO if v is not None else _FROM
    paths_leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
    _check_leaves(fn, paths_leaves, v)
    out: list[Any] = []
    placed: list[int] = []  # concrete arrays with a NamedSharding: regrouped under one jit
    for i, (_, leaf) in enumerate(paths_leaves):
        shape = _new_shape(tuple(leaf.shape), v)
        if isinstance(leaf, Tracer):
            out.append(_reshape(leaf, shape, v))
        elif isinstance(leaf, jax.ShapeDtypeStruct):
            sharding = leaf.sharding
            if isinstance(sharding, NamedSharding):
                sharding = NamedSharding(sharding.mesh, _new_spec(sharding.spec, leaf.ndim, v))
            out.append(jax.ShapeDtypeStruct(shape, leaf.dtype, sharding=sharding))
        elif isinstance(leaf, jax.Array) and isinstance(leaf.sharding, NamedSharding):
            out.append(None)
            placed.append(i)
        elif isinstance(leaf, jax.Array):
            out.append(jnp.reshape(leaf, shape))
        else:
            out.append(np.reshape(leaf, shape))
    if placed:
        arrays = [paths_leaves[i][1] for i in placed]
        shardings = [
            NamedSharding(a.sharding.mesh, _new_spec(a.sharding.spec, a.ndim, v)) for a in arrays
        ]
        moved = jax.jit(_reshape_all, static_argnums=1, out_shardings=shardings)(arrays, v)
        for i, a in zip(placed, moved, strict=True):
            out[i] = a
    return jax.tree_util.tree_unflatten(treedef, out)


def _reshape_all(arrays: list[jax.Array], v: int | None) -> list[jax.Array]:
    return [_reshape(a, _new_shape(a.shape, v), v) for a in arrays]


def _reshape(x: jax.Array, shape: tuple[int, ...], v: int | None, keep: bool = False) -> jax.Array:
    """``x`` reshaped under a trace: with the new layout as ``out_sharding`` where its type
    carries mesh axes (Explicit axes; JAX refuses to guess how a split dim splits). With
    ``keep``, ``x`` is ``(2, L / 2, ...)`` or ``(2, p, k, ...)`` and dim 1 keeps its axes."""
    sharding = jax.typeof(x).sharding
    if not isinstance(sharding, NamedSharding) or not any(
        _axes(e) for e in spec_entries(sharding.spec)
    ):
        return jnp.reshape(x, shape)
    if keep:
        entries = list(spec_entries(sharding.spec)) + [None] * x.ndim
        if len(shape) > x.ndim:  # dim 1 split into (p, k): its axes go to the p dim
            spec = PartitionSpec(entries[0], entries[1], None, *entries[2 : x.ndim])
        else:  # dims 1 and 2 merged: the p dim's axes stay
            spec = PartitionSpec(entries[0], entries[1], *entries[3 : x.ndim])
        return jnp.reshape(x, shape, out_sharding=NamedSharding(sharding.mesh, spec))
    out = NamedSharding(sharding.mesh, _new_spec(sharding.spec, x.ndim, v))
    return jnp.reshape(x, shape, out_sharding=out)


def _new_shape(shape: tuple[int, ...], v: int | None) -> tuple[int, ...]:
    if v is None:
        return (shape[0] * shape[1], *shape[2:])
    return (v, shape[0] // v, *shape[1:])


def _new_spec(spec: PartitionSpec, ndim: int, v: int | None) -> PartitionSpec:
    """The grouped layout of a ``(L, ...)`` leaf's ``spec`` (``v`` an int), or the one-group
    layout of a ``(v, L / v, ...)`` leaf's (``v`` None)."""
    entries = list(spec_entries(spec))
    entries += [None] * (ndim - len(entries))
    if v is not None:
        return PartitionSpec(None, *entries)
    merged = _axes(entries[0]) + _axes(entries[1])
    first = None if not merged else merged[0] if len(merged) == 1 else merged
    return PartitionSpec(first, *entries[2:])


def _axes(entry: Any) -> tuple[str, ...]:
    """The mesh axes of one PartitionSpec entry."""
    if entry is None:
        return ()
    if isinstance(entry, str):
        return (entry,)
    try:
        return tuple(a for a in entry if isinstance(a, str))
    except TypeError:  # P.UNCONSTRAINED
        return ()


def _split_over(leaf: Any) -> tuple[tuple[str, ...], int]:
    """The mesh axes dim 0 of ``leaf`` is split over, and their devices in all (its layout
    as a concrete array's ``NamedSharding``, or as its type's under ``jit``)."""
    try:
        sharding = jax.typeof(leaf).sharding if isinstance(leaf, Tracer) else leaf.sharding
    except AttributeError:
        return (), 1
    if not isinstance(sharding, NamedSharding) or not len(sharding.spec):
        return (), 1
    axes = _axes(sharding.spec[0])
    sizes = dict(zip(sharding.mesh.axis_names, sharding.mesh.axis_sizes, strict=True))
    return axes, math.prod(sizes[a] for a in axes)


def _check_leaves(fn: str, paths_leaves: list[tuple[Any, Any]], v: int | None) -> None:
    """Raise one ValueError for the first leaf that breaks a rule (naming the others that
    break one too)."""
    problems = [(p, r) for p, leaf in paths_leaves if (r := _leaf_problem(fn, leaf, v))]
    if not problems:
        return
    (path, reason), rest = problems[0], [_path(p) for p, _ in problems[1:]]
    also = f" (also {len(rest)} more: {', '.join(rest[:4])}{', ...' * (len(rest) > 4)})"
    raise ValueError(f"{fn}: argument `tree` leaf {_path(path)} {reason}{also * bool(rest)}")


def _leaf_problem(fn: str, leaf: Any, v: int | None) -> str | None:
    """Why ``leaf`` cannot be regrouped (the message after its path), or None."""
    shape = tuple(getattr(leaf, "shape", ()))
    if v is None:
        if len(shape) >= 2:
            return None
        return (
            f"has rank {len(shape)} (shape {shape}), but {fn.split('.')[1]} merges dim 0 (the "
            f"groups) with dim 1 (the layers of a group): expected rank >= 2, got "
            f"{len(shape)}; pass only the grouped 'v layers ...' weights, as to_groups returns"
        )
    if not shape:
        return (
            "is a scalar (shape ()), but to_groups splits dim 0 (the layers): expected rank "
            ">= 1, got 0; pass only the stacked 'layers ...' weights (and the optimizer moments "
            "that mirror them), not the scalars of a train state"
        )
    layers = shape[0]
    if layers % v:
        fits = [d for d in range(1, layers + 1) if layers % d == 0]
        return (
            f"has {layers} layers in dim 0 (shape {shape}), which do not split into v={v} "
            f"groups: expected dim 0 a multiple of {v}, got {layers}; pass a `v` in {fits}"
        )
    axes, p = _split_over(leaf)
    if (layers // v) % p:
        fits = [d for d in range(1, layers + 1) if layers % (d * p) == 0]
        over = f"axis {axes[0]!r}" if len(axes) == 1 else f"axes {', '.join(map(repr, axes))}"
        return (
            f"has dim 0 of {layers} layers split over mesh {over} ({p} devices), so each of "
            f"the v={v} groups must split over it too: expected the group size L / v = "
            f"{layers} / {v} a multiple of {p}, got {layers // v}; pass a `v` in {fits}"
        )
    return None


def _path(path: Any) -> str:
    """A leaf's key path as ``'params.stages.w_in'`` (field, dict and index keys alike)."""
    text = jax.tree_util.keystr(path, simple=True, separator=".")
    return repr(text) if path else "(the tree itself)"
