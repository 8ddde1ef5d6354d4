"""``shardlib.attention`` edge cases: the ``scale`` argument, and forward-mode AD.

A scale may be a Python float (fixed) or a float array of shape ``()`` that may be traced (a
learned scale): ``ring`` and ``gathered`` then give the same output and gradients (q, k, v and
the scale) as plain softmax attention on the global arrays. Anything else is refused with a
message naming the function, the argument, what it accepts and what it got.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from shardlib import attention
from shardlib.shardtypes import Array, f32, typed_shard_map
from tests._mesh_util import make_mesh, place

C4 = ((4,), ("c",), "B L/c H D", "B L/c K D")
DCT = ((2, 2, 2), ("d", "c", "t"), "B/d L/c H/t D", "B/d L/c K/t D")
B_, L_, H_, K_, D_ = 2, 16, 4, 2, 8


def reference(q, k, v, scale, causal=True):
    """Plain softmax attention on global arrays with score scale ``scale``."""
    h = q.shape[2]
    k = jnp.repeat(k, h // k.shape[2], axis=2)
    v = jnp.repeat(v, h // v.shape[2], axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * scale
    length = q.shape[1]
    keep = jnp.tril(jnp.ones((length, length), bool)) if causal else jnp.ones((length,) * 2, bool)
    p = jax.nn.softmax(jnp.where(keep[None, None], s, -jnp.inf), axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", p, v)


def _inputs(seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B_, L_, H_, D_)).astype(np.float32)
    k = rng.standard_normal((B_, L_, K_, D_)).astype(np.float32)
    v = rng.standard_normal((B_, L_, K_, D_)).astype(np.float32)
    ct = rng.standard_normal((B_, L_, H_, D_)).astype(np.float32)
    return q, k, v, ct


@functools.cache
def _loss(case, fn, layout, causal, vma):
    """``(q, k, v, scale, ct) -> sum(out * ct)``; the scale is an argument of the body, the
    same on every device (a traced f32 of shape ())."""
    _, _, qs, kvs = case
    spec = f"{qs}, {kvs}"

    def loss(q, k, v, scale, ct):
        @typed_shard_map(check_vma=vma)
        def f(
            q: f32[Array, qs.encode()],
            k: f32[Array, kvs.encode()],
            v: f32[Array, kvs.encode()],
            scale: f32[Array, b""],
        ) -> f32[Array, qs.encode()]:
            op = getattr(attention, fn)
            return op(spec, q, k, v, "c", causal=causal, layout=layout, scale=scale)

        out = f(q, k, v, scale)
        return jnp.sum(out * ct), out

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))


@pytest.mark.slow
@pytest.mark.parametrize("vma", [True, False], ids=["vma", "no-vma"])
@pytest.mark.parametrize("case", [C4, DCT], ids=["c4", "dxcxt"])
@pytest.mark.parametrize("fn", ["ring", "gathered"])
def test_traced_scale_matches_reference_with_its_gradient(fn, case, vma):
    shape, names, qs, kvs = case
    layout, causal = ("balanced", True) if case is C4 else ("contiguous", False)
    mesh = make_mesh(shape, names)
    c = shape[names.index("c")]
    q, k, v, ct = _inputs()
    order = attention.positions(L_, c, layout)
    back = np.argsort(order)
    scale = np.float32(0.37)
    with jax.set_mesh(mesh):
        args = (
            place(q[:, order], mesh, qs),
            place(k[:, order], mesh, kvs),
            place(v[:, order], mesh, kvs),
            jnp.asarray(scale),
            place(ct[:, order], mesh, qs),
        )
        (_, out), grads = _loss(case, fn, layout, causal, vma)(*args)
    got = [np.asarray(x)[:, back] for x in (out, *grads[:3])] + [np.asarray(grads[3])]

    def ref_loss(q, k, v, scale):
        out = reference(q, k, v, scale, causal)
        return jnp.sum(out * ct), out

    (_, ref_out), ref_grads = jax.value_and_grad(ref_loss, argnums=(0, 1, 2, 3), has_aux=True)(
        jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(scale)
    )
    want = [np.asarray(x) for x in (ref_out, *ref_grads)]
    assert got[4].shape == () and got[4].dtype == np.float32
    for name, g, w in zip(("out", "dq", "dk", "dv", "dscale"), got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5, err_msg=name)


def _call(fn, scale):
    shape, names, qs, kvs = C4
    mesh = make_mesh(shape, names)
    q, k, v, _ = _inputs()

    @typed_shard_map
    def f(
        q: f32[Array, qs.encode()], k: f32[Array, kvs.encode()], v: f32[Array, kvs.encode()]
    ) -> f32[Array, qs.encode()]:
        return getattr(attention, fn)(f"{qs}, {kvs}", q, k, v, "c", scale=scale)

    with jax.set_mesh(mesh):
        return f(place(q, mesh, qs), place(k, mesh, kvs), place(v, mesh, kvs))


@pytest.mark.slow
@pytest.mark.parametrize("fn", ["ring", "gathered"])
def test_float_and_array_scales_agree(fn):
    """A Python float, a numpy scalar and a concrete jax array give the same output."""
    outs = [np.asarray(_call(fn, s)) for s in (0.25, np.float32(0.25), jnp.float32(0.25))]
    for o in outs[1:]:
        np.testing.assert_allclose(o, outs[0], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("fn", ["ring", "gathered"])
@pytest.mark.parametrize(
    "scale, got",
    [
        (jnp.ones((2,), jnp.float32), r"an array of shape \(2,\) and dtype float32"),
        (jnp.int32(2), r"an array of shape \(\) and dtype int32"),
        (True, r"bool True"),
        ("0.5", r"str '0.5'"),
    ],
    ids=["vector", "int-array", "bool", "str"],
)
def test_scale_that_is_not_a_real_scalar(fn, scale, got):
    with pytest.raises(
        ValueError, match=rf"^{fn}: argument `scale` must be None .*; got {got}(\n|$)"
    ):
        _call(fn, scale)


def _forward_mode(fn):
    """``jax.jvp`` of ``attention.<fn>`` on C4, with its tangent of q."""
    shape, names, qs, kvs = C4
    mesh = make_mesh(shape, names)
    q, k, v, ct = _inputs(3)

    @typed_shard_map
    def f(
        q: f32[Array, qs.encode()], k: f32[Array, kvs.encode()], v: f32[Array, kvs.encode()]
    ) -> f32[Array, qs.encode()]:
        return getattr(attention, fn)(f"{qs}, {kvs}", q, k, v, "c")

    with jax.set_mesh(mesh):
        return jax.jvp(lambda q: f(q, k, v), (q,), (ct,))


def test_forward_mode_through_ring_is_refused_with_what_to_use():
    with pytest.raises(TypeError, match=r"ring: forward-mode .* attention\.gathered"):
        _forward_mode("ring")


@pytest.mark.slow
def test_forward_mode_through_gathered_matches_the_reference():
    q, k, v, ct = _inputs(3)
    out, dot = _forward_mode("gathered")
    scale = 1 / np.sqrt(D_)
    want, want_dot = jax.jvp(lambda q: reference(q, k, v, scale), (q,), (ct,))
    np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(dot, want_dot, rtol=1e-4, atol=1e-5)
