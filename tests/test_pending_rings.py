"""Partial sums sent round a ring: a full permutation over the pending axes keeps the sum.

The partial-sum analysis (`shardlib._analysis.rules_permute`) accepts a ``ppermute`` /
``shardops.shift`` of a value pending over the axes it permutes when the permutation is full
(every device sends once and receives once) and maps each group of devices one sum runs over
onto such a group; it refuses a partial permutation (some device receives zeros, some block
is dropped), one that mixes the groups, and one over an axis whose size it does not know.
The ring reduce-scatter matmul written with checked ops runs on 1-D and 2-D meshes, and its
values and gradients match jax.numpy on the global arrays.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from shardlib import shardops
from shardlib._analysis.walk import check_body
from shardlib.shardops import PendingReductionError
from shardlib.shardtypes import Array, f32, typed_shard_map
from tests._mesh_util import expect_pending, make_mesh, place

# (mesh shape, names, spec of a, spec of the ring's output): 'i' is the ring's axis.
MESHES = {
    "i4": ((4,), ("i",), "M K/i", "M/i N"),
    "i8": ((8,), ("i",), "M K/i", "M/i N"),
    "d2i4": ((2, 4), ("d", "i"), "M/d K/i", "M/d/i N"),
}
_MADE: dict[str, Any] = {}


def _mesh(key: str) -> Any:
    if key not in _MADE:
        shape, names, _, _ = MESHES[key]
        _MADE[key] = make_mesh(shape, names)
    return _MADE[key]


def _data(seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((16, 16)).astype(np.float32)
    b = rng.standard_normal((16, 3)).astype(np.float32)
    w = rng.standard_normal((16, 3)).astype(np.float32)
    return a, b, w


def _ring(a_spec: str, out_spec: str) -> Any:
    """The ring reduce-scatter matmul with checked ops: each step sends the accumulator one
    device back along 'i' and adds this device's partial product for the block it now holds."""

    @typed_shard_map
    def ring(
        a: f32[Array, a_spec.encode()], b: f32[Array, b"K/i N"]
    ) -> f32[Array, out_spec.encode()]:
        n, me = shardops.axis_size("i"), shardops.axis_index("i")
        rows = a.shape[0] // n

        def partial(k: int) -> jax.Array:
            block = lax.dynamic_slice_in_dim(a, ((me + k + 1) % n) * rows, rows, axis=0)
            return shardops.einsum_unreduced("R K/i, K/i N -> R N", block, b)

        acc = partial(0)
        for k in range(1, n):
            acc = shardops.shift("R N", acc, "i", offset=-1) + partial(k)
        acc = expect_pending(acc, ("i",))  # still a partial sum to the analysis
        return shardops.assume_reduced(acc)

    return ring


def _reduce_scatter(a_spec: str, out_spec: str) -> Any:
    @typed_shard_map
    def ref(
        a: f32[Array, a_spec.encode()], b: f32[Array, b"K/i N"]
    ) -> f32[Array, out_spec.encode()]:
        return shardops.einsum(f"{a_spec}, K/i N -> {out_spec}", a, b)

    return ref


