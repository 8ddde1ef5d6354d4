"""The recipe of an overlapped ``einsum`` (``overlap='ring'`` / ``'bidirectional'``; no JAX).

A collective matmul runs one all-gather or one reduce-scatter over one mesh axis as ring
steps: each step sends a block to the next device (``ppermute``) while the device multiplies
the block it holds. The spec is the einsum it replaces, and says which of the two it is:

- **gather**: an operand's dim is split over a trailing mesh axis ``a`` that no other mention
  of the dim has (``'L/t M, M F/t -> L F/t'``: ``x``'s ``L`` is gathered over ``t``;
  ``'M/i K, K/i N -> M/i N'``: ``b``'s ``K``). That operand travels round the ring; the
  others are sliced at the block in hand; the block's product is written at its place in the
  output (the dim is an output dim) or added up (the dim is contracted).
- **scatter**: an output dim gains a trailing axis ``a`` that splits a contracted dim
  (``'B L F/t, F/t M -> B L/t M'``). Each step computes the partial product of one output
  block and adds it to the accumulator that travels round the ring; after ``|a|`` steps each
  device holds the full sum of its block.

The spec checks of the local einsum are ``einsum_unreduced``'s (`einsum_parts`) on the spec
with ``a`` removed where it is gathered or scattered: what remains must be a local einsum
with no other reduction (one ring, no second collective).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from .._lang.op_spec import OpSpec, parse_op_spec
from .._lang.parsing import DimSpec, ShapeSpec, SpecError, as_str
from .local_recipes import einsum_parts
from .recipe import Recipe

__all__ = ["OVERLAPS", "OverlapRecipe", "overlapped_einsum_recipe"]

OVERLAPS = ("ring", "bidirectional")


@dataclass(frozen=True)
class OverlapRecipe(Recipe):
    """``kind``: ``'gather'`` or ``'scatter'``; ``direction``: one of `OVERLAPS`; ``axis``:
    the ring's mesh axis; ``equation``: the local einsum of one step's blocks; ``moved``: the
    operand that travels (gather; -1 for scatter); ``sliced``: ``(operand, dim)`` of each
    operand sliced at the step's block along the ring dim; ``out_dim``: the ring dim's place
    in the output (None: it is contracted, the steps' products are added); ``ring_dim``: the
    gathered dim's place in the travelling operand (scatter: -1)."""

    kind: str
    direction: str
    axis: str
    equation: str
    moved: int
    sliced: tuple[tuple[int, int], ...]
    out_dim: int | None
    ring_dim: int


def overlapped_einsum_recipe(
    spec: str | bytes, n_operands: int, overlap: str, resolved: bool = False
) -> OverlapRecipe | None:
    """The recipe of ``einsum(spec, *operands, overlap=overlap)``; None when ``resolved`` (axis
    rules rewrote the spec) and the rules left nothing to move (the ring's role is
    replicated): the plain einsum then runs."""
    text = as_str(spec)
    if overlap not in OVERLAPS:
        raise ValueError(
            f"einsum({text!r}): overlap={overlap!r} is not one of None, 'ring', "
            "'bidirectional'; pass overlap='ring' for a one-way ring of ppermutes, "
            "'bidirectional' to send half of each block each way"
        )
    if n_operands < 1:
        raise TypeError(f"einsum({text!r}) needs at least one operand, got none")
    if resolved and not _candidates(parse_op_spec(text, op="einsum", n_inputs=n_operands)):
        return None
    return _recipe(text, n_operands, overlap)


def _strip(s: ShapeSpec, j: int) -> str:
    """The shape spec ``s`` as text, with the last mesh axis of dim ``j`` removed."""
    dims = [
        str(DimSpec(d.shape, d.sharding[:-1])) if i == j else str(d) for i, d in enumerate(s.dims)
    ]
    return " ".join(dims)


def _local_text(ops: OpSpec, where: int | None, j: int) -> str:
    """The spec with the ring axis removed from dim ``j`` of input ``where`` (None: output)."""
    ins = [
        _strip(s, j) if k == where else " ".join(map(str, s.dims)) for k, s in enumerate(ops.inputs)
    ]
    out = _strip(ops.output, j) if where is None else " ".join(map(str, ops.output.dims))
    return f"{', '.join(ins)} -> {out}"


def _mentions(ops: OpSpec, name: str) -> list[tuple[int | None, int, DimSpec]]:
    """Every ``(input or None for the output, dim, DimSpec)`` where dim ``name`` is written."""
    found = []
    for k, s in (*enumerate(ops.inputs), (None, ops.output)):
        found.extend((k, j, d) for j, d in enumerate(s.dims) if str(d.shape) == name)
    return found


def _candidates(ops: OpSpec) -> list[tuple[str, int | None, int, str]]:
    """``(kind, input or None, dim, axis)``: each dim written with one more trailing mesh axis
    than another mention of it (an operand's gathered dim, the output's scattered dim)."""
    found = []
    for k, s in (*enumerate(ops.inputs), (None, ops.output)):
        for j, d in enumerate(s.dims):
            others = [
                e.sharding for kk, jj, e in _mentions(ops, str(d.shape)) if (kk, jj) != (k, j)
            ]
            lost = [d.sharding[len(o) :] for o in others if d.sharding[: len(o)] == o]
            if any(lost):
                kind = "scatter" if k is None else "gather"
                axes = max(lost, key=len)
                axis = axes[0]
                if len(axes) > 1:
                    raise ops.error(
                        f"einsum(..., overlap=...): dim {str(d)!r} moves over {len(axes)} mesh "
                        f"axes {list(axes)}; a ring runs over one",
                        operand=k,
                        dim=j,
                        hint="split the collective: gather or scatter all but the last axis "
                        "with overlap=None first",
                    )
                found.append((kind, k, j, axis))
    return found


def _refuse(ops: OpSpec, overlap: str, why: str, hint: str) -> SpecError:
    return ops.spec_error(f"einsum(..., overlap={overlap!r}): {why}", hint=hint)


_ONE_RING = (
    "write the einsum whose only collective is one all-gather of an operand's dim (the dim "
    "split over a trailing mesh axis the other mentions of it lack, 'L/t M, M F/t -> L F/t') "
    "or one reduce-scatter into an output dim ('L M/t, M/t F -> L/t F'); other reductions "
    "run with overlap=None"
)


@functools.lru_cache(maxsize=512)
def _recipe(text: str, n_operands: int, overlap: str) -> OverlapRecipe:
    ops = parse_op_spec(text, op="einsum", n_inputs=n_operands)
    for s in (*ops.inputs, ops.output):
        if s.pending or s.reduced:
            raise _refuse(ops, overlap, "a {+axis} clause is not supported here", _ONE_RING)
    found = _candidates(ops)
    if len(found) != 1:
        why = (
            "the spec moves no mesh axis, so there is nothing to overlap"
            if not found
            else f"the spec moves {len(found)} dims over mesh axes; a ring overlaps one"
        )
        raise _refuse(ops, overlap, why, _ONE_RING)
    kind, where, j, axis = found[0]
    local = _local_text(ops, where, j)
    try:
        parts = einsum_parts(local, n_operands, "einsum", reduces=False)
    except SpecError as e:
        raise _refuse(
            ops, overlap, f"without the ring over {axis!r} it is not a local einsum: {e}", _ONE_RING
        ) from None
    extra = [a for a in parts.axes if kind == "gather" or a != axis]
    if extra:  # the local einsum leaves a partial sum the ring does not reduce
        why = f"contracted dims split over {extra} need a reduction besides the ring"
        raise _refuse(ops, overlap, why, _ONE_RING)
    if kind == "scatter" and axis not in parts.axes:
        why = f"no contracted dim is split over {axis!r}, so there is nothing to reduce-scatter"
        raise _refuse(ops, overlap, why, _ONE_RING)
    return _build(ops, parts.equation, kind, where, j, axis, overlap)


def _build(
    ops: OpSpec, equation: str, kind: str, where: int | None, j: int, axis: str, overlap: str
) -> OverlapRecipe:
    name = str(ops.part(where).dims[j].shape)
    mentions = _mentions(ops, name)
    sliced = tuple((k, jj) for k, jj, _ in mentions if k is not None and k != where)
    out_dim = next((jj for k, jj, _ in mentions if k is None), None)
    n = len(ops.inputs)
    what = f"{kind}s dim {name!r} over {axis!r} in ring steps"
    return OverlapRecipe(
        ops,
        kind,
        overlap,
        axis,
        equation,
        -1 if where is None else where,
        sliced,
        out_dim,
        -1 if where is None else j,
        op="einsum",
        roles=tuple(f"operand {k}" for k in range(n)),
        needs=(axis,),
        why=f"einsum(..., overlap={overlap!r}) {what}",
    )
