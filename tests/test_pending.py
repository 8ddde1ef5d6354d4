"""Pending reductions: a forgotten or misplaced psum is an error at trace time.

``einsum_unreduced`` with a sharded contracted dim and ``index_unreduced`` with a sharded
table return a partial sum: an ordinary array that ``typed_shard_map`` follows through the
traced body (``shardlib._analysis.walk``). The catalogue ``CASES`` holds programs
with a deliberately forgotten or misplaced reduction (forward and backward, on 1-D, 2-D and
3-D meshes): each one, with ``check_vma`` off and on, must fail while ``jax.jit(...).trace``
runs (nothing is compiled) with a message naming the op and spec that made the partial sum
and the line it is on. The same program with the reduction in place must run and match
jax.numpy on the global arrays.

The other tests pin down the tracking rules (what keeps, clears and refuses pending axes),
the ``{+axis}`` declarations, the escape hatches, gradients of a training step and the
error texts quoted in docs/guide/pending.md.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax import lax
from jax.sharding import NamedSharding
from typeguard import TypeCheckError, typechecked

from shardlib import SpecError, shardops
from shardlib.shardops import PendingReductionError
from shardlib.shardtypes import (
    f32,
    i32,
    make_shardings,
    pytree_dataclass,
    typed_shard_map,
)
from tests._mesh_util import MESHES, expect_pending, make_mesh, place

_MESHES: dict[int, Any] = {}


def mesh_of(i: int) -> Any:
    if i not in _MESHES:
        _MESHES[i] = make_mesh(*MESHES[i])
    return _MESHES[i]


def normal(seed: int, shape: tuple[int, ...]) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=shape).astype(np.float32)


def tokens(seed: int, shape: tuple[int, ...], vocab: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, size=shape).astype(np.int32)


def line_of(fn: Callable, needle: str) -> int:
    """The line number of the first source line of ``fn`` containing ``needle``."""
    lines, start = inspect.getsourcelines(fn)
    for k, text in enumerate(lines):
        if needle in text:
            return start + k
    raise AssertionError(f"{needle!r} not in {fn.__name__}")


# ---------------------------------------------------------------------------------------------
# Helpers the programs call (module level: typeguard instruments them)
# ---------------------------------------------------------------------------------------------


@typechecked
def rms_norm(h: f32[b"B/x M"]) -> f32[b"B/x M"]:
    """A typechecked, non-linear helper: it wants a reduced activation."""
    return h * lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + 1e-6)


def rms_ref(h: np.ndarray) -> np.ndarray:
    return h / np.sqrt(np.mean(h * h, axis=-1, keepdims=True) + 1e-6)


# ---------------------------------------------------------------------------------------------
# The catalogue: each body takes `fixed` (static); fixed=False forgets or misplaces a reduction
# ---------------------------------------------------------------------------------------------


def return_partial(fixed: bool, x: f32[b"B F/d"], w: f32[b"F/d M"]) -> f32[b"B M"]:
    y = shardops.einsum_unreduced("B F/d, F/d M -> B M", x, w)
    return shardops.psum("B M", y, axes="d") if fixed else y


def psum_wrong_axis(fixed: bool, x: f32[b"B/x F/z"], w: f32[b"F/z M"]) -> f32[b"B/x M"]:
    y = shardops.einsum_unreduced("B/x F/z, F/z M -> B/x M", x, w)
    # Summing over 'y' is a legitimate (different) reduction: the sum over 'z' is still owed.
    return shardops.psum("B/x M", y, axes="z" if fixed else "y")


def pmax_of_partial(fixed: bool, x: f32[b"B/x F/y"], w: f32[b"F/y M"]) -> f32[b"B/x M"]:
    y = shardops.einsum_unreduced("B/x F/y, F/y M -> B/x M", x, w)
    reduce = shardops.psum if fixed else shardops.pmax
    return reduce("B/x M", y, axes="y")


def bias_on_partial(
    fixed: bool, x: f32[b"B/x F/y"], w: f32[b"F/y M"], b: f32[b"M"]
) -> f32[b"B/x M"]:
    y = shardops.einsum_unreduced("B/x F/y, F/y M -> B/x M", x, w)
    if fixed:
        return shardops.psum("B/x M", y, axes="y") + b
    return shardops.psum("B/x M", y + b, axes="y")


def square_of_partial(fixed: bool, x: f32[b"B/x F/y/z"], w: f32[b"F/y/z M"]) -> f32[b"B/x M"]:
    y = shardops.einsum_unreduced("B/x F/y/z, F/y/z M -> B/x M", x, w)
    if fixed:
        s = shardops.psum("B/x M", y, axes="y/z")
        return s * s
    return shardops.psum("B/x M", y * y, axes="y/z")


def relu_before_psum(fixed: bool, x: f32[b"B/x F/y"], w: f32[b"F/y M"]) -> f32[b"B/x M"]:
    y = shardops.einsum_unreduced("B/x F/y, F/y M -> B/x M", x, w)
    if fixed:
        return jax.nn.relu(shardops.psum("B/x M", y, axes="y"))
    return shardops.psum("B/x M", jax.nn.relu(y), axes="y")


def typed_helper(fixed: bool, x: f32[b"B/x F/y"], w: f32[b"F/y M"]) -> f32[b"B/x M"]:
    y = shardops.einsum_unreduced("B/x F/y, F/y M -> B/x M", x, w)
    if fixed:
        y = shardops.psum("B/x M", y, axes="y")
    return rms_norm(y)


def annotated_assignment(fixed: bool, x: f32[b"B/x F/y"], w: f32[b"F/y M"]) -> f32[b"B/x M"]:
    y = shardops.einsum_unreduced("B/x F/y, F/y M -> B/x M", x, w)
    r: f32[b"B/x M"] = shardops.psum("B/x M", y, axes="y") if fixed else y  # typeguard checks
    return jnp.cos(r)


def index_no_psum(
    fixed: bool, table: f32[b"V/y M"], tok: i32[b"B/x L"], w: f32[b"M N"]
) -> f32[b"B/x L N"]:
    e = shardops.index_unreduced("[V/y] M, B/x L -> B/x L M", table, tok)
    # A projection is linear: the lookup's pending sum is carried through it.
    h = shardops.einsum_unreduced("B/x L M, M N -> B/x L N", e, w)
    return shardops.psum("B/x L N", h, axes="y") if fixed else h


def einsum_split_pending(
    fixed: bool, x: f32[b"B/x F/y"], w1: f32[b"F/y M"], w2: f32[b"M N/y"]
) -> f32[b"B/x N/y"]:
    y = shardops.einsum_unreduced("B/x F/y, F/y M -> B/x M", x, w1)
    if fixed:
        y = shardops.psum("B/x M", y, axes="y")
    return shardops.einsum_unreduced("B/x M, M N/y -> B/x N/y", y, w2)


def scatter_one_of_two(fixed: bool, x: f32[b"B/x F/y/z"], w: f32[b"F/y/z M"]) -> f32[b"B/x M/y"]:
    y = shardops.einsum_unreduced("B/x F/y/z, F/y/z M -> B/x M", x, w)
    s = shardops.psum_scatter("B/x M -> B/x M/y", y)  # sums over 'y' only
    return shardops.psum("B/x M/y", s, axes="z") if fixed else s


def scan_pending_carry(
    fixed: bool, h: f32[b"B/x F"], w1: f32[b"K F G/y"], w2: f32[b"K G/y F"]
) -> f32[b"B/x F"]:
    def layer(h, w):
        a = shardops.einsum_unreduced("B/x F, F G/y -> B/x G/y", h, w[0])
        c = shardops.einsum_unreduced("B/x G/y, G/y F -> B/x F", a, w[1])
        return (jnp.tanh(shardops.psum("B/x F", c, axes="y")) if fixed else c), None

    return lax.scan(layer, h, (w1, w2))[0]


def declared_wrong(fixed: bool, x: f32[b"B/x F/z"], w: f32[b"F/z M"]) -> f32[b"B/x M"]:
    y = shardops.einsum_unreduced("B/x F/z, F/z M -> B/x M", x, w)
    return shardops.psum("B/x M {+z}" if fixed else "B/x M {+y}", y, axes="z")


def declared_wrong_output(fixed: bool, x: f32[b"B F/y"], w: f32[b"F/y M"]) -> f32[b"B M"]:
    spec = "B F/y, F/y M -> B M {+y}" if fixed else "B F/y, F/y M -> B M {+x}"
    y = shardops.einsum_unreduced(spec, x, w)
    return shardops.psum("B M {+y}", y, axes="y")


def add_mixed_pending(
    fixed: bool, x1: f32[b"B/x F/y"], w1: f32[b"F/y M"], x2: f32[b"B/x G/z"], w2: f32[b"G/z M"]
) -> f32[b"B/x M"]:
    y1 = shardops.einsum_unreduced("B/x F/y, F/y M -> B/x M", x1, w1)
    y2 = shardops.einsum_unreduced("B/x G/z, G/z M -> B/x M", x2, w2)
    if fixed:
        return shardops.psum("B/x M", y1, axes="y") + shardops.psum("B/x M", y2, axes="z")
    return shardops.psum("B/x M", y1 + y2, axes="y/z")


def remat_pending(fixed: bool, x: f32[b"B/x F/y"], w: f32[b"F/y M"]) -> f32[b"B/x M"]:
    def block(x, w):
        y = shardops.einsum_unreduced("B/x F/y, F/y M -> B/x M", x, w)
        return shardops.psum("B/x M", y, axes="y") if fixed else y

    return jnp.sin(jax.checkpoint(block)(x, w))


# -- backward: the loss of jax.grad forgets a reduction -----------------------------------------


def mse_loss(fixed: bool, x: f32[b"B/d F"], w: f32[b"F M"], t: f32[b"B/d M"]) -> f32[b""]:
    r = shardops.einsum_unreduced("B/d F, F M -> B/d M", x, w) - t
    local = shardops.einsum_unreduced("B/d M, B/d M ->", r, r)  # owes a sum over the batch
    return shardops.psum("", local, axes="d") if fixed else local


def xent_loss(fixed: bool, h: f32[b"B/x M/y"], w: f32[b"M/y V"], tgt: i32[b"B/x"]) -> f32[b""]:
    logits = shardops.einsum_unreduced("B/x M/y, M/y V -> B/x V", h, w)
    if fixed:
        logits = shardops.psum("B/x V", logits, axes="y")
    logp = jax.nn.log_softmax(logits, axis=-1)
    picked = jnp.take_along_axis(logp, tgt[:, None], axis=-1)[:, 0]
    return -shardops.psum("", picked.sum(), axes="x") / (picked.shape[0] * shardops.axis_size("x"))


def grad_of_loss(fixed: bool, x: f32[b"B/x F/y"], w: f32[b"F/y M"]) -> f32[b""]:
    y = shardops.einsum_unreduced("B/x F/y, F/y M -> B/x M", x, w)
    if fixed:
        y = shardops.psum("B/x M", y, axes="y")
    return shardops.psum("", jnp.sum(jnp.tanh(y)), axes="x")


@dataclass(frozen=True)
class Case:
    id: str
    body: Callable
    mesh: int  # index into MESHES
    args: Callable[[], tuple[np.ndarray, ...]]
    ref: Callable[..., Any]  # the intended result on global arrays
    creator: str  # the op and spec that made the partial sum: the error must name it
    error: type[Exception]
    also: tuple[str, ...] = ()  # more substrings the message must contain
    located: bool = True  # the message gives the creator's file:line
    grad: int | None = None  # differentiate the scalar result wrt this argument


def _args(*specs: tuple[int, tuple[int, ...]]) -> Callable[[], tuple[np.ndarray, ...]]:
    return lambda: tuple(normal(seed, shape) for seed, shape in specs)


def _index_args() -> tuple[np.ndarray, ...]:
    return normal(1, (16, 8)), tokens(2, (8, 4), 16), normal(3, (8, 4))


def _xent_args() -> tuple[np.ndarray, ...]:
    return normal(1, (8, 8)), normal(2, (8, 16)), tokens(3, (8,), 16)


def _mse_args() -> tuple[np.ndarray, ...]:
    return normal(1, (8, 16)), normal(2, (16, 4)) / 4, normal(3, (8, 4))


def _np_scan(h, w1, w2):
    for k in range(w1.shape[0]):
        h = np.tanh(h @ w1[k] @ w2[k])
    return h


def _np_xent(h, w, tgt):
    logits = jnp.asarray(h) @ w
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, tgt[:, None], axis=-1))


E = "einsum_unreduced"
CASES = [
    Case(
        "return-partial-sum",
        return_partial,
        0,
        _args((1, (8, 16)), (2, (16, 8))),
        lambda x, w: x @ w,
        f"{E}('B F/d, F/d M -> B M')",
        PendingReductionError,
        ("the return value", "owing a reduction over mesh axis 'd'", "shardops.psum"),
    ),
    Case(
        "psum-over-wrong-axis",
        psum_wrong_axis,
        2,
        _args((1, (8, 16)), (2, (16, 8))),
        lambda x, w: x @ w,
        f"{E}('B/x F/z, F/z M -> B/x M')",
        PendingReductionError,
        ("shardops.psum('B/x M')", "also sums over mesh axis 'y'", "mesh axis 'z'"),
    ),
    Case(
        "pmax-of-partial-sum",
        pmax_of_partial,
        1,
        _args((1, (8, 16)), (2, (16, 8))),
        lambda x, w: x @ w,
        f"{E}('B/x F/y, F/y M -> B/x M')",
        PendingReductionError,
        ("shardops.pmax('B/x M')", "The max of partial sums is not the max of the sums"),
    ),
    Case(
        "bias-on-partial-sum",
        bias_on_partial,
        1,
        _args((1, (8, 16)), (2, (16, 8)), (3, (8,))),
        lambda x, w, b: x @ w + b,
        f"{E}('B/x F/y, F/y M -> B/x M')",
        PendingReductionError,
        ("`add`", "combines a value that is not a partial sum", "once per device of mesh axis 'y'"),
    ),
    Case(
        "product-of-partial-sums",
        square_of_partial,
        2,
        _args((1, (8, 16)), (2, (16, 8))),
        lambda x, w: (x @ w) ** 2,
        f"{E}('B/x F/y/z, F/y/z M -> B/x M')",
        PendingReductionError,
        ("`mul`", "multiplies two partial sums", "mesh axes 'y', 'z'"),
    ),
    Case(
        "relu-before-psum",
        relu_before_psum,
        1,
        _args((1, (8, 16)), (2, (16, 8))),
        lambda x, w: np.maximum(x @ w, 0),
        f"{E}('B/x F/y, F/y M -> B/x M')",
        PendingReductionError,
        ("`max`", "is not linear"),
    ),
    Case(
        "typechecked-helper",
        typed_helper,
        1,
        _args((1, (8, 16)), (2, (16, 8))),
        lambda x, w: rms_ref(x @ w),
        f"{E}('B/x F/y, F/y M -> B/x M')",
        PendingReductionError,
        ("`mul`", "multiplies two partial sums"),
    ),
    Case(
        "annotated-assignment-in-the-body",
        annotated_assignment,
        2,
        _args((1, (8, 16)), (2, (16, 8))),
        lambda x, w: np.cos(x @ w),
        f"{E}('B/x F/y, F/y M -> B/x M')",
        PendingReductionError,
        ("`cos`", "is not linear"),
    ),
    Case(
        "index-unreduced-without-psum",
        index_no_psum,
        1,
        _index_args,
        lambda t, i, w: t[i] @ w,
        "index_unreduced('[V/y] M, B/x L -> B/x L M')",
        PendingReductionError,
        ("the return value", "mesh axis 'y'"),
    ),
    Case(
        "einsum-with-operand-split-over-pending-axis",
        einsum_split_pending,
        1,
        _args((1, (8, 16)), (2, (16, 8)), (3, (8, 6))),
        lambda x, w1, w2: x @ w1 @ w2,
        f"{E}('B/x F/y, F/y M -> B/x M')",
        PendingReductionError,
        ("`dot_general`", "differs across the devices of mesh axis 'y'"),
    ),
    Case(
        "psum-scatter-over-one-of-two-pending-axes",
        scatter_one_of_two,
        2,
        _args((1, (8, 16)), (2, (16, 8))),
        lambda x, w: x @ w,
        f"{E}('B/x F/y/z, F/y/z M -> B/x M')",
        PendingReductionError,
        ("the return value", "mesh axis 'z'"),
    ),
    Case(
        "scan-body-returns-pending-carry",
        scan_pending_carry,
        1,
        lambda: (normal(1, (8, 8)), normal(2, (2, 8, 8)) / 3, normal(3, (2, 8, 8)) / 3),
        _np_scan,
        f"{E}('B/x G/y, G/y F -> B/x F')",
        PendingReductionError,
        ("`scan`", "loop carry"),
    ),
    Case(
        "declared-+y-when-it-is-+z",
        declared_wrong,
        2,
        _args((1, (8, 16)), (2, (16, 8))),
        lambda x, w: x @ w,
        f"made by {E}('B/x F/z, F/z M -> B/x M')",
        SpecError,
        ("psum: the input is declared pending over 'y' ({+y}) but it is pending over 'z'",),
    ),
    Case(
        "einsum-output-declared-+x-when-it-is-+y",
        declared_wrong_output,
        1,
        _args((1, (8, 16)), (2, (16, 8))),
        lambda x, w: x @ w,
        f"{E}: the output is declared pending over 'x' ({{+x}}) but it is pending over 'y'",
        SpecError,
        ("the contracted dim 'F/y' is split", "'B F/y, F/y M -> B M {+x}'", "write '{+y}'"),
        located=False,
    ),
    Case(
        "add-partial-sums-over-different-axes",
        add_mixed_pending,
        2,
        _args((1, (8, 16)), (2, (16, 8)), (3, (8, 8)), (4, (8, 8))),
        lambda x1, w1, x2, w2: x1 @ w1 + x2 @ w2,
        f"{E}('B/x F/y, F/y M -> B/x M')",
        PendingReductionError,
        (f"{E}('B/x G/z, G/z M -> B/x M')", "must owe the same reduction"),
    ),
    Case(
        "checkpointed-block-returns-partial-sum",
        remat_pending,
        1,
        _args((1, (8, 16)), (2, (16, 8))),
        lambda x, w: np.sin(x @ w),
        f"{E}('B/x F/y, F/y M -> B/x M')",
        PendingReductionError,
        ("`sin`", "is not linear"),
    ),
    Case(
        "grad-of-loss-without-psum",
        mse_loss,
        0,
        _mse_args,
        lambda x, w, t: jnp.sum((x @ w - t) ** 2),
        f"{E}('B/d M, B/d M ->')",
        PendingReductionError,
        ("the return value", "mesh axis 'd'"),
        grad=1,
    ),
    Case(
        "grad-of-cross-entropy-on-partial-logits",
        xent_loss,
        1,
        _xent_args,
        _np_xent,
        f"{E}('B/x M/y, M/y V -> B/x V')",
        PendingReductionError,
        ("`reduce_max`", "is not linear"),
        grad=1,
    ),
    Case(
        "grad-through-tanh-of-partial-sum",
        grad_of_loss,
        1,
        _args((1, (8, 16)), (2, (16, 8))),
        lambda x, w: jnp.sum(jnp.tanh(x @ w)),
        f"{E}('B/x F/y, F/y M -> B/x M')",
        PendingReductionError,
        ("`tanh`", "is not linear"),
        grad=0,
    ),
]

_WRAPPED: dict[tuple[str, bool], Callable] = {}


def program(case: Case, fixed: bool, check_vma: bool) -> Callable:
    """The case's jitted program: the typed_shard_map, or the gradient of its scalar."""
    key = (case.id, check_vma)
    if key not in _WRAPPED:
        _WRAPPED[key] = typed_shard_map(case.body, static_argnames=("fixed",), check_vma=check_vma)
    f = _WRAPPED[key]

    def run(*args):
        if case.grad is None:
            return f(fixed, *args)
        g = case.grad
        return jax.grad(lambda a: f(fixed, *args[:g], a, *args[g + 1 :]))(args[g])

    return jax.jit(run)


