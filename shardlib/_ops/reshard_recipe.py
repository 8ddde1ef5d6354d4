"""``reshard``: a layout change worked out into collectives and local slices (pure Python, no JAX).

A layout is the tuple of mesh axes on each dim (``'B/t L M/x/y'`` is ``(('t',), (), ('x',
'y'))``; a dim's axes are major to minor). ``reshard(spec, x)`` changes the layout of ``x``
without changing its global value. The search goes through the layouts between the input's and
the output's for the cheapest sequence of these steps:

- **all_gather** (``shardops.all_gather``): a dim drops trailing mesh axes (product ``n``).
  Each device receives the ``n - 1`` blocks it lacks: ``(n - 1) · b`` bytes, ``b`` its block.
- **all_to_all** (``shardops.all_to_all``): trailing mesh axes (product ``n``) move from the
  end of one dim to the end of another. Each device sends (and receives) all of its block but
  its own share: ``(n - 1) / n · b`` bytes.
- **slice** (a local slice at ``axis_index``): a dim gains trailing mesh axes that no dim
  uses (the value is replicated over them). Each device keeps its share: ``0`` bytes.

**Cost model:** the bytes one device receives, summed over the steps (``b`` is the block
*before* the step; the ring-algorithm volumes that ``shardlib.explain`` reports). Only the
mesh axes written in the spec take part, and every intermediate layout must split each dim
evenly. Ties go to fewer collectives, then fewer steps. Axes are only ever removed from and
appended at the end of a dim, so every intermediate layout keeps the major-to-minor order of
the axes it has; a reorder such as ``'M/t/d -> M/d/t'`` is worked out like any other change
(gather, then slice), never approximated.

Because every step's bytes are a fraction of the global array's bytes that depends only on
the mesh axis sizes, the recipe depends on the spec, the axis sizes and the global dim sizes
(for divisibility), not on the dtype; it is cached per such key.
"""

from __future__ import annotations

import functools
import heapq
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from fractions import Fraction

from .._lang.op_spec import OpSpec, parse_op_spec
from .._lang.parsing import DimSpec, ShapeSpec, SpecError, as_str
from .recipe import Recipe

__all__ = ["Layout", "ReshardRecipe", "Step", "reshard_recipe", "route", "step_cost"]

Layout = tuple[tuple[str, ...], ...]  # the mesh axes of each dim, major to minor


@dataclass(frozen=True)
class Step:
    """One step of a route: ``kind`` is ``'all_gather'``, ``'all_to_all'`` or ``'slice'``.

    ``dim`` loses (gather, all_to_all) or gains (slice) ``axes`` at its end; ``to`` is the dim
    that gains them in an all_to_all (else None). ``cost``: bytes received per device, as a
    fraction of the global array's bytes.
    """

    kind: str
    before: Layout
    after: Layout
    dim: int
    axes: tuple[str, ...]
    to: int | None
    cost: Fraction


def step_cost(
    kind: str, before: Layout, axes: tuple[str, ...], sizes: Mapping[str, int]
) -> Fraction:
    """The cost model: bytes one device receives, as a fraction of the global bytes."""
    block = Fraction(1, math.prod(sizes[a] for d in before for a in d))  # b / global bytes
    n = math.prod(sizes[a] for a in axes)
    if kind == "all_gather":
        return (n - 1) * block
    if kind == "all_to_all":
        return Fraction(n - 1, n) * block
    return Fraction(0)


def _with(layout: Layout, dim: int, axes: tuple[str, ...]) -> Layout:
    return layout[:dim] + (axes,) + layout[dim + 1 :]


def _moves(
    layout: Layout, free: tuple[str, ...]
) -> Iterator[tuple[str, int, tuple[str, ...], int | None, Layout]]:
    """Every single step from ``layout``: ``(kind, dim, axes, to, after)``."""
    used = {a for d in layout for a in d}
    for i, d in enumerate(layout):
        for k in range(1, len(d) + 1):
            axes, rest = d[len(d) - k :], d[: len(d) - k]
            yield "all_gather", i, axes, None, _with(layout, i, rest)
            for j, e in enumerate(layout):
                if j != i:
                    yield "all_to_all", i, axes, j, _with(_with(layout, i, rest), j, e + axes)
        for a in free:
            if a not in used:
                yield "slice", i, (a,), None, _with(layout, i, (*d, a))


def _fits(layout: Layout, sizes: Mapping[str, int], shape: tuple[int, ...]) -> bool:
    return all(n % math.prod(sizes[a] for a in d) == 0 for d, n in zip(layout, shape, strict=True))


