"""Dimension-name scopes: where a name such as ``batch`` is bound to a size.

The rule, in one sentence: a checked call owns a `Scope` that holds its bindings, pushed and
popped by the call's own wrapper; ``shardops`` and ``check`` read the current one.

* Each call of a ``shardlib.typechecked`` function, and each run of a ``typed_shard_map``
  body, pushes a fresh scope, shared by all annotations of that call and by the
  ``shardops`` run in it. ``with Scope():`` and ``@scope`` push an explicit fresh scope.
* The current scope lives in a `contextvars.ContextVar`, so threads and asyncio tasks each
  see their own, and a nested call's scope is popped when it returns.
* Outside all of them, each ``shardops`` call and each ``check`` gets a throwaway scope.

One fallback: bare ``typeguard.typechecked`` functions (seqax's spelling) have no entry or
exit hook; their bindings live in the call's ``TypeCheckMemo``. Once such a memo has been
seen in the process, finding the current scope also looks up the stack for the innermost
instrumented call, stopping at the frame that pushed the innermost context scope
(`shardlib._env.frames.find_memo`; wrappers that push are recognised by their code). Before
that, no frame is read.
"""

from __future__ import annotations

import contextvars
import functools
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any, TypeVar

import typeguard
from typeguard import CollectionCheckStrategy, TypeCheckConfiguration, TypeCheckMemo

from .._env import frames as _frames

__all__ = [
    "CallMemo",
    "Scope",
    "current_scope",
    "op_scope",
    "pop",
    "push",
    "scope",
    "scope_for_memo",
]

_F = TypeVar("_F", bound=Callable[..., Any])

_MEMO_KEY = "__shardlib_scope__"


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

    __slots__ = ("_tokens", "_walk", "bindings", "owner")

    def __init__(self, owner: str | None = None):
        self.bindings: dict[str, int] = {}
        self.owner = owner  # the function whose call this scope belongs to, for messages
        # One context token per active `with`: the same Scope may be re-entered. Made on
        # first entry: most scopes are pushed by a checked call, never entered.
        self._tokens: list[contextvars.Token] | None = None
        # The fallback's last walk from an op's caller while this scope was in force (see
        # `op_scope`): (context entry, the caller's frame, what the walk found).
        self._walk: tuple[Any, FrameType, Any] | None = None

    def __enter__(self) -> Scope:
        if self._tokens is None:
            self._tokens = []
        self._tokens.append(_CURRENT.set((self, _frames.caller_frame())))
        return self

    def __exit__(self, *exc: object) -> None:
        _CURRENT.reset(self._tokens.pop())  # type: ignore[union-attr]  # entered before

    def __repr__(self) -> str:
        return f"Scope({self.bindings})"

    def describe(self) -> str:
        if not self.bindings:
            return "no names bound yet"
        return ", ".join(f"{k}={v}" for k, v in self.bindings.items())


# The current scope, with the frame where the memo fallback stops (None: see `push`).
_CURRENT: contextvars.ContextVar[tuple[Scope, FrameType | None] | None] = contextvars.ContextVar(
    "shardlib_scope", default=None
)


# ``token = push((s, None))`` makes ``s`` the current scope, ``pop(token)`` undoes it: the
# context variable's own methods, with no Python frame of their own (they run on every
# checked call). The second item is the frame where the fallback's walk stops: None for a
# wrapper registered with `shardlib._env.frames.pusher` (the walk recognises its frame).
push = _CURRENT.set
pop = _CURRENT.reset


def scope(f: _F) -> _F:
    """Decorator: each call of ``f`` runs in a fresh `Scope`.

    Examples:
        >>> @scope
        ... def step(x): return shardops.all_gather('a/d -> a', x)
    """
    owner = getattr(f, "__qualname__", None)

    @functools.wraps(f)
    @_frames.pusher
    def wrapper(*args, **kwargs):
        token = push((Scope(owner), None))
        try:
            return f(*args, **kwargs)
        finally:
            pop(token)

    return wrapper  # type: ignore[return-value]


class _Fallback:
    """Whether a bare ``typeguard.typechecked`` call has bound a name in this process."""

    seen = False