def reference(case: Case, args: tuple[np.ndarray, ...]) -> np.ndarray:
    if case.grad is None:
        return np.asarray(case.ref(*args))
    g = case.grad

    def scalar(a):
        return case.ref(*args[:g], a, *args[g + 1 :])

    return np.asarray(jax.grad(scalar)(jnp.asarray(args[g])))


def test_catalogue_size_and_meshes() -> None:
    assert issubclass(PendingReductionError, TypeCheckError)
    assert len(CASES) >= 15
    assert len({c.id for c in CASES}) == len(CASES)
    assert {c.mesh for c in CASES} == {0, 1, 2}  # 1-D, 2-D and 3-D meshes
    assert sum(c.grad is not None for c in CASES) >= 3  # backward programs


@pytest.mark.parametrize("check_vma", [False, True], ids=["vma-off", "vma-on"])
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_forgotten_reduction_fails_at_trace_time(case: Case, check_vma: bool) -> None:
    args = case.args()
    with jax.set_mesh(mesh_of(case.mesh)), pytest.raises(case.error) as info:
        program(case, False, check_vma).trace(*args)  # tracing only: nothing is compiled
    msg = str(info.value)
    for needle in (case.creator, *case.also):
        assert needle in msg, f"{needle!r} not in:\n{msg}"
    if case.located:
        spec = re.search(r"\('([^']*)'\)", case.creator).group(1)  # type: ignore[union-attr]
        line = line_of(case.body, '"' + spec + '"')
        where = f"test_pending.py:{line}"
        assert where in msg, f"{where!r} not in:\n{msg}"


