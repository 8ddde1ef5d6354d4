"""``shardlib.plan``: trace a step on every candidate mesh (abstract: no devices) and rank."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax

from .._env import rules as _rules
from .._explain.explain import explain
from .._explain.hardware import Hardware, hardware_of
from . import meshes as _meshes
from .cost import costs
from .result import Candidate, Plan, Skipped

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
    - `memory_budget`: bytes per device (default: the hardware's memory).
    - `overlap`: the share of ``min(compute, communication)`` hidden (0: none; 1: all).
    - `bandwidths`: measured bytes per second per device for mesh axes, used instead of the
      hardware's links for collectives over them.

    **Returns:** a `Plan`: ``candidates`` ranked (fitting the budget first, then by predicted
    step time), ``skipped``, ``best`` (``best.rules`` for ``shardlib.axis_rules``,
    ``best.make_mesh()``), ``markdown()``, and ``verify()`` to compile each candidate on real
    devices and compare.

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
    if not 0.0 <= overlap <= 1.0:
        raise ValueError(f"plan: overlap={overlap!r} must be between 0 (none) and 1 (all)")
    budget = hw.memory_bytes if memory_budget is None else memory_budget
    start = time.perf_counter()
    ranked: list[Candidate] = []
    skipped: list[Skipped] = []
    failed: list[Exception] = []
    for mesh in shapes:
        rules = _meshes.rules_of(mesh, axes, roles)
        why = _meshes.divisibility(args, in_specs, rules, mesh)
        if why is None:
            why = _trace(step, args, in_specs, rules, mesh, hw, overlap, bandwidths, budget)
            if isinstance(why, Exception):
                failed.append(why)
                why = f"{type(why).__name__}: {_first_line(why)}"
        if isinstance(why, Candidate):
            ranked.append(why)
        else:
            skipped.append(Skipped(mesh, why))
    _refuse_when_nothing_traced(ranked, skipped, failed)
    order = {True: 0, None: 1, False: 2}
    ranked.sort(key=lambda c: (order[c.fits], c.step_s))
    seconds = time.perf_counter() - start
    return Plan(step, devices, hw, budget, overlap, ranked, skipped, seconds)


def _trace(
    step: Callable[..., Any],
    args: tuple,
    in_specs: Any,
    rules: dict,
    mesh: dict[str, int],
    hw: Hardware,
    overlap: float,
    bandwidths: Mapping[str, float] | None,
    budget: float | None,
) -> Candidate | Exception:
    """The candidate traced on ``mesh``, or the error its trace raised."""
    abstract = _meshes.abstract_mesh(mesh)
    try:
        with jax.sharding.use_abstract_mesh(abstract), _rules.axis_rules(rules):
            placed = _meshes.abstract_args(args, in_specs, rules, abstract)
            report = explain(step, *placed, hardware=hw)
    except (ValueError, TypeError) as e:  # a size the model refuses, named by its error
        return e
    c = costs(report, hw, mesh, overlap, bandwidths)
    fits = None if c.memory_bytes is None or budget is None else c.memory_bytes <= budget
    return Candidate(dict(mesh), rules, report, c, fits, placed)


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
