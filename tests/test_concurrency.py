"""Dimension bindings are per thread and per call.

Several threads check, trace and run typechecked functions, explicit scopes and
``typed_shard_map`` functions at the same time, each with its own sizes (and its own mesh).
A ``threading.Barrier`` stops every thread between binding its names and checking them
again, so that all calls are in flight at once: any binding shared across threads would
show up as a spurious binding error or a wrong result.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from typeguard import TypeCheckError, typechecked

from shardlib import shardops
from shardlib.shardtypes import Scope, check, f32, typed_shard_map
from tests._mesh_util import make_mesh

N_THREADS = 4
ROUNDS = 3
TIMEOUT = 120  # seconds a thread may wait at a barrier before the test fails

# One mesh per thread: its 'd' axis has 8, 4, 2 or 8 devices, so per-device blocks differ.
MESHES = [
    make_mesh((8,), ("d",)),
    make_mesh((4, 2), ("d", "t")),
    make_mesh((2, 4), ("d", "t")),
    make_mesh((8,), ("d",), auto=True),
]


def sizes(i: int, r: int) -> tuple[int, int, int]:
    """(batch, len, out) of thread ``i`` in round ``r``: distinct across threads."""
    return 8 * (i + 1 + r), i + 2, i + 3 + r


def run_threads(work: Callable[[int, threading.Barrier], Any]) -> list[Any]:
    """Run ``work(i, barrier)`` in ``N_THREADS`` threads at once; re-raise the first error."""
    barrier = threading.Barrier(N_THREADS, timeout=TIMEOUT)
    results: list[Any] = [None] * N_THREADS
    errors: list[BaseException] = []

    def target(i: int) -> None:
        try:
            results[i] = work(i, barrier)
        except BaseException as e:  # noqa: BLE001 - handed to the main thread
            errors.append(e)
            barrier.abort()  # release the others rather than let them time out

    threads = [threading.Thread(target=target, args=(i,)) for i in range(N_THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT + 30)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    real = [e for e in errors if not isinstance(e, threading.BrokenBarrierError)]
    if real or errors:
        raise (real or errors)[0]
    return results


# ---------------------------------------------------------------------------------------------
# Typechecked functions
# ---------------------------------------------------------------------------------------------


@typechecked
def row_dot(x: f32[b"batch len"], y: f32[b"len"], barrier: threading.Barrier) -> f32[b"batch"]:
    h = shardops.einsum_unreduced("batch len, len -> batch", x, y)  # binds in the call scope
    barrier.wait()  # every thread has bound its own batch and len
    check(jnp.float32, "batch len", x)  # the call's scope still has this thread's sizes
    return h  # and the return value is checked against them


def test_typechecked_calls_eager_and_traced() -> None:
    rng = np.random.default_rng(0)
    data = {
        (i, r): (
            rng.standard_normal(sizes(i, r)[:2]).astype(np.float32),
            rng.standard_normal(sizes(i, r)[1]).astype(np.float32),
        )
        for i in range(N_THREADS)
        for r in range(ROUNDS)
    }

    def work(i: int, barrier: threading.Barrier) -> list[tuple[int, ...]]:
        shapes = []
        for r in range(ROUNDS):
            x, y = data[i, r]
            out = row_dot(jnp.asarray(x), jnp.asarray(y), barrier)
            np.testing.assert_allclose(np.asarray(out), x @ y, rtol=1e-5, atol=1e-5)
            traced = jax.jit(row_dot, static_argnums=2).trace(x, y, barrier)
            shapes.append(traced.out_info.shape)
        return shapes

    for i, shapes in enumerate(run_threads(work)):
        assert shapes == [(sizes(i, r)[0],) for r in range(ROUNDS)]


def test_explicit_scopes_are_per_thread() -> None:
    def work(i: int, barrier: threading.Barrier) -> list[str]:
        messages = []
        for r in range(ROUNDS):
            n = sizes(i, r)[0]
            with Scope() as s:
                check(jnp.float32, "n", jnp.zeros(n))
                barrier.wait()
                check(jnp.float32, "n k", jnp.zeros((n, i + 1)))
                assert s.bindings == {"n": n, "k": i + 1}
                # A mismatch is still caught, against this thread's binding.
                with pytest.raises(TypeCheckError) as e:
                    check(jnp.float32, "n", jnp.zeros(n + 1))
                messages.append(str(e.value))
                barrier.wait()  # nobody leaves its scope while others still check
        return messages

    for i, messages in enumerate(run_threads(work)):
        for r, msg in enumerate(messages):
            n = sizes(i, r)[0]
            assert f"expected size {n} (n={n} is already bound), got {n + 1}" in msg
            assert f"bindings: n={n}, k={i + 1}" in msg


# ---------------------------------------------------------------------------------------------
# typed_shard_map
# ---------------------------------------------------------------------------------------------


@functools.partial(typed_shard_map, static_argnames=("barrier",))
def matmul(
    x: f32[b"batch/d len"], w: f32[b"len out"], barrier: threading.Barrier
) -> f32[b"batch/d out"]:
    h = shardops.einsum_unreduced("batch/d len, len out -> batch/d out", x, w)
    barrier.wait()  # every thread is inside its own body, with its own bindings
    check(jnp.float32, "batch/d out", h)  # per-device block × this thread's |d|
    total = shardops.psum("", jnp.sum(h), axes="d")
    return h + 0 * total


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
def test_typed_shard_map_bodies_traced_at_once(jit: bool) -> None:
    rounds = ROUNDS if jit else 1  # eager shard_map is slow on CPU; one round suffices
    rng = np.random.default_rng(1)
    data = {
        (i, r): (
            rng.standard_normal(sizes(i, r)[:2]).astype(np.float32),
            rng.standard_normal(sizes(i, r)[1:]).astype(np.float32),
        )
        for i in range(N_THREADS)
        for r in range(rounds)
    }

    def work(i: int, barrier: threading.Barrier) -> list[tuple[Any, Any]]:
        layouts = []
        mesh = MESHES[i]
        f = jax.jit(matmul, static_argnames="barrier") if jit else matmul
        with jax.set_mesh(mesh):  # each thread has its own mesh in force
            for r in range(rounds):
                x, w = data[i, r]
                out = f(x, w, barrier=barrier)
                np.testing.assert_allclose(np.asarray(out), x @ w, rtol=1e-4, atol=1e-4)
                layouts.append((dict(out.sharding.mesh.shape), out.sharding.spec[0]))
        return layouts

    for i, layouts in enumerate(run_threads(work)):
        # The result lives on this thread's mesh, split over its 'd'.
        assert layouts == [(dict(MESHES[i].shape), "d")] * rounds


@functools.partial(typed_shard_map, static_argnames=("barrier",))
def wrong_return(x: f32[b"batch/d len"], barrier: threading.Barrier) -> f32[b"batch/d len"]:
    barrier.wait()
    return x[:, :1]


def test_errors_in_concurrent_bodies_name_their_own_sizes() -> None:
    """Every thread's error reports its own bindings, not another thread's."""

    def work(i: int, barrier: threading.Barrier) -> str:
        batch, length, _ = sizes(i, 0)
        with jax.set_mesh(MESHES[i]), pytest.raises(TypeCheckError) as e:
            jax.jit(wrong_return, static_argnames="barrier").trace(
                np.zeros((batch, length), np.float32), barrier=barrier
            )
        return str(e.value)

    for i, msg in enumerate(run_threads(work)):
        batch, length, _ = sizes(i, 0)
        assert "wrong_return()" in msg and "dim 1 'len'" in msg
        assert f"expected size {length} (len={length} is already bound), got 1" in msg
        assert f"bindings: batch={batch}, len={length}" in msg
