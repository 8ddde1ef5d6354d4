"""shardlib.explain: the communication / memory report agrees with the compiled program."""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import shardlib
from examples import fsdp_mlp
from examples import transformer_model as tm
from jax_extra import explicit_activation_checkpointing, save_for_backward
from shardlib import shardops
from shardlib.shardtypes import Array, f32, make_shardings, pytree_dataclass, typed_shard_map

CFG = tm.Config(
    vocab=64, d_model=32, n_heads=4, n_kv_heads=2, d_head=8, d_ff=64, n_layers=3, seq_len=16
)


def _model_and_tokens(mesh):
    with jax.set_mesh(mesh):
        model = tm.place_model(tm.init_model(CFG, jax.random.key(0, impl="rbg")))
    tokens = np.random.default_rng(0).integers(0, CFG.vocab, (8, CFG.seq_len), np.int32)
    return model, tokens


def _compiled_text(f, *args):
    return jax.jit(f).lower(*args).compile().as_text()


@pytest.mark.slow
@pytest.mark.parametrize("shape", [(4, 2), (2, 2), (8, 1)])
def test_transformer_step_report_matches_hlo(shape):
    mesh = jax.make_mesh(shape, ("d", "t"), devices=jax.devices()[: shape[0] * shape[1]])
    model, tokens = _model_and_tokens(mesh)

    def step(m, t):
        return tm.train_step(CFG, m, t, 0.1)

    with jax.set_mesh(mesh):
        report = shardlib.explain(step, model, tokens)
        cmp = report.compare_hlo(_compiled_text(step, model, tokens))
    assert cmp.identical, str(cmp)
    # Everything in the layer scan runs once per layer; everything else once.
    in_scan = [c for c in report.collectives if c.in_loop]
    assert in_scan and all(c.calls == CFG.n_layers for c in in_scan)
    assert all(c.calls == 1 for c in report.collectives if not c.in_loop)
    # The forward gathers of the weights come back as reduce-scatters in the gradient.
    fwd = [c for c in report.collectives if c.op == "all_gather" and not c.backward]
    grad_rs = [c for c in report.collectives if c.kind == "reduce-scatter" and c.backward]
    assert {c.spec for c in grad_rs} <= {c.spec for c in fwd}
    assert all(c.location.startswith("transformer_model.py:") for c in report.collectives)


def test_report_names_ops_specs_and_bytes():
    mesh = jax.make_mesh((4, 2), ("d", "t"))

    @typed_shard_map
    def f(x: f32[b"B/d M/t"], w: f32[b"M/t F/d"]) -> f32[b"B/d F"]:
        w_full = shardops.all_gather("M/t F/d -> M/t F", w)  # group 4, block 8x2 floats
        y = shardops.einsum_unreduced("B/d M/t, M/t F -> B/d F", x, w_full)
        return shardops.psum("B/d F", y, axes="t")  # group 2, 2x8 floats

    x, w = jnp.ones((8, 16)), jnp.ones((16, 8))
    with jax.set_mesh(mesh):
        report = shardlib.explain(f, x, w, hardware=shardlib.Hardware("toy", 1e3, 1e6))
        cmp = report.compare_hlo(_compiled_text(f, x, w))
    assert cmp.identical, str(cmp)
    ag, ar = report.collectives
    assert (ag.op, ag.spec, ag.kind, ag.axes, ag.group) == (
        "all_gather",
        "M/t F/d -> M/t F",
        "all-gather",
        ("d",),
        4,
    )
    assert ag.operand_shape == (8, 2) and ag.operand_bytes == 64
    assert ag.sent_bytes == ag.received_bytes == 3 * 64  # ring: (n - 1) blocks
    assert (ar.op, ar.spec, ar.kind, ar.axes, ar.group) == (
        "psum",
        "B/d F",
        "all-reduce",
        ("t",),
        2,
    )
    assert ar.operand_bytes == 2 * 8 * 4
    assert ar.sent_bytes == 2 * 64 * (2 - 1) // 2  # ring: 2 (n - 1) / n of the buffer
    assert report.totals_by_axes() == {("d",): (1, 192, 192), ("t",): (1, 64, 64)}
    # Roofline: per-device matmul FLOPs and the time model are plain arithmetic.
    assert report.flops == 2 * (2 * 8) * 8
    assert report.comm_seconds() == pytest.approx((192 + 64) / 1e3)
    assert report.compute_seconds() == pytest.approx(report.flops / 1e6)
    overlap, serial = report.mfu_ceiling()
    comp, comm = report.compute_seconds(), report.comm_seconds()
    assert overlap == pytest.approx(comp / max(comp, comm))
    assert serial == pytest.approx(comp / (comp + comm))
    text = str(report)
    for piece in ("all_gather", "M/t F/d -> M/t F", "psum", "test_explain.py:", "Roofline"):
        assert piece in text
    assert "2 collective calls per call (2 in the program" in report.short()


