"""The headline transformer with context parallelism (``--mesh DxCxT``) against the run without.

On a ``('d', 'c', 't')`` mesh the model splits the sequence over ``c`` (balanced layout, ring
attention, RoPE by original positions); its loss and every gradient must equal those of the
same weights and tokens on a ``('d', 't')`` mesh, which tests/test_transformer.py checks against
a plain jax.numpy reference.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np
import pytest

import shardlib
from examples import transformer_model as tm
from shardlib import attention
from shardlib.shardtypes import make_shardings

GQA = tm.Config(
    vocab=64, d_model=32, n_heads=4, n_kv_heads=2, d_head=8, d_ff=64, n_layers=2, seq_len=16
)

try:
    from examples import transformer as T
except ImportError:  # the `examples` extra (optax) is not installed
    T = None  # type: ignore[assignment]


def test_context_inputs_keep_each_next_token():
    tokens = np.arange(2 * 16, dtype=np.int32).reshape(2, 16)
    x, targets, pos = (np.asarray(a) for a in tm.context_inputs(tokens, 2))
    order = attention.positions(16, 2)
    np.testing.assert_array_equal(pos, order)
    np.testing.assert_array_equal(x, tokens[:, order])
    np.testing.assert_array_equal(targets, np.roll(tokens, -1, axis=1)[:, order])


def _value_and_grad(mesh_shape, names, model, tokens, config=GQA):
    with jax.set_mesh(jax.make_mesh(mesh_shape, names)):
        loss, grads = jax.jit(tm.loss_and_grad, static_argnums=0)(
            config, tm.place_model(model), tokens
        )
    return float(loss), [(jax.tree_util.keystr(p), np.asarray(g)) for p, g in
                         jax.tree.leaves_with_path(grads)]  # fmt: skip


# Ulysses splits the key/value heads over t and c: 4 of them on 1x4x2 would not divide.
CONTEXT_GRID = [
    ((2, 2, 2), "ring"),
    ((1, 4, 2), "ring"),
    ((2, 2, 2), "gathered"),
    ((2, 2, 2), "ulysses"),
    ((2, 4, 1), "ulysses"),
    ((1, 2, 2, 2), "ring_ulysses"),  # ('d', 'c', 'u', 't'): the ring over c, Ulysses over u
    ((2, 2, 2, 1), "ring_ulysses"),
]


@pytest.mark.slow
@pytest.mark.parametrize(
    "mesh, context", CONTEXT_GRID, ids=[f"{'x'.join(map(str, m))}-{c}" for m, c in CONTEXT_GRID]
)
def test_context_parallel_equals_the_run_without(mesh, context):
    """Loss and every gradient of the d x c x t run (attention by ``context``) equal the
    d x t run's (f32)."""
    config = dataclasses.replace(GQA, n_heads=8, n_kv_heads=4, d_head=4, context=context)
    model = tm.init_model(config, jax.random.key(0, impl="rbg"))
    tokens = np.random.default_rng(0).integers(0, GQA.vocab, size=(8, 16), dtype=np.int32)
    want_loss, want = _value_and_grad((2, 2), ("d", "t"), model, tokens, config)
    names = ("d", "c", "t") if len(mesh) == 3 else ("d", "c", "u", "t")
    got_loss, got = _value_and_grad(mesh, names, model, tokens, config)
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5)
    assert [n for n, _ in got] == [n for n, _ in want] and len(got) == 12
    for (name, g), (_, w) in zip(got, want, strict=True):
        scale = float(np.max(np.abs(w)))
        assert scale > 0, name
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5 * scale, err_msg=name)


def _weight_bytes(rules: dict) -> tuple[int, list[tuple[str, int, int]]]:
    """On a 2x2x2 ('d', 'c', 't') mesh under ``rules``: the compiled train step's argument
    bytes per device, and per weight (name, elements on device 0, elements in all)."""
    mesh = jax.make_mesh((2, 2, 2), ("d", "c", "t"))
    model = jax.eval_shape(lambda key: tm.init_model(GQA, key), jax.random.key(0))
    tokens = jax.ShapeDtypeStruct((8, 16), np.int32)
    with jax.set_mesh(mesh), shardlib.axis_rules(rules):
        shardings = make_shardings(tm.Model)
        model = jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), model, shardings
        )
        compiled = jax.jit(tm.loss_and_grad, static_argnums=0).lower(GQA, model, tokens).compile()
        per_weight = [
            (jax.tree_util.keystr(p), math.prod(s.shard_shape(a.shape)), math.prod(a.shape))
            for (p, a), s in zip(
                jax.tree.leaves_with_path(model), jax.tree.leaves(shardings), strict=True
            )
        ]
    return compiled.memory_analysis().argument_size_in_bytes, per_weight


