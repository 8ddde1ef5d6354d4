# seqax writes specs in dataclass fields as str (ruff reads them as names) and uses typing.Tuple.
# ruff: noqa: F821, UP006
"""A small Llama-style decoder written the way seqax's ``train.py`` writes its model.

This module is the subject of ``tests/test_seqax_model.py``: it checks that code in seqax's
own idioms runs unchanged on shardlib. So the sharded model below deliberately keeps those
idioms, even where shardlib offers something stricter:

- ``from shardlib.shardtypes import ...``, ``import shardlib.shardops as shardops``,
  ``shardtypes.register_with_typeguard()`` at import, ``import jax_extra``;
- ``@pytree_dataclass`` weight classes with ``str`` specs in their fields, the per-layer
  weights ``Layer`` stacked as ``layers: Array['layers', Layer]`` and built in ``Model.init``
  by instantiating ``Array['layers', Layer](...)`` with stacked arrays; every key comes from
  ``jax_extra.fold_in_str``; the pytree dataclasses are mutable (seqax's are);
- per-device code in ``@typechecked`` methods called from a ``typed_shard_map`` body; the
  residual stream is carried through ``lax.scan`` over the stacked layers as ``B/d L M/t``
  (batch split over ``d``, model width split over ``t``); FSDP weights are all-gathered just
  before use; the partial sums of ``shardops.einsum_unreduced`` / ``index_unreduced`` are
  reduced with ``shardops.psum_scatter`` where seqax does, and otherwise with raw
  ``jax.lax.psum`` / ``jax.lax.psum_scatter`` / ``jax.lax.pmax`` (seqax's shardops has no
  psum);
- remat with ``jax_extra.explicit_activation_checkpointing`` and ``save_for_backward``;
- AdamW written by hand over ``tree_leaves`` under ``jax.jit``, with a ``State`` of weights
  and moments;
- configs built with ``jax_extra.make_dataclass_from_dict`` from a nested dict that, like
  seqax's Hydra configs, carries a block the dataclasses do not describe.

The float32 model has no bf16 casts (seqax computes in bf16), so that the tests can compare it
tightly with ``reference_loss``: the same math in plain ``jax.numpy`` on global arrays, with
no ``shard_map`` and no shardlib, written independently (per-layer Python loop, complex RoPE,
``jax.nn.log_softmax``).

Dimension names: B batch, L sequence (``Qlen``/``Klen`` for query/key positions), M model
width, Q query heads per key/value head, K key/value heads, D head width, F MLP width,
V vocabulary.
"""

import dataclasses
import math
from functools import partial
from typing import Any, Tuple  # noqa: UP035 -- seqax's spelling

import jax
import jax.numpy as jnp
from jax import lax
from jax.tree_util import tree_leaves
from typeguard import typechecked

import jax_extra
import shardlib.shardops as shardops
import shardlib.shardtypes as shardtypes
from jax_extra import explicit_activation_checkpointing, fold_in_str, save_for_backward
from shardlib.shardtypes import (
    Array,
    f32,
    make_partition_specs,
    make_shardings,
    pytree_dataclass,
    typed_shard_map,
    u32,
)
from tests._seqax_fixtures import Hparams, MeshConfig, TrainingHparams

shardtypes.register_with_typeguard()

PRNGKey = Any


# ---------------------------------------------------------------------------------------------
# Configuration: seqax's frozen dataclasses (Hparams, TrainingHparams, MeshConfig: see
# tests/_seqax_fixtures.py), hashable, so jit can take them as static arguments.
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Config:
    model: Hparams
    training: TrainingHparams
    mesh: MeshConfig
    checkpoint_interval: int


