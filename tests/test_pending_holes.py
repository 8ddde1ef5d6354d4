"""The five silent wrong answers once found in pending-sum tracking, and values that cross
every JAX boundary.

Each broken program must now fail at trace time (check_vma off and on) with a message that
names the op, its line and the op that made the partial sum; its corrected twin must run and
match jax.numpy on the global arrays. The boundary programs carry partial sums through
``jit``, ``scan`` (carry and stacked outputs), ``jax.checkpoint``,
``explicit_activation_checkpointing``, ``cond`` and ``custom_vjp``, and reduce them with raw
``jax.lax`` collectives, as seqax-era code does.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from jax_extra import explicit_activation_checkpointing, save_for_backward
from shardlib import shardops
from shardlib.shardops import PendingReductionError
from shardlib.shardtypes import f32, typed_shard_map
from tests._mesh_util import make_mesh

VMA = pytest.mark.parametrize("check_vma", [False, True], ids=["vma-off", "vma-on"])


def _mesh():
    return make_mesh((4, 2), ("d", "t"))


def normal(seed: int, shape: tuple[int, ...]) -> np.ndarray:
    return np.random.RandomState(seed).standard_normal(shape).astype(np.float32)


X, W, V = normal(1, (8, 16)), normal(2, (16, 8)), normal(3, (8, 4))


def _mask_t() -> jax.Array:
    """A per-device dropout-like mask that differs across the devices of 't'."""
    key = jax.random.fold_in(jax.random.key(0), lax.axis_index("t"))
    return jax.random.bernoulli(key, 0.5, (8, 8)).astype(jnp.float32)


# -- 1. psum over an axis the value does not vary on, while pending on another -----------------


def psum_extra_axis(fixed: bool, x: f32[b"B F/t"], w: f32[b"F/t M"]) -> f32[b"B M"]:
    y = shardops.einsum_unreduced("B F/t, F/t M -> B M", x, w)
    if not fixed:
        y = shardops.psum("B M", y, axes="d")
    return shardops.psum("B M", y, axes="t")


def psum_scatter_extra_axis(fixed: bool, x: f32[b"B F/t"], w: f32[b"F/t M"]) -> f32[b"B M/d"]:
    y = shardops.einsum_unreduced("B F/t, F/t M -> B M", x, w)
    if fixed:
        y = shardops.psum("B M", y, axes="t")
        return y.reshape(y.shape[0], 4, -1)[:, shardops.axis_index("d")]
    y = shardops.psum_scatter("B M -> B M/d", y)
    return shardops.psum("B M/d", y, axes="t")


# -- 2. a partial sum times a factor that differs along the pending axis ------------------------


def masked_partial(fixed: bool, x: f32[b"B/d F/t"], w: f32[b"F/t M"]) -> f32[b"B/d M"]:
    y = shardops.einsum_unreduced("B/d F/t, F/t M -> B/d M", x, w)
    m = _mask_t()[: y.shape[0]]
    if fixed:
        return shardops.psum("B/d M", y, axes="t") * lax.psum(m, "t")
    return shardops.psum("B/d M", y * m, axes="t")


def einsum_masked_partial(fixed: bool, x: f32[b"B/d F/t"], w: f32[b"F/t M"]) -> f32[b"B/d M"]:
    y = shardops.einsum_unreduced("B/d F/t, F/t M -> B/d M", x, w)
    m = _mask_t()[: y.shape[0]]
    if fixed:
        y = shardops.psum("B/d M", y, axes="t")
        return shardops.einsum_unreduced("B/d M, B/d M -> B/d M", y, lax.psum(m, "t"))
    z = shardops.einsum_unreduced("B/d M, B/d M -> B/d M", y, m)
    return shardops.psum("B/d M", z, axes="t")


# -- 3. `@` skips the check einsum_unreduced makes ----------------------------------------------


def matmul_split_over_pending(
    fixed: bool, x: f32[b"B/d F/t"], w: f32[b"F/t M"], v: f32[b"M N/t"]
) -> f32[b"B/d N/t"]:
    y = shardops.einsum_unreduced("B/d F/t, F/t M -> B/d M", x, w)
    if fixed:
        return shardops.psum("B/d M", y, axes="t") @ v
    return lax.psum(y @ v, "t")


# -- 4. an integer cast keeps the pending axes ---------------------------------------------------


def int_cast(fixed: bool, x: f32[b"B/d F/t"], w: f32[b"F/t M"]) -> f32[b"B/d M"]:
    y = shardops.einsum_unreduced("B/d F/t, F/t M -> B/d M", x, w)
    if fixed:
        return shardops.psum("B/d M", y, axes="t").astype(jnp.int32).astype(jnp.float32)
    return shardops.psum("B/d M", y.astype(jnp.int32).astype(jnp.float32), axes="t")


# -- 5. psum over ('d', 't') of a value pending over 't' only ------------------------------------


def psum_two_axes(fixed: bool, x: f32[b"B F/t"], w: f32[b"F/t M"]) -> f32[b"B M"]:
    y = shardops.einsum_unreduced("B F/t, F/t M -> B M", x, w)
    return lax.psum(y, "t" if fixed else ("d", "t"))


HOLES: list[tuple[str, Callable, tuple[np.ndarray, ...], Callable, tuple[str, ...]]] = [
    ("psum-extra-axis", psum_extra_axis, (X, W), lambda x, w: x @ w, ("'d'",)),
    ("psum-scatter-extra-axis", psum_scatter_extra_axis, (X, W), lambda x, w: x @ w, ("'d'",)),
    ("mask", masked_partial, (X, W), None, ("`mul`", "differs across the devices")),
    ("einsum-mask", einsum_masked_partial, (X, W), None, ("differs across the devices",)),
    (
        "matmul-split",
        matmul_split_over_pending,
        (X, W, V),
        lambda x, w, v: x @ w @ v,
        ("`dot_general`", "mesh axis 't'"),
    ),
    (
        "int-cast",
        int_cast,
        (X, W),
        lambda x, w: np.trunc(x @ w),
        ("`convert_element_type`", "float32 to int32"),
    ),
    ("psum-two-axes", psum_two_axes, (X, W), lambda x, w: x @ w, ("`psum`", "'d'")),
]


@VMA
@pytest.mark.parametrize("hole", HOLES, ids=[h[0] for h in HOLES])
def test_wrong_answer_is_refused_and_its_twin_matches(hole, check_vma: bool) -> None:
    _, body, args, ref, needles = hole
    f = typed_shard_map(body, static_argnames=("fixed",), check_vma=check_vma)
    with jax.set_mesh(_mesh()):
        with pytest.raises(PendingReductionError) as info:
            jax.jit(lambda *a: f(False, *a)).trace(*args)
        out = np.asarray(jax.jit(lambda *a: f(True, *a))(*args))
    msg = str(info.value)
    assert "einsum_unreduced('B" in msg and "test_pending_holes.py:" in msg, msg
    for n in needles:
        assert n in msg, f"{n!r} not in {msg}"
    if ref is not None:
        np.testing.assert_allclose(out, ref(*args), rtol=1e-4, atol=1e-4)


def test_masked_twin_values() -> None:
    """The fixed mask programs: the reduced value times the mask summed over 't'."""
    f = typed_shard_map(masked_partial, static_argnames=("fixed",))
    g = typed_shard_map(einsum_masked_partial, static_argnames=("fixed",))
    with jax.set_mesh(_mesh()):
        a = np.asarray(jax.jit(lambda *x: f(True, *x))(X, W))
        b = np.asarray(jax.jit(lambda *x: g(True, *x))(X, W))
    np.testing.assert_allclose(a, b, rtol=1e-6)
    m = np.asarray(
        jax.random.bernoulli(jax.random.fold_in(jax.random.key(0), 0), 0.5, (8, 8)), np.float32
    ) + np.asarray(
        jax.random.bernoulli(jax.random.fold_in(jax.random.key(0), 1), 0.5, (8, 8)), np.float32
    )
    want = (X @ W).reshape(4, 2, 8) * m[:2][None]  # each d-block of B has 2 rows
    np.testing.assert_allclose(a, want.reshape(8, 8), rtol=1e-4, atol=1e-4)


# -- crossing JAX boundaries, reduced with raw lax collectives ----------------------------------


def _layer(x: jax.Array, w: jax.Array) -> jax.Array:
    return shardops.einsum_unreduced("B/d F/t, F/t M -> B/d M", x, w)


def cross_jit(x: f32[b"B/d F/t"], w: f32[b"F/t M"]) -> f32[b"B/d M"]:
    return lax.psum(jax.jit(lambda a, b: _layer(a, b) * 2.0)(x, w), "t") / 2.0


def cross_scan(x: f32[b"B/d F/t"], w: f32[b"F/t M"]) -> f32[b"B/d M"]:
    def step(acc, k):
        part = _layer(x, w) * k
        return acc + part, part  # a pending carry and a pending stacked output

    # 0 * (a partial sum) is known to be zero, and JAX types it as varying like the carry.
    acc, parts = lax.scan(step, 0.0 * _layer(x, w), jnp.arange(1.0, 4.0))
    return (lax.psum(acc, "t") + lax.psum(parts.sum(0), "t")) / 12.0


def cross_checkpoint(x: f32[b"B/d F/t"], w: f32[b"F/t M"]) -> f32[b"B/d M"]:
    return lax.pmean(jax.checkpoint(_layer)(x, w), "t") * 2.0


def cross_explicit_remat(x: f32[b"B/d F/t"], w: f32[b"F/t M"]) -> f32[b"B/d M"]:
    @explicit_activation_checkpointing
    def block(a: jax.Array, b: jax.Array) -> jax.Array:
        return save_for_backward(_layer(a, b))

    return lax.psum(block(x, w), "t")


def cross_cond(x: f32[b"B/d F/t"], w: f32[b"F/t M"]) -> f32[b"B/d M"]:
    y = lax.cond(True, lambda a: a, lambda a: -a, _layer(x, w))
    return lax.psum(y, "t")


@jax.custom_vjp
def _scaled(y: jax.Array) -> jax.Array:
    return y * 3.0


_scaled.defvjp(lambda y: (y * 3.0, None), lambda _, g: (g * 3.0,))


def cross_custom_vjp(x: f32[b"B/d F/t"], w: f32[b"F/t M"]) -> f32[b"B/d M"]:
    return lax.psum(_scaled(_layer(x, w)), "t") / 3.0


def cross_psum_scatter(x: f32[b"B/d F/t"], w: f32[b"F/t M"]) -> f32[b"B/d M/t"]:
    return lax.psum_scatter(_layer(x, w), "t", scatter_dimension=1, tiled=True)


CROSSING = [
    cross_jit,
    cross_scan,
    cross_checkpoint,
    cross_explicit_remat,
    cross_cond,
    cross_custom_vjp,
    cross_psum_scatter,
]


@VMA
@pytest.mark.parametrize("body", CROSSING, ids=[b.__name__ for b in CROSSING])
def test_partial_sums_cross_jax_boundaries(body: Callable, check_vma: bool) -> None:
    f = typed_shard_map(body, check_vma=check_vma)
    with jax.set_mesh(_mesh()):
        out = np.asarray(jax.jit(f)(X, W))
        grad = jax.jit(jax.grad(lambda x, w: jnp.sum(jnp.sin(f(x, w))), argnums=1))(X, W)
    np.testing.assert_allclose(out, X @ W, rtol=1e-5, atol=1e-5)
    want = jax.grad(lambda w: jnp.sum(jnp.sin(jnp.asarray(X) @ w)))(jnp.asarray(W))
    np.testing.assert_allclose(np.asarray(grad), np.asarray(want), rtol=1e-4, atol=1e-5)


def forgot_in_scan(x: f32[b"B/d F/t"], w: f32[b"F/t M"]) -> f32[b"B/d M"]:
    def step(acc, _):
        return acc + _layer(x, w), None

    return lax.scan(step, jnp.zeros((x.shape[0], w.shape[1])), None, length=2)[0]


def forgot_in_custom_vjp(x: f32[b"B/d F/t"], w: f32[b"F/t M"]) -> f32[b"B/d M"]:
    return jnp.tanh(_scaled(_layer(x, w)))


@VMA
@pytest.mark.parametrize("body", [forgot_in_scan, forgot_in_custom_vjp])
def test_forgotten_reduction_across_boundaries(body: Callable, check_vma: bool) -> None:
    f = typed_shard_map(body, check_vma=check_vma)
    with jax.set_mesh(_mesh()), pytest.raises(PendingReductionError) as info:
        jax.jit(f).trace(X, W)
    msg = str(info.value)
    assert "einsum_unreduced('B/d F/t, F/t M -> B/d M')" in msg, msg
    assert "test_pending_holes.py:" in msg, msg


def test_eager_call_runs_the_same_checks() -> None:
    f = typed_shard_map(psum_two_axes, static_argnames=("fixed",))
    with jax.set_mesh(_mesh()):
        np.testing.assert_allclose(np.asarray(f(True, X, W)), X @ W, rtol=1e-5, atol=1e-5)
        with pytest.raises(PendingReductionError):
            f(False, X, W)


def test_auto_mesh_runs_the_same_checks() -> None:
    from jax.sharding import AxisType

    mesh = jax.make_mesh((4, 2), ("d", "t"), axis_types=(AxisType.Auto,) * 2)
    f = typed_shard_map(psum_two_axes, static_argnames=("fixed",), mesh=mesh)
    np.testing.assert_allclose(
        np.asarray(jax.jit(lambda *a: f(True, *a))(X, W)), X @ W, rtol=1e-5, atol=1e-5
    )
    with pytest.raises(PendingReductionError):
        jax.jit(lambda *a: f(False, *a)).trace(X, W)
