"""The cotangents the memory-bounded schedules return from their custom_vjp: which arguments
are differentiated (``symbolic_zeros`` primals), the targets' float leaves, and the sum of a
gradient over the axes it varies over and its primal does not (`reduce_to`: over the axes the
loss varies over too, only once it is scaled by the loss's cotangent, `scaled`).

May import `shardlib._env` only.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.custom_derivatives import CustomVJPPrimal

from .._env.context import varying_axes

__all__ = [
    "float_leaves",
    "leaves_at",
    "reduce_to",
    "scaled",
    "target_cotangents",
    "unwrap",
    "with_leaves",
]


def unwrap(tree: Any) -> tuple[Any, tuple[bool, ...]]:
    """The values of a custom_vjp's ``symbolic_zeros`` primals, and per top-level argument
    whether any of its leaves is being differentiated."""

    def is_primal(x: Any) -> bool:
        return isinstance(x, CustomVJPPrimal)

    values = jax.tree.map(lambda p: p.value, tree, is_leaf=is_primal)
    perturbed = tuple(
        any(p.perturbed for p in jax.tree.leaves(arg, is_leaf=is_primal)) for arg in tree
    )
    return values, perturbed


def float_leaves(tree: Any) -> list[int]:
    """The indices of ``tree``'s leaves that have a gradient (inexact dtypes)."""
    leaves = jax.tree.leaves(tree)
    return [k for k, x in enumerate(leaves) if jnp.issubdtype(jnp.asarray(x).dtype, jnp.inexact)]


def leaves_at(tree: Any, at: list[int]) -> list[Any]:
    leaves = jax.tree.leaves(tree)
    return [leaves[k] for k in at]


def with_leaves(tree: Any, at: list[int], values: list[Any]) -> Any:
    """``tree`` with its leaves at ``at`` replaced by ``values``."""
    leaves, treedef = jax.tree.flatten(tree)
    for k, x in zip(at, values, strict=True):
        leaves[k] = x
    return jax.tree.unflatten(treedef, leaves)


def target_cotangents(
    tgt: Any, at: list[int], carry: dict[str, Any], keep: frozenset[str] = frozenset()
) -> Any:
    """The cotangents of the targets: the float leaves' from the loop (summed over the axes
    they vary over and the targets do not, but ``keep``: the last stage's), None (zero)
    elsewhere."""
    if not at:
        return None
    leaves, treedef = jax.tree.flatten(tgt)
    out: list[Any] = [None] * len(leaves)
    for k, d in zip(at, carry["dtgt"], strict=True):
        out[k] = reduce_to(d, leaves[k], keep)
    return jax.tree.unflatten(treedef, out)


def reduce_to(grad: Any, primal: Any, keep: frozenset[str] = frozenset()) -> Any:
    """Each gradient leaf summed over the axes it varies over and its primal does not (a
    weight the same on every device of an axis: the devices' shares, summed once), but
    ``keep``. A leaf None in ``grad`` (a zero cotangent) stays None."""

    def one(x: Any, g: Any) -> Any:
        if g is None:
            return None
        have, want = varying_axes(g), varying_axes(x)
        extra = () if have is None or want is None else tuple(sorted(have - want - keep))
        return lax.psum(g, extra) if extra else g

    return None if grad is None else jax.tree.map(one, primal, grad)


def scaled(grads: Any, ct: jax.Array, primals: Any) -> Any:
    """The custom_vjp's cotangents: each gradient of the summed loss (``grads``, left varying
    over the axes the loss varies over) times the loss's cotangent ``ct`` on its device, then
    summed over the axes it varies over and its primal (in ``primals``) does not. Over an
    axis the loss varies over, each device holds the gradient of its own share of the loss,
    so it is scaled before the sum: right for any cotangent there, where a sum first would
    scale every share by one device's cotangent."""
    products = jax.tree.map(lambda g: (g * ct).astype(g.dtype), grads)
    return tuple(reduce_to(g, x) for g, x in zip(products, primals, strict=True))
