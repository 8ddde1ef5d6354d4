"""``shardops.reshard``: values against numpy, bytes against a brute-force cost minimum, errors.

A layout change does not change the global array, so the numpy oracle is the input itself:
every device's block of the result (replicas included) must be the input's elements at that
block's global position, eager, under jit, and the gradient of ``sum(reshard(x) * w)`` must
be ``w`` in the input's layout. The bytes ``shardlib.explain`` counts must equal the minimum
of the cost model over all step sequences, found here by relaxing every edge of the
complete layout graph until nothing improves (independent of the planner's Dijkstra).
"""

from __future__ import annotations

import itertools
import math
import re
from fractions import Fraction
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import shardlib
from shardlib import SpecError, shardops
from shardlib.shardops import PendingReductionError
from shardlib.shardtypes import Array, f32, typed_shard_map
from tests._mesh_util import MESHES, make_mesh, place

_MESHES: dict[int, Any] = {}


def mesh_of(i: int) -> Any:
    if i not in _MESHES:
        _MESHES[i] = make_mesh(*MESHES[i])
    return _MESHES[i]


Layout = tuple[tuple[str, ...], ...]


def spec_of(names: tuple[str, ...], layout: Layout) -> str:
    return " ".join("/".join((n, *a)) for n, a in zip(names, layout, strict=True))


def random_layout(rng: np.random.Generator, rank: int, axes: tuple[str, ...]) -> Layout:
    dims: list[list[str]] = [[] for _ in range(rank)]
    for a in rng.permutation(axes):
        k = int(rng.integers(-1, rank))  # -1: the axis is not used
        if k >= 0:
            dims[k].append(str(a))
    return tuple(tuple(d) for d in dims)


def typed(spec_in: str, spec_out: str):
    """``typed_shard_map(x: f32[spec_in]) -> f32[spec_out]`` reshard-ing between them."""

    def body(x):
        return shardops.reshard(f"{spec_in} -> {spec_out}", x)

    body.__annotations__ = {
        "x": f32[Array, spec_in.encode()],
        "return": f32[Array, spec_out.encode()],
    }
    return typed_shard_map(body, check_vma=False)


# ---------------------------------------------------------------------------------------------
# The cost minimum by brute force
# ---------------------------------------------------------------------------------------------


def all_layouts(rank: int, axes: tuple[str, ...]) -> list[Layout]:
    """Every assignment of a subset of ``axes`` to the dims, in every order."""
    out = set()
    for where in itertools.product(range(-1, rank), repeat=len(axes)):
        for order in itertools.permutations(axes):
            dims: list[list[str]] = [[] for _ in range(rank)]
            for a in order:
                k = where[axes.index(a)]
                if k >= 0:
                    dims[k].append(a)
            out.add(tuple(tuple(d) for d in dims))
    return sorted(out)


def edges(u: Layout, v: Layout, sizes: dict[str, int]) -> Fraction | None:
    """Bytes per device (fraction of the global array) of one allowed step u -> v, or None."""
    block = Fraction(1, math.prod(sizes[a] for d in u for a in d))
    changed = [i for i in range(len(u)) if u[i] != v[i]]
    if len(changed) == 1:
        (i,) = changed
        if v[i][: len(u[i])] == u[i]:  # axes appended: a local slice of replicated axes
            return Fraction(0)
        if u[i][: len(v[i])] == v[i]:  # trailing axes removed: all_gather
            return (math.prod(sizes[a] for a in u[i][len(v[i]) :]) - 1) * block
        return None
    if len(changed) == 2:
        i, j = changed
        for s, t in ((i, j), (j, i)):
            lost, gained = u[s][len(v[s]) :], v[t][len(u[t]) :]
            if u[s][: len(v[s])] == v[s] and v[t][: len(u[t])] == u[t] and lost == gained and lost:
                n = math.prod(sizes[a] for a in lost)
                return Fraction(n - 1, n) * block
    return None


def splits_evenly(layout: Layout, shape: tuple[int, ...], sizes: dict[str, int]) -> bool:
    return all(n % math.prod(sizes[a] for a in d) == 0 for d, n in zip(layout, shape, strict=True))


def brute_minimum(
    src: Layout, dst: Layout, sizes: dict[str, int], shape: tuple[int, ...]
) -> Fraction:
    """The least cost over all step sequences through layouts that split ``shape`` evenly."""
    axes = tuple(sorted({a for d in (*src, *dst) for a in d}))
    nodes = [n for n in all_layouts(len(src), axes) if splits_evenly(n, shape, sizes)]
    best = {n: None for n in nodes}
    best[src] = Fraction(0)
    changed = True
    while changed:
        changed = False
        for u in nodes:
            if best[u] is None:
                continue
            for v in nodes:
                c = edges(u, v, sizes)
                if c is not None and (best[v] is None or best[u] + c < best[v]):
                    best[v] = best[u] + c
                    changed = True
    assert best[dst] is not None
    return best[dst]


