"""String-specified collectives and local ops for per-device (``shard_map``) code.

Every op takes its spec first, checks its input(s) and output against the spec in the
current binding scope, and emits exactly the one kind of collective it names (local ops
emit none). Specs are parsed and validated once per distinct string.

Shapes in specs are *global* sizes: inside a ``shard_map`` body a block of ``batch/d`` has
``batch // |d|`` rows.

An exception JAX raises while an op emits its collective (or einsum, or lookup) is re-raised
naming the op, its spec and its arguments, with JAX's text at the end; it is an instance of
JAX's exception type too, and has JAX's exception as its ``__cause__``.
"""

from __future__ import annotations

from typing import Any

import jax

from . import _ops
from ._opspecs import (
    plan_all_gather,
    plan_all_reduce,
    plan_all_to_all,
    plan_axes,
    plan_einsum,
    plan_index,
    plan_psum_scatter,
)
from ._pending import PendingReductionError, assume_reduced, linear

__all__ = [
    "PendingReductionError",
    "all_gather",
    "all_to_all",
    "assume_reduced",
    "axis_index",
    "axis_size",
    "einsum_unreduced",
    "index_unreduced",
    "linear",
    "pmax",
    "pmean",
    "pmin",
    "psum",
    "psum_scatter",
]


def all_gather(spec: str | bytes, x: jax.Array) -> jax.Array:
    """All-gather that removes trailing mesh axes from dims (tiled).

    **Arguments:** `spec` like ``'in hidden/d -> in hidden'``; `x` the per-device block.

    **Returns:** the gathered block. One ``all-gather`` per dim that loses axes.

    Examples:
        >>> w = shardops.all_gather('in hidden/d -> in hidden', w)  # FSDP weight gather
    """
    return _ops.run(plan_all_gather(spec), x)


def psum_scatter(spec: str | bytes, x: jax.Array) -> jax.Array:
    """Reduce-scatter: sum over the added mesh axes and keep this device's block.

    **Arguments:** `spec` like ``'batch len model -> batch len model/t'``; `x` a per-device
    partial sum (unreduced over the added axes).

    **Returns:** the reduced, scattered block. One ``reduce-scatter`` per dim gaining axes.

    Examples:
        >>> y = shardops.psum_scatter('B/d L M -> B/d L M/t', partial)
    """
    return _ops.run(plan_psum_scatter(spec), x)


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
    return _ops.run(plan_all_reduce("psum", spec, axes), x)


def pmean(spec: str | bytes, x: jax.Array, axes: str | tuple[str, ...]) -> jax.Array:
    """All-reduce (mean) over mesh ``axes``; same spec form as `psum`.

    Over the pending axes of a partial sum it clears them, like `psum`: the result is
    the sum divided by the number of devices on those axes.

    Examples:
        >>> g = shardops.pmean('in out', g, axes='d')
    """
    return _ops.run(plan_all_reduce("pmean", spec, axes), x)


def pmax(spec: str | bytes, x: jax.Array, axes: str | tuple[str, ...]) -> jax.Array:
    """All-reduce (max) over mesh ``axes``; same spec form as `psum`.

    Differentiable (``lax.pmax`` is not): the gradient goes to the devices that hold the
    maximum, split equally among ties, as for ``jnp.max``.

    Examples:
        >>> m = shardops.pmax('B/d L', local_max, axes='t')  # logsumexp over sharded vocab
    """
    return _ops.run(plan_all_reduce("pmax", spec, axes), x)


def pmin(spec: str | bytes, x: jax.Array, axes: str | tuple[str, ...]) -> jax.Array:
    """All-reduce (min) over mesh ``axes``; same spec form as `psum`.

    Differentiable like `pmax`.

    Examples:
        >>> m = shardops.pmin('B/d', x, axes='t')
    """
    return _ops.run(plan_all_reduce("pmin", spec, axes), x)


def all_to_all(spec: str | bytes, x: jax.Array) -> jax.Array:
    """Move mesh axes from the end of one dim to the end of another (tiled all-to-all).

    Examples:
        >>> y = shardops.all_to_all('B/d L -> B L/d', x)  # batch-split -> sequence-split
    """
    return _ops.run(plan_all_to_all(spec), x)


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
    return _ops.run(plan_einsum(spec, len(operands)), *operands, **einsum_kwargs)


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
    return _ops.run(plan_index(spec), table, indices)


def axis_size(name: str | tuple[str, ...]) -> int:
    """The size of a manual mesh axis (or the product for ``'d/t'``), as a Python int.

    Examples:
        >>> n = shardops.axis_size('d')
    """
    return _ops.axis_size(plan_axes("axis_size", name))


def axis_index(name: str | tuple[str, ...]) -> jax.Array:
    """This device's index along a manual mesh axis (``'d/t'``: row-major over both).

    Examples:
        >>> i = shardops.axis_index('t')
    """
    return _ops.axis_index(plan_axes("axis_index", name))
