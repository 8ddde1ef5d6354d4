"""Differential tests for ``shardlib.shardops``: every op against an unsharded reference.

Each case builds global arrays with numpy, places them in the input layout on a 1-D (8,),
2-D (4, 2) or 3-D (2, 2, 2) mesh of the 8 CPU devices, runs the op inside ``jax.shard_map``
(or ``typed_shard_map``) and compares the global result, and the gradient of a scalar loss,
with plain jax.numpy on the global arrays.

How results come back: the body returns its block with a new leading dim split over every
mesh axis the result is *not* split over, so the global output holds one copy per replica
and every copy is compared (not only device 0's). Unreduced inputs (psum, psum_scatter) are
given the same way: a leading dim split over the reduced axes holds each device's partial
value, and the reference sums over it. Unreduced results (einsum_unreduced, index_unreduced)
are reduced in the body with psum/psum_scatter.
"""

from __future__ import annotations

import itertools
import math
import re
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P
from typeguard import TypeCheckError

from shardlib import SpecError, shardops
from shardlib._lang.parsing import ShapeSpec
from shardlib.shardtypes import f32, i32, register_with_typeguard, typed_shard_map
from tests._mesh_util import MESHES, blocks, count_collectives, make_mesh, place
from tests._tiers import examples

register_with_typeguard()

_MESH_CACHE: dict[tuple[int, bool], Any] = {}


def mesh_of(i: int, auto: bool = False) -> Any:
    key = (i, auto)
    if key not in _MESH_CACHE:
        _MESH_CACHE[key] = make_mesh(*MESHES[i], auto=auto)
    return _MESH_CACHE[key]


def sizes_of(mesh: Any) -> dict[str, int]:
    return dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))


def dim_str(name: str, axes: Sequence[str]) -> str:
    return "/".join([name, *axes])


def spec_str(names: Sequence[str], layout: Sequence[Sequence[str]]) -> str:
    return " ".join(dim_str(n, a) for n, a in zip(names, layout, strict=True))


# ---------------------------------------------------------------------------------------------
# The harness
# ---------------------------------------------------------------------------------------------


def run_op(
    mesh: Any,
    body: Callable[..., jax.Array],
    in_specs: Sequence[str],
    out_spec: str,
    args: Sequence[np.ndarray],
    ref: Callable[..., jax.Array],
    *,
    diff: tuple[int, ...] = (0,),
    check_vma: bool = True,
    jit: bool = True,
    exact: bool = False,
    tol: float = 1e-5,
    collectives: dict[str, int] | None = None,
    seed: int = 0,
) -> None:
    """Run ``body`` per device under ``jax.shard_map`` and compare with ``ref`` on globals.

    Checks the value (every replica), the gradient w.r.t. ``args[diff]`` of
    ``sum(result * cotangent)``, and, if given, the collectives in the lowered forward pass.
    """
    out_entries = ShapeSpec.parse(out_spec).partition_entries()
    used = ShapeSpec.parse(out_spec).mesh_axes()
    rep = tuple(a for a in mesh.axis_names if a not in used)
    n_rep = math.prod(sizes_of(mesh)[a] for a in rep)
    smap = jax.shard_map(
        lambda *a: body(*a)[None],
        mesh=mesh,
        in_specs=tuple(ShapeSpec.parse(s).partition_spec() for s in in_specs),
        out_specs=P(rep or None, *out_entries),
        check_vma=check_vma,
    )
    want = np.asarray(ref(*args))
    cot = np.random.default_rng(seed + 1).standard_normal((n_rep, *want.shape)).astype(want.dtype)

    def value_and_grad(*a):
        y = smap(*a)
        if not diff:
            return y, ()
        return y, jax.grad(lambda *b: jnp.sum(smap(*b) * cot), argnums=diff)(*a)

    with jax.set_mesh(mesh):
        placed = [place(x, mesh, s) for x, s in zip(args, in_specs, strict=True)]
        y, grads = (jax.jit(value_and_grad) if jit else value_and_grad)(*placed)
        if collectives is not None:
            text = jax.jit(smap).lower(*placed).as_text()
    y = np.asarray(y)
    assert y.shape == (n_rep, *want.shape), (y.shape, want.shape)
    assert y.dtype == want.dtype, (y.dtype, want.dtype)
    for r in range(n_rep):
        if exact:
            np.testing.assert_array_equal(y[r], want, err_msg=f"replica {r}")
        else:
            np.testing.assert_allclose(y[r], want, rtol=tol, atol=tol, err_msg=f"replica {r}")
    if diff:
        want_grads = jax.grad(lambda *b: jnp.sum(ref(*b) * cot.sum(0)), argnums=diff)(*args)
        for k, g, w in zip(diff, grads, want_grads, strict=True):
            np.testing.assert_allclose(
                np.asarray(g), np.asarray(w), rtol=tol, atol=tol, err_msg=f"grad of arg {k}"
            )
    if collectives is not None:
        got = count_collectives(text)
        assert got == Counter({k: v for k, v in collectives.items() if v}), got


def normal(rng: np.random.Generator, shape: Sequence[int]) -> np.ndarray:
    return rng.standard_normal(tuple(shape)).astype(np.float32)


# ---------------------------------------------------------------------------------------------
# Strategies: meshes, layouts and sizes
# ---------------------------------------------------------------------------------------------


def draw_mesh(data: st.DataObject, auto: bool | None = None) -> Any:
    i = data.draw(st.integers(0, len(MESHES) - 1), label="mesh")
    if auto is None:
        auto = data.draw(st.booleans(), label="auto")
    return mesh_of(i, auto)