# What a Hydra YAML file parses to. The ``flat_tokens`` block configures seqax's data loader,
# which this test model does not have: ``Config`` has no field for it, so it is an unknown
# key for make_dataclass_from_dict (seqax's version skips such keys silently).
CONFIG_DICT: dict[str, Any] = {
    "model": {
        "d_model": 16,
        "n_q_per_kv": 2,
        "n_kv": 4,
        "d_head": 8,
        "layers": 2,
        "vocab": 32,
        "d_ff": 32,
        "rope_max_timescale": 16,
    },
    "training": {
        "adam_b1": 0.9,
        "adam_b2": 0.95,
        "adam_eps": 1.0e-5,
        "adam_eps_root": 0.0,
        "weight_decay": 0.1,
        "learning_rate": 1.0e-2,
        "steps": 4,
        "seed": 0,
    },
    "mesh": {"d": 4, "t": 2},
    "checkpoint_interval": 2,
    "flat_tokens": {
        "filespec": "synthetic_dataset.zarr",
        "streams": 1,
        "read_blocks_per_shuffle_buffer": 8,
        "sequences_per_read_block": 16,
        "seed": 0,
        "sequence_packing": True,
    },
}

BATCH = 8
SEQ_LEN = 8


def load_config(data: dict[str, Any] = CONFIG_DICT) -> Config:
    """seqax's ``main``: ``config = jax_extra.make_dataclass_from_dict(Config, config)``."""
    return jax_extra.make_dataclass_from_dict(Config, data)


# ---------------------------------------------------------------------------------------------
# Weights. At rest every weight is split over both mesh axes (fully sharded): FSDP over 'd',
# tensor parallelism over 't' on heads / MLP width / vocabulary.
# ---------------------------------------------------------------------------------------------


@pytree_dataclass
class Layer:
    ln1: f32["M/t/d"]
    ln2: f32["M/t/d"]
    w_q: f32["M/d Q K/t D"]
    w_kv: f32["2 M/d K/t D"]
    w_o: f32["M/d Q K/t D"]
    w_gate: f32["M/d F/t"]
    w_up: f32["M/d F/t"]
    w_down: f32["M/d F/t"]


