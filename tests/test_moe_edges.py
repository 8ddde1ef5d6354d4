"""``shardlib.moe`` at its edges (issue 38): tokens replicated over the expert axis with
``stats_axes`` naming it, argument validation of the counting helpers (ValueError, never
ZeroDivisionError), NumPy integers as counts, the exact capacity ceiling, and the name of
the default activation.

Values and gradients are compared with the dense jax.numpy oracle of ``tests/test_moe.py``;
the capacity with an exact ``fractions.Fraction`` reference.
"""

from __future__ import annotations

import math
import re
from fractions import Fraction
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from shardlib import moe, shardops
from shardlib.shardtypes import Array, f32, i32, typed_shard_map
from tests._mesh_util import make_mesh, place
from tests.test_moe import _close, _inputs, reference
from tests.test_moe_errors import _run

DE = ((4, 2), ("d", "e"))

# --- 8: tokens replicated over the expert axis, stats_axes naming it ---------------------


def _replicated_layer(check_vma: bool, stats_axes: tuple[str, ...]):
    @typed_shard_map(check_vma=check_vma)
    def f(
        x: f32[Array, b"B/d L M"],
        wr: f32[Array, b"M E"],
        wi: f32[Array, b"E/e M F"],
        wo: f32[Array, b"E/e F M"],
    ) -> tuple[f32[Array, b"B/d L M"], f32[Array, b""], f32[Array, b""], i32[Array, b""]]:
        y, s = moe.layer(x, wr, wi, wo, k=2, axis="e", dropless=True, stats_axes=stats_axes)
        return y, s.aux_loss, s.z_loss, shardops.psum("", s.dropped, "d")

    def run(x, wr, wi, wo, ct):
        def loss(*args):
            y, aux, z, _ = f(*args)
            return jnp.sum(y * ct) + 0.3 * aux + 0.1 * z, (y, aux, z)

        return jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(x, wr, wi, wo)

    return run


@pytest.mark.slow
@pytest.mark.parametrize("check_vma", [True, False], ids=["vma", "no_vma"])
def test_stats_axes_over_an_axis_the_tokens_are_replicated_on(check_vma):
    """``x`` ``'B/d L M'`` (the same tokens on both devices of ``e``) with
    ``stats_axes=('d', 'e')``: the statistics are those of every token of the mesh (the mean
    over ``e`` of equal copies is themselves), the output is returned replicated over ``e``
    without the caller reducing it, and values and gradients equal the dense oracle."""
    mesh = make_mesh(*DE)
    x, wr, wi, wo, ct = _inputs(1)
    specs = ("B/d L M", "M E", "E/e M F", "E/e F M", "B/d L M")
    run = jax.jit(_replicated_layer(check_vma, ("d", "e")))
    with jax.set_mesh(mesh):
        args = [place(v, mesh, s) for v, s in zip((x, wr, wi, wo, ct), specs, strict=True)]
        (_, (y, aux, z)), grads = run(*args)

    def ref_loss(x, wr, wi, wo):
        out, aux, z, _ = reference(x, wr, wi, wo, 2, 4)
        return jnp.sum(out * ct) + 0.3 * aux + 0.1 * z

    want = reference(x, wr, wi, wo, 2, 4)
    want_grads = jax.grad(ref_loss, argnums=(0, 1, 2, 3))(x, wr, wi, wo)
    for name, g, w in zip(("y", "aux", "z"), (y, aux, z), want[:3], strict=True):
        _close(np.asarray(g), np.asarray(w), name)
    for name, g, w in zip(("dx", "dwr", "dwi", "dwo"), grads, want_grads, strict=True):
        _close(np.asarray(g), np.asarray(w), name)


# --- 9: the counting helpers validate their arguments -------------------------------------

