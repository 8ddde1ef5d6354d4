"""Follow partial sums through a traced ``shard_map`` body; refuse any that go astray.

A value noted ``mark`` (see `shardlib._analysis.notes`) is a partial sum over some mesh axes. This
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

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from jax.extend.core import Literal

from .._env import collectives, programs
from .._env.context import aval_varying
from .._env.programs import Program
from .facts import (
    PLAIN,
    Ctx,
    Pend,
    St,
    axes_text,
    branch_collective_error,
    check_static_operands,
    fail,
    first_pending,
    plain_outs,
    reduce_hint,
)
from .nonlinear import NOT_LINEAR
from .notes import PendingReductionError
from .rules import RULES, Rule

__all__ = ["check_body", "const_state", "primitives_with_rules"]


# ---------------------------------------------------------------------------------------------
# The walk
# ---------------------------------------------------------------------------------------------


def const_state(value: Any) -> St:
    """A constant's facts: known zero when every element is 0 (host ``np.zeros`` included)."""
    try:
        zero = bool(np.all(np.asarray(value) == 0))
    except Exception:  # pragma: no cover - exotic constant (a key, a tracer)
        zero = False
    return St(zero=zero)


def _literal_state(v: Any) -> St:
    return const_state(v.val)


def _run(jaxpr: Program, ins: Sequence[St], ctx: Ctx) -> list[St]:
    env: dict[Any, St] = {}
    for v, c in zip(jaxpr.constvars, jaxpr.consts, strict=False):
        env[v] = const_state(c)
    for v, s in zip(jaxpr.invars, ins, strict=True):
        env[v] = s

    def read(v: Any) -> St:
        return _literal_state(v) if isinstance(v, Literal) else env.get(v, PLAIN)

    for eqn in jaxpr.eqns:
        states = [read(v) for v in eqn.invars]
        outs = _RULES.get(eqn.primitive.name, _unknown)(eqn, states, ctx)
        for v, s in zip(eqn.outvars, outs, strict=True):
            env[v] = s
    return [read(v) for v in jaxpr.outvars]


def _unknown(eqn: Any, states: Sequence[St], ctx: Ctx) -> list[St]:
    """A primitive without a rule: a call-like one (its body takes the operands and gives
    the results) is followed into; any other body is checked on its own; a pending operand
    is refused."""
    subs = programs.sub_programs(eqn)
    for jaxpr in subs:
        call_like = len(jaxpr.invars) == len(states) and len(jaxpr.outvars) == len(eqn.outvars)
        if len(subs) == 1 and call_like:
            return _run(jaxpr, states, ctx.inside(eqn))
        alone = _run(jaxpr, [PLAIN] * len(jaxpr.invars), ctx.inside(eqn))
        for k, s in enumerate(alone):
            if s.pend is not None:
                raise fail(
                    ctx,
                    eqn,
                    s.pend,
                    f"(a transformation shardlib does not know) gives out, as result {k},",
                    reduce_hint(s.pend),
                )
    return _not_linear(eqn, states, ctx)


def _not_linear(eqn: Any, states: Sequence[St], ctx: Ctx) -> list[St]:
    """A primitive known not to be linear (`shardlib._analysis.nonlinear`), or one without a
    rule: a pending operand is refused; the results of others are plain values."""
    pend = first_pending(states)
    if pend is not None:
        raise fail(
            ctx,
            eqn,
            pend,
            "is not linear (or not known to be), and its input is",
            reduce_hint(pend),
        )
    return plain_outs(eqn, states)


# -- control flow and calls ----------------------------------------------------------------------


def _call(eqn: Any, states: Sequence[St], ctx: Ctx) -> list[St]:
    """A call (jit, checkpoint, shard_map, custom_jvp/vjp...): its body takes the equation's
    trailing operands and gives its results."""
    jaxpr = programs.call_body(eqn)
    return _run(jaxpr, states[len(states) - len(jaxpr.invars) :], ctx.inside(eqn))


def _join(eqn: Any, ctx: Ctx, a: St, b: St, what: str) -> St:
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
        raise fail(
            ctx,
            eqn,
            pend,
            f"has a {what} that is not the same kind of value on every path: on one it is",
            "A loop carry or branch result must owe the same reduction on every path (start "
            "the carry as jnp.zeros to accumulate partial sums), or be reduced on every path",
        )
    return St(pend, False, vary)


