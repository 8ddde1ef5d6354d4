"""Which frame is the user's? The one module of shardlib that reads Python frames.

shardlib names the user's line in its errors: where a partial sum was made, where it was
misused. Two sources of that line: the live Python stack (at the moment an op runs) and the
traceback JAX records on each traced equation (when a traced body is analysed afterwards).
Both skip the frames of JAX, shardlib, typeguard and the standard library's plumbing. The
same test of a frame's file hides shardlib's frames from the tracebacks users see
(`hide_library_frames`), as JAX hides its own.

Three more questions need the live stack, and are answered here only:

- where the fallback below stops: at the frame of a wrapper that pushes a scope on every
  call (its code is registered with `pusher`, so the wrapper reads no frame), or at the
  frame that entered ``with Scope()`` (`caller_frame`);
- the names local to the scope that applied a decorator (`frame_locals`), for annotations
  that name them and that Python does not keep in the function's closure;
- for bare ``typeguard.typechecked`` functions, which have no entry/exit hook: the
  ``TypeCheckMemo`` of the innermost instrumented call (`find_memo`), and what typeguard is
  checking right now (`typeguard_site`). shardlib only walks for these once such a memo has
  been seen in the process (see `shardlib._check.scopes`).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Callable
from types import CodeType, FrameType
from typing import Any, TypeVar

import jax
import typeguard
from typeguard import TypeCheckMemo

__all__ = [
    "RAISED_BY_SHARDLIB",
    "caller_frame",
    "find_memo",
    "frame_locals",
    "is_library_file",
    "location_of_traceback",
    "name_stack_of",
    "pusher",
    "hide_library_frames",
    "raised_by_shardlib",
    "typeguard_site",
    "user_location",
    "user_stacklevel",
]

_SHARDLIB_DIR = os.path.dirname(os.path.dirname(__file__)) + os.sep  # shardlib/, not _env/
_TYPEGUARD_DIR = os.path.dirname(typeguard.__file__ or "") + os.sep
_LIBRARY_DIRS = (os.path.dirname(jax.__file__ or "") + os.sep, _SHARDLIB_DIR, _TYPEGUARD_DIR)
_EXTRA_DIRS: list[str] = []  # jax_extra, jaxlib, einops: found lazily (import order)
_PLUMBING = ("contextlib.py", "functools.py", "<frozen ")
_MAX_WALK = 1000  # frames; deeper stacks are cut off (the fallback then finds nothing)


def _library_dirs() -> tuple[str, ...]:
    if not _EXTRA_DIRS:
        for name in ("jax_extra", "jaxlib", "einops"):
            try:
                spec = importlib.util.find_spec(name)  # locates it without importing it
            except (ImportError, ValueError):
                spec = None
            if spec is not None and spec.origin:
                _EXTRA_DIRS.append(os.path.dirname(spec.origin) + os.sep)
    return _LIBRARY_DIRS + tuple(_EXTRA_DIRS)


def is_library_file(path: str) -> bool:
    """Whether ``path`` belongs to JAX, shardlib, jax_extra, typeguard, einops or Python's plumbing."""
    return path.startswith(_library_dirs()) or any(p in path for p in _PLUMBING)


def _short(path: str, line: int) -> str:
    return f"{os.path.basename(path)}:{line}"


def user_location(skip: int = 1) -> str:
    """``file.py:LINE`` of the innermost frame of the live stack outside the libraries."""
    f: FrameType | None = sys._getframe(skip)
    while f is not None and is_library_file(f.f_code.co_filename):
        f = f.f_back
    return "<unknown>" if f is None else _short(f.f_code.co_filename, f.f_lineno)


def user_stacklevel() -> int:
    """The ``stacklevel`` with which ``warnings.warn``, called by the function calling this
    one, names the innermost frame of the live stack outside the libraries (1: that
    function itself, where the whole stack is the libraries')."""
    f: FrameType | None = sys._getframe(1)
    level = 1
    while f is not None and is_library_file(f.f_code.co_filename):
        f, level = f.f_back, level + 1
    return 1 if f is None else level


def location_of_traceback(tb: Any) -> str | None:
    """``file.py:LINE`` of the innermost user frame of a traceback JAX recorded, or None.

    ``tb`` is ``eqn.source_info.traceback`` of a traced equation.
    """
    frames = getattr(tb, "frames", None)
    if not frames:
        return None
    for fr in frames:  # innermost first
        if not is_library_file(fr.file_name):
            return _short(fr.file_name, fr.line_num)
    return None


def name_stack_of(eqn: Any) -> str:
    """The named scopes (``jax.named_scope``) an equation was traced under, as ``a/b``."""
    return str(getattr(getattr(eqn, "source_info", None), "name_stack", "") or "")


def raised_by_shardlib(e: BaseException) -> bool:
    """Whether ``e`` was raised by shardlib's own code (not by JAX inside a shardlib call):
    its innermost frame is shardlib's, or was before `hide_library_frames` removed it."""
    answer = getattr(e, RAISED_BY_SHARDLIB, None)
    if answer is not None:
        return bool(answer)
    tb = e.__traceback__
    last = None
    while tb is not None:
        last = tb.tb_frame.f_code.co_filename
        tb = tb.tb_next
    return last is not None and last.startswith(_SHARDLIB_DIR)


# The attribute `hide_library_frames` leaves on an exception: whether shardlib raised it.
RAISED_BY_SHARDLIB = "__shardlib_raised__"


