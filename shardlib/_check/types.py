"""Array annotation types: ``f32[Array, 'batch/d len']`` and friends.

``f32`` is a class; subscripting it with a shape spec returns a cached subclass that carries
``dtype`` and ``spec``. ``f32[Array, 'a b']``, ``f32[jax.Array, 'a b']``, ``f32['a b']`` and
``f32[b'a b']`` are the same class. These classes are only annotations: values are ordinary
JAX arrays. ``Array`` (``Array['layers', Layer]``) and ``Stacked`` (``Stacked[Layer,
'layers']``, the spelling static type checkers accept) are the stacking front ends.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from .._lang.parsing import ShapeSpec, parse_annotation_spec
from .scopes import current_scope

# Set by the modules that build on this one, so that it imports neither (no import cycle):
# `checking` gives the value check behind ``isinstance``, `pytree` the stacking behind
# ``Array['layers', Layer]``. Importing shardlib imports both.
HOOKS: dict[str, Callable[..., Any]] = {}

__all__ = [
    "Array",
    "ArrayType",
    "DTYPES",
    "Stacked",
    "array_type",
    "dtype_short_name",
    "is_array_type",
]


# (short name, subscript as written) -> annotation class.
_SUBSCRIPTED: dict[tuple[str, Any], type[ArrayType]] = {}
# Written in front of the spec: f32[Array, 'a b'] (shardlib's Array or jax.Array).
_ARRAY_WORDS = "Array or jax.Array"


def _is_array_word(x: Any) -> bool:
    return x is Array or x is jax.Array


def _shown(x: Any) -> str:
    """How ``x`` was written in a subscript, for messages (``Array``, ``int``, ``'a b'``)."""
    if x is Array:
        return "Array"
    if x is jax.Array:
        return "jax.Array"
    if isinstance(x, type) and not issubclass(x, ArrayType):
        return x.__qualname__
    return repr(x)


def _spec_of(short: str, item: Any) -> tuple[Any, str]:
    """``(spec, the subscript as written)`` for ``short[item]``; TypeError for a wrong form.

    Accepts ``'spec'``, ``b'spec'``, ``(Array, 'spec')`` and ``(jax.Array, 'spec')``.
    """
    if not isinstance(item, tuple):
        if _is_array_word(item):
            raise TypeError(
                f"{short}[{_shown(item)}] has no shape spec: write {short}[Array, 'batch len'] "
                f"(or {short}[Array, ''] for a scalar)"
            )
        return item, f"{short}[{item!r}]"
    written = f"{short}[{', '.join(_shown(x) for x in item)}]"
    if len(item) == 2 and _is_array_word(item[0]):
        spec = item[1]
        if not isinstance(spec, str | bytes):
            raise TypeError(
                f"{written}: the shape spec must be a string such as 'batch/d len' (or '' for "
                f"a scalar), got {type(spec).__name__} {spec!r}"
            )
        return spec, f"{short}[{_shown(item[0])}, {spec!r}]"
    if len(item) == 2 and isinstance(item[0], str | bytes) and _is_array_word(item[1]):
        raise TypeError(
            f"{written}: the array type comes first, then the spec: write "
            f"{short}[Array, {item[0]!r}]"
        )
    if len(item) == 2 and isinstance(item[1], str | bytes):
        raise TypeError(
            f"{written}: the array type in front of the spec must be {_ARRAY_WORDS}, got "
            f"{_shown(item[0])}: write {short}[Array, {item[1]!r}]"
        )
    raise TypeError(
        f"{written}: {short}[...] takes an array type and a shape spec, as in "
        f"{short}[Array, 'batch/d len'], got {len(item)} item(s)"
    )


class _ArrayTypeMeta(type):
    """Metaclass so that ``f32[Array, 'a b']`` works and prints as ``f32['a b']``."""

    dtype: Any
    spec: ShapeSpec | None
    short_name: str

    def __getitem__(cls, item: Any) -> type[ArrayType]:
        if cls.spec is not None:
            raise TypeError(f"{cls!r} already has a shape spec; write {cls.short_name}[...] once")
        # typeguard evaluates annotations on every call: look the text up before parsing.
        key = (cls.short_name, item)
        try:
            return _SUBSCRIPTED[key]
        except (KeyError, TypeError):  # TypeError: unhashable, parse() explains
            pass
        spec, written = _spec_of(cls.short_name, item)
        if isinstance(spec, str | bytes):
            parsed = parse_annotation_spec(spec, what=written)
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

    def __instancecheck__(cls, obj: Any) -> bool:
        """``isinstance(x, f32['a b'])``: dtype, shape and layout, as the annotation checks.

        Names bind in the scope in force (a checked call's, ``with Scope()``), else in a
        throwaway one. This is what checkers that only call ``isinstance`` (beartype) use.
        """
        if cls.dtype is None:
            return type.__instancecheck__(cls, obj)
        from typeguard import TypeCheckError

        if cls.spec is None:
            return hasattr(obj, "dtype") and np.dtype(obj.dtype) == np.dtype(cls.dtype)
        try:
            HOOKS["check_value"](obj, cls.dtype, cls.spec, current_scope(start=2), where="")
        except TypeCheckError:
            return False
        return True


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

# The classes claim module "builtins" so that `f32['a b'] | None` prints as
# "f32['a b'] | None" (Python prints other classes in a union as module.qualname). beartype
# refuses hints whose union does not print starting with the hint's own repr.
_MODULE = "builtins"

_BASES: dict[str, type[ArrayType]] = {}
for _short, _dt in DTYPES.items():
    _BASES[_short] = _ArrayTypeMeta(
        _short,
        (ArrayType,),
        {"dtype": _dt, "spec": None, "short_name": _short, "__module__": _MODULE},
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
        {"spec": spec, "__module__": _MODULE},
    )  # type: ignore[return-value]


def is_array_type(t: Any) -> bool:
    """Whether ``t`` is an array annotation with a shape spec, such as ``f32['a b']``."""
    return isinstance(t, type) and issubclass(t, ArrayType) and t.spec is not None


def base(short_name: str) -> type[ArrayType]:
    return _BASES[short_name]


class _ArrayMeta(type):
    def __getitem__(cls, item: tuple[str | bytes, Any]) -> Any:
        if not isinstance(item, tuple) or len(item) != 2:
            raise TypeError(
                "Array takes a spec and a type: Array['layers', Layer] or Array['layers', "
                f"f32['a b']], got Array[{item!r}]"
            )
        spec, inner = item
        if not isinstance(spec, str | bytes) and isinstance(inner, str | bytes):
            raise TypeError(
                f"Array[{_shown(spec)}, {inner!r}]: Array takes the stacked dims first: write "
                f"Array[{inner!r}, {_shown(spec)}], or Stacked[{_shown(spec)}, {inner!r}]"
            )
        return HOOKS["stacked"](ShapeSpec.parse(spec), inner)


class Array(metaclass=_ArrayMeta):
    """Prepend dims to an array type or to every field of a pytree dataclass.

    ``Array['layers', f32['a b/d']]`` is ``f32['layers a b/d']``. ``Array['layers', Layer]``
    is a dataclass subclass of ``Layer`` whose fields have ``layers`` in front: the type of
    weights stacked for ``lax.scan``. Call it with the stacked arrays, as seqax does; the
    value it builds is a ``Layer`` (same pytree structure as ``Layer``). A spec that repeats a
    mesh axis once the dims are joined (``Array['l/d', f32['a/d']]``) raises the `SpecError`
    that writing the joined spec (``f32['l/d a/d']``) raises.

    ``Array`` also goes in front of the spec of an array type: ``f32[Array, 'a b']`` is
    ``f32['a b']``, in the form static type checkers read as ``jax.Array``. For stacks in
    that form write `Stacked`\\ ``[Layer, 'layers']``.

    Examples:
        >>> Transformer = Array['layers', Layer]  # Layer(w=f32[Array, 'in out/d'])
        >>> make_partition_specs(Transformer)
        Layer(w=P(None, None, 'd'))
        >>> stack = Transformer(w=jnp.zeros((4, 8, 8)))  # a Layer holding 4 layers
    """


class _StackedFrontMeta(type):
    def __getitem__(cls, item: Any) -> Any:
        if not isinstance(item, tuple) or len(item) != 2:
            shown = ", ".join(map(_shown, item)) if isinstance(item, tuple) else _shown(item)
            raise TypeError(
                f"Stacked[{shown}]: Stacked takes a type and the stacked dims, as in "
                "Stacked[Layer, 'layers']"
            )
        inner, spec = item
        if isinstance(inner, str | bytes) and not isinstance(spec, str | bytes):
            raise TypeError(
                f"Stacked[{inner!r}, {_shown(spec)}]: the type comes first, then the stacked "
                f"dims: write Stacked[{_shown(spec)}, {inner!r}]"
            )
        if not isinstance(spec, str | bytes):
            raise TypeError(
                f"Stacked[{_shown(inner)}, {_shown(spec)}]: the stacked dims must be a string "
                f"such as 'layers', got {type(spec).__name__} {spec!r}"
            )
        return Array[spec, inner]


class Stacked(metaclass=_StackedFrontMeta):
    """``Stacked[Layer, 'layers']`` is ``Array['layers', Layer]``, spelled for static checkers.

    Static type checkers read ``Stacked[T, 'dims']`` as ``T`` (it is ``typing.Annotated``
    to them), so a stacked field holds a ``Layer`` as far as they are concerned, which is
    what the value is. At runtime it is the stacked type `Array` builds.

    Examples:
        >>> @pytree_dataclass
        ... class Model:
        ...     layers: Stacked[Layer, 'layers']
        >>> Stacked[Layer, 'layers'] is Array['layers', Layer]
        True
    """
