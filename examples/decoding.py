"""Typed decoding for the headline transformer (``examples/transformer_model.py``): a key/value
cache, a prefill step and a one-token decode step, each written per device.

The cache is a pytree dataclass, :class:`KVCache`, whose annotations say its layout in roles,
as the weights' do (the mesh's rules, `transformer_model.rules_for`, place it):

- ``k``, ``v``: ``f32['layers B/batch S/seq K/tensor D']``: every layer's keys (after RoPE)
  and values. The batch is split like the tokens' (``d``), the key/value heads like the
  attention's (``t``), and the cache's positions ``S`` over the context axis ``c`` when the
  mesh has one: device ``i`` of ``c`` holds positions ``i * S/c .. (i+1) * S/c - 1``, so a
  long cache takes ``1/c`` of its bytes per device and never moves.
- ``lengths``: ``i32['B/batch']``: the positions filled in each row. Rows of different
  lengths decode together: row ``b`` attends to its positions ``< lengths[b]`` only.

:func:`empty_cache` makes one for a batch and a maximum length (created in its layout when a
mesh is in force). :func:`prefill` runs left-aligned prompts ``i32['B/batch L']`` (row ``b``'s
prompt is its first ``lengths[b]`` tokens) through the layers with the training's causal
attention, writes each layer's keys and values at positions ``0 .. L-1`` and returns the cache
and the logits of each row's last prompt token. :func:`decode_step` takes one token per row,
at position ``lengths[b]``: per layer it writes the token's key and value into the cache (only
the device of ``c`` holding that position writes; a masked scatter, the cache is never
gathered), attends with `shardlib.attention.decode` (one all-reduce of softmax states over
``c``) and returns the next logits and the cache one longer. The logits are
``f32['B/batch V/tensor/seq']``: the devices of ``c`` hold the same residual stream and each
computes its own slice of its ``tensor`` vocabulary block (no collective; on a mesh without
``c`` it is ``V/tensor``). A global ``argmax`` over ``V`` picks greedy tokens::

    with jax.set_mesh(mesh), shardlib.axis_rules(tm.rules_for(mesh)):
        cache = empty_cache(config, batch=8, max_len=64)
        cache, logits = prefill(config, model, prompts, prompt_lengths, cache)
        for _ in range(steps):
            tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # greedy
            cache, logits = decode_step(config, model, cache, tokens)

Two layouts meet in :func:`prefill` when the cache's positions are split over ``c``: the
prompt's activations are ``B/batch L`` (not split over ``c``: every device of ``c`` runs the
whole prompt, as :func:`transformer_model.loss` does, and the weights are gathered over fsdp
as in training), and each device then keeps the slice of the prompt's keys and values that
falls in its chunk of the cache. That costs ``c`` times the prompt's compute but no
communication beyond training's; a prompt split over ``c`` (ring attention, balanced layout)
would need its keys and values moved into the cache's contiguous chunks.

Training's layout options do not apply: ``Config.overlap`` and ``Config.context`` are
ignored (the residual stream is replicated over ``tensor``, and :func:`prefill` attends over
the whole prompt on each device). Role ``seq`` must be one mesh axis or none.

Errors: a prompt longer than the cache, a cache whose ``max_len`` the context axis does not
divide, a batch that differs between arguments, a cache placed on another mesh and ``seq``
over two axes are refused when traced, naming the function and argument; lengths out of range
too when :func:`prefill` or :func:`decode_step` is called outside ``jax.jit`` (they are values
then). Under ``jax.jit`` lengths are traced values, which no Python check can read: a prefill length outside ``[1, L]`` gives that row NaN logits and a cache length past
the cache (so every later step of the row is NaN too), and a decode step of a full row
(``lengths[b] == S``) writes nothing and gives NaN logits (`attention.decode`'s rule for a
length outside ``[0, S]``): never a silently truncated attention.

Importing this module only defines things; ``examples/generate.py`` is a command line around it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import shardlib.shardops as shardops
from examples import transformer_model as tm
from shardlib import attention
from shardlib.shardtypes import (
    Array,
    Scope,
    f32,
    i32,
    make_partition_specs,
    pytree_dataclass,
    typed_shard_map,
)

__all__ = ["KVCache", "decode_step", "empty_cache", "prefill"]


@pytree_dataclass
class KVCache:
    """Every layer's keys (after RoPE) and values of the positions decoded so far, and the
    number of positions filled in each row (see the module docstring for the layout)."""

    k: f32[Array, b"layers B/batch S/seq K/tensor D"]
    v: f32[Array, b"layers B/batch S/seq K/tensor D"]
    lengths: i32[Array, b"B/batch"]


def _mesh_sizes() -> dict[str, int]:
    """The mesh in force's axis sizes by name (empty: no mesh)."""
    mesh = jax.sharding.get_abstract_mesh()
    return dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))


