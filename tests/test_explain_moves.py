"""shardlib.explain: layout moves outside shard_map, and gathers re-run by checkpointing.

``typed_shard_map`` moves an argument that arrives in another layout than its annotation (on
Explicit meshes). The report must list each such move (argument, from -> to, bytes), warn when
it costs every call of a step, and ``compare_hlo`` must pair XLA's collectives for it with the
move rather than blame jit's partitioner. Bytes are checked against an oracle built from JAX's
own ``devices_indices_map``; values and gradients against plain jax.numpy.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import shardlib
from examples import transformer_model as tm
from jax_extra import explicit_activation_checkpointing
from shardlib import shardops
from shardlib.shardtypes import f32, pytree_dataclass, typed_shard_map


def _oracle_received(mesh, shape, itemsize, src, dst):
    """Bytes the worst-off device receives: its new block less what its old block holds,
    from JAX's own index maps."""
    old = NamedSharding(mesh, src).devices_indices_map(shape)
    new = NamedSharding(mesh, dst).devices_indices_map(shape)
    worst = 0
    for dev, idx in new.items():
        ranges = [s.indices(n) for s, n in zip(idx, shape, strict=True)]
        have = [s.indices(n) for s, n in zip(old[dev], shape, strict=True)]
        size = math.prod(b - a for a, b, _ in ranges)
        overlap = math.prod(
            max(0, min(b1, b2) - max(a1, a2))
            for (a1, b1, _), (a2, b2, _) in zip(ranges, have, strict=True)
        )
        worst = max(worst, size - overlap)
    return worst * itemsize


def _compiled_text(f, *args):
    return jax.jit(f).lower(*args).compile().as_text()


@typed_shard_map
def _sin(x: f32[b"B/d L M"]) -> f32[b"B/d L M"]:
    return jnp.sin(x)


def test_direct_call_reports_the_move_and_compare_hlo_attributes_it():
    mesh = jax.make_mesh((8,), ("d",))
    with jax.set_mesh(mesh):
        x = jax.device_put(
            jnp.arange(16 * 8 * 4.0).reshape(16, 8, 4), NamedSharding(mesh, P(None, "d"))
        )
        np.testing.assert_allclose(_sin(x), jnp.sin(np.asarray(x)), rtol=1e-6)
        report = shardlib.explain(_sin, x)
        cmp = report.compare_hlo(_compiled_text(_sin, x))
    (m,) = report.moves
    assert (m.argument, m.into, m.input_index) == ("x", "_sin", 0)
    assert (m.src, m.dst) == ("P(None, 'd', None)", "P('d', None, None)")
    assert m.shape == (16, 8, 4) and m.dtype == "float32" and m.block_bytes == 16 * 1 * 4 * 4
    expected = _oracle_received(mesh, (16, 8, 4), 4, P(None, "d"), P("d"))
    assert m.received_bytes == expected == 16 * 4 * 4 * 7 // 8  # an all-to-all moves 7/8
    assert m.kinds == ("all-to-all",) and m.calls == 1 and not m.backward
    assert not m.in_step  # f is the typed_shard_map itself: the caller's layout to fix
    # No user line inside the call: say which call (JAX 0.9 records the caller's line instead).
    assert m.location == "call of _sin()" or m.location.startswith("test_explain_moves.py:")
    text = str(report)
    assert "Layout moves outside shard_map" in text and "x -> _sin() input 0" in text
    assert "warning:" not in text
    assert "layout moves outside shard_map: 1" in report.short()
    # XLA's all-to-all is the move, not "jit's automatic partitioning".
    assert cmp.identical, str(cmp)
    assert [label for label, _ in cmp.moves] == ["x -> _sin() input 0"]
    assert "all-to-all" in cmp.moves[0][1]
    assert "partitioning" not in str(cmp) and "layout move (x -> _sin() input 0)" in str(cmp)


@pytree_dataclass
class _W:
    a: f32[b"M F/d"]
    b: f32[b"F/d"]


@typed_shard_map
def _layer(x: f32[b"B/d L M"], w: _W) -> f32[b"B/d L F"]:
    full = shardops.all_gather("M F/d -> M F", w.a)
    return shardops.einsum_unreduced("B/d L M, M F -> B/d L F", x, full) + shardops.all_gather(
        "F/d -> F", w.b
    )


def _step_loss(x, w):
    return jnp.sum(jnp.tanh(_layer(x, w)) ** 2)


def _reference_loss(x, w):
    return jnp.sum(jnp.tanh(jnp.einsum("blm,mf->blf", x, w.a) + w.b) ** 2)


