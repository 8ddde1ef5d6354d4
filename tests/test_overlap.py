"""Collective matmuls: ``shardops.einsum(..., overlap='ring' | 'bidirectional')``.

Each case is an einsum whose one collective (an all-gather of an operand's dim, or a
reduce-scatter into an output dim) runs as ring steps. Against an unsharded ``jnp.einsum``
on 1-D, 2-D and 3-D meshes: values and gradients; the compiled HLO has the ring's
collective-permutes (``|i| - 1`` per direction, forward and backward) and no all-gather or
reduce-scatter; explain's rows are those permutes with the formula's bytes, equal to the HLO.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import shardlib
from shardlib import shardops
from shardlib.shardtypes import Array, f32, typed_shard_map

MESHES = {
    "i4": ((4,), ("i",)),
    "i8": ((8,), ("i",)),
    "d2i4": ((2, 4), ("d", "i")),
    "d2t2i2": ((2, 2, 2), ("d", "t", "i")),
}
SIZES = {"B": 8, "L": 32, "M": 8, "F": 16, "K": 16, "N": 8}

# name -> (spec with {b}: the batch dim's axes, kind, the dim that moves, the operand that
# travels (-1: the accumulator)). Specs that need 'd' say so with {d}.
CASES = {
    "gather-free": ("B{b} L/i M, M F/i -> B{b} L F/i", "gather", "L", 0),
    "gather-contracted": ("B{b} M/i K, K/i N -> B{b} M/i N", "gather", "K", 1),
    "gather-operand-1": ("B/i M, F/i M -> B/i F", "gather", "F", 1),
    "gather-from-split": ("L{d}/i M, M F/i -> L{d} F/i", "gather", "L", 0),
    "scatter": ("B{b} L M/i, M/i F -> B{b} L/i F", "scatter", "L", -1),
    "scatter-onto-split": ("L{d} M/i, M/i F -> L{d}/i F", "scatter", "L", -1),
}
OVERLAPS = ("ring", "bidirectional")


def _spec(case: str, mesh_name: str) -> str:
    axes = MESHES[mesh_name][1]
    batch = "".join(f"/{a}" for a in axes if a != "i")
    d = "/d" if "d" in axes else ""
    return CASES[case][0].format(b=batch, d=d)


def _parts(spec: str) -> tuple[list[str], str]:
    ins, out = spec.split("->")
    return [s.strip() for s in ins.split(",")], out.strip()


def _names(shape: str) -> list[str]:
    return [d.split("/")[0] for d in shape.split()]


def _function(spec: str, overlap: str):
    (a, b), out = _parts(spec)

    @typed_shard_map
    def f(x: f32[Array, a.encode()], w: f32[Array, b.encode()]) -> f32[Array, out.encode()]:
        return shardops.einsum(spec, x, w, overlap=overlap)

    return f


def _reference(spec: str):
    (a, b), out = _parts(spec)
    letters = {n: chr(ord("a") + k) for k, n in enumerate(SIZES)}
    eq = "".join(letters[n] for n in _names(a)) + "," + "".join(letters[n] for n in _names(b))
    eq += "->" + "".join(letters[n] for n in _names(out))
    return lambda x, w: jnp.einsum(eq, x, w)


def _arrays(spec: str, seed: int = 0):
    (a, b), _ = _parts(spec)
    rng = np.random.default_rng(seed)
    return tuple(
        jnp.asarray(rng.normal(size=[SIZES[n] for n in _names(s)]), jnp.float32) for s in (a, b)
    )


def _loss(f):
    return lambda x, w: jnp.sum(f(x, w) ** 2)


def _check_parity(case: str, mesh_name: str, overlap: str) -> None:
    spec = _spec(case, mesh_name)
    f, ref = _function(spec, overlap), _reference(spec)
    x, w = _arrays(spec)
    with jax.set_mesh(jax.make_mesh(*MESHES[mesh_name])):
        np.testing.assert_allclose(jax.jit(f)(x, w), ref(x, w), rtol=1e-5, atol=1e-5)
        got = jax.jit(jax.grad(_loss(f), argnums=(0, 1)))(x, w)
    want = jax.grad(_loss(ref), argnums=(0, 1))(x, w)
    for g, r in zip(got, want, strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-4)


FAST = [(c, m, o) for c in CASES for m in ("d2t2i2",) for o in OVERLAPS]  # 3-D; 1-D, 2-D below
SLOW = [(c, m, o) for c in CASES for m in ("i4", "i8", "d2i4") for o in OVERLAPS]


@pytest.mark.parametrize("case, mesh_name, overlap", FAST)
def test_values_and_gradients_equal_the_unsharded_einsum(case, mesh_name, overlap):
    if "{d}" in CASES[case][0] and "d" not in MESHES[mesh_name][1]:
        pytest.skip("the case splits a dim over 'd' too")
    _check_parity(case, mesh_name, overlap)


@pytest.mark.slow
@pytest.mark.parametrize("case, mesh_name, overlap", SLOW)
def test_values_and_gradients_on_more_meshes(case, mesh_name, overlap):
    if "{d}" in CASES[case][0] and "d" not in MESHES[mesh_name][1]:
        pytest.skip("the case splits a dim over 'd' too")
    _check_parity(case, mesh_name, overlap)


def _census(text: str) -> dict[str, int]:
    kinds = ("all-gather", "reduce-scatter", "collective-permute")
    return {k: len(re.findall(rf"\b{k}(?:-start)?\(", text)) for k in kinds}


def _block_bytes(spec: str, mesh_name: str, case: str) -> int:
    """The bytes of the block that travels: the moved operand's per-device block (gather) or
    the output's per-device block (scatter)."""
    (a, b), out = _parts(spec)
    shape = (a, b, out)[CASES[case][3]] if CASES[case][3] >= 0 else out
    sizes = dict(zip(MESHES[mesh_name][1], MESHES[mesh_name][0], strict=True))
    n = 1
    for d in shape.split():
        name, *axes = d.split("/")
        n *= SIZES[name] // int(np.prod([sizes[x] for x in axes]))
    return 4 * n


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize(
    "overlap",
    # the fast tier reads the bidirectional ring's HLO (two rings, each half the bytes), the
    # slow tier the one-way ring's too (the values test above runs both on every change)
    [pytest.param("ring", marks=pytest.mark.slow), "bidirectional"],
)
def test_the_hlo_has_the_ring_and_explain_its_bytes(case, overlap):
    mesh_name = "d2i4" if "{d}" in CASES[case][0] else "i4"
    spec = _spec(case, mesh_name)
    f = _function(spec, overlap)
    x, w = _arrays(spec)
    ways = 2 if overlap == "bidirectional" else 1
    n = MESHES[mesh_name][0][-1]
    grad = jax.grad(_loss(f), argnums=(0, 1))
    with jax.set_mesh(jax.make_mesh(*MESHES[mesh_name])):
        for fn, rings in ((f, 1), (grad, 2)):
            report = shardlib.explain(fn, x, w)
            text = jax.jit(fn).lower(x, w).compile().as_text() or ""
            census = _census(text)
            assert census == {
                "all-gather": 0,
                "reduce-scatter": 0,
                "collective-permute": rings * ways * (n - 1),
            }, census
            # A replicated operand's gradient is summed once, not once per ring step.
            assert sum(c.kind == "all-reduce" for c in report.collectives) <= 1
            rows = [c for c in report.collectives if c.kind == "collective-permute"]
            assert len(rows) == rings * ways * (n - 1)
            assert all(c.op == "einsum" for c in rows)
            step = _block_bytes(spec, mesh_name, case) // ways  # formula: the block, or half
            assert {c.operand_bytes for c in rows} == {step}
            assert {c.sent_bytes for c in rows} == {step}
            cmp = report.compare_hlo(text)
            permutes = [c for c in cmp.only_in_report if c.kind == "collective-permute"]
            assert not permutes and not [h for h in cmp.only_in_hlo if "permute" in h[0]], str(cmp)


