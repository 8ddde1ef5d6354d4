"""Partial sums through the primitives JAX emits for iterating over an array, complex numbers,
``x.at[i].subtract``, a max-pool's derivatives and ``jax.lax.pbroadcast`` (issue 51 item 7).

JAX 0.12 binds one ``unstack`` where 0.10 bound a slice and a squeeze per row (``list(y)``,
``a, b = y``, ``zip(y, y)``, ``jnp.unstack`` from 0.10): iterating over a partial sum and
reducing each row was refused there as "`unstack` ... is not linear". Each accepted program
runs on 8 CPU devices and matches jax.numpy on the global arrays, values and gradients, on
every JAX; each refused relative names the op that misuses the partial sum and its line.
``pbroadcast`` lowers on GPUs only: its programs are traced, not run.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from shardlib import shardops
from shardlib._env import programs
from shardlib.shardops import PendingReductionError
from shardlib.shardtypes import f32, typed_shard_map
from tests._mesh_util import expect_pending, make_mesh

VMA = pytest.mark.parametrize("check_vma", [False, True], ids=["vma-off", "vma-on"])
JAX = jax.__version_info__[:2]


def _mesh():
    return make_mesh((4, 2), ("d", "t"))


def normal(seed: int, shape: tuple[int, ...]) -> np.ndarray:
    return np.random.RandomState(seed).standard_normal(shape).astype(np.float32)


X, W = normal(1, (8, 16)), normal(2, (16, 8))
XW = X @ W
# The primal a max-pool's derivative is taken at: the same on every device.
PRIMAL = normal(3, (2, 8))


def _partial(x: jax.Array, w: jax.Array) -> jax.Array:
    """Each device's (2, 8) block of x @ w, a partial sum over 't'."""
    return shardops.einsum_unreduced("B/d F/t, F/t M -> B/d M", x, w)


# -- iterating over a partial sum: accepted, each row reduced ----------------------------------


def rows_listed(x: f32[b"B/d F/t"], w: f32[b"F/t M"]) -> f32[b"B/d M"]:
    rows = list(_partial(x, w))
    return jnp.stack([lax.psum(expect_pending(r, ("t",)), "t") for r in rows])


def rows_unpacked(x: f32[b"B/d F/t"], w: f32[b"F/t M"]) -> f32[b"B/d M"]:
    a, b = _partial(x, w)  # B is 8 over 4 devices of 'd': two rows each
    return jnp.stack([lax.psum(a, "t"), shardops.psum("M", b, axes="t")])


def rows_zipped(x: f32[b"B/d F/t"], w: f32[b"F/t M"]) -> f32[b"B/d M"]:
    y = _partial(x, w)
    return jnp.stack([lax.psum(r + 2.0 * s, "t") for r, s in zip(y, y, strict=True)]) / 3.0


def rows_jnp_unstack(x: f32[b"B/d F/t"], w: f32[b"F/t M"]) -> f32[b"B/d M"]:
    return jnp.stack([lax.psum(r, "t") for r in jnp.unstack(_partial(x, w))])  # unstack: JAX 0.10


def columns(x: f32[b"B/d F/t"], w: f32[b"F/t M"]) -> f32[b"B/d M"]:
    return jnp.stack([lax.psum(c, "t") for c in _partial(x, w).T], axis=1)


def rows_restacked(x: f32[b"B/d F/t"], w: f32[b"F/t M"]) -> f32[b"B/d M"]:
    scaled = [r * (k + 1.0) for k, r in enumerate(_partial(x, w))]
    return lax.psum(jnp.stack(scaled), "t") / jnp.array([[1.0], [2.0]])  # reduced once


ITERATING = [rows_listed, rows_unpacked, rows_zipped, rows_jnp_unstack, columns, rows_restacked]


def _sin_sum_grads(f: Callable) -> tuple[jax.Array, jax.Array]:
    return jax.grad(lambda x, w: jnp.sum(jnp.sin(f(x, w))), argnums=(0, 1))(X, W)


