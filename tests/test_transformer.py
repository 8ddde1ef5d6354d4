"""The FSDP + tensor-parallel transformer example against a plain jax.numpy reference."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.ad_checkpoint import print_saved_residuals
from jax.sharding import NamedSharding
from typeguard import TypeCheckError

import shardlib
from examples import transformer_model as tm
from shardlib.shardtypes import f32, i32, make_shardings, typed_shard_map

# The brief's sizes: grouped-query attention with 2 query heads per key/value head.
GQA = tm.Config(
    vocab=64, d_model=32, n_heads=4, n_kv_heads=2, d_head=8, d_ff=64, n_layers=2, seq_len=16
)
# Wide enough in heads to split over t = 8; plain multi-head attention (n_kv_heads == n_heads).
MHA = tm.Config(
    vocab=64, d_model=32, n_heads=8, n_kv_heads=8, d_head=4, d_ff=64, n_layers=2, seq_len=16
)
BATCH = 8


@pytest.fixture(scope="module", autouse=True)
def _model_rules():
    """The model's specs name roles: its axis rules on this file's ('d', 't') meshes."""
    with shardlib.axis_rules(tm.rules_for(("d", "t"))):
        yield


def _mesh(d: int, t: int) -> jax.sharding.Mesh:
    return jax.make_mesh((d, t), ("d", "t"))


def _key(seed: int) -> jax.Array:
    # RBG keys: their random-bits programs compile much faster on CPU than threefry's.
    return jax.random.key(seed, impl="rbg")


def _tokens(config: tm.Config, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, config.vocab, size=(BATCH, config.seq_len), dtype=np.int32)


def _place_tokens(tokens: np.ndarray) -> jax.Array:
    return jax.device_put(tokens, make_shardings(i32["B/d L"]))


_reference_value_and_grad = jax.jit(jax.value_and_grad(tm.reference_loss), static_argnums=2)
_sharded_value_and_grad = jax.jit(tm.loss_and_grad, static_argnums=0)
_sharded_loss = jax.jit(tm.loss, static_argnums=0)


@pytest.fixture(scope="module")
def gqa_case():
    """Global weights and tokens, the reference loss and gradients, and the sharded ones."""
    model = tm.init_model(GQA, _key(0))
    tokens = _tokens(GQA, 0)
    ref_loss, ref_grads = _reference_value_and_grad(model, tokens, GQA)
    with jax.set_mesh(_mesh(4, 2)):
        placed = tm.place_model(model)
        loss, grads = _sharded_value_and_grad(GQA, placed, _place_tokens(tokens))
        expected_shardings = make_shardings(tm.Model)
    return dict(
        model=model,
        tokens=tokens,
        ref_loss=ref_loss,
        ref_grads=ref_grads,
        loss=loss,
        grads=grads,
        expected_shardings=expected_shardings,
    )


def test_loss_matches_reference(gqa_case):
    loss, ref = float(gqa_case["loss"]), float(gqa_case["ref_loss"])
    # A sanity bound: near log(vocab) at initialisation, so the comparison is not vacuous.
    assert 0.5 * np.log(GQA.vocab) < ref < 2 * np.log(GQA.vocab)
    np.testing.assert_allclose(loss, ref, rtol=1e-5)


def _leaves(tree) -> list[tuple[str, jax.Array]]:
    return [(jax.tree_util.keystr(path), leaf) for path, leaf in jax.tree.leaves_with_path(tree)]


def test_every_gradient_matches_reference(gqa_case):
    got, want = _leaves(gqa_case["grads"]), _leaves(gqa_case["ref_grads"])
    assert [n for n, _ in got] == [n for n, _ in want]
    assert len(got) == 3 + 9  # embed, final_norm, unembed and the 9 stacked layer weights
    for (name, g), (_, r) in zip(got, want, strict=True):
        g, r = np.asarray(g), np.asarray(r)
        assert g.shape == r.shape, name
        scale = float(np.max(np.abs(r)))
        assert scale > 0, f"{name}: the reference gradient is all zeros"
        np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-5 * scale, err_msg=name)


def test_gradients_are_sharded_like_the_weights(gqa_case):
    grads = _leaves(gqa_case["grads"])
    expected = _leaves(gqa_case["expected_shardings"])
    for (name, g), (_, s) in zip(grads, expected, strict=True):
        assert isinstance(g.sharding, NamedSharding), name
        assert g.sharding.is_equivalent_to(s, g.ndim), f"{name}: {g.sharding.spec} vs {s.spec}"
        # Fully sharded: each device holds 1/8 of every gradient.
        assert g.addressable_shards[0].data.size * 8 == g.size, name


@pytest.mark.slow
def test_sgd_steps_reduce_the_loss():
    model = tm.init_model(GQA, _key(1))
    tokens = _tokens(GQA, 1)
    with jax.set_mesh(_mesh(4, 2)):
        placed = tm.place_model(model)
        tokens = _place_tokens(tokens)
        losses = []
        for _ in range(4):
            placed, value = tm.train_step(GQA, placed, tokens, 0.5)
            losses.append(float(value))
        final = float(_sharded_loss(GQA, tokens, placed))
        expected = make_shardings(tm.Model)
    losses.append(final)
    assert all(b < a for a, b in zip(losses, losses[1:], strict=False)), losses
    assert losses[-1] < losses[0] - 1.0, losses
    # The updated weights stay in their annotated layout.
    for (name, w), (_, s) in zip(_leaves(placed), _leaves(expected), strict=True):
        assert w.sharding.is_equivalent_to(s, w.ndim), name
    # The first step's loss is the loss of the initial weights.
    np.testing.assert_allclose(
        losses[0], float(tm.reference_loss(model, _tokens(GQA, 1), GQA)), rtol=1e-5
    )


@pytest.mark.slow
@pytest.mark.parametrize("shape", [(8, 1), (4, 2), (2, 4), (1, 8)])
def test_loss_does_not_depend_on_the_mesh(shape):
    model = tm.init_model(MHA, _key(2))
    tokens = _tokens(MHA, 2)
    ref = float(jax.jit(tm.reference_loss, static_argnums=2)(model, tokens, MHA))
    with jax.set_mesh(_mesh(*shape)):
        loss = float(_sharded_loss(MHA, _place_tokens(tokens), tm.place_model(model)))
    np.testing.assert_allclose(loss, ref, rtol=1e-5)


@pytest.mark.slow
def test_unplaced_tokens_are_accepted_under_jit():
    # Tokens made outside `jax.set_mesh` have no mesh in their type under jit; typed_shard_map
    # moves them to the annotated layout 'B/d L' (this failed in an earlier shardlib).
    model = tm.init_model(GQA, _key(0))
    tokens = jnp.asarray(_tokens(GQA, 0))  # created before the mesh is set: not placed
    with jax.set_mesh(_mesh(4, 2)):
        loss = _sharded_loss(GQA, tokens, tm.place_model(model))
    np.testing.assert_allclose(
        float(loss), float(tm.reference_loss(model, _tokens(GQA, 0), GQA)), rtol=1e-5
    )


def test_heads_that_do_not_split_over_t_are_reported():
    # GQA has 2 key/value heads: they cannot be split over t = 4.
    model = tm.init_model(GQA, _key(0))
    with jax.set_mesh(_mesh(2, 4)), pytest.raises(TypeCheckError) as info:
        _sharded_loss(GQA, _tokens(GQA, 0), model)
    msg = str(info.value)
    assert "'model'" in msg and "K/t" in msg and "t=4" in msg and "size 2" in msg, msg


# ---------------------------------------------------------------------------------------------
# What explicit_activation_checkpointing keeps for one layer.
# ---------------------------------------------------------------------------------------------

_ARG_FIELDS = ["ln1", "w_q", "w_k", "w_v", "w_o", "ln2", "w_gate", "w_up", "w_down"]
# JAX names a pytree argument's leaves ``arg + keystr(path)``. pytree_dataclass keys print as
# the bare field name (seqax's key paths), so the leaf ``w.ln1`` of argument ``w`` prints as
# ``wln1``, as it does with seqax.
_LAYER_ARGS = ["x"] + [f"w{n}" for n in _ARG_FIELDS]


def _one_layer_inputs(config: tm.Config):
    model = tm.place_model(tm.init_model(config, _key(3)))
    layer = jax.tree.map(lambda a: a[0], model.layers)
    layer = jax.device_put(layer, make_shardings(tm.Layer))
    x = jax.random.normal(_key(4), (BATCH, config.seq_len, config.d_model))
    x = jax.device_put(x, make_shardings(f32["B/d L M"]))
    return x, layer


def _residual_lines(capsys, f, *args) -> list[str]:
    capsys.readouterr()
    print_saved_residuals(f, *args)
    return [line for line in capsys.readouterr().out.splitlines() if line.strip()]


def _one_run(runs: list[list[str]]) -> list[str]:
    """The lines printed by one run of a body that ran one or more times in a trace.

    ``typed_shard_map`` may run the body's Python more than once per trace (once to check the
    partial sums, once for the program itself); every run must print the same residuals.
    """
    assert runs, "the body did not run"
    assert all(r == runs[0] for r in runs), runs
    return runs[0]


def _arguments(lines: list[str]) -> list[str]:
    return [m.group(1) for line in lines if (m := re.search(r"from the argument (\S+)", line))]


@pytest.mark.slow
def test_layer_saves_exactly_its_arguments_and_marked_values(capsys):
    """Per device (inside shard_map): the arguments and the two ``save_for_backward`` values."""
    c = GQA
    runs: list[list[str]] = []

    @typed_shard_map
    def inspect(x: f32[b"B/d L M"], w: tm.Layer) -> f32[b"B/d L M"]:
        capsys.readouterr()
        print_saved_residuals(tm.checkpointed_layer(c), x, w)
        runs.append([line for line in capsys.readouterr().out.splitlines() if line.strip()])
        return x

    with jax.set_mesh(_mesh(4, 2)):
        jax.jit(inspect).trace(*_one_layer_inputs(c))
    lines = _one_run(runs)

    assert _arguments(lines) == _LAYER_ARGS, lines
    others = [line for line in lines if "from the argument" not in line]
    assert len(others) == 2, lines
    # Marked values print as "... (save_for_backward)" (the marking call) on every jax.
    assert all(line.rstrip().endswith("(save_for_backward)") for line in others), lines
    b, t_heads = BATCH // 4, c.n_kv_heads // 2
    shapes = sorted(re.match(r"f32\[([\d,]*)\]", line).group(1) for line in others)
    # The attention output before its projection (B/d L K/t G D) and the residual (B/d L M).
    assert shapes == sorted(
        [
            f"{b},{c.seq_len},{t_heads},{c.group},{c.d_head}",
            f"{b},{c.seq_len},{c.d_model}",
        ]
    ), lines


def test_layer_residuals_seen_from_outside_shard_map(capsys):
    """Globally: the arguments, and the two marked values as outputs of the shard_map."""
    c = GQA

    @typed_shard_map
    def one_layer(x: f32[b"B/d L M"], w: tm.Layer) -> f32[b"B/d L M"]:
        return tm.checkpointed_layer(c)(x, w)

    with jax.set_mesh(_mesh(4, 2)):
        x, w = _one_layer_inputs(c)
        lines = _residual_lines(capsys, lambda x, w: jnp.sum(one_layer(x, w)), x, w)
    assert _arguments(lines) == _LAYER_ARGS, lines
    others = [line for line in lines if "from the argument" not in line]
    assert len(others) == 2 and all("output of shard_map" in line for line in others), lines


def test_without_checkpointing_the_layer_saves_more(capsys):
    """The control: the undecorated layer keeps many intermediates (so the tests above can fail)."""
    c = GQA
    runs: list[list[str]] = []

    @typed_shard_map
    def inspect(x: f32[b"B/d L M"], w: tm.Layer) -> f32[b"B/d L M"]:
        capsys.readouterr()
        print_saved_residuals(lambda x, w: tm.layer_forward(c, x, w), x, w)
        runs.append([line for line in capsys.readouterr().out.splitlines() if line.strip()])
        return x

    with jax.set_mesh(_mesh(4, 2)):
        jax.jit(inspect).trace(*_one_layer_inputs(c))
    lines = _one_run(runs)
    others = [line for line in lines if "from the argument" not in line]
    assert len(others) > 10, lines
    assert any("all_gather" in line or "all-gather" in line for line in others), lines