def draw_layout(data: st.DataObject, axes: Sequence[str], n_dims: int) -> list[tuple[str, ...]]:
    """Each axis to one of ``n_dims`` dims or to none, in a random order within each dim."""
    where = [data.draw(st.integers(-1, n_dims - 1), label=f"dim of {a}") for a in axes]
    layout = []
    for i in range(n_dims):
        mine = [a for a, w in zip(axes, where, strict=True) if w == i]
        layout.append(tuple(data.draw(st.permutations(mine), label="order")))
    return layout


def draw_names(data: st.DataObject, shape: Sequence[int], letters: str = "abc") -> list[str]:
    """Dim names; now and then a literal size instead of a name."""
    return [
        str(n) if data.draw(st.integers(0, 3), label="literal") == 0 else letters[i]
        for i, n in enumerate(shape)
    ]


def factor(mesh: Any, axes: Sequence[str]) -> int:
    s = sizes_of(mesh)
    return math.prod(s[a] for a in axes)


def draw_sizes(data: st.DataObject, mesh: Any, layouts: Sequence[Sequence[str]]) -> list[int]:
    return [factor(mesh, axes) * data.draw(st.integers(1, 3), label="k") for axes in layouts]


def changed_dims(in_spec: str, out_spec: str) -> int:
    a, b = ShapeSpec.parse(in_spec).dims, ShapeSpec.parse(out_spec).dims
    return sum(x != y for x, y in zip(a, b, strict=True))


def stacked(axes: Sequence[str], spec: str) -> str:
    """The spec of a leading dim holding one partial value per device along ``axes``."""
    return f"{dim_str('rep', axes)} {spec}".strip()


# ---------------------------------------------------------------------------------------------
# all_gather
# ---------------------------------------------------------------------------------------------


@settings(max_examples=examples(20))
@given(data=st.data())
def test_all_gather_matches_global_identity(data):
    mesh = draw_mesh(data)
    rank = data.draw(st.integers(1, 3), label="rank")
    layout = draw_layout(data, mesh.axis_names, rank)
    if not any(layout):
        layout[0] = (mesh.axis_names[0],)
    keep = [data.draw(st.integers(0, len(a)), label="keep") for a in layout]
    if all(k == len(a) for k, a in zip(keep, layout, strict=True)):
        i = next(i for i, a in enumerate(layout) if a)
        keep[i] = data.draw(st.integers(0, len(layout[i]) - 1), label="keep")
    out_layout = [a[:k] for a, k in zip(layout, keep, strict=True)]
    shape = draw_sizes(data, mesh, layout)
    names = draw_names(data, shape)
    in_spec, out_spec = spec_str(names, layout), spec_str(names, out_layout)
    text = f"{in_spec} -> {out_spec}"
    seed = data.draw(st.integers(0, 2**16), label="seed")
    run_op(
        mesh,
        lambda x: shardops.all_gather(text, x),
        [in_spec],
        out_spec,
        [normal(np.random.default_rng(seed), shape)],
        lambda x: x,
        check_vma=data.draw(st.booleans(), label="check_vma"),
        exact=True,
        collectives={"all_gather": sum(k < len(a) for k, a in zip(keep, layout, strict=True))},
        seed=seed,
    )


@pytest.mark.parametrize(
    "mesh_i, in_spec, out_spec",
    [
        (1, "a/x/y b", "a b"),
        (1, "a/y/x b", "a b"),
        (1, "a/x/y b", "a/x b"),
        (1, "a/y/x b", "a/y b"),
        (2, "a/z/x/y b", "a/z b"),
        (2, "a/y/z b/x", "a b"),
        (2, "a b/z/x/y", "a b/z"),
    ],
)
def test_all_gather_multi_axis_order(mesh_i, in_spec, out_spec):
    """Axes of one dim are major to minor in the order written, as in a PartitionSpec."""
    mesh = mesh_of(mesh_i)
    x = np.arange(8 * 8, dtype=np.float32).reshape(8, 8)
    run_op(
        mesh,
        lambda v: shardops.all_gather(f"{in_spec} -> {out_spec}", v),
        [in_spec],
        out_spec,
        [x],
        lambda v: v,
        exact=True,
        collectives={"all_gather": changed_dims(in_spec, out_spec)},
    )


# ---------------------------------------------------------------------------------------------
# psum_scatter
# ---------------------------------------------------------------------------------------------


@settings(max_examples=examples(20))
@given(data=st.data())
def test_psum_scatter_sums_partials_and_scatters(data):
    mesh = draw_mesh(data)
    rank = data.draw(st.integers(1, 3), label="rank")
    out_layout = draw_layout(data, mesh.axis_names, rank)
    if not any(out_layout):
        out_layout[0] = (mesh.axis_names[0],)
    keep = [data.draw(st.integers(0, len(a)), label="keep") for a in out_layout]
    if all(k == len(a) for k, a in zip(keep, out_layout, strict=True)):
        i = next(i for i, a in enumerate(out_layout) if a)
        keep[i] = data.draw(st.integers(0, len(out_layout[i]) - 1), label="keep")
    in_layout = [a[:k] for a, k in zip(out_layout, keep, strict=True)]
    added = [a for lay, k in zip(out_layout, keep, strict=True) for a in lay[k:]]
    shape = draw_sizes(data, mesh, out_layout)
    names = draw_names(data, shape)
    in_spec, out_spec = spec_str(names, in_layout), spec_str(names, out_layout)
    text = f"{in_spec} -> {out_spec}"
    seed = data.draw(st.integers(0, 2**16), label="seed")
    partials = normal(np.random.default_rng(seed), (factor(mesh, added), *shape))
    run_op(
        mesh,
        lambda u: shardops.psum_scatter(text, u[0]),
        [stacked(added, in_spec)],
        out_spec,
        [partials],
        lambda u: u.sum(0),
        check_vma=data.draw(st.booleans(), label="check_vma"),
        collectives={
            "reduce_scatter": sum(k < len(a) for k, a in zip(keep, out_layout, strict=True))
        },
        seed=seed,
    )


