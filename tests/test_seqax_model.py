"""seqax compatibility: a model written in seqax's idioms runs on shardlib and is correct.

``tests/seqax_style_model.py`` is a small Llama-style decoder written the way seqax's
``train.py`` is (see its docstring). Here, on ``('d', 't')`` meshes of 8 simulated devices:

- its loss and every gradient match an unsharded plain-jax.numpy reference, float32, tight;
- a few hand-written AdamW steps match the same steps on the reference;
- the loss works with ``check_vma`` on (the default) and off (``check_vma=False`` and seqax's
  ``check_rep=False``);
- a checkpoint keyed seqax's way (``jax.tree_util.keystr`` of each leaf's path, which for
  seqax's pytree dataclasses prints ``'weightsembed'``) saved with ``np.savez``, reloaded into
  a fresh state, resumes to the same result as an uninterrupted run;
- the seqax-isms it needs: ``Array['layers', Layer](...)`` instantiation, mutable pytree
  dataclasses, seqax's ``fold_in_str`` keys, configs with unknown blocks (a warning),
  ``explicit_activation_checkpointing`` saving every named value; and the str specs of its
  dataclass fields are checked while tracing.

The meshes have Auto axes, like seqax's ``Mesh(...)``: seqax's ``Model.init`` reshards with
``lax.with_sharding_constraint``, which JAX treats as an assertion on Explicit axes.
``test_explicit_mesh`` covers ``jax.make_mesh``'s default Explicit axes.
"""

from __future__ import annotations

import dataclasses
import hashlib
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.ad_checkpoint import checkpoint_name, print_saved_residuals
from jax.sharding import AxisType
from typeguard import TypeCheckError

import jax_extra
from shardlib.shardtypes import Array, make_shardings, u32
from tests import seqax_style_model as sm

MESH_SHAPES = [(4, 2), (8, 1), (2, 4)]
_LAYER_FIELDS = [f.name for f in dataclasses.fields(sm.Layer)]
AXES = ("d", "t")


def _mesh(shape: tuple[int, int]) -> jax.sharding.Mesh:
    """A ('d', 't') mesh with Auto axes, the kind seqax's ``Mesh(create_device_mesh(...))`` is.

    seqax's ``Model.init`` ends with ``lax.with_sharding_constraint``, which on an Explicit
    axis (``jax.make_mesh``'s default) is an assertion, not a resharding: JAX refuses it.
    ``test_explicit_mesh`` runs the model on an Explicit mesh with the weights placed the way
    seqax's README does (``jax.device_put`` with ``make_shardings``).
    """
    return jax.make_mesh(shape, AXES, axis_types=(AxisType.Auto, AxisType.Auto))


# float32 on CPU: the sharded and the reference programs differ only in summation order.
LOSS_TOL = dict(rtol=1e-5, atol=1e-6)
GRAD_TOL = dict(rtol=1e-4, atol=2e-6)
TRAIN_STEPS = 3


def _hparams() -> sm.Hparams:
    return jax_extra.make_dataclass_from_dict(sm.Hparams, sm.CONFIG_DICT["model"])


def _training_hparams() -> sm.TrainingHparams:
    return jax_extra.make_dataclass_from_dict(sm.TrainingHparams, sm.CONFIG_DICT["training"])


def _targets(h: sm.Hparams) -> np.ndarray:
    key = jax.random.key(1)
    return np.asarray(
        jax.random.randint(key, (sm.BATCH, sm.SEQ_LEN), 0, h.vocab).astype(jnp.uint32)
    )


def _place_targets(targets: np.ndarray) -> jax.Array:
    return jax.device_put(targets, make_shardings(u32["B/d L"]))


# One jitted function each, so that XLA compiles once per mesh and not once per test.
_jit_state_init = jax.jit(sm.State.init, static_argnums=(0,))


