"""Dimension-name scopes: where a name such as ``batch`` is bound to a size.

Rules:

* Each call of a typechecked function (``typeguard.typechecked`` after
  ``register_with_typeguard()``, or the body of a ``typed_shard_map``) has its own fresh
  scope, shared by all annotations of that call and by the ``shardops`` run in its body.
* ``with Scope():`` and ``@scope`` open an explicit fresh scope.
* Outside both, each ``shardops`` call and each ``check`` gets a throwaway scope.

The scope of a typeguard-instrumented call lives in that call's ``TypeCheckMemo`` (in its
``locals`` dict, which lives exactly as long as the call). ``shardops`` find it by walking up
the Python stack to the nearest instrumented frame, so no global state leaks between calls
or threads.
"""

from __future__ import annotations

import contextvars
import functools
import os
import sys
import threading
from collections.abc import Callable
from types import CodeType, FrameType
from typing import Any, TypeVar

import typeguard
from typeguard import TypeCheckMemo

__all__ = ["Scope", "current_scope", "scope", "scope_for_memo"]

_F = TypeVar("_F", bound=Callable[..., Any])

_MEMO_KEY = "__shardlib_scope__"
_MAX_STACK_WALK = 1000
# typeguard's own checking functions take a `memo` argument too; they are not user calls.
# So are shardlib's own checkers: only frames of user functions can own a scope.
_NOT_USER_DIRS = (os.path.dirname(typeguard.__file__), os.path.dirname(__file__))


class Scope:
    """A fresh set of dimension-name bindings.

    Use as a context manager (``with Scope(): ...``) to give the code inside its own bindings.
    ``bindings`` maps dim names to global sizes.

    Examples:
        >>> with Scope() as s:
        ...     check(jnp.float32, 'batch', jnp.zeros(3))
        ...     s.bindings
        {'batch': 3}
    """

    __slots__ = ("bindings", "_entries", "owner")

    def __init__(self, owner: str | None = None):
        self.bindings: dict[str, int] = {}
        self.owner = owner  # the function whose call this scope belongs to, for messages
        # One (frame that entered, context token) per active `with`; a stack so that the
        # same Scope may be re-entered (e.g. a recursive @scope function).
        self._entries: list[tuple[FrameType, contextvars.Token]] = []

    @property
    def _frame(self) -> FrameType | None:
        return self._entries[-1][0] if self._entries else None

    def __enter__(self) -> Scope:
        self._entries.append((sys._getframe(1), _CURRENT.set(self)))
        return self

    def __exit__(self, *exc: object) -> None:
        _CURRENT.reset(self._entries.pop()[1])

    def __repr__(self) -> str:
        return f"Scope({self.bindings})"

    def describe(self) -> str:
        if not self.bindings:
            return "no names bound yet"
        return ", ".join(f"{k}={v}" for k, v in self.bindings.items())


_CURRENT: contextvars.ContextVar[Scope | None] = contextvars.ContextVar(
    "shardlib_scope", default=None
)


def scope(f: _F) -> _F:
    """Decorator: each call of ``f`` runs in a fresh `Scope`.

    Examples:
        >>> @scope
        ... def step(x): return shardops.all_gather('a/d -> a', x)
    """

    @functools.wraps(f)
    def wrapper(*args, **kwargs):
        with Scope(owner=getattr(f, "__qualname__", None)):
            return f(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


_module_level = threading.local()


def scope_for_memo(memo: TypeCheckMemo) -> Scope:
    """The scope of the instrumented call that owns ``memo`` (created on first use)."""
    loc = memo.locals
    if loc is memo.globals:
        # typeguard.check_type at module level: the "locals" are the module's globals, which
        # outlive any call; a binding stored there would leak into every later check. Give
        # the memo (one check_type call) a scope of its own instead.
        last = getattr(_module_level, "last", None)
        if last is None or last[0] is not memo:
            last = _module_level.last = (memo, Scope())
        return last[1]
    s = loc.get(_MEMO_KEY)
    if s is None:
        s = Scope()
        loc[_MEMO_KEY] = s
    return s


# code object -> names of its local variables that may hold a TypeCheckMemo (() if none).
_memo_vars: dict[CodeType, tuple[str, ...]] = {}


def _memo_var_names(code: CodeType) -> tuple[str, ...]:
    names = _memo_vars.get(code)
    if names is None:
        if code.co_filename.startswith(_NOT_USER_DIRS):
            names = ()
        else:
            names = tuple(n for n in code.co_varnames if n.startswith("memo"))
        if len(_memo_vars) > 10_000:
            _memo_vars.clear()
        _memo_vars[code] = names
    return names


def memo_in_frame(frame: FrameType) -> TypeCheckMemo | None:
    names = _memo_var_names(frame.f_code)
    if not names:
        return None
    loc = frame.f_locals
    for n in names:
        m = loc.get(n)
        if isinstance(m, TypeCheckMemo):
            return m
    return None


def find_memo_frame(memo: TypeCheckMemo, start: int = 2) -> FrameType | None:
    """The frame of the instrumented function that owns ``memo`` (for its name)."""
    f: FrameType | None = sys._getframe(start)
    for _ in range(64):
        if f is None:
            return None
        if memo_in_frame(f) is memo:
            return f
        f = f.f_back
    return None


def current_scope(start: int = 2) -> Scope:
    """The innermost scope in force for the caller: an instrumented call's or an explicit one.

    Returns a throwaway scope when none is in force.
    """
    explicit = _CURRENT.get()
    ef = explicit._frame if explicit is not None else None
    f: FrameType | None = sys._getframe(start)
    for _ in range(_MAX_STACK_WALK):
        if f is None:
            break
        if f is ef:
            return explicit  # type: ignore[return-value]
        memo = memo_in_frame(f)
        if memo is not None:
            s = scope_for_memo(memo)
            if s.owner is None:
                s.owner = f.f_code.co_qualname
            return s
        f = f.f_back
    return explicit if explicit is not None else Scope()
