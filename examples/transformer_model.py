"""A decoder-only transformer with FSDP + tensor parallelism, written with shardlib in roles.

The specs name *roles* (logical axes) after ``/``, never mesh axes; axis rules in force map
each role to mesh axes (`shardlib.axis_rules`), so the same code runs on any mesh:

- ``batch``: the data dim. The batch is split over it.
- ``fsdp``: fully sharded weights. Every weight is split over it on one dim at rest and
  all-gathered just before its use (the backward pass turns each gather into a
  reduce-scatter of the gradient).
- ``tensor``: tensor parallelism (Megatron style). Attention is split by key/value head and the
  MLP by its hidden dim ``F``; the embedding and unembedding are split by vocabulary. The
  residual stream ``B/batch L M`` is replicated over it: after each row-parallel matmul
  (attention output projection, MLP down projection) the partial sums are all-reduced with
  ``psum`` over ``tensor``. The alternative, a reduce-scatter into a sequence-split residual
  stream followed by an all-gather before the next column-parallel matmul, moves the same
  bytes: with ``Config.overlap`` (``'ring'`` or ``'bidirectional'``) :func:`loss` runs it,
  each gather and reduce-scatter a collective matmul (a ring of ``ppermute``s beside block
  matmuls, :func:`overlap_layer_forward`), with the same losses and gradients.
- ``seq``: context parallelism. :func:`context_loss` splits the sequence over it (balanced
  layout, ring attention); :func:`loss` does not split it.

:func:`rules_for` gives the rules of a mesh, read off its axis names with `AXIS_ROLES`: on
today's ``('d', 't')`` mesh ``batch`` and ``fsdp`` are ``d`` and ``tensor`` is ``t``; on a
``('data', 'fsdp', 'tensor')`` mesh ``batch`` is ``('data', 'fsdp')``; on one axis
``('fsdp',)`` ``tensor`` is None (replicated, its collectives vanish); a ``('d', 'c', 't')``
mesh adds ``seq`` -> ``c`` and makes ``fsdp`` ``('d', 'c')``: the weights are split over
the context axis too. Put them in force beside the mesh::

    with jax.set_mesh(mesh), shardlib.axis_rules(rules_for(mesh)):
        model, loss = train_step(config, model, tokens, lr)

Called with no axis rules in force, the entry points (:func:`init_model`, :func:`place_model`,
:func:`loss`, :func:`context_loss`, :func:`loss_and_grad` and so :func:`train_step`) put
``rules_for(the mesh in force)`` in force themselves. Specs resolved outside them (the types
``Layer`` and ``Model`` given to ``make_shardings`` or a ``typed_shard_map`` of your own,
:func:`layer_forward` in your own ``shard_map``) need rules in force.

Dimension names used in the specs:

====  =====================================================  ==========================
name  meaning                                                 split over (role)
====  =====================================================  ==========================
B     batch                                                   batch
L     sequence position (queries); ``S`` is the same size,    seq in :func:`context_loss`
      used for key positions in attention
M     model width (``d_model``)                               fsdp in weights
K     key/value heads (``n_kv_heads``)                        tensor
G     query heads per key/value head (``n_heads/n_kv_heads``) --
D     head width (``d_head``)                                 --
F     MLP hidden width (``d_ff``)                             tensor
V     vocabulary                                              tensor
====  =====================================================  ==========================

Grouped-query attention keeps query heads as ``K G`` (query head ``k * G + g`` uses key/value
head ``k``), so splitting ``K`` over ``tensor`` keeps each query head next to its key/value
head. ``n_kv_heads == n_heads`` (``G = 1``) is ordinary multi-head attention. The ``tensor``
axes must divide ``n_kv_heads``, ``d_ff`` and ``vocab``; the ``batch`` axes the batch; the
``fsdp`` axes ``d_model``, and the ``tensor`` and ``fsdp`` axes together ``d_model`` too
(norm gains are split over both).

Activation memory is explicit: each layer runs under
:func:`jax_extra.explicit_activation_checkpointing` (see :func:`checkpointed_layer`), so the
backward pass keeps only the layer's inputs (the residual stream and the layer's sharded
weights) and the two values marked with :func:`jax_extra.save_for_backward`: the attention
output before its projection and the residual stream after attention. Everything else,
including the weight all-gathers, is recomputed.

Importing this module only defines things. Run from the repository root,
``python -m examples.transformer_model`` trains a few SGD steps on 8 simulated CPU devices.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import math
import operator
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import ParamSpec, TypeVar

if __name__ == "__main__":  # run as a script: simulate 8 CPU devices (never on import)
    if __package__ in (None, ""):  # make the `examples` package importable
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from examples import _devices

    _devices.simulate_cpu_devices(8)  # sets XLA_FLAGS: 8 simulated CPU devices, before JAX starts

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import typeguard  # noqa: E402
from jax import lax  # noqa: E402

import shardlib.shardops as shardops  # noqa: E402
from jax_extra import (  # noqa: E402
    explicit_activation_checkpointing,
    fold_in_str,
    save_for_backward,
)
from shardlib import SpecError, attention, shardtypes  # noqa: E402
from shardlib.shardtypes import (  # noqa: E402
    Array,
    Stacked,
    axis_rules,
    current_axis_rules,
    f32,
    i32,
    make_partition_specs,
    make_shardings,
    pytree_dataclass,
    typed_shard_map,
)

shardtypes.register_with_typeguard()

_T = TypeVar("_T")
_P = ParamSpec("_P")

__all__ = [
    "AXIS_ROLES",
    "CONTEXTS",
    "OVERLAPS",
    "ROLES",
    "Config",
    "Layer",
    "Model",
    "checkpointed_context_layer",
    "checkpointed_layer",
    "checkpointed_overlap_layer",
    "config_from_flags",
    "context_inputs",
    "context_layer_forward",
    "context_loss",
    "context_size",
    "layout_size",
    "default_rules",
    "embed_tokens",
    "finish_layer",
    "init_model",
    "layer_forward",
    "loss",
    "loss_and_grad",
    "model_rules",
    "next_token_loss",
    "overlap_layer_forward",
    "overlap_loss_body",
    "place_model",
    "project_qkv",
    "reference_logits",
    "reference_loss",
    "rules_for",
    "sgd_update",
    "train_step",
]


# `Config.overlap`'s values: None, or how `shardops.einsum` runs its collective matmuls.
OVERLAPS = (None, "ring", "bidirectional")
# `Config.context`'s values: the `shardlib.attention` function `context_loss` attends with.
CONTEXTS = ("ring", "gathered", "ulysses", "ring_ulysses")


@dataclasses.dataclass(frozen=True)
class Config:
    """Model hyperparameters (hashable, so it can be a static argument of ``jax.jit``)."""

    vocab: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    d_head: int
    d_ff: int
    n_layers: int
    seq_len: int
    rope_base: float = 10000.0
    norm_eps: float = 1e-6
    # None: Megatron tensor parallelism (residual replicated over ``tensor``, psums). 'ring' /
    # 'bidirectional': sequence parallelism with collective matmuls (`overlap_layer_forward`).
    overlap: str | None = None
    # How `context_loss` attends over the sequence split over ``seq``: `attention.ring` (K/V
    # round the devices), `attention.gathered` (K/V all-gathered), `attention.ulysses`
    # (all-to-alls turn the sequence split into a head split; heads must divide) or, with
    # ``seq`` over two axes, `attention.ring_ulysses` (the ring over the first, Ulysses over
    # the second).
    context: str = "ring"

    def __post_init__(self) -> None:
        if self.context not in CONTEXTS:
            raise ValueError(
                f"Config: context={self.context!r} is not one of {CONTEXTS} (the "
                "`shardlib.attention` function context parallelism attends with)"
            )
        if self.overlap not in OVERLAPS:
            raise ValueError(
                f"Config: overlap={self.overlap!r} is not one of {OVERLAPS} (None: the "
                "residual replicated over tensor; 'ring' / 'bidirectional': collective matmuls)"
            )
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"Config: n_heads={self.n_heads} must be a multiple of n_kv_heads="
                f"{self.n_kv_heads} (grouped-query attention)"
            )
        if self.d_head % 2:
            raise ValueError(f"Config: d_head={self.d_head} must be even for RoPE")

    @property
    def group(self) -> int:
        """Query heads per key/value head."""
        return self.n_heads // self.n_kv_heads


def config_from_flags(args: argparse.Namespace) -> Config:
    """The ``Config`` of the transformer scripts' model flags (``--vocab``, ``--d-model``,
    ``--heads``, ``--kv-heads``, ``--d-head``, ``--d-ff``, ``--layers``, ``--seq-len``, and
    ``--overlap`` and ``--context`` where the script has them)."""
    return Config(
        vocab=args.vocab,
        d_model=args.d_model,
        n_heads=args.heads,
        n_kv_heads=args.kv_heads,
        d_head=args.d_head,
        d_ff=args.d_ff,
        n_layers=args.layers,
        seq_len=args.seq_len,
        overlap=getattr(args, "overlap", None),
        context=getattr(args, "context", "ring"),
    )


# ---------------------------------------------------------------------------------------------
# Roles and the rules of a mesh.
# ---------------------------------------------------------------------------------------------

ROLES = ("batch", "fsdp", "tensor", "seq", "stage")

# The roles each mesh axis name carries in this model: the data that makes the rules of a
# mesh (`rules_for`). An axis not named here carries no role; a role no axis carries is None
# (replicated). ``stage`` is the pipeline's (`examples/pipeline.py`): this model has no use
# for it.
AXIS_ROLES: dict[str, tuple[str, ...]] = {
    "d": ("batch", "fsdp"),  # data parallel and FSDP on one axis (the default 4x2 mesh)
    "fsdp": ("batch", "fsdp"),
    "data": ("batch",),  # data parallel only: the weights are replicated over it
    "t": ("tensor",),
    "tensor": ("tensor",),
    # Context parallel: `context_loss` splits the sequence over it, and the weights are split
    # over it too (FSDP over d x c: c times less weight memory per device).
    "c": ("seq", "fsdp"),
    "context": ("seq", "fsdp"),
    # A second context axis: Ulysses over it, the ring over the first (Config.context
    # 'ring_ulysses', `attention.ring_ulysses`). Weights split over it too.
    "u": ("seq", "fsdp"),
    "ulysses": ("seq", "fsdp"),
    "p": ("stage",),  # pipeline stages (examples/pipeline.py)
    "stage": ("stage",),
}


def rules_for(
    mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh | tuple[str, ...],
) -> dict[str, tuple[str, ...] | None]:
    """The axis rules of this model on ``mesh`` (or its axis names), for `shardlib.axis_rules`.

    Each role maps to the mesh axes that carry it in `AXIS_ROLES`, in mesh order, or to None.

    Examples:
        >>> rules_for(("data", "fsdp", "tensor"))
        {'batch': ('data', 'fsdp'), 'fsdp': ('fsdp',), 'tensor': ('tensor',), 'seq': None, 'stage': None}
    """
    names = tuple(mesh) if isinstance(mesh, tuple) else tuple(mesh.axis_names)
    rules: dict[str, tuple[str, ...] | None] = {}
    for role in ROLES:
        axes = tuple(a for a in names if role in AXIS_ROLES.get(a, ()))
        if role in names and axes != (role,):
            raise ValueError(
                f"rules_for: mesh axes {names} give role {role!r} to {axes}, but {role!r} is "
                f"itself an axis of the mesh (which always means itself); name the axes so "
                f"that only {role!r} carries the role"
            )
        rules[role] = axes or None
    return rules


@contextlib.contextmanager
def default_rules(
    mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh | None = None,
) -> Iterator[None]:
    """Nothing when axis rules are in force; else ``rules_for(mesh)`` in force (default: the
    mesh in force; none: nothing)."""
    mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
    if current_axis_rules() is not None or not mesh.axis_names:
        yield
    else:
        with axis_rules(rules_for(mesh)):
            yield


def model_rules(fn: Callable[_P, _T]) -> Callable[_P, _T]:
    """``fn`` run under the axis rules in force, or, with none in force, under
    ``rules_for(the mesh in force)`` (`default_rules`): the entry points of this module."""

    @functools.wraps(fn)
    def run(*args: _P.args, **kwargs: _P.kwargs) -> _T:
        with default_rules():
            return fn(*args, **kwargs)

    return run


# ---------------------------------------------------------------------------------------------
# Weights. At rest every weight is split over the roles fsdp on one dim and tensor on its heads
# / hidden / vocabulary dim. Norm gains have one dim and are split over both.
# ---------------------------------------------------------------------------------------------


@pytree_dataclass
class Layer:
    ln1: f32[Array, b"M/tensor/fsdp"]
    w_q: f32[Array, b"M/fsdp K/tensor G D"]
    w_k: f32[Array, b"M/fsdp K/tensor D"]
    w_v: f32[Array, b"M/fsdp K/tensor D"]
    w_o: f32[Array, b"K/tensor G D M/fsdp"]
    ln2: f32[Array, b"M/tensor/fsdp"]
    w_gate: f32[Array, b"M/fsdp F/tensor"]
    w_up: f32[Array, b"M/fsdp F/tensor"]
    w_down: f32[Array, b"F/tensor M/fsdp"]


@pytree_dataclass
class Model:
    embed: f32[Array, b"V/tensor M/fsdp"]
    layers: Stacked[Layer, b"layers"]
    final_norm: f32[Array, b"M/tensor/fsdp"]
    unembed: f32[Array, b"M/fsdp V/tensor"]


@model_rules
def init_model(config: Config, key: jax.Array, *, sharded: bool = False) -> Model:
    """Random weights: each has its own key, derived from ``key`` and its name with ``fold_in_str``.

    With ``sharded=False`` they are plain global arrays, to be placed with :func:`place_model`.
    With ``sharded=True`` (under ``jax.set_mesh`` of a mesh with Explicit axes, eagerly or inside
    ``jax.jit``) every weight is *created* in the layout its annotation describes: each random
    or constant array gets ``out_sharding=`` its ``PartitionSpec``, so each device computes only
    its own block and no device ever holds a full copy. The values are the same either way
    (JAX's random bits do not depend on the sharding). See ``examples/sharded_init.py``.
    """
    c = config
    n = c.n_layers
    specs = make_partition_specs(Model) if sharded else None

    def spec(path: str) -> jax.sharding.PartitionSpec | None:
        return None if specs is None else operator.attrgetter(path)(specs)

    def normal(name: str, shape: tuple[int, ...], fan_in: int) -> jax.Array:
        path = name if name in ("embed", "unembed") else f"layers.{name}"
        x = jax.random.normal(fold_in_str(key, name), shape, jnp.float32, out_sharding=spec(path))
        return x / math.sqrt(fan_in)

    def ones(path: str, shape: tuple[int, ...]) -> jax.Array:
        return jnp.ones(shape, jnp.float32, out_sharding=spec(path))

    layers = Layer(
        ln1=ones("layers.ln1", (n, c.d_model)),
        w_q=normal("w_q", (n, c.d_model, c.n_kv_heads, c.group, c.d_head), c.d_model),
        w_k=normal("w_k", (n, c.d_model, c.n_kv_heads, c.d_head), c.d_model),
        w_v=normal("w_v", (n, c.d_model, c.n_kv_heads, c.d_head), c.d_model),
        w_o=normal("w_o", (n, c.n_kv_heads, c.group, c.d_head, c.d_model), c.n_heads * c.d_head),
        ln2=ones("layers.ln2", (n, c.d_model)),
        w_gate=normal("w_gate", (n, c.d_model, c.d_ff), c.d_model),
        w_up=normal("w_up", (n, c.d_model, c.d_ff), c.d_model),
        w_down=normal("w_down", (n, c.d_ff, c.d_model), c.d_ff),
    )
    return Model(
        embed=normal("embed", (c.vocab, c.d_model), 1),
        layers=layers,
        final_norm=ones("final_norm", (c.d_model,)),
        unembed=normal("unembed", (c.d_model, c.vocab), c.d_model),
    )


def place_model(model: Model, mesh: jax.sharding.Mesh | None = None) -> Model:
    """Put global weights in the layout their annotations describe (the mesh in force by default)."""
    with default_rules(mesh):
        return jax.device_put(model, make_shardings(Model, mesh=mesh))


# ---------------------------------------------------------------------------------------------
# The sharded model: per-device code with explicit communication.
# ---------------------------------------------------------------------------------------------


def _rms_norm(x: jax.Array, gain: jax.Array, eps: float) -> jax.Array:
    """RMSNorm over the last dim (local: ``M`` is not split in activations)."""
    return x * lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * gain


def _rope(
    x: jax.Array, seq_axis: int, base: float, positions: jax.Array | None = None, seq: str = "L"
) -> jax.Array:
    """Rotary position embedding over the last dim (rotate-half form), positions along
    ``seq_axis``: ``0 .. L-1`` by default, else ``positions`` (this device's original
    positions in a context-parallel layout, ``i32['L/seq']`` with ``seq='L/seq'``)."""
    length, width = x.shape[seq_axis], x.shape[-1]
    half = width // 2
    inv_freq = base ** (-jnp.arange(half, dtype=jnp.float32) / half)
    if positions is None:
        pos = jnp.arange(length, dtype=jnp.float32)
    else:
        pos = positions.astype(jnp.float32)
    angle = pos[:, None] * inv_freq[None, :]  # L, D/2
    # The table broadcasts over the dims between the sequence and the last (the heads): P is
    # the number of rotation frequencies, D/2.
    units = " 1" * (x.ndim - seq_axis - 2)
    angle = shardops.rearrange(f"{seq} P -> {seq}{units} P", angle)
    cos, sin = jnp.cos(angle), jnp.sin(angle)
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def _softmax(x: jax.Array) -> jax.Array:
    e = jnp.exp(x - jnp.max(x, axis=-1, keepdims=True))
    return e / jnp.sum(e, axis=-1, keepdims=True)


@typeguard.typechecked
def layer_forward(
    config: Config, x: f32[Array, b"B/batch L M"], w: Layer
) -> f32[Array, b"B/batch L M"]:
    """One transformer block on the residual stream (per device, inside ``shard_map``).

    Run it through :func:`checkpointed_layer`, which saves for the backward pass only its
    arguments ``x`` and ``w`` (the sharded weights) and the two values marked here with
    ``save_for_backward``: the attention output before its projection and the residual stream
    after attention.
    """
    return _layer(config, x, w, "L", None)


@typeguard.typechecked
def context_layer_forward(
    config: Config, x: f32[Array, b"B/batch L/seq M"], positions: i32[Array, b"L/seq"], w: Layer
) -> f32[Array, b"B/batch L/seq M"]:
    """:func:`layer_forward` with the sequence split over role ``seq`` (context parallelism):
    the residual stream holds this device's positions ``positions`` of the balanced layout
    (`shardlib.attention.to_layout`), RoPE turns by those, and attention is
    `shardlib.attention.ring` (the K/V blocks go round the devices along ``seq``)."""
    return _layer(config, x, w, "L/seq", positions)


def _attend(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """Causal attention of the whole sequence on this device (heads split over ``tensor``)."""
    scores = shardops.einsum_unreduced(
        "B/batch L K/tensor G D, B/batch S K/tensor D -> B/batch K/tensor G L S", q, k
    )
    scores = scores / math.sqrt(q.shape[-1])
    seq = q.shape[1]
    causal = jnp.arange(seq)[:, None] >= jnp.arange(seq)[None, :]  # L S
    scores = jnp.where(causal, scores, -jnp.inf)
    probs = _softmax(scores)
    return shardops.einsum_unreduced(
        "B/batch K/tensor G L S, B/batch S K/tensor D -> B/batch L K/tensor G D", probs, v
    )


def _context_attend(config: Config, q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """Causal attention over the sequence split over ``seq``, balanced layout, by the
    `shardlib.attention` function ``config.context`` names. The query heads ``K/tensor G``
    are one dim ``H/tensor`` to it (each key/value head's group in a row)."""
    b, length, heads, group, width = q.shape
    q = q.reshape(b, length, heads * group, width)
    spec = "B/batch L/seq H/tensor D, B/batch L/seq K/tensor D"
    if config.context == "ring_ulysses":
        ring_axis, ulysses_axis = _context_axes(config)
        o = attention.ring_ulysses(spec, q, k, v, ring_axis, ulysses_axis, layout="balanced")
    else:
        o = getattr(attention, config.context)(spec, q, k, v, "seq", layout="balanced")
    return o.reshape(b, length, heads, group, width)


def _layer(
    config: Config, x: jax.Array, w: Layer, seq: str, positions: jax.Array | None
) -> jax.Array:
    """The block, with ``seq`` the sequence dim's spec (``'L'`` or ``'L/seq'``)."""
    q, k, v = project_qkv(config, x, w, seq)
    q = _rope(q, 1, config.rope_base, positions, seq)
    k = _rope(k, 1, config.rope_base, positions, seq)
    o = save_for_backward(
        _attend(q, k, v) if positions is None else _context_attend(config, q, k, v)
    )
    return finish_layer(config, x, o, w, seq)


def project_qkv(
    config: Config, x: jax.Array, w: Layer, seq: str = "L"
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The block's first half up to attention (per device): the first norm of the residual
    stream ``x`` ``'B/batch {seq} M'`` and its projections ``q`` ``'B/batch {seq} K/tensor G
    D'``, ``k`` and ``v`` ``'B/batch {seq} K/tensor D'`` (column-parallel over key/value heads,
    the weights gathered over fsdp), before RoPE. Training (:func:`layer_forward`) and decoding
    (``examples/decoding.py``) share it."""
    ln1 = shardops.all_gather("M/tensor/fsdp -> M", w.ln1)
    h = _rms_norm(x, ln1, config.norm_eps)
    w_q = shardops.all_gather("M/fsdp K/tensor G D -> M K/tensor G D", w.w_q)
    q = shardops.einsum_unreduced(
        f"B/batch {seq} M, M K/tensor G D -> B/batch {seq} K/tensor G D", h, w_q
    )
    w_k = shardops.all_gather("M/fsdp K/tensor D -> M K/tensor D", w.w_k)
    k = shardops.einsum_unreduced(
        f"B/batch {seq} M, M K/tensor D -> B/batch {seq} K/tensor D", h, w_k
    )
    w_v = shardops.all_gather("M/fsdp K/tensor D -> M K/tensor D", w.w_v)
    v = shardops.einsum_unreduced(
        f"B/batch {seq} M, M K/tensor D -> B/batch {seq} K/tensor D", h, w_v
    )
    return q, k, v


def finish_layer(config: Config, x: jax.Array, o: jax.Array, w: Layer, seq: str = "L") -> jax.Array:
    """The block's second half from the attention output ``o`` ``'B/batch {seq} K/tensor G D'``
    (per device): the output projection (row-parallel, psum over tensor) added to the residual
    stream ``x``, then the SwiGLU MLP; the residual stream after the block. Training and
    decoding share it, as :func:`project_qkv`."""
    w_o = shardops.all_gather("K/tensor G D M/fsdp -> K/tensor G D M", w.w_o)
    attn = shardops.einsum_unreduced(
        f"B/batch {seq} K/tensor G D, K/tensor G D M -> B/batch {seq} M", o, w_o
    )
    attn = shardops.psum(
        f"B/batch {seq} M", attn, axes="tensor"
    )  # row-parallel: sum the heads' parts
    x = save_for_backward(x + attn)

    # --- SwiGLU MLP: column-parallel in, row-parallel out over F/tensor ----------------------
    ln2 = shardops.all_gather("M/tensor/fsdp -> M", w.ln2)
    h = _rms_norm(x, ln2, config.norm_eps)
    w_gate = shardops.all_gather("M/fsdp F/tensor -> M F/tensor", w.w_gate)
    gate = shardops.einsum_unreduced(
        f"B/batch {seq} M, M F/tensor -> B/batch {seq} F/tensor", h, w_gate
    )
    w_up = shardops.all_gather("M/fsdp F/tensor -> M F/tensor", w.w_up)
    up = shardops.einsum_unreduced(
        f"B/batch {seq} M, M F/tensor -> B/batch {seq} F/tensor", h, w_up
    )
    act = jax.nn.silu(gate) * up
    w_down = shardops.all_gather("F/tensor M/fsdp -> F/tensor M", w.w_down)
    mlp = shardops.einsum_unreduced(
        f"B/batch {seq} F/tensor, F/tensor M -> B/batch {seq} M", act, w_down
    )
    mlp = shardops.psum(f"B/batch {seq} M", mlp, axes="tensor")
    return x + mlp


def checkpointed_layer(config: Config) -> Callable[[jax.Array, Layer], jax.Array]:
    """``layer_forward`` for ``config`` under ``explicit_activation_checkpointing``.

    A new function per call: ``jax.checkpoint`` caches its trace per function object, so making
    it inside the loss means every trace of the loss really runs (and checks) the layer code.
    """
    return explicit_activation_checkpointing(functools.partial(layer_forward, config))


def embed_tokens(
    embed: jax.Array, tokens: jax.Array, batch: str = "B/batch", seq: str = "L"
) -> jax.Array:
    """The residual stream ``'{batch} L M'`` of ``tokens`` ``'{batch} L'`` (per device):
    ``batch`` is the spec of the dims before ``L``, ``'m B/batch'`` for ``m`` microbatches, and
    ``seq`` the sequence dim's (``'L/seq'``: split over role ``seq``, context parallelism).

    Each device looks up the tokens in its vocabulary block (zeros for the others); the psum
    over ``tensor`` adds the one non-zero row per token.
    """
    table = shardops.all_gather("V/tensor M/fsdp -> V/tensor M", embed)
    x = shardops.index_unreduced(f"[V/tensor] M, {batch} {seq} -> {batch} {seq} M", table, tokens)
    return shardops.psum(f"{batch} {seq} M", x, axes="tensor")


def next_token_loss(
    config: Config,
    final_norm: jax.Array,
    unembed: jax.Array,
    x: jax.Array,
    tokens: jax.Array,
    batch: str = "B/batch",
    *,
    seq: str = "L",
    targets: jax.Array | None = None,
    positions: jax.Array | None = None,
) -> jax.Array:
    """The mean next-token cross-entropy over all devices, from the residual stream ``x``
    ``'{batch} L M'`` after the last layer (per device): final norm, unembedding, and position
    ``i`` of ``tokens`` ``'{batch} L'`` predicting token ``i + 1``. ``batch`` and ``seq`` as
    for :func:`embed_tokens`. With the sequence split (``seq='L/seq'``, a balanced layout) the
    next tokens are not on this device: pass ``targets`` (the next token of each position)
    and ``positions`` (the original positions, ``'L/seq'``), both in the layout of ``tokens``."""
    gain = shardops.all_gather("M/tensor/fsdp -> M", final_norm)
    h = _rms_norm(x, gain, config.norm_eps)
    unembed = shardops.all_gather("M/fsdp V/tensor -> M V/tensor", unembed)
    rows = f"{batch} {seq}"
    logits = shardops.einsum_unreduced(f"{rows} M, M V/tensor -> {rows} V/tensor", h, unembed)
    return _cross_entropy(logits, tokens, batch, seq, targets, positions)


def _cross_entropy(
    logits: jax.Array,
    tokens: jax.Array,
    batch: str,
    seq: str,
    targets: jax.Array | None,
    positions: jax.Array | None,
) -> jax.Array:
    """The mean next-token cross-entropy over all devices of ``logits`` ``'{batch} {seq}
    V/tensor'`` (the arguments of :func:`next_token_loss`)."""
    rows = f"{batch} {seq}"
    # logsumexp over the vocabulary, which is split over tensor. The shift by the max does not
    # change the value, so it carries no gradient (and pmax needs none).
    local_max = lax.stop_gradient(jnp.max(logits, axis=-1))
    shift = shardops.pmax(rows, local_max, axes="tensor")
    sum_exp = jnp.sum(jnp.exp(logits - shift[..., None]), axis=-1)
    lse = jnp.log(shardops.psum(rows, sum_exp, axes="tensor")) + shift

    # The target's logit: only the device whose vocabulary block holds the target finds it.
    targets = jnp.roll(tokens, -1, axis=-1) if targets is None else targets
    block = logits.shape[-1]
    local_target = targets - shardops.axis_index("tensor") * block
    hit = jnp.arange(block) == local_target[..., None]
    target_logit = jnp.sum(jnp.where(hit, logits, 0.0), axis=-1)
    target_logit = shardops.psum(rows, target_logit, axes="tensor")

    batch_axes = tuple(a for dim in batch.split() for a in dim.split("/")[1:])
    seq_axes = tuple(seq.split("/")[1:])  # the roles the sequence is split over
    length = tokens.shape[-1] * math.prod(shardops.axis_size(a) for a in seq_axes)
    pos = jnp.arange(length) if positions is None else positions
    predicts = pos < length - 1  # the last position has no next token
    local_sum = jnp.sum(jnp.where(predicts, lse - target_logit, 0.0))
    total = shardops.psum("", local_sum, axes=(*batch_axes, *seq_axes))
    sequences = math.prod(tokens.shape[:-1]) * math.prod(map(shardops.axis_size, batch_axes))
    return total / (sequences * (length - 1))


@model_rules
@typed_shard_map(static_argnames=("config",))
def loss(config: Config, tokens: i32[Array, b"B/batch L"], model: Model) -> f32[Array, b""]:
    """Mean next-token cross-entropy of ``tokens`` (position ``i`` predicts token ``i + 1``).

    Takes global arrays (it is a ``typed_shard_map``); the body below runs per device. With
    ``config.overlap`` set, the body is :func:`overlap_loss_body` (sequence parallelism with
    collective matmuls; the same number).
    """
    if config.overlap is not None:
        return overlap_loss_body(config, tokens, model)
    x = embed_tokens(model.embed, tokens)
    layer = checkpointed_layer(config)

    def body(x: jax.Array, w: Layer) -> tuple[jax.Array, None]:
        return layer(x, w), None

    x, _ = lax.scan(body, x, model.layers)
    return next_token_loss(config, model.final_norm, model.unembed, x, tokens)


def checkpointed_context_layer(
    config: Config,
) -> Callable[[jax.Array, jax.Array, Layer], jax.Array]:
    """:func:`context_layer_forward` for ``config`` under ``explicit_activation_checkpointing``."""
    return explicit_activation_checkpointing(functools.partial(context_layer_forward, config))


@model_rules
@typed_shard_map(static_argnames=("config",))
def context_loss(
    config: Config,
    tokens: i32[Array, b"B/batch L/seq"],
    targets: i32[Array, b"B/batch L/seq"],
    positions: i32[Array, b"L/seq"],
    model: Model,
) -> f32[Array, b""]:
    """:func:`loss` with the sequence split over role ``seq`` (context parallelism), in the
    balanced layout: ``tokens``, their next tokens ``targets`` and their original
    ``positions`` reordered by :func:`context_inputs`. The same number as :func:`loss`."""
    _refuse_overlap_with_context(config)
    x = embed_tokens(model.embed, tokens, seq="L/seq")
    layer = checkpointed_context_layer(config)

    def body(x: jax.Array, w: Layer) -> tuple[jax.Array, None]:
        return layer(x, positions, w), None

    x, _ = lax.scan(body, x, model.layers)
    return next_token_loss(
        config,
        model.final_norm,
        model.unembed,
        x,
        tokens,
        seq="L/seq",
        targets=targets,
        positions=positions,
    )


def context_inputs(tokens: jax.Array, c: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(tokens, targets, positions)`` of global ``tokens`` ``(B, L)`` in the balanced layout
    for ``c`` devices (`shardlib.attention.to_layout`): the next token of each position is
    taken before the reordering, so it stays the next token of the original sequence."""
    targets = jnp.roll(tokens, -1, axis=-1)
    positions = jnp.asarray(attention.positions(tokens.shape[-1], c))
    return attention.to_layout(tokens, c), attention.to_layout(targets, c), positions


def _seq_axes() -> tuple[str, ...]:
    """The mesh axes the role ``seq`` splits the sequence over, in order (none: not split;
    also with no rule for ``seq`` and no mesh axis so named)."""
    try:
        (axes,) = make_partition_specs(i32[Array, b"L/seq"])
    except SpecError:  # 'seq' is neither a role of the rules nor a mesh axis: not split
        return ()
    return (axes,) if isinstance(axes, str) else tuple(axes or ())


def _axis_size(axis: str) -> int:
    mesh = jax.sharding.get_abstract_mesh()
    return dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))[axis]


def context_size() -> int:
    """How many devices the role ``seq`` splits the sequence over, under the axis rules in force
    on the mesh in force (1: not split; also with no rule for ``seq`` and no mesh axis so named)."""
    return math.prod(_axis_size(a) for a in _seq_axes())


def _context_axes(config: Config) -> tuple[str, str]:
    """``(ring axis, Ulysses axis)``: the two axes of ``seq`` (``config.context`` is
    ``'ring_ulysses'``); raises naming them when ``seq`` has another number of axes."""
    axes = _seq_axes()
    if len(axes) != 2:
        raise ValueError(
            f"Config(context='ring_ulysses') needs the role seq over two mesh axes (the ring "
            f"over the first, Ulysses over the second, e.g. a mesh ('d', 'c', 'u', 't')); "
            f"seq is over {axes or 'no axis'}: use context='ring' or 'ulysses' for one axis"
        )
    return axes[0], axes[1]


def layout_size(config: Config) -> int:
    """The ``c`` of the balanced layout `context_loss` takes its inputs in: the devices of
    ``seq``; with ``config.context == 'ring_ulysses'`` those of the ring axis alone (the
    Ulysses devices of one ring step share its block)."""
    if config.context == "ring_ulysses":
        return _axis_size(_context_axes(config)[0])
    return context_size()


# ---------------------------------------------------------------------------------------------
# Sequence parallelism with collective matmuls (``Config.overlap``: 'ring' or 'bidirectional').
# Between the blocks the residual stream is split over the sequence on tensor,
# ``B/batch L/tensor M``; norms are per token (local). Each block's first matmul is an
# all-gather of the residual's L run as a ring of ppermutes beside block matmuls, its output
# projection a reduce-scatter into L/tensor run the same way (`shardops.einsum(...,
# overlap=)`). The attention between them sees the whole sequence, as in `layer_forward`.
# ---------------------------------------------------------------------------------------------


def _fused_qkv(w: Layer) -> jax.Array:
    """``w_q``, ``w_k``, ``w_v`` side by side on one last dim, ``M K/tensor E`` with
    ``E = (G + 2) D`` (this device's heads, gathered over fsdp): one ring moves the normed
    residual for all three projections."""
    m, heads, group, width = w.w_q.shape
    fused = jnp.concatenate([w.w_q.reshape(m, heads, group * width), w.w_k, w.w_v], axis=-1)
    return shardops.all_gather("M/fsdp K/tensor E -> M K/tensor E", fused)


def _fused_gate_up(w: Layer) -> jax.Array:
    """``w_gate`` and ``w_up`` stacked on a last dim ``C`` of 2, ``M F/tensor C``."""
    return shardops.all_gather(
        "M/fsdp F/tensor C -> M F/tensor C", jnp.stack([w.w_gate, w.w_up], -1)
    )


@typeguard.typechecked
def overlap_layer_forward(
    config: Config, x: f32[Array, b"B/batch L/tensor M"], w: Layer
) -> f32[Array, b"B/batch L/tensor M"]:
    """:func:`layer_forward` on a residual stream split over the sequence on ``tensor``: the
    same block, its tensor-parallel matmuls run as collective matmuls (``config.overlap``).

    Saves for the backward pass (under :func:`checkpointed_overlap_layer`) what
    :func:`layer_forward` saves: its arguments, the attention output before its projection
    and the residual stream after attention (this device's positions of it).
    """
    ring, group, width = config.overlap, config.group, config.d_head
    h = _rms_norm(x, shardops.all_gather("M/tensor/fsdp -> M", w.ln1), config.norm_eps)
    qkv = shardops.einsum(
        "B/batch L/tensor M, M K/tensor E -> B/batch L K/tensor E", h, _fused_qkv(w), overlap=ring
    )
    q = qkv[..., : group * width].reshape(*qkv.shape[:-1], group, width)
    k, v = qkv[..., group * width : (group + 1) * width], qkv[..., (group + 1) * width :]
    q = _rope(q, 1, config.rope_base)
    k = _rope(k, 1, config.rope_base)
    o = save_for_backward(_attend(q, k, v))
    w_o = shardops.all_gather("K/tensor G D M/fsdp -> K/tensor G D M", w.w_o)
    attn = shardops.einsum(  # the heads' parts summed, each device keeping its positions
        "B/batch L K/tensor G D, K/tensor G D M -> B/batch L/tensor M", o, w_o, overlap=ring
    )
    x = save_for_backward(x + attn)

    h = _rms_norm(x, shardops.all_gather("M/tensor/fsdp -> M", w.ln2), config.norm_eps)
    gate_up = shardops.einsum(
        "B/batch L/tensor M, M F/tensor C -> B/batch L F/tensor C",
        h,
        _fused_gate_up(w),
        overlap=ring,
    )
    act = jax.nn.silu(gate_up[..., 0]) * gate_up[..., 1]
    w_down = shardops.all_gather("F/tensor M/fsdp -> F/tensor M", w.w_down)
    mlp = shardops.einsum(
        "B/batch L F/tensor, F/tensor M -> B/batch L/tensor M", act, w_down, overlap=ring
    )
    return x + mlp


def checkpointed_overlap_layer(config: Config) -> Callable[[jax.Array, Layer], jax.Array]:
    """:func:`overlap_layer_forward` for ``config`` under ``explicit_activation_checkpointing``."""
    return explicit_activation_checkpointing(functools.partial(overlap_layer_forward, config))


def overlap_loss_body(config: Config, tokens: jax.Array, model: Model) -> jax.Array:
    """:func:`loss`'s body (per device) with ``config.overlap`` set: the embedding summed over
    ``tensor`` as in :func:`embed_tokens`, then each device keeps its positions
    ``B/batch L/tensor M`` (a local slice); the layers of :func:`overlap_layer_forward`; the
    final norm on this device's positions and the unembedding as one more collective matmul
    (the all-gather of L into logits ``B/batch L V/tensor``), then :func:`next_token_loss`'s
    cross-entropy."""
    x = embed_tokens(model.embed, tokens)
    x = shardops.reshard("B/batch L M -> B/batch L/tensor M", x)
    layer = checkpointed_overlap_layer(config)

    def body(x: jax.Array, w: Layer) -> tuple[jax.Array, None]:
        return layer(x, w), None

    x, _ = lax.scan(body, x, model.layers)
    gain = shardops.all_gather("M/tensor/fsdp -> M", model.final_norm)
    h = _rms_norm(x, gain, config.norm_eps)
    unembed = shardops.all_gather("M/fsdp V/tensor -> M V/tensor", model.unembed)
    logits = shardops.einsum(
        "B/batch L/tensor M, M V/tensor -> B/batch L V/tensor", h, unembed, overlap=config.overlap
    )
    return _cross_entropy(logits, tokens, "B/batch", "L", None, None)


def _refuse_overlap_with_context(config: Config) -> None:
    if config.overlap is not None:
        raise ValueError(
            f"Config(overlap={config.overlap!r}) runs the sequence-parallel layout of `loss`, "
            "which splits the sequence over tensor; with the sequence split over seq too "
            "(context parallelism, `context_loss`) it is not supported: use overlap=None on a "
            "mesh with a seq axis, or a mesh without one"
        )


@model_rules
def loss_and_grad(config: Config, model: Model, tokens: jax.Array) -> tuple[jax.Array, Model]:
    """``(loss, d loss / d model)``; the gradients come out in the weights' sharded layout.

    Where the role ``seq`` splits the sequence (:func:`context_size` > 1, e.g. a mesh with an
    axis ``c``), this is :func:`context_loss` (ring attention in the balanced layout), else
    :func:`loss`; ``tokens`` are the global ``(B, L)`` tokens either way.
    """
    c = context_size()
    if c > 1:
        _refuse_overlap_with_context(config)
        inputs = context_inputs(tokens, layout_size(config))
        return jax.value_and_grad(lambda m: context_loss(config, *inputs, m))(model)
    return jax.value_and_grad(lambda m: loss(config, tokens, m))(model)


def sgd_update(model: Model, grads: Model, lr: float | jax.Array) -> Model:
    """Plain SGD, elementwise on the sharded weights (no communication)."""
    return jax.tree.map(lambda w, g: w - lr * g, model, grads)


@functools.partial(jax.jit, static_argnames=("config",))
def train_step(
    config: Config, model: Model, tokens: jax.Array, lr: float | jax.Array
) -> tuple[Model, jax.Array]:
    """One SGD step: returns the updated weights and the loss before the update."""
    value, grads = loss_and_grad(config, model, tokens)
    return sgd_update(model, grads, lr), value


# ---------------------------------------------------------------------------------------------
# The same model in plain jax.numpy on global arrays: the oracle for the tests. Written
# independently of the sharded code: flat head dims, repeated key/value heads, complex RoPE,
# jax.nn.log_softmax.
# ---------------------------------------------------------------------------------------------


def reference_loss(model: Model, tokens: jax.Array, config: Config) -> jax.Array:
    """Mean next-token cross-entropy, computed without any sharding."""
    logits = reference_logits(model, tokens, config)
    logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
    nll = -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)
    return jnp.mean(nll)


def reference_logits(model: Model, tokens: jax.Array, config: Config) -> jax.Array:
    """The logits ``(B, L, V)`` of every position of ``tokens`` ``(B, L)`` (position ``i``'s
    prediction of token ``i + 1``), computed without any sharding."""
    c = config
    batch, seq = tokens.shape
    heads, width = c.n_heads, c.d_head

    def norm(x, gain):
        return x / jnp.sqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + c.norm_eps) * gain

    half = width // 2
    freqs = 1.0 / c.rope_base ** (2.0 * jnp.arange(half, dtype=jnp.float32) / width)
    turn = jnp.exp(1j * (jnp.arange(seq, dtype=jnp.float32)[:, None] * freqs[None, :]))

    def rotary(u):  # batch, seq, heads, width
        z = lax.complex(u[..., :half], u[..., half:]) * turn[None, :, None, :]
        return jnp.concatenate([jnp.real(z), jnp.imag(z)], axis=-1)

    causal = jnp.tril(jnp.ones((seq, seq), dtype=bool))
    x = model.embed[tokens]
    for i in range(c.n_layers):
        w = jax.tree.map(lambda a, i=i: a[i], model.layers)
        h = norm(x, w.ln1)
        q = (h @ w.w_q.reshape(c.d_model, heads * width)).reshape(batch, seq, heads, width)
        k = (h @ w.w_k.reshape(c.d_model, -1)).reshape(batch, seq, c.n_kv_heads, width)
        v = (h @ w.w_v.reshape(c.d_model, -1)).reshape(batch, seq, c.n_kv_heads, width)
        q, k = rotary(q), rotary(k)
        k = jnp.repeat(k, c.group, axis=2)
        v = jnp.repeat(v, c.group, axis=2)
        s = jnp.einsum("bqhe,bkhe->bhqk", q, k) / jnp.sqrt(jnp.float32(width))
        p = jax.nn.softmax(jnp.where(causal, s, -jnp.inf), axis=-1)
        o = jnp.einsum("bhqk,bkhe->bqhe", p, v).reshape(batch, seq, heads * width)
        x = x + o @ w.w_o.reshape(heads * width, c.d_model)
        h = norm(x, w.ln2)
        x = x + (jax.nn.silu(h @ w.w_gate) * (h @ w.w_up)) @ w.w_down
    return norm(x, model.final_norm) @ model.unembed


def build_parser() -> argparse.ArgumentParser:
    """The command line (no flags; ``--help`` describes the run)."""
    return argparse.ArgumentParser(
        description="Train the small model a few SGD steps on 8 devices (mesh d=4, t=2).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )


def main(argv: list[str] | None = None) -> None:
    build_parser().parse_args(argv or [])  # no options; --help describes the run
    config = Config(
        vocab=64, d_model=32, n_heads=4, n_kv_heads=2, d_head=8, d_ff=64, n_layers=2, seq_len=16
    )
    mesh = jax.make_mesh((4, 2), ("d", "t"))
    with jax.set_mesh(mesh), axis_rules(rules_for(mesh)):  # batch, fsdp -> d; tensor -> t
        model = place_model(init_model(config, jax.random.key(0)))
        tokens = jax.random.randint(jax.random.key(1), (8, config.seq_len), 0, config.vocab)
        tokens = jax.device_put(tokens, make_shardings(i32[Array, b"B/batch L"]))
        for step in range(5):
            model, value = train_step(config, model, tokens, 0.5)
            print(f"step {step}: loss {float(value):.4f}")


if __name__ == "__main__":
    main(sys.argv[1:])
