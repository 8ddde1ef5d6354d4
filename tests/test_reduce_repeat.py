"""``shardops.reduce`` and ``shardops.repeat``: random legal patterns against einops on the
global array, and a table of refused patterns with their messages.

The random cases are written as `tests.test_rearrange`'s are (`tests._einops_cases`): factors
with global sizes, grouped into terms, mesh axes only on factors that lead their term. ``reduce`` drops
factors that no mesh axis splits; ``repeat`` adds factors, some split over the mesh axes the
input does not use. Each body runs inside ``typed_shard_map`` on the 1-D, 2-D and 3-D meshes
(eagerly and under ``jit``; ``'sum'`` also under ``grad``), and the global result must equal
``einops.reduce``/``einops.repeat`` of the global input with the axes erased.
"""

from __future__ import annotations

import random
from typing import Any

import einops
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from typeguard import TypeCheckError

from shardlib import SpecError, shardops
from shardlib._ops.reduce_repeat_recipe import reduce_recipe, repeat_recipe
from shardlib.shardtypes import Array, f32, register_with_typeguard, typed_shard_map
from tests import _einops_cases as cases
from tests._mesh_util import MESHES, count_collectives, make_mesh

register_with_typeguard()

_REDUCTIONS = ("sum", "mean", "max", "min", "prod")


def random_reduce_case(rng: random.Random, mesh_index: int) -> dict[str, Any]:
    """A legal reduce pattern: the dims it removes are split over no mesh axis."""
    mesh_axes, axis_size = cases.mesh_sizes(mesh_index)
    names = list("abcdef"[: rng.randint(2, 5)])
    rng.shuffle(names)
    axes = cases.assign_axes(
        rng, mesh_axes, rng.sample(names, k=rng.randint(0, min(2, len(names) - 1)))
    )
    unsplit = [n for n in names if n not in axes]
    reduced = set(rng.sample(unsplit, k=rng.randint(1, min(len(unsplit), len(names) - 1))))
    kept = [n for n in names if n not in reduced]
    rng.shuffle(kept)
    ins, outs = cases.group(rng, names, set(axes)), cases.group(rng, kept, set(axes))
    case = cases.make_case(rng, ins, outs, axes, cases.global_sizes(rng, names, axes, axis_size))
    case["reduction"] = rng.choice(_REDUCTIONS)
    return case


def random_repeat_case(rng: random.Random, mesh_index: int) -> dict[str, Any]:
    """A legal repeat pattern: new dims split only over axes the input does not use."""
    mesh_axes, axis_size = cases.mesh_sizes(mesh_index)
    names = list("abcd"[: rng.randint(1, 4)])
    new = list("uvw"[: rng.randint(1, 2)])
    rng.shuffle(names)
    pool = names + new
    axes = cases.assign_axes(rng, mesh_axes, rng.sample(pool, k=rng.randint(0, min(3, len(pool)))))
    out_names = pool[:]
    rng.shuffle(out_names)
    ins, outs = cases.group(rng, names, set(axes)), cases.group(rng, out_names, set(axes))
    return cases.make_case(
        rng, ins, outs, axes, cases.global_sizes(rng, pool, axes, axis_size), new=new
    )


def _body(case: dict[str, Any]) -> Any:
    pattern, sizes, reduction = case["pattern"], case["sizes"], case.get("reduction")

    def body(x):
        if reduction is None:
            return shardops.repeat(pattern, x, **sizes)
        return shardops.reduce(pattern, x, reduction, **sizes)

    return cases.typed_body(body, case["ann_in"], case["ann_out"])


def _input(case: dict[str, Any], k: int) -> np.ndarray:
    x = np.random.default_rng(k).standard_normal(case["shape"]).astype(np.float32)
    if case.get("reduction") == "prod":  # keep products of a few dozen factors finite
        x = (1 + 0.05 * x).astype(np.float32)
    return x


_N_CASES = 16  # per mesh and op


@pytest.mark.slow
@pytest.mark.parametrize("mesh_index", range(len(MESHES)))
def test_random_legal_reduce_patterns_match_einops(mesh_index):
    rng = random.Random(2000 + mesh_index)
    mesh = cases.mesh_of(mesh_index)
    for k in range(_N_CASES):
        case = random_reduce_case(rng, mesh_index)
        x = _input(case, k)
        want = einops.reduce(x, case["plain"], case["reduction"], **case["sizes"])
        f = _body(case)
        with jax.set_mesh(mesh):
            got = f(x) if k % 2 else jax.jit(f)(x)
            np.testing.assert_allclose(
                np.asarray(got), want, rtol=1e-5, atol=1e-5, err_msg=str(case)
            )
        if case["reduction"] == "sum":
            _check_grad(mesh, f, case, x, k)


