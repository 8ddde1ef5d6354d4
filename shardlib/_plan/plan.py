"""``shardlib.plan``: trace a step on every candidate mesh (abstract: no devices) and rank."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jax

from .._env import rules as _rules
from .._explain.explain import explain
from .._explain.hardware import Hardware, hardware_of, positive
from . import meshes as _meshes
from .cost import costs
from .result import Candidate, Plan, Skipped, idle_axes, rank_key
from .roofline import matmuls

__all__ = ["plan"]


def plan(
    step: Callable[..., Any],
    *args: Any,
    axes: Mapping[str, Sequence[str]],
    devices: int | None = None,
    mesh_shapes: Sequence[Mapping[str, int]] | None = None,
    in_specs: Any = None,
    roles: Sequence[str] = (),
    hardware: str | Hardware = "h100",
    memory_budget: float | None = None,
    overlap: float = 0.0,
    bandwidths: Mapping[str, float] | None = None,
) -> Plan:
    """Rank the layouts of ``step(*args)`` on ``devices`` devices, from its trace alone.

    Each candidate is a mesh over some of ``axes`` (in the order given) whose sizes multiply to
    ``devices``, with the axis rules that give each role the candidate's axes that carry it
    (None, replicated, where none does). ``step`` is traced once per candidate on a
    `jax.sharding.AbstractMesh` (no devices: a 1024-device layout plans on a laptop) under
    those rules, and `shardlib.explain` reads its collectives, bytes, FLOPs and memory. A mesh
    whose sizes do not divide an argument, or whose trace fails, is skipped with its reason.

    **Arguments:**

    - `step`: the function to lay out (a training step: loss and gradients, or an update).
    - `*args`: its arguments: pytrees of ``jax.ShapeDtypeStruct`` (global shapes, no
      sharding) or arrays; Python scalars are passed as they are.
    - `axes`: mesh axis name -> the roles it carries, e.g. ``{'data': ('batch',), 'fsdp':
      ('batch', 'fsdp'), 'tensor': ('tensor',)}``.
    - `devices`: the device count to enumerate meshes for; or `mesh_shapes`: the meshes
      (``[{'fsdp': 64, 'tensor': 16}, ...]``), each over axes of ``axes``.
    - `in_specs`: one ``PartitionSpec`` (naming roles or mesh axes; a prefix pytree: one spec
      for a whole argument, or a tree of them, e.g. ``make_partition_specs(Model)``) per
      argument, as ``shard_map``'s; None: replicated.
    - `roles`: roles the step names that no axis of ``axes`` carries (always None).
    - `hardware`: a name from ``shardlib.HARDWARE`` or a ``shardlib.Hardware``.
    - `memory_budget`: bytes per device, a positive number (default: the hardware's memory).
    - `overlap`: the share of ``min(compute, communication)`` hidden in each phase, forward
      and backward (0: none; 1: all).
    - `bandwidths`: measured bytes per second per device (positive) for axes of ``axes``,
      used instead of the hardware's links for collectives over them.

    **Returns:** a `Plan`: ``candidates`` ranked (fitting the budget first, then those whose
    every axis splits something, then by predicted step time; those over the budget by how
    far over), ``skipped``, ``best`` (``best.rules`` for ``shardlib.axis_rules``,
    ``best.make_mesh()``, ``best.scaled_to(8)`` to try it on 8 devices), ``warnings`` (nothing
    fits; an axis that splits nothing), ``markdown()`` (the warnings first), and ``verify()``
    to compile each candidate on real devices and compare.

    Examples:
        ```python
        result = shardlib.plan(step, model, tokens, axes={"fsdp": ("batch", "fsdp"),
                               "tensor": ("tensor",)}, devices=1024,
                               in_specs=(make_partition_specs(Model), P("batch")))
        print(result.markdown(top=10))
        ```
    """
    hw = hardware_of(hardware, "plan")
    shapes = _shapes(axes, devices, mesh_shapes)
    _meshes.check_axes(axes)
    if not (isinstance(overlap, int | float) and 0.0 <= overlap <= 1.0):
        raise ValueError(f"plan: overlap={overlap!r} must be between 0 (none) and 1 (all)")
    _check_budget(memory_budget)
    _check_bandwidths(bandwidths, axes)
    budget = hw.memory_bytes if memory_budget is None else memory_budget
    tracer = _Tracer(step, args, in_specs, hw, overlap, bandwidths, budget)
    start = time.perf_counter()
    ranked: list[Candidate] = []
    skipped: list[Skipped] = []
    failed: list[Exception] = []
    for mesh in shapes:
        why = tracer(_meshes.rules_of(mesh, axes, roles), mesh)
        if isinstance(why, Exception):
            failed.append(why)
            why = f"{type(why).__name__}: {_first_line(why)}"
        if isinstance(why, Candidate):
            ranked.append(why)
        else:
            skipped.append(Skipped(mesh, why))
    _refuse_when_nothing_traced(ranked, skipped, failed)
    ranked.sort(key=lambda c: rank_key(c, budget))
    seconds = time.perf_counter() - start
    return Plan(step, devices, hw, budget, overlap, ranked, skipped, seconds)


def _check_budget(memory_budget: object) -> None:
    if memory_budget is not None and not positive(memory_budget):
        raise ValueError(
            f"plan: memory_budget={memory_budget!r} must be a positive, finite number of bytes "
            "per device (e.g. 60e9), or None for the hardware's memory"
        )


def _check_bandwidths(bandwidths: Mapping[str, float] | None, axes: Mapping[str, Any]) -> None:
    if bandwidths is None:
        return
    if not isinstance(bandwidths, Mapping):
        raise TypeError(
            f"plan: bandwidths={bandwidths!r} must map mesh axes to bytes per second, "
            "e.g. {'data': 20e9}"
        )
    unknown = [a for a in bandwidths if a not in axes]
    bad = [f"{a!r}: {v!r}" for a, v in bandwidths.items() if a in axes and not positive(v)]
    if unknown:
        raise ValueError(
            f"plan: bandwidths names {unknown}, not axes of axes= ({', '.join(axes)}); "
            "give a bandwidth for the mesh axes the plan may use"
        )
    if bad:
        raise ValueError(
            f"plan: bandwidths {{{', '.join(bad)}}}: each must be a positive, finite number "
            "of bytes per second per device (what your benchmark measured over that axis)"
        )


@dataclass(frozen=True)
class _Tracer:
    """Traces ``step`` on a mesh under given rules: every candidate of a plan, and
    `Candidate.scaled_to`'s smaller mesh."""

    step: Callable[..., Any]
    args: tuple
    in_specs: Any
    hw: Hardware
    overlap: float
    bandwidths: Mapping[str, float] | None
    budget: float | None

    def __call__(self, rules: dict, mesh: dict[str, int]) -> Candidate | Exception | str:
        """The candidate traced on ``mesh``, why its sizes do not divide the arguments, or the
        error its trace raised."""
        why = _meshes.divisibility(self.args, self.in_specs, rules, mesh)
        if why is not None:
            return why
        abstract = _meshes.abstract_mesh(mesh)
        try:
            with jax.sharding.use_abstract_mesh(abstract), _rules.axis_rules(rules):
                placed = _meshes.abstract_args(self.args, self.in_specs, rules, abstract)
                report = explain(self.step, *placed, hardware=self.hw)
                mm = matmuls(self.step, placed, self.hw)
        except (ValueError, TypeError) as e:  # a size the model refuses, named by its error
            return e
        c = costs(report, mm, self.hw, mesh, self.overlap, self.bandwidths)
        budget = self.budget
        fits = None if c.memory_bytes is None or budget is None else c.memory_bytes <= budget
        idle = idle_axes(report, placed, mesh)
        return Candidate(dict(mesh), rules, report, c, fits, placed, idle, self)


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else ""


def _refuse_when_nothing_traced(
    ranked: list[Candidate], skipped: list[Skipped], failed: list[Exception]
) -> None:
    """Every mesh that divided the arguments failed to trace: a bug in the step, not a size
    it refuses. Raise the first error rather than return an empty plan."""
    if failed and not ranked:
        raise ValueError(
            f"plan: the step failed to trace on every candidate mesh ({len(failed)} traced, "
            f"{len(skipped) - len(failed)} skipped for sizes); the first error: "
            f"{type(failed[0]).__name__}: {_first_line(failed[0])}"
        ) from failed[0]


def _shapes(
    axes: Mapping[str, Sequence[str]],
    devices: int | None,
    mesh_shapes: Sequence[Mapping[str, int]] | None,
) -> list[dict[str, int]]:
    """The candidate meshes: every mesh for ``devices``, or ``mesh_shapes`` checked."""
    if (devices is None) == (mesh_shapes is None):
        raise ValueError(
            "plan: give exactly one of devices= (enumerate the meshes) and mesh_shapes= "
            f"(these meshes); got devices={devices!r}, mesh_shapes={mesh_shapes!r}"
        )
    if devices is not None:
        if not isinstance(devices, int) or devices < 1:
            raise ValueError(f"plan: devices={devices!r} must be a positive int")
        return list(_meshes.mesh_shapes(devices, list(axes)))
    out = []
    for shape in mesh_shapes or ():
        unknown = [a for a in shape if a not in axes]
        if unknown or not shape:
            raise ValueError(
                f"plan: mesh_shapes entry {dict(shape)} names axes {unknown} not in axes= "
                f"({', '.join(axes)})"
            )
        out.append({a: int(shape[a]) for a in axes if a in shape})
    return out
