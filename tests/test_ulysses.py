"""``attention.ulysses``: values and gradients against the unsharded oracle, its refusals, its
all-to-alls (explain = formula = compiled HLO) and what its backward pass keeps.

The parity cases reuse ``tests/test_attention.py``'s harness (global f32 q, k, v and segment
ids in the original order, put into the layout, placed on the mesh, attended inside
``typed_shard_map``, compared with plain softmax attention, output and the gradients of q, k
and v) and ``tests/test_attention_edges.py``'s for a traced scale. Ulysses needs the query
heads per device divisible by ``c``, so the cases choose ``H`` and ``K`` per mesh; a ``K``
that ``c`` does not divide is repeated (``K=2`` on ``c=4`` and ``c=8`` here).
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import shardlib
from shardlib import attention
from shardlib._attention import chunks as P
from shardlib._explain import hlo
from shardlib.shardtypes import Array, f32, i32, typed_shard_map
from tests import test_attention_edges as E
from tests._mesh_util import make_mesh, place
from tests.test_attention import C2, C4, C8, DC, DCT, NAMES, _assert_close, _run

CT = ((2, 2), ("c", "t"), "B L/c H/t D", "B L/c K/t D")
NAMES = {**NAMES, CT: "cxt"}

# (mesh, layout, causal, segment ids, H, K)
FAST = [
    (C4, "balanced", True, False, 8, 4),
    (C8, "balanced", True, True, 8, 2),  # K=2 on c=8: each kv head repeated 4 times
    (DCT, "contiguous", True, True, 8, 4),  # batch over d, heads over t
    (C2, "contiguous", False, False, 4, 2),
]
SLOW = [
    (C2, "balanced", True, True, 4, 2),
    (C4, "contiguous", False, True, 4, 4),
    (C4, "balanced", True, True, 4, 1),  # MQA
    (C8, "contiguous", False, False, 8, 8),
    (DC, "balanced", False, False, 8, 2),
    (DC, "contiguous", True, True, 4, 2),
    (DCT, "balanced", False, True, 4, 2),
    (CT, "balanced", True, True, 8, 4),
    (CT, "contiguous", False, False, 8, 2),
]


def _id(case, layout, causal, ids, h, kh):
    mask = "causal" if causal else "full"
    return f"{NAMES[case]}-{layout}-{mask}{'-segments' if ids else ''}-H{h}K{kh}"


@pytest.mark.slow
@pytest.mark.parametrize("case, layout, causal, ids, h, kh", FAST, ids=[_id(*p) for p in FAST])
def test_matches_reference(case, layout, causal, ids, h, kh):
    _assert_close(*_run(case, "ulysses", layout, causal, ids, h=h, kh=kh))


@pytest.mark.slow
@pytest.mark.parametrize("case, layout, causal, ids, h, kh", SLOW, ids=[_id(*p) for p in SLOW])
def test_matches_reference_grid(case, layout, causal, ids, h, kh):
    seed = SLOW.index((case, layout, causal, ids, h, kh)) + 1
    _assert_close(*_run(case, "ulysses", layout, causal, ids, h=h, kh=kh, seed=seed))


@pytest.mark.slow
def test_without_check_vma():
    _assert_close(*_run(DCT, "ulysses", "balanced", True, True, h=8, kh=4, vma=False))


def _traced_scale(case, vma):
    """Values and gradients (q, k, v and the scale) against the oracle: edges' harness."""
    E.test_traced_scale_matches_reference_with_its_gradient("ulysses", case, vma)


@pytest.mark.slow
def test_traced_scale_matches_reference_with_its_gradient():
    _traced_scale(E.C4, True)  # H=4, K=2 on c=4: one query head per device


@pytest.mark.slow
@pytest.mark.parametrize("vma", [True, False], ids=["vma", "no-vma"])
def test_traced_scale_on_three_axes(vma):
    _traced_scale(E.DCT, vma)


# -- refusals ---------------------------------------------------------------------------------


