"""Layout moves outside ``shard_map``: what they are, what they cost, and where XLA put them.

``typed_shard_map`` moves an argument that arrives in another layout than its annotation (on
meshes whose axes are all Explicit) with ``jax.reshard`` just before its ``jax.shard_map``: in
the trace a ``reshard`` equation whose result is an input of the ``shard_map``; its gradient
moves back with the transposed ``reshard``. A user's own ``jax.reshard`` (or ``device_put``,
``sharding_constraint``) between ``shard_map`` calls is the same kind of equation. Each one
whose layouts differ becomes a `LayoutMove` row.

The bytes are exact for the layouts (not an algorithm): each device receives the part of its
new block that its old block does not hold, ``received_bytes``, the largest over the devices.
XLA implements a move with all-to-alls, all-gathers or collective-permutes of blocks no larger
than the old block; `attribute` pairs the HLO's leftover collectives with the moves so that
``compare_hlo`` does not blame them on the partitioner.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from .._env import programs
from .._env.context import spec_entries
from . import hlo as _hlo

__all__ = [
    "MOVE_PRIMITIVES",
    "Layout",
    "LayoutMove",
    "attribute",
    "consumers",
    "is_one_call",
    "layout_of",
    "link_transposes",
    "move_of",
    "received_bytes",
]

# The jaxpr primitives that change a value's layout outside shard_map.
MOVE_PRIMITIVES = ("reshard", "device_put", "sharding_constraint")
# HLO collectives XLA implements a move with.
_MOVE_KINDS = ("all-to-all", "all-gather", "collective-permute")
_MAX_DEVICES = 1 << 16  # mesh sizes whose devices are enumerated to count bytes


@dataclasses.dataclass(frozen=True)
class LayoutMove:
    """A value moved to another layout outside ``shard_map``: one row of the report.

    Typically ``typed_shard_map`` moving an argument that arrived in another layout than its
    annotation (``into`` names the function, ``argument`` the explained function's argument
    when the value is one), or the gradient of that argument moving back (``backward``).
    ``received_bytes`` is exact for the two layouts: what one device lacks of its new block.
    """

    primitive: str  # reshard, device_put or sharding_constraint
    into: str | None  # the shard_map function whose input it becomes (None: not an input)
    input_index: int | None  # which input of that function (flattened)
    argument: str | None  # the argument of the explained function it is (None: computed in it)
    shape: tuple[int, ...]  # global
    dtype: str
    src: str  # the layout it arrives in, as a PartitionSpec: "P(None, 'd')"
    dst: str  # the layout it is moved to
    block_bytes: int  # per device, in the old layout (what XLA's collectives carry)
    received_bytes: int  # per device per call (the most any device receives)
    kinds: tuple[str, ...]  # the collectives it needs (empty: each device slices its block)
    calls: int  # times it runs per call of f
    location: str
    in_loop: str | None = None
    backward: bool = False  # the gradient moving back (the transpose of a move)
    in_step: bool = False  # f does more than this one call: the move costs every step

    @property
    def total_received(self) -> int:
        return self.received_bytes * self.calls

    @property
    def label(self) -> str:
        """``x -> f() input 0`` (``grad of x <- f() input 0`` for the gradient moving back)."""
        what = self.argument or ("a value computed in f" if self.into else "a value")
        if self.into is None:
            return f"{what} ({self.primitive})"
        target = f"{self.into}() input {self.input_index}"
        return f"grad of {what} <- {target}" if self.backward else f"{what} -> {target}"


@dataclasses.dataclass(frozen=True)
class Layout:
    """A value's layout on a mesh: per dim, the mesh axes it is split over (major first)."""

    dims: tuple[tuple[str, ...], ...]
    sizes: dict[str, int]  # the mesh's axis sizes

    def axes(self) -> set[str]:
        return {a for d in self.dims for a in d}

    def text(self) -> str:
        """``P(None, 'd', ('d', 't'))``: the ``PartitionSpec`` of the layout."""
        parts = [
            "None" if not d else repr(d[0]) if len(d) == 1 else repr(tuple(d)) for d in self.dims
        ]
        return f"P({', '.join(parts)})"

    def block(self, shape: Sequence[int], coord: dict[str, int]) -> list[tuple[int, int]]:
        """The ``[start, stop)`` range per dim of the block held by the device at ``coord``."""
        out = []
        for n, axes in zip(shape, self.dims, strict=True):
            k = math.prod(self.sizes[a] for a in axes)
            index = 0
            for a in axes:  # the first axis is the major one
                index = index * self.sizes[a] + coord.get(a, 0)
            b = -(-n // k)
            out.append((min(index * b, n), min((index + 1) * b, n)))
        return out


def layout_of(aval: Any) -> Layout | None:
    """The layout a traced value's type says it has; None without a mesh (or not an array)."""
    sharding = getattr(aval, "sharding", None)
    mesh, spec = getattr(sharding, "mesh", None), getattr(sharding, "spec", None)
    shape = getattr(aval, "shape", None)
    if mesh is None or spec is None or shape is None or not getattr(mesh, "axis_names", ()):
        return None
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))
    entries = spec_entries(spec)
    entries += (None,) * (len(shape) - len(entries))
    dims = tuple(
        (e,)
        if isinstance(e, str)
        else tuple(a for a in e if isinstance(a, str))
        if isinstance(e, tuple | list)
        else ()
        for e in entries[: len(shape)]
    )
    return Layout(dims, sizes)


