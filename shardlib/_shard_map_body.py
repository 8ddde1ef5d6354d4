"""The per-device body of a ``typed_shard_map``, with its arguments and result checked.

Each run of the body owns a fresh `Scope`, pushed by the wrapper here and popped when the
body returns: the per-device checks of the arguments and the result bind in it, and so do
the ``shardops`` in the body. Annotated local variables in the body are not checked (no
source is read): call ``shardtypes.check(dtype, spec, value)``, or decorate the body with
``typechecked``, to check them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from typeguard import TypeCheckError

from . import _frames
from ._checking import _describe_value, annotation_str, check_value
from ._scopes import Scope, pop, push
from ._shard_map_plan import Leaf, Plan

__all__ = ["checked_body"]


def checked_body(f: Callable, plan: Plan) -> Callable:
    """``f``, checking its arguments and result against the plan's annotations on every call.

    All checks of one call share one fresh scope, pushed in this wrapper's frame; the
    ``shardops`` in the body find it.
    """
    sig = plan.signature
    dynamic = plan.dynamic
    name = plan.name

    @functools.wraps(f)
    def body(*args: Any, **kwargs: Any) -> Any:
        bound = sig.bind(*args, **kwargs)
        s = Scope(owner=name)
        token = push(s, _frames.caller_frame(0))
        try:
            for p in dynamic:
                what = f"argument {p.name!r}"
                _check_tree(bound.arguments[p.name], p.flat, p.treedef, s, what, name)
            try:
                out = f(*args, **kwargs)
            except TypeCheckError as e:  # e.g. from a shardops call: say whose body it was
                _name_function(e, plan.short_name, name)
                raise
            _check_tree(out, plan.out_flat, plan.out_treedef, s, "the return value", name)
        finally:
            pop(token)
        return out

    return body


def _name_function(e: TypeCheckError, short_name: str, name: str) -> None:
    """Say in ``e``'s message that it was raised in the body of ``name``.

    An error from a shardops call gets the prefix ``in name(): ``. An error that already
    names where it happened (typeguard's ``argument "y" ...`` path, or ``in other(): ``
    from a checked function called in the body) keeps its start, which names the argument
    of *that* function, and gets a last line naming the body instead.
    """
    if f"{short_name}()" in str(e) or not e.args or not isinstance(e.args[0], str):
        return
    msg = e.args[0]
    if getattr(e, "_path", None) or msg.startswith("in "):
        e.args = (f"{msg}\n  (raised in the body of {name}())", *e.args[1:])
    else:
        e.args = (f"in {name}(): {msg}", *e.args[1:])


class _Shown:
    """A placeholder whose repr is the given text (to print a treedef with annotations)."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


def _structure_text(flat: tuple[Leaf, ...], treedef: Any) -> str:
    """The annotated structure, e.g. ``(f32['a/d'], f32['b'])``."""
    try:
        shown = [_Shown(annotation_str(lf.dtype, lf.spec)) for lf in flat]
        return repr(treedef.unflatten(shown))
    except Exception:  # a node type that will not hold placeholders: JAX's own text
        return str(treedef)


def _check_tree(
    value: Any, flat: tuple[Leaf, ...], treedef: Any, s: Scope, what: str, fname: str
) -> None:
    try:
        vals = treedef.flatten_up_to(value)
    except (ValueError, TypeError):
        raise TypeCheckError(
            f"{what} of {fname}() does not have the annotated structure: expected "
            f"{_structure_text(flat, treedef)}, got {_describe_value(value)}"
        ) from None
    for lf, v in zip(flat, vals, strict=True):
        check_value(v, lf.dtype, lf.spec, s, where=f"{what} of {fname}()")
