"""The recipe of ``einsum``: an einsum that reduces as its output spec says (no JAX).

The local einsum over a contracted dim split over mesh axes leaves each device a partial sum
over those axes (what ``einsum_unreduced`` returns). ``einsum`` reduces it in the same op,
as its output spec says: an output dim split over some of those axes, at the end of its
input's layout, is reduce-scattered over them (``psum_scatter``); the output is summed over
the others (``psum``, the output replicated over them). The spec checks are
``einsum_unreduced``'s (`shardlib._ops.local_recipes.einsum_parts`); the result is never a
partial sum of the op's own making.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from .._lang.op_spec import OpSpec
from .._lang.parsing import as_str
from .local_recipes import einsum_parts
from .recipe import Recipe, axes_list

__all__ = ["ReducedEinsumRecipe", "reduced_einsum_recipe"]


@dataclass(frozen=True)
class ReducedEinsumRecipe(Recipe):
    """``equation``: the local ``jnp.einsum``; ``scatters``: ``(output dim, mesh axes)`` to
    reduce-scatter, in order; ``sources``: ``(operand, dim)`` each scattered dim comes from
    (for the divisibility check); ``summed``: the contracted axes then all-reduced."""

    equation: str
    scatters: tuple[tuple[int, tuple[str, ...]], ...]
    sources: tuple[tuple[int, int], ...]
    summed: tuple[str, ...]


def reduced_einsum_recipe(spec: str | bytes, n_operands: int) -> ReducedEinsumRecipe:
    """The recipe of ``einsum(spec, *operands)`` with ``n_operands`` operands."""
    text = as_str(spec)
    if not n_operands:
        raise TypeError(f"einsum({text!r}) needs at least one operand, got none")
    return _reduced_einsum_recipe(text, n_operands)


def _refuse_pending(ops: OpSpec, op: str, axes: tuple[str, ...], contracted: str) -> None:
    """No operand and not the output may be declared pending over a contracted split axis."""
    for k, s in (*enumerate(ops.inputs), (None, ops.output)):
        clash = [a for a in s.pending if a in axes]
        if not clash:
            continue
        if k is None:
            what = f"the output is declared pending over {clash[0]!r}, but {op} sums over it"
            hint = "remove the clause, or use einsum_unreduced to keep the partial sum"
        else:
            what = (
                f"operand {k} is declared pending over {clash[0]!r}, which also splits a "
                "contracted dim: the local product of a partial sum with blocks split over the "
                "same axis is not a partial sum of the product"
            )
            hint = f"psum operand {k} over {clash[0]!r} first"
        raise ops.error(f"{op}: {what} ({contracted})", operand=k, dim=None, hint=hint)


@functools.lru_cache(maxsize=1024)
def _reduced_einsum_recipe(spec: str, n_operands: int) -> ReducedEinsumRecipe:
    op = "einsum"
    parts = einsum_parts(spec, n_operands, op, reduces=True)
    n = len(parts.contracted)
    contracted = (
        f"the contracted dim{'s' if n != 1 else ''} {', '.join(map(repr, parts.contracted))} "
        f"{'are' if n != 1 else 'is'} split over {axes_list(parts.axes)}"
        if n
        else "no contracted dim is split"
    )
    _refuse_pending(parts.ops, op, parts.axes, contracted)
    scattered = {a for _, axes in parts.scatters for a in axes}
    summed = tuple(a for a in parts.axes if a not in scattered)
    why = f"{contracted}; {op} sums over what it contracts, so the output owes only what its operands owe"
    return ReducedEinsumRecipe(
        parts.ops,
        parts.equation,
        parts.scatters,
        parts.sources,
        summed,
        op=op,
        roles=tuple(f"operand {k}" for k in range(n_operands)),
        needs=parts.axes,
        why=why,
    )