@pytest.mark.parametrize("check_vma", [False, True], ids=["vma-off", "vma-on"])
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_with_the_reduction_in_place_matches_reference(case: Case, check_vma: bool) -> None:
    args = case.args()
    with jax.set_mesh(mesh_of(case.mesh)):
        out = program(case, True, check_vma)(*args)
    np.testing.assert_allclose(np.asarray(out), reference(case, args), rtol=2e-5, atol=2e-5)


# ---------------------------------------------------------------------------------------------
# Tracking rules, with values
# ---------------------------------------------------------------------------------------------


def tracking_body(
    x: f32[b"B/x F/z"], w: f32[b"F/z M"], x2: f32[b"B/x F/z"], w2: f32[b"M N"], m: f32[b"B/x M"]
) -> tuple[
    f32[b"B/x M"],
    f32[b"B/x M"],
    f32[b"B/x M"],
    f32[b"B/x M"],
    f32[b"B/x N"],
    f32[b"B/x M"],
    f32[b"M B/x"],
    f32[b"B/x"],
    f32[b"B/x M"],
    f32[b"B/x M"],
    f32[b"B/x M"],
]:
    y = shardops.einsum_unreduced("B/x F/z, F/z M -> B/x M", x, w)
    y2 = shardops.einsum_unreduced("B/x F/z, F/z M -> B/x M", x2, w)
    y = expect_pending(y, ("z",))

    def red(v: Any, spec: str = "B/x M") -> jax.Array:
        return shardops.psum(spec, expect_pending(v, ("z",)), axes="z")

    gathered = shardops.all_gather("B/x M -> B M", y)  # keeps 'z'
    # A different reduction, over an axis it varies over: still owes 'z'.
    other = shardops.psum("B/x M", y * shardops.axis_index("y"), axes="y")
    return (
        # The gathered sum, then this device's rows of it again.
        lax.dynamic_slice_in_dim(
            red(gathered, "B M"), shardops.axis_index("x") * y.shape[0], y.shape[0]
        ),
        red(y + y2 - 0.5 * y),  # + and - of partial sums over the same axes, scaling
        red(other),
        shardops.pmean("B/x M", y, axes="z"),  # the sum divided by |z|: clears 'z'
        red(shardops.einsum_unreduced("B/x M, M N -> B/x N", y, w2), "B/x N"),
        red(sum([y, -y2, y2 / 2])),  # builtin sum starts from 0: 0 + y is y
        red(y.T, "M B/x"),
        red(y.sum(-1), "B/x"),
        red(shardops.linear(lambda v, mask: jnp.where(mask > 0, v, 0.0), y, m)),
        # A bias folded into the sum: added on one device of 'z' only (the hint's recipe).
        red(shardops.linear(lambda v: v + w2[:, 0] * (shardops.axis_index("z") == 0), y)),
        red(jnp.float32(2) * y.astype(jnp.bfloat16).astype(jnp.float32).reshape(y.shape)),
    )


