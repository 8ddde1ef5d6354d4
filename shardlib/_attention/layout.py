"""Put a global sequence into a context-parallel layout and back (JAX, on global arrays).

The order is `shardlib._attention.chunks.stored_positions`: slot ``j`` of the stored sequence
holds original position ``order[j]``; splitting the stored sequence contiguously over ``c``
devices (``'B L/c ...'``) gives device ``i`` chunks ``i`` and ``2c - 1 - i`` (balanced).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .chunks import LAYOUTS, stored_positions

__all__ = ["from_layout", "positions", "to_layout"]


def _order(fn: str, x: Any, c: int, layout: str, axis: int) -> tuple[np.ndarray, int]:
    if layout not in LAYOUTS:
        raise ValueError(
            f"{fn}: argument `layout` must be one of {', '.join(map(repr, LAYOUTS))}, got "
            f"{layout!r}"
        )
    if isinstance(c, bool) or not isinstance(c, int) or c < 1:
        raise ValueError(f"{fn}: argument `c` must be a positive int (devices), got {c!r}")
    ndim = np.ndim(x)
    if not -ndim <= axis < ndim:
        raise ValueError(f"{fn}: argument `axis` must name a dim of `x` (rank {ndim}), got {axis}")
    length = np.shape(x)[axis]
    try:
        order = stored_positions(length, c, layout)
    except ValueError as e:
        raise ValueError(f"{fn}: argument `x` dim {axis} (sequence): {e}") from None
    return np.asarray(order, dtype=np.int32), axis % ndim


def positions(length: int, c: int, layout: str = "balanced") -> np.ndarray:
    """The original position of each stored slot (int32): the position ids (for RoPE and
    masks) of a sequence of ``length`` in ``layout`` over ``c`` devices.

    Examples:
        >>> attention.positions(8, c=2)  # device 0: chunks 0 and 3; device 1: chunks 1 and 2
        array([0, 1, 6, 7, 2, 3, 4, 5], dtype=int32)
    """
    return np.asarray(stored_positions(length, c, layout), dtype=np.int32)


def to_layout(x: Any, c: int, layout: str = "balanced", axis: int = 1) -> jax.Array:
    """``x`` (a global array) with its sequence dim ``axis`` reordered into ``layout`` for
    ``c`` devices: split the result over ``c`` (``'B L/c ...'``) and device ``i`` holds
    chunks ``i`` and ``2c - 1 - i`` of ``2c`` (balanced). The length must be divisible by
    ``2c`` (balanced) or ``c``. The result keeps ``x``'s sharding.

    Examples:
        >>> tokens = attention.to_layout(tokens, c=4)  # 'B L' in the balanced order
    """
    order, axis = _order("to_layout", x, c, layout, axis)
    return _take(x, order, axis)


def from_layout(x: Any, c: int, layout: str = "balanced", axis: int = 1) -> jax.Array:
    """The inverse of `to_layout`: the sequence dim ``axis`` back in its original order.

    Examples:
        >>> out = attention.from_layout(out, c=4)
    """
    order, axis = _order("from_layout", x, c, layout, axis)
    return _take(x, np.argsort(order), axis)


def _take(x: Any, order: np.ndarray, axis: int) -> jax.Array:
    """``x`` reordered along ``axis``, in ``x``'s own layout (a sequence split over ``c``
    stays split: the compiler moves the chunks between devices)."""
    x = jnp.asarray(x)
    index = (slice(None),) * axis + (order,)
    return x.at[index].get(out_sharding=jax.typeof(x).sharding)
