"""What an overlapped ``einsum`` emits: ring steps of ``ppermute`` and block einsums (JAX).

The recipe (`shardlib._ops.overlap_recipe`) says which operand travels (a gather) or that the
accumulator does (a scatter). With ``n`` devices on the ring axis and ``me`` this device's
index, step ``k`` (``0 .. n-1``) multiplies the block in hand while the next block is sent:

- gather, one way: the travelling block is that of device ``me + k`` (each device sends its
  block to ``i - 1``); its product is written at block ``me + k`` of the output (a
  ``dynamic_update_slice``), or added up when the ring dim is contracted (the other operands
  then sliced at that block).
- scatter, one way: step ``k`` computes the partial product of output block ``me + k + 1``
  and adds it to the accumulator received from ``i + 1``; after ``n - 1`` sends device ``me``
  holds the sum of every device's part of block ``me``.
- bidirectional: each block is cut in two halves; the first travels as above, the second the
  other way round the ring (device ``me - k``), so each link carries half the bytes.

Every send is one ``collective-permute`` of a block (``n - 1`` per direction), none an
all-gather or reduce-scatter. The transpose of each (JAX's derivative of these steps) is the
other kind of ring, so gradients overlap too. Block positions are ``axis_index`` arithmetic.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
from jax import lax

from .._env.context import manual_axis_sizes, vary_over, varying_axes, vma_checked
from .overlap_recipe import OverlapRecipe

__all__ = ["emit_overlap", "overlap_check"]


def overlap_check(recipe: OverlapRecipe, xs: list[Any], manual: Mapping[str, int]) -> None:
    """The ring dim's block must split evenly over the ring (scatter) and in halves
    (bidirectional): JAX cannot slice uneven blocks."""
    n = manual[recipe.axis]
    out_axes = {a for d in recipe.spec.output.dims for a in d.sharding}
    if recipe.kind == "gather" and recipe.axis not in out_axes and n > 1 and vma_checked():
        raise ValueError(
            f"einsum({recipe.text!r}, overlap={recipe.direction!r}): the output is not split over "
            f"{recipe.axis!r}, so the ring leaves the same result on every device of it, which "
            "JAX's varying-axis types (check_vma=True) cannot know; split an output dim over "
            f"{recipe.axis!r}, pass check_vma=False to typed_shard_map, or use overlap=None"
        )
    parts = 2 if recipe.direction == "bidirectional" else 1
    if recipe.kind == "gather":
        k, dim = recipe.moved, recipe.ring_dim
        size, need, what = xs[k].shape[dim], parts, "its block"
    else:
        k, dim = recipe.sliced[0]
        size, need, what = xs[k].shape[dim], n * parts, f"{n} blocks"
    if size % need:
        d = recipe.spec.inputs[k].dims[dim]
        cut = f"{what} in halves" if parts == 2 else what
        raise ValueError(
            f"einsum({recipe.text!r}, overlap={recipe.direction!r}): dim {dim} {str(d)!r} of operand "
            f"{k} has {size} per device, which is not divisible by {need}, so the ring cannot cut "
            f"{cut}; expected a multiple of {need}: pad the dim, or use overlap='ring' / None"
        )


def emit_overlap(recipe: OverlapRecipe, xs: list[Any], kwargs: Mapping[str, Any]) -> Any:
    n = manual_axis_sizes()[recipe.axis]
    me = lax.axis_index(recipe.axis)
    # Every step's einsum mixes the operands: cast them to vary alike once, here, so that the
    # derivative sums a replicated operand's gradient once, not once per step (JAX inserts a
    # cast per einsum otherwise, and its transpose is an all-reduce per step).
    vary = frozenset({recipe.axis}).union(*(varying_axes(x) or frozenset() for x in xs))
    xs = [vary_over(x, vary) for x in xs]
    if recipe.kind == "gather":
        return _gather(recipe, xs, kwargs, n, me)
    return _scatter(recipe, xs, kwargs, n, me)


def _send(x: Any, axis: str, n: int, step: int) -> Any:
    """Each device's ``x`` to device ``i - step`` (it receives from ``i + step``)."""
    return lax.ppermute(x, axis, perm=[(i, (i - step) % n) for i in range(n)])


def _halves(recipe: OverlapRecipe) -> tuple[tuple[int, int], ...]:
    """``(direction, half)``: one way, the whole block; bidirectional, half 0 one way (``+1``:
    received from ``i + 1``) and half 1 the other (``-1``)."""
    return ((1, 0),) if recipe.direction == "ring" else ((1, 0), (-1, 1))


def _gather(
    recipe: OverlapRecipe, xs: list[Any], kwargs: Mapping[str, Any], n: int, me: Any
) -> Any:
    g, dim = recipe.moved, recipe.ring_dim
    block = xs[g].shape[dim]
    ways = _halves(recipe)
    piece = block // len(ways)
    held = [lax.slice_in_dim(xs[g], h * piece, (h + 1) * piece, axis=dim) for _, h in ways]
    out = None
    for k in range(n):
        for w, (sign, h) in enumerate(ways):
            here = held[w]
            if k < n - 1:  # the next block travels while this one is multiplied
                held[w] = _send(here, recipe.axis, n, sign)
            at = ((me + sign * k) % n) * block + h * piece  # where device me + k's block goes
            args = list(xs)
            args[g] = here
            for o, d in recipe.sliced:
                args[o] = lax.dynamic_slice_in_dim(xs[o], at, piece, d)
            p = jnp.einsum(recipe.equation, *args, **kwargs)
            if recipe.out_dim is None:  # the ring dim is contracted: add the products up
                out = p if out is None else out + p
                continue
            if out is None:
                shape = (*p.shape[: recipe.out_dim], block * n, *p.shape[recipe.out_dim + 1 :])
                out = vary_over(jnp.zeros(shape, p.dtype), varying_axes(p) or frozenset())
            out = lax.dynamic_update_slice_in_dim(out, p, at, recipe.out_dim)
    return out


def _scatter(
    recipe: OverlapRecipe, xs: list[Any], kwargs: Mapping[str, Any], n: int, me: Any
) -> Any:
    k0, d0 = recipe.sliced[0]
    block = xs[k0].shape[d0] // n
    ways = _halves(recipe)
    piece = block // len(ways)
    accs: list[Any] = [None for _ in ways]
    for k in range(n):
        for w, (sign, h) in enumerate(ways):
            dest = (me + sign * (k + 1)) % n
            moved = None if accs[w] is None else _send(accs[w], recipe.axis, n, sign)
            args = list(xs)
            for o, d in recipe.sliced:
                args[o] = lax.dynamic_slice_in_dim(xs[o], dest * block + h * piece, piece, d)
            p = jnp.einsum(recipe.equation, *args, **kwargs)  # while the accumulator travels
            accs[w] = p if moved is None else moved + p
    out = accs[0] if len(accs) == 1 else jnp.concatenate(accs, axis=recipe.out_dim)
    return vary_over(out, frozenset({recipe.axis}))