def _check_grad(mesh: Any, f: Any, case: dict[str, Any], x: np.ndarray, k: int) -> None:
    """The gradient of a sum through ``f`` equals einops' on the global array."""
    want = einops.reduce(x, case["plain"], "sum", **case["sizes"])
    cot = np.random.default_rng(k + 1).standard_normal(want.shape).astype(np.float32)
    with jax.set_mesh(mesh):
        g = jax.jit(jax.grad(lambda x: jnp.sum(f(x) * cot)))(x)
    ref = jax.grad(lambda x: jnp.sum(einops.reduce(x, case["plain"], "sum", **case["sizes"]) * cot))
    np.testing.assert_allclose(np.asarray(g), np.asarray(ref(jnp.asarray(x))), err_msg=str(case))


@pytest.mark.slow
@pytest.mark.parametrize("mesh_index", range(len(MESHES)))
def test_random_legal_repeat_patterns_match_einops(mesh_index):
    rng = random.Random(3000 + mesh_index)
    mesh = cases.mesh_of(mesh_index)
    for k in range(_N_CASES):
        case = random_repeat_case(rng, mesh_index)
        x = _input(case, k)
        want = einops.repeat(x, case["plain"], **case["sizes"])
        f = _body(case)
        with jax.set_mesh(mesh):
            got = f(x) if k % 2 else jax.jit(f)(x)
        np.testing.assert_array_equal(np.asarray(got), want, err_msg=str(case))


def test_reduce_and_repeat_emit_no_collectives_and_use_local_sizes():
    mesh = make_mesh((4, 2), ("d", "t"))
    seen = {}

    @typed_shard_map
    def f(x: f32[Array, b"B/d L HD/t"]) -> f32[Array, b"B/d R L H/t"]:
        h = shardops.reduce("B/d L (H D)/t -> B/d L H/t", x, "max", D=3)
        seen["reduced"] = h.shape
        y = shardops.repeat("B/d L H/t -> B/d (R L) H/t", h, R=2)  # R unsplit: t is used
        seen["repeated"] = y.shape
        return shardops.rearrange("B/d (R L) H/t -> B/d R L H/t", y, R=2)

    @typed_shard_map
    def g(x: f32[Array, b"B/d M"]) -> f32[Array, b"B/d R/t M"]:
        y = shardops.repeat("B/d M -> B/d R/t M", x, R=6)
        seen["split"] = y.shape
        return y

    x = np.random.default_rng(0).standard_normal((8, 5, 12)).astype(np.float32)
    with jax.set_mesh(mesh):
        got = np.asarray(jax.jit(f)(x))
        hlo = jax.jit(f).lower(x).as_text() + jax.jit(g).lower(x[:, 0]).as_text()
        split = np.asarray(jax.jit(g)(x[:, 0]))
    assert seen == {"reduced": (2, 5, 2), "repeated": (2, 10, 2), "split": (2, 3, 12)}
    h = einops.reduce(x, "b l (h d) -> b l h", "max", d=3)
    np.testing.assert_array_equal(got, einops.repeat(h, "b l h -> b r l h", r=2))
    np.testing.assert_array_equal(split, einops.repeat(x[:, 0], "b m -> b r m", r=6))
    assert not count_collectives(hlo)


def test_repeat_binds_the_new_dim_in_the_scope():
    mesh = make_mesh((4, 2), ("d", "t"))

    @typed_shard_map
    def f(x: f32[Array, b"B/d M"]) -> f32[Array, b"B/d R/t M"]:
        y = shardops.repeat("B/d M -> B/d R/t M", x, R=4)
        return shardops.rearrange("B/d R/t M -> B/d R/t M", y, R=2)

    with jax.set_mesh(mesh), pytest.raises(TypeCheckError, match=r"R=2 disagrees.*R=4"):
        f(np.zeros((8, 3), np.float32))


# ---------------------------------------------------------------------------------------------
# Refused patterns
# ---------------------------------------------------------------------------------------------

# (op, pattern, reduction, key phrases of the message)
ILLEGAL = [
    (
        "reduce",
        "B/d L/t H -> B/d H",
        "sum",
        [
            "dim L is split over 't' ('L/t')",
            "this device's part of the result",
            "y = einops.reduce(x, 'B L H -> B H', 'sum')",
            "shardops.psum('B/d H', y, axes='t')",
        ],
    ),
    ("reduce", "B/d L/t H -> B/d H", "mean", ["shardops.pmean('B/d H', y, axes='t')"]),
    ("reduce", "B L H/t/d -> B L", "max", ["'H/t/d'", "shardops.pmax('B L', y, axes='t/d')"]),
    ("reduce", "B/d L H/t -> L", "min", ["dim B is split over 'd'", "axes='d/t'"]),
    (
        "reduce",
        "B/d L/t H -> B/d H",
        "prod",
        [
            "no all-reduce multiplies",
            "shardops.all_gather('B/d L/t H -> B/d L H', x)",
            "shardops.reduce('B/d L H -> B/d H', x, 'prod')",
        ],
    ),
    (
        "reduce",
        "(H D)/t -> D",
        "sum",
        ["dim H is split over 't' ('(H D)/t')", "shardops.psum('D', y, axes='t')"],
    ),
    (
        "reduce",
        "H/t L -> H L",
        "sum",
        ["dim H is split over 't' in the input but not split in the output", "write 'H/t L ->"],
    ),
    ("reduce", "H D/t -> (H D)/t", "sum", ["a group's axes go to its leading factor"]),
    ("reduce", "H -> H R", "sum", ["dim 'R' of the output is not in the input", "repeat"]),
    ("reduce", "H, D -> H", "sum", ["unexpected ','"]),
    ("reduce", "H ((D)) -> H", "sum", ["nested parentheses"]),
    (
        "repeat",
        "H/t -> H/t R/t",
        None,
        [
            "the new dim R is split over 't' ('R/t'), which the input already uses ('H/t')",
            "over a mesh axis the input does not use, or leave it unsplit",
        ],
    ),
    ("repeat", "H/t -> (R H)/t", None, ["the new dim R", "already uses ('H/t')"]),
    ("repeat", "H -> (H R)/t", None, ["dim H is not split in the input but split over 't'"]),
    ("repeat", "H D -> H R", None, ["dim 'D' of the input is not in the output", "reduce"]),
    ("repeat", "H -> H R R", None, ["dim 'R' appears twice in the output"]),
    ("repeat", "H -> H 3", None, ["literal size '3'"]),
]