# ---------------------------------------------------------------------------------------------
# (1) + (2): random spec pairs on the three meshes
# ---------------------------------------------------------------------------------------------

CASES_PER_MESH = 12


def _cases():
    """Seeded random (mesh, input layout, output layout, global shape); each dim's size is a
    random multiple of what both layouts need, so some intermediate layouts do not fit."""
    rng = np.random.default_rng(16)
    for m, (mesh_shape, names) in enumerate(MESHES):
        sizes = dict(zip(names, mesh_shape, strict=True))
        for k in range(CASES_PER_MESH):
            rank = int(rng.integers(1, 4))
            src = random_layout(rng, rank, names)
            dst = random_layout(rng, rank, names)
            shape = tuple(
                math.lcm(*(math.prod(sizes[a] for a in d[i]) for d in (src, dst)))
                * int(rng.choice([1, 1, 2, 4]))
                for i in range(rank)
            )
            yield pytest.param(m, src, dst, shape, id=f"mesh{m}-{k}")


@pytest.mark.slow
@pytest.mark.parametrize("m, src, dst, shape", list(_cases()))
def test_reshard_random_pairs(m, src, dst, shape):
    mesh = mesh_of(m)
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))
    dims = ("A", "B", "C")[: len(src)]
    spec_in, spec_out = spec_of(dims, src), spec_of(dims, dst)
    rng = np.random.default_rng(len(spec_in) * 31 + len(spec_out))
    x = rng.standard_normal(shape).astype(np.float32)
    w = rng.standard_normal(shape).astype(np.float32)
    f = typed(spec_in, spec_out)
    with jax.set_mesh(mesh):
        xp, wp = place(x, mesh, spec_in), place(w, mesh, spec_out)
        for y in (f(xp), jax.jit(f)(xp)):
            assert_blocks(y, x)
        g = jax.jit(jax.grad(lambda a: jnp.sum(f(a) * wp)))(xp)
        assert_blocks(g, w, tol=1e-6)
        report = shardlib.explain(f, xp)
    got = sum(c.received_bytes * c.calls for c in report.collectives)
    want = brute_minimum(src, dst, sizes, shape) * x.nbytes
    assert got == want, (spec_in, spec_out, [(c.op, c.spec) for c in report.collectives])
    for c in report.collectives:
        assert c.op in ("all_gather", "all_to_all"), c


def assert_blocks(y: jax.Array, want: np.ndarray, tol: float = 0.0) -> None:
    """Every device's block of ``y`` (each replica) is ``want`` at its global position.

    The gradient is compared with a tolerance: the transpose of a gather (a reduce-scatter
    of the replicated cotangent, then JAX's division by the replica count) rounds."""
    assert y.shape == want.shape
    for shard in y.addressable_shards:
        got, ref = np.asarray(shard.data), want[shard.index]
        np.testing.assert_allclose(got, ref, rtol=tol, atol=tol, err_msg=str(shard.index))


# ---------------------------------------------------------------------------------------------
# Chosen plans for the guide's table
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec, ops",
    [
        ("B/d L M -> B L/d M", ["all_to_all"]),
        ("B L M -> B L/d M", []),
        ("B/d L M -> B L M", ["all_gather"]),
        ("B/d L M -> B/d L M", []),
    ],
)
def test_chosen_ops_1d(spec, ops):
    mesh = mesh_of(0)
    f = typed(*spec.split(" -> "))
    with jax.set_mesh(mesh):
        report = shardlib.explain(
            f, place(np.ones((8, 8, 8), np.float32), mesh, spec.split(" -> ")[0])
        )
    assert [c.op for c in report.collectives] == ops


def test_reorder_of_axes_is_exact():
    """``M/x/y -> M/y/x``: the order of a dim's axes is honoured (blocks checked)."""
    mesh = mesh_of(1)
    x = np.arange(16 * 4, dtype=np.float32).reshape(16, 4)
    with jax.set_mesh(mesh):
        y = typed("M/x/y L", "M/y/x L")(place(x, mesh, "M/x/y L"))
    assert_blocks(y, x)


# ---------------------------------------------------------------------------------------------
# (3) errors
# ---------------------------------------------------------------------------------------------


