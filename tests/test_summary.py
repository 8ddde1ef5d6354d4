"""sharding_summary: per-leaf layout and bytes, for types and for placed values."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from typeguard import TypeCheckError

from shardlib import SpecError, axis_rules
from shardlib.shardtypes import (
    Array,
    bf16,
    device_put_checked,
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


# ---------------------------------------------------------------------------------------------
# Under axis rules: each role shown with the mesh axes it became; sizes from those axes
# ---------------------------------------------------------------------------------------------


@pytree_dataclass
class RoleLayer:
    w1: f32["M/fsdp F/tensor"]
    w2: bf16["F/tensor M/fsdp"]


@pytree_dataclass
class RoleModel:
    emb: f32["V/tensor M/embed"]
    x: f32["B/batch M"]
    layers: Array[b"layers", RoleLayer]


@pytree_dataclass
class PhysLayer:
    w1: f32["M/d F/t"]
    w2: bf16["F/t M/d"]


@pytree_dataclass
class PhysModel:
    emb: f32["V/t M"]
    x: f32["B/d/t M"]
    layers: Array[b"layers", PhysLayer]


ROLE_DIMS = dict(M=64, F=256, V=1000, layers=4, B=16)
RULES_4x2 = dict(batch=("d", "t"), fsdp="d", tensor="t", embed=None)


def _role_model() -> RoleModel:
    return RoleModel(
        np.zeros((1000, 64), np.float32),
        np.zeros((16, 64), np.float32),
        RoleLayer(np.zeros((4, 64, 256), np.float32), np.zeros((4, 256, 64), jnp.bfloat16)),
    )


def test_summary_under_rules_shows_roles_and_the_axes_they_became():
    mesh = jax.make_mesh((4, 2), ("d", "t"))
    with jax.set_mesh(mesh), axis_rules(RULES_4x2):
        from_type = sharding_summary(RoleModel, dims=ROLE_DIMS)
        placed = device_put_checked(_role_model())
        from_value = sharding_summary(placed)
    physical = sharding_summary(PhysModel, mesh=mesh, dims=ROLE_DIMS)
    assert from_type.rows == from_value.rows
    rows = {r.path: r for r in from_value.rows}
    assert rows["emb"].annotation == "f32['V/tensor(t) M/embed(None)']"
    assert rows["x"].annotation == "f32['B/batch(d/t) M']"
    assert rows["layers.w1"].annotation == "f32['layers M/fsdp(d) F/tensor(t)']"
    assert rows["layers.w2"].annotation == "bf16['layers F/tensor(t) M/fsdp(d)']"
    # the sizes are those of the same model written with the mesh axes, and of the real shards
    for r, p in zip(from_type.rows, physical.rows, strict=True):
        assert (r.device_shape, r.bytes_per_device) == (p.device_shape, p.bytes_per_device)
    for path, leaf in [("emb", placed.emb), ("x", placed.x), ("layers.w1", placed.layers.w1)]:
        assert rows[path].device_shape == leaf.addressable_shards[0].data.shape
    assert rows["x"].device_shape == (2, 64)
    text = str(from_type)
    assert text.splitlines()[1] == (
        "axis rules: batch -> ('d', 't'), fsdp -> 'd', tensor -> 't', embed -> None "
        "(a role's mesh axes in parentheses)"
    )
    assert "f32['layers M/fsdp(d) F/tensor(t)']" in text
    assert "axis rules" not in str(physical)


def test_summary_under_rules_on_a_mesh_whose_axes_are_roles_names():
    """On a mesh with axes named fsdp and tensor those names are mesh axes (shown bare); only
    the roles with rules get their axes in parentheses."""
    mesh = jax.make_mesh((2, 2, 2), ("data", "fsdp", "tensor"))
    with axis_rules(batch=("data", "fsdp"), embed=None):
        s = sharding_summary(RoleModel, mesh=mesh, dims=ROLE_DIMS)  # the mesh given, not set
    rows = {r.path: r for r in s.rows}
    assert rows["layers.w1"].annotation == "f32['layers M/fsdp F/tensor']"
    assert rows["x"].annotation == "f32['B/batch(data/fsdp) M']"
    assert rows["emb"].annotation == "f32['V/tensor M/embed(None)']"
    assert rows["x"].device_shape == (4, 64) and rows["emb"].device_shape == (500, 64)
    assert rows["layers.w1"].device_shape == (4, 32, 128)


def test_summary_refuses_a_role_without_a_rule():
    mesh = jax.make_mesh((4, 2), ("d", "t"))
    with jax.set_mesh(mesh), axis_rules(fsdp="d", tensor="t"), pytest.raises(SpecError) as e:
        sharding_summary(RoleModel, dims=ROLE_DIMS)
    msg = str(e.value)
    assert msg.startswith("sharding_summary(RoleModel)") and "'embed' is neither" in msg, msg


def test_device_put_checked_under_rules_names_the_role_and_its_axes():
    mesh = jax.make_mesh((4, 2), ("d", "t"))
    bad = _role_model()
    bad.x = np.zeros((12, 64), np.float32)
    with jax.set_mesh(mesh), axis_rules(RULES_4x2), pytest.raises(TypeCheckError) as e:
        device_put_checked(bad)
    msg = str(e.value)
    assert "field RoleModel.x, dim 0 'B/batch' (resolved: 'B/d/t')" in msg, msg
    assert "global size 12 is not divisible by d=4 × t=2 = 8" in msg, msg