@pytest.mark.parametrize(
    "mesh_i, in_spec, out_spec",
    [
        (1, "a b", "a/x/y b"),
        (1, "a b", "a/y/x b"),
        (1, "a/x b", "a/x/y b"),
        (1, "a/y b", "a/y/x b"),
        (2, "a/z b", "a/z/y/x b"),
        (2, "a b/y", "a/x b/y/z"),
    ],
)
def test_psum_scatter_multi_axis_order(mesh_i, in_spec, out_spec):
    mesh = mesh_of(mesh_i)
    in_axes = ShapeSpec.parse(in_spec).mesh_axes()
    added = [a for a in ShapeSpec.parse(out_spec).mesh_axes() if a not in in_axes]
    u = normal(np.random.default_rng(0), (factor(mesh, added), 8, 8))
    run_op(
        mesh,
        lambda v: shardops.psum_scatter(f"{in_spec} -> {out_spec}", v[0]),
        [stacked(added, in_spec)],
        out_spec,
        [u],
        lambda v: v.sum(0),
        collectives={"reduce_scatter": changed_dims(in_spec, out_spec)},
    )


# ---------------------------------------------------------------------------------------------
# psum, pmean, pmax, pmin
# ---------------------------------------------------------------------------------------------

_REDUCTIONS = {
    "psum": (shardops.psum, lambda u: jnp.sum(u, 0)),
    "pmean": (shardops.pmean, lambda u: jnp.mean(u, 0)),
    "pmax": (shardops.pmax, lambda u: jnp.max(u, 0)),
    "pmin": (shardops.pmin, lambda u: jnp.min(u, 0)),
}


@settings(max_examples=examples(20))
@given(data=st.data())
def test_all_reduce_ops(data):
    name = data.draw(st.sampled_from(sorted(_REDUCTIONS)), label="op")
    op, reduce = _REDUCTIONS[name]
    mesh = draw_mesh(data)
    order = data.draw(st.permutations(mesh.axis_names), label="axes")
    n_red = data.draw(st.integers(1, len(order)), label="n_red")
    red, rest = tuple(order[:n_red]), order[n_red:]
    rank = data.draw(st.integers(0, 3), label="rank")
    layout = draw_layout(data, rest, rank)
    shape = draw_sizes(data, mesh, layout)
    names = draw_names(data, shape)
    spec = spec_str(names, layout)
    form = data.draw(st.sampled_from(["slash", "space", "tuple"]), label="axes form")
    axes_arg: str | tuple[str, ...] = {"slash": "/".join(red), "space": " ".join(red)}.get(
        form, red
    )
    seed = data.draw(st.integers(0, 2**16), label="seed")
    run_op(
        mesh,
        lambda u: op(spec, u[0], axes_arg),
        [stacked(red, spec)],
        spec,
        [normal(np.random.default_rng(seed), (factor(mesh, red), *shape))],
        reduce,
        check_vma=data.draw(st.booleans(), label="check_vma"),
        collectives={"all_reduce": 1},
        seed=seed,
    )


@pytest.mark.parametrize("name", ["pmax", "pmin"])
def test_pmax_pmin_gradient_splits_ties(name):
    """Tied maxima share the gradient equally, as for jnp.max/jnp.min."""
    mesh = mesh_of(0)
    op, reduce = _REDUCTIONS[name]
    u = normal(np.random.default_rng(3), (8, 4))
    u[[1, 4, 6], 2] = 9.0 if name == "pmax" else -9.0  # a three-way tie in column 2
    run_op(mesh, lambda v: op("n", v[0], "d"), ["rep/d n"], "n", [u], reduce)


def test_pmax_pmin_integer_values():
    mesh = mesh_of(1)
    u = np.random.default_rng(4).integers(-50, 50, (8, 6), dtype=np.int32)

    def body(v):
        return jnp.stack([shardops.pmax("n", v[0], "x/y"), shardops.pmin("n", v[0], "x/y")])

    run_op(
        mesh,
        body,
        ["rep/x/y n"],
        "2 n",
        [u],
        lambda v: jnp.stack([v.max(0), v.min(0)]),
        diff=(),
        exact=True,
    )


# ---------------------------------------------------------------------------------------------
# all_to_all
# ---------------------------------------------------------------------------------------------


def draw_all_to_all(data: st.DataObject):
    """A mesh and an all_to_all spec: a suffix of one dim's axes moves to another dim's end."""
    mesh = draw_mesh(data)
    rank = data.draw(st.integers(2, 3), label="rank")
    layout = draw_layout(data, mesh.axis_names, rank)
    if not any(layout):
        layout[0] = (mesh.axis_names[0],)
    src = data.draw(st.sampled_from([i for i, a in enumerate(layout) if a]), label="src")
    dst = data.draw(st.sampled_from([i for i in range(rank) if i != src]), label="dst")
    m = data.draw(st.integers(1, len(layout[src])), label="moved")
    moved = layout[src][len(layout[src]) - m :]
    out_layout = list(layout)
    out_layout[src] = layout[src][: len(layout[src]) - m]
    out_layout[dst] = layout[dst] + moved
    shape = draw_sizes(data, mesh, [layout[i] + out_layout[i] for i in range(rank)])
    names = draw_names(data, shape)
    return mesh, spec_str(names, layout), spec_str(names, out_layout), shape, moved