def hide_library_frames(e: BaseException) -> None:
    """Drop shardlib's own frames from ``e``'s traceback, as JAX drops its own.

    Called by a public entry point (``typed_shard_map``'s wrapper) on the exception path
    only, before it re-raises ``e`` with a bare ``raise`` (which adds no frame). Follows
    JAX's setting, read through the public ``jax.config``: ``JAX_TRACEBACK_FILTERING=off``
    keeps every frame; ``tracebackhide`` (and ``auto`` under IPython) marks shardlib's frames
    ``__tracebackhide__`` instead of removing them; otherwise they are removed. No JAX
    internals are used. Whether shardlib's own code raised ``e`` (its innermost frame) stays
    readable as the attribute ``RAISED_BY_SHARDLIB``.
    """
    import builtins
    import types

    mode = getattr(jax.config, "jax_traceback_filtering", "auto")
    if mode == "off" or e.__traceback__ is None:
        return
    entries = []
    tb = e.__traceback__
    while tb is not None:
        entries.append(tb)
        tb = tb.tb_next
    ours = [t.tb_frame.f_code.co_filename.startswith(_SHARDLIB_DIR) for t in entries]
    if not any(ours):
        return
    if not hasattr(e, RAISED_BY_SHARDLIB):  # the innermost entry point's answer is the true one
        setattr(e, RAISED_BY_SHARDLIB, ours[-1])
    if mode == "tracebackhide" or (mode in (None, "auto") and hasattr(builtins, "get_ipython")):
        for t, mine in zip(entries, ours, strict=True):
            if mine:
                t.tb_frame.f_locals["__tracebackhide__"] = True
        return
    kept = None
    for t, mine in zip(reversed(entries), reversed(ours), strict=True):
        if not mine:
            kept = types.TracebackType(kept, t.tb_frame, t.tb_lasti, t.tb_lineno)
    e.with_traceback(kept)


def caller_frame(depth: int = 1) -> FrameType:
    """The frame ``depth`` calls above the function calling this one (0: that function)."""
    return sys._getframe(depth + 1)


# Code objects of the wrappers that push a scope for each call (see `pusher`).
_PUSHERS: set[CodeType] = set()

_Fn = TypeVar("_Fn", bound=Callable[..., Any])


def pusher(fn: _Fn) -> _Fn:
    """Register ``fn`` as a wrapper that pushes a scope for each of its calls; returns it.

    `find_memo` stops at such a frame: the scope it pushed is the one in force below it.
    """
    _PUSHERS.add(fn.__code__)
    return fn


def frame_locals(frame: FrameType | None) -> dict[str, Any]:
    """A copy of the local names of ``frame`` ({} for None)."""
    return dict(frame.f_locals) if frame is not None else {}


# code object -> names of its local variables that may hold a TypeCheckMemo (() if none).
_memo_vars: dict[CodeType, tuple[str, ...]] = {}


def _memo_var_names(code: CodeType) -> tuple[str, ...]:
    names = _memo_vars.get(code)
    if names is None:
        # typeguard's own checking functions take a `memo` argument too, and so do
        # shardlib's checkers: only frames of user functions can own a call's memo.
        if code.co_filename.startswith((_TYPEGUARD_DIR, _SHARDLIB_DIR)):
            names = ()
        else:
            names = tuple(n for n in code.co_varnames if n.startswith("memo"))
        if len(_memo_vars) > 10_000:
            _memo_vars.clear()
        _memo_vars[code] = names
    return names


def _memo_in_frame(frame: FrameType) -> TypeCheckMemo | None:
    names = _memo_var_names(frame.f_code)
    if not names:
        return None
    loc = frame.f_locals
    for n in names:
        m = loc.get(n)
        if isinstance(m, TypeCheckMemo):
            return m
    return None


def find_memo(stop: FrameType | None, skip: int = 1) -> tuple[TypeCheckMemo, FrameType] | None:
    """The memo of the innermost typeguard-instrumented call on the stack, and its frame.

    Walks up from ``skip`` frames above the caller; gives up (None) on reaching ``stop``
    (the frame that entered the innermost ``with Scope()``) or the frame of a registered
    `pusher`: the context scope pushed there is then the one in force.
    """
    f: FrameType | None = sys._getframe(skip + 1)
    for _ in range(_MAX_WALK):
        if f is None or f is stop or f.f_code in _PUSHERS:
            return None
        memo = _memo_in_frame(f)
        if memo is not None:
            return memo, f
        f = f.f_back
    return None


_SITES = {
    "check_return_type_internal": "the return value",
    "check_variable_assignment": "an assigned value",
    "check_yield_type": "a yielded value",
    "check_send_type": "a sent value",
}


def typeguard_site(memo: TypeCheckMemo) -> tuple[str | None, str | None]:
    """``('argument "x"', 'f')``: what typeguard checks now for ``memo``'s call, and whose.

    For bare ``typeguard.typechecked`` functions only (shardlib's own checked calls carry
    both in their memo); either part is None when the stack does not say.
    """
    what: str | None = None
    f: FrameType | None = sys._getframe(1)
    for _ in range(_MAX_WALK):
        if f is None:
            break
        name = f.f_code.co_name
        if what is None and f.f_code.co_filename.startswith(_TYPEGUARD_DIR):
            if name == "check_argument_types_internal":
                what = f'argument "{f.f_locals.get("argname", "?")}"'
            else:
                what = _SITES.get(name)
        elif _memo_in_frame(f) is memo:
            return what, f.f_code.co_qualname
        f = f.f_back
    return what, None
