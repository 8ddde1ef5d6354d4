"""The MLP workloads: fully sharded data parallel (FSDP) and plain data parallel (DP).

Both run on a mesh with axes ``d`` and ``t`` and use them *together* as one 8-way axis:
the batch is split over ``('d', 't')`` (spec ``B/d/t``).

- FSDP (like ``examples/fsdp_mlp.py``): weights are split over ``('d', 't')`` at rest and
  all-gathered just before use; the gradient of each gather is a reduce-scatter. The loss is a
  ``shard_map``; ``jax.value_and_grad`` and the SGD update run outside it, in the same ``jit``.
- DP: weights are replicated. The whole step runs inside ``shard_map``: each device computes
  the gradient of its local mean loss and the gradients are averaged with ``pmean`` over
  ``('d', 't')``. The weights are cast to *varying* before differentiating
  (``lax.pcast(..., to='varying')``), so that JAX does not sum the gradient of the replicated
  weights by itself: the one reduction is the explicit ``pmean``.

Each comes in three variants with the same math: ``shardlib`` (``typed_shard_map`` +
``shardops``), ``hand`` (``jax.shard_map`` + ``jax.lax``, einsum letters in shardlib's order)
and ``global`` (plain ``jnp`` on global arrays, for ``jax.jit`` with shardings only).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

import shardlib.shardops as shardops
from shardlib.shardtypes import f32, pytree_dataclass, typed_shard_map

__all__ = [
    "DPWeights",
    "FSDPWeights",
    "MLPConfig",
    "dp_step_global",
    "dp_step_hand",
    "dp_step_shardlib",
    "fsdp_loss_global",
    "fsdp_loss_hand",
    "fsdp_loss_shardlib",
]

AXES = ("d", "t")


@dataclasses.dataclass(frozen=True)
class MLPConfig:
    batch: int
    d_in: int
    hidden1: int
    hidden2: int


@pytree_dataclass
class FSDPWeights:
    w1: f32[b"In H1/d/t"]
    w2: f32[b"H1 H2/d/t"]
    w3: f32[b"H2/d/t"]


@pytree_dataclass
class DPWeights:
    w1: f32[b"In H1"]
    w2: f32[b"H1 H2"]
    w3: f32[b"H2"]


# One entry per dim, as shardlib writes them (P(AXES) and P(AXES, None) mean the same).
FSDP_SPECS = FSDPWeights(w1=P(None, AXES), w2=P(None, AXES), w3=P(AXES))
DP_SPECS = DPWeights(w1=P(None, None), w2=P(None, None), w3=P(None))
X_SPEC = P(AXES, None)
BATCH_SPEC = P(AXES)


# ---------------------------------------------------------------------------------------------
# FSDP.
# ---------------------------------------------------------------------------------------------


@typed_shard_map
def fsdp_loss_shardlib(x: f32[b"B/d/t In"], y: f32[b"B/d/t"], w: FSDPWeights) -> f32[b""]:
    """Mean squared error of the 3-layer MLP; weights gathered just before use."""
    w1 = shardops.all_gather("In H1/d/t -> In H1", w.w1)
    h = jax.nn.relu(shardops.einsum_unreduced("B/d/t In, In H1 -> B/d/t H1", x, w1))
    w2 = shardops.all_gather("H1 H2/d/t -> H1 H2", w.w2)
    h = jax.nn.relu(shardops.einsum_unreduced("B/d/t H1, H1 H2 -> B/d/t H2", h, w2))
    w3 = shardops.all_gather("H2/d/t -> H2", w.w3)
    pred = shardops.einsum_unreduced("B/d/t H2, H2 -> B/d/t", h, w3)
    err = jnp.sum(jnp.square(pred - y))
    return shardops.psum("", err, axes="d/t") / (x.shape[0] * shardops.axis_size("d/t"))


def _fsdp_body_hand(x: jax.Array, y: jax.Array, w: FSDPWeights) -> jax.Array:
    w1 = lax.all_gather(w.w1, AXES, axis=1, tiled=True)
    h = jax.nn.relu(jnp.einsum("ab,bc->ac", x, w1))
    w2 = lax.all_gather(w.w2, AXES, axis=1, tiled=True)
    h = jax.nn.relu(jnp.einsum("ab,bc->ac", h, w2))
    w3 = lax.all_gather(w.w3, AXES, axis=0, tiled=True)
    pred = jnp.einsum("ab,b->a", h, w3)
    err = jnp.sum(jnp.square(pred - y))
    return lax.psum(err, AXES) / (x.shape[0] * lax.axis_size("d") * lax.axis_size("t"))


def fsdp_loss_hand(x: jax.Array, y: jax.Array, w: FSDPWeights) -> jax.Array:
    return jax.shard_map(_fsdp_body_hand, in_specs=(X_SPEC, BATCH_SPEC, FSDP_SPECS), out_specs=P())(
        x, y, w
    )


def fsdp_loss_global(x: jax.Array, y: jax.Array, w: FSDPWeights) -> jax.Array:
    h = jax.nn.relu(jnp.einsum("ab,bc->ac", x, w.w1))
    h = jax.nn.relu(jnp.einsum("ab,bc->ac", h, w.w2))
    pred = jnp.einsum("ab,b->a", h, w.w3)
    return jnp.sum(jnp.square(pred - y)) / x.shape[0]


# ---------------------------------------------------------------------------------------------
# Data parallel: the whole step per device, gradients averaged with pmean.
# ---------------------------------------------------------------------------------------------


def _varying(w: DPWeights) -> DPWeights:
    return jax.tree.map(lambda a: lax.pcast(a, AXES, to="varying"), w)


@typed_shard_map
def dp_step_shardlib(
    x: f32[b"B/d/t In"], y: f32[b"B/d/t"], w: DPWeights, lr: f32[b""]
) -> tuple[DPWeights, f32[b""]]:
    """One SGD step: local gradients, averaged over the data axes ``d`` and ``t``."""

    def local_loss(w: DPWeights) -> jax.Array:
        h = jax.nn.relu(shardops.einsum_unreduced("B/d/t In, In H1 -> B/d/t H1", x, w.w1))
        h = jax.nn.relu(shardops.einsum_unreduced("B/d/t H1, H1 H2 -> B/d/t H2", h, w.w2))
        pred = shardops.einsum_unreduced("B/d/t H2, H2 -> B/d/t", h, w.w3)
        return jnp.mean(jnp.square(pred - y))

    value, g = jax.value_and_grad(local_loss)(_varying(w))
    g = DPWeights(
        w1=shardops.pmean("In H1", g.w1, axes="d/t"),
        w2=shardops.pmean("H1 H2", g.w2, axes="d/t"),
        w3=shardops.pmean("H2", g.w3, axes="d/t"),
    )
    new = jax.tree.map(lambda a, b: a - lr * b, w, g)
    return new, shardops.pmean("", value, axes="d/t")


def _dp_body_hand(
    x: jax.Array, y: jax.Array, w: DPWeights, lr: jax.Array
) -> tuple[DPWeights, jax.Array]:
    def local_loss(w: DPWeights) -> jax.Array:
        h = jax.nn.relu(jnp.einsum("ab,bc->ac", x, w.w1))
        h = jax.nn.relu(jnp.einsum("ab,bc->ac", h, w.w2))
        pred = jnp.einsum("ab,b->a", h, w.w3)
        return jnp.mean(jnp.square(pred - y))

    value, g = jax.value_and_grad(local_loss)(_varying(w))
    g = jax.tree.map(lambda a: lax.pmean(a, AXES), g)
    new = jax.tree.map(lambda a, b: a - lr * b, w, g)
    return new, lax.pmean(value, AXES)


def dp_step_hand(
    x: jax.Array, y: jax.Array, w: DPWeights, lr: jax.Array
) -> tuple[DPWeights, jax.Array]:
    return jax.shard_map(
        _dp_body_hand,
        in_specs=(X_SPEC, BATCH_SPEC, DP_SPECS, P()),
        out_specs=(DP_SPECS, P()),
    )(x, y, w, lr)


def _dp_loss_global(w: DPWeights, x: jax.Array, y: jax.Array) -> jax.Array:
    h = jax.nn.relu(jnp.einsum("ab,bc->ac", x, w.w1))
    h = jax.nn.relu(jnp.einsum("ab,bc->ac", h, w.w2))
    pred = jnp.einsum("ab,b->a", h, w.w3)
    return jnp.mean(jnp.square(pred - y))


def dp_step_global(
    x: jax.Array, y: jax.Array, w: DPWeights, lr: jax.Array
) -> tuple[DPWeights, jax.Array]:
    value, g = jax.value_and_grad(_dp_loss_global)(w, x, y)
    return jax.tree.map(lambda a, b: a - lr * b, w, g), value


def init(config: MLPConfig, key: jax.Array, cls: type) -> tuple[jax.Array, jax.Array, object]:
    """Global inputs, targets and weights of class ``cls`` (not yet placed)."""
    k1, k2, k3, k4, k5 = jax.random.split(key, 5)
    c = config
    w = cls(
        w1=jax.random.normal(k1, (c.d_in, c.hidden1), jnp.float32) / c.d_in**0.5,
        w2=jax.random.normal(k2, (c.hidden1, c.hidden2), jnp.float32) / c.hidden1**0.5,
        w3=jax.random.normal(k3, (c.hidden2,), jnp.float32) / c.hidden2**0.5,
    )
    x = jax.random.normal(k4, (c.batch, c.d_in), jnp.float32)
    y = jax.random.normal(k5, (c.batch,), jnp.float32)
    return x, y, w
