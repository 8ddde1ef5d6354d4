"""typeguard integration: checkers for array types, pytree dataclasses and stacked types,
and for containers of them.

A check binds names in the scope `shardlib._check.scopes.scope_for_memo` gives for typeguard's
memo: the call's own scope for shardlib's checked calls and bare instrumented functions,
the current scope for ``typeguard.check_type``.

typeguard checks only the first item of a list, sequence, dict or ``tuple[X, ...]`` (its
default ``collection_check_strategy``). A container whose item types hold a shardlib type
is checked here instead, every item, in the same scope, so names bind across items; other
containers (``list[int]``) are left to typeguard as configured.
"""

from __future__ import annotations

import collections.abc
import contextvars
import functools
import typing
from typing import Any

import numpy as np
import typeguard
from typeguard import TypeCheckError, TypeCheckMemo

from .._env import frames as _frames
from .checking import check_value, seen_before
from .pytree import StackedType, field_types, is_pytree_dataclass, stacked
from .scopes import CallMemo, is_bare_memo, scope_for_memo
from .types import ArrayType

__all__ = ["register_with_typeguard"]

# Where in the checked value the check is ('field "w"', 'item 2'), innermost last (for
# messages raised after the fact).
_PATH: contextvars.ContextVar[tuple[str, ...]] = contextvars.ContextVar("shardlib_path", default=())


def _site(memo: TypeCheckMemo) -> tuple[str | None, str | None]:
    """(what is checked, whose call): from shardlib's memo, or the stack for bare typeguard."""
    if type(memo) is CallMemo:
        return memo.what, memo.owner
    if is_bare_memo(memo):
        return _frames.typeguard_site(memo)
    return None, None


def _with_owner(e: TypeCheckError, memo: TypeCheckMemo) -> TypeCheckError:
    """``e`` saying ``in f(): `` first, for a bare typeguard call (shardlib's say it later)."""
    if not is_bare_memo(memo):
        return e
    owner = _frames.typeguard_site(memo)[1]
    if owner is None:
        return e
    # Keep the class: a PendingReductionError must stay one for callers that catch it.
    new = type(e)(f"in {owner}(): {e.args[0]}")
    new._path = e._path  # keep any path elements added so far
    return new


def _describe(memo: TypeCheckMemo) -> str:
    """``'field "w" of argument "p" in f()'``: what is being checked.

    typeguard adds this context to errors as they propagate; a layout check deferred to
    compile time (Auto meshes under jit) raises later, so it needs the text up front.
    """
    what, owner = _site(memo)
    parts = list(reversed(_PATH.get()))
    if what is not None:
        parts.append(what)
    text = " of ".join(parts or ["a value"])
    return f"{text} in {owner}()" if owner is not None else text


def _check_array(value: Any, origin_type: Any, args: tuple, memo: TypeCheckMemo) -> None:
    spec = origin_type.spec
    if spec is None:
        # A bare dtype class such as `f32`: check dtype only.
        if not (hasattr(value, "dtype") and np.dtype(value.dtype) == np.dtype(origin_type.dtype)):
            raise TypeCheckError(
                f"is not an array of dtype {np.dtype(origin_type.dtype).name} "
                f"(got {type(value).__name__} {getattr(value, 'dtype', '')})"
            )
        return
    try:
        check_value(
            value,
            origin_type.dtype,
            spec,
            scope_for_memo(memo),
            where="",
            describe=lambda: _describe(memo),
        )
    except TypeCheckError as e:
        raise _with_owner(e, memo) from None


def _check_part(value: Any, t: Any, memo: TypeCheckMemo, label: str, plain: bool = False) -> None:
    """Check one part of a value (a field, an item) against ``t``; errors name ``label``.

    ``plain``: ``t`` is an array type with a spec, checked without typeguard's dispatch.
    """
    token = _PATH.set((*_PATH.get(), label))
    try:
        if plain:
            _check_array(value, t, (), memo)
        else:
            typeguard.check_type_internal(value, t, memo)
    except TypeCheckError as e:
        e.append_path_element(label)
        raise
    finally:
        _PATH.reset(token)


def _check_fields(value: Any, cls: type, memo: TypeCheckMemo, prefix=None) -> None:
    if not isinstance(value, cls):
        raise TypeCheckError(f"is not an instance of {cls.__qualname__}")
    for name, ft in field_types(cls):
        t = stacked(prefix, ft) if prefix is not None else ft
        _check_part(getattr(value, name), t, memo, f'field "{name}"')


def _check_dataclass(value: Any, origin_type: Any, args: tuple, memo: TypeCheckMemo) -> None:
    _check_fields(value, origin_type, memo)


