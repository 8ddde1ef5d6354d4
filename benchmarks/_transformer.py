"""The transformer training step of ``examples/transformer_model.py`` written two more ways.

- :func:`hand_loss`: the same per-device program with ``jax.shard_map`` and ``jax.lax``
  collectives. Every ``shardops`` call is replaced by the ``lax`` collective it stands for,
  einsum equations use the letters shardlib assigns (dim names get ``a, b, c, ...`` in order of
  first appearance, operands then output), ``in_specs``/``out_specs`` are written out as
  ``PartitionSpec`` literals, and the layer runs under ``jax.checkpoint`` with the policy that
  ``jax_extra.explicit_activation_checkpointing`` uses (values marked with the same checkpoint
  name, ``'jax_extra.save_for_backward'``, are saved). The remat policy can be swapped for the
  remat comparison.
- :func:`global_loss`: the same global math on global arrays with no sharding annotations at
  all: under ``jax.jit`` with ``in_shardings``/``out_shardings`` the partitioner decides the
  communication (the ``auto`` variant).

The pure-``jnp`` pieces (RMSNorm, RoPE, softmax) are copies of the model's: both programs must
do exactly the same arithmetic for their compiled HLO to be comparable.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from examples.transformer_model import Config, Layer, Model
from jax_extra import SAVE_FOR_BACKWARD_NAME

__all__ = [
    "LAYER_SPECS",
    "MODEL_SPECS",
    "POLICIES",
    "SAVE_NAME",
    "TOKENS_SPEC",
    "global_loss",
    "hand_loss",
    "hand_loss_body",
]

# The checkpoint name jax_extra.save_for_backward attaches (a label, imported so that the two
# steps cannot drift apart).
SAVE_NAME = SAVE_FOR_BACKWARD_NAME

# How each layer is rematerialised: 'explicit' = what explicit_activation_checkpointing does
# (save the layer's arguments and the marked values), 'none' = no jax.checkpoint at all (save
# whatever autodiff keeps), 'nothing_saveable' = jax.checkpoint saving only the arguments.
POLICIES = ("explicit", "none", "nothing_saveable")

LAYER_SPECS = Layer(
    ln1=P(None, ("t", "d")),
    w_q=P(None, "d", "t", None, None),
    w_k=P(None, "d", "t", None),
    w_v=P(None, "d", "t", None),
    w_o=P(None, "t", None, None, "d"),
    ln2=P(None, ("t", "d")),
    w_gate=P(None, "d", "t"),
    w_up=P(None, "d", "t"),
    w_down=P(None, "t", "d"),
)
MODEL_SPECS = Model(
    embed=P("t", "d"), layers=LAYER_SPECS, final_norm=P(("t", "d")), unembed=P("d", "t")
)
TOKENS_SPEC = P("d", None)


def rms_norm(x: jax.Array, gain: jax.Array, eps: float) -> jax.Array:
    return x * lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * gain


def rope(x: jax.Array, seq_axis: int, base: float) -> jax.Array:
    length, width = x.shape[seq_axis], x.shape[-1]
    half = width // 2
    inv_freq = base ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angle = jnp.arange(length, dtype=jnp.float32)[:, None] * inv_freq[None, :]
    angle = angle.reshape((length,) + (1,) * (x.ndim - seq_axis - 2) + (half,))
    cos, sin = jnp.cos(angle), jnp.sin(angle)
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def softmax(x: jax.Array) -> jax.Array:
    e = jnp.exp(x - jnp.max(x, axis=-1, keepdims=True))
    return e / jnp.sum(e, axis=-1, keepdims=True)


def _remat(fn: Any, policy: str) -> Any:
    if policy == "none":
        return fn
    if policy == "explicit":
        p = jax.checkpoint_policies.save_only_these_names(SAVE_NAME)
    elif policy == "nothing_saveable":
        p = jax.checkpoint_policies.nothing_saveable
    else:
        raise ValueError(f"unknown remat policy {policy!r}; choose one of {POLICIES}")
    return jax.checkpoint(fn, prevent_cse=True, policy=p)


# ---------------------------------------------------------------------------------------------
# Hand-written shard_map.
# ---------------------------------------------------------------------------------------------


def _hand_layer(config: Config, x: jax.Array, w: Layer) -> jax.Array:
    ln1 = lax.all_gather(w.ln1, ("t", "d"), axis=0, tiled=True)
    h = rms_norm(x, ln1, config.norm_eps)
    w_q = lax.all_gather(w.w_q, "d", axis=0, tiled=True)
    q = jnp.einsum("abc,cdef->abdef", h, w_q)  # B L M, M K G D -> B L K G D
    w_k = lax.all_gather(w.w_k, "d", axis=0, tiled=True)
    k = jnp.einsum("abc,cde->abde", h, w_k)  # B L M, M K D -> B L K D
    w_v = lax.all_gather(w.w_v, "d", axis=0, tiled=True)
    v = jnp.einsum("abc,cde->abde", h, w_v)
    q = rope(q, 1, config.rope_base)
    k = rope(k, 1, config.rope_base)
    scores = jnp.einsum("abcde,afce->acdbf", q, k)  # B L K G D, B S K D -> B K G L S
    scores = scores / math.sqrt(q.shape[-1])
    seq = x.shape[1]
    causal = jnp.arange(seq)[:, None] >= jnp.arange(seq)[None, :]
    scores = jnp.where(causal, scores, -jnp.inf)
    probs = softmax(scores)
    o = jnp.einsum("abcde,aebf->adbcf", probs, v)  # B K G L S, B S K D -> B L K G D
    o = checkpoint_name(o, SAVE_NAME)
    w_o = lax.all_gather(w.w_o, "d", axis=3, tiled=True)
    attn = jnp.einsum("abcde,cdef->abf", o, w_o)  # B L K G D, K G D M -> B L M
    attn = lax.psum(attn, "t")
    x = checkpoint_name(x + attn, SAVE_NAME)

    ln2 = lax.all_gather(w.ln2, ("t", "d"), axis=0, tiled=True)
    h = rms_norm(x, ln2, config.norm_eps)
    w_gate = lax.all_gather(w.w_gate, "d", axis=0, tiled=True)
    gate = jnp.einsum("abc,cd->abd", h, w_gate)  # B L M, M F -> B L F
    w_up = lax.all_gather(w.w_up, "d", axis=0, tiled=True)
    up = jnp.einsum("abc,cd->abd", h, w_up)
    act = jax.nn.silu(gate) * up
    w_down = lax.all_gather(w.w_down, "d", axis=1, tiled=True)
    mlp = jnp.einsum("abc,cd->abd", act, w_down)  # B L F, F M -> B L M
    mlp = lax.psum(mlp, "t")
    return x + mlp


def hand_loss_body(
    config: Config, tokens: jax.Array, model: Model, policy: str = "explicit"
) -> jax.Array:
    """The per-device loss (runs inside ``shard_map`` over mesh axes ``d`` and ``t``)."""
    embed = lax.all_gather(model.embed, "d", axis=1, tiled=True)
    # index_unreduced('[V/t] M, B/d L -> B/d L M'): look up in this device's vocabulary block.
    block = embed.shape[0]
    local = tokens - lax.axis_index("t") * block
    ok = (local >= 0) & (local < block)
    got = jnp.take(embed, jnp.where(ok, local, 0), axis=0, mode="clip")
    x = jnp.where(ok.reshape(tokens.shape + (1,)), got, jnp.zeros((), embed.dtype))
    x = lax.psum(x, "t")

    layer = _remat(functools.partial(_hand_layer, config), policy)

    def body(x, w):
        return layer(x, w), None

    x, _ = lax.scan(body, x, model.layers)

    gain = lax.all_gather(model.final_norm, ("t", "d"), axis=0, tiled=True)
    h = rms_norm(x, gain, config.norm_eps)
    unembed = lax.all_gather(model.unembed, "d", axis=0, tiled=True)
    logits = jnp.einsum("abc,cd->abd", h, unembed)

    local_max = lax.stop_gradient(jnp.max(logits, axis=-1))
    shift = lax.pmax(local_max, "t")
    sum_exp = jnp.sum(jnp.exp(logits - shift[..., None]), axis=-1)
    lse = jnp.log(lax.psum(sum_exp, "t")) + shift

    targets = jnp.roll(tokens, -1, axis=1)
    block = logits.shape[-1]
    local_target = targets - lax.axis_index("t") * block
    hit = jnp.arange(block) == local_target[..., None]
    target_logit = jnp.sum(jnp.where(hit, logits, 0.0), axis=-1)
    target_logit = lax.psum(target_logit, "t")

    seq = tokens.shape[1]
    predicts = jnp.arange(seq) < seq - 1
    local_sum = jnp.sum(jnp.where(predicts, lse - target_logit, 0.0))
    total = lax.psum(local_sum, "d")
    return total / (tokens.shape[0] * lax.axis_size("d") * (seq - 1))


def hand_loss(
    config: Config, tokens: jax.Array, model: Model, policy: str = "explicit"
) -> jax.Array:
    """The loss with a plain ``jax.shard_map`` (mesh from ``jax.set_mesh``)."""
    return jax.shard_map(
        functools.partial(hand_loss_body, config, policy=policy),
        in_specs=(TOKENS_SPEC, MODEL_SPECS),
        out_specs=P(),
    )(tokens, model)


# ---------------------------------------------------------------------------------------------
# The same global math without any sharding (for the auto-sharded variant).
# ---------------------------------------------------------------------------------------------


def _global_layer(config: Config, x: jax.Array, w: Layer) -> jax.Array:
    h = rms_norm(x, w.ln1, config.norm_eps)
    q = jnp.einsum("abc,cdef->abdef", h, w.w_q)
    k = jnp.einsum("abc,cde->abde", h, w.w_k)
    v = jnp.einsum("abc,cde->abde", h, w.w_v)
    q = rope(q, 1, config.rope_base)
    k = rope(k, 1, config.rope_base)
    scores = jnp.einsum("abcde,afce->acdbf", q, k) / math.sqrt(q.shape[-1])
    seq = x.shape[1]
    causal = jnp.arange(seq)[:, None] >= jnp.arange(seq)[None, :]
    probs = softmax(jnp.where(causal, scores, -jnp.inf))
    o = checkpoint_name(jnp.einsum("abcde,aebf->adbcf", probs, v), SAVE_NAME)
    x = checkpoint_name(x + jnp.einsum("abcde,cdef->abf", o, w.w_o), SAVE_NAME)
    h = rms_norm(x, w.ln2, config.norm_eps)
    gate = jnp.einsum("abc,cd->abd", h, w.w_gate)
    up = jnp.einsum("abc,cd->abd", h, w.w_up)
    return x + jnp.einsum("abc,cd->abd", jax.nn.silu(gate) * up, w.w_down)


def global_loss(
    config: Config, tokens: jax.Array, model: Model, policy: str = "explicit"
) -> jax.Array:
    """The same loss on global arrays: no shard_map, no collectives, no sharding constraints."""
    x = jnp.take(model.embed, tokens, axis=0)
    layer = _remat(functools.partial(_global_layer, config), policy)
    x, _ = lax.scan(lambda x, w: (layer(x, w), None), x, model.layers)
    h = rms_norm(x, model.final_norm, config.norm_eps)
    logits = jnp.einsum("abc,cd->abd", h, model.unembed)
    shift = lax.stop_gradient(jnp.max(logits, axis=-1))
    lse = jnp.log(jnp.sum(jnp.exp(logits - shift[..., None]), axis=-1)) + shift
    targets = jnp.roll(tokens, -1, axis=1)
    target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    seq = tokens.shape[1]
    predicts = jnp.arange(seq) < seq - 1
    return jnp.sum(jnp.where(predicts, lse - target_logit, 0.0)) / (tokens.shape[0] * (seq - 1))
