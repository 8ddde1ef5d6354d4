"""``shardops.ppermute`` and ``shardops.shift``: point-to-point transfers along one mesh axis.

Each case places a global numpy array on a (8,), (4, 2) or (2, 2, 2) mesh, permutes it along
one axis inside ``typed_shard_map`` (eager and under ``jit``), and compares every device's
block with a numpy reference built from the blocks each device held before: the device at
index ``dst`` along the axis gets the block of the device at ``src`` (other coordinates
equal), devices that no pair sends to get zeros. Gradients are checked the same way: the
transpose of a permutation is its inverse.
"""

from __future__ import annotations

import itertools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import shardlib
from shardlib import SpecError, shardops
from shardlib._explain import hlo as _hlo
from shardlib.shardtypes import Array, f32, typed_shard_map
from tests._mesh_util import MESHES, blocks, make_mesh, place

Pairs = list[tuple[int, int]]


def _mesh(i: int) -> Any:
    return make_mesh(*MESHES[i])


def _device_blocks(y: jax.Array, mesh: Any) -> dict[tuple[int, ...], np.ndarray]:
    """What each device holds, keyed by its mesh coordinates."""
    by_device = {s.device: np.asarray(s.data) for s in y.addressable_shards}
    return {
        c: by_device[mesh.devices[c]]
        for c in itertools.product(*(range(n) for n in mesh.devices.shape))
    }


def _permuted(before: dict, k: int, pairs: Pairs) -> dict:
    """Numpy reference: each device's block after permuting along mesh dim ``k``."""
    src_of = {d: s for s, d in pairs}
    out = {}
    for c, b in before.items():
        s = src_of.get(c[k])
        out[c] = np.zeros_like(b) if s is None else before[(*c[:k], s, *c[k + 1 :])]
    return out


def _shift_pairs(n: int, offset: int, wrap: bool) -> Pairs:
    if wrap:
        return [(i, (i + offset) % n) for i in range(n)]
    return [(i, i + offset) for i in range(n) if 0 <= i + offset < n]


def _inverse(pairs: Pairs) -> Pairs:
    return [(d, s) for s, d in pairs]


def _spec(names: tuple[str, ...], layout: int) -> str:
    """Two layouts per mesh: every axis on the rows, or the last axis on the columns."""
    if layout == 0 or len(names) == 1:
        return f"S/{'/'.join(names)} M"
    return f"S/{'/'.join(names[:-1])} M/{names[-1]}"


def _perms(n: int) -> list[tuple[str, Pairs]]:
    rng = np.random.default_rng(n)
    full = [int(v) for v in rng.permutation(n)]
    return [
        ("next-cyclic", _shift_pairs(n, 1, True)),
        ("back-no-wrap", _shift_pairs(n, -1, False)),
        ("random-full", list(enumerate(full))),
        ("partial", [(0, n - 1)] if n > 1 else [(0, 0)]),
    ]


CASES = [
    pytest.param(i, layout, axis, name, perm, id=f"{MESHES[i][0]}-L{layout}-{axis}-{name}")
    for i, (shape, names) in enumerate(MESHES)
    for layout in (0, 1)
    if layout == 0 or len(names) > 1
    for axis, n in zip(names, shape, strict=True)
    for name, perm in _perms(n)
]


def _run(mesh: Any, spec: str, op, jit: bool):
    @typed_shard_map
    def f(x: f32[Array, spec.encode()]) -> f32[Array, spec.encode()]:
        return op(x)

    return jax.jit(f) if jit else f


@pytest.mark.parametrize("i, layout, axis, name, perm", CASES)
def test_ppermute_values_and_grad_match_numpy(i, layout, axis, name, perm):
    mesh = _mesh(i)
    names = MESHES[i][1]
    spec, k = _spec(names, layout), names.index(axis)
    rng = np.random.default_rng(i)
    x = rng.standard_normal((16, 6)).astype(np.float32)
    w = rng.standard_normal((16, 6)).astype(np.float32)
    with jax.set_mesh(mesh):
        xs = place(x, mesh, spec)
        for jit in (False, True):
            f = _run(mesh, spec, lambda v: shardops.ppermute(spec, v, axis, perm), jit)
            got = _device_blocks(f(xs), mesh)
            want = _permuted(blocks(x, mesh, spec), k, perm)
            for c in want:
                np.testing.assert_array_equal(got[c], want[c], err_msg=f"device {c}, jit={jit}")
        ws = place(w, mesh, spec)
        f = _run(mesh, spec, lambda v: shardops.ppermute(spec, v, axis, perm), True)
        g = jax.jit(jax.grad(lambda v: jnp.sum(f(v) * ws)))(xs)
    # d/dx sum(P(x) * w) = P^T w: the inverse permutation of w's blocks.
    want_g = _permuted(blocks(w, mesh, spec), k, _inverse(perm))
    got_g = _device_blocks(g, mesh)
    for c in want_g:
        np.testing.assert_allclose(got_g[c], want_g[c], err_msg=f"grad, device {c}")


