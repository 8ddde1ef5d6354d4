"""Build (nested) dataclasses from (nested) dicts, e.g. parsed JSON/YAML configs."""

from __future__ import annotations

import dataclasses
import enum
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

__all__ = ["DataclassFromDictError", "make_dataclass_from_dict"]

_T = TypeVar("_T")
_MAX_REPR = 120


class DataclassFromDictError(ValueError):
    """Raised by [`make_dataclass_from_dict`][] when the data does not fit the dataclass.

    The message names the full path of the offending field (e.g. `Config.model.d_model`).
    The path is also available as the `path` attribute.
    """

    def __init__(self, path: str, message: str):
        self.path = path
        super().__init__(f"{path}: {message}")


def _type_name(tp: Any) -> str:
    """A short, readable name for a type annotation, e.g. `list[ModelConfig] | None`."""
    if tp is type(None) or tp is None:
        return "None"
    if tp is Ellipsis:
        return "..."
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if _is_union(origin):
        return " | ".join(_type_name(arg) for arg in args)
    if origin is typing.Literal:
        return f"Literal[{', '.join(repr(arg) for arg in args)}]"
    if origin is not None:
        name = getattr(origin, "__qualname__", None) or repr(origin).replace("typing.", "")
        if args == ((),) or (origin is tuple and not args and tp is not typing.Tuple):  # noqa: UP006
            return f"{name}[()]"
        return f"{name}[{', '.join(_type_name(arg) for arg in args)}]" if args else name
    if isinstance(tp, type):
        return tp.__qualname__
    return repr(tp).replace("typing.", "")


def _value_repr(value: Any) -> str:
    text = repr(value)
    if len(text) > _MAX_REPR:
        text = text[: _MAX_REPR - 3] + "..."
    return f"{text} (of type {type(value).__qualname__})"


def _mismatch(path: str, tp: Any, value: Any) -> DataclassFromDictError:
    return DataclassFromDictError(path, f"expected {_type_name(tp)}, got {_value_repr(value)}")


def _is_union(origin: Any) -> bool:
    return origin is typing.Union or origin is types.UnionType


def _convert(tp: Any, value: Any, path: str) -> Any:
    """Check `value` against the type `tp`, building dataclasses from mappings where needed."""
    if tp is Any or tp is object:
        return value
    if isinstance(tp, typing.NewType):
        return _convert(tp.__supertype__, value, path)
    if isinstance(tp, TypeVar):
        return value
    if tp is None or tp is type(None):
        if value is None:
            return None
        raise _mismatch(path, tp, value)

    origin = typing.get_origin(tp)
    args = typing.get_args(tp)

    if _is_union(origin):
        return _convert_union(tp, args, value, path)
    if origin is typing.Literal:
        if any(value == arg and type(value) is type(arg) for arg in args):
            return value
        raise _mismatch(path, tp, value)
    if origin is typing.Annotated:
        return _convert(args[0], value, path)
    if origin is not None:
        return _convert_generic(tp, origin, args, value, path)

    if isinstance(tp, type):
        if dataclasses.is_dataclass(tp):
            if isinstance(value, tp):
                return value
            if isinstance(value, Mapping):
                return _build(tp, value, path)
            raise _mismatch(path, tp, value)
        if tp is float:
            if isinstance(value, float):
                return value
            if isinstance(value, int) and not isinstance(value, bool):
                return float(value)
            raise _mismatch(path, tp, value)
        if tp is int and isinstance(value, bool):
            raise _mismatch(path, tp, value)
        if isinstance(value, tp):
            return value
        if issubclass(tp, enum.Enum):
            try:
                return tp(value)
            except ValueError:
                raise _mismatch(path, tp, value) from None
        raise _mismatch(path, tp, value)

    # Anything else (Callable[...], ParamSpec, string forward references left unresolved...)
    # cannot be checked meaningfully: pass the value through.
    return value


def _convert_union(tp: Any, args: tuple[Any, ...], value: Any, path: str) -> Any:
    if value is None:
        if type(None) in args:
            return None
        raise _mismatch(path, tp, value)
    # An exact type match wins over conversions (e.g. `1` stays an int for `float | int`).
    for arg in args:
        if isinstance(arg, type) and type(value) is arg and not dataclasses.is_dataclass(arg):
            return value
    nested: list[str] = []
    for arg in args:
        if arg is type(None):
            continue
        try:
            return _convert(arg, value, path)
        except DataclassFromDictError as e:
            # Errors from inside a member (a dataclass field, a list item...) say why that member
            # did not fit; a plain mismatch at this path would only repeat the message below.
            if e.path != path or not str(e).startswith(f"{path}: expected"):
                nested.append(f"as {_type_name(arg)}: {e}")
    message = f"expected {_type_name(tp)}, got {_value_repr(value)}"
    if nested:
        message += "; " + "; ".join(nested)
    raise DataclassFromDictError(path, message)


