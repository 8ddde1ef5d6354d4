"""`restore_target` and `state_shardings`: a whole optax train state on a mesh.

The round trip saves model + AdamW state + step on a (4, 2) mesh with Orbax and restores it on
(8, 1) and (2, 2, 2): values, shardings and each device's block are checked, then training
goes on and is compared with the same steps in plain jax.numpy on one device.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec

import shardlib
import shardlib.shardops as shardops
from shardlib.shardtypes import (
    Array,
    Stacked,
    f32,
    i32,
    make_partition_specs,
    make_shardings,
    pytree_dataclass,
    restore_target,
    state_shardings,
    typed_shard_map,
)

optax = pytest.importorskip("optax")

P = PartitionSpec
L, M, F, B = 2, 16, 32, 16


@pytree_dataclass
class Layer:
    w_in: f32[Array, b"M/d F/t"]
    w_out: f32[Array, b"F/t M/d"]


@pytree_dataclass
class Model:
    layers: Stacked[Layer, b"layers"]
    gain: f32[Array, b"M"]  # replicated by its annotation


@typed_shard_map
def loss_fn(model: Model, x: f32[Array, b"B/d M"], y: f32[Array, b"B/d M"]) -> f32[Array, b""]:
    def body(h, w: Layer):
        w_in = shardops.all_gather("M/d F/t -> M F/t", w.w_in)
        u = jax.nn.relu(shardops.einsum_unreduced("B/d M, M F/t -> B/d F/t", h, w_in))
        w_out = shardops.all_gather("F/t M/d -> F/t M", w.w_out)
        out = shardops.einsum_unreduced("B/d F/t, F/t M -> B/d M", u, w_out)
        return h + shardops.psum("B/d M", out, axes="t"), None

    h, _ = lax.scan(body, x, model.layers)
    return shardops.pmean("", jnp.mean((h * model.gain - y) ** 2), axes="d")


def reference_loss(model: Model, x: jax.Array, y: jax.Array) -> jax.Array:
    h = x
    for w_in, w_out in zip(model.layers.w_in, model.layers.w_out, strict=True):
        h = h + jax.nn.relu(h @ w_in) @ w_out
    return jnp.mean((h * model.gain - y) ** 2)


def _decay_mask(model: Model) -> Any:
    mask = jax.tree.map(lambda _: True, model)
    mask.gain = False
    return mask


OPTIMIZER = optax.chain(
    optax.clip_by_global_norm(1.0), optax.adamw(1e-2, weight_decay=0.1, mask=_decay_mask)
)


def _host_model(key: jax.Array) -> Model:
    k1, k2, k3 = jax.random.split(key, 3)
    return Model(
        Layer(jax.random.normal(k1, (L, M, F)) / 4, jax.random.normal(k2, (L, F, M)) / 6),
        1 + jax.random.normal(k3, (M,)) / 10,
    )


def init_state(key: jax.Array) -> dict[str, Any]:
    model: Any = jax.sharding.reshard(_host_model(key), make_shardings(Model))
    return {"model": model, "opt_state": OPTIMIZER.init(model), "step": jnp.zeros((), jnp.int32)}


def _step(state: dict[str, Any], x: jax.Array, y: jax.Array, loss: Any) -> dict[str, Any]:
    grads = jax.grad(loss)(state["model"], x, y)
    updates, opt_state = OPTIMIZER.update(grads, state["opt_state"], state["model"])
    model = optax.apply_updates(state["model"], updates)
    return {"model": model, "opt_state": opt_state, "step": state["step"] + 1}


train_step = jax.jit(lambda s, x, y: _step(s, x, y, loss_fn), donate_argnums=0)


def _batch(i: int) -> tuple[np.ndarray, np.ndarray]:
    x = np.random.default_rng(i).standard_normal((B, M)).astype(np.float32)
    return x, -x


def _train(state: dict[str, Any], steps: range, mesh: jax.sharding.Mesh) -> dict[str, Any]:
    batch = make_shardings(f32[Array, b"B/d M"], mesh=mesh)
    with jax.set_mesh(mesh):
        for i in steps:
            x, y = (jax.device_put(a, batch) for a in _batch(i))
            state = train_step(state, x, y)
    return state


def _reference(steps: int) -> dict[str, Any]:
    """The same steps on one device, unsharded, with the plain jax.numpy loss."""
    model: Any = _host_model(jax.random.key(0))
    state = {"model": model, "opt_state": OPTIMIZER.init(model), "step": jnp.zeros((), jnp.int32)}
    for i in range(steps):
        state = _step(state, *_batch(i), reference_loss)
    return state


def _expected_spec(path: tuple[Any, ...], model_specs: dict[str, PartitionSpec]) -> PartitionSpec:
    """The model's annotated spec for a weight or Adam moment (key path ends in a field)."""
    tail = jax.tree_util.keystr(path[-2:], simple=True, separator=".")
    return model_specs.get(tail, model_specs.get(tail.split(".")[-1], P()))


