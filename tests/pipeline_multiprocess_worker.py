"""One process of the pipeline multi-process test (see test_pipeline_multiprocess.py).

Not a test module. Usage: python tests/pipeline_multiprocess_worker.py PID NPROC PORT OUT_JSON
Each process has 4 simulated CPU devices (XLA_FLAGS set by the parent); together they form
one (2, 2, 2) mesh ('p', 'd', 't') whose stage axis 'p' spans the processes: stage 0's four
devices are process 0's, stage 1's are process 1's, so every GPipe transfer between the
stages crosses processes. The same `train` runs in the pytest process on 8 local devices.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import AxisType, Mesh

from shardlib import pipeline
from shardlib.shardtypes import Array, f32, make_shardings, typed_shard_map
from tests import _pipeline_model as pm
from tests._multiprocess_util import worker_main
from tests._pipeline_model import Stack3

L, MICRO = 4, 4  # layers, microbatches (widths and rows: tests._pipeline_model's)
SHAPE, NAMES = (2, 2, 2), ("p", "d", "t")
STEPS = 3
LR = 0.1


def weights() -> dict[str, np.ndarray]:
    return pm.weights(0, L)


def data() -> tuple[np.ndarray, np.ndarray]:
    """The microbatches ``x`` and the loss coefficients, both ``(MICRO, B, M)``."""
    return pm.microbatches(1, MICRO)


def stage_mesh(devices: list[Any]) -> Mesh:
    """The (2, 2, 2) mesh with each process's devices on one stage (process-major order)."""
    ordered = sorted(devices, key=lambda d: (d.process_index, d.id))
    grid = np.array(ordered, dtype=object).reshape(SHAPE)
    return Mesh(grid, NAMES, axis_types=(AxisType.Explicit,) * len(NAMES))


@typed_shard_map
def forward(s: Stack3, x: f32[Array, b"m B/d M"]) -> f32[Array, b"m B/d M"]:
    return pipeline.gpipe(jax.checkpoint(pm.stage3), s, x, spec="B/d M", axis="p")


def loss_fn(s: Stack3, x: jax.Array, coef: jax.Array) -> jax.Array:
    return pm.loss(forward(s, x), coef)


@jax.jit
def sgd_step(s: Stack3, x: jax.Array, coef: jax.Array) -> tuple[Stack3, jax.Array, Stack3]:
    loss, g = jax.value_and_grad(loss_fn)(s, x, coef)
    return jax.tree.map(lambda w, gw: w - LR * gw, s, g), loss, g


def _global(tree: Any) -> dict[str, list]:
    """Every leaf gathered to this process as a global numpy array, as nested lists."""
    full = multihost_utils.process_allgather(tree, tiled=True)
    return {k: np.asarray(v).tolist() for k, v in vars(full).items()}


def train(mesh: Mesh) -> dict[str, Any]:
    """``STEPS`` SGD steps of the pipelined loss on ``mesh``: losses, first grads, final weights.

    Arrays are built with ``make_array_from_callback`` (each process fills its own blocks).
    """
    with jax.set_mesh(mesh):
        shardings = make_shardings(Stack3)
        params = jax.tree.map(
            lambda v, sh: jax.make_array_from_callback(v.shape, sh, lambda i, v=v: v[i]),
            Stack3(**weights()),
            shardings,
        )
        x_np, coef_np = data()
        x_sh = make_shardings(f32[Array, b"m B/d M"])
        x = jax.make_array_from_callback(x_np.shape, x_sh, lambda i: x_np[i])
        coef = jax.make_array_from_callback(coef_np.shape, x_sh, lambda i: coef_np[i])
        losses, first_grads = [], None
        for _ in range(STEPS):
            params, loss, g = sgd_step(params, x, coef)
            losses.append(float(loss))
            if first_grads is None:
                first_grads = _global(g)
        return {
            "losses": losses,
            "grads": first_grads,
            "params": _global(params),
            "fully_addressable": bool(params.w_in.is_fully_addressable),
        }


def _work() -> dict[str, Any]:
    mesh = stage_mesh(jax.devices())
    stage_processes = [sorted({d.process_index for d in mesh.devices[s].flat}) for s in (0, 1)]
    return {**train(mesh), "stage_processes": stage_processes}


if __name__ == "__main__":
    worker_main(_work)
