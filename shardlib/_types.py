"""Array annotation types: ``f32['batch/d len']`` and friends.

``f32`` is a class; subscripting it with a shape spec returns a cached subclass that carries
``dtype`` and ``spec``. These classes are only annotations: values are ordinary JAX arrays.
"""

from __future__ import annotations

import functools
from typing import Any, ClassVar

import jax.numpy as jnp
import numpy as np

from ._parsing import ShapeSpec, parse_annotation_spec

__all__ = [
    "ArrayType",
    "DTYPES",
    "array_type",
    "dtype_short_name",
    "is_array_type",
]


# (short name, spec text as written) -> annotation class.
_SUBSCRIPTED: dict[tuple[str, Any], type[ArrayType]] = {}


class _ArrayTypeMeta(type):
    """Metaclass so that ``f32['a b']`` works and prints as written."""

    dtype: Any
    spec: ShapeSpec | None
    short_name: str

    def __getitem__(cls, spec: str | bytes) -> type[ArrayType]:
        # typeguard evaluates annotations on every call: look the text up before parsing.
        key = (cls.short_name, spec)
        try:
            return _SUBSCRIPTED[key]
        except (KeyError, TypeError):  # TypeError: unhashable, parse() explains
            pass
        if isinstance(spec, str | bytes):
            parsed = parse_annotation_spec(spec, what=f"{cls.short_name}[{spec!r}]")
        else:
            parsed = ShapeSpec.parse(spec)  # not text: parse() says what is wrong
        t = array_type(cls.short_name, parsed)
        if len(_SUBSCRIPTED) < 65536:
            _SUBSCRIPTED[key] = t
        return t

    def __repr__(cls) -> str:
        if cls.spec is None:
            return cls.short_name
        return f"{cls.short_name}[{str(cls.spec)!r}]"


class ArrayType(metaclass=_ArrayTypeMeta):
    """Base of all array annotation types. ``dtype`` is None for ``ArrayType`` itself."""

    dtype: ClassVar[Any] = None
    spec: ClassVar[ShapeSpec | None] = None
    short_name: ClassVar[str] = "ArrayType"

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(
            f"{cls!r} is an annotation, not a constructor: create arrays with jax.numpy "
            f"(e.g. jnp.zeros(shape, dtype=jnp.{np.dtype(cls.dtype).name if cls.dtype else 'float32'}))"
        )


# Short names (as users write them) -> JAX dtypes.
DTYPES: dict[str, Any] = {
    "bool_": jnp.bool_,
    "bf16": jnp.bfloat16,
    "f16": jnp.float16,
    "f32": jnp.float32,
    "f64": jnp.float64,
    "i8": jnp.int8,
    "i16": jnp.int16,
    "i32": jnp.int32,
    "i64": jnp.int64,
    "u8": jnp.uint8,
    "u16": jnp.uint16,
    "u32": jnp.uint32,
    "u64": jnp.uint64,
}
# The float8 types this JAX has (names vary across releases).
_FLOAT8 = {
    "f8_e4m3fn": "float8_e4m3fn",
    "f8_e5m2": "float8_e5m2",
    "f8_e4m3fnuz": "float8_e4m3fnuz",
    "f8_e5m2fnuz": "float8_e5m2fnuz",
    "f8_e4m3b11fnuz": "float8_e4m3b11fnuz",
    "f8_e4m3": "float8_e4m3",
    "f8_e3m4": "float8_e3m4",
    "f8_e8m0fnu": "float8_e8m0fnu",
}
for _short, _attr in _FLOAT8.items():
    if hasattr(jnp, _attr):
        DTYPES[_short] = getattr(jnp, _attr)

_BASES: dict[str, type[ArrayType]] = {}
for _short, _dt in DTYPES.items():
    _BASES[_short] = _ArrayTypeMeta(
        _short,
        (ArrayType,),
        {"dtype": _dt, "spec": None, "short_name": _short, "__module__": "shardlib.shardtypes"},
    )  # type: ignore[assignment]

_NAME_OF_DTYPE = {np.dtype(dt): short for short, dt in DTYPES.items()}


def dtype_short_name(dtype: Any) -> str:
    """``jnp.float32`` -> ``'f32'`` (falls back to the NumPy name)."""
    if dtype is None:
        return "Array"
    try:
        d = np.dtype(dtype)
    except TypeError:
        return str(dtype)
    return _NAME_OF_DTYPE.get(d, d.name)


@functools.cache
def array_type(short_name: str, spec: ShapeSpec) -> type[ArrayType]:
    """The annotation class for ``short_name[spec]`` (cached: same spec, same class).

    Raises `SpecError` for a spec with a pending-reduction clause (``{+t}``): annotations
    describe reduced values.
    """
    parse_annotation_spec(spec, what=f"{short_name}[{str(spec)!r}]")
    base = _BASES[short_name]
    return _ArrayTypeMeta(
        f"{short_name}[{str(spec)!r}]",
        (base,),
        {"spec": spec, "__module__": "shardlib.shardtypes"},
    )  # type: ignore[return-value]


def is_array_type(t: Any) -> bool:
    """Whether ``t`` is an array annotation with a shape spec, such as ``f32['a b']``."""
    return isinstance(t, type) and issubclass(t, ArrayType) and t.spec is not None


def base(short_name: str) -> type[ArrayType]:
    return _BASES[short_name]
