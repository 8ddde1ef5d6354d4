"""The matmuls of a traced step, per phase, each priced by the roofline.

Each ``dot_general`` of the program (scan trip counts multiplied in; a ``cond`` at its
costliest branch, as `shardlib.explain` counts FLOPs) takes ``max(FLOPs / peak FLOP/s, bytes /
HBM bytes/s)`` seconds, its bytes being its operands and its result (per device: inside
``shard_map`` the blocks). An equation is in the **backward** phase when it was made by
differentiation (``transpose`` in its name stack, or in an enclosing equation's), else in the
**forward** phase. Reads the program through the one adapter, `shardlib._env.programs`.

Two more terms, each 0 unless the hardware sets it (`shardlib.calibrate` does; no preset
does), go to the same phase as **overhead**: ``op_overhead_s`` per kernel-launching equation
run (matmuls included, trip counts multiplied in; not a sub-program's container, a collective,
or an equation that compiles to nothing or folds into its reader: reshapes, broadcasts,
conversions, `_NO_KERNEL`), and the bytes per device each such equation but a matmul moves
at ``elementwise_bytes_per_s``. Both model XLA's loop fusion on the traced program
(`_Fusion`): an elementwise equation read only by elementwise equations or reductions in its
program, and not its result, runs inside its readers' kernel: no launch, nothing written, and
its readers read its operands instead of its result; so a chain of elementwise equations costs
one launch and the bytes of its inputs and its last result.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import jax

from .._env import context as _context
from .._env import programs
from .._env.context import aval_varying
from .._env.frames import name_stack_of
from .._explain.hardware import Hardware
from .._explain.memory import local_bytes
from .._explain.walk import COLLECTIVE_PRIMITIVES

__all__ = ["PHASES", "Matmuls", "matmuls"]

PHASES = ("forward", "backward")
# Elementwise primitives XLA fuses into one loop kernel with their readers, the reductions
# that take such a chain as their input, and the changes of shape or type between them.
# fmt: off
_ELEMENTWISE = frozenset({
    "add", "sub", "mul", "div", "neg", "max", "min", "abs", "sign", "exp", "exp2", "log",
    "log1p", "expm1", "tanh", "logistic", "sqrt", "rsqrt", "cbrt", "pow", "integer_pow",
    "square", "select_n", "clamp", "eq", "ne", "lt", "le", "gt", "ge", "and", "or", "not",
    "xor", "erf", "erfc", "erf_inv", "sin", "cos", "tan", "floor", "ceil", "round",
    "is_finite", "nextafter", "rem", "atan2", "add_any",
})
_REDUCTIONS = frozenset({"reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "argmax", "argmin"})
_TRANSPARENT = frozenset({
    "reshape", "squeeze", "expand_dims", "broadcast_in_dim", "convert_element_type",
    "reduce_precision",
})
# fmt: on
_CASTS = ("pvary", "pcast")
_GATHERS = ("all_gather", "all_gather_invariant")
# Equations that launch no kernel of their own: collectives (priced as communication),
# bookkeeping that compiles to nothing, and the changes of shape or type that XLA folds into
# the kernel that reads them.
_NO_KERNEL = COLLECTIVE_PRIMITIVES | {
    "pvary",
    "name",
    "stop_gradient",
    "reshape",
    "squeeze",
    "expand_dims",
    "broadcast_in_dim",
    "convert_element_type",
    "reduce_precision",
    "iota",
    "axis_index",
}


@dataclass
class Matmuls:
    """Per phase: matmul FLOPs, roofline seconds, and the seconds of the equations whose
    bytes bind (memory-bound: ``bytes / HBM > FLOPs / peak``)."""

    flops: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    hbm_bound_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    # Per phase: equations run, and the seconds of the overhead terms (``op_overhead_s`` per
    # equation, other equations' bytes at ``elementwise_bytes_per_s``; 0 when neither is set).
    ops: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    overhead_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    # The same terms by the manual axes each equation's values vary over (their types inside
    # ``shard_map``; none outside), for `shardlib._plan.screen` to scale to another mesh:
    # each matmul (phase, FLOPs, the axes its result varies over, (bytes, axes) of each
    # operand and result) -> times run; (phase, the axes its result varies over) -> [ops,
    # overhead seconds].
    dots: dict[tuple, float] = field(default_factory=dict)
    overhead_by: dict[tuple[str, frozenset[str]], list[float]] = field(default_factory=dict)

    def add(self, other: Matmuls, times: float = 1.0) -> None:
        for p in PHASES:
            self.flops[p] += other.flops[p] * times
            self.seconds[p] += other.seconds[p] * times
            self.hbm_bound_s[p] += other.hbm_bound_s[p] * times
            self.ops[p] += other.ops[p] * times
            self.overhead_s[p] += other.overhead_s[p] * times
        for key, n in other.dots.items():
            self.dots[key] = self.dots.get(key, 0.0) + n * times
        for key, (ops, seconds) in other.overhead_by.items():
            mine = self.overhead_by.setdefault(key, [0.0, 0.0])
            mine[0] += ops * times
            mine[1] += seconds * times

    @property
    def total_s(self) -> float:
        return sum(self.seconds.values())

    def phase_s(self, phase: str) -> float:
        """Compute seconds of ``phase``: its matmuls' roofline and its overhead."""
        return self.seconds[phase] + self.overhead_s[phase]