@pytree_dataclass
class Model:
    embed: f32["V/t M/d"]
    layers: Array["layers", Layer]
    final_norm: f32["M/d/t"]
    unembed: f32["V/t M/d"]

    @staticmethod
    @typechecked
    def init(h: Hparams, rng: PRNGKey) -> "Model":
        """Random weights, each from its own key ``fold_in_str(rng, name)``; sharded as annotated.

        Fan-in scaled truncated normals, as in seqax; the query scale also carries the
        ``1/sqrt(d_head)`` of attention (the attention logits are not scaled again).
        """
        stddev = 0.87962566103423978  # of a standard normal truncated to (-2, 2)

        def truncated(name: str, shape: Tuple[int, ...], fan_in: int) -> jax.Array:
            scale = 1.0 / (math.sqrt(fan_in) * stddev)
            key = jax_extra.fold_in_str(rng, name)
            return scale * jax.random.truncated_normal(key, -2, 2, shape, dtype=jnp.float32)

        n = h.layers
        q_shape = (n, h.d_model, h.n_q_per_kv, h.n_kv, h.d_head)
        ff_shape = (n, h.d_model, h.d_ff)
        layers = Array["layers", Layer](
            ln1=jnp.ones((n, h.d_model), dtype=jnp.float32),
            ln2=jnp.ones((n, h.d_model), dtype=jnp.float32),
            w_q=truncated("w_q", q_shape, h.d_model) / math.sqrt(h.d_head),
            w_kv=truncated("w_kv", (n, 2, h.d_model, h.n_kv, h.d_head), h.d_model),
            w_o=truncated("w_o", q_shape, h.n_q_per_kv * h.n_kv * h.d_head),
            w_gate=truncated("w_gate", ff_shape, h.d_model),
            w_up=truncated("w_up", ff_shape, h.d_model),
            w_down=truncated("w_down", ff_shape, h.d_ff),
        )
        arrays = Model(
            embed=jax.random.normal(fold_in_str(rng, "embed"), (h.vocab, h.d_model), jnp.float32),
            layers=layers,
            final_norm=jnp.ones((h.d_model,), dtype=jnp.float32),
            unembed=truncated("unembed", (h.vocab, h.d_model), h.d_model),
        )
        shardings = make_shardings(Model)
        return jax.tree.map(lax.with_sharding_constraint, arrays, shardings)

    # -- per-device code: runs inside the typed_shard_map body of `sharded_loss` -------------

    @typechecked
    def forward_pass(self, h: Hparams, ids: u32[b"B/d L"]) -> f32[b"B/d L V/t"]:
        # Embedding lookup: each device finds the ids in its vocabulary block (zeros for the
        # others); the reduce-scatter over 't' sums the one non-zero row and splits M over 't'.
        embed = shardops.all_gather("V/t M/d -> V/t M", self.embed)
        x = shardops.index_unreduced("[V/t] M, B/d L -> B/d L M", embed, ids)
        x = shardops.psum_scatter("B/d L M -> B/d L M/t", x)

        L = ids.shape[1]
        causal_mask = jnp.tril(jnp.ones((L, L), dtype=jnp.bool_))[None, :, :, None, None]
        rope_table = RopeTable.create(L, h)

        @explicit_activation_checkpointing
        @typechecked
        def loop_body(x: f32[b"B/d L M/t"], w: Layer) -> Tuple[f32[b"B/d L M/t"], Tuple[()]]:
            # Attention (grouped-query, RoPE).
            ln1 = shardops.all_gather("M/t/d -> M", w.ln1)
            gx = shardops.all_gather("B/d L M/t -> B/d L M", x)
            nx = rms_norm(gx) * ln1
            w_q = shardops.all_gather("M/d Q K/t D -> M Q K/t D", w.w_q)
            q = save_for_backward(
                shardops.einsum_unreduced("B/d L M, M Q K/t D -> B/d L Q K/t D", nx, w_q)
            )
            q = rope_table.apply(q)
            w_kv = shardops.all_gather("2 M/d K/t D -> 2 M K/t D", w.w_kv)
            k, v = shardops.einsum_unreduced("B/d L M, k_v M K/t D -> k_v B/d L K/t D", nx, w_kv)
            k = save_for_backward(k)
            v = save_for_backward(v)
            k = rope_table.apply(k)
            logits = shardops.einsum_unreduced(
                "B/d Qlen Q K/t D, B/d Klen K/t D -> B/d Qlen Klen Q K/t", q, k
            )
            logits = jnp.where(causal_mask, logits, -1e10)
            probs = jax.nn.softmax(logits, axis=2)
            attn_out = shardops.einsum_unreduced(
                "B/d Qlen Klen Q K/t, B/d Klen K/t D -> B/d Qlen Q K/t D", probs, v
            )
            w_o = shardops.all_gather("M/d Q K/t D -> M Q K/t D", w.w_o)
            attn_out = shardops.einsum_unreduced(
                "B/d Qlen Q K/t D, M Q K/t D -> B/d Qlen M", attn_out, w_o
            )
            attn_out = shardops.psum_scatter("B/d Qlen M -> B/d Qlen M/t", attn_out)
            x = save_for_backward(x + attn_out)

            # SwiGLU MLP. Its partial sum is reduced with raw lax.psum_scatter.
            ln2 = shardops.all_gather("M/t/d -> M", w.ln2)
            gx = shardops.all_gather("B/d L M/t -> B/d L M", x)
            nx = rms_norm(gx) * ln2
            w_gate = shardops.all_gather("M/d F/t -> M F/t", w.w_gate)
            gate_proj = save_for_backward(
                shardops.einsum_unreduced("B/d L M, M F/t -> B/d L F/t", nx, w_gate)
            )
            w_up = shardops.all_gather("M/d F/t -> M F/t", w.w_up)
            up_proj = save_for_backward(
                shardops.einsum_unreduced("B/d L M, M F/t -> B/d L F/t", nx, w_up)
            )
            y = jax.nn.swish(gate_proj) * up_proj
            w_down = shardops.all_gather("M/d F/t -> M F/t", w.w_down)
            ffn_out = shardops.einsum_unreduced("B/d L F/t, M F/t -> B/d L M", y, w_down)
            ffn_out = jax.lax.psum_scatter(ffn_out, "t", scatter_dimension=2, tiled=True)

            return x + ffn_out, ()

        x, () = jax.lax.scan(loop_body, x, self.layers)

        # Final norm and unembedding (vocabulary split over 't').
        x = shardops.all_gather("B/d L M/t -> B/d L M", x)
        ln = shardops.all_gather("M/d/t -> M", self.final_norm)
        x = rms_norm(x) * ln
        unembed = shardops.all_gather("V/t M/d -> V/t M", self.unembed)
        return shardops.einsum_unreduced("B/d L M, V/t M -> B/d L V/t", x, unembed)

    @typechecked
    def loss(self, h: Hparams, targets: u32[b"B/d L"]) -> f32[b""]:
        """Mean next-token cross-entropy over the global batch (per device, reduced here).

        Position ``i`` is fed token ``i - 1`` (token 0 at the start) and predicts ``targets[i]``.
        """
        inputs = jnp.pad(targets[:, :-1], pad_width=((0, 0), (1, 0)))
        logits: f32[b"B/d L V/t"] = self.forward_pass(h, inputs)
        # log-softmax over the vocabulary, which is split over 't'.
        max_logits = lax.pmax(jnp.max(lax.stop_gradient(logits), axis=-1, keepdims=True), "t")
        logits = logits - max_logits
        sum_exp = lax.psum(jnp.sum(jnp.exp(logits), axis=-1, keepdims=True), "t")
        logprobs: f32[b"B/d L V/t"] = logits - jnp.log(sum_exp)
        # Only the device whose vocabulary block holds the target finds it: a partial sum.
        at_targets = shardops.index_unreduced("B/d L [V/t], B/d L -> B/d L", logprobs, targets)
        at_targets = jax.lax.psum(at_targets, "t")
        tokens_in_global_batch = at_targets.size * jax.lax.psum(1, "d")
        total = jax.lax.psum(jnp.sum(at_targets), "d")
        return -total / jnp.float32(tokens_in_global_batch)


