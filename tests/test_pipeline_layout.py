"""``pipeline.to_groups`` / ``pipeline.from_groups``: stacked layer weights moved between the
one-group layout ``(L, ...)`` (``'layers/p ...'``: gpipe, 1f1b, zb-h1) and the grouped one
``(v, L / v, ...)`` (``'v layers/p ...'``: circular, interleaved).

The regrouped values equal numpy's group-major reshape (layer ``r * (L / v) + j`` at
``[r, j]``) and the round trip is exact, for numpy, single-device and placed arrays (Explicit
and Auto mesh axes) and under ``jit``; placed leaves come back with the shardings
``make_shardings`` gives the grouped class. Then the point of it: weights placed for 1F1B,
regrouped, give ``pipeline_loss(schedule='interleaved' | 'circular')`` the loss and the
gradients (mapped back with ``from_groups``) of ``schedule='1f1b'`` on the original stack and
of plain autodiff of all layers in order on the global arrays (``tests/_pipeline_model.py``),
on a ``(4,)`` and a ``(2, 2, 2)`` mesh; and a one-group train state saved with Orbax, restored
and regrouped, trains on under interleaved as under 1F1B. Last, each refused argument.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from shardlib import pipeline, shardops
from shardlib.shardtypes import Array, f32, make_shardings, pytree_dataclass, typed_shard_map
from tests import _pipeline_model as pm
from tests._mesh_util import make_mesh
from tests._pipeline_model import Groups3, Stack, Stack3

L, V = 8, 2  # layers, layer groups per stage


@pytree_dataclass
class Groups:  # `Stack` in the grouped layout
    w_in: f32[Array, b"v layers/p M F"]
    w_out: f32[Array, b"v layers/p F M"]
    bias: f32[Array, b"v layers/p M"]
    gain: f32[Array, b"v layers/p M"]


def _grouped(w: dict[str, np.ndarray], v: int) -> dict[str, np.ndarray]:
    """The oracle: layer ``r * (L / v) + j`` at ``[r, j]``, written out index by index."""
    out = {}
    for name, a in w.items():
        k = a.shape[0] // v
        out[name] = np.stack([np.stack([a[r * k + j] for j in range(k)]) for r in range(v)])
    return out


def _assert_tree_equal(got: Any, want: Any) -> None:
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert g.shape == w.shape
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def _specs(tree: Any) -> list[Any]:
    """The shardings of ``tree``'s leaves (a tree of shardings: its leaves)."""
    leaves = jax.tree.leaves(tree)
    return [s if isinstance(s, jax.sharding.Sharding) else s.sharding for s in leaves]


# ---------------------------------------------------------------------------------------------
# Values and layouts
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("v", [1, 2, 4, 8])
def test_numpy_leaves_group_major_and_round_trip(v: int) -> None:
    """Numpy in, numpy out, in model order group-major; ``from_groups`` undoes it exactly."""
    w = pm.weights(0, L)
    groups = pipeline.to_groups(w, v)
    assert all(isinstance(a, np.ndarray) for a in groups.values())
    _assert_tree_equal(groups, _grouped(w, v))
    _assert_tree_equal(pipeline.from_groups(groups), w)


def test_single_device_arrays_and_a_bare_array() -> None:
    """Unplaced ``jax.Array`` leaves are reshaped; the tree may be one array."""
    w = jnp.asarray(pm.weights(1, L)["w_in"])
    groups = pipeline.to_groups(w, 4)
    np.testing.assert_array_equal(groups, _grouped({"w": np.asarray(w)}, 4)["w"])
    np.testing.assert_array_equal(pipeline.from_groups(groups), w)


