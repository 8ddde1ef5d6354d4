"""The matmuls of a traced step, per phase, each priced by the roofline.

Each ``dot_general`` of the program (scan trip counts multiplied in; a ``cond`` at its
costliest branch, as `shardlib.explain` counts FLOPs) takes ``max(FLOPs / peak FLOP/s, bytes /
HBM bytes/s)`` seconds, its bytes being its operands and its result (per device: inside
``shard_map`` the blocks). An equation is in the **backward** phase when it was made by
differentiation (``transpose`` in its name stack, or in an enclosing equation's), else in the
**forward** phase. Reads the program through the one adapter, `shardlib._env.programs`.
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

__all__ = ["PHASES", "Matmuls", "matmuls"]

PHASES = ("forward", "backward")


@dataclass
class Matmuls:
    """Per phase: matmul FLOPs, roofline seconds, and the seconds of the equations whose
    bytes bind (memory-bound: ``bytes / HBM > FLOPs / peak``)."""

    flops: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    hbm_bound_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))

    def add(self, other: Matmuls, times: float = 1.0) -> None:
        for p in PHASES:
            self.flops[p] += other.flops[p] * times
            self.seconds[p] += other.seconds[p] * times
            self.hbm_bound_s[p] += other.hbm_bound_s[p] * times

    @property
    def total_s(self) -> float:
        return sum(self.seconds.values())


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
        if name == "dot_general":
            flops = float(programs.dot_flops(eqn))
            moved = sum(_bytes(v.aval) for v in (*eqn.invars, *eqn.outvars))
            math_s = flops / hw.flops_per_s
            hbm_s = 0.0 if hw.hbm_bytes_per_s is None else moved / hw.hbm_bytes_per_s
            out.flops[phase] += flops
            out.seconds[phase] += max(math_s, hbm_s)
            out.hbm_bound_s[phase] += hbm_s if hbm_s > math_s else 0.0
            continue
        subs = [_walk(sub, hw, back) for sub in programs.sub_programs(eqn)]
        if not subs:
            continue
        if name == "cond":  # one branch runs: the costliest
            out.add(max(subs, key=lambda m: m.total_s))
            continue
        times = programs.scan_parts(eqn).length if name == "scan" else 1
        for sub in subs:
            out.add(sub, times)
    return out


def _bytes(aval: Any) -> int:
    shape = getattr(aval, "shape", None)
    dtype = getattr(aval, "dtype", None)
    if shape is None or dtype is None:
        return 0
    return math.prod(shape) * dtype.itemsize