def _scan(eqn: Any, states: Sequence[St], ctx: Ctx) -> list[St]:
    """Iterate the body to a fixpoint: each round can only add pending axes, drop "known
    zero" or add varying axes to a carry, so it ends (no round cap that could stop early)."""
    parts = programs.scan_parts(eqn)
    nc, nk, jaxpr = parts.n_consts, parts.n_carry, parts.body
    const_s, carry, xs = list(states[:nc]), list(states[nc : nc + nk]), list(states[nc + nk :])
    while True:
        outs = _run(jaxpr, const_s + carry + xs, ctx.rounds(eqn))
        new = [_join(eqn, ctx, c, o, "loop carry") for c, o in zip(carry, outs[:nk], strict=True)]
        if new == carry:
            break
        carry = new
    outs = _run(jaxpr, const_s + carry + xs, ctx.inside(eqn))  # the checking round
    return carry + outs[nk:]


def _while(eqn: Any, states: Sequence[St], ctx: Ctx) -> list[St]:
    """As `_scan`; and when the predicate (so the trip count) differs across devices, so do
    the carries the body changes, and none of them may be a partial sum over those axes."""
    parts = programs.while_parts(eqn)
    cn, bn, cj, bj = parts.cond_nconsts, parts.body_nconsts, parts.cond, parts.body
    cond_s, body_s, carry = list(states[:cn]), list(states[cn : cn + bn]), list(states[cn + bn :])
    changed = [o is not i for o, i in zip(bj.outvars, bj.invars[bn:], strict=True)]
    while True:
        pred = _run(cj, cond_s + carry, ctx.rounds(eqn))[0]
        outs = _run(bj, body_s + carry, ctx.rounds(eqn))
        new = [_join(eqn, ctx, c, o, "loop carry") for c, o in zip(carry, outs, strict=True)]
        new = [
            St(s.pend, s.zero, s.vary | pred.vary) if ch else s
            for s, ch in zip(new, changed, strict=True)
        ]
        if new == carry:
            break
        carry = new
    _run(cj, cond_s + carry, ctx.inside(eqn))  # the checking round
    _run(bj, body_s + carry, ctx.inside(eqn))
    if pred.vary:  # a per-device trip count: the body's collectives run unevenly
        _check_branch_collectives(eqn, pred.vary, ctx, (cj, bj))
    for s, ch in zip(carry, changed, strict=True):
        if ch and s.pend is not None and s.pend.axes & pred.vary:
            raise _per_device(eqn, ctx, s, pred, "runs a number of iterations")
    return carry


def _per_device(eqn: Any, ctx: Ctx, s: St, chooser: St, what: str) -> Exception:
    assert s.pend is not None
    axes = s.pend.axes & chooser.vary
    return fail(
        ctx,
        eqn,
        s.pend,
        f"{what} that differs across the devices of {axes_text(axes)} (its predicate, index "
        "or trip count depends on axis_index or on a value split over it), and so makes, "
        "differently on each device,",
        "Each device would add a different multiple of its share: a per-device mask in "
        "disguise. Reduce inside the branch or loop, or make its predicate the same on every "
        "device of those axes",
    )


def _cond(eqn: Any, states: Sequence[St], ctx: Ctx) -> list[St]:
    index, ops = states[0], list(states[1:])
    if index.pend is not None:
        raise fail(ctx, eqn, index.pend, "uses as a branch index", reduce_hint(index.pend))
    if index.vary:
        _check_branch_collectives(eqn, index.vary, ctx)
    for s in ops:
        if s.pend is not None:
            check_static_operands(eqn, s, [index], ctx)
    result: list[St] | None = None
    for jaxpr in programs.cond_branches(eqn):
        outs = _run(jaxpr, ops, ctx.inside(eqn))
        if result is None:
            result = outs
        else:
            result = [
                _join(eqn, ctx, a, b, "branch result") for a, b in zip(result, outs, strict=True)
            ]
    assert result is not None
    for s in result:
        if s.pend is not None and s.pend.axes & index.vary:
            raise _per_device(eqn, ctx, s, index, "takes a branch")
    return [St(s.pend, s.zero, s.vary | index.vary) for s in result]


def _check_branch_collectives(
    eqn: Any, varying: frozenset[str], ctx: Ctx, bodies: Sequence[Any] | None = None
) -> None:
    """A ``cond``/``switch`` whose index differs across the devices of ``varying`` is real
    per-device control flow: only some devices run a branch. A collective in a branch (nested
    programs included) is right only when it has replica groups (`collectives.GROUPED`) over
    none of those axes, so that each of its groups lies inside devices that take the same
    branch; anything else is refused (see `branch_collective_error`). The same holds for the
    ``bodies`` (predicate and body) of a ``while_loop`` whose trip count differs so."""
    inside = ctx.inside(eqn)
    for branch in programs.cond_branches(eqn) if bodies is None else bodies:
        for c in collectives.collectives(branch):
            axes = frozenset(collectives.axis_names(c))
            if c.primitive.name in collectives.GROUPED and not axes & varying:
                continue
            raise branch_collective_error(inside, c, axes, varying, loop=bodies is not None)