@pytest.mark.slow
def test_moves_inside_a_step_warn_and_gradients_move_back():
    mesh = jax.make_mesh((4, 2), ("d", "t"))
    rng = np.random.default_rng(0)
    x_host = rng.standard_normal((16, 8, 4)).astype(np.float32)
    w_host = _W(
        rng.standard_normal((4, 8)).astype(np.float32), rng.standard_normal(8).astype(np.float32)
    )
    step = jax.jit(jax.grad(_step_loss, argnums=(0, 1)))
    with jax.set_mesh(mesh):
        x = jax.device_put(x_host, NamedSharding(mesh, P(None, "d")))  # annotated B/d L M
        w = _W(
            jax.device_put(w_host.a, NamedSharding(mesh, P("d"))),  # annotated M F/d
            jax.device_put(w_host.b, NamedSharding(mesh, P("d"))),  # as annotated: no move
        )
        gx, gw = step(x, w)
        report = shardlib.explain(step, x, w)
        cmp = report.compare_hlo(_compiled_text(step, x, w))
    rx, rw = jax.grad(_reference_loss, argnums=(0, 1))(x_host, w_host)
    np.testing.assert_allclose(gx, rx, rtol=2e-5, atol=1e-5)
    np.testing.assert_allclose(gw.a, rw.a, rtol=2e-5, atol=1e-5)
    np.testing.assert_allclose(gw.b, rw.b, rtol=2e-5, atol=1e-5)

    fwd = {m.argument: m for m in report.moves if not m.backward}
    back = {m.argument: m for m in report.moves if m.backward}
    assert set(fwd) == set(back) == {"x", "w.a"}
    assert fwd["w.a"].input_index == 1 and fwd["w.a"].into == "_layer"
    for name, src, dst, shape, text in (
        ("x", P(None, "d"), P("d"), (16, 8, 4), ("P(None, 'd', None)", "P('d', None, None)")),
        ("w.a", P("d"), P(None, "d"), (4, 8), ("P('d', None)", "P(None, 'd')")),
    ):
        f, b = fwd[name], back[name]
        assert (f.src, f.dst) == text
        assert (b.src, b.dst) == (f.dst, f.src) and b.shape == f.shape == shape
        assert f.received_bytes == _oracle_received(mesh, shape, 4, src, dst)
        assert b.received_bytes == _oracle_received(mesh, shape, 4, dst, src)
        assert f.in_step and b.in_step
    text = str(report)
    assert "grad of x <- _layer() input 0" in text
    warnings = [ln for ln in text.splitlines() if ln.startswith("warning:")]
    assert len(warnings) == 2 and all("on every call of" in ln for ln in warnings)
    assert "argument 'x'" in warnings[0] and "and back for its gradient" in warnings[0]
    assert report.short().count("warning:") == 2
    # Every collective XLA added for the moves is paired with one; nothing is left unexplained.
    assert cmp.identical, str(cmp)
    assert {label for label, _ in cmp.moves} == {m.label for m in report.moves}


LAYOUT_PAIRS = [
    (P(None, "d"), P("d")),  # all-to-all
    (P("d"), P()),  # all-gather
    (P("t"), P("d")),  # collective-permute
    (P(("d", "t")), P("d")),  # all-gather over t
    (P("d", "t"), P("t", "d")),  # all-to-alls and a permute
    (P(), P("d")),  # a local slice: nothing moves, no row
]


@pytest.mark.parametrize("src, dst", LAYOUT_PAIRS, ids=lambda p: str(p))
def test_reshard_between_layouts_costs_what_the_layouts_say(src, dst):
    mesh = jax.make_mesh((4, 2), ("d", "t"))

    def f(x):
        return jnp.sin(jax.reshard(x, dst))

    with jax.set_mesh(mesh):
        x = jax.device_put(jnp.arange(256.0).reshape(16, 16), NamedSharding(mesh, src))
        np.testing.assert_allclose(
            jax.jit(f)(x), np.sin(np.arange(256.0).reshape(16, 16)), rtol=1e-6
        )
        report = shardlib.explain(f, x)
        cmp = report.compare_hlo(_compiled_text(f, x))
    expected = _oracle_received(mesh, (16, 16), 4, src, dst)
    if not expected:
        assert report.moves == []
    else:
        (m,) = report.moves
        assert m.received_bytes == expected and m.argument == "x" and m.into is None
        assert m.label == "x (reshard)"
    assert cmp.identical, str(cmp)
    assert bool(cmp.moves) == bool(expected)