@pytest.mark.parametrize("i", range(len(MESHES)))
@pytest.mark.parametrize(
    "offset, wrap",
    [(1, True), (-1, True), (1, False), (-1, False), (3, True), (2, False), (9, False)],
)
def test_shift_matches_numpy(i, offset, wrap):
    mesh = _mesh(i)
    shape, names = MESHES[i]
    spec = _spec(names, 0)
    x = np.arange(8 * 3, dtype=np.float32).reshape(8, 3) + 1
    w = np.random.default_rng(0).standard_normal((8, 3)).astype(np.float32)
    with jax.set_mesh(mesh):
        xs, ws = place(x, mesh, spec), place(w, mesh, spec)
        for axis, n in zip(names, shape, strict=True):
            k, pairs = names.index(axis), _shift_pairs(n, offset, wrap)
            f = _run(mesh, spec, lambda v, a=axis: shardops.shift(spec, v, a, offset, wrap), True)
            got = _device_blocks(f(xs), mesh)
            want = _permuted(blocks(x, mesh, spec), k, pairs)
            g = _device_blocks(jax.grad(lambda v, f=f: jnp.sum(f(v) * ws))(xs), mesh)
            want_g = _permuted(blocks(w, mesh, spec), k, _inverse(pairs))
            for c in want:
                np.testing.assert_array_equal(got[c], want[c], err_msg=f"{axis} device {c}")
                np.testing.assert_allclose(g[c], want_g[c], err_msg=f"grad {axis} device {c}")


def test_shift_forward_then_back_is_identity_with_wrap():
    mesh = _mesh(2)
    spec = "S/x/y/z M"
    x = np.arange(16.0, dtype=np.float32).reshape(8, 2)

    def there_and_back(v):
        for axis in ("x", "y", "z"):
            v = shardops.shift(spec, v, axis, offset=1)
        for axis in ("z", "y", "x"):
            v = shardops.shift(spec, v, axis, offset=-1)
        return v

    with jax.set_mesh(mesh):
        y = _run(mesh, spec, there_and_back, True)(place(x, mesh, spec))
    np.testing.assert_array_equal(np.asarray(y), x)


# -- compiled program: one collective-permute, named scope, explain ------------------------------


def _permutes(text: str) -> list[Any]:
    return [c for c in _hlo.collectives(text)[0] if c.kind == "collective-permute"]


@pytest.mark.parametrize(
    "op",
    [
        lambda v: shardops.ppermute("S/x M/y", v, "x", [(0, 1), (1, 2), (2, 3), (3, 0)]),
        lambda v: shardops.shift("S/x M/y", v, "x", offset=1, wrap=False),
    ],
    ids=["ppermute", "shift"],
)
def test_one_collective_permute_forward_and_one_backward(op):
    mesh = _mesh(1)
    x = place(np.ones((8, 4), np.float32), mesh, "S/x M/y")
    with jax.set_mesh(mesh):
        f = _run(mesh, "S/x M/y", op, True)
        fwd = jax.jit(f).lower(x).compile().as_text()
        bwd = jax.jit(jax.grad(lambda v: jnp.sum(f(v) ** 2))).lower(x).compile().as_text()
    (c,) = _permutes(fwd)
    assert c.in_bytes == 2 * 2 * 4  # the (8/4) x (4/2) f32 block
    others = [c for c in _hlo.collectives(fwd)[0] if c.kind != "collective-permute"]
    assert others == []
    assert len(_permutes(bwd)) == 2  # forward, and its inverse for the gradient


