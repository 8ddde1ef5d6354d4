"""JAX's own sharding in types: unreduced (``{+t}``) and reduced (``{=t}``) annotations.

The examples are ports of JAX's "Autodiff and sharding" page (a matmul whose result is left
unreduced for the caller to reduce; a replicated weight typed ``reduced`` so that its gradient
stays unreduced), written once with ``jax.shard_map`` and once typed: values, gradients and
compiled programs must be the same.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from typeguard import TypeCheckError

from benchmarks._hlo import canonicalize, collective_census
from shardlib import shardops
from shardlib._analysis.notes import PendingReductionError
from shardlib._lang.parsing import ShapeSpec, SpecError
from shardlib.shardtypes import Array, f32, typechecked, typed_shard_map


@pytest.fixture
def mesh():
    m = jax.make_mesh((4, 2), ("X", "Y"), axis_types=(AxisType.Explicit,) * 2)
    with jax.set_mesh(m):
        yield m


def _data(mesh):
    rng = np.random.default_rng(0)
    A = rng.standard_normal((4, 8)).astype(np.float32)
    B = rng.standard_normal((8, 4)).astype(np.float32)
    a = jax.device_put(A, NamedSharding(mesh, P(None, "X")))
    b = jax.device_put(B, NamedSharding(mesh, P("X", None)))
    return A, B, a, b


@typed_shard_map
def matmul_unreduced(a: f32[Array, b"M K/X"], b: f32[Array, b"K/X N"]) -> f32[Array, b"M N {+X}"]:
    return shardops.einsum_unreduced("M K/X, K/X N -> M N {+X}", a, b)


@typed_shard_map
def reduce_x(y: f32[Array, b"M N {+X}"]) -> f32[Array, b"M N"]:
    return shardops.psum("M N {+X}", y, axes="X")


def _jax_matmul_unreduced(a, b):
    """JAX's own version: the body's local product cast to unreduced."""
    return jax.shard_map(
        lambda a, b: jax.lax.pcast(jnp.einsum("mk,kn->mn", a, b), "X", to="unreduced"),
        in_specs=(P(None, "X"), P("X", None)),
        out_specs=P(None, None, unreduced={"X"}),
    )(a, b)


# -- the spelling ---------------------------------------------------------------------------------


def test_the_clause_is_jax_unreduced_and_reduced_fields() -> None:
    assert ShapeSpec.parse("M N {+X}").partition_spec() == P(None, None, unreduced={"X"})
    assert ShapeSpec.parse("M N {=X}").partition_spec() == P(None, None, reduced={"X"})
    both = ShapeSpec.parse("M/Y N {+X=Z}")
    assert both.partition_spec() == P("Y", None, unreduced={"X"}, reduced={"Z"})
    assert str(both) == "M/Y N {+X=Z}"
    assert ShapeSpec.parse("M N").partition_spec() == P(None, None)


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        ("M N {=X=X}", "named twice"),
        ("M/X N {=X}", "both splits dim"),
        ("M N {X}", "malformed clause"),
    ],
)
def test_malformed_clauses_are_refused(spec: str, words: str) -> None:
    with pytest.raises(SpecError, match=words):
        ShapeSpec.parse(spec)


def test_a_shardops_spec_cannot_say_reduced(mesh) -> None:
    _, _, a, _ = _data(mesh)

    @typed_shard_map
    def f(a: f32[Array, b"M K/X"]) -> f32[Array, b"M K/X"]:
        return shardops.psum("M K/X {=Y}", a, axes="Y")

    with pytest.raises(SpecError, match="cannot say a value is reduced"):
        f(a)


# -- unreduced results ------------------------------------------------------------------------------


def test_unreduced_result_types_values_and_gradients(mesh) -> None:
    A, B, a, b = _data(mesh)
    y = jax.jit(matmul_unreduced)(a, b)
    assert jax.typeof(y).sharding.spec == P(None, None, unreduced={"X"})
    np.testing.assert_allclose(
        jax.jit(lambda a, b: reduce_x(matmul_unreduced(a, b)))(a, b), A @ B, rtol=1e-5
    )

    def loss(f):
        return lambda a, b: jnp.sum(jnp.tanh(f(a, b)))

    got = jax.jit(jax.grad(loss(lambda a, b: reduce_x(matmul_unreduced(a, b))), argnums=(0, 1)))(
        a, b
    )
    ref = jax.grad(loss(lambda a, b: a @ b), argnums=(0, 1))(A, B)
    for g, r in zip(got, ref, strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-6)


def test_unreduced_result_compiles_to_jax_own_program(mesh) -> None:
    """The sharding-ad port: the caller reduces with ``jax.reshard``; forward and backward
    compile to the program JAX's own ``shard_map`` + ``pcast`` version gives."""
    _, _, a, b = _data(mesh)

    def step(f):
        return jax.jit(
            jax.value_and_grad(
                lambda a, b: jnp.sum(jnp.sin(jax.reshard(f(a, b), P()))), argnums=(0, 1)
            )
        )

    typed = step(matmul_unreduced).lower(a, b).compile().as_text()
    hand = step(_jax_matmul_unreduced).lower(a, b).compile().as_text()
    assert collective_census(typed) == collective_census(hand)
    assert canonicalize(typed) == canonicalize(hand)
    ours = jax.jit(
        jax.value_and_grad(
            lambda a, b: jnp.sum(jnp.sin(jax.reshard(matmul_unreduced(a, b), P()))), argnums=(0, 1)
        )
    )(a, b)
    theirs = jax.jit(
        jax.value_and_grad(
            lambda a, b: jnp.sum(jnp.sin(jax.reshard(_jax_matmul_unreduced(a, b), P()))),
            argnums=(0, 1),
        )
    )(a, b)
    for x, y in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs), strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-6)