@pytest.mark.parametrize("check_vma", [False, True], ids=["vma-off", "vma-on"])
def test_tracking_rules_give_the_reference_values(check_vma: bool) -> None:
    mesh = mesh_of(2)
    x, w, x2 = normal(1, (8, 16)), normal(2, (16, 8)), normal(3, (8, 16))
    w2, m = normal(4, (8, 4)), normal(5, (8, 8))
    f = jax.jit(typed_shard_map(tracking_body, check_vma=check_vma))
    with jax.set_mesh(mesh):
        out = [np.asarray(o) for o in f(x, w, x2, w2, m)]
    y, y2 = x @ w, x2 @ w
    bf = np.asarray(jnp.asarray(y).astype(jnp.bfloat16).astype(jnp.float32))
    expected = [
        y,
        y + y2 - 0.5 * y,
        y,  # psum over 'y' (size 2) of y * axis_index('y'): 0 * y + 1 * y
        y / 2,  # pmean over 'z' (size 2) of a partial sum is the sum / |z|
        y @ w2,
        y - y2 + y2 / 2,
        y.T,
        y.sum(-1),
        np.where(m > 0, y, 0.0),
        y + w2[:, 0],
        None,  # bf16 round trip: compared below with a looser tolerance
    ]
    for k, (o, e) in enumerate(zip(out[:-1], expected[:-1], strict=True)):
        np.testing.assert_allclose(o, e, rtol=1e-5, atol=1e-5, err_msg=f"output {k}")
    # The bf16 cast is applied to each partial sum before the reduction.
    np.testing.assert_allclose(out[-1], 2 * bf, rtol=2e-2, atol=2e-2)