def test_fsdp_mlp_report_matches_hlo():
    mesh = fsdp_mlp.MESH

    def loss(x, w):
        return jnp.sum(fsdp_mlp.forward_pass(x, w) ** 2)

    with jax.set_mesh(mesh):
        w = jax.device_put(
            fsdp_mlp.Weights(jnp.ones((16, 32)), jnp.ones((32, 16)), jnp.ones((16,))),
            shardlib.shardtypes.make_shardings(fsdp_mlp.Weights),
        )
        x = jnp.ones((32, 16))
        grad = jax.grad(loss, argnums=1)
        report = shardlib.explain(grad, x, w)
        cmp = report.compare_hlo(_compiled_text(grad, x, w))
    assert cmp.identical, str(cmp)
    kinds = report.census()
    assert kinds["all-gather"] >= 3 and kinds["reduce-scatter"] == 3


@pytest.mark.parametrize("shape", [(8,), (4,)])
def test_data_parallel_step_report_matches_hlo(shape):
    mesh = jax.make_mesh(shape, ("d",), devices=jax.devices()[: shape[0]])

    @typed_shard_map
    def grads(x: f32[b"B/d M"], y: f32[b"B/d"], w: f32[b"M"]) -> f32[b"M"]:
        # pcast: each device's own gradient (JAX would otherwise already sum it over 'd').
        w = jax.lax.pcast(w, "d", to="varying")
        g = jax.grad(lambda w: jnp.mean((x @ w - y) ** 2))(w)
        return shardops.pmean("M", g, axes="d")

    x, y, w = jnp.ones((16, 4)), jnp.ones((16,)), jnp.ones((4,))
    with jax.set_mesh(mesh):
        report = shardlib.explain(grads, x, y, w)
        cmp = report.compare_hlo(_compiled_text(grads, x, y, w))
    assert cmp.identical, str(cmp)
    (c,) = [c for c in report.collectives if c.op == "pmean"]
    assert c.kind == "all-reduce" and c.operand_bytes == 16
    assert c.sent_bytes == int(2 * 16 * (shape[0] - 1) / shape[0])