@pytree_dataclass
class RopeTable:
    sin: f32["len d_head2"]
    cos: f32["len d_head2"]

    @staticmethod
    def create(max_len: int, h: Hparams) -> "RopeTable":
        half = h.d_head // 2
        timescale = jnp.logspace(
            0, jnp.log10(jnp.float32(h.rope_max_timescale)), half, endpoint=False
        )
        angle = jnp.arange(max_len, dtype=jnp.float32)[:, None] / timescale[None, :]
        return RopeTable(sin=jnp.sin(angle), cos=jnp.cos(angle))

    def apply(self, x: jax.Array) -> jax.Array:
        """Rotate the two halves of the last dim of ``x`` (batch, len, heads..., d_head)."""
        x1, x2 = jnp.split(x, 2, axis=-1)
        table_shape = (1, self.sin.shape[0]) + (1,) * (x.ndim - 3) + (self.sin.shape[1],)
        sin = self.sin.reshape(table_shape)
        cos = self.cos.reshape(table_shape)
        return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


@typechecked
def rms_norm(x: f32[b"batch/d len M"]) -> f32[b"batch/d len M"]:
    mean2 = save_for_backward(jnp.mean(jax.lax.square(x), axis=-1, keepdims=True))
    return x * jax.lax.rsqrt(mean2 + 1e-6)


# ---------------------------------------------------------------------------------------------
# The loss as a typed_shard_map, and a hand-written AdamW training step.
# ---------------------------------------------------------------------------------------------


