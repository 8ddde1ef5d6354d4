"""What one forward of a memory-bounded schedule keeps for its backward (JAX).

`keeping` chooses how ``stage_fn`` is differentiated (as given when it checkpoints, else under
a checkpoint that keeps no slices of the weights); `warn_weight_slices` warns when the stage's
own checkpoints leave weight slices among the residuals; `split_vjp` separates a VJP object's
leaves into the residuals a ring slot stores and the stage weights, kept once. `tick_policy`
is the checkpoint policy of a tick of these schedules and of `circular`'s: weight slices
(`SELECTING`) are taken again, never kept.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any

import jax

from .._env import programs

__all__ = ["SELECTING", "keeping", "split_vjp", "tick_policy", "warn_weight_slices"]

# Primitives that only select or rearrange elements: cheap to recompute from their input.
SELECTING = frozenset(
    {
        "dynamic_slice",
        "slice",
        "squeeze",
        "reshape",
        "gather",
        "transpose",
        "broadcast_in_dim",
        "convert_element_type",
        "copy",
        "expand_dims",
    }
)


def tick_policy(stage_fn: Callable, policy: Callable[..., bool] | None) -> Callable[..., bool]:
    """The checkpoint policy of one circular tick: ``policy`` (or the one
    `jax_extra.explicit_activation_checkpointing` gave ``stage_fn``; else: save every value),
    except that selections of elements (weight slices above all) are never saved."""
    chosen = policy if policy is not None else getattr(stage_fn, "checkpoint_policy", None)

    def keep(prim: Any, *args: Any, **params: Any) -> bool:
        if prim.name in SELECTING:
            return False
        return True if chosen is None else bool(chosen(prim, *args, **params))

    return keep


def keeping(stage_fn: Callable, group: Any, h: jax.Array) -> tuple[Callable, bool]:
    """``stage_fn`` as each forward differentiates it, and whether that is ``stage_fn`` as
    given.

    - As given when it holds a checkpoint (``jax.checkpoint`` or
      `jax_extra.explicit_activation_checkpointing`, a ``remat2`` equation in JAX 0.10's
      jaxprs), whether it is one or calls some inside (one per layer, in a scan): their
      policies decide what the residuals are. An outer checkpoint here would impose its
      own policy on everything inside it and undo them.
    - Else under a checkpoint that keeps every value but selections of elements, so that a
      slice of the stage weights (``w[i]`` of a layer stack) is not kept per microbatch but
      taken again from the weights, which are kept once.
    """
    if _has_checkpoint(jax.make_jaxpr(stage_fn)(group, h).jaxpr):
        return stage_fn, True
    return jax.checkpoint(stage_fn, policy=tick_policy(stage_fn, None)), False


def warn_weight_slices(fn: str, jaxpr: Any, n_weights: int) -> None:
    """Warn when the residuals of a ``stage_fn`` kept as given hold slices of the weights
    (``w[i]`` taken outside its checkpoints): kept per microbatch in flight. ``jaxpr``: the
    program from the stage weights (its first ``n_weights`` inputs) and the input block to
    the residuals (its outputs)."""
    sliced = _weight_selections(jaxpr, n_weights)
    if sliced:
        size = sum(math.prod(a.shape) * a.dtype.itemsize for a in sliced)
        warnings.warn(
            f"{fn}: argument `stage_fn` keeps {len(sliced)} slices of its weights per "
            f"microbatch in flight ({size} bytes per device each microbatch, e.g. shape "
            f"{tuple(sliced[0].shape)}): they are taken outside its jax.checkpoint calls; take "
            "them inside (a lax.scan over the stacked weights with the checkpointed layer as "
            "its body does), so that the weights are kept once",
            stacklevel=2,
        )


def _weight_selections(jaxpr: Any, n_weights: int) -> list[Any]:
    """The avals of ``jaxpr``'s outputs computed from its first ``n_weights`` inputs by
    selections of elements alone (slices, reshapes, casts: `SELECTING`'s
    list)."""
    from_weights = {id(v) for v in jaxpr.invars[:n_weights]}
    for eqn in jaxpr.eqns:
        data = eqn.invars[:1]
        if eqn.primitive.name in SELECTING and data and id(data[0]) in from_weights:
            from_weights.update(id(v) for v in eqn.outvars)
    return [v.aval for v in jaxpr.outvars if id(v) in from_weights and v not in jaxpr.invars]


_CHECKPOINTS = frozenset({"checkpoint", "remat", "remat2"})


def _has_checkpoint(jaxpr: Any) -> bool:
    """Whether a traced program calls a checkpoint, at any depth (scan bodies included)."""
    return any(
        eqn.primitive.name in _CHECKPOINTS or any(map(_has_checkpoint, programs.sub_programs(eqn)))
        for eqn in jaxpr.eqns
    )


def split_vjp(vjp: Any, group: Any) -> tuple[list[jax.Array], list[tuple[str, int]]]:
    """The VJP object's leaves that are not the stage weights themselves, and where each
    leaf comes from: a residual to keep, or a weight leaf (kept once, outside the rings)."""
    weights = jax.tree.leaves(group)
    stored: list[jax.Array] = []
    where: list[tuple[str, int]] = []
    for leaf in jax.tree.leaves(vjp):
        k = next((j for j, w in enumerate(weights) if w is leaf), -1)
        if k >= 0:
            where.append(("param", k))
        else:
            where.append(("res", len(stored)))
            stored.append(leaf)
    return stored, where
