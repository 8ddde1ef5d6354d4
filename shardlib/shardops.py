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
from ._pending import (
    PendingReductionError,
    Unreduced,
    assume_reduced,
    caller_location,
    linear,
    pending_axes,
    unwrap,
)
from ._scopes import Scope, current_scope

__all__ = [
    "PendingReductionError",
    "Unreduced",
    "all_gather",
    "all_to_all",
    "assume_reduced",
    "axis_index",
    "axis_size",
    "einsum_unreduced",
    "index_unreduced",
    "linear",
    "pending_axes",
    "pmax",
    "pmean",
    "pmin",
    "psum",
    "psum_scatter",
]


def _check(x: Any, spec: ShapeSpec, scope: Scope, op: str, text: str, role: str) -> None:
    check_value(x, None, spec, scope, where=f"{op}({text!r}) {role}", check_sharding=False)


def _axes(axes: tuple[str, ...] | list[str]) -> str:
    return ", ".join(repr(a) for a in axes) if axes else "no axis"


def _clause_pos(text: str, part: int | None) -> tuple[int | None, int]:
    """Position and width of the ``{+...}`` clause of input ``part`` (None: the output)."""
    arrow = text.find("->")
    if part is None:
        start, end = (arrow + 2 if arrow >= 0 else 0), len(text)
    else:
        lhs = text[: arrow if arrow >= 0 else len(text)]
        bounds = [0] + [i + 1 for i, c in enumerate(lhs) if c == ","] + [len(lhs) + 1]
        if part + 1 >= len(bounds):
            return None, 1
        start, end = bounds[part], bounds[part + 1] - 1
    i = text.find("{", start, end)
    if i < 0:
        return None, 1
    j = text.find("}", i, end)
    return i, (j - i + 1 if j >= 0 else 1)


def _declared_mismatch(
    op: str,
    text: str,
    part: int | None,
    role: str,
    declared: tuple[str, ...],
    pending: tuple[str, ...],
    origin: str | None,
    why: str = "",
) -> SpecError:
    """A '{+...}' clause that does not match the axes the value really owes a sum over."""
    clause = str(ShapeSpec((), declared))
    if pending:
        actual = f"it is pending over {_axes(pending)} ({str(ShapeSpec((), pending))})"
        if origin:
            actual += f", made by {origin}"
        fix = f"write {str(ShapeSpec((), pending))!r}, or leave the clause out to have it inferred"
    else:
        actual = "it is not a partial sum (nothing is pending)"
        fix = f"remove {clause!r}"
    pos, width = _clause_pos(text, part)
    return SpecError(
        f"{op}: the {role} is declared pending over {_axes(declared)} ({clause}) but "
        + actual
        + (f": {why}" if why else ""),
        text,
        pos,
        width,
        hint=fix,
    )


def _input(
    x: Any, spec: ShapeSpec, scope: Scope, op: str, text: str, role: str, part: int = 0
) -> tuple[Any, tuple[str, ...], str | None]:
    """Check one input; return ``(array, pending axes, origin of the pending sum)``."""
    arr, pending, origin = unwrap(x)
    _check(arr, spec, scope, op, text, role)
    if spec.pending and set(spec.pending) != set(pending):
        raise _declared_mismatch(op, text, part, role, spec.pending, pending, origin)
    return arr, pending, origin


def _output(
    y: Any,
    pending: tuple[str, ...],
    origin: str | None,
    spec: ShapeSpec,
    scope: Scope,
    op: str,
    text: str,
    why: str = "",
    own_origin: bool = False,
) -> Any:
    """Check the output; wrap it as `Unreduced` when it still owes a sum.

    ``why`` explains the pending axes in a mismatch error; ``own_origin``: it names the
    origin itself (the message then leaves it out).
    """
    _check(y, spec, scope, op, text, "output")
    if spec.pending and set(spec.pending) != set(pending):
        part = None if "->" in text else 0
        shown = None if own_origin else origin
        raise _declared_mismatch(op, text, part, "output", spec.pending, pending, shown, why)
    if not pending:
        return y
    return Unreduced(y, pending, origin or f"{op}({text!r}) at {caller_location()}")


def _refuse_pending(x: Any, op: str, text: str, role: str, why: str) -> None:
    if isinstance(x, Unreduced):
        raise PendingReductionError(
            f"{op}({text!r}): the {role} is {x.describe()}; {why}. Reduce it first with "
            f"shardops.psum or psum_scatter over {'/'.join(x.axes)!r}"
        )


