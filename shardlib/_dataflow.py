"""Follow partial sums through a traced ``shard_map`` body; refuse any that go astray.

A value noted ``mark`` (see `shardlib._pending`) is a partial sum over some mesh axes. This
module walks the body's jaxpr once, in program order, and keeps three facts per value:

- ``pend``: the mesh axes it still owes a sum over, and the op that made it;
- ``zero``: it is known to be all zeros (``jnp.zeros``, a literal ``0``): adding it, or
  selecting it, leaves a partial sum a partial sum;
- ``vary``: the manual mesh axes over which it may differ from device to device (what JAX's
  ``check_vma`` types say, computed here too so ``check_vma=False`` bodies get it).

A partial sum may flow only through linear operations (``+``/``-`` with another partial sum
over the same axes, scaling by a value that is the same on every device of those axes, float
casts, reshapes, slices, local sums, ``jit``/``scan``/``cond``/``checkpoint``/``custom_vjp``
bodies...) and be reduced by ``psum``/``psum_scatter``/``pmean`` over its axes (any axes it
reduces over beyond them must be axes it varies over). Anything else, returning it included,
is a `PendingReductionError` naming the op, its line and the op that made the value.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np
from jax.extend.core import ClosedJaxpr, Jaxpr, Literal

from . import _frames
from ._parsing import ShapeSpec, SpecError
from ._pending import Note, PendingReductionError

__all__ = ["check_body"]


@dataclass(frozen=True)
class Pend:
    axes: frozenset[str]
    origin: str

    def text(self) -> str:
        return _axes_text(self.axes)


class St(NamedTuple):
    pend: Pend | None = None
    zero: bool = False
    vary: frozenset[str] = frozenset()


_PLAIN = St()


def _axes_text(axes: Any) -> str:
    axes = sorted(axes)
    word = "axes" if len(axes) > 1 else "axis"
    return f"mesh {word} " + ", ".join(repr(a) for a in axes)


def _axes_arg(axes: Any) -> str:
    return "/".join(sorted(axes))


# ---------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------


class _Ctx:
    """The function whose body is analysed, and the equations (calls, loops) we are inside:
    messages about an equation without a name or line of its own use theirs."""

    def __init__(self, fname: str, outer: tuple[Any, ...] = ()):
        self.fname = fname
        self.outer = outer

    def inside(self, eqn: Any) -> _Ctx:
        return _Ctx(self.fname, (*self.outer, eqn))


def _shardops_name(eqn: Any) -> str | None:
    """``shardops.psum('B M')`` when ``eqn`` ran under a shardops op's named scope."""
    stack = _frames.name_stack_of(eqn)
    at = stack.rfind("shardops.")
    if at >= 0:  # 'shardops.OP[SPEC]', perhaps followed by '/inner' scopes
        op, _, rest = stack[at:].partition("[")
        if "]" in rest:
            return f"{op}({rest[: rest.rfind(']')]!r})"
    return None


def _location(eqn: Any) -> str | None:
    return _frames.location_of_traceback(getattr(eqn.source_info, "traceback", None))


def _op_name(eqn: Any, ctx: _Ctx | None = None) -> str:
    """How the user wrote the op: its shardops name (its own, or that of the call it is in),
    else the primitive (``max``, ``mul``...)."""
    for e in (eqn, *reversed(ctx.outer if ctx else ())):
        name = _shardops_name(e)
        if name:
            return name
    return f"`{eqn.primitive.name}`"


def _where(eqn: Any, ctx: _Ctx | None = None) -> str:
    for e in (eqn, *reversed(ctx.outer if ctx else ())):
        loc = _location(e)
        if loc:
            return f" at {loc}"
    return ""


def _fail(ctx: _Ctx, eqn: Any, pend: Pend, what: str, hint: str) -> PendingReductionError:
    return PendingReductionError(
        f"in {ctx.fname}(): {_op_name(eqn, ctx)}{_where(eqn, ctx)} {what} a partial sum still "
        f"owing a reduction over {pend.text()} (made by {pend.origin}). {hint}"
    )


def _reduce_hint(pend: Pend) -> str:
    return (
        f"Reduce it first: shardops.psum(spec, x, axes={_axes_arg(pend.axes)!r}) (or "
        f"jax.lax.psum(x, {tuple(sorted(pend.axes))!r}), or psum_scatter), or, if the "
        "operation is linear, apply it with shardops.linear(fn, x)"
    )


# ---------------------------------------------------------------------------------------------
# The walk
# ---------------------------------------------------------------------------------------------