def test_escape_hatches_on_plain_arrays() -> None:
    """``linear`` and ``assume_reduced`` outside a body: they compute what they say."""
    v = jnp.arange(6.0).reshape(2, 3)
    np.testing.assert_array_equal(np.asarray(shardops.assume_reduced(v)), np.asarray(v))
    np.testing.assert_array_equal(np.asarray(shardops.linear(jnp.transpose, v)), np.asarray(v).T)
    with pytest.raises(TypeError, match="fn returned tuple"):
        shardops.linear(lambda a: (a, a), v)


# Operations JAX users apply to a partial sum before reducing it. LINEAR_OPS are linear
# (the program is right: it must run and match the reference); NONLINEAR_OPS are not (the
# program must be refused at trace time, naming the op that made the partial sum).
LINEAR_OPS: dict[str, tuple[Callable[[Any], Any], Callable[[Any], Any]]] = {
    "jnp.where(True, y, 0)": (lambda y: jnp.where(True, y, 0.0), lambda y: y),
    "jnp.sum(axis=1)": (
        lambda y: jnp.sum(y, axis=1, keepdims=True) * jnp.ones((1, 8)),
        lambda y: y.sum(1, keepdims=True) * np.ones((1, 8)),
    ),
    "jnp.einsum": (lambda y: jnp.einsum("ij->ji", y).T, lambda y: y),
    "jnp.dot(ones)": (lambda y: jnp.dot(y, jnp.ones((8, 8))), lambda y: y @ np.ones((8, 8))),
    "lax.add(y, y)": (lambda y: lax.add(y, y), lambda y: 2 * y),
    "lax.stop_gradient": (lax.stop_gradient, lambda y: y),
    "jax.checkpoint": (lambda y: jax.checkpoint(lambda a: a * 3)(y), lambda y: 3 * y),
    "jax.jit": (lambda y: jax.jit(lambda a: a * 2)(y), lambda y: 2 * y),
    "jax.vmap": (jax.vmap(lambda r: r[::-1]), lambda y: y[:, ::-1]),
    "lax.cond": (
        lambda y: lax.cond(True, lambda a: a * 2, lambda a: -a, y),
        lambda y: 2 * y,
    ),
    "lax.fori_loop": (
        lambda y: lax.fori_loop(0, 3, lambda i, acc: acc + y, jnp.zeros_like(y)),
        lambda y: 3 * y,
    ),
    "bf16 round trip": (
        lambda y: y.astype(jnp.bfloat16).astype(jnp.float32),
        None,  # rounds each share: compared loosely
    ),
    "concatenate halves": (lambda y: jnp.concatenate([y[:, :4], y[:, 4:]], 1), lambda y: y),
    "pad with zeros": (lambda y: jnp.pad(y, ((0, 0), (1, 0)))[:, 1:], lambda y: y),
}
NONLINEAR_OPS: dict[str, Callable[[Any], Any]] = {
    "jax.nn.relu": jax.nn.relu,
    "jnp.exp": jnp.exp,
    "jnp.maximum": lambda y: jnp.maximum(y, 0.0),
    "y.max()": lambda y: y.max() * jnp.ones_like(y),
    "array + y": lambda y: jnp.ones(8) + y,
    "y * y": lambda y: y * y,
    "1 / y": lambda y: 1.0 / y,
    "abs": jnp.abs,
    "int cast": lambda y: y.astype(jnp.int32).astype(jnp.float32),
    "pad with ones": lambda y: jnp.pad(y, ((0, 0), (1, 0)), constant_values=1.0)[:, 1:],
    "where(y > 0)": lambda y: jnp.where(y > 0, y, 0.0),
    "jit(relu)": lambda y: jax.jit(jax.nn.relu)(y),
    "cond on the value": lambda y: lax.cond(y.sum() > 0, lambda a: a, lambda a: -a, y),
}


def _misuse_body(op: Callable[[Any], Any]) -> Callable:
    def body(x: f32[b"B F/d"], w: f32[b"F/d M"]) -> f32[b"B M"]:
        y = shardops.einsum_unreduced("B F/d, F/d M -> B M", x, w)
        return shardops.psum("B M", op(y), axes="d")

    return body