NEW_MESHES = [((8, 1), ("d", "t")), ((2, 2, 2), ("p", "d", "t"))]


@pytest.mark.slow
@pytest.mark.parametrize("shape, names", NEW_MESHES, ids=["8x1", "2x2x2"])
def test_full_train_state_round_trip_onto_another_mesh(tmp_path, shape, names):
    ocp = pytest.importorskip("orbax.checkpoint")
    old = jax.make_mesh((4, 2), ("d", "t"))
    with jax.set_mesh(old):
        state = _train(jax.jit(init_state)(jax.random.key(0)), range(2), old)
    saved = jax.device_get(state)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(tmp_path / "state", state)

    new = jax.make_mesh(shape, names)
    with jax.set_mesh(new):
        target = restore_target(jax.eval_shape(init_state, jax.random.key(1)))
    with ocp.StandardCheckpointer() as ckptr:
        restored = ckptr.restore(tmp_path / "state", target)

    # Values: exactly what was saved, in the same structure (Model, optax states, step).
    assert jax.tree.structure(restored) == jax.tree.structure(saved)
    for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(saved), strict=True):
        np.testing.assert_array_equal(np.asarray(got), want)
    assert int(restored["step"]) == 2 and int(restored["opt_state"][1][0].count) == 2
    # Shardings: the weights and Adam's moments in Model's layout, the scalars replicated.
    model_specs = {
        jax.tree_util.keystr(p, simple=True, separator="."): s
        for p, s in jax.tree_util.tree_leaves_with_path(make_partition_specs(Model))
    }
    for path, leaf in jax.tree_util.tree_leaves_with_path(restored):
        want = NamedSharding(new, _expected_spec(path, model_specs))
        assert leaf.sharding.mesh == new, path
        assert leaf.sharding.spec == want.spec, (path, leaf.sharding.spec, want.spec)
        assert leaf.addressable_shards[0].data.shape == want.shard_shape(leaf.shape), path
    adam = restored["opt_state"][1][0]
    assert adam.mu.layers.w_in.sharding.spec == P(None, "d", "t")
    assert adam.count.sharding.spec == P() and restored["step"].sharding.spec == P()

    # Training goes on from the restored state, on the new mesh, as it would have on one device.
    resumed = _train(restored, range(2, 3), new)
    want = _reference(3)
    for got, ref in zip(jax.tree.leaves(resumed), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=2e-4, atol=2e-5)
    # And the gradients there agree with plain JAX's.
    x, y = _batch(3)
    with jax.set_mesh(new):
        batch = make_shardings(f32[Array, b"B/d M"])
        got = jax.jit(jax.value_and_grad(loss_fn))(
            resumed["model"], jax.device_put(x, batch), jax.device_put(y, batch)
        )
    ref = jax.value_and_grad(reference_loss)(want["model"], x, y)
    for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(ref), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=2e-4, atol=2e-5)


