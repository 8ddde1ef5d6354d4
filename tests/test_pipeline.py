"""``pipeline.gpipe``: GPipe over a stage axis, compared with applying all layers in order.

A stack of ``L = 8`` MLP layers (``(relu(h @ w_in) @ w_out + bias) * gain``; the bias makes a
stage's output on a zero input non-zero, so a bubble value leaking into the results or the
gradients would show) is split over mesh axis ``p`` (``'layers/p M F'``) on meshes of 2, 4
and 8 stages, with ``m = p`` and ``m = 2p`` microbatches, with and without ``jax.checkpoint``
on the stage function. Under ``jit`` the pipelined outputs, loss and every gradient equal a
plain jax.numpy loop over all layers on the global arrays. One case adds data and tensor
parallelism inside each stage (a (2, 2, 2) mesh, ``'layers/p M/d F/t'``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from shardlib import pipeline, shardops
from shardlib.pipeline import gpipe, gpipe_bubble_fraction
from shardlib.shardtypes import Array, f32, make_shardings, pytree_dataclass, typed_shard_map
from tests._mesh_util import count_collectives, make_mesh

L, M, F, B = 8, 8, 16, 4  # layers, model, hidden, rows per microbatch


@pytree_dataclass
class Stack:
    w_in: f32[Array, b"layers/p M F"]
    w_out: f32[Array, b"layers/p F M"]
    bias: f32[Array, b"layers/p M"]
    gain: f32[Array, b"layers/p M"]


@pytree_dataclass
class Stack3:  # tensor parallel inside each stage: (p, d, t) mesh
    w_in: f32[Array, b"layers/p M/d F/t"]
    w_out: f32[Array, b"layers/p F/t M/d"]
    bias: f32[Array, b"layers/p M"]
    gain: f32[Array, b"layers/p M"]


def _weights(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "w_in": (rng.standard_normal((L, M, F)) / np.sqrt(M)).astype(np.float32),
        "w_out": (rng.standard_normal((L, F, M)) / np.sqrt(F)).astype(np.float32),
        "bias": (0.1 * rng.standard_normal((L, M))).astype(np.float32),
        "gain": (1 + 0.1 * rng.standard_normal((L, M))).astype(np.float32),
    }


def _stage(s: Stack, h: jax.Array) -> jax.Array:
    """This stage's layers in order, on one microbatch block 'B M'."""

    def layer(h, lw):
        w_in, w_out, bias, gain = lw
        return (jax.nn.relu(h @ w_in) @ w_out + bias) * gain, None

    h, _ = lax.scan(layer, h, (s.w_in, s.w_out, s.bias, s.gain))
    return h


def _stage3(s: Stack3, h: jax.Array) -> jax.Array:
    """As `_stage` with the weights gathered over 'd' and the hidden dim split over 't'."""

    def layer(h, lw):
        w_in, w_out, bias, gain = lw
        z = jax.nn.relu(shardops.einsum_unreduced("B/d M, M F/t -> B/d F/t", h, w_in))
        y = shardops.einsum_unreduced("B/d F/t, F/t M -> B/d M", z, w_out)
        return (shardops.psum("B/d M", y, axes="t") + bias) * gain, None

    w_in = shardops.all_gather("layers/p M/d F/t -> layers/p M F/t", s.w_in)
    w_out = shardops.all_gather("layers/p F/t M/d -> layers/p F/t M", s.w_out)
    h, _ = lax.scan(layer, h, (w_in, w_out, s.bias, s.gain))
    return h


def _reference(w: dict, x: jax.Array) -> jax.Array:
    """All layers in order on every microbatch, on the global arrays (no mesh)."""
    for i in range(L):
        x = (jax.nn.relu(x @ w["w_in"][i]) @ w["w_out"][i] + w["bias"][i]) * w["gain"][i]
    return x


def _loss(y: jax.Array, coef: jax.Array) -> jax.Array:
    return jnp.sum(jnp.tanh(y) * coef)


def _forward(stage_fn, tp: bool):
    if tp:

        @typed_shard_map
        def forward3(s: Stack3, x: f32[Array, b"m B/d M"]) -> f32[Array, b"m B/d M"]:
            return pipeline.gpipe(stage_fn, s, x, spec="B/d M", axis="p")

        return forward3

    @typed_shard_map
    def forward(s: Stack, x: f32[Array, b"m B M"]) -> f32[Array, b"m B M"]:
        return pipeline.gpipe(stage_fn, s, x, spec="B M", axis="p")

    return forward


