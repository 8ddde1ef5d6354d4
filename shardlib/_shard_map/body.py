"""The per-device body of a ``typed_shard_map``, with its result checked.

Each run of the body owns a fresh `Scope`, pushed by the wrapper here and popped when the
body returns. It starts with the names the global arguments bound (their per-device blocks
are what ``in_specs`` makes of checked global arguments); the ``shardops`` in the body and
the check of the result bind in it. Annotated local variables in the body are not checked (no
source is read): call ``shardtypes.check(dtype, spec, value)``, or decorate the body with
``typechecked``, to check them.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import jax
from typeguard import TypeCheckError

from .._analysis.notes import PendingReductionError
from .._check.checking import _describe_value, annotation_str, check_block
from .._check.pytree import flatten_to
from .._check.scopes import Scope, pop, push
from .._env import context as _context
from .._env import frames as _frames
from .plan import Leaf, Plan

__all__ = ["checked_body"]


def checked_body(f: Callable, plan: Plan) -> Callable:
    """``body(statics, bindings, *dynamic_values)``: ``f`` called with the static values (a
    dict by name) and the per-device blocks, its result checked against the plan's return
    annotation.

    Each call owns a fresh scope, pushed by this function, that starts with
    ``bindings``: the dim sizes the call's global arguments bound (the caller checked them,
    and each per-device block is the block of a checked global argument that ``in_specs``,
    made from the same annotations, gives this device, so the blocks are not checked again).
    The ``shardops`` in the body find the scope. Its ``__name__`` is ``f``'s, so JAX's own
    errors name the user's function; ``__wrapped__`` is ``f``. One frame between JAX and
    ``f``: few frames on the stack while the body is traced keep tracing cheap.
    """
    names = plan.dynamic_names
    positional = plan.positional_only
    name = plan.name

    @_frames.pusher
    def body(statics: dict[str, Any], bindings: dict[str, int], *dyn_vals: Any) -> Any:
        s = Scope(owner=name)
        s.bindings.update(bindings)
        token = push((s, None))
        try:
            kw = dict(statics)
            kw.update(zip(names, dyn_vals, strict=True))
            pos = [kw.pop(n) for n in positional]
            try:
                out = f(*pos, **kw)
            except TypeCheckError as e:  # e.g. from a shardops call: say whose body it was
                _name_function(e, plan.short_name, name)
                raise
            _check_tree(out, plan.out_flat, plan.out_treedef, s, "the return value", name)
        finally:
            pop(token)
        if plan.out_unreduced:
            out = _typed_unreduced(out, plan)
        return out

    body.__name__ = plan.short_name
    body.__qualname__ = name
    body.__wrapped__ = f  # type: ignore[attr-defined]
    # What JAX reads for argument names: the call's own parameters, not f's.
    body.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [
            inspect.Parameter("statics", inspect.Parameter.POSITIONAL_ONLY),
            inspect.Parameter("bindings", inspect.Parameter.POSITIONAL_ONLY),
            inspect.Parameter("args", inspect.Parameter.VAR_POSITIONAL),
        ]
    )
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


def _typed_unreduced(out: Any, plan: Plan) -> Any:
    """The outputs annotated unreduced (``{+t}``) cast to JAX's unreduced type over those
    axes, as ``jax.shard_map`` wants for an ``out_specs`` entry with ``unreduced`` (the
    analysis checks that each is a partial sum over exactly them)."""
    leaves = plan.out_treedef.flatten_up_to(out)
    cast = []
    for lf, v in zip(plan.out_flat, leaves, strict=True):
        axes = tuple(lf.spec.pending)
        if axes:
            vary = _context.varying_axes(v)
            if vary is None:  # check_vma off: no types to cast (the analysis still checks)
                cast.append(v)
                continue
            missing = tuple(a for a in axes if a not in vary)
            if missing:  # the same on every device of those axes: no partial sum over them
                raise PendingReductionError(
                    f"in {plan.name}(): the return value annotated {annotation_str(lf.dtype, lf.spec)} "
                    f"is the same on every device of mesh axes {list(missing)}, so it is not a "
                    "partial sum over them: whoever sums it would add the same value once per "
                    "device. Make it with a shardops op that leaves a partial sum over them "
                    "(shardops.einsum_unreduced), or remove them from the '{+...}' clause"
                )
            v = jax.lax.pcast(v, axes, to="unreduced")
        cast.append(v)
    return plan.out_treedef.unflatten(cast)


def _check_tree(
    value: Any, flat: tuple[Leaf, ...], treedef: Any, s: Scope, what: str, fname: str
) -> None:
    vals = flatten_to(
        treedef,
        value,
        lambda: (
            f"{what} of {fname}() does not have the annotated structure: expected "
            f"{_structure_text(flat, treedef)}, got {_describe_value(value)}"
        ),
    )
    where = f"{what} of {fname}()"
    manual = _context.manual_axis_items()  # read once for every leaf
    for lf, v in zip(flat, vals, strict=True):
        check_block(v, lf.spec, s, manual, where, lf.dtype)
