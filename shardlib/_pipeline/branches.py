"""What may communicate inside a stage of the memory-bounded schedules (1F1B, interleaved,
ZB-H1), and the refusals of what may not.

Those schedules run a stage's work for one tick in a ``lax.switch`` branch chosen by the
stage's row of the tick table: the devices of one stage (one index along the stage axis) take
the same branch, the devices of other stages another one, or none. A collective inside a
branch is right only if every device that takes part in it takes the same branch:

- A collective with replica groups (``psum``, ``pmax``/``pmin``, ``all_gather``,
  ``psum_scatter``, ``all_to_all``, their unreduced/reduced forms) over axes other than the
  stage axis has groups that lie inside one stage's devices: all of them take the branch, and
  XLA meets them in one group. These are safe, on XLA:CPU and by XLA's semantics for
  GPU/TPU (a collective runs when all of its group's devices reach it).
- A ``collective-permute`` (``ppermute``, ``shardops.shift``, ``attention.ring``) has no
  replica groups: XLA forms one rendezvous over every device of the program, and on XLA:CPU
  every permute carries the same channel, so a permute in one stage's branch is paired with
  whatever permute the devices of the other stages run at that moment (the tick's own
  stage-to-stage shift): wrong values, or a deadlock the runtime aborts. Nothing in XLA's
  semantics makes it safe on GPU/TPU either. Refused.
- Anything over the stage axis mixes microbatches and stages: refused (a collective the
  other stages never reach deadlocks).
- A communicating primitive not listed here: refused, as not proven safe.

`check_branch_program` reads a traced ``stage_fn`` or ``loss_fn`` program through the one
adapter (`shardlib._env.programs`). `check_functions` runs it on both, after refusing what
the schedules' custom_vjp cannot differentiate: forward mode, and a closure over a value
being differentiated. `check_backwards` runs it on their backward programs, traced, when the
schedule is differentiated: a ``custom_vjp`` whose backward rule alone communicates is seen
there (its forward program does not hold the rule). `check_loss_axes` refuses a loss that
varies over an axis the stage or the loss communicates over: the schedule computes the
gradients before it knows the loss's cotangent, which is exact there only if that cotangent
is the same on every device of the axis, and JAX's types cannot show it. May import
`shardlib._env`, `shardlib._check.format`, `.arguments` (messages) and `.stage`
(`hashable`) only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from .._check.format import dtype_name
from .._env import collectives, programs
from .._env import frames as _frames
from .._env.collectives import GROUPED
from .._env.context import differentiated, forward_mode, vary_over, varying_axes
from .arguments import op_name, stage_collective_error
from .stage import hashable

__all__ = [
    "GROUPED",
    "check_backwards",
    "check_branch_program",
    "check_functions",
    "check_loss_axes",
    "check_loss_fn",
]

# What a stage or loss communicates over, besides the stage axis: per mesh axis, the first
# collective found, as a message names it ("`stage_fn` runs `all_gather` at model.py:12").
Communicated = dict[str, str]


def check_branch_program(
    fn: str, arg: str, program: Any, axis: str, backward: bool = False
) -> Communicated:
    """Refuse a traced ``stage_fn`` or ``loss_fn`` (``arg``; ``backward``: the program of its
    backward) of schedule function ``fn`` that communicates over the stage ``axis`` or runs a
    collective that is not safe in a per-stage branch (see the module docstring); return what
    it communicates over."""
    who = f"`{arg}`'s backward" if backward else f"`{arg}`"
    found: Communicated = {}
    for eqn in collectives.collectives(program):
        name = eqn.primitive.name
        written = collectives.written_name(name)
        stack = _frames.name_stack_of(eqn)
        where = _frames.location_of_traceback(getattr(eqn.source_info, "traceback", None))
        at = f" at {where}" if where else ""
        what = op_name(written, stack)
        axes = collectives.axis_names(eqn)
        if axis in axes and arg == "stage_fn":
            message = stage_collective_error(fn, axis, written, stack, where)
            raise ValueError(message.replace(f"`{arg}`", who, 1))
        if axis in axes:
            raise ValueError(
                f"{fn}: {who} must not communicate over the stage axis {axis!r}, but it runs "
                f"{what}{at}: the loss of a microbatch is computed on the last stage only, "
                f"while the other stages do other work, so the collective never completes "
                f"(a deadlock). Reduce over {axis!r} after the schedule: it returns the loss "
                f"summed over microbatches, the same on every stage"
            )
        if name not in GROUPED:
            others = ", ".join(repr(a) for a in axes)
            kind = "a collective-permute, which is" if "permute" in name else "which is not"
            kind += " not safe" if "permute" in name else " known to be safe"
            raise ValueError(
                f"{fn}: {who} runs {what} over {others}{at}, {kind} inside a stage of this "
                f"schedule: a stage's work runs in a branch only its own devices take, and "
                f"XLA pairs a collective-permute with the permutes the other stages' devices "
                f"run at the same time (wrong values or a deadlock). Use schedule 'gpipe' or "
                f"'circular' (every stage runs every tick), or a grouped collective in "
                f"`{arg}` (psum, all_gather, psum_scatter, all_to_all over the other axes are "
                f"safe; e.g. attention.gathered instead of attention.ring)"
            )
        for a in axes:
            found.setdefault(a, f"{who} runs {what}{at}")
    return found


def check_functions(
    fn: str,
    schedule: str,
    axis: str,
    stage: tuple[Callable, Any, Any],
    loss: tuple[Callable, Any, Any, Any],
    inputs: Any,
) -> Communicated:
    """Refuse forward-mode differentiation of the schedule (``inputs``: its differentiable
    arguments), then a ``stage_fn`` or ``loss_fn`` that closes over a value being
    differentiated, then one that communicates in a way a per-stage branch cannot (traced
    on ``stage = (stage_fn, group, h)`` and ``loss = (loss_fn, loss_params, y, target)``);
    return what they communicate over."""
    if forward_mode(inputs):
        raise TypeError(
            f"{fn}: forward-mode differentiation (jax.jvp, jax.jacfwd) of the {schedule!r} "
            f"schedule is not supported: it defines its reverse pass only (the backward runs "
            f"inside the schedule). Differentiate with jax.grad, jax.value_and_grad or "
            f"jax.vjp, or use schedule 'gpipe' or 'circular', which plain autodiff runs in "
            f"both modes"
        )
    found: Communicated = {}
    for arg, (f, *args) in (("stage_fn", stage), ("loss_fn", loss)):
        program = programs.open_program(jax.jit(hashable(f)).trace(*args).jaxpr)
        # A jit trace takes the tracers a function closes over as extra inputs: only then can
        # one of them be differentiated (closure_convert's second trace tells which).
        if len(program.invars) > len(jax.tree.leaves(args)):
            _refuse_closures(fn, arg, f, *args)
        found = check_branch_program(fn, arg, program, axis) | found
    return found


def check_backwards(
    fn: str, axis: str, stage: tuple[Callable, Any, Any], loss: tuple[Callable, Any, Any, Any]
) -> Communicated:
    """`check_branch_program` on the backward programs of ``stage_fn`` and ``loss_fn`` (the
    tuples of `check_functions`), as the schedule runs them in its per-stage branches: a
    ``custom_vjp``'s backward rule is only in the backward program. Returns what they
    communicate over."""
    stage_fn, group, h = stage
    loss_fn, lparams, y, target = loss
    found: Communicated = {}
    for arg, f, args in (
        ("stage_fn", stage_fn, (group, h)),
        ("loss_fn", lambda lp, y: loss_fn(lp, y, target), (lparams, y)),
    ):
        program = programs.open_program(jax.jit(_backward_of(f)).trace(*args).jaxpr)
        found = check_branch_program(fn, arg, program, axis, backward=True) | found
    return found


def _backward_of(f: Callable) -> Callable:
    """``f``'s backward as a function of its arguments: its VJP applied to zeros typed as
    its output (the forward runs too; its collectives are checked already)."""

    def backward(*args: Any) -> Any:
        out, vjp = jax.vjp(f, *args)
        return vjp(jax.tree.map(lambda o: vary_over(jnp.zeros_like(o), _axes(o)), out))

    return backward


def _axes(x: Any) -> frozenset[str]:
    return varying_axes(x) or frozenset()


def check_loss_axes(fn: str, loss_axes: frozenset[str], communicated: Communicated) -> None:
    """Refuse a loss that varies over mesh axes (``loss_axes``, the stage axis's aside: each
    device's share, combined after the schedule) that the stage or the loss communicates
    over (``communicated``, from `check_functions` and `check_backwards`). The schedule
    computes the gradients while it runs, before the loss's cotangent is known, with the
    same seed on every device: where a collective mixes the devices of such an axis, they
    are right only if the cotangent is the same on all of them, which JAX's types cannot
    show. Over an axis nothing communicates over, each device's gradient is its own share's,
    and the custom_vjp scales it by its own cotangent: right for any cotangent."""
    mixed = sorted(a for a in loss_axes if a in communicated)
    if not mixed:
        return
    names = ", ".join(repr(a) for a in mixed)
    raise ValueError(
        f"{fn}: `loss_fn` returns a loss that varies over {names} (each device's share, "
        f"combined after the schedule), while {communicated[mixed[0]]}: the schedule computes "
        f"its gradients while it runs, before it knows the loss's cotangent, so they are "
        f"right only if that cotangent is the same on every device of {names}, which JAX's "
        f"types cannot show. Reduce the loss over {names} in `loss_fn` (e.g. return "
        f"shardops.psum('', loss, axes={mixed[0]!r})), so that the schedule returns it whole, "
        f"the same on every device"
    )


def _refuse_closures(fn: str, arg: str, f: Callable, *args: Any) -> None:
    """Refuse a ``stage_fn`` or ``loss_fn`` (``arg``) that closes over a value being
    differentiated (``jax.closure_convert`` on ``args``' types finds what it closes over):
    the schedule's gradients come from its own custom_vjp, which returns those of its
    arguments only. A closure over a value that is not differentiated runs."""
    _, found = jax.closure_convert(f, *args)
    consts = [c for c in found if differentiated(c)]
    if consts:
        where = "stage_params" if arg == "stage_fn" else "loss_params"
        got = ", ".join(f"{dtype_name(c.dtype)}{list(c.shape)}" for c in consts)
        raise ValueError(
            f"{fn}: `{arg}` closes over a value being differentiated ({got}): the schedule "
            f"computes its gradients itself and returns those of its arguments only, so that "
            f"value's gradient would be lost. Pass it in `{where}` and read it from there "
            f"(or use schedule 'gpipe' or 'circular', which plain autodiff differentiates)"
        )


def check_loss_fn(fn: str, loss_fn: Callable, args: tuple[Any, Any, Any], axis: str) -> None:
    """Refuse a ``loss_fn`` of ``pipeline_loss`` under gpipe or circular that communicates
    over the stage ``axis`` (traced on ``args = (loss_params, y, target)``): every stage
    applies it to its own outputs, of which only the last stage's are the pipeline's, so a
    collective over ``axis`` mixes the other stages' unfinished blocks into the loss."""
    eqn = collectives.first_collective_over(jax.jit(hashable(loss_fn)).trace(*args).jaxpr, axis)
    if eqn is None:
        return
    where = _frames.location_of_traceback(getattr(eqn.source_info, "traceback", None))
    what = op_name(collectives.written_name(eqn.primitive.name), _frames.name_stack_of(eqn))
    raise ValueError(
        f"{fn}: `loss_fn` must not communicate over the stage axis {axis!r}, but it runs "
        f"{what}{f' at {where}' if where else ''}: every stage applies it to its own outputs "
        f"and only the last stage's are the pipeline's, so a collective over {axis!r} would "
        f"mix the other stages' unfinished blocks into the loss. Reduce over {axis!r} after "
        f"the schedule: it returns the loss summed over microbatches, the same on every stage"
    )