def _init_state(h: sm.Hparams, seed: int = 0) -> sm.State:
    """seqax's ``jax.jit(partial(State.init, h))(fold_in_str(root_rng, 'init'))``."""
    return _jit_state_init(h, jax_extra.fold_in_str(jax.random.PRNGKey(seed), "init"))


def _place(host_tree, cls):
    """Put host arrays in the layout ``cls`` annotates, seqax-README style (``device_put``)."""
    return jax.tree.map(jax.device_put, host_tree, make_shardings(cls))


@partial(jax.jit, static_argnums=(0, 1))
def _loss_and_grad(h: sm.Hparams, shard_map_kwargs: tuple, weights: sm.Model, targets):
    loss_fn = sm.make_loss(h, **dict(shard_map_kwargs))
    return jax.value_and_grad(loss_fn)(weights, targets)


_reference_loss_and_grad = jax.jit(
    jax.value_and_grad(sm.reference_loss, argnums=1), static_argnums=(0,)
)
_reference_step = jax.jit(sm.reference_training_step, static_argnums=(4, 5))


def _assert_tree_close(actual: dict, expected: dict, what: str, **tol) -> None:
    assert sorted(actual) == sorted(expected)
    for name in expected:
        np.testing.assert_allclose(
            np.asarray(actual[name]), np.asarray(expected[name]), err_msg=f"{what} {name}", **tol
        )


@pytest.fixture(scope="module")
def initial() -> dict:
    """The initial state, made once by the jitted seqax-style ``State.init`` on a 4x2 mesh,
    as host arrays (other tests place them on their own meshes), with the reference loss and
    gradients at those weights."""
    h = _hparams()
    with jax.set_mesh(_mesh((4, 2))):
        state = _init_state(h)
        host = jax.tree.map(np.asarray, state)
        specs = {
            jax.tree_util.keystr(path): a.sharding.spec
            for path, a in jax.tree_util.tree_leaves_with_path(state)
        }
    weights = sm.weights_dict(host.weights)
    targets = _targets(h)
    loss, grads = _reference_loss_and_grad(h, weights, targets)
    return {
        "state": host,
        "specs": specs,
        "weights": weights,
        "targets": targets,
        "loss": loss,
        "grads": grads,
    }


# ---------------------------------------------------------------------------------------------
# seqax-isms, one at a time
# ---------------------------------------------------------------------------------------------


def test_config_from_dict_warns_on_unknown_block() -> None:
    with pytest.warns(Warning) as record:
        config = sm.load_config()
    assert any("flat_tokens" in str(w.message) for w in record), [str(w.message) for w in record]
    assert config.model == sm.Hparams(**sm.CONFIG_DICT["model"])
    assert config.training == sm.TrainingHparams(**sm.CONFIG_DICT["training"])
    assert config.training.queue is None
    assert config.mesh == sm.MeshConfig(d=4, t=2)
    assert config.checkpoint_interval == 2


def test_config_from_dict_still_rejects_bad_values() -> None:
    data = {k: v for k, v in sm.CONFIG_DICT.items() if k != "flat_tokens"}
    data = {**data, "model": {**data["model"], "d_model": "16"}}
    with pytest.raises(ValueError, match="d_model"):
        sm.load_config(data)


def test_fold_in_str_matches_seqax() -> None:
    """seqax folds in the first 8 hex digits of the string's MD5: same keys, same weights."""
    for key in (jax.random.PRNGKey(0), jax.random.key(0)):
        for name in ("embed", "w_q", "init"):
            seqax_data = int(hashlib.md5(name.encode()).hexdigest()[:8], 16)
            expected = jax.random.fold_in(key, seqax_data)
            np.testing.assert_array_equal(
                jax.random.key_data(jax_extra.fold_in_str(key, name)),
                jax.random.key_data(expected),
            )