def matmuls(step: Any, args: tuple, hw: Hardware) -> Matmuls:
    """The matmuls of ``step(*args)`` on ``hw``, traced as `shardlib.explain` traces it (the
    same context: JAX's trace cache gives the program back without tracing again)."""
    with _context.estimating():
        traced = jax.jit(step).trace(*args)
    return _walk(programs.open_program(traced.jaxpr), hw, backward=False)


def _walk(program: Any, hw: Hardware, backward: bool) -> Matmuls:
    out = Matmuls()
    # A value made varying by ``pvary``/``pcast`` (a replicated weight entering a matmul of
    # data-varying activations) holds the same block as its input, and an all-gather's result
    # (typed varying over the axes it gathers) holds them whole: their bytes scale with the
    # axes the input varies over, less those gathered.
    cast: dict[Any, frozenset[str]] = {}

    def varying(atom: Any) -> frozenset[str]:
        got = cast.get(atom) if not programs.is_literal(atom) else None
        return got if got is not None else _varying(atom)

    fused = _Fusion(program)
    for index, eqn in enumerate(program.eqns):
        name = eqn.primitive.name
        if name in _CASTS:
            for a, b in zip(eqn.invars, eqn.outvars, strict=False):
                cast[b] = varying(a)
        elif name in _GATHERS:  # typed varying over the axes it gathers: it holds them whole
            gathered = set(programs.collective_axes(eqn))
            for a, b in zip(eqn.invars, eqn.outvars, strict=False):
                cast[b] = varying(a) - gathered
        back = backward or "transpose" in name_stack_of(eqn)
        phase = PHASES[back]
        inner = programs.sub_programs(eqn)
        if not inner and name not in _NO_KERNEL:
            absorbed = fused.absorbed(index)
            seconds = _overhead(eqn, hw, name == "dot_general", fused, absorbed)
            out.ops[phase] += 0 if absorbed else 1
            out.overhead_s[phase] += seconds
            mine = out.overhead_by.setdefault((phase, _varying(eqn.outvars[0])), [0.0, 0.0])
            mine[0] += 0 if absorbed else 1
            mine[1] += seconds
        if name == "dot_general":
            flops = float(programs.dot_flops(eqn))
            atoms = (*eqn.invars, *eqn.outvars)
            moved = sum(_bytes(v.aval) for v in atoms)
            key = (
                phase,
                flops,
                _varying(eqn.outvars[0]),
                tuple((_bytes(v.aval), varying(v)) for v in atoms),
            )
            out.dots[key] = out.dots.get(key, 0.0) + 1
            math_s = flops / hw.flops_per_s
            hbm_s = 0.0 if hw.hbm_bytes_per_s is None else moved / hw.hbm_bytes_per_s
            out.flops[phase] += flops
            out.seconds[phase] += max(math_s, hbm_s)
            out.hbm_bound_s[phase] += hbm_s if hbm_s > math_s else 0.0
            continue
        subs = [_walk(sub, hw, back) for sub in inner]
        if not subs:
            continue
        if name == "cond":  # one branch runs: the costliest
            out.add(max(subs, key=lambda m: m.total_s + sum(m.overhead_s.values())))
            continue
        times = programs.scan_parts(eqn).length if name == "scan" else 1
        for sub in subs:
            out.add(sub, times)
    return out