def _sub(j: Any) -> tuple[Jaxpr, Sequence[Any]]:
    return (j.jaxpr, j.consts) if isinstance(j, ClosedJaxpr) else (j, ())


def _literal_state(v: Any) -> St:
    try:
        zero = bool(np.all(np.asarray(v.val) == 0))
    except Exception:  # pragma: no cover - exotic literal
        zero = False
    return St(zero=zero)


def _run(jaxpr: Jaxpr, consts: Sequence[Any], ins: Sequence[St], ctx: _Ctx) -> list[St]:
    env: dict[Any, St] = {}
    for v in jaxpr.constvars:
        env[v] = _PLAIN
    for v, s in zip(jaxpr.invars, ins, strict=True):
        env[v] = s

    def read(v: Any) -> St:
        return _literal_state(v) if isinstance(v, Literal) else env.get(v, _PLAIN)

    for eqn in jaxpr.eqns:
        states = [read(v) for v in eqn.invars]
        outs = _RULES.get(eqn.primitive.name, _unknown)(eqn, states, ctx)
        for v, s in zip(eqn.outvars, outs, strict=True):
            env[v] = s
    return [read(v) for v in jaxpr.outvars]


def _union(states: Sequence[St]) -> frozenset[str]:
    out: frozenset[str] = frozenset()
    for s in states:
        out |= s.vary
    return out


def _plain_outs(eqn: Any, states: Sequence[St], zero: bool = False) -> list[St]:
    vary = _union(states)
    return [St(None, zero, vary) for _ in eqn.outvars]


def _first_pending(states: Sequence[St]) -> Pend | None:
    return next((s.pend for s in states if s.pend is not None), None)


def _jaxprs_in(params: dict[str, Any]) -> list[Any]:
    out = []
    for v in params.values():
        for j in v if isinstance(v, tuple | list) else (v,):
            if isinstance(j, Jaxpr | ClosedJaxpr):
                out.append(j)
    return out


def _unknown(eqn: Any, states: Sequence[St], ctx: _Ctx) -> list[St]:
    """A primitive without a rule: a call-like one (its body takes the operands and gives
    the results) is followed into; any other body is checked on its own; a pending operand
    is refused."""
    subs = _jaxprs_in(eqn.params)
    for j in subs:
        jaxpr, consts = _sub(j)
        call_like = len(jaxpr.invars) == len(states) and len(jaxpr.outvars) == len(eqn.outvars)
        if len(subs) == 1 and call_like:
            return _run(jaxpr, consts, states, ctx.inside(eqn))
        alone = _run(jaxpr, consts, [_PLAIN] * len(jaxpr.invars), ctx.inside(eqn))
        for k, s in enumerate(alone):
            if s.pend is not None:
                raise _fail(
                    ctx,
                    eqn,
                    s.pend,
                    f"(a transformation shardlib does not know) gives out, as result {k},",
                    _reduce_hint(s.pend),
                )
    pend = _first_pending(states)
    if pend is not None:
        raise _fail(
            ctx,
            eqn,
            pend,
            "is not linear (or not known to be), and its input is",
            _reduce_hint(pend),
        )
    return _plain_outs(eqn, states)


# -- linear, one operand at a time -------------------------------------------------------------


def _unary(eqn: Any, states: Sequence[St], ctx: _Ctx) -> list[St]:
    """Linear in its first operand; other operands (indices, sizes) must not be pending and
    must be the same on every device of the pending axes."""
    first = states[0]
    _check_static_operands(eqn, first, states[1:], ctx)
    return [St(first.pend, first.zero, _union(states)) for _ in eqn.outvars]


def _each(eqn: Any, states: Sequence[St], ctx: _Ctx) -> list[St]:
    """Each operand passes to the output at its position (device_put, optimization_barrier)."""
    return list(states)


def _check_static_operands(eqn: Any, first: St, others: Sequence[St], ctx: _Ctx) -> None:
    for s in others:
        if s.pend is not None:
            raise _fail(
                ctx, eqn, s.pend, "uses as an index, a size or a mask", _reduce_hint(s.pend)
            )
        if first.pend is not None and s.vary & first.pend.axes:
            axes = s.vary & first.pend.axes
            raise _fail(
                ctx,
                eqn,
                first.pend,
                f"uses an index or mask that differs across the devices of {_axes_text(axes)} on",
                "Each device would select a different part of its share, which does not add "
                "up to the part of the sum. Reduce first, or make the index the same on every "
                "device of those axes",
            )