@pytest.mark.parametrize("auto", [False, True], ids=["explicit", "auto"])
def test_placed_leaves_get_the_grouped_classes_shardings(auto: bool) -> None:
    """On (p, d, t) = (2, 2, 2): `Stack3` regrouped is laid out as `make_shardings(Groups3)`
    (``P('p', 'd', 't')`` -> ``P(None, 'p', 'd', 't')``), and back as `make_shardings(Stack3)`;
    the values are the oracle's."""
    mesh = make_mesh((2, 2, 2), ("p", "d", "t"), auto=auto)
    w = pm.weights(2, L)
    stack = jax.device_put(Stack3(**w), make_shardings(Stack3, mesh=mesh))
    groups = pipeline.to_groups(stack, V)
    assert isinstance(groups, Stack3)  # the same pytree, its leaves regrouped
    assert _specs(groups) == _specs(make_shardings(Groups3, mesh=mesh))
    _assert_tree_equal(groups, Stack3(**_grouped(w, V)))
    back = pipeline.from_groups(groups)
    assert _specs(back) == _specs(make_shardings(Stack3, mesh=mesh))
    _assert_tree_equal(back, stack)


def test_under_jit_the_layout_follows_the_type() -> None:
    """Traced leaves (Explicit axes): reshaped with the grouped layout in their type."""
    mesh = make_mesh((4,), ("p",))
    w = pm.weights(3, L)
    stack = jax.device_put(Stack(**w), make_shardings(Stack, mesh=mesh))
    with jax.set_mesh(mesh):
        groups = jax.jit(lambda s: pipeline.to_groups(s, V))(stack)
        back = jax.jit(pipeline.from_groups)(groups)
    assert _specs(groups) == _specs(make_shardings(Groups, mesh=mesh))
    _assert_tree_equal(groups, Stack(**_grouped(w, V)))
    assert _specs(back) == _specs(make_shardings(Stack, mesh=mesh))
    _assert_tree_equal(back, stack)


def test_shape_dtype_structs_are_regrouped_with_their_sharding() -> None:
    """Abstract leaves (``jax.eval_shape``, restore targets) get the grouped shape and layout."""
    mesh = make_mesh((4,), ("p",))
    stack = jax.device_put(Stack(**pm.weights(0, L)), make_shardings(Stack, mesh=mesh))
    abstract = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), stack
    )
    groups = pipeline.to_groups(abstract, V)
    assert groups.w_in.shape == (V, L // V, pm.M, pm.F)
    assert _specs(groups) == _specs(make_shardings(Groups, mesh=mesh))


# ---------------------------------------------------------------------------------------------
# Switching schedule: 1F1B on the stack = interleaved / circular on the regrouped stack
# ---------------------------------------------------------------------------------------------


def _head(scale: jax.Array, y: jax.Array, coef: jax.Array) -> jax.Array:
    return scale * jnp.sum(jnp.tanh(y) * coef)


def _head3(scale: jax.Array, y: jax.Array, coef: jax.Array) -> jax.Array:
    return scale * shardops.psum("", jnp.sum(jnp.tanh(y) * coef), axes="d")


def _loss(schedule: str, cls: Any, tp: bool) -> Any:
    """The pipelined loss ``(weights, scale, x, coef) -> scalar`` under ``schedule``."""
    stage, head, rows = (pm.stage3, _head3, "B/d M") if tp else (pm.stage, _head, "B M")
    micro = f32[Array, f"m {rows}".encode()]

    @typed_shard_map
    def loss(s: cls, scale: f32[Array, b""], x: micro, c: micro) -> f32[Array, b""]:  # pyright: ignore[reportInvalidTypeForm]
        return pipeline.pipeline_loss(
            stage, s, x, spec=rows, loss_fn=head, loss_params=scale, targets=c, schedule=schedule
        )

    return loss


def _value_and_grads(loss: Any, weights: Any, x: np.ndarray, coef: np.ndarray) -> Any:
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(weights, np.float32(0.7), x, coef)


@pytest.mark.parametrize(
    ("shape", "tp"),
    [((4,), False), pytest.param((2, 2, 2), True, marks=pytest.mark.slow)],
    ids=["p4", "p2d2t2"],
)
def test_regrouped_weights_give_1f1b_loss_and_gradients(shape: tuple[int, ...], tp: bool) -> None:
    """Weights placed for '1f1b', regrouped with ``to_groups``: 'interleaved' and 'circular'
    give the same loss and gradients (``from_groups`` of theirs) as '1f1b' on the stack, and
    as plain autodiff of the unpipelined model (rtol 1e-5, atol 1e-6)."""
    mesh = make_mesh(shape, ("p", "d", "t")[: len(shape)])
    stack_cls, groups_cls = (Stack3, Groups3) if tp else (Stack, Groups)
    w = pm.weights(4, L)
    x, coef = pm.microbatches(5, 2 * mesh.shape["p"])
    stack = jax.device_put(stack_cls(**w), make_shardings(stack_cls, mesh=mesh))
    groups = groups_cls(**vars(pipeline.to_groups(stack, V)))  # the class the schedule takes
    assert _specs(groups) == _specs(make_shardings(groups_cls, mesh=mesh))

    def reference(w: dict, scale: jax.Array) -> jax.Array:
        return scale * jnp.sum(jnp.tanh(pm.reference(w, x)) * coef)

    ref_value, (ref_w, ref_scale) = jax.value_and_grad(reference, (0, 1))(w, np.float32(0.7))
    with jax.set_mesh(mesh):
        one, (g_one, s_one) = _value_and_grads(_loss("1f1b", stack_cls, tp), stack, x, coef)
        results = {
            schedule: _value_and_grads(_loss(schedule, groups_cls, tp), groups, x, coef)
            for schedule in ("interleaved", "circular")
        }
    np.testing.assert_allclose(one, ref_value, rtol=1e-5, atol=1e-6)
    for schedule, (value, (g, s)) in results.items():
        np.testing.assert_allclose(value, one, rtol=1e-5, atol=1e-6, err_msg=schedule)
        np.testing.assert_allclose(s, s_one, rtol=1e-5, atol=1e-6, err_msg=schedule)
        np.testing.assert_allclose(s, ref_scale, rtol=1e-5, atol=1e-6, err_msg=schedule)
        back = pipeline.from_groups(g)
        assert _specs(back) == _specs(g_one)
        for name, ref in ref_w.items():
            got, want = np.asarray(getattr(back, name)), np.asarray(getattr(g_one, name))
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=name)
            np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6, err_msg=name)


