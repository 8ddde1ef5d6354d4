"""``shardlib.moe``: the expert-parallel MoE layer against an unsharded jax.numpy oracle.

The oracle runs every token through its top-k experts (all experts computed densely, the
output a gate-weighted sum; dropped pairs masked out by a numpy model of the drop rule) on the
global arrays; the sharded layer runs inside ``typed_shard_map`` with the experts split over
``e`` (and their hidden dim over ``t``), the batch over ``d`` and ``e``. Values and the
gradients of every input (router included, through the auxiliary and z losses) are compared
in f32.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from shardlib import moe, shardops
from shardlib.shardtypes import Array, f32, i32, typed_shard_map
from tests._mesh_util import make_mesh, place

E8 = ((8,), ("e",))
DE = ((4, 2), ("d", "e"))
DE24 = ((2, 4), ("d", "e"))
DET = ((2, 2, 2), ("d", "e", "t"))
B_, L_, M_, E_, F_ = 16, 4, 8, 8, 16
RTOL, ATOL = 1e-5, 1e-6


def _tokens_spec(names):
    split = "/".join(a for a in names if a in ("d", "e"))
    return f"B/{split} L M"


def _inputs(seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((B_, L_, M_)).astype(np.float32)
    wr = rng.standard_normal((M_, E_)).astype(np.float32)
    wi = (rng.standard_normal((E_, M_, F_)) * 0.3).astype(np.float32)
    wo = (rng.standard_normal((E_, F_, M_)) * 0.3).astype(np.float32)
    ct = rng.standard_normal((B_, L_, M_)).astype(np.float32)
    return x, wr, wi, wo, ct


def drop_rule(experts: np.ndarray, num_experts: int, cap: int) -> np.ndarray:
    """The documented rule in plain numpy: first choices in token order, then second
    choices, ...; a pair whose expert already holds ``cap`` pairs is dropped."""
    t, k = experts.shape
    used = np.zeros(num_experts, int)
    keep = np.zeros((t, k), bool)
    for j in range(k):
        for i in range(t):
            ex = experts[i, j]
            keep[i, j] = used[ex] < cap
            used[ex] += 1
    return keep


def reference(x, wr, wi, wo, k, groups, cap=None, gate="softmax", renorm=True):
    """Dense MoE on global arrays: (output, aux loss, z loss, dropped); ``groups`` token
    blocks (one per device, in device order) each apply the drop rule at ``cap``."""
    t = x.reshape(-1, x.shape[-1])
    logits = t @ wr
    p = jax.nn.softmax(logits) if gate == "softmax" else jax.nn.sigmoid(logits)
    g, ids = jax.lax.top_k(p, k)
    g = g / g.sum(-1, keepdims=True) if renorm else g
    keep = np.ones(ids.shape, bool)
    if cap is not None:
        blocks = np.split(np.asarray(ids), groups)
        keep = np.concatenate([drop_rule(b, wr.shape[1], cap) for b in blocks])
    h = jax.nn.gelu(jnp.einsum("tm,emf->tef", t, wi))
    every = jnp.einsum("tef,efm->tem", h, wo)
    w = jnp.einsum("tk,tke->te", jnp.where(keep, g, 0.0), jax.nn.one_hot(ids, wr.shape[1]))
    out = jnp.einsum("te,tem->tm", w, every).reshape(x.shape)
    frac = jnp.mean(jax.nn.one_hot(ids, wr.shape[1]), axis=(0, 1))
    aux = wr.shape[1] * jnp.sum(frac * jnp.mean(p, axis=0))
    z = jnp.mean(jax.nn.logsumexp(logits, axis=-1) ** 2)
    return out, aux, z, int((~keep).sum())


@functools.cache
def _layer(case, k, cap, dropless, gate="softmax", renorm=True):
    shape, names = case
    xs = _tokens_spec(names)
    hid = "t" if "t" in names else None
    ws = ("E/e M F/t", "E/e F/t M") if hid else ("E/e M F", "E/e F M")
    token_axes = tuple(a for a in names if a in ("d", "e"))

    @typed_shard_map
    def f(
        x: f32[Array, xs.encode()],
        wr: f32[Array, b"M E"],
        wi: f32[Array, ws[0].encode()],
        wo: f32[Array, ws[1].encode()],
    ) -> tuple[f32[Array, xs.encode()], f32[Array, b""], f32[Array, b""], i32[Array, b""]]:
        y, s = moe.layer(
            x, wr, wi, wo, k=k, axis="e", hidden_axis=hid, capacity=cap, dropless=dropless,
            gate=gate, renormalize=renorm, stats_axes=token_axes,
        )  # fmt: skip
        return y, s.aux_loss, s.z_loss, shardops.psum("", s.dropped, token_axes)

    def run(x, wr, wi, wo, ct, a=0.3, b=0.1):
        def loss(*args):
            y, aux, z, dropped = f(*args)
            return jnp.sum(y * ct) + a * aux + b * z, (y, aux, z, dropped)

        return jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(x, wr, wi, wo)

    return jax.jit(run)


def _close(got, want, name):
    scale = float(np.max(np.abs(want))) or 1.0
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL * scale, err_msg=name)


def _check(case, k=2, cap=None, dropless=True, gate="softmax", renorm=True, seed=0):
    shape, names = case
    mesh = make_mesh(shape, names)
    x, wr, wi, wo, ct = _inputs(seed)
    hid = "/t" if "t" in names else ""
    specs = (_tokens_spec(names), "M E", f"E/e M F{hid}", f"E/e F{hid} M", _tokens_spec(names))
    with jax.set_mesh(mesh):
        args = [place(v, mesh, s) for v, s in zip((x, wr, wi, wo, ct), specs, strict=True)]
        (_, (y, aux, z, dropped)), grads = _layer(case, k, cap, dropless, gate, renorm)(*args)
    groups = int(np.prod([n for a, n in zip(names, shape, strict=True) if a in ("d", "e")]))

    def ref_loss(x, wr, wi, wo):
        out, aux, z, _ = reference(x, wr, wi, wo, k, groups, cap, gate, renorm)
        return jnp.sum(out * ct) + 0.3 * aux + 0.1 * z

    want = reference(x, wr, wi, wo, k, groups, cap, gate, renorm)
    want_grads = jax.grad(ref_loss, argnums=(0, 1, 2, 3))(x, wr, wi, wo)
    for name, g, w in zip(("y", "aux", "z"), (y, aux, z), want[:3], strict=True):
        _close(np.asarray(g), np.asarray(w), name)
    for name, g, w in zip(("dx", "dwr", "dwi", "dwo"), grads, want_grads, strict=True):
        _close(np.asarray(g), np.asarray(w), name)
    assert int(dropped) == want[3]
    return int(dropped)


@pytest.mark.slow
@pytest.mark.parametrize("case", [E8, DE, DE24, DET], ids=["e8", "dxe", "dxe24", "dxext"])
def test_dropless_equals_dense_reference(case):
    """Nothing dropped: output, losses and every gradient equal the dense oracle."""
    assert _check(case, dropless=True) == 0


@pytest.mark.slow
@pytest.mark.parametrize("case", [E8, DET], ids=["e8", "dxext"])
def test_large_capacity_path_equals_dense_reference(case):
    """The capacity path (the default) with a capacity that happens to drop nothing."""
    assert _check(case, cap=B_ * L_, dropless=False) == 0


@pytest.mark.slow
@pytest.mark.parametrize(
    ("gate", "renorm", "k"), [("sigmoid", False, 2), ("sigmoid", True, 3), ("softmax", False, 1)]
)
def test_gates(gate, renorm, k):
    _check(DE, k=k, gate=gate, renorm=renorm)


# The fast tier runs the 2-D mesh; the 1-D and 3-D ones run with --runslow.
@pytest.mark.parametrize(
    "case",
    [pytest.param(E8, marks=pytest.mark.slow), DE, pytest.param(DET, marks=pytest.mark.slow)],
    ids=["e8", "dxe", "dxext"],
)
def test_small_capacity_drops_by_the_rule(case):
    """At capacity 1 the dropped pairs are exactly the numpy rule's, and so is the output."""
    assert _check(case, cap=1, dropless=False) > 0


