"""Array annotation types: every dtype class, subscripting, caching, repr and dtype checks."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import typeguard
from typeguard import TypeCheckError, typechecked

from shardlib import SpecError, shardtypes
from shardlib.shardtypes import (
    Array,
    ArrayType,
    Scope,
    ShapeSpec,
    Stacked,
    check,
    f32,
    i32,
    register_with_typeguard,
)

register_with_typeguard()

# Every dtype class the API promises, with the NumPy dtype it must stand for.
BASE_DTYPES = {
    "bool_": np.dtype(np.bool_),
    "bf16": np.dtype(ml_dtypes.bfloat16),
    "f16": np.dtype(np.float16),
    "f32": np.dtype(np.float32),
    "f64": np.dtype(np.float64),
    "i8": np.dtype(np.int8),
    "i16": np.dtype(np.int16),
    "i32": np.dtype(np.int32),
    "i64": np.dtype(np.int64),
    "u8": np.dtype(np.uint8),
    "u16": np.dtype(np.uint16),
    "u32": np.dtype(np.uint32),
    "u64": np.dtype(np.uint64),
}
# The float8 types: a class for each one this JAX has.
FLOAT8 = {
    "f8_e4m3fn": "float8_e4m3fn",
    "f8_e5m2": "float8_e5m2",
    "f8_e4m3fnuz": "float8_e4m3fnuz",
    "f8_e5m2fnuz": "float8_e5m2fnuz",
    "f8_e4m3b11fnuz": "float8_e4m3b11fnuz",
    "f8_e4m3": "float8_e4m3",
    "f8_e3m4": "float8_e3m4",
    "f8_e8m0fnu": "float8_e8m0fnu",
}
ALL_DTYPES = dict(BASE_DTYPES)
ALL_DTYPES.update(
    {short: np.dtype(getattr(jnp, long)) for short, long in FLOAT8.items() if hasattr(jnp, long)}
)
NAMES = sorted(ALL_DTYPES)
SIXTY_FOUR = {"f64", "i64", "u64"}


def _other_dtype(dt: np.dtype) -> np.dtype:
    """A dtype different from ``dt``, for mismatch tests."""
    return np.dtype(np.int32) if dt == np.float32 else np.dtype(np.float32)


def test_float8_classes_follow_jax():
    present = {short for short, long in FLOAT8.items() if hasattr(jnp, long)}
    assert present, "this JAX has no float8 types at all?"
    for short in FLOAT8:
        assert hasattr(shardtypes, short) == (short in present), short
        assert (short in shardtypes.__all__) == (short in present), short


@pytest.mark.parametrize("name", NAMES)
def test_base_class(name):
    cls = getattr(shardtypes, name)
    assert name in shardtypes.__all__
    assert issubclass(cls, ArrayType)
    assert np.dtype(cls.dtype) == ALL_DTYPES[name]
    assert cls.spec is None
    assert repr(cls) == name


@pytest.mark.parametrize("name", NAMES)
def test_subscript_is_cached_and_carries_dtype_and_spec(name):
    cls = getattr(shardtypes, name)
    t = cls["batch/d len"]
    assert t is cls["batch/d len"]
    assert t is cls[b"batch/d len"]  # str and bytes give the same class
    assert t is not cls["batch len"]
    assert issubclass(t, cls) and issubclass(t, ArrayType)
    assert np.dtype(t.dtype) == ALL_DTYPES[name]
    assert t.spec == ShapeSpec.parse("batch/d len")
    assert str(t.spec) == "batch/d len"
    assert repr(t) == f"{name}['batch/d len']"
    assert t.spec.partition_spec() == jax.sharding.PartitionSpec("d", None)


def test_scalar_and_literal_specs():
    assert repr(f32[""]) == "f32['']"
    assert f32[""].spec.dims == ()
    assert f32["2 M/t/d"].spec.partition_spec() == jax.sharding.PartitionSpec(None, ("t", "d"))
    assert f32["2 M"].spec.dims[0].shape == 2


@pytest.mark.parametrize("name", NAMES)
def test_dtype_checked_with_numpy_values(name):
    """``check`` accepts the class's dtype and rejects another, naming both."""
    cls = getattr(shardtypes, name)
    dt = ALL_DTYPES[name]
    ok = np.zeros((2, 3), dtype=dt)
    with Scope():
        check(cls.dtype, "a b", ok)
    bad_dt = _other_dtype(dt)
    with pytest.raises(TypeCheckError) as e:
        check(cls.dtype, "a b", np.zeros((2, 3), dtype=bad_dt))
    msg = str(e.value)
    assert f"value does not match {name}['a b']" in msg
    assert f"dtype: expected {dt.name}, got {bad_dt.name}" in msg


