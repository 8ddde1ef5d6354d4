"""The runnable examples, at small sizes, checked against unsharded references.

The headline transformer example needs the ``examples`` extra (optax; orbax-checkpoint for the
checkpoint tests): without it those tests skip and the others still run.

Compiling the transformer's train step takes several seconds per mesh on CPU, so the headline
tests share one configuration (``TINY``, same ``--steps`` and ``--lr``, which are static
arguments of the jitted step) and a module-scoped straight run; ``--stop-after`` shortens runs
without changing what is compiled.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import shardlib
from examples import data_parallel, fsdp_mlp, gspmd_vs_shardlib, sharded_init
from examples import transformer_model as tm
from shardlib.shardtypes import i32, make_shardings, restore_target

try:
    import optax

    from examples import transformer as T
except ImportError:  # the `examples` extra is not installed
    optax = T = None  # type: ignore[assignment]
try:
    import orbax.checkpoint  # noqa: F401

    HAVE_ORBAX = True
except ImportError:
    HAVE_ORBAX = False

_EXTRA = "needs the examples extra: pip install -e '.[examples]'"
needs_optax = pytest.mark.skipif(T is None, reason=f"optax missing; {_EXTRA}")
needs_orbax = pytest.mark.skipif(
    T is None or not HAVE_ORBAX, reason=f"optax or orbax-checkpoint missing; {_EXTRA}"
)

# Grouped-query attention (2 query heads per key/value head) that every mesh of 8 devices can
# split: t <= 8 divides the 8 key/value heads, d_ff and vocab; d * t = 8 divides d_model.
TINY = [
    "--d-model", "32", "--layers", "2", "--heads", "16", "--kv-heads", "8", "--d-head", "4",
    "--d-ff", "64", "--vocab", "64", "--seq-len", "16", "--batch", "8",
    "--steps", "16", "--warmup", "2", "--lr", "1e-2", "--log-every", "4", "--seed", "3",
]  # fmt: skip
STEPS = 16


def _config() -> tm.Config:
    return T._settings(T.parse_args(TINY))[0]  # the model config the example itself builds


def _train_config() -> T.TrainConfig:
    args = T.parse_args(TINY)
    return T.TrainConfig(steps=args.steps, lr=args.lr, warmup=args.warmup)


@pytest.fixture(scope="module")
def straight():
    """16 steps on the 4x2 mesh, no interruption."""
    return T.main([*TINY, "--mesh", "4x2"])


# ---------------------------------------------------------------------------------------------
# The headline transformer example.
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow  # runs the example (T.main): `pytest --runslow`
@needs_optax
def test_headline_loss_falls(straight):
    losses = np.asarray(straight["losses"])
    assert straight["steps"] == list(range(1, STEPS + 1))
    assert np.all(np.isfinite(losses))
    # Starts near a uniform guess over the vocabulary and falls clearly towards the chain's
    # entropy (it cannot go below it on fresh data).
    assert abs(losses[0] - np.log(64)) < 1.0
    assert losses[-3:].mean() < losses[0] - 1.5, losses
    assert losses[-3:].mean() > straight["best_possible_loss"] - 0.05
    # The learning rate follows the schedule: 0 at step 1, peak after warmup, decayed at the end.
    lrs = straight["lrs"]
    assert lrs[0] == 0.0 and lrs[2] == pytest.approx(1e-2) and lrs[-1] < 2e-3


@pytest.mark.slow  # runs the example (T.main): `pytest --runslow`
@needs_optax
def test_state_keeps_the_weights_layout(straight):
    state = straight["state"]
    with jax.set_mesh(T.make_mesh("4x2")), shardlib.axis_rules(tm.rules_for(("d", "t"))):
        expected = jax.tree.leaves(make_shardings(tm.Model))
    mu = optax.tree_utils.tree_get(state["opt_state"], "mu")
    nu = optax.tree_utils.tree_get(state["opt_state"], "nu")
    for tree in (state["model"], mu, nu):
        leaves = jax.tree.leaves(tree)
        assert len(leaves) == len(expected)
        for a, s in zip(leaves, expected, strict=True):
            assert a.sharding.is_equivalent_to(s, a.ndim), (a.sharding, s)
    # Fully sharded: each device holds 1/8 of every weight and of each Adam moment.
    for a in jax.tree.leaves(mu):
        assert a.addressable_shards[0].data.size * 8 == a.size
    assert int(state["step"]) == STEPS


@needs_optax
@pytest.mark.slow
@pytest.mark.parametrize("mesh", ["8x1", "2x4", "1x8"])
def test_every_mesh_gives_the_same_losses(straight, mesh):
    other = T.main([*TINY, "--mesh", mesh, "--stop-after", "3"])
    assert other["mesh"] == tuple(int(n) for n in mesh.split("x"))
    np.testing.assert_allclose(other["losses"], straight["losses"][:3], rtol=2e-5)
    np.testing.assert_allclose(other["grad_norms"], straight["grad_norms"][:3], rtol=2e-5)


@functools.partial(jax.jit, static_argnums=0)
def _norms(config, model, tokens, max_norm):
    _, grads = tm.loss_and_grad(config, model, tokens)
    clip = optax.clip_by_global_norm(max_norm)
    clipped, _ = clip.update(grads, clip.init(grads))
    return optax.tree_utils.tree_norm(grads), T.grad_norm(grads), clipped


@pytest.mark.slow  # runs the example (T.main): `pytest --runslow`
@needs_optax
def test_global_grad_norm_is_the_unsharded_norm(straight):
    config, train = _config(), _train_config()
    language = T.MarkovLanguage.make(config.vocab, 3)
    tokens = language.batch(0, 8, config.seq_len, 3)
    with jax.set_mesh(T.make_mesh("4x2")):
        model = T.init_state(config, train, jax.random.key(3))["model"]
        placed_tokens = jax.device_put(tokens, make_shardings(i32[b"B/d L"]))
        host_model = jax.device_get(model)
        ref_grads = jax.grad(tm.reference_loss)(host_model, tokens, config)
        ref_norm = np.sqrt(
            sum(np.sum(np.square(np.float64(g))) for g in jax.tree.leaves(ref_grads))
        )
        max_norm = jnp.float32(ref_norm / 4)
        optax_norm, shardlib_norm, clipped = _norms(config, model, placed_tokens, max_norm)
    assert ref_norm > 0.1
    np.testing.assert_allclose(float(optax_norm), ref_norm, rtol=1e-5)
    np.testing.assert_allclose(float(shardlib_norm), ref_norm, rtol=1e-5)
    # The train step logs the same norm for step 1 (same weights, same batch).
    np.testing.assert_allclose(straight["grad_norms"][0], ref_norm, rtol=1e-5)
    # Clipping scales every block by the one global factor max_norm / norm.
    for c, g in zip(jax.tree.leaves(clipped), jax.tree.leaves(ref_grads), strict=True):
        np.testing.assert_allclose(np.asarray(c), np.asarray(g) / 4, rtol=2e-4, atol=1e-7)


@pytest.mark.slow
@needs_optax
def test_init_creates_weights_sharded_with_the_unsharded_values():
    config, train = _config(), _train_config()
    with jax.set_mesh(T.make_mesh("4x2")), shardlib.axis_rules(tm.rules_for(("d", "t"))):
        compiled = T.init_state.lower(config, train, jax.random.key(3)).compile()
        state = compiled(jax.random.key(3))
        expected = jax.tree.leaves(make_shardings(tm.Model))
    reference = jax.jit(tm.init_model, static_argnums=0)(config, jax.random.key(3))
    for a, r, s in zip(
        jax.tree.leaves(state["model"]), jax.tree.leaves(reference), expected, strict=True
    ):
        assert a.sharding.is_equivalent_to(s, a.ndim)
        np.testing.assert_allclose(np.asarray(a), np.asarray(r), rtol=1e-6, atol=0)
    # No array in the per-device program is larger than a device's block of the largest weight.
    block = max(a.addressable_shards[0].data.nbytes for a in jax.tree.leaves(state["model"]))
    full = max(a.nbytes for a in jax.tree.leaves(reference))
    assert sharded_init.largest_array_bytes(compiled.as_text()) <= block < full


@pytest.mark.slow  # runs the example (T.main): `pytest --runslow`
@needs_orbax
def test_resume_continues_the_loss_curve(straight, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    first = T.main([*TINY, "--mesh", "4x2", "--checkpoint-dir", ckpt, "--stop-after", "8"])
    np.testing.assert_allclose(first["losses"], straight["losses"][:8], rtol=1e-6)
    # Resume on another mesh: the checkpoint is read straight into the 2x4 layout.
    second = T.main([*TINY, "--mesh", "2x4", "--checkpoint-dir", ckpt, "--resume"])
    assert second["start_step"] == 8
    assert second["steps"] == list(range(9, STEPS + 1))
    np.testing.assert_allclose(second["losses"], straight["losses"][8:], rtol=1e-4)
    np.testing.assert_allclose(
        jax.device_get(second["state"]["model"].layers.w_up),
        jax.device_get(straight["state"]["model"].layers.w_up),
        rtol=1e-3,
        atol=1e-5,
    )


@pytest.mark.slow  # runs the example (T.main): `pytest --runslow`
@needs_orbax
def test_restore_reads_into_the_target_layout(tmp_path):
    config, train = _config(), _train_config()
    ckpt = str(tmp_path / "ckpt")
    T.main([*TINY, "--mesh", "4x2", "--checkpoint-dir", ckpt, "--stop-after", "1"])
    mesh = T.make_mesh("1x8")
    with jax.set_mesh(mesh), shardlib.axis_rules(tm.rules_for(mesh)):
        target = restore_target(
            jax.eval_shape(T.init_state, config, train, jax.random.key(3)), mesh
        )
        manager = T._checkpoint_manager(ckpt)
        try:
            state, meta = T.restore_checkpoint(manager, target)
        finally:
            manager.close()
    assert meta["mesh"] == "4x2" and int(state["step"]) == 1
    for a, t in zip(jax.tree.leaves(state), jax.tree.leaves(target), strict=True):
        assert a.shape == t.shape and a.dtype == t.dtype
        assert a.sharding.is_equivalent_to(t.sharding, a.ndim), (a.sharding, t.sharding)
        # Each device received only its own block.
        assert a.addressable_shards[0].data.shape == t.sharding.shard_shape(t.shape)
    assert state["model"].embed.addressable_shards[0].data.shape == (64 // 8, 32)


@pytest.mark.slow  # runs the example (T.main): `pytest --runslow`
@needs_orbax
def test_resume_refuses_other_settings(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    T.main([*TINY, "--mesh", "4x2", "--checkpoint-dir", ckpt, "--stop-after", "1"])
    changed = [*TINY[: TINY.index("--lr")], "--lr", "5e-3", *TINY[TINY.index("--lr") + 2 :]]
    with pytest.raises(SystemExit, match=r"other train settings.*'lr': 0\.01.*'lr': 0\.005"):
        T.main([*changed, "--mesh", "4x2", "--checkpoint-dir", ckpt, "--resume"])


@needs_orbax
def test_resume_without_a_checkpoint_says_so(tmp_path):
    with pytest.raises(SystemExit, match="--resume: no checkpoint in"):
        T.main([*TINY, "--checkpoint-dir", str(tmp_path / "empty"), "--resume"])


@needs_optax
def test_mesh_that_cannot_split_the_model_is_refused():
    args = [*TINY, "--mesh", "1x8"]
    args[args.index("--kv-heads") + 1] = "4"
    args[args.index("--heads") + 1] = "8"
    with pytest.raises(
        SystemExit, match=r"--mesh 1x8 \(d=1, t=8\): --kv-heads 4 is not a multiple of 8"
    ):
        T.main(args)


@needs_optax
def test_markov_language_best_loss_is_its_entropy():
    lang = T.MarkovLanguage.make(vocab=32, seed=1)
    assert np.allclose(lang.probs.sum(-1), 1.0)
    np.testing.assert_array_equal(lang.batch(5, 4, 12, 0), lang.batch(5, 4, 12, 0))
    assert not np.array_equal(lang.batch(5, 4, 12, 0), lang.batch(6, 4, 12, 0))
    tokens = np.concatenate([lang.batch(s, 256, 12, 0) for s in range(8)])
    # The chain's log-loss on its own samples (every transition must be a listed successor).
    prev, nxt = tokens[:, :-1].ravel(), tokens[:, 1:].ravel()
    hit = lang.successors[prev] == nxt[:, None]
    assert np.all(hit.sum(-1) == 1)
    nll = -np.log(np.sum(np.where(hit, lang.probs[prev], 0.0), axis=-1))
    stderr = nll.std() / np.sqrt(nll.size)
    assert abs(nll.mean() - lang.best_loss(12)) < 4 * stderr


# ---------------------------------------------------------------------------------------------
# The smaller examples.
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_fsdp_mlp_matches_reference():
    out = fsdp_mlp.main()
    assert out["output"].shape == (32,)
    np.testing.assert_allclose(out["output"], out["reference"], rtol=1e-5, atol=1e-5)
    assert np.abs(out["reference"]).max() > 0.1  # not a trivially zero output
    assert out["w1_block_shape"] == (16, 4)
    assert tuple(out["output_spec"]) == ("d",)


@pytest.mark.slow
def test_data_parallel_matches_one_device():
    out = data_parallel.main(["--steps", "12"])
    assert out["devices"] == 8 and out["replicated"]
    np.testing.assert_allclose(out["loss"], out["reference_loss"], rtol=1e-6)
    assert out["grad_err"] < 1e-6
    np.testing.assert_allclose(out["dp_losses"], out["reference_losses"], rtol=1e-5)
    assert out["dp_losses"][-1] < 0.5 * out["dp_losses"][0]
    assert out["weight_err"] < 1e-5
    # Without pcast, autodiff has already summed the gradient over the 8 devices: the pmean
    # would return it 8x too large, and shardlib refuses it at trace time.
    assert out["trap_error"] is not None
    assert "pmean('In H')" in out["trap_error"] and "same on every device" in out["trap_error"]


@pytest.mark.slow
def test_gspmd_and_shardlib_agree():
    out = gspmd_vs_shardlib.main(["--batch", "16", "--d-model", "8", "--d-ff", "32"])
    np.testing.assert_allclose(out["gspmd_loss"], out["reference_loss"], rtol=1e-5)
    np.testing.assert_allclose(out["shardlib_loss"], out["reference_loss"], rtol=1e-5)
    assert out["grad_diff"] < 1e-5 and out["reference_grad_diff"] < 1e-5
    # shardlib compiles to what its code says: an all-reduce of the per-device activation
    # block (batch 16 / d=4, width 8) over t, and all-reduces over d; nothing gathered.
    kinds = [k for k, _ in out["shardlib_collectives"]]
    assert set(kinds) == {"all-reduce"}, out["shardlib_collectives"]
    assert ("all-reduce", "f32[4,8]") in out["shardlib_collectives"]
    assert len(out["gspmd_collectives"]) >= 1
    assert tuple(out["shardlib_grad_shardings"].w_in) == (None, "t")


def test_collective_ops_counts_instructions_not_names():
    text = "\n".join(
        [
            "  %all-reduce.1 = f32[8,16]{1,0} all-reduce(%x), channel_id=1, to_apply=%add",
            "  %ag = (f32[4]{0}, f32[8]{0}) all-gather-start(%y), dimensions={0}",
            "  %ag.done = f32[8]{0} all-gather-done(%ag)",
            '  %fusion = f32[8]{0} fusion(%all-reduce.1), metadata={op_name="all-reduce("}',
            "  ROOT %rs = f32[2]{0} reduce-scatter(%z), dimensions={0}",
        ]
    )
    assert gspmd_vs_shardlib.collective_ops(text) == [
        ("all-reduce", "f32[8,16]"),
        ("all-gather", "(f32[4], f32[8])"),
        ("reduce-scatter", "f32[2]"),
    ]


@pytest.mark.slow
def test_sharded_init_never_builds_full_weights():
    out = sharded_init.main(["--vocab", "1024", "--d-model", "64", "--d-ff", "256"])
    biggest = out["largest_weight_bytes"]
    assert biggest == 1024 * 64 * 4
    methods = out["methods"]
    for r in methods.values():
        assert r["values_equal"] and r["layout_ok"]
    # Created sharded: nothing in the per-device program is bigger than one block (1/8).
    for name in ("out_sharding= per array, Explicit", "jit(out_shardings), Auto mesh"):
        assert methods[name]["largest_array"] <= biggest // 8, (name, methods[name])
    # The trap the example warns about: on an Explicit mesh, out_shardings alone still has
    # every device compute the full arrays.
    assert methods["jit(out_shardings), Explicit mesh"]["largest_array"] >= biggest


# ---------------------------------------------------------------------------------------------
# Every example's --help lists every flag with its help text and default.
# ---------------------------------------------------------------------------------------------

_CLI = {
    "data_parallel": data_parallel,
    "fsdp_mlp": fsdp_mlp,
    "gspmd_vs_shardlib": gspmd_vs_shardlib,
    "sharded_init": sharded_init,
    "transformer_model": tm,
}
if T is not None:
    _CLI["transformer"] = T


@pytest.mark.parametrize("name", sorted(_CLI))
def test_help_lists_every_flag_with_its_default(name, capsys):
    module = _CLI[name]
    parser = module.build_parser()
    with pytest.raises(SystemExit) as exit_info:
        module.main(["--help"])  # main reads the command line through build_parser()
    assert exit_info.value.code == 0
    shown = " ".join(capsys.readouterr().out.split())  # argparse wraps long lines
    assert shown.startswith("usage:"), shown
    flags = [a for a in parser._actions if a.option_strings and a.dest != "help"]
    for action in flags:
        flag = max(action.option_strings, key=len)
        assert flag in shown, f"{name} --help does not list {flag}"
        assert action.help, f"{name}: {flag} has no help text"
        help_text = " ".join(action.help.split())
        default = f"(default: {action.default})"
        assert f"{help_text} {default}" in shown, f"{name} --help: {flag} shows no {default}"