@pytest.mark.parametrize("check_vma", [False, True], ids=["vma-off", "vma-on"])
@pytest.mark.parametrize("name", list(LINEAR_OPS))
def test_linear_ops_on_partial_sums_match_reference(name: str, check_vma: bool) -> None:
    op, ref = LINEAR_OPS[name]
    x, w = normal(1, (8, 16)), normal(2, (16, 8))
    f = jax.jit(typed_shard_map(_misuse_body(op), check_vma=check_vma))
    with jax.set_mesh(mesh_of(0)):
        out = np.asarray(f(x, w))
    if ref is None:
        np.testing.assert_allclose(out, x @ w, rtol=5e-2, atol=5e-2)
    else:
        np.testing.assert_allclose(out, ref(x @ w), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("check_vma", [False, True], ids=["vma-off", "vma-on"])
@pytest.mark.parametrize("name", list(NONLINEAR_OPS))
def test_nonlinear_ops_name_the_origin(name: str, check_vma: bool) -> None:
    body = _misuse_body(NONLINEAR_OPS[name])
    f = jax.jit(typed_shard_map(body, check_vma=check_vma))
    with jax.set_mesh(mesh_of(0)), pytest.raises(PendingReductionError) as info:
        f.trace(normal(1, (8, 16)), normal(2, (16, 8)))
    msg = str(info.value)
    assert "einsum_unreduced('B F/d, F/d M -> B M')" in msg, msg
    assert f"test_pending.py:{line_of(_misuse_body, 'einsum_unreduced')}" in msg, msg
    assert "owing a reduction over mesh axis 'd'" in msg, msg


# ---------------------------------------------------------------------------------------------
# Declarations: checked where written
# ---------------------------------------------------------------------------------------------


def declared_body(
    x: f32[b"B/x F/y/z"], w: f32[b"F/y/z M"], table: f32[b"V/y M"], tok: i32[b"B/x"]
) -> tuple[f32[b"B/x M/y"], f32[b"B M/x"], f32[b"B M"], f32[b"B/x M"]]:
    y = shardops.einsum_unreduced("B/x F/y/z, F/y/z M -> B/x M {+y+z}", x, w)
    s = shardops.psum_scatter("B/x M {+z+y} -> B/x M/y {+z}", y)  # order does not matter
    s = shardops.psum("B/x M/y {+z}", s, axes="z")
    z_only = shardops.psum("B/x M {+y+z}", y, axes="y")
    a = shardops.all_to_all("B/x M {+z} -> B M/x {+z}", z_only)
    a = shardops.psum("B M/x {+z}", a, axes="z")
    g = shardops.all_gather("B/x M {+z} -> B M {+z}", z_only)
    g = shardops.psum("B M {+z}", g, axes="z")
    e = shardops.index_unreduced("[V/y] M, B/x -> B/x M {+y}", table, tok)
    e = shardops.psum("B/x M {+y}", e, axes="y")
    return s, a, g, e


def test_correct_declarations_pass_and_match_reference() -> None:
    x, w, table, tok = normal(1, (8, 16)), normal(2, (16, 8)), normal(3, (16, 8)), None
    tok = tokens(4, (8,), 16)
    # check_vma=False: the all_gather result is typed as varying over 'x' by JAX.
    f = jax.jit(typed_shard_map(declared_body, check_vma=False))
    with jax.set_mesh(mesh_of(2)):
        s, a, g, e = (np.asarray(o) for o in f(x, w, table, tok))
    for k, o in enumerate((s, a, g)):
        np.testing.assert_allclose(o, x @ w, rtol=1e-5, atol=1e-5, err_msg=f"output {k}")
    np.testing.assert_allclose(e, table[tok], rtol=1e-6)


def _einsum_yz(x: jax.Array, w: jax.Array) -> jax.Array:
    return shardops.einsum_unreduced("B/x F/y/z, F/y/z M -> B/x M", x, w)


# (id, op on x 'B/x F/y/z' and w 'F/y/z M', the spec, where its wrong clause starts, message)
MISDECLARED: list[tuple[str, Callable, str, int, tuple[str, ...]]] = [
    (
        "einsum-output-missing-an-axis",
        lambda x, w: shardops.einsum_unreduced("B/x F/y/z, F/y/z M -> B/x M {+y}", x, w),
        "B/x F/y/z, F/y/z M -> B/x M {+y}",
        "B/x F/y/z, F/y/z M -> B/x M {+y}".index("{"),
        (
            "einsum_unreduced: the output is declared pending over 'y' ({+y}) but it is "
            "pending over 'y', 'z' ({+y+z}): the contracted dim 'F/y/z' is split",
            "hint: write '{+y+z}'",
        ),
    ),
    (
        "psum-scatter-output-nothing-left",
        lambda x, w: shardops.psum_scatter(
            "B/x M -> B/x M/y {+z}", shardops.psum("B/x M", _einsum_yz(x, w), axes="z")
        ),
        "B/x M -> B/x M/y {+z}",
        "B/x M -> B/x M/y {+z}".index("{"),
        (
            "psum_scatter: the output is declared pending over 'z' ({+z}) but it is not a "
            "partial sum (nothing is pending): this sums over 'y'",
            "hint: remove '{+z}'",
        ),
    ),
    (
        "psum-input-already-reduced",
        lambda x, w: shardops.psum(
            "B/x M {+y}", shardops.psum("B/x M", _einsum_yz(x, w), axes="y/z"), axes="y"
        ),
        "B/x M {+y}",
        "B/x M {+y}".index("{"),
        ("psum: the input is declared pending over 'y' ({+y}) but it is not a partial sum",),
    ),
    (
        "all-gather-input-missing-an-axis",
        lambda x, w: shardops.all_gather("B/x M {+z} -> B M {+z}", _einsum_yz(x, w)),
        "B/x M {+z} -> B M {+z}",
        "B/x M {+z} -> B M {+z}".index("{"),  # the input's clause, not the output's
        (
            "all_gather: the input is declared pending over 'z' ({+z}) but it is pending over "
            "'y', 'z' ({+y+z}), made by einsum_unreduced('B/x F/y/z, F/y/z M -> B/x M') at "
            "test_pending.py:",
        ),
    ),
    (
        "all-gather-output-after-a-right-input",
        lambda x, w: shardops.all_gather("B/x M {+y+z} -> B M {+z}", _einsum_yz(x, w)),
        "B/x M {+y+z} -> B M {+z}",
        "B/x M {+y+z} -> B M {+z}".rindex("{"),  # the output's clause, not the input's
        (
            "all_gather: the output is declared pending over 'z' ({+z}) but it is pending over "
            "'y', 'z' ({+y+z}): all_gather keeps the pending axes of its input",
        ),
    ),
    (
        "einsum-second-operand-not-pending",
        lambda x, w: shardops.einsum_unreduced("B/x F/y/z, F/y/z M {+x} -> B/x M", x, w),
        "B/x F/y/z, F/y/z M {+x} -> B/x M",
        "B/x F/y/z, F/y/z M {+x} -> B/x M".index("{"),
        ("einsum_unreduced: the operand 1 is declared pending over 'x' ({+x}) but it is not",),
    ),
]


@pytest.mark.parametrize("case", MISDECLARED, ids=[c[0] for c in MISDECLARED])
def test_wrong_declaration_says_what_is_pending_and_why(case) -> None:
    _, op, spec, at, parts = case

    def body(x: f32[b"B/x F/y/z"], w: f32[b"F/y/z M"]) -> f32[b"B/x M"]:
        op(x, w)
        return jnp.zeros((x.shape[0], 8))  # the analysis of the body refuses it

    f = jax.jit(typed_shard_map(body, check_vma=False))
    with jax.set_mesh(mesh_of(2)), pytest.raises(SpecError) as info:
        f.trace(normal(1, (8, 16)), normal(2, (16, 8)))
    msg = str(info.value)
    for part in parts:
        assert part in msg, f"{part!r} not in:\n{msg}"
    # The caret underlines the wrong clause.
    lines = msg.splitlines()
    k = next(i for i, line in enumerate(lines) if line.strip() == repr(spec))
    col = lines[k].index("'") + 1 + at
    width = spec.index("}", at) - at + 1
    assert lines[k + 1] == " " * col + "^" * width, f"caret misplaced:\n{lines[k]}\n{lines[k + 1]}"


@settings(max_examples=30, deadline=None)
@given(st.data())
def test_pending_axes_are_the_split_contracted_dims_axes(data) -> None:
    """Property: the inferred pending axes are the contracted dim's mesh axes; declaring
    exactly those (in any order) passes, declaring any other set is a SpecError."""
    i = data.draw(st.sampled_from([0, 1, 2]), label="mesh")
    names = MESHES[i][1]
    order = data.draw(st.permutations(names), label="axes order")
    split = tuple(order[: data.draw(st.integers(1, len(names)), label="how many")])
    declared = data.draw(
        st.none() | st.lists(st.sampled_from(names), min_size=1, unique=True).map(tuple),
        label="declared",
    )
    fdim = "/".join(("F", *split))
    clause = "" if declared is None else " {" + "".join("+" + a for a in declared) + "}"
    spec = f"B {fdim}, {fdim} M -> B M{clause}"

    def body(x, w):
        y = expect_pending(shardops.einsum_unreduced(spec, x, w), split)
        return shardops.psum("B M", y, axes=split)

    body.__annotations__ = {
        "x": f32[f"B {fdim}".encode()],
        "w": f32[f"{fdim} M".encode()],
        "return": f32[b"B M"],
    }
    f = typed_shard_map(body, check_vma=False)
    x, w = normal(1, (2, 16)), normal(2, (16, 3))
    with jax.set_mesh(mesh_of(i)):
        if declared is None or set(declared) == set(split):
            jax.jit(f).trace(x, w)
        else:
            with pytest.raises(SpecError, match=re.escape(f"({clause.strip()}) but it is")):
                jax.jit(f).trace(x, w)


# ---------------------------------------------------------------------------------------------
# Gradients: a training step
# ---------------------------------------------------------------------------------------------


@pytree_dataclass
class MLP:
    w1: f32[b"M/x F/y"]  # FSDP over 'x', tensor-parallel over 'y'
    w2: f32[b"F/y M/x"]


def mlp_loss(forget: bool, x: f32[b"B/x M"], t: f32[b"B/x M"], p: MLP) -> f32[b""]:
    w1 = shardops.all_gather("M/x F/y -> M F/y", p.w1)
    h = jax.nn.relu(shardops.einsum_unreduced("B/x M, M F/y -> B/x F/y", x, w1))
    w2 = shardops.all_gather("F/y M/x -> F/y M", p.w2)
    o = shardops.einsum_unreduced("B/x F/y, F/y M -> B/x M", h, w2)
    if not forget:
        o = shardops.psum("B/x M", o, axes="y")
    r = o - t
    local = shardops.einsum_unreduced("B/x M, B/x M ->", r, r)
    return shardops.psum("", local, axes="x") / (r.shape[0] * shardops.axis_size("x"))


def mlp_ref(p: MLP, x: jax.Array, t: jax.Array) -> jax.Array:
    return jnp.mean(jnp.sum((jax.nn.relu(x @ p.w1) @ p.w2 - t) ** 2, axis=-1))


def make_step(check_vma: bool, forget: bool) -> Callable:
    loss = typed_shard_map(mlp_loss, static_argnames=("forget",), check_vma=check_vma)

    def step(p: MLP, x: jax.Array, t: jax.Array) -> tuple[jax.Array, MLP, MLP]:
        value, g = jax.value_and_grad(lambda p: loss(forget, x, t, p))(p)
        return value, g, jax.tree.map(lambda w, gw: w - 0.1 * gw, p, g)

    return jax.jit(step)


@pytest.mark.parametrize("check_vma", [False, True], ids=["vma-off", "vma-on"])
def test_training_step_catches_forgotten_psum_before_compiling(check_vma: bool) -> None:
    mesh = mesh_of(1)
    with jax.set_mesh(mesh):
        p = jax.device_put(
            MLP(w1=normal(1, (8, 16)) / 3, w2=normal(2, (16, 8)) / 4), make_shardings(MLP)
        )
        x = place(normal(3, (8, 8)), mesh, "B/x M")
        t = place(normal(4, (8, 8)), mesh, "B/x M")
        compiles: list[str] = []

        def listen(event: str, *_: Any, **__: Any) -> None:
            if event == "/jax/core/compile/backend_compile_duration":
                compiles.append(event)

        jax.monitoring.register_event_duration_secs_listener(listen)
        try:
            with pytest.raises(PendingReductionError) as info:
                make_step(check_vma, forget=True)(p, x, t)  # a real call, not only trace()
            assert compiles == [], "the broken step was compiled before failing"
            with pytest.raises(PendingReductionError):
                make_step(check_vma, forget=True).trace(p, x, t)
            value, g, new = make_step(check_vma, forget=False)(p, x, t)
            assert compiles, "the compile listener saw nothing: the check above is vacuous"
        finally:
            jax.monitoring.unregister_event_duration_listener(listen)
    msg = str(info.value)
    assert "combines a value that is not a partial sum with" in msg, msg
    assert "einsum_unreduced('B/x F/y, F/y M -> B/x M')" in msg, msg
    assert f"test_pending.py:{line_of(mlp_loss, 'F/y M -> B/x M')}" in msg, msg

    host = jax.device_get(p)
    want_value, want_g = jax.value_and_grad(mlp_ref)(host, normal(3, (8, 8)), normal(4, (8, 8)))
    np.testing.assert_allclose(float(value), float(want_value), rtol=1e-5)
    expected = make_shardings(MLP, mesh=mesh)
    for name in ("w1", "w2"):
        got, want = getattr(g, name), getattr(want_g, name)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-5)
        sharding = getattr(expected, name)
        for arr in (got, getattr(new, name)):
            assert isinstance(arr.sharding, NamedSharding), name
            assert arr.sharding.is_equivalent_to(sharding, arr.ndim), (
                f"{name}: {arr.sharding.spec} vs {sharding.spec}"
            )


