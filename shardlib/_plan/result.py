"""What `shardlib.plan` returns: ranked candidates, the skipped ones with reasons, the table,
and the check of every candidate against the program XLA compiles for it (`Plan.verify`)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding

from .._check.format import byte_str
from .._env import rules as _rules
from .._explain import hlo as _hlo
from .._explain.hardware import Hardware, prime_factors
from .._explain.memory import xla_memory
from .._explain.report import ExplainReport, HloComparison
from .cost import Costs
from .meshes import shape_str
from .strategies import bind, strategy_str

__all__ = [
    "Candidate",
    "Check",
    "Plan",
    "Skipped",
    "Tracer",
    "idle_axes",
    "rank_key",
    "scaled_mesh",
    "with_tracer",
]


# Traces a plan's step on a mesh under rules with a strategy: a `Candidate`, or why not.
Tracer = Callable[[dict, dict[str, int], dict[str, Any]], Any]


@dataclass(frozen=True)
class Candidate:
    """One layout: a mesh (axis -> size, in mesh order), its axis rules (role -> mesh axes, or
    None: replicated; pass them to ``shardlib.axis_rules``), the report traced on it, and the
    predicted costs per device per step (`shardlib._plan.cost`). ``idle``: the mesh's axes
    (of size > 1) that split no argument and carry no collective: the step never names their
    roles, so their devices repeat each other's work (flagged in the table, ranked after the
    layouts without one). ``strategy``: the keyword arguments the step was traced with
    (``plan(..., strategies=)``; empty without), to pass it as ``step(*args, **strategy)``;
    ``equivalent``: the other strategies that traced to the same program on this mesh (the
    same costs: listed here rather than as rows of their own)."""

    mesh: dict[str, int]
    rules: dict[str, tuple[str, ...] | None]
    report: ExplainReport = field(repr=False)
    costs: Costs = field(repr=False)
    fits: bool | None  # peak estimate within the memory budget (None: not estimated)
    args: tuple = field(repr=False, default=())  # the arguments placed on the abstract mesh
    idle: tuple[str, ...] = ()
    strategy: dict[str, Any] = field(default_factory=dict)
    equivalent: tuple[dict[str, Any], ...] = ()
    # Traces the step again on another mesh (`scaled_to`): (rules, mesh, strategy) -> a
    # Candidate or why not. Not a constructor argument: `shardlib.plan` sets it (`with_tracer`).
    _tracer: Tracer | None = field(init=False, repr=False, compare=False, default=None)

    compute_s = property(lambda self: self.costs.compute_s)
    comm_s = property(lambda self: self.costs.comm_s)
    step_s = property(lambda self: self.costs.step_s)
    bytes_sent = property(lambda self: self.costs.bytes_sent)
    memory_bytes = property(lambda self: self.costs.memory_bytes)

    @property
    def shape(self) -> str:
        """``'data=4 x tensor=2'``."""
        return shape_str(self.mesh)

    @property
    def memory_bound(self) -> bool:
        """Whether most of the predicted compute is matmuls bound by memory bandwidth (the
        roofline; needs the hardware's ``hbm_bytes_per_s``)."""
        return self.costs.memory_bound

    @property
    def dominant(self) -> str:
        """What binds the predicted time: ``'compute'`` when the matmuls take at least as long
        as all communication (``'compute (HBM)'`` when they are memory-bound), else the
        costliest collective kind and axes (``'all-reduce over tensor'``)."""
        if not self.costs.comm_by or self.compute_s >= self.comm_s:
            return "compute (HBM)" if self.memory_bound else "compute"
        return max(self.costs.comm_by.items(), key=lambda kv: kv[1])[0]

    def scaled_to(self, devices: int) -> Candidate:
        """This layout on ``devices`` devices: the same axes in the same order and the same
        rules, the sizes divided down (each prime factor of the ratio taken from the largest
        axis it divides, so small axes, a tensor axis bound by a head count, keep their size
        longest; an axis may reach size 1), traced again on that mesh with the same
        ``strategy``. E.g. ``data=256 x t=4`` on 8 devices is ``data=2 x t=4``:
        ``plan.best.scaled_to(8).make_mesh()`` runs on 8 devices, and its ``concrete_args``
        place the arguments there."""
        small = scaled_mesh(self.mesh, devices)
        if self._tracer is None:
            raise ValueError(
                "Candidate.scaled_to: this candidate was not made by shardlib.plan, so it "
                "cannot trace its step again; plan it with mesh_shapes=[...] instead"
            )
        got = self._tracer(self.rules, small, self.strategy)
        if not isinstance(got, Candidate):
            why = got if isinstance(got, str) else f"{type(got).__name__}: {got}"
            raise ValueError(
                f"Candidate.scaled_to({devices}): {self.shape} scaled to {shape_str(small)} "
                f"cannot run the step: {why}"
            )
        return got

    def make_mesh(self, devices: Sequence[Any] | None = None) -> Mesh:
        """A real mesh of this shape (Explicit axes) on ``devices`` (default: all)."""
        devs = list(jax.devices() if devices is None else devices)
        n = int(np.prod(list(self.mesh.values())))
        if len(devs) != n:
            raise ValueError(
                f"Candidate.make_mesh: the mesh {self.shape} needs {n} devices, got {len(devs)}"
            )
        grid = np.array(devs, dtype=object).reshape(tuple(self.mesh.values()))
        return Mesh(grid, tuple(self.mesh), axis_types=(AxisType.Explicit,) * len(self.mesh))

    def concrete_args(self, mesh: Mesh) -> tuple:
        """The arguments laid out on a real ``mesh`` of this shape (for ``jax.jit(...).lower``)."""

        def place(x: Any) -> Any:
            if not isinstance(x, jax.ShapeDtypeStruct) or x.sharding is None:
                return x
            spec = x.sharding.spec  # type: ignore[union-attr]
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec))

        return jax.tree.map(place, self.args)