@VMA
@pytest.mark.parametrize("body", ITERATING, ids=[b.__name__ for b in ITERATING])
def test_iterating_over_a_partial_sum_and_reducing_each_row(body: Callable, check_vma: bool):
    f = typed_shard_map(body, check_vma=check_vma)
    with jax.set_mesh(_mesh()):
        out = np.asarray(jax.jit(f)(X, W))
        gx, gw = jax.jit(lambda x, w: _sin_sum_grads(f))(X, W)
    np.testing.assert_allclose(out, XW, rtol=1e-5, atol=1e-5)
    want_x, want_w = _sin_sum_grads(lambda x, w: jnp.asarray(x) @ w)
    np.testing.assert_allclose(np.asarray(gx), np.asarray(want_x), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.asarray(gw), np.asarray(want_w), rtol=1e-4, atol=1e-5)


def test_iteration_binds_unstack_where_this_jax_does() -> None:
    """The tests above exercise ``unstack``: ``jnp.unstack`` binds it from JAX 0.10,
    ``list(y)`` from JAX 0.12 (before, slices and squeezes)."""
    with jax.set_mesh(_mesh()):
        for body, since in ((rows_jnp_unstack, (0, 10)), (rows_listed, (0, 12))):
            jaxpr = programs.open_program(jax.jit(typed_shard_map(body)).trace(X, W).jaxpr)
            names = {e.primitive.name for e in programs.iter_eqns(jaxpr)}
            assert ("unstack" in names) == (since <= JAX), (body.__name__, sorted(names))


# -- its relatives: refused, naming the op that misuses a row ----------------------------------


def row_through_exp(x: f32[b"B/d F/t"], w: f32[b"F/t M"]) -> f32[b"B/d M"]:
    rows = list(_partial(x, w))
    return lax.psum(jnp.stack([jnp.exp(r) for r in rows]), "t")


def rows_returned(x: f32[b"B/d F/t"], w: f32[b"F/t M"]) -> f32[b"B/d M"]:
    return jnp.stack(list(_partial(x, w)))


def row_plus_reduced_row(x: f32[b"B/d F/t"], w: f32[b"F/t M"]) -> f32[b"B/d M"]:
    a, b = _partial(x, w)
    return jnp.stack([lax.psum(a, "t"), lax.psum(b + lax.psum(a, "t"), "t")])


REFUSED = [
    (row_through_exp, "`exp` at "),
    (rows_returned, "the return value is a partial sum still owing a reduction over mesh axis 't'"),
    (row_plus_reduced_row, "combines a value that is not a partial sum with a partial sum"),
]


@VMA
@pytest.mark.parametrize("body,says", REFUSED, ids=[b.__name__ for b, _ in REFUSED])
def test_misusing_a_row_of_a_partial_sum_is_refused(body: Callable, says: str, check_vma: bool):
    f = typed_shard_map(body, check_vma=check_vma)
    with jax.set_mesh(_mesh()), pytest.raises(PendingReductionError) as info:
        jax.jit(f).trace(X, W)
    msg = str(info.value)
    assert says in msg and "einsum_unreduced('B/d F/t, F/t M -> B/d M')" in msg, msg


# -- complex numbers and x.at[i].subtract: linear, accepted; a reduced operand refused ---------


def complex_parts(x: f32[b"B/d F/t"], w: f32[b"F/t M"]) -> f32[b"B/d M"]:
    y = _partial(x, w)
    c = lax.psum(lax.complex(y, 2.0 * y), "t")
    return (jnp.real(c) + jnp.imag(c)) / 3.0


def subtract_a_row(x: f32[b"B/d F/t"], w: f32[b"F/t M"]) -> f32[b"B/d M"]:
    y = _partial(x, w)
    return lax.psum(y.at[0].subtract(y[1]), "t")


