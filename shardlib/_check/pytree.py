"""Pytree dataclasses, stacked types (``Stacked[T, 'layers']``) and walking annotations."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import typing
from collections.abc import Callable
from typing import Any, Literal, TypeVar, overload

import jax
from jax.tree_util import GetAttrKey
from typeguard import TypeCheckError

from .._lang.parsing import ShapeSpec, SpecError
from . import types
from .interop import from_jaxtyping, is_jaxtyping_array
from .types import Array, ArrayType, array_type, is_array_type

__all__ = [
    "Array",
    "FieldKey",
    "StackedType",
    "field_types",
    "flatten_to",
    "is_pytree_dataclass",
    "keypath_str",
    "map_annotation",
    "pytree_dataclass",
]

_T = TypeVar("_T")
_PYTREE_MARK = "__shardlib_pytree_dataclass__"
_KEY_STYLES = ("name", "attr")


class FieldKey(GetAttrKey):
    """The key of a `pytree_dataclass` field in a JAX key path; prints as the bare field name.

    seqax registered its pytree dataclasses with the field names themselves as keys, so
    ``jax.tree_util.keystr`` of the path to ``state.weights.embed`` is ``'weightsembed'``
    (seqax's checkpoints name arrays by that string). `FieldKey` prints the same way, and is
    a ``jax.tree_util.GetAttrKey``, so libraries that read key paths (orbax, ``keystr(...,
    simple=True)``) still see an attribute key with a ``.name``.

    Examples:
        >>> jax.tree_util.keystr((FieldKey('weights'), FieldKey('embed')))
        'weightsembed'
    """

    __slots__ = ()

    def __str__(self) -> str:
        return self.name

    def __repr__(self) -> str:
        return f"FieldKey(name={self.name!r})"


def flatten_to(treedef: Any, value: Any, message: Callable[[], str]) -> list[Any]:
    """The leaves of ``value`` down to ``treedef`` (an annotation's structure); a
    ``TypeCheckError`` saying ``message()`` when ``value`` does not have that structure."""
    try:
        return treedef.flatten_up_to(value)
    except (ValueError, TypeError):
        raise TypeCheckError(message()) from None


def keypath_str(path: tuple[Any, ...]) -> str:
    """A key path as ``'layers.w'`` whatever the key style, for messages and tables.

    Attribute keys (`FieldKey` or ``GetAttrKey``) are joined by ``'.'``; other keys print as
    ``jax.tree_util.keystr`` prints them (``"['x'].w"``, ``'[0]'``). This is what
    ``keystr(path).lstrip('.')`` gave before keys printed bare.
    """
    out: list[str] = []
    for k in path:
        if isinstance(k, GetAttrKey):
            out.append(f".{k.name}" if out else k.name)
        else:
            out.append(str(k))
    return "".join(out)


def _register(cls: type, names: tuple[str, ...], keys: tuple[Any, ...]) -> None:
    """Register ``cls`` as a pytree whose children are its fields ``names``, keyed by ``keys``."""

    def flatten(obj: Any) -> tuple[list[Any], tuple[()]]:
        return [getattr(obj, n) for n in names], ()

    def flatten_with_keys(obj: Any) -> tuple[list[tuple[Any, Any]], tuple[()]]:
        return [(k, getattr(obj, n)) for k, n in zip(keys, names, strict=True)], ()

    def unflatten(_aux: Any, children: Any) -> Any:
        # Not through __init__: JAX unflattens with placeholders (None, object()) too.
        obj = object.__new__(cls)
        for n, c in zip(names, children, strict=True):
            object.__setattr__(obj, n, c)
        return obj

    jax.tree_util.register_pytree_with_keys(cls, flatten_with_keys, unflatten, flatten)


# pytree_dataclass -> (field names, key objects), for the stacked classes derived from it.
_LAYOUT: dict[type, tuple[tuple[str, ...], tuple[Any, ...]]] = {}  # keys: GetAttrKey


def _check_key_style(keys: Any) -> None:
    if keys not in _KEY_STYLES:
        raise ValueError(
            f"pytree_dataclass(keys=...) takes 'name' (seqax's key paths, "
            f"keystr gives 'weightsembed') or 'attr' (keystr gives '.weights.embed'), "
            f"got keys={keys!r}"
        )


def _make_pytree_dataclass(cls: type[_T], frozen: bool, keys: str) -> type[_T]:
    dc = dataclasses.dataclass(frozen=frozen)(cls)
    names = tuple(f.name for f in dataclasses.fields(typing.cast(Any, dc)))
    key_type = FieldKey if keys == "name" else GetAttrKey
    key_objs = tuple(key_type(n) for n in names)
    _register(dc, names, key_objs)
    _LAYOUT[dc] = (names, key_objs)
    setattr(dc, _PYTREE_MARK, True)
    return dc


@overload
def pytree_dataclass(cls: type[_T], /) -> type[_T]: ...


@overload
def pytree_dataclass(
    cls: None = None, /, *, frozen: bool = False, keys: Literal["name", "attr"] = "name"
) -> Callable[[type[_T]], type[_T]]: ...


@typing.dataclass_transform(field_specifiers=(dataclasses.field, dataclasses.Field))
def pytree_dataclass(
    cls: type[_T] | None = None,
    /,
    *,
    frozen: bool = False,
    keys: Literal["name", "attr"] = "name",
) -> Any:
    """Make ``cls`` a dataclass registered as a JAX pytree (with keys), as seqax's is.

    Fields are annotated with array types (``f32[Array, 'in hidden/d']``), nested pytree
    dataclasses or stacked types (``Stacked[Layer, 'layers']``). Every field is a pytree
    child. The decorator carries ``typing.dataclass_transform``, so static type checkers
    know the generated ``__init__`` (``Weights(w1=..., w2=...)``).

    Use it bare (``@pytree_dataclass``) or with options (``@pytree_dataclass(frozen=True)``).

    **Arguments:**

    - `cls`: the class to turn into a dataclass.
    - `frozen`: ``False`` (the default, as in seqax): fields can be assigned to
      (``state.weights = new_weights``). ``True``: a frozen dataclass; assigning raises
      ``dataclasses.FrozenInstanceError`` and ``dataclasses.replace`` makes modified copies.
    - `keys`: the keys in JAX key paths. ``'name'`` (the default, as in seqax): each key is a
      `FieldKey` that prints as the bare field name, so ``jax.tree_util.keystr`` of the path to
      ``state.weights.embed`` is ``'weightsembed'``, the names seqax's checkpoints use.
      ``'attr'``: ``jax.tree_util.GetAttrKey``, printed ``'.weights.embed'``.

    **Returns:** the dataclass (or, without `cls`, a decorator that makes one).

    Examples:
        >>> @pytree_dataclass
        ... class Weights:
        ...     w1: f32[Array, 'in hidden/d']
        ...     w2: f32[Array, 'hidden out/d']
        >>> make_partition_specs(Weights)
        Weights(w1=P(None, 'd'), w2=P(None, 'd'))
    """
    _check_key_style(keys)
    if not isinstance(frozen, bool):
        raise TypeError(f"pytree_dataclass(frozen=...) takes True or False, got frozen={frozen!r}")
    if cls is None:
        return functools.partial(_make_pytree_dataclass, frozen=frozen, keys=keys)
    if not isinstance(cls, type):
        raise TypeError(
            f"pytree_dataclass(cls) decorates a class, got {cls!r}; pass options by keyword, "
            "e.g. @pytree_dataclass(frozen=True)"
        )
    return _make_pytree_dataclass(cls, frozen, keys)


def is_pytree_dataclass(t: Any) -> bool:
    return isinstance(t, type) and t.__dict__.get(_PYTREE_MARK, False)


@functools.cache
def field_types(cls: type) -> tuple[tuple[str, Any], ...]:
    """``(name, resolved annotation)`` for each field of a pytree dataclass (resolved once).

    For a stacked type ``Array['layers', Layer]`` these are the fields of ``Layer`` with the
    stacked dims in front.
    """
    if isinstance(cls, type) and issubclass(cls, StackedType):
        return tuple(
            (name, _stack_field(cls.prefix, cls.inner, name, ft))
            for name, ft in field_types(cls.inner)
        )
    try:
        hints = typing.get_type_hints(cls)
    except NameError as e:
        raise TypeError(
            f"cannot resolve the field annotations of {cls.__qualname__}: {e}; define the "
            "types it names before using it"
        ) from None
    return tuple((f.name, hints.get(f.name, Any)) for f in dataclasses.fields(cls))


class _StackedMeta(type):
    """Metaclass of the stacked types: an instance of ``Layer`` is an instance of them."""

    def __instancecheck__(cls, obj: Any) -> bool:
        inner = cls.__dict__.get("inner")
        if inner is None:
            return super().__instancecheck__(obj)
        return isinstance(obj, inner)


class StackedType(metaclass=_StackedMeta):
    """Base of ``Array['layers', Cls]``: ``Cls`` with the ``prefix`` dims in front of every field.

    A stacked type is a dataclass subclass of ``Cls`` whose field annotations have the dims
    prepended. Calling it builds a ``Cls`` holding the stacked arrays (so a stacked value has
    exactly the pytree structure of ``Cls`` and ``lax.scan`` over it hands the body ``Cls``
    values); ``isinstance(x, Array['layers', Cls])`` is ``isinstance(x, Cls)``.
    """

    prefix: typing.ClassVar[ShapeSpec]
    inner: typing.ClassVar[type]


def _join(prefix: ShapeSpec, spec: ShapeSpec) -> ShapeSpec:
    """``prefix`` then ``spec``, parsed as one spec: clashes raise the SpecError of that text."""
    if not prefix.dims and not prefix.pending:
        return spec
    text = " ".join(s for s in (str(prefix), str(spec)) if s)
    return ShapeSpec.parse(text)


def _stack_field(prefix: ShapeSpec, owner: type, name: str, ft: Any) -> Any:
    """The annotation of field ``name`` of ``Array[prefix, owner]`` (``ft`` is its own)."""
    stackable = (
        is_array_type(ft)
        or (isinstance(ft, type) and issubclass(ft, StackedType))
        or is_pytree_dataclass(ft)
    )
    if not stackable:
        raise TypeError(
            f"Array[{str(prefix)!r}, {owner.__qualname__}]: field {name!r} is annotated "
            f"{ft!r}, which cannot be stacked: expected an array type such as f32['a b'], a "
            "pytree_dataclass or Array[...]"
        )
    try:
        return stacked(prefix, ft)
    except SpecError as e:
        e.add_note(
            f"Array[{str(prefix)!r}, {owner.__qualname__}]: field {name!r} of "
            f"{owner.__qualname__} is {ft!r}, and the stacked dims {str(prefix)!r} go in "
            "front of it"
        )
        raise


@functools.cache
def stacked(prefix: ShapeSpec, inner: Any) -> Any:
    """``Array[prefix, inner]`` (cached: the same arguments give the same type)."""
    if is_array_type(inner):
        return array_type(inner.short_name, _join(prefix, inner.spec))
    if isinstance(inner, type) and issubclass(inner, StackedType):
        return stacked(_join(prefix, inner.prefix), inner.inner)
    if is_pytree_dataclass(inner):
        return _stacked_class(prefix, inner)
    raise TypeError(
        f"Array[{str(prefix)!r}, ...] needs an array type such as f32['a b'] or a "
        f"pytree_dataclass, got {inner!r}"
    )


@functools.cache
def _stacked_meta(meta: type) -> type:
    if issubclass(_StackedMeta, meta):
        return _StackedMeta
    return type(f"_Stacked{meta.__name__}", (_StackedMeta, meta), {})


def _stacked_class(prefix: ShapeSpec, inner: type) -> type:
    name = f"Array[{str(prefix)!r}, {inner.__qualname__}]"
    try:
        inner_fields: tuple[tuple[str, Any], ...] | None = field_types(inner)
    except TypeError:
        inner_fields = None  # annotations not resolvable yet: field_types() stacks them later
    annotations: dict[str, Any] = {}
    namespace: dict[str, Any] = {}
    if inner_fields is not None:
        own = {f.name: f for f in dataclasses.fields(inner)}
        for fname, ft in inner_fields:
            annotations[fname] = _stack_field(prefix, inner, fname, ft)
            f = own[fname]
            namespace[fname] = dataclasses.field(
                default=f.default,
                default_factory=f.default_factory,
                init=f.init,
                repr=f.repr,
                hash=f.hash,
                compare=f.compare,
                metadata=f.metadata,
                kw_only=f.kw_only,
            )  # type: ignore[call-overload]

    def __new__(cls: type, *args: Any, **kwargs: Any) -> Any:
        # The value of a stacked type is a plain `inner`: one pytree structure either way.
        return inner(*args, **kwargs)

    namespace.update(
        {
            "__annotations__": annotations,
            "__module__": "shardlib.shardtypes",
            "__qualname__": name,
            "__doc__": (
                f"{inner.__qualname__} with {str(prefix)!r} in front of every field. Calling "
                f"it builds a {inner.__qualname__} holding the stacked arrays."
            ),
            "__new__": __new__,
            "prefix": prefix,
            "inner": inner,
        }
    )
    meta = _stacked_meta(type(inner))
    cls = meta(name, (inner, StackedType), namespace)
    params = getattr(inner, "__dataclass_params__", None)
    cls = dataclasses.dataclass(frozen=bool(getattr(params, "frozen", False)))(cls)
    with contextlib.suppress(TypeError, ValueError):  # a class without a readable signature
        cls.__signature__ = inspect.signature(inner)  # type: ignore[attr-defined]
    if inner in _LAYOUT:
        names, keys = _LAYOUT[inner]
        _register(cls, names, keys)
    return cls


def _tuple_args(t: Any) -> tuple[Any, ...] | None:
    if typing.get_origin(t) is tuple:
        args = typing.get_args(t)
        if len(args) == 2 and args[1] is Ellipsis:
            raise TypeError(
                f"{t!r}: variable-length tuples have no fixed layout; list each element type"
            )
        return args
    return None


def map_annotation(
    t: Any, leaf: Callable[..., Any], *, what: str = "type", with_path: bool = False
) -> Any:
    """Build a pytree shaped like annotation ``t`` with ``leaf(dtype, spec)`` at each array.

    Pytree dataclasses become instances of themselves; ``Array['l', Cls]`` instances of
    ``Cls``; ``tuple[...]`` tuples. With ``with_path=True`` the leaf also gets the path of
    the array in ``t`` (``'Model.layers.w'``), for messages.
    """
    return _map(t, leaf, what, with_path)


def _map(t: Any, leaf, what: str, with_path: bool = False) -> Any:
    if is_jaxtyping_array(t):  # replicated, its dims named as in shardlib's annotations
        try:
            t = from_jaxtyping(t)
        except TypeError as e:
            raise TypeError(f"{what}: {e}") from None
    if is_array_type(t):
        return leaf(t.dtype, t.spec, what) if with_path else leaf(t.dtype, t.spec)
    if isinstance(t, type) and issubclass(t, StackedType):
        cls: type | None = t.inner  # the value of a stacked type is an instance of its inner
    elif is_pytree_dataclass(t):
        cls = t
    else:
        cls = None
    if cls is not None:
        obj = object.__new__(cls)
        for name, ft in field_types(t):
            object.__setattr__(obj, name, _map(ft, leaf, f"{what}.{name}", with_path))
        return obj
    args = _tuple_args(t)
    if args is not None:
        return tuple(_map(a, leaf, f"{what}[{i}]", with_path) for i, a in enumerate(args))
    if isinstance(t, type) and issubclass(t, ArrayType):
        raise TypeError(f"{what}: {t!r} has no shape spec; write e.g. {t!r}['batch len']")
    raise TypeError(
        f"{what}: {t!r} is not an array type (f32['a b']), a pytree_dataclass, "
        "Array['layers', T] or a tuple of those"
    )


types.HOOKS["stacked"] = stacked  # Array['layers', Layer] stacks with it
