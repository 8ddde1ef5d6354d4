"""Stages in the types: stacked layers split over a stage axis, ``f32['layers/p M/d F/t']``.

On a (2, 2, 2) mesh with axes ('p', 'd', 't'): ``make_shardings``, sharded init, a
``typed_shard_map`` body in which each device sees its own stage's layers, and
``sharding_summary``, for stacks written directly (``f32[Array, 'layers/p M/d F/t']``) and as
``Stacked[Layer, 'layers/p']``. Values are compared with numpy; a two-stage forward pass
(stage 0's layers, ``shardops.shift`` to stage 1, stage 1's layers) is compared, with its
gradient, against applying all layers in order on one device. An Orbax checkpoint of the
stacked weights saved on the 2-stage mesh restores onto a 1-stage (1, 4, 2) mesh in the layout
``make_shardings`` gives there (and back), and ``pipeline.gpipe`` on the restored weights
gives the 2-stage run's outputs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

from shardlib import pipeline, shardops
from shardlib.shardtypes import (
    Array,
    Stacked,
    f32,
    make_partition_specs,
    make_shardings,
    pytree_dataclass,
    sharding_summary,
    typed_shard_map,
)
from tests._mesh_util import blocks, make_mesh

L, M, F, B = 8, 8, 16, 4  # layers, model, hidden, batch
P_, D_, T_ = 2, 2, 2  # mesh sizes
LP = L // P_  # layers per stage


@pytree_dataclass
class Layer:
    w_in: f32[Array, b"M/d F/t"]
    w_out: f32[Array, b"F/t M/d"]


@pytree_dataclass
class Model:
    layers: Stacked[Layer, b"layers/p"]
    gain: f32[Array, b"layers/p M"]


@pytree_dataclass
class Direct:
    w: f32[Array, b"layers/p M/d F/t"]


SPECS = {"layers.w_in": "layers/p M/d F/t", "layers.w_out": "layers/p F/t M/d"}


@pytest.fixture(scope="module")
def mesh():
    return make_mesh((P_, D_, T_), ("p", "d", "t"))


def _weights(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "w_in": (rng.standard_normal((L, M, F)) / np.sqrt(M)).astype(np.float32),
        "w_out": (rng.standard_normal((L, F, M)) / np.sqrt(F)).astype(np.float32),
        "gain": (1 + 0.1 * rng.standard_normal((L, M))).astype(np.float32),
    }


def _model(w: dict[str, np.ndarray], mesh) -> Model:
    m = Model(layers=Layer(w_in=w["w_in"], w_out=w["w_out"]), gain=w["gain"])
    return jax.device_put(m, make_shardings(Model, mesh=mesh))


def _check_blocks(arr: jax.Array, want: np.ndarray, mesh, spec: str) -> None:
    """Every device's block of ``arr`` is the numpy block ``spec`` gives it."""
    expected = blocks(want, mesh, spec)
    by_device = {s.device: np.asarray(s.data) for s in arr.addressable_shards}
    for coords, block in expected.items():
        np.testing.assert_array_equal(by_device[mesh.devices[coords]], block, err_msg=str(coords))


