"""``shardops.einsum``: an einsum that reduces over its split contracted dims as its output
spec says (psum for a replicated output, psum_scatter for an output split over them).

Each case runs ``einsum`` and the hand-written form (``einsum_unreduced`` then the explicit
``psum_scatter`` / ``psum``) side by side under ``jax.shard_map`` on a 1-D (8,), 2-D (4, 2)
or 3-D (2, 2, 2) mesh, and compares both, values and gradients, with ``jnp.einsum`` on the
global arrays; the collectives each lowers to must be the same.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from typeguard import TypeCheckError

import shardlib
from shardlib import SpecError, shardops
from shardlib._lang.op_spec import parse_op_spec
from shardlib.shardtypes import Array, f32, typed_shard_map
from tests._mesh_util import MESHES, count_collectives, make_mesh, place

_MESHES: dict[int, Any] = {}


def mesh_of(i: int) -> Any:
    if i not in _MESHES:
        _MESHES[i] = make_mesh(*MESHES[i])
    return _MESHES[i]


# (mesh, einsum spec, the hand-written form: einsum_unreduced's output spec and the reduction
# steps, the collectives both lower to). A step is ('scatter', spec) or ('psum', spec, axes).
CASES = [
    # 1-D mesh ('d',)
    (0, "B/d M, M F -> B/d F", "B/d F", [], {}),
    (0, "B M/d, M/d F -> B F", "B F", [("psum", "B F", "d")], {"all_reduce": 1}),
    (0, "B M/d, M/d F -> B F/d", "B F", [("scatter", "B F -> B F/d")], {"reduce_scatter": 1}),
    (0, "B M/d K, M/d K F -> B/d F", "B F", [("scatter", "B F -> B/d F")], {"reduce_scatter": 1}),
    (0, "B M/d -> B/d", "B", [("scatter", "B -> B/d")], {"reduce_scatter": 1}),
    # 2-D mesh ('x' 4, 'y' 2)
    (1, "B/x M, M F/y -> B/x F/y", "B/x F/y", [], {}),
    (1, "B/x M/y, M/y F -> B/x F", "B/x F", [("psum", "B/x F", "y")], {"all_reduce": 1}),
    (
        1,
        "B/x M/y, M/y F -> B/x F/y",
        "B/x F",
        [("scatter", "B/x F -> B/x F/y")],
        {"reduce_scatter": 1},
    ),
    (
        1,
        "B M/y, M/y F/x -> B F/x/y",
        "B F/x",
        [("scatter", "B F/x -> B F/x/y")],
        {"reduce_scatter": 1},
    ),
    (1, "B M/x K/y, M/x K/y F -> B F", "B F", [("psum", "B F", "x/y")], {"all_reduce": 1}),
    (
        1,
        "B M/x/y, M/x/y F -> B F/y/x",
        "B F",
        [("scatter", "B F -> B F/y/x")],
        {"reduce_scatter": 1},
    ),
    (
        1,
        "B M/x K/y, M/x K/y F -> B/x F/y",
        "B F",
        [("scatter", "B F -> B/x F/y")],
        {"reduce_scatter": 2},
    ),
    (
        1,
        "B M/x/y, M/x/y F -> B F/x",
        "B F",
        [("scatter", "B F -> B F/x"), ("psum", "B F/x", "y")],
        {"reduce_scatter": 1, "all_reduce": 1},
    ),
    # 3-D mesh ('x', 'y', 'z', 2 each)
    (2, "B/x M, M F/y/z -> B/x F/y/z", "B/x F/y/z", [], {}),
    (2, "B/x M/y K/z, M/y K/z F -> B/x F", "B/x F", [("psum", "B/x F", "y/z")], {"all_reduce": 1}),
    (
        2,
        "B/x M/y/z, M/y/z F -> B/x F/z",
        "B/x F",
        [("scatter", "B/x F -> B/x F/z"), ("psum", "B/x F/z", "y")],
        {"reduce_scatter": 1, "all_reduce": 1},
    ),
    (
        2,
        "B M/x K/y/z, M/x K/y/z F -> B/y F/x",
        "B F",
        [("scatter", "B F -> B/y F/x"), ("psum", "B/y F/x", "z")],
        {"reduce_scatter": 2, "all_reduce": 1},
    ),
    (
        2,
        "B/x M/y, M/y F/z, F/z G -> B/x G/y",
        "B/x G",
        [("scatter", "B/x G -> B/x G/y"), ("psum", "B/x G/y", "z")],
        {"reduce_scatter": 1, "all_reduce": 1},
    ),
]


def _hand(text: str, local_out: str, steps: list[tuple[str, ...]]):
    """The hand-written form: einsum_unreduced, then each explicit collective."""
    unreduced = text.split("->")[0] + "-> " + local_out

    def body(*xs):
        y = shardops.einsum_unreduced(unreduced, *xs)
        for step in steps:
            if step[0] == "scatter":
                y = shardops.psum_scatter(step[1], y)
            else:
                y = shardops.psum(step[1], y, axes=step[2])
        return y

    return body


def _global_sizes(mesh: Any, text: str) -> tuple[list[list[int]], str]:
    """Global operand shapes (each dim 2x its largest split) and the jnp.einsum equation."""
    ops = parse_op_spec(text, op="test")
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))
    need: dict[str, int] = {}
    for s in (*ops.inputs, ops.output):
        for d in s.dims:
            k = math.prod(sizes[a] for a in d.sharding)
            need[str(d.shape)] = max(need.get(str(d.shape), 1), k)
    letters = {n: chr(ord("a") + i) for i, n in enumerate(need)}
    shapes = [[2 * need[str(d.shape)] for d in s.dims] for s in ops.inputs]
    eq = ",".join("".join(letters[str(d.shape)] for d in s.dims) for s in ops.inputs)
    return shapes, eq + "->" + "".join(letters[str(d.shape)] for d in ops.output.dims)


def _shard_map(mesh: Any, body, text: str, check_vma: bool):
    """``body`` under jax.shard_map, its block returned with a leading dim per replica."""
    ops = parse_op_spec(text, op="test")
    used = ops.output.mesh_axes()
    rep = tuple(a for a in mesh.axis_names if a not in used)
    return jax.shard_map(
        lambda *a: body(*a)[None],
        mesh=mesh,
        in_specs=tuple(s.partition_spec() for s in ops.inputs),
        out_specs=P(rep or None, *ops.output.partition_entries()),
        check_vma=check_vma,
    )


def _compare(mesh_i, text, local_out, steps, counts, check_vma=True, jit=True, **kwargs):
    mesh = mesh_of(mesh_i)
    shapes, eq = _global_sizes(mesh, text)
    rng = np.random.default_rng(len(text))
    args = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    ins = [str(s) for s in parse_op_spec(text, op="test").inputs]
    mine = _shard_map(mesh, lambda *xs: shardops.einsum(text, *xs, **kwargs), text, check_vma)
    hand = _shard_map(mesh, _hand(text, local_out, steps), text, check_vma)
    want = np.asarray(jnp.einsum(eq, *args, **kwargs))
    n_rep = math.prod(mesh.axis_sizes) // math.prod(
        dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))[a]
        for a in parse_op_spec(text, op="test").output.mesh_axes()
    )
    cot = rng.standard_normal((n_rep, *want.shape)).astype(want.dtype)
    argnums = tuple(range(len(args)))

    def value_and_grad(f, *a):
        return f(*a), jax.grad(lambda *b: jnp.sum(f(*b) * cot), argnums=argnums)(*a)

    want_grads = jax.grad(
        lambda *b: jnp.sum(jnp.einsum(eq, *b, **kwargs) * cot.sum(0)), argnums=argnums
    )(*args)
    results = {}
    with jax.set_mesh(mesh):
        placed = [place(x, mesh, s) for x, s in zip(args, ins, strict=True)]
        for name, f in (("einsum", mine), ("hand-written", hand)):
            run = jax.jit(value_and_grad, static_argnums=0) if jit else value_and_grad
            results[name] = run(f, *placed)
            got = count_collectives(jax.jit(f).lower(*placed).as_text())
            assert got == Counter(counts), (name, got)
    for name, (y, grads) in results.items():
        y = np.asarray(y)
        assert y.shape == (n_rep, *want.shape), (name, y.shape)
        for r in range(n_rep):
            np.testing.assert_allclose(y[r], want, rtol=1e-4, atol=1e-4, err_msg=f"{name} {r}")
        for k, (g, w) in enumerate(zip(grads, want_grads, strict=True)):
            np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4, err_msg=f"{name} grad {k}")
    (y, grads), (y_hand, grads_hand) = results["einsum"], results["hand-written"]
    np.testing.assert_allclose(y, y_hand, rtol=1e-5, atol=1e-5)
    for g, h in zip(grads, grads_hand, strict=True):
        np.testing.assert_allclose(g, h, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{len(MESHES[c[0]][0])}d: {c[1]}")
def test_einsum_matches_hand_written_reduction_and_jnp(case):
    _compare(*case)


@pytest.mark.slow
@pytest.mark.parametrize("case", [CASES[8], CASES[12], CASES[16]], ids=lambda c: c[1])
def test_einsum_without_check_vma_and_eager(case):
    _compare(*case, check_vma=False)
    _compare(*case, jit=False)


def test_einsum_passes_keyword_arguments_to_jnp_einsum():
    """preferred_element_type: the local einsum and its reduction are in float32."""
    case = CASES[12]  # mixed: reduce-scatter over x, then all-reduce over y
    _compare(*case, preferred_element_type=jnp.float32)
    mesh = mesh_of(1)
    text = case[1]
    body = _shard_map(
        mesh,
        lambda a, b: shardops.einsum(text, a, b, preferred_element_type=jnp.float32),
        text,
        True,
    )
    with jax.set_mesh(mesh):
        a = place(jnp.ones((2, 16), jnp.bfloat16), mesh, "B M/x/y")
        b = place(jnp.ones((16, 8), jnp.bfloat16), mesh, "M/x/y F")
        assert body(a, b).dtype == jnp.float32


# ---------------------------------------------------------------------------------------------
# In typed_shard_map: the result owes no reduction; an operand's pending axes pass through
# ---------------------------------------------------------------------------------------------


def test_einsum_result_is_not_pending_where_einsum_unreduced_is():
    mesh = mesh_of(1)
    x = np.random.default_rng(1).standard_normal((8, 8)).astype(np.float32)
    w = np.random.default_rng(2).standard_normal((8, 6)).astype(np.float32)

    @typed_shard_map
    def reduced(x: f32[Array, b"B/x M/y"], w: f32[Array, b"M/y F"]) -> f32[Array, b"B/x F"]:
        return shardops.einsum("B/x M/y, M/y F -> B/x F", x, w)

    @typed_shard_map
    def unreduced(x: f32[Array, b"B/x M/y"], w: f32[Array, b"M/y F"]) -> f32[Array, b"B/x F"]:
        return shardops.einsum_unreduced("B/x M/y, M/y F -> B/x F", x, w)

    with jax.set_mesh(mesh):
        np.testing.assert_allclose(reduced(x, w), x @ w, rtol=1e-5, atol=1e-5)
        g = jax.grad(lambda w: jnp.sum(reduced(x, w) ** 2))(w)
        np.testing.assert_allclose(g, 2 * x.T @ (x @ w), rtol=1e-4, atol=1e-4)
        with pytest.raises(shardops.PendingReductionError, match="'y'"):
            unreduced(x, w)


def test_einsum_keeps_an_operands_own_pending_axes():
    """An operand pending over x stays pending over x; einsum reduces only what it contracts."""
    mesh = mesh_of(1)
    rng = np.random.default_rng(3)
    a = rng.standard_normal((2, 8, 4)).astype(np.float32)
    v = rng.standard_normal((8,)).astype(np.float32)
    w = rng.standard_normal((4, 6)).astype(np.float32)
    spec = "B M/y {+x}, M/y F -> B F/y {+x}"

    @typed_shard_map
    def f(
        a: f32[Array, b"B K/x M/y"], v: f32[Array, b"K/x"], w: f32[Array, b"M/y F"]
    ) -> f32[Array, b"B F/y"]:
        h = shardops.einsum_unreduced("B K/x M/y, K/x -> B M/y", a, v)  # pending over x
        return shardops.psum("B F/y", shardops.einsum(spec, h, w), axes="x")

    @typed_shard_map
    def forgets(
        a: f32[Array, b"B K/x M/y"], v: f32[Array, b"K/x"], w: f32[Array, b"M/y F"]
    ) -> f32[Array, b"B F/y"]:
        h = shardops.einsum_unreduced("B K/x M/y, K/x -> B M/y", a, v)
        return shardops.einsum("B M/y, M/y F -> B F/y", h, w)

    with jax.set_mesh(mesh):
        np.testing.assert_allclose(f(a, v, w), np.einsum("bkm,k,mf->bf", a, v, w), rtol=1e-4)
        with pytest.raises(shardops.PendingReductionError, match="'x'"):
            forgets(a, v, w)


# ---------------------------------------------------------------------------------------------
# explain and the compiled HLO
# ---------------------------------------------------------------------------------------------


def test_explain_lists_einsums_collectives_and_matches_hlo():
    mesh = mesh_of(2)
    text = "B/x M/y/z, M/y/z F -> B/x F/z"

    @typed_shard_map
    def f(x: f32[Array, b"B/x M/y/z"], w: f32[Array, b"M/y/z F"]) -> f32[Array, b"B/x F/z"]:
        return shardops.einsum(text, x, w)

    def loss(x, w):
        return jnp.sum(f(x, w) ** 2)

    x, w = jnp.ones((4, 8)), jnp.ones((8, 6))
    with jax.set_mesh(mesh):
        report = shardlib.explain(f, x, w)
        cmp = report.compare_hlo(jax.jit(f).lower(x, w).compile().as_text())
        assert cmp.identical, str(cmp)
        grad = jax.grad(loss, argnums=1)
        grad_report = shardlib.explain(grad, x, w)
        grad_cmp = grad_report.compare_hlo(jax.jit(grad).lower(x, w).compile().as_text())
        assert grad_cmp.identical, str(grad_cmp)
        hlo = jax.jit(f).lower(x, w).as_text(debug_info=True)
    rows = [(c.op, c.spec, c.kind, c.axes, c.group) for c in report.collectives]
    assert rows == [
        ("einsum", text, "reduce-scatter", ("z",), 2),
        ("einsum", text, "all-reduce", ("y",), 2),
    ]
    assert report.collectives[0].operand_shape == (2, 6)  # the local einsum, full F
    assert report.collectives[1].operand_shape == (2, 3)  # then the scattered block
    text_report = str(report)
    assert "einsum" in text_report and text in text_report and "test_einsum.py:" in text_report
    # The reduce-scatter's transpose, under the op's name; (w's gradient is also summed over
    # 'x' by JAX's implicit psum_invariant: w is replicated over 'x').
    backward = [(c.op, c.spec, c.kind, c.axes) for c in grad_report.collectives if c.backward]
    assert ("einsum", text, "all-gather", ("z",)) in backward
    assert f"shardops.einsum[{text}]" in hlo
    # The local einsum is not under the scope: no collective, nothing listed.
    local = "B/x M, M F/y/z -> B/x F/y/z"

    @typed_shard_map
    def g(x: f32[Array, b"B/x M"], w: f32[Array, b"M F/y/z"]) -> f32[Array, b"B/x F/y/z"]:
        return shardops.einsum(local, x, w)

    with jax.set_mesh(mesh):
        assert shardlib.explain(g, x, jnp.ones((8, 8))).collectives == []
        assert "shardops.einsum" not in jax.jit(g).lower(x, jnp.ones((8, 8))).as_text(
            debug_info=True
        )


# ---------------------------------------------------------------------------------------------
# Misuse
# ---------------------------------------------------------------------------------------------

SPEC_ERRORS = [
    (
        "B M/x, M/x F -> B F/y",
        "einsum: output dim 'F/y' is split over mesh axis 'y', which splits no input dim, so "
        "einsum has no partial sum to scatter over it (contracted split axes: 'x')",
    ),
    (
        "B/x M/y, M/y F -> F/x B",
        "einsum: output dim 'F/x' is split over mesh axis 'x', which splits input dim 'B/x', "
        "not a contracted dim; einsum does not move mesh axes between dims",
    ),
    (
        "B/x M/y, M/y F -> B F",
        "einsum: output dim 'B' drops mesh axis 'x' of input dim 'B/x'; einsum sums over "
        "contracted dims but does not gather",
    ),
    (
        "B M/y, M/y F/x -> B F/y/x",
        "einsum: output dim 'F/y/x' puts mesh axes before those of input dim 'F/x'",
    ),
    (
        "B M/y, M/y F -> B F {+y}",
        "einsum: the output is declared pending over 'y', but einsum sums over it (the "
        "contracted dim 'M/y' is split over 'y')",
    ),
    (
        "B M/y, M/y F, G {+y} -> B F G",
        "einsum: operand 2 is declared pending over 'y', which also splits a contracted dim",
    ),
    (
        "B M/x, M/y F -> B F",
        "einsum: dim 'M' is 'M/x' in operand 0 but 'M/y' in operand 1",
    ),
    ("B M, M F -> B F F", "einsum: output dim 'F' appears twice"),
    ("B M, M F -> B G", "einsum: output dim 'G' does not appear in any input"),
]


@pytest.mark.parametrize("text, message", SPEC_ERRORS, ids=[t for t, _ in SPEC_ERRORS])
def test_spec_errors_name_einsum_the_dim_and_the_fix(text, message):
    n = text.split("->")[0].count(",") + 1
    with pytest.raises(SpecError, match=re.escape(message)) as info:
        shardops.einsum(text, *[jnp.ones(())] * n)  # the plan refuses before any check
    assert text in str(info.value) and "^" in str(info.value)


def test_spec_error_hints():
    hints = {
        "B M/x, M/x F -> B F/y": "write 'F', or split a contracted dim over 'y'",
        "B/x M/y, M/y F -> F/x B": "all_to_all the result afterwards",
        "B/x M/y, M/y F -> B F": "keep 'B/x' in the output and all_gather the result",
        "B M/y, M/y F/x -> B F/y/x": "write 'F/x/y'",
        "B M/y, M/y F -> B F {+y}": "use einsum_unreduced to keep the partial sum",
    }
    for text, hint in hints.items():
        with pytest.raises(SpecError, match=re.escape(hint)):
            shardops.einsum(text, jnp.ones(()), jnp.ones(()))


def test_einsum_unreduced_still_refuses_a_layout_change():
    with pytest.raises(SpecError, match="a local einsum cannot change a layout"):
        shardops.einsum_unreduced("B M/y, M/y F -> B F/y", jnp.ones(()), jnp.ones(()))


def test_value_errors_name_einsum_the_operand_and_the_sizes():
    mesh = mesh_of(0)
    text = "B M/d, M/d F -> B F/d"

    def run(f, *shapes):
        ops = parse_op_spec(text, op="test")
        g = jax.shard_map(
            f,
            mesh=mesh,
            in_specs=tuple(s.partition_spec() for s in ops.inputs),
            out_specs=ops.output.partition_spec(),
        )
        with jax.set_mesh(mesh):
            args = [place(jnp.ones(n), mesh, s) for n, s in zip(shapes, ops.inputs, strict=True)]
            return jax.jit(g).lower(*args)

    with pytest.raises(
        ValueError,
        match=re.escape(
            f"einsum({text!r}): dim 1 'F' of operand 1 has global size 4, which is not divisible "
            "by d=8, so einsum cannot scatter it over 'd'; expected a multiple of 8"
        ),
    ):
        run(lambda a, b: shardops.einsum(text, a, b), (2, 16), (16, 4))
    with pytest.raises(TypeCheckError, match=re.escape(f"einsum({text!r}) operand 1")):
        run(lambda a, b: shardops.einsum(text, a, b[:1]), (2, 16), (16, 8))
    with pytest.raises(
        ValueError,
        match=re.escape(
            f"einsum({text!r}) communicates over mesh axis 'd', so it must run inside a shard_map"
        ),
    ):
        shardops.einsum(text, jnp.ones((2, 16)), jnp.ones((16, 8)))
    with pytest.raises(TypeError, match=re.escape("einsum('B M -> B') needs at least one operand")):
        shardops.einsum("B M -> B")


def test_local_einsum_runs_outside_shard_map():
    x, w = jnp.arange(6.0).reshape(2, 3), jnp.ones((3, 4))
    np.testing.assert_allclose(shardops.einsum("B M, M F -> F B", x, w), (x @ w).T)