@pytest.mark.parametrize("name", sorted(set(NAMES) - SIXTY_FOUR))
def test_dtype_checked_with_jax_values_through_typeguard(name):
    cls = getattr(shardtypes, name)
    dt = ALL_DTYPES[name]
    x = jnp.zeros((2, 3), dtype=dt)
    assert typeguard.check_type(x, cls[b"a b"]) is x
    bad_dt = _other_dtype(dt)
    with pytest.raises(TypeCheckError) as e:
        typeguard.check_type(jnp.zeros((2, 3), dtype=bad_dt), cls[b"a b"])
    assert f"does not match {name}['a b']" in str(e.value)
    assert f"dtype: expected {dt.name}, got {bad_dt.name}" in str(e.value)


# typeguard instruments a function only when its annotations use module-level names (a
# closure variable in an annotation silently turns instrumentation off), so these live here.
@typechecked
def takes_bf16(x: shardtypes.bf16[b"a b"]) -> shardtypes.bf16[b"a b"]:
    return x


@typechecked
def takes_u8(x: shardtypes.u8[b"a b"]) -> shardtypes.u8[b"a b"]:
    return x


@typechecked
def takes_bool(x: shardtypes.bool_[b"a b"]) -> shardtypes.bool_[b"a b"]:
    return x


@typechecked
def takes_f8(x: shardtypes.f8_e4m3fn[b"a b"]) -> shardtypes.f8_e4m3fn[b"a b"]:
    return x


@pytest.mark.parametrize(
    ("f", "name"),
    [(takes_bf16, "bf16"), (takes_u8, "u8"), (takes_bool, "bool_"), (takes_f8, "f8_e4m3fn")],
)
def test_dtype_mismatch_names_the_argument_and_function(f, name):
    dt = ALL_DTYPES[name]
    x = jnp.ones((2, 3), dtype=dt)
    assert f(x) is x
    for bad_dt in [np.dtype(np.float32), np.dtype(np.int8)]:
        with pytest.raises(TypeCheckError) as e:
            f(jnp.ones((2, 3), dtype=bad_dt))
        msg = str(e.value)
        assert msg.startswith('argument "x"')
        assert f"in {f.__name__}(): does not match {name}['a b']" in msg
        assert f"dtype: expected {dt.name}, got {bad_dt.name}" in msg


enable_x64 = getattr(jax, "enable_x64", None)


@typechecked
def takes_f64(x: shardtypes.f64[b"a"]) -> shardtypes.f64[b"a"]:
    return x


@typechecked
def takes_i64(x: shardtypes.i64[b"a"]) -> shardtypes.i64[b"a"]:
    return x


@typechecked
def takes_u64(x: shardtypes.u64[b"a"]) -> shardtypes.u64[b"a"]:
    return x


@pytest.mark.skipif(enable_x64 is None, reason="this JAX has no jax.enable_x64")
@pytest.mark.parametrize(
    ("f", "name"), [(takes_f64, "f64"), (takes_i64, "i64"), (takes_u64, "u64")]
)
def test_64_bit_dtypes_with_x64_jax_values(f, name):
    dt = ALL_DTYPES[name]
    with enable_x64(True):
        x = jnp.zeros(4, dtype=dt)
        assert x.dtype == dt
        assert f(x) is x
        narrow = jnp.zeros(4, dtype=np.dtype(dt.kind + "4"))
        with pytest.raises(TypeCheckError, match=f"dtype: expected {dt.name}, got {narrow.dtype}"):
            f(narrow)
    # Without x64, JAX has no 64-bit arrays; NumPy values are still checked.
    assert f(np.zeros(4, dtype=dt)).dtype == dt


def test_bare_dtype_class_checks_dtype_only():
    @typechecked
    def f(x: f32) -> i32:
        return x.astype(jnp.int32)

    assert f(jnp.zeros((2, 3, 4))).dtype == jnp.int32  # any shape
    with pytest.raises(TypeCheckError, match="dtype float32"):
        f(jnp.zeros(3, jnp.int32))


@pytest.mark.parametrize("t", [f32, f32["a b"], shardtypes.bf16, ArrayType])
def test_instantiating_an_annotation_raises(t):
    with pytest.raises(TypeError, match="is an annotation, not a constructor") as e:
        t()
    assert "jnp.zeros(shape, dtype=jnp." in str(e.value)
    with pytest.raises(TypeError, match="annotation"):
        t(np.zeros(3))