def _convert(eqn: Any, states: Sequence[St], ctx: _Ctx) -> list[St]:
    s = states[0]
    if s.pend is not None:
        new = np.dtype(eqn.params["new_dtype"])
        old = np.dtype(eqn.invars[0].aval.dtype)
        if not _linear_cast(old, new):
            raise _fail(
                ctx,
                eqn,
                s.pend,
                f"casts {old.name} to {new.name}, which is not linear (it rounds or "
                "truncates each share), on",
                _reduce_hint(s.pend),
            )
    return [St(s.pend, s.zero, s.vary)]


def _linear_cast(old: np.dtype, new: np.dtype) -> bool:
    """Casts to a float type (rounding aside) and between integer types are linear; casts to
    an integer from a float, and to or from bool, are not."""
    if jnp.issubdtype(new, jnp.inexact):
        return not jnp.issubdtype(old, jnp.bool_)
    if jnp.issubdtype(new, jnp.integer):
        return jnp.issubdtype(old, jnp.integer)
    return False


def _pad(eqn: Any, states: Sequence[St], ctx: _Ctx) -> list[St]:
    x, value = states
    if x.pend is not None and not value.zero:
        raise _fail(
            ctx,
            eqn,
            x.pend,
            "pads with a value other than zero",
            "Padding with c adds c once per device. Pad with zeros, or reduce first",
        )
    return _combine(eqn, [x, value], ctx)


# -- sums and selections: every non-zero operand owes the same axes -----------------------------


def _combine(eqn: Any, states: Sequence[St], ctx: _Ctx) -> list[St]:
    vary = _union(states)
    live = [s for s in states if not s.zero]
    pends = [s.pend for s in live]
    pend = next((p for p in pends if p is not None), None)
    if pend is None:
        return [St(None, not live, vary) for _ in eqn.outvars]
    for p in pends:
        if p is None:
            raise _fail(
                ctx,
                eqn,
                pend,
                "combines a value that is not a partial sum with",
                "Adding a reduced value to a partial sum adds it once per device of "
                f"{_axes_text(pend.axes)}. Reduce first and add after, or add it on one device "
                "only: shardops.linear(lambda v: v + b * (shardops.axis_index(axis) == 0), x)",
            )
        if p.axes != pend.axes:
            raise _fail(
                ctx,
                eqn,
                pend,
                f"combines a partial sum over {p.text()} (made by {p.origin}) with",
                "Both must owe the same reduction. Reduce one of them first",
            )
    return [St(pend, False, vary) for _ in eqn.outvars]


def _select(eqn: Any, states: Sequence[St], ctx: _Ctx) -> list[St]:
    out = _combine(eqn, states[1:], ctx)
    pend = out[0].pend
    if pend is not None:
        _check_static_operands(eqn, St(pend), states[:1], ctx)
    return [St(o.pend, o.zero, _union(states)) for o in out]


def _update(eqn: Any, states: Sequence[St], ctx: _Ctx) -> list[St]:
    """dynamic_update_slice (operand, update, *indices), scatter (operand, indices, updates):
    the data operands combine as a sum does, the indices must be the same across the
    pending axes."""
    if eqn.primitive.name == "dynamic_update_slice":
        data, idx = states[:2], states[2:]
    else:
        data, idx = [states[0], *states[2:]], states[1:2]
    out = _combine(eqn, data, ctx)
    if out[0].pend is not None:
        _check_static_operands(eqn, St(out[0].pend), idx, ctx)
    return [St(o.pend, o.zero, _union(states)) for o in out]


# -- products: linear in one operand when the other is the same across its pending axes ----------


def _product(eqn: Any, states: Sequence[St], ctx: _Ctx) -> list[St]:
    name = eqn.primitive.name
    vary = _union(states)
    if name == "mul" and any(s.zero for s in states):
        # Zero on every device: a partial sum of zeros, still owing what it owed.
        return [St(_first_pending(states), True, vary)]
    pending = [i for i, s in enumerate(states) if s.pend is not None]
    if not pending:
        return [St(None, False, vary)]
    i = pending[0]
    pend = states[i].pend
    assert pend is not None
    if len(pending) > 1 or (name == "div" and i == 1):
        why = "divides by" if name == "div" and i == 1 else "multiplies two partial sums, one is"
        raise _fail(
            ctx,
            eqn,
            pend,
            why,
            "The product (or quotient) of partial sums is not a partial sum of the result. "
            "Reduce first",
        )
    other = states[1 - i]
    clash = other.vary & pend.axes
    if clash:
        raise _fail(
            ctx,
            eqn,
            pend,
            f"multiplies by a value that differs across the devices of {_axes_text(clash)} "
            "(a per-device mask, or a block split over that axis)",
            "Each device would scale its share by a different factor, which does not add up to "
            "the scaled sum. Reduce first, then multiply",
        )
    return [St(pend, name == "div" and states[0].zero, vary)]