def test_assign_matches_numpy_rule():
    rng = np.random.default_rng(3)
    for cap in (1, 2, 3, 5):
        ids = np.stack([rng.choice(6, size=3, replace=False) for _ in range(20)])
        slots = moe.assign(jnp.asarray(ids, jnp.int32), 6, cap)
        keep = drop_rule(ids, 6, cap)
        np.testing.assert_array_equal(np.asarray(slots.keep), keep)
        s = np.asarray(slots.slot)
        assert np.all(s[~keep] == 6 * cap)
        kept = s[keep]
        assert len(set(kept.tolist())) == kept.size  # each slot holds one pair
        np.testing.assert_array_equal(kept // cap, ids[keep])  # in its expert's rows


def test_capacity_arithmetic():
    assert moe.capacity(64, 2, 8, 1.0) == 16
    assert moe.capacity(64, 2, 8, 1.25) == 20
    assert moe.capacity(10, 1, 8, 1.0) == 2
    assert moe.dropless_capacity(64) == 64
    assert moe.all_to_all_bytes(8, 20, 64, 4, 4) == 8 * 20 * 64 * 4 * 3 // 4


def test_explain_shows_the_two_all_to_alls_each_way_with_the_formula_bytes():
    """Forward: dispatch and combine; backward: their transposes. Each sends the (E, C, M)
    buffer but its own 1/e, the formula; the compiled HLO has the same four all-to-alls."""
    import shardlib

    case = DE
    mesh = make_mesh(*case)
    x, wr, wi, wo, ct = _inputs()
    cap = 3

    @typed_shard_map
    def f(
        x: f32[Array, b"B/d/e L M"],
        wr: f32[Array, b"M E"],
        wi: f32[Array, b"E/e M F"],
        wo: f32[Array, b"E/e F M"],
    ) -> f32[Array, b"B/d/e L M"]:
        return moe.layer(x, wr, wi, wo, k=2, axis="e", capacity=cap)[0]

    grad = jax.grad(lambda *a: jnp.sum(f(*a) * ct), argnums=(0, 1, 2, 3))
    with jax.set_mesh(mesh):
        report = shardlib.explain(grad, x, wr, wi, wo)
        hlo = str(jax.jit(grad).lower(x, wr, wi, wo).compile().as_text())
    cmp = report.compare_hlo(hlo)
    assert cmp.identical, str(cmp)
    rows = [c for c in report.collectives if c.kind == "all-to-all"]
    one = moe.all_to_all_bytes(E_, cap, M_, 4, 2)
    dispatch, back = "E C/e M -> E/e C M", "E/e C M -> E C/e M"
    assert [(c.spec, c.axes, c.backward) for c in rows] == [
        (dispatch, ("e",), False),  # dispatch
        (back, ("e",), False),  # combine
        (back, ("e",), True),  # the combine's transpose
        (dispatch, ("e",), True),  # the dispatch's transpose
    ]
    assert all(c.sent_bytes == one and c.calls == 1 for c in rows)
    calls, sent, _ = report.totals_by_axes()[("e",)]
    assert (calls, sent) == (4, 4 * one)
    assert hlo.count(" all-to-all(") == 4
