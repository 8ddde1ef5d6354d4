"""The shortcuts that keep tracing cheap still refuse every wrong value (issue 23, item 5).

Three checks are skipped or shortened while a program is traced, each by remembering what a
passing check depended on:

1. A ``shardops`` operand or result (a traced per-device block) whose shape passed the same
   spec before under the same manual axis sizes only compares its names with the current
   bindings (`shardlib._check.checking.check_block`).
2. The global checks of a ``typed_shard_map`` call whose traced arguments have the structure,
   types and meshes of a call that passed (and moved nothing) are not run again: the call
   binds the names that call bound (`shardlib._shard_map.call.Call._checked`).
3. With a bare ``typeguard.typechecked`` function seen in the process, each op walks the stack
   for its memo; the walk is remembered per context entry and calling frame
   (`shardlib._check.scopes.op_scope`).
4. An op whose plan, manual axis sizes and operand shapes and dtypes are those of a call that
   passed replays it: binds the names it bound, emits, and compares the result's shape and
   dtype with the one checked then (`shardlib._ops.run`, ``_OP_MEMO``).

Each test below makes the shortcut's remembered answer wrong for a new value (a name bound
to another size, other manual axis sizes, another spec, other argument types or structure, a
layout move, another calling frame or context entry, a result of another shape) and checks
that shardlib still refuses it, or binds where it must; each was run with the rule disabled
and fails then (a replay inside the analysis trace fails tests/test_pending.py instead).
"""

from __future__ import annotations

import contextlib
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import typeguard
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P
from typeguard import TypeCheckError

from shardlib import shardops
from shardlib._analysis.notes import recording
from shardlib._check.scopes import Scope
from shardlib.shardtypes import check, f32, i32, pytree_dataclass, typed_shard_map


def _mesh(n: int, auto: bool = True) -> jax.sharding.Mesh:
    kind = (AxisType.Auto,) if auto else (AxisType.Explicit,)
    return jax.make_mesh((n,), ("d",), axis_types=kind, devices=jax.devices()[:n])


def _smap(body, mesh, in_specs):
    """``jax.shard_map`` of ``body``, replicated result (gathered results are typed varying:
    no vma check)."""
    return jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=P(), check_vma=False)


def _traced(fn, mesh, *args):
    """``fn`` traced under ``jax.jit`` on ``mesh`` (``jax.shard_map`` bodies run then)."""
    with jax.set_mesh(mesh):
        return jax.jit(fn).trace(*args)


# -- 1. op operands and results: the shape seen before, other bindings, sizes or specs --------


def _gather_body(x: jax.Array, other: jax.Array) -> jax.Array:
    with Scope():
        check(None, "n", other)  # binds n to other's size first (when it is not x's)
        return shardops.all_gather("n/d -> n", x)


def test_op_operand_seen_before_is_refused_against_another_binding() -> None:
    """The same block shape passed ``n/d -> n`` with n=8; in a scope where n=6 it is refused."""
    mesh = _mesh(4)
    smap = _smap(_gather_body, mesh, (P("d"), P()))
    for _ in range(2):  # the second time the op's check is a remembered one
        _traced(smap, mesh, jnp.zeros(8), jnp.zeros(8))
        with pytest.raises(TypeCheckError, match=r"n=6 is already bound"):
            _traced(smap, mesh, jnp.zeros(8), jnp.zeros(6))


def _literal_body(x: jax.Array) -> jax.Array:
    with Scope():
        return shardops.all_gather("8/d -> 8", x)


def test_op_operand_seen_before_is_refused_under_other_manual_sizes() -> None:
    """A block of 2 is 8 globally over d=4 and 4 over d=2: the same shape, another answer."""
    for _ in range(2):
        m4 = _mesh(4)
        smap4 = _smap(_literal_body, m4, P("d"))
        y = jax.jit(smap4)(jnp.arange(8.0))
        np.testing.assert_array_equal(np.asarray(y), np.arange(8.0))
        m2 = _mesh(2)
        smap2 = _smap(_literal_body, m2, P("d"))
        with pytest.raises(TypeCheckError, match=r"expected size 8, got 4 \(per-device 2"):
            _traced(smap2, m2, jnp.zeros(4))


