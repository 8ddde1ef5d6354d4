"""Build (nested) dataclasses from (nested) dicts, e.g. parsed JSON/YAML configs."""

from __future__ import annotations

import dataclasses
import enum
import types
import typing
import warnings
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

__all__ = ["DataclassFromDictError", "UnknownKeyWarning", "make_dataclass_from_dict"]

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


class UnknownKeyWarning(UserWarning):
    """Warned by [`make_dataclass_from_dict`][] for a key the dataclass has no field for.

    The key is ignored, as seqax ignores it (seqax's config files carry such blocks). Pass
    `strict=True` to make it a [`DataclassFromDictError`][] instead, or silence it with
    `warnings.filterwarnings("ignore", category=UnknownKeyWarning)`.
    """


@dataclasses.dataclass
class _Unknown:
    """A key of `data` that the dataclass at `path` has no `__init__` field for."""

    path: str
    key: Any
    owner: str
    valid: tuple[str, ...]
    not_init: bool  # a field of the dataclass, but with init=False


@dataclasses.dataclass
class _Ctx:
    strict: bool
    unknown: list[_Unknown] = dataclasses.field(default_factory=list)

    def child(self) -> _Ctx:
        return _Ctx(self.strict)


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


def _convert(tp: Any, value: Any, path: str, ctx: _Ctx) -> Any:
    """Check `value` against the type `tp`, building dataclasses from mappings where needed."""
    if tp is Any or tp is object:
        return value
    if isinstance(tp, typing.NewType):
        return _convert(tp.__supertype__, value, path, ctx)
    if isinstance(tp, TypeVar):
        return value
    if tp is None or tp is type(None):
        if value is None:
            return None
        raise _mismatch(path, tp, value)

    origin = typing.get_origin(tp)
    args = typing.get_args(tp)

    if _is_union(origin):
        return _convert_union(tp, args, value, path, ctx)
    if origin is typing.Literal:
        if any(value == arg and type(value) is type(arg) for arg in args):
            return value
        raise _mismatch(path, tp, value)
    if origin is typing.Annotated:
        return _convert(args[0], value, path, ctx)
    if origin is not None:
        return _convert_generic(tp, origin, args, value, path, ctx)

    if isinstance(tp, type):
        if dataclasses.is_dataclass(tp):
            if isinstance(value, tp):
                return value
            if isinstance(value, Mapping):
                return _build(tp, value, path, ctx)
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


def _convert_union(tp: Any, args: tuple[Any, ...], value: Any, path: str, ctx: _Ctx) -> Any:
    if value is None:
        if type(None) in args:
            return None
        raise _mismatch(path, tp, value)
    # An exact type match wins over conversions (e.g. `1` stays an int for `float | int`).
    for arg in args:
        if isinstance(arg, type) and type(value) is arg and not dataclasses.is_dataclass(arg):
            return value
    nested: list[str] = []
    # Of the members that fit, the one that ignores the fewest unknown keys wins (the first
    # among equals); with strict=True no key is ignored, so the first member that fits wins.
    best: tuple[Any, _Ctx] | None = None
    for arg in args:
        if arg is type(None):
            continue
        trial = ctx.child()
        try:
            result = _convert(arg, value, path, trial)
        except DataclassFromDictError as e:
            # Errors from inside a member (a dataclass field, a list item...) say why that member
            # did not fit; a plain mismatch at this path would only repeat the message below.
            if e.path != path or not str(e).startswith(f"{path}: expected"):
                nested.append(f"as {_type_name(arg)}: {e}")
            continue
        if best is None or len(trial.unknown) < len(best[1].unknown):
            best = (result, trial)
        if not trial.unknown:
            break
    if best is not None:
        ctx.unknown.extend(best[1].unknown)
        return best[0]
    message = f"expected {_type_name(tp)}, got {_value_repr(value)}"
    if nested:
        message += "; " + "; ".join(nested)
    raise DataclassFromDictError(path, message)