BAD_HELPER_CALLS = [
    (moe.capacity, (16, 2, 0, 1.25), "moe.capacity: argument `experts`", "got 0"),
    (moe.capacity, (0, 2, 8, 1.25), "moe.capacity: argument `tokens`", "got 0"),
    (moe.capacity, (16, 0, 8, 1.25), "moe.capacity: argument `k`", "got 0"),
    (moe.capacity, (16, -1, 8, 1.25), "moe.capacity: argument `k`", "got -1"),
    (moe.capacity, (16, 3, 2, 1.25), "argument `k` (experts per token) must be at most", "got 3"),
    (moe.capacity, (16, 2, 8, 0), "moe.capacity: argument `factor` must be a number > 0", "0"),
    (moe.capacity, (16, 2, 8, -1.0), "moe.capacity: argument `factor`", "got -1.0"),
    (moe.capacity, (16, 2, 8, float("inf")), "argument `factor` must be a number > 0 and", "inf"),
    (moe.capacity, (16, 2, 8, float("nan")), "moe.capacity: argument `factor`", "got nan"),
    (moe.capacity, (16, 2, 8, True), "moe.capacity: argument `factor`", "got True"),
    (moe.capacity, (16.0, 2, 8, 1.25), "moe.capacity: argument `tokens`", "16.0 (float)"),
    (moe.capacity, (16, True, 8, 1.25), "moe.capacity: argument `k`", "True (bool)"),
    (moe.capacity, (16, 2, "8", 1.25), "moe.capacity: argument `experts`", "'8' (str)"),
    (moe.all_to_all_bytes, (8, 4, 16, 4, 0), "moe.all_to_all_bytes: argument `e`", "got 0"),
    (moe.all_to_all_bytes, (0, 4, 16, 4, 2), "moe.all_to_all_bytes: argument `experts`", "0"),
    (moe.all_to_all_bytes, (8, 0, 16, 4, 2), "moe.all_to_all_bytes: argument `cap`", "got 0"),
    (moe.all_to_all_bytes, (8, 4, -16, 4, 2), "argument `width`", "got -16"),
    (moe.all_to_all_bytes, (8, 4, 16, 0, 2), "argument `itemsize`", "got 0"),
    (moe.all_to_all_bytes, (8, 4.5, 16, 4, 2), "argument `cap`", "got 4.5 (float)"),
    (
        moe.all_to_all_bytes,
        (8, 4, 16, 4, 3),
        "argument `experts` must be divisible by `e` (3)",
        "8",
    ),
    (moe.dropless_capacity, (0,), "moe.dropless_capacity: argument `tokens`", "got 0"),
    (moe.dropless_capacity, (16.0,), "moe.dropless_capacity: argument `tokens`", "(float)"),
    (moe.assign, (jnp.zeros((4, 2), jnp.int32), 0, 2), "moe.assign: argument `num_experts`", "0"),
    (moe.assign, (jnp.zeros((4, 2), jnp.int32), 8, 0), "moe.assign: argument `cap`", "got 0"),
    (moe.assign, (jnp.zeros((4, 2), jnp.int32), 8, 2.0), "moe.assign: argument `cap`", "(float)"),
    (moe.dispatch, (jnp.zeros((4, 8)), None, 8, 0), "moe.dispatch: argument `cap`", "got 0"),
]


@pytest.mark.parametrize(
    ("fn", "args", "start", "actual"),
    BAD_HELPER_CALLS,
    ids=[f"{c[0].__name__}{c[1][-3:]!r}".replace(" ", "") for c in BAD_HELPER_CALLS],
)
def test_helpers_refuse_meaningless_arguments(fn, args, start, actual):
    """A ValueError naming the function, the argument and the value (never a
    ZeroDivisionError, never a silent 0 or a float)."""
    with pytest.raises(ValueError) as info:
        fn(*args)
    text = str(info.value)
    assert start in text and actual in text, text
    assert text.startswith(f"moe.{fn.__name__}: argument `"), text


# --- 10: NumPy integers are counts; floats and bools are not ------------------------------


def test_helpers_take_numpy_ints():
    assert moe.capacity(np.int64(64), np.int32(2), np.int16(8), 1.25) == 20
    assert type(moe.capacity(np.int64(64), 2, 8, 1.25)) is int
    assert moe.all_to_all_bytes(np.int64(8), np.int32(20), 64, np.int8(4), np.uint8(4)) == 30720
    assert type(moe.dropless_capacity(np.int64(64))) is int
    ids = np.array([[0, 1], [1, 2], [1, 0]], np.int32)
    got = moe.assign(jnp.asarray(ids), np.int64(3), np.int32(1))
    want = moe.assign(jnp.asarray(ids), 3, 1)
    np.testing.assert_array_equal(np.asarray(got.slot), np.asarray(want.slot))
    np.testing.assert_array_equal(np.asarray(got.keep), np.asarray(want.keep))


@pytest.mark.slow
def test_layer_takes_numpy_ints_for_k_and_capacity():
    want = np.asarray(_run(k=2, capacity=2))
    got = np.asarray(_run(k=np.int64(2), capacity=np.int32(2)))
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(np.asarray(_run(k=np.int32(1))), np.asarray(_run(k=1)))