def _convert_generic(tp: Any, origin: Any, args: tuple[Any, ...], value: Any, path: str) -> Any:
    if origin in (list, set, frozenset, Sequence):
        accepted = list | tuple if origin in (list, Sequence) else list | tuple | set | frozenset
        if not isinstance(value, accepted):
            raise _mismatch(path, tp, value)
        item_tp = args[0] if args else Any
        items = [_convert(item_tp, item, f"{path}[{i}]") for i, item in enumerate(value)]
        if origin is set:
            return set(items)
        if origin is frozenset:
            return frozenset(items)
        return items
    if origin is tuple:
        if not isinstance(value, list | tuple):
            raise _mismatch(path, tp, value)
        if tp is typing.Tuple or (len(args) == 2 and args[1] is Ellipsis):  # noqa: UP006
            item_tp = args[0] if args else Any
            return tuple(_convert(item_tp, item, f"{path}[{i}]") for i, item in enumerate(value))
        if args == ((),):  # `tuple[()]` on older Pythons; newer ones give no args
            args = ()
        if len(value) != len(args):
            raise DataclassFromDictError(
                path,
                f"expected {_type_name(tp)} with {len(args)} items, got {len(value)} items: "
                f"{_value_repr(value)}",
            )
        return tuple(
            _convert(item_tp, item, f"{path}[{i}]")
            for i, (item_tp, item) in enumerate(zip(args, value, strict=True))
        )
    if origin in (dict, Mapping):
        if not isinstance(value, Mapping):
            raise _mismatch(path, tp, value)
        key_tp, val_tp = args if len(args) == 2 else (Any, Any)
        return {
            _convert(key_tp, k, f"{path}[{k!r}]"): _convert(val_tp, v, f"{path}[{k!r}]")
            for k, v in value.items()
        }
    if origin is type:
        if isinstance(value, type):
            return value
        raise _mismatch(path, tp, value)
    if isinstance(origin, type):
        # Some other parameterised class (e.g. a user generic): check the class only.
        if isinstance(value, origin):
            return value
        raise _mismatch(path, tp, value)
    return value


def _build(cls: Any, data: Mapping[Any, Any], path: str) -> Any:
    try:
        hints = typing.get_type_hints(cls)
    except NameError as e:
        raise TypeError(
            f"cannot resolve the type annotations of {cls.__qualname__} ({e}); classes used in "
            "string annotations must be importable from the module defining the dataclass"
        ) from e
    init_fields = [f for f in dataclasses.fields(cls) if f.init]
    valid = [f.name for f in init_fields]

    unknown = [k for k in data if k not in valid]
    if unknown:
        raise DataclassFromDictError(
            path,
            f"unknown key(s) {', '.join(repr(k) for k in unknown)} for {cls.__qualname__}; "
            f"valid fields are: {', '.join(valid)}",
        )

    missing = [
        f.name
        for f in init_fields
        if f.name not in data
        and f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise DataclassFromDictError(
            path,
            f"missing required field(s) for {cls.__qualname__}: "
            + ", ".join(f"{path}.{name} ({_type_name(hints[name])})" for name in missing),
        )

    kwargs = {
        f.name: _convert(hints[f.name], data[f.name], f"{path}.{f.name}")
        for f in init_fields
        if f.name in data
    }
    return cls(**kwargs)


def make_dataclass_from_dict(cls: type[_T], data: Mapping[str, Any]) -> _T:
    """Construct a dataclass, recursively, from a (nested) dict.

    Each key of `data` must be an `__init__` field of `cls`; each value is checked against the
    field's type annotation (string annotations are resolved with `typing.get_type_hints`) and
    converted where needed:

    - a dataclass-typed field takes a dict (built recursively) or an instance;
    - `X | None` / `Optional[X]` accepts `None`; `Union[A, B]` tries each member in turn (an exact
        primitive type match is preferred, so `1` stays an `int` for `float | int`);
    - `list[X]`, `tuple[X, ...]`, `tuple[A, B]`, `set[X]`, `dict[K, V]` convert every item (so
        `list[Cls]` takes a list of dicts); lists and tuples are accepted interchangeably;
    - primitives are passed as-is after an `isinstance` check, except that an `int` is accepted
        (and converted) for a `float` field, and `bool` is not accepted for `int`;
    - `Literal[...]` checks membership, `Enum` fields accept a member or its value;
    - `Any` and types that cannot be checked are passed through.

    Fields with a default (or `default_factory`) may be missing from `data`.

    **Arguments:**


    - `cls`: the dataclass type to build.
    - `data`: a mapping from field names to values, e.g. parsed from JSON, YAML or TOML.

    **Returns:**

    An instance of `cls`.

    **Raises:**

    [`DataclassFromDictError`][] (a `ValueError`) on an unknown key, a missing required field or
    a value of the wrong type. The message names the full field path (e.g.
    `Config.model.d_model`), the expected type and the offending value; for unknown keys, it also
    lists the valid field names.

    Examples:

    ```python
    @dataclasses.dataclass
    class Model:
        d_model: int
        dropout: float = 0.0

    @dataclasses.dataclass
    class Config:
        model: Model
        layers: list[Model] = dataclasses.field(default_factory=list)
        seed: int | None = None

    config = make_dataclass_from_dict(Config, {"model": {"d_model": 512, "dropout": 0}})
    assert config == Config(model=Model(d_model=512, dropout=0.0))
    ```
    """
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        raise TypeError(f"make_dataclass_from_dict expects a dataclass type, got {cls!r}")
    path = cls.__qualname__
    if not isinstance(data, Mapping):
        raise _mismatch(path, cls, data)
    return _build(cls, data, path)
