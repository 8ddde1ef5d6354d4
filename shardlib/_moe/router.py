"""The top-k router: gates, expert ids, the load-balancing loss and the router z-loss (JAX)."""

from __future__ import annotations

import operator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from .._check.scopes import Scope
from .._env import rules as _rules
from .._env.context import manual_axis_sizes, mesh_axis_sizes, varying_axes
from ..shardops import pmean
from .capacity import axis_error, gate_error, k_error

__all__ = ["Routing", "route", "route_as"]

F32 = jnp.float32


class Routing(NamedTuple):
    """What the router decided for this device's ``T`` tokens over ``E`` experts."""

    gates: jax.Array  # f32 (T, k): the weight of each chosen expert's output
    experts: jax.Array  # int32 (T, k): the chosen experts, best first
    probs: jax.Array  # f32 (T, E): softmax (or sigmoid) of the logits
    aux_loss: jax.Array  # f32 (): Switch/GShard load balancing, E * sum_e f_e * P_e
    z_loss: jax.Array  # f32 (): mean over tokens of logsumexp(logits) ** 2


def _check(fn: str, logits: Any, k: Any, gate: Any, axes: tuple[str, ...]) -> None:
    if getattr(logits, "ndim", None) != 2:
        shape = getattr(logits, "shape", type(logits).__name__)
        raise ValueError(
            f"{fn}: argument `router_logits` must be this device's (tokens, experts) block, "
            f"2 dims; got shape {shape}: flatten the token dims first (x.reshape(-1, E))"
        )
    bad = k_error(fn, k, logits.shape[-1]) or gate_error(fn, gate)
    for a in axes:
        bad = bad or axis_error(fn, "axes", a, manual_axis_sizes(), mesh_axis_sizes())
    if bad:
        raise ValueError(bad)


def route(
    router_logits: jax.Array,
    k: int,
    *,
    gate: str = "softmax",
    renormalize: bool = True,
    axes: str | tuple[str, ...] = (),
) -> Routing:
    """Top-k routing of this device's tokens.

    **Arguments:**

    - `router_logits`: ``(T, E)``, this device's tokens by every expert.
    - `k`: experts per token, ``1 <= k <= E``.
    - `gate`: ``'softmax'`` (over the experts) or ``'sigmoid'`` (each expert on its own).
    - `renormalize`: scale each token's ``k`` gates to sum to 1.
    - `axes`: manual mesh axes the tokens are split over; the losses' statistics (the
      fraction of pairs per expert ``f_e``, the mean probability ``P_e``, the z-loss) are
      then means over every token of those axes (`shardops.pmean`), as on one device.

    **Returns:** a `Routing`: ``gates`` ``(T, k)``, ``experts`` ``(T, k)`` int32, ``probs``,
    ``aux_loss`` ``E * sum_e f_e * P_e`` (1 when balanced) and ``z_loss``.

    Examples:
        >>> r = moe.route(x @ w_router, 2, axes=('d', 'e'))
    """
    return route_as("moe.route", router_logits, k, gate=gate, renormalize=renormalize, axes=axes)


def route_as(
    fn: str,
    router_logits: jax.Array,
    k: int,
    *,
    gate: str = "softmax",
    renormalize: bool = True,
    axes: str | tuple[str, ...] = (),
) -> Routing:
    """Top-k routing of this device's tokens (`route`) for the public function ``fn``
    (``'moe.route'``, ``'moe.layer'``), which the errors name."""
    axes = _rules.axes(axes, f"{fn}: argument `axes`")  # roles -> mesh axes
    axes = (axes,) if isinstance(axes, str) else tuple(axes)
    _check(fn, router_logits, k, gate, axes)
    k = operator.index(k)  # a NumPy int too
    x = router_logits.astype(F32)
    t, e = x.shape
    probs = jax.nn.softmax(x, axis=-1) if gate == "softmax" else jax.nn.sigmoid(x)
    top, ids = lax.top_k(probs, k)
    gates = top / jnp.sum(top, axis=-1, keepdims=True) if renormalize else top
    frac = jnp.sum(jax.nn.one_hot(ids, e, dtype=F32), axis=(0, 1)) / (t * k)
    mean_p = jnp.mean(probs, axis=0)
    z = jnp.mean(jax.nn.logsumexp(x, axis=-1) ** 2)
    frac, mean_p, z = _means(x, axes, frac, mean_p, z)
    aux = e * jnp.sum(frac * mean_p)
    return Routing(gates, ids.astype(jnp.int32), probs, aux, z)


def _means(
    logits: jax.Array, axes: tuple[str, ...], frac: jax.Array, mean_p: jax.Array, z: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The statistics of every token on ``axes``, not only this device's: their means.

    Over an axis the tokens are replicated on (``x`` ``'B/d L M'`` with ``axes=('d', 'e')``)
    every device holds the same statistics, whose mean is themselves. With ``check_vma`` on,
    JAX's types say which axes the logits vary over, and the mean runs over those only
    (``jax.lax.pmean`` refuses an input that does not vary over its axis). With it off,
    nothing says, so the mean runs over every axis named, as ``jax.lax.pmean`` (the same
    values: a mean of equal copies; `shardops.pmean` would be refused by the partial-sum
    analysis, which reads a reduction over a replicated axis as a forgotten gradient's).
    """
    if not axes:
        return frac, mean_p, z
    vary = varying_axes(logits)
    if vary is None:
        return lax.pmean(frac, axes), lax.pmean(mean_p, axes), lax.pmean(z, axes)
    axes = tuple(a for a in axes if a in vary)
    if not axes:
        return frac, mean_p, z
    with Scope("moe.route"):
        return pmean("E", frac, axes), pmean("E", mean_p, axes), pmean("", z, axes)