@settings(max_examples=examples(20))
@given(data=st.data())
def test_all_to_all_matches_global_identity(data):
    mesh, in_spec, out_spec, shape, _ = draw_all_to_all(data)
    text = f"{in_spec} -> {out_spec}"
    seed = data.draw(st.integers(0, 2**16), label="seed")
    run_op(
        mesh,
        lambda x: shardops.all_to_all(text, x),
        [in_spec],
        out_spec,
        [normal(np.random.default_rng(seed), shape)],
        lambda x: x,
        check_vma=data.draw(st.booleans(), label="check_vma"),
        exact=True,
        collectives={"all_to_all": 1},
        seed=seed,
    )


@pytest.mark.parametrize(
    "mesh_i, in_spec, out_spec",
    [
        (1, "a/x/y b", "a b/x/y"),
        (1, "a/y/x b", "a b/y/x"),
        (1, "a/x/y b", "a/x b/y"),
        (1, "a/x b/y", "a b/y/x"),
        (1, "a b/y/x", "a/y/x b"),
        (2, "a/x/y b/z", "a b/z/x/y"),
        (2, "a/z/y/x b c", "a/z b c/y/x"),
    ],
)
def test_all_to_all_multi_axis_order(mesh_i, in_spec, out_spec):
    mesh = mesh_of(mesh_i)
    shape = (8, 8, 4)[: len(ShapeSpec.parse(in_spec).dims)]
    x = np.arange(math.prod(shape), dtype=np.float32).reshape(shape)
    run_op(
        mesh,
        lambda v: shardops.all_to_all(f"{in_spec} -> {out_spec}", v),
        [in_spec],
        out_spec,
        [x],
        lambda v: v,
        exact=True,
        collectives={"all_to_all": 1},
    )


@settings(max_examples=examples(8))
@given(data=st.data())
def test_all_to_all_there_and_back_is_identity(data):
    mesh, in_spec, out_spec, shape, _ = draw_all_to_all(data)

    def body(x):
        y = shardops.all_to_all(f"{in_spec} -> {out_spec}", x)
        return shardops.all_to_all(f"{out_spec} -> {in_spec}", y)

    seed = data.draw(st.integers(0, 2**16), label="seed")
    run_op(
        mesh,
        body,
        [in_spec],
        in_spec,
        [normal(np.random.default_rng(seed), shape)],
        lambda x: x,
        check_vma=data.draw(st.booleans(), label="check_vma"),
        exact=True,
        collectives={"all_to_all": 2},
        seed=seed,
    )


@settings(max_examples=examples(8))
@given(data=st.data())
def test_psum_scatter_then_all_gather_equals_psum(data):
    mesh = draw_mesh(data)
    order = data.draw(st.permutations(mesh.axis_names), label="axes")
    n_add = data.draw(st.integers(1, len(order)), label="n_add")
    added, rest = order[:n_add], order[n_add:]
    layout = draw_layout(data, rest, 2)
    target = data.draw(st.integers(0, 1), label="target")
    out_layout = list(layout)
    out_layout[target] = layout[target] + tuple(added)
    shape = draw_sizes(data, mesh, out_layout)
    spec, scattered = spec_str("ab", layout), spec_str("ab", out_layout)

    def body(u):
        s = shardops.psum_scatter(f"{spec} -> {scattered}", u[0])
        return jnp.stack(
            [shardops.all_gather(f"{scattered} -> {spec}", s), shardops.psum(spec, u[0], added)]
        )

    seed = data.draw(st.integers(0, 2**16), label="seed")
    run_op(
        mesh,
        body,
        [stacked(added, spec)],
        f"2 {spec}",
        [normal(np.random.default_rng(seed), (factor(mesh, added), *shape))],
        lambda u: jnp.stack([u.sum(0), u.sum(0)]),
        check_vma=data.draw(st.booleans(), label="check_vma"),
        collectives={"reduce_scatter": 1, "all_gather": 1, "all_reduce": 1},
        seed=seed,
    )


# ---------------------------------------------------------------------------------------------
# einsum_unreduced
# ---------------------------------------------------------------------------------------------


@settings(max_examples=examples(20))
@given(data=st.data())
def test_einsum_unreduced(data):
    mesh = draw_mesh(data)
    n_ops = data.draw(st.integers(1, 3), label="n_operands")
    pool = st.sampled_from("abcde")
    operands = [
        data.draw(st.lists(pool, min_size=1, max_size=3, unique=True), label="operand")
        for _ in range(n_ops)
    ]
    used = list(dict.fromkeys(n for o in operands for n in o))
    out = data.draw(st.permutations(used), label="out")[: data.draw(st.integers(0, len(used)))]
    layout = dict(zip(used, draw_layout(data, mesh.axis_names, len(used)), strict=True))
    unreduced = tuple(a for n in used if n not in out for a in layout[n])
    size = {n: factor(mesh, layout[n]) * data.draw(st.integers(1, 3)) for n in used}
    scatter_to = None
    if unreduced and out and data.draw(st.booleans(), label="scatter"):
        scatter_to = data.draw(st.sampled_from(out), label="scatter_to")
        size[scatter_to] *= factor(mesh, unreduced)

    def spec(ns, extra=None):
        return " ".join(dim_str(n, layout[n] + (unreduced if n == extra else ())) for n in ns)

    text = ", ".join(spec(o) for o in operands) + " -> " + spec(out)
    out_spec = spec(out, scatter_to)

    def body(*xs):
        y = shardops.einsum_unreduced(text, *xs)
        if scatter_to is not None:
            return shardops.psum_scatter(f"{spec(out)} -> {out_spec}", y)
        if unreduced:
            return shardops.psum(spec(out), y, unreduced)
        return y

    eq = ",".join("".join(o) for o in operands) + "->" + "".join(out)
    seed = data.draw(st.integers(0, 2**16), label="seed")
    rng = np.random.default_rng(seed)
    run_op(
        mesh,
        body,
        [spec(o) for o in operands],
        out_spec,
        [normal(rng, [size[n] for n in o]) for o in operands],
        lambda *xs: jnp.einsum(eq, *xs),
        diff=tuple(range(n_ops)),
        check_vma=data.draw(st.booleans(), label="check_vma"),
        tol=1e-4,
        collectives={
            "all_reduce": int(bool(unreduced) and scatter_to is None),
            "reduce_scatter": int(scatter_to is not None),
        },
        seed=seed,
    )