@pytest.mark.parametrize(
    ("op", "pattern", "reduction", "phrases"), ILLEGAL, ids=[f"{o}:{p}" for o, p, *_ in ILLEGAL]
)
def test_illegal_patterns_are_refused_with_their_message(op, pattern, reduction, phrases):
    with pytest.raises(SpecError) as info:
        reduce_recipe(pattern, reduction) if op == "reduce" else repeat_recipe(pattern)
    cases.assert_refusal(str(info.value), op, pattern, phrases)


def test_a_reduction_over_a_split_dim_fails_at_trace_time_inside_the_body():
    mesh = make_mesh((4, 2), ("d", "t"))

    @typed_shard_map
    def f(x: f32[Array, b"B/d L/t"]) -> f32[Array, b"B/d"]:
        return shardops.reduce("B/d L/t -> B/d", x, "sum")

    with jax.set_mesh(mesh), pytest.raises(SpecError, match=r"shardops.psum\('B/d', y, axes='t'\)"):
        jax.jit(f).lower(np.zeros((8, 4), np.float32))


def test_an_unknown_reduction_is_refused():
    with pytest.raises(ValueError, match=r"reduction='median'.*one of 'sum', 'mean'"):
        shardops.reduce("a b -> a", jnp.zeros((2, 3)), "median")


@pytest.mark.parametrize(
    ("sizes", "phrases"),
    [
        ({}, ["the size of the new dim R is unknown", "e.g. R=4"]),
        ({"R": 3}, ["the new dim R=3 is split over t=2", "not divisible by 2"]),
        ({"R": -1}, ["must be a non-negative int"]),
    ],
)
def test_new_dim_sizes_that_do_not_fit_are_refused(sizes, phrases):
    mesh = make_mesh((4, 2), ("d", "t"))

    def body(x):
        return shardops.repeat("B/d -> B/d R/t", x, **sizes)

    f = cases.typed_body(body, "B/d", "B/d R/t")
    with jax.set_mesh(mesh), pytest.raises((TypeCheckError, TypeError)) as info:
        f(np.zeros((8,), np.float32))
    cases.assert_phrases(str(info.value), phrases)


def test_unsplit_patterns_work_anywhere():
    x = np.arange(24, dtype=np.float32).reshape(2, 12)
    got = shardops.reduce("a (b c) -> c 1", jnp.asarray(x), "sum", b=3)
    np.testing.assert_array_equal(np.asarray(got), einops.reduce(x, "a (b c) -> c 1", "sum", b=3))
    got = shardops.repeat("a b -> (r a) b", jnp.asarray(x), r=2)
    np.testing.assert_array_equal(np.asarray(got), einops.repeat(x, "a b -> (r a) b", r=2))


@pytest.mark.parametrize("reduction", ["sum", "max"])
def test_a_partial_sum_may_be_summed_but_not_maxed_over_an_unsplit_dim(reduction):
    mesh = make_mesh((4, 2), ("d", "t"))

    @typed_shard_map
    def f(x: f32[Array, b"B/d L M/t"], w: f32[Array, b"M/t F"]) -> f32[Array, b"B/d F"]:
        y = shardops.einsum_unreduced("B/d L M/t, M/t F -> B/d L F", x, w)  # pending over t
        z = shardops.reduce("B/d L F -> B/d F", y, reduction)
        return shardops.psum("B/d F", z, axes="t")

    x = np.random.default_rng(0).standard_normal((8, 3, 4)).astype(np.float32)
    w = np.random.default_rng(1).standard_normal((4, 5)).astype(np.float32)
    with jax.set_mesh(mesh):
        if reduction == "sum":  # linear: the sum of the parts is the part of the sum
            got = np.asarray(f(x, w))
            np.testing.assert_allclose(got, np.einsum("blm,mf->bf", x, w), rtol=1e-5, atol=1e-5)
        else:
            with pytest.raises(shardops.PendingReductionError, match="reduce_max"):
                f(x, w)
