"""Packed sequences in ring attention: the blocks whose segments cannot meet are not computed.

Each case packs 8 documents into every row of a batch (segment ids, global, in the original
order), puts q, k, v and the ids into the layout on a 1-D mesh ``('c',)`` and runs
``attention.ring`` forward and backward under ``jax.vjp``. The block math is wrapped, for the
test only, by a ``jax.debug.callback`` that records the device each time a (query chunk, key
chunk) block is really computed (inside the ring's ``lax.cond``), so the counts are of the
program that ran, not of a Python rule. They are compared with the blocks whose segments can
meet, counted here from the global ids by brute force (some batch row with a query and a key
of one segment, and the key not after the query under a causal mask): equal for packed
(sorted) ids, between it and the causal-only count for ids in any order. The output and the
gradients of q, k and v equal plain attention on the global arrays with the segment mask.
"""

from __future__ import annotations

import functools
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from shardlib import attention
from shardlib._attention import blocks
from shardlib._attention import ring as ring_module
from shardlib.shardtypes import Array, f32, i32, typed_shard_map
from tests._mesh_util import make_mesh, place
from tests.test_attention import _assert_close, reference

B_, L_, H_, K_, D_ = 2, 64, 4, 2, 4  # GQA: two query heads per key/value head
DOCS = 8


def packed_ids(rng, batch, length, docs=DOCS, order="sorted"):
    """``docs`` documents per row at random cut points: ids ``0 .. docs-1`` non-decreasing
    (``'sorted'``), the same runs with their labels shuffled (``'shuffled'``: contiguous
    documents, ids in no order), or ids drawn at random per position (``'random'``)."""
    if order == "random":
        return rng.integers(0, docs, size=(batch, length)).astype(np.int32)
    rows = []
    for _ in range(batch):
        cuts = np.sort(rng.choice(np.arange(1, length), size=docs - 1, replace=False))
        ids = np.zeros(length, np.int32)
        ids[cuts] = 1
        ids = np.cumsum(ids).astype(np.int32)
        if order == "shuffled":
            ids = rng.permutation(docs).astype(np.int32)[ids]
        rows.append(ids)
    return np.stack(rows)


def chunks_of(device, c, layout):
    """The chunks of the original sequence that ``device`` holds (written out, not plan's)."""
    return [device, 2 * c - 1 - device] if layout == "balanced" else [device]


def blocks_that_meet(ids, c, layout, causal):
    """Per device, the (query chunk, key chunk) blocks with some visible score, by brute force
    over the global ids: the blocks a skip of everything masked would leave."""
    n = 2 * c if layout == "balanced" else c
    size = ids.shape[1] // n
    pos = np.arange(ids.shape[1])
    out = []
    for me in range(c):
        count = 0
        for src in range(c):
            for qc in chunks_of(me, c, layout):
                for kc in chunks_of(src, c, layout):
                    qs, ks = slice(qc * size, (qc + 1) * size), slice(kc * size, (kc + 1) * size)
                    keep = ids[:, qs, None] == ids[:, None, ks]
                    if causal:
                        keep &= (pos[qs, None] >= pos[None, ks])[None]
                    count += bool(keep.any())
        out.append(count)
    return out


class Counted:
    """`blocks.forward_block` and `blocks.backward_block` wrapped (monkeypatched) so that
    every block the ring really computes records ``(kind, device)`` at run time."""

    def __init__(self, monkeypatch, axis="c"):
        jax.clear_caches()  # no trace of the ring made before the wrapping is reused
        self.calls: list[tuple[str, int]] = []
        self._lock = threading.Lock()
        for kind, name in (("forward", "forward_block"), ("backward", "backward_block")):
            original = getattr(blocks, name)
            monkeypatch.setattr(blocks, name, self._wrap(kind, original, axis))

    def _record(self, kind, device):
        with self._lock:
            self.calls.append((kind, int(device)))

    def _wrap(self, kind, original, axis):
        def wrapped(*args, **kwargs):
            jax.debug.callback(functools.partial(self._record, kind), jax.lax.axis_index(axis))
            return original(*args, **kwargs)

        return wrapped

    def per_device(self, kind, c):
        return [sum(1 for k, d in self.calls if k == kind and d == i) for i in range(c)]


