"""What each ``shardops`` op emits, given its recipe and its checked operands (JAX).

One `Emitter` per recipe type: the JAX call it makes (named in error messages), the function
that makes it, an optional check of the operands' sizes or dtypes that needs the per-device
arrays, and whether it runs under the op's named scope (collectives do; the local ops,
``einsum_unreduced`` and ``index_unreduced``, emit no collective and keep the primitives'
names). ``einsum`` runs its local einsum unscoped and its reduction (reduce-scatters, then an
all-reduce) under its named scope. The op skeleton (`shardlib._ops.run`) does everything
else.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from .._env import context as _context
from .._lang.parsing import ShapeSpec
from .collective_recipes import (
    AllGatherRecipe,
    AllReduceRecipe,
    AllToAllRecipe,
    EinsumRecipe,
    IndexRecipe,
    ReduceScatterRecipe,
)
from .overlap_recipe import OverlapRecipe
from .overlap_run import emit_overlap, overlap_check
from .permute_recipes import PermuteRecipe, ShiftRecipe, check_pairs
from .reduced_einsum_recipe import ReducedEinsumRecipe

__all__ = ["EMITTERS", "Emitter"]


class Emitter:
    """How one kind of op emits (see the module docstring)."""

    __slots__ = ("call", "check", "emit", "scoped")

    def __init__(
        self,
        call: str,
        emit: Callable[[Any, list[Any], Mapping[str, Any]], Any],
        check: Callable[[Any, list[Any], Mapping[str, int]], None] | None = None,
        scoped: bool = True,
    ):
        self.call, self.emit, self.check, self.scoped = call, emit, check, scoped


def axis_arg(axes: tuple[str, ...]) -> str | tuple[str, ...]:
    """The axis-name argument of a ``jax.lax`` collective: one name, or a tuple."""
    return axes[0] if len(axes) == 1 else axes


def _check_splittable(
    op: str,
    text: str,
    x: Any,
    spec: ShapeSpec,
    splits: Sequence[tuple[int, tuple[str, ...]]],
    manual: Mapping[str, int],
    verb: str,
    role: str = "the input",
) -> None:
    """Each dim in ``splits`` must split evenly over the mesh axes it gains (JAX refuses)."""
    for dim, axes in splits:
        k = math.prod(manual[a] for a in axes)
        n = x.shape[dim]
        if n % k == 0:
            continue
        d = spec.dims[dim]
        have = math.prod(manual[a] for a in d.sharding)
        size = f"global size {n * have}" + (f" ({n} per device)" if have > 1 else "")
        factor = " × ".join(f"{a}={manual[a]}" for a in (*d.sharding, *axes))
        if len(d.sharding) + len(axes) > 1:
            factor += f" = {k * have}"
        raise ValueError(
            f"{op}({text!r}): dim {dim} {str(d)!r} of {role} has {size}, which is not "
            f"divisible by {factor}, so {op} cannot {verb} it over {'/'.join(axes)!r}; expected "
            f"a multiple of {k * have}: pad the dim, or {verb} another dim"
        )


def _all_gather(recipe: AllGatherRecipe, xs: list[Any], kwargs: Mapping[str, Any]) -> Any:
    x = xs[0]
    for dim, axes in recipe.gathers:
        x = lax.all_gather(x, axis_arg(axes), axis=dim, tiled=True)
    return x


def _psum_scatter(recipe: ReduceScatterRecipe, xs: list[Any], kwargs: Mapping[str, Any]) -> Any:
    x = xs[0]
    for dim, axes in recipe.scatters:
        x = lax.psum_scatter(x, axis_arg(axes), scatter_dimension=dim, tiled=True)
    return x


def _scatter_check(recipe: ReduceScatterRecipe, xs: list[Any], manual: Mapping[str, int]) -> None:
    spec = recipe.spec.inputs[0]
    _check_splittable(recipe.op, recipe.text, xs[0], spec, recipe.scatters, manual, "scatter")


def _all_to_all(recipe: AllToAllRecipe, xs: list[Any], kwargs: Mapping[str, Any]) -> Any:
    if not recipe.axes:  # axis rules made the moved roles replicated
        return xs[0]
    return lax.all_to_all(
        xs[0],
        axis_arg(recipe.axes),
        split_axis=recipe.split_dim,
        concat_axis=recipe.concat_dim,
        tiled=True,
    )


def _all_to_all_check(recipe: AllToAllRecipe, xs: list[Any], manual: Mapping[str, int]) -> None:
    splits = ((recipe.split_dim, recipe.axes),)
    _check_splittable(recipe.op, recipe.text, xs[0], recipe.spec.inputs[0], splits, manual, "split")


def _ppermute(recipe: PermuteRecipe, xs: list[Any], kwargs: Mapping[str, Any]) -> Any:
    pairs = recipe.pairs(_context.manual_axis_sizes()[recipe.axis])  # checked by _ppermute_check
    return lax.ppermute(xs[0], recipe.axis, perm=pairs)


def _ppermute_check(recipe: PermuteRecipe, xs: list[Any], manual: Mapping[str, int]) -> None:
    check_pairs(recipe, manual)


def _differentiable_chooser(prim):
    """``prim`` (``lax.pmax``/``lax.pmin``) with a JVP: JAX defines none for them.

    Like the gradient of ``jnp.max``, the tangent comes from the devices whose value was
    chosen, split equally among ties. Integer inputs go straight to ``prim``.
    """

    @functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
    def choose(x, axes):
        return prim(x, axes)

    @choose.defjvp
    def choose_jvp(axes, primals, tangents):
        (x,), (t,) = primals, tangents
        y = choose(x, axes)  # not prim: higher derivatives need this rule again
        hit = x == y
        count = lax.psum(hit.astype(t.dtype), axes)
        dy = lax.psum(jnp.where(hit, t, jnp.zeros((), t.dtype)), axes) / count
        return y, dy

    def reduce(x, axes):
        if jnp.issubdtype(jnp.result_type(x), jnp.inexact):
            return choose(x, axes)
        return prim(x, axes)

    return reduce


_CHOOSERS = {
    "pmax": _differentiable_chooser(lax.pmax),
    "pmin": _differentiable_chooser(lax.pmin),
}


def _all_reduce(recipe: AllReduceRecipe, xs: list[Any], kwargs: Mapping[str, Any]) -> Any:
    if not recipe.axes:  # axis rules made every reduced role replicated
        return xs[0]
    reduce = _CHOOSERS.get(recipe.op) or getattr(lax, recipe.op)  # lax.psum, lax.pmean
    return reduce(xs[0], axis_arg(recipe.axes))


def _einsum(recipe: EinsumRecipe, xs: list[Any], kwargs: Mapping[str, Any]) -> Any:
    return jnp.einsum(recipe.equation, *xs, **kwargs)


def _reduced_einsum(recipe: ReducedEinsumRecipe, xs: list[Any], kwargs: Mapping[str, Any]) -> Any:
    y = jnp.einsum(recipe.equation, *xs, **kwargs)
    if not (recipe.scatters or recipe.summed):
        return y
    with jax.named_scope(recipe.scope_name):
        for dim, axes in recipe.scatters:  # first: the all-reduce then moves a smaller block
            y = lax.psum_scatter(y, axis_arg(axes), scatter_dimension=dim, tiled=True)
        if recipe.summed:
            y = lax.psum(y, axis_arg(recipe.summed))
    return y


def _reduced_einsum_check(
    recipe: ReducedEinsumRecipe, xs: list[Any], manual: Mapping[str, int]
) -> None:
    """Each scattered output dim (its size is its input dim's) splits evenly over its axes."""
    for (_, axes), (k, dim) in zip(recipe.scatters, recipe.sources, strict=True):
        spec = recipe.spec.inputs[k]
        splits = ((dim, axes),)
        role = f"operand {k}"
        _check_splittable(recipe.op, recipe.text, xs[k], spec, splits, manual, "scatter", role)


def _index_check(recipe: IndexRecipe, xs: list[Any], manual: Mapping[str, int]) -> None:
    indices = xs[1]
    if not jnp.issubdtype(indices.dtype, jnp.integer):
        raise TypeError(
            f"index_unreduced({recipe.text!r}): indices must have an integer dtype, got "
            f"{indices.dtype}"
        )


def _index(recipe: IndexRecipe, xs: list[Any], kwargs: Mapping[str, Any]) -> Any:
    table, indices = xs
    # Compare in at least 32 bits: block offsets overflow narrow index dtypes (uint8...).
    indices = indices.astype(jnp.promote_types(indices.dtype, jnp.int32))
    b = recipe.inner_dim
    block = table.shape[recipe.table_dim]
    offset = lax.axis_index(axis_arg(recipe.axes)) * block if recipe.axes else 0

    def lookup(t: jax.Array, i: jax.Array) -> jax.Array:
        local = i - offset
        ok = (local >= 0) & (local < block)
        got = jnp.take(t, jnp.where(ok, local, 0), axis=b, mode="clip")
        mask = ok.reshape((1,) * b + i.shape + (1,) * (t.ndim - b - 1))
        return jnp.where(mask, got, jnp.zeros((), t.dtype))

    fn = lookup
    for in_axes in recipe.vmaps:  # shared (batch) dims, innermost first
        fn = jax.vmap(fn, in_axes=in_axes)
    y = fn(table, indices)
    if recipe.perm != tuple(range(len(recipe.perm))):
        y = jnp.transpose(y, recipe.perm)
    return y


EMITTERS: dict[type, Emitter] = {
    AllGatherRecipe: Emitter("jax.lax.all_gather", _all_gather),
    ReduceScatterRecipe: Emitter("jax.lax.psum_scatter", _psum_scatter, _scatter_check),
    AllToAllRecipe: Emitter("jax.lax.all_to_all", _all_to_all, _all_to_all_check),
    AllReduceRecipe: Emitter("jax.lax.{op}", _all_reduce),
    PermuteRecipe: Emitter("jax.lax.ppermute", _ppermute, _ppermute_check),
    ShiftRecipe: Emitter("jax.lax.ppermute", _ppermute, _ppermute_check),
    EinsumRecipe: Emitter("jnp.einsum", _einsum, scoped=False),
    ReducedEinsumRecipe: Emitter(
        "jnp.einsum (then jax.lax.psum_scatter / jax.lax.psum)",
        _reduced_einsum,
        _reduced_einsum_check,
        scoped=False,  # the local einsum keeps its name; the reduction opens the scope
    ),
    OverlapRecipe: Emitter(
        "the ring of jax.lax.ppermute and jnp.einsum", emit_overlap, overlap_check
    ),
    IndexRecipe: Emitter(
        "the lookup (jnp.take under jax.vmap)", _index, _index_check, scoped=False
    ),
}
