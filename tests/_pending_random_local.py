"""More ops of the random suite's issue-22 families: each device's block folded, scaled in part,
padded or tiled, split by a layout op (`tests._pending_random_families` draws them).

- `Fold`: ``lax.reduce`` / ``reduce_window`` with the user's computation and initial value,
  a gather with a fill value;
- `LookAlike`: scatter-multiply, concatenation with host zeros (or ones), ``jnp.tile``;
- `Vary`, `Layout`: a value made to vary over a mesh axis, then ``shardops.reshard`` /
  ``shardops.repeat`` splitting it over an axis (the interpreters' truth keeps the slices of
  the copy at index 0 of that axis: a value that varies over it has no one global array).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax import lax

from shardlib import shardops
from tests._pending_random_ops import at0, both
from tests.test_pending_random import Blocks, Op, clause, dim, each, spec_of


@dataclass(repr=False)
class Fold(Op):
    """``lax.reduce`` over M (broadcast back), ``lax.reduce_window`` over pairs of columns
    (VALID, stride 2, concatenated twice back to M), with ``comp`` ('add': lax.add, 'add_fn':
    a lambda adding, 'mul', 'max') and ``init``; or (``kind='fill'``) a row gather with
    ``mode='fill'`` and ``fill_value=init`` at the host rows ``rows`` (some out of bounds)."""

    kind: str  # 'reduce' | 'window' | 'fill'
    comp: str
    init: float
    rows: tuple[int, ...] = ()

    def __repr__(self) -> str:
        if self.kind == "fill":
            return f"v.at[{list(self.rows)}].get(mode='fill', fill_value={self.init})"
        op = "reduce(v, {}, {}, (1,))" if self.kind == "reduce" else "reduce_window(v, {}, {}, ...)"
        return "lax." + op.format(self.init, self.comp)

    def fn(self) -> Any:
        return {
            "add": lax.add,
            "add_fn": lambda x, y: x + y,
            "mul": lax.mul,
            "max": lax.max,
        }[self.comp]

    def jax(self, v, a):
        init = np.asarray(self.init, v.dtype)
        if self.kind == "fill":
            return v.at[np.array(self.rows)].get(mode="fill", fill_value=self.init)
        if self.kind == "reduce":
            r = lax.reduce(v, init, self.fn(), (1,))
            return jnp.broadcast_to(r[:, None], v.shape)
        r = lax.reduce_window(v, init, self.fn(), (1, 2), (1, 2), "VALID")
        return jnp.concatenate([r, r], axis=1)

    def sim(self, st, pg):
        f = {"add": np.add, "add_fn": np.add, "mul": np.multiply, "max": np.maximum}[self.comp]

        def fn(b, c, w):
            if self.kind == "fill":
                ok = np.array(self.rows) < b.shape[0]
                got = b[np.where(ok, self.rows, 0)]
                return np.where(ok[:, None], got, self.init)
            if self.kind == "reduce":
                r = f.reduce(b, axis=1, initial=self.init)
                return np.broadcast_to(r[:, None], b.shape)
            r = f(f(self.init, b[:, 0::2]), b[:, 1::2])
            return np.concatenate([r, r], axis=1)

        return each(st, fn, st.dt)


@dataclass(repr=False)
class LookAlike(Op):
    """``v.at[rows, cols].multiply(f)`` with f = c, or c * (1 + axis_index(axis)) (differs
    across ``axis``); ``jnp.concatenate([v[:, :k], np.zeros/np.ones(...)], 1)``;
    ``jnp.tile(v[:, :M/2], (1, 2))``."""

    how: str  # 'scatter_mul' | 'concat_zeros' | 'concat_ones' | 'tile'
    c: float = 2.0
    axis: str | None = None
    k: int = 0

    def __repr__(self) -> str:
        if self.how == "scatter_mul":
            f = f"{self.c} * (1 + axis_index({self.axis!r}))" if self.axis else f"{self.c}"
            return f"v.at[{self.k}:, ::2].multiply({f})"
        if self.how == "tile":
            return "jnp.tile(v[:, :M/2], (1, 2))"
        return f"jnp.concatenate([v[:, :{self.k}], np.{self.how[7:]}(...)], 1)"

    def jax(self, v, a):
        if self.how == "scatter_mul":
            f = jnp.float32(self.c)
            if self.axis is not None:
                f = f * (1 + lax.axis_index(self.axis)).astype(jnp.float32)
            return v.at[self.k :, ::2].multiply(f.astype(v.dtype))
        if self.how == "tile":
            return jnp.tile(v[:, : v.shape[1] // 2], (1, 2))
        fill = np.zeros if self.how == "concat_zeros" else np.ones
        host = fill((v.shape[0], v.shape[1] - self.k), np.dtype(v.dtype))
        return jnp.concatenate([v[:, : self.k], host], axis=1)

    def sim(self, st, pg):
        def fn(b, c, w):
            out = b.copy()
            if self.how == "scatter_mul":
                n = 1 + pg.mesh.lin(c, (self.axis,)) if self.axis else 1
                out[self.k :, ::2] *= self.c * n
            elif self.how == "tile":
                out = np.tile(b[:, : b.shape[1] // 2], (1, 2))
            else:
                out[:, self.k :] = 0.0 if self.how == "concat_zeros" else 1.0
            return out

        return each(st, fn, st.dt)


# ---------------------------------------------------------------------------------------------
# 5. Layout ops on a value that varies over the axis they split over
# ---------------------------------------------------------------------------------------------


@dataclass(repr=False)
class Vary(Op):
    """v * (1 + axis_index(axis)) or v * s[0], s an f32 input split over ``axis``: linear
    when v owes no sum over ``axis``; afterwards v differs across the devices of ``axis``."""

    axis: str
    src: str = ""

    def __repr__(self) -> str:
        return f"v * {self.src}[0]" if self.src else f"v * (1 + axis_index({self.axis!r}))"

    def jax(self, v, a):
        if self.src:
            return v * a[self.src].reshape(-1)[0].astype(v.dtype)
        return v * (1 + lax.axis_index(self.axis)).astype(v.dtype)

    def sim(self, st, pg):
        def fn(b, c, w):
            if self.src:
                return b * pg.block(self.src, c).reshape(-1)[0]
            return b * (1 + pg.mesh.lin(c, (self.axis,)))

        return each(st, fn, st.dt)


@dataclass(repr=False)
class Layout(Op):
    """``shardops.reshard`` splitting dim ``d`` further over ``axis`` (a local slice), or
    ``shardops.repeat`` adding a dim R split over ``axis`` (then ``[..., 0]``)."""

    how: str  # 'reshard' | 'repeat'
    axis: str
    d: int
    lay: tuple[tuple[str, ...], tuple[str, ...]]
    declare: tuple[str, ...]
    n: int  # the size of ``axis``

    def new_lay(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        if self.how == "repeat":
            return self.lay
        dims = list(self.lay)
        dims[self.d] = (*dims[self.d], self.axis)
        return (dims[0], dims[1])

    def text(self) -> str:
        c = clause(self.declare)
        if self.how == "repeat":
            return f"{spec_of(self.lay)} -> {spec_of(self.lay)} {dim('R', (self.axis,))}"
        return f"{spec_of(self.lay)}{c} -> {spec_of(self.new_lay())}{c}"

    def __repr__(self) -> str:
        if self.how == "repeat":
            return f"shardops.repeat({self.text()!r}, v, R={self.n})[..., 0]"
        return f"shardops.reshard({self.text()!r}, v)"

    def jax(self, v, a):
        if self.how == "repeat":
            return shardops.repeat(self.text(), v, R=self.n)[..., 0]
        return shardops.reshard(self.text(), v)

    def sim(self, st, pg):
        m = pg.mesh

        def fn(bl: Blocks, w: str) -> Blocks:
            out = {}
            for c in m.coords:  # the truth: the slices of the copy at index 0 of the axis
                b = bl[c] if w == "A" else bl[at0(m, c, self.axis)]
                if self.how == "reshard":
                    b = np.split(b, self.n, axis=self.d)[m.lin(c, (self.axis,))]
                out[c] = b
            return out

        return both(st, fn, lay=self.new_lay())