def _run(c, layout, causal, order, seed=0, segment_skip=True):
    """Output and q/k/v gradients of the ring (original order) and of the reference."""
    mesh = make_mesh((c,), ("c",))
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B_, L_, H_, D_)).astype(np.float32)
    k = rng.standard_normal((B_, L_, K_, D_)).astype(np.float32)
    v = rng.standard_normal((B_, L_, K_, D_)).astype(np.float32)
    ct = rng.standard_normal((B_, L_, H_, D_)).astype(np.float32)
    ids = packed_ids(rng, B_, L_, order=order)
    qs, kvs = "B L/c H D", "B L/c K D"

    @typed_shard_map
    def f(
        q: f32[Array, b"B L/c H D"],
        k: f32[Array, b"B L/c K D"],
        v: f32[Array, b"B L/c K D"],
        ids: i32[Array, b"B L/c"],
    ) -> f32[Array, b"B L/c H D"]:
        return ring_module.ring_attention(
            f"{qs}, {kvs}",
            q,
            k,
            v,
            "c",
            causal=causal,
            layout=layout,
            segment_ids=ids,
            segment_skip=segment_skip,
        )

    def run(q, k, v, ids, ct):
        out, pull = jax.vjp(lambda q, k, v: f(q, k, v, ids), q, k, v)
        return out, pull(ct)

    order_ = attention.positions(L_, c, layout)
    back = np.argsort(order_)
    with jax.set_mesh(mesh):
        args = (
            place(q[:, order_], mesh, qs),
            place(k[:, order_], mesh, kvs),
            place(v[:, order_], mesh, kvs),
            place(ids[:, order_], mesh, "B L/c"),
            place(ct[:, order_], mesh, qs),
        )
        out, grads = jax.block_until_ready(jax.jit(run)(*args))
    jax.effects_barrier()
    got = [np.asarray(x)[:, back] for x in (out, *grads)]
    ref_out, pull = jax.vjp(
        lambda q, k, v: reference(q, k, v, causal, jnp.asarray(ids)),
        *(jnp.asarray(x) for x in (q, k, v)),
    )
    want = [np.asarray(x) for x in (ref_out, *pull(jnp.asarray(ct)))]
    return got, want, ids


CASES = [
    (4, "contiguous", True, "sorted"),
    (8, "balanced", True, "sorted"),
    (4, "balanced", False, "sorted"),
    (8, "contiguous", False, "shuffled"),
    (4, "balanced", True, "random"),
]
# The fast tier runs the first case; the others, and ids in no order, `pytest --runslow`.
FAST = CASES[0]


def _case_id(c, layout, causal, order):
    return f"c{c}-{layout}-{'causal' if causal else 'full'}-{order}"


@pytest.mark.parametrize(
    "c, layout, causal, order",
    [
        pytest.param(*x, id=_case_id(*x), marks=[] if x == FAST else [pytest.mark.slow])
        for x in CASES
    ],
)
def test_ring_computes_only_the_blocks_whose_segments_meet(monkeypatch, c, layout, causal, order):
    counted = Counted(monkeypatch)
    got, want, ids = _run(c, layout, causal, order, seed=CASES.index((c, layout, causal, order)))
    _assert_close(got, want)
    meet = blocks_that_meet(ids, c, layout, causal)
    causal_only = attention.score_blocks(c, layout, causal)
    helper = attention.score_blocks(c, layout, causal, segment_ids=ids)
    for kind in ("forward", "backward"):
        ran = counted.per_device(kind, c)
        assert ran == helper, (kind, ran, helper)
        if order == "sorted":
            assert ran == meet, (kind, ran, meet)
        else:  # the rule is conservative for ids in no order: never skips a needed block
            assert all(m <= r <= n for m, r, n in zip(meet, ran, causal_only, strict=True))
    if order == "sorted":
        # 8 documents in a row: blocks are skipped
        assert sum(meet) < sum(causal_only), (meet, causal_only)


