"""A catalogue of wrong uses of shardlib: each one fails with a clear, specific error.

Every entry of ``CASES`` is one misuse: a callable that commits it, the exception type it
must raise and the substrings its message must contain: the offending argument, dim or mesh
axis, and expected vs actual where there are two. ``docs/reliability.md`` lists the same
catalogue with the actual messages and their fixes.

typeguard instruments only functions whose annotations use module-level names, so the
checked functions used here live at module level.
"""

from __future__ import annotations

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

from shardlib import SpecError, shardops
from shardlib.shardops import PendingReductionError
from shardlib.shardtypes import (
    Array,
    Scope,
    check,
    f32,
    is_fully_sharded,
    make_shardings,
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
    y: f32[b"batch/d"] = x * 2
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
    xfail: str | None = None  # a known bug in a module this file does not own


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
        ["psum", "malformed pending-reduction clause '{t}'", "'{+t}'"],
        "write the pending axes as `{+t}`",
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
        ["psum_scatter: the spec scatters nothing", "psum(spec, x, axes=...)"],
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
        ["psum: name at least one mesh axis to reduce over"],
        "pass axes='d' (or several: 'd/t')",
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
        "tsm-str-spec-with-body-annotation",
        "a str spec (typeguard reads it as a forward reference) in a function whose body "
        "has annotated assignments",
        lambda: typed_shard_map(_str_spec_and_assignment),
        TypeError,
        ["_str_spec_and_assignment", "parameter 'x'", "f32['batch/d']", "b'batch/d'"],
        "write the spec as bytes: f32[b'batch/d']",
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
        "pass-unreduced",
        "passing a partial sum to a typechecked function",
        on(MESH, lambda: tsm_passes_unreduced(zeros(2, 8), zeros(8, 3))),
        PendingReductionError,
        ['argument "y"', "wants_reduced()", "partial sum", "'d'", "einsum_unreduced("],
        "reduce it before the call",
    ),
    Case(
        "nonlinear-on-unreduced",
        "jnp.exp of a partial sum",
        on(MESH, lambda: tsm_exp_of_unreduced(zeros(2, 8), zeros(8, 3))),
        TypeError,
        ["shardlib.shardops.Unreduced", "pending sum over 'd'"],
        "reduce before non-linear operations",
    ),
    Case(
        "add-reduced-to-unreduced",
        "adding an ordinary array to a partial sum",
        on(MESH, lambda: tsm_adds_reduced_to_unreduced(zeros(2, 8), zeros(8, 3))),
        PendingReductionError,
        ["+ with a value that is not a partial sum", "once per device of 'd'"],
        "reduce first, or add it on one device only",
    ),
    Case(
        "bool-of-unreduced",
        "branching on a partial sum",
        on(MESH, lambda: tsm_branches_on_unreduced(zeros(2, 8), zeros(8, 3))),
        PendingReductionError,
        ["used as a Python bool", "partial sum", "'d'", "einsum_unreduced("],
        "reduce first; branch with jnp.where / lax.cond on reduced values",
    ),
    Case(
        "pmax-of-unreduced",
        "pmax of a partial sum",
        on(MESH, lambda: tsm_pmax_of_unreduced(zeros(2, 8), zeros(8, 3))),
        PendingReductionError,
        ["pmax('B F')", "the input is a partial sum", "'d'"],
        "psum first, then pmax",
    ),
    Case(
        "product-of-partial-sums",
        "an einsum of two partial sums",
        on(MESH, lambda: tsm_product_of_partial_sums(zeros(2, 8), zeros(8, 3))),
        PendingReductionError,
        ["einsum_unreduced('B F, B F -> B F')", "operands 0 and 1 are both partial sums"],
        "reduce one operand first",
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
    return [
        pytest.param(c, id=c.id, marks=[pytest.mark.xfail(reason=c.xfail, strict=True)])
        if c.xfail
        else pytest.param(c, id=c.id)
        for c in cases
    ]


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
    """docs/reliability.md lists every case (regenerate it when adding one)."""
    from pathlib import Path

    doc = (Path(__file__).parent.parent / "docs" / "reliability.md").read_text()
    missing = [c.id for c in CASES if f"`{c.id}`" not in doc]
    assert not missing, f"cases missing from docs/reliability.md: {missing}"


def test_one_word_str_spec_in_typed_shard_map_works() -> None:
    """typeguard would read ``f32['batch']`` as ``f32[batch]`` (a forward reference) and fail
    when the function runs. typed_shard_map checks arguments and results itself, so a body
    without annotated assignments runs uninstrumented: str specs work, and are checked."""

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
