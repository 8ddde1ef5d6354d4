"""sharding_summary: per-leaf layout and bytes, for types and for placed values."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from shardlib.shardtypes import (
    Array,
    bf16,
    f32,
    make_shardings,
    pytree_dataclass,
    sharding_summary,
)


@pytree_dataclass
class Layer:
    w1: f32["M/d F/t"]
    w2: bf16["F/t M/d"]


@pytree_dataclass
class Model:
    emb: f32["V/t M/d"]
    layers: Array[b"layers", Layer]


DIMS = dict(M=64, F=256, V=1000, layers=4)


@pytest.mark.parametrize("shape", [(4, 2), (2, 4), (8, 1)])
def test_type_summary_matches_placed_value(shape):
    mesh = jax.make_mesh(shape, ("d", "t"))
    from_type = sharding_summary(Model, mesh=mesh, dims=DIMS)
    with jax.set_mesh(mesh):
        m = Model(
            jnp.zeros((1000, 64)),
            Layer(jnp.zeros((4, 64, 256)), jnp.zeros((4, 256, 64), jnp.bfloat16)),
        )
        m = jax.tree.map(jax.device_put, m, make_shardings(Model))
        from_value = sharding_summary(m)
    assert from_type.rows == from_value.rows
    d, t = shape
    rows = {r.path: r for r in from_value.rows}
    # Per-device shapes come from the real shards of the placed arrays.
    assert rows["emb"].device_shape == m.emb.addressable_shards[0].data.shape
    assert rows["layers.w1"].device_shape == (4, 64 // d, 256 // t)
    assert rows["layers.w2"].bytes_per_device == 4 * (256 // t) * (64 // d) * 2
    expected_total = sum(
        int(np.prod(x.addressable_shards[0].data.shape)) * x.dtype.itemsize
        for x in jax.tree.leaves(m)
    )
    assert from_value.total_bytes_per_device == expected_total
    text = str(from_value)
    assert "layers.w1" in text and "f32['layers M/d F/t']" in text and "total" in text


def test_type_summary_needs_every_dim():
    mesh = jax.make_mesh((4, 2), ("d", "t"))
    with pytest.raises(ValueError, match="dim 'V'"):
        sharding_summary(Model, mesh=mesh, dims=dict(M=64, F=256, layers=4))


def test_unannotated_value_tree():
    mesh = jax.make_mesh((8,), ("d",))
    x = jax.device_put(jnp.zeros((16, 4)), jax.sharding.NamedSharding(mesh, jax.P("d")))
    s = sharding_summary({"x": x, "y": np.zeros(3, np.float32)})
    rows = {r.path: r for r in s.rows}
    assert rows["['x']"].device_shape == (2, 4)
    assert rows["['x']"].bytes_per_device == 2 * 4 * 4
    assert rows["['y']"].device_shape == (3,)
    assert "unannotated" in rows["['x']"].annotation


@pytree_dataclass(keys="attr")
class AttrLayer:
    w1: f32["M/d F/t"]
    w2: bf16["F/t M/d"]


@pytree_dataclass(keys="attr")
class AttrModel:
    emb: f32["V/t M/d"]
    layers: Array[b"layers", AttrLayer]


def test_paths_are_dotted_whatever_the_key_style():
    # The default keys print bare, as seqax's (keystr gives 'layersw1'); the table still
    # separates the fields, and a keys='attr' class gives the same rows.
    mesh = jax.make_mesh((4, 2), ("d", "t"))
    seqax_style = sharding_summary(Model, mesh=mesh, dims=DIMS)
    attr_style = sharding_summary(AttrModel, mesh=mesh, dims=DIMS)
    assert [r.path for r in seqax_style.rows] == ["emb", "layers.w1", "layers.w2"]
    assert seqax_style.rows == attr_style.rows
    paths = [
        jax.tree_util.keystr(p) for p, _ in jax.tree.leaves_with_path(make_shardings(Model, mesh))
    ]
    assert paths == ["emb", "layersw1", "layersw2"]