def _refuse_invariant(x: Any, axes: tuple[str, ...], op: str, text: str) -> None:
    """With check_vma=True, summing a value that is the same on every device is a bug.

    JAX then knows ``x`` does not vary over ``axes``; a sum over them multiplies it by the
    number of devices (and a mean returns it unchanged). The classic way to get here is
    ``jax.grad`` inside the body with respect to a replicated value: JAX has already summed
    that gradient over the axes.
    """
    vma = _context.varying_axes(x)
    if vma is None:
        return
    same = [a for a in axes if a not in vma]
    if same:
        raise ValueError(
            f"{op}({text!r}): the input is the same on every device of mesh axis "
            f"{'/'.join(same)!r} (JAX's type says it does not vary over it), so {op} would "
            f"{'return it unchanged' if op == 'pmean' else 'multiply it by the axis size'}. "
            "If it is a gradient taken inside the body with respect to a replicated value, "
            "JAX has already summed it over that axis: drop the reduction (or take the "
            "gradient of jax.lax.pcast(w, axis, to='varying') to get per-device parts). If you "
            "really want size x value, multiply by shardops.axis_size(axis)"
        )


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


# Every collective runs under a named scope 'shardops.OP[SPEC]': it shows in profiles and
# HLO metadata, and shardlib.explain finds each collective's op and spec by it.
SCOPE_PREFIX = "shardops."


def _scope(op: str, text: str):
    return jax.named_scope(f"{SCOPE_PREFIX}{op}[{text}]")


def _axis_arg(axes: tuple[str, ...]) -> str | tuple[str, ...]:
    return axes[0] if len(axes) == 1 else axes


def all_gather(spec: str | bytes, x: jax.Array) -> jax.Array:
    """All-gather that removes trailing mesh axes from dims (tiled).

    **Arguments:** `spec` like ``'in hidden/d -> in hidden'``; `x` the per-device block.

    **Returns:** the gathered block. One ``all-gather`` per dim that loses axes.

    Examples:
        >>> w = shardops.all_gather('in hidden/d -> in hidden', w)  # FSDP weight gather
    """
    text = _as_str(spec)
    plan = plan_all_gather(text)
    s = current_scope()
    _manual("all_gather", text, tuple(a for _, axes in plan.gathers for a in axes))
    x, pending, origin = _input(x, plan.spec.inputs[0], s, "all_gather", text, "input")
    for dim, axes in plan.gathers:
        with _scope("all_gather", text):
            x = lax.all_gather(x, _axis_arg(axes), axis=dim, tiled=True)
    why = "all_gather keeps the pending axes of its input"
    return _output(x, pending, origin, plan.spec.output, s, "all_gather", text, why)


def psum_scatter(spec: str | bytes, x: jax.Array) -> jax.Array:
    """Reduce-scatter: sum over the added mesh axes and keep this device's block.

    **Arguments:** `spec` like ``'batch len model -> batch len model/t'``; `x` a per-device
    partial sum (unreduced over the added axes).

    **Returns:** the reduced, scattered block. One ``reduce-scatter`` per dim gaining axes.

    Examples:
        >>> y = shardops.psum_scatter('B/d L M -> B/d L M/t', partial)
    """
    text = _as_str(spec)
    plan = plan_psum_scatter(text)
    s = current_scope()
    _manual("psum_scatter", text, tuple(a for _, axes in plan.scatters for a in axes))
    x, pending, origin = _input(x, plan.spec.inputs[0], s, "psum_scatter", text, "input")
    if not pending:  # a partial sum has its own check (its pending axes)
        scattered = tuple(a for _, axes in plan.scatters for a in axes)
        _refuse_invariant(x, scattered, "psum_scatter", text)
    summed: list[str] = []
    for dim, axes in plan.scatters:
        with _scope("psum_scatter", text):
            x = lax.psum_scatter(x, _axis_arg(axes), scatter_dimension=dim, tiled=True)
        summed.extend(axes)
    left = tuple(a for a in pending if a not in summed)
    why = f"the input owed {_axes(pending)} and this sums over {_axes(summed)}"
    return _output(x, left, origin, plan.spec.output, s, "psum_scatter", text, why)


def _all_reduce(op: str, prim, spec: str | bytes, x: jax.Array, axes, *, is_sum: bool) -> Any:
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
    if not is_sum:
        _refuse_pending(
            x, op, text, "input", f"the {op[1:]} of partial sums is not the {op[1:]} of the sums"
        )
    x, pending, origin = _input(x, shape, s, op, text, "input")
    if is_sum and not pending:  # a partial sum has its own check (its pending axes)
        _refuse_invariant(x, red, op, text)
    with _scope(op, text):
        out = prim(x, _axis_arg(red))
    left = tuple(a for a in pending if a not in red)
    return _output(out, left, origin, shape.without_pending(), s, op, text)