def test_partition_specs_and_shardings(mesh):
    specs = make_partition_specs(Model)
    assert specs.layers.w_in == P("p", "d", "t")
    assert specs.layers.w_out == P("p", "t", "d")
    assert specs.gain == P("p", None)
    assert make_partition_specs(Direct).w == P("p", "d", "t")
    sh = make_shardings(Model, mesh=mesh)
    assert sh.layers.w_in.spec == P("p", "d", "t") and sh.layers.w_in.mesh == mesh
    assert sh.layers.w_in.shard_shape((L, M, F)) == (LP, M // D_, F // T_)


def test_device_put_places_each_stage_on_its_devices(mesh):
    w = _weights()
    model = _model(w, mesh)
    _check_blocks(model.layers.w_in, w["w_in"], mesh, SPECS["layers.w_in"])
    _check_blocks(model.layers.w_out, w["w_out"], mesh, SPECS["layers.w_out"])
    _check_blocks(model.gain, w["gain"], mesh, "layers/p M")
    direct = jax.device_put(Direct(w=w["w_in"]), make_shardings(Direct, mesh=mesh))
    _check_blocks(direct.w, w["w_in"], mesh, "layers/p M/d F/t")
    # Stage s holds layers s*LP .. (s+1)*LP - 1 on each of its devices.
    for s in model.layers.w_in.addressable_shards:
        stage = int(np.argwhere(mesh.devices == s.device)[0][0])
        assert s.index[0] == slice(stage * LP, (stage + 1) * LP)


def test_sharded_creation_matches_unsharded(mesh):
    """Creating each block in place (``out_sharding=``) gives the same values as creating
    the global array and placing it."""
    spec = make_partition_specs(Direct).w
    key = jax.random.key(3)
    with jax.set_mesh(mesh):
        w = jax.jit(lambda k: jax.random.normal(k, (L, M, F), out_sharding=spec))(key)
    assert w.sharding.spec == spec
    _check_blocks(w, np.asarray(jax.random.normal(key, (L, M, F))), mesh, "layers/p M/d F/t")


def test_body_sees_its_stage_layers(mesh):
    w = _weights()
    model = _model(w, mesh)

    @typed_shard_map
    def tag(m: Model) -> f32[Array, b"layers/p M/d F/t"]:
        assert m.layers.w_in.shape == (LP, M // D_, F // T_)
        assert m.gain.shape == (LP, M)
        return m.layers.w_in + 100.0 * shardops.axis_index("p")

    with jax.set_mesh(mesh):
        got = np.asarray(jax.jit(tag)(model))
    stage = np.repeat(np.arange(P_, dtype=np.float32), LP)[:, None, None]
    np.testing.assert_array_equal(got, w["w_in"] + np.float32(100.0) * stage)


def _stage_np(x: np.ndarray, w: dict[str, np.ndarray], layers: range) -> np.ndarray:
    for i in layers:
        x = (np.maximum(x @ w["w_in"][i], 0) @ w["w_out"][i]) * w["gain"][i]
    return x


def _run_stage(m: Model, x: jax.Array, *, enters: bool = True) -> jax.Array:
    """This stage's layers, in a scan over the local stack: x is 'B/d M'.

    ``enters``: x is the same on every stage (the pipeline's input); the scan carry must start
    varying over 'p', as the stage's weights make it (JAX's check_vma types a carry).
    """

    def layer(x, lw):
        w_in, w_out, gain = lw
        h = jax.nn.relu(shardops.einsum_unreduced("B/d M, M F/t -> B/d F/t", x, w_in))
        y = shardops.einsum_unreduced("B/d F/t, F/t M -> B/d M", h, w_out)
        return shardops.psum("B/d M", y, axes="t") * gain, None

    w_in = shardops.all_gather("layers/p M/d F/t -> layers/p M F/t", m.layers.w_in)
    w_out = shardops.all_gather("layers/p F/t M/d -> layers/p F/t M", m.layers.w_out)
    if enters:
        x = lax.pcast(x, "p", to="varying")
    x, _ = lax.scan(layer, x, (w_in, w_out, m.gain))
    return x


def test_each_stage_runs_its_own_layers(mesh):
    w = _weights()
    model = _model(w, mesh)
    x = np.random.default_rng(1).standard_normal((B, M)).astype(np.float32)

    @typed_shard_map
    def per_stage(m: Model, x: f32[Array, b"B/d M"]) -> f32[Array, b"S/p B/d M"]:
        return _run_stage(m, x)[None]

    with jax.set_mesh(mesh):
        got = np.asarray(jax.jit(per_stage)(model, x))
    for s in range(P_):
        want = _stage_np(x, w, range(s * LP, (s + 1) * LP))
        np.testing.assert_allclose(got[s], want, rtol=1e-5, atol=1e-5, err_msg=f"stage {s}")


@pytest.mark.slow
def test_two_stage_forward_and_grad_match_one_device(mesh):
    """Stage 0's layers, shift to stage 1, stage 1's layers: all layers in order."""
    w = _weights(2)
    model = _model(w, mesh)
    x = np.random.default_rng(3).standard_normal((B, M)).astype(np.float32)

    @typed_shard_map
    def pipeline(m: Model, x: f32[Array, b"B/d M"]) -> f32[Array, b"S/p B/d M"]:
        h = _run_stage(m, x)  # right on stage 0
        h = shardops.shift("B/d M", h, "p", offset=1, wrap=False)  # stage 1 gets stage 0's
        return _run_stage(m, h, enters=False)[None]  # right on stage 1

    last = (np.arange(P_) == P_ - 1)[:, None, None]  # the last stage's slot holds the result

    def loss(m, x):
        return jnp.sum(pipeline(m, x) ** 2 * last)

    def ref_loss(w_in, w_out, gain, x):
        for i in range(L):
            x = (jax.nn.relu(x @ w_in[i]) @ w_out[i]) * gain[i]
        return jnp.sum(x**2)

    with jax.set_mesh(mesh):
        got = np.asarray(jax.jit(pipeline)(model, x))[P_ - 1]
        val, g = jax.jit(jax.value_and_grad(loss))(model, x)
    np.testing.assert_allclose(got, _stage_np(x, w, range(L)), rtol=1e-5, atol=1e-5)
    ref_val, ref_g = jax.value_and_grad(ref_loss, argnums=(0, 1, 2))(
        w["w_in"], w["w_out"], w["gain"], x
    )
    np.testing.assert_allclose(val, ref_val, rtol=1e-5)
    for got_g, want_g in zip((g.layers.w_in, g.layers.w_out, g.gain), ref_g, strict=True):
        np.testing.assert_allclose(np.asarray(got_g), np.asarray(want_g), rtol=1e-4, atol=1e-5)


def test_sharding_summary_of_value_and_type(mesh):
    model = _model(_weights(), mesh)
    rows = {r.path: r for r in sharding_summary(model).rows}
    r = rows["layers.w_in"]
    assert r.annotation.endswith("layers/p M/d F/t']") or "layers/p M/d F/t" in r.annotation
    assert (r.global_shape, r.device_shape) == ((L, M, F), (LP, M // D_, F // T_))
    assert r.bytes_per_device == LP * (M // D_) * (F // T_) * 4
    assert rows["gain"].device_shape == (LP, M)
    typed = sharding_summary(Model, mesh=mesh, dims={"layers": L, "M": M, "F": F})
    assert [(r.path, r.device_shape) for r in typed.rows] == [
        (r.path, r.device_shape) for r in sharding_summary(model).rows
    ]
    text = str(typed)
    assert "p=2" in text and "layers/p F/t M/d" in text
    direct = sharding_summary(Direct, mesh=mesh, dims={"layers": L, "M": M, "F": F})
    assert direct.rows[0].device_shape == (LP, M // D_, F // T_)


def _pipelined(model: Model, x: np.ndarray, mesh) -> np.ndarray:
    """``pipeline.gpipe`` over however many stages ``mesh`` has along 'p'; x is 'm B M'."""

    @typed_shard_map
    def forward(m: Model, x: f32[Array, b"m B/d M"]) -> f32[Array, b"m B/d M"]:
        stage = lambda m, h: _run_stage(m, h, enters=False)  # h already varies over 'p'
        return pipeline.gpipe(jax.checkpoint(stage), m, x, spec="B/d M", axis="p")

    with jax.set_mesh(mesh):
        return np.asarray(jax.jit(forward)(model, x))


def _save_and_restore(ocp, path, model: Model, mesh) -> Model:
    """Save ``model`` with Orbax and read it back onto ``mesh`` in ``Model``'s layout there."""
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(path, model)
    target = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
        model,
        make_shardings(Model, mesh=mesh),
    )
    with ocp.StandardCheckpointer() as ckptr:
        restored = ckptr.restore(path, target)
    assert isinstance(restored, Model)
    for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(target), strict=True):
        assert got.sharding.mesh == mesh and got.sharding.spec == want.sharding.spec
        assert got.sharding.is_equivalent_to(want.sharding, got.ndim)
        assert got.addressable_shards[0].data.shape == want.sharding.shard_shape(want.shape)
    return restored


def _check_model_blocks(model: Model, w: dict[str, np.ndarray], mesh) -> None:
    _check_blocks(model.layers.w_in, w["w_in"], mesh, SPECS["layers.w_in"])
    _check_blocks(model.layers.w_out, w["w_out"], mesh, SPECS["layers.w_out"])
    _check_blocks(model.gain, w["gain"], mesh, "layers/p M")


@pytest.mark.slow
def test_checkpoint_moves_stages_between_meshes(mesh, tmp_path):
    """Save on 2 stages, restore on 1 (and back): same values, target layout, same outputs."""
    ocp = pytest.importorskip("orbax.checkpoint")
    one_stage = make_mesh((1, 4, 2), ("p", "d", "t"))
    w = _weights(4)
    x = np.random.default_rng(5).standard_normal((3, B, M)).astype(np.float32)
    want = np.stack([_stage_np(xi, w, range(L)) for xi in x])
    model = _model(w, mesh)
    two = _pipelined(model, x, mesh)
    np.testing.assert_allclose(two, want, rtol=1e-5, atol=1e-5)

    restored = _save_and_restore(ocp, tmp_path / "p2", model, one_stage)
    _check_model_blocks(restored, w, one_stage)
    assert restored.layers.w_in.addressable_shards[0].data.shape == (L, M // 4, F // 2)
    np.testing.assert_allclose(_pipelined(restored, x, one_stage), two, rtol=1e-5, atol=1e-6)

    back = _save_and_restore(ocp, tmp_path / "p1", restored, mesh)
    _check_model_blocks(back, w, mesh)
    np.testing.assert_allclose(_pipelined(back, x, mesh), two, rtol=1e-5, atol=1e-6)