def _call(case, shapes, spec=None, **kw):
    mesh_shape, names, qs, kvs = case
    mesh = make_mesh(mesh_shape, names)
    q, k, v = (np.zeros(s, np.float32) for s in shapes)

    @typed_shard_map(check_vma=False)
    def f(
        q: f32[Array, qs.encode()], k: f32[Array, kvs.encode()], v: f32[Array, kvs.encode()]
    ) -> f32[Array, qs.encode()]:
        return attention.ulysses(spec or f"{qs}, {kvs}", q, k, v, "c", **kw)

    with jax.set_mesh(mesh):
        return f(place(q, mesh, qs), place(k, mesh, kvs), place(v, mesh, kvs))


def test_heads_not_divisible_by_c_name_ring():
    with pytest.raises(ValueError) as e:
        _call(C4, [(2, 16, 6, 8), (2, 16, 2, 8), (2, 16, 2, 8)])
    assert str(e.value) == (
        "ulysses: argument `q` dim 'H' (query heads) must be divisible by the 4 devices of axis "
        "'c' (each device attends with H/c of the heads over the whole sequence); expected a "
        "multiple of c=4 heads per device, got 6; use attention.ring, which has no head "
        "constraint"
    )


def test_heads_per_device_are_what_must_divide():
    """Heads over t: 6 query heads are 3 per device, not divisible by c=2."""
    with pytest.raises(ValueError, match=r"dim 'H/t' .* multiple of c=2 heads per device, got 3"):
        _call(DCT, [(2, 16, 6, 8), (2, 16, 2, 8), (2, 16, 2, 8)])


def test_the_rules_of_ring_name_ulysses():
    with pytest.raises(ValueError, match=r"^ulysses: argument `q` dim 'L/c' \(sequence\) must be"):
        _call(C4, [(2, 12, 4, 8), (2, 12, 2, 8), (2, 12, 2, 8)], layout="balanced")
    with pytest.raises(ValueError, match=r"^ulysses: argument `scale` must be None"):
        _call(C4, [(2, 16, 4, 8), (2, 16, 2, 8), (2, 16, 2, 8)], scale="0.5")


def test_forward_mode_is_refused_with_what_to_use():
    shape, names, qs, kvs = C4
    mesh = make_mesh(shape, names)

    @typed_shard_map
    def f(
        q: f32[Array, qs.encode()], k: f32[Array, kvs.encode()], v: f32[Array, kvs.encode()]
    ) -> f32[Array, qs.encode()]:
        return attention.ulysses(f"{qs}, {kvs}", q, k, v, "c")

    q, k = jnp.ones((2, 16, 4, 8)), jnp.ones((2, 16, 4, 8))
    refused = r"ulysses: forward-mode .* attention\.gathered"
    with pytest.raises(TypeError, match=refused), jax.set_mesh(mesh):
        jax.jvp(lambda q: f(q, k, k), (q,), (q,))


# -- the plan ---------------------------------------------------------------------------------


@pytest.mark.parametrize("c", [2, 4, 8])
def test_local_pairs_are_the_blocks_with_something_unmasked(c):
    """The local loop computes exactly the (query chunk, key chunk) blocks of the stored
    sequence with a key at or before a query: (n + 1) n / 2 of n chunks, causal."""
    for layout in ("contiguous", "balanced"):
        n = P.chunk_count(c, layout)
        order = P.stored_positions(n, c, layout)  # one position per chunk: the chunk id
        pairs = P.local_pairs(c, layout, True)
        assert pairs == [(a, b) for a in range(n) for b in range(n) if order[a] >= order[b]]
        assert len(pairs) == n * (n + 1) // 2
        assert len(P.local_pairs(c, layout, False)) == n * n


def test_kv_repeat():
    assert [P.kv_repeat(k, 4) for k in (1, 2, 3, 4, 6, 8)] == [4, 2, 4, 1, 2, 1]


# -- the all-to-alls: explain, the formula and the compiled program ----------------------------