def psum(spec: str | bytes, x: jax.Array, axes: str | tuple[str, ...]) -> jax.Array:
    """All-reduce (sum) over mesh ``axes``; the layout ``spec`` is unchanged.

    The spec describes ``x`` before and after (an all-reduce does not change the layout);
    ``axes`` names the mesh axes summed over: ``'t'``, ``'d/t'`` or ``('d', 't')``. For a
    partial sum (`Unreduced`) this clears the pending axes it sums over; the spec may
    declare the input's pending axes, ``'B/d M {+t}'`` (checked).

    Examples:
        >>> loss = shardops.psum('', local_loss, axes='d')
        >>> y = shardops.psum('B/d L M', partial, axes='t')
    """
    return _all_reduce("psum", lax.psum, spec, x, axes, is_sum=True)


def pmean(spec: str | bytes, x: jax.Array, axes: str | tuple[str, ...]) -> jax.Array:
    """All-reduce (mean) over mesh ``axes``; same spec form as `psum`.

    Over the pending axes of a partial sum it clears them, like `psum`: the result is
    the sum divided by the number of devices on those axes.

    Examples:
        >>> g = shardops.pmean('in out', g, axes='d')
    """
    return _all_reduce("pmean", lax.pmean, spec, x, axes, is_sum=True)


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
    """All-reduce (max) over mesh ``axes``; same spec form as `psum`.

    Differentiable (``lax.pmax`` is not): the gradient goes to the devices that hold the
    maximum, split equally among ties, as for ``jnp.max``.

    Examples:
        >>> m = shardops.pmax('B/d L', local_max, axes='t')  # logsumexp over sharded vocab
    """
    return _all_reduce("pmax", _pmax, spec, x, axes, is_sum=False)


def pmin(spec: str | bytes, x: jax.Array, axes: str | tuple[str, ...]) -> jax.Array:
    """All-reduce (min) over mesh ``axes``; same spec form as `psum`.

    Differentiable like `pmax`.

    Examples:
        >>> m = shardops.pmin('B/d', x, axes='t')
    """
    return _all_reduce("pmin", _pmin, spec, x, axes, is_sum=False)


def all_to_all(spec: str | bytes, x: jax.Array) -> jax.Array:
    """Move mesh axes from the end of one dim to the end of another (tiled all-to-all).

    Examples:
        >>> y = shardops.all_to_all('B/d L -> B L/d', x)  # batch-split -> sequence-split
    """
    text = _as_str(spec)
    plan = plan_all_to_all(text)
    s = current_scope()
    _manual("all_to_all", text, plan.axes)
    x, pending, origin = _input(x, plan.spec.inputs[0], s, "all_to_all", text, "input")
    with _scope("all_to_all", text):
        y = lax.all_to_all(
            x,
            _axis_arg(plan.axes),
            split_axis=plan.split_dim,
            concat_axis=plan.concat_dim,
            tiled=True,
        )
    why = "all_to_all keeps the pending axes of its input"
    return _output(y, pending, origin, plan.spec.output, s, "all_to_all", text, why)