@tm.model_rules
def empty_cache(config: tm.Config, batch: int, max_len: int) -> KVCache:
    """An empty :class:`KVCache` for ``batch`` rows of up to ``max_len`` positions: zeros and
    ``lengths`` 0. Under ``jax.set_mesh`` of a mesh with Explicit axes it is created in its
    annotated layout (each device makes only its block, as ``init_model(sharded=True)``),
    else as plain arrays. ``max_len`` must be a multiple of the devices that split the cache's
    positions (role ``seq``)."""
    has_mesh = bool(_mesh_sizes())
    c = tm.context_size() if has_mesh else 1
    if max_len < 1 or max_len % c:
        raise ValueError(
            f"empty_cache: argument `max_len` is {max_len}; expected a positive multiple of "
            f"{c}, the devices of role seq {tm._seq_axes()} that split the cache's positions "
            f"(each holds max_len / {c} of them)"
        )
    shape = (config.n_layers, batch, max_len, config.n_kv_heads, config.d_head)
    specs = make_partition_specs(KVCache) if has_mesh else None
    k_spec = None if specs is None else specs.k
    v_spec = None if specs is None else specs.v
    len_spec = None if specs is None else specs.lengths
    return KVCache(
        k=jnp.zeros(shape, jnp.float32, out_sharding=k_spec),
        v=jnp.zeros(shape, jnp.float32, out_sharding=v_spec),
        lengths=jnp.zeros((batch,), jnp.int32, out_sharding=len_spec),
    )


def _check_cache(fn: str, cache: KVCache) -> None:
    """Refuse a cache placed on a mesh other than the one in force, naming ``fn`` and the
    argument (JAX's own error names neither)."""
    mine = _mesh_sizes()
    for name in ("k", "v", "lengths"):
        sharding = getattr(jax.typeof(getattr(cache, name)), "sharding", None)
        other = getattr(sharding, "mesh", None)
        if other is None or not other.axis_names or not mine:
            continue
        theirs = dict(zip(other.axis_names, other.axis_sizes, strict=True))
        if mine != theirs:
            raise ValueError(
                f"{fn}: argument `cache.{name}` is laid out for the mesh {theirs}, but the mesh "
                f"in force is {mine}; make the cache with empty_cache under this mesh (or "
                f"move it with jax.device_put(cache, make_shardings(KVCache)))"
            )


def _check_mesh(fn: str) -> None:
    """Refuse role ``seq`` over more than one mesh axis: the cache's positions are split over
    one (`attention.decode`'s ``axis``)."""
    axes = tm._seq_axes()
    if len(axes) > 1:
        raise ValueError(
            f"{fn}: the axis rules in force put role seq (the cache's positions S) over the "
            f"mesh axes {axes}; decoding splits the cache over one axis: map seq to one of "
            f"them (shardlib.axis_rules(seq={axes[0]!r}, ...)) or use a mesh with one context axis"
        )


def _context_axis() -> str | None:
    """``'seq'`` when the role splits the cache's positions (over one mesh axis), else None."""
    return "seq" if tm.context_size() > 1 else None


def _chunk_start(chunk: int) -> jax.Array | int:
    """The global position of this device's first cache slot."""
    axis = _context_axis()
    return 0 if axis is None else shardops.axis_index(axis) * chunk


def _logits(config: tm.Config, model: tm.Model, x: jax.Array) -> jax.Array:
    """The logits ``'B/batch V/tensor/seq'`` of the residual stream ``x`` ``'B/batch M'``.

    The devices of ``seq`` hold the same ``x`` (their cache chunks' attention states were
    combined) and the same vocabulary block of ``tensor``: each computes its own slice of that
    block (``V/tensor/seq``), so no device repeats another's work and no collective is needed
    (a logits replicated over ``seq`` would need one: JAX types the weights gathered over
    fsdp, which includes ``seq``'s axes, as varying over them)."""
    gain = shardops.all_gather("M/tensor/fsdp -> M", model.final_norm)
    h = tm._rms_norm(x, gain, config.norm_eps)
    unembed = shardops.all_gather("M/fsdp V/tensor -> M V/tensor", model.unembed)
    c = tm.context_size()
    if c > 1:
        block = unembed.shape[1] // c
        unembed = lax.dynamic_slice_in_dim(unembed, shardops.axis_index("seq") * block, block, 1)
    return shardops.einsum_unreduced(
        "B/batch M, M V/tensor/seq -> B/batch V/tensor/seq", h, unembed
    )