def _run(spec: str, overlap: str, mesh_shape=(4,), axes=("i",), sizes=None, **kw):
    (a, b), out = _parts(spec)
    sizes = sizes or SIZES

    @typed_shard_map(**kw)
    def f(x: f32[Array, a.encode()], w: f32[Array, b.encode()]) -> f32[Array, out.encode()]:
        return shardops.einsum(spec, x, w, overlap=overlap)

    x = jnp.ones([sizes[n] for n in _names(a)], jnp.float32)
    w = jnp.ones([sizes[n] for n in _names(b)], jnp.float32)
    with jax.set_mesh(jax.make_mesh(mesh_shape, axes)):
        return f(x, w)


def test_an_unknown_overlap_is_refused():
    with pytest.raises(ValueError, match=r"overlap='rings' is not one of None, 'ring', 'bidir"):
        _run("L/i M, M F/i -> L F/i", "rings")


@pytest.mark.parametrize(
    "spec, words",
    [
        ("L M, M F -> L F", "moves no mesh axis, so there is nothing to overlap"),
        ("B/i M, F/t M -> B F", "the spec moves 2 dims over mesh axes; a ring overlaps one"),
        ("L M/i, M/i F/t -> L/i F", "the spec moves 2 dims over mesh axes; a ring overlaps one"),
    ],
)
def test_a_spec_with_no_ring_or_two_is_refused(spec, words):
    with pytest.raises(shardlib.SpecError, match=re.escape(words)):
        _run(spec, "ring", (4, 2), ("i", "t"))


