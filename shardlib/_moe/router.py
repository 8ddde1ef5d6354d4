"""The top-k router: gates, expert ids, the load-balancing loss and the router z-loss (JAX)."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from .._check.scopes import Scope
from .._env import rules as _rules
from .._env.context import manual_axis_sizes, mesh_axis_sizes
from ..shardops import pmean
from .plan import axis_error, gate_error, k_error

__all__ = ["Routing", "route"]

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
    fn: str = "moe.route",
) -> Routing:
    """Top-k routing of this device's tokens (see `shardlib.moe.route`); ``fn`` names the
    public function in errors."""
    axes = _rules.axes(axes, f"{fn}: argument `axes`")  # roles -> mesh axes
    axes = (axes,) if isinstance(axes, str) else tuple(axes)
    _check(fn, router_logits, k, gate, axes)
    x = router_logits.astype(F32)
    t, e = x.shape
    probs = jax.nn.softmax(x, axis=-1) if gate == "softmax" else jax.nn.sigmoid(x)
    top, ids = lax.top_k(probs, k)
    gates = top / jnp.sum(top, axis=-1, keepdims=True) if renormalize else top
    frac = jnp.sum(jax.nn.one_hot(ids, e, dtype=F32), axis=(0, 1)) / (t * k)
    mean_p = jnp.mean(probs, axis=0)
    z = jnp.mean(jax.nn.logsumexp(x, axis=-1) ** 2)
    if axes:  # the statistics of every token on the axes, not only this device's
        with Scope("moe.route"):
            frac = pmean("E", frac, axes)
            mean_p = pmean("E", mean_p, axes)
            z = pmean("", z, axes)
    aux = e * jnp.sum(frac * mean_p)
    return Routing(gates, ids.astype(jnp.int32), probs, aux, z)
