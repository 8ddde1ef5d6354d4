"""The screen: a candidate's costs estimated from a probe, a candidate traced on a mesh over
the same axes (in the same order: the same rules, so the same program with other block sizes).

A plan over many meshes (four axes at 1024 devices: about 200 that divide the arguments)
cannot trace each one in seconds. With ``plan(screen=N)`` it traces one probe per set of axes
(the mesh of most even sizes), estimates every other mesh of that set from it here, and
traces exactly only the best estimates: what it ranks is always a traced price; an estimate
only decides what is traced, and the meshes left out are listed with theirs.

Each term of the probe is scaled to the other mesh (`estimate`); ``r(A)`` is the product over
the axes ``A`` of the probe's size over the mesh's:

- **compute**: each matmul's FLOPs times ``r(V)``, ``V`` the axes its result varies over
  (its type), and its bytes (each operand's and the result's times ``r`` of the axes that one
  varies over), the roofline taken again; each overhead term (`shardlib._plan.roofline`) times
  ``r(V)``: a device's share of the work is its share of the results, loop trip counts
  included (a ring of ``c`` steps over blocks ``1/c`` of the keys does ``1/c`` of the work
  whatever ``c`` is);
- **communication**: each collective's operand per device times ``r(S)``, ``S`` the axes
  that split its operand (`operand_splits`: the operand's side of its shardops spec; a
  collective made by differentiation has no spec: the split of a collective of the same
  shape that has one, else none); its group is the product of its axes' sizes, its bytes the
  ring's for that group (`shardlib._explain.hlo.ring_bytes`); a collective-permute over one
  axis in a loop of ``size - k`` iterations (``k`` <= 2: a ring) runs ``size - k`` times on
  the other mesh; a layout move outside ``shard_map`` (a global shape between two specs) is
  priced again on the other mesh;
- **memory**: the mesh's arguments per device (exact: no trace) plus what the probe's peak
  holds above its arguments, scaled as the bytes its matmuls read and write (activations,
  gathered weights and gradients are what they read and write).

Exact for a step whose every term scales so (the tests' FSDP + tensor-parallel MLP); on the
transformer it ranks the exact top layouts first (tests/test_plan_screen.py checks that
against planning every mesh); replicated work, a loop whose trip count another size sets, or
shape coincidences make it an estimate, never a price.

May import: `shardlib._explain` and this package's `cost`, `roofline` and `result`.
"""

from __future__ import annotations

import ast
import dataclasses
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jax

from .._explain.hardware import Hardware
from .._explain.hlo import array_bytes, ring_bytes
from .._explain.moves import Layout, LayoutMove
from .._explain.report import CollectiveCall
from .cost import Costs, costs
from .result import Candidate
from .roofline import Matmuls

__all__ = ["Probe", "estimate", "operand_splits", "probe_index"]


def probe_index(meshes: Sequence[Mapping[str, int]]) -> int:
    """The index of the mesh to trace for ``meshes`` (over the same axes): the most even sizes
    (the least spread of their logarithms), the first of equals."""

    def spread(mesh: Mapping[str, int]) -> float:
        logs = [math.log(n) for n in mesh.values()]
        mean = sum(logs) / len(logs)
        return sum((x - mean) ** 2 for x in logs)

    return min(range(len(meshes)), key=lambda i: (spread(meshes[i]), i))


@dataclass(frozen=True)
class Probe:
    """A traced candidate, ready to be scaled to the other meshes over its axes: its matmuls
    (each term with the axes its values vary over), the bytes of its arguments per device,
    and per collective the axes that split its operand and the ring loop that sets its
    calls."""

    candidate: Candidate
    matmuls: Matmuls
    args_bytes: int
    splits: tuple[tuple[str, ...], ...]
    rings: tuple[tuple[str, int] | None, ...]

    @classmethod
    def of(cls, candidate: Candidate, matmuls: Matmuls, args_bytes: int) -> Probe:
        report = candidate.report
        mesh = candidate.mesh
        splits = tuple(operand_splits(report.collectives, mesh, candidate.args))
        nests = {(c.axes, tuple(_loop_lengths(c.in_loop))) for c in report.collectives}
        rings = tuple(_ring(c, mesh, nests) for c in report.collectives)
        return cls(candidate, matmuls, args_bytes, splits, rings)