@pytest.mark.slow
def test_stacked_layer_instantiation(initial: dict) -> None:
    """``Array['layers', Layer](...)`` in ``Model.init`` builds the stacked weights to scan over."""
    h = _hparams()
    layers = initial["state"].weights.layers
    assert isinstance(layers, sm.Layer)
    assert layers.w_q.shape == (h.layers, h.d_model, h.n_q_per_kv, h.n_kv, h.d_head)
    assert layers.w_kv.shape == (h.layers, 2, h.d_model, h.n_kv, h.d_head)
    assert layers.ln1.shape == (h.layers, h.d_model)
    # One layer's slice is an ordinary Layer: what lax.scan hands the loop body.
    first = jax.tree.map(lambda a: a[0], layers)
    assert isinstance(first, sm.Layer)
    assert first.w_down.shape == (h.d_model, h.d_ff)
    # Model.init's with_sharding_constraint put 'layers' (unsplit) in front of each spec.
    spec = initial["specs"]["weightslayersw_q"]
    assert tuple(spec) + (None,) * (5 - len(spec)) == (None, "d", None, "t", None)
    # Direct instantiation, as Model.init does it, with unstacked-per-layer arrays stacked.
    stacked = Array["layers", sm.Layer](**{k: getattr(layers, k) for k in _LAYER_FIELDS})
    assert isinstance(stacked, sm.Layer)
    assert stacked.w_up is layers.w_up


@pytest.mark.slow
def test_pytree_dataclass_fields_mutable(initial: dict) -> None:
    """seqax's pytree_dataclass is not frozen: fields can be assigned, and the loss sees it."""
    h = _hparams()
    with jax.set_mesh(_mesh((4, 2))):
        state = _place(initial["state"], sm.State)
        targets = _place_targets(initial["targets"])
        weights = state.weights
        weights.final_norm = weights.final_norm * 1.5
        weights.layers.ln2 = weights.layers.ln2 * 0.5
        state.weights = weights
        assert state.weights.final_norm is weights.final_norm
        loss, _ = _loss_and_grad(h, (), state.weights, targets)
    changed = dict(initial["weights"])
    changed["final_norm"] = changed["final_norm"] * 1.5
    changed["layers.ln2"] = changed["layers.ln2"] * 0.5
    expected, _ = _reference_loss_and_grad(h, changed, initial["targets"])
    np.testing.assert_allclose(loss, expected, **LOSS_TOL)
    assert not np.allclose(loss, initial["loss"])


def test_explicit_activation_checkpointing_saves_named_values(capsys) -> None:
    """seqax's policy saves every named value, not only save_for_backward's."""

    @jax_extra.explicit_activation_checkpointing
    def f(x, w):
        y = checkpoint_name(jnp.sin(x @ w), "attn_out")
        z = jnp.sin(y @ w)  # not named: recomputed
        return jnp.sum(jnp.sin(z @ w))

    x = jnp.ones((4, 8))
    w = jnp.full((8, 8), 0.1)
    capsys.readouterr()
    print_saved_residuals(f, x, w)
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.strip()]
    not_args = [ln for ln in lines if "from the argument" not in ln]
    assert len(not_args) == 1, lines  # the named value; z is recomputed
    if any("named '" in ln for ln in lines):  # JAX >= 0.10 prints the name
        assert "'attn_out'" in not_args[0], lines


# ---------------------------------------------------------------------------------------------
# The model: loss, gradients and training against the reference
# ---------------------------------------------------------------------------------------------