@pytest.mark.parametrize(
    "op, scope", [("ppermute", "shardops.ppermute[S/d M]"), ("shift", "shardops.shift[S/d M]")]
)
def test_named_scope_and_explain_bytes(op, scope):
    mesh = _mesh(0)

    @typed_shard_map
    def f(x: f32[Array, b"S/d M"]) -> f32[Array, b"S/d M"]:
        if op == "shift":
            return shardops.shift("S/d M", x, "d")
        return shardops.ppermute("S/d M", x, "d", [(i, (i + 1) % 8) for i in range(8)])

    x = place(np.ones((16, 4), np.float32), mesh, "S/d M")
    with jax.set_mesh(mesh):
        assert scope in jax.jit(f).lower(x).as_text(debug_info=True)
        report = shardlib.explain(f, x)
        cmp = report.compare_hlo(jax.jit(f).lower(x).compile().as_text())
    assert cmp.identical, str(cmp)
    (c,) = report.collectives
    assert (c.op, c.spec, c.kind, c.axes, c.group) == (op, "S/d M", "collective-permute", ("d",), 8)
    assert c.operand_bytes == 2 * 4 * 4  # a 2 x 4 f32 block
    assert c.sent_bytes == c.received_bytes == c.operand_bytes  # each device sends its block once
    assert op in str(report)


# -- partial sums and varying values -------------------------------------------------------------


def test_ppermute_of_a_partial_sum_over_another_axis_keeps_it_pending():
    mesh = _mesh(1)  # x: 4, y: 2
    perm = [(0, 3), (1, 0), (2, 1), (3, 2)]

    @typed_shard_map
    def f(a: f32[Array, b"B/x K/y"], b: f32[Array, b"K/y N"]) -> f32[Array, b"B/x N"]:
        part = shardops.einsum_unreduced("B/x K/y, K/y N -> B/x N {+y}", a, b)
        moved = shardops.ppermute("B/x N {+y}", part, "x", perm)  # declared: still owes y
        return shardops.psum("B/x N", moved, axes="y")

    rng = np.random.default_rng(1)
    a = rng.standard_normal((8, 4)).astype(np.float32)
    b = rng.standard_normal((4, 3)).astype(np.float32)
    with jax.set_mesh(mesh):
        got = np.asarray(jax.jit(f)(place(a, mesh, "B/x K/y"), place(b, mesh, "K/y N")))
    full = (a @ b).reshape(4, 2, 3)
    want = np.zeros_like(full)
    for s, d in perm:
        want[d] = full[s]
    np.testing.assert_allclose(got, want.reshape(8, 3), rtol=1e-5, atol=1e-5)


def test_non_cyclic_shift_of_a_partial_sum_over_its_own_axis_is_refused():
    """A cyclic shift keeps the sum (tests/test_pending_rings.py); without wrap, device 0
    receives zeros and the last device's share is dropped."""
    mesh = _mesh(1)

    @typed_shard_map
    def f(a: f32[Array, b"B K/x"], b: f32[Array, b"K/x N"]) -> f32[Array, b"B N"]:
        part = shardops.einsum_unreduced("B K/x, K/x N -> B N", a, b)
        moved = shardops.shift("B N", part, "x", wrap=False)
        return shardops.psum("B N", moved, axes="x")

    msg = r"shardops.shift\('B N'\) .* is not a full permutation over mesh axis 'x'.*psum"
    with jax.set_mesh(mesh), pytest.raises(shardops.PendingReductionError, match=msg):
        f(jnp.ones((2, 8)), jnp.ones((8, 3)))


def test_shifted_replicated_value_varies_so_a_sum_over_the_axis_is_allowed():
    """Without wrap, stage 0 receives zeros: the value differs along 'p' and psum over 'p' is
    a real sum, (p - 1) copies of x, not the sum of a replicated value that shardlib refuses."""
    mesh = make_mesh((4, 2), ("p", "d"))

    @typed_shard_map
    def f(x: f32[Array, b"M/d"]) -> f32[Array, b"M/d"]:
        y = shardops.shift("M/d", x, "p", offset=1, wrap=False)
        return shardops.psum("M/d", y, axes="p")

    x = np.arange(4.0, dtype=np.float32) + 1
    with jax.set_mesh(mesh):
        got = np.asarray(jax.jit(f)(place(x, mesh, "M/d")))
    np.testing.assert_array_equal(got, 3 * x)


# -- errors ----------------------------------------------------------------------------------------


def _traced(body, spec: str = "S/x M"):
    mesh = _mesh(1)

    @typed_shard_map
    def f(x: f32[Array, spec.encode()]) -> f32[Array, spec.encode()]:
        return body(x)

    with jax.set_mesh(mesh):
        return f(place(np.ones((8, 4), np.float32), mesh, spec))


