"""Running ``shardops.reshard``: check, plan the route (`shardlib._reshard`), emit its steps.

The steps are emitted as the ops they are: each collective through the op skeleton
(`shardlib._ops.run`) as ``shardops.all_gather`` / ``shardops.all_to_all`` with the step's
own spec, so it runs under the named scope ``shardops.all_gather[B/t L M -> B L M]`` nested
in ``shardops.reshard[SPEC]``; `shardlib.explain` lists each collective with the step's op
and spec, and the HLO metadata keeps the whole stack. A slice is a ``dynamic_slice`` at
``axis_index`` under the reshard scope (no collective).

A partial sum is refused: while ``typed_shard_map`` analyses the body, the input passes
through an identity primitive that the pending-sum analysis does not know, so a pending
input fails there with the usual `PendingReductionError`. The program that runs has no such
equation.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import jax
from jax import lax
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from . import _context, _ops
from ._checking import check_value, format_sizes
from ._emit import axis_arg
from ._opspecs import plan_all_gather, plan_all_to_all
from ._parsing import SpecError, did_you_mean
from ._pending import notes_on
from ._reshard import ReshardPlan, Step, route, step_text
from ._scopes import current_scope

__all__ = ["reshard"]

# Identity; no pending-sum rule on purpose, so a partial sum reaching reshard is refused.
_reduced_p = Primitive("shardlib_reshard_input")
_reduced_p.def_impl(lambda x: x)
_reduced_p.def_abstract_eval(lambda x: x)
mlir.register_lowering(_reduced_p, lambda ctx, x: [x])
ad.primitive_jvps[_reduced_p] = lambda primals, tangents: (_reduced_p.bind(*primals), tangents[0])
batching.primitive_batchers[_reduced_p] = lambda args, dims: (_reduced_p.bind(*args), dims[0])


def reshard(plan: ReshardPlan, x: Any) -> Any:
    """Change the layout of ``x`` from ``plan``'s input spec to its output spec."""
    manual = _manual_axes(plan)
    scope = current_scope()
    spec = plan.spec
    check_value(x, None, spec.inputs[0], scope, where=plan.labels[0], check_sharding=False)
    shape = tuple(
        n * math.prod(manual[a] for a in axes) for n, axes in zip(x.shape, plan.src, strict=True)
    )
    _check_divisible(plan, shape, manual)
    steps = route(plan.src, plan.dst, manual, shape)
    with jax.named_scope(plan.scope_name):
        if notes_on():
            x = _reduced_p.bind(x)
        for step in steps:
            x = _emit_step(plan, step, x)
    check_value(x, None, spec.output, scope, where=plan.labels[-1], check_sharding=False)
    return x


def _emit_step(plan: ReshardPlan, step: Step, x: Any) -> Any:
    if step.kind == "all_gather":
        return _ops.run(plan_all_gather(step_text(plan.names, step)), x)
    if step.kind == "all_to_all":
        return _ops.run(plan_all_to_all(step_text(plan.names, step)), x)
    n = x.shape[step.dim]
    k = math.prod(lax.axis_size(a) for a in step.axes)
    block = n // k
    start = lax.axis_index(axis_arg(step.axes)) * block
    return lax.dynamic_slice_in_dim(x, start, block, axis=step.dim)


def _manual_axes(plan: ReshardPlan) -> dict[str, int]:
    """The manual axes; each mesh axis of the spec must be one (else a SpecError there)."""
    manual = _context.manual_axis_sizes()
    if plan.needs and not manual:
        raise ValueError(
            f"reshard({plan.text!r}) communicates over mesh axis {plan.needs[0]!r}, so it must "
            "run inside a shard_map body (use typed_shard_map); here no mesh axis is manual"
        )
    for operand, part in ((0, plan.spec.inputs[0]), (None, plan.spec.output)):
        for i, d in enumerate(part.dims):
            for a in d.sharding:
                if a not in manual:
                    raise plan.spec.error(
                        f"reshard: mesh axis {a!r} of dim {i} {str(d)!r} is not a manual axis of "
                        f"the enclosing shard_map (manual axes: {format_sizes(manual)})"
                        f"{did_you_mean(a, manual)}",
                        operand=operand,
                        dim=i,
                        hint="name an axis of the mesh the body runs on",
                    )
    return manual


def _check_divisible(plan: ReshardPlan, shape: tuple[int, ...], manual: Mapping[str, int]) -> None:
    """Each output dim must split evenly over its mesh axes."""
    for i, (n, axes) in enumerate(zip(shape, plan.dst, strict=True)):
        k = math.prod(manual[a] for a in axes)
        if n % k:
            factor = " × ".join(f"{a}={manual[a]}" for a in axes)
            raise SpecError.at(
                f"reshard: dim {i} has global size {n}, which is not divisible by {factor} = "
                f"{k}, so it cannot be split over {'/'.join(axes)!r}; expected a multiple of {k}",
                plan.text,
                plan.spec.output.dims[i].span,
                hint="pad the dim, or split another dim",
            )