# The fast tier runs the first mesh; the slow tier every one.
@pytest.mark.parametrize(
    "mesh_shape",
    [s if i == 0 else pytest.param(s, marks=pytest.mark.slow) for i, s in enumerate(MESH_SHAPES)],
    ids=lambda s: f"{s[0]}x{s[1]}",
)
def test_loss_and_gradients_match_reference(mesh_shape, initial: dict) -> None:
    h = _hparams()
    with jax.set_mesh(_mesh(mesh_shape)):
        weights = _place(initial["state"].weights, sm.Model)
        targets = _place_targets(initial["targets"])
        loss, grads = _loss_and_grad(h, (), weights, targets)
    # The gradients come back in the weights' own (fully sharded) layout.
    for (path, g), w in zip(
        jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(weights), strict=True
    ):
        assert g.sharding.is_equivalent_to(w.sharding, g.ndim), jax.tree_util.keystr(path)
    np.testing.assert_allclose(loss, initial["loss"], **LOSS_TOL)
    _assert_tree_close(sm.weights_dict(grads), initial["grads"], "grad", **GRAD_TOL)


@pytest.mark.slow
@pytest.mark.parametrize(
    "shard_map_kwargs",
    [(), (("check_vma", False),), (("check_rep", False),)],
    ids=["check_vma_default", "check_vma_False", "check_rep_False"],
)
def test_loss_with_and_without_check_vma(shard_map_kwargs, initial: dict) -> None:
    h = _hparams()
    with jax.set_mesh(_mesh((4, 2))):
        weights = _place(initial["state"].weights, sm.Model)
        targets = _place_targets(initial["targets"])
        loss, grads = _loss_and_grad(h, shard_map_kwargs, weights, targets)
    np.testing.assert_allclose(loss, initial["loss"], **LOSS_TOL)
    _assert_tree_close(sm.weights_dict(grads), initial["grads"], "grad", **GRAD_TOL)


def test_shape_mismatch_is_caught_at_trace_time(initial: dict) -> None:
    """The str specs of seqax-style dataclass fields are checked: a layer whose ``w_up`` has
    another MLP width than ``w_gate`` fails while tracing, naming the dim."""
    h = _hparams()
    host = initial["state"].weights
    layers = dataclasses.replace(host.layers, w_up=np.zeros_like(host.layers.w_up[..., :8]))
    bad = dataclasses.replace(host, layers=layers)
    with jax.set_mesh(_mesh((4, 2))):
        weights = _place(bad, sm.Model)
        targets = _place_targets(initial["targets"])
        with pytest.raises(TypeCheckError, match="F/t"):
            jax.jit(sm.make_loss(h)).trace(weights, targets)


@pytest.mark.slow
def test_explicit_mesh(initial: dict) -> None:
    """On ``jax.make_mesh``'s Explicit axes (weights placed seqax's README way): same results."""
    h = _hparams()
    with jax.set_mesh(jax.make_mesh((2, 4), AXES)):
        weights = _place(initial["state"].weights, sm.Model)
        targets = _place_targets(initial["targets"])
        loss, grads = _loss_and_grad(h, (), weights, targets)
    np.testing.assert_allclose(loss, initial["loss"], **LOSS_TOL)
    _assert_tree_close(sm.weights_dict(grads), initial["grads"], "grad", **GRAD_TOL)


def _train(state: sm.State, targets: jax.Array, steps: range):
    h, hp = _hparams(), _training_hparams()
    losses = []
    for step in steps:
        state, loss = sm.training_step(state, jnp.uint32(step), h, hp, targets)
        losses.append(float(loss))
    return state, losses