def caret_at(err: Exception, spec: str, fragment: str, start: int = 0) -> None:
    """The message shows ``spec`` with carets under ``fragment`` (found from ``start``)."""
    lines = str(err).splitlines()
    i = lines.index(f"    {spec!r}")
    col = 5 + spec.index(fragment, start)
    assert lines[i + 1] == " " * col + "^" * len(fragment), str(err)


_PLAN_ERRORS = [
    ("B/d L -> B", "input has 2 dims but the output has 1", "B", 9),
    ("B/d L -> B K", "dim 1 is 'L' in the input but 'K' in the output", "K", 9),
    ("B/d 8 -> B 16", "reshard does not change a size", "16", 9),
    ("B/d L -> L B/d", "dim 0 is 'B' in the input but 'L' in the output", "L", 9),
    ("B/d L/d -> B L", "mesh axis 'd' is used twice", "d", 6),
    (
        "B/d L {+t} -> B L",
        "input declares pending axes {+t} but the output declares none",
        "{+t}",
        0,
    ),
    (
        "B L -> B/d L {+t}",
        "input declares none but the output declares pending axes {+t}",
        "{+t}",
        0,
    ),
]


@pytest.mark.parametrize("spec, msg, fragment, start", _PLAN_ERRORS)
def test_spec_errors(spec, msg, fragment, start):
    with pytest.raises(SpecError, match=re.escape(msg)) as e:
        shardops.reshard(spec, jnp.ones((8, 8)))
    assert str(e.value).startswith("reshard: ")
    caret_at(e.value, spec, fragment, start)


def test_unknown_axis_is_a_spec_error_under_it():
    mesh = mesh_of(1)
    with jax.set_mesh(mesh), pytest.raises(SpecError, match="mesh axis 'yy' of dim 1") as e:

        @typed_shard_map
        def f(x: f32[Array, b"B/x L"]) -> f32[Array, b"B L"]:
            return shardops.reshard("B/x L -> B L/yy", x)

        f(place(np.ones((8, 8), np.float32), mesh, "B/x L"))
    assert "did you mean 'y'?" in str(e.value)
    caret_at(e.value, "B/x L -> B L/yy", "L/yy")


def test_output_dim_not_divisible():
    mesh = mesh_of(0)
    f = typed("B/d L", "B L/d")
    with (
        jax.set_mesh(mesh),
        pytest.raises(SpecError, match="global size 4, which is not divisible by d=8") as e,
    ):
        f(place(np.ones((8, 4), np.float32), mesh, "B/d L"))
    caret_at(e.value, "B/d L -> B L/d", "L/d")


def test_pending_sum_is_refused():
    mesh = mesh_of(0)

    @typed_shard_map
    def f(x: f32[Array, b"B L/d"], w: f32[Array, b"L/d M"]) -> f32[Array, b"B M/d"]:
        y = shardops.einsum_unreduced("B L/d, L/d M -> B M", x, w)  # pending over d
        return shardops.reshard("B M -> B M/d", y)

    with (
        jax.set_mesh(mesh),
        pytest.raises(PendingReductionError, match=r"shardops\.reshard\('B M -> B M/d'\)") as e,
    ):
        f(
            place(np.ones((8, 8), np.float32), mesh, "B L/d"),
            place(np.ones((8, 8), np.float32), mesh, "L/d M"),
        )
    assert "Reduce-scatter it first: shardops.psum_scatter('B M -> B M/d', x)" in str(e.value)


def test_outside_shard_map():
    with pytest.raises(ValueError, match="must run inside a shard_map body"):
        shardops.reshard("B/d L -> B L", jnp.ones((8, 8)))


def test_check_vma_on_with_a_split_result():
    """With check_vma on (the default), a result split over every axis: value and gradient."""
    mesh = mesh_of(1)
    spec_in, spec_out = "B/x L M/y", "B L/y M/x"

    @typed_shard_map
    def f(x: f32[Array, b"B/x L M/y"]) -> f32[Array, b"B L/y M/x"]:
        return shardops.reshard(f"{spec_in} -> {spec_out}", x)

    rng = np.random.default_rng(0)
    x, w = (rng.standard_normal((8, 4, 8)).astype(np.float32) for _ in range(2))
    with jax.set_mesh(mesh):
        xp, wp = place(x, mesh, spec_in), place(w, mesh, spec_out)
        assert_blocks(jax.jit(f)(xp), x)
        assert_blocks(jax.grad(lambda a: jnp.sum(f(a) * wp))(xp), w, tol=1e-6)
