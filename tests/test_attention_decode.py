"""``shardlib.attention.decode``: one query token per row against a key/value cache, against an
unsharded NumPy oracle.

Each case makes a global f32 q ``(B, H, D)``, cache k, v ``(B, S, K, D)`` and per-row lengths,
places them on a 1-D, 2-D or 3-D mesh of the 8 simulated devices (the cache's sequence over
``c``, batch over ``d``, heads over ``t``), runs `decode` inside ``typed_shard_map`` and
compares the output with plain softmax attention of each row's query over the cache positions
``< lengths[b]`` (float64, K/V repeated per query head). Also: decoding token ``t`` is row ``t``
of causal attention over the same K/V (teacher forcing, against `attention.ring`), the
combine's bytes (explain = `decode_bytes` = the compiled HLO), the gradients, and every rule
of the arguments with its message.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec
from typeguard import TypeCheckError

import shardlib
from shardlib import SpecError, attention
from shardlib._attention.rules import check_decode
from shardlib._explain import hlo
from shardlib.shardtypes import Array, bf16, f32, i32, typed_shard_map
from tests._mesh_util import make_mesh, place

# (mesh shape, names, q spec, k/v spec, axis)
C8 = ((8,), ("c",), "B H D", "B S/c K D", "c")
C4 = ((4,), ("c",), "B H D", "B S/c K D", "c")
T4 = ((4,), ("t",), "B H/t D", "B S K/t D", None)
DC = ((2, 4), ("d", "c"), "B/d H D", "B/d S/c K D", "c")
DCT = ((2, 2, 2), ("d", "c", "t"), "B/d H/t D", "B/d S/c K/t D", "c")
CASES = {"c8": C8, "c4": C4, "t4": T4, "dxc": DC, "dxcxt": DCT}
RTOL, ATOL = 1e-5, 2e-6


def reference(q, k, v, lengths):
    """Softmax attention of each row's one query over the cache positions ``< lengths[b]``
    (float64; K/V repeated per query head; a row that sees nothing gives 0)."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    _, s_len, kh, d = k.shape
    g = q.shape[1] // kh
    k, v = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)
    s = np.einsum("bhd,bshd->bhs", q, k) / np.sqrt(d)
    keep = (np.arange(s_len)[None, :] < np.asarray(lengths)[:, None])[:, None]
    s = np.where(keep, s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    p = np.exp(s - np.where(np.isinf(m), 0.0, m))
    total = p.sum(axis=-1, keepdims=True)
    return np.einsum("bhs,bshd->bhd", p / np.where(total == 0, 1.0, total), v)


def _lengths_spec(case):
    return case[2].split()[0]


@functools.cache
def _decoder(case, with_scale=False):
    """The ``typed_shard_map`` of `decode` for one mesh case."""
    _, _, qs, kvs, axis = case
    ls = _lengths_spec(case)

    @typed_shard_map
    def f(
        q: f32[Array, qs.encode()],
        k: f32[Array, kvs.encode()],
        v: f32[Array, kvs.encode()],
        lengths: i32[Array, ls.encode()],
    ) -> f32[Array, qs.encode()]:
        scale = jnp.float32(0.3) if with_scale else None
        return attention.decode(f"{qs}, {kvs}", q, k, v, lengths, axis, scale=scale)

    return f


def _inputs(b, s, h, kh, d, seed):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, h, d)).astype(np.float32)
    k = rng.standard_normal((b, s, kh, d)).astype(np.float32)
    v = rng.standard_normal((b, s, kh, d)).astype(np.float32)
    return q, k, v


def _placed(case, q, k, v, lengths):
    shape, names, qs, kvs, _ = case
    mesh = make_mesh(shape, names)
    args = (
        place(q, mesh, qs),
        place(k, mesh, kvs),
        place(v, mesh, kvs),
        place(np.asarray(lengths, np.int32), mesh, _lengths_spec(case)),
    )
    return mesh, args


def _decode(case, q, k, v, lengths):
    mesh, args = _placed(case, q, k, v, lengths)
    with jax.set_mesh(mesh):
        return np.asarray(jax.jit(_decoder(case))(*args))


