"""One process of the pipeline multi-process test (see test_pipeline_multiprocess.py).

Not a test module. Usage: python tests/pipeline_multiprocess_worker.py PID NPROC PORT OUT_JSON
Each process has 4 simulated CPU devices (XLA_FLAGS set by the parent); together they form
one (2, 2, 2) mesh ('p', 'd', 't') whose stage axis 'p' spans the processes: stage 0's four
devices are process 0's, stage 1's are process 1's, so every GPipe transfer between the
stages crosses processes. The same `train` runs in the pytest process on 8 local devices.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import multihost_utils
from jax.sharding import AxisType, Mesh

from shardlib import pipeline, shardops
from shardlib.shardtypes import Array, f32, make_shardings, pytree_dataclass, typed_shard_map

L, M, F, B, MICRO = 4, 8, 16, 4, 4  # layers, model, hidden, rows per microbatch, microbatches
SHAPE, NAMES = (2, 2, 2), ("p", "d", "t")
STEPS = 3
LR = 0.1


@pytree_dataclass
class Stack3:
    w_in: f32[Array, b"layers/p M/d F/t"]
    w_out: f32[Array, b"layers/p F/t M/d"]
    bias: f32[Array, b"layers/p M"]
    gain: f32[Array, b"layers/p M"]


def weights() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "w_in": (rng.standard_normal((L, M, F)) / np.sqrt(M)).astype(np.float32),
        "w_out": (rng.standard_normal((L, F, M)) / np.sqrt(F)).astype(np.float32),
        "bias": (0.1 * rng.standard_normal((L, M))).astype(np.float32),
        "gain": (1 + 0.1 * rng.standard_normal((L, M))).astype(np.float32),
    }


def data() -> tuple[np.ndarray, np.ndarray]:
    """The microbatches ``x`` and the loss coefficients, both ``(MICRO, B, M)``."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((MICRO, B, M)).astype(np.float32)
    return x, rng.standard_normal((MICRO, B, M)).astype(np.float32)


def stage_mesh(devices: list[Any]) -> Mesh:
    """The (2, 2, 2) mesh with each process's devices on one stage (process-major order)."""
    ordered = sorted(devices, key=lambda d: (d.process_index, d.id))
    grid = np.array(ordered, dtype=object).reshape(SHAPE)
    return Mesh(grid, NAMES, axis_types=(AxisType.Explicit,) * len(NAMES))


def _stage(s: Stack3, h: jax.Array) -> jax.Array:
    """This stage's layers on one microbatch 'B/d M': weights gathered over 'd', F over 't'."""

    def layer(h, lw):
        w_in, w_out, bias, gain = lw
        z = jax.nn.relu(shardops.einsum_unreduced("B/d M, M F/t -> B/d F/t", h, w_in))
        y = shardops.einsum_unreduced("B/d F/t, F/t M -> B/d M", z, w_out)
        return (shardops.psum("B/d M", y, axes="t") + bias) * gain, None

    w_in = shardops.all_gather("layers/p M/d F/t -> layers/p M F/t", s.w_in)
    w_out = shardops.all_gather("layers/p F/t M/d -> layers/p F/t M", s.w_out)
    h, _ = lax.scan(layer, h, (w_in, w_out, s.bias, s.gain))
    return h


@typed_shard_map
def forward(s: Stack3, x: f32[Array, b"m B/d M"]) -> f32[Array, b"m B/d M"]:
    return pipeline.gpipe(jax.checkpoint(_stage), s, x, spec="B/d M", axis="p")


def loss_fn(s: Stack3, x: jax.Array, coef: jax.Array) -> jax.Array:
    return jnp.sum(jnp.tanh(forward(s, x)) * coef)


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


def main() -> None:
    pid, nproc, port, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=nproc, process_id=pid)
    try:
        mesh = stage_mesh(jax.devices())
        stage_processes = [sorted({d.process_index for d in mesh.devices[s].flat}) for s in (0, 1)]
        result = train(mesh)
        result.update(
            process=pid,
            devices=jax.device_count(),
            local_devices=jax.local_device_count(),
            stage_processes=stage_processes,
        )
        with open(out, "w") as f:
            json.dump(result, f)
    finally:
        jax.distributed.shutdown()


if __name__ == "__main__":
    main()
