"""The FSDP MLP from the original shardlib README, on current JAX.

Run: python examples/fsdp_mlp.py   (simulates 8 CPU devices when no accelerator is present)
"""

import argparse
import sys

from examples import _devices

_devices.simulate_cpu_devices(8)  # sets XLA_FLAGS: 8 simulated CPU devices, before JAX starts

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import shardlib.shardops as shardops  # noqa: E402
from shardlib import shardtypes  # noqa: E402
from shardlib.shardtypes import Array, f32, make_shardings, pytree_dataclass, typed_shard_map  # noqa: E402

shardtypes.register_with_typeguard()

# A mesh of 8 devices; 'd' is the data-parallel axis.
MESH = jax.make_mesh((8,), ("d",))


# At rest, weights are fully sharded over 'd' (FSDP). `hidden1/d` means the second dim has
# global size `hidden1` and each device holds `hidden1 / |d|` of it.
@pytree_dataclass
class Weights:
    w1: f32[Array, b"in hidden1/d"]
    w2: f32[Array, b"hidden1 hidden2/d"]
    w3: f32[Array, b"hidden2/d"]


@typed_shard_map
def forward_pass(x: f32[Array, b"batch/d in"], w: Weights) -> f32[Array, b"batch/d"]:
    # Weights are all-gathered just before use: the core idea of FSDP.
    w1 = shardops.all_gather("in hidden1/d -> in hidden1", w.w1)
    y = jax.nn.relu(shardops.einsum_unreduced("batch/d in, in hidden1 -> batch/d hidden1", x, w1))
    w2 = shardops.all_gather("hidden1 hidden2/d -> hidden1 hidden2", w.w2)
    z = jax.nn.relu(
        shardops.einsum_unreduced("batch/d hidden1, hidden1 hidden2 -> batch/d hidden2", y, w2)
    )
    w3 = shardops.all_gather("hidden2/d -> hidden2", w.w3)
    return shardops.einsum_unreduced("batch/d hidden2, hidden2 -> batch/d", z, w3)


def reference(x, w: Weights):
    """The same network in plain jax.numpy on global arrays."""
    return jax.nn.relu(jax.nn.relu(x @ w.w1) @ w.w2) @ w.w3


def build_parser() -> argparse.ArgumentParser:
    """The command line (no flags; ``--help`` describes the example)."""
    return argparse.ArgumentParser(
        description=(__doc__ or "").splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )


def main(argv: list[str] | None = None) -> dict:
    """Run the sharded MLP once; return its output, the reference and the largest difference."""
    build_parser().parse_args(argv or [])  # no options; --help describes the example
    with jax.set_mesh(MESH):
        k1, k2, k3, k4 = jax.random.split(jax.random.key(0), 4)
        w = Weights(
            w1=jax.random.normal(k1, (16, 32)) / 4,
            w2=jax.random.normal(k2, (32, 16)) / 6,
            w3=jax.random.normal(k3, (16,)) / 4,
        )
        # Place the weights in the layout their annotations describe.
        w = jax.tree.map(jax.device_put, w, make_shardings(Weights))
        x = jax.random.normal(k4, (32, 16))
        y = jax.jit(forward_pass)(x, w)
        # The reference runs on one device, on gathered copies of the global arrays.
        ref = reference(*jax.device_get((x, w)))
        err = float(jnp.max(jnp.abs(y - ref)))
        print(
            f"output shape {y.shape}, layout {y.sharding.spec}, max |shardlib - reference| = {err:.2e}"
        )
        print("w1 per-device block:", w.w1.addressable_shards[0].data.shape, "of", w.w1.shape)
        assert err < 1e-4, err
        return {
            "output": jax.device_get(y),
            "reference": ref,
            "max_err": err,
            "output_spec": y.sharding.spec,
            "w1_block_shape": w.w1.addressable_shards[0].data.shape,
        }


if __name__ == "__main__":
    main(sys.argv[1:])
