"""``shardlib.plan``: trace a step on every candidate mesh (abstract: no devices) and rank."""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jax

from .._check.format import byte_str
from .._env import context as _context
from .._env import rules as _rules
from .._explain.explain import explain
from .._explain.hardware import Hardware, hardware_of, positive
from .._explain.walk import argument_bytes
from . import meshes as _meshes
from . import strategies as _strategies
from .cost import costs
from .result import Candidate, Plan, Skipped, idle_axes, rank_key, with_tracer
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
    strategies: Mapping[str, Sequence[Any]] | None = None,
) -> Plan:
    """Rank the layouts of ``step(*args)`` on ``devices`` devices, from its trace alone.

    Each candidate is a mesh over some of ``axes`` (in the order given) whose sizes multiply to
    ``devices``, with the axis rules that give each role the candidate's axes that carry it
    (None, replicated, where none does). ``step`` is traced once per candidate on a
    `jax.sharding.AbstractMesh` (no devices: a 1024-device layout plans on a laptop) under
    those rules, and `shardlib.explain` reads its collectives, bytes, FLOPs and memory. A mesh
    whose sizes do not divide an argument, or whose trace fails, is skipped with its reason.

    **Strategies** (the protocol): a choice the step exposes as a keyword argument (remat on
    or off, the context-parallel attention, a pipeline schedule or a microbatch count, a
    collective-matmul overlap) is searched with ``strategies={'remat': (False, True),
    'context': ('ring', 'gathered')}``: every combination of the values (their product, names
    in the order given, the last varying fastest) is passed to the step as keyword arguments,
    ``step(*args, **strategy)``, and a candidate is a (mesh, rules, strategy); ``best.strategy``
    is what to pass. Memory first: a mesh whose arguments alone (their bytes per device, as
    placed) exceed the memory budget is skipped without tracing, for every strategy (unless no
    mesh's arguments fit: then every mesh is traced and ranked by how far over). Strategies
    that trace to the same program on a mesh (e.g. two context strategies on a mesh that does
    not split the sequence) are priced once: one candidate, the others in its
    ``equivalent``.

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
    - `strategies`: keyword argument of ``step`` -> the values to try (a tuple or a list, each
      value once); None: the step as it is.

    **Returns:** a `Plan`: ``candidates`` ranked (fitting the budget first, then those whose
    every axis splits something, then by predicted step time; those over the budget by how
    far over), ``skipped``, ``best`` (``best.rules`` for ``shardlib.axis_rules``,
    ``best.strategy`` for the step, ``best.make_mesh()``, ``best.scaled_to(8)`` to try it on 8
    devices), ``warnings`` (nothing
    fits; an axis that splits nothing), ``markdown()`` (the warnings first), and ``verify()``
    to compile each candidate on real devices and compare.

    Examples:
        ```python
        result = shardlib.plan(step, model, tokens, axes={"fsdp": ("batch", "fsdp"),
                               "tensor": ("tensor",)}, devices=1024,
                               in_specs=(make_partition_specs(Model), P("batch")))
        print(result.markdown(top=10))

        # A step taking its choices as keyword arguments: the product is searched.
        def step(model, tokens, *, remat=False, context="ring"): ...
        result = shardlib.plan(step, model, tokens, axes=..., devices=1024, in_specs=...,
                               strategies={"remat": (False, True),
                                           "context": ("ring", "gathered")})
        print(result.best.strategy)  # {'remat': True, 'context': 'ring'}: step(..., **it)
        ```
    """
    hw = hardware_of(hardware, "plan")
    shapes = _shapes(axes, devices, mesh_shapes)
    _meshes.check_axes(axes)
    if not (isinstance(overlap, int | float) and 0.0 <= overlap <= 1.0):
        raise ValueError(f"plan: overlap={overlap!r} must be between 0 (none) and 1 (all)")
    _check_budget(memory_budget)
    _check_bandwidths(bandwidths, axes)
    combos = _strategies.combinations(step, len(args), strategies)
    budget = hw.memory_bytes if memory_budget is None else memory_budget
    tracer = _Tracer(step, args, in_specs, hw, overlap, bandwidths, budget)
    start = time.perf_counter()
    ranked: list[Candidate] = []
    skipped: list[Skipped] = []
    failed: list[Exception] = []
    placed = _place(tracer, shapes, axes, roles, budget, skipped)
    steps = [_strategies.bind(step, s) for s in combos]  # one callable each: one trace each
    for mesh, rules, on_mesh in placed:
        priced: list[_Program] = []  # this mesh's programs so far, each with its candidate
        for strategy, bound in zip(combos, steps, strict=True):
            got = tracer.trace(rules, mesh, bound, on_mesh)
            if not isinstance(got, Exception):
                program = _Program(got, strategy)
                twin = next((p for p in priced if p.same_as(program)), None)
                if twin is not None:
                    twin.equivalent.append(strategy)  # the same program: priced once
                    continue
                got = tracer.price(rules, mesh, bound, on_mesh, strategy)
                if isinstance(got, Candidate):
                    program.candidate = got
                    priced.append(program)
                    continue
            failed.append(got)
            skipped.append(Skipped(mesh, f"{type(got).__name__}: {_first_line(got)}", strategy))
        ranked += [p.merged(tracer) for p in priced]
    _refuse_when_nothing_traced(ranked, skipped, failed)
    order = {tuple(m.items()): i for i, m in enumerate(shapes)}
    skipped.sort(key=lambda s: order[tuple(s.mesh.items())])  # mesh order, as enumerated
    ranked.sort(key=lambda c: rank_key(c, budget))
    seconds = time.perf_counter() - start
    tried = {k: tuple(v) for k, v in (strategies or {}).items()}
    return Plan(step, devices, hw, budget, overlap, ranked, skipped, seconds, tried)


