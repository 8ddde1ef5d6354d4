"""``shardlib.attention``: ring and all-gather attention against an unsharded jax.numpy oracle.

Each case makes global f32 q, k, v (and segment ids) in the original sequence order, puts them
into the layout (contiguous or balanced, numpy indexing), places them on a 1-D, 2-D or 3-D
mesh of the 8 simulated devices (sequence over ``c``; batch over ``d``; heads over ``t``),
runs the attention inside ``typed_shard_map`` and compares the output and the gradients of
q, k and v (a random cotangent), put back into the original order, with plain softmax
attention on the global arrays (K/V repeated per query head, a dense mask).
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from typeguard import TypeCheckError

from shardlib import SpecError, attention
from shardlib._attention import chunks as P
from shardlib.shardtypes import Array, bf16, f32, i32, typed_shard_map
from tests._mesh_util import make_mesh, place

# (mesh shape, names, q spec, k/v spec)
C2 = ((2,), ("c",), "B L/c H D", "B L/c K D")
C4 = ((4,), ("c",), "B L/c H D", "B L/c K D")
C8 = ((8,), ("c",), "B L/c H D", "B L/c K D")
DC = ((2, 4), ("d", "c"), "B/d L/c H D", "B/d L/c K D")
DCT = ((2, 2, 2), ("d", "c", "t"), "B/d L/c H/t D", "B/d L/c K/t D")
NAMES = {C2: "c2", C4: "c4", C8: "c8", DC: "dxc", DCT: "dxcxt"}
B_, L_, D_ = 2, 32, 8
RTOL, ATOL = 1e-5, 2e-6


def reference(q, k, v, causal=True, seg=None):
    """Plain softmax attention on global arrays: K/V repeated per query head, a dense mask."""
    _, length, h, d = q.shape
    k = jnp.repeat(k, h // k.shape[2], axis=2)
    v = jnp.repeat(v, h // v.shape[2], axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d)
    keep = jnp.tril(jnp.ones((length, length), bool)) if causal else jnp.ones((length,) * 2, bool)
    keep = keep[None, None]
    if seg is not None:
        keep = keep & (seg[:, None, :, None] == seg[:, None, None, :])
    p = jax.nn.softmax(jnp.where(keep, s, -jnp.inf), axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", p, v)


def _segments(rng, batch, length):
    """Packed sequences: sorted ids, each row cut into a few segments at random places."""
    cuts = rng.integers(0, 2, size=(batch, length)) * (rng.random((batch, length)) < 0.2)
    return np.cumsum(cuts, axis=1).astype(np.int32)


def _inputs(h, kh, seed=0, dtype=np.float32):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B_, L_, h, D_)).astype(dtype)
    k = rng.standard_normal((B_, L_, kh, D_)).astype(dtype)
    v = rng.standard_normal((B_, L_, kh, D_)).astype(dtype)
    ct = rng.standard_normal((B_, L_, h, D_)).astype(np.float32)
    return q, k, v, ct, _segments(rng, B_, L_)


@functools.cache
def _attend(case, fn, layout, causal, with_ids, bf=False, vma=True):
    """A jitted ``(q, k, v, ids, ct) -> (out, (dq, dk, dv))`` for one mesh and setting."""
    shape, names, qs, kvs = case
    spec = f"{qs}, {kvs}"
    ids_spec = " ".join(qs.split()[:2])
    op = getattr(attention, fn)
    t = bf16 if bf else f32

    @typed_shard_map(check_vma=vma)
    def f(
        q: t[Array, qs.encode()],
        k: t[Array, kvs.encode()],
        v: t[Array, kvs.encode()],
        ids: i32[Array, ids_spec.encode()],
    ) -> t[Array, qs.encode()]:
        return op(
            spec, q, k, v, "c", causal=causal, layout=layout, segment_ids=ids if with_ids else None
        )

    def run(q, k, v, ids, ct):
        out, pull = jax.vjp(lambda q, k, v: f(q, k, v, ids), q, k, v)
        return out, pull(ct)

    return jax.jit(run)


def _run(case, fn, layout, causal, with_ids, h=4, kh=2, seed=0, dtype=np.float32, vma=True):
    """Output and gradients (original order) of the sharded call, and the reference ones."""
    shape, names, qs, kvs = case
    mesh = make_mesh(shape, names)
    c = shape[names.index("c")]
    q, k, v, ct, seg = _inputs(h, kh, seed, dtype)
    order = attention.positions(L_, c, layout)
    back = np.argsort(order)
    ids_spec = " ".join(qs.split()[:2])
    with jax.set_mesh(mesh):
        args = (
            place(q[:, order], mesh, qs),
            place(k[:, order], mesh, kvs),
            place(v[:, order], mesh, kvs),
            place(seg[:, order], mesh, ids_spec),
            place(ct[:, order].astype(dtype), mesh, qs),
        )
        attend = _attend(case, fn, layout, causal, with_ids, dtype != np.float32, vma)
        out, grads = attend(*args)
    got = [np.asarray(x, np.float32)[:, back] for x in (out, *grads)]
    f32s = [jnp.asarray(x, jnp.float32) for x in (q, k, v)]
    ids = jnp.asarray(seg) if with_ids else None
    ref_out, pull = jax.vjp(lambda q, k, v: reference(q, k, v, causal, ids), *f32s)
    want = [np.asarray(x) for x in (ref_out, *pull(jnp.asarray(ct)))]
    return got, want


def _assert_close(got, want, rtol=RTOL, atol=ATOL):
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        scale = float(np.max(np.abs(w)))
        assert scale > 0, name
        np.testing.assert_allclose(g, w, rtol=rtol, atol=atol * scale, err_msg=name)


FAST = [
    (C4, "ring", "contiguous", True, False),
    (C4, "ring", "balanced", True, False),
    (C8, "ring", "balanced", True, True),
    (DC, "ring", "balanced", False, False),
    (DCT, "ring", "balanced", True, True),
    (DCT, "ring", "contiguous", True, False),
    (C4, "gathered", "balanced", True, True),
    (DCT, "gathered", "contiguous", False, False),
]


def _id(case, fn, layout, causal, with_ids):
    mask = "causal" if causal else "full"
    return f"{NAMES[case]}-{fn}-{layout}-{mask}{'-segments' if with_ids else ''}"


# The fast tier runs the first case (the causal ring on c = 4); the slow tier all of them.
@pytest.mark.parametrize(
    "case, fn, layout, causal, with_ids",
    [p if i == 0 else pytest.param(*p, marks=pytest.mark.slow) for i, p in enumerate(FAST)],
    ids=[_id(*p) for p in FAST],
)
def test_matches_reference(case, fn, layout, causal, with_ids):
    _assert_close(*_run(case, fn, layout, causal, with_ids))


# The slow grid: a covering design, not the full product of 5 meshes x 2 functions x 2 layouts
# x 2 masks x 2 (segment ids or not) = 80 compiles. Each mesh gets two settings, one the
# complement of the other, so every mesh meets both values of every switch (pairwise with the
# mesh); the eight settings are the even-weight words of (gathered, balanced, full mask,
# segment ids), which hold every combination of any three switches (strength 3 among them).
# GQA (H=4, K=2) is in every row; test_grouped_heads varies the heads. Rows shared with FAST
# reuse its compiled functions; each row has its own data seed.
_WORDS = {C2: "0000", C4: "0011", C8: "0101", DC: "0110", DCT: "0101"}


def _setting(word):
    fn, layout, full, ids = (bit == "1" for bit in word)
    return ("gathered" if fn else "ring", "balanced" if layout else "contiguous", not full, ids)


def _complement(word):
    return "".join("1" if bit == "0" else "0" for bit in word)


GRID = [(case, *_setting(word)) for case, w in _WORDS.items() for word in (w, _complement(w))]


def test_the_grid_covers_every_axis():
    """Every mesh with both values of every switch; every switch triple in all 8 combinations."""
    switches = [
        (fn == "gathered", layout == "balanced", not causal, ids)
        for _, fn, layout, causal, ids in GRID
    ]
    for case in _WORDS:
        rows = [s for (c, *_), s in zip(GRID, switches, strict=True) if c is case]
        assert all({r[j] for r in rows} == {False, True} for j in range(4)), NAMES[case]
    for trio in ((0, 1, 2), (0, 1, 3), (0, 2, 3), (1, 2, 3)):
        assert len({tuple(s[j] for j in trio) for s in switches}) == 8, trio
    assert len(set(GRID)) == len(GRID) == 10


@pytest.mark.slow
@pytest.mark.parametrize("case, fn, layout, causal, with_ids", GRID, ids=[_id(*p) for p in GRID])
def test_parity_grid(case, fn, layout, causal, with_ids):
    _assert_close(
        *_run(
            case,
            fn,
            layout,
            causal,
            with_ids,
            seed=GRID.index((case, fn, layout, causal, with_ids)),
        )
    )


@pytest.mark.slow
@pytest.mark.parametrize("h, kh", [(4, 4), (4, 1), (8, 2)], ids=["MHA", "MQA", "GQA-4"])
@pytest.mark.parametrize("case", [C4, DCT], ids=["c4", "dxcxt"])
def test_grouped_heads(case, h, kh):
    """Any K dividing H: K/V are never repeated (query heads are grouped)."""
    if case is DCT and kh == 1:
        pytest.skip("one key/value head cannot be split over t")
    _assert_close(*_run(case, "ring", "balanced", True, True, h=h, kh=kh))


@pytest.mark.slow
@pytest.mark.parametrize("fn", ["ring", "gathered"])
def test_without_check_vma(fn):
    """The ring's loop state is typed by the axes it varies over only where JAX tracks them."""
    _assert_close(*_run(DCT, fn, "balanced", True, True, vma=False))