def _check_stacked(value: Any, origin_type: Any, args: tuple, memo: TypeCheckMemo) -> None:
    _check_fields(value, origin_type.inner, memo, origin_type.prefix)


# Containers typeguard samples, by origin: what a value that is not one is called.
_SEQUENCES = {
    list: "a list",
    tuple: "a tuple",  # tuple[X, ...] only: typeguard checks every item of tuple[X, Y]
    collections.abc.Sequence: "a sequence",
    collections.abc.MutableSequence: "a mutable sequence",
}
_MAPPINGS = {
    dict: "a dict",
    collections.abc.Mapping: "a mapping",
    collections.abc.MutableMapping: "a mutable mapping",
}


def _plain_scope(t: Any, memo: TypeCheckMemo):
    """For an item type ``f32[Array, b"..."]``: the scope its checks bind in (then an item
    `seen_before` needs nothing more, as in `check_value`); None for other types."""
    if isinstance(t, type) and issubclass(t, ArrayType) and t.spec is not None:
        return scope_for_memo(memo)
    return None


def _check_sequence(value: Any, origin_type: Any, args: tuple, memo: TypeCheckMemo) -> None:
    if not isinstance(value, origin_type):
        raise TypeCheckError(f"is not {_SEQUENCES[origin_type]}")
    t = args[0]
    s = _plain_scope(t, memo)
    for i, v in enumerate(value):
        if s is None:
            _check_part(v, t, memo, f"item {i}")
        elif not seen_before(v, t.dtype, t.spec, s):
            _check_part(v, t, memo, f"item {i}", plain=True)


def _check_mapping(value: Any, origin_type: Any, args: tuple, memo: TypeCheckMemo) -> None:
    if not isinstance(value, origin_type):
        raise TypeCheckError(f"is not {_MAPPINGS[origin_type]}")
    key_type, value_type = args
    s = _plain_scope(value_type, memo)
    for k, v in value.items():
        if key_type is not Any:
            _check_part(k, key_type, memo, f"key {k!r}")
        if s is None:
            _check_part(v, value_type, memo, f"value of key {k!r}")
        elif not seen_before(v, value_type.dtype, value_type.spec, s):
            _check_part(v, value_type, memo, f"value of key {k!r}", plain=True)


def _is_shardlib_type(t: Any) -> bool:
    try:
        return issubclass(t, ArrayType | StackedType) or is_pytree_dataclass(t)
    except TypeError:  # not a class (a generic alias on some Python versions)
        return False


def _holds_shardlib(args: tuple) -> bool:
    """Whether these type arguments name a shardlib type, at any depth (cached)."""
    try:
        return _holds_cached(args)
    except TypeError:  # unhashable arguments (Annotated metadata): not cached
        return _scan(args)


def _scan(args: tuple) -> bool:
    return any(
        (isinstance(a, type) and _is_shardlib_type(a)) or _scan(typing.get_args(a)) for a in args
    )


_holds_cached = functools.cache(_scan)


def _container_checker(origin_type: type, args: tuple):
    """The checker of every item, for a container whose item types hold a shardlib type."""
    if origin_type in _SEQUENCES:
        if origin_type is tuple and (len(args) != 2 or args[1] is not Ellipsis):
            return None
        return _check_sequence if _holds_shardlib(args[:1]) else None
    if origin_type in _MAPPINGS and len(args) == 2:
        return _check_mapping if _holds_shardlib(args) else None
    return None


def _lookup(origin_type: Any, args: tuple, extras: tuple):
    if isinstance(origin_type, type):
        if issubclass(origin_type, ArrayType):
            return _check_array
        if issubclass(origin_type, StackedType):
            return _check_stacked
        if is_pytree_dataclass(origin_type):
            return _check_dataclass
        if args:
            return _container_checker(origin_type, args)
    return None


def register_with_typeguard() -> None:
    """Teach typeguard to check shardlib annotations (idempotent).

    After this, ``@typeguard.typechecked`` functions check ``f32['batch/d len']`` arguments
    and return values (dtype, shape, bindings, sharding), pytree dataclasses field by field,
    ``Array['layers', T]``, and every item of a list, sequence, dict, mapping or
    ``tuple[X, ...]`` of those (typeguard alone checks only the first).

    Examples:
        >>> register_with_typeguard()
        >>> @typechecked
        ... def f(x: f32[b'batch len']) -> f32[b'batch']: return x.sum(1)
    """
    if _lookup not in typeguard.checker_lookup_functions:
        typeguard.checker_lookup_functions.insert(0, _lookup)
