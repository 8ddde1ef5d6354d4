"""What every pipeline schedule does with its stage, in JAX: the helpers the loops share.

`check_arguments` checks the stage axis, the spec and the microbatches (the rules and their
messages are `shardlib._pipeline.arguments`'); `carry_axes` finds the axes a loop's values
vary over, reading a traced ``stage_fn`` for collectives over the stage axis and checking its
output (`check_stage_output`); `group_count` and `group_of` read the layer groups of stacked
weights (``'v layers/p ...'``); `vary` makes a pytree vary over axes; `hashable` lets
``jax.jit`` trace any callable. `shardlib._pipeline.schedules` (gpipe, circular),
`shardlib._pipeline.table_loop` and `shardlib._pipeline.tick` import them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
from jax import lax

from .._analysis.notes import Note, note, notes_on
from .._check.format import describe_value, dtype_name
from .._env import collectives
from .._env import frames as _frames
from .._env import rules as _rules
from .._env.context import manual_axis_sizes, mesh_axis_sizes, vary_over, varying_axes
from .._lang.parsing import ShapeSpec
from .arguments import (
    axis_error,
    replicated_rule,
    spec_split_error,
    stage_collective_error,
    stage_output_error,
)

__all__ = [
    "carry_axes",
    "check_arguments",
    "check_stage_output",
    "group_count",
    "group_of",
    "hashable",
    "vary",
]


def group_count(params: Any) -> int:
    """``v``: the common leading dim of every leaf of a circular schedule's ``stage_params``."""
    leaves = jax.tree_util.tree_leaves_with_path(params)
    if not leaves:
        raise ValueError("circular: argument `stage_params` has no arrays (no layer groups)")
    sizes: dict[str, tuple[int, ...]] = {
        jax.tree_util.keystr(path): tuple(getattr(leaf, "shape", ()))[:1] for path, leaf in leaves
    }
    first_path, first = next(iter(sizes.items()))
    for path, size in sizes.items():
        if not size or size != first:
            raise ValueError(
                f"circular: every leaf of argument `stage_params` must have the layer-group dim "
                f"v first, the same for all; leaf {path or '(root)'} has leading dims {size}, "
                f"leaf {first_path or '(root)'} has {first}"
            )
    return int(first[0])


def group_of(params: Any, r: Any) -> Any:
    """Layer group ``r`` (pass ``r``) of a circular schedule's ``stage_params``."""
    return jax.tree.map(lambda w: lax.dynamic_index_in_dim(w, r, keepdims=False), params)


def check_arguments(
    fn: str, microbatches: Any, spec: str | bytes, axis: Any
) -> tuple[str, jax.Array, str]:
    """Check the stage axis, ``spec`` and microbatches (roles resolved under the axis rules in
    force); return the spec text, the microbatches and the stage mesh axis. The microbatches
    are noted for the body's analysis (`shardlib._analysis.walk`, with ``check_vma`` on or
    off) to be the same on every stage: JAX's types cannot tell (``all_gather`` results count
    as varying there)."""
    manual = manual_axis_sizes()
    axis = _rules.one_axis(fn, "axis", axis)
    bad = axis_error(fn, axis, manual, mesh_axis_sizes())
    if bad:
        raise ValueError(bad)
    shape = getattr(microbatches, "shape", None)
    if shape is None or len(shape) < 1 or shape[0] < 1:
        raise ValueError(
            f"{fn}: argument `microbatches` must be an array of shape (m, *microbatch) with "
            f"m >= 1 microbatches along its first dim, got shape {shape}"
        )
    spec_text = _rules.text(spec, f"{fn}: argument `spec`")
    bad = spec_split_error(fn, ShapeSpec.parse(spec_text), axis, manual[axis])
    if bad:
        raise ValueError(bad)
    why = f"For {fn}, {replicated_rule(axis, manual[axis])}. "
    same = Note("same", (axis,), f"pipeline.{fn}", "microbatches", role="rule", why=why)
    return spec_text, note(microbatches, same), axis


def check_stage_output(fn: str, y: Any, h: Any, spec_text: str) -> None:
    shape, dtype = getattr(y, "shape", None), getattr(y, "dtype", None)
    if shape == h.shape and dtype == h.dtype:
        return
    got = (tuple(shape), dtype_name(dtype)) if shape is not None else describe_value(y)
    bad = stage_output_error(
        fn, ShapeSpec.parse(spec_text), manual_axis_sizes(), (h.shape, dtype_name(h.dtype)), got
    )
    raise ValueError(bad)


def _check_stage_jaxpr(fn: str, jaxpr: Any, axis: str) -> None:
    """Refuse a ``stage_fn`` whose traced program communicates over the stage axis."""
    eqn = collectives.first_collective_over(jaxpr, axis)
    if eqn is not None:
        where = _frames.location_of_traceback(getattr(eqn.source_info, "traceback", None))
        op, stack = collectives.written_name(eqn.primitive.name), _frames.name_stack_of(eqn)
        raise ValueError(stage_collective_error(fn, axis, op, stack, where))


def carry_axes(
    fn: str,
    stage_fn: Callable[[Any, jax.Array], jax.Array],
    params: Any,
    zero: jax.Array,
    axis: str,
    spec_text: str,
) -> frozenset[str] | None:
    """The manual axes the loop's values vary over (None without ``check_vma``), after
    checking ``stage_fn`` on abstract values.

    Under ``check_vma`` a scan carry keeps its type. A stage's output varies over the stage
    axis (each stage has its own weights) and over what ``stage_fn`` leaves varying, which
    may depend on what its inputs vary over: grow the set until a stage output varies over
    no axis outside it (a few traces of ``stage_fn``'s shapes, no computation). The weights
    are made to vary over the set too (`vary`): a weight the same on every device of an
    axis (say the data axis ``d``) used in the loop would otherwise have its gradient summed
    over that axis at every tick; varying, the sum happens once, after the loop.

    On the analysis trace (notes on) the first trace is also read for collectives over the
    stage axis, and its output checked against the input block: once per call.
    """
    have = varying_axes(zero)
    axes = None if have is None else have | {axis}
    check = notes_on()
    while axes is not None or check:
        # As jax.eval_shape(f, ...), which is jax.jit(f).trace(...).out_info (one trace cache).
        traced = jax.jit(hashable(stage_fn)).trace(vary(params, axes), vary(zero, axes))
        out = traced.out_info
        if check:
            _check_stage_jaxpr(fn, traced.jaxpr.jaxpr, axis)
            check_stage_output(fn, out, zero, spec_text)
            check = False
        if axes is None:
            return None
        more = varying_axes(out) if isinstance(out, jax.ShapeDtypeStruct) else None
        if more is None or more <= axes:
            return axes
        axes = axes | more
    return None


def hashable(fn: Callable) -> Callable:
    """``fn``, or a partial of it when it cannot be hashed (``jax.jit`` needs a hash)."""
    return fn if getattr(type(fn), "__hash__", None) else functools.partial(fn)


def vary(tree: Any, axes: frozenset[str] | None) -> Any:
    """Every array of ``tree`` (or ``tree``, one array) made to vary over ``axes`` too
    (`shardlib._env.context.vary_over`); ``tree`` when ``axes`` is None."""
    return tree if axes is None else jax.tree.map(lambda x: vary_over(x, axes), tree)