@pytest.mark.slow
def test_bf16_within_bf16_tolerance():
    got, want = _run(C4, "ring", "balanced", True, False, dtype=jnp.bfloat16)
    _assert_close(got, want, rtol=5e-2, atol=2e-2)


# -- the balanced layout ---------------------------------------------------------------------


def test_positions_and_layout_round_trip():
    assert attention.positions(8, 2).tolist() == [0, 1, 6, 7, 2, 3, 4, 5]
    assert attention.positions(8, 2, "contiguous").tolist() == list(range(8))
    x = np.arange(2 * 16 * 3).reshape(2, 16, 3)
    y = attention.to_layout(x, 4)
    assert np.asarray(y)[0, :, 0].tolist() == [3 * p for p in attention.positions(16, 4)]
    np.testing.assert_array_equal(np.asarray(attention.from_layout(y, 4)), x)
    with pytest.raises(ValueError, match=r"divisible by 8, got 12"):
        attention.to_layout(np.zeros((1, 12)), 4)


@pytest.mark.parametrize("c", [2, 4, 8])
def test_balanced_layout_balances_the_causal_work(c):
    """Every device computes the same number of unmasked score blocks in the balanced layout
    (2c + 1 chunk pairs of (L/2c)^2 scores); contiguous: device i computes i + 1 of (L/c)^2."""
    assert P.score_blocks(c, "balanced") == [2 * c + 1] * c
    assert P.score_blocks(c, "contiguous") == [i + 1 for i in range(c)]
    assert P.score_blocks(c, "balanced", causal=False) == [4 * c] * c
    # The pairs the ring computes are exactly those with something unmasked.
    order = P.stored_positions(2 * c, c, "balanced")
    for me in range(c):
        for src in range(c):
            for a, b, needed in P.block_pairs(me, src, c, "balanced", True):
                q_pos, k_pos = order[2 * me + a], order[2 * src + b]
                assert bool(needed) == (q_pos >= k_pos), (me, src, a, b)