def _check_prompt(tokens: jax.Array, cache: KVCache) -> None:
    """Refuse prompts whose batch is not the cache's or that are longer than the cache."""
    if tokens.ndim != 2 or tokens.shape[0] != cache.lengths.shape[0]:
        raise ValueError(
            f"prefill: argument `tokens` has shape {tokens.shape}; expected (B, L) with B="
            f"{cache.lengths.shape[0]}, the rows of argument `cache`"
        )
    length, size = tokens.shape[1], cache.k.shape[2]
    if length > size:
        raise ValueError(
            f"prefill: argument `tokens` holds prompts of L={length} positions, but argument "
            f"`cache` holds max_len={size}; make the cache with empty_cache(config, batch, "
            f"max_len >= {length}) (nothing is truncated)"
        )


def _check_lengths(fn: str, argument: str, lengths: jax.Array, low: int, high: int) -> None:
    """Refuse concrete ``lengths`` outside ``[low, high]``, naming ``fn`` and ``argument``.
    Under ``jax.jit`` they are traced values, which no Python check can read: there a row out
    of range gets NaN logits instead (see the module docstring), never a truncated attention."""
    try:
        values = np.asarray(lengths)
    except jax.errors.TracerArrayConversionError:  # under jax.jit: traced, no value to read
        return
    bad = np.flatnonzero((values < low) | (values > high))
    if bad.size:
        row = int(bad[0])
        raise ValueError(
            f"{fn}: argument `{argument}` is {int(values[row])} in row {row}; expected each "
            f"row's length in [{low}, {high}]"
            + (
                " (the cache is full: make it with a larger max_len)"
                if values[row] > high and argument == "cache.lengths"
                else ""
            )
        )


@tm.model_rules
def prefill(
    config: tm.Config, model: tm.Model, tokens: jax.Array, lengths: jax.Array, cache: KVCache
) -> tuple[KVCache, jax.Array]:
    """Fill ``cache`` from left-aligned prompts: ``(cache, logits)``.

    **Arguments:**

    - `tokens`: ``i32['B/batch L']``; row ``b``'s prompt is its first ``lengths[b]`` tokens
      (the rest is padding: causal attention keeps it out of the prompt's positions, and
      the cache masks it).
    - `lengths`: ``i32['B/batch']``, each in ``[1, L]``.
    - `cache`: a :class:`KVCache` with ``max_len >= L`` (its keys and values at positions
      ``>= L`` are kept, its lengths replaced).

    **Returns:** the cache with every layer's keys and values of positions ``0 .. L-1`` and
    ``lengths``, and the logits ``f32['B/batch V/tensor/seq']`` of each row's last prompt token
    (the prediction of its first new token). A row whose length is outside ``[1, L]`` gets NaN
    logits and a length past the cache (its later decode steps are NaN too).
    """
    _check_mesh("prefill")
    _check_cache("prefill", cache)
    _check_prompt(tokens, cache)
    _check_lengths("prefill", "lengths", lengths, 1, tokens.shape[1])
    return _prefill(config, model, tokens, lengths, cache)


