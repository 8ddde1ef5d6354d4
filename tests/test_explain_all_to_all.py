"""explain's compare_hlo on all-to-alls: a tuple all-to-all is one collective, not a combination.

XLA's CPU backend compiles every all-to-all into one *tuple* all-to-all instruction whose
operands are the blocks sent to each device of the group (one per device). The comparison must
count it once and match it with the report's row by kind, group and bytes, and still say "XLA
combined several collectives" where XLA really did (two all-reduces in one instruction).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import shardlib
from shardlib import shardops
from shardlib._explain import hlo as _hlo
from shardlib.shardtypes import f32, typed_shard_map

MESHES = {"8": ((8,), ("d",)), "4x2": ((4, 2), ("d", "t"))}


def _mesh(name):
    shape, axes = MESHES[name]
    return jax.make_mesh(shape, axes)


@typed_shard_map
def _one(x: f32[b"B/d L M"]) -> f32[b"B L/d M"]:
    return shardops.reshard("B/d L M -> B L/d M", x)  # one all_to_all over 'd'


@typed_shard_map
def _there_and_back(x: f32[b"B/d L M"]) -> f32[b"B/d L M"]:
    y = jnp.sin(shardops.all_to_all("B/d L M -> B L/d M", x))
    return shardops.all_to_all("B L/d M -> B/d L M", y)


@typed_shard_map
def _two_axes(x: f32[b"B/d L/t M"]) -> f32[b"B/t L/d M"]:
    return shardops.reshard("B/d L/t M -> B/t L/d M", x)  # three all_to_alls over 'd' and 't'


def _grad_of_there_and_back(x):
    return jax.grad(lambda x: jnp.sum(_there_and_back(x) ** 2))(x)


def _reference_grad(x):
    return jax.grad(lambda x: jnp.sum(jnp.sin(x) ** 2))(x)


CASES = [
    # (name, function, mesh, all_to_alls in the report, reference)
    ("reshard", _one, "8", 1, lambda x: x),
    ("reshard", _one, "4x2", 1, lambda x: x),
    ("there_and_back", _there_and_back, "8", 2, jnp.sin),
    ("there_and_back", _there_and_back, "4x2", 2, jnp.sin),
    ("two_axes", _two_axes, "4x2", 3, lambda x: x),
    ("grad", _grad_of_there_and_back, "8", 4, _reference_grad),
    ("grad", _grad_of_there_and_back, "4x2", 4, _reference_grad),
]


@pytest.mark.parametrize(
    "f, mesh_name, n, reference", [c[1:] for c in CASES], ids=[f"{c[0]}-{c[2]}" for c in CASES]
)
def test_a_tuple_all_to_all_matches_its_report_row(f, mesh_name, n, reference):
    x = jnp.asarray(np.random.default_rng(0).normal(size=(16, 16, 4)), jnp.float32)
    with jax.set_mesh(_mesh(mesh_name)):
        report = shardlib.explain(f, x)
        lowered = jax.jit(f).lower(x)
        compiled = lowered.compile()
        np.testing.assert_allclose(compiled(x), reference(x), rtol=1e-5, atol=1e-6)
    assert [c.kind for c in report.collectives] == ["all-to-all"] * n
    text = compiled.as_text()
    tuple_a2a = re.findall(r"= \(f32\[[^)]*\) all-to-all\(", text)
    assert len(tuple_a2a) == n, "the CPU backend no longer writes tuple all-to-alls"
    for hlo in (text, lowered.as_text(dialect="hlo")):
        cmp = report.compare_hlo(hlo)
        assert cmp.identical and not cmp.combined, str(cmp)
        assert cmp.n_hlo == cmp.n_report == n  # one per instruction, as XLA runs them
        assert str(cmp) == f"all {n} collectives match the compiled HLO"


def test_one_tuple_all_to_all_has_one_part_with_every_block():
    x = jnp.ones((16, 16, 4))
    with jax.set_mesh(_mesh("8")):
        text = jax.jit(_one).lower(x).compile().as_text()
    (c,) = _hlo.collectives(text)[0]
    # 8 blocks of 2x2x4 floats, the sixth printed after '/*index=5*/'.
    assert c.operand_bytes == (64,) * 8 and c.in_bytes == 2 * 16 * 4 * 4
    assert c.parts == (c.in_bytes,) and c.group == 8


def _two_psums():
    @typed_shard_map
    def f(x: f32[b"B M/d"], w: f32[b"M/d F"], v: f32[b"M/d F"]) -> f32[b"B F"]:
        a = shardops.einsum_unreduced("B M/d, M/d F -> B F", x, w)
        b = shardops.einsum_unreduced("B M/d, M/d F -> B F", x, v)
        return shardops.psum("B F", a, axes="d") * shardops.psum("B F", b, axes="d")

    return f, (jnp.ones((8, 8)), jnp.ones((8, 4)), 2 * jnp.ones((8, 4)))


def test_combined_all_reduces_are_still_reported_as_combined():
    f, args = _two_psums()
    with jax.set_mesh(_mesh("4x2")):
        report = shardlib.explain(f, *args)
        compiled = jax.jit(f).lower(*args).compile()
        np.testing.assert_allclose(compiled(*args), (8.0 * 16.0) * np.ones((8, 4)))
    text = compiled.as_text()
    (c,) = _hlo.collectives(text)[0]
    if len(c.operand_bytes) != 2:
        pytest.skip("XLA did not combine the two all-reduces on this version")
    assert c.parts == (128, 128)
    cmp = report.compare_hlo(text)
    assert cmp.identical and cmp.n_hlo == cmp.n_report == 2, str(cmp)
    assert cmp.combined == [c.line.strip()]
    assert "XLA combined several collectives into one instruction: %all-reduce" in str(cmp)


def test_a_collective_over_another_group_does_not_match():
    f, args = _two_psums()
    with jax.set_mesh(_mesh("4x2")):
        report = shardlib.explain(f, *args)
        text = jax.jit(f).lower(*args).compile().as_text()
    # The psums' groups ('d') as this XLA writes them (a list, or the mesh form from JAX 0.11),
    # swapped for the other axis's ('t': 4 groups of 2).
    (attr,) = {_hlo.groups_attr(c.line) for c in _hlo.collectives(text)[0]}
    assert attr is not None and _hlo.replica_groups(attr, 8) == ((0, 2, 4, 6), (1, 3, 5, 7))
    other = "replica_groups=[4,2]<=[8]"
    assert _hlo.group_axes(_hlo.replica_groups(other, 8), {"d": 4, "t": 2}) == ("t",)
    cmp = report.compare_hlo(text.replace(attr, other))
    assert not cmp.identical
    assert len(cmp.only_in_report) == 2 and len(cmp.only_in_hlo) == 2, str(cmp)