# -- errors -----------------------------------------------------------------------------------


def _call(case, fn, spec, shapes, axis="c", layout="contiguous", **kw):
    """Run ``fn`` in a body whose annotations take whatever shapes the test passes."""
    mesh_shape, names, qs, kvs = case
    mesh = make_mesh(mesh_shape, names)
    q, k, v = (np.zeros(s, np.float32) for s in shapes)

    @typed_shard_map(check_vma=False)
    def f(
        q: f32[Array, qs.encode()], k: f32[Array, kvs.encode()], v: f32[Array, kvs.encode()]
    ) -> f32[Array, qs.encode()]:
        return getattr(attention, fn)(spec, q, k, v, axis, layout=layout, **kw)

    with jax.set_mesh(mesh):
        return f(place(q, mesh, qs), place(k, mesh, kvs), place(v, mesh, kvs))


QKV = [(2, 32, 4, 8), (2, 32, 2, 8), (2, 32, 2, 8)]


@pytest.mark.parametrize("fn", ["ring", "gathered"])
def test_balanced_sequence_not_divisible_by_2c(fn):
    shapes = [(2, 12, 4, 8), (2, 12, 2, 8), (2, 12, 2, 8)]
    with pytest.raises(ValueError) as e:
        _call(C4, fn, "B L/c H D, B L/c K D", shapes, layout="balanced")
    text = str(e.value)
    assert f"{fn}: argument `q` dim 'L/c' (sequence) must be divisible by 2*c = 8" in text
    assert "expected a multiple of 8, got 12" in text


