"""String-specified collectives and local ops for per-device (``shard_map``) code.

Every op takes its spec first, checks its input(s) and output against the spec in the
current binding scope, and emits exactly the one kind of collective it names (local ops
emit none; `einsum` emits the reduction its output spec asks for). Specs are parsed and
validated once per distinct string. A name after ``/`` (or in ``axes=``, ``axis=``) may be a
role, resolved under `shardlib.axis_rules` once per (spec, rules, mesh); a collective whose
roles all resolve to no mesh axis is an identity (no collective).

Shapes in specs are *global* sizes: inside a ``shard_map`` body a block of ``batch/d`` has
``batch // |d|`` rows.

An exception JAX raises while an op emits its collective (or einsum, or lookup) is re-raised
naming the op, its spec and its arguments, with JAX's text at the end; it is an instance of
JAX's exception type too, and has JAX's exception as its ``__cause__``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from ._analysis.notes import PendingReductionError, assume_reduced, linear
from ._env import rules as _rules
from ._lang.parsing import as_str
from ._ops import run as _ops
from ._ops.collective_recipes import (
    all_gather_recipe,
    all_reduce_recipe,
    all_to_all_recipe,
    axes_recipe,
    einsum_recipe,
    index_recipe,
    ppermute_recipe,
    psum_scatter_recipe,
    shift_recipe,
)
from ._ops.overlap_recipe import overlapped_einsum_recipe
from ._ops.reduced_einsum_recipe import reduced_einsum_recipe
from ._ops.reshard_recipe import reshard_recipe
from ._ops.reshard_run import reshard as _reshard

__all__ = [
    "PendingReductionError",
    "all_gather",
    "all_to_all",
    "assume_reduced",
    "axis_index",
    "axis_size",
    "einsum",
    "einsum_unreduced",
    "index_unreduced",
    "linear",
    "pmax",
    "pmean",
    "pmin",
    "ppermute",
    "psum",
    "psum_scatter",
    "rearrange",
    "reduce",
    "repeat",
    "reshard",
    "shift",
]


def all_gather(spec: str | bytes, x: jax.Array) -> jax.Array:
    """All-gather that removes trailing mesh axes from dims (tiled).

    **Arguments:** `spec` like ``'in hidden/d -> in hidden'``; `x` the per-device block.

    **Returns:** the gathered block. One ``all-gather`` per dim that loses axes.

    Examples:
        >>> w = shardops.all_gather('in hidden/d -> in hidden', w)  # FSDP weight gather
    """
    return _ops.run(all_gather_recipe(*_resolved(spec, "all_gather")), x)


def psum_scatter(spec: str | bytes, x: jax.Array) -> jax.Array:
    """Reduce-scatter: sum over the added mesh axes and keep this device's block.

    **Arguments:** `spec` like ``'batch len model -> batch len model/t'``; `x` a per-device
    partial sum (unreduced over the added axes).

    **Returns:** the reduced, scattered block. One ``reduce-scatter`` per dim gaining axes.

    Examples:
        >>> y = shardops.psum_scatter('B/d L M -> B/d L M/t', partial)
    """
    return _ops.run(psum_scatter_recipe(*_resolved(spec, "psum_scatter")), x)


def psum(spec: str | bytes, x: jax.Array, axes: str | tuple[str, ...]) -> jax.Array:
    """All-reduce (sum) over mesh ``axes``; the layout ``spec`` is unchanged.

    The spec describes ``x`` before and after (an all-reduce does not change the layout);
    ``axes`` names the mesh axes summed over: ``'t'``, ``'d/t'`` or ``('d', 't')``. For a
    partial sum (an `einsum_unreduced` / `index_unreduced` result) this clears the pending
    axes it sums over, as ``jax.lax.psum`` does; the spec may declare the input's pending
    axes, ``'B/d M {+t}'`` (checked).

    Examples:
        >>> loss = shardops.psum('', local_loss, axes='d')
        >>> y = shardops.psum('B/d L M', partial, axes='t')
    """
    return _ops.run(_all_reduce_recipe("psum", spec, axes), x)


def pmean(spec: str | bytes, x: jax.Array, axes: str | tuple[str, ...]) -> jax.Array:
    """All-reduce (mean) over mesh ``axes``; same spec form as `psum`.

    Over the pending axes of a partial sum it clears them, like `psum`: the result is
    the sum divided by the number of devices on those axes.

    Examples:
        >>> g = shardops.pmean('in out', g, axes='d')
    """
    return _ops.run(_all_reduce_recipe("pmean", spec, axes), x)


def pmax(spec: str | bytes, x: jax.Array, axes: str | tuple[str, ...]) -> jax.Array:
    """All-reduce (max) over mesh ``axes``; same spec form as `psum`.

    Differentiable (``lax.pmax`` is not): the gradient goes to the devices that hold the
    maximum, split equally among ties, as for ``jnp.max``.

    Examples:
        >>> m = shardops.pmax('B/d L', local_max, axes='t')  # logsumexp over sharded vocab
    """
    return _ops.run(_all_reduce_recipe("pmax", spec, axes), x)


def pmin(spec: str | bytes, x: jax.Array, axes: str | tuple[str, ...]) -> jax.Array:
    """All-reduce (min) over mesh ``axes``; same spec form as `psum`.

    Differentiable like `pmax`.

    Examples:
        >>> m = shardops.pmin('B/d', x, axes='t')
    """
    return _ops.run(_all_reduce_recipe("pmin", spec, axes), x)


def all_to_all(spec: str | bytes, x: jax.Array) -> jax.Array:
    """Move mesh axes from the end of one dim to the end of another (tiled all-to-all).

    Examples:
        >>> y = shardops.all_to_all('B/d L -> B L/d', x)  # batch-split -> sequence-split
    """
    return _ops.run(all_to_all_recipe(*_resolved(spec, "all_to_all")), x)


def ppermute(
    spec: str | bytes, x: jax.Array, axis: str, perm: Sequence[tuple[int, int]]
) -> jax.Array:
    """Send each device's block to another device along one mesh ``axis`` (point to point).

    ``perm`` lists ``(source, destination)`` pairs of indices along ``axis``, as in
    ``jax.lax.ppermute``: each index at most once as a source and once as a destination, all
    in ``0 .. axis_size(axis) - 1``. A device that no pair sends to receives zeros. The
    layout does not change, so ``spec`` is one shape spec (no arrow) describing the block
    before and after; a partial sum over other axes stays one (``{+t}`` may declare it). A
    partial sum over ``axis`` itself may be sent round a full cycle, or any full permutation
    (every index a source once and a destination once): it stays a partial sum of the same
    total. A partial permutation of one is refused (`PendingReductionError`): the devices
    that receive nothing would get zeros and the blocks sent nowhere would drop out of the sum.

    **Arguments:** `spec` like ``'B/d M'``; `x` the per-device block; `axis` one manual mesh
    axis, such as ``'p'``; `perm` the pairs.

    **Returns:** the block received (zeros where none is sent). One ``collective-permute``;
    its gradient is the inverse permutation.

    Examples:
        >>> # p = 4 stages: stage i sends its activations to stage i + 1; stage 0 gets zeros.
        >>> y = shardops.ppermute('B/d M', x, 'p', [(0, 1), (1, 2), (2, 3)])
    """
    return _ops.run(
        ppermute_recipe(
            _rules.text(spec, "ppermute"), _rules.one_axis("ppermute", "axis", axis), perm
        ),
        x,
    )


def shift(
    spec: str | bytes, x: jax.Array, axis: str, offset: int = 1, wrap: bool = True
) -> jax.Array:
    """Send each device's block to the device ``offset`` further along mesh ``axis``.

    Device ``i`` sends to ``i + offset`` (a negative offset sends backwards). With
    ``wrap=True`` (the default) indices wrap around: a cyclic shift, every device receives a
    block. With ``wrap=False`` the devices with no sender (the first ``offset`` ones for a
    positive offset, the last ``-offset`` ones for a negative) **receive zeros**. It is a
    `ppermute` with those pairs, under its own named scope ``shardops.shift[SPEC]``. A partial
    sum over ``axis`` may be shifted with ``wrap=True`` (a full cycle: it stays a partial sum
    of the same total, as in a ring reduce-scatter); a non-cyclic shift of one is refused.

    **Arguments:** `spec` like ``'B/d M'``; `x` the per-device block; `axis` one manual mesh
    axis; `offset` an int; `wrap` whether to shift cyclically.

    **Returns:** the block received. One ``collective-permute``; its gradient is the shift by
    ``-offset``.

    Examples:
        >>> # pipeline: each stage passes its activations to the next; stage 0 gets zeros
        >>> y = shardops.shift('B/d M', x, 'p', offset=1, wrap=False)
    """
    return _ops.run(
        shift_recipe(
            _rules.text(spec, "shift"), _rules.one_axis("shift", "axis", axis), offset, wrap
        ),
        x,
    )


def reshard(spec: str | bytes, x: jax.Array) -> jax.Array:
    """Change the layout of ``x`` (its mesh axes) by the cheapest collectives and local slices.

    Both sides of ``spec`` have the same dims in the same order; only their mesh axes differ.
    The change is worked out once per spec and mesh into ``all_gather`` / ``all_to_all`` steps and
    local slices (at ``axis_index``) that move the fewest bytes per device (see the guide
    page "Layout changes"). Each collective runs as that op, under its own named scope inside
    ``shardops.reshard[SPEC]``, so `shardlib.explain` lists it. A partial sum over axes the
    route slices or moves over is refused; over other axes it passes (declare it with the same
    ``{+t}`` on both sides). A value that differs across the devices of an axis the route
    slices over (the input spec says it is replicated there) is refused with a ``ValueError``.

    **Arguments:** `spec` like ``'B/t L M -> B L/t M'``; `x` the per-device block.

    **Returns:** the block of the same global array in the output layout.

    Examples:
        >>> y = shardops.reshard('B/t L M -> B L/t M', x)  # one all_to_all
        >>> w = shardops.reshard('M/t/d F -> M F/d', w)  # all_to_all of d, then gather t
    """
    return _reshard(reshard_recipe(_rules.text(spec, "reshard")), x)


def einsum(
    spec: str | bytes, *operands: jax.Array, overlap: str | None = None, **einsum_kwargs: Any
) -> jax.Array:
    """Einsum that reduces over its split contracted dims as its output spec says.

    Dims are named as in shape specs, with `einsum_unreduced`'s rules. Where a contracted dim
    is split over mesh axes, the local einsum is a partial sum over them, and the output spec
    says how ``einsum`` reduces it: an output dim split over some of those axes, written after
    its input's own axes (``F`` becomes ``F/t``), gets a **reduce-scatter** over them
    (``psum_scatter``); over the others the output is replicated and gets an **all-reduce**
    (``psum``). No contracted dim split: no collective. The collectives run under the named
    scope ``shardops.einsum[SPEC]``, so `shardlib.explain` lists them as ``einsum``. The
    result is reduced (no pending axes); an operand's own pending axes (``{+u}``) pass
    through. Keyword arguments (``preferred_element_type``, ``precision``) go to
    ``jnp.einsum``. `einsum_unreduced` (seqax's) leaves the reduction to the caller.

    ``overlap='ring'`` (or ``'bidirectional'``) runs a **collective matmul**: the one
    reduce-scatter, or one all-gather of an operand's dim (split over a trailing axis that the
    dim's other mentions lack: ``'L/t M, M F/t -> L F/t'``), as ``|t|`` ring steps, each a
    block einsum beside a ``ppermute`` of the next block (bidirectional: half each way). Same
    values and gradients, no all-gather or reduce-scatter; see the guide "Collective matmuls".

    **Arguments:** `spec` like ``'B/d M/t, M/t F -> B/d F'``; `operands` the per-device blocks;
    `overlap` None, ``'ring'`` or ``'bidirectional'``.

    **Returns:** the reduced block. Reduce-scatters (one per output dim that gains axes)
    first, then one all-reduce over the contracted axes the output is not split over.

    Examples:
        >>> y = shardops.einsum('B/d M/t, M/t F -> B/d F', x, w)  # all-reduce (psum) over t
        >>> y = shardops.einsum('B/d M/t, M/t F -> B/d F/t', x, w)  # reduce-scatter over t
        >>> h = shardops.einsum('B/d M, M F/t -> B/d F/t', x, w)  # local: M is not split
        >>> h = shardops.einsum('L/t M, M F/t -> L F/t', x, w, overlap='ring')  # gathers L
    """
    if overlap is None:
        text = _rules.text(spec, "einsum")
    else:
        text, changed = _resolved(spec, "einsum")
        ring = overlapped_einsum_recipe(text, len(operands), overlap, changed)
        if ring is not None:  # None: the axis rules left the ring's role replicated
            return _ops.run(ring, *operands, **einsum_kwargs)
    recipe = reduced_einsum_recipe(text, len(operands))
    return _ops.run(recipe, *operands, **einsum_kwargs)


def einsum_unreduced(spec: str | bytes, *operands: jax.Array, **einsum_kwargs: Any) -> jax.Array:
    """Device-local einsum with sharding-aware shape checks; no communication.

    Dims are named as in shape specs. A contracted dim that is sharded leaves the result
    *unreduced* over its mesh axes: each device holds a partial sum (an ordinary array), to
    reduce afterwards (``psum``/``psum_scatter``, or ``jax.lax.psum``); in a
    ``typed_shard_map`` body, using it otherwise (returning it, a non-linear op, a reduction
    over other axes) is an error at trace time. The output spec may declare those axes,
    ``'... -> B/d M {+t}'`` (checked). One operand may itself be a partial sum when the
    other is the same on every device of its pending axes: the result keeps them. Keyword arguments
    (``preferred_element_type``, ``precision``) go to ``jnp.einsum``.

    Examples:
        >>> y = shardops.einsum_unreduced('B/d L M, M F/t -> B/d L F/t', x, w)
        >>> z = shardops.einsum_unreduced('B/d L F/t, F/t M -> B/d L M', y, w2)  # pending over t
        >>> z = shardops.psum_scatter('B/d L M -> B/d L M/t', z)
    """
    recipe = einsum_recipe(_rules.text(spec, "einsum_unreduced"), len(operands))
    return _ops.run(recipe, *operands, **einsum_kwargs)


def index_unreduced(spec: str | bytes, table: jax.Array, indices: jax.Array) -> jax.Array:
    """Look up ``indices`` in the bracketed dim of a (possibly sharded) ``table``.

    Each device looks up the indices that fall in its block of the bracketed dim and returns
    zeros for the others, so the result is *unreduced* over the bracketed dim's mesh axes (a
    partial sum): sum it over them afterwards (``psum``/``psum_scatter``). Indices outside ``[0, size)``
    (negative or too large) find no block and give zeros, like an off-shard lookup. Dims named
    in both the table and the indices are batch dims (vmapped together); the output may list
    its dims in any order.

    Examples:
        >>> x = shardops.index_unreduced('[V/t] M, B/d L -> B/d L M', embed, tokens)
        >>> x = shardops.psum('B/d L M', x, axes='t')
    """
    return _ops.run(index_recipe(_rules.text(spec, "index_unreduced")), table, indices)


def axis_size(name: str | tuple[str, ...]) -> int:
    """The size of a manual mesh axis (or the product for ``'d/t'``), as a Python int.

    Examples:
        >>> n = shardops.axis_size('d')
    """
    axes = _rules.axes(name, "axis_size")
    if axes == () and axes != name:  # axis rules made the role replicated: one device
        return 1
    name = axes
    return _ops.axis_size(axes_recipe("axis_size", name))


def axis_index(name: str | tuple[str, ...]) -> jax.Array:
    """This device's index along a manual mesh axis (``'d/t'``: row-major over both).

    Examples:
        >>> i = shardops.axis_index('t')
    """
    axes = _rules.axes(name, "axis_index")
    if axes == () and axes != name:  # axis rules made the role replicated: one device
        return jnp.zeros((), jnp.int32)
    name = axes
    return _ops.axis_index(axes_recipe("axis_index", name))


def rearrange(pattern: str | bytes, x: jax.Array, **sizes: int) -> jax.Array:
    """``einops.rearrange`` on the per-device block, with the sharding written in the pattern.

    Dims carry mesh axes as in specs; a parenthesised group is one dim, the merge of its
    factors, and ``(H D)/t`` splits it over ``t``, which puts the axis on its leading factor
    ``H`` (each device holds a block of ``H``, with all of ``D``). The per-device pattern has
    each factor at its local size, and the result is exactly einops' on the block. Each factor
    must keep its axes on both sides: ``'(H D)/t -> H/t D'`` is a local reshape, while
    ``'(H D)/t -> H D/t'`` would change which elements a device holds and is refused at trace
    time (`SpecError`), naming the pattern that keeps the axes and the ``reshard`` that moves
    them. Sizes of split factors are global, from ``**sizes`` or the current binding scope.

    **Arguments:** `pattern` like ``'B/d L (H D)/t -> B/d L H/t D'``; `x` the per-device block;
    `sizes` global sizes of factors (``H=8``) where the pattern splits a group.

    **Returns:** the rearranged block. No communication.

    Examples:
        >>> q = shardops.rearrange('B/d L (H D)/t -> B/d L H/t D', qkv, H=8)
    """
    from ._ops.rearrange_run import rearrange as run

    return run(_rules.text(pattern, "rearrange"), x, sizes)


def reduce(pattern: str | bytes, x: jax.Array, reduction: str, **sizes: int) -> jax.Array:
    """``einops.reduce`` on the per-device block, over dims that are not split.

    The pattern is `rearrange`'s (global sizes, mesh axes on dims, groups); the dims missing
    from the output are reduced with ``reduction`` (``'sum'``, ``'mean'``, ``'max'``,
    ``'min'`` or ``'prod'``). Only dims split over no mesh axis may be reduced: then each
    device's result is its block of the global result. Reducing a split dim is refused at
    trace time (`SpecError`) with the fix: the local reduction, then ``psum``/``pmean``/
    ``pmax``/``pmin`` over its axes. The dims kept keep their axes, as in `rearrange`.

    **Arguments:** `pattern` like ``'B/d L H/t -> B/d H/t'``; `x` the per-device block;
    `reduction` the einops reduction; `sizes` global sizes of factors of split groups.

    **Returns:** the reduced block. No communication.

    Examples:
        >>> m = shardops.reduce('B/d L M/t -> B/d M/t', x, 'mean')  # mean over the sequence
    """
    from ._ops.rearrange_run import reduce as run

    return run(_rules.text(pattern, "reduce"), x, reduction, sizes)


def repeat(pattern: str | bytes, x: jax.Array, **sizes: int) -> jax.Array:
    """``einops.repeat`` on the per-device block: new dims, unsplit or split.

    The pattern is `rearrange`'s; the dims only the output has are new, with their global
    sizes from ``**sizes`` or the current binding scope. A new dim may be split over mesh
    axes the input does not use (the input is the same on every device of them): each device
    then materialises only its block, ``R / |t|`` copies. A new dim split over an axis the
    input uses is refused at trace time (`SpecError`); the dims kept keep their axes.

    **Arguments:** `pattern` like ``'B/d M -> B/d R/t M'``; `x` the per-device block;
    `sizes` global sizes of the new dims (``R=8``) and of factors of split groups.

    **Returns:** the repeated block. No communication.

    Examples:
        >>> y = shardops.repeat('B/d M -> B/d R/t M', x, R=8)
    """
    from ._ops.rearrange_run import repeat as run

    return run(_rules.text(pattern, "repeat"), x, sizes)


def _all_reduce_recipe(op: str, spec: str | bytes, axes: Any) -> Any:
    """The all-reduce's recipe with roles resolved (no axes left: an identity)."""
    if type(spec) is str and type(axes) is str and _rules.current() is None:
        return all_reduce_recipe(op, spec, axes)  # no rules: nothing to resolve
    red = _rules.axes(axes, f"{op}: argument `axes`")
    return all_reduce_recipe(op, _rules.text(spec, op), red, red == () and red != axes)


def _resolved(spec: str | bytes, op: str) -> tuple[str, bool]:
    """The op spec with its roles resolved, and whether the rules changed it (then a
    collective left with nothing to move is an identity, not an error)."""
    text = _rules.text(spec, op)
    return text, text != as_str(spec)
