"""PRNG helpers."""

from __future__ import annotations

import hashlib

import jax
import numpy as np

__all__ = ["fold_in_str"]


def _hash_to_uint32(string: str) -> np.uint32:
    # seqax's hash: the first 8 hex digits of the MD5 of the UTF-8 bytes, read as a
    # big-endian 32-bit integer. Keep it: the same seed must give the same weights as seqax.
    return np.uint32(int(hashlib.md5(string.encode("utf-8")).hexdigest()[:8], 16))


def fold_in_str(key: jax.Array, string: str) -> jax.Array:
    """Derive a new PRNG key from `key` and a string.

    The string is hashed as seqax hashes it (the first 32 bits of the MD5 digest of its UTF-8
    bytes, big-endian), independent of the Python process and of `PYTHONHASHSEED`, and the hash
    is folded into the key with `jax.random.fold_in`. So the same seed gives the same keys, and
    the same initial weights, as in seqax. The same key and string always give the same new key; different
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
        raise TypeError(
            f"fold_in_str(key, string): string must be a str, got {type(string).__name__} "
            f"{string!r}"
        )
    return jax.random.fold_in(key, _hash_to_uint32(string))