def _two_specs_body(x: jax.Array) -> jax.Array:
    with Scope():
        y = shardops.psum("a b", x, axes="d")  # binds a=2, b=3
        return shardops.psum("b a", y, axes="d")  # the same shape, the names swapped


def test_op_result_seen_before_is_checked_against_another_spec() -> None:
    mesh = _mesh(4)
    smap = _smap(_two_specs_body, mesh, P())
    for _ in range(2):
        with pytest.raises(TypeCheckError, match=r"'b a'(.|\n)*b=3 is already bound"):
            _traced(smap, mesh, jnp.zeros((2, 3)))
    square = _traced(smap, mesh, jnp.zeros((3, 3)))  # a=b: both specs hold
    assert square.jaxpr is not None


@typed_shard_map
def int_block_as_float(x: i32[b"n/d"]) -> f32[b"n/d"]:
    check(None, "n/d", x)  # passes the int32 block against the annotation's spec, any dtype
    return x  # the result check expects float32: the same block and spec are refused here


def test_body_result_of_a_block_checked_without_a_dtype_is_checked_for_its_dtype() -> None:
    """The body's result check takes the op operands' shortcut (`check_block`); the dtype
    it expects is part of the remembered key, so a check without one does not answer it."""
    with jax.set_mesh(_mesh(4)):
        for _ in range(2):
            with pytest.raises(TypeCheckError, match=r"dtype: expected float32, got int32"):
                jax.jit(int_block_as_float).trace(jnp.zeros(8, jnp.int32))


# Ops replay in typed_shard_map's own trace, where no notes are kept (its analysis trace keeps
# them and checks every op in full); `_quiet` traces a shard_map body the same way.


def _quiet(fn, mesh, *args):
    """``_traced``, with notes off (as typed_shard_map traces a body after its analysis)."""
    with recording(notes=False):
        return _traced(fn, mesh, *args)


def _gather_then_check(x: jax.Array, other: jax.Array) -> jax.Array:
    with Scope():
        y = shardops.all_gather("k/d -> k", x)  # binds k to x's global size
        check(None, "k", other)  # refused when other's size differs
        return y


def test_replayed_op_binds_the_names_the_passing_call_bound() -> None:
    """The replayed gather still binds k, so the check after it refuses another size."""
    mesh = _mesh(4)
    smap = _smap(_gather_then_check, mesh, (P("d"), P()))
    _quiet(smap, mesh, jnp.zeros(8), jnp.zeros(8))  # passes: remembered
    with pytest.raises(TypeCheckError, match=r"k=8 is already bound"):
        _quiet(smap, mesh, jnp.zeros(8), jnp.zeros(6))


def _dot_eight(x: jax.Array) -> jax.Array:
    with Scope():
        shardops.einsum_unreduced("8/d, 8/d ->", x, x)  # a scalar, whatever d is
        return x


def _shift_eight(x: jax.Array) -> jax.Array:
    with Scope():
        return shardops.shift("8/d", x, axis="d")  # blocks of the same shape, whatever d is


@pytest.mark.parametrize("body", [_shift_eight, _dot_eight], ids=["one operand", "two"])
def test_op_is_not_replayed_under_other_manual_sizes(body) -> None:
    """Blocks of 2 are 8 globally over d=4 and pass; over d=2 they are 4 and the result has
    the same shape: only the operand check, made again, refuses them."""
    _quiet(_smap(body, _mesh(4), P("d")), _mesh(4), jnp.zeros(8))
    with pytest.raises(TypeCheckError, match=r"expected size 8, got 4"):
        _quiet(_smap(body, _mesh(2), P("d")), _mesh(2), jnp.zeros(4))


@typed_shard_map
def gather_eight(x: f32[b"n/d"]) -> f32[b"n/d"]:
    shardops.all_gather("8/d -> 8", x)  # only the op's own checks see its result
    return x