# ---------------------------------------------------------------------------------------------
# docs/guide/pending.md quotes real error text
# ---------------------------------------------------------------------------------------------


def mlp(x: f32[b"B/d M"], w_in: f32[b"M F/t"], w_out: f32[b"F/t M"]) -> f32[b"B/d M"]:
    h = jax.nn.relu(shardops.einsum_unreduced("B/d M, M F/t -> B/d F/t", x, w_in))
    y = shardops.einsum_unreduced("B/d F/t, F/t M -> B/d M", h, w_out)
    return y  # forgot: shardops.psum("B/d M", y, axes="t")


def mlp_relu_first(x: f32[b"B/d M"], w_in: f32[b"M F/t"], w_out: f32[b"F/t M"]) -> f32[b"B/d M"]:
    h = jax.nn.relu(shardops.einsum_unreduced("B/d M, M F/t -> B/d F/t", x, w_in))
    y = shardops.einsum_unreduced("B/d F/t, F/t M -> B/d M", h, w_out)
    return shardops.psum("B/d M", jax.nn.relu(y), axes="t")


def _normalized(text: str) -> str:
    """Error text with file names, line numbers and addresses replaced by placeholders."""
    text = re.sub(r"[\w.]+\.py:\d+", "FILE:LINE", text)
    return re.sub(r" at 0x[0-9a-f]+", "", text)


