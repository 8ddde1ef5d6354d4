"""What ring and Ulysses attention share (JAX): the argument checks, the score scale, the
settings a ``custom_vjp`` takes as its static argument, and the small steps of a block loop.

`prepare` checks an attention call's arguments by the rules of `shardlib._attention.rules`
and gives the `CheckedCall`; `read_scale` and `score_factor` the score scale; `make_config` the `Config`
(the checked call, the axis size, a fixed scale and the axes the results vary over), with which
`varying` and `varying_zero` make a loop's carries vary over those axes
(`shardlib._env.context.vary_over`); `segments_may_meet` and `when` skip a block no query
sees; `refuse_forward_mode` refuses ``jax.jvp`` of a ``custom_vjp``; `attention_scope` the
named scope a call runs under.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from .._check.checking import check_block
from .._check.scopes import op_scope
from .._env import rules as _rules
from .._env.context import (
    forward_mode,
    manual_axis_items,
    manual_axis_sizes,
    mesh_axis_sizes,
    vary_over,
    varying_axes,
)
from .._lang.parsing import ShapeSpec
from .._lang.scope_codec import AttentionScope
from . import blocks as B
from .chunks import segments_meet
from .rules import CheckedCall, axis_error, check_call, heads_error, sequence_error

__all__ = [
    "Config",
    "attention_scope",
    "score_factor",
    "make_config",
    "prepare",
    "read_scale",
    "refuse_forward_mode",
    "segments_may_meet",
    "varying",
    "varying_zero",
    "when",
]

F32 = jnp.float32


class Config(NamedTuple):
    """What the ring needs besides arrays (hashable: a ``custom_vjp`` static argument)."""

    checked: CheckedCall
    c: int
    scale: float | None  # None: the scale is an array, passed to the ring as an argument
    axes: frozenset[str] | None  # the axes the results vary over (None: not tracked)
    segment_skip: bool = True  # skip blocks whose segments cannot meet (`segments_meet`)


def prepare(
    fn: str, spec: Any, q: Any, k: Any, v: Any, axis: Any, causal: bool, layout: str, ids: Any
) -> CheckedCall:
    """Check the arguments of ``fn`` (the rules of `shardlib._attention.rules`); the checked."""
    manual = manual_axis_sizes()
    axis = _rules.one_axis(fn, "axis", axis)
    bad = axis_error(fn, axis, manual, mesh_axis_sizes())
    if bad:
        raise ValueError(bad)
    checked = check_call(fn, _rules.text(spec, f"{fn}: argument `spec`"), axis, layout, causal)
    scope, items = op_scope(), manual_axis_items()
    check_block(q, checked.q, scope, items, f"{fn}: argument `q`")
    check_block(k, checked.kv, scope, items, f"{fn}: argument `k`")
    check_block(v, checked.kv, scope, items, f"{fn}: argument `v`")
    if ids is not None:
        check_block(
            ids, ShapeSpec.parse(checked.ids_text), scope, items, f"{fn}: argument `segment_ids`"
        )
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(
            f"{fn}: arguments `q`, `k` and `v` must have one dtype, got {q.dtype}, {k.dtype} "
            f"and {v.dtype}; cast them with .astype()"
        )
    heads = math.prod(manual.get(a, 1) for a in checked.q.dims[2].sharding)
    bad = heads_error(fn, checked, q.shape[2], k.shape[2], heads) or sequence_error(
        fn, checked, q.shape[1], manual[axis]
    )
    if bad:
        raise ValueError(bad)
    return checked


def read_scale(fn: str, scale: Any, width: int) -> tuple[float | None, jax.Array | None]:
    """``scale`` as a Python float (fixed: folded into the program) or as a float array of
    shape ``()`` (traced, and differentiable: ``jax.grad`` w.r.t. it works); the other None."""
    if scale is None:
        return width**-0.5, None
    if isinstance(scale, numbers.Real) and not isinstance(scale, bool):
        return float(scale), None
    shape, dtype = getattr(scale, "shape", None), getattr(scale, "dtype", None)
    if shape == () and dtype is not None and jnp.issubdtype(dtype, jnp.floating):
        return None, jnp.asarray(scale)
    got = (
        f"an array of shape {tuple(shape)} and dtype {dtype}"
        if shape is not None
        else f"{type(scale).__name__} {scale!r}"
    )
    raise ValueError(
        f"{fn}: argument `scale` must be None (1/sqrt(D)), a Python float, or a float array "
        f"of shape () (it may be traced, e.g. a learned scale); got {got}"
    )


def make_config(
    checked: CheckedCall, q: Any, k: Any, v: Any, ids: Any, scale: float | None
) -> Config:
    """The `Config` of a checked call: the axis size, and the axes the results vary over
    (the sequence axis and every axis an argument varies over; None when JAX tracks none)."""
    c = manual_axis_sizes()[checked.axis]
    found = [varying_axes(x) for x in (q, k, v, ids) if x is not None]
    axes = None
    if all(f is not None for f in found):
        axes = frozenset({checked.axis}).union(*(f for f in found if f is not None))
    return Config(checked, c, scale, axes)


def score_factor(cfg: Config, scale: jax.Array | None) -> Any:
    """The score scale the blocks multiply by: the fixed float, or the array in f32."""
    return cfg.scale if scale is None else scale.astype(F32)


def varying(cfg: Config, x: Any) -> Any:
    """``x`` cast to vary over every axis the results vary over (`vary_over`), if it does
    not; ``x`` when it is None or nothing is tracked."""
    if x is None or cfg.axes is None:
        return x
    return vary_over(x, cfg.axes)


def varying_zero(cfg: Config) -> jax.Array:
    """An f32 zero that varies over every axis the results vary over (`varying`)."""
    return varying(cfg, jnp.zeros((), F32))


def segments_may_meet(query: B.Queries, keys: B.Keys) -> Any:
    """Whether the block may hold a visible score by its segment ids: their ranges per batch
    row meet (`segments_meet`); True without ids. The ring's rule and Ulysses' local loop's."""
    if query.seg is None or keys.seg is None:
        return True
    q, k = query.seg, keys.seg
    return segments_meet(q.min(axis=1), q.max(axis=1), k.min(axis=1), k.max(axis=1))


def when(needed: Any, compute: Any, skip: Any, *args: Any) -> Any:
    """``compute(*args)`` where the block is needed, else ``skip(*args)`` (no work)."""
    if needed is True:
        return compute(*args)
    return lax.cond(needed, compute, skip, *args)


def refuse_forward_mode(fn: str, args: tuple, what: str, why: str) -> None:
    """Raise naming ``fn`` when ``args`` carry forward-mode tangents: ``what`` (e.g. ``'ring
    attention'``) defines its own backward pass (``why``, a ``jax.custom_vjp``)."""
    if forward_mode(args):
        raise TypeError(
            f"{fn}: forward-mode differentiation (jax.jvp, jax.jacfwd) of {what} is not "
            f"supported: {why} (a jax.custom_vjp). Differentiate with jax.grad, "
            "jax.value_and_grad or jax.vjp, or use attention.gathered, which plain autodiff "
            "runs in both modes"
        )


def attention_scope(fn: str, checked: CheckedCall, c: int) -> str:
    """The named scope of the call ``fn`` (`shardlib._lang.scope_codec.AttentionScope`)."""
    return AttentionScope(fn, checked.axis, c, checked.layout).text()