def _in_force(start: int) -> Scope | None:
    """The innermost scope in force ``start`` frames above this function, or None."""
    entry = _CURRENT.get()
    if _Fallback.seen:
        found = _frames.find_memo(entry[1] if entry is not None else None, skip=start + 1)
        if found is not None:
            return _memo_scope(found[0])
    return entry[0] if entry is not None else None


def current_scope(start: int = 2) -> Scope:
    """The innermost scope in force for the caller; a throwaway scope when none is.

    ``start`` counts the frames above this function where the fallback's walk begins (2:
    the caller of the op that asks), as in earlier versions.
    """
    s = _in_force(start)
    return s if s is not None else Scope()


def op_scope() -> Scope:
    """`current_scope` for the op skeleton (`shardlib._ops.run.run`), whose caller is
    shardlib code (a ``shardops`` function, a layout op's step): a frame that holds no
    typeguard memo and is no wrapper that pushes a scope.

    Once the bare-typeguard fallback is on, an op walks the stack from its caller up to the
    innermost context scope, through every frame of JAX's tracer in between. The walk is
    remembered in that scope, by the context entry and the frame that called the op's caller
    (both held, so compared by identity): another op called from that frame while the same
    entry is in force finds the same memo, because the frames above it are suspended in
    their calls and an instrumented call binds its memo when it starts. (If the op's caller
    is the frame that entered the scope, the walk stops there at once, and only that frame's
    ops can find this entry with this caller.)
    """
    entry = _CURRENT.get()
    if not _Fallback.seen:
        return entry[0] if entry is not None else Scope()
    if entry is None:  # nowhere to remember the walk
        s = _in_force(2)
        return s if s is not None else Scope()
    s, stop = entry
    user = _frames.caller_frame(3)
    walk = s._walk
    if walk is not None and walk[0] is entry and walk[1] is user:
        found = walk[2]
    else:
        found = _frames.find_memo(stop, skip=2)
        s._walk = (entry, user, found)
    return _memo_scope(found[0]) if found is not None else s


class CallMemo(TypeCheckMemo):
    """The memo shardlib's own checked calls give typeguard: it carries the call's scope.

    ``what``/``owner`` name the value being checked and the function, for messages.
    """

    __slots__ = ("owner", "scope", "what")

    def __init__(self, globals_: dict[str, Any], s: Scope, what: str, owner: str) -> None:
        super().__init__(globals_, {}, config=_CONFIG)
        self.scope = s
        self.what = what
        self.owner = owner


_CONFIG = TypeCheckConfiguration(collection_check_strategy=CollectionCheckStrategy.ALL_ITEMS)
# (not typeguard's global one: see `is_bare_memo`; every item of a container is checked)
_last = threading.local()


def is_bare_memo(memo: TypeCheckMemo) -> bool:
    """Whether ``memo`` is the per-call memo of a typeguard-instrumented function.

    Instrumented code makes its memo with typeguard's global configuration and the
    function's ``locals()``; ``typeguard.check_type`` and shardlib make theirs otherwise.
    """
    return memo.config is typeguard.config and memo.locals is not memo.globals


def _memo_scope(memo: TypeCheckMemo) -> Scope:
    """The scope of a bare typeguard call, kept in its memo's ``locals`` (one per call)."""
    s = memo.locals.get(_MEMO_KEY)
    if s is None:
        s = memo.locals[_MEMO_KEY] = Scope()
        _Fallback.seen = True
    return s


def scope_for_memo(memo: TypeCheckMemo) -> Scope:
    """The scope a typeguard check made with ``memo`` binds its names in.

    shardlib's own memo carries its call's scope; a bare instrumented call has its own; a
    ``typeguard.check_type`` call uses the current scope, or one of its own when none is in
    force (so that the leaves of one checked value agree with each other).
    """
    if type(memo) is CallMemo:
        return memo.scope
    if is_bare_memo(memo):
        return _memo_scope(memo)
    s = _in_force(2)
    if s is not None:
        return s
    last = getattr(_last, "pair", None)
    if last is None or last[0] is not memo:
        last = _last.pair = (memo, Scope())
    return last[1]
