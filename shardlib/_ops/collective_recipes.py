"""What each ``shardops`` op spec means: validated, cached recipes (pure Python, no JAX).

Each ``*_recipe`` function takes the op's spec string (and, for the all-reduces, its mesh
axes), parses it, checks that it describes the collective the op names, and returns a small
frozen `Recipe` that the op skeleton (`shardlib._ops.run`) runs. Recipes are cached per spec text,
so an op traced again costs a dictionary lookup. The local ops' recipes (``einsum_unreduced``,
``index_unreduced``) are in `shardlib._ops.local_recipes`, the point-to-point ops' (``ppermute``,
``shift``) in `shardlib._ops.permute_recipes`, the reducing ``einsum``'s in
`shardlib._ops.reduced_einsum_recipe`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from .._lang.op_spec import OpSpec, parse_op_spec
from .._lang.parsing import ShapeSpec, SpecError, as_str, is_identifier, refuse_reduced
from .local_recipes import EinsumRecipe, IndexRecipe, einsum_recipe, index_recipe
from .permute_recipes import PermuteRecipe, ShiftRecipe, ppermute_recipe, shift_recipe
from .recipe import Recipe, axes_list

__all__ = [
    "AllGatherRecipe",
    "AllReduceRecipe",
    "AllToAllRecipe",
    "AxesRecipe",
    "EinsumRecipe",
    "IndexRecipe",
    "PermuteRecipe",
    "Recipe",
    "ReduceScatterRecipe",
    "ShiftRecipe",
    "parse_axes",
    "all_gather_recipe",
    "all_reduce_recipe",
    "all_to_all_recipe",
    "axes_recipe",
    "einsum_recipe",
    "index_recipe",
    "ppermute_recipe",
    "psum_scatter_recipe",
    "shift_recipe",
]


def _same_rank(ops: OpSpec, op: str, fix: str) -> None:
    a, b = ops.inputs[0], ops.output
    if len(a.dims) != len(b.dims):
        raise ops.error(
            f"{op}: input has {len(a.dims)} dims but output has {len(b.dims)}; {op} keeps the rank",
            operand=None,
            dim=None,  # underline the whole output
            hint=fix,
        )


def _same_names(ops: OpSpec, op: str) -> None:
    for i, (a, b) in enumerate(zip(ops.inputs[0].dims, ops.output.dims, strict=True)):
        if a.shape != b.shape:
            raise ops.error(
                f"{op}: dim {i} is {a.shape!r} in the input but {b.shape!r} in the output; "
                f"{op} does not rename or reorder dims",
                operand=None,
                dim=i,
                hint="write the same dim names in the same order on both sides",
            )


def _moved_hint(other: ShapeSpec, dim: int, axes: tuple[str, ...], *, into: bool) -> str:
    """A hint naming all_to_all when ``axes`` shard another dim of ``other``, else ''.

    ``into=True``: dim ``dim`` gains ``axes`` and ``other`` is the input; ``into=False``: it
    loses them and ``other`` is the output.
    """
    for j, d in enumerate(other.dims):
        hit = [x for x in axes if x in d.sharding]
        if j != dim and hit:
            src, dst = (j, dim) if into else (dim, j)
            return f"this moves mesh axis {hit[0]!r} from dim {src} to dim {dst}: use all_to_all"
    return ""


def _trailing_changes(
    ops: OpSpec, op: str, *, removes: bool, other_hint: str, order_hint: str
) -> tuple[tuple[int, tuple[str, ...]], ...]:
    """``(dim, axes)`` for each dim whose trailing mesh axes ``op`` removes (or adds).

    all_gather (``removes=True``) needs each output dim's axes to be a prefix of the input's;
    psum_scatter the reverse. Anything else is an error saying what the spec does instead.
    """
    verb = "remove" if removes else "add"
    changes = []
    for i, (a, b) in enumerate(zip(ops.inputs[0].dims, ops.output.dims, strict=True)):
        short, long = (b.sharding, a.sharding) if removes else (a.sharding, b.sharding)
        if long[: len(short)] != short:
            if short[: len(long)] == long:
                what = "adds sharding" if removes else "removes sharding"
                moved = short[len(long) :]
                hint = (
                    _moved_hint(ops.inputs[0] if removes else ops.output, i, moved, into=removes)
                    or other_hint
                )
            elif set(short) <= set(long):
                what = f"does not {verb} trailing mesh axes"
                hint = order_hint
            else:
                what = "replaces mesh axes"
                hint = f"{op} only {verb}s trailing mesh axes; to move an axis between dims "
                hint += "use all_to_all"
            raise ops.error(
                f"{op}: dim {i} goes from {str(a)!r} to {str(b)!r}, which {what}",
                operand=None,
                dim=i,
                hint=hint,
            )
        if len(long) > len(short):
            changes.append((i, long[len(short) :]))
    return tuple(changes)


@dataclass(frozen=True)
class AllGatherRecipe(Recipe):
    gathers: tuple[tuple[int, tuple[str, ...]], ...]  # (dim, mesh axes removed)


def all_gather_recipe(spec: str | bytes, empty_ok: bool = False) -> AllGatherRecipe:
    """The recipe of ``all_gather(spec, x)``: which dims lose which trailing mesh axes.

    ``empty_ok``: a spec that gathers nothing is an identity (axis rules made its roles
    replicated) rather than an error. The same holds for the other collectives' recipes.
    """
    return _all_gather_recipe(as_str(spec), empty_ok)


@functools.lru_cache(maxsize=1024)
def _all_gather_recipe(spec: str, empty_ok: bool) -> AllGatherRecipe:
    op = "all_gather"
    ops = parse_op_spec(spec, op=op, n_inputs=1)
    _same_rank(ops, op, "all_gather only removes mesh axes: 'a/d b -> a b'")
    _same_names(ops, op)
    gathers = _trailing_changes(
        ops,
        op,
        removes=True,
        other_hint="all_gather only removes mesh axes; psum_scatter adds them (summing over them)",
        order_hint="all_gather removes axes from the end: 'a/x/y -> a/x', not 'a/x/y -> a/y'",
    )
    if not gathers and not empty_ok:
        raise ops.spec_error(
            f"{op}: the spec gathers nothing (input and output layouts are equal)",
            hint="remove the call, or remove a '/axis' from the output",
        )
    needs = tuple(a for _, axes in gathers for a in axes)
    why = "all_gather keeps the pending axes of its input"
    return AllGatherRecipe(ops, gathers, op=op, needs=needs, why=why)


@dataclass(frozen=True)
class ReduceScatterRecipe(Recipe):
    scatters: tuple[tuple[int, tuple[str, ...]], ...]  # (dim, mesh axes added)


def psum_scatter_recipe(spec: str | bytes, empty_ok: bool = False) -> ReduceScatterRecipe:
    """The recipe of ``psum_scatter(spec, x)``: which dims gain which trailing mesh axes."""
    return _psum_scatter_recipe(as_str(spec), empty_ok)


@functools.lru_cache(maxsize=1024)
def _psum_scatter_recipe(spec: str, empty_ok: bool) -> ReduceScatterRecipe:
    op = "psum_scatter"
    ops = parse_op_spec(spec, op=op, n_inputs=1)
    _same_rank(ops, op, "psum_scatter only adds mesh axes: 'a b -> a/d b'")
    _same_names(ops, op)
    scatters = _trailing_changes(
        ops,
        op,
        removes=False,
        other_hint="psum_scatter only adds mesh axes; all_gather removes them",
        order_hint="psum_scatter adds axes at the end: 'a/x -> a/x/y', not 'a/x -> a/y/x'",
    )
    if not scatters and not empty_ok:
        raise ops.spec_error(
            f"{op}: the spec scatters nothing (input and output layouts are equal)",
            hint=f"to sum without scattering use psum({str(ops.inputs[0])!r}, x, axes=...)",
        )
    summed = tuple(a for _, axes in scatters for a in axes)
    why = f"this sums over {axes_list(summed)}"
    return ReduceScatterRecipe(ops, scatters, op=op, needs=summed, sums=summed, why=why)


@dataclass(frozen=True)
class AllToAllRecipe(Recipe):
    axes: tuple[str, ...]
    split_dim: int  # the dim that gains the axes (split into blocks)
    concat_dim: int  # the dim that loses the axes (blocks concatenated)


def all_to_all_recipe(spec: str | bytes, empty_ok: bool = False) -> AllToAllRecipe:
    """The recipe of ``all_to_all(spec, x)``: the mesh axes moved and the two dims."""
    return _all_to_all_recipe(as_str(spec), empty_ok)


def _moves(ops: OpSpec, op: str) -> tuple[int | None, tuple[str, ...], int | None, tuple[str, ...]]:
    """``(src, axes lost, dst, axes gained)``: the one dim that loses trailing mesh axes and
    the one that gains some (None when none does). Any other change is an error."""
    src = dst = None
    moved_from: tuple[str, ...] = ()
    moved_to: tuple[str, ...] = ()
    for i, (a, b) in enumerate(zip(ops.inputs[0].dims, ops.output.dims, strict=True)):
        if a.sharding == b.sharding:
            continue
        n = len(b.sharding)
        loses = n < len(a.sharding) and a.sharding[:n] == b.sharding
        gains = len(a.sharding) < n and b.sharding[: len(a.sharding)] == a.sharding
        if not (loses or gains):
            raise ops.error(
                f"{op}: dim {i} goes from {str(a)!r} to {str(b)!r}; all_to_all removes trailing "
                "axes from one dim and appends them to another",
                operand=None,
                dim=i,
            )
        if (src if loses else dst) is not None:
            raise ops.error(
                f"{op}: dims {src if loses else dst} and {i} both {'lose' if loses else 'gain'} "
                "mesh axes; all_to_all moves axes out of one dim into one other dim",
                operand=None,
                dim=i,
                hint="split it into several all_to_all calls",
            )
        if loses:
            src, moved_from = i, a.sharding[n:]
        else:
            dst, moved_to = i, b.sharding[len(a.sharding) :]
    return src, moved_from, dst, moved_to


@functools.lru_cache(maxsize=1024)
def _all_to_all_recipe(spec: str, empty_ok: bool) -> AllToAllRecipe:
    op = "all_to_all"
    ops = parse_op_spec(spec, op=op, n_inputs=1)
    _same_rank(ops, op, "all_to_all moves a mesh axis between dims: 'a/d b -> a b/d'")
    _same_names(ops, op)
    src, moved_from, dst, moved_to = _moves(ops, op)
    if src is None and dst is None and empty_ok:
        return AllToAllRecipe(ops, (), split_dim=0, concat_dim=0, op=op, needs=())
    if src is None and dst is None:
        raise ops.spec_error(
            f"{op}: the spec moves nothing (input and output layouts are equal)",
            hint="all_to_all moves mesh axes from one dim to another, e.g. 'a/d b -> a b/d'",
        )
    if dst is None:
        raise ops.error(
            f"{op}: dim {src} loses {'/'.join(moved_from)!r} but no dim gains it; removing "
            "sharding is all_gather",
            operand=None,
            dim=src,
            hint="use all_gather, or append the axis to another dim: 'a/d b -> a b/d'",
        )
    if src is None:
        raise ops.error(
            f"{op}: dim {dst} gains {'/'.join(moved_to)!r} but no dim loses it; adding "
            "sharding is psum_scatter",
            operand=None,
            dim=dst,
            hint="use psum_scatter, or take the axis from another dim: 'a/d b -> a b/d'",
        )
    if moved_from != moved_to:
        raise ops.error(
            f"{op}: dim {src} loses {'/'.join(moved_from)!r} but dim {dst} gains "
            f"{'/'.join(moved_to)!r}; the same axes must move",
            operand=None,
            dim=dst,
        )
    why = "all_to_all keeps the pending axes of its input"
    return AllToAllRecipe(
        ops, moved_from, split_dim=dst, concat_dim=src, op=op, needs=moved_from, why=why
    )


@dataclass(frozen=True)
class AllReduceRecipe(Recipe):
    axes: tuple[str, ...]  # the mesh axes reduced over


def all_reduce_recipe(
    op: str, spec: str | bytes, axes: object, empty_ok: bool = False
) -> AllReduceRecipe:
    """The recipe of ``psum``/``pmean``/``pmax``/``pmin`` (``op``) of ``spec`` over ``axes``.

    The spec describes the value before and after (the layout does not change); its
    ``{+t}`` clause, if any, declares the input's pending axes.
    """
    if type(spec) is str and type(axes) is str:  # hashable: one lookup (the common call)
        return _all_reduce_recipe(op, spec, axes, empty_ok)
    return _cached(_all_reduce_recipe, _all_reduce, op, as_str(spec), axes, empty_ok)


def _split_sum_hint(dim: str, axis: str) -> str:
    """The fix for an all-reduce over an axis that splits ``dim``: raw JAX's psum of a block
    adds the blocks elementwise; typed, the blocks become a dim of their own, then summed."""
    return (
        f"to add up the blocks of {dim!r} elementwise (raw JAX's psum of a block), make them a "
        f"dim of their own and sum it: shardops.einsum('K/{axis} R -> R', shardops.rearrange("
        f"'(K R)/{axis} -> K/{axis} R', x, K=shardops.axis_size({axis!r}))) (the shardops "
        f"guide's recipes); to keep the whole dim, all_gather {dim!r} first"
    )


def _all_reduce(op: str, text: str, axes: object, empty_ok: bool) -> AllReduceRecipe:
    try:
        shape = ShapeSpec.parse(text)
        refuse_reduced(shape, text)
    except SpecError as e:
        raise e.with_context(op) from None
    # Axis rules that make every named role replicated leave no axes: an identity.
    red = () if empty_ok and axes == () else parse_axes(axes, op, text)  # type: ignore[arg-type]
    for i, d in enumerate(shape.dims):
        clash = [a for a in red if a in d.sharding]
        if clash:
            raise SpecError(
                f"{op}: reduces over mesh axis {clash[0]!r}, but dim {i} {str(d)!r} is split over "
                "it; an all-reduce sums copies of the same block, so the value must be "
                f"replicated (or unreduced) over {clash[0]!r}",
                text,
                None,
                hint=_split_sum_hint(str(d), clash[0]),
            )
    ops = OpSpec(text, (shape,), shape.without_pending(), (None,))
    sums = red if op in ("psum", "pmean") else ()
    return AllReduceRecipe(ops, red, op=op, needs=red, sums=sums)


_all_reduce_recipe = functools.lru_cache(maxsize=1024)(_all_reduce)


@dataclass(frozen=True)
class AxesRecipe:
    """``axis_size``/``axis_index`` of ``text`` (``'d/t'``): the mesh axes they read."""

    op: str
    text: str
    axes: tuple[str, ...]


def axes_recipe(op: str, name: object) -> AxesRecipe:
    """The recipe of ``axis_size(name)``/``axis_index(name)`` (``op``)."""
    return _cached(_axes_recipe, _build_axes_recipe, op, name)


def _build_axes_recipe(op: str, name: object) -> AxesRecipe:
    axes = parse_axes(name, op, arg="name")  # type: ignore[arg-type]  # it checks the type
    return AxesRecipe(op, "/".join(axes), axes)


_axes_recipe = functools.lru_cache(maxsize=256)(_build_axes_recipe)


def _cached(cached, build, *key):
    """``cached(*key)``, or ``build(*key)`` when the key is unhashable (axes given as a list)."""
    try:
        hash(key)
    except TypeError:
        return build(*key)
    return cached(*key)


def parse_axes(
    axes: str | tuple[str, ...] | list[str],
    op: str,
    spec: str | None = None,
    *,
    arg: str = "axes",
) -> tuple[str, ...]:
    """``'d'``, ``'d/t'``, ``'d t'`` or ``('d', 't')`` -> ``('d', 't')``.

    ``spec`` (the op's spec) and ``arg`` (the argument's name) only go into messages:
    ``psum('B M'): ...``. A value that is not a str, tuple or list is a ``TypeError``;
    a malformed name list is a `SpecError`.
    """
    label = op if spec is None else f"{op}({spec!r})"
    if isinstance(axes, str):
        parts = tuple(p for p in axes.replace("/", " ").split() if p)
    elif isinstance(axes, tuple | list):
        parts = tuple(axes)
    else:
        raise TypeError(
            f"{label}: {arg}={axes!r} does not name mesh axes: expected a str such as 'd' or "
            f"'d/t', or a tuple of str such as ('d', 't'), got {type(axes).__name__}"
        )
    if not parts:
        what = " to reduce over" if arg == "axes" else ""
        raise SpecError(f"{label}: name at least one mesh axis{what}", str(axes))
    for p in parts:
        if not isinstance(p, str) or not is_identifier(p):
            raise SpecError(f"{label}: {p!r} is not a mesh axis name", str(axes))
    if len(set(parts)) != len(parts):
        raise SpecError(f"{label}: a mesh axis is named twice in {arg}={axes!r}", str(axes))
    return parts