def _check_against_reference(mesh, m: int, *, remat: bool, tp: bool, seed: int) -> None:
    w = _weights(seed)
    rng = np.random.default_rng(seed + 100)
    x = rng.standard_normal((m, B, M)).astype(np.float32)
    coef = rng.standard_normal((m, B, M)).astype(np.float32)
    cls, fn = (Stack3, _stage3) if tp else (Stack, _stage)
    forward = _forward(jax.checkpoint(fn) if remat else fn, tp)
    params = jax.device_put(cls(**w), make_shardings(cls, mesh=mesh))

    def loss(s, x):
        return _loss(forward(s, x), coef)

    with jax.set_mesh(mesh):
        y = jax.jit(forward)(params, x)
        val, (g, gx) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(params, x)
    np.testing.assert_allclose(np.asarray(y), _reference(w, x), rtol=1e-5, atol=1e-5)
    ref_val, (ref_g, ref_gx) = jax.value_and_grad(
        lambda w, x: _loss(_reference(w, x), coef), argnums=(0, 1)
    )(w, x)
    np.testing.assert_allclose(val, ref_val, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(gx), ref_gx, rtol=1e-4, atol=1e-5, err_msg="x")
    for name in ("w_in", "w_out", "bias", "gain"):
        got = np.asarray(getattr(g, name))
        np.testing.assert_allclose(got, ref_g[name], rtol=1e-4, atol=1e-5, err_msg=name)


@pytest.mark.parametrize("remat", [False, True])
@pytest.mark.parametrize("p", [2, 4, 8])
@pytest.mark.parametrize("per_stage", [1, 2])
def test_gpipe_matches_all_layers_in_order(p: int, per_stage: int, remat: bool) -> None:
    """m = p and m = 2p microbatches on p stages, with and without remat on the stage."""
    mesh = make_mesh((p,), ("p",))
    m = per_stage * p
    _check_against_reference(mesh, m, remat=remat, tp=False, seed=p + m)


def test_gpipe_with_data_and_tensor_parallel_stages() -> None:
    """(2, 2, 2) mesh ('p', 'd', 't'): each stage's MLP is split over 'd' and 't'."""
    mesh = make_mesh((2, 2, 2), ("p", "d", "t"))
    _check_against_reference(mesh, 4, remat=True, tp=True, seed=7)


def test_gpipe_one_permute_per_tick_and_one_all_reduce() -> None:
    """The scan body holds the one shift; the broadcast of the outputs is one all-reduce."""
    mesh = make_mesh((4,), ("p",))
    forward = _forward(_stage, tp=False)
    params = jax.device_put(Stack(**_weights(0)), make_shardings(Stack, mesh=mesh))
    x = np.zeros((16, B, M), np.float32)
    with jax.set_mesh(mesh):
        text = jax.jit(forward).lower(params, x).as_text()
    counts = count_collectives(text)
    assert counts.get("collective_permute") == 1 and counts.get("all_reduce") == 1, counts
    assert text.count("stablehlo.while") >= 1


def test_gpipe_without_broadcast_leaves_outputs_on_last_stage() -> None:
    p, m = 4, 4
    mesh = make_mesh((p,), ("p",))
    w = _weights(3)
    x = np.random.default_rng(4).standard_normal((m, B, M)).astype(np.float32)

    @typed_shard_map
    def forward(s: Stack, x: f32[Array, b"m B M"]) -> f32[Array, b"S/p m B M"]:
        return gpipe(_stage, s, x, spec=b"B M", axis="p", broadcast=False)[None]

    params = jax.device_put(Stack(**w), make_shardings(Stack, mesh=mesh))
    with jax.set_mesh(mesh):
        got = np.asarray(jax.jit(forward)(params, x))
    np.testing.assert_allclose(got[p - 1], _reference(w, x), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(got[: p - 1], 0.0)


def test_gpipe_stage_output_shape_error() -> None:
    mesh = make_mesh((2,), ("p",))

    @typed_shard_map
    def forward(s: Stack, x: f32[Array, b"m B M"]) -> f32[Array, b"m B M"]:
        return gpipe(lambda s, h: h[:, :1], s, x, spec="B M")

    params = jax.device_put(Stack(**_weights(0)), make_shardings(Stack, mesh=mesh))
    with jax.set_mesh(mesh), pytest.raises(ValueError, match=r"gpipe: `stage_fn` must return"):
        forward(params, np.zeros((2, B, M), np.float32))


@pytest.mark.parametrize(("p", "m"), [(1, 1), (2, 2), (4, 4), (4, 8), (8, 16), (8, 1)])
def test_bubble_fraction_formula(p: int, m: int) -> None:
    """(p - 1) / (m + p - 1): each stage idles p - 1 of the m + p - 1 ticks."""
    ticks = m + p - 1
    idle = [sum(not (0 <= t - s < m) for t in range(ticks)) for s in range(p)]
    assert idle == [p - 1] * p
    assert gpipe_bubble_fraction(p, m) == pytest.approx((p - 1) / (m + p - 1))
    assert gpipe_bubble_fraction(p, m) == pytest.approx(idle[0] / ticks)


@pytest.mark.parametrize(("p", "m"), [(0, 4), (4, 0), (2.0, 4), (True, 4)])
def test_bubble_fraction_rejects_bad_counts(p, m) -> None:
    with pytest.raises(ValueError, match="gpipe_bubble_fraction: argument `[pm]` must be"):
        gpipe_bubble_fraction(p, m)