def test_einsum_unreduced_preferred_element_type():
    mesh = mesh_of(1)
    rng = np.random.default_rng(5)
    x = normal(rng, (8, 16)).astype(jnp.bfloat16)
    w = normal(rng, (16, 6)).astype(jnp.bfloat16)
    text = "B/x M/y, M/y F -> B/x F"

    def body(a, b):
        y = shardops.einsum_unreduced(text, a, b, preferred_element_type=jnp.float32)
        assert y.dtype == jnp.float32
        return shardops.psum("B/x F", y, "y")

    run_op(
        mesh,
        body,
        ["B/x M/y", "M/y F"],
        "B/x F",
        [x, w],
        lambda a, b: jnp.einsum("bm,mf->bf", a, b, preferred_element_type=jnp.float32),
        diff=(),
        tol=1e-3,
    )


def test_einsum_unreduced_emits_no_collective():
    mesh = mesh_of(2)
    text = "B/x M/y/z, M/y/z F -> B/x F"
    x, w = normal(np.random.default_rng(6), (4, 8)), normal(np.random.default_rng(7), (8, 3))
    f = jax.shard_map(
        # Return the partial sums themselves, as blocks: assume_reduced drops the pending mark.
        lambda a, b: shardops.assume_reduced(shardops.einsum_unreduced(text, a, b))[None],
        mesh=mesh,
        in_specs=(P("x", ("y", "z")), P(("y", "z"))),
        out_specs=P(("y", "z"), "x"),
    )
    with jax.set_mesh(mesh):
        args = place(x, mesh, "B/x M/y/z"), place(w, mesh, "M/y/z F")
        counts = count_collectives(jax.jit(f).lower(*args).as_text())
        partial = np.asarray(jax.jit(f)(*args))
    assert counts == Counter()
    # The unreduced blocks, summed on the host, give the product.
    np.testing.assert_allclose(partial.sum(0), x @ w, rtol=1e-5, atol=1e-5)
    # ... and each block is the product of this device's slices of M.
    np.testing.assert_allclose(partial[1], x[:, 2:4] @ w[2:4], rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# index_unreduced
# ---------------------------------------------------------------------------------------------


def one_hot_lookup(table_names, idx_names, out_names):
    """The reference lookup as an einsum with a one-hot of the indices (zeros off range)."""
    v = table_names.index("V")
    eq = "".join(table_names) + "," + "".join(idx_names) + "V->" + "".join(out_names)

    def ref(table, idx):
        hot = (jnp.asarray(idx)[..., None] == jnp.arange(table.shape[v])).astype(table.dtype)
        return jnp.einsum(eq, table, hot)

    return ref


@settings(max_examples=examples(16))
@given(data=st.data())
def test_index_unreduced(data):
    mesh = draw_mesh(data)
    shared = data.draw(st.lists(st.sampled_from("st"), unique=True, max_size=2), label="shared")
    t_own = data.draw(st.lists(st.sampled_from("mn"), unique=True, max_size=2), label="table")
    i_own = data.draw(st.lists(st.sampled_from("bl"), unique=True, max_size=2), label="idx")
    t_names = data.draw(st.permutations(["V", *shared, *t_own]), label="table order")
    i_names = data.draw(st.permutations([*shared, *i_own]), label="idx order")
    o_names = data.draw(st.permutations([*shared, *t_own, *i_own]), label="out order")
    every = ["V", *shared, *t_own, *i_own]
    layout = dict(zip(every, draw_layout(data, mesh.axis_names, len(every)), strict=True))
    size = {n: factor(mesh, layout[n]) * data.draw(st.integers(1, 3)) for n in every}

    def spec(ns):
        return " ".join(("[{}]" if n == "V" else "{}").format(dim_str(n, layout[n])) for n in ns)

    text = f"{spec(t_names)}, {spec(i_names)} -> {spec(o_names)}"
    out_spec = spec(o_names)
    idx_dtype = data.draw(st.sampled_from([np.int32, np.int16, np.uint8]), label="idx dtype")
    seed = data.draw(st.integers(0, 2**16), label="seed")
    rng = np.random.default_rng(seed)
    low = 0 if idx_dtype == np.uint8 else -3
    idx = rng.integers(low, size["V"] + 3, [size[n] for n in i_names]).astype(idx_dtype)
    table = normal(rng, [size[n] for n in t_names])

    def body(t, i):
        y = shardops.index_unreduced(text, t, i)
        return shardops.psum(out_spec, y, layout["V"]) if layout["V"] else y

    run_op(
        mesh,
        body,
        [spec(t_names).replace("[", "").replace("]", ""), spec(i_names)],
        out_spec,
        [table, idx],
        one_hot_lookup(t_names, i_names, o_names),
        check_vma=data.draw(st.booleans(), label="check_vma"),
        collectives={"all_reduce": int(bool(layout["V"]))},
        seed=seed,
    )


@pytest.mark.parametrize(
    "mesh_i, v_axes, m_axes",
    [
        (1, ("x", "y"), ()),
        (1, ("y", "x"), ()),
        (2, ("z", "x"), ("y",)),
        (2, ("y", "z", "x"), ()),
        (2, (), ("x", "z")),
    ],
)
def test_index_unreduced_multi_axis_table(mesh_i, v_axes, m_axes):
    """'[V/x/y]': device (i, j) holds rows of block i*|y| + j and finds only those."""
    mesh = mesh_of(mesh_i)
    v_dim, m_dim = dim_str("V", v_axes), dim_str("M", m_axes)
    b_axes = tuple(a for a in mesh.axis_names if a not in v_axes + m_axes)
    b_dim = dim_str("B", b_axes)
    text = f"[{v_dim}] {m_dim}, {b_dim} L -> {b_dim} L {m_dim}"
    table = np.arange(16 * 4, dtype=np.float32).reshape(16, 4) + 1
    rng = np.random.default_rng(8)
    idx = rng.integers(-4, 20, (8, 5)).astype(np.int32)

    def body(t, i):
        y = shardops.index_unreduced(text, t, i)
        return shardops.psum(f"{b_dim} L {m_dim}", y, v_axes) if v_axes else y

    run_op(
        mesh,
        body,
        [f"{v_dim} {m_dim}", f"{b_dim} L"],
        f"{b_dim} L {m_dim}",
        [table, idx],
        one_hot_lookup("VM", "bl", "blM"),
        exact=False,
    )


def test_index_unreduced_unreduced_blocks_and_out_of_range():
    """Each device returns only the rows in its block; others, and bad indices, are zeros.

    The lookup itself communicates nothing: the blocks come back unreduced.
    """
    mesh = mesh_of(1)
    table = np.arange(16 * 3, dtype=np.float32).reshape(16, 3) + 1
    idx = np.array([[0, 5, 15, -1], [16, 7, 8, 100]], dtype=np.int32)
    text = "[V/y/x] M, B L -> B L M"
    f = jax.shard_map(
        lambda t, i: shardops.assume_reduced(shardops.index_unreduced(text, t, i))[None, None],
        mesh=mesh,
        in_specs=(P(("y", "x")), P()),
        out_specs=P("y", "x"),
    )
    with jax.set_mesh(mesh):
        args = place(table, mesh, "V/y/x M"), place(idx, mesh, "B L")
        out = np.asarray(jax.jit(f)(*args))
        assert count_collectives(jax.jit(f).lower(*args).as_text()) == Counter()
    assert out.shape == (2, 4, 2, 4, 3)
    for j in range(2):
        for i in range(4):
            lo = (j * 4 + i) * 2  # block j*|x| + i of V, two rows each
            mine = (idx >= lo) & (idx < lo + 2)
            want = np.where(mine[..., None], table[np.clip(idx, 0, 15)], 0)
            np.testing.assert_array_equal(out[j, i], want, err_msg=f"device y={j} x={i}")
    # Out-of-range and negative indices are zeros on every device.
    assert not out[:, :, 0, 3].any() and not out[:, :, 1, 0].any() and not out[:, :, 1, 3].any()


# ---------------------------------------------------------------------------------------------
# axis_size, axis_index
# ---------------------------------------------------------------------------------------------


def _axis_combos(names):
    for r in range(1, len(names) + 1):
        yield from itertools.permutations(names, r)


@pytest.mark.parametrize("mesh_i, jit", [(0, True), (1, True), (2, True), (1, False)])
def test_axis_size_and_axis_index(mesh_i, jit):
    """Sizes and row-major indices for every ordered subset of mesh axes; no collective."""
    mesh = mesh_of(mesh_i)
    sizes = sizes_of(mesh)
    combos = list(_axis_combos(mesh.axis_names))
    seen_sizes: dict[tuple[str, ...], int] = {}

    def body():
        outs = []
        for axes in combos:
            form = "/".join(axes) if len(axes) % 2 else axes  # both argument forms
            seen_sizes[axes] = shardops.axis_size(form)
            outs.append(shardops.axis_index(form)[None])
        return tuple(outs)

    rest = [tuple(a for a in mesh.axis_names if a not in axes) for axes in combos]
    f = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(),
        out_specs=tuple(P(axes + r) for axes, r in zip(combos, rest, strict=True)),
    )
    with jax.set_mesh(mesh):
        outs = (jax.jit(f) if jit else f)()
        if jit:
            assert count_collectives(jax.jit(f).lower().as_text()) == Counter()
    for axes, r, out in zip(combos, rest, outs, strict=True):
        assert seen_sizes[axes] == math.prod(sizes[a] for a in axes)
        assert isinstance(seen_sizes[axes], int)
        n_rest = math.prod(sizes[a] for a in r)
        # Row-major over the axes as written: entry k of the output is device block k.
        np.testing.assert_array_equal(np.asarray(out), np.arange(8) // n_rest, err_msg=str(axes))


# ---------------------------------------------------------------------------------------------
# Eager (no jit) and typed_shard_map
# ---------------------------------------------------------------------------------------------

_EAGER = [
    ("all_gather", "a/x/y b/z -> a/x b"),
    ("psum_scatter", "a b -> a b/z/x"),
    ("all_to_all", "a/x/y b -> a/x b/y"),
]


@pytest.mark.parametrize("op, text", _EAGER)
def test_layout_ops_eager(op, text):
    mesh = mesh_of(2)
    in_spec, out_spec = (s.strip() for s in text.split("->"))
    x = normal(np.random.default_rng(9), (8, 8))
    if op == "psum_scatter":
        run_op(
            mesh,
            lambda u: shardops.psum_scatter(text, u[0]),
            ["rep/z/x a b"],
            out_spec,
            [normal(np.random.default_rng(9), (4, 8, 8))],
            lambda u: u.sum(0),
            jit=False,
        )
    else:
        run_op(
            mesh,
            lambda v: getattr(shardops, op)(text, v),
            [in_spec],
            out_spec,
            [x],
            lambda v: v,
            jit=False,
            exact=True,
        )


@pytest.mark.slow
def test_local_ops_and_psum_eager():
    mesh = mesh_of(1)
    rng = np.random.default_rng(10)
    x, w, table = normal(rng, (8, 6)), normal(rng, (6, 4)), normal(rng, (12, 4))
    idx = rng.integers(-2, 14, (8,)).astype(np.int32)

    def body(a, b, t, i):
        h = shardops.einsum_unreduced("B/x M/y, M/y F -> B/x F", a, b)
        h = shardops.psum("B/x F", h, "y")
        e = shardops.index_unreduced("[V/y] F, B/x -> B/x F", t, i)
        return h + shardops.psum("B/x F", e, "y")

    run_op(
        mesh,
        body,
        ["B/x M/y", "M/y F", "V/y F", "B/x"],
        "B/x F",
        [x, w, table, idx],
        lambda a, b, t, i: a @ b + one_hot_lookup("VF", "B", "BF")(t, i),
        diff=(0, 1, 2),
        jit=False,
        tol=1e-4,
    )


@pytest.mark.parametrize("check_vma", [True, False])
def test_typed_shard_map_mlp_block(check_vma):
    """An FSDP + tensor-parallel block: gather weights, local matmul, reduce-scatter."""
    mesh = mesh_of(1)

    @typed_shard_map(check_vma=check_vma)
    def block(x: f32[b"B/x M/y"], w: f32[b"M/y F/x"]) -> f32[b"B/x F/y"]:
        full = shardops.all_gather(b"M/y F/x -> M/y F", w)  # bytes specs work too
        h = shardops.einsum_unreduced("B/x M/y, M/y F -> B/x F", x, full)
        return shardops.psum_scatter("B/x F -> B/x F/y", h)

    rng = np.random.default_rng(11)
    x, w = normal(rng, (8, 6)), normal(rng, (6, 8))
    cot = normal(rng, (8, 8))
    with jax.set_mesh(mesh):
        xs, ws = place(x, mesh, "B/x M/y"), place(w, mesh, "M/y F/x")
        y = jax.jit(block)(xs, ws)
        grads = jax.jit(jax.grad(lambda a, b: jnp.sum(block(a, b) * cot), argnums=(0, 1)))(xs, ws)
    assert y.sharding.spec == P("x", "y")
    np.testing.assert_allclose(np.asarray(y), x @ w, rtol=1e-5, atol=1e-5)
    want = jax.grad(lambda a, b: jnp.sum((a @ b) * cot), argnums=(0, 1))(x, w)
    for g, gw in zip(grads, want, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(gw), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("check_vma", [True, False])
def test_typed_shard_map_embedding_lookup(check_vma):
    mesh = mesh_of(2)

    @typed_shard_map(check_vma=check_vma)
    def embed(table: f32[b"V/y/z M"], tokens: i32[b"B/x L"]) -> f32[b"B/x L M"]:
        e = shardops.index_unreduced("[V/y/z] M, B/x L -> B/x L M", table, tokens)
        return shardops.psum("B/x L M", e, "y/z")

    rng = np.random.default_rng(12)
    table = normal(rng, (12, 3))
    tokens = rng.integers(0, 12, (4, 5)).astype(np.int32)
    cot = normal(rng, (4, 5, 3))
    with jax.set_mesh(mesh):
        ts, ks = place(table, mesh, "V/y/z M"), place(tokens, mesh, "B/x L")
        y = jax.jit(embed)(ts, ks)
        g = jax.jit(jax.grad(lambda t: jnp.sum(embed(t, ks) * cot)))(ts)
    np.testing.assert_array_equal(np.asarray(y), table[tokens])
    want = np.zeros_like(table)
    np.add.at(want, tokens, cot)
    np.testing.assert_allclose(np.asarray(g), want, rtol=1e-5, atol=1e-5)


def test_typed_shard_map_binds_op_dims_to_annotations():
    """The body's annotations and its op specs share one binding scope."""
    mesh = mesh_of(0)

    @typed_shard_map
    def bad(x: f32[b"B/d M"]) -> f32[b"B/d M"]:
        # 'M' is bound to 6 by the annotation; this spec's input has M = 3.
        return shardops.einsum_unreduced("B/d M -> B/d M", x[:, :3]).sum() + x

    with jax.set_mesh(mesh), pytest.raises(TypeCheckError) as e:
        jax.jit(bad)(np.zeros((8, 6), np.float32))
    msg = str(e.value)
    assert "einsum_unreduced('B/d M -> B/d M') operand 0" in msg
    assert re.search(r"dim 1 'M': expected size 6\b.*got 3\b", msg), msg


# ---------------------------------------------------------------------------------------------
# Errors (the full misuse catalogue lives elsewhere)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("jit", [False, True])
def test_op_outside_shard_map_names_axis_and_typed_shard_map(jit):
    mesh = mesh_of(0)
    x = np.zeros((8, 2), np.float32)

    def f(v):
        return shardops.all_gather("a/d b -> a b", v)

    with jax.set_mesh(mesh), pytest.raises(ValueError, match="typed_shard_map") as e:
        (jax.jit(f) if jit else f)(place(x, mesh, "a/d b"))
    assert "all_gather('a/d b -> a b')" in str(e.value) and "'d'" in str(e.value)
    for call in (lambda: shardops.axis_size("d"), lambda: shardops.psum("a", x[:, 0], "d")):
        with pytest.raises(ValueError, match="'d'.*typed_shard_map"):
            call()


def test_axis_not_manual_in_partially_manual_shard_map():
    mesh = mesh_of(1)
    x = np.zeros((8, 4), np.float32)

    def body(v):
        return shardops.all_gather("a/x b/y -> a/x b", v)

    f = jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x"), axis_names={"x"})
    with jax.set_mesh(mesh), pytest.raises(ValueError) as e:
        jax.jit(f)(place(x, mesh, "a/x b"))
    msg = str(e.value)
    assert "all_gather('a/x b/y -> a/x b')" in msg
    assert "'y' is not a manual axis" in msg and "x=4" in msg


def test_input_shape_contradicting_spec():
    mesh = mesh_of(0)
    text = "a b/d, b/d c -> a c"

    def body(x, w):
        return shardops.einsum_unreduced(text, x, w)

    f = jax.shard_map(body, mesh=mesh, in_specs=(P(None, "d"), P("d")), out_specs=P())
    with jax.set_mesh(mesh), pytest.raises(TypeCheckError) as e:
        jax.jit(f)(
            place(np.zeros((3, 16), np.float32), mesh, "a b/d"),
            place(np.zeros((24, 2), np.float32), mesh, "b/d c"),
        )
    msg = str(e.value)
    assert f"einsum_unreduced({text!r}) operand 1" in msg
    assert re.search(r"dim 0 'b/d': expected size 16\b.*got 24\b", msg), msg

    g = jax.shard_map(
        lambda v: shardops.all_to_all("a/d b -> a b/d", v),
        mesh=mesh,
        in_specs=P("d"),
        out_specs=P("d"),
    )
    with jax.set_mesh(mesh), pytest.raises(TypeCheckError) as e:
        jax.jit(g)(place(np.zeros((8,), np.float32), mesh, "a/d"))
    msg = str(e.value)
    assert "all_to_all('a/d b -> a b/d') input" in msg and "rank: expected 2 dims" in msg


def test_psum_over_axis_the_spec_shards():
    with pytest.raises(SpecError) as e:
        shardops.psum("a/x b", np.zeros((2, 2), np.float32), axes=("y", "x"))
    msg = str(e.value)
    assert "psum" in msg and "'x'" in msg and "dim 0 'a/x'" in msg


# ---------------------------------------------------------------------------------------------
# The helpers themselves
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("spec", ["a/x/y b", "a/y b/x", "a b/y/x"])
def test_blocks_matches_placement(spec):
    mesh = mesh_of(1)
    x = np.arange(64, dtype=np.float32).reshape(8, 8)
    placed = place(x, mesh, spec)
    want = blocks(x, mesh, spec)
    pos = {d.id: c for c, d in np.ndenumerate(mesh.devices)}
    for shard in placed.addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), want[pos[shard.device.id]])


