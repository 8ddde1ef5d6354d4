"""Numerics: bf16 and float32 through typed_shard_map + shardops, and out-of-range lookups.

* Matmuls split over a contracted mesh axis (``einsum_unreduced`` then ``psum`` or
  ``psum_scatter``) with bf16 inputs, accumulated in f32 (``preferred_element_type``) or in
  bf16, and with f32 inputs, compared with a float64 reference on the same (bf16-rounded)
  inputs. Tolerances are error bounds relative to ``|x| @ |w|`` (the sum of the magnitudes
  of the terms): about ``2**-24`` per rounding in f32 and ``2**-9`` in bf16.
* ``psum``/``psum_scatter``/``pmax`` of bf16 per-device values against float64 sums.
* ``index_unreduced`` with negative and out-of-range indices gives zero rows (it does not
  wrap like NumPy's ``a[-1]``), on sharded and unsharded tables, eagerly and under jit.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from shardlib import shardops
from shardlib.shardtypes import bf16, f32, i32, typed_shard_map
from shardlib.shardtypes import i8 as i8_t
from shardlib.shardtypes import u8 as u8_t
from tests._mesh_util import expect_pending, make_mesh, place

BF16 = ml_dtypes.bfloat16
EPS = {np.dtype(np.float32): 2.0**-24, np.dtype(BF16): 2.0**-9}  # unit roundoff
# (mesh shape, axis names, the tensor-parallel axes that split the contracted dim M)
MESHES = {
    "d4_t2": ((4, 2), ("d", "t"), ("t",)),
    "d2_t4": ((2, 4), ("d", "t"), ("t",)),
    "d2_t2_u2": ((2, 2, 2), ("d", "t", "u"), ("t", "u")),
}
_MESH_CACHE: dict[str, Any] = {}


def mesh_of(name: str) -> Any:
    if name not in _MESH_CACHE:
        shape, names, _ = MESHES[name]
        _MESH_CACHE[name] = make_mesh(shape, names)
    return _MESH_CACHE[name]


def tp_of(name: str) -> tuple[str, ...]:
    return MESHES[name][2]


def n_tp(name: str) -> int:
    sizes = dict(zip(MESHES[name][1], MESHES[name][0], strict=True))
    return math.prod(sizes[a] for a in tp_of(name))


def rounded(x: np.ndarray, dtype: Any) -> np.ndarray:
    """``x`` rounded to ``dtype`` (what the device sees)."""
    return np.asarray(x, np.float32).astype(dtype)


def assert_within(actual: Any, exact: np.ndarray, bound: np.ndarray, what: str) -> float:
    """``|actual - exact| <= bound`` elementwise; returns the largest error/bound ratio."""
    err = np.abs(np.asarray(actual, np.float64) - exact)
    ratio = err / np.maximum(bound, 1e-30)
    worst = np.unravel_index(np.argmax(ratio), ratio.shape)
    assert (err <= bound).all(), (
        f"{what}: error {err[worst]:.3g} > bound {bound[worst]:.3g} at {worst} "
        f"(actual {np.asarray(actual)[worst]}, exact {exact[worst]})"
    )
    return float(ratio.max())


# ---------------------------------------------------------------------------------------------
# Matmuls over a split contracted dim
# ---------------------------------------------------------------------------------------------


def matmul(mesh_name: str, in_t: Any, out_t: Any, *, scatter: bool, acc32: bool) -> Any:
    """``typed_shard_map`` of ``B/d M/tp, M/tp F -> B/d F`` reduced over ``tp``.

    The annotations are built here (for each mesh's tensor-parallel axes) and set on the
    function, as a decorator would read them.
    """
    tp = "/".join(tp_of(mesh_name))
    text = f"B/d M/{tp}, M/{tp} F -> B/d F"
    out_spec = f"B/d F/{tp}" if scatter else "B/d F"
    kwargs = {"preferred_element_type": jnp.float32} if acc32 else {}

    def body(x, w):
        y = shardops.einsum_unreduced(text, x, w, **kwargs)
        y = expect_pending(y, tp_of(mesh_name))
        if scatter:
            return shardops.psum_scatter(f"B/d F -> {out_spec}", y)
        return shardops.psum("B/d F", y, axes=tp)

    body.__annotations__ = {
        "x": in_t[f"B/d M/{tp}".encode()],
        "w": in_t[f"M/{tp} F".encode()],
        "return": out_t[out_spec.encode()],
    }
    return typed_shard_map(body, mesh=mesh_of(mesh_name)), out_spec


B, M, F = 8, 64, 16


def operands(seed: int, dtype: Any) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rounded(rng.standard_normal((B, M)), dtype)
    w = rounded(rng.standard_normal((M, F)), dtype)
    return x, w


def exact_and_scale(x: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The float64 product and ``|x| @ |w|``, the scale of its rounding errors."""
    x64, w64 = np.asarray(x, np.float64), np.asarray(w, np.float64)
    return x64 @ w64, np.abs(x64) @ np.abs(w64)


CASES = {
    # id: (input dtype, output dtype, accumulate in f32, rounding steps allowed)
    # bf16 inputs and f32 accumulation: products are exact in f32, only the sums round.
    "bf16_in_f32_acc": (bf16, f32, True, M),
    # bf16 throughout: the local partial rounds to bf16, then each of the |tp| - 1 additions
    # of the all-reduce rounds again; both relative to at most |x| @ |w|.
    "bf16_in_bf16_out": (bf16, bf16, False, None),
    "f32": (f32, f32, False, M),
}


@pytest.mark.parametrize("scatter", [False, True], ids=["psum", "psum_scatter"])
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("mesh_name", sorted(MESHES))
def test_matmul_split_contraction(mesh_name: str, case: str, scatter: bool) -> None:
    in_t, out_t, acc32, steps = CASES[case]
    f, out_spec = matmul(mesh_name, in_t, out_t, scatter=scatter, acc32=acc32)
    x, w = operands(seed=len(case) + 10 * len(mesh_name), dtype=in_t.dtype)
    exact, scale = exact_and_scale(x, w)
    mesh = mesh_of(mesh_name)
    with jax.set_mesh(mesh):
        y = jax.jit(f)(x, w)
    assert y.dtype == out_t.dtype
    assert y.sharding.spec == place(np.zeros((B, F)), mesh, out_spec).sharding.spec
    if steps is None:  # bf16 accumulation: 1 local rounding + (|tp| - 1) additions
        steps = n_tp(mesh_name)
    eps = EPS[np.dtype(out_t.dtype)]
    bound = 2 * steps * eps * scale + 1e-30
    assert_within(y, exact, bound, f"{case} on {mesh_name}")
    if out_t is bf16:
        # Not accidentally exact: bf16 really rounded (a sanity check of the setup).
        assert np.abs(np.asarray(y, np.float64) - exact).max() > 0


def test_bf16_accumulating_in_f32_is_more_accurate_than_in_bf16() -> None:
    mesh = mesh_of("d2_t4")
    x, w = operands(seed=3, dtype=BF16)
    exact, scale = exact_and_scale(x, w)
    errors = {}
    for acc32, out_t in ((True, f32), (False, bf16)):
        f, _ = matmul("d2_t4", bf16, out_t, scatter=False, acc32=acc32)
        with jax.set_mesh(mesh):
            y = np.asarray(jax.jit(f)(x, w), np.float64)
        errors[acc32] = np.abs(y - exact).max() / scale.max()
    assert errors[True] < 1e-6 < errors[False] < 2**-6


def test_bf16_matmul_eager_matches_jit() -> None:
    f, _ = matmul("d4_t2", bf16, f32, scatter=True, acc32=True)
    x, w = operands(seed=4, dtype=BF16)
    with jax.set_mesh(mesh_of("d4_t2")):
        np.testing.assert_array_equal(np.asarray(f(x, w)), np.asarray(jax.jit(f)(x, w)))


def test_bf16_gradient_through_split_contraction() -> None:
    """d/dw sum(y * c) = x^T c, in bf16 (the dtype of w), within bf16 rounding."""
    f, _ = matmul("d4_t2", bf16, f32, scatter=False, acc32=True)
    x, w = operands(seed=5, dtype=BF16)
    c = np.random.default_rng(6).standard_normal((B, F)).astype(np.float32)
    with jax.set_mesh(mesh_of("d4_t2")):
        g = jax.jit(jax.grad(lambda w_: jnp.sum(f(x, w_) * c)))(w)
    assert g.dtype == jnp.bfloat16
    x64 = np.asarray(x, np.float64)
    exact, scale = x64.T @ c, np.abs(x64).T @ np.abs(c)
    # The transposed einsum rounds the f32 cotangent to bf16 (w's dtype), may add its B
    # terms in bf16, and rounds the result: at most B + 2 roundings of size eps * scale.
    assert_within(g, exact, (B + 2) * EPS[np.dtype(BF16)] * scale, "grad w")


# ---------------------------------------------------------------------------------------------
# All-reduces of per-device values in bf16
# ---------------------------------------------------------------------------------------------


@typed_shard_map
def reduce_bf16(u: bf16[b"R/t B/d F"]) -> tuple[bf16[b"B/d F"], bf16[b"B/d F/t"], bf16[b"B/d F"]]:
    part = u[0]  # this device's value: one row of R per device of t
    return (
        shardops.psum("B/d F", part, axes="t"),
        shardops.psum_scatter("B/d F -> B/d F/t", part),
        shardops.pmax("B/d F", part, axes="t"),
    )


@pytest.mark.parametrize("mesh_name", ["d4_t2", "d2_t4"])
def test_bf16_all_reduces(mesh_name: str) -> None:
    mesh = mesh_of(mesh_name)
    t = n_tp(mesh_name)
    u = rounded(np.random.default_rng(7).standard_normal((t, B, F)) * 10, BF16)
    u64 = np.asarray(u, np.float64)
    with jax.set_mesh(mesh):
        summed, scattered, biggest = jax.jit(reduce_bf16)(u)
    # t values added with t - 1 bf16 roundings, each at most eps times the running magnitude
    bound = 2 * t * EPS[np.dtype(BF16)] * np.abs(u64).sum(0)
    for name, y in (("psum", summed), ("psum_scatter", scattered)):
        assert y.dtype == jnp.bfloat16
        assert_within(y, u64.sum(0), bound, f"{name} on {mesh_name}")
    np.testing.assert_array_equal(np.asarray(biggest, np.float64), u64.max(0))  # exact


# ---------------------------------------------------------------------------------------------
# index_unreduced: negative and out-of-range indices give zeros
# ---------------------------------------------------------------------------------------------

V = 16
ROWS = np.arange(V * 4, dtype=np.float32).reshape(V, 4) + 1  # no row is all zeros
IDX = np.array(
    [
        [0, 7, 15, -1, -2, -V, -V - 1, V],
        [V + 1, 100, 2**31 - 1, -(2**31), 3, -5, 12, 2 * V],
    ],
    dtype=np.int32,
)


def expected_lookup(table: np.ndarray, idx: np.ndarray) -> np.ndarray:
    idx64 = idx.astype(np.int64)
    ok = (idx64 >= 0) & (idx64 < table.shape[0])
    return np.where(ok[..., None], table[np.clip(idx64, 0, table.shape[0] - 1)], 0)


@typed_shard_map
def lookup_rows_split(table: f32[b"V/d M"], idx: i32[b"B L"]) -> f32[b"B L M"]:
    found = shardops.index_unreduced("[V/d] M, B L -> B L M", table, idx)
    return shardops.psum("B L M", found, axes="d")


@typed_shard_map
def lookup_rows_replicated(table: f32[b"V M"], idx: i32[b"B L/d"]) -> f32[b"B L/d M"]:
    return shardops.index_unreduced("[V] M, B L/d -> B L/d M", table, idx)


@typed_shard_map
def lookup_rows_two_axes(table: f32[b"V/y/x M"], idx: i32[b"B L"]) -> f32[b"B L M"]:
    found = shardops.index_unreduced("[V/y/x] M, B L -> B L M", table, idx)
    return shardops.psum("B L M", found, axes="x/y")


@typed_shard_map
def lookup_rows_and_cols_split(table: bf16[b"V/x M/y"], idx: i32[b"B L"]) -> bf16[b"B L M/y"]:
    found = shardops.index_unreduced("[V/x] M/y, B L -> B L M/y", table, idx)
    return shardops.psum("B L M/y", found, axes="x")


LOOKUPS = {
    "rows_split_1d": (lookup_rows_split, ((8,), ("d",)), np.float32),
    "rows_replicated_1d": (lookup_rows_replicated, ((8,), ("d",)), np.float32),
    "rows_split_two_axes": (lookup_rows_two_axes, ((4, 2), ("x", "y")), np.float32),
    "rows_and_cols_split_bf16": (lookup_rows_and_cols_split, ((4, 2), ("x", "y")), BF16),
}


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("case", sorted(LOOKUPS))
def test_index_out_of_range_gives_zeros(case: str, jit: bool) -> None:
    f, (shape, names), dtype = LOOKUPS[case]
    table = ROWS.astype(dtype)
    mesh = make_mesh(shape, names)
    with jax.set_mesh(mesh):
        out = np.asarray((jax.jit(f) if jit else f)(table, IDX))
    want = expected_lookup(table, IDX)
    np.testing.assert_array_equal(out, want)
    # Negative indices do not wrap around (NumPy's table[-1] is the last row).
    assert not out[0, 3].any() and not out[1, 3].any()
    assert (np.asarray(table[-1]) != 0).all()


@pytest.mark.parametrize(
    "idx_t, jit",
    [
        (i8_t, False),
        (u8_t, False),
        (i32, False),
        # Under jit a narrow index dtype once wrapped the block size (300 -> 44).
        (i8_t, True),
        (u8_t, True),
        (i32, True),
    ],
    ids=["i8-eager", "u8-eager", "i32-eager", "i8-jit", "u8-jit", "i32-jit"],
)
def test_index_narrow_dtypes_without_a_mesh(idx_t: Any, jit: bool) -> None:
    """Outside shard_map (no mesh) with narrow index dtypes and a table longer than they
    can address; every representable index, including negative ones, is tried."""
    info = np.iinfo(idx_t.dtype)
    idx = np.arange(max(info.min, -300), min(info.max, 400) + 1).astype(idx_t.dtype)
    table = np.arange(300 * 2, dtype=np.float32).reshape(300, 2) + 1

    def lookup(t, i):
        return shardops.index_unreduced("[V] M, B -> B M", t, i)

    out = np.asarray((jax.jit(lookup) if jit else lookup)(table, idx))
    np.testing.assert_array_equal(out, expected_lookup(table, idx))
