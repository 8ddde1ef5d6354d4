"""typeguard integration: checkers for array types, pytree dataclasses and stacked types."""

from __future__ import annotations

import functools
import sys
from typing import Any

import typeguard
from typeguard import TypeCheckError, TypeCheckMemo

from ._checking import check_value
from ._pytree import StackedType, field_types, is_pytree_dataclass, stacked
from ._scopes import find_memo_frame, memo_in_frame, scope_for_memo
from ._types import ArrayType

__all__ = ["register_with_typeguard"]


def _owner_name(memo: TypeCheckMemo) -> str | None:
    f = find_memo_frame(memo, start=3)
    return f.f_code.co_qualname if f is not None else None


def _with_owner(e: TypeCheckError, memo: TypeCheckMemo) -> TypeCheckError:
    owner = _owner_name(memo)
    if owner is None:
        return e
    # Keep the class: a PendingReductionError must stay one for callers that catch it.
    new = type(e)(f"in {owner}(): {e.args[0]}")
    new._path = e._path  # keep any path elements added so far
    return new


def _describe(memo: TypeCheckMemo) -> str:
    """``'field "w" of argument "p" in f()'``: what is being checked, read off the stack.

    typeguard adds this context to errors as they propagate; a layout check deferred to
    compile time (Auto meshes under jit) raises later, so it needs the text up front.
    """
    parts: list[str] = []
    f = sys._getframe(1)
    for _ in range(64):
        if f is None:
            break
        code = f.f_code
        if code is _check_fields.__code__:
            parts.append(f'field "{f.f_locals.get("name", "?")}"')
        elif code.co_name == "check_argument_types_internal":
            parts.append(f'argument "{f.f_locals.get("argname", "?")}"')
        elif code.co_name == "check_return_type_internal":
            parts.append("the return value")
        elif code.co_name == "check_variable_assignment":
            parts.append("an assigned value")
        elif memo_in_frame(f) is memo:
            return " of ".join(parts or ["a value"]) + f" in {code.co_qualname}()"
        f = f.f_back
    return " of ".join(parts or ["a value"])


def _check_array(value: Any, origin_type: Any, args: tuple, memo: TypeCheckMemo) -> None:
    spec = origin_type.spec
    if spec is None:
        # A bare dtype class such as `f32`: check dtype only.
        import numpy as np

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
            describe=functools.partial(_describe, memo),
        )
    except TypeCheckError as e:
        raise _with_owner(e, memo) from None


def _check_fields(value: Any, cls: type, memo: TypeCheckMemo, prefix=None) -> None:
    if not isinstance(value, cls):
        raise TypeCheckError(f"is not an instance of {cls.__qualname__}")
    for name, ft in field_types(cls):
        t = stacked(prefix, ft) if prefix is not None else ft
        try:
            typeguard.check_type_internal(getattr(value, name), t, memo)
        except TypeCheckError as e:
            e.append_path_element(f'field "{name}"')
            raise


def _check_dataclass(value: Any, origin_type: Any, args: tuple, memo: TypeCheckMemo) -> None:
    _check_fields(value, origin_type, memo)


def _check_stacked(value: Any, origin_type: Any, args: tuple, memo: TypeCheckMemo) -> None:
    _check_fields(value, origin_type.inner, memo, origin_type.prefix)


def _lookup(origin_type: Any, args: tuple, extras: tuple):
    if isinstance(origin_type, type):
        if issubclass(origin_type, ArrayType):
            return _check_array
        if issubclass(origin_type, StackedType):
            return _check_stacked
        if is_pytree_dataclass(origin_type):
            return _check_dataclass
    return None


def register_with_typeguard() -> None:
    """Teach typeguard to check shardlib annotations (idempotent).

    After this, ``@typeguard.typechecked`` functions check ``f32['batch/d len']`` arguments
    and return values (dtype, shape, bindings, sharding), pytree dataclasses field by field,
    and ``Array['layers', T]``.

    Examples:
        >>> register_with_typeguard()
        >>> @typechecked
        ... def f(x: f32[b'batch len']) -> f32[b'batch']: return x.sum(1)
    """
    if _lookup not in typeguard.checker_lookup_functions:
        typeguard.checker_lookup_functions.insert(0, _lookup)
