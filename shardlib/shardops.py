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

import contextlib
import functools
import math
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from typeguard import TypeCheckError

from . import _context
from ._checking import _short_value, check_value, format_sizes
from ._frames import user_location
from ._opspecs import (
    parse_axes,
    plan_all_gather,
    plan_all_to_all,
    plan_einsum,
    plan_index,
    plan_psum_scatter,
)
from ._parsing import ShapeSpec, SpecError, _as_str, did_you_mean
from ._pending import Note, PendingReductionError, assume_reduced, linear, note
from ._scopes import Scope, current_scope

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


def _declare(
    x: Any, spec: ShapeSpec, op: str, text: str, role: str, part: int | None, why: str = ""
) -> Any:
    """Leave an ``expect`` note when ``spec`` has a ``{+t}`` clause (checked after tracing)."""
    if not spec.pending:
        return x
    pos, width = _clause_pos(text, part)
    n = Note("expect", spec.pending, op, text, role=role, pos=pos, width=width, why=why)
    return note(x, n)


def _input(
    x: Any, spec: ShapeSpec, scope: Scope, op: str, text: str, role: str, part: int = 0
) -> Any:
    """Check one input against its spec (a ``{+t}`` clause is checked after tracing)."""
    _check(x, spec, scope, op, text, role)
    return _declare(x, spec, op, text, role, part)


def _output(y: Any, spec: ShapeSpec, scope: Scope, op: str, text: str, why: str = "") -> Any:
    """Check the output against its spec; ``why`` explains the pending axes in a mismatch."""
    _check(y, spec, scope, op, text, "output")
    return _declare(y, spec, op, text, "output", None if "->" in text else 0, why)


def _summed(x: Any, axes: tuple[str, ...], op: str, text: str) -> Any:
    """Leave a ``sum`` note: summing a value that is the same on every device is refused."""
    return note(x, Note("sum", axes, op, text))


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


class _OpFailure(Exception):
    """Base of the errors a shardops op raises for an exception JAX (or Python) raised in it.

    Each is also an instance of the original exception's type (a generated subclass), so
    ``except TypeError`` still catches it; the message names the op, its spec and its
    arguments, then keeps the original text.
    """

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


_FAILURE_TYPES: dict[type, type] = {}


def _failure_type(t: type) -> type:
    """A subclass of ``_OpFailure`` and ``t`` (or of TypeError/ValueError when ``t`` is final)."""
    cls = _FAILURE_TYPES.get(t)
    if cls is None:
        attrs = {"__module__": __name__, "__qualname__": t.__name__, "__init__": Exception.__init__}
        try:
            cls = type(t.__name__, (_OpFailure, t), attrs)
        except TypeError:  # a type that cannot be subclassed (or laid out with ours)
            fallback = next((b for b in (ValueError, TypeError) if issubclass(t, b)), TypeError)
            cls = type(t.__name__, (_OpFailure, fallback), attrs)
        _FAILURE_TYPES[t] = cls
    return cls


def _describe_args(args: dict[str, Any]) -> str:
    """``"input f32[1, 4] per device"``: each argument with its dtype and shape."""
    where = " per device" if _context.manual_axis_sizes() else ""
    parts = []
    for name, v in args.items():
        if name.endswith("keyword arguments"):
            if v:
                parts.append(f"{name} " + ", ".join(f"{k}={w!r}" for k, w in v.items()))
        else:
            shown = _short_value(v)
            parts.append(f"{name} {shown}{where if hasattr(v, 'shape') else ''}")
    return ", ".join(parts)


@contextlib.contextmanager
def _emitting(op: str, text: str, call: str, args: dict[str, Any]) -> Iterator[None]:
    """Re-raise what JAX raises while ``op`` emits ``call``, in shardops' words.

    shardlib's own errors (`SpecError`, ``TypeCheckError``, `PendingReductionError`, and
    errors already re-raised here) pass through unchanged.
    """
    try:
        yield
    except (SpecError, TypeCheckError, _OpFailure, StopIteration):
        raise
    except Exception as e:
        msg = (
            f"{op}({text!r}) on {_describe_args(args)}: {call} refused it; fix the spec or the "
            f"arguments so that they agree. {type(e).__name__}: {e}"
        )
        try:
            err = _failure_type(type(e))(msg)
        except Exception:  # pragma: no cover - an exception type we cannot build: keep JAX's
            raise e from None
        raise err from e


def _check_splittable(
    op: str,
    text: str,
    x: Any,
    spec: ShapeSpec,
    splits: tuple[tuple[int, tuple[str, ...]], ...],
    manual: dict[str, int],
    verb: str,
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
            f"{op}({text!r}): dim {dim} {str(d)!r} of the input has {size}, which is not "
            f"divisible by {factor}, so {op} cannot {verb} it over {'/'.join(axes)!r}; expected "
            f"a multiple of {k * have}: pad the dim, or {verb} another dim"
        )


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
    x = _input(x, plan.spec.inputs[0], s, "all_gather", text, "input")
    with _emitting("all_gather", text, "jax.lax.all_gather", {"input": x}):
        for dim, axes in plan.gathers:
            with _scope("all_gather", text):
                x = lax.all_gather(x, _axis_arg(axes), axis=dim, tiled=True)
    why = "all_gather keeps the pending axes of its input"
    return _output(x, plan.spec.output, s, "all_gather", text, why)


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
    manual = _manual("psum_scatter", text, tuple(a for _, axes in plan.scatters for a in axes))
    x = _input(x, plan.spec.inputs[0], s, "psum_scatter", text, "input")
    _check_splittable(
        "psum_scatter", text, x, plan.spec.inputs[0], plan.scatters, manual, "scatter"
    )
    summed = tuple(a for _, axes in plan.scatters for a in axes)
    x = _summed(x, summed, "psum_scatter", text)
    with _emitting("psum_scatter", text, "jax.lax.psum_scatter", {"input": x}):
        for dim, axes in plan.scatters:
            with _scope("psum_scatter", text):
                x = lax.psum_scatter(x, _axis_arg(axes), scatter_dimension=dim, tiled=True)
    why = f"this sums over {_axes(summed)}"
    return _output(x, plan.spec.output, s, "psum_scatter", text, why)