def estimate(
    probe: Probe,
    mesh: Mapping[str, int],
    args_bytes: int,
    hw: Hardware,
    overlap: float,
    bandwidths: Mapping[str, float] | None,
) -> Costs:
    """The probe's costs scaled to ``mesh`` (the probe's axes, other sizes) whose arguments
    take ``args_bytes`` per device: the module's rules, priced by `shardlib._plan.cost`."""
    base = probe.candidate.mesh
    if tuple(mesh) != tuple(base):
        raise ValueError(
            f"screen.estimate: the mesh {dict(mesh)} is not over the probe's axes "
            f"{tuple(base)} (in that order)"
        )

    seen: dict[frozenset[str] | tuple[str, ...], float] = {}

    def ratio(axes: frozenset[str] | tuple[str, ...]) -> float:
        got = seen.get(axes)
        if got is None:
            got = seen[axes] = math.prod(base[a] / mesh[a] for a in axes if a in mesh)
        return got

    mm = _matmuls(probe.matmuls, ratio, hw)
    report = probe.candidate.report
    scaled = [
        _scaled(c, mesh, ratio(split), ring)
        for c, split, ring in zip(report.collectives, probe.splits, probe.rings, strict=True)
    ]
    memory = report.memory
    if memory.peak is not None:
        rest = (memory.peak - probe.args_bytes) * _moved_ratio(probe.matmuls, ratio)
        memory = dataclasses.replace(memory, peak=round(rest) + args_bytes)
    moves = [_moved(m, mesh) for m in report.moves]
    report = dataclasses.replace(report, collectives=scaled, moves=moves, memory=memory)
    return costs(report, mm, hw, mesh, overlap, bandwidths)


def _matmuls(probe: Matmuls, ratio: Any, hw: Hardware) -> Matmuls:
    """The probe's matmuls and overhead with each term scaled (`estimate`): a matmul's FLOPs
    by its result's axes, its bytes by each operand's and the result's, the roofline taken
    again; the overhead by its equations' results' axes."""
    out = Matmuls()
    for (phase, flops, varying, atoms), times in probe.dots.items():
        f = flops * ratio(varying) * times
        moved = sum(n * ratio(axes) for n, axes in atoms) * times
        math_s = f / hw.flops_per_s
        hbm_s = 0.0 if hw.hbm_bytes_per_s is None else moved / hw.hbm_bytes_per_s
        out.flops[phase] += f
        out.seconds[phase] += max(math_s, hbm_s)
        out.hbm_bound_s[phase] += hbm_s if hbm_s > math_s else 0.0
    for (phase, varying), (ops, seconds) in probe.overhead_by.items():
        out.ops[phase] += ops
        out.overhead_s[phase] += seconds * ratio(varying)
    return out


def _moved_ratio(probe: Matmuls, ratio: Any) -> float:
    """How the bytes the probe's matmuls read and write change on the other mesh (each
    operand's and result's bytes times ``r`` of the axes it varies over): the memory
    estimate scales what the probe's peak holds above its arguments (activations, gathered
    weights, gradients) by it."""
    before = after = 0.0
    for (_, _, _, atoms), times in probe.dots.items():
        before += sum(n for n, _ in atoms) * times
        after += sum(n * ratio(axes) for n, axes in atoms) * times
    return after / before if before else 1.0


def _scaled(
    c: CollectiveCall, mesh: Mapping[str, int], ratio: float, ring: tuple[str, int] | None
) -> CollectiveCall:
    group = math.prod(mesh.get(a, 1) for a in c.axes)
    operand = c.operand_bytes * ratio
    result = operand * (group if c.kind == "all-gather" else 1)
    if c.kind == "reduce-scatter":
        result = operand / max(group, 1)
    moving = 1.0 if c.sent_bytes or c.kind != "collective-permute" else 0.0
    sent = math.ceil(ring_bytes(c.kind, operand, result, group, moving))
    calls = c.calls
    if ring is not None:
        axis, k = ring
        calls = math.prod(_loop_lengths(c.in_loop)[:-1]) * max(mesh[axis] - k, 0)
    return dataclasses.replace(
        c,
        group=group,
        operand_bytes=math.ceil(operand),
        sent_bytes=sent,
        received_bytes=sent,
        calls=calls,
    )


def _moved(m: LayoutMove, mesh: Mapping[str, int]) -> LayoutMove:
    """A layout move outside ``shard_map`` on ``mesh``: its bytes again for the same global
    shape and layouts (the probe's when a layout's text does not read as a spec)."""
    src, dst = _layout(m.src, mesh), _layout(m.dst, mesh)
    if src is None or dst is None or len(src.dims) != len(m.shape) != len(dst.dims):
        return m
    # One device's bytes (the first's: on a mesh that divides the value evenly every device
    # receives as much); `received_bytes` visits every device for the worst, too slow to run
    # for hundreds of estimated meshes of a thousand devices.
    new, old = dst.block(m.shape, {}), src.block(m.shape, {})
    have = math.prod(
        max(0, min(e1, e2) - max(s1, s2)) for (s1, e1), (s2, e2) in zip(new, old, strict=True)
    )
    lacking = math.prod(e - s for s, e in new) - have
    return dataclasses.replace(m, received_bytes=array_bytes(m.dtype, (lacking,)))


