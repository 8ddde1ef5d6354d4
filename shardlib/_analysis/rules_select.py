"""The partial-sum rules of the primitives that combine, select, gather, scatter and reduce.

Split from `shardlib._analysis.rules` (the table that `shardlib._analysis.walk` walks). These primitives
are linear in their data operands only under conditions: the operands combined must owe the
same reduction (or be known zero), an index, a selector or a mask must be neither a partial
sum nor different across the devices of the pending axes, a fill or initial value must be
zero (it is added once per device), and a reduction's computation must be an addition.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from jax.lax import GatherScatterMode

from .._env.programs import open_program, optional_param, param
from .facts import (
    Ctx,
    St,
    axes_text,
    check_static_operands,
    fail,
    first_pending,
    reduce_hint,
    union,
)

Rule = Callable[[Any, Sequence[St], Ctx], list[St]]

__all__ = ["SELECT_RULES", "combine"]


def combine(eqn: Any, states: Sequence[St], ctx: Ctx) -> list[St]:
    """A sum or a concatenation: every operand that is not known zero owes the same axes."""
    vary = union(states)
    live = [s for s in states if not s.zero]
    pends = [s.pend for s in live]
    pend = next((p for p in pends if p is not None), None)
    if pend is None:
        return [St(None, not live, vary) for _ in eqn.outvars]
    for p in pends:
        if p is None:
            raise fail(
                ctx,
                eqn,
                pend,
                "combines a value that is not a partial sum with",
                "Adding a reduced value to a partial sum adds it once per device of "
                f"{axes_text(pend.axes)}. Reduce first and add after, or add it on one device "
                "only: shardops.linear(lambda v: v + b * (shardops.axis_index(axis) == 0), x)",
            )
        if p.axes != pend.axes:
            raise fail(
                ctx,
                eqn,
                pend,
                f"combines a partial sum over {p.text()} (made by {p.origin}) with",
                "Both must owe the same reduction. Reduce one of them first",
            )
    return [St(pend, False, vary) for _ in eqn.outvars]


def _select(eqn: Any, states: Sequence[St], ctx: Ctx) -> list[St]:
    """select_n(which, *cases): the cases combine; the selector is a per-element choice."""
    out = combine(eqn, states[1:], ctx)
    check_static_operands(eqn, St(out[0].pend), states[:1], ctx, role="a selector")
    return [St(o.pend, o.zero, union(states)) for o in out]


def _update(eqn: Any, states: Sequence[St], ctx: Ctx) -> list[St]:
    """dynamic_update_slice (operand, update, *indices), scatter, scatter-add and scatter-sub
    (operand, indices, updates):
    the data operands combine as a sum does, the indices must be static across the pending
    axes (and never partial sums)."""
    if eqn.primitive.name == "dynamic_update_slice":
        data, idx = states[:2], states[2:]
    else:
        data, idx = [states[0], *states[2:]], states[1:2]
    out = combine(eqn, data, ctx)
    check_static_operands(eqn, St(out[0].pend), idx, ctx, role="scatter indices")
    return [St(o.pend, o.zero, union(states)) for o in out]


def _scatter_scale(eqn: Any, states: Sequence[St], ctx: Ctx) -> list[St]:
    """scatter-mul (operand, indices, updates): scaling part of a partial sum by factors that
    are the same on every device of its axes is linear."""
    x, idx, upd = states
    pend = x.pend
    check_static_operands(eqn, St(pend), [idx], ctx, role="scatter indices")
    if upd.pend is not None:
        raise fail(ctx, eqn, upd.pend, "multiplies by", reduce_hint(upd.pend))
    if pend is not None and upd.vary & pend.axes:
        raise fail(
            ctx,
            eqn,
            pend,
            "multiplies part of it by factors that differ across the devices of "
            f"{axes_text(upd.vary & pend.axes)}; the value is",
            "Each device would scale its share by a different factor. Reduce first",
        )
    return [St(pend, x.zero, union(states))]


def _fill_is_zero(eqn: Any) -> bool:
    """Whether a gather's out-of-bounds fill adds nothing per device (zero, or NaN: a NaN
    share sums to NaN, the value JAX gives the whole array there)."""
    if optional_param(eqn, "mode") != GatherScatterMode.FILL_OR_DROP:
        return True  # clip / promise-in-bounds: no fill
    fill = optional_param(eqn, "fill_value")
    if fill is None:
        return bool(np.issubdtype(np.dtype(eqn.outvars[0].aval.dtype), np.inexact))
    return bool(fill == 0 or np.isnan(fill))


def _gather(eqn: Any, states: Sequence[St], ctx: Ctx) -> list[St]:
    x, idx = states
    check_static_operands(eqn, x, [idx], ctx, role="gather indices")
    filled = not _fill_is_zero(eqn)
    if x.pend is not None and filled:
        raise fail(
            ctx,
            eqn,
            x.pend,
            f"fills out-of-bounds positions with {optional_param(eqn, 'fill_value')!r}, which would "
            "be added once per device, in",
            "Gather with fill_value=0 (or mode='clip'), or reduce first",
        )
    return [St(x.pend, x.zero and not filled, union(states))]


def _computation(eqn: Any) -> list[str]:
    return [e.primitive.name for e in open_program(param(eqn, "jaxpr")).eqns]


def _reduce(eqn: Any, states: Sequence[St], ctx: Ctx) -> list[St]:
    """reduce / reduce_window with a computation of the user's: (*operands, *inits)."""
    n = len(states) // 2
    ops, inits = states[:n], states[n:]
    pend = first_pending(ops) or first_pending(inits)
    if pend is None:
        return [St(None, False, union(states)) for _ in eqn.outvars]
    comp = _computation(eqn)
    if comp != ["add"]:
        what = ", ".join(f"`{c}`" for c in comp) or "nothing"
        raise fail(
            ctx,
            eqn,
            pend,
            f"reduces with a computation ({what}) that is not an addition, over",
            "Only a sum of shares is a share of the sum. " + reduce_hint(pend),
        )
    if not all(s.zero for s in inits):
        raise fail(
            ctx,
            eqn,
            pend,
            "sums with an initial value other than zero (added once per device) over",
            "Start the sum at 0, and add the initial value after reducing",
        )
    out = combine(eqn, ops, ctx)
    return [St(out[0].pend, False, union(states)) for _ in eqn.outvars]


SELECT_RULES: dict[str, Rule] = {
    "select_n": _select,
    "dynamic_update_slice": _update,
    "scatter-add": _update,
    "scatter_add": _update,
    "scatter-sub": _update,
    "scatter": _update,
    "scatter-mul": _scatter_scale,
    "scatter_mul": _scatter_scale,
    "gather": _gather,
    "reduce": _reduce,
    "reduce_window": _reduce,
}