def test_heads_not_divisible():
    shapes = [(2, 32, 3, 8), (2, 32, 2, 8), (2, 32, 2, 8)]
    with pytest.raises(ValueError) as e:
        _call(C4, "ring", "B L/c H D, B L/c K D", shapes)
    text = str(e.value)
    assert (
        "ring: argument `q` dim 'H' (query heads) must be a multiple of argument `k` dim 'K'"
        in text
    )
    assert "expected a multiple of 2, got 3" in text
    with pytest.raises(SpecError, match=r"expected H divisible by K=2, got H=3"):
        _call(C4, "ring", "B L/c 3 D, B L/c 2 D", [(2, 32, 3, 8), (2, 32, 2, 8), (2, 32, 2, 8)])


@pytest.mark.parametrize(
    "spec, match",
    [
        ("B/d L/c H D, B L/c K D", r"different batch dims: q 'B/d', k/v 'B'"),
        ("B L/c H D, B S/c K D", r"different sequence dims: q 'L/c', k/v 'S/c'"),
        ("B L/c H D, B L/c K E", r"different head width dims: q 'D', k/v 'E'"),
        ("B L/c H/d D, B L/c K D", r"splits the heads of q and k/v over different mesh axes"),
        ("B L H D, B L K D", r"must split the sequence dim over exactly argument `axis` 'c'"),
        ("B L/c H D/d, B L/c K D/d", r"must not split the head width dim 'D/d'"),
        ("B L/c H, B L/c K", r"must give q four dims"),
    ],
)
def test_specs_that_disagree(spec, match):
    with pytest.raises(SpecError, match=match):
        _call(DC, "ring", spec, QKV)


def test_blocks_that_do_not_match_the_spec():
    loose = ((4,), ("c",), "B L/c H D", "B L/c K E")  # the body's annotations let D differ
    with pytest.raises(TypeCheckError, match=r"(?s)ring: argument `k` .*expected size 8.*got 4"):
        _call(loose, "ring", "B L/c H D, B L/c K D", [QKV[0], (2, 32, 2, 4), (2, 32, 2, 4)])
    mesh = make_mesh((4,), ("c",))

    @typed_shard_map
    def f(q: f32[Array, b"B L/c H D"], k: f32[Array, b"B L/c K D"]) -> f32[Array, b"B L/c H D"]:
        return attention.ring("B L/c H D, B L/c K D", q, k, k.astype(jnp.bfloat16))

    q, k = np.zeros(QKV[0], np.float32), np.zeros(QKV[1], np.float32)
    dtypes = r"must have one dtype, got float32, float32 and bfloat16"
    with pytest.raises(ValueError, match=dtypes), jax.set_mesh(mesh):
        f(place(q, mesh, "B L/c H D"), place(k, mesh, "B L/c K D"))


