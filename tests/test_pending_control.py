"""Partial sums under per-device control flow, deep loop carries, forward-mode AD, non-linear
roles that look linear, and a body whose program changes between calls (issue 22).

Every broken program must fail at trace time, with check_vma off and on, with a message that
names the op, its line and the op that made the partial sum. The correct programs beside them
(false alarms once) must compute what jax.numpy computes on the global arrays, gradients
included.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from shardlib import shardops
from shardlib.shardops import PendingReductionError
from shardlib.shardtypes import f32, typed_shard_map
from tests._mesh_util import make_mesh

VMA = pytest.mark.parametrize("check_vma", [False, True], ids=["vma-off", "vma-on"])


def normal(seed: int, shape: tuple[int, ...]) -> np.ndarray:
    return np.random.RandomState(seed).standard_normal(shape).astype(np.float32)


X, W = normal(1, (8, 16)), normal(2, (16, 8))


def E(x: jax.Array, w: jax.Array) -> jax.Array:
    """A partial sum over 't' (its contracted dim F is split over 't')."""
    return shardops.einsum_unreduced("B/d F/t, F/t M -> B/d M", x, w)


def reduce_t(y: jax.Array) -> jax.Array:
    return shardops.psum("B/d M", y, axes="t")


def _t0() -> jax.Array:
    return lax.axis_index("t") == 0


# -- 1. per-device control flow around partial sums made inside it -------------------------------


def cond_made_inside(x: f32[b"B/d F/t"], w: f32[b"F/t M"]) -> f32[b"B/d M"]:
    y = lax.cond(_t0(), lambda: E(x, w), lambda: 2 * E(x, w))
    return reduce_t(y)


def cond_zero_branch(x: f32[b"B/d F/t"], w: f32[b"F/t M"]) -> f32[b"B/d M"]:
    y = lax.cond(_t0(), lambda: E(x, w), lambda: jnp.zeros((2, 8)))
    return reduce_t(y)


def switch_made_inside(x: f32[b"B/d F/t"], w: f32[b"F/t M"]) -> f32[b"B/d M"]:
    branches = [lambda: E(x, w), lambda: 3 * E(x, w)]
    return reduce_t(lax.switch(lax.axis_index("t"), branches))


def fori_trip_count(x: f32[b"B/d F/t"], w: f32[b"F/t M"]) -> f32[b"B/d M"]:
    n = lax.axis_index("t") + 1
    y = lax.fori_loop(0, n, lambda i, acc: acc + E(x, w), jnp.zeros((2, 8)))
    return reduce_t(y)


def while_predicate(x: f32[b"B/d F/t"], w: f32[b"F/t M"]) -> f32[b"B/d M"]:
    def body(c):
        i, acc = c
        return i + 1, acc + E(x, w)

    _, y = lax.while_loop(lambda c: c[0] <= lax.axis_index("t"), body, (0, jnp.zeros((2, 8))))
    return reduce_t(y)


def while_predicate_via_carry(x: f32[b"B/d F/t"], w: f32[b"F/t M"]) -> f32[b"B/d M"]:
    """The predicate reads a carry slot that becomes per-device only in the loop body."""

    def body(c):
        i, lim, acc = c
        return i + 1, lim + lax.axis_index("t"), acc + E(x, w)

    _, _, y = lax.while_loop(lambda c: c[0] < c[1], body, (0, 1, jnp.zeros((2, 8))))
    return reduce_t(y)


# -- 2. a loop carry chain deeper than any iteration cap ------------------------------------------


def deep_carry_chain(x: f32[b"B/d F/t"], w: f32[b"F/t M"]) -> f32[b"B/d M"]:
    depth = 12
    z = jnp.zeros((2, 8))

    def step(c, _):
        first = E(x, w)
        shifted = (first, *c[:-1])
        return shifted, jnp.tanh(c[-1])  # the last slot meets a non-linear op

    carry, ys = lax.scan(step, (z,) * depth, None, length=depth + 2)
    return reduce_t(carry[0]) + ys[-1]


# -- 3. forward-mode AD: tangents of partial sums are partial sums --------------------------------


def jvp_tangent(x: f32[b"B/d F/t"], w: f32[b"F/t M"]) -> f32[b"B/d M"]:
    _, t = jax.jvp(lambda v: E(v, w), (x,), (x,))
    return reduce_t(jnp.tanh(t))


def linearize_tangent(x: f32[b"B/d F/t"], w: f32[b"F/t M"]) -> f32[b"B/d M"]:
    _, f_lin = jax.linearize(lambda v: E(v, w), x)
    return reduce_t(jnp.tanh(f_lin(x)))


def jacfwd_tangent(x: f32[b"B/d F/t"], w: f32[b"F/t M"]) -> f32[b"B/d M"]:
    jac = jax.jacfwd(lambda s: E(x * s, w))(1.0)
    return reduce_t(jnp.tanh(jac))


# -- 4. non-linear roles that look linear ------------------------------------------------------


def Ei(x: jax.Array, w: jax.Array) -> jax.Array:
    """An integer partial sum over 't' (as from an integer table or a count)."""
    xi, wi = (x * 4).astype(jnp.int32), (w * 4).astype(jnp.int32)
    return shardops.einsum_unreduced("B/d F/t, F/t M -> B/d M", xi, wi)


def as_selector(x: f32[b"B/d F/t"], w: f32[b"F/t M"]) -> f32[b"B/d M"]:
    p = lax.psum(x[:, :8], "t")
    return lax.select_n(Ei(x, w), p, 2 * p)


def as_bool_selector(x: f32[b"B/d F/t"], w: f32[b"F/t M"]) -> f32[b"B/d M"]:
    p = lax.psum(x[:, :8], "t")
    which = shardops.linear(lambda v: v.astype(bool), E(x, w))  # a false claim of linearity
    return lax.select_n(which, p, 2 * p)


_ROWS = lax.GatherDimensionNumbers(
    offset_dims=(1,), collapsed_slice_dims=(0,), start_index_map=(0,)
)


def as_gather_index(x: f32[b"B/d F/t"], w: f32[b"F/t M"]) -> f32[b"B/d M"]:
    table = lax.psum(jnp.ones((16, 8)), "t")
    i = Ei(x, w)[:, :1]
    return lax.gather(table, i, _ROWS, (1, 8), mode="clip")


def as_scatter_index(x: f32[b"B/d F/t"], w: f32[b"F/t M"]) -> f32[b"B/d M"]:
    base = lax.psum(x[:, :8], "t")
    i = Ei(x, w)[:, :1]
    dn = lax.ScatterDimensionNumbers((1,), (0,), (0,))
    return lax.scatter_add(base, i, jnp.ones((2, 8)), dn, mode="clip")


def integer_division(x: f32[b"B/d F/t"], w: f32[b"F/t M"]) -> f32[b"B/d M"]:
    y = shardops.linear(lambda v: jnp.round(v * 10).astype(jnp.int32), E(x, w))
    return lax.psum(y // 3, "t").astype(jnp.float32)


def narrow_and_widen(x: f32[b"B/d F/t"], w: f32[b"F/t M"]) -> f32[b"B/d M"]:
    y = shardops.linear(lambda v: jnp.round(v * 100).astype(jnp.int32), E(x, w))
    z = y.astype(jnp.int8).astype(jnp.int32)
    return lax.psum(z, "t").astype(jnp.float32)


def reduce_with_mul(x: f32[b"B/d F/t"], w: f32[b"F/t M"]) -> f32[b"B/d M"]:
    y = E(x, w)
    r = lax.reduce(y, np.float32(1), lax.mul, (1,))
    return jnp.broadcast_to(lax.psum(r, "t")[:, None], (2, 8))


def reduce_with_nonzero_init(x: f32[b"B/d F/t"], w: f32[b"F/t M"]) -> f32[b"B/d M"]:
    y = E(x, w)
    r = lax.reduce(y, np.float32(1), lax.add, (1,))
    return jnp.broadcast_to(lax.psum(r, "t")[:, None], (2, 8))


def reduce_window_max(x: f32[b"B/d F/t"], w: f32[b"F/t M"]) -> f32[b"B/d M"]:
    y = E(x, w)
    r = lax.reduce_window(y, -np.inf, lax.max, (1, 2), (1, 2), "VALID")
    return jnp.concatenate([lax.psum(r, "t")] * 2, axis=1)


def reduce_window_mul(x: f32[b"B/d F/t"], w: f32[b"F/t M"]) -> f32[b"B/d M"]:
    y = E(x, w)
    r = lax.reduce_window(y, np.float32(1), lax.mul, (1, 2), (1, 2), "VALID")
    return jnp.concatenate([lax.psum(r, "t")] * 2, axis=1)


def gather_fill(x: f32[b"B/d F/t"], w: f32[b"F/t M"]) -> f32[b"B/d M"]:
    y = E(x, w)
    g = y.at[jnp.arange(8) - 2].get(mode="fill", fill_value=1.0)
    return reduce_t(g[:2])


def gather_fill_of_zeros(x: f32[b"B/d F/t"], w: f32[b"F/t M"]) -> f32[b"B/d M"]:
    """A buffer gathered with a non-zero fill is not "known zero": adding it is refused."""
    buf = jnp.zeros((2, 8)).at[jnp.arange(2) + 1].get(mode="fill", fill_value=1.0)
    return reduce_t(E(x, w) + buf)


WRONG: list[tuple[str, Callable, tuple[str, ...]]] = [
    ("cond-made-inside", cond_made_inside, ("cond", "differs across the devices")),
    ("cond-zero-branch", cond_zero_branch, ("cond", "differs across the devices")),
    ("switch-made-inside", switch_made_inside, ("cond", "differs across the devices")),
    ("fori-trip-count", fori_trip_count, ("while", "differs across the devices")),
    ("while-predicate", while_predicate, ("while", "differs across the devices")),
    ("while-via-carry", while_predicate_via_carry, ("while", "differs across the devices")),
    ("deep-carry-chain", deep_carry_chain, ("`tanh`",)),
    ("jvp-tangent", jvp_tangent, ("`tanh`",)),
    ("linearize-tangent", linearize_tangent, ("`tanh`",)),
    ("jacfwd-tangent", jacfwd_tangent, ("`tanh`",)),
    ("selector", as_selector, ("`select_n`", "selector")),
    ("bool-selector", as_bool_selector, ("`select_n`", "selector")),
    ("gather-index", as_gather_index, ("`gather`", "gather indices")),
    ("scatter-index", as_scatter_index, ("`scatter-add`", "scatter indices")),
    ("integer-division", integer_division, ("`div`", "integer")),
    ("narrow-and-widen", narrow_and_widen, ("`convert_element_type`", "int32 to int8")),
    ("reduce-mul", reduce_with_mul, ("`reduce", "mul")),
    ("reduce-init", reduce_with_nonzero_init, ("`reduce", "initial value")),
    ("reduce-window-max", reduce_window_max, ("`reduce_window",)),
    ("reduce-window-mul", reduce_window_mul, ("`reduce_window", "mul")),
    ("gather-fill", gather_fill, ("`gather`", "fill")),
    ("gather-fill-zeros", gather_fill_of_zeros, ("`add`",)),
]


def _mesh():
    return make_mesh((4, 2), ("d", "t"))


@VMA
@pytest.mark.parametrize("case", WRONG, ids=[c[0] for c in WRONG])
def test_wrong_program_is_refused(case, check_vma: bool) -> None:
    _, body, needles = case
    f = typed_shard_map(body, check_vma=check_vma)
    with jax.set_mesh(_mesh()), pytest.raises(PendingReductionError) as info:
        jax.jit(f).trace(X, W)
    msg = str(info.value)
    assert "einsum_unreduced('B/d F/t, F/t M -> B/d M') at test_pending_control.py:" in msg, msg
    assert f"in {body.__name__}()" in msg and "test_pending_control.py:" in msg, msg
    for n in needles:
        assert n in msg, f"{n!r} not in {msg}"


# -- correct programs: once refused, now computed right ------------------------------------------


def scatter_multiply(x: f32[b"B/d F/t"], w: f32[b"F/t M"]) -> f32[b"B/d M"]:
    return reduce_t(E(x, w).at[:, 0].multiply(2.0))


def scatter_divide(x: f32[b"B/d F/t"], w: f32[b"F/t M"]) -> f32[b"B/d M"]:
    return reduce_t(E(x, w).at[1:, 2:5].divide(4.0))


def concat_host_zeros(x: f32[b"B/d F/t"], w: f32[b"F/t M"]) -> f32[b"B/d M"]:
    y = jnp.concatenate([E(x, w)[:, :6], np.zeros((2, 2), np.float32)], axis=1)
    return reduce_t(y)


def cond_same_on_t(x: f32[b"B/d F/t"], w: f32[b"F/t M"]) -> f32[b"B/d M"]:
    """A predicate that varies over 'd' only: each 't' group takes one branch together."""
    y = lax.cond(lax.axis_index("d") == 0, lambda: E(x, w), lambda: 2 * E(x, w))
    return reduce_t(y)


def fori_trip_count_on_d(x: f32[b"B/d F/t"], w: f32[b"F/t M"]) -> f32[b"B/d M"]:
    n = lax.axis_index("d") % 2 + 1
    y = lax.fori_loop(0, n, lambda i, acc: acc + E(x, w), x[:, :8] * 0)
    return reduce_t(y)


def jvp_reduced(x: f32[b"B/d F/t"], w: f32[b"F/t M"]) -> f32[b"B/d M"]:
    y, t = jax.jvp(lambda v: E(v, w), (x,), (x,))
    return jnp.tanh(reduce_t(t)) + reduce_t(y)


def tile_partial(x: f32[b"B/d F/t"], w: f32[b"F/t M"]) -> f32[b"B/d M"]:
    y = jnp.tile(E(x, w)[:, :4], (1, 2))
    return reduce_t(y)


def _ref_plain(x, w):
    return x @ w


def _ref_jvp(x, w):
    return np.tanh(x @ w) + x @ w


def _ref_tile(x, w):
    y = x @ w
    return np.tile(y[:, :4], (1, 2))


def _ref_cond_d(x, w):
    y = x @ w
    scale = np.repeat([1.0, 2.0, 2.0, 2.0], 2)[:, None]
    return y * scale


def _ref_fori_d(x, w):
    y = x @ w
    return y * np.repeat([1.0, 2.0, 1.0, 2.0], 2)[:, None]


def _ref_scatter_mul(x, w):
    y = x @ w
    y[:, 0] *= 2
    return y


def _ref_scatter_div(x, w):
    y = (x @ w).reshape(4, 2, 8)
    y[:, 1:, 2:5] /= 4
    return y.reshape(8, 8)


def _ref_concat(x, w):
    y = (x @ w).copy()
    y[:, 6:] = 0
    return y


def reduce_carry_started_as_zeros(x: f32[b"B/d F/t"], w: f32[b"F/t M"]) -> f32[b"B/d M"]:
    """A reduction of a carry slot that is zeros on the first round and a partial sum later:
    the fixpoint decides, not the first round (the psum of zeros there is harmless)."""
    y = E(x, w)
    z = jnp.zeros_like(y)

    def step(c, _):
        return (y, c[0]), reduce_t(c[1])

    _, ys = lax.scan(step, (z, z), None, length=3)
    return ys[-1]


RIGHT: list[tuple[str, Callable, Callable]] = [
    ("reduce-carry-started-as-zeros", reduce_carry_started_as_zeros, _ref_plain),
    ("scatter-multiply", scatter_multiply, _ref_scatter_mul),
    ("scatter-divide", scatter_divide, _ref_scatter_div),
    ("concat-host-zeros", concat_host_zeros, _ref_concat),
    ("cond-on-other-axis", cond_same_on_t, _ref_cond_d),
    ("fori-on-other-axis", fori_trip_count_on_d, _ref_fori_d),
    ("jvp-reduced", jvp_reduced, _ref_jvp),
    ("tile", tile_partial, _ref_tile),
]


@VMA
@pytest.mark.parametrize("case", RIGHT, ids=[c[0] for c in RIGHT])
def test_correct_program_matches_numpy(case, check_vma: bool) -> None:
    _, body, ref = case
    f = typed_shard_map(body, check_vma=check_vma)
    with jax.set_mesh(_mesh()):
        out = np.asarray(jax.jit(f)(X, W))
        np.testing.assert_allclose(out, ref(X.astype(np.float64), W), rtol=1e-4, atol=1e-4)
        if check_vma and body is not fori_trip_count_on_d:  # no reverse mode: dynamic trip count
            gx, gw = jax.jit(jax.grad(lambda a, b: jnp.sum(jnp.sin(f(a, b))), (0, 1)))(X, W)
            rx, rw = jax.grad(lambda a, b: jnp.sum(jnp.sin(_jnp_ref(ref, a, b))), (0, 1))(X, W)
            np.testing.assert_allclose(np.asarray(gx), np.asarray(rx), rtol=1e-3, atol=1e-3)
            np.testing.assert_allclose(np.asarray(gw), np.asarray(rw), rtol=1e-3, atol=1e-3)


def _jnp_ref(ref: Callable, a: jax.Array, b: jax.Array) -> jax.Array:
    """The numpy reference, traced with jax.numpy (for its gradient)."""
    y = a @ b
    name = ref.__name__
    if name == "_ref_tile":
        return jnp.tile(y[:, :4], (1, 2))
    if name == "_ref_cond_d":
        return y * jnp.asarray(np.repeat([1.0, 2.0, 2.0, 2.0], 2), jnp.float32)[:, None]
    if name == "_ref_fori_d":
        return y * jnp.asarray(np.repeat([1.0, 2.0, 1.0, 2.0], 2), jnp.float32)[:, None]
    if name == "_ref_scatter_mul":
        return y.at[:, 0].multiply(2.0)
    if name == "_ref_scatter_div":
        return y.reshape(4, 2, 8).at[:, 1:, 2:5].divide(4.0).reshape(8, 8)
    if name == "_ref_plain":
        return y
    if name == "_ref_concat":
        return y.at[:, 6:].set(0.0)
    return jnp.tanh(y) + y


# -- 5. the analysis is of the program that runs ------------------------------------------------


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "fresh-jit"])
def test_changed_closure_is_analysed_again(jit: bool) -> None:
    """The body's Python reads a closure that changes between calls: the second program
    forgets the reduction and must be refused, not run with the first program's analysis."""
    state = {"reduce": True}

    def body(x: f32[b"B/d F/t"], w: f32[b"F/t M"]) -> f32[b"B/d M"]:
        y = E(x, w)
        return reduce_t(y) if state["reduce"] else y

    f = typed_shard_map(body, check_vma=False)
    run = (lambda *a: jax.jit(lambda *b: f(*b))(*a)) if jit else f
    with jax.set_mesh(_mesh()):
        np.testing.assert_allclose(np.asarray(run(X, W)), X @ W, rtol=1e-4, atol=1e-4)
        state["reduce"] = False
        with pytest.raises(PendingReductionError, match="return value is a partial sum"):
            run(X, W)
