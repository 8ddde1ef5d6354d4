"""The headline transformer with context parallelism (``--mesh DxCxT``) against the run without.

On a ``('d', 'c', 't')`` mesh the model splits the sequence over ``c`` (balanced layout, ring
attention, RoPE by original positions); its loss and every gradient must equal those of the
same weights and tokens on a ``('d', 't')`` mesh, which tests/test_transformer.py checks against
a plain jax.numpy reference.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from examples import transformer_model as tm
from shardlib import attention

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


def _value_and_grad(mesh_shape, names, model, tokens):
    with jax.set_mesh(jax.make_mesh(mesh_shape, names)):
        loss, grads = jax.jit(tm.loss_and_grad, static_argnums=0)(
            GQA, tm.place_model(model), tokens
        )
    return float(loss), [(jax.tree_util.keystr(p), np.asarray(g)) for p, g in
                         jax.tree.leaves_with_path(grads)]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("mesh", [(2, 2, 2), (1, 4, 2)], ids=["2x2x2", "1x4x2"])
def test_context_parallel_equals_the_run_without(mesh):
    """Loss and every gradient of the d x c x t run equal the d x t run's (f32)."""
    model = tm.init_model(GQA, jax.random.key(0, impl="rbg"))
    tokens = np.random.default_rng(0).integers(0, GQA.vocab, size=(8, 16), dtype=np.int32)
    want_loss, want = _value_and_grad((2, 2), ("d", "t"), model, tokens)
    got_loss, got = _value_and_grad(mesh, ("d", "c", "t"), model, tokens)
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5)
    assert [n for n, _ in got] == [n for n, _ in want] and len(got) == 12
    for (name, g), (_, w) in zip(got, want, strict=True):
        scale = float(np.max(np.abs(w)))
        assert scale > 0, name
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5 * scale, err_msg=name)


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