def test_a_gather_that_also_needs_a_reduction_is_refused():
    with pytest.raises(shardlib.SpecError, match=r"need a reduction besides the ring"):
        _run("L/i M/t, M/t F/i -> L F/i", "ring", (4, 2), ("i", "t"))


@pytest.mark.slow
def test_a_block_that_does_not_halve_is_refused_for_bidirectional():
    sizes = {**SIZES, "L": 12}  # blocks of 3 rows on 4 devices
    with pytest.raises(
        ValueError, match=r"dim 0 'L/i' of operand 0 has 3 per device, which is not"
    ):
        _run("L/i M, M F/i -> L F/i", "bidirectional", sizes=sizes)
    np.testing.assert_allclose(_run("L/i M, M F/i -> L F/i", "ring", sizes=sizes), 8.0)


@pytest.mark.slow
def test_a_gather_whose_output_is_not_split_over_the_ring_needs_check_vma_off():
    spec = "L/i M, M F -> L F"
    with pytest.raises(ValueError, match=r"the output is not split over 'i'.*check_vma=False"):
        _run(spec, "ring")
    np.testing.assert_allclose(_run(spec, "ring", check_vma=False), 8.0)


def test_a_ring_over_two_axes_is_refused_with_the_split_named():
    with pytest.raises(shardlib.SpecError, match=r"moves over 2 mesh axes \['t', 'i'\]; a ring"):
        _run("L/t/i M, M F/t/i -> L F/t/i", "ring", (4, 2), ("i", "t"))


@pytest.mark.slow
def test_under_axis_rules_a_replicated_ring_role_is_the_plain_einsum():
    spec = "L/tensor M, M F/tensor -> L F/tensor"
    x = jnp.asarray(np.random.default_rng(1).normal(size=(16, 8)), jnp.float32)
    w = jnp.asarray(np.random.default_rng(2).normal(size=(8, 16)), jnp.float32)

    @typed_shard_map
    def f(x: f32[Array, b"L/tensor M"], w: f32[Array, b"M F/tensor"]) -> f32[Array, b"L F/tensor"]:
        return shardops.einsum(spec, x, w, overlap="ring")

    for axes, permutes in (({"tensor": "i"}, 3), ({"tensor": None}, 0)):
        with jax.set_mesh(jax.make_mesh((4,), ("i",))), shardlib.axis_rules(axes):
            np.testing.assert_allclose(f(x, w), x @ w, rtol=1e-5, atol=1e-5)
            text = jax.jit(f).lower(x, w).compile().as_text() or ""
        assert _census(text)["collective-permute"] == permutes