# -- collectives -----------------------------------------------------------------------------------


def _names(axes: Any) -> frozenset[str]:
    if axes is None:
        return frozenset()
    if isinstance(axes, str):
        return frozenset((axes,))
    out: set[str] = set()
    for a in axes:
        out |= _names(a) if isinstance(a, tuple | list) else ({a} if isinstance(a, str) else set())
    return frozenset(out)


def _axes_param(eqn: Any) -> frozenset[str]:
    p = eqn.params
    return _names(p.get("axes", p.get("axis_name")))


def _sum(eqn: Any, states: Sequence[St], ctx: _Ctx, scatter: bool = False) -> list[St]:
    red = _axes_param(eqn)
    outs = []
    for s in states:
        pend = s.pend
        if pend is not None:
            same = red - pend.axes - s.vary
            if same:
                raise _fail(
                    ctx,
                    eqn,
                    pend,
                    f"also sums over {_axes_text(same)}, over which the value does not vary "
                    "(it is the same on every device), so that sum multiplies it by the axis "
                    "size; the value is",
                    f"Sum only over {_axes_arg(pend.axes)!r} (and axes the value is split or "
                    "varies over)",
                )
            left = pend.axes - red
            pend = Pend(left, pend.origin) if left else None
        vary = (s.vary | red) if scatter else (s.vary - red)
        outs.append(St(pend, s.zero, vary))
    return outs


def _psum_scatter(eqn: Any, states: Sequence[St], ctx: _Ctx) -> list[St]:
    return _sum(eqn, states, ctx, scatter=True)


def _moves(invariant: bool) -> Callable[[Any, Sequence[St], _Ctx], list[St]]:
    """all_gather (result the same across its axes), all_to_all, ppermute (varying)."""

    def rule(eqn: Any, states: Sequence[St], ctx: _Ctx) -> list[St]:
        axes = _axes_param(eqn)
        outs = []
        for s in states:
            if s.pend is not None and s.pend.axes & axes:
                raise _fail(
                    ctx,
                    eqn,
                    s.pend,
                    f"moves data across the devices of {_axes_text(s.pend.axes & axes)}, the "
                    "axes it still owes a sum over, of",
                    "A partial sum over an axis cannot also be split or moved over it. "
                    "Reduce it first (psum_scatter reduces and splits in one op)",
                )
            outs.append(St(s.pend, s.zero, (s.vary - axes) if invariant else (s.vary | axes)))
        return outs

    return rule


def _choose(eqn: Any, states: Sequence[St], ctx: _Ctx) -> list[St]:
    pend = _first_pending(states)
    if pend is not None:
        raise _fail(
            ctx,
            eqn,
            pend,
            "takes the max/min across devices of",
            "The max of partial sums is not the max of the sums. " + _reduce_hint(pend),
        )
    axes = _axes_param(eqn)
    return [St(None, False, s.vary - axes) for s in states]


def _axis_index(eqn: Any, states: Sequence[St], ctx: _Ctx) -> list[St]:
    return [St(None, False, _axes_param(eqn))]


# -- shardlib's own notes ----------------------------------------------------------------------


def _note(eqn: Any, states: Sequence[St], ctx: _Ctx) -> list[St]:
    n: Note = eqn.params["note"]
    s = states[0]
    if n.kind == "mark":
        axes = frozenset(n.axes) | (s.pend.axes if s.pend else frozenset())
        return [St(Pend(axes, n.origin), False, s.vary)]
    if n.kind == "clear":
        return [St(None, s.zero, s.vary)]
    if n.kind == "relink":
        return [St(states[1].pend, s.zero, s.vary | states[1].vary)]
    if n.kind == "expect":
        actual = s.pend.axes if s.pend else frozenset()
        if set(n.axes) != set(actual):
            raise _declared_mismatch(ctx, n, s.pend)
        return [s]
    if n.kind == "sum":
        owed = s.pend.axes if s.pend else frozenset()
        same = [a for a in n.axes if a not in owed and a not in s.vary]
        if same and s.pend is None:
            raise _invariant_sum(ctx, eqn, n, same)
        return [s]
    raise AssertionError(f"unknown note kind {n.kind!r}")  # pragma: no cover - internal