@pytest.mark.parametrize("key", sorted(MESHES))
def test_ring_reduce_scatter_matmul_values_and_gradients(key: str) -> None:
    mesh = _mesh(key)
    _, _, a_spec, out_spec = MESHES[key]
    ring, ref = _ring(a_spec, out_spec), _reduce_scatter(a_spec, out_spec)
    a, b, w = _data()

    def loss(f: Any) -> Any:
        return lambda a, b: jnp.sum(jnp.asarray(w) * f(a, b))

    with jax.set_mesh(mesh):
        ga, gb = place(a, mesh, a_spec), place(b, mesh, "K/i N")
        got = np.asarray(jax.jit(ring)(ga, gb))
        np.testing.assert_allclose(got, a @ b, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(got, np.asarray(jax.jit(ref)(ga, gb)), rtol=1e-5, atol=1e-5)
        da, db = jax.jit(jax.grad(loss(ring), argnums=(0, 1)))(ga, gb)
    want_a, want_b = jax.grad(loss(jnp.matmul), argnums=(0, 1))(jnp.asarray(a), jnp.asarray(b))
    np.testing.assert_allclose(np.asarray(da), np.asarray(want_a), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(db), np.asarray(want_b), rtol=1e-5, atol=1e-5)


def _shifted_sum(a_spec: str, move: Any) -> Any:
    """einsum_unreduced over 'i', ``move`` applied to the partial sum, then psum over 'i'."""
    out_spec = a_spec.replace(" K/i", " N")

    @typed_shard_map
    def f(a: f32[Array, a_spec.encode()], b: f32[Array, b"K/i N"]) -> f32[Array, out_spec.encode()]:
        y = shardops.einsum_unreduced(f"{a_spec}, K/i N -> {out_spec}", a, b)
        y = expect_pending(move(y, out_spec), ("i",))
        return shardops.psum(out_spec, y, axes="i")

    return f


def _run(key: str, move: Any, reference: Any = jnp.matmul) -> None:
    """`_shifted_sum` on mesh ``key``: its value and its gradient (of a weighted sum, with
    respect to both operands) match ``reference`` on the global arrays."""
    mesh = _mesh(key)
    a_spec = MESHES[key][2]
    f = _shifted_sum(a_spec, move)
    a, b, w = _data(1)

    def loss(g: Any) -> Any:
        return lambda a, b: jnp.sum(jnp.asarray(w) * g(a, b))

    with jax.set_mesh(mesh):
        ga, gb = place(a, mesh, a_spec), place(b, mesh, "K/i N")
        got = np.asarray(jax.jit(f)(ga, gb))
        grads = jax.jit(jax.grad(loss(f), argnums=(0, 1)))(ga, gb)
    want = reference(jnp.asarray(a), jnp.asarray(b))
    want_grads = jax.grad(loss(reference), argnums=(0, 1))(jnp.asarray(a), jnp.asarray(b))
    np.testing.assert_allclose(got, np.asarray(want), rtol=1e-5, atol=1e-5)
    for g, wg in zip(grads, want_grads, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(wg), rtol=1e-5, atol=1e-5)


def _trace(key: str, move: Any) -> None:
    mesh = _mesh(key)
    a_spec = MESHES[key][2]
    a, b, _ = _data(1)
    with jax.set_mesh(mesh):
        jax.jit(_shifted_sum(a_spec, move)).trace(place(a, mesh, a_spec), place(b, mesh, "K/i N"))


# -- accepted: full permutations over the pending axis ------------------------------------------


@pytest.mark.parametrize("key", sorted(MESHES))
@pytest.mark.parametrize("offset", [1, -1, 3])
def test_cyclic_shift_of_a_partial_sum_then_psum(key: str, offset: int) -> None:
    _run(key, lambda y, s: shardops.shift(s, y, "i", offset=offset))


@pytest.mark.parametrize("key", sorted(MESHES))
def test_full_ppermute_in_reversed_order_keeps_the_sum(key: str) -> None:
    n = MESHES[key][0][-1]
    perm = [(k, n - 1 - k) for k in range(n)]
    _run(key, lambda y, s: shardops.ppermute(s, y, "i", perm))
    _run(key, lambda y, s: lax.ppermute(y, "i", perm))


def test_shift_of_a_known_zero_partial_sum_stays_known_zero() -> None:
    """0 * (partial sum) is known zero; shifted, it may still be added to a non-partial sum
    only as zero: here it is added to another partial sum over 'i', which stays pending."""

    def move(y: jax.Array, s: str) -> jax.Array:
        zero = shardops.shift(s, y * 0.0, "i", offset=1, wrap=False)  # partial, but zeros
        return y + zero

    _run("i4", move)


# -- refused: partial permutations ----------------------------------------------------------------


def test_non_cyclic_shift_is_refused_naming_the_devices_and_the_fix() -> None:
    msg = (
        r"shardops\.shift\('M N'\) .* is not a full permutation over mesh axis 'i' \(device 0 "
        r"of 'i' receives nothing and the block of device 3 of 'i' is sent nowhere\): a device "
        r"that receives no block gets zeros and a block that is not sent is dropped, so the sum "
        r"over mesh axis 'i' would lose those shares.*made by einsum_unreduced.*wrap=True.*psum"
    )
    with pytest.raises(PendingReductionError, match=msg):
        _trace("i4", lambda y, s: shardops.shift(s, y, "i", offset=1, wrap=False))


def test_non_cyclic_shift_is_refused_on_a_2d_mesh() -> None:
    with pytest.raises(PendingReductionError, match=r"device 3 of 'i' receives nothing"):
        _trace("d2i4", lambda y, s: shardops.shift(s, y, "i", offset=-1, wrap=False))


@pytest.mark.parametrize("lib", ["shardops", "lax"])
def test_ppermute_missing_one_pair_is_refused(lib: str) -> None:
    perm = [(k, (k + 1) % 4) for k in range(3)]  # (3, 0) left out

    def move(y: jax.Array, s: str) -> jax.Array:
        if lib == "lax":
            return lax.ppermute(y, "i", perm)
        return shardops.ppermute(s, y, "i", perm)

    msg = r"device 0 of 'i' receives nothing and the block of device 3 of 'i' is sent nowhere"
    with pytest.raises(PendingReductionError, match=msg):
        _trace("i4", move)


def test_a_partial_permutation_over_another_axis_keeps_the_pending_axis() -> None:
    """Over 'd', where the value is not pending, devices that receive nothing get zeros: the
    permuted sum (zeros there), as before."""

    def reference(a: jax.Array, b: jax.Array) -> jax.Array:
        halves = (a @ b).reshape(2, 8, 3)  # the 'd' blocks: block 1 gets block 0's, 0 zeros
        return jnp.stack([jnp.zeros_like(halves[0]), halves[0]]).reshape(16, 3)

    _run("d2i4", lambda y, s: shardops.shift(s, y, "d", offset=1, wrap=False), reference)


# -- permutations over several axes: groups (fibers) onto groups ------------------------------------


def _linear(d: int, i: int) -> int:
    return d * 4 + i  # row-major over ('d', 'i') on the (2, 4) mesh


@pytest.mark.parametrize("swap", [False, True], ids=["same-d", "swap-d"])
def test_ppermute_over_two_axes_mapping_groups_onto_groups_is_accepted(swap: bool) -> None:
    """Pending over 'i' only; the perm cycles over 'i' within each 'd' (and may swap the two
    'd' groups whole): each group's sum over 'i' arrives whole at one group."""
    perm = [
        (_linear(d, i), _linear(1 - d if swap else d, (i + 1) % 4))
        for d in range(2)
        for i in range(4)
    ]

    def reference(a: jax.Array, b: jax.Array) -> jax.Array:
        halves = (a @ b).reshape(2, 8, 3)  # the 'd' blocks, swapped or not
        return (halves[::-1] if swap else halves).reshape(16, 3)

    _run("d2i4", lambda y, s: lax.ppermute(y, ("d", "i"), perm), reference)


def test_ppermute_over_two_axes_mixing_groups_is_refused() -> None:
    perm = [(k, (k + 1) % 8) for k in range(8)]  # (0, 3) -> (1, 0): across the 'd' groups
    msg = (
        r"permutes over mesh axes 'd', 'i' .* sends the devices of group \(d=0\), whose shares "
        r"make one sum over mesh axis 'i', to several groups \(\(d=0\), \(d=1\)\).*psum"
    )
    with pytest.raises(PendingReductionError, match=msg):
        _trace("d2i4", lambda y, s: lax.ppermute(y, ("d", "i"), perm))


def test_ppermute_over_two_axes_named_out_of_mesh_order_must_keep_groups_in_both_numberings() -> (
    None
):
    """Numbered over ('i', 'd') as named, k -> k + 2 cycles 'i' within each 'd'; numbered in
    mesh order ('d', 'i'), as older JAX does, it mixes the 'd' groups: refused."""
    perm = [(k, (k + 2) % 8) for k in range(8)]
    with pytest.raises(PendingReductionError, match=r"row-major over \('d', 'i'\)"):
        _trace("d2i4", lambda y, s: lax.ppermute(y, ("i", "d"), perm))


def test_ppermute_over_all_pending_axes_needs_only_fullness() -> None:
    mesh = _mesh("d2i4")
    perm = [(k, (k + 3) % 8) for k in range(8)]

    @typed_shard_map
    def f(a: f32[Array, b"M K/d/i"], b: f32[Array, b"K/d/i N"]) -> f32[Array, b"M N"]:
        y = shardops.einsum_unreduced("M K/d/i, K/d/i N -> M N", a, b)
        y = expect_pending(lax.ppermute(y, ("d", "i"), perm), ("d", "i"))
        return shardops.psum("M N", y, axes="d/i")

    a, b, _ = _data(2)
    with jax.set_mesh(mesh):
        got = jax.jit(f)(place(a, mesh, "M K/d/i"), place(b, mesh, "K/d/i N"))
    np.testing.assert_allclose(np.asarray(got), a @ b, rtol=1e-5, atol=1e-5)


# -- sizes the analysis does not know -----------------------------------------------------------------


def test_unknown_axis_size_cannot_prove_the_permutation_full() -> None:
    perm = [(k, (k + 1) % 4) for k in range(4)]
    body = jax.make_jaxpr(lambda y: lax.ppermute(y, "i", perm), axis_env=[("i", 4)])(
        np.ones((2, 2), np.float32)
    )
    typed = {"in_unreduced": [frozenset({"i"})], "out_unreduced": [frozenset({"i"})]}
    with pytest.raises(PendingReductionError, match="cannot prove the permutation is full"):
        check_body(body, [frozenset()], "f", **typed)  # type: ignore[arg-type]
    check_body(body, [frozenset()], "f", axis_sizes={"i": 4}, **typed)  # type: ignore[arg-type]
    with pytest.raises(PendingReductionError, match="is not a full permutation"):
        check_body(body, [frozenset()], "f", axis_sizes={"i": 8}, **typed)  # type: ignore[arg-type]


# -- docs/guide/pending.md quotes the real refusal ------------------------------------------------


@typed_shard_map
def shifted_without_wrap(a: f32[Array, b"M K/i"], b: f32[Array, b"K/i N"]) -> f32[Array, b"M N"]:
    y = shardops.einsum_unreduced("M K/i, K/i N -> M N", a, b)
    y = shardops.shift("M N", y, "i", offset=-1, wrap=False)
    return shardops.psum("M N", y, axes="i")


def test_docs_quote_the_real_non_cyclic_shift_error() -> None:
    a, b, _ = _data(3)
    with jax.set_mesh(_mesh("i8")), pytest.raises(PendingReductionError) as info:
        jax.jit(shifted_without_wrap).trace(a, b)
    doc = (Path(__file__).parent.parent / "docs" / "guide" / "pending.md").read_text()

    def normalized(text: str) -> str:
        return re.sub(r"[\w.]+\.py:\d+", "FILE:LINE", text)

    msg = str(info.value).splitlines()[0]
    assert normalized(msg) in normalized(doc), f"docs/guide/pending.md lacks:\n{msg}"


def test_ring_inside_a_fori_loop_is_followed_with_the_mesh_sizes() -> None:
    """The loop body's rounds and its checking round know the axis sizes too."""
    mesh = _mesh("i4")

    @typed_shard_map
    def ring(a: f32[Array, b"M K/i"], b: f32[Array, b"K/i N"]) -> f32[Array, b"M/i N"]:
        n, me = shardops.axis_size("i"), shardops.axis_index("i")
        rows = a.shape[0] // n

        def partial(k: Any) -> jax.Array:
            block = lax.dynamic_slice_in_dim(a, ((me + k + 1) % n) * rows, rows, axis=0)
            return shardops.einsum_unreduced("R K/i, K/i N -> R N", block, b)

        def step(k: Any, acc: jax.Array) -> jax.Array:
            return shardops.shift("R N", acc, "i", offset=-1) + partial(k)

        return shardops.assume_reduced(lax.fori_loop(1, n, step, partial(0)))

    a, b, _ = _data(4)
    with jax.set_mesh(mesh):
        got = jax.jit(ring)(place(a, mesh, "M K/i"), place(b, mesh, "K/i N"))
    np.testing.assert_allclose(np.asarray(got), a @ b, rtol=1e-5, atol=1e-5)
