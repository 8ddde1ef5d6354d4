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
conversions, `_NO_KERNEL`), and the bytes per device (operands and results) of each such
equation but a matmul at ``elementwise_bytes_per_s``. Both read the traced program, before XLA
fuses it: elementwise chains that XLA fuses into one kernel count once per equation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import jax

from .._env import context as _context
from .._env import programs
from .._env.frames import name_stack_of
from .._explain.hardware import Hardware
from .._explain.memory import local_bytes
from .._explain.walk import COLLECTIVE_PRIMITIVES

__all__ = ["PHASES", "Matmuls", "matmuls"]

PHASES = ("forward", "backward")
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

    def add(self, other: Matmuls, times: float = 1.0) -> None:
        for p in PHASES:
            self.flops[p] += other.flops[p] * times
            self.seconds[p] += other.seconds[p] * times
            self.hbm_bound_s[p] += other.hbm_bound_s[p] * times
            self.ops[p] += other.ops[p] * times
            self.overhead_s[p] += other.overhead_s[p] * times

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
    for eqn in program.eqns:
        name = eqn.primitive.name
        back = backward or "transpose" in name_stack_of(eqn)
        phase = PHASES[back]
        inner = programs.sub_programs(eqn)
        if not inner and name not in _NO_KERNEL:
            out.ops[phase] += 1
            out.overhead_s[phase] += _overhead(eqn, hw, name == "dot_general")
        if name == "dot_general":
            flops = float(programs.dot_flops(eqn))
            moved = sum(_bytes(v.aval) for v in (*eqn.invars, *eqn.outvars))
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


def _overhead(eqn: Any, hw: Hardware, matmul: bool) -> float:
    """The overhead seconds of one equation: ``op_overhead_s``, and unless it is a matmul its
    bytes per device at ``elementwise_bytes_per_s``."""
    seconds = hw.op_overhead_s
    if hw.elementwise_bytes_per_s is not None and not matmul:
        atoms = (*eqn.invars, *eqn.outvars)
        moved = sum(local_bytes(v.aval) for v in atoms if not programs.is_literal(v))
        seconds += moved / hw.elementwise_bytes_per_s
    return seconds


def _bytes(aval: Any) -> int:
    shape = getattr(aval, "shape", None)
    dtype = getattr(aval, "dtype", None)
    if shape is None or dtype is None:
        return 0
    return math.prod(shape) * dtype.itemsize