def test_state_shardings_moves_a_live_state_between_meshes():
    old, new = jax.make_mesh((4, 2), ("d", "t")), jax.make_mesh((2, 4), ("d", "t"))
    with jax.set_mesh(old):
        state = jax.jit(init_state)(jax.random.key(0))
    moved = jax.device_put(state, state_shardings(state, new))
    assert moved["model"].layers.w_out.sharding.spec == P(None, "t", "d")
    assert moved["model"].layers.w_out.addressable_shards[0].data.shape == (L, F // 4, M // 2)
    assert moved["model"].gain.sharding.spec == P(None)  # f32[Array, b"M"]: replicated
    for a, b in zip(jax.tree.leaves(moved), jax.tree.leaves(state), strict=True):
        assert a.sharding.mesh == new
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # A live state gives the same target as its abstract shapes.
    with jax.set_mesh(new):
        assert restore_target(state) == restore_target(
            jax.eval_shape(init_state, jax.random.key(0))
        )


@pytree_dataclass
class Small:
    w: f32[Array, b"M/d F/t"]
    g: f32[Array, b"M/d"]


def _small(m: int = 16) -> Small:
    return Small(
        jax.ShapeDtypeStruct((m, 32), jnp.float32), jax.ShapeDtypeStruct((m,), jnp.float32)
    )


def _specs(tree: Any) -> Any:
    return jax.tree.map(lambda s: s.spec, tree)


def test_factored_statistics_are_replicated_and_mirrors_take_the_layout():
    """Adafactor: v_row/v_col of another rank and the (1,) placeholders are replicated."""
    mesh = jax.make_mesh((4, 2), ("d", "t"))
    opt = optax.adafactor(1e-3, min_dim_size_to_factor=4)
    factored = jax.eval_shape(opt.init, _small())[0]
    got = _specs(state_shardings(factored, mesh))
    assert got.v_row.w == P() and got.v_col.w == P() and got.v.w == P()  # (16,), (32,), (1,)
    assert got.v_row.g == P() and got.v_col.g == P()  # (1,): size 1 where g is split over d
    assert got.v.g == P("d") and got.count == P()  # v of g mirrors g


def test_masked_moments_take_the_layout_of_their_fields():
    mesh = jax.make_mesh((4, 2), ("d", "t"))
    opt = optax.masked(optax.scale_by_adam(), Small(w=True, g=False))  # type: ignore[arg-type]
    adam = jax.eval_shape(opt.init, _small()).inner_state
    got = _specs(state_shardings(adam, mesh))
    assert got.mu.w == P("d", "t") and got.nu.w == P("d", "t") and got.count == P()
    assert isinstance(adam.mu.g, optax.MaskedNode) and isinstance(got.mu.g, optax.MaskedNode)


@pytree_dataclass
class TrainState:
    model: Small
    opt_state: Any  # not an array type: walked like any pytree
    step: i32[Array, b""]
    pair: tuple[f32[Array, b"a/t"], f32[Array, b"a"]]


def test_annotated_state_with_unannotated_fields():
    mesh = jax.make_mesh((4, 2), ("d", "t"))
    sds = jax.ShapeDtypeStruct
    state = TrainState(
        _small(),
        {
            "adam": jax.eval_shape(optax.adam(1e-3).init, _small()),
            "ema": _small(),
            "plain": sds((8, 4), jnp.float32),  # no annotation covers it
        },
        sds((), jnp.int32),
        (sds((8,), jnp.float32), sds((8,), jnp.float32)),
    )
    got = _specs(state_shardings(state, mesh))
    assert got.model.w == P("d", "t") and got.model.g == P("d") and got.step == P()
    assert got.opt_state["adam"][0].nu.w == P("d", "t") and got.opt_state["ema"].g == P("d")
    assert got.opt_state["adam"][0].count == P() and got.opt_state["plain"] == P()
    assert got.pair == (P("t"), P(None))


def test_a_leaf_of_the_fields_rank_that_does_not_divide_is_an_error():
    state = {"model": _small(m=4), "step": jax.ShapeDtypeStruct((), jnp.int32)}
    with pytest.raises(ValueError) as e:
        restore_target(state, jax.make_mesh((8, 1), ("d", "t")))
    msg = str(e.value)
    assert msg.startswith("restore_target: 2 leaves of the state do not fit the mesh (d=8, t=1)")
    assert (
        "state['model'].w: shape [4, 32], annotation 'M/d F/t': dim 0 (M, size 4) is split "
        "over d=8, which does not divide 4" in msg
    )
    assert "state['model'].g: shape [4]" in msg


def test_abstract_mesh_no_mesh_and_not_a_mesh_are_errors():
    mesh = jax.make_mesh((4, 2), ("d", "t"))
    state = {"model": _small()}
    with pytest.raises(ValueError, match=r"restore_target\(state, mesh=\.\.\.\) needs a concrete "):
        restore_target(state, mesh.abstract_mesh)
    with pytest.raises(ValueError, match=r"state_shardings\(state\) needs a concrete mesh: pass"):
        state_shardings(state)
    with pytest.raises(TypeError, match=r"takes a jax.sharding.Mesh, got str"):
        state_shardings(state, "d")  # type: ignore[arg-type]
    with jax.set_mesh(mesh):  # the mesh in force is used
        assert _specs(state_shardings(state))["model"].w == P("d", "t")


@pytree_dataclass
class OtherAxis:
    w: f32[Array, b"M/data F"]


def test_an_axis_the_mesh_lacks_is_an_error():
    mesh = jax.make_mesh((4, 2), ("d", "t"))
    state = {"model": OtherAxis(jax.ShapeDtypeStruct((8, 8), jnp.float32))}
    with pytest.raises(ValueError) as e:
        state_shardings(state, mesh)
    assert str(e.value) == (
        "state_shardings: 1 leaf of the state does not fit the mesh (d=4, t=2); 'data' is not "
        "a mesh axis and no axis rules are in force, so it looks like a role (a logical axis): "
        "call state_shardings with the axis rules the model runs under in force, `with "
        "shardlib.axis_rules(data=<mesh axes>):`, or use a mesh that has these axes:\n"
        "  - state['model'].w: annotation 'M/data F' splits dims over 'data', not an axis of "
        "the mesh"
    )


@pytree_dataclass
class InRoles:
    w: f32[Array, b"M/fsdp F/tensor"]
    b: f32[Array, b"F/tensor"]


def test_a_model_in_roles_needs_its_axis_rules_and_the_error_says_so():
    """Without axis rules, every role of every leaf is named as a role (not a mesh axis), with
    the `shardlib.axis_rules(...)` to put in force; with them the target is the layout."""
    mesh = jax.make_mesh((4, 2), ("d", "t"))
    state = {"model": InRoles(jax.ShapeDtypeStruct((8, 16), jnp.float32),
                              jax.ShapeDtypeStruct((16,), jnp.float32))}  # fmt: skip
    with pytest.raises(ValueError) as e:
        restore_target(state, mesh)
    assert str(e.value) == (
        "restore_target: 2 leaves of the state do not fit the mesh (d=4, t=2); 'fsdp' and "
        "'tensor' are not mesh axes and no axis rules are in force, so they look like roles "
        "(logical axes): call restore_target with the axis rules the model runs under in "
        "force, `with shardlib.axis_rules(fsdp=<mesh axes>, tensor=<mesh axes>):`, or use a "
        "mesh that has these axes:\n"
        "  - state['model'].w: annotation 'M/fsdp F/tensor' splits dims over 'fsdp' and "
        "'tensor', not axes of the mesh\n"
        "  - state['model'].b: annotation 'F/tensor' splits dims over 'tensor', not an axis of "
        "the mesh"
    )
    with shardlib.axis_rules(fsdp="d", tensor="t"):
        target = restore_target(state, mesh)
    assert target["model"].w.sharding == NamedSharding(mesh, P("d", "t"))
    assert target["model"].b.sharding == NamedSharding(mesh, P("t"))


def test_a_leaf_that_is_not_an_array_is_an_error():
    mesh = jax.make_mesh((4, 2), ("d", "t"))
    with pytest.raises(TypeError, match=r"state\['step'\] is 3 \(int\), not an array"):
        restore_target({"model": _small(), "step": 3}, mesh)


def test_restore_target_keeps_shape_dtype_and_weak_type():
    mesh = jax.make_mesh((4, 2), ("d", "t"))
    state = {"lr": jax.ShapeDtypeStruct((), jnp.float32, weak_type=True), "model": _small()}
    target = restore_target(state, mesh)
    assert target["lr"].weak_type and target["lr"].sharding == NamedSharding(mesh, P())
    assert target["model"].w.shape == (16, 32) and target["model"].w.dtype == jnp.float32
    assert target["model"].w.sharding == NamedSharding(mesh, P("d", "t"))


def test_a_bare_stacked_layer_keeps_the_layout_eval_shape_gives_it():
    """A state whose model is a stacked `Layer` (its weights one dim more than the fields):
    no annotation covers the leaves, so they keep the layout ``jax.eval_shape`` gives them,
    moved onto the new mesh, instead of being replicated (a newcomer's silent trap)."""
    opt = optax.adam(1e-3)

    def init_state():
        layers = Layer(jnp.zeros((L, M, F)), jnp.zeros((L, F, M)))
        layers = jax.sharding.reshard(layers, make_shardings(Stacked[Layer, b"layers"]))
        return {"model": layers, "opt": opt.init(layers)}

    with jax.set_mesh(jax.make_mesh((2, 4), ("d", "t"))):
        abstract = jax.eval_shape(init_state)
    new = jax.make_mesh((4, 2), ("d", "t"))
    target = restore_target(abstract, new)
    assert target["model"].w_in.sharding == NamedSharding(new, P(None, "d", "t"))
    assert target["opt"][0].mu.w_out.sharding == NamedSharding(new, P(None, "t", "d"))
    assert target["opt"][0].count.sharding == NamedSharding(new, P())
    # Axis sizes that divide the dims keep the layout; ones that do not (F=32 over t=3) give
    # a replicated leaf, as for any leaf no annotation covers.
    wide = jax.make_mesh((1, 8), ("d", "t"))
    assert _specs(state_shardings(abstract, wide))["model"].w_in == P(None, "d", "t")
    odd = jax.make_mesh((2, 3), ("d", "t"), devices=jax.devices()[:6])
    assert _specs(state_shardings(abstract, odd))["model"].w_in == P()
    with jax.set_mesh(jax.make_mesh((2, 4), ("d", "t"))):
        state = init_state()
    placed = jax.device_put(state, state_shardings(state, new))
    np.testing.assert_array_equal(np.asarray(placed["model"].w_in), np.zeros((L, M, F)))