def make_loss(h: Hparams, **shard_map_kwargs: Any):
    """``loss(weights, targets)`` on global arrays; ``shard_map_kwargs`` go to typed_shard_map
    (``check_vma=False``, or seqax's ``check_rep=False``)."""

    @partial(typed_shard_map, **shard_map_kwargs)
    def sharded_loss(weights: Model, targets: u32[b"B/d L"]) -> f32[b""]:
        return weights.loss(h, targets)

    return sharded_loss


@pytree_dataclass
class State:
    weights: Model
    adam_mu: Model
    adam_nu: Model

    @staticmethod
    def init(h: Hparams, rng: PRNGKey) -> "State":
        weights = Model.init(h, rng)
        adam_mu = jax.tree.map(lambda p: p * 0.0, weights)
        adam_nu = jax.tree.map(lambda p: p * 0.0, weights)
        return State(weights=weights, adam_mu=adam_mu, adam_nu=adam_nu)


@partial(jax.jit, static_argnums=(2, 3))
def training_step(
    state: State, step: u32[b""], h: Hparams, hparams: TrainingHparams, targets: u32[b"B/d L"]
) -> Tuple[State, f32[b""]]:
    """One AdamW step; returns the new state and the loss before the update.

    The gradients come back fully sharded (the transpose of each weight all-gather is a
    reduce-scatter), so the update is elementwise with no communication.
    """
    loss, grad = jax.value_and_grad(lambda w: make_loss(h)(w, targets))(state.weights)
    grad_leaves, grad_treedef = jax.tree_util.tree_flatten(grad)
    completed_steps = step + 1  # bias correction counts from 1
    new_ps, new_mus, new_nus = [], [], []
    for p, g, mu, nu, spec in zip(
        tree_leaves(state.weights),
        grad_leaves,
        tree_leaves(state.adam_mu),
        tree_leaves(state.adam_nu),
        tree_leaves(make_partition_specs(Model)),
        strict=True,
    ):
        assert shardtypes.is_fully_sharded(spec), "every weight is split over every mesh axis"
        mu = (1 - hparams.adam_b1) * g + hparams.adam_b1 * mu
        nu = (1 - hparams.adam_b2) * jax.lax.square(g) + hparams.adam_b2 * nu
        mu_hat = mu / (1 - jnp.float32(hparams.adam_b1) ** completed_steps)
        nu_hat = nu / (1 - jnp.float32(hparams.adam_b2) ** completed_steps)
        update = mu_hat / (jnp.sqrt(nu_hat + hparams.adam_eps_root) + hparams.adam_eps)
        update = update + hparams.weight_decay * p
        new_ps.append(p - hparams.learning_rate * update)
        new_mus.append(mu)
        new_nus.append(nu)
    new_state = State(
        weights=jax.tree_util.tree_unflatten(grad_treedef, new_ps),
        adam_mu=jax.tree_util.tree_unflatten(grad_treedef, new_mus),
        adam_nu=jax.tree_util.tree_unflatten(grad_treedef, new_nus),
    )
    return new_state, loss


# ---------------------------------------------------------------------------------------------
# The unsharded reference: the same math in plain jax.numpy on global arrays. It takes the
# weights as a dict of arrays (see `weights_dict`) so that it uses nothing from shardlib.
# ---------------------------------------------------------------------------------------------


def weights_dict(model: Model) -> dict[str, Any]:
    """The weights as plain numpy arrays keyed by field name (layer fields stacked)."""
    layers = {
        f.name: jax.device_get(getattr(model.layers, f.name)) for f in dataclasses.fields(Layer)
    }
    return {
        "embed": jax.device_get(model.embed),
        "final_norm": jax.device_get(model.final_norm),
        "unembed": jax.device_get(model.unembed),
        **{f"layers.{k}": v for k, v in layers.items()},
    }