# ---------------------------------------------------------------------------------------------
# The rule table: the computing primitives' rules, then calls and control flow
# ---------------------------------------------------------------------------------------------

_RULES: dict[str, Rule] = {
    **dict.fromkeys(NOT_LINEAR, _not_linear),
    **RULES,
    **dict.fromkeys(programs.CALL_PRIMITIVES, _call),
    "scan": _scan,
    "while": _while,
    "cond": _cond,
}


def primitives_with_rules() -> frozenset[str]:
    """The names of the primitives the walk has a rule for (linear, structural, a collective,
    a call or a loop, or known not to be linear); any other primitive is refused on a partial
    sum as one the analysis does not know (``tests/test_primitive_coverage.py`` lists them)."""
    return frozenset(_RULES)


# ---------------------------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------------------------


def check_body(
    body: Any,
    in_vary: Sequence[frozenset[str]],
    fname: str,
    in_zero: Sequence[bool] | None = None,
    out_specs: Sequence[str] = (),
    in_unreduced: Sequence[frozenset[str]] = (),
    out_unreduced: Sequence[frozenset[str]] = (),
    axis_sizes: Mapping[str, int] | None = None,
) -> None:
    """Analyse a ``shard_map`` body: raise if a partial sum is misused or returned.

    ``in_vary``: for each body input, the manual mesh axes it is split over (and so varies
    over); ``in_zero``: which inputs are known to be all zeros (constants the body closed
    over, such as a host ``np.zeros``); ``out_specs``: the annotated spec of each output,
    for the reduction a returned partial sum needs. ``in_unreduced`` / ``out_unreduced``: the
    axes each input / output is typed unreduced over (JAX's ``unreduced`` field, shardlib's
    ``{+t}``): such an input is a partial sum over them, and such an output must be one,
    over exactly them (the one legal way to return a partial sum). ``axis_sizes``: the
    sizes of the mesh axes, in mesh order (a ``ppermute`` of a partial sum over an axis
    whose size is not given is refused: shardlib cannot prove it is a full permutation).
    """
    ctx = Ctx(fname, sizes=axis_sizes)
    jaxpr = programs.open_program(body)
    zeros = in_zero if in_zero is not None else [False] * len(in_vary)
    unreduced = list(in_unreduced) + [frozenset()] * (len(in_vary) - len(in_unreduced))
    ins = [
        St(Pend(u, f"argument {k} of {fname}(), typed unreduced") if u else None, z, v | _vma(var))
        for k, (var, v, z, u) in enumerate(
            zip(jaxpr.invars, in_vary, zeros, unreduced, strict=True)
        )
    ]
    outs = _run(jaxpr, ins, ctx)
    for k, s in enumerate(outs):
        which = f"output {k} of " if len(outs) > 1 else ""
        declared = out_unreduced[k] if k < len(out_unreduced) else frozenset()
        if declared:
            _check_unreduced_output(s, declared, f"in {fname}(): {which}the return value")
        elif s.pend is not None:
            raise PendingReductionError(
                f"in {fname}(): {which}the return value is a partial sum still owing a reduction "
                f"over {s.pend.text()} (made by {s.pend.origin}). "
                + reduce_hint(s.pend, out_specs[k] if k < len(out_specs) else None)
            )


def _check_unreduced_output(s: St, declared: frozenset[str], what: str) -> None:
    """An output typed unreduced over ``declared`` must be a partial sum over exactly those
    axes: a reduced value summed again would be multiplied by the axes' size."""
    clause = "{" + "".join("+" + a for a in sorted(declared)) + "}"
    if s.pend is None:
        raise PendingReductionError(
            f"{what} is annotated unreduced over {axes_text(declared)} ('{clause}'), but it is "
            "not a partial sum over them (or shardlib cannot tell that it is): whoever sums it "
            "would add the same value once per device. Make it with a shardops op that leaves "
            "a partial sum (shardops.einsum_unreduced, or an op whose spec ends in "
            f"'{clause}'), or remove '{clause}' from the annotation"
        )
    if s.pend.axes != declared:
        raise PendingReductionError(
            f"{what} is annotated unreduced over {axes_text(declared)} ('{clause}'), but it is a "
            f"partial sum over {s.pend.text()} (made by {s.pend.origin}). "
            + reduce_hint(s.pend, None)
            + f", or annotate it '{{{''.join('+' + a for a in sorted(s.pend.axes))}}}'"
        )


def _vma(var: Any) -> frozenset[str]:
    return aval_varying(getattr(var, "aval", None)) or frozenset()