@pytest.mark.slow
def test_memory_report_lists_arguments_and_marked_values():
    mesh = jax.make_mesh((4, 2), ("d", "t"))
    model, tokens = _model_and_tokens(mesh)

    def loss(m, t):
        return tm.loss(CFG, t, m)

    with jax.set_mesh(mesh):
        report = shardlib.explain(loss, model, tokens)
        compiled = jax.jit(jax.grad(loss)).lower(model, tokens).compile()
    marked = [s for s in report.saved if s.what == "marked"]
    args = [s for s in report.saved if s.what == "argument"]
    # The layer names no value with checkpoint_name besides its save_for_backward marks.
    assert {s.what for s in report.saved} == {"marked", "argument"}
    assert report.checkpoint_calls == CFG.n_layers
    # Two marked activations per layer: the attention output and the residual stream.
    b, n = 8 // 4, CFG.seq_len
    assert sorted(s.shape for s in marked) == sorted(
        [(b, n, CFG.n_kv_heads // 2, CFG.group, CFG.d_head), (b, n, CFG.d_model)]
    )
    assert all(
        s.calls == CFG.n_layers and s.location.startswith("transformer_model.py:") for s in marked
    )
    # The arguments of the checkpointed layer: the residual stream and one layer's weights,
    # all per device.
    per_layer_weights = sum(
        math.prod(leaf.addressable_shards[0].data.shape[1:]) * 4
        for leaf in jax.tree.leaves(model.layers)
    )
    act = b * n * CFG.d_model * 4
    assert sum(s.bytes for s in args) == act + per_layer_weights
    assert report.saved_bytes == CFG.n_layers * sum(s.bytes for s in report.saved)
    # Against XLA: the saved residuals live in the compiled step's temporary buffers.
    temp = compiled.memory_analysis().temp_size_in_bytes
    ratio = report.saved_bytes / temp
    print(f"saved residuals {report.saved_bytes} B vs compiled temp {temp} B: ratio {ratio:.3f}")
    assert 0 < ratio < 1


def _checkpointed_block(only_save_for_backward: bool):
    @explicit_activation_checkpointing(only_save_for_backward=only_save_for_backward)
    def block(x, w):
        h = save_for_backward(jnp.sin(x @ w))  # saved under either policy
        g = jax.ad_checkpoint.checkpoint_name(jnp.cos(h @ w), "attn")  # default policy only
        return jnp.tanh(g @ w)

    return block


def _jax_saved_names(capsys, f, *args) -> list[str]:
    """The names of the values JAX itself saves (print_saved_residuals), arguments left out.

    JAX before 0.10 prints a named value as ``output of reduce_precision`` without its name:
    such a line stands as ``?``."""
    capsys.readouterr()
    jax.ad_checkpoint.print_saved_residuals(f, *args)
    lines = [ln for ln in capsys.readouterr().out.splitlines() if "from the argument" not in ln]
    return sorted(
        (m.group(1) if (m := re.search(r"named '([^']+)'", ln)) else "?") for ln in lines if ln
    )


@pytest.mark.parametrize("only_save_for_backward", [False, True])
def test_memory_report_lists_the_named_values_the_policy_saves(capsys, only_save_for_backward):
    """The default policy saves every checkpoint_name value (seqax's); the option, the marks."""
    block = _checkpointed_block(only_save_for_backward)
    x, w = jnp.ones((4, 8)), jnp.ones((8, 8))
    expected = sorted(
        ["jax_extra.save_for_backward"] + ([] if only_save_for_backward else ["attn"])
    )
    jax_saved = _jax_saved_names(capsys, block, x, w)  # what JAX keeps
    if "?" in jax_saved:  # an older JAX that does not print names: compare the count
        assert len(jax_saved) == len(expected), jax_saved
    else:
        assert jax_saved == expected

    def named(report):
        return sorted(s.name for s in report.saved if s.what != "argument")

    forward = shardlib.explain(block, x, w)
    assert named(forward) == expected
    assert [s.what for s in forward.saved if s.name == "attn"] == (
        [] if only_save_for_backward else ["named"]
    )
    assert [s.shape for s in forward.saved if s.what == "argument"] == [(4, 8), (8, 8)]
    assert forward.checkpoint_calls == 1
    text = str(forward)
    assert ("named 'attn'" in text) is not only_save_for_backward
    assert "marked" in text

    # Differentiated (in a scan over 3 layers): the checkpoint call is gone from the forward
    # pass, and the named values it kept are read from its policy.
    def loss(x, ws):
        return jnp.sum(jax.lax.scan(lambda c, w: (block(c, w), None), x, ws)[0] ** 2)

    ws = jnp.ones((3, 8, 8)) / 8
    grad = shardlib.explain(jax.grad(loss, argnums=1), x, ws)
    assert named(grad) == expected
    assert all(s.calls == 3 for s in grad.saved)
    assert grad.checkpoint_calls == 3
    assert any("only the named values" in n for n in grad.notes)


def test_memory_report_without_checkpointing_lists_nothing():
    def loss(x, w):
        g = jax.ad_checkpoint.checkpoint_name(jnp.cos(x @ w), "attn")  # no checkpoint: no policy
        return jnp.sum(save_for_backward(g) @ w)

    x, w = jnp.ones((4, 8)), jnp.ones((8, 8))
    for f in (loss, jax.grad(loss, argnums=1)):
        report = shardlib.explain(f, x, w)
        assert report.saved == [] and report.checkpoint_calls == 0


@pytree_dataclass
class _Layer:
    w: f32[b"M/d F"]


@pytree_dataclass
class _Model:
    emb: f32[b"V M/d"]
    layers: Array[b"layers", _Layer]


@pytree_dataclass(keys="attr")
class _AttrLayer:
    w: f32[b"M/d F"]


@pytree_dataclass(keys="attr")
class _AttrModel:
    emb: f32[b"V M/d"]
    layers: Array[b"layers", _AttrLayer]


@pytest.mark.parametrize(
    "model_type, layer_type", [(_Model, _Layer), (_AttrModel, _AttrLayer)], ids=["name", "attr"]
)
def test_argument_paths_are_dotted_whatever_the_key_style(model_type, layer_type):
    mesh = jax.make_mesh((8,), ("d",))
    with jax.set_mesh(mesh):
        m = model_type(jnp.zeros((4, 16)), layer_type(jnp.zeros((2, 16, 4))))
        m = jax.device_put(m, make_shardings(model_type))
        report = shardlib.explain(lambda m, k: jnp.sum(m.layers.w) * k, m, jnp.ones(3))
    assert report.argument_bytes == [
        ("[0].emb", 4 * 2 * 4),
        ("[0].layers.w", 2 * 2 * 4 * 4),
        ("[1]", 3 * 4),
    ]
    assert "  [0].layers.w: 64 B" in str(report)


def test_collectives_carry_their_spec_into_hlo_metadata():
    mesh = jax.make_mesh((8,), ("d",))

    # check_vma=False: JAX types an all_gather result as still varying over 'd'.
    @typed_shard_map(check_vma=False)
    def f(x: f32[b"B/d"]) -> f32[b"B"]:
        return shardops.all_gather("B/d -> B", x)

    with jax.set_mesh(mesh):
        text = jax.jit(f).lower(jnp.ones(16)).as_text(debug_info=True)
    assert "shardops.all_gather[B/d -> B]" in text


def test_unknown_hardware_is_an_error():
    with pytest.raises(ValueError, match="unknown hardware 'tpu-v9'"):
        shardlib.explain(lambda x: x, jnp.ones(2), hardware="tpu-v9")
