"""The pipeline workload: a GPipe training step of stacked MLP layers, written three ways.

``L`` residual MLP layers (``h + relu(h @ w_in) @ w_out``) are stacked along a ``layers`` dim
split over the stage axis ``p`` of a ``('p', 'd')`` mesh: each of the ``p`` stages holds
``L / p`` consecutive layers. ``m`` microbatches of ``B`` rows (split over ``d``: data
parallelism inside each stage) run through the stages by GPipe's schedule, ``m + p - 1`` ticks
under ``lax.scan``; the loss (mean squared error against a target) and the SGD update are
outside the pipeline, in the same ``jit``. The backward pass is ``jax.grad`` of the scan.

- ``shardlib``: ``typed_shard_map`` + ``shardlib.pipeline.gpipe``;
- ``hand``: the same schedule written out with ``jax.shard_map``, ``lax.ppermute``,
  ``lax.scan`` and ``jnp.where`` masks, op for op in ``gpipe``'s order (so the compiled HLO can
  be compared as text);
- ``gspmd``: the schedule in MaxText's style on global arrays, no ``shard_map``: the layers
  reshaped to ``(p, L / p, ...)``, the stage function ``jax.vmap``-ed over the stage dim, the
  state ``(p, B, M)`` pinned to ``P('p', 'd', None)`` with ``with_sharding_constraint`` and
  rotated one stage per tick with ``jnp.roll``; XLA's partitioner turns the roll into the
  transfer between stages.

:func:`reference_step` is the same step on unsharded arrays (all layers in order on every
microbatch), for the tests.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from shardlib import pipeline
from shardlib.shardtypes import Array, f32, pytree_dataclass, typed_shard_map

__all__ = [
    "DATA_SPEC",
    "STACK_SPECS",
    "PipelineConfig",
    "Stack",
    "forward_gspmd",
    "forward_hand",
    "forward_shardlib",
    "init",
    "loss_of",
    "reference_step",
    "sgd_step",
]

STAGE_AXIS = "p"


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    layers: int  # L, a multiple of the number of stages
    d_model: int  # M
    d_ff: int  # F
    rows: int  # B, global rows per microbatch (a multiple of the 'd' axis size)
    microbatches: int  # m


@pytree_dataclass
class Stack:
    w_in: f32[Array, b"layers/p M F"]
    w_out: f32[Array, b"layers/p F M"]


# The hand-written shard_map's in_specs, as PartitionSpec literals (a Stack of specs, not arrays).
STACK_SPECS = Stack(
    w_in=P(STAGE_AXIS, None, None),  # pyright: ignore[reportArgumentType]
    w_out=P(STAGE_AXIS, None, None),  # pyright: ignore[reportArgumentType]
)
DATA_SPEC = P(None, "d", None)  # 'm B/d M'


def init(c: PipelineConfig, key: jax.Array) -> tuple[Stack, jax.Array, jax.Array]:
    """Global (unplaced) weights, microbatches ``x`` and targets, both ``(m, B, M)``."""
    k1, k2, k3, k4 = jax.random.split(key, 4)
    w_in = jax.random.normal(k1, (c.layers, c.d_model, c.d_ff), jnp.float32) / c.d_model**0.5
    w_out = jax.random.normal(k2, (c.layers, c.d_ff, c.d_model), jnp.float32) / c.d_ff**0.5
    shape = (c.microbatches, c.rows, c.d_model)
    x = jax.random.normal(k3, shape, jnp.float32)
    target = jax.random.normal(k4, shape, jnp.float32)
    return Stack(w_in=w_in, w_out=0.5 * w_out), x, target


def _stage(s: Stack, h: jax.Array) -> jax.Array:
    """One stage: its block of layers in order, on one microbatch block ``'B M'``."""

    def layer(h, w):
        w_in, w_out = w
        return h + jax.nn.relu(h @ w_in) @ w_out, None

    h, _ = lax.scan(layer, h, (s.w_in, s.w_out))
    return h


# ---------------------------------------------------------------------------------------------
# The three forward passes: (Stack, x 'm B/d M') -> y 'm B/d M', replicated over 'p'.
# ---------------------------------------------------------------------------------------------


@typed_shard_map
def forward_shardlib(s: Stack, x: f32[Array, b"m B/d M"]) -> f32[Array, b"m B/d M"]:
    return pipeline.gpipe(_stage, s, x, spec="B/d M", axis=STAGE_AXIS)


def _hand_body(s: Stack, x: jax.Array) -> jax.Array:
    """``gpipe``'s per-device program with plain ``jax.lax`` (same ops, same order)."""
    m = x.shape[0]
    n = lax.axis_size(STAGE_AXIS)
    stage = lax.axis_index(STAGE_AXIS)
    zero = jnp.zeros_like(x[0])
    # The weights (the same on every 'd' device) made to vary over 'd' before the loop, so
    # their gradient is summed over 'd' once, after it, not at every tick.
    s = jax.tree.map(lambda w: lax.pcast(w, ("d",), to="varying"), s)

    def tick(state: jax.Array, t: jax.Array) -> tuple[jax.Array, jax.Array]:
        fresh = lax.dynamic_index_in_dim(x, jnp.minimum(t, m - 1), keepdims=False)
        h = jnp.where(stage == 0, fresh, state)
        working = (t >= stage) & (t - stage < m)
        h = jnp.where(working, h, zero)
        y = _stage(s, h)
        y = jnp.where(working, y, jnp.zeros_like(y))
        sent = lax.ppermute(y, STAGE_AXIS, perm=[(i, i + 1) for i in range(n - 1)])
        return sent, y

    # The carry varies over 'p' as well as 'd' (each stage has its own weights).
    init = lax.pcast(zero, (STAGE_AXIS,), to="varying")
    _, ys = lax.scan(tick, init, jnp.arange(m + n - 1))
    out = jnp.where(stage == n - 1, ys[n - 1 :], jnp.zeros_like(ys[n - 1 :]))
    return lax.psum(out, STAGE_AXIS)


