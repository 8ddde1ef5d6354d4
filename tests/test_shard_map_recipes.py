"""The recipes for the spots of JAX's shard_map tutorial that do not port one to one.

Each recipe (docs/guide/shardops.md, "Recipes from JAX's shard_map tutorial") against the raw
``jax.shard_map`` + ``jax.lax`` version, values and gradients, and the errors a user meets on
the way name the recipe.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from typeguard import TypeCheckError

import shardlib
from shardlib import shardops
from shardlib.shardtypes import Array, f32, pytree_dataclass, typechecked, typed_shard_map

N = 4  # devices on 'i'


@pytest.fixture
def mesh():
    m = jax.make_mesh((N,), ("i",))
    with jax.set_mesh(m):
        yield m


def _x(*shape, seed=0):
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape), jnp.float32)


def _split(x, mesh):
    """``x`` laid out as the raw shard_map's ``in_specs=P('i')`` says (JAX checks it)."""
    return jax.device_put(x, jax.sharding.NamedSharding(mesh, P("i")))


def test_summing_the_blocks_of_a_split_dim(mesh):
    @jax.shard_map(in_specs=P("i"), out_specs=P())
    def raw(x):
        return jax.lax.psum(x, "i")

    @typed_shard_map
    def typed(x: f32[Array, b"N/i"]) -> f32[Array, b"R"]:
        blocks = shardops.rearrange("(K R)/i -> K/i R", x, K=shardops.axis_size("i"))
        return shardops.einsum("K/i R -> R", blocks)

    x = _split(_x(16), mesh)
    np.testing.assert_allclose(typed(x), raw(x), rtol=1e-6)
    np.testing.assert_allclose(typed(x), np.asarray(x).reshape(N, -1).sum(0), rtol=1e-6)
    g = jax.grad(lambda x: jnp.sum(typed(x) ** 2))(x)
    np.testing.assert_allclose(g, jax.grad(lambda x: jnp.sum(raw(x) ** 2))(x), rtol=1e-5)


def test_the_psum_of_a_split_dim_names_the_recipe(mesh):
    @typed_shard_map
    def wrong(x: f32[Array, b"N/i"]) -> f32[Array, b"N/i"]:
        return shardops.psum("N/i", x, axes="i")

    with pytest.raises(shardlib.SpecError) as e:
        wrong(_x(16))
    hint = str(e.value).splitlines()[-1]
    assert "raw JAX's psum of a block" in hint
    assert "shardops.einsum('K/i R -> R', shardops.rearrange('(K R)/i -> K/i R', x," in hint


def test_all_to_all_with_the_same_split_and_concat_dim(mesh):
    @jax.shard_map(in_specs=P("i"), out_specs=P("i"))
    def raw(x):
        return jax.lax.all_to_all(x, "i", 0, 0, tiled=True)

    @typed_shard_map
    def typed(x: f32[Array, b"N/i"]) -> f32[Array, b"N/i"]:
        y = shardops.rearrange("(I J C)/i -> I/i J C", x, I=N, J=N)
        y = shardops.all_to_all("I/i J C -> I J/i C", y)
        return shardops.rearrange("I J/i C -> (J I C)/i", y)

    x = _split(_x(32), mesh)
    np.testing.assert_allclose(typed(x), raw(x))
    # Globally: the (I, J) grid of chunks transposed.
    want = np.asarray(x).reshape(N, N, -1).transpose(1, 0, 2).reshape(-1)
    np.testing.assert_allclose(typed(x), want)


def test_untiled_all_gather(mesh):
    @jax.shard_map(in_specs=P("i"), out_specs=P(), check_vma=False)
    def raw(x):
        return jax.lax.all_gather(x, "i")  # tiled=False: a new leading dim

    @typed_shard_map(check_vma=False)  # as the raw version: JAX cannot type it replicated
    def typed(x: f32[Array, b"N/i"]) -> f32[Array, b"I M"]:
        return shardops.all_gather("I/i M -> I M", shardops.rearrange("(I M)/i -> I/i M", x, I=N))

    x = _split(_x(16), mesh)
    np.testing.assert_allclose(typed(x), raw(x))
    assert typed(x).shape == (N, 4)


@pytree_dataclass
class Layers:
    """Differently shaped layers: one field (and one set of names) per layer."""

    w0: f32[Array, b"D0 D1/i"]
    w1: f32[Array, b"D1/i D2"]
    w2: f32[Array, b"D2 D3/i"]


@typechecked
def _dense(x: f32[Array, b"B/i Din"], w: f32[Array, b"Din Dout"]) -> f32[Array, b"B/i Dout"]:
    """One layer: its names bind per call, so a loop over layers needs no per-layer names."""
    return jnp.tanh(shardops.einsum("B/i Din, Din Dout -> B/i Dout", x, w))


@pytest.mark.slow
def test_a_loop_over_differently_shaped_layers(mesh):
    sizes = [8, 16, 12, 4]
    ws = [_x(a, b, seed=k) for k, (a, b) in enumerate(zip(sizes, sizes[1:], strict=False))]

    @typechecked
    def shapes(ws: list[f32[Array, b"A B"]]) -> None:  # a list's items share A and B
        pass

    with pytest.raises(TypeCheckError, match=r"expected size"):
        shapes(ws)

    @typed_shard_map
    def mlp(x: f32[Array, b"B/i D0"], layers: Layers) -> f32[Array, b"B/i D3"]:
        ws = [shardops.all_gather("D0 D1/i -> D0 D1", layers.w0)]
        ws.append(shardops.all_gather("D1/i D2 -> D1 D2", layers.w1))
        ws.append(shardops.all_gather("D2 D3/i -> D2 D3", layers.w2))
        for w in ws:  # a fresh binding of Din, Dout per call of _dense
            x = _dense(x, w)
        return x

    def ref(x, ws):
        for w in ws:
            x = jnp.tanh(x @ w)
        return x

    x = _x(8, 8, seed=9)
    layers = Layers(*ws)
    np.testing.assert_allclose(mlp(x, layers), ref(x, ws), rtol=1e-5, atol=1e-6)
    got = jax.grad(lambda lay: jnp.sum(mlp(x, lay) ** 2))(layers)
    want = jax.grad(lambda ws: jnp.sum(ref(x, ws) ** 2))(ws)
    for g, r in zip((got.w0, got.w1, got.w2), want, strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-5)


def test_a_square_weight_takes_two_names(mesh):
    @typed_shard_map
    def wrong(x: f32[Array, b"B/i D"], w: f32[Array, b"D D"]) -> f32[Array, b"B/i D"]:
        return shardops.einsum("B/i D, D D -> B/i D", x, w)

    with pytest.raises(shardlib.SpecError, match=r"takes two names of the same size.*'D2'"):
        wrong(_x(8, 4), _x(4, 4))

    @typed_shard_map
    def right(x: f32[Array, b"B/i D"], w: f32[Array, b"D D2"]) -> f32[Array, b"B/i D2"]:
        return shardops.einsum("B/i D, D D2 -> B/i D2", x, w)

    x, w = _x(8, 4), _x(4, 4, seed=1)
    np.testing.assert_allclose(right(x, w), x @ w, rtol=1e-5, atol=1e-6)