def reference_loss(h: Hparams, w: dict[str, jax.Array], targets: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy, computed on global arrays without any sharding."""
    batch, seq = targets.shape
    targets = targets.astype(jnp.int32)
    inputs = jnp.concatenate([jnp.zeros((batch, 1), jnp.int32), targets[:, :-1]], axis=1)
    n_heads = h.n_q_per_kv * h.n_kv

    def norm(x, gain):
        return x / jnp.sqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * gain

    # RoPE as a complex rotation of (first half + i * second half) of each head.
    half = h.d_head // 2
    timescale = float(h.rope_max_timescale) ** (jnp.arange(half, dtype=jnp.float32) / half)
    angle = jnp.arange(seq, dtype=jnp.float32)[:, None] / timescale[None, :]
    turn = jnp.exp(1j * angle)  # seq, half

    def rotary(u):  # batch, seq, heads, d_head
        z = lax.complex(u[..., :half], u[..., half:]) * turn[None, :, None, :]
        return jnp.concatenate([jnp.real(z), jnp.imag(z)], axis=-1)

    # Flat query heads, head index = kv * n_q_per_kv + q (each query head next to its kv head).
    def heads_last(a):  # (M, Q, K, D) -> (M, K*Q*D) with K outermost
        return jnp.transpose(a, (0, 2, 1, 3)).reshape(a.shape[0], -1)

    allowed = jnp.tril(jnp.ones((seq, seq), dtype=bool))
    x = w["embed"][inputs]
    for i in range(h.layers):
        lw = {name[len("layers.") :]: a[i] for name, a in w.items() if name.startswith("layers.")}
        a = norm(x, lw["ln1"])
        q = (a @ heads_last(lw["w_q"])).reshape(batch, seq, n_heads, h.d_head)
        k = (a @ lw["w_kv"][0].reshape(h.d_model, -1)).reshape(batch, seq, h.n_kv, h.d_head)
        v = (a @ lw["w_kv"][1].reshape(h.d_model, -1)).reshape(batch, seq, h.n_kv, h.d_head)
        q, k = rotary(q), rotary(k)
        k = jnp.repeat(k, h.n_q_per_kv, axis=2)
        v = jnp.repeat(v, h.n_q_per_kv, axis=2)
        s = jnp.einsum("bqhe,bkhe->bhqk", q, k)
        p = jax.nn.softmax(jnp.where(allowed, s, -1e10), axis=-1)
        o = jnp.einsum("bhqk,bkhe->bqhe", p, v).reshape(batch, seq, n_heads * h.d_head)
        x = x + o @ heads_last(lw["w_o"]).T
        a = norm(x, lw["ln2"])
        x = x + (jax.nn.silu(a @ lw["w_gate"]) * (a @ lw["w_up"])) @ lw["w_down"].T
    logits = norm(x, w["final_norm"]) @ w["unembed"].T
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))


def reference_training_step(
    w: dict[str, jax.Array],
    mu: dict[str, jax.Array],
    nu: dict[str, jax.Array],
    step: int,
    h: Hparams,
    hp: TrainingHparams,
    targets: jax.Array,
):
    """AdamW on the reference model (same hyperparameters); returns (w, mu, nu, loss)."""
    loss, g = jax.value_and_grad(reference_loss, argnums=1)(h, w, targets)
    t = step + 1
    mu = jax.tree.map(lambda m, gi: hp.adam_b1 * m + (1 - hp.adam_b1) * gi, mu, g)
    nu = jax.tree.map(lambda n, gi: hp.adam_b2 * n + (1 - hp.adam_b2) * gi * gi, nu, g)

    def update(p, m, n):
        m_hat = m / (1 - hp.adam_b1**t)
        n_hat = n / (1 - hp.adam_b2**t)
        direction = m_hat / (jnp.sqrt(n_hat + hp.adam_eps_root) + hp.adam_eps)
        return p - hp.learning_rate * (direction + hp.weight_decay * p)

    return jax.tree.map(update, w, mu, nu), mu, nu, loss
