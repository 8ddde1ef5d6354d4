"""PRNG helpers."""

from __future__ import annotations

import hashlib

import jax
import numpy as np

__all__ = ["fold_in_str"]


def _hash_to_uint32(string: str) -> np.uint32:
    digest = hashlib.blake2b(string.encode("utf-8"), digest_size=4).digest()
    return np.uint32(int.from_bytes(digest, "little"))


def fold_in_str(key: jax.Array, string: str) -> jax.Array:
    """Derive a new PRNG key from `key` and a string.

    The string is hashed with a stable hash (BLAKE2b of its UTF-8 bytes, truncated to 32 bits),
    independent of the Python process and of `PYTHONHASHSEED`, and the hash is folded into the key
    with `jax.random.fold_in`. The same key and string always give the same new key; different
    strings give (with overwhelming probability) different keys. Handy for giving each named
    parameter or layer its own key.

    The string is a static Python value, so this works under `jax.jit` with `key` traced.

    **Arguments:**


    - `key`: a PRNG key, either a raw `uint32` key (`jax.random.PRNGKey`) or a typed key
        (`jax.random.key`).
    - `string`: any Python string.

    **Returns:**

    A new PRNG key of the same kind (raw or typed) as `key`.

    Examples:

    ```python
    key = jax.random.key(0)
    w_key = fold_in_str(key, "layers.0.attention.w_q")
    w_q = jax.random.normal(w_key, (512, 512))
    ```
    """
    if not isinstance(string, str):
        raise TypeError(f"fold_in_str expects a str, got {type(string).__name__}: {string!r}")
    return jax.random.fold_in(key, _hash_to_uint32(string))