def with_tracer(c: Candidate, tracer: Tracer) -> Candidate:
    """``c``, able to trace its step again (`Candidate.scaled_to`): the tracer is kept out of
    the constructor and the public fields."""
    object.__setattr__(c, "_tracer", tracer)
    return c


@dataclass(frozen=True)
class Skipped:
    """A mesh that was not ranked, and why: a size that does not divide or arguments over the
    memory budget (``strategy`` empty: skipped before tracing, for every strategy), or a trace
    that failed (with the ``strategy`` it was traced with)."""

    mesh: dict[str, int]
    reason: str
    strategy: dict[str, Any] = field(default_factory=dict)

    @property
    def shape(self) -> str:
        return shape_str(self.mesh)


@dataclass(frozen=True)
class Check:
    """A candidate compiled on real devices (`Plan.verify`): the report against the HLO."""

    candidate: Candidate
    comparison: HloComparison
    # The report's collectives' operand bytes (each instruction once), less the rows XLA ran
    # as one with another (``comparison.merged``) or dropped (``never_run``: zero-trip loops).
    predicted_bytes: int
    hlo_bytes: int  # the compiled HLO's collectives' operand bytes (each instruction once)
    memory_ratio: float | None  # the estimated peak over XLA's total (memory_analysis)
    compiled: Any = field(repr=False)


