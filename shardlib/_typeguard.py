"""typeguard integration: checkers for array types, pytree dataclasses and stacked types.

A check binds names in the scope `shardlib._scopes.scope_for_memo` gives for typeguard's
memo: the call's own scope for shardlib's checked calls and bare instrumented functions,
the current scope for ``typeguard.check_type``.
"""

from __future__ import annotations

import contextvars
from typing import Any

import numpy as np
import typeguard
from typeguard import TypeCheckError, TypeCheckMemo

from . import _frames
from ._checking import check_value
from ._pytree import StackedType, field_types, is_pytree_dataclass, stacked
from ._scopes import CallMemo, is_bare_memo, scope_for_memo
from ._types import ArrayType

__all__ = ["register_with_typeguard"]

# The dataclass fields being checked, innermost last (for messages raised after the fact).
_FIELDS: contextvars.ContextVar[tuple[str, ...]] = contextvars.ContextVar(
    "shardlib_fields", default=()
)


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
    parts = [f'field "{n}"' for n in reversed(_FIELDS.get())]
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


def _check_fields(value: Any, cls: type, memo: TypeCheckMemo, prefix=None) -> None:
    if not isinstance(value, cls):
        raise TypeCheckError(f"is not an instance of {cls.__qualname__}")
    outer = _FIELDS.get()
    for name, ft in field_types(cls):
        t = stacked(prefix, ft) if prefix is not None else ft
        token = _FIELDS.set((*outer, name))
        try:
            typeguard.check_type_internal(getattr(value, name), t, memo)
        except TypeCheckError as e:
            e.append_path_element(f'field "{name}"')
            raise
        finally:
            _FIELDS.reset(token)


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