def _reference(body: Callable, xw: jax.Array) -> jax.Array:
    """The unsharded jax.numpy value of ``body`` from the global x @ w: the same, or, of each
    device's two rows, the first minus the second."""
    if body is complex_parts:
        return xw
    blocks = xw.reshape(4, 2, 8)
    return blocks.at[:, 0].subtract(blocks[:, 1]).reshape(8, 8)


@VMA
@pytest.mark.parametrize("body", [complex_parts, subtract_a_row])
def test_complex_and_scatter_sub_keep_a_partial_sum(body: Callable, check_vma: bool) -> None:
    f = typed_shard_map(body, check_vma=check_vma)
    with jax.set_mesh(_mesh()):
        out = np.asarray(jax.jit(f)(X, W))
        _, gw = jax.jit(lambda x, w: _sin_sum_grads(f))(X, W)
    np.testing.assert_allclose(out, _reference(body, jnp.asarray(XW)), rtol=1e-5, atol=1e-5)
    want = jax.grad(lambda w: jnp.sum(jnp.sin(_reference(body, jnp.asarray(X) @ w))))(W)
    np.testing.assert_allclose(np.asarray(gw), np.asarray(want), rtol=1e-4, atol=1e-5)


def complex_of_reduced(x: f32[b"B/d F/t"], w: f32[b"F/t M"]) -> f32[b"B/d M"]:
    y = _partial(x, w)
    return jnp.real(lax.psum(lax.complex(y, lax.psum(y, "t")), "t"))


def subtract_reduced_row(x: f32[b"B/d F/t"], w: f32[b"F/t M"]) -> f32[b"B/d M"]:
    y = _partial(x, w)
    return lax.psum(y.at[0].subtract(lax.psum(y[1], "t")), "t")


@pytest.mark.parametrize("body", [complex_of_reduced, subtract_reduced_row])
def test_complex_and_scatter_sub_of_a_reduced_operand_are_refused(body: Callable) -> None:
    with jax.set_mesh(_mesh()), pytest.raises(PendingReductionError) as info:
        jax.jit(typed_shard_map(body)).trace(X, W)
    name = "complex" if body is complex_of_reduced else "scatter-sub"
    assert f"`{name}` at " in str(info.value), str(info.value)
    assert "combines a value that is not a partial sum" in str(info.value)


# -- a max-pool's derivatives: linear in the (co)tangent, at a primal the same everywhere ------


def _pool(z: jax.Array) -> jax.Array:
    return lax.reduce_window(z, -jnp.inf, lax.max, (2, 2), (2, 2), "VALID")


def _primal(y: jax.Array, per_device: bool = False) -> jax.Array:
    """`PRIMAL` on every device (typed varying like ``y``, so that JAX's types match), or
    (``per_device``) shifted by the device's index along 't'."""
    shift = lax.axis_index("t").astype(jnp.float32) if per_device else 0.0
    return jnp.zeros_like(y) + jnp.asarray(PRIMAL) + shift


def pool_tangent(x: f32[b"B/d F/t"], w: f32[b"F/t M"]) -> f32[b"P/d Q"]:
    y = _partial(x, w)
    return lax.psum(jax.jvp(_pool, (_primal(y),), (y,))[1], "t")  # select_and_gather_add


def pool_cotangent(x: f32[b"B/d F/t"], w: f32[b"F/t M"]) -> f32[b"B/d M"]:
    y = _partial(x, w)
    _, back = jax.vjp(_pool, _primal(y))
    return lax.psum(back(y[:1, :4])[0], "t")  # select_and_scatter_add


def _per_block(fn: Callable, xw: np.ndarray) -> np.ndarray:
    """``fn`` of each device's (2, 8) block of the global x @ w, unsharded, stacked."""
    return np.concatenate([np.asarray(fn(xw[2 * i : 2 * i + 2])) for i in range(4)])


POOL = [
    (pool_tangent, lambda b: jax.jvp(_pool, (jnp.asarray(PRIMAL),), (b,))[1]),
    (pool_cotangent, lambda b: jax.vjp(_pool, jnp.asarray(PRIMAL))[1](b[:1, :4])[0]),
]