def einsum_unreduced(spec: str | bytes, *operands: jax.Array, **einsum_kwargs: Any) -> jax.Array:
    """Device-local einsum with sharding-aware shape checks; no communication.

    Dims are named as in shape specs. A contracted dim that is sharded leaves the result
    *unreduced* over its mesh axes: it is returned as a `Unreduced` partial sum, to
    reduce afterwards (``psum``/``psum_scatter``); using it otherwise is an error at trace
    time. The output spec may declare those axes, ``'... -> B/d M {+t}'`` (checked). One
    operand may itself be a partial sum: the result keeps its pending axes. Keyword arguments
    (``preferred_element_type``, ``precision``) go to ``jnp.einsum``.

    Examples:
        >>> y = shardops.einsum_unreduced('B/d L M, M F/t -> B/d L F/t', x, w)
        >>> z = shardops.einsum_unreduced('B/d L F/t, F/t M -> B/d L M', y, w2)  # pending over t
        >>> z = shardops.psum_scatter('B/d L M -> B/d L M/t', z)
    """
    text = _as_str(spec)
    if not operands:
        raise TypeError(f"einsum_unreduced({text!r}) needs at least one operand")
    plan = plan_einsum(text, len(operands))
    s = current_scope()
    op = "einsum_unreduced"
    arrays = []
    inherited: tuple[str, ...] = ()
    origin: str | None = None
    first: tuple[int, Unreduced] | None = None  # the operand that is a partial sum
    for k, (x, sp) in enumerate(zip(operands, plan.spec.inputs, strict=True)):
        arr, pending, org = _input(x, sp, s, op, text, f"operand {k}", part=k)
        if isinstance(x, Unreduced):
            if first is not None:
                j, u = first
                raise PendingReductionError(
                    f"{op}({text!r}): operands {j} and {k} are both partial sums: operand {j} is "
                    f"{u.describe()}; operand {k} is {x.describe()}. The product of two partial "
                    "sums is not a partial sum of the product: reduce one of them first "
                    "(shardops.psum)"
                )
            clash = [
                (j, str(d), a)
                for j, o in enumerate(plan.spec.inputs)
                for d in o.dims
                for a in d.sharding
                if a in pending
            ]
            if clash:
                j, dim, a = clash[0]
                raise PendingReductionError(
                    f"{op}({text!r}): operand {k} is {x.describe()}, and dim {dim!r} of "
                    f"operand {j} is split over the pending axis {a!r}: each device would "
                    f"multiply its share of the sum by a different block, which does not add "
                    f"up to the product. Reduce operand {k} first (shardops.psum over "
                    f"{'/'.join(pending)!r}), or all_gather operand {j}'s dim {dim!r}"
                )
            inherited, origin, first = pending, org, (k, x)
        arrays.append(arr)
    y = jnp.einsum(plan.equation, *arrays, **einsum_kwargs)
    new = tuple(a for a in plan.unreduced if a not in inherited)
    pending = inherited + new
    if new:
        origin = f"{op}({text!r}) at {caller_location()}"
    out_names = {str(o.shape) for o in plan.spec.output.dims}
    contracted = list(
        dict.fromkeys(
            str(d)
            for sp in plan.spec.inputs
            for d in sp.dims
            if d.sharding and str(d.shape) not in out_names
        )
    )
    reasons = []
    if first is not None:
        reasons.append(
            f"operand {first[0]} is a partial sum over {_axes(inherited)} (made by "
            f"{first[1].origin}) and an einsum is linear in it"
        )
    if contracted:
        n = len(contracted)
        reasons.append(
            f"the contracted dim{'s' if n != 1 else ''} {', '.join(map(repr, contracted))} "
            f"{'are' if n != 1 else 'is'} split, so each device holds a partial sum"
        )
    why = "; ".join(reasons) or "no contracted dim is split and no operand is a partial sum"
    return _output(y, pending, origin, plan.spec.output, s, op, text, why, own_origin=True)


def index_unreduced(spec: str | bytes, table: jax.Array, indices: jax.Array) -> jax.Array:
    """Look up ``indices`` in the bracketed dim of a (possibly sharded) ``table``.

    Each device looks up the indices that fall in its block of the bracketed dim and returns
    zeros for the others, so the result is *unreduced* over the bracketed dim's mesh axes (a
    `Unreduced`): sum it over them afterwards (``psum``/``psum_scatter``). Indices outside ``[0, size)``
    (negative or too large) find no block and give zeros, like an off-shard lookup. Dims named
    in both the table and the indices are batch dims (vmapped together); the output may list
    its dims in any order.

    Examples:
        >>> x = shardops.index_unreduced('[V/t] M, B/d L -> B/d L M', embed, tokens)
        >>> x = shardops.psum('B/d L M', x, axes='t')
    """
    text = _as_str(spec)
    plan = plan_index(text)
    s = current_scope()
    if plan.axes:
        _manual("index_unreduced", text, plan.axes)
    op = "index_unreduced"
    _refuse_pending(table, op, text, "table", "a lookup in a partial-sum table is not linear")
    _refuse_pending(indices, op, text, "indices", "indices must be exact integers")
    _check(table, plan.spec.inputs[0], s, op, text, "table")
    _check(indices, plan.spec.inputs[1], s, op, text, "indices")
    if not jnp.issubdtype(indices.dtype, jnp.integer):
        raise TypeError(
            f"index_unreduced({text!r}): indices must have an integer dtype, got {indices.dtype}"
        )
    # Compare in at least 32 bits: block offsets overflow narrow index dtypes (uint8...).
    indices = indices.astype(jnp.promote_types(indices.dtype, jnp.int32))
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
    looked_up = str(plan.spec.inputs[0].dims[b])
    why = (
        f"the looked-up dim {looked_up!r} is split, so each device finds only its own rows"
        if plan.axes
        else f"the looked-up dim {looked_up!r} is not split"
    )
    return _output(y, plan.axes, None, plan.spec.output, s, op, text, why)


def axis_size(name: str | tuple[str, ...]) -> int:
    """The size of a manual mesh axis (or the product for ``'d/t'``), as a Python int.

    Examples:
        >>> n = shardops.axis_size('d')
    """
    axes = parse_axes(name, "axis_size")
    manual = _manual("axis_size", "/".join(axes), axes)
    return math.prod(manual[a] for a in axes)


def axis_index(name: str | tuple[str, ...]) -> jax.Array:
    """This device's index along a manual mesh axis (``'d/t'``: row-major over both).

    Examples:
        >>> i = shardops.axis_index('t')
    """
    axes = parse_axes(name, "axis_index")
    _manual("axis_index", "/".join(axes), axes)
    return lax.axis_index(_axis_arg(axes))
