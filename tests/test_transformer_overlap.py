"""The headline transformer with ``Config.overlap``: sequence parallelism with collective matmuls.

With ``overlap='ring'`` or ``'bidirectional'`` the residual stream between the blocks is split
over the sequence on ``tensor``; each block's first matmuls all-gather it and its output
projections reduce-scatter into it, each as a ring of collective-permutes beside block matmuls
(``shardops.einsum(..., overlap=)``). Against the plain run (``overlap=None``) on meshes with
tensor > 1: the loss and every gradient; in the compiled train step, the ring's
collective-permutes and no all-gather or reduce-scatter over the tensor axis alone (the
activations'), while the weights' FSDP all-gathers stay. The fast part runs one mesh and one
direction; the grid (2-D meshes both ways round, a 3-D data x FSDP x tensor mesh, both
directions) and the example's ``--overlap`` flag run with ``--runslow``.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections import Counter

import jax
import numpy as np
import pytest
from jax.ad_checkpoint import print_saved_residuals

import shardlib
from examples import transformer_model as tm
from shardlib._explain.hlo import collectives
from shardlib.shardtypes import f32, i32, make_shardings, typed_shard_map

try:
    from examples import transformer as T
except ImportError:  # the `examples` extra (optax) is not installed
    T = None  # type: ignore[assignment]

needs_optax = pytest.mark.skipif(T is None, reason="optax missing: pip install -e '.[examples]'")

GQA = tm.Config(
    vocab=64, d_model=32, n_heads=4, n_kv_heads=2, d_head=8, d_ff=64, n_layers=2, seq_len=16
)
# Key/value heads that split over t = 4.
MHA = tm.Config(
    vocab=64, d_model=32, n_heads=8, n_kv_heads=8, d_head=4, d_ff=64, n_layers=2, seq_len=16
)
BATCH = 8
MESHES = {  # name -> (shape, axis names, config); one layer keeps the fast test's compile short
    "4x2": ((4, 2), ("d", "t"), dataclasses.replace(GQA, n_layers=1)),
    "2x4": ((2, 4), ("d", "t"), MHA),
    "2x2x2": ((2, 2, 2), ("data", "fsdp", "tensor"), GQA),
}


def _mesh(name: str) -> jax.sharding.Mesh:
    shape, axes, _ = MESHES[name]
    return jax.make_mesh(shape, axes)


def _axis_groups(mesh: jax.sharding.Mesh, role: str) -> set[tuple[int, ...]]:
    """The device groups (positions in the mesh, as HLO replica groups name them) of the
    mesh axes that carry ``role``."""
    axes = tm.rules_for(mesh)[role] or ()
    ids = np.arange(mesh.size).reshape(mesh.devices.shape)
    where = [mesh.axis_names.index(a) for a in axes]
    rest = [i for i in range(ids.ndim) if i not in where]
    size = int(np.prod([ids.shape[i] for i in where]))
    return {tuple(sorted(g)) for g in np.transpose(ids, rest + where).reshape(-1, size).tolist()}


def census(text: str, mesh: jax.sharding.Mesh) -> Counter[tuple[str, str]]:
    """Executions per step of each collective kind, by the devices it runs over: ``'tensor'``
    or ``'fsdp'`` (the groups of that role's axes), ``'other'``, ``'pairs'`` (permutes)."""
    roles = {role: _axis_groups(mesh, role) for role in ("tensor", "fsdp")}
    found, unknown = collectives(text)
    assert unknown == 0
    counts: Counter[tuple[str, str]] = Counter()
    for c in found:
        groups = {tuple(sorted(g)) for g in c.groups}
        over = next((r for r, g in roles.items() if groups == g), "other")
        counts[c.kind, "pairs" if c.kind == "collective-permute" else over] += c.runs
    return counts


def _tokens(config: tm.Config) -> np.ndarray:
    rng = np.random.default_rng(0)
    return rng.integers(0, config.vocab, size=(BATCH, config.seq_len), dtype=np.int32)


@functools.cache
def _model(config: tm.Config) -> tm.Model:
    return jax.jit(tm.init_model, static_argnums=0)(config, jax.random.key(0, impl="rbg"))


@functools.cache
def run(mesh_name: str, overlap: str | None):
    """``(loss, grads, compiled HLO text)`` of ``loss_and_grad`` on the mesh, compiled once."""
    config = dataclasses.replace(MESHES[mesh_name][2], overlap=overlap)
    mesh = _mesh(mesh_name)
    with jax.set_mesh(mesh), shardlib.axis_rules(tm.rules_for(mesh)):
        model = tm.place_model(_model(MESHES[mesh_name][2]))
        tokens = jax.device_put(_tokens(config), make_shardings(i32["B/batch L"]))
        compiled = (
            jax.jit(tm.loss_and_grad, static_argnums=0).lower(config, model, tokens).compile()
        )
        loss, grads = compiled(model, tokens)
    return float(loss), jax.device_get(grads), compiled.as_text() or ""


def check_against_plain(mesh_name: str, overlap: str) -> None:
    """The loss and gradients equal the plain run's; the HLO has the rings and no all-gather or
    reduce-scatter over tensor."""
    shape, axes, config = MESHES[mesh_name]
    plain_loss, plain_grads, plain_text = run(mesh_name, None)
    loss, grads, text = run(mesh_name, overlap)
    np.testing.assert_allclose(loss, plain_loss, rtol=1e-5)
    for (path, g), want in zip(
        jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(plain_grads), strict=True
    ):
        np.testing.assert_allclose(g, want, rtol=1e-5, atol=1e-6, err_msg=str(path))

    mesh = _mesh(mesh_name)
    got, plain = census(text, mesh), census(plain_text, mesh)
    t = dict(zip(axes, shape, strict=True))[tm.rules_for(mesh)["tensor"][0]]
    ways = 2 if overlap == "bidirectional" else 1
    # Per layer 4 rings forward (q/k/v, w_o, gate/up, w_down), 2 recomputed in the backward
    # pass (the inputs of attention and of the MLP; the marked values are saved), 4 transposed;
    # the unembedding's ring forward and transposed. Each ring: t - 1 sends per direction.
    assert got["collective-permute", "pairs"] == ways * (t - 1) * (10 * config.n_layers + 2)
    assert plain["collective-permute", "pairs"] == 0
    for kind in ("all-gather", "reduce-scatter"):
        assert got[kind, "tensor"] == 0 == plain[kind, "tensor"], (kind, got)
        assert got[kind, "fsdp"] > 0, (kind, got)  # the weights' FSDP gathers stay
    # The layers' psums over tensor are gone; the embedding's and the loss's stay.
    assert got["all-reduce", "tensor"] < plain["all-reduce", "tensor"], (got, plain)


@pytest.mark.slow
def test_ring_on_4x2_equals_the_plain_run_with_rings_in_the_hlo():
    check_against_plain("4x2", "ring")


GRID = [(m, o) for m in MESHES for o in ("ring", "bidirectional") if (m, o) != ("4x2", "ring")]


@pytest.mark.slow
@pytest.mark.parametrize("mesh_name, overlap", GRID)
def test_every_mesh_and_direction_equals_the_plain_run(mesh_name, overlap):
    check_against_plain(mesh_name, overlap)


def test_an_unknown_overlap_is_refused():
    with pytest.raises(ValueError, match=r"overlap='rings' is not one of \(None, 'ring'"):
        dataclasses.replace(GQA, overlap="rings")


def test_overlap_with_context_parallelism_is_refused():
    config = dataclasses.replace(GQA, overlap="ring")
    mesh = jax.make_mesh((2, 2, 2), ("d", "c", "t"))
    refused = pytest.raises(ValueError, match=r"context parallelism.*not supported")
    with jax.set_mesh(mesh), shardlib.axis_rules(tm.rules_for(mesh)), refused:
        model = jax.eval_shape(lambda key: tm.init_model(GQA, key), jax.random.key(0))
        tm.loss_and_grad(config, model, _tokens(GQA))


def test_the_overlap_layer_saves_its_arguments_and_the_marked_values(capsys):
    """Per device: the arguments and the two ``save_for_backward`` values, the attention output
    over the whole sequence and the residual stream over this device's positions."""
    c = dataclasses.replace(GQA, overlap="bidirectional")
    runs: list[list[str]] = []

    @typed_shard_map
    def inspect(x: f32[b"B/batch L/tensor M"], w: tm.Layer) -> f32[b"B/batch L/tensor M"]:
        capsys.readouterr()
        print_saved_residuals(tm.checkpointed_overlap_layer(c), x, w)
        runs.append([line for line in capsys.readouterr().out.splitlines() if line.strip()])
        return x

    mesh = _mesh("4x2")
    with jax.set_mesh(mesh), shardlib.axis_rules(tm.rules_for(mesh)):
        model = jax.eval_shape(lambda key: tm.init_model(GQA, key), jax.random.key(0))
        w = jax.tree.map(  # one layer's weights, abstract: the trace needs shapes and layouts
            lambda a, s: jax.ShapeDtypeStruct(a.shape[1:], a.dtype, sharding=s),
            model.layers,
            make_shardings(tm.Layer),
        )
        x = jax.ShapeDtypeStruct(
            (BATCH, c.seq_len, c.d_model),
            np.float32,
            sharding=make_shardings(f32["B/batch L/tensor M"]),
        )
        jax.jit(inspect).trace(x, w)
    assert runs and all(r == runs[0] for r in runs), runs
    lines = runs[0]
    args = [m.group(1) for line in lines if (m := re.search(r"from the argument (\S+)", line))]
    assert args[0] == "x" and len(args) == 1 + len(dataclasses.fields(tm.Layer)), lines
    others = [line for line in lines if "from the argument" not in line]
    assert all(line.rstrip().endswith("(save_for_backward)") for line in others), lines
    shapes = sorted(re.match(r"f32\[([\d,]*)\]", line).group(1) for line in others)
    b, t = BATCH // 4, 2
    assert shapes == sorted(
        [f"{b},{c.seq_len},{c.n_kv_heads // t},{c.group},{c.d_head}", f"{b},{c.seq_len // t},32"]
    ), lines


@needs_optax
def test_the_flag_is_refused_with_context_parallelism_and_checked_for_sizes(capsys):
    with pytest.raises(SystemExit):
        T.parse_args(["--mesh", "2x2x2", "--overlap", "ring"])
    assert "--overlap ring needs a mesh without context parallelism" in capsys.readouterr().err
    args = T.parse_args(["--mesh", "2x4", "--overlap", "bidirectional", "--seq-len", "12"])
    with pytest.raises(SystemExit, match=r"--seq-len 12 is not a multiple of 8 \(--overlap"):
        T._check_divisibility(args, *T.parse_mesh("2x4"))
    config, _, meta = T._settings(args)
    assert config.overlap == "bidirectional" and "overlap" not in meta["model"]


@pytest.mark.slow  # runs the example twice (T.main)
@needs_optax
def test_the_example_with_overlap_gives_the_same_losses():
    tiny = [
        "--d-model", "32", "--layers", "2", "--heads", "16", "--kv-heads", "8", "--d-head", "4",
        "--d-ff", "64", "--vocab", "64", "--seq-len", "16", "--batch", "8", "--steps", "16",
        "--warmup", "2", "--lr", "1e-2", "--seed", "3", "--mesh", "2x4", "--stop-after", "3",
    ]  # fmt: skip
    plain = T.main(tiny)
    ring = T.main([*tiny, "--overlap", "bidirectional"])
    np.testing.assert_allclose(ring["losses"], plain["losses"], rtol=2e-5)
    np.testing.assert_allclose(ring["grad_norms"], plain["grad_norms"], rtol=2e-5)