# -- against the oracle --------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(CASES))
def test_matches_the_reference_with_gqa_and_per_row_lengths(name):
    """GQA (H=8 over K=2 or K=4 heads); the rows' lengths: one inside the first device's chunk
    only (every other device sees nothing of that row), one ending inside the last chunk, the
    whole cache, one ending on a chunk's edge, 1, and 0 (the output is 0)."""
    case = CASES[name]
    b, s, h, kh, d = 6, 32, 8, (4 if name == "t4" else 2), 8
    q, k, v = _inputs(b, s, h, kh, d, seed=1)
    lengths = [3, 29, s, 16, 1, 0]
    got = _decode(case, q, k, v, lengths)
    np.testing.assert_allclose(got, reference(q, k, v, lengths), rtol=RTOL, atol=ATOL)
    assert not np.isnan(got).any()
    assert (got[5] == 0).all()


def _random_case(rng):
    name = rng.choice(list(CASES))
    case = CASES[name]
    sizes = dict(zip(case[1], case[0], strict=True))
    c, t, dn = sizes.get("c", 1), sizes.get("t", 1), sizes.get("d", 1)
    kh = t * int(rng.choice([1, 2]))
    h = kh * int(rng.choice([1, 2, 4]))  # MHA, GQA, ...
    if rng.random() < 0.2:
        kh, h = t, t * 4  # MQA per device
    b = dn * int(rng.integers(1, 4))
    s = c * int(rng.integers(1, 6))
    d = int(rng.choice([4, 8, 16]))
    lengths = rng.integers(0, s + 1, size=b)
    return name, case, (b, s, h, kh, d), lengths


@pytest.mark.parametrize("seed", [0, 1, 2, pytest.param(3, marks=pytest.mark.slow)])
def test_random_shapes_and_lengths(seed):
    """Seeded random meshes, shapes (MHA, GQA, MQA, chunks of 1 to 5 positions) and lengths
    in ``[0, S]``, a few cases per seed."""
    rng = np.random.default_rng(100 + seed)
    for _ in range(3 if seed < 3 else 20):
        name, case, shape, lengths = _random_case(rng)
        q, k, v = _inputs(*shape, seed=int(rng.integers(1 << 30)))
        got = _decode(case, q, k, v, lengths)
        want = reference(q, k, v, lengths)
        np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL, err_msg=f"{name} {shape}")


def test_a_length_outside_the_cache_gives_nan_in_its_row_only():
    """A position past the cache (length > S) or a negative length is a bug upstream: that
    row is NaN, never silently truncated; the other rows are right."""
    q, k, v = _inputs(4, 32, 4, 2, 8, seed=3)
    lengths = [33, 32, -1, 7]
    got = _decode(C4, q, k, v, lengths)
    assert np.isnan(got[0]).all() and np.isnan(got[2]).all()
    ok = [1, 3]
    want = reference(q[ok], k[ok], v[ok], [lengths[i] for i in ok])
    np.testing.assert_allclose(got[ok], want, rtol=RTOL, atol=ATOL)


def test_teacher_forcing_equals_causal_attention():
    """Decoding token ``t`` of row ``b`` (its query, ``lengths[b] = t + 1``) gives row ``t``
    of causal attention over the same K/V (`attention.ring`, the same mesh)."""
    case = DCT
    _, _, qs, kvs, _ = case
    b, s, h, kh, d = 4, 32, 8, 2, 8
    rng = np.random.default_rng(7)
    q_all = rng.standard_normal((b, s, h, d)).astype(np.float32)
    _, k, v = _inputs(b, s, h, kh, d, seed=8)
    seq_q = qs.replace("H", "L/c H")

    @typed_shard_map
    def causal(
        q: f32[Array, seq_q.encode()], k: f32[Array, kvs.encode()], v: f32[Array, kvs.encode()]
    ) -> f32[Array, seq_q.encode()]:
        return attention.ring(f"{seq_q.replace('L', 'S')}, {kvs}", q, k, v, "c")

    mesh = make_mesh(case[0], case[1])
    with jax.set_mesh(mesh):
        full = np.asarray(
            jax.jit(causal)(place(q_all, mesh, seq_q), place(k, mesh, kvs), place(v, mesh, kvs))
        )
    for ts in ([0, 9, 16, 31], [31, 30, 15, 8]):
        rows = np.arange(b)
        got = _decode(case, q_all[rows, ts], k, v, np.asarray(ts) + 1)
        np.testing.assert_allclose(got, full[rows, ts], rtol=RTOL, atol=ATOL)