@pytest.mark.slow
def test_the_weights_are_split_over_the_context_axis_too():
    """FSDP over d x c: every weight is split over d, c and t (8 ways), and the compiled step's
    weight arguments take 1/c of the bytes they take with the weights replicated over c."""
    mesh = ("d", "c", "t")
    rules = tm.rules_for(mesh)
    assert rules["fsdp"] == ("d", "c")
    split_bytes, per_weight = _weight_bytes(rules)
    for name, local, total in per_weight:
        assert local * 8 == total, name
    replicated_bytes, _ = _weight_bytes({**rules, "fsdp": ("d",)})
    token_bytes = 8 * 16 * 4  # given without a sharding: whole on every device
    assert (replicated_bytes - token_bytes) == 2 * (split_bytes - token_bytes)


TINY = [
    "--d-model", "32", "--layers", "2", "--heads", "16", "--kv-heads", "8", "--d-head", "4",
    "--d-ff", "64", "--vocab", "64", "--seq-len", "16", "--batch", "8",
    "--steps", "16", "--warmup", "2", "--lr", "1e-2", "--log-every", "1", "--seed", "3",
]  # fmt: skip


@pytest.mark.slow
@pytest.mark.skipif(T is None, reason="needs the examples extra (optax)")
def test_example_trains_with_the_sequence_split():
    """``examples/transformer.py --mesh 2x2x2`` trains the same as ``--mesh 2x2``."""
    assert T is not None
    split = T.main([*TINY, "--mesh", "2x2x2", "--stop-after", "3"])
    plain = T.main([*TINY, "--mesh", "2x2", "--stop-after", "3"])
    assert split["mesh"] == (2, 2, 2)
    np.testing.assert_allclose(split["losses"], plain["losses"], rtol=2e-5)
    np.testing.assert_allclose(split["grad_norms"], plain["grad_norms"], rtol=2e-5)


def test_example_refuses_a_sequence_the_layout_cannot_split():
    if T is None:
        pytest.skip("needs the examples extra (optax)")
    args = [a if a != "16" or i != TINY.index("--seq-len") + 1 else "12" for i, a in
            enumerate(TINY)]  # fmt: skip
    with pytest.raises(SystemExit, match=r"--seq-len 12 is not a multiple of 8"):
        T.main([*args, "--mesh", "1x4x2"])


def test_example_checks_the_heads_ulysses_splits():
    if T is None:
        pytest.skip("needs the examples extra (optax)")
    args = T.parse_args([*TINY, "--kv-heads", "2", "--heads", "4", "--context", "ulysses"])
    want = r"--kv-heads 2 is not a multiple of 8 \(--context ulysses splits the key/value heads"
    with pytest.raises(SystemExit, match=want):
        T._check_divisibility(args, *T.parse_mesh("1x4x2"))
    config, _, meta = T._settings(args)
    assert config.context == "ulysses" and "context" not in meta["model"]


def test_an_unknown_context_strategy_is_refused():
    with pytest.raises(ValueError, match=r"context='rings' is not one of \('ring', "):
        dataclasses.replace(GQA, context="rings")


def test_ring_ulysses_needs_two_context_axes():
    config = dataclasses.replace(GQA, context="ring_ulysses")
    mesh = jax.make_mesh((2, 2, 2), ("d", "c", "t"))
    refused = pytest.raises(
        ValueError, match=r"context='ring_ulysses'\) needs the role seq over two"
    )
    with jax.set_mesh(mesh), shardlib.axis_rules(tm.rules_for(mesh)), refused:
        model = jax.eval_shape(lambda key: tm.init_model(GQA, key), jax.random.key(0))
        tm.loss_and_grad(config, model, np.zeros((8, 16), np.int32))