def _overhead(eqn: Any, hw: Hardware, matmul: bool, fused: _Fusion, absorbed: bool) -> float:
    """The overhead seconds of one equation: ``op_overhead_s`` unless its kernel is fused into
    its consumers' (`_Fusion`), and unless it is a matmul the bytes per device it moves at
    ``elementwise_bytes_per_s``: the operands not made inside the same fused kernel, and its
    results unless it is fused into its consumers."""
    seconds = 0.0 if absorbed else hw.op_overhead_s
    if hw.elementwise_bytes_per_s is not None and not matmul:
        ins = [v for v in eqn.invars if not programs.is_literal(v) and not fused.in_kernel(v)]
        outs = [] if absorbed else list(eqn.outvars)
        moved = sum(local_bytes(v.aval) for v in (*ins, *outs))
        seconds += moved / hw.elementwise_bytes_per_s
    return seconds


class _Fusion:
    """Which elementwise equations of one program XLA fuses into the kernel of their
    consumers (its loop fusion): an elementwise equation whose every result is read only by
    elementwise equations or reductions (through reshapes, broadcasts and conversions, which
    launch nothing) inside the same program, and is not the program's result, launches no
    kernel and writes nothing; its readers read its operands instead of its results. A model
    of XLA's fusion read from the traced program, not the compiled one: it counts a chain of
    elementwise operations once, as a CPU or an accelerator runs it."""

    def __init__(self, program: Any) -> None:
        self.eqns = list(program.eqns)
        self.producer: dict[Any, int] = {}
        self.readers: dict[Any, list[int]] = {}
        for i, eqn in enumerate(self.eqns):
            for v in eqn.outvars:
                self.producer[v] = i
            for v in eqn.invars:
                if not programs.is_literal(v):
                    self.readers.setdefault(v, []).append(i)
        self.results = {v for v in program.outvars if not programs.is_literal(v)}
        self._absorbed: dict[int, bool] = {}

    def absorbed(self, i: int) -> bool:
        """Whether equation ``i`` is fused into its readers' kernel."""
        if i not in self._absorbed:
            eqn = self.eqns[i]
            self._absorbed[i] = eqn.primitive.name in _ELEMENTWISE and all(
                self._fusible_reads(v) for v in eqn.outvars
            )
        return self._absorbed[i]

    def _fusible_reads(self, v: Any, depth: int = 0) -> bool:
        readers = self.readers.get(v, [])
        if v in self.results or not readers or depth > 8:
            return False
        for r in readers:
            name = self.eqns[r].primitive.name
            if name in _TRANSPARENT:
                if not all(self._fusible_reads(o, depth + 1) for o in self.eqns[r].outvars):
                    return False
            elif name not in _ELEMENTWISE and name not in _REDUCTIONS:
                return False
        return True

    def in_kernel(self, v: Any) -> bool:
        """Whether ``v`` is made inside its reader's fused kernel (never written to memory)."""
        i = self.producer.get(v)
        while i is not None and self.eqns[i].primitive.name in _TRANSPARENT:
            ins = [x for x in self.eqns[i].invars if not programs.is_literal(x)]
            i = self.producer.get(ins[0]) if len(ins) == 1 else None
        return i is not None and self.absorbed(i)


def _varying(atom: Any) -> frozenset[str]:
    """The manual axes a value's type says it varies over (none outside ``shard_map``)."""
    return aval_varying(getattr(atom, "aval", None)) or frozenset()


def _bytes(aval: Any) -> int:
    shape = getattr(aval, "shape", None)
    dtype = getattr(aval, "dtype", None)
    if shape is None or dtype is None:
        return 0
    return math.prod(shape) * dtype.itemsize