def received_bytes(shape: Sequence[int], dtype: str, src: Layout, dst: Layout) -> int:
    """Bytes the device that lacks most of its new block receives when a value of ``shape``
    moves from layout ``src`` to ``dst``: its ``dst`` block less what its ``src`` block holds."""
    axes = sorted(src.axes() | dst.axes())
    sizes = {**src.sizes, **dst.sizes}
    if math.prod(sizes[a] for a in axes) > _MAX_DEVICES:  # pragma: no cover - huge meshes
        axes = []  # count one device: blocks are alike on a uniform mesh
    worst = 0
    for values in itertools.product(*(range(sizes[a]) for a in axes)):
        coord = dict(zip(axes, values, strict=True))
        new, old = dst.block(shape, coord), src.block(shape, coord)
        pairs = zip(new, old, strict=True)
        have = math.prod(max(0, min(e1, e2) - max(s1, s2)) for (s1, e1), (s2, e2) in pairs)
        worst = max(worst, math.prod(e - s for s, e in new) - have)
    return _hlo.array_bytes(dtype, (worst,))


def _kinds(src: Layout, dst: Layout, received: int) -> tuple[str, ...]:
    """The collectives a move needs: all-gather for the axes it stops splitting over,
    all-to-all for the axes that split another dim (or in another order); none for a slice."""
    if not received:
        return ()
    placed_src = {(a, i, j) for i, d in enumerate(src.dims) for j, a in enumerate(d)}
    placed_dst = {(a, i, j) for i, d in enumerate(dst.dims) for j, a in enumerate(d)}
    gone = src.axes() - dst.axes()
    moved = {a for a, _, _ in placed_src - placed_dst} - gone
    out = (("all-gather",) if gone else ()) + (("all-to-all",) if moved else ())
    return out or ("collective-permute",)