def test_replayed_op_checks_a_result_of_another_shape(monkeypatch) -> None:
    """A replay compares the emitted result with the one checked then: an emitter that (here,
    deliberately) stops gathering is refused by the result check."""
    from shardlib._ops import emit as emit_mod
    from shardlib._ops.collective_recipes import AllGatherRecipe

    with jax.set_mesh(_mesh(4)):
        jax.jit(gather_eight).trace(jnp.zeros(8))  # passes: remembered
        broken = emit_mod.Emitter("jax.lax.all_gather", lambda plan, xs, kwargs: xs[0])
        monkeypatch.setitem(emit_mod.EMITTERS, AllGatherRecipe, broken)
        with pytest.raises(TypeCheckError, match=r"expected size 8, got 2"):
            jax.jit(lambda x: gather_eight(x)).trace(jnp.zeros(8))  # a new function: traced


# -- 2. typed_shard_map arguments: other types, structure, layout, nesting ----------------------


@typed_shard_map
def pair_sum(x: f32[b"n/d"], y: f32[b"n/d"]) -> f32[b"n/d"]:
    return x + y


def test_arguments_of_other_sizes_or_dtypes_are_checked_again() -> None:
    with jax.set_mesh(_mesh(4)):
        for _ in range(2):  # from the second call on, the passing types are remembered
            out = jax.jit(pair_sum)(jnp.arange(8.0), jnp.ones(8))
            np.testing.assert_array_equal(np.asarray(out), np.arange(8.0) + 1)
        with pytest.raises(TypeCheckError, match=r"argument 'y'(.|\n)*n=8 is already bound"):
            jax.jit(pair_sum)(jnp.zeros(8), jnp.zeros(12))
        with pytest.raises(TypeCheckError, match=r"argument 'y'(.|\n)*dtype: expected float32"):
            jax.jit(pair_sum)(jnp.zeros(8), jnp.zeros(8, jnp.int32))


def test_arguments_seen_on_one_mesh_are_checked_again_on_another() -> None:
    for _ in range(2):
        with jax.set_mesh(_mesh(4)):
            np.testing.assert_array_equal(
                np.asarray(jax.jit(pair_sum)(jnp.ones(4), jnp.ones(4))), 2 * np.ones(4)
            )
        with (
            jax.set_mesh(_mesh(8)),
            pytest.raises(TypeCheckError, match=r"size 4 is not divisible by .*d=8"),
        ):
            jax.jit(pair_sum)(jnp.ones(4), jnp.ones(4))