def test_an_unreduced_output_must_be_a_partial_sum(mesh) -> None:
    _, _, a, b = _data(mesh)

    @typed_shard_map
    def reduced_already(
        a: f32[Array, b"M K/X"], b: f32[Array, b"K/X N"]
    ) -> f32[Array, b"M N {+X}"]:
        y = shardops.einsum_unreduced("M K/X, K/X N -> M N {+X}", a, b)
        return shardops.psum("M N {+X}", y, axes="X")

    with pytest.raises(PendingReductionError, match="not a partial sum over them"):
        reduced_already(a, b)
    # The analysis alone (a body JAX does not type, check_vma=False) refuses it as well.
    from shardlib._analysis.walk import check_body

    plain = jax.make_jaxpr(lambda y: y * 2)(np.ones((4, 4), np.float32))
    with pytest.raises(PendingReductionError, match="not a partial sum over them"):
        check_body(plain, [frozenset({"X"})], "f", out_unreduced=[frozenset({"X"})])


def test_an_unreduced_output_over_other_axes_is_refused(mesh) -> None:
    _, _, a, b = _data(mesh)

    @typed_shard_map
    def wrong_axes(a: f32[Array, b"M K/X"], b: f32[Array, b"K/X N"]) -> f32[Array, b"M N {+Y}"]:
        return shardops.einsum_unreduced("M K/X, K/X N -> M N {+X}", a, b)

    # The analysis refuses it (JAX's types alone cannot say which axes a partial sum owes).
    with pytest.raises(
        PendingReductionError,
        match=r"annotated unreduced over mesh axis 'Y' .*, but it is a partial sum over mesh axis 'X'",
    ):
        wrong_axes(a, b)


def test_a_non_linear_use_before_an_unreduced_return_is_refused(mesh) -> None:
    _, _, a, b = _data(mesh)

    @typed_shard_map
    def tanh_first(a: f32[Array, b"M K/X"], b: f32[Array, b"K/X N"]) -> f32[Array, b"M N {+X}"]:
        return jnp.tanh(shardops.einsum_unreduced("M K/X, K/X N -> M N {+X}", a, b))

    with pytest.raises(PendingReductionError, match="`tanh`"):
        tanh_first(a, b)


def test_an_unreduced_argument_is_a_partial_sum_in_the_body(mesh) -> None:
    _, _, a, b = _data(mesh)

    @typed_shard_map
    def tanh_of_partial(y: f32[Array, b"M N {+X}"]) -> f32[Array, b"M N"]:
        return shardops.psum("M N {+X}", jnp.tanh(y), axes="X")

    # JAX's own types refuse tanh of an unreduced value too; either refusal names tanh.
    with pytest.raises(Exception, match="tanh"):  # noqa: B017 - JAX raises ShardingTypeError
        jax.jit(lambda a, b: tanh_of_partial(matmul_unreduced(a, b)))(a, b)
    ys = jax.jit(matmul_unreduced)(a, b)
    prog = jax.make_jaxpr(lambda y: y)(ys)
    from shardlib._analysis.walk import check_body

    # The analysis alone (what a body JAX does not type-check sees): the argument is pending.
    body = jax.make_jaxpr(lambda y: jnp.tanh(y))(np.ones((4, 4), np.float32))
    with pytest.raises(PendingReductionError, match="typed unreduced"):
        check_body(body, [frozenset()], "f", in_unreduced=[frozenset({"X"})])
    check_body(
        prog, [frozenset()], "f", in_unreduced=[frozenset({"X"})], out_unreduced=[frozenset({"X"})]
    )


def test_the_type_outside_the_body_is_checked(mesh) -> None:
    _, _, a, b = _data(mesh)

    @typechecked
    def plain(y: f32[Array, b"M N"]) -> f32[Array, b"M N"]:
        return y

    @typechecked
    def unreduced(y: f32[Array, b"M N {+X}"]) -> f32[Array, b"M N {+X}"]:
        return y

    y = jax.jit(matmul_unreduced)(a, b)
    unreduced(y)
    jax.jit(unreduced)(y)
    with pytest.raises(TypeCheckError, match=r"JAX type is unreduced over \['X'\]"):
        plain(y)
    with pytest.raises(TypeCheckError, match=r"JAX type is unreduced over \['X'\]"):
        jax.jit(plain)(y)
    with pytest.raises(TypeCheckError, match=r"clause is '\{\+X\}'"):
        unreduced(jax.jit(lambda a, b: reduce_x(matmul_unreduced(a, b)))(a, b))


