"""The rules of issue 22 switched off, one family at a time (the random suite's mutation check).

Each ``off_FAMILY(monkeypatch)`` puts back what the analysis did before the rule that the
family exercises (`tests._pending_random_families`): the family's generated programs must then
include an accepted wrong answer. Only the rule tables and module globals of shardlib are
patched (``monkeypatch`` restores them); no shardlib file is edited. One exception:
``off_branches`` also replaces the suite's ``run_case`` by one that only traces, since a
program with a collective-permute in a per-device branch may deadlock XLA when run.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import pytest
from jax.interpreters import ad

import shardlib._analysis.rules as rules
import shardlib._analysis.walk as dataflow
from shardlib._analysis.facts import Ctx, St, check_static_operands, union
from shardlib._analysis.notes import Note, pending_p
from shardlib._analysis.rules_select import combine
from shardlib._env import programs

Patch = pytest.MonkeyPatch


def _old_cond(eqn: Any, states: Sequence[St], ctx: Ctx) -> list[St]:
    """``cond`` without the per-device branch check (and without the pending-index one)."""
    index, ops = states[0], list(states[1:])
    for s in ops:
        if s.pend is not None:
            check_static_operands(eqn, s, [index], ctx)
    result: list[St] | None = None
    for jaxpr in programs.cond_branches(eqn):
        outs = dataflow._run(jaxpr, ops, ctx.inside(eqn))
        result = (
            outs
            if result is None
            else [
                dataflow._join(eqn, ctx, a, b, "branch result")
                for a, b in zip(result, outs, strict=True)
            ]
        )
    assert result is not None
    return [St(s.pend, s.zero, s.vary | index.vary) for s in result]


def _old_while(eqn: Any, states: Sequence[St], ctx: Ctx) -> list[St]:
    """``while`` without the per-device trip count check."""
    parts = programs.while_parts(eqn)
    cn, bn, cj, bj = parts.cond_nconsts, parts.body_nconsts, parts.cond, parts.body
    cond_s, body_s, carry = list(states[:cn]), list(states[cn : cn + bn]), list(states[cn + bn :])
    while True:
        dataflow._run(cj, cond_s + carry, ctx.inside(eqn))
        outs = dataflow._run(bj, body_s + carry, ctx.inside(eqn))
        new = [
            dataflow._join(eqn, ctx, c, o, "loop carry") for c, o in zip(carry, outs, strict=True)
        ]
        if new == carry:
            return carry
        carry = new


def _capped_scan(eqn: Any, states: Sequence[St], ctx: Ctx) -> list[St]:
    """``scan`` iterated at most 8 rounds (a carry chain deeper than that is not followed)."""
    parts = programs.scan_parts(eqn)
    nc, nk, jaxpr = parts.n_consts, parts.n_carry, parts.body
    const_s, carry, xs = list(states[:nc]), list(states[nc : nc + nk]), list(states[nc + nk :])
    outs: list[St] = []
    for _ in range(8):
        outs = dataflow._run(jaxpr, const_s + carry + xs, ctx.inside(eqn))
        new = [
            dataflow._join(eqn, ctx, c, o, "loop carry")
            for c, o in zip(carry, outs[:nk], strict=True)
        ]
        if new == carry:
            break
        carry = new
    return carry + outs[nk:]


def _untouched_tangent(primals: Any, tangents: Any, *, note: Note) -> tuple[Any, Any]:
    return pending_p.bind(*primals, note=note), tangents[0]


def _old_select(eqn: Any, states: Sequence[St], ctx: Ctx) -> list[St]:
    """``select_n`` checking its selector only when the cases are partial sums."""
    out = combine(eqn, states[1:], ctx)
    if out[0].pend is not None:
        check_static_operands(eqn, St(out[0].pend), states[:1], ctx)
    return [St(o.pend, o.zero, union(states)) for o in out]


def _old_scatter(eqn: Any, states: Sequence[St], ctx: Ctx) -> list[St]:
    """``scatter-add`` checking its indices only when the data are partial sums."""
    out = combine(eqn, [states[0], *states[2:]], ctx)
    if out[0].pend is not None:
        check_static_operands(eqn, St(out[0].pend), states[1:2], ctx)
    return [St(o.pend, o.zero, union(states)) for o in out]


def _int_division_linear(old: Callable) -> Callable:
    def rule(eqn: Any, states: Sequence[St], ctx: Ctx) -> list[St]:
        x, c = states
        integer = not jnp.issubdtype(eqn.outvars[0].aval.dtype, jnp.inexact)
        mine = eqn.primitive.name == "div" and integer and c.pend is None
        if mine and x.pend is not None and not (c.vary & x.pend.axes):
            return [St(x.pend, False, union(states))]
        return old(eqn, states, ctx)

    return rule


def _any_int_cast(old: Any, new: Any) -> bool:
    """Before: casts between integer types of any widths counted as linear."""
    if jnp.issubdtype(new, jnp.inexact):
        return not jnp.issubdtype(old, jnp.bool_)
    return bool(jnp.issubdtype(new, jnp.integer) and jnp.issubdtype(old, jnp.integer))


def _any_fold(eqn: Any, states: Sequence[St], ctx: Ctx) -> list[St]:
    """``reduce`` / ``reduce_window`` linear whatever the computation and initial value."""
    out = combine(eqn, states[: len(states) // 2], ctx)
    return [St(out[0].pend, False, union(states)) for _ in eqn.outvars]


def _same_factors(old: Callable) -> Callable:
    """``scatter-mul`` without the check that its factors are the same on every device."""

    def rule(eqn: Any, states: Sequence[St], ctx: Ctx) -> list[St]:
        x, idx, upd = states
        return old(eqn, [x, idx, St(upd.pend, upd.zero, frozenset())], ctx)

    return rule


def _set(mp: Patch, names: Sequence[str], rule: Callable) -> None:
    for n in names:
        mp.setitem(dataflow._RULES, n, rule)


def off_control(mp: Patch) -> None:
    _set(mp, ["cond"], _old_cond)
    _set(mp, ["while"], _old_while)


def off_chain(mp: Patch) -> None:
    _set(mp, ["scan"], _capped_scan)


def off_jvp(mp: Patch) -> None:
    mp.setitem(ad.primitive_jvps, pending_p, _untouched_tangent)


def off_index(mp: Patch) -> None:
    _set(mp, ["select_n"], _old_select)
    _set(mp, ["scatter-add", "scatter_add"], _old_scatter)


def off_int(mp: Patch) -> None:
    _set(mp, ["div"], _int_division_linear(dataflow._RULES["div"]))
    mp.setattr(rules, "_linear_cast", _any_int_cast)


def off_fold(mp: Patch) -> None:
    _set(mp, ["reduce", "reduce_window"], _any_fold)
    _set(mp, ["gather"], rules._unary)


def off_lookalike(mp: Patch) -> None:
    _set(mp, ["scatter-mul", "scatter_mul"], _same_factors(dataflow._RULES["scatter-mul"]))


def off_layout(mp: Patch) -> None:
    mp.setattr(rules, "_check_same", lambda eqn, s, n, ctx: None)


def off_branches(mp: Patch) -> None:
    """The per-device ``cond`` rule off. A program it refuses may deadlock XLA when run (the
    runtime then aborts the process), so the suite's `run_case` is replaced, for this check
    only, by one that traces each program and never runs it: an accepted program the oracle
    calls wrong is the accepted wrong answer the check looks for."""
    mp.setattr(dataflow, "_check_branch_collectives", lambda eqn, varying, ctx: None)
    for name in ("tests.test_pending_random", "test_pending_random"):
        module = sys.modules.get(name)
        if module is not None:
            mp.setattr(module, "run_case", _trace_only(module))


def _trace_only(suite: Any) -> Callable:
    def run_case(pg: Any, check_vma: bool) -> Any:
        truth, why = suite.verdict(pg)
        fn = suite.typed_shard_map(suite.body_function(pg), check_vma=check_vma)
        m = pg.mesh
        args = suite.placed_inputs(pg)
        with jax.set_mesh(m.jmesh):
            try:
                jax.jit(fn).trace(*args)  # traced only: never run
            except Exception as e:
                return suite.Outcome("refused", f"{type(e).__name__}: {e}")
        if truth == "wrong":
            return suite.Outcome("accepted_wrong", why + " (traced, not run)")
        return suite.Outcome("accepted_not_run", truth)

    return run_case


OFF: dict[str, Callable[[Patch], None]] = {
    "control": off_control,
    "chain": off_chain,
    "jvp": off_jvp,
    "index": off_index,
    "int": off_int,
    "fold": off_fold,
    "lookalike": off_lookalike,
    "layout": off_layout,
    "branches": off_branches,
}