def test_axis_that_is_not_manual_names_op_axis_and_manual_axes():
    msg = r"ppermute\('S/x M'\): mesh axis 'p' is not a manual axis .*\(manual axes: x=4, y=2\)"
    with pytest.raises(ValueError, match=msg):
        _traced(lambda v: shardops.ppermute("S/x M", v, "p", [(0, 1)]))


def test_outside_shard_map_is_an_error():
    with pytest.raises(
        ValueError, match=r"shift\('S M'\) communicates over mesh axis 'x'.*shard_map"
    ):
        shardops.shift("S M", jnp.ones((2, 2)), "x")


@pytest.mark.parametrize(
    "perm, match",
    [
        (
            [(0, 1), (0, 2)],
            r"ppermute\('S/x M'\) along 'x': perm has source 0 twice, in \(0, 1\) and \(0, 2\)",
        ),
        ([(0, 1), (2, 1)], r"destination 1 twice, in \(0, 1\) and \(2, 1\)"),
    ],
)
def test_repeated_source_or_destination_is_refused(perm, match):
    with pytest.raises(ValueError, match=match):
        _traced(lambda v: shardops.ppermute("S/x M", v, "x", perm))


@pytest.mark.parametrize("pair", [(0, 4), (-1, 0), (7, 1)])
def test_index_off_the_axis_names_pair_axis_and_size(pair):
    with pytest.raises(
        ValueError,
        match=rf"ppermute\('S/x M'\): the pair \({pair[0]}, {pair[1]}\) .*mesh axis 'x', which has 4 devices; indices must be in 0..3",
    ):
        _traced(lambda v: shardops.ppermute("S/x M", v, "x", [pair]))


@pytest.mark.parametrize(
    "perm, match",
    [
        ("01", "must be a list of"),
        (3, "must be a list of"),
        ([(0, 1, 2)], r"perm\[0\] = \(0, 1, 2\) is not a \(source index, destination index\) pair"),
        ([(0, 1.5)], r"perm\[0\]"),
        ([(True, 1)], r"perm\[0\]"),
    ],
)
def test_malformed_perm_is_a_type_error(perm, match):
    with pytest.raises(TypeError, match=match):
        shardops.ppermute("S/x M", jnp.ones((2, 2)), "x", perm)


def test_spec_and_axis_errors():
    with pytest.raises(SpecError, match="ppermute: the spec is one shape spec, not 'a -> b'"):
        shardops.ppermute("S/x -> S", jnp.ones(2), "x", [(0, 1)])
    with pytest.raises(SpecError, match=r"shift\('S/x M'\): axis='x/y' is not one mesh axis name"):
        shardops.shift("S/x M", jnp.ones((2, 2)), "x/y")
    with pytest.raises(TypeError, match=r"axis=\('x', 'y'\) must name one mesh axis"):
        shardops.shift("S/x M", jnp.ones((2, 2)), ("x", "y"))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"offset=1.5 must be an int"):
        shardops.shift("S/x M", jnp.ones((2, 2)), "x", 1.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"wrap=1 must be True or False"):
        shardops.shift("S/x M", jnp.ones((2, 2)), "x", 1, 1)  # type: ignore[arg-type]


def test_input_that_does_not_match_the_spec_is_refused():
    with pytest.raises(Exception, match=r"ppermute\('S/x M K'\) input"):
        _traced(lambda v: shardops.ppermute("S/x M K", v, "x", [(0, 1)]))


@pytest.mark.parametrize(
    "perm, sent",
    [
        ([(0, 1), (1, 0), (2, 2), (3, 3)], 32),  # two swap, two stay: the busiest sends a block
        ([(0, 0), (1, 1), (2, 2), (3, 3)], 0),  # every pair stays: nothing crosses a link
    ],
)
def test_explain_counts_the_busiest_device_s_bytes_and_none_for_pairs_that_stay(perm, sent):
    """explain's byte convention (docs/guide/explain.md): the busiest device's bytes."""
    mesh = _mesh(0)

    @typed_shard_map
    def f(x: f32[Array, b"S/d M"]) -> f32[Array, b"S/d M"]:
        return shardops.ppermute("S/d M", x, "d", perm)

    x = place(np.ones((16, 4), np.float32), mesh, "S/d M")
    with jax.set_mesh(mesh):
        (c,) = shardlib.explain(f, x).collectives
    assert c.operand_bytes == 32 and c.sent_bytes == sent