@pytest.mark.slow
@pytest.mark.parametrize("mesh_shape", MESH_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_training_steps_match_reference(mesh_shape, initial: dict) -> None:
    h, hp = _hparams(), _training_hparams()
    with jax.set_mesh(_mesh(mesh_shape)):
        state = _place(initial["state"], sm.State)
        targets = _place_targets(initial["targets"])
        state, losses = _train(state, targets, range(TRAIN_STEPS))
        for a in jax.tree.leaves(state):
            assert a.dtype == jnp.float32
    w = initial["weights"]
    mu = jax.tree.map(np.zeros_like, w)
    nu = jax.tree.map(np.zeros_like, w)
    expected_losses = []
    for step in range(TRAIN_STEPS):
        w, mu, nu, loss = _reference_step(w, mu, nu, step, h, hp, initial["targets"])
        expected_losses.append(float(loss))
    np.testing.assert_allclose(losses, expected_losses, **LOSS_TOL)
    assert losses[-1] < losses[0]
    # Adam divides by sqrt(v) + 1e-5: where a gradient is near that size, the rounding of its
    # sum (another reduction order on another JAX) moves the update by up to a few lr-scaled
    # 1e-5 (seen on JAX 0.12: one weight in 2048 off by 1.6e-5 after three steps).
    _assert_tree_close(sm.weights_dict(state.weights), w, "weights", rtol=1e-4, atol=5e-5)
    _assert_tree_close(sm.weights_dict(state.adam_mu), mu, "adam_mu", **GRAD_TOL)


# ---------------------------------------------------------------------------------------------
# Checkpoints keyed by keystr, seqax's way
# ---------------------------------------------------------------------------------------------

_MODEL_KEYS = [
    "embed",
    "layersln1",
    "layersln2",
    "layersw_q",
    "layersw_kv",
    "layersw_o",
    "layersw_gate",
    "layersw_up",
    "layersw_down",
    "final_norm",
    "unembed",
]


def _save(filename, state: sm.State) -> list[str]:
    """seqax's ``save_zarr``, with numpy: every leaf under ``keystr`` of its path."""
    leaves, _ = jax.tree_util.tree_flatten_with_path(state)
    arrays = {jax.tree_util.keystr(path): np.asarray(jax.device_get(a)) for path, a in leaves}
    np.savez(filename, **arrays)
    return [jax.tree_util.keystr(path) for path, _ in leaves]


def _load(filename, template: sm.State) -> sm.State:
    """seqax's ``load_zarr``: shape, dtype and sharding from ``template``, values from disk."""
    stored = np.load(filename)

    def load_one(path, prev: jax.Array) -> jax.Array:
        arr = stored[jax.tree_util.keystr(path)]
        assert arr.shape == prev.shape and arr.dtype == prev.dtype, jax.tree_util.keystr(path)
        return jax.make_array_from_callback(prev.shape, prev.sharding, lambda index: arr[index])

    leaves, treedef = jax.tree_util.tree_flatten_with_path(template)
    return jax.tree_util.tree_unflatten(treedef, [load_one(p, a) for p, a in leaves])


@pytest.mark.slow
def test_checkpoint_keystr_round_trip_and_resume(tmp_path, initial: dict) -> None:
    with jax.set_mesh(_mesh((4, 2))):
        targets = _place_targets(initial["targets"])
        full, full_losses = _train(_place(initial["state"], sm.State), targets, range(4))

        half, losses = _train(_place(initial["state"], sm.State), targets, range(2))
        keys = _save(tmp_path / "0000000002.npz", half)
        expected_keys = [
            f"{part}{k}" for part in ("weights", "adam_mu", "adam_nu") for k in _MODEL_KEYS
        ]
        assert sorted(keys) == sorted(expected_keys)

        # A fresh state of other values: same structure and layout, as load_zarr requires.
        template = _place(jax.tree.map(np.zeros_like, initial["state"]), sm.State)
        restored = _load(tmp_path / "0000000002.npz", template)
        for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(half), strict=True):
            assert a.sharding.is_equivalent_to(b.sharding, a.ndim)
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

        resumed, more_losses = _train(restored, targets, range(2, 4))
    assert losses + more_losses == full_losses
    for a, b in zip(jax.tree.leaves(resumed), jax.tree.leaves(full), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_keystr_names_are_seqax_style() -> None:
    """``keystr`` of a pytree_dataclass path is the plain concatenation of the field names."""
    h = _hparams()
    with jax.set_mesh(_mesh((4, 2))):
        state = jax.eval_shape(partial(sm.State.init, h), jax.random.PRNGKey(0))
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(state)[0]]
    assert "weightsembed" in paths
    assert "adam_nulayersw_down" in paths