def forward_hand(s: Stack, x: jax.Array) -> jax.Array:
    return jax.shard_map(_hand_body, in_specs=(STACK_SPECS, DATA_SPEC), out_specs=DATA_SPEC)(s, x)


def forward_gspmd(s: Stack, x: jax.Array) -> jax.Array:
    """MaxText-style GSPMD pipeline: vmap over a stage dim sharded over 'p', rotate the state."""
    mesh = jax.sharding.get_abstract_mesh()
    n = mesh.shape[STAGE_AXIS]
    m = x.shape[0]

    def pin(a: jax.Array, *spec: Any) -> jax.Array:
        return jax.lax.with_sharding_constraint(a, P(*spec))

    w = jax.tree.map(lambda a: pin(a.reshape(n, a.shape[0] // n, *a.shape[1:]), STAGE_AXIS), s)
    stages = jnp.arange(n)

    def tick(state: jax.Array, t: jax.Array) -> tuple[jax.Array, jax.Array]:
        fresh = lax.dynamic_index_in_dim(x, jnp.minimum(t, m - 1), keepdims=False)
        h = jnp.where((stages == 0)[:, None, None], fresh[None], state)
        working = ((t >= stages) & (t - stages < m))[:, None, None]
        h = pin(jnp.where(working, h, 0.0), STAGE_AXIS, "d", None)
        y = jax.vmap(_stage)(w, h)
        y = pin(jnp.where(working, y, 0.0), STAGE_AXIS, "d", None)
        rotated = pin(jnp.roll(y, 1, axis=0), STAGE_AXIS, "d", None)  # stage s -> s + 1
        return rotated, y

    init = pin(jnp.zeros((n, *x.shape[1:]), x.dtype), STAGE_AXIS, "d", None)
    _, ys = lax.scan(tick, init, jnp.arange(m + n - 1))  # (ticks, stages, B, M)
    return pin(ys[n - 1 :, n - 1], None, "d", None)  # the last stage's outputs


# ---------------------------------------------------------------------------------------------
# The step: loss, gradient, SGD.
# ---------------------------------------------------------------------------------------------

Forward = Callable[[Stack, jax.Array], jax.Array]


def loss_of(forward: Forward, s: Stack, x: jax.Array, target: jax.Array) -> jax.Array:
    return jnp.mean((forward(s, x) - target) ** 2)


def sgd_step(forward: Forward) -> Callable[..., tuple[Stack, jax.Array]]:
    """An (unjitted) step ``(params, x, target, lr) -> (new params, loss)``; a fresh closure."""

    def step(s: Stack, x: jax.Array, target: jax.Array, lr: jax.Array) -> tuple[Stack, Any]:
        value, g = jax.value_and_grad(lambda s: loss_of(forward, s, x, target))(s)
        return jax.tree.map(lambda w, gw: w - lr * gw, s, g), value

    return step


def _all_layers(s: Stack, x: jax.Array) -> jax.Array:
    """Every layer in order on every microbatch, on unsharded arrays."""
    return jax.vmap(lambda h: _stage(s, h))(x)


def reference_step(s: Stack, x: Any, target: Any, lr: float) -> tuple[Stack, jax.Array]:
    """The step on unsharded arrays (no mesh, no pipeline): the value the variants must give."""
    host = jax.devices()[0]
    s, x, target = jax.device_put((s, x, target), host)
    return jax.jit(sgd_step(_all_layers))(s, x, target, jnp.float32(lr))


def place(s: Stack, x: jax.Array, target: jax.Array) -> tuple[Stack, jax.Array, jax.Array]:
    """The inputs on the current mesh: layers over 'p', microbatch rows over 'd'."""
    mesh = jax.sharding.get_mesh()
    s = jax.device_put(s, jax.tree.map(lambda p: NamedSharding(mesh, p), STACK_SPECS))
    data = NamedSharding(mesh, DATA_SPEC)
    return s, jax.device_put(x, data), jax.device_put(target, data)