def test_gradients_match_the_reference():
    """Autodiff through the combine (no custom rule): dq, dk, dv and a traced scale's."""
    case = DC
    b, s, h, kh, d = 4, 16, 4, 2, 8
    q, k, v = _inputs(b, s, h, kh, d, seed=5)
    lengths = np.array([16, 3, 0, 9], np.int32)
    ct = np.random.default_rng(6).standard_normal((b, h, d)).astype(np.float32)
    mesh, args = _placed(case, q, k, v, lengths)
    f = _decoder(case)
    grad = jax.grad(lambda q, k, v: (f(q, k, v, args[3]) * ct).sum(), argnums=(0, 1, 2))
    with jax.set_mesh(mesh):
        grads = jax.jit(grad)(*args[:3])
        report = shardlib.explain(grad, *args[:3])
        text = jax.jit(grad).lower(*args[:3]).compile().as_text() or ""
    # Backward: q's gradient summed over c (q is the same on its 4 devices), 2 (c-1)/c of it.
    (call,) = report.rings
    q_block = (b // 2) * h * d * 4
    assert call.forward_bytes == attention.decode_bytes(b // 2, h, d, 4)
    assert call.backward_bytes == 2 * 3 * q_block // 4
    assert report.compare_hlo(text).identical

    def plain(q, k, v):
        g = h // kh
        kk, vv = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)
        sc = jnp.einsum("bhd,bshd->bhs", q, kk) / np.sqrt(d)
        keep = (jnp.arange(s)[None, :] < lengths[:, None])[:, None]
        p = jax.nn.softmax(jnp.where(keep, sc, -1e30), axis=-1) * keep
        return jnp.einsum("bhs,bshd->bhd", p, vv)

    want = jax.grad(lambda *a: (plain(*a) * ct).sum(), argnums=(0, 1, 2))(q, k, v)
    for name, g, w in zip(("dq", "dk", "dv"), grads, want, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-5, err_msg=name)
    assert (np.asarray(grads[0])[2] == 0).all()  # the row that sees nothing


# -- the combine's bytes: the formula, explain and the compiled program ---------------------------


@pytest.mark.parametrize("name", ["c4", "dxcxt", pytest.param("c8", marks=pytest.mark.slow)])
def test_combine_bytes_explain_equal_the_formula_and_the_hlo(name):
    """One collective per call, an all-reduce over ``c`` of ``B*H*(D+2)`` f32 per device in
    ``c`` slots: ``2 (c - 1) B H (D + 2) * 4`` bytes sent (per device, per layer and token),
    the same whatever the cache's length; explain's row and its attention call say so, and
    so does the compiled HLO."""
    case = CASES[name]
    sizes = dict(zip(case[1], case[0], strict=True))
    c, t, dn = sizes["c"], sizes.get("t", 1), sizes.get("d", 1)
    b, h, kh, d = 4, 8, 2, 16
    want = attention.decode_bytes(b // dn, h // t, d, c)
    assert want == 2 * (c - 1) * (b // dn) * (h // t) * (d + 2) * 4
    for s in (8 * c, 32 * c):  # the cache's length does not change the bytes
        q, k, v = _inputs(b, s, h, kh, d, seed=0)
        mesh, args = _placed(case, q, k, v, [1] * b)
        f = _decoder(case)
        with jax.set_mesh(mesh):
            report = shardlib.explain(f, *args)
            text = jax.jit(f).lower(*args).compile().as_text() or ""
        found, unknown = hlo.collectives(text)
        assert unknown == 0 and [x.kind for x in found] == ["all-reduce"]
        assert [(r.kind, r.axes, r.total_sent) for r in report.collectives] == [
            ("all-reduce", ("c",), want)
        ]
        cmp = report.compare_hlo(text)
        assert cmp.identical and cmp.n_hlo == cmp.n_report == 1, str(cmp)
        (call,) = report.rings
        assert (call.fn, call.axis, call.c, call.layout) == ("decode", "c", c, "contiguous")
        assert (call.forward_bytes, call.backward_bytes) == (want, 0)
        assert "attention.decode over c" in report.short()


def test_layers_of_a_scan_multiply_the_combine():
    """A decode step of 3 layers (a ``scan``, each layer its own cache): 3 runs of the
    combine, ``3 * decode_bytes`` per token, in explain's table and in the compiled loop."""
    layers, b, s, h, kh, d = 3, 4, 16, 4, 2, 8
    mesh = make_mesh((4,), ("c",))

    @typed_shard_map
    def step(
        q: f32[Array, b"B H D"],
        k: f32[Array, b"N B S/c K D"],
        v: f32[Array, b"N B S/c K D"],
        lengths: i32[Array, b"B"],
    ) -> f32[Array, b"B H D"]:
        def layer(x, kv):
            k, v = kv
            return attention.decode("B H D, B S/c K D", x, k, v, lengths, "c"), None

        return jax.lax.scan(layer, q, (k, v))[0]

    rng = np.random.default_rng(9)
    q = rng.standard_normal((b, h, d)).astype(np.float32)
    k, v = (rng.standard_normal((layers, b, s, kh, d)).astype(np.float32) for _ in "kv")
    lengths = np.array([16, 5, 0, 11], np.int32)
    with jax.set_mesh(mesh):
        args = (
            place(q, mesh, "B H D"),
            place(k, mesh, "N B S/c K D"),
            place(v, mesh, "N B S/c K D"),
            place(lengths, mesh, "B"),
        )
        got = np.asarray(jax.jit(step)(*args))
        report = shardlib.explain(step, *args)
        text = jax.jit(step).lower(*args).compile().as_text() or ""
    want = q
    for i in range(layers):
        want = reference(want, k[i], v[i], lengths)
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)
    (call,) = report.rings
    assert (call.fn, call.runs) == ("decode", layers)
    assert call.forward_bytes == layers * attention.decode_bytes(b, h, d, 4) == report.bytes_sent
    cmp = report.compare_hlo(text)
    assert cmp.identical, str(cmp)
    rows = [r for r in report.render().splitlines() if r.lstrip().startswith("decode ")]
    assert len(rows) == 1 and "all-reduce" in rows[0] and f"x{layers}" in rows[0], rows
    assert attention.decode_bytes(batch=8, heads=4, width=128, c=8) == 232960  # the docstring's


def test_a_cache_that_is_not_split_needs_no_collective():
    """``axis=None`` (heads over ``t`` only): each device attends alone, nothing is sent."""
    q, k, v = _inputs(2, 16, 8, 4, 8, seed=0)
    mesh, args = _placed(T4, q, k, v, [16, 5])
    with jax.set_mesh(mesh):
        f = _decoder(T4)
        report = shardlib.explain(f, *args)
        text = jax.jit(f).lower(*args).compile().as_text() or ""
    assert report.collectives == [] and hlo.collectives(text)[0] == []
    assert attention.decode_bytes(2, 2, 8, 1) == 0


def test_roles_for_the_spec_and_the_axis():
    """The spec and ``axis`` may name roles (`shardlib.axis_rules`): resolved to the mesh's."""
    mesh = make_mesh((2, 4), ("d", "c"))
    q, k, v = _inputs(4, 16, 4, 2, 8, seed=4)
    lengths = np.array([16, 2, 9, 0], np.int32)

    @typed_shard_map
    def f(
        q: f32[Array, b"B/batch H D"],
        k: f32[Array, b"B/batch S/seq K D"],
        v: f32[Array, b"B/batch S/seq K D"],
        lengths: i32[Array, b"B/batch"],
    ) -> f32[Array, b"B/batch H D"]:
        return attention.decode("B/batch H D, B/batch S/seq K D", q, k, v, lengths, "seq")

    with jax.set_mesh(mesh), shardlib.axis_rules(batch="d", seq="c"):
        args = (
            place(q, mesh, "B/d H D"),
            place(k, mesh, "B/d S/c K D"),
            place(v, mesh, "B/d S/c K D"),
            place(lengths, mesh, "B/d"),
        )
        got = np.asarray(jax.jit(f)(*args))
        (call,) = shardlib.explain(f, *args).rings
    np.testing.assert_allclose(got, reference(q, k, v, lengths), rtol=RTOL, atol=ATOL)
    assert (call.fn, call.axis, call.c) == ("decode", "c", 4)


def test_bf16_gives_bf16_with_the_combine_in_f32():
    """A bf16 cache: the output is bf16 (q's dtype); the state and the combine are f32."""
    mesh = make_mesh((4,), ("c",))
    q, k, v = _inputs(2, 32, 4, 2, 8, seed=11)
    lengths = [29, 6]

    @typed_shard_map
    def f(
        q: bf16[Array, b"B H D"],
        k: bf16[Array, b"B S/c K D"],
        v: bf16[Array, b"B S/c K D"],
        lengths: i32[Array, b"B"],
    ) -> bf16[Array, b"B H D"]:
        return attention.decode("B H D, B S/c K D", q, k, v, lengths, "c")

    q, k, v = (x.astype(jnp.bfloat16) for x in (q, k, v))
    with jax.set_mesh(mesh):
        specs = ("B H D", "B S/c K D", "B S/c K D")
        args = [place(x, mesh, s) for x, s in zip((q, k, v), specs, strict=True)]
        out = jax.jit(f)(*args, place(np.asarray(lengths, np.int32), mesh, "B"))
    assert out.dtype == jnp.bfloat16
    want = reference(np.float32(q), np.float32(k), np.float32(v), lengths)
    np.testing.assert_allclose(np.asarray(out, np.float32), want, rtol=2e-2, atol=2e-2)


def test_a_traced_scale():
    """``scale`` as an f32 array of shape (): the scores are scaled by it."""
    q, k, v = _inputs(2, 16, 4, 2, 8, seed=2)
    lengths = [11, 4]
    mesh, args = _placed(C4, q, k, v, lengths)
    with jax.set_mesh(mesh):
        got = np.asarray(jax.jit(_decoder(C4, with_scale=True))(*args))
    want = reference(q * 0.3 * np.sqrt(8), k, v, lengths)  # the reference scales by 1/sqrt(D)
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)


# -- the rules: each broken one names the argument -----------------------------------------------

SPEC_RULES = [
    ("B H D", None, "must be q's shape spec, ', ' and the cache's"),
    ("B H D, B S/c K D, B S/c K D", "c", "must be q's shape spec, ', ' and the cache's"),
    ("B 1 H D, B S/c K D", "c", "must give q 3 dims"),
    ("B H D, B S/c K", "c", "must give k and v 4 dims"),
    ("B/d H D, B S/c K D", "c", "different batch dims"),
    ("B H D, B S/c K E", "c", "different head width dims"),
    ("B H/t D, B S/c K D", "c", "splits the heads of q and k/v over different mesh axes"),
    ("B H D, B S/c K D", None, "must not split the cache's sequence dim when argument `axis`"),
    ("B H D, B S/c/e K D", None, "must not split the cache's sequence dim 'S/c/e'"),
    ("B H D, B S K D", "c", "must split the cache's sequence dim over exactly argument `axis`"),
    ("B H D, B S/e K D", "c", "must split the cache's sequence dim over exactly argument `axis`"),
    ("B H D/t, B S/c K D/t", "c", "must not split the head width dim"),
    ("B 6 D, B S/c 4 D", "c", "expected H divisible by K=4, got H=6"),
]


def test_spec_rules():
    for spec, axis, message in SPEC_RULES:
        with pytest.raises(SpecError) as err:
            check_decode("decode", spec, axis)
        assert "decode: argument `spec`" in str(err.value) and message in str(err.value)


def test_the_spec_rules_take_a_good_spec():
    checked = check_decode("decode", "B/d H/t D, B/d S/c K/t D", "c")
    assert (checked.axis, checked.lengths_text) == ("c", "B/d")
    assert checked.combine_text(4, 10) == "4 B/d H/t 10"
    assert check_decode("decode", "B H D, B S K D", None).axis is None


def _trace(case, q, k, v, lengths, spec=None, axis: Any = "same", body_axis=None):
    """Trace (no compile) a decode call with the given blocks; returns what it raised."""
    shape, names, qs, kvs, case_axis = case
    mesh = make_mesh(shape, names)
    axis = case_axis if axis == "same" else axis

    def f(q, k, v, lengths):
        return attention.decode(spec or f"{qs}, {kvs}", q, k, v, lengths, axis)

    specs = (qs, kvs, kvs, _lengths_spec(case))
    with jax.set_mesh(mesh):
        args = [
            jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, _pspec(s)))
            for x, s in zip((q, k, v, lengths), specs, strict=True)
        ]
        sm = jax.shard_map(
            f,
            in_specs=tuple(_pspec(s) for s in specs),
            out_specs=_pspec(qs),
            axis_names=set(names) if body_axis is None else body_axis,
            check_vma=False,
        )
        return jax.jit(sm).trace(*args)


