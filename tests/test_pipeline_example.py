"""``examples/pipeline.py``: the headline transformer pipelined over ``p`` equals the model
unpipelined.

For every schedule (GPipe, circular, 1F1B, ZB-H1, interleaved, ZB-V) on ``(p, d, t)`` meshes
``(2, 2, 2)`` or ``(4, 2, 1)`` (``m = 2p`` and ``m = p`` microbatches), under ``jit`` with
every layer under ``explicit_activation_checkpointing``, the loss and every gradient equal (a) the plain
``jax.numpy`` model on the global arrays (``transformer_model.reference_loss``) and (b) the
headline model, not pipelined, on a ``(4, 2)`` ``('d', 't')`` mesh, for the same weights and
tokens (the tokens cut into microbatches, the weights' layer stack in model order).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
import pytest

import shardlib
from examples import pipeline as P
from examples import transformer_model as tm
from shardlib import pipeline
from shardlib.shardtypes import Array, i32, make_shardings
from tests._mesh_util import make_mesh

CONFIG = tm.Config(
    vocab=32, d_model=16, n_heads=4, n_kv_heads=2, d_head=4, d_ff=32, n_layers=8, seq_len=8
)
BATCH = 8  # global rows; microbatch i holds rows i*B .. (i+1)*B of the (BATCH, L) tokens


def _weights() -> tm.Model:
    """Random weights, norm gains away from one (so their gradients are not special)."""
    model = tm.init_model(CONFIG, jax.random.key(0))
    rng = np.random.default_rng(1)

    def gain(w: jax.Array) -> np.ndarray:
        return (1 + 0.2 * rng.standard_normal(w.shape)).astype(np.float32)

    layers = dataclasses.replace(
        model.layers, ln1=gain(model.layers.ln1), ln2=gain(model.layers.ln2)
    )
    return dataclasses.replace(model, layers=layers, final_norm=gain(model.final_norm))


def _tokens() -> np.ndarray:
    rng = np.random.default_rng(2)
    return rng.integers(0, CONFIG.vocab, (BATCH, CONFIG.seq_len)).astype(np.int32)


@functools.cache
def _reference() -> tuple[float, dict[str, np.ndarray]]:
    """(a) plain jax.numpy on the global arrays."""
    value_and_grad = jax.jit(jax.value_and_grad(tm.reference_loss), static_argnums=2)
    value, grads = value_and_grad(_weights(), _tokens(), CONFIG)
    return float(value), _flat(grads)


@functools.cache
def _headline() -> tuple[float, dict[str, np.ndarray]]:
    """(b) the headline model, not pipelined, on a (4, 2) ('d', 't') mesh."""
    mesh = make_mesh((4, 2), ("d", "t"))
    with jax.set_mesh(mesh):
        model = tm.place_model(_weights())
        tokens = jax.device_put(_tokens(), make_shardings(i32[Array, b"B/d L"]))
        value, grads = jax.jit(tm.loss_and_grad, static_argnums=0)(CONFIG, model, tokens)
    return float(value), _flat(jax.device_get(grads))


def _flat(model: tm.Model) -> dict[str, np.ndarray]:
    leaves = jax.tree_util.tree_leaves_with_path(model)
    return {jax.tree_util.keystr(k): np.asarray(v) for k, v in leaves}


def _pipelined(schedule: str, mesh_shape: tuple[int, int, int], m: int, v: int):
    mesh = make_mesh(mesh_shape, ("p", "d", "t"))
    weights = P.pipeline_model(_weights(), schedule, v, stages=mesh_shape[0])
    with jax.set_mesh(mesh), shardlib.axis_rules(tm.rules_for(mesh)):
        model = jax.device_put(weights, make_shardings(type(weights)))
        tokens = _tokens().reshape(m, BATCH // m, CONFIG.seq_len)
        tokens = jax.device_put(tokens, make_shardings(P.TOKENS))
        step = jax.jit(P.loss_and_grad, static_argnums=(0, 3))
        value, grads = step(CONFIG, model, tokens, schedule)
    assert isinstance(grads, type(weights))
    return float(value), _flat(P.headline_model(grads))


CASES = [
    ("gpipe", (2, 2, 2), 4),
    ("circular", (2, 2, 2), 4),
    ("gpipe", (4, 2, 1), 4),
    ("circular", (4, 2, 1), 4),
    ("1f1b", (2, 2, 2), 4),
    ("zb-h1", (2, 2, 2), 4),
    ("interleaved", (2, 2, 2), 4),
    ("1f1b", (4, 2, 1), 4),
    ("zb-v", (2, 2, 2), 4),
    ("zb-v", (4, 2, 1), 4),
]


@pytest.mark.slow
@pytest.mark.parametrize(("schedule", "mesh_shape", "m"), CASES)
def test_loss_and_every_gradient_match(schedule: str, mesh_shape, m: int) -> None:
    value, grads = _pipelined(schedule, mesh_shape, m, 2 if schedule in P.GROUPED else 1)
    for name, (ref_value, ref_grads) in (("reference", _reference()), ("headline", _headline())):
        np.testing.assert_allclose(value, ref_value, rtol=1e-5, err_msg=name)
        assert grads.keys() == ref_grads.keys()
        for leaf, g in grads.items():
            assert np.abs(ref_grads[leaf]).max() > 0, leaf  # the comparison means something
            np.testing.assert_allclose(
                g, ref_grads[leaf], rtol=1e-4, atol=1e-5, err_msg=f"{name}: {leaf}"
            )


@pytest.mark.slow
def test_main_trains_and_reports_the_schedule(capsys) -> None:
    out = P.main(["--steps", "3", "--d-model", "16", "--d-head", "4", "--seq-len", "8"])
    losses = out["losses"]
    assert len(losses) == 3 and np.all(np.isfinite(losses))
    assert losses[-1] < losses[1] < losses[0]
    assert out["mesh"] == (2, 2, 2) and out["schedule"] == "gpipe" and out["microbatches"] == 4
    assert out["bubble_fraction"] == pytest.approx(pipeline.gpipe_bubble_fraction(2, 4))
    (info,) = out["report"].schedules
    assert (info.schedule, info.stages, info.microbatches, info.groups) == ("gpipe", 2, 4, 1)
    printed = capsys.readouterr().out
    assert "Pipeline schedules" in printed and "shift" in printed
    assert out["timeline"] in printed and "bytes/device" in printed


@pytest.mark.slow
def test_main_with_1f1b(capsys) -> None:
    out = P.main(["--schedule", "1f1b", "--steps", "2", "--d-model", "16", "--d-head", "4",
                  "--seq-len", "8"])  # fmt: skip
    assert len(out["losses"]) == 2 and out["losses"][1] < out["losses"][0]
    assert out["bubble_fraction"] == pytest.approx(pipeline.bubble_fraction("1f1b", 2, 4))
    (info,) = out["report"].schedules
    assert (info.schedule, info.stages, info.microbatches) == ("1f1b", 2, 4)
    assert out["timeline"] in capsys.readouterr().out and "F0" in out["timeline"]


def test_bad_sizes_name_the_flag() -> None:
    with pytest.raises(SystemExit, match=r"--layers 6 is not a multiple of 4"):
        P.parse_args(["--schedule", "circular", "--layers", "6"])
    with pytest.raises(SystemExit, match=r"--microbatches 2 must be at least P=4"):
        P.parse_args(["--schedule", "circular", "--mesh", "4x2x1", "--microbatches", "2"])
    with pytest.raises(SystemExit, match=r"--groups 3: the zb-v schedule has two layer chunks"):
        P.parse_args(["--schedule", "zb-v", "--groups", "3"])
    # ZB-V runs with fewer microbatches than stages, and always with its two chunks.
    args, _ = P.parse_args(["--schedule", "zb-v", "--mesh", "4x2x1", "--microbatches", "2"])
    assert (args.groups, args.microbatches, args.layers) == (2, 2, 8)