def _layout(text: str, mesh: Mapping[str, int]) -> Layout | None:
    """The `Layout` a move's ``P(('data', 'd'), None)`` names on ``mesh``, or None."""
    if not (text.startswith("P(") and text.endswith(")")):
        return None
    try:
        entries = ast.literal_eval(f"({text[2:-1]},)") if text != "P()" else ()
    except (ValueError, SyntaxError):
        return None
    dims = []
    for e in entries:
        names = e if isinstance(e, tuple) else () if e is None else (e,)
        if not all(isinstance(a, str) and a in mesh for a in names):
            return None
        dims.append(tuple(names))
    return Layout(tuple(dims), dict(mesh))


def operand_splits(
    collectives: Sequence[CollectiveCall], mesh: Mapping[str, int], args: Any = ()
) -> list[tuple[str, ...]]:
    """Per collective, the axes of ``mesh`` that split its operand: by its shardops spec (the
    side whose rank is the operand's: the left of ``->`` first, the right first for a
    transpose made by differentiation, whose operand is the forward op's result; an einsum's
    reduction has its operands on the left and its result on the right); without a spec (a
    reduction differentiation made: a gradient), the split of an argument (placed on
    ``mesh``: ``args``) whose block has the operand's shape per device, else of a spec'd
    collective whose operand or result has it, else none."""
    sides = [_sides(c, mesh) for c in collectives]
    by_shape: dict[tuple[int, ...], tuple[str, ...]] = dict(_argument_blocks(args, mesh)[::-1])
    for c, got in zip(collectives, sides, strict=True):
        if got is not None:
            operand, result = got
            by_shape.setdefault(c.operand_shape, operand)
            if result is not None:
                by_shape.setdefault(c.result_shape, result)
    out = []
    for c, got in zip(collectives, sides, strict=True):
        out.append(got[0] if got is not None else by_shape.get(c.operand_shape, ()))
    return out


def _argument_blocks(args: Any, mesh: Mapping[str, int]) -> list[tuple[tuple[int, ...], tuple]]:
    """(block shape per device, the axes splitting it) of each array argument placed on
    ``mesh``."""
    out = []
    for x in jax.tree.leaves(args):
        spec = getattr(getattr(x, "sharding", None), "spec", None)
        shape = getattr(x, "shape", None)
        if spec is None or shape is None:
            continue
        entries = tuple(spec) + (None,) * (len(shape) - len(tuple(spec)))
        block, axes = [], []
        for n, e in zip(shape, entries, strict=False):
            names = tuple(a for a in (e if isinstance(e, tuple) else (e,)) if a in mesh)
            block.append(n // math.prod(mesh[a] for a in names))
            axes += names
        out.append((tuple(block), tuple(axes)))
    return out


def _sides(
    c: CollectiveCall, mesh: Mapping[str, int]
) -> tuple[tuple[str, ...], tuple[str, ...] | None] | None:
    """(the axes splitting the operand, those splitting the result or None) by ``c``'s spec,
    or None when no side of it has the operand's rank."""
    if not c.spec or c.spec.count("->") > 1:
        return None
    parts = [p.strip() for p in c.spec.split("->")]
    if len(parts) == 1:
        operand = _axes_of(parts[0], len(c.operand_shape), mesh)
        return None if operand is None else (operand, None)
    if c.backward:
        parts.reverse()  # a transpose: its operand is the forward op's result
    for first, second in (parts, parts[::-1]):
        operand = _axes_of(first, len(c.operand_shape), mesh)
        if operand is not None:
            return operand, _axes_of(second, len(c.result_shape), mesh)
    return None


def _axes_of(side: str, rank: int, mesh: Mapping[str, int]) -> tuple[str, ...] | None:
    """The mesh axes a spec side's dims name (``'B/data/d L/c M'``: data, d, c), when it has
    ``rank`` dims; None otherwise (several operands, or another notation)."""
    if "," in side:
        return None
    dims = side.split()
    if len(dims) != rank:
        return None
    return tuple(a for d in dims for a in d.split("/")[1:] if a in mesh)


def _loop_lengths(in_loop: str | None) -> list[int]:
    return [int(n) for n in re.findall(r"x(\d+)", in_loop or "")]


def _ring(c: CollectiveCall, mesh: Mapping[str, int], nests: set) -> tuple[str, int] | None:
    """(axis, k) when ``c`` is a permute over one axis inside a loop of ``size - k`` iterations
    (``0 <= k <= 2``) that a permute over the same axis runs outside of (``nests``: each
    collective's axes and loop lengths; a ring runs its first or last step outside its loop):
    a ring's steps, which follow the axis's size. A loop of layers holding the whole ring is
    not one: no permute of the ring runs outside it."""
    if c.kind != "collective-permute" or len(c.axes) != 1 or c.axes[0] not in mesh:
        return None
    lengths = _loop_lengths(c.in_loop)
    if not lengths or math.prod(lengths) != c.calls:  # not a plain nest of loops
        return None
    if (c.axes, tuple(lengths[:-1])) not in nests:
        return None
    k = mesh[c.axes[0]] - lengths[-1]
    return (c.axes[0], k) if 0 <= k <= 2 else None
