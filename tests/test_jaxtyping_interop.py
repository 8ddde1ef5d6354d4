"""jaxtyping and shardlib annotations in one checked function, and `from_jaxtyping`.

Checked by ``@jaxtyped(typechecker=beartype)`` (beartype calls ``isinstance``, which shardlib
types answer with the same check as the annotation) and by shardlib's own ``typechecked``
under ``@jaxtyped``. Each library binds its own dim names; shardlib's bind per call under
``typechecked``.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from shardlib._check.interop import from_jaxtyping
from shardlib.shardtypes import Array, f32, i32

jaxtyping = pytest.importorskip("jaxtyping", reason="jaxtyping is not installed")
from jaxtyping import Bool, Float, Float32, Int32, Shaped, jaxtyped  # noqa: E402

try:
    from beartype import beartype
except ImportError:  # pragma: no cover - beartype is optional
    beartype = None

try:
    from shardlib._check.typechecked import typechecked as shardlib_typechecked
except ImportError:  # pragma: no cover - not there yet
    shardlib_typechecked = None

CHECKERS = [
    pytest.param(
        beartype,
        id="beartype",
        marks=pytest.mark.skipif(beartype is None, reason="beartype is not installed"),
    ),
    pytest.param(
        shardlib_typechecked,
        id="shardlib.typechecked",
        marks=pytest.mark.skipif(shardlib_typechecked is None, reason="no shardlib.typechecked"),
    ),
]


def _mixed(checker):
    @jaxtyped(typechecker=checker)
    def mixed(
        x: f32[Array, "a b"], y: Float32[jax.Array, "a b"], z: Float32[jax.Array, " b"]
    ) -> f32[Array, b"a"]:
        return jnp.sum(x + y + z, axis=1)

    return mixed


@pytest.mark.parametrize("checker", CHECKERS)
def test_both_checked_in_one_function(checker):
    mixed = _mixed(checker)
    x = jnp.arange(6.0).reshape(2, 3)
    out = mixed(x, jnp.ones((2, 3)), jnp.ones(3))
    np.testing.assert_allclose(out, np.sum(np.arange(6.0).reshape(2, 3) + 2, axis=1))
    # shardlib's annotation: wrong dtype, wrong rank.
    with pytest.raises(Exception, match="x"):
        mixed(x.astype(jnp.int32), jnp.ones((2, 3)), jnp.ones(3))
    with pytest.raises(Exception, match="x"):
        mixed(jnp.ones(6), jnp.ones((2, 3)), jnp.ones(3))
    # jaxtyping's annotations: 'b' is 3 in y, so z must have 3 elements.
    with pytest.raises(Exception, match="z"):
        mixed(x, jnp.ones((2, 3)), jnp.ones(4))
    # The return annotation is shardlib's: a (2,) result, not (3,).
    bad_return = jaxtyped(typechecker=checker)(_wrong_return)
    with pytest.raises(Exception, match="return"):
        bad_return(jnp.ones((2, 3)))


def _wrong_return(x: Float32[jax.Array, "a b"]) -> f32[Array, b"a"]:
    return jnp.sum(x)  # rank 0, annotated rank 1


@pytest.mark.skipif(shardlib_typechecked is None, reason="no shardlib.typechecked")
def test_shardlib_names_bind_across_arguments_under_typechecked():
    @jaxtyped(typechecker=shardlib_typechecked)
    def f(
        x: f32[Array, "a b"], w: f32[Array, "b c"], y: Float32[jax.Array, " c"]
    ) -> f32[Array, "a c"]:
        return x @ w + y

    out = f(jnp.ones((2, 3)), jnp.ones((3, 4)), jnp.zeros(4))
    np.testing.assert_allclose(out, np.full((2, 4), 3.0))
    with pytest.raises(Exception, match="b"):
        f(jnp.ones((2, 3)), jnp.ones((5, 4)), jnp.zeros(4))


@pytest.mark.skipif(beartype is None, reason="beartype is not installed")
def test_shardlib_types_are_valid_beartype_hints():
    @beartype
    def f(x: f32[Array, "a b"] | None, n: i32[Array, b""]) -> f32[Array, "a b"] | None:
        return x

    assert f(None, jnp.int32(1)) is None
    assert f(jnp.ones((2, 2)), jnp.int32(1)).shape == (2, 2)
    with pytest.raises(Exception, match="n"):
        f(None, jnp.float32(1))


def test_isinstance_checks_dtype_shape_and_spec():
    assert isinstance(jnp.ones((2, 3)), f32[Array, "a b"])
    assert not isinstance(jnp.ones((2, 3), jnp.int32), f32[Array, "a b"])
    assert not isinstance(jnp.ones(3), f32[Array, "a b"])
    assert not isinstance(np.ones((2, 3), np.float32), f32[Array, "a 4"])
    assert isinstance(jnp.ones(3), f32)  # a bare dtype: the dtype only
    assert not isinstance(3.0, f32[Array, ""])


@pytest.mark.parametrize(
    ("annotation", "expected"),
    [
        (Float32[jax.Array, "b d"], f32["b d"]),
        (Int32[jax.Array, "batch 3"], i32["batch 3"]),
        (Bool[jax.Array, ""], "bool_['']"),
        (f32[Array, "b"], None),
        (int, None),
    ],
)
def test_from_jaxtyping(annotation, expected):
    got = from_jaxtyping(annotation)
    if isinstance(expected, str):
        assert repr(got) == expected
    else:
        assert got is expected


@pytest.mark.parametrize(
    ("annotation", "message"),
    [
        (Float[jax.Array, "b d"], r"allows several dtypes .*write f32\[Array, b'b d'\] or bf16"),
        (Shaped[jax.Array, "b"], r"allows any dtype.*f32\[Array, b'b'\]"),
        (Int32[jax.Array, "*batch d"], r"dim '\*batch' is a variadic dim"),
        (Int32[jax.Array, "... d"], r"dim '\.\.\.' is a variadic dim"),
        (Int32[jax.Array, "#b d"], r"dim '#b' is a broadcastable dim"),
        (Int32[jax.Array, "_ d"], r"dim '_' is an unchecked dim"),
        (Int32[jax.Array, "b=3"], r"dim 'b=3' is a symbolic"),
    ],
)
def test_from_jaxtyping_refuses_what_shardlib_cannot_say(annotation, message):
    with pytest.raises(TypeError, match=message) as e:
        from_jaxtyping(annotation)
    assert "jaxtyping annotation" in str(e.value)


# -- typed_shard_map: a jaxtyping parameter is replicated -----------------------------------


def _scale_fn():
    from shardlib.shardtypes import typed_shard_map

    @typed_shard_map
    def scale(x: f32[Array, b"b/d e"], s: Float32[jax.Array, " e"]) -> f32[Array, b"b/d e"]:
        return x * s

    return scale


@pytest.mark.parametrize("shape", [(8,), (4, 2), (2, 2, 2)])
def test_typed_shard_map_takes_a_jaxtyping_parameter_replicated(shape):
    names = ("d", "t", "u")[: len(shape)]
    mesh = jax.make_mesh(shape, names)
    scale = _scale_fn()
    x = jnp.arange(24.0).reshape(8, 3)
    s = jnp.array([1.0, -2.0, 0.5])
    with jax.set_mesh(mesh):
        got = scale(x, s)
        jitted = jax.jit(scale)(x, s)
    np.testing.assert_allclose(np.asarray(got), np.asarray(x) * np.asarray(s))
    np.testing.assert_allclose(np.asarray(jitted), np.asarray(x) * np.asarray(s))
    plan = scale.__shardlib_signature__
    assert plan.in_specs[1] == jax.sharding.PartitionSpec(None)


def test_typed_shard_map_binds_jaxtyping_dims_with_shardlib_ones():
    from typeguard import TypeCheckError

    scale = _scale_fn()
    with jax.set_mesh(jax.make_mesh((8,), ("d",))):
        with pytest.raises(TypeCheckError, match=r"(?s)argument 's'.*dim 0 'e': expected size 3"):
            scale(jnp.ones((8, 3)), jnp.ones(4))
        with pytest.raises(TypeCheckError, match=r"dtype: expected float32, got int32"):
            scale(jnp.ones((8, 3)), jnp.ones(3, jnp.int32))


def test_typed_shard_map_refuses_a_jaxtyping_family_at_decoration():
    from shardlib.shardtypes import typed_shard_map

    with pytest.raises(TypeError, match=r"typed_shard_map\(.*parameter 's'.*allows several"):

        @typed_shard_map
        def scale(x: f32[Array, b"b/d e"], s: Float[jax.Array, " e"]) -> f32[Array, b"b/d e"]:
            return x * s
