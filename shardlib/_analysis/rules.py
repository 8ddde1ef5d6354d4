"""The partial-sum rules of the primitives that compute (`shardlib._analysis.walk` walks).

Each rule takes an equation and the facts (`shardlib._analysis.facts.St`) about its operands, returns
the facts about its results, and raises when a partial sum goes where it cannot: a partial
sum may flow only through linear operations and be reduced over its axes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from .._env.programs import optional_param, param
from .facts import (
    PLAIN,
    Ctx,
    Pend,
    St,
    axes_arg,
    axes_text,
    check_static_operands,
    declared_mismatch,
    fail,
    first_pending,
    invariant_sum,
    reduce_hint,
    same_varies,
    union,
)
from .notes import Note
from .rules_permute import MOVE_FIX_PERMUTE, ppermute_rule
from .rules_select import SELECT_RULES, combine

Rule = Callable[[Any, Sequence[St], Ctx], list[St]]

# -- linear, one operand at a time -------------------------------------------------------------


def _unary(eqn: Any, states: Sequence[St], ctx: Ctx) -> list[St]:
    """Linear in its first operand; other operands (indices, sizes) must not be pending and
    must be the same on every device of the pending axes."""
    first = states[0]
    check_static_operands(eqn, first, states[1:], ctx)
    return [St(first.pend, first.zero, union(states)) for _ in eqn.outvars]


def _each(eqn: Any, states: Sequence[St], ctx: Ctx) -> list[St]:
    """Each operand passes to the output at its position (device_put, optimization_barrier)."""
    return list(states)


def _convert(eqn: Any, states: Sequence[St], ctx: Ctx) -> list[St]:
    s = states[0]
    if s.pend is not None:
        new = np.dtype(param(eqn, "new_dtype"))
        old = np.dtype(eqn.invars[0].aval.dtype)
        if not _linear_cast(old, new):
            raise fail(
                ctx,
                eqn,
                s.pend,
                f"casts {old.name} to {new.name}, which is not linear (it rounds or "
                "truncates each share), on",
                reduce_hint(s.pend),
            )
    return [St(s.pend, s.zero, s.vary)]


def _linear_cast(old: np.dtype, new: np.dtype) -> bool:
    """Casts to a float type (rounding aside) and to an integer type at least as wide are
    linear; casts to an integer from a float, to a narrower integer (it wraps each share, and
    the shares widened again no longer add up), and to or from bool, are not."""
    if jnp.issubdtype(new, jnp.inexact):
        return not jnp.issubdtype(old, jnp.bool_)
    if jnp.issubdtype(new, jnp.integer):
        return jnp.issubdtype(old, jnp.integer) and new.itemsize >= old.itemsize
    return False


def _pad(eqn: Any, states: Sequence[St], ctx: Ctx) -> list[St]:
    x, value = states
    if x.pend is not None and not value.zero:
        raise fail(
            ctx,
            eqn,
            x.pend,
            "pads with a value other than zero",
            "Padding with c adds c once per device. Pad with zeros, or reduce first",
        )
    return combine(eqn, [x, value], ctx)


# -- products: linear in one operand when the other is the same across its pending axes ----------


def _product(eqn: Any, states: Sequence[St], ctx: Ctx) -> list[St]:
    name = eqn.primitive.name
    vary = union(states)
    if name == "mul" and any(s.zero for s in states):
        # Zero on every device: a partial sum of zeros, still owing what it owed.
        return [St(first_pending(states), True, vary)]
    pending = [i for i, s in enumerate(states) if s.pend is not None]
    if not pending:
        return [St(None, False, vary)]
    i = pending[0]
    pend = states[i].pend
    assert pend is not None
    if name == "div" and not jnp.issubdtype(eqn.outvars[0].aval.dtype, jnp.inexact):
        raise fail(
            ctx,
            eqn,
            pend,
            "divides with integer division (it rounds each share, so the shares no longer add "
            "up to the quotient of the sum)",
            reduce_hint(pend),
        )
    if len(pending) > 1 or (name == "div" and i == 1):
        why = "divides by" if name == "div" and i == 1 else "multiplies two partial sums, one is"
        raise fail(
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
        raise fail(
            ctx,
            eqn,
            pend,
            f"multiplies by a value that differs across the devices of {axes_text(clash)} "
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
    axes = optional_param(eqn, "axes")
    return _names(axes if axes is not None else optional_param(eqn, "axis_name"))


def _sum(eqn: Any, states: Sequence[St], ctx: Ctx, scatter: bool = False) -> list[St]:
    red = _axes_param(eqn)
    outs = []
    for s in states:
        pend = s.pend
        if pend is not None:
            same = red - pend.axes - s.vary
            if same and not ctx.trial:
                raise fail(
                    ctx,
                    eqn,
                    pend,
                    f"also sums over {axes_text(same)}, over which the value does not vary "
                    "(it is the same on every device), so that sum multiplies it by the axis "
                    "size; the value is",
                    f"Sum only over {axes_arg(pend.axes)!r} (and axes the value is split or "
                    "varies over)",
                )
            left = pend.axes - red
            pend = Pend(left, pend.origin) if left else None
        vary = (s.vary | red) if scatter else (s.vary - red)
        outs.append(St(pend, s.zero, vary))
    return outs


def _psum_scatter(eqn: Any, states: Sequence[St], ctx: Ctx) -> list[St]:
    return _sum(eqn, states, ctx, scatter=True)


_MOVE_FIX = {
    "all_gather": "Reduce it first (psum_scatter reduces and splits in one op)",
    "ppermute": MOVE_FIX_PERMUTE,
}


def _moves(invariant: bool) -> Rule:
    """all_gather (result the same across its axes), all_to_all (varying). A ``ppermute``
    has its own rule (`shardlib._analysis.rules_permute`): a full cycle keeps a partial sum."""

    def rule(eqn: Any, states: Sequence[St], ctx: Ctx) -> list[St]:
        axes = _axes_param(eqn)
        outs = []
        for s in states:
            if s.pend is not None and s.pend.axes & axes:
                raise fail(
                    ctx,
                    eqn,
                    s.pend,
                    f"moves data across the devices of {axes_text(s.pend.axes & axes)}, the "
                    "axes it still owes a sum over, of",
                    "A partial sum over an axis cannot also be split or moved over it. "
                    + _MOVE_FIX.get(eqn.primitive.name, _MOVE_FIX["all_gather"]),
                )
            outs.append(St(s.pend, s.zero, (s.vary - axes) if invariant else (s.vary | axes)))
        return outs

    return rule


def _choose(eqn: Any, states: Sequence[St], ctx: Ctx) -> list[St]:
    pend = first_pending(states)
    if pend is not None:
        raise fail(
            ctx,
            eqn,
            pend,
            "takes the max/min across devices of",
            "The max of partial sums is not the max of the sums. " + reduce_hint(pend),
        )
    axes = _axes_param(eqn)
    return [St(None, False, s.vary - axes) for s in states]


def _axis_index(eqn: Any, states: Sequence[St], ctx: Ctx) -> list[St]:
    return [St(None, False, _axes_param(eqn))]


# -- shardlib's own notes ----------------------------------------------------------------------


def _note(eqn: Any, states: Sequence[St], ctx: Ctx) -> list[St]:
    n: Note = param(eqn, "note")
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
            raise declared_mismatch(ctx, n, s.pend)
        return [s]
    if n.kind == "sum":
        owed = s.pend.axes if s.pend else frozenset()
        same = [a for a in n.axes if a not in owed and a not in s.vary]
        if same and s.pend is None and not s.zero and not ctx.trial:
            raise invariant_sum(ctx, eqn, n, same)
        return [s]
    if n.kind == "same":
        _check_same(eqn, s, n, ctx)
        return [s]
    raise AssertionError(f"unknown note kind {n.kind!r}")  # pragma: no cover - internal


def _check_same(eqn: Any, s: St, n: Note, ctx: Ctx) -> None:
    """A layout op that slices its input over ``n.axes`` needs it the same on every device of
    those axes, and not a partial sum over them."""
    axes = frozenset(n.axes)
    if s.pend is not None and s.pend.axes & axes:
        raise fail(
            ctx,
            eqn,
            s.pend,
            f"keeps on each device of {axes_text(s.pend.axes & axes)} only its own slice of",
            "Each device would keep a slice of its own share, not of the sum. "
            + reduce_hint(s.pend, _reshard_out(n)),
        )
    varying = s.vary & axes
    if varying:
        raise same_varies(ctx, eqn, n, varying)


def _reshard_out(n: Note) -> str | None:
    """The output spec of a ``reshard`` (its fix is a ``psum_scatter`` to it), else None."""
    if n.op != "reshard" or "->" not in n.text:
        return None
    return n.text.rpartition("->")[2].strip()


# ---------------------------------------------------------------------------------------------
# The table of these rules (calls and control flow are added by the walker)
# ---------------------------------------------------------------------------------------------

_LINEAR_UNARY = (
    "neg",
    "reshape",
    "tile",
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
    "pcast",
    "sharding_constraint",
    "mesh_cast",
    "reshard",
    "dynamic_slice",
    "fft",
    "reduce_window_sum",
    "split",
    "unstack",  # iterating over an array (``list(y)``, ``a, b = y``): JAX >= 0.10
    "stop_gradient",
    "name",  # jax.ad_checkpoint.checkpoint_name
    # JAX's casts between its varying, unreduced and reduced types (identities on the value;
    # named with a stray ``_p`` before JAX 0.11)
    "preduced",
    "vary_unreduced_cast",
    "vary_unreduced_cast_p",
    "reduced_vary_cast",
    "reduced_vary_cast_p",
    # A max-pool's derivatives: linear in the tangent (cotangent), the first operand; the
    # operand that picks each window's maximum must be the same on every device
    "select_and_gather_add",
    "select_and_scatter_add",
)


def _broadcast(eqn: Any, states: Sequence[St], ctx: Ctx) -> list[St]:
    """``pbroadcast(x)`` (``jax.lax.pbroadcast`` with an int source) and
    ``pbroadcast_dynamic(x, source)`` (a traced source, JAX >= 0.12): every device of the
    axes gets the source device's ``x``, the same on all of them; a partial sum over them
    would lose the other devices' shares."""
    x, source = states[0], states[1] if len(states) > 1 else PLAIN
    axes = _axes_param(eqn)
    for s in (x, source):
        if s.pend is not None and (s is source or s.pend.axes & axes):
            raise fail(
                ctx,
                eqn,
                s.pend,
                f"broadcasts one device's value to every device of {axes_text(axes)}, of",
                "Only the source device's share would be kept. " + reduce_hint(s.pend),
            )
    return [St(x.pend, x.zero, (x.vary | source.vary) - axes)]


RULES: dict[str, Rule] = {
    **dict.fromkeys(_LINEAR_UNARY, _unary),
    **dict.fromkeys(("add", "sub", "add_any", "concatenate", "stack", "complex"), combine),
    **dict.fromkeys(("mul", "div", "dot_general", "conv_general_dilated"), _product),
    **dict.fromkeys(("psum", "psum_invariant", "psum2", "unreduced_psum"), _sum),
    "convert_element_type": _convert,
    "pad": _pad,
    **SELECT_RULES,
    "reduce_scatter": _psum_scatter,
    "unreduced_reduce_scatter": _psum_scatter,
    **dict.fromkeys(("all_gather", "all_gather_invariant", "all_gather_reduced"), _moves(True)),
    "all_to_all": _moves(invariant=False),
    "ppermute": ppermute_rule,
    **dict.fromkeys(("pmax", "pmin", "unreduced_pmax", "unreduced_pmin"), _choose),
    **dict.fromkeys(("pbroadcast", "pbroadcast_dynamic"), _broadcast),
    "axis_index": _axis_index,
    "device_put": _each,
    "optimization_barrier": _each,
    "shardlib_pending": _note,
}