# ---------------------------------------------------------------------------------------------
# An Orbax checkpoint of a one-group train state, resumed under interleaved
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow  # an Orbax save and restore and three compiled steps
def test_orbax_one_group_state_resumed_under_interleaved(tmp_path: Any) -> None:
    """One 1F1B step on (2, 2, 2), the whole state saved with Orbax and restored onto
    (4, 2, 1); its weights and Adam's moments regrouped with ``to_groups``. The interleaved
    loss equals the 1F1B loss of the restored state, and one more step under each schedule
    gives the same loss and the same state (``from_groups`` of the interleaved one)."""
    pytest.importorskip("optax")
    ocp = pytest.importorskip("orbax.checkpoint")
    from tests import test_pipeline_checkpoint as ck  # its train state, steps and restore

    mesh = make_mesh((2, 2, 2), ck.NAMES)
    with jax.set_mesh(mesh):
        state = jax.jit(ck.init_state)()
    state, _ = ck._run(state, "1f1b", range(1), mesh)  # Adam's moments no longer zero
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(tmp_path / "state", state)

    mesh = make_mesh((4, 2, 1), ck.NAMES)
    restored = ck._restore(tmp_path / "state", mesh)

    def regroup(n: Any) -> Any:
        return Groups3(**vars(pipeline.to_groups(n, ck.V))) if isinstance(n, Stack3) else n

    grouped = jax.tree.map(regroup, restored, is_leaf=lambda n: isinstance(n, Stack3))
    assert _specs(grouped["params"]["stages"]) == _specs(make_shardings(Groups3, mesh=mesh))
    assert _specs(grouped["opt_state"][0].nu["stages"]) == _specs(grouped["params"]["stages"])
    x, coef = ck._batch(1)
    params, params_g = restored["params"], grouped["params"]
    with jax.set_mesh(mesh):
        one = jax.jit(ck._make_loss("1f1b"))(params["stages"], params["scale"], x, coef)
        inter = jax.jit(ck._make_loss("interleaved"))(
            params_g["stages"], params_g["scale"], x, coef
        )
    np.testing.assert_allclose(inter, one, rtol=1e-5)

    after_one, losses_one = ck._run(restored, "1f1b", range(1, 2), mesh)
    after_inter, losses_inter = ck._run(grouped, "interleaved", range(1, 2), mesh)
    np.testing.assert_allclose(losses_inter, losses_one, rtol=1e-5)
    np.testing.assert_allclose(losses_one[0], one, rtol=1e-5)

    def ungroup(n: Any) -> Any:
        return Stack3(**vars(pipeline.from_groups(n))) if isinstance(n, Groups3) else n

    back = jax.tree.map(ungroup, after_inter, is_leaf=lambda n: isinstance(n, Groups3))
    for got, want in zip(jax.tree.leaves(back), jax.tree.leaves(after_one), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# Refusals
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("v", [0, -2, True, 2.0])
def test_v_must_be_a_positive_int(v: Any) -> None:
    with pytest.raises(
        ValueError, match=r"pipeline.to_groups: argument `v` must be a positive"
    ) as e:
        pipeline.to_groups(pm.weights(0, L), v)
    assert f"got {v!r}" in str(e.value)


def test_layers_not_a_multiple_of_v() -> None:
    w = {"a": np.zeros((L, 3)), "b": np.zeros((6, 3))}
    with pytest.raises(ValueError) as e:
        pipeline.to_groups(w, 4)
    msg = str(e.value)
    assert msg.startswith("pipeline.to_groups: argument `tree` leaf 'b' has 6 layers in dim 0")
    assert "expected dim 0 a multiple of 4, got 6" in msg
    assert "pass a `v` in [1, 2, 3, 6]" in msg


def test_group_size_not_a_multiple_of_the_stage_count() -> None:
    """8 layers over p = 4: v = 4 leaves groups of 2, which do not split over 4 stages."""
    mesh = make_mesh((4, 2), ("p", "d"))
    stack = jax.device_put(Stack(**pm.weights(0, L)), make_shardings(Stack, mesh=mesh))
    with pytest.raises(ValueError) as e:
        pipeline.to_groups(stack, 4)
    msg = str(e.value)
    assert msg.startswith("pipeline.to_groups: argument `tree` leaf 'w_in' has dim 0 of 8 layers")
    assert "split over mesh axis 'p' (4 devices)" in msg
    assert "expected the group size L / v = 8 / 4 a multiple of 4, got 2" in msg
    assert "pass a `v` in [1, 2]" in msg
    assert "(also 3 more: 'w_out', 'bias', 'gain')" in msg
    # the same stack unplaced has no stages to split over: v = 4 is fine
    assert pipeline.to_groups(jax.device_get(stack), 4).w_in.shape == (4, 2, pm.M, pm.F)


def test_group_size_rule_under_jit_reads_the_type() -> None:
    mesh = make_mesh((4,), ("p",))
    stack = jax.device_put(Stack(**pm.weights(0, L)), make_shardings(Stack, mesh=mesh))
    with jax.set_mesh(mesh), pytest.raises(ValueError, match=r"got 2; pass a `v` in \[1, 2\]"):
        jax.jit(lambda s: pipeline.to_groups(s, 4))(stack)


def test_a_scalar_leaf_is_refused() -> None:
    state = {"layers": np.zeros((L, 3)), "step": np.int32(0)}
    with pytest.raises(ValueError) as e:
        pipeline.to_groups(state, V)
    msg = str(e.value)
    assert msg.startswith("pipeline.to_groups: argument `tree` leaf 'step' is a scalar")
    assert "splits dim 0 (the layers): expected rank >= 1, got 0" in msg


def test_from_groups_needs_rank_two() -> None:
    with pytest.raises(ValueError) as e:
        pipeline.from_groups([np.zeros((2, 4, 3)), np.zeros((8,))])
    msg = str(e.value)
    assert msg.startswith("pipeline.from_groups: argument `tree` leaf '1' has rank 1 (shape (8,))")
    assert "merges dim 0 (the groups) with dim 1" in msg
    assert "expected rank >= 2, got 1" in msg
    with pytest.raises(ValueError, match=r"leaf \(the tree itself\) has rank 0"):
        pipeline.from_groups(np.float32(1.0))
