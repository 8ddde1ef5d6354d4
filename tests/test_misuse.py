"""A catalogue of wrong uses of shardlib: each one fails with a clear, specific error.

Every entry of ``CASES`` is one misuse: a callable that commits it, the exception type it
must raise and the substrings its message must contain: the offending argument, dim or mesh
axis, and expected vs actual where there are two. ``docs/reliability.md`` lists the same
catalogue with the actual messages and their fixes.

typeguard instruments only functions whose annotations use module-level names, so the
checked functions used here live at module level.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from typeguard import TypeCheckError, typechecked

from shardlib import SpecError, axis_rules, shardops
from shardlib.shardops import PendingReductionError
from shardlib.shardtypes import (
    Array,
    Scope,
    check,
    f32,
    is_fully_sharded,
    make_shardings,
    pytree_dataclass,
    typed_shard_map,
)
from tests._mesh_util import make_mesh, place

MESH = make_mesh((8,), ("d",))
MESH2 = make_mesh((4, 2), ("x", "y"))
AUTO = make_mesh((8,), ("d",), auto=True)


def zeros(*shape: int, dtype: Any = np.float32) -> np.ndarray:
    return np.zeros(shape, dtype)


def on(mesh: Any, fn: Callable[[], Any]) -> Callable[[], Any]:
    """``fn`` run under ``jax.set_mesh(mesh)``."""

    def run() -> Any:
        with jax.set_mesh(mesh):
            return fn()

    return run


# ---------------------------------------------------------------------------------------------
# Checked functions (module level, so that typeguard instruments them)
# ---------------------------------------------------------------------------------------------


@typechecked
def rows(x: f32[b"batch len"], y: f32[b"batch"]) -> f32[b"batch"]:
    return y + x.sum(1)


@typechecked
def two_by_three(x: f32[b"2 3"]) -> f32[b"2 3"]:
    return x


@typechecked
def diagonal(x: f32[b"n n"]) -> f32[b"n"]:
    return jnp.diagonal(x)


@typechecked
def doubles_length(x: f32[b"n"]) -> f32[b"n"]:
    return jnp.concatenate([x, x])


@typechecked
def split_rows(x: f32[b"a/d b"]) -> f32[b"a/d b"]:
    return x * 2


@typechecked
def wants_reduced(y: f32[b"B F"]) -> f32[b"B F"]:
    return y


@typed_shard_map
def tsm_double(x: f32[b"batch/d len"]) -> f32[b"batch/d len"]:
    return x * 2


@typed_shard_map
def tsm_bad_return(x: f32[b"batch/d len"]) -> f32[b"batch/d len"]:
    return x[:, :1]


@typed_shard_map
def tsm_returns_tuple(x: f32[b"batch/d len"]) -> f32[b"batch/d len"]:
    return x, x


@typed_shard_map
def tsm_returns_unreduced(x: f32[b"B M/d"], w: f32[b"M/d F"]) -> f32[b"B F"]:
    return shardops.einsum_unreduced("B M/d, M/d F -> B F", x, w)


@typed_shard_map
def tsm_passes_unreduced(x: f32[b"B M/d"], w: f32[b"M/d F"]) -> f32[b"B F"]:
    y = shardops.einsum_unreduced("B M/d, M/d F -> B F", x, w)
    return wants_reduced(y)


@typed_shard_map
def tsm_exp_of_unreduced(x: f32[b"B M/d"], w: f32[b"M/d F"]) -> f32[b"B F"]:
    y = shardops.einsum_unreduced("B M/d, M/d F -> B F", x, w)
    return shardops.psum("B F", jnp.exp(y), axes="d")


@typed_shard_map
def tsm_cond_per_device(x: f32[b"B M/d"], w: f32[b"M/d F"]) -> f32[b"B F"]:
    def make(k: float) -> Callable[[], jax.Array]:
        return lambda: k * shardops.einsum_unreduced("B M/d, M/d F -> B F", x, w)

    y = jax.lax.cond(shardops.axis_index("d") == 0, make(1.0), make(2.0))
    return shardops.psum("B F", y, axes="d")


@typed_shard_map
def tsm_tangent_of_unreduced(x: f32[b"B M/d"], w: f32[b"M/d F"]) -> f32[b"B F"]:
    _, t = jax.jvp(lambda v: shardops.einsum_unreduced("B M/d, M/d F -> B F", v, w), (x,), (x,))
    return shardops.psum("B F", jnp.tanh(t), axes="d")


@typed_shard_map
def tsm_unreduced_as_selector(x: f32[b"B M/d"], w: f32[b"M/d F"]) -> f32[b"B F"]:
    xi, wi = x.astype(jnp.int32), w.astype(jnp.int32)
    i = shardops.einsum_unreduced("B M/d, M/d F -> B F", xi, wi)
    r = jax.lax.psum(x[:, :1], "d") * jnp.ones((1, 3))
    return jax.lax.select_n(i, r, 2 * r)


@typed_shard_map
def tsm_reshard_varying(x: f32[b"B F"]) -> f32[b"B F/d"]:
    return shardops.reshard("B F -> B F/d", x + shardops.axis_index("d"))


@typed_shard_map
def tsm_adds_reduced_to_unreduced(x: f32[b"B M/d"], w: f32[b"M/d F"]) -> f32[b"B F"]:
    y = shardops.einsum_unreduced("B M/d, M/d F -> B F", x, w)
    return shardops.psum("B F", y + jnp.ones(y.shape), axes="d")


@typed_shard_map
def tsm_pmax_of_unreduced(x: f32[b"B M/d"], w: f32[b"M/d F"]) -> f32[b"B F"]:
    y = shardops.einsum_unreduced("B M/d, M/d F -> B F", x, w)
    return shardops.pmax("B F", y, axes="d")


@typed_shard_map
def tsm_wrong_pending_clause(x: f32[b"B/x M"], w: f32[b"M F"]) -> f32[b"B/x F"]:
    return shardops.einsum_unreduced("B/x M, M F -> B/x F {+y}", x, w)


@typed_shard_map
def tsm_product_of_partial_sums(x: f32[b"B M/d"], w: f32[b"M/d F"]) -> f32[b"B F"]:
    y = shardops.einsum_unreduced("B M/d, M/d F -> B F", x, w)
    z = shardops.einsum_unreduced("B M/d, M/d F -> B F", x, w)
    return shardops.psum("B F", shardops.einsum_unreduced("B F, B F -> B F", y, z), axes="d")


@typed_shard_map
def tsm_returns_gathered(x: f32[b"a/d"]) -> f32[b"a"]:
    return shardops.all_gather("a/d -> a", x)


@typed_shard_map
def tsm_branches_on_unreduced(x: f32[b"B M/d"], w: f32[b"M/d F"]) -> f32[b"B F"]:
    y = shardops.einsum_unreduced("B M/d, M/d F -> B F", x, w)
    if y:
        y = -y
    return shardops.psum("B F", y, axes="d")


@typed_shard_map
def tsm_unknown_axis_annotation(x: f32[b"a/q"]) -> f32[b"a/q"]:
    return x


@typed_shard_map
def tsm_unknown_axis_in_op(x: f32[b"a/d b"]) -> f32[b"a b"]:
    return shardops.all_gather("a/q b -> a b", x)


@typed_shard_map
def tsm_body_size_mismatch(x: f32[b"a/d b"]) -> f32[b"a b"]:
    return shardops.all_gather("a/d c -> a c", x[:, :1]) + shardops.all_gather("a/d c -> a c", x)


@typed_shard_map
def tsm_axis_size_unknown(x: f32[b"a/d"]) -> f32[b"a/d"]:
    return x * shardops.axis_size("t")


@typed_shard_map
def tsm_float_indices(t: f32[b"V/d M"], i: f32[b"B"]) -> f32[b"B M"]:
    return shardops.psum("B M", shardops.index_unreduced("[V/d] M, B -> B M", t, i), axes="d")


@typed_shard_map
def tsm_psum_over_split_axis(x: f32[b"a/d b"]) -> f32[b"a/d b"]:
    return shardops.psum("a/d b", x, axes="d")


def tsm_not_manual() -> Any:
    """A shard_map manual over 'x' only whose body reduces over 'y'."""

    def body(v: f32[b"a/x b"]) -> f32[b"a/x b"]:
        return shardops.psum("a/x b", v, axes="y")

    f = typed_shard_map(body, axis_names="x")
    with jax.set_mesh(MESH2):
        return jax.jit(f)(place(zeros(8, 2), MESH2, "a/x b"))


def tsm_partial_manual_annotation() -> Any:
    """An annotation inside a shard_map manual over 'x' splits a dim over 'y'."""

    @typechecked
    def inner(v: f32[b"a/x b/y"]) -> f32[b"a/x b/y"]:
        return v

    f = jax.shard_map(inner, mesh=MESH2, in_specs=P("x"), out_specs=P("x"), axis_names={"x"})
    with jax.set_mesh(MESH2):
        return jax.jit(f)(place(zeros(8, 4), MESH2, "a/x b"))


@typed_shard_map
def tsm_all_to_all_not_divisible(x: f32[b"B/d L"]) -> f32[b"B L/d"]:
    return shardops.all_to_all("B/d L -> B L/d", x)


@typed_shard_map
def tsm_psum_scatter_not_divisible(x: f32[b"B L"]) -> f32[b"B L/d"]:
    return shardops.psum_scatter("B L -> B L/d", x)


@typed_shard_map
def tsm_pair(x: tuple[f32[b"a/d"], f32[b"a/d"]]) -> f32[b"a/d"]:
    return x[0] + x[1]


@typed_shard_map
def tsm_nests_over_d(x: f32[b"batch/d len"]) -> f32[b"batch/d len"]:
    return tsm_double(x)


@typed_shard_map(check_vma=False)
def tsm_returns_unreduced_no_vma(x: f32[b"B M/d"], w: f32[b"M/d F"]) -> f32[b"B F"]:
    return shardops.einsum_unreduced("B M/d, M/d F -> B F", x, w)


@typed_shard_map
def tsm_psum_of_replicated(x: f32[b"a"]) -> f32[b"a"]:
    return shardops.psum("a", x, axes="d")


@typed_shard_map(check_vma=False)
def tsm_psum_of_replicated_no_vma(x: f32[b"a"]) -> f32[b"a"]:
    return shardops.psum("a", x, axes="d")


@typed_shard_map
def tsm_einsum_bad_keyword(x: f32[b"B M/d"], w: f32[b"M/d F"]) -> f32[b"B F"]:
    y = shardops.einsum_unreduced("B M/d, M/d F -> B F", x, w, preferred_element_type="zz")
    return shardops.psum("B F", y, axes="d")


class Scaler:
    """A model-like class: typed_shard_map runs its bound methods and its instances."""

    def __init__(self, k: float) -> None:
        self.k = k

    def apply(self, x: f32[b"a/d"]) -> f32[b"a/d"]:
        y: f32[b"a/d"] = x * self.k  # not checked: typed_shard_map does not read the body
        return y

    @typechecked  # typeguard's: checks the annotated assignment in the body
    def apply_wrong_body(self, x: f32[b"a/d"]) -> f32[b"a/d"]:
        y: f32[b"a/d a"] = x * self.k
        return y

    def __call__(self, x: f32[b"a/d"], w: f32[b"a/d"]) -> f32[b"a/d"]:
        return x * w * self.k


def scaled(x: f32[b"a/d"], w: f32[b"a/d"], s: float) -> f32[b"a/d"]:
    return x * w * s


# typed_shard_map functions that are wrong at decoration time (decorated inside the cases).
def _no_annotation(x: f32[b"a/d"], scale) -> f32[b"a/d"]:
    return x * scale


def _no_return(x: f32[b"a/d"]):
    return x


def _star_args(x: f32[b"a/d"], *rest: f32[b"a/d"]) -> f32[b"a/d"]:
    return x


def _bare_dtype(x: f32) -> f32[b"a/d"]:
    return x


def _var_tuple(x: tuple[f32[b"a/d"], ...]) -> f32[b"a/d"]:
    return x[0]


def _int_param(x: f32[b"a/d"], steps: int) -> f32[b"a/d"]:
    return x * steps


@typechecked
def typechecked_str_spec(x: f32["batch"]) -> f32["batch"]:  # noqa: F821, UP037
    return x


def _str_spec_and_assignment(x: f32["batch/d"]) -> f32["batch/d"]:  # noqa: F821, UP037
    y: f32["batch/d"] = x * 2  # noqa: F821, UP037 - not checked: nothing reads the body
    return y


def legacy_mesh_call(fn: Callable[[], Any], mesh: Any) -> Callable[[], Any]:
    def run() -> Any:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            with mesh:
                return fn()

    return run


def layout_jit_explicit() -> Any:
    with jax.set_mesh(MESH):
        return jax.jit(split_rows).trace(place(zeros(8, 8), MESH, "a b/d"))


def layout_auto_compile() -> Any:
    with jax.set_mesh(AUTO):
        return jax.jit(split_rows).lower(place(zeros(8, 8), AUTO, "a b/d")).compile()


def in_scope(fn: Callable[[], Any]) -> Callable[[], Any]:
    def run() -> Any:
        with Scope():
            return fn()

    return run


# Axis roles: functions written with roles (batch, fsdp, tensor), run on MESH2 (x=4, y=2).
ROLES = {"batch": "x", "fsdp": "x", "tensor": "y"}


def under_rules(fn: Callable[[], Any], rules: Any = None, **kw: Any) -> Callable[[], Any]:
    """``fn`` run under ``jax.set_mesh(MESH2)`` and ``axis_rules(rules, **kw)``."""

    def run() -> Any:
        with jax.set_mesh(MESH2), axis_rules(rules, **kw):
            return fn()

    return run


def enter_rules(rules: Any = None, **kw: Any) -> Callable[[], Any]:
    """Enter ``axis_rules(rules, **kw)`` (its arguments are judged on entry)."""

    def run() -> Any:
        with axis_rules(rules, **kw):
            pass

    return run


@typed_shard_map
def tsm_role_typo(x: f32[b"B/batch M/tensr"]) -> f32[b"B/batch M"]:
    return x


@typed_shard_map
def tsm_roles_share_an_axis(x: f32[b"B/batch M"]) -> f32[b"B/batch M"]:
    return shardops.all_gather("B/batch M/fsdp -> B/batch M", x)


@typed_shard_map
def tsm_enters_other_rules(x: f32[b"B/batch M"]) -> f32[b"B/batch M"]:
    with axis_rules(batch="y"):
        return x


@typed_shard_map
def tsm_shift_along_two_axes(x: f32[b"S/stage M"]) -> f32[b"S/stage M"]:
    return shardops.shift("S/stage M", x, "stage", offset=1)


@typed_shard_map
def tsm_psum_role_typo(x: f32[b"B/batch M"]) -> f32[b"B/batch M"]:
    return shardops.psum("B/batch M", x, axes="tensr")


# -- pipeline schedules, attention and MoE (issue 38) -------------------------------------------
MESH_PC = make_mesh((2, 2), ("p", "c"))


@pytree_dataclass
class _Stack:
    w: f32[Array, b"layers/p M M"]


def _pipeline_case(stage_op: str = "", loss_op: str = "", closure: bool = False,
                   forward_mode: bool = False) -> Callable[[], Any]:  # fmt: skip
    """A 1F1B pipeline on MESH_PC whose stage or loss misbehaves as asked (``stage_op``
    "shift", "gather" or "backward-shift": a custom_vjp layer whose backward alone shifts;
    ``loss_op`` "psum-p", or "shares": each device's share over 'c', summed after)."""
    from jax import lax  # noqa: PLC0415

    from shardlib import pipeline  # noqa: PLC0415

    @jax.custom_vjp
    def through(h: Any) -> Any:
        return h

    def back(_: Any, g: Any) -> tuple[Any]:
        return (shardops.shift("B/c M", shardops.shift("B/c M", g, "c"), "c", offset=-1),)

    through.defvjp(lambda h: (h, None), back)

    def layer(h: Any, w: Any) -> tuple[Any, None]:
        h = shardops.shift("B/c M", h, "c") if stage_op == "shift" else h
        h = through(h) if stage_op == "backward-shift" else h
        if stage_op == "gather":
            h = h + jnp.mean(shardops.all_gather("B/c M -> B M", h), axis=0)
        return jnp.tanh(h @ w), None

    def head(lp: Any, y: Any, t: Any) -> Any:
        if loss_op == "shares":
            return lp * jnp.sum(y * t)
        axes = ("c", "p") if loss_op == "psum-p" else "c"
        return lp * shardops.psum("", jnp.sum(y * t), axes=axes)

    @typed_shard_map
    def loss(
        s: _Stack, lp: f32[Array, b""], x: f32[Array, b"m B/c M"], t: f32[Array, b"m B/c M"]
    ) -> f32[Array, b""]:
        loss_fn = (lambda _, y, t: head(lp, y, t)) if closure else head
        out = pipeline.pipeline_loss(
            lambda s, h: lax.scan(layer, h, s.w)[0], s, x, spec="B/c M", loss_fn=loss_fn,
            loss_params=lp, targets=t, schedule="1f1b",
        )  # fmt: skip
        return shardops.psum("", out, axes="c") if loss_op == "shares" else out

    w, x = zeros(4, 4, 4) + 0.1, zeros(4, 4, 4) + 1.0
    lp = np.float32(1.0)

    def run() -> Any:
        with jax.set_mesh(MESH_PC):
            if forward_mode:
                return jax.jvp(lambda x: loss(_Stack(w=w), lp, x, x), (x,), (x,))
            if closure:
                return jax.grad(loss, argnums=1)(_Stack(w=w), lp, x, x)
            if stage_op == "backward-shift" or loss_op == "shares":  # refused as it traces
                return jax.jit(jax.grad(loss)).trace(_Stack(w=w), lp, x, x)
            return jax.jit(loss)(_Stack(w=w), lp, x, x)

    return run


def _ring_forward_mode() -> Any:
    from shardlib import attention  # noqa: PLC0415

    @typed_shard_map
    def f(q: f32[Array, b"B L/d H D"]) -> f32[Array, b"B L/d H D"]:
        return attention.ring("B L/d H D", q, q, q, "d")

    q = zeros(1, 8, 1, 4)
    with jax.set_mesh(MESH):
        return jax.jvp(f, (q,), (q,))


def _moe_capacity() -> Any:
    from shardlib import moe  # noqa: PLC0415

    return moe.capacity(16, 2, 0, 1.25)


# ---------------------------------------------------------------------------------------------
# The catalogue
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    id: str
    what: str  # the misuse, in words
    fn: Callable[[], Any]
    exc: type[BaseException]
    words: Sequence[str]  # substrings the message must contain
    fix: str  # how to fix it, for the docs


CASES: list[Case] = [
    # -- values against annotations ------------------------------------------------------
    Case(
        "wrong-dtype",
        "an int32 array where the annotation says f32",
        lambda: rows(zeros(2, 3, dtype=np.int32), zeros(2)),
        TypeCheckError,
        ['argument "x"', "rows()", "dtype: expected float32, got int32"],
        "cast with `x.astype(jnp.float32)` or change the annotation's dtype",
    ),
    Case(
        "wrong-rank",
        "a 1-D array for a 2-D annotation",
        lambda: rows(zeros(6), zeros(2)),
        TypeCheckError,
        ['argument "x"', "rank: expected 2 dims (batch len), got 1", "(6,)"],
        "reshape the array, or fix the annotation's dims",
    ),
    Case(
        "wrong-literal-size",
        "a (2, 4) array for f32['2 3']",
        lambda: two_by_three(zeros(2, 4)),
        TypeCheckError,
        ['argument "x"', "dim 1 '3': expected size 3, got 4"],
        "pass an array of the literal size, or name the dim instead of fixing it",
    ),
    Case(
        "binding-conflict",
        "two arguments disagree on the size of a shared dim name",
        lambda: rows(zeros(4, 3), zeros(5)),
        TypeCheckError,
        ['argument "y"', "dim 0 'batch'", "expected size 4", "batch=4 is already bound", "got 5"],
        "make the sizes agree, or give the dims different names",
    ),
    Case(
        "binding-conflict-within-value",
        "a non-square array for f32['n n']",
        lambda: diagonal(zeros(2, 3)),
        TypeCheckError,
        ["dim 1 'n'", "expected size 2", "earlier dim of this value", "got 3"],
        "pass a square array, or use two names",
    ),
    Case(
        "wrong-return",
        "a function returns an array that contradicts its annotation",
        lambda: doubles_length(zeros(3)),
        TypeCheckError,
        ["return value", "doubles_length()", "dim 0 'n'", "expected size 3", "got 6"],
        "fix the function body or its return annotation",
    ),
    Case(
        "not-an-array",
        "a Python list where an array is annotated",
        lambda: rows([[1.0]], zeros(1)),
        TypeCheckError,
        ['argument "x"', "expected an array matching f32['batch len']", "got list"],
        "convert it with `jnp.asarray` first",
    ),
    Case(
        "check-function",
        "`check()` with a value of the wrong size",
        in_scope(lambda: (check(jnp.float32, "a", zeros(3)), check(jnp.float32, "a", zeros(4)))),
        TypeCheckError,
        ["value does not match f32['a']", "dim 0 'a'", "expected size 3", "got 4"],
        "make the sizes agree, or check the two values in different scopes",
    ),
    Case(
        "unknown-mesh-axis",
        "an annotation splits a dim over an axis the mesh does not have",
        on(MESH, lambda: check(jnp.float32, "a/dd", zeros(8))),
        TypeCheckError,
        ["dim 0 'a/dd'", "mesh axis 'dd' is not an axis of the mesh (d=8)", "did you mean 'd'"],
        "use one of the mesh's axis names",
    ),
    Case(
        "not-divisible",
        "a dim split over a mesh axis whose size does not divide it",
        on(MESH2, lambda: check(jnp.float32, "a/x/y", zeros(12))),
        TypeCheckError,
        ["dim 0 'a/x/y'", "size 12 is not divisible by x=4 × y=2 = 8"],
        "pad the dim to a multiple of the axis sizes, or split it over fewer axes",
    ),
    Case(
        "layout-explicit-eager",
        "an array laid out P(None, 'd') passed eagerly where the annotation says P('d')",
        on(MESH, lambda: split_rows(place(zeros(8, 8), MESH, "a b/d"))),
        TypeCheckError,
        ['argument "x"', "split_rows()", "wants P('d', None)", "laid out as P(None, 'd')", "d=8"],
        "move it: `jax.device_put(x, NamedSharding(mesh, P('d')))` or `jax.reshard`",
    ),
    Case(
        "layout-explicit-jit",
        "the same, under jit on an Explicit mesh: caught at trace time",
        layout_jit_explicit,
        TypeCheckError,
        ['argument "x"', "split_rows()", "wants P('d', None)", "laid out as P(None, 'd')"],
        "`jax.reshard(x, P('d'))` before the call",
    ),
    Case(
        "layout-auto-compile",
        "the same, under jit on an Auto mesh: caught when XLA has chosen the layout",
        layout_auto_compile,
        jax.errors.JaxRuntimeError,
        [
            'argument "x" in split_rows()',
            "wants P('d', None)",
            "laid out as P(None, 'd')",
            "checked at compile time",
        ],
        "place the input in the annotated layout, or add `jax.lax.with_sharding_constraint`",
    ),
    Case(
        "replicated-for-sharded",
        "a fully replicated array where the annotation says sharded",
        on(MESH, lambda: split_rows(place(zeros(8, 8), MESH, "a b"))),
        TypeCheckError,
        ["wants P('d', None)", "laid out as P(None, None)"],
        "`jax.device_put` it with the annotated sharding",
    ),
    Case(
        "legacy-mesh-layout",
        "a wrongly laid out array under the legacy `with mesh:`",
        legacy_mesh_call(lambda: split_rows(place(zeros(8, 8), MESH, "a b/d")), MESH),
        TypeCheckError,
        ["wants P('d', None)", "laid out as P(None, 'd')"],
        "as above; and prefer `jax.set_mesh(mesh)` to `with mesh:`",
    ),
    # -- malformed specs --------------------------------------------------------------------
    Case(
        "spec-empty-axis",
        "an empty mesh axis between two '/'",
        lambda: f32[b"a//d"],
        SpecError,
        ["empty mesh axis between '/' and '/'", "'a//d'", "did you mean 'a/d'"],
        "remove the extra '/'",
    ),
    Case(
        "spec-trailing-slash",
        "a '/' with no mesh axis after it",
        lambda: f32[b"a/ b"],
        SpecError,
        ["missing mesh axis after '/'", "did you mean 'a b'"],
        "name the axis or remove the '/'",
    ),
    Case(
        "spec-axis-twice",
        "one mesh axis splitting two dims",
        lambda: f32[b"a/d b/d"],
        SpecError,
        ["mesh axis 'd' is used twice", "first used by dim 'a/d'"],
        "split the second dim over another axis, or not at all",
    ),
    Case(
        "spec-commas",
        "dims separated by commas",
        lambda: f32[b"a, b"],
        SpecError,
        ["unexpected character ','", "did you mean 'a b'"],
        "separate dims with spaces",
    ),
    Case(
        "spec-arrow",
        "an arrow in a shape (not op) spec",
        lambda: f32[b"a -> b"],
        SpecError,
        ["arrow '->' is not allowed in a shape spec", "'a -> b'"],
        "arrows belong in shardops op specs",
    ),
    Case(
        "spec-bad-name",
        "a dim name that is not an identifier",
        lambda: f32[b"2len"],
        SpecError,
        ["invalid dim size '2len'", "'len2', not '2len'"],
        "start names with a letter or '_'",
    ),
    Case(
        "spec-hyphen",
        "a hyphen in a dim name",
        lambda: f32[b"seq-len"],
        SpecError,
        ["unexpected character '-' in dim 'seq-len'", "did you mean 'seq_len'"],
        "use '_' in names",
    ),
    Case(
        "spec-non-ascii",
        "a non-ASCII space pasted into a spec",
        lambda: f32["a\xa0b"],
        SpecError,
        ["non-ASCII character", "NO-BREAK SPACE", "ordinary ASCII spaces"],
        "retype the space",
    ),
    Case(
        "spec-not-text",
        "a spec that is neither str nor bytes",
        lambda: f32[3],
        TypeError,
        ["a shape spec must be str or bytes, got int: 3"],
        "write the spec as a string: `f32[b'3']`",
    ),
    Case(
        "spec-bad-pending-clause",
        "a pending-reduction clause without '+'",
        lambda: shardops.psum("B M {t}", zeros(2, 2), axes="t"),
        SpecError,
        ["psum", "malformed clause '{t}'", "'{+t}'"],
        "write the pending axes as `{+t}`",
    ),
    Case(
        "op-spec-reduced-clause",
        "a reduced clause ('{=t}', a type for annotations) in a shardops spec",
        lambda: shardops.psum("B M {=d}", zeros(2, 2), axes="t"),
        SpecError,
        ["psum", "cannot say a value is reduced ('{=d}')", "'B M {=d}'\n         ^^^^"],
        "annotate the typed_shard_map argument '{=d}' instead; shardops specs name partial sums",
    ),
    Case(
        "check-clause-not-the-type",
        "a value checked against an unreduced annotation ('{+d}') when it is an ordinary array",
        lambda: check(jnp.float32, "a {+d}", zeros(2)),
        TypeCheckError,
        ["f32['a {+d}']", "the annotation's clause is '{+d}'", "JAX type is unreduced over []"],
        "annotate what the value is: drop the clause for an ordinary (reduced) array",
    ),
    Case(
        "spec-unicode-arrow-in-shape",
        "a Unicode arrow pasted into a shape spec",
        lambda: f32["a → b"],
        SpecError,
        ["non-ASCII character '→' (U+2192 RIGHTWARDS ARROW)", "'a → b'\n       ^", "'->'"],
        "arrows belong in shardops op specs, written '->'",
    ),
    # -- op specs that do not describe the named collective --------------------------------
    Case(
        "all-gather-adds",
        "all_gather whose output adds sharding",
        lambda: shardops.all_gather("a b -> a/d b", zeros(8, 2)),
        SpecError,
        ["all_gather: dim 0 goes from 'a' to 'a/d', which adds sharding", "psum_scatter"],
        "all_gather removes axes; psum_scatter adds them",
    ),
    Case(
        "all-gather-nothing",
        "all_gather with equal input and output layouts",
        lambda: shardops.all_gather("a/d b -> a/d b", zeros(8, 2)),
        SpecError,
        ["all_gather: the spec gathers nothing", "'a/d b -> a/d b'"],
        "remove the call, or remove a '/axis' from the output",
    ),
    Case(
        "all-gather-not-trailing",
        "all_gather removing a leading (not trailing) axis",
        lambda: shardops.all_gather("a/x/y -> a/y", zeros(8)),
        SpecError,
        ["dim 0 goes from 'a/x/y' to 'a/y'", "does not remove trailing mesh axes"],
        "gather the trailing axes, or all_to_all/reorder first",
    ),
    Case(
        "psum-scatter-removes",
        "psum_scatter whose output removes sharding",
        lambda: shardops.psum_scatter("a/d b -> a b", zeros(8, 2)),
        SpecError,
        ["psum_scatter: dim 0 goes from 'a/d' to 'a', which removes sharding", "all_gather"],
        "psum_scatter adds axes; all_gather removes them",
    ),
    Case(
        "psum-scatter-moves",
        "psum_scatter that moves an axis between dims",
        lambda: shardops.psum_scatter("a/d b -> a b/d", zeros(8, 2)),
        SpecError,
        ["removes sharding", "moves mesh axis 'd' from dim 0 to dim 1: use all_to_all"],
        "use all_to_all to move an axis",
    ),
    Case(
        "psum-scatter-nothing",
        "psum_scatter with equal layouts",
        lambda: shardops.psum_scatter("a b -> a b", zeros(8, 2)),
        SpecError,
        ["psum_scatter: the spec scatters nothing", "psum('a b', x, axes=...)"],
        "use psum to sum without scattering",
    ),
    Case(
        "all-to-all-nothing",
        "all_to_all that moves nothing",
        lambda: shardops.all_to_all("a/d b -> a/d b", zeros(8, 2)),
        SpecError,
        ["all_to_all: the spec moves nothing", "'a/d b -> a b/d'"],
        "move an axis, or remove the call",
    ),
    Case(
        "all-to-all-only-removes",
        "all_to_all that only removes an axis",
        lambda: shardops.all_to_all("a/d b -> a b", zeros(8, 2)),
        SpecError,
        ["all_to_all: dim 0 loses 'd' but no dim gains it", "all_gather"],
        "use all_gather, or append the axis to another dim",
    ),
    Case(
        "all-to-all-different-axes",
        "all_to_all that removes one axis and adds another",
        lambda: shardops.all_to_all("a/x b -> a b/y", zeros(8, 2)),
        SpecError,
        ["dim 0 loses 'x' but dim 1 gains 'y'", "the same axes must move"],
        "move the same axis: 'a/x b -> a b/x'",
    ),
    Case(
        "renamed-dim",
        "a collective that renames a dim",
        lambda: shardops.all_gather("a/d b -> a c", zeros(8, 2)),
        SpecError,
        ["all_gather: dim 1 is 'b' in the input but 'c' in the output", "does not rename"],
        "keep the names; rename by annotation or reshape outside the collective",
    ),
    Case(
        "rank-change",
        "a collective whose output has another rank",
        lambda: shardops.all_gather("a/d b -> a", zeros(8, 2)),
        SpecError,
        ["all_gather: input has 2 dims but output has 1", "keeps the rank"],
        "write every dim on both sides",
    ),
    Case(
        "missing-arrow",
        "an op spec without '->'",
        lambda: shardops.all_gather("a/d b", zeros(8, 2)),
        SpecError,
        ["all_gather: missing '->'", "'a/d b'"],
        "write 'INPUT -> OUTPUT'",
    ),
    Case(
        "op-unicode-arrow",
        "an op spec written with a Unicode arrow '→' instead of '->'",
        lambda: shardops.all_gather("a/d → a", zeros(8)),
        SpecError,
        [
            "all_gather: missing '->'",
            "'→' (U+2192 RIGHTWARDS ARROW) is not an arrow shardops reads",
            "'a/d → a'\n         ^\n",
            "hint: write the arrow as ASCII '->': did you mean 'a/d -> a'?",
        ],
        "write the arrow as ASCII '->'",
    ),
    Case(
        "op-fat-arrow",
        "an op spec written with '=>' instead of '->'",
        lambda: shardops.all_gather("a/d => a", zeros(8)),
        SpecError,
        ["all_gather: missing '->'", "'=>' is not an arrow", "did you mean 'a/d -> a'?"],
        "write the arrow as '->'",
    ),
    Case(
        "einsum-output-dim-unknown",
        "einsum_unreduced whose output names a dim no input has",
        lambda: shardops.einsum_unreduced("a b, b c -> a d", zeros(2, 3), zeros(3, 4)),
        SpecError,
        ["einsum_unreduced: output dim 'd' does not appear in any input", "'a', 'b', 'c'"],
        "name only dims of the inputs in the output",
    ),
    Case(
        "einsum-sizes-disagree",
        "einsum_unreduced operands whose shared dim has different sizes",
        lambda: shardops.einsum_unreduced("a b, b c -> a c", zeros(4, 3), zeros(5, 2)),
        TypeCheckError,
        ["einsum_unreduced('a b, b c -> a c') operand 1", "dim 0 'b'", "expected size 3", "got 5"],
        "make the contracted dims agree",
    ),
    Case(
        "einsum-split-differently",
        "a dim shared by two operands split differently",
        lambda: shardops.einsum_unreduced("a b/d, b c -> a c", zeros(2, 8), zeros(8, 2)),
        SpecError,
        ["dim 'b' is 'b/d' in operand 0 but 'b' in operand 1", "split the same way"],
        "all_gather or psum_scatter one operand first",
    ),
    Case(
        "einsum-axis-two-dims",
        "one mesh axis splitting different dims of two operands",
        lambda: shardops.einsum_unreduced("a/d b, b c/d -> a c/d", zeros(8, 2), zeros(2, 8)),
        SpecError,
        ["mesh axis 'd' splits dim 'a/d' in operand 0 and dim 'c/d' in operand 1"],
        "all_gather one of them first, or split them over different axes",
    ),
    Case(
        "einsum-operand-count",
        "an einsum spec for two operands given one",
        lambda: shardops.einsum_unreduced("a b, b c -> a c", zeros(2, 3)),
        SpecError,
        ["einsum_unreduced: expected 1 input spec before '->', got 2"],
        "pass one array per operand spec",
    ),
    Case(
        "einsum-unknown-keyword",
        "einsum_unreduced given a keyword jnp.einsum does not take (JAX's error, in shardops' "
        "words)",
        lambda: shardops.einsum_unreduced("a b, b c -> a c", zeros(2, 3), zeros(3, 4), foo=1),
        TypeError,
        [
            "einsum_unreduced('a b, b c -> a c')",
            "operand 0 f32[2, 3], operand 1 f32[3, 4], keyword arguments foo=1",
            "jnp.einsum refused it",
            "TypeError: einsum() got an unexpected keyword argument 'foo'",
        ],
        "pass only jnp.einsum's keywords (preferred_element_type, precision, ...)",
    ),
    Case(
        "einsum-bad-keyword-in-body",
        "einsum_unreduced with an invalid preferred_element_type, inside typed_shard_map",
        on(MESH, lambda: tsm_einsum_bad_keyword(zeros(2, 8), zeros(8, 3))),
        TypeError,
        [
            "einsum_unreduced('B M/d, M/d F -> B F')",
            "operand 0 f32[2, 1] per device",
            "preferred_element_type='zz'",
            "data type 'zz' not understood",
        ],
        "pass a dtype: preferred_element_type=jnp.float32",
    ),
    Case(
        "einsum-output-layout",
        "an einsum output split differently from its input",
        lambda: shardops.einsum_unreduced("a/d b -> a b", zeros(8, 2)),
        SpecError,
        ["output dim 'a' is split differently from input dim 'a/d'"],
        "change the layout with a collective afterwards",
    ),
    Case(
        "einsum-wrong-pending",
        "a '{+y}' clause on an einsum that contracts no split dim",
        on(MESH2, lambda: tsm_wrong_pending_clause(zeros(8, 4), zeros(4, 2))),
        SpecError,
        ["declared pending over 'y'", "not a partial sum", "no contracted dim is split"],
        "remove the clause (it is inferred), or fix it",
    ),
    Case(
        "index-no-brackets",
        "an index_unreduced spec without a bracketed dim",
        lambda: shardops.index_unreduced("V M, B -> B M", zeros(4, 2), zeros(3, dtype=np.int32)),
        SpecError,
        ["the table spec needs one bracketed dim", "'[vocab/t] d, batch len"],
        "bracket the dim the indices address: '[V] M, B -> B M'",
    ),
    Case(
        "index-two-brackets",
        "an index_unreduced spec with two bracketed dims",
        lambda: shardops.index_unreduced("[V] [M], B -> B", zeros(4, 2), zeros(3, dtype=np.int32)),
        SpecError,
        ["more than one bracketed dim", "'[V] [M], B -> B'\n         ^^^"],
        "bracket exactly one dim",
    ),
    Case(
        "index-brackets-on-indices",
        "brackets on the indices rather than the table",
        lambda: shardops.index_unreduced(
            "[V] M, [B] -> B M", zeros(4, 2), zeros(3, dtype=np.int32)
        ),
        SpecError,
        ["only the table (first operand) has a bracketed dim"],
        "remove the brackets from the indices",
    ),
    Case(
        "index-float-indices",
        "floating-point indices",
        on(MESH, lambda: tsm_float_indices(zeros(8, 2), zeros(4))),
        TypeError,
        ["index_unreduced('[V/d] M, B -> B M')", "indices", "integer dtype", "float32"],
        "cast the indices with `.astype(jnp.int32)`",
    ),
    Case(
        "index-output-missing-dim",
        "an index_unreduced output that drops a dim",
        lambda: shardops.index_unreduced("[V] M, B -> B", zeros(4, 2), zeros(3, dtype=np.int32)),
        SpecError,
        ["the output must have every non-bracketed table dim", "missing ['M']", "-> B M"],
        "list every non-bracketed table dim and every index dim in the output",
    ),
    Case(
        "psum-over-split-axis",
        "psum over an axis that splits a dim of the value",
        on(MESH, lambda: tsm_psum_over_split_axis(zeros(8, 2))),
        SpecError,
        ["psum: reduces over mesh axis 'd'", "dim 0 'a/d' is split over it"],
        "all_gather first, or use psum_scatter",
    ),
    Case(
        "psum-no-axes",
        "psum with no axes to reduce over",
        lambda: shardops.psum("a b", zeros(2, 2), axes=""),
        SpecError,
        ["psum('a b'): name at least one mesh axis to reduce over"],
        "pass axes='d' (or several: 'd/t')",
    ),
    Case(
        "psum-axes-int",
        "psum with an int where the mesh axes go",
        lambda: shardops.psum("a b", zeros(2, 2), axes=0),
        TypeError,
        ["psum('a b')", "axes=0 does not name mesh axes", "expected a str such as 'd'", "got int"],
        "name the axes: axes='d', 'd/t' or ('d', 't')",
    ),
    Case(
        "psum-axes-none",
        "psum with axes=None",
        lambda: shardops.psum("a b", zeros(2, 2), axes=None),
        TypeError,
        ["psum('a b')", "axes=None does not name mesh axes", "got NoneType"],
        "name the axes: axes='d', 'd/t' or ('d', 't')",
    ),
    Case(
        "axis-size-not-a-name",
        "axis_size of an int",
        lambda: shardops.axis_size(0),
        TypeError,
        ["axis_size: name=0 does not name mesh axes", "got int"],
        "name the axis: axis_size('d')",
    ),
    Case(
        "all-to-all-not-divisible",
        "all_to_all onto a dim whose size the moved axis does not divide",
        on(MESH, lambda: tsm_all_to_all_not_divisible(zeros(8, 4))),
        ValueError,
        [
            "all_to_all('B/d L -> B L/d')",
            "dim 1 'L' of the input has global size 4",
            "not divisible by d=8",
            "expected a multiple of 8",
        ],
        "pad the dim to a multiple of the axis size, or move the axis onto another dim",
    ),
    Case(
        "psum-scatter-not-divisible",
        "psum_scatter onto a dim whose size the added axis does not divide",
        on(MESH, lambda: tsm_psum_scatter_not_divisible(zeros(8, 4))),
        ValueError,
        [
            "psum_scatter('B L -> B L/d')",
            "dim 1 'L' of the input has global size 4",
            "not divisible by d=8",
            "cannot scatter it over 'd'",
            "expected a multiple of 8",
        ],
        "pad the dim to a multiple of the axis size, or scatter another dim",
    ),
    Case(
        "psum-arrow",
        "psum given an op spec instead of a shape spec",
        lambda: shardops.psum("a b -> a b", zeros(2, 2), axes="d"),
        SpecError,
        ["psum: an arrow '->' is not allowed in a shape spec"],
        "psum's spec describes the value (unchanged): 'a b'",
    ),
    # -- where collectives may run ----------------------------------------------------------
    Case(
        "collective-outside-shard-map",
        "a collective called on a global array, outside any shard_map",
        on(MESH, lambda: shardops.all_gather("a/d b -> a b", place(zeros(8, 2), MESH, "a/d b"))),
        ValueError,
        [
            "all_gather('a/d b -> a b')",
            "mesh axis 'd'",
            "inside a shard_map body",
            "typed_shard_map",
        ],
        "call it in the body of a `typed_shard_map` (or `jax.shard_map`)",
    ),
    Case(
        "einsum-unreduced-outside-shard-map",
        "einsum_unreduced contracting a split dim outside any shard_map (a global einsum is "
        "already reduced; the partial sum only exists per device)",
        on(
            MESH,
            lambda: shardops.einsum_unreduced(
                "a b/d, b/d c -> a c",
                place(zeros(2, 8), MESH, "a b/d"),
                place(zeros(8, 2), MESH, "b/d c"),
            ),
        ),
        ValueError,
        [
            "einsum_unreduced('a b/d, b/d c -> a c')",
            "mesh axis 'd'",
            "inside a shard_map body",
            "no mesh axis is manual",
        ],
        "call it in the body of a `typed_shard_map`, or use jnp.einsum on global arrays",
    ),
    Case(
        "axis-not-manual",
        "a collective over an axis the enclosing shard_map is not manual over",
        tsm_not_manual,
        ValueError,
        ["psum('a/x b')", "mesh axis 'y' is not a manual axis", "manual axes: x=4"],
        "add the axis to axis_names, or reduce over a manual axis",
    ),
    Case(
        "annotation-axis-not-manual",
        "an annotation in a partially manual body splitting a dim over a non-manual axis",
        tsm_partial_manual_annotation,
        TypeCheckError,
        ["dim 1 'b/y'", "mesh axis 'y' is not one of the manual axes", "(x=4)"],
        "inside shard_map split dims only over its manual axes",
    ),
    Case(
        "unknown-axis-in-op",
        "a collective over an axis the mesh does not have",
        on(MESH, lambda: tsm_unknown_axis_in_op(zeros(8, 2))),
        ValueError,
        ["all_gather('a/q b -> a b')", "mesh axis 'q' is not a manual axis", "d=8"],
        "use the mesh's axis names",
    ),
    Case(
        "axis-size-unknown",
        "axis_size of an axis that is not manual",
        on(MESH, lambda: tsm_axis_size_unknown(zeros(8))),
        ValueError,
        ["axis_size('t')", "mesh axis 't' is not a manual axis", "d=8"],
        "name a manual axis",
    ),
    Case(
        "op-block-size-mismatch",
        "a block inside the body whose size contradicts the bindings of the call",
        on(MESH, lambda: tsm_body_size_mismatch(zeros(8, 2))),
        TypeCheckError,
        ["tsm_body_size_mismatch()", "all_gather('a/d c -> a c') input", "dim 1 'c'"],
        "make the block sizes agree with the names",
    ),
    Case(
        "return-gathered-replicated",
        "returning an all_gather result as a replicated output with check_vma on (JAX's "
        "varying-axes check does not know that lax.all_gather replicates)",
        on(MESH, lambda: tsm_returns_gathered(zeros(8))),
        ValueError,
        [
            "typed_shard_map(tsm_returns_gathered)",
            "return annotation f32['a']",
            "lax.all_gather results stay varying",
            "replicated across mesh axis 'd'",
            "check_vma=False",
        ],
        "return the value split (and gather outside), reduce it with psum, or pass "
        "check_vma=False to typed_shard_map",
    ),
    # -- typed_shard_map ------------------------------------------------------------------
    Case(
        "tsm-not-an-array",
        "a non-array argument to typed_shard_map",
        on(MESH, lambda: tsm_double("not an array")),
        TypeCheckError,
        ["argument 'x' of tsm_double()", "expected an array matching f32['batch/d len']", "str"],
        "pass an array (or mark the parameter static_argnames)",
    ),
    Case(
        "tsm-wrong-dtype",
        "an argument of the wrong dtype",
        on(MESH, lambda: tsm_double(zeros(8, 2, dtype=np.int32))),
        TypeCheckError,
        ["argument 'x' of tsm_double()", "expected float32, got int32"],
        "cast the argument",
    ),
    Case(
        "tsm-not-divisible",
        "an argument whose split dim is not divisible by the mesh axis",
        on(MESH, lambda: tsm_double(zeros(12, 2))),
        TypeCheckError,
        ["argument 'x' of tsm_double()", "dim 0 'batch/d'", "size 12 is not divisible", "d=8"],
        "pad the dim to a multiple of the axis size",
    ),
    Case(
        "tsm-unknown-axis",
        "an annotation splitting a dim over an axis the mesh does not have",
        on(MESH, lambda: tsm_unknown_axis_annotation(zeros(8))),
        TypeCheckError,
        ["argument 'x' of tsm_unknown_axis_annotation()", "mesh axis 'q' is not an axis", "d=8"],
        "use the mesh's axis names",
    ),
    Case(
        "tsm-bad-return",
        "a body that returns a block of the wrong size",
        on(MESH, lambda: tsm_bad_return(zeros(8, 2))),
        TypeCheckError,
        ["tsm_bad_return()", "return value", "dim 1 'len'", "expected size 2", "got 1"],
        "fix the body or the return annotation",
    ),
    Case(
        "tsm-return-structure",
        "a body that returns a tuple where one array is annotated",
        on(MESH, lambda: tsm_returns_tuple(zeros(8, 2))),
        TypeCheckError,
        ["tsm_returns_tuple()", "expected an array matching f32['batch/d len']", "tuple"],
        "annotate the return as a tuple, or return one array",
    ),
    Case(
        "tsm-tuple-length",
        "a 1-element tuple for a tuple[f32[...], f32[...]] annotation",
        on(MESH, lambda: tsm_pair((zeros(8),))),
        TypeCheckError,
        [
            "argument 'x' of tsm_pair()",
            "expected tuple[f32['a/d'], f32['a/d']]",
            "got tuple of 1 item (f32[8])",
        ],
        "pass one array per element of the annotated tuple",
    ),
    Case(
        "tsm-nested-same-axis",
        "a typed_shard_map over 'd' called in the body of another one over 'd'",
        on(MESH, lambda: tsm_nests_over_d(zeros(8, 2))),
        ValueError,
        [
            "typed_shard_map(tsm_double) is called inside a shard_map body that is already "
            "manual over mesh axis 'd'",
            "argument 'x' is annotated f32['batch/d len']",
            "a nested typed_shard_map over 'd' again is impossible",
        ],
        "call the inner function undecorated in the body, or outside the body",
    ),
    Case(
        "tsm-mesh-not-a-mesh",
        "mesh='d' (an axis name) where a Mesh goes",
        lambda: typed_shard_map(_int_param, mesh="d"),
        TypeError,
        [
            "typed_shard_map(_int_param)",
            "mesh must be a jax.sharding.Mesh",
            "got str 'd'",
            "axis_names='d'",
        ],
        "pass a Mesh (`jax.make_mesh(...)`), or leave mesh out under `jax.set_mesh`",
    ),
    Case(
        "tsm-class",
        "a class instead of a function",
        lambda: typed_shard_map(Scaler),
        TypeError,
        ["typed_shard_map(Scaler)", "got the class Scaler, expected a function"],
        "decorate a bound method (`typed_shard_map(model.apply)`) or an instance with __call__",
    ),
    Case(
        "tsm-unbound-method",
        "a method taken from the class (self unannotated)",
        lambda: typed_shard_map(Scaler.apply),
        TypeError,
        ["typed_shard_map(Scaler.apply)", "parameter 'self' has no annotation", "obj.method"],
        "decorate the bound method: `typed_shard_map(model.apply)`",
    ),
    Case(
        "tsm-partial-positional-array",
        "a functools.partial that binds a split array positionally",
        lambda: typed_shard_map(functools.partial(scaled, zeros(8))),
        TypeError,
        [
            "typed_shard_map(partial(scaled))",
            "binds parameter 'x' (annotated f32['a/d'], which is split) positionally",
            "closed over",
            "functools.partial(..., x=value)",
        ],
        "bind it by keyword, or pass it when calling",
    ),
    Case(
        "tsm-body-annotation-of-method",
        "an annotated assignment that does not match, in a bound method run by typed_shard_map",
        on(MESH, lambda: typed_shard_map(Scaler(2.0).apply_wrong_body)(zeros(8))),
        TypeCheckError,
        ["value assigned to y", "Scaler.apply_wrong_body()", "rank: expected 2 dims"],
        "fix the annotation or the body",
    ),
    Case(
        "tsm-no-mesh",
        "typed_shard_map called with no mesh in force",
        lambda: tsm_double(zeros(8, 2)),
        ValueError,
        ["typed_shard_map(tsm_double) needs a mesh", "jax.set_mesh", "mesh=..."],
        "call it under `with jax.set_mesh(mesh):` or pass mesh=",
    ),
    Case(
        "tsm-no-annotation",
        "a parameter without an annotation",
        lambda: typed_shard_map(_no_annotation),
        TypeError,
        ["typed_shard_map(_no_annotation)", "parameter 'scale' has no annotation", "static"],
        "annotate it, or list it in static_argnames",
    ),
    Case(
        "tsm-no-return-annotation",
        "no return annotation",
        lambda: typed_shard_map(_no_return),
        TypeError,
        ["typed_shard_map(_no_return)", "annotate the return type"],
        "annotate the return type",
    ),
    Case(
        "tsm-star-args",
        "`*args` in a typed_shard_map function",
        lambda: typed_shard_map(_star_args),
        TypeError,
        ["typed_shard_map(_star_args)", "parameter *rest is not supported"],
        "give every array its own parameter",
    ),
    Case(
        "tsm-bare-dtype",
        "a bare dtype class (no spec) as an annotation",
        lambda: typed_shard_map(_bare_dtype),
        TypeError,
        ["parameter 'x'", "f32 has no shape spec", "f32['batch len']"],
        "write a spec: f32[b'a/d']",
    ),
    Case(
        "tsm-variable-tuple",
        "a variable-length tuple annotation",
        lambda: typed_shard_map(_var_tuple),
        TypeError,
        ["typed_shard_map(_var_tuple)", "variable-length tuples have no fixed layout"],
        "list each element type: tuple[f32[...], f32[...]]",
    ),
    Case(
        "tsm-non-array-annotation",
        "an int parameter not marked static",
        lambda: typed_shard_map(_int_param),
        TypeError,
        ["parameter 'steps'", "is not an array type", "static_argnames=('steps',)"],
        "mark it static_argnames=('steps',)",
    ),
    Case(
        "tsm-static-unknown",
        "static_argnames naming a parameter that does not exist",
        lambda: typed_shard_map(_int_param, static_argnames=("step",)),
        ValueError,
        ["typed_shard_map(_int_param)", "static_argnames names ['step']", "'steps'"],
        "spell the parameter name as in the signature",
    ),
    Case(
        "tsm-check-rep-vs-vma",
        "check_rep and check_vma that disagree",
        lambda: typed_shard_map(_int_param, check_rep=True, check_vma=False),
        ValueError,
        ["check_rep=True and check_vma=False disagree", "pass only check_vma"],
        "pass only check_vma",
    ),
    Case(
        "tsm-in-specs",
        "in_specs passed to typed_shard_map",
        lambda: typed_shard_map(_no_annotation, in_specs=P("d")),
        TypeError,
        ["do not pass in_specs", "read from _no_annotation's annotations"],
        "drop in_specs (or use jax.shard_map)",
    ),
    Case(
        "tsm-unknown-keyword",
        "a misspelled keyword",
        lambda: typed_shard_map(_int_param, chek_vma=False),
        TypeError,
        ["unexpected keyword argument(s) ['chek_vma']", "check_vma"],
        "spell the keyword as documented",
    ),
    Case(
        "typechecked-str-spec",
        "a one-word str spec in a @typechecked function: typeguard evaluates f32['batch'] as "
        "f32[batch]",
        lambda: typechecked_str_spec(zeros(3)),
        NameError,
        ["name 'batch' is not defined"],
        "write the spec as bytes: f32[b'batch'] (typeguard leaves bytes alone)",
    ),
    # -- pending reductions -----------------------------------------------------------------
    Case(
        "return-unreduced",
        "returning a partial sum from typed_shard_map",
        on(MESH, lambda: tsm_returns_unreduced(zeros(2, 8), zeros(8, 3))),
        PendingReductionError,
        ["return value", "partial sum", "'d'", "einsum_unreduced('B M/d, M/d F -> B F')", "psum"],
        "reduce it: `shardops.psum('B F', y, axes='d')`",
    ),
    Case(
        "return-unreduced-no-vma",
        "the same with check_vma=False: the partial-sum analysis does not depend on JAX's",
        on(MESH, lambda: tsm_returns_unreduced_no_vma(zeros(2, 8), zeros(8, 3))),
        PendingReductionError,
        ["in tsm_returns_unreduced_no_vma()", "return value is a partial sum", "'d'"],
        "reduce it: `shardops.psum('B F', y, axes='d')`",
    ),
    Case(
        "pass-unreduced",
        "passing a partial sum through a typechecked function: a plain @typechecked function "
        "cannot see that its argument is a partial sum, so the error comes where the body "
        "returns it, naming the op that made it",
        on(MESH, lambda: tsm_passes_unreduced(zeros(2, 8), zeros(8, 3))),
        PendingReductionError,
        [
            "in tsm_passes_unreduced()",
            "the return value is a partial sum",
            "'d'",
            "(made by einsum_unreduced('B M/d, M/d F -> B F') at test_misuse.py:",
        ],
        "reduce it before the call",
    ),
    Case(
        "nonlinear-on-unreduced",
        "jnp.exp of a partial sum",
        on(MESH, lambda: tsm_exp_of_unreduced(zeros(2, 8), zeros(8, 3))),
        PendingReductionError,
        [
            "in tsm_exp_of_unreduced()",
            "`exp` at test_misuse.py:",
            "is not linear",
            "a partial sum still owing a reduction over mesh axis 'd'",
            "(made by einsum_unreduced('B M/d, M/d F -> B F') at test_misuse.py:",
        ],
        "reduce before non-linear operations",
    ),
    Case(
        "add-reduced-to-unreduced",
        "adding an ordinary array to a partial sum",
        on(MESH, lambda: tsm_adds_reduced_to_unreduced(zeros(2, 8), zeros(8, 3))),
        PendingReductionError,
        [
            "`add` at test_misuse.py:",
            "combines a value that is not a partial sum with a partial sum",
            "once per device of mesh axis 'd'",
        ],
        "reduce first, or add it on one device only",
    ),
    Case(
        "bool-of-unreduced",
        "branching on a partial sum: the body is traced, so JAX refuses the Python bool of "
        "any traced array (partial sum or not) before the analysis runs",
        on(MESH, lambda: tsm_branches_on_unreduced(zeros(2, 8), zeros(8, 3))),
        ValueError,
        ["truth value of an array", "ambiguous"],
        "reduce first; branch with jnp.where / lax.cond on reduced values",
    ),
    Case(
        "pmax-of-unreduced",
        "pmax of a partial sum",
        on(MESH, lambda: tsm_pmax_of_unreduced(zeros(2, 8), zeros(8, 3))),
        PendingReductionError,
        [
            "in tsm_pmax_of_unreduced()",
            "pmax",
            "takes the max/min across devices of a partial sum",
            "'d'",
            "einsum_unreduced(",
        ],
        "psum first, then pmax",
    ),
    Case(
        "product-of-partial-sums",
        "an einsum of two partial sums",
        on(MESH, lambda: tsm_product_of_partial_sums(zeros(2, 8), zeros(8, 3))),
        PendingReductionError,
        [
            "in tsm_product_of_partial_sums()",
            "at test_misuse.py:",
            "multiplies two partial sums",
            "(made by einsum_unreduced('B M/d, M/d F -> B F') at test_misuse.py:",
        ],
        "reduce one operand first",
    ),
    Case(
        "psum-of-replicated",
        "psum of a value that is the same on every device of the summed axis (it would "
        "multiply it by the axis size)",
        on(MESH, lambda: tsm_psum_of_replicated(zeros(8))),
        ValueError,
        ["psum", "the same on every device of mesh axis 'd'", "multiply it by the axis size"],
        "drop the reduction, or multiply by `shardops.axis_size('d')` if that is what you want",
    ),
    Case(
        "psum-of-replicated-no-vma",
        "the same with check_vma=False",
        on(MESH, lambda: tsm_psum_of_replicated_no_vma(zeros(8))),
        ValueError,
        ["psum", "the same on every device of mesh axis 'd'", "multiply it by the axis size"],
        "drop the reduction, or multiply by `shardops.axis_size('d')` if that is what you want",
    ),
    Case(
        "cond-per-device-on-unreduced",
        "a lax.cond whose predicate differs across the devices of the pending axis, around "
        "partial sums made inside it (a per-device mask in disguise)",
        on(MESH, lambda: tsm_cond_per_device(zeros(2, 8), zeros(8, 3))),
        PendingReductionError,
        ["in tsm_cond_per_device()", "`cond`", "differs across the devices of mesh axis 'd'"],
        "make the predicate the same on every device of 'd', or reduce inside each branch",
    ),
    Case(
        "tangent-of-unreduced",
        "a non-linear op on the jax.jvp tangent of a partial sum (the tangent owes the same sum)",
        on(MESH, lambda: tsm_tangent_of_unreduced(zeros(2, 8), zeros(8, 3))),
        PendingReductionError,
        ["in tsm_tangent_of_unreduced()", "`tanh`", "partial sum", "'d'"],
        "reduce the tangent first: `shardops.psum('B F', t, axes='d')`",
    ),
    Case(
        "unreduced-as-selector",
        "an integer partial sum used as the selector of lax.select_n",
        on(MESH, lambda: tsm_unreduced_as_selector(zeros(2, 8), zeros(8, 3))),
        PendingReductionError,
        ["in tsm_unreduced_as_selector()", "`select_n`", "as a selector", "'d'"],
        "reduce it first",
    ),
    Case(
        "reshard-varying-input",
        "reshard to a split over 'd' of a value that differs across the devices of 'd' (the "
        "spec says it is replicated there)",
        on(MESH, lambda: tsm_reshard_varying(zeros(2, 8))),
        ValueError,
        ["reshard", "differs across the devices of mesh axis 'd'"],
        "reduce or gather it first, or write the spec with the axis it is split over",
    ),
    # -- pytree helpers and types -------------------------------------------------------------
    Case(
        "make-shardings-no-mesh",
        "make_shardings with no mesh in force",
        lambda: make_shardings(f32[b"a/d"]),
        ValueError,
        ["make_shardings(f32['a/d']) needs a mesh", "jax.set_mesh"],
        "call it under `with jax.set_mesh(mesh):` or pass mesh=",
    ),
    Case(
        "make-shardings-unknown-axis",
        "make_shardings of a spec using an axis the mesh lacks",
        lambda: make_shardings(f32[b"a/t"], mesh=MESH),
        ValueError,
        ["uses mesh axis 't'", "mesh axes: d=8"],
        "use the mesh's axis names",
    ),
    Case(
        "is-fully-sharded-no-mesh",
        "is_fully_sharded with no mesh in force",
        lambda: is_fully_sharded("a/d"),
        ValueError,
        ["is_fully_sharded needs a mesh", "jax.set_mesh"],
        "call it under `with jax.set_mesh(mesh):` or in a shard_map body",
    ),
    Case(
        "is-fully-sharded-wrong-type",
        "is_fully_sharded of something that is not a spec",
        lambda: is_fully_sharded(3),
        TypeError,
        ["is_fully_sharded takes a PartitionSpec, shape spec or array type, got 3"],
        "pass a PartitionSpec, a spec string or an array type",
    ),
    Case(
        "array-one-argument",
        "Array[...] with only a spec",
        lambda: Array["layers"],
        TypeError,
        ["Array takes a spec and a type", "Array['layers']"],
        "write Array['layers', Layer]",
    ),
    Case(
        "array-not-a-type",
        "Array[...] of a type that is not an array type or pytree dataclass",
        lambda: Array["layers", int],
        TypeError,
        ["Array['layers', ...] needs an array type", "got <class 'int'>"],
        "stack an array type or a pytree_dataclass",
    ),
    Case(
        "instantiate-annotation",
        "calling an annotation class as if it made arrays",
        lambda: f32[b"a b"](),
        TypeError,
        ["f32['a b'] is an annotation, not a constructor", "jnp.zeros"],
        "create arrays with jax.numpy",
    ),
    # -- axis roles and their rules (issue 27) ------------------------------------------------
    Case(
        "role-unknown",
        "a spec names a role that has no rule and is no axis of the mesh (a typo)",
        under_rules(lambda: tsm_role_typo(zeros(8, 4)), ROLES),
        SpecError,
        [
            "typed_shard_map(tsm_role_typo)",
            "'tensr' is neither an axis of the mesh in force (axes x, y)",
            "nor a role of the axis rules in force (batch -> 'x', fsdp -> 'x', tensor -> 'y')",
            "did you mean 'tensor'?",
            "'B/batch M/tensr'",
        ],
        "fix the role's spelling, or add a rule for it to `axis_rules(...)`",
    ),
    Case(
        "role-without-rules",
        "a spec written with roles, called with no axis rules in force",
        on(MESH2, lambda: tsm_roles_scaled(zeros(8, 4))),
        TypeCheckError,
        [
            "argument 'x' of tsm_roles_scaled()",
            "mesh axis 'batch' is not an axis of the mesh (x=4, y=2)",
            "if 'batch' is a role (a logical axis), put axis rules in force around the call",
            "shardlib.axis_rules(batch=<mesh axes>)",
        ],
        "call it under `with shardlib.axis_rules(batch=..., tensor=...):`",
    ),
    Case(
        "role-unknown-in-axes",
        "an axis argument names an unknown role",
        under_rules(lambda: tsm_psum_role_typo(zeros(8, 4)), ROLES),
        SpecError,
        ["psum", "`axes`", "'tensr' is neither an axis of the mesh", "did you mean 'tensor'?"],
        "fix the role's spelling, or add a rule for it",
    ),
    Case(
        "rule-unknown-mesh-axis",
        "a rule maps a role to an axis the mesh in force does not have",
        under_rules(lambda: make_shardings(f32[b"B/batch M"]), batch="xx"),
        SpecError,
        [
            "axis_rules: the rule batch -> 'xx' names mesh axis 'xx'",
            "which the mesh in force does not have (its axes: x, y)",
            "did you mean 'x'?",
        ],
        "use rules written for this mesh (each mesh its own `axis_rules`), or fix the axis name",
    ),
    Case(
        "rule-for-mesh-axis-name",
        "a rule for a role named like a mesh axis, mapping it elsewhere (a mesh axis always "
        "means itself)",
        under_rules(lambda: make_shardings(f32[b"B/x M"]), x="y"),
        SpecError,
        ["axis_rules: the rule x -> 'y' never applies", "'x' is an axis of the mesh in force"],
        "rename the role in the specs and the rules, or drop the rule",
    ),
    Case(
        "roles-share-mesh-axis",
        "two dims of one array whose roles resolve to the same mesh axis",
        under_rules(lambda: check(jnp.float32, "B/batch M/fsdp", zeros(8, 8)), ROLES),
        SpecError,
        [
            "dims 0 'B/batch' (role 'batch') and 1 'M/fsdp' (role 'fsdp') both resolve to mesh "
            "axis 'x'",
            "one array cannot be split over a mesh axis twice",
            "map 'batch' and 'fsdp' to different mesh axes (or one of them to None)",
        ],
        "map the two roles to different mesh axes, or one of them to None",
    ),
    Case(
        "roles-share-mesh-axis-in-one-dim",
        "one dim split over two roles that resolve to the same mesh axis",
        under_rules(lambda: check(jnp.float32, "B/batch/fsdp M", zeros(8, 8)), ROLES),
        SpecError,
        ["dim 0 'B/batch/fsdp' resolves to mesh axis 'x' twice (roles 'batch' and 'fsdp')"],
        "map the two roles to different mesh axes",
    ),
    Case(
        "roles-share-mesh-axis-in-op",
        "an op spec in which two dims of one operand resolve to the same mesh axis",
        under_rules(lambda: tsm_roles_share_an_axis(zeros(8, 4)), ROLES),
        SpecError,
        [
            "dims 0 'B/batch' (role 'batch') and 1 'M/fsdp' (role 'fsdp') both resolve to mesh "
            "axis 'x'",
            "'B/batch M/fsdp -> B/batch M'",
            "all_gather",
        ],
        "map the two roles to different mesh axes, or one of them to None",
    ),
    Case(
        "role-not-divisible",
        "a dim whose size does not divide by the product of its role's mesh axes",
        under_rules(lambda: check(jnp.float32, "a/batch", zeros(12)), batch=("x", "y")),
        TypeCheckError,
        [
            "does not match f32['a/batch']",
            "under the axis rules in force f32['a/x/y']",
            "role 'batch' -> mesh axes ('x', 'y')",
            "dim 0 'a/batch' (resolved: 'a/x/y'): size 12 is not divisible by x=4 × y=2 = 8",
        ],
        "pad the dim to a multiple of the axes' product, or map the role to fewer axes",
    ),
    Case(
        "rules-changed-in-body",
        "axis_rules entered inside a typed_shard_map body with other rules than the call's "
        "(its in/out specs were resolved under the outer ones)",
        under_rules(lambda: tsm_enters_other_rules(zeros(8, 4)), ROLES),
        SpecError,
        [
            "axis_rules(batch -> 'y'): entered inside a shard_map body",
            "under batch -> 'x', fsdp -> 'x', tensor -> 'y'",
            "rules changed between resolving a call and tracing its body",
            "enter axis_rules(...) around the call",
        ],
        "enter `axis_rules(...)` around the call, outside typed_shard_map and jax.jit",
    ),
    Case(
        "point-to-point-axis-role-two-axes",
        "shift along a role that resolves to two mesh axes",
        under_rules(lambda: tsm_shift_along_two_axes(zeros(8, 4)), stage=("x", "y")),
        SpecError,
        [
            "shift: argument `axis` is 'stage'",
            "resolve to 2 mesh axes ('x', 'y')",
            "needs exactly one mesh axis there",
        ],
        "map the role to one mesh axis",
    ),
    Case(
        "rule-role-not-identifier",
        "a role that is not a Python identifier",
        enter_rules({"2d": "x"}),
        ValueError,
        ["axis_rules: '2d' is not a role name (a Python identifier)"],
        "name roles like Python variables",
    ),
    Case(
        "rule-role-twice",
        "a role given two rules",
        enter_rules([("batch", "x"), ("batch", "y")]),
        ValueError,
        ["axis_rules: role 'batch' has two rules"],
        "give each role one rule",
    ),
    Case(
        "rule-role-twice-pairs-and-keywords",
        "a role given once in the pairs and once as a keyword",
        enter_rules({"batch": "x"}, batch="y"),
        ValueError,
        ["axis_rules: role 'batch' has two rules"],
        "give each role one rule",
    ),
    Case(
        "rule-bad-target",
        "a rule whose target is not a mesh axis name, a tuple of them or None",
        enter_rules(batch=3),
        TypeError,
        ["axis_rules: the rule for role 'batch' is 3", "or None (replicated)"],
        "map a role to 'x', ('x', 'y') or None",
    ),
    Case(
        "rule-bad-target-in-tuple",
        "a tuple target with something that is not a str",
        enter_rules(batch=("x", 3)),
        TypeError,
        ["axis_rules: the rule for role 'batch' is ('x', 3)"],
        "map a role to 'x', ('x', 'y') or None",
    ),
    Case(
        "rule-axis-twice",
        "a rule naming one mesh axis twice",
        enter_rules(batch=("x", "x")),
        ValueError,
        ["axis_rules: the rule for role 'batch' names a mesh axis twice: ('x', 'x')"],
        "name each mesh axis once",
    ),
    Case(
        "rule-not-a-pair",
        "a rule in the pair form that is not a (role, axes) pair",
        enter_rules([("batch",)]),
        TypeError,
        ["axis_rules: rule 0 is ('batch',)", "(role, mesh axes) pair"],
        "write ('batch', 'x'), ('batch', ('x', 'y')) or ('embed', None)",
    ),
    Case(
        "pipeline-permute-in-stage",
        "a `shardops.shift` over another axis inside a 1F1B stage (a collective-permute)",
        _pipeline_case(stage_op="shift"),
        ValueError,
        [
            "one_f_one_b: `stage_fn` runs shardops.shift('B/c M') (`ppermute`) over 'c'",
            "collective-permute",
            "schedule 'gpipe' or 'circular'",
        ],  # fmt: skip
        "use schedule 'gpipe' or 'circular' for a stage that permutes, or a grouped "
        "collective (`attention.gathered` instead of `attention.ring`)",
    ),
    Case(
        "pipeline-permute-in-backward",
        "a custom_vjp in a 1F1B stage whose backward rule alone shifts over another axis",
        _pipeline_case(stage_op="backward-shift"),
        ValueError,
        [
            "one_f_one_b: `stage_fn`'s backward runs shardops.shift('B/c M') (`ppermute`)",
            "collective-permute",
        ],  # fmt: skip
        "as for a permute in the stage: schedule 'gpipe' or 'circular', or a backward with "
        "grouped collectives only",
    ),
    Case(
        "pipeline-loss-shares-mixed",
        "under 1F1B, a `loss_fn` leaving each device of 'c' its share of the loss (summed "
        "after the schedule) while the stage all-gathers over 'c'",
        _pipeline_case(stage_op="gather", loss_op="shares"),
        ValueError,
        [
            "one_f_one_b: `loss_fn` returns a loss that varies over 'c'",
            "Reduce the loss over 'c' in `loss_fn`",
        ],  # fmt: skip
        "sum the loss over 'c' in `loss_fn` (`shardops.psum('', loss, axes='c')`), so the "
        "schedule returns the whole loss",
    ),
    Case(
        "pipeline-loss-over-stage-axis",
        "a `loss_fn` that sums over the stage axis under 1F1B (it would deadlock)",
        _pipeline_case(loss_op="psum-p"),
        ValueError,
        ["one_f_one_b: `loss_fn` must not communicate over the stage axis 'p'", "deadlock"],
        "reduce over the stage axis after the schedule (its loss is the same on every stage)",
    ),
    Case(
        "pipeline-forward-mode",
        "`jax.jvp` through a 1F1B pipeline",
        _pipeline_case(forward_mode=True),
        TypeError,
        ["one_f_one_b: forward-mode differentiation (jax.jvp, jax.jacfwd)", "jax.grad"],
        "differentiate with `jax.grad`/`jax.vjp`, or use schedule 'gpipe' for forward mode",
    ),
    Case(
        "pipeline-closure",
        "a `loss_fn` closing over a value being differentiated, under 1F1B",
        _pipeline_case(closure=True),
        ValueError,
        [
            "one_f_one_b: `loss_fn` closes over a value being differentiated (float32[])",
            "Pass it in `loss_params`",
        ],  # fmt: skip
        "pass the value in `loss_params` (or `stage_params`) and read it from there",
    ),
    Case(
        "ring-forward-mode",
        "`jax.jvp` through `attention.ring`",
        _ring_forward_mode,
        TypeError,
        ["ring: forward-mode differentiation", "attention.gathered"],
        "differentiate with `jax.grad`, or use `attention.gathered` for forward mode",
    ),
    Case(
        "moe-capacity-no-experts",
        "`moe.capacity` with zero experts",
        _moe_capacity,
        ValueError,
        ["capacity", "experts", "got 0"],
        "pass the number of experts, at least 1",
    ),
]


# ---------------------------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------------------------


def message_of(case: Case) -> str:
    """The message of the exception ``case`` raises (fails unless it is ``case.exc``)."""
    with pytest.raises(case.exc) as info:
        case.fn()
    return str(info.value)


def _params(cases: Sequence[Case]) -> list[Any]:
    return [pytest.param(c, id=c.id) for c in cases]


@pytest.mark.parametrize("case", _params(CASES))
def test_misuse_is_a_clear_error(case: Case) -> None:
    msg = message_of(case)
    missing = [w for w in case.words if w not in msg]
    assert not missing, f"{case.id}: {missing} not in message:\n{msg}"


def test_catalogue_size_and_ids() -> None:
    ids = [c.id for c in CASES]
    assert len(ids) == len(set(ids)), "duplicate case ids"
    assert len(CASES) >= 40


def test_catalogue_is_documented() -> None:
    """docs/reliability.md lists every case (regenerate it when adding one: run this test
    with SHARDLIB_WRITE_CATALOGUE=1, see `write_catalogue`)."""
    import os
    from pathlib import Path

    if os.environ.get("SHARDLIB_WRITE_CATALOGUE"):
        write_catalogue()

    doc = (Path(__file__).parent.parent / "docs" / "reliability.md").read_text()
    missing = [c.id for c in CASES if f"`{c.id}`" not in doc]
    assert not missing, f"cases missing from docs/reliability.md: {missing}"


def test_one_word_str_spec_in_typed_shard_map_works() -> None:
    """typeguard would read ``f32['batch']`` as ``f32[batch]`` (a forward reference) and fail
    when the function runs. typed_shard_map checks arguments and results itself and does not
    instrument the body: str specs work, and are checked."""

    def body(x: f32["batch/d"], y: f32["batch"]) -> f32["batch/d"]:  # noqa: F821, UP037
        return x * 2

    f = typed_shard_map(body)
    x = np.arange(8, dtype=np.float32)
    with jax.set_mesh(MESH):
        np.testing.assert_array_equal(np.asarray(jax.jit(f)(x, x)), 2 * x)
        np.testing.assert_array_equal(np.asarray(f(x, x)), 2 * x)
        with pytest.raises(TypeCheckError) as e:
            f(x, np.zeros(4, np.float32))
    msg = str(e.value)
    assert "argument 'y' of" in msg and "dim 0 'batch'" in msg
    assert "expected size 8 (batch=8 is already bound), got 4" in msg


def test_str_spec_body_with_annotated_locals_runs() -> None:
    """A str-spec body with annotated locals (once refused: typeguard instrumentation read
    them as forward references) runs; its arguments and result are checked."""
    f = typed_shard_map(_str_spec_and_assignment)
    x = np.arange(16, dtype=np.float32)
    with jax.set_mesh(MESH):
        np.testing.assert_array_equal(np.asarray(f(x)), 2 * x)
        np.testing.assert_array_equal(np.asarray(jax.jit(f)(x)), 2 * x)
        with pytest.raises(TypeCheckError) as e:
            f(np.zeros((16, 2), np.float32))
        with pytest.raises(TypeCheckError) as e2:
            f(np.zeros(12, np.float32))  # 12 rows do not split over d=8
    msg = str(e.value)
    assert "argument 'x' of _str_spec_and_assignment()" in msg and "rank" in msg, msg
    assert "divisible" in str(e2.value) and "d=8" in str(e2.value)


@typed_shard_map
def tsm_roles_scaled(x: f32[b"B/batch M/tensor"]) -> f32[b"B/batch M/tensor"]:
    return x * shardops.axis_size("tensor")


def test_eager_calls_resolve_specs_under_the_rules_of_each_call() -> None:
    """A typed_shard_map function called eagerly under rules A, then B, then A again lays its
    result out, and runs its body, under the rules of each call (one resolved plan per rules)."""
    x = np.arange(8 * 4, dtype=np.float32).reshape(8, 4)
    rules_a = {"batch": "x", "tensor": "y"}  # B over x=4, M over y=2
    rules_b = {"batch": ("x", "y"), "tensor": None}  # B over x and y, M replicated
    with jax.set_mesh(MESH2):
        for rules, spec, block, factor in [
            (rules_a, P("x", "y"), (2, 2), 2),
            (rules_b, P(("x", "y"), None), (1, 4), 1),
            (rules_a, P("x", "y"), (2, 2), 2),
            ({"batch": "y", "tensor": "x"}, P("y", "x"), (4, 1), 4),
        ]:
            with axis_rules(rules):
                out = tsm_roles_scaled(x)
            assert out.sharding.spec == spec, (rules, out.sharding.spec)  # type: ignore[attr-defined]
            assert {s.data.shape for s in out.addressable_shards} == {block}
            np.testing.assert_array_equal(np.asarray(out), factor * x)


# ---------------------------------------------------------------------------------------------
# What typed_shard_map runs: functions, bound methods, partials, callable objects
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_bound_methods_partials_and_callable_objects_run() -> None:
    """Each kind of callable runs eagerly and under jit with its annotations checked, and
    gives what the plain function gives on the global arrays."""
    model = Scaler(3.0)
    x = np.arange(8, dtype=np.float32)
    w = np.arange(8, dtype=np.float32) + 1
    cases = [
        (typed_shard_map(model.apply), (x,), {}, x * 3),
        (typed_shard_map(model), (x, w), {}, x * w * 3),
        (typed_shard_map(model), (x,), {"w": w}, x * w * 3),
        # a keyword-bound non-array parameter becomes static; an array one stays an input
        (typed_shard_map(functools.partial(scaled, s=2.0)), (x, w), {}, x * w * 2),
        (typed_shard_map(functools.partial(scaled, w=w, s=2.0)), (x,), {}, x * w * 2),
        (typed_shard_map(functools.partial(model, w=w)), (x,), {}, x * w * 3),
        (typed_shard_map(functools.partial(model.apply)), (x,), {}, x * 3),
    ]
    with jax.set_mesh(MESH):
        for f, args, kwargs, want in cases:
            np.testing.assert_allclose(np.asarray(f(*args, **kwargs)), want)
            np.testing.assert_allclose(np.asarray(jax.jit(f)(*args, **kwargs)), want)
        # The annotations are checked: a size that does not divide, then a wrong dtype.
        with pytest.raises(TypeCheckError, match=r"argument 'x' of Scaler\.apply\(\)"):
            typed_shard_map(model.apply)(np.zeros(12, np.float32))
        with pytest.raises(TypeCheckError, match=r"argument 'w' of partial\(scaled\)\(\)"):
            typed_shard_map(functools.partial(scaled, s=2.0))(x, w.astype(np.int32))
    # Names in messages and plans.
    assert typed_shard_map(model).__shardlib_signature__.name == "Scaler.__call__"
    assert typed_shard_map(model.apply).__shardlib_signature__.name == "Scaler.apply"
    plan = typed_shard_map(functools.partial(scaled, s=2.0)).__shardlib_signature__
    assert plan.name == "partial(scaled)"
    assert [p.name for p in plan.params if p.static] == ["s"]


def test_partial_binding_a_replicated_array_positionally_is_allowed() -> None:
    """Only split arrays are refused when bound positionally: a replicated one is the same
    constant on every device, which is what closing over it gives."""

    def add(b: f32[b"n"], x: f32[b"n/d"]) -> f32[b"n/d"]:
        return x + b[: x.shape[0]] * 0 + 1

    x = np.zeros(8, np.float32)
    with jax.set_mesh(MESH):
        out = typed_shard_map(functools.partial(add, np.zeros(8, np.float32)))(x)
    np.testing.assert_allclose(np.asarray(out), x + 1)


# ---------------------------------------------------------------------------------------------
# JAX's errors inside shardops ops, in shardlib's words
# ---------------------------------------------------------------------------------------------


def _failing(exc: BaseException) -> Callable[..., Any]:
    def boom(*args: Any, **kwargs: Any) -> Any:
        raise exc

    return boom


def _gather_body(x: f32[b"a/x b"]) -> f32[b"a b"]:
    return shardops.all_gather("a/x b -> a b", x)


def _psum_body(x: f32[b"a/x b"]) -> f32[b"a/x b"]:
    return shardops.psum("a/x b", x, axes="y")


def _all_to_all_body(x: f32[b"a/x b"]) -> f32[b"a b/x"]:
    return shardops.all_to_all("a/x b -> a b/x", x)


def _psum_scatter_body(x: f32[b"a b"]) -> f32[b"a b/y"]:
    return shardops.psum_scatter("a b -> a b/y", x)


@pytest.mark.parametrize(
    ("primitive", "body", "exc"),
    [
        ("all_gather", _gather_body, ValueError("bad gather")),
        ("psum", _psum_body, TypeError("bad sum")),
        ("all_to_all", _all_to_all_body, KeyError("axis")),
        ("psum_scatter", _psum_scatter_body, RuntimeError("bad scatter")),
    ],
)
def test_jax_errors_in_collectives_name_the_op(monkeypatch, primitive, body, exc) -> None:
    """An exception JAX raises while an op emits its collective is re-raised naming the op,
    its spec and its input, with JAX's text after; its type is a subclass of JAX's (so
    ``except ValueError`` still works) and JAX's exception is its ``__cause__``."""
    monkeypatch.setattr(jax.lax, primitive, _failing(exc))
    f = typed_shard_map(body)
    with jax.set_mesh(MESH2), pytest.raises(type(exc)) as info:
        f(zeros(8, 4))
    err = info.value
    msg = str(err)
    assert msg.startswith(f"{primitive}('a"), msg
    assert "on input f32[" in msg and "per device" in msg, msg
    assert f"jax.lax.{primitive} refused it" in msg, msg
    assert msg.endswith(f"{type(exc).__name__}: {exc}"), msg
    assert err.__cause__ is exc
    assert type(err) is not type(exc) and type(err).__name__ == type(exc).__name__


def test_shardlib_errors_raised_inside_ops_are_not_wrapped(monkeypatch) -> None:
    """A shardlib error raised while an op emits (here a SpecError) passes through as is."""
    own = SpecError("own error", "a b")
    monkeypatch.setattr(jax.lax, "all_gather", _failing(own))
    with jax.set_mesh(MESH2), pytest.raises(SpecError) as info:
        typed_shard_map(_gather_body)(zeros(8, 4))
    assert info.value is own


def test_einsum_keyword_error_keeps_jax_type() -> None:
    with pytest.raises(TypeError) as info:
        shardops.einsum_unreduced("a b, b c -> a c", zeros(2, 3), zeros(3, 4), foo=1)
    err = info.value
    assert isinstance(err.__cause__, TypeError) and err.__cause__ is not err
    assert str(err).endswith(f"TypeError: {err.__cause__}")


# ---------------------------------------------------------------------------------------------
# The catalogue in docs/reliability.md:
#   SHARDLIB_WRITE_CATALOGUE=1 pytest tests/test_misuse.py -k catalogue_is_documented
# rewrites it from CASES and the messages they raise
# ---------------------------------------------------------------------------------------------

# The first case of each section of the page, and the section's title.
SECTIONS = {
    "wrong-dtype": "Values that do not match their annotation",
    "spec-empty-axis": "Malformed specs",
    "all-gather-adds": "Op specs that do not describe the named collective",
    "collective-outside-shard-map": "Where collectives may run",
    "return-gathered-replicated": "typed_shard_map",
    "return-unreduced": "Pending reductions (partial sums)",
    "make-shardings-no-mesh": "Pytree helpers and annotation types",
    "role-unknown": "Axis roles and their rules",
    "pipeline-permute-in-stage": "Pipeline schedules, attention and MoE",
}
CATALOGUE_HEADING = "## The misuse catalogue"


def _shown_message(case: Case) -> str:
    """The message of ``case`` as the page shows it."""
    try:
        case.fn()
    except case.exc as e:
        msg = str(e)
        if isinstance(e, jax.errors.JaxRuntimeError):  # shardlib's part of XLA's report
            msg = "... " + msg[msg.index("TypeCheckError:") :].split("\n\t")[0].rstrip()
        ours, quoted, theirs = msg.partition("\n\nJAX's message: ")
        if quoted:  # JAX's long text, quoted after ours: its first words
            msg = f"{ours}{quoted}{' '.join(theirs.split()[:3])} ... (JAX's own text)"
        return msg
    raise AssertionError(f"{case.id} raised nothing")  # pragma: no cover - tests catch it


def catalogue_markdown() -> str:
    """The catalogue section of docs/reliability.md, from ``CASES`` and their real messages."""
    unknown = [i for i in SECTIONS if i not in {c.id for c in CASES}]
    assert not unknown, f"SECTIONS names cases that do not exist: {unknown}"
    out = [
        CATALOGUE_HEADING,
        "",
        "Each entry: the misuse, the exception and its message as shardlib prints it, and the fix.",
        "`MESH` is `jax.make_mesh((8,), ('d',))`, `MESH2` is `jax.make_mesh((4, 2), ('x', 'y'))`;",
        "the functions named are in `tests/test_misuse.py`.",
    ]
    for k, c in enumerate(CASES):
        if c.id in SECTIONS:
            out += ["", f"### {SECTIONS[c.id]}"] if k == 0 else ["", "", f"### {SECTIONS[c.id]}"]
        out += [
            "",
            f"**`{c.id}`**: {c.what}. Raises `{c.exc.__name__}`:",
            "",
            "```text",
            _shown_message(c),
            "```",
            "",
            f"*Fix:* {c.fix}.",
        ]
    return "\n".join(out) + "\n\n"


def write_catalogue(path: str = "docs/reliability.md") -> None:
    """Replace the catalogue section (to the end of the page) and the case counts."""
    import re
    from pathlib import Path

    page = Path(__file__).parent.parent / path
    text = page.read_text()
    head = text[: text.index(CATALOGUE_HEADING)]
    head = re.sub(
        r"(\| misuse cases, each asserting the error type and what its message names \| \*\*)\d+",
        rf"\g<1>{len(CASES)}",
        head,
    )
    head = re.sub(r"A table of \d+ wrong uses", f"A table of {len(CASES)} wrong uses", head)
    page.write_text(head + catalogue_markdown())
