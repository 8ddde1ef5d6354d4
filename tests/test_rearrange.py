"""``shardops.rearrange``: random legal patterns against einops on the global array, and a
table of refused patterns with their messages.

Each random case draws factors with global sizes, groups them into an input and an output
pattern, and gives mesh axes only to factors that lead their group (or stand alone) on both
sides: exactly the legal patterns. The body runs inside ``typed_shard_map`` on the 1-D, 2-D
and 3-D meshes of 8 CPU devices, eagerly and under ``jit``, and the global result must equal
``einops.rearrange`` of the global input with the axes removed from the pattern.
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
from shardlib._ops.rearrange_recipe import rearrange_recipe
from shardlib.shardtypes import Array, f32, register_with_typeguard, typed_shard_map
from tests import _einops_cases as cases
from tests._mesh_util import MESHES, make_mesh

register_with_typeguard()

# ---------------------------------------------------------------------------------------------
# Random legal patterns (tests/_einops_cases.py writes them)
# ---------------------------------------------------------------------------------------------


def random_case(rng: random.Random, mesh_index: int) -> dict[str, Any]:
    """One legal pattern on mesh ``mesh_index``: its texts, global shape and keyword sizes."""
    mesh_axes, axis_size = cases.mesh_sizes(mesh_index)
    names = list("abcdef"[: rng.randint(2, 5)])
    rng.shuffle(names)
    # Some factors are sharded: each mesh axis goes to one of them (or to none).
    axes = cases.assign_axes(
        rng, mesh_axes, rng.sample(names, k=rng.randint(0, min(2, len(names))))
    )
    lead = set(axes)
    ins = cases.group(rng, names, lead)
    out_names = names[:]
    rng.shuffle(out_names)
    outs = cases.group(rng, out_names, lead)
    return cases.make_case(rng, ins, outs, axes, cases.global_sizes(rng, names, axes, axis_size))


def _run(mesh: Any, case: dict[str, Any], x: np.ndarray, jit: bool) -> np.ndarray:
    pattern, sizes = case["pattern"], case["sizes"]

    def body(x):
        return shardops.rearrange(pattern, x, **sizes)

    f = cases.typed_body(body, case["ann_in"], case["ann_out"])
    with jax.set_mesh(mesh):
        return np.asarray((jax.jit(f) if jit else f)(x))


_N_CASES = 30  # per mesh


@pytest.mark.slow
@pytest.mark.parametrize("mesh_index", range(len(MESHES)))
def test_random_legal_patterns_match_einops_on_the_global_array(mesh_index):
    rng = random.Random(1000 + mesh_index)
    mesh = cases.mesh_of(mesh_index)
    for k in range(_N_CASES):
        case = random_case(rng, mesh_index)
        x = np.random.default_rng(k).standard_normal(case["shape"]).astype(np.float32)
        want = einops.rearrange(x, case["plain"], **case["sizes"])
        for jit in (k % 2 == 0, True) if k % 3 else (True,):
            got = _run(mesh, case, x, jit)
            np.testing.assert_array_equal(got, want, err_msg=f"{case} jit={jit}")


def test_the_per_device_pattern_uses_local_sizes():
    plan = rearrange_recipe("B/d L (H D)/t -> B/d L H/t D")
    assert plan.local == "a0 a1 (a2 a3) -> a0 a1 a2 a3"
    assert plan.sharding == {"B": ("d",), "L": (), "H": ("t",), "D": ()}
    mesh = make_mesh((4, 2), ("d", "t"))
    seen = {}

    @typed_shard_map
    def f(x: f32[Array, b"B/d L HD/t"]) -> f32[Array, b"B/d L H/t D"]:
        seen["local"] = x.shape
        y = shardops.rearrange("B/d L (H D)/t -> B/d L H/t D", x, D=3)
        seen["out"] = y.shape
        return y

    x = np.arange(8 * 5 * 12, dtype=np.float32).reshape(8, 5, 12)
    with jax.set_mesh(mesh):
        got = np.asarray(jax.jit(f)(x))
    assert seen == {"local": (2, 5, 6), "out": (2, 5, 2, 3)}  # H=4 globally, 2 per device
    np.testing.assert_array_equal(got, einops.rearrange(x, "b l (h d) -> b l h d", d=3))


def test_rearrange_binds_the_factors_in_the_scope():
    mesh = make_mesh((4, 2), ("d", "t"))

    @typed_shard_map
    def f(x: f32[Array, b"B/d HD/t"]) -> f32[Array, b"B/d H/t D"]:
        y = shardops.rearrange("B/d (H D)/t -> B/d H/t D", x, H=4)
        # H and D are bound now (global sizes): a later spec that disagrees is refused.
        return shardops.rearrange("B/d H/t D -> B/d H/t D", y, D=8)

    with jax.set_mesh(mesh), pytest.raises(TypeCheckError, match=r"D=8 disagrees.*D=2"):
        f(np.zeros((8, 8), np.float32))


def test_gradient_flows_through_rearrange():
    mesh = make_mesh((4, 2), ("d", "t"))

    @typed_shard_map
    def f(x: f32[Array, b"B/d HD/t"]) -> f32[Array, b"B/d D H/t"]:
        return shardops.rearrange("B/d (H D)/t -> B/d D H/t", x, H=4)

    x = np.random.default_rng(0).standard_normal((8, 12)).astype(np.float32)
    cot = np.random.default_rng(1).standard_normal((8, 3, 4)).astype(np.float32)
    with jax.set_mesh(mesh):
        g = jax.jit(jax.grad(lambda x: jnp.sum(f(x) * cot)))(x)
    np.testing.assert_allclose(np.asarray(g), einops.rearrange(cot, "b d h -> b (h d)"))


# ---------------------------------------------------------------------------------------------
# Refused patterns
# ---------------------------------------------------------------------------------------------

# (pattern, key phrases of the message)
ILLEGAL = [
    (
        "(H D)/t -> H D/t",
        [
            "the axis 't' of '(H D)/t' lands on its leading factor H",
            "output splits D",
            "write '(H D)/t -> H/t D'",
            "shardops.reshard('H/t D -> H D/t', y)",
        ],
    ),
    (
        "H D/t -> (H D)/t",
        [
            "the axis 't' of '(H D)/t' would land on its leading factor H",
            "input splits D",
            "x = shardops.reshard('H D/t -> H/t D', x)",
            "shardops.rearrange('H/t D -> (H D)/t', x)",
        ],
    ),
    ("(D H)/t -> (H D)/t", ["leading factor D", "split the groups first", "'D/t H -> D H/t'"]),
    ("B/d (H D)/t -> B/d (D H)/t", ["leading factor H", "output splits D"]),
    ("H/t D -> (D H)/t", ["would land on its leading factor D", "input splits H"]),
    ("H/t D -> H D", ["splits H ('H/t') in the input only", "cannot gather", "reshard"]),
    ("H D -> H/t D", ["in the output only", "cannot split", "shardops.reshard('H D -> H/t D'"]),
    ("H/t D -> H D/t", ["mesh axis 't' splits H in the input but D in the output"]),
    ("H/t/d D -> H/d/t D", ["('t', 'd') in the input but ('d', 't')", "order"]),
    ("H/t D -> H/t/d D", ["'d' splits H ('H/t/d') in the output only"]),
    ("(H/t D) -> H/t D", ["a factor inside a group cannot carry mesh axes", "'(H D)/t'"]),
    ("H D -> H", ["dim 'D' of the input is not in the output"]),
    ("H -> H D", ["dim 'D' of the output is not in the input"]),
    ("H H -> H H", ["dim 'H' appears twice in the input"]),
    ("H/t D/t -> H D", ["mesh axis 't' is used twice in the input"]),
    ("H 3 -> H", ["literal size '3'"]),
    ("H ... -> H", ["invalid dim name '...'", "ellipses are not supported"]),
    ("((H D)) -> H D", ["nested parentheses"]),
    ("(H D -> H D", ["unclosed parenthesis"]),
    ("()/t H -> H", ["the unit dim '()/t' cannot be split"]),
    ("H D", ["missing '->'"]),
    ("H, D -> H D", ["unexpected ','", "one array"]),
]


@pytest.mark.parametrize(("pattern", "phrases"), ILLEGAL, ids=[p for p, _ in ILLEGAL])
def test_illegal_patterns_are_refused_with_their_message(pattern, phrases):
    with pytest.raises(SpecError) as info:
        rearrange_recipe(pattern)
    cases.assert_refusal(str(info.value), "rearrange", pattern, phrases)


def test_an_illegal_split_fails_at_trace_time_inside_the_body():
    mesh = make_mesh((4, 2), ("d", "t"))

    @typed_shard_map
    def f(x: f32[Array, b"B/d HD/t"]) -> f32[Array, b"B/d H D/t"]:
        return shardops.rearrange("B/d (H D)/t -> B/d H D/t", x, H=4)

    with jax.set_mesh(mesh), pytest.raises(SpecError, match="lands on its leading factor H"):
        jax.jit(f).lower(np.zeros((8, 8), np.float32))


@pytest.mark.parametrize(
    ("pattern", "sizes", "phrases"),
    [
        # 4 devices on t but only 2 heads: a block of (H D) is half a head.
        ("(H D)/t -> H/t D", {"H": 2}, ["leading factor H; H=2 is not divisible by 4"]),
        ("(H D)/t -> H/t D", {}, ["the sizes of H, D are unknown", "pass all but one"]),
        ("(H D)/t -> H/t D", {"H": 3}, ["global size 16, which is not a multiple of 3"]),
        ("(H D)/t -> H/t D", {"H": 4, "D": 5}, ["but H=4 × D=5 = 20"]),
        ("(H D)/t -> H/t D", {"Q": 4}, ["keyword size Q=4 names no dim", "H, D"]),
        ("(H D)/t -> H/t D", {"H": 2.0}, ["must be a non-negative int"]),
    ],
)
def test_sizes_that_do_not_fit_are_refused(pattern, sizes, phrases):
    mesh = make_mesh((2, 4), ("d", "t"))

    def body(x):
        return shardops.rearrange(pattern, x, **sizes)

    f = cases.typed_body(body, "G/t", "H/t D")
    with jax.set_mesh(mesh), pytest.raises((TypeCheckError, TypeError)) as info:
        f(np.zeros((16,), np.float32))
    cases.assert_phrases(str(info.value), phrases)


def test_sharded_pattern_outside_shard_map_is_refused():
    with pytest.raises(ValueError, match=r"mesh axis 't'.*no mesh axis is manual"):
        shardops.rearrange("(H D)/t -> H/t D", jnp.zeros(8), H=2)


def test_unsharded_pattern_works_anywhere():
    x = np.arange(24, dtype=np.float32).reshape(2, 12)
    got = shardops.rearrange("a (b c) -> c 1 (a b)", jnp.asarray(x), b=3)
    np.testing.assert_array_equal(np.asarray(got), einops.rearrange(x, "a (b c) -> c 1 (a b)", b=3))