def test_axis_not_manual():
    with pytest.raises(ValueError, match=r"which the mesh does not have \(mesh axes: c=4\)"):
        _call(C4, "ring", "B L/x H D, B L/x K D", QKV, axis="x")
    q = jnp.zeros((2, 8, 4, 8))
    with pytest.raises(ValueError, match=r"no mesh axis is manual here: call ring inside a"):
        attention.ring("B L/c H D", q, q, q)
    # A plain jax.shard_map manual over c only: d is in the mesh, not manual.
    mesh = make_mesh((2, 4), ("d", "c"))
    spec = jax.sharding.PartitionSpec(None, "c")

    def body(q):
        return attention.ring("B L/d H D", q, q, q, "d")

    f = jax.shard_map(body, in_specs=spec, out_specs=spec, axis_names={"c"})
    not_manual = r"got 'd', a mesh axis that this body is not manual"
    # The input already in the in_specs layout (JAX 0.12 refuses any other on Explicit axes).
    q = jax.device_put(jnp.zeros((2, 32, 4, 8)), jax.sharding.NamedSharding(mesh, spec))
    with pytest.raises(ValueError, match=not_manual), jax.set_mesh(mesh):
        f(q)


def test_unknown_layout():
    with pytest.raises(ValueError, match=r"`layout` must be one of .*did you mean 'balanced'"):
        _call(C4, "ring", "B L/c H D, B L/c K D", QKV, layout="balance")


# -- what the backward pass keeps ---------------------------------------------------------------