# -- reduced arguments --------------------------------------------------------------------------


def _weight_step(typed: bool, reduced: bool, mesh):
    rng = np.random.default_rng(1)
    X = rng.standard_normal((8, 4)).astype(np.float32)
    W = rng.standard_normal((4, 4)).astype(np.float32)
    wspec = P(None, None, reduced={"X"}) if reduced else P(None, None)
    x = jax.device_put(X, NamedSharding(mesh, P("X", None)))
    w = jax.device_put(W, NamedSharding(mesh, wspec))
    if typed and reduced:

        @typed_shard_map
        def layer(x: f32[Array, b"B/X M"], w: f32[Array, b"M N {=X}"]) -> f32[Array, b"B/X N"]:
            return jnp.tanh(shardops.einsum("B/X M, M N -> B/X N", x, w))

    elif typed:

        @typed_shard_map
        def layer(x: f32[Array, b"B/X M"], w: f32[Array, b"M N"]) -> f32[Array, b"B/X N"]:
            return jnp.tanh(shardops.einsum("B/X M, M N -> B/X N", x, w))

    else:
        layer = jax.shard_map(
            lambda x, w: jnp.tanh(jnp.einsum("bm,mn->bn", x, w)),
            in_specs=(P("X", None), wspec),
            out_specs=P("X", None),
        )
    grad = jax.jit(jax.grad(lambda x, w: jnp.sum(layer(x, w) ** 2), argnums=1))
    ref = jax.grad(lambda x, w: jnp.sum(jnp.tanh(x @ w) ** 2), argnums=1)(X, W)
    return grad, (x, w), ref


def test_a_reduced_weight_gets_no_all_reduce_in_the_backward_pass(mesh) -> None:
    """JAX's ``reduced`` weight: its gradient stays unreduced (``{U:X}``), no all-reduce, as
    in JAX's own program; the same weight annotated replicated gets JAX's one all-reduce."""
    grad, args, ref = _weight_step(typed=True, reduced=True, mesh=mesh)
    jgrad, jargs, _ = _weight_step(typed=False, reduced=True, mesh=mesh)
    g = grad(*args)
    assert jax.typeof(g).sharding.spec == P(None, None, unreduced={"X"})
    np.testing.assert_allclose(jax.jit(lambda g: jax.reshard(g, P()))(g), ref, rtol=1e-5, atol=1e-6)
    typed = grad.lower(*args).compile().as_text()
    hand = jgrad.lower(*jargs).compile().as_text()
    assert collective_census(typed) == collective_census(hand)
    assert "all-reduce" not in collective_census(typed)
    assert canonicalize(typed) == canonicalize(hand)
    pgrad, pargs, pref = _weight_step(typed=True, reduced=False, mesh=mesh)
    assert collective_census(pgrad.lower(*pargs).compile().as_text()).get("all-reduce") == 1
    np.testing.assert_allclose(pgrad(*pargs), pref, rtol=1e-5, atol=1e-6)


# -- explain ----------------------------------------------------------------------------------------


def test_explain_reports_the_all_reduce_of_an_unreduced_value(mesh) -> None:
    """A psum of an argument typed unreduced is JAX's ``unreduced_psum``: explain lists it as
    an all-reduce, forward and under grad, equal to the compiled HLO."""
    import shardlib

    _, _, a, b = _data(mesh)

    def f(a, b):
        return reduce_x(matmul_unreduced(a, b))

    grad = jax.grad(lambda a, b: jnp.sum(jnp.tanh(f(a, b))), argnums=(0, 1))
    for g in (f, grad):
        report = shardlib.explain(g, a, b)
        assert [c.kind for c in report.collectives] == ["all-reduce"]
        assert report.collectives[0].sent_bytes == 96  # 4x4 f32 over a ring of 4: 2*3/4*64
        cmp = report.compare_hlo(jax.jit(g).lower(a, b).compile().as_text())
        assert cmp.identical, str(cmp)


def test_a_replicated_array_passed_as_reduced_is_moved_and_its_gradient_summed(mesh) -> None:
    """An ordinary replicated weight passed where ``{=X}`` is annotated is moved to JAX's
    reduced type on the way in (as a layout is); the gradient of the ordinary argument then
    comes back summed (ordinary, as its type says), equal to the reference."""
    grad, (x, w), ref = _weight_step(typed=True, reduced=True, mesh=mesh)
    plain = jax.device_put(np.asarray(w), NamedSharding(mesh, P()))
    g = grad(x, plain)
    assert jax.typeof(g).sharding.spec == P(None, None)
    np.testing.assert_allclose(g, ref, rtol=1e-5, atol=1e-6)