def test_a_replicated_argument_is_sliced_in_a_step_without_a_warning():
    mesh = jax.make_mesh((8,), ("d",))
    step = jax.jit(jax.grad(lambda x: jnp.sum(_sin(x) ** 2)))
    with jax.set_mesh(mesh):
        x = jax.device_put(jnp.ones((16, 8, 4)), NamedSharding(mesh, P()))
        np.testing.assert_allclose(
            step(x), 2 * np.sin(1.0) * np.cos(1.0) * np.ones((16, 8, 4)), rtol=1e-6
        )
        report = shardlib.explain(step, x)
        direct = shardlib.explain(_sin, x)
    # Called directly: a slice row in the table, nothing in the summary (it costs no bytes).
    assert [m.kinds for m in direct.moves] == [()] and "layout moves" not in direct.short()
    moves = [m for m in report.moves if not m.backward]
    (m,) = moves
    assert (m.src, m.dst, m.received_bytes, m.kinds) == (
        "P(None, None, None)",
        "P('d', None, None)",
        0,
        (),
    )
    assert m.in_step and "none (local slice)" in str(report)
    assert "warning:" not in str(report)  # nothing is sent: no cost to warn about


def test_arguments_in_the_annotated_layout_move_nothing():
    mesh = jax.make_mesh((8,), ("d",))
    with jax.set_mesh(mesh):
        x = jax.device_put(jnp.ones((16, 8, 4)), NamedSharding(mesh, P("d")))
        report = shardlib.explain(_sin, x)
    assert report.moves == []
    assert "Layout moves" not in str(report) and "layout moves" not in report.short()


# -- gathers re-run by activation checkpointing ---------------------------------------------


CFG = tm.Config(
    vocab=64, d_model=32, n_heads=4, n_kv_heads=2, d_head=8, d_ff=64, n_layers=3, seq_len=16
)


@pytest.mark.slow
def test_gathers_rerun_by_checkpointing_are_recomputation_not_grad():
    mesh = jax.make_mesh((4, 2), ("d", "t"))
    with jax.set_mesh(mesh):
        model = tm.place_model(tm.init_model(CFG, jax.random.key(0, impl="rbg")))
        tokens = np.random.default_rng(0).integers(0, CFG.vocab, (8, CFG.seq_len), np.int32)
        report = shardlib.explain(jax.grad(lambda m, t: tm.loss(CFG, t, m)), model, tokens)
    rerun = [c for c in report.collectives if c.recomputed]
    forward_in_layer = [
        c for c in report.collectives if c.in_loop and c.op == "all_gather" and not c.backward
    ]
    # The checkpointed layer gathers its weights again in the backward pass: one re-run per
    # forward gather of the layer, same spec, same bytes, one per layer.
    assert rerun and all(c.kind == "all-gather" and not c.backward for c in rerun)
    assert sorted(c.spec for c in rerun) == sorted(
        c.spec for c in forward_in_layer if not c.recomputed
    )
    assert all(c.calls == CFG.n_layers for c in rerun)
    # "(grad)" is left to the transposes: every backward row of an all_gather op is its
    # reduce-scatter.
    grads = [c for c in report.collectives if c.backward and c.op == "all_gather"]
    assert grads and all(c.kind == "reduce-scatter" for c in grads)
    text = report.render()
    assert "all_gather (re-computation)" in text
    assert not any("all_gather (grad)" in ln and "all-gather " in ln for ln in text.splitlines())


@pytest.mark.slow
def test_a_checkpointed_gather_outside_a_scan_is_recomputation():
    mesh = jax.make_mesh((8,), ("d",))

    @typed_shard_map
    def loss(x: f32[b"B/d M"], w: f32[b"M/d F"]) -> f32[b""]:
        @explicit_activation_checkpointing
        def block(x, w):
            full = shardops.all_gather("M/d F -> M F", w)
            return jnp.tanh(shardops.einsum_unreduced("B/d M, M F -> B/d F", x, full))

        return shardops.psum("", jnp.sum(block(x, w) ** 2), axes="d")

    rng = np.random.default_rng(1)
    x_host = rng.standard_normal((16, 8)).astype(np.float32)
    w_host = rng.standard_normal((8, 4)).astype(np.float32)
    grad = jax.grad(loss, argnums=1)
    with jax.set_mesh(mesh):
        x = jax.device_put(x_host, NamedSharding(mesh, P("d")))
        w = jax.device_put(w_host, NamedSharding(mesh, P("d")))
        g = grad(x, w)
        report = shardlib.explain(grad, x, w)
    ref = jax.grad(lambda w: jnp.sum(jnp.tanh(x_host @ w) ** 2))(w_host)
    np.testing.assert_allclose(g, ref, rtol=2e-5, atol=1e-5)
    labels = sorted((c.kind, c.recomputed, c.backward) for c in report.collectives)
    assert ("all-gather", True, False) in labels  # the re-run
    assert ("reduce-scatter", False, True) in labels  # the transpose
    assert ("all-gather", False, False) in labels  # the forward