@pytest.mark.parametrize("body", [mlp, mlp_relu_first], ids=["return", "relu"])
def test_docs_quote_the_real_error(body: Callable) -> None:
    mesh = make_mesh((4, 2), ("d", "t"))
    f = jax.jit(typed_shard_map(body))
    with jax.set_mesh(mesh), pytest.raises(PendingReductionError) as info:
        f.trace(normal(1, (8, 8)), normal(2, (8, 16)), normal(3, (16, 8)))
    doc = _normalized((Path(__file__).parent.parent / "docs" / "guide" / "pending.md").read_text())
    msg = str(info.value).splitlines()[0]  # shardlib's own message: quoted whole
    assert _normalized(msg) in doc, f"docs/guide/pending.md lacks:\n{msg}"


# ---------------------------------------------------------------------------------------------
# Summing copies: with check_vma=True JAX knows when a value is the same on every device.
# ---------------------------------------------------------------------------------------------


def test_pmean_of_gradient_already_summed_by_jax_is_an_error():
    """jax.grad w.r.t. a replicated weight inside the body is already summed over 'd'."""
    mesh = jax.make_mesh((8,), ("d",))
    x = np.arange(16.0, dtype=np.float32)
    w = np.ones((1,), np.float32)

    def make(check_vma, pcast):
        @typed_shard_map(check_vma=check_vma)
        def grads(x: f32[b"B/d"], w: f32[b"1"]) -> f32[b"1"]:
            w_ = jax.lax.pcast(w, "d", to="varying") if pcast else w
            g = jax.grad(lambda v: jnp.mean(x * v))(w_)
            return shardops.pmean("1", g, axes="d")

        return grads

    with jax.set_mesh(mesh):
        with pytest.raises(
            ValueError, match=r"pmean\('1'\).*same on every device of mesh axis 'd'"
        ):
            jax.jit(make(True, False)).trace(x, w)
        # Per-device parts (pcast to varying), then the mean: the true gradient.
        good = jax.jit(make(True, True))(x, w)
        np.testing.assert_allclose(np.asarray(good), [x.mean()], rtol=1e-6)
        # check_vma=False: JAX does not track it, the gradient is per device, the mean right.
        off = jax.jit(make(False, False))(x, w)
        np.testing.assert_allclose(np.asarray(off), [x.mean()], rtol=1e-6)


@pytest.mark.parametrize("check_vma", [False, True], ids=["vma-off", "vma-on"])
def test_psum_of_a_replicated_value_is_an_error(check_vma: bool):
    mesh = jax.make_mesh((4, 2), ("d", "t"))

    @typed_shard_map(check_vma=check_vma)
    def f(x: f32[b"B/d"]) -> f32[b"B/d"]:
        return shardops.psum("B/d", x, axes="t")  # x is the same on both devices of 't'

    with jax.set_mesh(mesh), pytest.raises(ValueError, match="multiply it by the axis size"):
        jax.jit(f).trace(np.ones(8, np.float32))


def _raw_psum(spec: Any, x: jax.Array, axes: Any) -> jax.Array:
    """``shardops.psum`` as seqax-era code writes it: ``jax.lax.psum`` (the spec is unused)."""
    names = tuple(axes.split("/")) if isinstance(axes, str) else tuple(axes)
    return lax.psum(x, names)


# Declarations ('{+z}' clauses) are a shardops feature: raw lax.psum has no spec to declare in.
RAW_CASES = [c for c in CASES if c.error is not SpecError]


@pytest.mark.parametrize("check_vma", [False, True], ids=["vma-off", "vma-on"])
@pytest.mark.parametrize("case", RAW_CASES, ids=[c.id for c in RAW_CASES])
def test_catalogue_with_raw_lax_psum(case: Case, check_vma: bool, monkeypatch) -> None:
    """The same catalogue with every shardops.psum written as jax.lax.psum: the fixed
    programs match the reference, the broken ones are still refused at trace time."""
    monkeypatch.setattr(shardops, "psum", _raw_psum)
    body = typed_shard_map(case.body, static_argnames=("fixed",), check_vma=check_vma)

    def run(fixed: bool) -> Callable:
        def f(*args):
            if case.grad is None:
                return body(fixed, *args)
            g = case.grad
            return jax.grad(lambda a: body(fixed, *args[:g], a, *args[g + 1 :]))(args[g])

        return jax.jit(f)

    args = case.args()
    with jax.set_mesh(mesh_of(case.mesh)):
        out = run(True)(*args)
        with pytest.raises(PendingReductionError):
            run(False).trace(*args)
    np.testing.assert_allclose(np.asarray(out), reference(case, args), rtol=2e-5, atol=2e-5)