@dataclass
class Plan:
    """The ranked layouts of one model (`shardlib.plan`): ``candidates`` best first (those
    whose memory fits the budget first, then by predicted step time), ``skipped`` with reasons,
    ``best`` (``best.strategy``: the keyword arguments to give the step, when ``strategies``
    were searched); ``str()`` / ``markdown()`` for the table."""

    step: Callable[..., Any] = field(repr=False)
    devices: int | None
    hardware: Hardware
    memory_budget: float | None
    overlap: float
    candidates: list[Candidate]
    skipped: list[Skipped]
    seconds: float  # planning wall time
    # name -> the values tried (``plan(..., strategies=)``; empty without).
    strategies: dict[str, tuple[Any, ...]] = field(default_factory=dict)
    # (mesh, strategy) pairs estimated by the screen and not traced (``plan(screen=)``): in
    # ``skipped``, each with its estimate.
    screened: int = 0

    @property
    def warnings(self) -> list[str]:
        """What the table's reader must know first: no candidate fits the memory budget; a
        mesh axis splits nothing on any candidate (its roles are never named by the step)."""
        out = []
        if self.candidates and all(c.fits is False for c in self.candidates):
            least = min(c.memory_bytes or 0 for c in self.candidates)
            out.append(
                f"no candidate fits the memory budget of {byte_str(int(self.memory_budget or 0), 1)}"
                f" per device: the least memory is {byte_str(least, 1)}; candidates are ranked "
                "by how far over the budget they are (a larger budget, more devices, or remat)"
            )
        idle = [c.idle for c in self.candidates if c.idle]
        for axis in dict.fromkeys(a for axes in idle for a in axes):
            with_axis = [c for c in self.candidates if c.mesh.get(axis, 1) > 1]
            if with_axis and all(axis in c.idle for c in with_axis):
                out.append(
                    f"mesh axis {axis!r} splits no argument and carries no collective on any "
                    "candidate: the step never names the roles it carries, so its devices "
                    "repeat the same work (those layouts rank after the others); drop the "
                    "axis or move its roles to an axis the step uses"
                )
        return out

    @property
    def best(self) -> Candidate:
        if not self.candidates:
            raise ValueError(
                f"Plan.best: no candidate could be traced ({len(self.skipped)} skipped); see "
                "plan.skipped for the reasons"
            )
        return self.candidates[0]

    def markdown(self, top: int | None = None) -> str:
        """The ranked table (``top`` rows), then the skipped meshes with their reasons."""
        return "\n".join(_table(self, top))

    def __str__(self) -> str:
        return self.markdown(top=20)

    def verify(self, devices: Sequence[Any] | None = None) -> list[Check]:
        """Compile every candidate on a real mesh of ``devices`` (default ``jax.devices()``;
        the plan must be for that many) and check it: the report's collectives against the
        compiled HLO's (`ExplainReport.compare_hlo`) and its memory estimate against XLA's
        ``memory_analysis()``."""
        return [self._check(c, devices) for c in self.candidates]

    def _check(self, c: Candidate, devices: Sequence[Any] | None) -> Check:
        mesh = c.make_mesh(devices)
        step = bind(self.step, c.strategy)
        with jax.set_mesh(mesh), _rules.axis_rules(c.rules):
            compiled = jax.jit(step).lower(*c.concrete_args(mesh)).compile()
        text = compiled.as_text() or ""
        comparison = c.report.compare_hlo(text)
        found, _ = _hlo.collectives(text)
        xla, _ = xla_memory(compiled)
        peak = c.report.memory.peak
        ratio = None if xla is None or peak is None or not xla.total else peak / xla.total
        return Check(
            candidate=c,
            comparison=comparison,
            predicted_bytes=_predicted_bytes(c.report, comparison),
            hlo_bytes=sum(sum(h.parts) for h in found),
            memory_ratio=ratio,
            compiled=compiled,
        )


