"""Collectives inside a per-device ``lax.cond`` / ``lax.switch`` of a ``typed_shard_map`` body.

A ``cond``/``switch`` whose index differs across devices (it depends on ``axis_index`` or on a
value split over an axis) is a real conditional: only some devices run a branch. A grouped
collective (psum, all_gather, all_to_all, psum_scatter) over axes the index does not vary over
is right there (its groups lie inside devices that take the same branch): checked against a
jax.numpy reference on a (p, c) = (4, 2) mesh, with ``check_vma`` off and on. A
collective-permute (``lax.ppermute``, ``shardops.shift``) in such a branch is paired by XLA
with the permutes of the devices in other branches (wrong values or a deadlock), and a
collective over an axis the index varies over spans devices that take different branches:
both refused at trace time by the partial-sum analysis (`shardlib._analysis.walk`), in a
``cond``, a ``switch``, a ``scan`` body and a ``jit`` inside the body. The refused programs are
only traced here, never run (they may deadlock XLA). A ``ppermute`` in a ``cond`` whose
predicate is the same on every device, or outside the ``cond``, runs. The same holds for a
``lax.while_loop`` whose trip count differs across devices: a permute or a collective over the
axes its predicate varies over is refused, a psum over another axis runs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from shardlib import shardops
from shardlib.shardtypes import Array, f32, typed_shard_map
from tests._mesh_util import make_mesh

R, C = 8, 4  # rows (split over 'p', 4 devices), columns (split over 'c', 2 devices)
VMA = (False, True)


@pytest.fixture(scope="module")
def mesh():
    return make_mesh((4, 2), ("p", "c"))


def _x(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((R, C)).astype(np.float32)


def _first(h: jax.Array) -> jax.Array:
    """True on the devices of the first 'p' block: a per-device predicate."""
    return lax.axis_index("p") == 0


def _ring(axis: str, n: int) -> list[tuple[int, int]]:
    return [(i, (i + 1) % n) for i in range(n)]


# -- refused: traced only ----------------------------------------------------------------------


def _cond_ppermute(h):
    return lax.cond(_first(h), lambda v: lax.ppermute(v, "c", _ring("c", 2)), lambda v: v, h)


def _cond_shift(h):
    return lax.cond(_first(h), lambda v: shardops.shift("R/p C/c", v, "p"), lambda v: 2 * v, h)


def _switch_shift(h):
    branches = (lambda v: v, lambda v: shardops.shift("R/p C/c", v, "c"), lambda v: -v)
    return lax.switch(lax.axis_index("p") % 3, branches, h)


def _scan_cond_ppermute(h):
    def step(carry, _):
        return _cond_ppermute(carry), None

    return lax.scan(step, h, None, length=2)[0]


def _jit_cond_ppermute(h):
    return jax.jit(_cond_ppermute)(h)


def _cond_psum_varying(h):
    """A psum over the axis the predicate varies over: devices of one group disagree."""
    return lax.cond(_first(h), lambda v: v + lax.psum(v, "p"), lambda v: v, h)


def _data_cond_gather(h):
    """The predicate comes from the data (split over 'p' and 'c'), the gather is over 'p'."""
    pred = jnp.sum(h) > 0
    return lax.cond(
        pred, lambda v: v + jnp.mean(lax.all_gather(v, "p", tiled=True)), lambda v: v, h
    )


def _data_cond_ppermute(h):
    """A predicate that varies over 'p' and 'c' (data split over them), a ppermute over 'c'."""
    return lax.cond(jnp.sum(h) > 0, lambda v: lax.ppermute(v, "c", _ring("c", 2)), lambda v: v, h)


def _nested_uniform_cond_shift(h):
    """A cond with a uniform predicate nested in a per-device branch: still refused."""

    def inner(v):
        return lax.cond(
            jnp.float32(1) > 0, lambda u: shardops.shift("R/p C/c", u, "c"), jnp.negative, v
        )

    return lax.cond(_first(h), inner, lambda v: v, h)


REFUSED = {
    # name: (body, what the message names, the collective's axes, the index's varying axes)
    "cond_ppermute": (_cond_ppermute, "`ppermute`", "'c'", "'p'"),
    "cond_shift": (_cond_shift, "shardops.shift('R/p C/c') (`ppermute`)", "'p'", "'p'"),
    "switch_shift": (_switch_shift, "shardops.shift('R/p C/c') (`ppermute`)", "'c'", "'p'"),
    "scan_cond_ppermute": (_scan_cond_ppermute, "`ppermute`", "'c'", "'p'"),
    "jit_cond_ppermute": (_jit_cond_ppermute, "`ppermute`", "'c'", "'p'"),
    "cond_psum_varying": (_cond_psum_varying, "`psum", "'p'", "'p'"),
    "data_cond_gather": (_data_cond_gather, "`all_gather", "'p'", "'c', 'p'"),
    "data_cond_ppermute": (_data_cond_ppermute, "`ppermute`", "'c'", "'c', 'p'"),
    "nested_uniform_cond_shift": (
        _nested_uniform_cond_shift,
        "shardops.shift('R/p C/c') (`ppermute`)",
        "'c'",
        "'p'",
    ),
}


@pytest.mark.parametrize("check_vma", VMA)
@pytest.mark.parametrize("case", sorted(REFUSED))
def test_refused(mesh, case: str, check_vma: bool) -> None:
    body, what, axes, varying = REFUSED[case]

    @typed_shard_map(check_vma=check_vma)
    def f(x: f32[Array, b"R/p C/c"]) -> f32[Array, b"R/p C/c"]:
        return body(x)

    with jax.set_mesh(mesh), pytest.raises(ValueError) as e:
        jax.jit(f).trace(_x())  # traced, never run: it may deadlock XLA
    msg = str(e.value)
    assert msg.startswith("in test_refused.<locals>.f(): "), msg
    assert what in msg, msg
    assert f"runs over mesh axis {axes} inside a branch of a lax.cond/lax.switch" in msg, msg
    word = "axes" if "," in varying else "axis"
    assert f"index differs across the devices of mesh {word} {varying}" in msg, msg
    assert "test_branch_collectives.py:" in msg, msg  # the collective's line
    assert "Move the collective out of the branch" in msg, msg
    assert "jnp.where" in msg, msg
    if axes in varying:
        assert f"it communicates over mesh axis {axes}, across which" in msg, msg
    else:
        assert "XLA pairs it with whatever permute" in msg, msg


# -- accepted: run, checked against jax.numpy ------------------------------------------------------


def _rows_first(x: np.ndarray, then: np.ndarray, other: np.ndarray) -> np.ndarray:
    """``then`` on the rows of the first 'p' block (2 rows), ``other`` elsewhere."""
    out = other.copy()
    out[: R // 4] = then[: R // 4]
    return out


def _psum_other(h):
    def then(v):
        rows = shardops.psum("R/p", jnp.sum(v, axis=1), axes="c")
        return v + lax.psum(v, "c") + rows[:, None]

    return lax.cond(_first(h), then, lambda v: 2 * v, h)


def _ref_psum_other(x):
    halves = x[:, : C // 2] + x[:, C // 2 :]
    return _rows_first(x, x + np.tile(halves, (1, 2)) + x.sum(axis=1, keepdims=True), 2 * x)


def _gather_other(h):
    def then(v):
        return v + jnp.mean(shardops.all_gather("R/p C/c -> R/p C", v), axis=1, keepdims=True)

    return lax.cond(_first(h), then, lambda v: v, h)


def _ref_gather_other(x):
    return _rows_first(x, x + x.mean(axis=1, keepdims=True), x)


def _all_to_all_other(h):
    def then(v):
        return lax.all_to_all(v, "c", split_axis=1, concat_axis=1, tiled=True)

    return lax.cond(_first(h), then, lambda v: -v, h)


def _ref_all_to_all_other(x):
    # device c's block of columns gets column c of each device's block
    moved = x.reshape(R, 2, 2).transpose(0, 2, 1).reshape(R, C)
    return _rows_first(x, moved, -x)


def _scatter_other(h):
    def then(v):
        return lax.psum_scatter(jnp.tile(v, (1, 2)), "c", scatter_dimension=1, tiled=True)

    return lax.switch(lax.axis_index("p") % 2, (then, lambda v: v), h)


def _ref_scatter_other(x):
    summed = np.tile(x[:, : C // 2] + x[:, C // 2 :], (1, 2))
    out = x.copy()
    for block in (0, 2):  # the 'p' blocks whose index % 2 == 0
        rows = slice(block * R // 4, (block + 1) * R // 4)
        out[rows] = summed[rows]
    return out


def _uniform_cond_shift(h):
    """The predicate is the same on every device (a constant): the ppermute runs everywhere."""
    pred = jnp.sum(jnp.ones((3,), jnp.float32)) > 0
    return lax.cond(pred, lambda v: shardops.shift("R/p C/c", v, "p"), lambda v: v, h)


def _ref_uniform_cond_shift(x):
    return np.roll(x, R // 4, axis=0)


def _shift_outside(h):
    moved = shardops.shift("R/p C/c", h, "p")
    return lax.cond(_first(h), lambda v: 2 * v, lambda v: v, moved)


def _ref_shift_outside(x):
    moved = np.roll(x, R // 4, axis=0)
    return _rows_first(x, 2 * moved, moved)


def _where_instead(h):
    """The fix the message suggests: the permute on every device, selected per device."""
    moved = lax.ppermute(h, "c", _ring("c", 2))
    return jnp.where(_first(h), moved, h)


def _ref_where_instead(x):
    swapped = np.concatenate([x[:, C // 2 :], x[:, : C // 2]], axis=1)
    return _rows_first(x, swapped, x)


# -- while_loop with a per-device trip count --------------------------------------------------


def _trips(h: jax.Array) -> jax.Array:
    """1 + the 'p' index: a trip count that differs across the devices of 'p'."""
    return lax.axis_index("p") + 1


def _while_ppermute(h):
    def body(c):
        i, v = c
        return i + 1, lax.ppermute(v, "c", _ring("c", 2))

    return lax.while_loop(lambda c: c[0] < _trips(h), body, (0, h))[1]


def _while_psum_varying(h):
    def body(c):
        i, v = c
        return i + 1, v + lax.psum(v, "p")

    return lax.while_loop(lambda c: c[0] < _trips(h), body, (0, h))[1]


def _while_psum_other(h):
    """A psum over 'c' in a loop whose trip count varies over 'p' only: right."""

    def body(c):
        i, v = c
        return i + 1, 0.5 * (v + lax.psum(v, "c"))

    return lax.while_loop(lambda c: c[0] < _trips(h), body, (0, h))[1]


def _ref_while_psum_other(x):
    out = x.copy()
    for block in range(4):  # rows of 'p' block b run b + 1 iterations
        rows = slice(2 * block, 2 * block + 2)
        v = x[rows]
        for _ in range(block + 1):
            halves = v[:, : C // 2] + v[:, C // 2 :]
            v = 0.5 * (v + np.tile(halves, (1, 2)))
        out[rows] = v
    return out


ACCEPTED = {
    "psum_other": (_psum_other, _ref_psum_other),
    "gather_other": (_gather_other, _ref_gather_other),
    "all_to_all_other": (_all_to_all_other, _ref_all_to_all_other),
    "scatter_other": (_scatter_other, _ref_scatter_other),
    "uniform_cond_shift": (_uniform_cond_shift, _ref_uniform_cond_shift),
    "shift_outside": (_shift_outside, _ref_shift_outside),
    "where_instead": (_where_instead, _ref_where_instead),
    "while_psum_other": (_while_psum_other, _ref_while_psum_other),
}


@pytest.mark.parametrize("check_vma", VMA)
@pytest.mark.parametrize("case", sorted(ACCEPTED))
def test_accepted(mesh, case: str, check_vma: bool) -> None:
    body, ref = ACCEPTED[case]

    @typed_shard_map(check_vma=check_vma)
    def f(x: f32[Array, b"R/p C/c"]) -> f32[Array, b"R/p C/c"]:
        return body(x)

    x = _x(1)
    with jax.set_mesh(mesh):
        got = jax.jit(f)(x)
    np.testing.assert_allclose(np.asarray(got), ref(x), rtol=1e-5, atol=1e-5)


def test_uniform_predicate_from_replicated_argument(mesh) -> None:
    """A predicate read from a replicated argument is the same on every device: a ppermute
    in its branch runs (on every device, or on none)."""

    @typed_shard_map
    def f(x: f32[Array, b"R/p C/c"], flag: f32[Array, b""]) -> f32[Array, b"R/p C/c"]:
        return lax.cond(flag > 0, lambda v: shardops.shift("R/p C/c", v, "p"), lambda v: v, x)

    x = _x(2)
    with jax.set_mesh(mesh):
        for flag, want in ((1.0, np.roll(x, R // 4, axis=0)), (-1.0, x)):
            got = jax.jit(f)(x, np.float32(flag))
            np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6)


@pytest.mark.parametrize("check_vma", VMA)
@pytest.mark.parametrize(
    ("body", "what", "axes"),
    [(_while_ppermute, "`ppermute`", "'c'"), (_while_psum_varying, "`psum", "'p'")],
    ids=["ppermute", "psum_varying"],
)
def test_while_loop_with_a_per_device_trip_count_is_refused(mesh, body, what, axes, check_vma):
    @typed_shard_map(check_vma=check_vma)
    def f(x: f32[Array, b"R/p C/c"]) -> f32[Array, b"R/p C/c"]:
        return body(x)

    with jax.set_mesh(mesh), pytest.raises(ValueError) as e:
        jax.jit(f).trace(_x())  # traced, never run: it may deadlock XLA
    msg = str(e.value)
    assert what in msg, msg
    assert f"runs over mesh axis {axes} inside a lax.while_loop whose number of iterations" in msg
    assert "differs across the devices of mesh axis 'p'" in msg, msg
    assert "same trip count on every device" in msg, msg