def _pspec(spec):
    return PartitionSpec(*[d.split("/")[1] if "/" in d else None for d in spec.split()])


def _raises(exc, fn, *words):
    with pytest.raises(exc) as err:
        fn()
    for w in words:
        assert w in str(err.value), str(err.value)


def test_argument_rules_at_trace_time():
    """Each broken rule of the blocks names the argument: an axis that is not manual or not
    the mesh's, a length of another dtype or batch, blocks that do not match the spec,
    dtypes that differ, heads that do not divide per device."""
    q, k, v = (np.zeros(s, np.float32) for s in ((4, 8, 8), (4, 16, 2, 8), (4, 16, 2, 8)))
    n = np.zeros(4, np.int32)
    _raises(ValueError, lambda: _trace(C4, q, k, v, n, axis="x"), "decode: argument `axis`")
    _raises(ValueError, lambda: _trace(C4, q, k, v, n, axis=3), "decode: argument `axis`")
    _raises(
        ValueError,
        lambda: _trace(C4, q, k, v, n.astype(np.float32)),
        "decode: argument `lengths` must be integers",
    )
    _raises(TypeCheckError, lambda: _trace(C4, q, k, v, np.zeros(2, np.int32)), "`lengths`")
    _raises(TypeCheckError, lambda: _trace(C4, q, k[:, :, :, :4], v, n), "argument `k`")
    _raises(TypeCheckError, lambda: _trace(C4, q[None], k, v, n), "argument `q`")
    _raises(TypeCheckError, lambda: _trace(C4, q[:2], k, v, n[:2]), "argument `k`", "B=2")
    _raises(
        ValueError,
        lambda: _trace(C4, q, k, v.astype(np.float16), n),
        "arguments `q`, `k` and `v` must have one dtype",
    )
    q6, k4 = np.zeros((4, 6, 8), np.float32), np.zeros((4, 16, 4, 8), np.float32)
    _raises(ValueError, lambda: _trace(C4, q6, k4, k4, n), "decode: argument `q` dim 'H'")
    partial = ((2, 4), ("d", "c"), "B H D", "B S/c K D", "c")  # manual over c only
    _raises(
        ValueError,
        lambda: _trace(partial, q, k, v, n, axis="d", body_axis={"c"}),
        "decode: argument `axis`",
        "not manual over",
    )


def test_decode_is_public():
    assert {"decode", "decode_bytes"} <= set(attention.__all__)