@VMA
@pytest.mark.parametrize("body,block", POOL, ids=[b.__name__ for b, _ in POOL])
def test_max_pool_derivatives_of_a_partial_sum(body: Callable, block: Callable, check_vma):
    f = typed_shard_map(body, check_vma=check_vma)
    with jax.set_mesh(_mesh()):
        out = np.asarray(jax.jit(f)(X, W))
    np.testing.assert_allclose(out, _per_block(block, XW), rtol=1e-5, atol=1e-5)


def pool_tangent_at_per_device_primal(x: f32[b"B/d F/t"], w: f32[b"F/t M"]) -> f32[b"P/d Q"]:
    y = _partial(x, w)
    return lax.psum(jax.jvp(_pool, (_primal(y, per_device=True),), (y,))[1], "t")


def pool_cotangent_at_per_device_primal(x: f32[b"B/d F/t"], w: f32[b"F/t M"]) -> f32[b"B/d M"]:
    y = _partial(x, w)
    _, back = jax.vjp(_pool, _primal(y, per_device=True))
    return lax.psum(back(y[:1, :4])[0], "t")


@pytest.mark.parametrize(
    "body", [pool_tangent_at_per_device_primal, pool_cotangent_at_per_device_primal]
)
def test_max_pool_derivative_at_a_primal_differing_across_the_pending_axis_is_refused(body):
    """Each device would pick each window's maximum at another place of its share."""
    with jax.set_mesh(_mesh()), pytest.raises(PendingReductionError) as info:
        jax.jit(typed_shard_map(body)).trace(X, W)
    msg = str(info.value)
    assert "select_and_" in msg and "differs across the devices of mesh axis 't'" in msg, msg


# -- jax.lax.pbroadcast: a collective broadcast from one device (traced: it lowers on GPUs) -----


def _source(dynamic: bool) -> int | jax.Array:
    """Device 0: an int binds ``pbroadcast``, a traced int32 (JAX 0.12) ``pbroadcast_dynamic``."""
    return jnp.int32(0) + 0 * lax.axis_index("d") if dynamic else 0


def _broadcast(over: str, dynamic: bool) -> Callable:
    """A body that broadcasts its partial sum over 't' from device 0 of ``over``, then
    reduces it over 't' (over 'd', the result is still a partial sum over 't')."""

    def body(x: f32[b"B/d F/t"], w: f32[b"F/t M"]) -> f32[b"B/d M"]:
        y = lax.pbroadcast(_partial(x, w), over, _source(dynamic))
        return lax.psum(y if over == "t" else expect_pending(y, ("t",)), "t")

    return body


DYNAMIC = pytest.mark.parametrize(
    "dynamic",
    [False, pytest.param(True, marks=pytest.mark.skipif(JAX < (0, 12), reason="JAX 0.12"))],
    ids=["int-source", "traced-source"],
)


@DYNAMIC
def test_pbroadcast_of_a_partial_sum_over_its_axis_is_refused(dynamic: bool) -> None:
    with jax.set_mesh(_mesh()), pytest.raises(PendingReductionError) as info:
        jax.jit(typed_shard_map(_broadcast("t", dynamic))).trace(X, W)
    msg = str(info.value)
    assert "body(): `pbroadcast` at test_pending_primitives.py:" in msg, msg
    assert "broadcasts one device's value to every device of mesh axis 't'" in msg, msg


@DYNAMIC
def test_pbroadcast_over_another_axis_keeps_the_partial_sum(dynamic: bool) -> None:
    with jax.set_mesh(_mesh()):
        jaxpr = programs.open_program(
            jax.jit(typed_shard_map(_broadcast("d", dynamic))).trace(X, W).jaxpr
        )
    names = {e.primitive.name for e in programs.iter_eqns(jaxpr)}
    assert ("pbroadcast_dynamic" if dynamic else "pbroadcast") in names, sorted(names)