@pytest.mark.parametrize("fn", ["ring", "gathered"])
def test_ring_keeps_only_q_k_v_out_and_logsumexp(fn, capsys):
    """The ring's backward pass keeps O(L/c) per device: q, k, v, the output and the
    log-sum-exp, nothing of size L x L (the all-gather variant keeps its score blocks)."""
    from jax.ad_checkpoint import print_saved_residuals

    mesh = make_mesh((4,), ("c",))
    op = getattr(attention, fn)

    @typed_shard_map
    def f(
        q: f32[Array, b"B L/c H D"], k: f32[Array, b"B L/c K D"], v: f32[Array, b"B L/c K D"]
    ) -> f32[Array, b"B L/c H D"]:
        return op("B L/c H D, B L/c K D", q, k, v, layout="balanced")

    q, k = np.ones((2, 64, 4, 8), np.float32), np.ones((2, 64, 2, 8), np.float32)
    with jax.set_mesh(mesh):
        args = (place(q, mesh, "B L/c H D"), place(k, mesh, "B L/c K D"))
        print_saved_residuals(lambda q, k, v: f(q, k, v).sum(), args[0], args[1], args[1])
    shapes = re.findall(r"^\w+\[([^\]]*)\]", capsys.readouterr().out, flags=re.M)
    sizes = sorted(int(np.prod([int(n.split("@")[0]) for n in s.split(",")])) for s in shapes)
    if fn == "ring":
        # q, k, v, out (q's size) and the log-sum-exp (one per query row and head)
        assert sizes == sorted([q.size, k.size, k.size, q.size, q.size // 8])
    else:
        # a chunk's (L/2c) x L scores per device and head (B=2, H=4, L=64, 2c=8): 4x q's size
        assert max(sizes) == 2 * 4 * (64 // 2) * 64 == 4 * q.size


def _temp_bytes(fn, c, length, b=1, h=4, kh=2, d=16):
    """XLA's temp memory per device (compiled ``memory_analysis``) of the forward and
    backward pass, balanced layout."""
    mesh = make_mesh((c,), ("c",))
    op = getattr(attention, fn)

    @typed_shard_map
    def f(
        q: f32[Array, b"B L/c H D"], k: f32[Array, b"B L/c K D"], v: f32[Array, b"B L/c K D"]
    ) -> f32[Array, b"B L/c H D"]:
        return op("B L/c H D, B L/c K D", q, k, v, "c", layout="balanced")

    with jax.set_mesh(mesh):
        q = place(np.ones((b, length, h, d), np.float32), mesh, "B L/c H D")
        k = place(np.ones((b, length, kh, d), np.float32), mesh, "B L/c K D")
        grad = jax.jit(jax.grad(lambda q, k, v: f(q, k, v).sum(), argnums=(0, 1, 2)))
        return grad.lower(q, k, k).compile().memory_analysis().temp_size_in_bytes


@pytest.mark.slow
def test_ring_temp_memory_is_flat_in_c_and_a_fraction_of_gathered():
    """Issue 25's numbers: at c = 8 the ring needs at most 1/4 of the all-gather variant's
    temp memory at the same length, and the same at fixed L/c for any c."""
    ring8, gathered8 = _temp_bytes("ring", 8, 2048), _temp_bytes("gathered", 8, 2048)
    assert ring8 * 4 <= gathered8, (ring8, gathered8)
    ring4 = _temp_bytes("ring", 4, 1024)  # L/c = 256 both
    assert abs(ring4 - ring8) <= 0.1 * ring8, (ring4, ring8)


@pytest.mark.slow
@pytest.mark.parametrize("c", [2, 4, 8])
def test_ring_bytes_equal_the_formula_and_the_compiled_hlo(c):
    """Per device: c - 1 K/V blocks forward; c - 1 K/V and c - 1 dK/dV blocks backward; only
    collective-permutes, counted in the compiled program (loop trip counts multiplied in)."""
    from shardlib._explain import hlo

    mesh = make_mesh((c,), ("c",))

    @typed_shard_map
    def f(
        q: f32[Array, b"B L/c H D"], k: f32[Array, b"B L/c K D"], v: f32[Array, b"B L/c K D"]
    ) -> f32[Array, b"B L/c H D"]:
        return attention.ring("B L/c H D, B L/c K D", q, k, v, "c", layout="balanced")

    b, length, h, kh, d = 2, 64, 4, 2, 8
    with jax.set_mesh(mesh):
        q = place(np.ones((b, length, h, d), np.float32), mesh, "B L/c H D")
        k = place(np.ones((b, length, kh, d), np.float32), mesh, "B L/c K D")
        fwd = jax.jit(f).lower(q, k, k).compile().as_text()
        grad = jax.grad(lambda q, k, v: f(q, k, v).sum(), argnums=(0, 1, 2))
        both = jax.jit(grad).lower(q, k, k).compile().as_text()
    block = 2 * b * (length // c) * kh * d * 4  # one K and one V block per device, f32
    forward, backward = attention.ring_bytes(block, block, c)

    def sent(text):
        found, unknown = hlo.collectives(text)
        assert unknown == 0 and {x.kind for x in found} <= {"collective-permute"}
        return sum(x.in_bytes * x.runs for x in found)

    assert sent(fwd) == forward == (c - 1) * block
    # the gradient program runs the forward ring (for the residuals) and the backward ring;
    # at c = 2 each sends K/V once, the same transfer, and XLA computes it once
    assert sent(both) == forward + backward - (block if c == 2 else 0)


@pytest.mark.parametrize("fn", ["ring", "gathered"])
def test_segment_ids_made_in_the_body_and_replicated_kv(fn):
    """Segment ids built inside the body (jnp.zeros: not varying over 'c') and K/V replicated
    over 'c' (the whole sequence on every device, sliced to this device's block) still make a
    ring whose loop carry JAX accepts; all zeros is one segment: the causal reference."""
    case = C4
    shape, names, qs, kvs = case
    mesh = make_mesh(shape, names)
    q, k, v, _, _ = _inputs(4, 2, seed=5)
    spec = f"{qs}, {kvs}"

    @typed_shard_map
    def f(
        q: f32[Array, b"B L/c H D"], k: f32[Array, b"B L K D"], v: f32[Array, b"B L K D"]
    ) -> f32[Array, b"B L/c H D"]:
        c = jax.lax.axis_size("c")
        i = jax.lax.axis_index("c")
        n = k.shape[1] // c
        kb = jax.lax.dynamic_slice_in_dim(k, i * n, n, axis=1)
        vb = jax.lax.dynamic_slice_in_dim(v, i * n, n, axis=1)
        ids = jnp.zeros(q.shape[:2], jnp.int32)
        return getattr(attention, fn)(spec, q, kb, vb, "c", causal=True, segment_ids=ids)

    with jax.set_mesh(mesh):
        out = jax.jit(f)(place(q, mesh, qs), place(k, mesh, "B L K D"), place(v, mesh, "B L K D"))
    want = reference(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), True)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=RTOL, atol=1e-5)