# ---------------------------------------------------------------------------------------------
# Forward- and reverse-mode derivatives, checked numerically
# ---------------------------------------------------------------------------------------------

_GRAD_CASES = {
    "all_gather": ("a/x/y b", "a/x b", lambda v: shardops.all_gather("a/x/y b -> a/x b", v)),
    # pcast: a value that differs per device of 'y' (summing copies JAX knows are equal is
    # refused: see test_pending.py).
    "psum_scatter": (
        "a b",
        "a b/y",
        lambda v: shardops.psum_scatter("a b -> a b/y", jax.lax.pcast(v, "y", to="varying")),
    ),
    "all_to_all": ("a/y b/x", "a b/x/y", lambda v: shardops.all_to_all("a/y b/x -> a b/x/y", v)),
    "pmax": ("a/x b", "a/x b", lambda v: shardops.pmax("a/x b", v, "y")),
    "pmin": ("a/x b", "a/x b", lambda v: shardops.pmin("a/x b", v, "y")),
    "pmean": (
        "a/x b",
        "a/x b",
        lambda v: shardops.pmean("a/x b", jax.lax.pcast(v, "y", to="varying"), "y"),
    ),
    "einsum_unreduced": (
        "a/x b/y",
        "a/x",
        lambda v: shardops.psum(
            "a/x", shardops.einsum_unreduced("a/x b/y, a/x b/y -> a/x", v, v), "y"
        ),
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("op", sorted(_GRAD_CASES))
def test_check_grads_forward_and_reverse(op):
    from jax.test_util import check_grads

    in_spec, out_spec, body = _GRAD_CASES[op]
    mesh = mesh_of(1, auto=True)  # check_grads perturbs inputs; Auto axes take any layout
    f = jax.jit(
        jax.shard_map(
            lambda v: body(v)[None],
            mesh=mesh,
            in_specs=ShapeSpec.parse(in_spec).partition_spec(),
            out_specs=P(
                tuple(a for a in mesh.axis_names if a not in ShapeSpec.parse(out_spec).mesh_axes())
                or None,
                *ShapeSpec.parse(out_spec).partition_entries(),
            ),
        )
    )
    x = normal(np.random.default_rng(13), (8, 8))
    with jax.set_mesh(mesh):
        check_grads(f, (place(x, mesh, in_spec),), order=2, modes=("fwd", "rev"), eps=1e-2)


def test_local_ops_work_outside_shard_map():
    """einsum_unreduced and an unsharded index_unreduced need no mesh axis."""
    rng = np.random.default_rng(14)
    x, w, table = normal(rng, (4, 5)), normal(rng, (5, 3)), normal(rng, (6, 3))
    idx = np.array([[0, 5, -1], [6, 2, 3]], np.int32)
    y = shardops.einsum_unreduced("B M, M F -> F B", x, w)
    np.testing.assert_allclose(np.asarray(y), (x @ w).T, rtol=1e-5, atol=1e-5)
    e = shardops.index_unreduced("[V] F, B L -> L F B", table, idx)
    want = np.where(((idx >= 0) & (idx < 6))[..., None], table[np.clip(idx, 0, 5)], 0)
    np.testing.assert_array_equal(np.asarray(e), want.transpose(1, 2, 0))
