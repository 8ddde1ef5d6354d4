"""``shardlib.plan``: trace a step on every candidate mesh (abstract: no devices) and rank."""

from __future__ import annotations

import contextlib
import dataclasses
import math
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
from . import screen as _screen_mod
from . import strategies as _strategies
from .cost import costs
from .meshes import shape_str
from .result import Candidate, Plan, Skipped, idle_axes, rank_key, with_tracer
from .roofline import Matmuls, matmuls

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
    screen: int | None = 32,
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
    - `screen`: when more (mesh, strategy) pairs than this (default 32) are to be traced,
      screen them: one mesh per set of axes is traced (with every strategy), every other
      pair estimated from the traced mesh of its axes nearest to it (`shardlib._plan.screen`:
      each term scaled by the sizes), and the best estimate traced next (with the strategies
      that traced to one program on the probe), until ``screen`` meshes were traced (at least
      ``screen // 3`` besides the probes). Only traced candidates are ranked; the others are
      ``skipped`` with their estimates (``Plan.screened`` counts them). None: trace every
      pair.

    **Returns:** a `Plan`: ``candidates`` ranked (fitting the budget first, then those whose
    every axis splits something, then by predicted step time, ties in the order enumerated;
    those over the budget by how far over), ``skipped``, ``best`` (``best.rules`` for
    ``shardlib.axis_rules``, ``best.strategy`` for the step, ``best.make_mesh()``,
    ``best.scaled_to(8)`` to try it on 8 devices), ``warnings`` (nothing fits; an axis that
    splits nothing), ``markdown()`` (the warnings first), and ``verify()`` to compile each
    candidate on real devices and compare.

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
    _check_screen(screen)
    combos = _strategies.combinations(step, len(args), strategies)
    budget = hw.memory_bytes if memory_budget is None else memory_budget
    tracer = _Tracer(step, args, in_specs, hw, overlap, bandwidths, budget)
    start = time.perf_counter()
    skipped: list[Skipped] = []
    run = _Run(tracer, combos, [_strategies.bind(step, s) for s in combos], skipped)
    placed = _place(tracer, shapes, axes, roles, budget, skipped)
    screened = 0
    if screen is not None and len(placed) * len(combos) > screen:
        screened = _Screen(run).run_on(placed, screen)
    else:
        for entry in placed:
            run.trace_mesh(entry, range(len(combos)))
    ranked = run.ranked
    _refuse_when_nothing_traced(ranked, skipped, run.failed)
    order = {tuple(m.items()): i for i, m in enumerate(shapes)}
    skipped.sort(key=lambda s: order[tuple(s.mesh.items())])  # mesh order, as enumerated
    # Ties (equal costs) in the order enumerated, so the ranking never depends on what was
    # traced first (the screen traces out of order).
    ranked.sort(
        key=lambda c: (*rank_key(c, budget), order[tuple(c.mesh.items())], combos.index(c.strategy))
    )
    seconds = time.perf_counter() - start
    tried = {k: tuple(v) for k, v in (strategies or {}).items()}
    return Plan(step, devices, hw, budget, overlap, ranked, skipped, seconds, tried, screened)


@dataclass
class _Placed:
    """A mesh to trace: its rules, and the arguments placed on it and their bytes per
    device."""

    mesh: dict[str, int]
    rules: dict
    args: tuple
    args_bytes: int


@dataclass
class _Run:
    """One plan's tracing: the programs priced so far per mesh (the strategies that traced to
    the same program on a mesh are one candidate) and the errors of failed traces."""

    tracer: _Tracer
    combos: list[dict[str, Any]]
    steps: list[Callable[..., Any]]  # one callable per strategy: one trace each
    skipped: list[Skipped]
    programs: dict[tuple, list[_Program]] = dataclasses.field(default_factory=dict)
    failed: list[Exception] = dataclasses.field(default_factory=list)

    @property
    def ranked(self) -> list[Candidate]:
        return [p.merged(self.tracer) for ps in self.programs.values() for p in ps]

    def trace_mesh(self, entry: _Placed, which: Sequence[int]) -> dict[int, _Program]:
        """Trace and price ``entry``'s mesh with the strategies ``which``; one that traces to
        a program already priced on this mesh joins its candidate. Returns each strategy's
        program (those whose trace failed: none, and a skipped row)."""
        priced = self.programs.setdefault(tuple(entry.mesh.items()), [])
        by: dict[int, _Program] = {}
        for i in which:
            strategy, bound = self.combos[i], self.steps[i]
            got = self.tracer.trace(entry.rules, entry.mesh, bound, entry.args)
            if not isinstance(got, Exception):
                program = _Program(got, strategy)
                twin = next((p for p in priced if p.same_as(program)), None)
                if twin is not None:
                    twin.equivalent.append(strategy)  # the same program: priced once
                    by[i] = twin
                    continue
                got = self.tracer.price_parts(entry.rules, entry.mesh, bound, entry.args, strategy)
                if not isinstance(got, Exception):
                    program.candidate, program.matmuls = got
                    priced.append(program)
                    by[i] = program
                    continue
            self.failed.append(got)
            self.skipped.append(
                Skipped(entry.mesh, f"{type(got).__name__}: {_first_line(got)}", strategy)
            )
        return by


def _classes(by: dict[int, _Program]) -> list[tuple[tuple[int, ...], _Program]]:
    """The strategies of ``by`` grouped by their program: (indices, program) each."""
    out: list[tuple[tuple[int, ...], _Program]] = []
    for i, program in by.items():
        k = next((j for j, (_, p) in enumerate(out) if p is program), None)
        if k is None:
            out.append(((i,), program))
        else:
            out[k] = ((*out[k][0], i), program)
    return out


class _Screen:
    """`plan(screen=)`: per set of axes a probe traced, every other (mesh, strategies)
    estimated from the nearest traced mesh of its axes and strategies (`shardlib._plan.screen`),
    and the best estimate traced next, again and again: each trace is one more mesh to
    estimate from, so the estimates near the top sharpen as the screen goes."""

    def __init__(self, run: _Run) -> None:
        self.run = run
        # (axes, strategy indices that traced to one program on the probe) -> traced probes
        self.probes: dict[tuple, list[_screen_mod.Probe]] = {}
        # (mesh, strategy indices) -> the mesh and those indices, not traced yet
        self.pending: dict[tuple, tuple[_Placed, tuple[int, ...]]] = {}
        # the same keys -> (the estimate, the traced candidate it came from)
        self.guesses: dict[tuple, tuple[Candidate, Candidate]] = {}
        self.traced = 0
        self.left_out = 0

    def run_on(self, placed: list[_Placed], keep: int) -> int:
        """Screen ``placed`` in ``keep`` traces (the probes first; at least ``keep // 3`` of
        the best estimates besides them). Returns how many (mesh, strategy) pairs were left
        out, each a skipped row with its estimate."""
        groups: dict[tuple[str, ...], list[_Placed]] = {}
        for entry in placed:
            groups.setdefault(tuple(entry.mesh), []).append(entry)
        for axes, entries in groups.items():
            self._probe(axes, entries)
        for _ in range(max(keep - self.traced, keep // 3)):
            if not self.pending:
                break
            budget = self.run.tracer.budget
            key = min(self.pending, key=lambda k: rank_key(self.guesses[k][0], budget))
            entry, cls = self.pending.pop(key)
            del self.guesses[key]
            self._learn(tuple(entry.mesh), cls, self.run.trace_mesh(entry, cls))
        for key, (entry, cls) in self.pending.items():
            guess, probe = self.guesses[key]  # every pending pair has one from its probe
            for i in cls:
                self.run.skipped.append(
                    Skipped(
                        entry.mesh,
                        f"not traced: the screen estimates {_secs(guess.step_s)} per step "
                        f"from {probe.shape} (the same axes, traced), behind the estimates "
                        "it traced (plan(screen=None) traces every mesh)",
                        self.run.combos[i],
                    )
                )
                self.left_out += 1
        return self.left_out

    def _probe(self, axes: tuple[str, ...], entries: list[_Placed]) -> None:
        """Trace the most even mesh of ``axes`` with every strategy (the next one for the
        strategies whose trace failed, `_PROBE_TRIES` meshes at most) and estimate the
        others from it."""
        rest = list(entries)
        open_ = list(range(len(self.run.combos)))
        tries: list[str] = []
        while open_ and rest and len(tries) < _PROBE_TRIES:
            entry = rest.pop(_screen_mod.probe_index([e.mesh for e in rest]))
            tries.append(shape_str(entry.mesh))
            by = self.run.trace_mesh(entry, open_)
            for cls, _ in _classes(by):
                open_ = [i for i in open_ if i not in cls]
                for other in rest:
                    self.pending[(tuple(other.mesh.items()), cls)] = (other, cls)
            self._learn(axes, None, by)
        for other in rest:  # strategies whose probes all failed: nothing to estimate from
            for i in open_:
                self.run.skipped.append(
                    Skipped(
                        other.mesh,
                        f"not traced: the screen's probes of the same axes ({'; '.join(tries)}) "
                        "failed to trace (their rows say why; plan(screen=None) traces every "
                        "mesh)",
                        self.run.combos[i],
                    )
                )
                self.left_out += 1

    def _learn(
        self, axes: tuple[str, ...], cls: tuple[int, ...] | None, by: dict[int, _Program]
    ) -> None:
        """Keep what ``by`` traced on a mesh of ``axes`` as probes, each under the strategy
        classes it serves (``cls``, the class traced; None: a probe, whose classes are its
        programs'), and estimate again the pending meshes of those classes."""
        self.traced += 1
        tracer = self.run.tracer
        served: set[tuple] = set()
        for got, program in _classes(by):
            assert program.candidate is not None and program.matmuls is not None
            c = program.candidate
            args_bytes = sum(b for _, b in argument_bytes(c.args, {}))
            probe = _screen_mod.Probe.of(c, program.matmuls, args_bytes)
            for key in {(axes, got)} | ({(axes, cls)} if cls is not None else set()):
                if set(key[1]) & set(got):
                    self.probes.setdefault(key, []).append(probe)
                    served.add(key)
        for key, (entry, k) in self.pending.items():
            if (tuple(entry.mesh), k) not in served:
                continue
            probes = self.probes[(tuple(entry.mesh), k)]
            probe = min(probes, key=lambda p: _distance(p.candidate.mesh, entry.mesh))
            costs_ = _screen_mod.estimate(
                probe, entry.mesh, entry.args_bytes, tracer.hw, tracer.overlap, tracer.bandwidths
            )
            # Optimistic on memory: an estimate that fits with slack is traced if its time
            # ranks it there (the trace decides), rather than never traced for a guess.
            budget = tracer.budget
            fits = (
                None
                if costs_.memory_bytes is None or budget is None
                else costs_.memory_bytes <= budget * _MEMORY_SLACK
            )
            guess = dataclasses.replace(probe.candidate, mesh=entry.mesh, costs=costs_, fits=fits)
            self.guesses[key] = (guess, probe.candidate)


def _distance(a: Mapping[str, int], b: Mapping[str, int]) -> float:
    """How far two meshes over the same axes are: the sum of their sizes' log ratios."""
    return sum(abs(math.log(a[x] / b[x])) for x in a)


# Meshes of one set of axes tried as its probe before the screen gives up on the set.
_PROBE_TRIES = 3
# How far over the memory budget an estimate may be and still count as fitting when the
# screen picks what to trace next (its memory estimates were within 30% in the tests).
_MEMORY_SLACK = 1.3


def _secs(s: float) -> str:
    return f"{s * 1e3:.3g} ms" if s >= 1e-3 else f"{s * 1e6:.3g} us"


def _check_screen(screen: object) -> None:
    if screen is not None and (
        isinstance(screen, bool) or not isinstance(screen, int) or screen < 1
    ):
        raise ValueError(
            f"plan: screen={screen!r} must be a positive int (the most (mesh, strategy) "
            "candidates to trace before screening the others) or None (trace every one)"
        )


def _place(
    tracer: _Tracer,
    shapes: list[dict[str, int]],
    axes: Mapping[str, Sequence[str]],
    roles: Sequence[str],
    budget: float | None,
    skipped: list[Skipped],
) -> list[_Placed]:
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
        out.append(_Placed(mesh, rules, placed, sum(b for _, b in argument_bytes(placed, {}))))
    if budget is not None and any(o.args_bytes <= budget for o in out):
        for o in out:
            if o.args_bytes > budget:
                skipped.append(
                    Skipped(
                        o.mesh,
                        f"the arguments alone take {byte_str(o.args_bytes, 1)} per device, over "
                        f"the memory budget of {byte_str(int(budget), 1)} (not traced)",
                    )
                )
        out = [o for o in out if o.args_bytes <= budget]
    return out


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
        got = self.price_parts(rules, mesh, step, placed, strategy)
        return got if isinstance(got, Exception) else got[0]

    def price_parts(
        self,
        rules: dict,
        mesh: dict[str, int],
        step: Callable[..., Any],
        placed: tuple,
        strategy: dict[str, Any],
    ) -> tuple[Candidate, Matmuls] | Exception:
        """`price`, with the matmuls it was priced from (a probe of `shardlib._plan.screen`
        scales them)."""
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
        return with_tracer(made, self), mm

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
        self.matmuls: Matmuls | None = None
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
