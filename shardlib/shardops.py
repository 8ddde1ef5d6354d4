"""String-specified collectives and local ops for per-device (``shard_map``) code.

Every op takes its spec first, checks its input(s) and output against the spec in the
current binding scope, and emits exactly the one kind of collective it names (local ops
emit none). Specs are parsed and validated once per distinct string.

Shapes in specs are *global* sizes: inside a ``shard_map`` body a block of ``batch/d`` has
``batch // |d|`` rows.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from . import _context
from ._checking import check_value, format_sizes
from ._opspecs import (
    parse_axes,
    plan_all_gather,
    plan_all_to_all,
    plan_einsum,
    plan_index,
    plan_psum_scatter,
)
from ._parsing import ShapeSpec, SpecError, _as_str, did_you_mean
from ._scopes import Scope, current_scope

__all__ = [
    "all_gather",
    "all_to_all",
    "axis_index",
    "axis_size",
    "einsum_unreduced",
    "index_unreduced",
    "pmax",
    "pmean",
    "pmin",
    "psum",
    "psum_scatter",
]


def _check(x: Any, spec: ShapeSpec, scope: Scope, op: str, text: str, role: str) -> None:
    check_value(x, None, spec, scope, where=f"{op}({text!r}) {role}", check_sharding=False)


def _manual(op: str, text: str, axes: tuple[str, ...]) -> dict[str, int]:
    """The manual axes, after checking that ``axes`` are among them."""
    manual = _context.manual_axis_sizes()
    for a in axes:
        if a not in manual:
            if not manual:
                raise ValueError(
                    f"{op}({text!r}) communicates over mesh axis {a!r}, so it must run inside a "
                    "shard_map body (use typed_shard_map); here no mesh axis is manual"
                )
            raise ValueError(
                f"{op}({text!r}): mesh axis {a!r} is not a manual axis of the enclosing "
                f"shard_map (manual axes: {format_sizes(manual)}){did_you_mean(a, manual)}"
            )
    return manual


def _axis_arg(axes: tuple[str, ...]) -> str | tuple[str, ...]:
    return axes[0] if len(axes) == 1 else axes


def all_gather(spec: str | bytes, x: jax.Array) -> jax.Array:
    """All-gather that removes trailing mesh axes from dims (tiled).

    **Arguments:** `spec` like ``'in hidden/d -> in hidden'``; `x` the per-device block.

    **Returns:** the gathered block. One ``all-gather`` per dim that loses axes.

    Example:
        >>> w = shardops.all_gather('in hidden/d -> in hidden', w)  # FSDP weight gather
    """
    text = _as_str(spec)
    plan = plan_all_gather(text)
    s = current_scope()
    _manual("all_gather", text, tuple(a for _, axes in plan.gathers for a in axes))
    _check(x, plan.spec.inputs[0], s, "all_gather", text, "input")
    for dim, axes in plan.gathers:
        x = lax.all_gather(x, _axis_arg(axes), axis=dim, tiled=True)
    _check(x, plan.spec.output, s, "all_gather", text, "output")
    return x


def psum_scatter(spec: str | bytes, x: jax.Array) -> jax.Array:
    """Reduce-scatter: sum over the added mesh axes and keep this device's block.

    **Arguments:** `spec` like ``'batch len model -> batch len model/t'``; `x` a per-device
    partial sum (unreduced over the added axes).

    **Returns:** the reduced, scattered block. One ``reduce-scatter`` per dim gaining axes.

    Example:
        >>> y = shardops.psum_scatter('B/d L M -> B/d L M/t', partial)
    """
    text = _as_str(spec)
    plan = plan_psum_scatter(text)
    s = current_scope()
    _manual("psum_scatter", text, tuple(a for _, axes in plan.scatters for a in axes))
    _check(x, plan.spec.inputs[0], s, "psum_scatter", text, "input")
    for dim, axes in plan.scatters:
        x = lax.psum_scatter(x, _axis_arg(axes), scatter_dimension=dim, tiled=True)
    _check(x, plan.spec.output, s, "psum_scatter", text, "output")
    return x


def _all_reduce(op: str, prim, spec: str | bytes, x: jax.Array, axes) -> jax.Array:
    text = _as_str(spec)
    try:
        shape = ShapeSpec.parse(text)
    except SpecError as e:
        raise e.with_context(op) from None
    red = parse_axes(axes, op)
    for i, d in enumerate(shape.dims):
        clash = [a for a in red if a in d.sharding]
        if clash:
            raise SpecError(
                f"{op}: reduces over mesh axis {clash[0]!r}, but dim {i} {str(d)!r} is split over "
                "it; an all-reduce sums copies of the same block, so the value must be "
                f"replicated (or unreduced) over {clash[0]!r}",
                text,
                None,
                hint=f"all_gather {str(d)!r} first, or use psum_scatter to produce a split result",
            )
    s = current_scope(start=3)
    _manual(op, text, red)
    _check(x, shape, s, op, text, "input")
    out = prim(x, _axis_arg(red))
    _check(out, shape, s, op, text, "output")
    return out


def psum(spec: str | bytes, x: jax.Array, axes: str | tuple[str, ...]) -> jax.Array:
    """All-reduce (sum) over mesh ``axes``; the layout ``spec`` is unchanged.

    The spec describes ``x`` before and after (an all-reduce does not change the layout);
    ``axes`` names the mesh axes summed over: ``'t'``, ``'d/t'`` or ``('d', 't')``.

    Example:
        >>> loss = shardops.psum('', local_loss, axes='d')
        >>> y = shardops.psum('B/d L M', partial, axes='t')
    """
    return _all_reduce("psum", lax.psum, spec, x, axes)


def pmean(spec: str | bytes, x: jax.Array, axes: str | tuple[str, ...]) -> jax.Array:
    """All-reduce (mean) over mesh ``axes``; same spec form as :func:`psum`.

    Example:
        >>> g = shardops.pmean('in out', g, axes='d')
    """
    return _all_reduce("pmean", lax.pmean, spec, x, axes)


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


_pmax = _differentiable_chooser(lax.pmax)
_pmin = _differentiable_chooser(lax.pmin)


def pmax(spec: str | bytes, x: jax.Array, axes: str | tuple[str, ...]) -> jax.Array:
    """All-reduce (max) over mesh ``axes``; same spec form as :func:`psum`.

    Differentiable (``lax.pmax`` is not): the gradient goes to the devices that hold the
    maximum, split equally among ties, as for ``jnp.max``.

    Example:
        >>> m = shardops.pmax('B/d L', local_max, axes='t')  # logsumexp over sharded vocab
    """
    return _all_reduce("pmax", _pmax, spec, x, axes)


def pmin(spec: str | bytes, x: jax.Array, axes: str | tuple[str, ...]) -> jax.Array:
    """All-reduce (min) over mesh ``axes``; same spec form as :func:`psum`.

    Differentiable like :func:`pmax`.

    Example:
        >>> m = shardops.pmin('B/d', x, axes='t')
    """
    return _all_reduce("pmin", _pmin, spec, x, axes)


def all_to_all(spec: str | bytes, x: jax.Array) -> jax.Array:
    """Move mesh axes from the end of one dim to the end of another (tiled all-to-all).

    Example:
        >>> y = shardops.all_to_all('B/d L -> B L/d', x)  # batch-split -> sequence-split
    """
    text = _as_str(spec)
    plan = plan_all_to_all(text)
    s = current_scope()
    _manual("all_to_all", text, plan.axes)
    _check(x, plan.spec.inputs[0], s, "all_to_all", text, "input")
    y = lax.all_to_all(
        x,
        _axis_arg(plan.axes),
        split_axis=plan.split_dim,
        concat_axis=plan.concat_dim,
        tiled=True,
    )
    _check(y, plan.spec.output, s, "all_to_all", text, "output")
    return y


def einsum_unreduced(spec: str | bytes, *operands: jax.Array, **einsum_kwargs: Any) -> jax.Array:
    """Device-local einsum with sharding-aware shape checks; no communication.

    Dims are named as in shape specs. A contracted dim that is sharded leaves the result
    *unreduced* over its mesh axes: reduce it afterwards (``psum``/``psum_scatter``).
    Keyword arguments (``preferred_element_type``, ``precision``) go to ``jnp.einsum``.

    Example:
        >>> y = shardops.einsum_unreduced('B/d L M, M F/t -> B/d L F/t', x, w)
        >>> z = shardops.einsum_unreduced('B/d F/t, F/t M -> B/d M', y, w2)  # unreduced over t
        >>> z = shardops.psum_scatter('B/d M -> B/d M/t', z)
    """
    text = _as_str(spec)
    if not operands:
        raise TypeError(f"einsum_unreduced({text!r}) needs at least one operand")
    plan = plan_einsum(text, len(operands))
    s = current_scope()
    for k, (x, sp) in enumerate(zip(operands, plan.spec.inputs, strict=True)):
        _check(x, sp, s, "einsum_unreduced", text, f"operand {k}")
    y = jnp.einsum(plan.equation, *operands, **einsum_kwargs)
    _check(y, plan.spec.output, s, "einsum_unreduced", text, "output")
    return y


def index_unreduced(spec: str | bytes, table: jax.Array, indices: jax.Array) -> jax.Array:
    """Look up ``indices`` in the bracketed dim of a (possibly sharded) ``table``.

    Each device looks up the indices that fall in its block of the bracketed dim and returns
    zeros for the others, so the result is *unreduced* over the bracketed dim's mesh axes:
    sum it over them afterwards (``psum``/``psum_scatter``). Indices outside ``[0, size)``
    (negative or too large) find no block and give zeros, like an off-shard lookup. Dims named
    in both the table and the indices are batch dims (vmapped together); the output may list
    its dims in any order.

    Example:
        >>> x = shardops.index_unreduced('[V/t] M, B/d L -> B/d L M', embed, tokens)
        >>> x = shardops.psum('B/d L M', x, axes='t')
    """
    text = _as_str(spec)
    plan = plan_index(text)
    s = current_scope()
    if plan.axes:
        _manual("index_unreduced", text, plan.axes)
    _check(table, plan.spec.inputs[0], s, "index_unreduced", text, "table")
    _check(indices, plan.spec.inputs[1], s, "index_unreduced", text, "indices")
    if not jnp.issubdtype(indices.dtype, jnp.integer):
        raise TypeError(
            f"index_unreduced({text!r}): indices must have an integer dtype, got {indices.dtype}"
        )
    b = plan.table_dim
    block = table.shape[b]
    offset = lax.axis_index(_axis_arg(plan.axes)) * block if plan.axes else 0
    shared_t = [t for t, _ in plan.shared]
    b_local = b - sum(1 for t in shared_t if t < b)

    def lookup(t: jax.Array, i: jax.Array) -> jax.Array:
        local = i - offset
        ok = (local >= 0) & (local < block)
        got = jnp.take(t, jnp.where(ok, local, 0), axis=b_local, mode="clip")
        mask = ok.reshape((1,) * b_local + i.shape + (1,) * (t.ndim - b_local - 1))
        return jnp.where(mask, got, jnp.zeros((), t.dtype))

    fn = lookup
    # vmap over shared (batch) dims, innermost first, so the first ends up outermost.
    positions = []
    removed_t: list[int] = []
    removed_i: list[int] = []
    for t_dim, i_dim in plan.shared:
        positions.append(
            (
                t_dim - sum(1 for r in removed_t if r < t_dim),
                i_dim - sum(1 for r in removed_i if r < i_dim),
            )
        )
        removed_t.append(t_dim)
        removed_i.append(i_dim)
    for t_pos, i_pos in reversed(positions):
        fn = jax.vmap(fn, in_axes=(t_pos, i_pos))
    y = fn(table, indices)
    if plan.perm != tuple(range(len(plan.perm))):
        y = jnp.transpose(y, plan.perm)
    _check(y, plan.spec.output, s, "index_unreduced", text, "output")
    return y


def axis_size(name: str | tuple[str, ...]) -> int:
    """The size of a manual mesh axis (or the product for ``'d/t'``), as a Python int.

    Example:
        >>> n = shardops.axis_size('d')
    """
    axes = parse_axes(name, "axis_size")
    manual = _manual("axis_size", "/".join(axes), axes)
    return math.prod(manual[a] for a in axes)


def axis_index(name: str | tuple[str, ...]) -> jax.Array:
    """This device's index along a manual mesh axis (``'d/t'``: row-major over both).

    Example:
        >>> i = shardops.axis_index('t')
    """
    axes = parse_axes(name, "axis_index")
    _manual("axis_index", "/".join(axes), axes)
    return lax.axis_index(_axis_arg(axes))