@contextlib.contextmanager
def legacy_mesh(mesh: jax.sharding.Mesh):
    """The legacy ``with mesh:`` (its DeprecationWarning, in newer JAX, is expected here)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*with mesh", category=DeprecationWarning)
        mesh.__enter__()
    try:
        yield mesh
    finally:
        mesh.__exit__(None, None, None)


def test_arguments_seen_under_one_legacy_mesh_are_checked_again_under_another() -> None:
    """Under the legacy ``with mesh:`` the traced arguments' types name no mesh, and no
    abstract mesh is in force: only the target mesh tells the two calls apart."""
    for _ in range(2):
        with legacy_mesh(_mesh(4)):
            out = jax.jit(pair_sum)(jnp.ones(4), jnp.ones(4))
            np.testing.assert_array_equal(np.asarray(out), 2 * np.ones(4))
        with (
            legacy_mesh(_mesh(8)),
            pytest.raises(TypeCheckError, match=r"global size 4, which is not divisible by d=8"),
        ):
            jax.jit(pair_sum)(jnp.ones(4), jnp.ones(4))


@pytree_dataclass
class Pair:
    a: f32[b"n/d"]
    b: f32[b"n/d"]


@typed_shard_map
def pair_total(p: Pair) -> f32[b"n/d"]:
    return p.a + p.b


def test_arguments_of_another_structure_are_checked_again() -> None:
    """The same leaves in a tuple instead of the annotated dataclass: refused every time."""
    with jax.set_mesh(_mesh(4)):
        for _ in range(2):
            out = jax.jit(lambda a, b: pair_total(Pair(a=a, b=b)))(jnp.ones(8), jnp.ones(8))
            np.testing.assert_array_equal(np.asarray(out), 2 * np.ones(8))
            with pytest.raises(TypeCheckError, match=r"argument 'p' of pair_total\(\)"):
                jax.jit(lambda a, b: pair_total((a, b)))(jnp.ones(8), jnp.ones(8))


def test_arguments_moved_to_their_layout_are_moved_on_every_call() -> None:
    """On an Explicit mesh a replicated input of a split annotation is resharded under jit:
    such a call is not remembered (its arguments are not the ones shard_map gets)."""
    mesh = _mesh(4, auto=False)
    with jax.set_mesh(mesh):
        x = jax.device_put(jnp.arange(8.0), jax.NamedSharding(mesh, P()))
        step = jax.jit(lambda x, y: pair_sum(x, y))
        for _ in range(3):
            out = step(x, x)
            np.testing.assert_array_equal(np.asarray(out), 2 * np.arange(8.0))
            step = jax.jit(lambda x, y: pair_sum(x, y))  # a fresh trace each time


@typed_shard_map
def split_twice(x: f32[b"n/d"]) -> f32[b"n/d"]:
    return x * 2


def test_nested_call_is_refused_after_the_same_types_passed_outside() -> None:
    mesh = _mesh(4)
    with jax.set_mesh(mesh):
        for _ in range(2):
            np.testing.assert_array_equal(
                np.asarray(jax.jit(split_twice)(jnp.ones(8))), 2 * np.ones(8)
            )
        inner = jax.shard_map(split_twice, in_specs=P(), out_specs=P())
        with pytest.raises(ValueError, match=r"already manual over mesh axis 'd'"):
            jax.jit(inner)(jnp.ones(8))


@typed_shard_map
def counts(x: i32[b"n/d"]) -> i32[b"n/d"]:
    return x + 1


def test_eager_calls_are_checked_every_time() -> None:
    with jax.set_mesh(_mesh(4)):
        for _ in range(2):
            np.testing.assert_array_equal(np.asarray(counts(jnp.arange(8))), np.arange(8) + 1)
            with pytest.raises(TypeCheckError, match=r"dtype: expected int32, got float32"):
                counts(jnp.zeros(8))


# -- 3. the bare-typeguard walk, remembered per context entry and calling frame ----------------


@typeguard.typechecked
def bare_dot(a: f32[b"n"]) -> jax.Array:
    """A bare typeguard function (seqax's spelling): its ops bind in its own call's scope."""
    return shardops.einsum_unreduced("n, n ->", a, a)


def plain_dot(a: jax.Array) -> jax.Array:
    return shardops.einsum_unreduced("n, n ->", a, a)


def test_op_in_another_frame_does_not_reuse_a_bare_call_s_walk() -> None:
    with Scope():
        check(jnp.float32, "n", jnp.zeros(3))
        for _ in range(2):
            assert float(bare_dot(jnp.ones(5))) == 5.0  # n=5 in bare_dot's own scope
            with pytest.raises(TypeCheckError, match=r"n=3 is already bound"):
                plain_dot(jnp.ones(5))  # in the `with Scope()`: n=3 there


OUTER = Scope()


@typeguard.typechecked
def bare_then_enter(a: f32[b"n"], b: jax.Array) -> None:
    shardops.einsum_unreduced("n, n ->", a, a)  # found: this call's memo (n = len(a))
    with OUTER:  # the same Scope object, entered again here: a new context entry
        shardops.einsum_unreduced("n, n ->", b, b)  # binds in OUTER, not in the memo


def test_op_under_a_re_entered_scope_does_not_reuse_the_walk_of_another_entry() -> None:
    with OUTER:
        check(jnp.float32, "n", jnp.zeros(7))
        for _ in range(2):
            bare_then_enter(jnp.ones(3), jnp.ones(7))  # n=3 in the call, n=7 in OUTER
            with pytest.raises(TypeCheckError, match=r"n=7 is already bound"):
                bare_then_enter(jnp.ones(3), jnp.ones(4))


def test_ops_from_one_frame_share_the_walk_and_its_memo() -> None:
    """Two ops from one bare call: both in its scope (the second by the remembered walk)."""

    @typeguard.typechecked
    def two(a: f32[b"n"], b: jax.Array) -> None:
        shardops.einsum_unreduced("n, n ->", a, a)
        shardops.einsum_unreduced("n, n ->", b, b)

    with Scope():
        check(jnp.float32, "n", jnp.zeros(9))
        for _ in range(2):
            two(jnp.ones(2), jnp.ones(2))  # both n=2, in two's scope (not the n=9 one)
            with pytest.raises(TypeCheckError, match=r"n=2 is already bound"):
                two(jnp.ones(2), jnp.ones(9))