@pytest.mark.slow
def test_without_the_segment_rule_every_causal_block_is_computed(monkeypatch):
    """The internal switch (for the benchmark): the same values, the causal rule's count."""
    counted = Counted(monkeypatch)
    got, want, ids = _run(4, "balanced", True, "sorted", segment_skip=False)
    _assert_close(got, want)
    for kind in ("forward", "backward"):
        assert counted.per_device(kind, 4) == attention.score_blocks(4, "balanced") == [9] * 4
    assert sum(attention.score_blocks(4, "balanced", segment_ids=ids)) < 36


def test_score_blocks_with_segment_ids():
    one = np.zeros((2, 64), np.int32)  # one segment: the causal count
    assert attention.score_blocks(4, "balanced", segment_ids=one) == [9] * 4
    assert attention.score_blocks(4, "contiguous", False, segment_ids=one) == [4] * 4
    docs = np.repeat(np.arange(4), 16)  # one document per contiguous chunk: the diagonal
    assert attention.score_blocks(4, "contiguous", segment_ids=docs) == [1] * 4
    assert attention.score_blocks(4, "contiguous", False, segment_ids=docs) == [1] * 4
    # balanced: chunks i and 7 - i of 8 (two per document): own chunks, and chunk 2j+1 sees 2j
    assert attention.score_blocks(4, "balanced", segment_ids=docs) == [3, 3, 3, 3]
    # the batch rows together: a block is computed when any row needs it
    two = np.stack([docs, np.zeros(64, np.int32)])
    assert attention.score_blocks(4, "contiguous", segment_ids=two) == [1, 2, 3, 4]
    rng = np.random.default_rng(0)
    for order in ("sorted", "shuffled", "random"):
        for c, layout, causal in [(4, "balanced", True), (8, "contiguous", False)]:
            ids = packed_ids(rng, 3, 64, order=order)
            got = attention.score_blocks(c, layout, causal, segment_ids=ids)
            meet = blocks_that_meet(ids, c, layout, causal)
            if order == "sorted":
                assert got == meet
            assert all(m <= g for m, g in zip(meet, got, strict=True))
    with pytest.raises(ValueError, match=r"L divisible by the 8 chunks"):
        attention.score_blocks(4, "balanced", segment_ids=np.zeros((2, 12), np.int32))


@pytest.mark.parametrize(
    "causal", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["full", "causal"]
)
def test_the_compiled_program_keeps_the_skips(causal):
    """Without the test's callbacks too, XLA keeps each block behind a conditional (a
    select would compute both sides): with no causal mask the segment rule alone adds them."""
    mesh = make_mesh((4,), ("c",))

    def conditionals(segment_skip):
        @typed_shard_map
        def f(
            q: f32[Array, b"B L/c H D"],
            k: f32[Array, b"B L/c K D"],
            ids: i32[Array, b"B L/c"],
        ) -> f32[Array, b"B L/c H D"]:
            spec = "B L/c H D, B L/c K D"
            return ring_module.ring_attention(
                spec, q, k, k, causal=causal, segment_ids=ids, segment_skip=segment_skip
            )

        q = place(np.ones((B_, L_, H_, D_), np.float32), mesh, "B L/c H D")
        k = place(np.ones((B_, L_, K_, D_), np.float32), mesh, "B L/c K D")
        ids = place(np.zeros((B_, L_), np.int32), mesh, "B L/c")
        grad = jax.grad(lambda q, k: f(q, k, ids).sum(), argnums=(0, 1))
        text = jax.jit(grad).lower(q, k).compile().as_text()
        return text.count(" conditional(")

    with jax.set_mesh(mesh):
        with_rule, without = conditionals(True), conditionals(False)
    assert with_rule > 0, with_rule
    assert without == (with_rule if causal else 0), (with_rule, without)
