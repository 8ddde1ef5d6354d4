"""Which frame is the user's? Source locations for messages.

shardlib names the user's line in its errors: where a partial sum was made, where it was
misused. Two sources of that line: the live Python stack (at the moment an op runs) and the
traceback JAX records on each traced equation (when a traced body is analysed afterwards).
Both skip the frames of JAX, shardlib, typeguard and the standard library's plumbing.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import jax

__all__ = [
    "is_library_file",
    "location_of_traceback",
    "name_stack_of",
    "raised_by_shardlib",
    "user_location",
]

_LIBRARY_DIRS = (
    os.path.dirname(jax.__file__ or "") + os.sep,
    os.path.dirname(__file__) + os.sep,  # shardlib
)
_EXTRA_DIRS: list[str] = []  # jax_extra, typeguard, jaxlib: added lazily (import order)
_PLUMBING = ("contextlib.py", "functools.py", "<frozen ")


def _library_dirs() -> tuple[str, ...]:
    if not _EXTRA_DIRS:
        for name in ("jax_extra", "typeguard", "jaxlib"):
            path = getattr(sys.modules.get(name), "__file__", None)
            if path:
                _EXTRA_DIRS.append(os.path.dirname(path) + os.sep)
    return _LIBRARY_DIRS + tuple(_EXTRA_DIRS)


def is_library_file(path: str) -> bool:
    """Whether ``path`` belongs to JAX, shardlib, jax_extra, typeguard or Python's plumbing."""
    return path.startswith(_library_dirs()) or any(p in path for p in _PLUMBING)


def _short(path: str, line: int) -> str:
    return f"{os.path.basename(path)}:{line}"


def user_location(skip: int = 1) -> str:
    """``file.py:LINE`` of the innermost frame of the live stack outside the libraries."""
    f = sys._getframe(skip)
    while f is not None and is_library_file(f.f_code.co_filename):
        f = f.f_back
    return "<unknown>" if f is None else _short(f.f_code.co_filename, f.f_lineno)


def location_of_traceback(tb: Any) -> str | None:
    """``file.py:LINE`` of the innermost user frame of a traceback JAX recorded, or None."""
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
    """Whether ``e`` was raised by shardlib's own code (not by JAX inside a shardlib call)."""
    tb = e.__traceback__
    last = None
    while tb is not None:
        last = tb.tb_frame.f_code.co_filename
        tb = tb.tb_next
    return last is not None and last.startswith(_LIBRARY_DIRS[1])