def move_of(eqn: Any, into: tuple[str, int] | None, argument: str | None, **where: Any):
    """The `LayoutMove` of a layout-changing equation, or None when its layouts are the same
    (or not known: a value without a mesh). ``where``: calls, location, in_loop, backward."""
    a_in, a_out = eqn.invars[0].aval, eqn.outvars[0].aval
    src, dst = layout_of(a_in), layout_of(a_out)
    if src is None or dst is None or src.dims == dst.dims:
        return None
    shape = tuple(a_in.shape)
    try:
        dtype = np.dtype(a_in.dtype).name
    except TypeError:  # an extended dtype (PRNG keys): not priced
        return None
    received = received_bytes(shape, dtype, src, dst)
    block = _hlo.array_bytes(dtype, tuple(e - s for s, e in src.block(shape, {})))
    if into is None and not received:
        return None  # a slice of a value that is not a shard_map input: nothing moves
    if where.get("location", "?") == "?" and into is not None:  # no user line: a direct call
        where = {**where, "location": f"call of {into[0]}()"}
    return LayoutMove(
        primitive=eqn.primitive.name,
        into=into[0] if into else None,
        input_index=into[1] if into else None,
        argument=argument,
        shape=shape,
        dtype=dtype,
        src=src.text(),
        dst=dst.text(),
        block_bytes=block,
        received_bytes=received,
        kinds=_kinds(src, dst, received),
        **where,
    )


def consumers(jaxpr: Any) -> dict[int, tuple[str, int]]:
    """``{id(var): (function name, input index)}`` for the inputs of the ``shard_map``
    equations of ``jaxpr`` (the function named by its body's debug info)."""
    out: dict[int, tuple[str, int]] = {}
    for e in jaxpr.eqns:
        if e.primitive.name != "shard_map":
            continue
        info = programs.call_body(e).debug_info
        src = getattr(info, "func_src_info", None) or "shard_map"
        name = src.split(" at ", 1)[0]
        for i, v in enumerate(e.invars):
            out.setdefault(id(v), (name, i))
    return out


def link_transposes(moves: list[LayoutMove]) -> list[LayoutMove]:
    """Name each gradient move after the forward move it transposes (the same value, the
    layouts swapped), so that its row says which argument it belongs to."""
    out = []
    for m in moves:
        if m.backward and m.into is None:
            fwd = next(
                (
                    f
                    for f in moves
                    if not f.backward
                    and (f.src, f.dst, f.shape) == (m.dst, m.src, m.shape)
                    and f.into is not None
                ),
                None,
            )
            if fwd is not None:
                m = dataclasses.replace(
                    m, into=fwd.into, input_index=fwd.input_index, argument=fwd.argument
                )
        out.append(m)
    return out


def is_one_call(jaxpr: Any) -> bool:
    """Whether the program is one ``shard_map`` call and the moves of its inputs (maybe inside
    one ``jit``): then a move is the caller's to avoid, not a cost inside a step."""
    eqns = list(jaxpr.eqns)
    while len(eqns) == 1 and eqns[0].primitive.name in ("pjit", "jit", "closed_call", "eval_jaxpr"):
        eqns = list(programs.call_body(eqns[0]).eqns)
    names = [e.primitive.name for e in eqns]
    return names.count("shard_map") == 1 and all(
        n == "shard_map" or n in MOVE_PRIMITIVES for n in names
    )


def attribute(
    moves: Sequence[LayoutMove], leftover: list[tuple[str, int, int, str]]
) -> tuple[list[tuple[str, str]], list[tuple[str, int, int, str]]]:
    """Pair HLO collectives that match no reported collective with the moves.

    ``leftover``: ``(kind, group, operand bytes, line)`` of the HLO's unmatched collectives.
    A collective belongs to a move when it is of a kind XLA moves layouts with and carries no
    more than the move's old block: first one per move of a kind the move predicts that carries
    its whole old block, then any other. Returns ``(move label, instruction line)`` pairs and what
    is left.
    """
    costly = [m for m in moves if m.received_bytes]
    if not costly:
        return [], leftover
    found: list[tuple[str, str]] = []
    rest = list(leftover)
    for strict in (True, False):
        for m in costly:
            for h in list(_matches(m, rest, strict)):
                found.append((m.label, h[3]))
                rest.remove(h)
    return found, rest


def _matches(m: LayoutMove, hlo: list[tuple[str, int, int, str]], strict: bool) -> Iterator:
    for h in hlo:
        kind, _group, b, _line = h
        if kind not in _MOVE_KINDS or b > m.block_bytes:
            continue
        if not strict or (kind in m.kinds and b == m.block_bytes):
            yield h
            if strict:
                return