# -- a seeded random suite: ring axis, dim orders, operand order and direction drawn ----------

_TEMPLATES = {  # (operand 0, operand 1, output) with {r}: the ring axis, {b}: the batch axes
    "gather-free": (["B{b}", "G/{r}", "M"], ["M", "F/{r}"], ["B{b}", "G", "F/{r}"]),
    "gather-contracted": (["B{b}", "X/{r}", "K"], ["K/{r}", "N"], ["B{b}", "X/{r}", "N"]),
    "scatter": (["B{b}", "S", "K/{r}"], ["K/{r}", "N"], ["B{b}", "S/{r}", "N"]),
}


def _random_case(seed: int):
    rng = np.random.default_rng(seed)
    mesh_name = ["i4", "d2i4", "d2t2i2"][seed % 3]
    shape, axes = MESHES[mesh_name]
    ring = str(rng.choice(axes))
    batch = "".join(f"/{a}" for a in axes if a != ring)
    parts = [list(p) for p in _TEMPLATES[sorted(_TEMPLATES)[seed % len(_TEMPLATES)]]]
    for p in parts:
        rng.shuffle(p)
    if rng.random() < 0.5:
        parts[0], parts[1] = parts[1], parts[0]
    a, b, out = (" ".join(d.format(r=ring, b=batch) for d in p) for p in parts)
    n = dict(zip(axes, shape, strict=True))[ring]
    sizes = {"B": 8, "M": 6, "N": 6, "G": 4 * n, "F": 2 * n, "X": 2 * n, "K": 2 * n, "S": 4 * n}
    return mesh_name, f"{a}, {b} -> {out}", sizes, str(rng.choice(OVERLAPS))


@pytest.mark.parametrize(
    "seed", [*range(2), *(pytest.param(s, marks=pytest.mark.slow) for s in range(2, 18))]
)
def test_random_overlapped_einsums_equal_the_unsharded_one(seed):
    mesh_name, spec, sizes, overlap = _random_case(seed)
    (a, b), out = _parts(spec)
    letters = {n: chr(ord("a") + k) for k, n in enumerate(sizes)}
    eq = ",".join("".join(letters[n] for n in _names(s)) for s in (a, b))
    eq += "->" + "".join(letters[n] for n in _names(out))
    rng = np.random.default_rng(seed)
    x, w = (
        jnp.asarray(rng.normal(size=[sizes[n] for n in _names(s)]), jnp.float32) for s in (a, b)
    )
    f = _function(spec, overlap)

    def ref(x, w):
        return jnp.einsum(eq, x, w)

    with jax.set_mesh(jax.make_mesh(*MESHES[mesh_name])):
        np.testing.assert_allclose(jax.jit(f)(x, w), ref(x, w), rtol=1e-5, atol=1e-5, err_msg=spec)
        got = jax.jit(jax.grad(_loss(f), argnums=(0, 1)))(x, w)
    want = jax.grad(_loss(ref), argnums=(0, 1))(x, w)
    for g, r in zip(got, want, strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-4, err_msg=spec)


def test_a_scatter_with_nothing_to_reduce_is_refused():
    # The output's L gains 'i' but no contracted dim is split over it: a slice, not a ring.
    with pytest.raises(shardlib.SpecError, match=r"no contracted dim is split over 'i', so there"):
        _run("L M, M F -> L/i F", "ring")
