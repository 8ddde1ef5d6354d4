"""The Gumbel noise of each (key, step, row, vocabulary id): a function of those four only.

``fold_in(fold_in(fold_in(key, step), row), id)`` is the key of one (row, token) pair at one
decoding step, and its Gumbel variate the noise the sampler adds to that token's tempered
logit. Nothing else enters: not the device that holds the row or the token, nor the batch or
vocabulary split, nor the block's shape. So a sample is the same on every mesh (and outside
``shard_map``), and each device draws noise only for the ids it holds.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["gumbel", "keys", "step_key"]

F32 = jnp.float32


def step_key(key: Any, step: Any) -> jax.Array:
    """The key of one decoding step: ``fold_in(key, step)``."""
    return jax.random.fold_in(key, step)


def keys(key: jax.Array, rows: jax.Array, ids: jax.Array) -> jax.Array:
    """The keys ``(B, N)`` of the global ``rows`` ``(B,)`` and vocabulary ``ids`` ``(B, N)``
    (or ``(1, N)``: the same ids in every row) under the step's ``key`` (`step_key`):
    ``fold_in(fold_in(key, row), id)``."""
    ids = jnp.broadcast_to(ids, (rows.shape[0], ids.shape[-1]))
    row_keys = jax.vmap(lambda r: jax.random.fold_in(key, r))(rows)
    return jax.vmap(lambda k, i: jax.vmap(lambda j: jax.random.fold_in(k, j))(i))(row_keys, ids)


def gumbel(key: jax.Array, rows: jax.Array, ids: jax.Array) -> jax.Array:
    """Standard Gumbel noise ``(B, N)`` f32, one variate per key of `keys`."""
    pair = keys(key, rows, ids)
    flat = pair.reshape(-1, *pair.shape[2:])  # a raw key keeps its trailing words
    noise = jax.vmap(lambda k: jax.random.gumbel(k, (), F32))(flat)
    return noise.reshape(pair.shape[:2])
