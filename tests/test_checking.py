"""Checking values against annotations: dtype, rank, sizes, bindings, layouts and scopes.

Through ``typeguard.typechecked`` (after ``register_with_typeguard()``) and through
``check(dtype, spec, value)``; outside ``shard_map`` (global shapes and actual sharding on
1-D, 2-D and 3-D meshes, Explicit and Auto axes, eager and jitted) and inside it (per-device
shapes times the manual axis sizes).

typeguard only instruments functions whose annotations use module-level names, so the
typechecked functions live at module level (or use only module-level names).
"""

from __future__ import annotations

import contextlib
import re
import threading
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from typeguard import TypeCheckError, typechecked

from shardlib import shardops
from shardlib.shardtypes import (
    Scope,
    check,
    f32,
    i32,
    register_with_typeguard,
    scope,
    typed_shard_map,
)
from tests._mesh_util import make_mesh, place

register_with_typeguard()

JaxRuntimeError = jax.errors.JaxRuntimeError


@contextlib.contextmanager
def legacy_mesh(mesh):
    """The legacy ``with mesh:`` (its DeprecationWarning, in newer JAX, is expected here)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*with mesh", category=DeprecationWarning)
        mesh.__enter__()
    try:
        yield mesh
    finally:
        mesh.__exit__(None, None, None)


def _bullets(msg: str) -> list[str]:
    """The ``  - reason`` lines of a TypeCheckError message."""
    return [line[4:] for line in msg.splitlines() if line.startswith("  - ")]


# ------------------------------------------------------------------ basics (no mesh)


@typechecked
def pair(x: f32[b"batch len"], y: f32[b"batch"]) -> f32[b"batch"]:
    return y + x.sum(1)


@typechecked
def literal(x: f32[b"2 3"]) -> f32[b"2 3"]:
    return x


@typechecked
def scalar(x: f32[b""]) -> f32[b""]:
    return x * 2


@typechecked
def repeated(x: f32[b"n n"]) -> f32[b"n"]:
    return jnp.diagonal(x)


@typechecked
def bad_return(x: f32[b"n"]) -> f32[b"n"]:
    return jnp.concatenate([x, x])


@typechecked
def same_sizes(x: f32[b"batch len"], y: f32[b"batch len"]) -> f32[b"batch len"]:
    return x + y


def test_matching_values_pass_and_compute():
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    y = np.arange(3, dtype=np.float32)
    np.testing.assert_allclose(pair(jnp.asarray(x), jnp.asarray(y)), y + x.sum(1))
    np.testing.assert_allclose(literal(jnp.ones((2, 3))), np.ones((2, 3)))
    assert float(scalar(jnp.float32(1.5))) == 3.0
    assert float(scalar(np.float32(2.0))) == 4.0
    np.testing.assert_allclose(repeated(jnp.eye(3)), np.ones(3))


def test_dtype_mismatch_message():
    with pytest.raises(TypeCheckError) as e:
        pair(jnp.zeros((3, 4), jnp.int32), jnp.zeros(3))
    msg = str(e.value)
    assert msg.startswith('argument "x"')
    assert "in pair(): does not match f32['batch len']:" in msg
    assert _bullets(msg) == ["dtype: expected float32, got int32 (cast with .astype())"]
    assert "(mesh axes: none; bindings: none yet)" in msg


def test_rank_mismatch_message():
    with pytest.raises(TypeCheckError) as e:
        pair(jnp.zeros(3), jnp.zeros(3))
    msg = str(e.value)
    assert msg.startswith('argument "x"') and "in pair()" in msg
    assert _bullets(msg) == ["rank: expected 2 dims (batch len), got 1: shape (3,)"]


def test_binding_mismatch_names_dim_expected_actual_and_bindings():
    with pytest.raises(TypeCheckError) as e:
        pair(jnp.zeros((3, 4)), jnp.zeros(5))
    msg = str(e.value)
    assert msg.startswith('argument "y"')
    assert "in pair(): does not match f32['batch']:" in msg
    assert _bullets(msg) == ["dim 0 'batch': expected size 3 (batch=3 is already bound), got 5"]
    assert "bindings: batch=3, len=4" in msg


def test_every_mismatching_dim_is_listed():
    with pytest.raises(TypeCheckError) as e:
        same_sizes(jnp.zeros((3, 4)), jnp.zeros((5, 6)))
    assert _bullets(str(e.value)) == [
        "dim 0 'batch': expected size 3 (batch=3 is already bound), got 5",
        "dim 1 'len': expected size 4 (len=4 is already bound), got 6",
    ]
    with pytest.raises(TypeCheckError) as e:
        literal(jnp.zeros((4, 5)))
    assert _bullets(str(e.value)) == [
        "dim 0 '2': expected size 2, got 4",
        "dim 1 '3': expected size 3, got 5",
    ]
    # dtype and shape problems are reported together
    with pytest.raises(TypeCheckError) as e:
        literal(jnp.zeros((2, 4), jnp.int32))
    assert _bullets(str(e.value)) == [
        "dtype: expected float32, got int32 (cast with .astype())",
        "dim 1 '3': expected size 3, got 4",
    ]


def test_scalars():
    with pytest.raises(TypeCheckError) as e:
        scalar(jnp.zeros(1))
    assert _bullets(str(e.value)) == ["rank: expected 0 dims (a scalar), got 1: shape (1,)"]
    with pytest.raises(TypeCheckError, match=r"expected an array matching f32\[''\], got float"):
        scalar(1.5)


def test_repeated_name_in_one_value():
    with pytest.raises(TypeCheckError) as e:
        repeated(jnp.zeros((3, 4)))
    assert _bullets(str(e.value)) == [
        "dim 1 'n': expected size 3 (n=3 from an earlier dim of this value), got 4"
    ]


def test_return_value_is_checked_against_argument_bindings():
    with pytest.raises(TypeCheckError) as e:
        bad_return(jnp.zeros(3))
    msg = str(e.value)
    assert msg.startswith("the return value")
    assert "in bad_return()" in msg
    assert _bullets(msg) == ["dim 0 'n': expected size 3 (n=3 is already bound), got 6"]


def test_non_arrays_are_rejected():
    with pytest.raises(
        TypeCheckError, match=r"expected an array matching f32\['batch'\], got list"
    ):
        pair(jnp.zeros((3, 4)), [1.0, 2.0, 3.0])


def test_check_function():
    with Scope() as s:
        check(jnp.float32, "a b", jnp.zeros((2, 3)))
        check(jnp.int32, b"b", jnp.zeros(3, jnp.int32))
        check(None, "a", jnp.zeros(2, jnp.int8))  # dtype None: shape only
        assert s.bindings == {"a": 2, "b": 3}
        with pytest.raises(TypeCheckError) as e:
            check(jnp.float32, "b a", jnp.zeros((2, 3), jnp.int32))
    msg = str(e.value)
    assert msg.startswith("value does not match f32['b a']:")
    assert _bullets(msg) == [
        "dtype: expected float32, got int32 (cast with .astype())",
        "dim 0 'b': expected size 3 (b=3 is already bound), got 2",
        "dim 1 'a': expected size 2 (a=2 is already bound), got 3",
    ]
    assert "bindings: a=2, b=3" in msg


# A property test: random specs of names and literals against random shapes, with an oracle
# that binds names left to right.
_dim = st.one_of(st.sampled_from(["a", "b", "c"]), st.integers(1, 3))


@given(
    specs=st.lists(st.lists(_dim, max_size=3), min_size=1, max_size=3),
    shapes=st.lists(st.lists(st.integers(1, 3), max_size=3), min_size=3, max_size=3),
)
def test_bindings_property(specs, shapes):
    bound: dict[str, int] = {}
    with Scope() as s:
        for spec_dims, shape in zip(specs, shapes, strict=False):
            spec = " ".join(str(d) for d in spec_dims)
            value = np.zeros(shape, np.float32)
            if len(shape) != len(spec_dims):
                with pytest.raises(TypeCheckError, match="rank: expected"):
                    check(np.float32, spec, value)
                continue
            bad, new = [], {}
            for i, (d, n) in enumerate(zip(spec_dims, shape, strict=True)):
                want = d if isinstance(d, int) else bound.get(d, new.get(d))
                if want is not None and want != n:
                    bad.append(i)
                elif isinstance(d, str):
                    new.setdefault(d, n)
            if bad:
                with pytest.raises(TypeCheckError) as e:
                    check(np.float32, spec, value)
                got = [int(re.match(r"dim (\d+)", b).group(1)) for b in _bullets(str(e.value))]
                assert got == bad
            else:
                check(np.float32, spec, value)
                bound.update(new)
            assert s.bindings == bound


# ------------------------------------------------------------------ outside shard_map: layouts


@typechecked
def double_1d(x: f32[b"a/d b"]) -> f32[b"a/d b"]:
    return x * 2


@typechecked
def double_2d(x: f32[b"a/x b/y"]) -> f32[b"a/x b/y"]:
    return x * 2


@typechecked
def double_3d(x: f32[b"a/x/y b/z"]) -> f32[b"a/x/y b/z"]:
    return x * 2


# name: (mesh shape, axis names, function, its spec, a wrong layout, want text, got text)
LAYOUT_CASES = {
    "1d": ((8,), ("d",), double_1d, "a/d b", "a b/d", "P('d', None)", "P(None, 'd')"),
    "2d": ((4, 2), ("x", "y"), double_2d, "a/x b/y", "a/y b/x", "P('x', 'y')", "P('y', 'x')"),
    "3d": (
        (2, 2, 2),
        ("x", "y", "z"),
        double_3d,
        "a/x/y b/z",
        "a/z b/x/y",
        "P(('x', 'y'), 'z')",
        "P('z', ('x', 'y'))",
    ),
}
X = np.arange(16 * 16, dtype=np.float32).reshape(16, 16)


@pytest.mark.parametrize("auto", [False, True], ids=["explicit", "auto"])
@pytest.mark.parametrize("case", sorted(LAYOUT_CASES))
def test_layout_good_eager_and_jit(case, auto):
    shape, names, f, spec, _, _, _ = LAYOUT_CASES[case]
    mesh = make_mesh(shape, names, auto=auto)
    with jax.set_mesh(mesh):
        x = place(X, mesh, spec)
        y = f(x)
        np.testing.assert_array_equal(np.asarray(y), 2 * X)
        assert y.sharding.is_equivalent_to(x.sharding, 2)
        np.testing.assert_array_equal(np.asarray(jax.jit(f)(x)), 2 * X)


@pytest.mark.parametrize("auto", [False, True], ids=["explicit", "auto"])
@pytest.mark.parametrize("case", sorted(LAYOUT_CASES))
def test_layout_bad_eager(case, auto):
    shape, names, f, spec, wrong, want, got = LAYOUT_CASES[case]
    mesh = make_mesh(shape, names, auto=auto)
    sizes = ", ".join(f"{a}={n}" for a, n in zip(names, shape, strict=True))
    with jax.set_mesh(mesh), pytest.raises(TypeCheckError) as e:
        f(place(X, mesh, wrong))
    msg = str(e.value)
    assert msg.startswith('argument "x"') and f"in {f.__name__}()" in msg
    assert _bullets(msg) == [
        f"layout: the annotation wants {want} but the array is laid out as {got} on mesh "
        f"({sizes}); move it with jax.device_put(x, NamedSharding(mesh, {want})) or jax.reshard"
    ]
    assert f"(mesh axes: {sizes}; bindings: none yet)" in msg


@pytest.mark.parametrize("case", sorted(LAYOUT_CASES))
def test_layout_bad_jit_explicit_fails_at_trace_time(case):
    shape, names, f, spec, wrong, want, got = LAYOUT_CASES[case]
    mesh = make_mesh(shape, names)
    with jax.set_mesh(mesh), pytest.raises(TypeCheckError) as e:
        jax.jit(f).trace(place(X, mesh, wrong))
    msg = str(e.value)
    assert msg.startswith('argument "x"') and f"in {f.__name__}()" in msg
    assert f"the annotation wants {want} but the array is laid out as {got}" in msg


@pytest.mark.parametrize("case", sorted(LAYOUT_CASES))
def test_layout_bad_jit_auto_fails_at_compile_time(case):
    """On Auto axes XLA picks layouts, so the check runs when the program is compiled."""
    shape, names, f, spec, wrong, want, got = LAYOUT_CASES[case]
    mesh = make_mesh(shape, names, auto=True)
    with jax.set_mesh(mesh):
        bad = place(X, mesh, wrong)
        lowered = jax.jit(f).lower(bad)  # tracing and lowering pass
        with pytest.raises(JaxRuntimeError) as e:
            lowered.compile()
        msg = str(e.value)
        assert f'argument "x" in {f.__name__}() does not match f32[{spec!r}]' in msg
        assert f"the annotation wants {want} but the array is laid out as {got}" in msg
        assert "checked at compile time: the mesh axes are Auto" in msg
        with pytest.raises(JaxRuntimeError, match=re.escape(f"laid out as {got}")):
            jax.jit(f)(bad)


@typechecked
def rows_d_cols_x(x: f32[b"a/d b/x"]) -> f32[b"a/d b/x"]:
    return x + 1


@typechecked
def rows_d(x: f32[b"a/d b"]) -> f32[b"a/d b"]:
    return x + 1


@pytest.mark.parametrize("auto", [False, True], ids=["explicit", "auto"])
def test_size_one_axes_and_trailing_none_are_equivalent(auto):
    mesh = make_mesh((8, 1), ("d", "x"), auto=auto)
    with jax.set_mesh(mesh):
        for f, placed in [
            (rows_d_cols_x, "a/d b"),
            (rows_d_cols_x, "a/d b/x"),
            (rows_d, "a/d b/x"),
            (rows_d, "a/d/x b"),
        ]:
            x = place(X, mesh, placed)
            np.testing.assert_array_equal(np.asarray(f(x)), X + 1)
            np.testing.assert_array_equal(np.asarray(jax.jit(f)(x)), X + 1)
        x = jax.device_put(X, NamedSharding(mesh, P("d", None, *())))
        np.testing.assert_array_equal(np.asarray(rows_d(x)), X + 1)
        # but a size-1 axis does not excuse a real difference
        with pytest.raises(TypeCheckError, match=re.escape("laid out as P(None, None)")):
            rows_d_cols_x(place(X, mesh, "a b/x"))


@pytest.mark.parametrize("auto", [False, True], ids=["explicit", "auto"])
def test_replicated_or_single_device_annotated_sharded_is_a_mismatch(auto):
    mesh = make_mesh((8,), ("d",), auto=auto)
    replicated = place(X, mesh, "a b")
    single = jnp.asarray(X)
    want = "the annotation wants P('d', None) but the array is laid out as P(None, None)"
    with jax.set_mesh(mesh):
        for v in (replicated, single):
            with pytest.raises(TypeCheckError, match=re.escape(want)):
                double_1d(v)
            with pytest.raises(TypeCheckError, match=re.escape(want)), Scope():
                check(jnp.float32, "a/d b", v)
        # annotated replicated: fine
        with Scope():
            check(jnp.float32, "a b", replicated)
            check(jnp.float32, "a b", single)
    if not auto:
        with jax.set_mesh(mesh), pytest.raises(TypeCheckError, match=re.escape(want)):
            jax.jit(double_1d).trace(replicated)
    # No mesh in force: a single-device value has nothing to be compared with.
    np.testing.assert_array_equal(np.asarray(double_1d(single)), 2 * X)


def test_replicated_under_jit_on_auto_mesh_fails_at_compile_time():
    mesh = make_mesh((8,), ("d",), auto=True)
    # (not an uncommitted argument: XLA may choose any layout for that one)
    bad = place(X, mesh, "a b")
    with (
        jax.set_mesh(mesh),
        pytest.raises(JaxRuntimeError, match=re.escape("laid out as P(None, None)")),
    ):
        jax.jit(double_1d)(bad)


def test_divisibility_and_unknown_axes():
    mesh = make_mesh((4, 2), ("x", "y"))
    with jax.set_mesh(mesh), Scope():
        with pytest.raises(TypeCheckError) as e:
            check(jnp.float32, "a/x b/y", np.zeros((6, 3), np.float32))
        assert _bullets(str(e.value)) == [
            "dim 0 'a/x': size 6 is not divisible by the size of mesh axis x=4",
            "dim 1 'b/y': size 3 is not divisible by the size of mesh axis y=2",
        ]
        assert "(mesh axes: x=4, y=2; bindings: none yet)" in str(e.value)
        with pytest.raises(TypeCheckError) as e:
            check(jnp.float32, "a/x/y b", np.zeros((12, 3), np.float32))
        assert _bullets(str(e.value)) == [
            "dim 0 'a/x/y': size 12 is not divisible by x=4 × y=2 = 8"
        ]
        with pytest.raises(TypeCheckError) as e:
            check(jnp.float32, "a/x b/z", np.zeros((8, 8), np.float32))
        assert _bullets(str(e.value)) == [
            "dim 1 'b/z': mesh axis 'z' is not an axis of the mesh (x=4, y=2); if 'z' is a "
            "role (a logical axis), put axis rules in force around the call: with "
            "shardlib.axis_rules(z=<mesh axes>)"
        ]


@pytest.mark.parametrize("auto", [False, True], ids=["explicit", "auto"])
def test_transformations(auto):
    """grad, vmap and jvp of checked functions: layouts are checked through them."""
    mesh = make_mesh((8,), ("d",), auto=auto)
    with jax.set_mesh(mesh):
        x = place(X, mesh, "a/d b")
        xs = jax.device_put(np.stack([X, X + 1, X + 2]), NamedSharding(mesh, P(None, "d")))
        loss = lambda x: double_1d(x).sum()
        np.testing.assert_array_equal(np.asarray(jax.grad(loss)(x)), np.full_like(X, 2))
        np.testing.assert_array_equal(np.asarray(jax.jit(jax.grad(loss))(x)), np.full_like(X, 2))
        want = 2 * np.asarray(xs)
        np.testing.assert_array_equal(np.asarray(jax.vmap(double_1d)(xs)), want)
        np.testing.assert_array_equal(np.asarray(jax.jit(jax.vmap(double_1d))(xs)), want)
        _, t = jax.jit(lambda x: jax.jvp(double_1d, (x,), (x,)))(x)
        np.testing.assert_array_equal(np.asarray(t), 2 * X)

        want_msg = re.escape("the annotation wants P('d', None) but the array is laid out as")
        bad = place(X, mesh, "a b/d")
        bads = jax.device_put(np.stack([X, X]), NamedSharding(mesh, P(None, None, "d")))
        # eager transformations see the concrete array underneath
        with pytest.raises(TypeCheckError, match=want_msg):
            jax.grad(loss)(bad)
        with pytest.raises(TypeCheckError, match=want_msg):
            jax.vmap(double_1d)(bads)
        jit_error = JaxRuntimeError if auto else TypeCheckError
        with pytest.raises(jit_error, match=want_msg):
            jax.jit(jax.grad(loss))(bad)
        with pytest.raises(jit_error, match=want_msg):
            jax.jit(jax.vmap(double_1d))(bads)


def test_legacy_with_mesh():
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("x", "y"))  # Auto axes
    good = place(X, mesh, "a/x b/y")
    bad = place(X, mesh, "a/y b/x")
    with legacy_mesh(mesh):
        np.testing.assert_array_equal(np.asarray(double_2d(good)), 2 * X)
        np.testing.assert_array_equal(np.asarray(jax.jit(double_2d)(good)), 2 * X)
        with pytest.raises(TypeCheckError, match=re.escape("laid out as P('y', 'x')")):
            double_2d(bad)
        with pytest.raises(JaxRuntimeError, match=re.escape("laid out as P('y', 'x')")):
            jax.jit(double_2d)(bad)
        # a single-device array under the legacy mesh is a mismatch too; under jit the
        # legacy mesh does not choose the devices, so the program has one device and the
        # layout is known (and checked) while lowering: a TypeCheckError, not at compile time
        with pytest.raises(TypeCheckError, match=re.escape("laid out as P(None, None)")):
            double_2d(jnp.asarray(X))
        with pytest.raises(TypeCheckError, match=re.escape("laid out as P(None, None)")):
            jax.jit(double_2d)(jnp.asarray(X))


# ------------------------------------------------------------------ inside shard_map


@typechecked
def body_sharded(x: f32[b"batch/d len"], y: f32[b"batch len"]) -> f32[b"batch/d len"]:
    i = jax.lax.axis_index("d")
    n = x.shape[0]
    return x + jax.lax.dynamic_slice_in_dim(y, i * n, n, 0)


@typechecked
def body_literal(x: f32[b"16/d 4"]) -> f32[b"16/d 4"]:
    return x * 3


@typechecked
def body_partial(x: f32[b"a/x b"]) -> f32[b"a/x b"]:
    return x * 2


@typechecked
def body_partial_bad(x: f32[b"a/x b/y"]) -> f32[b"a/x b/y"]:
    return x * 2


def test_plain_shard_map_with_typechecked_body():
    mesh = make_mesh((8,), ("d",))
    x = np.arange(16 * 4, dtype=np.float32).reshape(16, 4)
    y = np.ones((16, 4), np.float32)
    with jax.set_mesh(mesh):
        sm = jax.shard_map(body_sharded, in_specs=(P("d"), P()), out_specs=P("d"))
        got = jax.jit(sm)(place(x, mesh, "a/d b"), place(y, mesh, "a b"))
        np.testing.assert_array_equal(np.asarray(got), x + y)
        # y's global batch (8) contradicts x's (per-device 2 × d=8 = 16)
        with pytest.raises(TypeCheckError) as e:
            jax.jit(sm).trace(place(x, mesh, "a/d b"), place(y[:8], mesh, "a b"))
    msg = str(e.value)
    assert msg.startswith('argument "y"') and "in body_sharded()" in msg
    assert _bullets(msg) == ["dim 0 'batch': expected size 16 (batch=16 is already bound), got 8"]
    assert "manual axes: d" in msg and "bindings: batch=16, len=4" in msg


def test_per_device_shape_times_manual_axes():
    mesh = make_mesh((8,), ("d",))
    x = np.arange(16 * 4, dtype=np.float32).reshape(16, 4)
    with jax.set_mesh(mesh):
        sm = jax.shard_map(body_literal, in_specs=P("d"), out_specs=P("d"))
        np.testing.assert_array_equal(np.asarray(jax.jit(sm)(place(x, mesh, "a/d b"))), 3 * x)
        # the same body given the whole array per device: 16 rows × d=8 = 128 global rows
        replicated = jax.shard_map(body_literal, in_specs=P(), out_specs=P("d"))
        with pytest.raises(TypeCheckError) as e:
            jax.jit(replicated).trace(place(x, mesh, "a b"))
    assert _bullets(str(e.value)) == [
        "dim 0 '16/d': expected size 16, got 128 (per-device 16 × d=8)"
    ]


@pytest.mark.parametrize("auto", [False, True], ids=["explicit", "auto"])
def test_partially_manual_shard_map(auto):
    mesh = make_mesh((4, 2), ("x", "y"), auto=auto)
    x = np.arange(8 * 4, dtype=np.float32).reshape(8, 4)
    with jax.set_mesh(mesh):
        xv = place(x, mesh, "a/x b/y")
        sm = jax.shard_map(body_partial, in_specs=P("x"), out_specs=P("x"), axis_names={"x"})
        np.testing.assert_array_equal(np.asarray(jax.jit(sm)(xv)), 2 * x)
        bad = jax.shard_map(body_partial_bad, in_specs=P("x"), out_specs=P("x"), axis_names={"x"})
        with pytest.raises(TypeCheckError) as e:
            jax.jit(bad).trace(xv)
    msg = str(e.value)
    assert msg.startswith('argument "x"') and "in body_partial_bad()" in msg
    assert _bullets(msg) == [
        "dim 1 'b/y': mesh axis 'y' is not one of the manual axes of the enclosing shard_map "
        "(x=4); inside shard_map only manual axes can split a dim"
    ]


@typed_shard_map
def tsm_matvec(x: f32[b"batch/d in"], w: f32[b"in out"]) -> f32[b"batch/d out"]:
    return shardops.einsum_unreduced("batch/d in, in out -> batch/d out", x, w)


@typed_shard_map
def tsm_bad_return(x: f32[b"batch/d in"]) -> f32[b"batch/d in"]:
    return jnp.concatenate([x, x])


@typed_shard_map
def tsm_not_manual(x: f32[b"batch/d in"]) -> f32[b"batch/d in"]:
    check(jnp.float32, "batch/q in", x)
    return x


def test_typed_shard_map_body_is_checked():
    mesh = make_mesh((8,), ("d",))
    x = np.arange(16 * 3, dtype=np.float32).reshape(16, 3)
    w = np.arange(3 * 5, dtype=np.float32).reshape(3, 5)
    with jax.set_mesh(mesh):
        np.testing.assert_allclose(np.asarray(jax.jit(tsm_matvec)(x, w)), x @ w)
        with pytest.raises(TypeCheckError) as e:
            jax.jit(tsm_bad_return).trace(x)
        assert "the return value" in str(e.value) and "tsm_bad_return" in str(e.value)
        assert _bullets(str(e.value)) == [
            "dim 0 'batch/d': expected size 16 (batch=16 is already bound), got 32 "
            "(per-device 4 × d=8)"
        ]
        with pytest.raises(TypeCheckError) as e:
            jax.jit(tsm_not_manual).trace(x)
        assert _bullets(str(e.value)) == [
            "dim 0 'batch/q': mesh axis 'q' is not one of the manual axes of the enclosing "
            "shard_map (d=8); inside shard_map only manual axes can split a dim; if 'q' is a "
            "role (a logical axis), put axis rules in force around the call: with "
            "shardlib.axis_rules(q=<mesh axes>)"
        ]


# ------------------------------------------------------------------ scopes


@typechecked
def ident(x: f32[b"n"]) -> f32[b"n"]:
    return x


@typechecked
def returns_three(x: f32[b"n"]) -> f32[b"n"]:
    return jnp.zeros(3)


@typechecked
def outer(x: f32[b"n"]) -> f32[b"n"]:
    inner_out = ident(jnp.zeros(x.shape[0] + 1))  # inner binds its own n
    assert inner_out.shape[0] == x.shape[0] + 1
    check(jnp.float32, "n", x)  # outer's n is untouched by the inner call
    return x


@typechecked
def checks_in_body(x: f32[b"n"], m: int) -> f32[b"n"]:
    check(jnp.float32, "n", jnp.zeros(m))
    return x


@typechecked
def explicit_scope_in_body(x: f32[b"n"]) -> f32[b"n"]:
    with Scope():
        check(jnp.float32, "n", jnp.zeros(x.shape[0] + 5))  # a fresh scope: no conflict
    return x


@typechecked
def einsum_in_body(x: f32[b"a b"], y: f32[b"c d"]) -> f32[b"a d"]:
    # `c` of y must equal `b`: the op's spec shares the call's bindings
    return shardops.einsum_unreduced("a b, b d -> a d", x, y)


@typechecked
def einsum_contradicts(x: f32[b"a b"], y: f32[b"c d"]) -> f32[b"b a"]:
    # a valid transpose for jnp, but the op calls x's dims `c d`, which y has bound
    return shardops.einsum_unreduced("c d -> d c", x)


def test_calls_do_not_leak_bindings():
    for n in (3, 5, 2, 7):
        np.testing.assert_array_equal(
            np.asarray(ident(jnp.arange(n, dtype=jnp.float32))), np.arange(n)
        )
    with jax.set_mesh(make_mesh((8,), ("d",))):
        for n in (4, 6):
            assert jax.jit(ident).trace(jnp.zeros(n)).out_info.shape == (n,)


def test_args_and_return_share_bindings():
    assert returns_three(jnp.zeros(3)).shape == (3,)
    with pytest.raises(TypeCheckError) as e:
        returns_three(jnp.zeros(4))
    assert "the return value" in str(e.value)
    assert _bullets(str(e.value)) == ["dim 0 'n': expected size 4 (n=4 is already bound), got 3"]


def test_nested_calls_have_fresh_scopes():
    np.testing.assert_array_equal(np.asarray(outer(jnp.arange(4.0))), np.arange(4.0))


def test_check_in_body_uses_the_call_scope():
    checks_in_body(jnp.zeros(4), 4)
    with pytest.raises(TypeCheckError) as e:
        checks_in_body(jnp.zeros(4), 5)
    assert _bullets(str(e.value)) == ["dim 0 'n': expected size 4 (n=4 is already bound), got 5"]
    explicit_scope_in_body(jnp.zeros(4))


def test_shardops_share_the_call_scope():
    x, y = jnp.ones((2, 3)), jnp.ones((3, 4))
    np.testing.assert_allclose(np.asarray(einsum_in_body(x, y)), np.full((2, 4), 3.0))
    with pytest.raises(TypeCheckError) as e:
        einsum_contradicts(jnp.ones((2, 3)), jnp.ones((3, 4)))
    msg = str(e.value)
    assert msg.startswith("einsum_unreduced('c d -> d c') operand 0 does not match spec 'c d'")
    assert _bullets(msg) == [
        "dim 0 'c': expected size 3 (c=3 is already bound), got 2",
        "dim 1 'd': expected size 4 (d=4 is already bound), got 3",
    ]
    assert "bindings: a=2, b=3, c=3, d=4" in msg
    # without the conflict the same code passes
    np.testing.assert_array_equal(
        np.asarray(einsum_contradicts(jnp.arange(6.0).reshape(2, 3), jnp.ones((2, 3)))),
        np.arange(6.0).reshape(2, 3).T,
    )


def test_explicit_scopes():
    # outside any scope, each check stands alone
    check(jnp.float32, "n", jnp.zeros(3))
    check(jnp.float32, "n", jnp.zeros(4))
    with Scope() as s:
        check(jnp.float32, "n", jnp.zeros(3))
        with pytest.raises(TypeCheckError, match="n=3 is already bound"):
            check(jnp.float32, "n", jnp.zeros(4))
        with Scope() as inner:
            check(jnp.float32, "n", jnp.zeros(4))
        assert inner.bindings == {"n": 4}
        assert s.bindings == {"n": 3}
    with Scope() as s2:
        check(jnp.float32, "n", jnp.zeros(4))
    assert s2.bindings == {"n": 4} and repr(s2) == "Scope({'n': 4})"


@scope
def scoped(a, b):
    check(jnp.float32, "n", a)
    check(jnp.float32, "n", b)
    return a + b


def test_scope_decorator():
    np.testing.assert_array_equal(np.asarray(scoped(jnp.ones(3), jnp.ones(3))), np.full(3, 2.0))
    scoped(jnp.ones(5), jnp.ones(5))  # a fresh scope per call
    with pytest.raises(TypeCheckError, match="n=3 is already bound"):
        scoped(jnp.ones(3), jnp.ones(4))
    assert scoped.__name__ == "scoped"


@typechecked
def reenters(x: f32[b"n"], s: Scope) -> f32[b"n"]:
    with s:
        with s:
            pass
        check(jnp.float32, "n", jnp.zeros(7))  # binds in s, not in this call's scope
    return x


def test_reentered_scope_stays_in_force():
    s = Scope()
    assert reenters(jnp.zeros(2), s).shape == (2,)
    assert s.bindings == {"n": 7}


@typechecked
def threaded(x: f32[b"n"], barrier: threading.Barrier) -> f32[b"n"]:
    barrier.wait()  # every thread is inside its call, with its own n bound
    check(jnp.float32, "n", jnp.zeros(x.shape[0]))
    barrier.wait()
    return x + 1


def test_threads_do_not_share_bindings():
    sizes = [1, 2, 3, 4]
    barrier = threading.Barrier(len(sizes))
    results: dict[int, object] = {}

    def work(n):
        try:
            results[n] = [
                threaded(jnp.zeros(n), barrier).shape,
                jax.jit(threaded, static_argnums=1).trace(jnp.zeros(n), barrier).out_info.shape,
            ]
        except BaseException as e:  # reported below
            results[n] = e
            barrier.abort()

    threads = [threading.Thread(target=work, args=(n,)) for n in sizes]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert results == {n: [(n,), (n,)] for n in sizes}


def test_typeguard_check_type_at_module_level_does_not_leak():
    import typeguard

    # check_type's memo at module level would otherwise bind in the module's globals
    code = (
        "import typeguard, jax.numpy as jnp\n"
        "from shardlib.shardtypes import f32\n"
        "typeguard.check_type(jnp.zeros(3), f32[b'n'])\n"
        "typeguard.check_type(jnp.zeros(4), f32[b'n'])\n"
    )
    namespace: dict = {}
    exec(compile(code, "<module-level>", "exec"), namespace)
    assert "__shardlib_scope__" not in namespace
    assert typeguard.check_type(jnp.zeros(2, jnp.int32), i32[b"n"]).shape == (2,)