def scaled_mesh(mesh: dict[str, int], devices: int) -> dict[str, int]:
    """``mesh``'s axes, in order, with sizes multiplying to ``devices`` (`Candidate.scaled_to`):
    each prime factor of the ratio, largest first, divides the largest axis it divides."""
    n = math.prod(mesh.values())
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
        raise ValueError(f"Candidate.scaled_to: devices={devices!r} must be a positive int")
    if n % devices:
        raise ValueError(
            f"Candidate.scaled_to: devices={devices} must divide the {n} devices of "
            f"{shape_str(mesh)} (the sizes are divided down, never changed otherwise)"
        )
    sizes = dict(mesh)
    for p in sorted(prime_factors(n // devices), reverse=True):
        axis = max((a for a in sizes if sizes[a] % p == 0), key=lambda a: sizes[a])
        sizes[axis] //= p
    return sizes


def idle_axes(report: ExplainReport, args: tuple, mesh: dict[str, int]) -> tuple[str, ...]:
    """The axes of ``mesh`` (size > 1) that split none of ``args`` (placed on the mesh) and
    carry none of the report's collectives: nothing the step does uses them."""
    used = {a for c in report.collectives for a in c.axes}
    for x in jax.tree.leaves(args):
        spec = getattr(getattr(x, "sharding", None), "spec", None) or ()
        for entry in spec:
            used.update(entry if isinstance(entry, tuple) else (entry,))
    return tuple(a for a, n in mesh.items() if n > 1 and a not in used)


def rank_key(c: Candidate, budget: float | None) -> tuple:
    """Fitting the budget first (then not estimated, then over it); then the layouts with no
    idle axis; those over the budget by how far over; then by predicted step time."""
    order = {True: 0, None: 1, False: 2}[c.fits]
    over = 0 if c.fits is not False or budget is None else (c.memory_bytes or 0) - budget
    return (order, bool(c.idle), over, c.step_s)


def _predicted_bytes(report: ExplainReport, comparison: HloComparison) -> int:
    gone = {id(r) for r in (*comparison.merged, *comparison.never_run)}
    return sum(r.operand_bytes for r in report.collectives if id(r) not in gone)


def _secs(s: float) -> str:
    return f"{s * 1e3:.3g} ms" if s >= 1e-3 else f"{s * 1e6:.3g} us"


def _table(plan: Plan, top: int | None) -> list[str]:
    budget = "no budget" if plan.memory_budget is None else byte_str(int(plan.memory_budget), 1)
    lines = [f"**Warning: {w}.**" for w in plan.warnings]
    lines += [""] if lines else []
    merged = sum(len(c.equivalent) for c in plan.candidates)
    same = f" ({merged} more strategies traced to a ranked program)" if merged else ""
    screened = (
        f" ({plan.screened} of them estimated by the screen and not traced)"
        if plan.screened
        else ""
    )
    lines += [
        f"Layouts of {getattr(plan.step, '__qualname__', 'step')} on "
        f"{plan.devices or 'the given'} devices of {plan.hardware.name} (memory budget "
        f"{budget}; overlap {plan.overlap:g}); {len(plan.candidates)} ranked{same}, "
        f"{len(plan.skipped)} skipped{screened}, planned in {plan.seconds:.1f} s",
        "",
    ]
    # The strategy column, when strategies were searched.
    col = (lambda cell: f" {cell} |") if plan.strategies else (lambda cell: "")
    rule = "---|" if plan.strategies else ""
    lines += [
        f"| rank | mesh |{col('strategy')} step | compute | communication | dominant "
        "| sent/device | memory (est.) | fits |",
        f"|---:|---|{rule}---:|---:|---:|---|---:|---:|---|",
    ]
    for i, c in enumerate(plan.candidates[:top], 1):
        mem = "?" if c.memory_bytes is None else byte_str(c.memory_bytes, 1)
        fits = {True: "yes", False: "**no**", None: "?"}[c.fits]
        idle = f" (idle: {', '.join(c.idle)})" if c.idle else ""
        lines.append(
            f"| {i} | {c.shape}{idle} |{col(_strategy_cell(c))} {_secs(c.step_s)} | "
            f"{_secs(c.compute_s)} | {_secs(c.comm_s)} | {c.dominant} | "
            f"{byte_str(c.bytes_sent, 1)} | {mem} | {fits} |"
        )
    if plan.candidates:
        rules = {k: v for k, v in plan.best.rules.items() if v is not None}
        lines += ["", f"Top layout's rules (for shardlib.axis_rules): {rules}"]
        if plan.strategies:
            lines.append(f"Top layout's strategy (step(*args, **strategy)): {plan.best.strategy}")
    if plan.skipped:
        lines += ["", f"| skipped mesh |{col('strategy')} why |", f"|---|{rule}---|"]
        lines += [
            f"| {s.shape} |{col(_cell(strategy_str(s.strategy)) or 'every')} {s.reason} |"
            for s in plan.skipped
        ]
    return lines


def _strategy_cell(c: Candidate) -> str:
    """``remat=True (same program: remat=False)``: the strategy, and those that traced to
    the same program."""
    same = "; ".join(strategy_str(e) for e in c.equivalent)
    return _cell(strategy_str(c.strategy) + (f" (same program: {same})" if same else ""))


def _cell(text: str) -> str:
    return text.replace("|", "\\|")