@functools.lru_cache(maxsize=1024)
def _route(
    src: Layout, dst: Layout, sizes: tuple[tuple[str, int], ...], shape: tuple[int, ...]
) -> tuple[Step, ...]:
    size = dict(sizes)
    free = tuple(sorted({a for d in (*src, *dst) for a in d}))
    # Dijkstra on (cost, collectives, steps).
    heap: list[tuple[Fraction, int, int, int, tuple[Step, ...], Layout]] = []
    heap.append((Fraction(0), 0, 0, 0, (), src))
    done: set[Layout] = set()
    pushed = 0  # ties beyond (cost, collectives, steps) go to the move found first
    while heap:
        cost, ncoll, nsteps, _, path, layout = heapq.heappop(heap)
        if layout == dst:
            return _merge_slices(path)
        if layout in done:
            continue
        done.add(layout)
        for kind, dim, axes, to, after in _moves(layout, free):
            if after in done or not _fits(after, size, shape):
                continue
            c = step_cost(kind, layout, axes, size)
            step = Step(kind, layout, after, dim, axes, to, c)
            coll = ncoll + (kind != "slice")
            pushed += 1
            heapq.heappush(heap, (cost + c, coll, nsteps + 1, pushed, (*path, step), after))
    raise AssertionError(f"no route from {src} to {dst}")  # pragma: no cover - gather+slice works


def _merge_slices(path: tuple[Step, ...]) -> tuple[Step, ...]:
    """Consecutive slices of one dim become one step (one ``dynamic_slice``)."""
    out: list[Step] = []
    for s in path:
        p = out[-1] if out else None
        if p is not None and s.kind == p.kind == "slice" and s.dim == p.dim:
            out[-1] = Step("slice", p.before, s.after, p.dim, p.axes + s.axes, None, Fraction(0))
        else:
            out.append(s)
    return tuple(out)


def route(
    src: Layout, dst: Layout, sizes: Mapping[str, int], shape: tuple[int, ...]
) -> tuple[Step, ...]:
    """The cheapest steps from layout ``src`` to ``dst`` (see the module docstring).

    ``sizes``: the mesh axis sizes; ``shape``: the global dim sizes (each intermediate layout
    must split them evenly; ``dst`` must, too).
    """
    axes = {a for d in (*src, *dst) for a in d}
    key = tuple(sorted((a, sizes[a]) for a in axes))
    return _route(src, dst, key, tuple(shape))


def layout_of(dims: tuple[DimSpec, ...]) -> Layout:
    return tuple(d.sharding for d in dims)


def step_text(names: tuple[str, ...], step: Step) -> str:
    """The spec of one step, ``'B/t L M -> B L/t M'``, in the user's dim names."""

    def side(layout: Layout) -> str:
        return " ".join("/".join((n, *a)) for n, a in zip(names, layout, strict=True))

    return f"{side(step.before)} -> {side(step.after)}"


@dataclass(frozen=True)
class ReshardRecipe(Recipe):
    src: Layout
    dst: Layout
    names: tuple[str, ...]  # the dims as written ('B', '8')


def reshard_recipe(spec: str | bytes) -> ReshardRecipe:
    """The recipe of ``reshard(spec, x)``: the two layouts, checked to share their dims."""
    return _reshard_recipe(as_str(spec))


_FIX = "reshard changes only the mesh axes after '/': write the same dims on both sides"


@functools.lru_cache(maxsize=1024)
def _reshard_recipe(spec: str) -> ReshardRecipe:
    op = "reshard"
    ops = parse_op_spec(spec, op=op, n_inputs=1)
    a, b = ops.inputs[0], ops.output
    _same_pending(ops)
    if len(a.dims) != len(b.dims):
        raise ops.error(
            f"{op}: the input has {len(a.dims)} dims but the output has {len(b.dims)}; reshard "
            "keeps the dims and changes their mesh axes",
            operand=None,
            dim=None,
            hint=_FIX + " (to reshape, use a reshape after the layout change)",
        )
    for i, (p, q) in enumerate(zip(a.dims, b.dims, strict=True)):
        if p.shape != q.shape:
            what = "size" if isinstance(p.shape, int) and isinstance(q.shape, int) else "dim"
            raise ops.error(
                f"{op}: dim {i} is {p.shape!r} in the input but {q.shape!r} in the output; "
                f"reshard does not change a {what} (nor rename or reorder dims)",
                operand=None,
                dim=i,
                hint=f"reshard changes only the mesh axes after '/': write dim {i} as {str(p.shape)!r} on both sides",
            )
    needs = tuple(sorted({x for d in (*a.dims, *b.dims) for x in d.sharding}))
    names = tuple(str(d.shape) for d in a.dims)
    why = "reshard keeps the pending axes of its input"
    return ReshardRecipe(
        ops, layout_of(a.dims), layout_of(b.dims), names, op=op, needs=needs, why=why
    )


def _same_pending(ops: OpSpec) -> None:
    """A ``{+t}`` clause declares a partial sum; reshard keeps it, so both sides say the same."""
    a, b = ops.inputs[0], ops.output
    if set(a.pending) == set(b.pending):
        return
    part = b if b.pending else a
    said = [f"pending axes {ShapeSpec((), p.pending)}" if p.pending else "none" for p in (a, b)]
    raise SpecError.at(
        f"reshard: the input declares {said[0]} but the output declares {said[1]}; reshard "
        "neither reduces a partial sum nor makes one, so both sides owe the same sums",
        ops.text,
        part.pending_span,
        hint="write the same '{+axis}' clause on both sides (shardops.psum or psum_scatter "
        "reduce it)",
    )