def test_bad_subscripts():
    with pytest.raises(SpecError) as e:
        f32["a//d"]
    assert isinstance(e.value, ValueError)
    assert "'a//d'" in str(e.value) and "^" in str(e.value)
    with pytest.raises(TypeError, match="str or bytes"):
        f32[3]
    with pytest.raises(TypeError, match="str or bytes"):
        f32[["a"]]
    # A failed subscript leaves nothing behind: the good spelling still works.
    assert f32["a/d"].spec.dims[0].sharding == ("d",)


# ---------------------------------------------------------------------------------------------
# The spelling static checkers accept: f32[Array, 'spec'] and Stacked[T, 'dims'].
# ---------------------------------------------------------------------------------------------


def test_array_spelling_is_the_same_type_as_the_old_ones():
    t = shardtypes.f32[Array, "batch/d len"]
    assert t is shardtypes.f32["batch/d len"] is shardtypes.f32[b"batch/d len"]
    assert t is shardtypes.f32[jax.Array, "batch/d len"] is shardtypes.f32[Array, b"batch/d len"]
    assert shardtypes.i32[Array, ""] is shardtypes.i32[""]
    assert repr(t) == "f32['batch/d len']"
    assert shardtypes.make_partition_specs(t) == jax.sharding.PartitionSpec("d", None)


def test_stacked_is_array_with_the_arguments_swapped():
    @shardtypes.pytree_dataclass
    class Layer:
        w: shardtypes.f32[Array, b"a b/d"]

    assert Stacked[Layer, "layers"] is Array["layers", Layer] is Stacked[Layer, b"layers"]
    assert Stacked[shardtypes.f32[Array, "a"], "l"] is shardtypes.f32["l a"]
    specs = shardtypes.make_partition_specs(Stacked[Layer, "layers"])
    assert specs.w == jax.sharding.PartitionSpec(None, None, "d")


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda A: shardtypes.f32[A], r"f32\[Array\] has no shape spec: write f32\[Array, "),
        (lambda A: shardtypes.f32[A, 3], r"f32\[Array, 3\]: the shape spec must be a string"),
        (
            lambda A: shardtypes.f32[int, "x"],
            r"must be Array or jax.Array, got int: write f32\[Array, 'x'\]",
        ),
        (lambda A: shardtypes.f32["x", A], r"the array type comes first.*write f32\[Array, 'x'\]"),
        (lambda A: shardtypes.f32[A, "a", "b"], r"takes an array type and a shape spec.*3 item"),
        (lambda A: shardtypes.f32[A, "a"][A, "b"], r"already has a shape spec"),
    ],
)
def test_wrong_array_spellings_name_what_was_written_and_the_fix(make, message):
    with pytest.raises(TypeError, match=message):
        make(Array)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (
            lambda S, A: S["layers", int],
            r"Stacked\['layers', int\]: the type comes first.*write Stacked\[int, 'layers'\]",
        ),
        (lambda S, A: S[int], r"Stacked\[int\]: Stacked takes a type and the stacked dims"),
        (lambda S, A: S[int, 3], r"the stacked dims must be a string"),
        (
            lambda S, A: A[int, "l"],
            r"Array takes the stacked dims first: write Array\['l', int\], or Stacked\[int, 'l'\]",
        ),
    ],
)
def test_wrong_stacked_spellings_name_the_fix(make, message):
    with pytest.raises(TypeError, match=message):
        make(Stacked, Array)


def test_array_spelling_is_checked_by_typeguard_and_typed_shard_map():
    @typechecked
    def f(
        x: shardtypes.f32[Array, b"a b"], y: shardtypes.f32[Array, b"b"]
    ) -> shardtypes.f32[Array, b"a"]:
        return x @ y

    np.testing.assert_allclose(f(jnp.ones((2, 3)), jnp.ones(3)), [3.0, 3.0])
    with pytest.raises(TypeCheckError, match="'b'"):
        f(jnp.ones((2, 3)), jnp.ones(4))

    @shardtypes.typed_shard_map
    def g(x: shardtypes.f32[Array, "batch/d n"]) -> shardtypes.f32[Array, b"batch/d"]:
        return jnp.sum(x, axis=1)

    with jax.set_mesh(jax.make_mesh((8,), ("d",))):
        x = np.arange(32.0, dtype=np.float32).reshape(16, 2)
        np.testing.assert_allclose(g(x), x.sum(1))
        with pytest.raises(TypeCheckError, match="batch"):
            g(np.ones((12, 2), np.float32))  # 12 does not split over d=8