def _place(
    tracer: _Tracer,
    shapes: list[dict[str, int]],
    axes: Mapping[str, Sequence[str]],
    roles: Sequence[str],
    budget: float | None,
    skipped: list[Skipped],
) -> list[tuple[dict[str, int], dict, tuple]]:
    """The meshes to trace, each with its rules and the arguments placed on it; the others
    appended to ``skipped`` (before any trace): sizes that do not divide an argument, and,
    memory first, arguments whose bytes per device alone exceed ``budget`` (unless no mesh's
    fit: then every mesh is traced, and ranked by how far over)."""
    out = []
    for mesh in shapes:
        rules = _meshes.rules_of(mesh, axes, roles)
        why = _meshes.divisibility(tracer.args, tracer.in_specs, rules, mesh)
        if why is not None:
            skipped.append(Skipped(mesh, why))
            continue
        placed = _meshes.abstract_args(
            tracer.args, tracer.in_specs, rules, _meshes.abstract_mesh(mesh)
        )
        out.append((mesh, rules, placed, sum(b for _, b in argument_bytes(placed, {}))))
    if budget is not None and any(n <= budget for *_, n in out):
        for mesh, _, _, n in out:
            if n > budget:
                skipped.append(
                    Skipped(
                        mesh,
                        f"the arguments alone take {byte_str(n, 1)} per device, over the memory "
                        f"budget of {byte_str(int(budget), 1)} (not traced)",
                    )
                )
        out = [o for o in out if o[3] <= budget]
    return [(mesh, rules, placed) for mesh, rules, placed, _ in out]


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
    """Traces ``step`` on a mesh under given rules and prices the program: every candidate of
    a plan, and `Candidate.scaled_to`'s smaller mesh. The trace is the expensive part and is
    made once per (mesh, strategy); the cost model (``overlap``, the bandwidths) only prices
    what the trace gave, so it never traces again."""

    step: Callable[..., Any]
    args: tuple
    in_specs: Any
    hw: Hardware
    overlap: float
    bandwidths: Mapping[str, float] | None
    budget: float | None

    def __call__(
        self, rules: dict, mesh: dict[str, int], strategy: dict[str, Any]
    ) -> Candidate | Exception | str:
        """The candidate traced on ``mesh`` with ``strategy``, why its sizes do not divide
        the arguments, or the error its trace raised."""
        why = _meshes.divisibility(self.args, self.in_specs, rules, mesh)
        if why is not None:
            return why
        placed = _meshes.abstract_args(self.args, self.in_specs, rules, _meshes.abstract_mesh(mesh))
        return self.price(rules, mesh, _strategies.bind(self.step, strategy), placed, strategy)

    def trace(
        self, rules: dict, mesh: dict[str, int], step: Callable[..., Any], placed: tuple
    ) -> Any:
        """``step``'s program (its jaxpr) on ``mesh`` under ``rules``, traced as `explain` and
        the roofline trace it (JAX's trace cache then gives it to them), or the error its
        trace raised."""
        try:
            with self._on(rules, mesh), _context.estimating():
                return jax.jit(step).trace(*placed).jaxpr
        except (ValueError, TypeError) as e:  # a size the model refuses, named by its error
            return e

    def price(
        self,
        rules: dict,
        mesh: dict[str, int],
        step: Callable[..., Any],
        placed: tuple,
        strategy: dict[str, Any],
    ) -> Candidate | Exception:
        """The candidate of ``step`` (``strategy`` bound) on ``mesh``: its report, matmuls and
        costs, or the error its trace raised."""
        try:
            with self._on(rules, mesh):
                report = explain(step, *placed, hardware=self.hw)
                mm = matmuls(step, placed, self.hw)
        except (ValueError, TypeError) as e:  # a size the model refuses, named by its error
            return e
        c = costs(report, mm, self.hw, mesh, self.overlap, self.bandwidths)
        budget = self.budget
        fits = None if c.memory_bytes is None or budget is None else c.memory_bytes <= budget
        idle = idle_axes(report, placed, mesh)
        made = Candidate(dict(mesh), rules, report, c, fits, placed, idle, dict(strategy))
        return with_tracer(made, self)

    @staticmethod
    def _on(rules: dict, mesh: dict[str, int]) -> Any:
        stack = contextlib.ExitStack()
        stack.enter_context(jax.sharding.use_abstract_mesh(_meshes.abstract_mesh(mesh)))
        stack.enter_context(_rules.axis_rules(rules))
        return stack