def _convert_generic(
    tp: Any, origin: Any, args: tuple[Any, ...], value: Any, path: str, ctx: _Ctx
) -> Any:
    if origin in (list, set, frozenset, Sequence):
        accepted = list | tuple if origin in (list, Sequence) else list | tuple | set | frozenset
        if not isinstance(value, accepted):
            raise _mismatch(path, tp, value)
        item_tp = args[0] if args else Any
        items = [_convert(item_tp, item, f"{path}[{i}]", ctx) for i, item in enumerate(value)]
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
            return tuple(
                _convert(item_tp, item, f"{path}[{i}]", ctx) for i, item in enumerate(value)
            )
        if args == ((),):  # `tuple[()]` on older Pythons; newer ones give no args
            args = ()
        if len(value) != len(args):
            raise DataclassFromDictError(
                path,
                f"expected {_type_name(tp)} with {len(args)} items, got {len(value)} items: "
                f"{_value_repr(value)}",
            )
        return tuple(
            _convert(item_tp, item, f"{path}[{i}]", ctx)
            for i, (item_tp, item) in enumerate(zip(args, value, strict=True))
        )
    if origin in (dict, Mapping):
        if not isinstance(value, Mapping):
            raise _mismatch(path, tp, value)
        key_tp, val_tp = args if len(args) == 2 else (Any, Any)
        return {
            _convert(key_tp, k, f"{path}[{k!r}]", ctx): _convert(val_tp, v, f"{path}[{k!r}]", ctx)
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


def _build(cls: Any, data: Mapping[Any, Any], path: str, ctx: _Ctx) -> Any:
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
    if unknown and ctx.strict:
        raise DataclassFromDictError(
            path,
            f"unknown key(s) {', '.join(repr(k) for k in unknown)} for {cls.__qualname__}; "
            f"valid fields are: {', '.join(valid)}",
        )
    every = {f.name for f in dataclasses.fields(cls)}
    ctx.unknown.extend(
        _Unknown(path, k, cls.__qualname__, tuple(valid), k in every) for k in unknown
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
        f.name: _convert(hints[f.name], data[f.name], f"{path}.{f.name}", ctx)
        for f in init_fields
        if f.name in data
    }
    return cls(**kwargs)


def make_dataclass_from_dict(cls: type[_T], data: Mapping[str, Any], *, strict: bool = False) -> _T:
    """Construct a dataclass, recursively, from a (nested) dict.

    Each key of `data` names an `__init__` field of `cls`; each value is checked against the
    field's type annotation (string annotations are resolved with `typing.get_type_hints`) and
    converted where needed:

    - a dataclass-typed field takes a dict (built recursively) or an instance;
    - `X | None` / `Optional[X]` accepts `None`; `Union[A, B]` tries each member in turn (an exact
        primitive type match is preferred, so `1` stays an `int` for `float | int`; a dataclass
        member that fits without ignoring keys is preferred over one that ignores some);
    - `list[X]`, `tuple[X, ...]`, `tuple[A, B]`, `set[X]`, `dict[K, V]` convert every item (so
        `list[Cls]` takes a list of dicts); lists and tuples are accepted interchangeably;
    - primitives are passed as-is after an `isinstance` check, except that an `int` is accepted
        (and converted) for a `float` field, and `bool` is not accepted for `int`;
    - `Literal[...]` checks membership, `Enum` fields accept a member or its value;
    - `Any` and types that cannot be checked are passed through.

    Fields with a default (or `default_factory`) may be missing from `data`.

    A key that no field takes is ignored, as seqax ignores it (its shipped configs carry such
    blocks), with one [`UnknownKeyWarning`][] per unknown key naming the key and where it is.
    With `strict=True` it is an error instead.

    **Arguments:**


    - `cls`: the dataclass type to build.
    - `data`: a mapping from field names to values, e.g. parsed from JSON, YAML or TOML.
    - `strict`: `False` (the default, seqax's behaviour): ignore unknown keys, with a warning.
        `True`: raise [`DataclassFromDictError`][] for them.

    **Returns:**

    An instance of `cls`.

    **Raises:**

    [`DataclassFromDictError`][] (a `ValueError`) on a missing required field, a value of the
    wrong type or (with `strict=True`) an unknown key. The message names the full field path
    (e.g. `Config.model.d_model`), the expected type and the offending value; for unknown keys,
    it also lists the valid field names.

    **Warns:**

    [`UnknownKeyWarning`][] (a `UserWarning`) for each unknown key, unless `strict=True`.

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

    # An unknown key is ignored with an UnknownKeyWarning naming Config.model.p_threshold ...
    make_dataclass_from_dict(Config, {"model": {"d_model": 512, "p_threshold": 0.0}})
    # ... or raises with strict=True.
    make_dataclass_from_dict(Config, {"model": {"d_model": 512, "p_threshold": 0.0}}, strict=True)
    ```
    """
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        raise TypeError(f"make_dataclass_from_dict expects a dataclass type, got {cls!r}")
    if not isinstance(strict, bool):
        raise TypeError(
            f"make_dataclass_from_dict({cls.__qualname__}, data, strict=...): strict takes True "
            f"or False, got strict={strict!r}"
        )
    path = cls.__qualname__
    if not isinstance(data, Mapping):
        raise _mismatch(path, cls, data)
    ctx = _Ctx(strict)
    result = _build(cls, data, path, ctx)
    # One warning per unknown key (per dataclass that lacks it), listing where it occurs.
    grouped: dict[tuple[str, Any], list[_Unknown]] = {}
    for u in ctx.unknown:
        grouped.setdefault((u.owner, u.key), []).append(u)
    for (owner, key), found in grouped.items():
        paths = list(dict.fromkeys(f"{u.path}.{key}" for u in found))
        where = ", ".join(paths[:3]) + (f" and {len(paths) - 3} more" if len(paths) > 3 else "")
        lacks = (
            f"{owner}.{key} is a field with init=False"
            if found[0].not_init
            else f"{owner} has no such field"
        )
        warnings.warn(
            f"make_dataclass_from_dict({cls.__qualname__}, data): ignoring key {key!r} at "
            f"{where}: {lacks} (the fields it takes are: {', '.join(found[0].valid) or 'none'}); "
            "pass strict=True to make this an error",
            UnknownKeyWarning,
            stacklevel=2,
        )
    return result