@typed_shard_map(static_argnames=("config",))
def _prefill(
    config: tm.Config,
    model: tm.Model,
    tokens: i32[Array, b"B/batch L"],
    lengths: i32[Array, b"B/batch"],
    cache: KVCache,
) -> tuple[KVCache, f32[Array, b"B/batch V/tensor/seq"]]:
    length = tokens.shape[1]
    chunk = cache.k.shape[2]
    size = chunk * tm.context_size()
    # This device's cache slots, as positions of the prompt (past it: keep the old contents).
    pos = _chunk_start(chunk) + jnp.arange(chunk)
    inside = (pos < length)[None, :, None, None]
    take = jnp.minimum(pos, length - 1)

    def keep(new: jax.Array, old: jax.Array) -> jax.Array:
        return jnp.where(inside, jnp.take(new, take, axis=1), old)

    def body(x: jax.Array, layer: tuple[tm.Layer, jax.Array, jax.Array]):
        w, k_old, v_old = layer
        q, k, v = tm.project_qkv(config, x, w)
        q = tm._rope(q, 1, config.rope_base)
        k = tm._rope(k, 1, config.rope_base)
        x = tm.finish_layer(config, x, tm._attend(q, k, v), w)
        return x, (keep(k, k_old), keep(v, v_old))

    # A scope of its own: the prompt's attention names its key positions S too (L of them).
    with Scope():
        x = tm.embed_tokens(model.embed, tokens)
        x, (k, v) = lax.scan(body, x, (model.layers, cache.k, cache.v))
    last = jnp.clip(lengths - 1, 0, length - 1)
    x = jnp.take_along_axis(x, last[:, None, None], axis=1)[:, 0]
    bad = (lengths < 1) | (lengths > length)
    logits = jnp.where(bad[:, None], jnp.nan, _logits(config, model, x))
    # A bad row's length is put past the cache: attention.decode makes its later steps NaN.
    lengths = jnp.where(bad, size + 1, lengths)
    return KVCache(k=k, v=v, lengths=lengths), logits


@tm.model_rules
def decode_step(
    config: tm.Config, model: tm.Model, cache: KVCache, tokens: jax.Array
) -> tuple[KVCache, jax.Array]:
    """One token per row: ``(cache, logits)``.

    **Arguments:**

    - `cache`: a :class:`KVCache`; row ``b``'s new token goes to position ``lengths[b]``.
    - `tokens`: ``i32['B/batch']``, the new token of each row.

    **Returns:** the cache with the new tokens' keys and values written and ``lengths + 1``,
    and the logits ``f32['B/batch V/tensor/seq']`` of the new tokens (the prediction of the next).
    A row already full (``lengths[b] >= max_len``) writes nothing and gets NaN logits.
    """
    _check_mesh("decode_step")
    _check_cache("decode_step", cache)
    if tokens.shape != cache.lengths.shape:
        raise ValueError(
            f"decode_step: argument `tokens` has shape {tokens.shape}; expected one token per "
            f"row of argument `cache`, shape {cache.lengths.shape}"
        )
    _check_lengths("decode_step", "cache.lengths", cache.lengths, 0, cache.k.shape[2] - 1)
    return _decode_step(config, model, cache, tokens)


@typed_shard_map(static_argnames=("config",))
def _decode_step(
    config: tm.Config, model: tm.Model, cache: KVCache, tokens: i32[Array, b"B/batch"]
) -> tuple[KVCache, f32[Array, b"B/batch V/tensor/seq"]]:
    positions = cache.lengths
    chunk = cache.k.shape[2]
    # Each row's slot in this device's chunk; a position outside it (another device's, or past
    # the cache) is dropped by the scatter.
    slot = positions - _chunk_start(chunk)
    slot = jnp.where((slot >= 0) & (slot < chunk), slot, chunk)
    rows = jnp.arange(tokens.shape[0])
    axis = _context_axis()
    spec = "B/batch H/tensor D, B/batch S/seq K/tensor D"

    def body(x: jax.Array, layer: tuple[tm.Layer, jax.Array, jax.Array]):
        w, k_cache, v_cache = layer
        q, k, v = tm.project_qkv(config, x, w)  # 'B/batch 1 K/tensor (G) D'
        q = tm._rope(q[:, 0], 0, config.rope_base, positions, "B/batch")
        k = tm._rope(k[:, 0], 0, config.rope_base, positions, "B/batch")
        k_cache = k_cache.at[rows, slot].set(k, mode="drop")
        v_cache = v_cache.at[rows, slot].set(v[:, 0], mode="drop")
        b, heads, group, width = q.shape
        o = attention.decode(
            spec, q.reshape(b, heads * group, width), k_cache, v_cache, positions + 1, axis
        )
        x = tm.finish_layer(config, x, o.reshape(b, 1, heads, group, width), w)
        return x, (k_cache, v_cache)

    x = tm.embed_tokens(model.embed, tokens[:, None])
    x, (k, v) = lax.scan(body, x, (model.layers, cache.k, cache.v))
    return KVCache(k=k, v=v, lengths=positions + 1), _logits(config, model, x[:, 0])