def _declared_mismatch(ctx: _Ctx, n: Note, pend: Pend | None) -> SpecError:
    declared = tuple(n.axes)
    clause = str(ShapeSpec((), declared))
    if pend is not None:
        axes = tuple(sorted(pend.axes))
        actual = f"it is pending over {', '.join(map(repr, axes))} ({str(ShapeSpec((), axes))})"
        if not n.why:
            actual += f", made by {pend.origin}"
        fix = f"write {str(ShapeSpec((), axes))!r}, or leave the clause out to have it inferred"
    else:
        actual = "it is not a partial sum (nothing is pending)"
        fix = f"remove {clause!r}"
    return SpecError(
        f"in {ctx.fname}(): {n.op}: the {n.role} is declared pending over "
        f"{', '.join(map(repr, declared))} ({clause}) but {actual}"
        + (f": {n.why}" if n.why else ""),
        n.text,
        n.pos,
        n.width,
        hint=fix,
    )


def _invariant_sum(ctx: _Ctx, eqn: Any, n: Note, same: list[str]) -> ValueError:
    effect = "return it unchanged" if n.op == "pmean" else "multiply it by the axis size"
    return ValueError(
        f"in {ctx.fname}(): {n.op}({n.text!r}){_where(eqn, ctx)}: the input is the same on every "
        f"device of mesh axis {'/'.join(same)!r} (it does not vary over it), so {n.op} would "
        f"{effect}. If it is a gradient taken inside the body with respect to a replicated "
        "value, JAX has already summed it over that axis: drop the reduction (or take the "
        "gradient of jax.lax.pcast(w, axis, to='varying') to get per-device parts). If you "
        "really want size x value, multiply by shardops.axis_size(axis)"
    )


# -- control flow and calls ----------------------------------------------------------------------


def _call(key: str) -> Callable[[Any, Sequence[St], _Ctx], list[St]]:
    def rule(eqn: Any, states: Sequence[St], ctx: _Ctx) -> list[St]:
        jaxpr, consts = _sub(eqn.params[key])
        return _run(jaxpr, consts, states[len(states) - len(jaxpr.invars) :], ctx.inside(eqn))

    return rule


def _custom_vjp(eqn: Any, states: Sequence[St], ctx: _Ctx) -> list[St]:
    p = eqn.params
    key = "call_jaxpr" if "call_jaxpr" in p else "fun_jaxpr"
    return _call(key)(eqn, states, ctx)


def _join(eqn: Any, ctx: _Ctx, a: St, b: St, what: str) -> St:
    vary = a.vary | b.vary
    if a.zero:
        return St(b.pend, b.zero, vary)
    if b.zero:
        return St(a.pend, False, vary)
    if a.pend is None and b.pend is None:
        return St(None, False, vary)
    pend = a.pend or b.pend
    assert pend is not None
    if a.pend is None or b.pend is None or a.pend.axes != b.pend.axes:
        raise _fail(
            ctx,
            eqn,
            pend,
            f"has a {what} that is not the same kind of value on every path: on one it is",
            "A loop carry or branch result must owe the same reduction on every path (start "
            "the carry as jnp.zeros to accumulate partial sums), or be reduced on every path",
        )
    return St(pend, False, vary)


def _scan(eqn: Any, states: Sequence[St], ctx: _Ctx) -> list[St]:
    p = eqn.params
    nc, nk = p["num_consts"], p["num_carry"]
    jaxpr, consts = _sub(p["jaxpr"])
    const_s, carry, xs = list(states[:nc]), list(states[nc : nc + nk]), list(states[nc + nk :])
    outs: list[St] = []
    for _ in range(8):
        outs = _run(jaxpr, consts, const_s + carry + xs, ctx.inside(eqn))
        new = [_join(eqn, ctx, c, o, "loop carry") for c, o in zip(carry, outs[:nk], strict=True)]
        if new == carry:
            break
        carry = new
    return carry + outs[nk:]


def _while(eqn: Any, states: Sequence[St], ctx: _Ctx) -> list[St]:
    p = eqn.params
    cn, bn = p["cond_nconsts"], p["body_nconsts"]
    cj, cc = _sub(p["cond_jaxpr"])
    bj, bc = _sub(p["body_jaxpr"])
    cond_s, body_s, carry = list(states[:cn]), list(states[cn : cn + bn]), list(states[cn + bn :])
    for _ in range(8):
        _run(cj, cc, cond_s + carry, ctx.inside(eqn))
        outs = _run(bj, bc, body_s + carry, ctx.inside(eqn))
        new = [_join(eqn, ctx, c, o, "loop carry") for c, o in zip(carry, outs, strict=True)]
        if new == carry:
            break
        carry = new
    return carry


