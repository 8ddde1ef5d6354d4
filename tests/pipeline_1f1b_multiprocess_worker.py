"""One process of the 1F1B multi-process test (see test_pipeline_1f1b_multiprocess.py).

Not a test module. Usage: python tests/pipeline_1f1b_multiprocess_worker.py PID NPROC PORT OUT
As ``tests/pipeline_multiprocess_worker.py`` (whose mesh, weights and data it reuses: stage
0 on process 0's four devices, stage 1 on process 1's), with the loss computed by
``pipeline.one_f_one_b`` on the last stage: every forward transfer and every backward
cotangent between the stages crosses the processes.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from shardlib import pipeline, shardops
from shardlib.shardtypes import Array, f32, make_shardings, typed_shard_map
from tests import _pipeline_model as pm
from tests import pipeline_multiprocess_worker as base
from tests._multiprocess_util import worker_main
from tests._pipeline_model import Stack3

STEPS, LR = 3, 0.1


def head(_: Any, y: jax.Array, coef: jax.Array) -> jax.Array:
    """One microbatch's share of ``pm.loss`` on a 'B/d M' block."""
    return shardops.psum("", jnp.sum(jnp.tanh(y) * coef), axes="d")


@typed_shard_map
def loss_fn(s: Stack3, x: f32[Array, b"m B/d M"], coef: f32[Array, b"m B/d M"]) -> f32[Array, b""]:
    return pipeline.one_f_one_b(
        jax.checkpoint(pm.stage3), s, x, spec="B/d M", loss_fn=head, targets=coef
    )


@jax.jit
def sgd_step(s: Stack3, x: jax.Array, coef: jax.Array) -> tuple[Stack3, jax.Array, Stack3]:
    loss, g = jax.value_and_grad(loss_fn)(s, x, coef)
    return jax.tree.map(lambda w, gw: w - LR * gw, s, g), loss, g


def train(mesh: Mesh) -> dict[str, Any]:
    """``STEPS`` SGD steps on ``mesh``: losses, first gradients, final weights (global)."""
    with jax.set_mesh(mesh):
        params = jax.tree.map(
            lambda v, sh: jax.make_array_from_callback(v.shape, sh, lambda i, v=v: v[i]),
            Stack3(**base.weights()),
            make_shardings(Stack3),
        )
        x_np, coef_np = base.data()
        x_sh = make_shardings(f32[Array, b"m B/d M"])
        x = jax.make_array_from_callback(x_np.shape, x_sh, lambda i: x_np[i])
        coef = jax.make_array_from_callback(coef_np.shape, x_sh, lambda i: coef_np[i])
        losses, first = [], None
        for _ in range(STEPS):
            params, loss, g = sgd_step(params, x, coef)
            losses.append(float(loss))
            first = base._global(g) if first is None else first
        return {"losses": losses, "grads": first, "params": base._global(params)}


if __name__ == "__main__":
    worker_main(lambda: train(base.stage_mesh(jax.devices())))