LAYER_REFUSALS = [
    (dict(k=2.0), "moe.layer: argument `k` (experts per token) must be an int in 1..8", "2.0 (f"),
    (dict(k=True), "argument `k` (experts per token) must be an int in 1..8", "True (bool)"),
    (dict(k=np.float64(2)), "moe.layer: argument `k`", "np.float64(2.0) (float64)"),
    (dict(capacity=2.0), "moe.layer: argument `capacity` (slots per expert per device)", "2.0"),
    (dict(capacity=True), "moe.layer: argument `capacity` (slots per expert", "True (bool)"),
    (dict(capacity_factor=True), "moe.layer: argument `capacity_factor` must be", "True"),
    (dict(capacity_factor=float("inf")), "moe.layer: argument `capacity_factor`", "inf"),
]


@pytest.mark.parametrize(("kw", "start", "actual"), LAYER_REFUSALS, ids=str)
def test_layer_refuses_floats_and_bools_as_counts(kw, start, actual):
    with pytest.raises(ValueError) as info:
        _run(**kw)
    text = str(info.value)
    assert start in text and f"got {actual}" in text, text


# --- 11: the capacity's ceiling is exact ---------------------------------------------------


def _exact_capacity(tokens, k, experts, factor):
    """ceil(factor * tokens * k / experts), the factor as written (its decimal repr)."""
    return math.ceil(Fraction(repr(factor)) * tokens * k / experts)


def test_capacity_ceiling_is_exact():
    """1.1 * 25 * 2 / 5 is 11.000000000000002 in floats: the ceiling is still 11."""
    assert moe.capacity(25, 2, 5, 1.1) == 11
    assert moe.capacity(45, 2, 11, 1.1) == 9
    assert moe.capacity(64, 2, 8, 1.25) == 20
    assert moe.capacity(64, 2, 8, 1) == 16
    assert moe.capacity(10, 1, 8, 1.0) == 2
    assert moe.capacity(3, 1, 4, Fraction(4, 3)) == 1
    assert moe.capacity(25, 2, 5, np.float32(1.1)) == 11  # as written, not float32's binary


def test_capacity_against_fraction_reference_seeded():
    rng = np.random.default_rng(38)
    factors = [1.0, 1.1, 1.2, 1.25, 1.3, 1.5, 2.0, 0.7, 0.9, 1.05, 1.15, 3.3]
    for _ in range(3000):
        experts = int(rng.integers(1, 65))
        k = int(rng.integers(1, min(experts, 8) + 1))
        tokens = int(rng.integers(1, 5000))
        factor = factors[int(rng.integers(len(factors)))]
        if rng.random() < 0.3:  # a random decimal with up to 3 places
            factor = round(float(rng.uniform(0.1, 4.0)), int(rng.integers(1, 4)))
        got = moe.capacity(tokens, k, experts, factor)
        assert got == _exact_capacity(tokens, k, experts, factor), (tokens, k, experts, factor)


@pytest.mark.slow
def test_layer_uses_the_exact_capacity():
    """The layer's ``Stats.capacity`` is the exact one: 25 tokens per device, E=10, k=4,
    factor 1.1 is ceil(11) = 11 (floats: ceil(11.000000000000002) = 12)."""
    mesh = make_mesh((4, 2), ("d", "e"), auto=True)

    def body(x, wr, wi, wo):
        _, s = moe.layer(x, wr, wi, wo, k=4, axis="e", capacity_factor=1.1)
        return jnp.full((1,), s.capacity, jnp.int32)

    f = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(P(("d", "e")), P(), P("e"), P("e")),
        out_specs=P(("d", "e")),
    )
    with jax.set_mesh(mesh):
        caps = f(jnp.ones((200, 8)), jnp.ones((8, 10)), jnp.ones((10, 8, 4)), jnp.ones((10, 4, 8)))
    assert set(np.asarray(caps).tolist()) == {11}


# --- 16: the default activation has a name -------------------------------------------------


def test_default_activation_is_named():
    import inspect

    for fn in (moe.layer, moe.expert_ffn):
        default = inspect.signature(fn).parameters["activation"].default
        assert repr(default) == "jax.nn.gelu"
        x = jnp.linspace(-3.0, 3.0, 13)
        np.testing.assert_array_equal(np.asarray(default(x)), np.asarray(jax.nn.gelu(x)))
        assert "jax.nn.gelu" in (fn.__doc__ or "")
    guide = (Path(__file__).parent.parent / "docs" / "guide" / "moe.md").read_text()
    assert re.search(r"`activation`.*`jax\.nn\.gelu`", guide), "the guide names the activation"