def _cond(eqn: Any, states: Sequence[St], ctx: _Ctx) -> list[St]:
    index, ops = states[0], list(states[1:])
    for s in ops:
        if s.pend is not None:
            _check_static_operands(eqn, s, [index], ctx)
    result: list[St] | None = None
    for branch in eqn.params["branches"]:
        jaxpr, consts = _sub(branch)
        outs = _run(jaxpr, consts, ops, ctx.inside(eqn))
        if result is None:
            result = outs
        else:
            result = [
                _join(eqn, ctx, a, b, "branch result") for a, b in zip(result, outs, strict=True)
            ]
    assert result is not None
    return [St(s.pend, s.zero, s.vary | index.vary) for s in result]


# ---------------------------------------------------------------------------------------------
# The rule table
# ---------------------------------------------------------------------------------------------

_RULES: dict[str, Callable[[Any, Sequence[St], _Ctx], list[St]]] = {}

_LINEAR_UNARY = (
    "neg",
    "reshape",
    "squeeze",
    "expand_dims",
    "broadcast_in_dim",
    "transpose",
    "slice",
    "rev",
    "reduce_sum",
    "cumsum",
    "copy",
    "copy_p",
    "real",
    "imag",
    "conj",
    "reduce_precision",
    "pvary",
    "pbroadcast",
    "pcast",
    "sharding_constraint",
    "mesh_cast",
    "reshard",
    "dynamic_slice",
    "gather",
    "fft",
    "reduce_window_sum",
    "split",
    "stop_gradient",
    "name",  # jax.ad_checkpoint.checkpoint_name
)
for _name in _LINEAR_UNARY:
    _RULES[_name] = _unary
for _name in ("add", "sub", "add_any", "concatenate", "stack"):
    _RULES[_name] = _combine
for _name in ("mul", "div", "dot_general", "conv_general_dilated"):
    _RULES[_name] = _product
for _name in ("psum", "psum_invariant", "psum2"):
    _RULES[_name] = _sum
for _name in (
    "pjit",
    "jit",
    "closed_call",
    "core_call",
    "remat",
    "remat2",
    "checkpoint",
    "shard_map",
):
    _RULES[_name] = _call("jaxpr" if _name not in ("closed_call", "core_call") else "call_jaxpr")
_RULES.update(
    {
        "convert_element_type": _convert,
        "pad": _pad,
        "select_n": _select,
        "dynamic_update_slice": _update,
        "scatter-add": _update,
        "scatter_add": _update,
        "scatter": _update,
        "reduce_scatter": _psum_scatter,
        "all_gather": _moves(invariant=True),
        "all_to_all": _moves(invariant=False),
        "ppermute": _moves(invariant=False),
        "pmax": _choose,
        "pmin": _choose,
        "axis_index": _axis_index,
        "device_put": _each,
        "optimization_barrier": _each,
        "custom_jvp_call": _call("call_jaxpr"),
        "custom_vjp_call": _custom_vjp,
        "custom_vjp_call_jaxpr": _custom_vjp,
        "scan": _scan,
        "while": _while,
        "cond": _cond,
        "shardlib_pending": _note,
    }
)


# ---------------------------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------------------------


def check_body(jaxpr: Jaxpr, in_vary: Sequence[frozenset[str]], fname: str) -> None:
    """Analyse a ``shard_map`` body: raise if a partial sum is misused or returned.

    ``in_vary``: for each body input, the manual mesh axes it is split over (and so varies
    over).
    """
    ctx = _Ctx(fname)
    ins = [St(None, False, v | _vma(var)) for var, v in zip(jaxpr.invars, in_vary, strict=True)]
    outs = _run(jaxpr, (), ins, ctx)
    for k, s in enumerate(outs):
        if s.pend is not None:
            which = f"output {k} of " if len(outs) > 1 else ""
            raise PendingReductionError(
                f"in {fname}(): {which}the return value is a partial sum still owing a reduction "
                f"over {s.pend.text()} (made by {s.pend.origin}). {_reduce_hint(s.pend)}"
            )


def _vma(var: Any) -> frozenset[str]:
    return frozenset(getattr(getattr(var, "aval", None), "vma", None) or ())