def _all_reduce(op: str, prim, spec: str | bytes, x: jax.Array, axes, *, is_sum: bool) -> Any:
    text = _as_str(spec)
    try:
        shape = ShapeSpec.parse(text)
    except SpecError as e:
        raise e.with_context(op) from None
    red = parse_axes(axes, op, text)
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
    x = _input(x, shape, s, op, text, "input")
    if is_sum:
        x = _summed(x, red, op, text)
    with _emitting(op, text, f"jax.lax.{op}", {"input": x}), _scope(op, text):
        out = prim(x, _axis_arg(red))
    return _output(out, shape.without_pending(), s, op, text)


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
    manual = _manual("all_to_all", text, plan.axes)
    x = _input(x, plan.spec.inputs[0], s, "all_to_all", text, "input")
    splits = ((plan.split_dim, plan.axes),)
    _check_splittable("all_to_all", text, x, plan.spec.inputs[0], splits, manual, "split")
    emit = _emitting("all_to_all", text, "jax.lax.all_to_all", {"input": x})
    with emit, _scope("all_to_all", text):
        y = lax.all_to_all(
            x,
            _axis_arg(plan.axes),
            split_axis=plan.split_dim,
            concat_axis=plan.concat_dim,
            tiled=True,
        )
    why = "all_to_all keeps the pending axes of its input"
    return _output(y, plan.spec.output, s, "all_to_all", text, why)


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
    text = _as_str(spec)
    if not operands:
        raise TypeError(f"einsum_unreduced({text!r}) needs at least one operand")
    plan = plan_einsum(text, len(operands))
    s = current_scope()
    op = "einsum_unreduced"
    if plan.unreduced:
        _manual(op, text, plan.unreduced)
    arrays = [
        _input(x, sp, s, op, text, f"operand {k}", part=k)
        for k, (x, sp) in enumerate(zip(operands, plan.spec.inputs, strict=True))
    ]
    args: dict[str, Any] = {f"operand {k}": a for k, a in enumerate(arrays)}
    args["keyword arguments"] = einsum_kwargs
    with _emitting(op, text, "jnp.einsum", args):
        y = jnp.einsum(plan.equation, *arrays, **einsum_kwargs)
    if plan.unreduced:
        y = note(y, Note("mark", plan.unreduced, origin=f"{op}({text!r}) at {user_location()}"))
    out_names = {str(o.shape) for o in plan.spec.output.dims}
    contracted = list(
        dict.fromkeys(
            str(d)
            for sp in plan.spec.inputs
            for d in sp.dims
            if d.sharding and str(d.shape) not in out_names
        )
    )
    n = len(contracted)
    why = (
        f"the contracted dim{'s' if n != 1 else ''} {', '.join(map(repr, contracted))} "
        f"{'are' if n != 1 else 'is'} split, so each device holds a partial sum"
        if contracted
        else "no contracted dim is split"
    )
    return _output(y, plan.spec.output, s, op, text, why)


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
    text = _as_str(spec)
    plan = plan_index(text)
    s = current_scope()
    if plan.axes:
        _manual("index_unreduced", text, plan.axes)
    op = "index_unreduced"
    _check(table, plan.spec.inputs[0], s, op, text, "table")
    _check(indices, plan.spec.inputs[1], s, op, text, "indices")
    if not jnp.issubdtype(indices.dtype, jnp.integer):
        raise TypeError(
            f"index_unreduced({text!r}): indices must have an integer dtype, got {indices.dtype}"
        )
    args = {"table": table, "indices": indices}
    with _emitting(op, text, "the lookup (jnp.take under jax.vmap)", args):
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
    if plan.axes:
        y = note(y, Note("mark", plan.axes, origin=f"{op}({text!r}) at {user_location()}"))
    return _output(y, plan.spec.output, s, op, text, why)


def axis_size(name: str | tuple[str, ...]) -> int:
    """The size of a manual mesh axis (or the product for ``'d/t'``), as a Python int.

    Examples:
        >>> n = shardops.axis_size('d')
    """
    axes = parse_axes(name, "axis_size", arg="name")
    manual = _manual("axis_size", "/".join(axes), axes)
    return math.prod(manual[a] for a in axes)


def axis_index(name: str | tuple[str, ...]) -> jax.Array:
    """This device's index along a manual mesh axis (``'d/t'``: row-major over both).

    Examples:
        >>> i = shardops.axis_index('t')
    """
    axes = parse_axes(name, "axis_index", arg="name")
    _manual("axis_index", "/".join(axes), axes)
    return lax.axis_index(_axis_arg(axes))