class _Program:
    """A strategy's program on one mesh (kept alive while the mesh's strategies are compared,
    so `strategies.fingerprint`'s reprs of distinct objects stay distinct), the strategies
    that traced to the same program, and its candidate once priced."""

    def __init__(self, jaxpr: Any, strategy: dict[str, Any]) -> None:
        self.jaxpr = jaxpr
        self.strategy = strategy
        self.equivalent: list[dict[str, Any]] = []
        self.candidate: Candidate | None = None
        self._outline: tuple | None = None
        self._fingerprint: bytes | None = None

    def same_as(self, other: _Program) -> bool:
        """Whether the two are one program: their outlines (the primitives, in order: cheap)
        first, their fingerprints (exact) only when the outlines agree."""
        return self.outline == other.outline and self.fingerprint == other.fingerprint

    def merged(self, tracer: _Tracer) -> Candidate:
        """The candidate, with the strategies that traced to the same program."""
        assert self.candidate is not None
        if not self.equivalent:
            return self.candidate
        c = dataclasses.replace(self.candidate, equivalent=tuple(self.equivalent))
        return with_tracer(c, tracer)

    @property
    def outline(self) -> tuple:
        if self._outline is None:
            self._outline = _strategies.outline(self.jaxpr)
        return self._outline

    @property
    def fingerprint(self) -> bytes:
        if self._fingerprint is None:
            self._fingerprint = _strategies.fingerprint(self.jaxpr)
        return self._fingerprint


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
            f"{len(skipped) - len(failed)} skipped before tracing); the first error: "
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
