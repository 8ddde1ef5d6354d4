"""Running ``shardops.reshard``: check, work out the route (`shardlib._ops.reshard_recipe`),
emit its steps.

The steps are emitted as the ops they are: each collective through the op skeleton
(`shardlib._ops.run`) as ``shardops.all_gather`` / ``shardops.all_to_all`` with the step's
own spec, so it runs under the named scope ``shardops.all_gather[B/t L M -> B L M]`` nested
in ``shardops.reshard[SPEC]``; `shardlib.explain` lists each collective with the step's op
and spec, and the HLO metadata keeps the whole stack. A slice is a ``dynamic_slice`` at
``axis_index`` under the reshard scope (no collective).

A slice keeps each device's block of a dim over mesh axes the value is replicated over, so
it is right only if the value is the same on every device of them. While ``typed_shard_map``
analyses the body, each slice leaves a ``same`` note (`shardlib._analysis.notes`): the analysis
refuses a value that differs across those axes (``ValueError``) or is a partial sum over them
(`PendingReductionError`). A partial sum over other axes goes through: the collectives and
slices over other axes are linear in it, and a ``{+t}`` clause (the same on both sides)
declares it. The program that runs has no notes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import jax
from jax import lax

from .._analysis.notes import Note, note
from .._check.checking import check_value, format_sizes
from .._check.scopes import current_scope
from .._env import context as _context
from .._lang.parsing import SpecError, did_you_mean
from . import run as _ops
from .collective_recipes import all_gather_recipe, all_to_all_recipe
from .emit import axis_arg
from .reshard_recipe import ReshardRecipe, Step, route, step_text

__all__ = ["reshard"]


def reshard(recipe: ReshardRecipe, x: Any) -> Any:
    """Change the layout of ``x`` from ``recipe``'s input spec to its output spec."""
    manual = _manual_axes(recipe)
    scope = current_scope()
    spec = recipe.spec
    check_value(x, None, spec.inputs[0], scope, where=recipe.labels[0], check_sharding=False)
    x = _ops.declare(x, spec.inputs[0], recipe, recipe.roles[0])
    shape = tuple(
        n * math.prod(manual[a] for a in axes) for n, axes in zip(x.shape, recipe.src, strict=True)
    )
    _check_divisible(recipe, shape, manual)
    steps = route(recipe.src, recipe.dst, manual, shape)
    with jax.named_scope(recipe.scope_name):
        for step in steps:
            x = _emit_step(recipe, step, x)
    check_value(x, None, spec.output, scope, where=recipe.labels[-1], check_sharding=False)
    return _ops.declare(x, spec.output, recipe, "output", recipe.why)


def _emit_step(recipe: ReshardRecipe, step: Step, x: Any) -> Any:
    if step.kind == "all_gather":
        return _ops.run(all_gather_recipe(step_text(recipe.names, step)), x)
    if step.kind == "all_to_all":
        return _ops.run(all_to_all_recipe(step_text(recipe.names, step)), x)
    x = note(x, _same_note(recipe, step))
    n = x.shape[step.dim]
    k = math.prod(lax.axis_size(a) for a in step.axes)
    block = n // k
    start = lax.axis_index(axis_arg(step.axes)) * block
    return lax.dynamic_slice_in_dim(x, start, block, axis=step.dim)


def _same_note(recipe: ReshardRecipe, step: Step) -> Note:
    """The slice's claim, checked by the analysis: ``x`` is the same on every device of the
    axes it slices over (so each keeps its block of one array) and owes no sum over them."""
    axes = "/".join(step.axes)
    why = (
        f"(It splits dim {step.dim} {recipe.names[step.dim]!r} over {axes!r} by a local slice, "
        f"without communication, which is right only for a value replicated over {axes!r}.) "
    )
    return Note("same", step.axes, op=recipe.op, text=recipe.text, why=why)


def _manual_axes(recipe: ReshardRecipe) -> dict[str, int]:
    """The manual axes; each mesh axis of the spec must be one (else a SpecError there)."""
    manual = _context.manual_axis_sizes()
    if recipe.needs and not manual:
        raise ValueError(
            f"reshard({recipe.text!r}) communicates over mesh axis {recipe.needs[0]!r}, so it must "
            "run inside a shard_map body (use typed_shard_map); here no mesh axis is manual"
        )
    for operand, part in ((0, recipe.spec.inputs[0]), (None, recipe.spec.output)):
        for i, d in enumerate(part.dims):
            for a in d.sharding:
                if a not in manual:
                    raise recipe.spec.error(
                        f"reshard: mesh axis {a!r} of dim {i} {str(d)!r} is not a manual axis of "
                        f"the enclosing shard_map (manual axes: {format_sizes(manual)})"
                        f"{did_you_mean(a, manual)}",
                        operand=operand,
                        dim=i,
                        hint="name an axis of the mesh the body runs on",
                    )
    return manual


def _check_divisible(
    recipe: ReshardRecipe, shape: tuple[int, ...], manual: Mapping[str, int]
) -> None:
    """Each output dim must split evenly over its mesh axes."""
    for i, (n, axes) in enumerate(zip(shape, recipe.dst, strict=True)):
        k = math.prod(manual[a] for a in axes)
        if n % k:
            factor = " × ".join(f"{a}={manual[a]}" for a in axes)
            if len(axes) > 1:
                factor += f" = {k}"
            raise SpecError.at(
                f"reshard: dim {i} {recipe.names[i]!r} has global size {n}, which is not divisible "
                f"by {factor}, so it cannot be split over {'/'.join(axes)!r}; expected a multiple "
                f"of {k}",
                recipe.text,
                recipe.spec.output.dims[i].span,
                hint="pad the dim, or split another dim",
            )
