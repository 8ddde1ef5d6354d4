"""The stack of MLP layers the pipeline tests run through the schedules (not collected).

Shared by ``tests/test_pipeline.py`` and the multi-process worker
``tests/pipeline_multiprocess_worker.py`` (which imports it from its own process).

A layer is ``(relu(h @ w_in) @ w_out + bias) * gain``: the bias makes a stage's output on a
zero input non-zero, so a bubble value leaking into the results or the gradients would show.
The stack, ``(L, ...)`` in model order, is split over the stage axis ``p``: ``Stack``
(``'layers/p M F'``), ``Stack3`` (with data and tensor parallelism inside each stage, on a
``(p, d, t)`` mesh) and ``Groups3`` (the circular schedule's ``(v, L / v, ...)`` layout, see
`groups`). `reference` applies all layers in order on the global arrays, no mesh.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_extra import save_for_backward
from shardlib import shardops
from shardlib.shardtypes import Array, f32, pytree_dataclass

M, F, B = 8, 16, 4  # model width, hidden width, rows per microbatch


@pytree_dataclass
class Stack:
    w_in: f32[Array, b"layers/p M F"]
    w_out: f32[Array, b"layers/p F M"]
    bias: f32[Array, b"layers/p M"]
    gain: f32[Array, b"layers/p M"]


@pytree_dataclass
class Stack3:  # tensor parallel inside each stage: (p, d, t) mesh
    w_in: f32[Array, b"layers/p M/d F/t"]
    w_out: f32[Array, b"layers/p F/t M/d"]
    bias: f32[Array, b"layers/p M"]
    gain: f32[Array, b"layers/p M"]


@pytree_dataclass
class Groups3:  # the circular schedule's layout: v layer groups per stage
    w_in: f32[Array, b"v layers/p M/d F/t"]
    w_out: f32[Array, b"v layers/p F/t M/d"]
    bias: f32[Array, b"v layers/p M"]
    gain: f32[Array, b"v layers/p M"]


def weights(seed: int, layers: int) -> dict[str, np.ndarray]:
    """Random global weights of ``layers`` layers, by field name, in model order."""
    rng = np.random.default_rng(seed)
    return {
        "w_in": (rng.standard_normal((layers, M, F)) / np.sqrt(M)).astype(np.float32),
        "w_out": (rng.standard_normal((layers, F, M)) / np.sqrt(F)).astype(np.float32),
        "bias": (0.1 * rng.standard_normal((layers, M))).astype(np.float32),
        "gain": (1 + 0.1 * rng.standard_normal((layers, M))).astype(np.float32),
    }


def groups(w: dict[str, np.ndarray], v: int) -> dict[str, np.ndarray]:
    """The ``(L, ...)`` stack reshaped to ``(v, L / v, ...)``: `Groups3`'s layout."""
    return {k: a.reshape(v, -1, *a.shape[1:]) for k, a in w.items()}


def microbatches(seed: int, m: int) -> tuple[np.ndarray, np.ndarray]:
    """``m`` microbatches ``x`` and the loss coefficients, both ``(m, B, M)``."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, B, M)).astype(np.float32)
    return x, rng.standard_normal((m, B, M)).astype(np.float32)


def stage(s: Stack, h: jax.Array) -> jax.Array:
    """This stage's layers in order, on one microbatch block 'B M'."""

    def layer(h, lw):
        w_in, w_out, bias, gain = lw
        return (jax.nn.relu(h @ w_in) @ w_out + bias) * gain, None

    h, _ = lax.scan(layer, h, (s.w_in, s.w_out, s.bias, s.gain))
    return h


def stage3(s: Stack3, h: jax.Array, mark: bool = False) -> jax.Array:
    """As `stage` with the weights gathered over 'd' and the hidden dim split over 't';
    with ``mark``, each layer's hidden activation is marked with ``save_for_backward``."""

    def layer(h, lw):
        w_in, w_out, bias, gain = lw
        z = jax.nn.relu(shardops.einsum_unreduced("B/d M, M F/t -> B/d F/t", h, w_in))
        z = save_for_backward(z) if mark else z
        y = shardops.einsum_unreduced("B/d F/t, F/t M -> B/d M", z, w_out)
        return (shardops.psum("B/d M", y, axes="t") + bias) * gain, None

    w_in = shardops.all_gather("layers/p M/d F/t -> layers/p M F/t", s.w_in)
    w_out = shardops.all_gather("layers/p F/t M/d -> layers/p F/t M", s.w_out)
    h, _ = lax.scan(layer, h, (w_in, w_out, s.bias, s.gain))
    return h


def reference(w: dict, x: jax.Array) -> jax.Array:
    """All layers in order on every microbatch, on the global arrays (no mesh)."""
    for i in range(len(w["w_in"])):
        x = (jax.nn.relu(x @ w["w_in"][i]) @ w["w_out"][i] + w["bias"][i]) * w["gain"][i]
    return x


def loss(y: jax.Array, coef: jax.Array) -> jax.Array:
    """The tests' loss on the pipeline's outputs."""
    return jnp.sum(jnp.tanh(y) * coef)