def _program(c, with_ids=False, h=8, kh=4, b=2, length=32, d=8):
    mesh = make_mesh((c,), ("c",))

    @typed_shard_map
    def f(
        q: f32[Array, b"B L/c H D"],
        k: f32[Array, b"B L/c K D"],
        v: f32[Array, b"B L/c K D"],
        ids: i32[Array, b"B L/c"],
    ) -> f32[Array, b"B L/c H D"]:
        seg = ids if with_ids else None
        spec = "B L/c H D, B L/c K D"
        return attention.ulysses(spec, q, k, v, "c", layout="balanced", segment_ids=seg)

    def vjp(q, k, v, ids):
        out, pull = jax.vjp(lambda q, k, v: f(q, k, v, ids), q, k, v)
        return out, pull(out)

    with jax.set_mesh(mesh):
        args = (
            place(np.ones((b, length, h, d), np.float32), mesh, "B L/c H D"),
            place(np.ones((b, length, kh, d), np.float32), mesh, "B L/c K D"),
            place(np.ones((b, length, kh, d), np.float32), mesh, "B L/c K D"),
            place(np.zeros((b, length), np.int32), mesh, "B L/c"),
        )
        out = []
        for fn in (f, vjp):
            report = shardlib.explain(fn, *args)
            out.append((report, jax.jit(fn).lower(*args).compile().as_text()))
    q_block = b * (length // c) * h * d * 4
    kv_block = 2 * b * (length // c) * kh * d * 4
    return out, attention.ulysses_bytes(q_block, kv_block, c, P.kv_repeat(kh, c))


@pytest.mark.parametrize("c", [4, pytest.param(8, marks=pytest.mark.slow)])
def test_all_to_alls_explain_equal_the_formula_and_the_hlo(c):
    """Forward: one all-to-all of q, K and V, one of the output; the vjp adds their two
    transposes. No other collective (no all-gather of K/V); explain's rows, the formula and
    the compiled program agree on the bytes."""
    programs, (forward, backward) = _program(c)
    for (report, text), n, want in (
        (programs[0], 2, forward),
        (programs[1], 4, forward + backward),
    ):
        found, unknown = hlo.collectives(text)
        assert unknown == 0 and [x.kind for x in found] == ["all-to-all"] * n
        rows = report.collectives
        assert [r.kind for r in rows] == ["all-to-all"] * n
        assert sum(r.total_sent for r in rows) == want
        cmp = report.compare_hlo(text)
        assert cmp.identical and cmp.n_hlo == cmp.n_report == n, str(cmp)
        (call,) = report.rings
        assert (call.fn, call.c, call.layout) == ("ulysses", c, "balanced")
        assert call.forward_bytes == forward
        assert call.backward_bytes == (backward if n == 4 else 0)


@pytest.mark.slow
def test_segment_ids_are_all_gathered_once_and_not_sent_back():
    """With segment ids: one all-gather of the int32 ids (B x L/c per device), forward only."""
    programs, _ = _program(4, with_ids=True)
    for report, text in programs:
        found, _ = hlo.collectives(text)
        gathers = [x for x in found if x.kind == "all-gather"]
        assert len(gathers) == 1 and gathers[0].in_bytes == 2 * 8 * 4, gathers
        assert [r.kind for r in report.collectives].count("all-gather") == 1


@pytest.mark.slow
def test_grad_alone_needs_three_all_to_alls():
    """``jax.grad`` of a sum does not use the output: XLA drops the forward all-to-all of the
    output (the local attention's output is a residual before it), leaving three."""
    mesh = make_mesh((4,), ("c",))

    @typed_shard_map
    def f(
        q: f32[Array, b"B L/c H D"], k: f32[Array, b"B L/c K D"], v: f32[Array, b"B L/c K D"]
    ) -> f32[Array, b"B L/c H D"]:
        return attention.ulysses("B L/c H D, B L/c K D", q, k, v, "c")

    grad = jax.grad(lambda q, k, v: f(q, k, v).sum(), argnums=(0, 1, 2))
    with jax.set_mesh(mesh):
        q = place(np.ones((2, 16, 4, 8), np.float32), mesh, "B L/c H D")
        text = jax.jit(grad).lower(q, q, q).compile().as_text() or ""
    found, _ = hlo.collectives(text)
    assert [x.kind for x in found] == ["all-to-all"] * 3


# -- what the backward pass keeps ---------------------------------------------------------------


def test_backward_keeps_q_k_v_out_and_logsumexp(capsys):
    """Per device: q, k, v and the output of its H/c heads over the whole sequence (the size
    of its sequence blocks) and the log-sum-exp; nothing of size L x L."""
    from jax.ad_checkpoint import print_saved_residuals

    mesh = make_mesh((4,), ("c",))

    @typed_shard_map
    def f(
        q: f32[Array, b"B L/c H D"], k: f32[Array, b"B L/c K D"], v: f32[Array, b"B L/c K D"]
    ) -> f32[Array, b"B L/c H D"]:
        return attention.ulysses("B L/c H D, B L/c K D", q, k, v, layout="balanced")

    q, k = np.ones((2, 64, 8, 8), np.float32), np.ones((2, 64, 4, 8), np.float32)
    with jax.set_mesh(mesh):
        args = (place(q, mesh, "B L/c H D"), place(k, mesh, "B L/c K D"))
        print_saved_residuals(lambda q, k, v: f(q, k, v).sum(), args[0], args[1], args[1])
    shapes = re.findall(r"^\w+\[([^\]]*)\]", capsys.readouterr().out, flags=re.M)
    sizes = sorted(int(np.prod([int(n.split("@")[0]) for n in s.split(",")])) for s in shapes)
    assert sizes == sorted([q.size, k.size, k.size, q.size, q.size // 8])


# -- ring x Ulysses: the sequence over two axes -------------------------------------------------

# The ring axis is named c, so that the harness puts the sequence into the layout for c = |c|
# (the ring's size) and calls ring_ulysses(spec, q, k, v, "c"): Ulysses over u (the default).
CU22 = ((2, 2), ("c", "u"), "B L/c/u H D", "B L/c/u K D")
CU24 = ((2, 4), ("c", "u"), "B L/c/u H D", "B L/c/u K D")
DCU = ((2, 2, 2), ("d", "c", "u"), "B/d L/c/u H D", "B/d L/c/u K D")
NAMES.update({CU22: "cxu", CU24: "cxu4", DCU: "dxcxu"})
HYBRID_FAST = [(CU22, "balanced", True, True, 4, 2)]
HYBRID_SLOW = [
    (CU24, "balanced", True, True, 8, 4),
    (CU24, "contiguous", False, False, 8, 4),
    (DCU, "balanced", True, False, 4, 2),
]


@pytest.mark.slow
@pytest.mark.parametrize(
    "case, layout, causal, ids, h, kh", HYBRID_FAST, ids=[_id(*p) for p in HYBRID_FAST]
)
def test_ring_ulysses_matches_reference(case, layout, causal, ids, h, kh):
    _assert_close(*_run(case, "ring_ulysses", layout, causal, ids, h=h, kh=kh))


@pytest.mark.slow
@pytest.mark.parametrize(
    "case, layout, causal, ids, h, kh", HYBRID_SLOW, ids=[_id(*p) for p in HYBRID_SLOW]
)
def test_ring_ulysses_matches_reference_grid(case, layout, causal, ids, h, kh):
    _assert_close(*_run(case, "ring_ulysses", layout, causal, ids, h=h, kh=kh, seed=7))


def _hybrid_call(case, shapes, spec=None, **kw):
    mesh_shape, names, qs, kvs = case
    mesh = make_mesh(mesh_shape, names)
    q, k, v = (np.zeros(s, np.float32) for s in shapes)

    @typed_shard_map(check_vma=False)
    def f(
        q: f32[Array, qs.encode()], k: f32[Array, kvs.encode()], v: f32[Array, kvs.encode()]
    ) -> f32[Array, qs.encode()]:
        axes = {"ring_axis": "c", "ulysses_axis": "u", **kw}
        return attention.ring_ulysses(spec or f"{qs}, {kvs}", q, k, v, **axes)

    with jax.set_mesh(mesh):
        return f(place(q, mesh, qs), place(k, mesh, kvs), place(v, mesh, kvs))


def test_ring_ulysses_refusals():
    shapes = [(2, 16, 4, 8), (2, 16, 2, 8), (2, 16, 2, 8)]
    with pytest.raises(shardlib.SpecError, match=r"^ring_ulysses: argument `spec` must give q"):
        _hybrid_call(CU22, shapes, spec="B L/u/c H D, B L/u/c K D")
    with pytest.raises(ValueError, match=r"^ring_ulysses: argument `k` dim 'K' \(heads\) must "):
        _hybrid_call(CU24, [(2, 16, 4, 8), (2, 16, 2, 8), (2, 16, 2, 8)])
    with pytest.raises(ValueError, match=r"^ring_ulysses: arguments `ring_axis` and `ulysses_"):
        _hybrid_call(CU22, shapes, spec="B L/c/u H D, B L/c/u K D", ulysses_axis="c")


# -- packed sequences: the blocks whose segments cannot meet are not computed -------------------


@pytest.mark.slow
def test_packed_blocks_are_skipped(monkeypatch):
    """Segment ids sorted along the sequence (8 documents per row): each device computes, forward
    and backward, exactly the causal blocks (of the 2c chunks) holding a visible score, counted
    at run time (the block math wrapped with a ``jax.debug.callback``) and by brute force."""
    from shardlib._attention import blocks

    c, length, docs = 4, 64, 8
    calls = []

    def wrap(kind, original):
        def wrapped(*args, **kwargs):
            record = lambda i: calls.append((kind, int(i)))  # noqa: E731
            jax.debug.callback(record, jax.lax.axis_index("c"))
            return original(*args, **kwargs)

        return wrapped

    jax.clear_caches()
    for kind in ("forward", "backward"):
        monkeypatch.setattr(blocks, f"{kind}_block", wrap(kind, getattr(blocks, f"{kind}_block")))
    rng = np.random.default_rng(3)
    cuts = np.stack(
        [np.sort(rng.choice(np.arange(1, length), docs - 1, replace=False)) for _ in "ab"]
    )
    ids = np.zeros((2, length), np.int32)
    np.put_along_axis(ids, cuts, 1, axis=1)
    ids = np.cumsum(ids, axis=1).astype(np.int32)
    size = length // (2 * c)
    pos = np.arange(length)
    want = 0
    for qc in range(2 * c):
        for kc in range(qc + 1):
            qs, ks = slice(qc * size, (qc + 1) * size), slice(kc * size, (kc + 1) * size)
            keep = (ids[:, qs, None] == ids[:, None, ks]) & (pos[qs, None] >= pos[None, ks])
            want += bool(keep.any())
    assert want < 2 * c * (2 * c + 1) // 2  # something is skipped
    shape, names, qs_, kvs = C4
    mesh = make_mesh(shape, names)

    @typed_shard_map
    def f(
        q: f32[Array, b"B L/c H D"],
        k: f32[Array, b"B L/c K D"],
        v: f32[Array, b"B L/c K D"],
        seg: i32[Array, b"B L/c"],
    ) -> f32[Array, b"B L/c H D"]:
        spec = "B L/c H D, B L/c K D"
        return attention.ulysses(spec, q, k, v, "c", layout="balanced", segment_ids=seg)

    order = attention.positions(length, c)
    x = np.ones((2, length, 4, 4), np.float32)
    with jax.set_mesh(mesh):
        q = place(x, mesh, "B L/c H D")
        s = place(ids[:, order], mesh, "B L/c")
        out, pull = jax.vjp(lambda q: f(q, q, q, s), q)
        jax.block_until_ready(pull(out))
    for kind in ("forward", "backward"):
        assert [sum(1 for k, d in calls if k == kind and d == i) for i in range(c)] == [want] * c
