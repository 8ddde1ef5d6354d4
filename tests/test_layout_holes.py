"""Layout ops that keep a per-device slice: no silent wrong answer, no false alarm.

``reshard`` (its local-slice steps) and ``repeat`` (a new dim split over mesh axes) keep on
each device its block of the value over axes the spec says it is replicated over. A value
that differs across those axes (a forgotten ``psum``, an ``axis_index``) would give a mix of
different arrays; a partial sum over them would give a block of a share. Both must be refused
while the body is analysed, with ``check_vma`` on and off, naming the op, the axis and why.
A partial sum over *other* axes is linear through these ops (and through ``rearrange``,
``jnp.tile`` and ``einops.repeat``) and must give jax.numpy's values and gradients once
reduced. Also: numpy integer sizes, and the divisibility messages.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import einops
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from typeguard import TypeCheckError

from shardlib import SpecError, shardops
from shardlib.shardops import PendingReductionError
from shardlib.shardtypes import f32, typed_shard_map
from tests._mesh_util import make_mesh

_SHAPES = {1: ((8,), ("d",)), 2: ((4, 2), ("d", "t")), 3: ((2, 2, 2), ("d", "t", "u"))}
_MESHES: dict[int, Any] = {}


def mesh_of(rank: int) -> Any:
    if rank not in _MESHES:
        _MESHES[rank] = make_mesh(*_SHAPES[rank])
    return _MESHES[rank]


def normal(seed: int, shape: tuple[int, ...]) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=shape).astype(np.float32)


def line_of(fn: Callable, needle: str) -> int:
    lines, start = inspect.getsourcelines(fn)
    return start + next(k for k, text in enumerate(lines) if needle in text)


VMA = pytest.mark.parametrize("check_vma", [False, True], ids=["vma-off", "vma-on"])

# ---------------------------------------------------------------------------------------------
# Refused: the input is not the same on every device of the axes the op slices over
# ---------------------------------------------------------------------------------------------


def reshard_plus_index(a: f32[b"B/d M"]) -> f32[b"B/d M/t"]:
    return shardops.reshard("B/d M -> B/d M/t", a + shardops.axis_index("t"))


def reshard_scaled_1d(a: f32[b"B M"]) -> f32[b"B M/d"]:
    return shardops.reshard("B M -> B M/d", a * (shardops.axis_index("d") + 1))


def reshard_after_all_to_all(a: f32[b"B/d M"]) -> f32[b"B M/d/t"]:
    return shardops.reshard("B/d M -> B M/d/t", a + shardops.axis_index("t"))


def reshard_varies_over_u(a: f32[b"B/d M"]) -> f32[b"B/d M/t/u"]:
    return shardops.reshard("B/d M -> B/d M/t/u", a - shardops.axis_index("u"))


def reshard_forgotten_psum(w: f32[b"T/t M"]) -> f32[b"M/t"]:
    part = jnp.sum(w, axis=0)  # this device's part of the sum: differs across t
    return shardops.reshard("M -> M/t", part)


def repeat_plus_index(a: f32[b"B/d M"]) -> f32[b"B/d M R/t"]:
    return shardops.repeat("B/d M -> B/d M R/t", a + shardops.axis_index("t"), R=4)


def repeat_scaled_1d(a: f32[b"B M"]) -> f32[b"B M R/d"]:
    return shardops.repeat("B M -> B M R/d", a * (shardops.axis_index("d") + 1), R=8)


def repeat_two_axes(a: f32[b"B/d M"]) -> f32[b"B/d R/t/u M"]:
    return shardops.repeat("B/d M -> B/d R/t/u M", a + shardops.axis_index("t"), R=4)


def reshard_partial_over_slice(x: f32[b"B F/t"], w: f32[b"F/t M"]) -> f32[b"B M/t"]:
    y = shardops.einsum_unreduced("B F/t, F/t M -> B M", x, w)  # pending over t
    return shardops.reshard("B M -> B M/t", y)


def repeat_partial_over_slice(x: f32[b"B F/t"], w: f32[b"F/t M"]) -> f32[b"B M R/t"]:
    y = shardops.einsum_unreduced("B F/t, F/t M -> B M", x, w)  # pending over t
    return shardops.repeat("B M -> B M R/t", y, R=2)


@dataclass(frozen=True)
class Refused:
    body: Callable
    mesh: int
    shapes: tuple[tuple[int, ...], ...]
    call: str  # the op as the message names it (also the needle for the line)
    axis: str
    error: type[Exception] = ValueError
    also: tuple[str, ...] = ()


_VARIES = ("the input differs across the devices of", "by a local slice")
_REPEAT = ("the input differs across the devices of", "each device makes only its block")
_SLICED = ("only its own slice of a partial sum", "einsum_unreduced('B F/t, F/t M -> B M')")
REFUSED = [
    Refused(reshard_plus_index, 2, ((8, 8),), "reshard('B/d M -> B/d M/t')", "t", also=_VARIES),
    Refused(reshard_scaled_1d, 1, ((8, 8),), "reshard('B M -> B M/d')", "d", also=_VARIES),
    Refused(reshard_after_all_to_all, 2, ((8, 8),), "reshard('B/d M -> B M/d/t')", "t"),
    Refused(reshard_varies_over_u, 3, ((8, 8),), "reshard('B/d M -> B/d M/t/u')", "u"),
    Refused(reshard_forgotten_psum, 2, ((4, 8),), "reshard('M -> M/t')", "t", also=_VARIES),
    Refused(repeat_plus_index, 2, ((8, 8),), "repeat('B/d M -> B/d M R/t')", "t", also=_REPEAT),
    Refused(repeat_scaled_1d, 1, ((8, 8),), "repeat('B M -> B M R/d')", "d", also=_REPEAT),
    Refused(repeat_two_axes, 3, ((8, 8),), "repeat('B/d M -> B/d R/t/u M')", "t"),
    Refused(
        reshard_partial_over_slice,
        2,
        ((8, 8), (8, 8)),
        "shardops.reshard('B M -> B M/t')",
        "t",
        PendingReductionError,
        _SLICED,
    ),
    Refused(
        repeat_partial_over_slice,
        2,
        ((8, 8), (8, 8)),
        "shardops.repeat('B M -> B M R/t')",
        "t",
        PendingReductionError,
        _SLICED,
    ),
]


@VMA
@pytest.mark.parametrize("case", REFUSED, ids=[c.body.__name__ for c in REFUSED])
def test_slice_of_a_value_that_is_not_replicated_is_refused(case: Refused, check_vma: bool):
    f = jax.jit(typed_shard_map(case.body, check_vma=check_vma))
    args = [normal(k, s) for k, s in enumerate(case.shapes)]
    with jax.set_mesh(mesh_of(case.mesh)), pytest.raises(case.error) as info:
        f.trace(*args)  # refused while tracing: nothing is compiled
    msg = str(info.value)
    needle = case.call.removeprefix("shardops.").split("(")[0] + "("
    where = f"test_layout_holes.py:{line_of(case.body, needle)}"
    for part in (f"in {case.body.__name__}()", case.call, f"mesh axis {case.axis!r}", where):
        assert part in msg, f"{part!r} not in:\n{msg}"
    for part in case.also:
        assert part in msg, f"{part!r} not in:\n{msg}"


def test_the_message_names_only_the_axes_the_value_varies_over():
    f = jax.jit(typed_shard_map(reshard_varies_over_u))
    with jax.set_mesh(mesh_of(3)), pytest.raises(ValueError) as info:
        f.trace(normal(0, (8, 8)))
    msg = str(info.value)
    assert "devices of mesh axis 'u'" in msg and "'t'" not in msg.split("(It splits")[0], msg
    assert "It splits dim 1 'M' over 't/u' by a local slice" in msg, msg


# ---------------------------------------------------------------------------------------------
# Accepted: partial sums over other axes, and values that are replicated
# ---------------------------------------------------------------------------------------------


def repeat_partial(x: f32[b"B/d F/t"], w: f32[b"F/t M"]) -> f32[b"B/d M R"]:
    y = shardops.einsum_unreduced("B/d F/t, F/t M -> B/d M", x, w)  # pending over t
    z = shardops.repeat("B/d M -> B/d M R", y, R=3)
    return shardops.psum("B/d M R", z, axes="t")


def repeat_partial_split_other(x: f32[b"B/d F/t"], w: f32[b"F/t M"]) -> f32[b"B/d R/u M"]:
    y = shardops.einsum_unreduced("B/d F/t, F/t M -> B/d M", x, w)  # pending over t
    z = shardops.repeat("B/d M -> B/d R/u M", y, R=4)  # split over u, not over t
    return shardops.psum("B/d R/u M", z, axes="t")


def repeat_partial_group_1d(x: f32[b"B F/d"], w: f32[b"F/d M"]) -> f32[b"N M"]:
    y = shardops.einsum_unreduced("B F/d, F/d M -> B M", x, w)  # pending over d
    return shardops.psum("N M", shardops.repeat("B M -> (R B) M", y, R=2), axes="d")


def tile_partial_1d(x: f32[b"B F/d"], w: f32[b"F/d M"]) -> f32[b"N M"]:
    y = shardops.einsum_unreduced("B F/d, F/d M -> B M", x, w)
    return shardops.psum("N M", jnp.tile(y, (2, 1)), axes="d")


def einops_repeat_partial_1d(x: f32[b"B F/d"], w: f32[b"F/d M"]) -> f32[b"B M R"]:
    y = shardops.einsum_unreduced("B F/d, F/d M -> B M", x, w)
    return shardops.psum("B M R", einops.repeat(y, "b m -> b m r", r=3), axes="d")


def reshard_partial_slice_other(x: f32[b"B F/t"], w: f32[b"F/t M"]) -> f32[b"B/d M"]:
    y = shardops.einsum_unreduced("B F/t, F/t M -> B M", x, w)  # pending over t
    z = shardops.reshard("B M -> B/d M", y)  # a local slice over d
    return shardops.psum("B/d M", z, axes="t")


def reshard_partial_declared(x: f32[b"B/d F/t"], w: f32[b"F/t M"]) -> f32[b"B M/d"]:
    y = shardops.einsum_unreduced("B/d F/t, F/t M -> B/d M {+t}", x, w)
    z = shardops.reshard("B/d M {+t} -> B M/d {+t}", y)  # an all_to_all over d
    return shardops.psum("B M/d", z, axes="t")


def reshard_partial_3d(x: f32[b"B/d F/t"], w: f32[b"F/t M/u"]) -> f32[b"B/u M/d"]:
    y = shardops.einsum_unreduced("B/d F/t, F/t M/u -> B/d M/u", x, w)  # pending over t
    z = shardops.reshard("B/d M/u -> B/u M/d", y)
    return shardops.psum("B/u M/d", z, axes="t")


def reshard_reorder(x: f32[b"M/t/d N"]) -> f32[b"M/d/t N"]:
    return shardops.reshard("M/t/d N -> M/d/t N", x)  # gathers, then slices: legitimately


def rearrange_partial(x: f32[b"B/d F/t"], w: f32[b"F/t M"]) -> f32[b"B/d H D"]:
    y = shardops.einsum_unreduced("B/d F/t, F/t M -> B/d M", x, w)  # pending over t
    z = shardops.rearrange("B/d (H D) -> B/d H D", y, H=np.int64(2))
    return shardops.psum("B/d H D", z, axes="t")


def _mm(x, w):
    return x @ w


@dataclass(frozen=True)
class Accepted:
    body: Callable
    mesh: int
    shapes: tuple[tuple[int, ...], ...]
    ref: Callable


ACCEPTED = [
    Accepted(
        repeat_partial,
        2,
        ((8, 6), (6, 4)),
        lambda x, w: einops.repeat(x @ w, "b m -> b m r", r=3),
    ),
    Accepted(
        repeat_partial_split_other,
        3,
        ((4, 6), (6, 4)),
        lambda x, w: einops.repeat(x @ w, "b m -> b r m", r=4),
    ),
    Accepted(repeat_partial_group_1d, 1, ((4, 8), (8, 3)), lambda x, w: jnp.tile(x @ w, (2, 1))),
    Accepted(tile_partial_1d, 1, ((4, 8), (8, 3)), lambda x, w: jnp.tile(x @ w, (2, 1))),
    Accepted(
        einops_repeat_partial_1d,
        1,
        ((4, 8), (8, 3)),
        lambda x, w: einops.repeat(x @ w, "b m -> b m r", r=3),
    ),
    Accepted(reshard_partial_slice_other, 2, ((8, 6), (6, 4)), _mm),
    Accepted(reshard_partial_declared, 2, ((8, 6), (6, 8)), _mm),
    Accepted(reshard_partial_3d, 3, ((4, 6), (6, 4)), _mm),
    Accepted(reshard_reorder, 2, ((8, 3),), lambda x: x),
    Accepted(
        rearrange_partial, 2, ((8, 6), (6, 4)), lambda x, w: (x @ w).reshape(x.shape[0], 2, -1)
    ),
]


@VMA
@pytest.mark.parametrize("case", ACCEPTED, ids=[c.body.__name__ for c in ACCEPTED])
def test_linear_layout_ops_match_reference(case: Accepted, check_vma: bool):
    f = typed_shard_map(case.body, check_vma=check_vma)
    args = [normal(k, s) for k, s in enumerate(case.shapes)]
    want = np.asarray(case.ref(*args))
    c = normal(9, want.shape)
    argnums = tuple(range(len(args)))

    def loss(fn):
        return jax.jit(jax.grad(lambda *a: jnp.sum(fn(*a) * c), argnums=argnums))

    with jax.set_mesh(mesh_of(case.mesh)):
        got = np.asarray(jax.jit(f)(*args))
        grads = loss(f)(*args)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    for g, r in zip(grads, loss(case.ref)(*args), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# reshard's {+t} clauses; numpy sizes; divisibility messages
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "msg"),
    [
        ("B/d L {+t} -> B L", "the input declares pending axes {+t} but the output declares none"),
        ("B/d L -> B L {+t}", "the input declares none but the output declares pending axes {+t}"),
        ("B L {+t} -> B L {+u}", "the input declares pending axes {+t} but the output declares"),
    ],
)
def test_reshard_pending_clauses_must_agree(spec: str, msg: str):
    with pytest.raises(SpecError) as info:
        shardops.reshard(spec, jnp.ones((8, 8)))
    assert msg in str(info.value), str(info.value)
    assert "neither reduces a partial sum nor makes one" in str(info.value)


def test_reshard_declared_pending_is_checked():
    def body(x: f32[b"B/d F/t"], w: f32[b"F/t M"]) -> f32[b"B M/d"]:
        y = shardops.einsum_unreduced("B/d F/t, F/t M -> B/d M", x, w)  # pending over t
        z = shardops.reshard("B/d M {+u} -> B M/d {+u}", y)  # wrong: it owes t, not u
        return shardops.psum("B M/d", z, axes="t")

    with jax.set_mesh(mesh_of(3)), pytest.raises(SpecError) as info:
        jax.jit(typed_shard_map(body)).trace(normal(0, (8, 6)), normal(1, (6, 8)))
    msg = str(info.value)
    assert "reshard: the input is declared pending over 'u' ({+u}) but it is pending over" in msg
    assert "'B/d M {+u} -> B M/d {+u}'" in msg, msg


@pytest.mark.parametrize("size", [np.int64(2), np.int32(2), np.uint8(2), 2])
def test_rearrange_takes_numpy_integer_sizes(size: Any):
    def body(x: f32[b"B/d HD/t"]) -> f32[b"B/d H/t D"]:
        return shardops.rearrange("B/d (H D)/t -> B/d H/t D", x, H=size)

    x = normal(0, (8, 12))
    with jax.set_mesh(mesh_of(2)):
        got = np.asarray(jax.jit(typed_shard_map(body))(x))
    np.testing.assert_array_equal(got, x.reshape(8, 2, 6))
    local = shardops.repeat("a b -> a b r", jnp.asarray(x), r=np.int16(3))
    np.testing.assert_array_equal(np.asarray(local), einops.repeat(x, "a b -> a b r", r=3))


@pytest.mark.parametrize(
    ("size", "phrases"),
    [
        (8.0, ["keyword size H=8.0 is a float", "e.g. H=8"]),
        (np.float32(8), ["is a float32", "e.g. H=8"]),
        (2.5, ["keyword size H=2.5 is a float", "must be a non-negative int"]),
        (True, ["keyword size H=True is a bool", "not a bool"]),
        (np.bool_(True), ["is a bool", "not a bool"]),
        (np.int64(-4), ["keyword size H=np.int64(-4) is negative"]),
        ("8", ["keyword size H='8' is a str"]),
    ],
)
def test_rearrange_refuses_sizes_that_are_not_integers(size: Any, phrases: list[str]):
    with pytest.raises(TypeError) as info:
        shardops.rearrange("(H D) -> H D", jnp.ones(16), H=size)
    msg = str(info.value)
    assert msg.startswith("rearrange('(H D) -> H D'): "), msg
    for p in phrases:
        assert p in msg, f"{p!r} not in:\n{msg}"


@pytest.mark.parametrize(
    ("spec", "n", "want"),
    [
        ("B/d L -> B L/t", 3, "dim 1 'L' has global size 3, which is not divisible by t=2, so"),
        ("B/d L -> B L/d/t", 12, "not divisible by d=4 × t=2 = 8, so it cannot be split"),
    ],
)
def test_reshard_divisibility_message(spec: str, n: int, want: str):
    src, dst = (s.strip() for s in spec.split("->"))

    def body(x):
        return shardops.reshard(spec, x)

    body.__annotations__ = {"x": f32[src.encode()], "return": f32[dst.encode()]}
    with jax.set_mesh(mesh_of(2)), pytest.raises(SpecError) as info:
        jax.jit(typed_shard_map(body)).trace(normal(0, (8, n)))
    msg = str(info.value)
    assert want in msg, msg
    assert "t=2 = 2" not in msg, msg


@pytest.mark.parametrize(
    ("pattern", "sizes", "want"),
    [
        ("B M -> B M R/d/t", {"R": 4}, "the new dim R=4 is split over d=4 × t=2 = 8, but 4"),
        ("B M -> B M R/t", {"R": 3}, "the new dim R=3 is split over t=2, but 3 is not"),
        ("B (H D)/d/t -> B H/d/t D", {"H": 4}, "split over d=4 × t=2 = 8, which puts the axes"),
    ],
)
def test_repeat_and_rearrange_divisibility_messages(pattern: str, sizes: dict, want: str):
    op = shardops.repeat if "R" in pattern else shardops.rearrange

    def body(x: f32[b"B M"]) -> f32[b"B M"]:
        op(pattern, x, **sizes)
        return x

    with jax.set_mesh(mesh_of(2)), pytest.raises(TypeCheckError) as info:
        jax.jit(typed_shard_map(body, check_vma=False)).trace(normal(0, (4, 8)))
    assert want in str(info.value), str(info.value)
