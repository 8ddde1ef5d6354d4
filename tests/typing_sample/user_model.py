"""A small model written the way the docs show, kept free of static type errors.

CI runs pyright (basic) on this file (``[tool.pyright] include``), and
``tests/test_static_typing.py`` runs it too, so it must stay at zero errors with no
per-line ignores. ``tests/test_static_typing.py`` also runs it, against a NumPy reference.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from shardlib import shardops
from shardlib.shardtypes import (
    Array,
    Stacked,
    f32,
    i32,
    make_partition_specs,
    make_shardings,
    pytree_dataclass,
    typed_shard_map,
)


@pytree_dataclass
class Layer:
    w_in: f32[Array, b"M/d F"]
    w_out: f32[Array, b"F M/d"]


@pytree_dataclass(frozen=True)
class Model:
    embed: f32[Array, b"V M/d"]
    layers: Stacked[Layer, b"layers"]


def init(key: jax.Array, vocab: int, d_model: int, d_ff: int, n_layers: int) -> Model:
    k_embed, k_in, k_out = jax.random.split(key, 3)
    layers = Layer(
        jax.random.normal(k_in, (n_layers, d_model, d_ff)) / np.sqrt(d_model),
        jax.random.normal(k_out, (n_layers, d_ff, d_model)) / np.sqrt(d_ff),
    )
    return Model(embed=jax.random.normal(k_embed, (vocab, d_model)), layers=layers)


def mlp(x: jax.Array, w: Layer) -> jax.Array:
    """Per device: ``x`` is ``B/d M``; the weights are gathered just before use."""
    w_in = shardops.all_gather("M/d F -> M F", w.w_in)
    h = jax.nn.relu(shardops.einsum_unreduced("B/d M, M F -> B/d F", x, w_in))
    w_out = shardops.all_gather("F M/d -> F M", w.w_out)
    return x + shardops.einsum_unreduced("B/d F, F M -> B/d M", h, w_out)


@typed_shard_map
def forward(tokens: i32[Array, b"B/d"], model: Model) -> f32[Array, b"B/d M"]:
    embed = shardops.all_gather("V M/d -> V M", model.embed)
    x = embed[tokens]

    def body(x: jax.Array, w: Layer) -> tuple[jax.Array, None]:
        return mlp(x, w), None

    x, _ = lax.scan(body, x, model.layers)
    return x


@typed_shard_map
def mean_square(x: f32[Array, b"B/d M"]) -> f32[Array, b""]:
    local = jnp.sum(x * x)
    total = shardops.psum("", local, axes="d")
    return total / (x.shape[0] * shardops.axis_size("d") * x.shape[1])


@partial(typed_shard_map, check_rep=False)
def rms_norm(x: f32[Array, b"B/d M"]) -> f32[Array, b"B/d M"]:
    """Each row scaled to unit root mean square (decorated with JAX's ``partial`` idiom)."""
    return x * lax.rsqrt(jnp.mean(x * x, axis=1, keepdims=True) + 1e-6)


@typed_shard_map(check_vma=False)
def scale_rows(x: f32[Array, b"B/d M"], s: f32[Array, b"B/d"]) -> f32[Array, b"B/d M"]:
    return x * s[:, None]


def reference(tokens: np.ndarray, model: Model) -> np.ndarray:
    """The same network in NumPy, on global arrays."""
    x = np.asarray(model.embed)[tokens]
    for i in range(np.shape(model.layers.w_in)[0]):
        w_in = np.asarray(model.layers.w_in)[i]
        w_out = np.asarray(model.layers.w_out)[i]
        x = x + np.maximum(x @ w_in, 0.0) @ w_out
    return x


def main() -> float:
    """Run the model on 8 devices; return the largest difference from the NumPy reference."""
    mesh = jax.make_mesh((8,), ("d",))
    with jax.set_mesh(mesh):
        model = init(jax.random.key(0), vocab=32, d_model=16, d_ff=32, n_layers=3)
        model = jax.device_put(model, make_shardings(Model))
        specs: Model = make_partition_specs(Model)
        assert specs.layers.w_in == jax.sharding.PartitionSpec(None, "d", None)
        tokens = jnp.arange(16, dtype=jnp.int32) % 32
        out = jax.jit(forward)(tokens, model)
        loss = float(mean_square(out))
        ref = reference(np.asarray(tokens), jax.device_get(model))
        err = float(np.max(np.abs(np.asarray(out) - ref)))
        assert abs(loss - float(np.mean(ref * ref))) < 1e-3 * max(1.0, loss), loss
        s = jnp.arange(1, 17, dtype=jnp.float32)
        normed: jax.Array = scale_rows(rms_norm(out), s)
        ref_norm = ref / np.sqrt(np.mean(ref * ref, axis=1, keepdims=True) + 1e-6)
        ref_norm = ref_norm * np.arange(1, 17)[:, None]
        return max(err, float(np.max(np.abs(np.asarray(normed) - ref_norm))))


if __name__ == "__main__":
    print(f"max |shardlib - numpy| = {main():.2e}")
