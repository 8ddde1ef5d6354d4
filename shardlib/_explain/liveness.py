"""Which equations of a traced program run: a liveness pass over the jaxpr, outputs backward.

``jax.jit(f).trace`` gives the jaxpr as traced, dead code included: under ``jax.grad`` the
forward value of a ``psum`` that only feeds the (discarded) primal output is still there. JAX
drops such equations when it lowers (the unoptimised HLO has no trace of them), so the report
must not list them. `live_equations` marks, from the program's outputs backward, every
equation whose result is used or that has an effect, and recurses into the bodies it knows how
to map, as JAX's own dead-code rules do (calls such as ``jit``, ``shard_map``, ``checkpoint``
and custom-derivative calls whose inputs and outputs are the equation's; ``scan`` carries to a
fixed point; the branches of ``cond``; ``while`` as this JAX prunes it). JAX 0.12 has a rule
for ``while`` too: a carry is kept when its result is used, when the condition reads it or
when the body needs it for a kept carry (to a fixed point), and the rest of the body goes;
JAX 0.10 has none and keeps a live while loop's condition and body whole. Which of the two
this JAX does is probed once (`shardlib._env.programs.prunes_dead_while_carries`). The body
of any other equation is kept whole.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from .._env import programs

__all__ = ["live_equations"]

# The call-like primitives whose bodies JAX prunes with the equation (its dead-code rules for
# them map the body's inputs and outputs to the equation's); any other body is kept whole.
_PRUNED_CALLS = (
    "jit",
    "pjit",
    "closed_call",
    "call",
    "core_call",
    "shard_map",
    "checkpoint",
    "remat",
    "remat_opt",
    "custom_jvp_call",
    "custom_vjp_call",
    "compute_on",
)
# Effects that do not keep an equation alive (JAX's own dead-code elimination drops equations
# whose only effects are these: a collective's use of a named axis, reading a ref). Named
# rather than imported: the classes are not public API.
_NOT_REALLY_EFFECTS = ("NamedAxisEffect", "ReadEffect", "InternalMutableArrayEffect")


def live_equations(jaxpr: Any) -> frozenset[int]:
    """``id``s of the equations of ``jaxpr`` and of its nested jaxprs that run: those whose
    results reach the program's outputs, and those with effects."""
    live: set[int] = set()
    jaxpr = programs.open_program(jaxpr)
    _mark(jaxpr, [True] * len(jaxpr.outvars), live)
    return frozenset(live)


def _has_effects(eqn: Any) -> bool:
    return any(type(e).__name__ not in _NOT_REALLY_EFFECTS for e in eqn.effects)


def _is_var(v: Any) -> bool:
    return not hasattr(v, "val")  # a Literal has a value; a Var (DropVar included) does not


def _mark(jaxpr: Any, used_outs: Sequence[bool], live: set[int]) -> list[bool]:
    """Add the live equations of ``jaxpr`` to ``live``, given which of its outputs are used;
    return which of its inputs are used."""
    used: set[Any] = {v for v, u in zip(jaxpr.outvars, used_outs, strict=True) if u and _is_var(v)}
    for eqn in reversed(jaxpr.eqns):
        outs = [_is_var(v) and v in used for v in eqn.outvars]
        effects = _has_effects(eqn)
        if not any(outs) and not effects:
            continue
        live.add(id(eqn))
        if effects:
            outs = [True] * len(outs)
        for v, u in zip(eqn.invars, _mark_eqn(eqn, outs, live), strict=True):
            if u and _is_var(v):
                used.add(v)
    return [v in used for v in jaxpr.invars]


def _mark_eqn(eqn: Any, outs: list[bool], live: set[int]) -> list[bool]:
    """Mark the bodies of a live equation ``eqn`` (``outs``: which results are used); return
    which of its inputs are used."""
    name = eqn.primitive.name
    if name == "scan":
        return _mark_scan(eqn, outs, live)
    if name == "while" and _prunes_while():
        return _mark_while(eqn, outs, live)
    if name == "cond":
        used = [True] + [False] * (len(eqn.invars) - 1)  # the branch index
        for branch in programs.cond_branches(eqn):
            inner = _mark(branch, outs, live)
            used[1:] = [a or b for a, b in zip(used[1:], inner, strict=True)]
        return used
    subs = programs.sub_programs(eqn)
    if name in _PRUNED_CALLS and len(subs) == 1 and _is_call(subs[0], eqn):
        return _mark(subs[0], outs, live)
    for sub in subs:  # JAX keeps the body whole (a while loop's, for one): all of it runs
        _keep_whole(sub, live)
    return [True] * len(eqn.invars)


def _keep_whole(jaxpr: Any, live: set[int]) -> None:
    for eqn in jaxpr.eqns:
        live.add(id(eqn))
        for sub in programs.sub_programs(eqn):
            _keep_whole(sub, live)


def _mark_scan(eqn: Any, outs: list[bool], live: set[int]) -> list[bool]:
    """A ``scan``: body inputs are consts, carry, xs; outputs carry, ys. A carry is used when
    its result is, or when the body uses it to compute a used output (to a fixed point)."""
    scan = programs.scan_parts(eqn)
    body, n_consts, n_carry = scan.body, scan.n_consts, scan.n_carry
    carry = list(outs[:n_carry])
    while True:
        used = _mark(body, carry + list(outs[n_carry:]), live)
        grown = [a or b for a, b in zip(carry, used[n_consts : n_consts + n_carry], strict=True)]
        if grown == carry:
            return used
        carry = grown


@functools.cache
def _prunes_while() -> bool:
    return programs.prunes_dead_while_carries()


def _mark_while(eqn: Any, outs: list[bool], live: set[int]) -> list[bool]:
    """A ``while``, as JAX 0.12's dead-code rule prunes it: inputs are the condition's consts,
    the body's consts, then the carries. A carry is used when its result is, when the
    condition reads it, or when the body uses it to compute a used carry (to a fixed point);
    the condition is kept for its one output, the body for the used carries."""
    loop = programs.while_parts(eqn)
    n_cond, n_body = loop.cond_nconsts, loop.body_nconsts
    cond_used = _mark(loop.cond, [True], live)
    carry = [a or b for a, b in zip(outs, cond_used[n_cond:], strict=True)]
    while True:
        body_used = _mark(loop.body, carry, live)
        grown = [a or b for a, b in zip(carry, body_used[n_body:], strict=True)]
        if grown == carry:
            return cond_used[:n_cond] + body_used[:n_body] + carry
        carry = grown


def _is_call(sub: Any, eqn: Any) -> bool:
    """``sub`` takes the equation's inputs and gives its outputs (pjit, shard_map, ...)."""
    return len(sub.invars) == len(eqn.invars) and len(sub.outvars) == len(eqn.outvars)
