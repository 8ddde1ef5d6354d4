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

from .._check.checking import annotation_str, check_block
from .._check.format import describe_value
from .._check.pytree import flatten_to
from .._check.scopes import Scope, pop, push
from .._env import context as _context
from .._env import frames as _frames
from .._lang.parsing import ShapeSpec
from .signature import Leaf, ShardMapSignature

__all__ = ["checked_body"]


def checked_body(f: Callable, sig: ShardMapSignature) -> Callable:
    """``body(statics, bindings, *dynamic_values)``: ``f`` called with the static values (a
    dict by name) and the per-device blocks, its result checked against the signature's return
    annotation.

    Each call owns a fresh scope, pushed by this function, that starts with
    ``bindings``: the dim sizes the call's global arguments bound (the caller checked them,
    and each per-device block is the block of a checked global argument that ``in_specs``,
    made from the same annotations, gives this device, so the blocks are not checked again).
    The ``shardops`` in the body find the scope. Its ``__name__`` is ``f``'s, so JAX's own
    errors name the user's function; ``__wrapped__`` is ``f``. One frame between JAX and
    ``f``: few frames on the stack while the body is traced keep tracing cheap.
    """
    names = sig.dynamic_names
    positional = sig.positional_only
    name = sig.name

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
                _name_function(e, sig.short_name, name)
                raise
            _check_tree(out, sig.out_flat, sig.out_treedef, s, "the return value", name)
        finally:
            pop(token)
        if sig.out_typed:
            out = _typed_results(out, sig)
        return out

    body.__name__ = sig.short_name
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


def _typed_results(out: Any, sig: ShardMapSignature) -> Any:
    """The results as ``jax.shard_map`` wants them for their ``out_specs`` (with
    ``check_vma`` on): one typed reduced over an axis its annotation does not say is refused
    (`_refuse_reduced`); the outputs annotated unreduced (``{+t}``) are cast to JAX's
    unreduced type over those axes.

    A value JAX types unreduced over an axis already (an argument annotated ``{+t}``,
    returned as it is or through an op that keeps the type) is left as it is; one typed
    varying over it is cast; one typed neither (JAX's type says every device holds the same
    value: JAX drops the unreduced type through some linear ops, ``jnp.where`` with a
    constant mask) is cast through varying. Whether each is a partial sum over exactly those
    axes is the analysis's question (`shardlib._analysis.walk`), not the types': it refuses
    a value that is not, e.g. one already summed."""
    if not _context.vma_checked():  # check_vma off: no types (the analysis still checks)
        return out
    leaves = sig.out_treedef.flatten_up_to(out)
    cast = []
    for i, (lf, v) in enumerate(zip(sig.out_flat, leaves, strict=True)):
        aval = jax.typeof(v)
        _refuse_reduced(aval, lf, i, sig)
        axes = tuple(lf.spec.pending)
        if axes:
            vary = _context.aval_varying(aval) or frozenset()
            typed = _context.aval_unreduced(aval)
            same = tuple(a for a in axes if a not in vary and a not in typed)
            if same:  # typed the same on every device of them: varying first
                v = jax.lax.pcast(v, same, to="varying")
            todo = tuple(a for a in axes if a not in typed)
            if todo:
                v = jax.lax.pcast(v, todo, to="unreduced")
        cast.append(v)
    return sig.out_treedef.unflatten(cast)


def _refuse_reduced(aval: Any, lf: Leaf, i: int, sig: ShardMapSignature) -> None:
    """Refuse a return value JAX types reduced over a mesh axis (``{R:t}``, computed from an
    argument annotated ``{=t}``) whose annotation does not say ``=t``: JAX returns such a
    value only as reduced (its ``out_specs`` check reads it as an unproven replication)."""
    extra = sorted(_context.aval_reduced(aval) - frozenset(lf.spec.reduced))
    if not extra:
        return
    a = extra[0]
    what = "the return value" if len(sig.out_flat) == 1 else f"return leaf {i}"
    args = [
        f"argument {p.name!r}, annotated {annotation_str(arg.dtype, arg.spec)}"
        for p in sig.dynamic
        for arg in p.flat
        if a in arg.spec.reduced
    ]
    source = f" as computed from {' or '.join(args)}" if args else ""
    fix = f"drop '={a}' from the argument's annotation"
    if a not in lf.spec.mesh_axes() and a not in lf.spec.pending:
        said = ShapeSpec(lf.spec.dims, lf.spec.pending, (*lf.spec.reduced, a))
        fix = (
            f"annotate it {annotation_str(lf.dtype, said)} (the same on every device of {a!r}, "
            f"its gradient left unreduced there), or {fix}"
        )
    raise TypeCheckError(
        f"in {sig.name}(): {what} is typed reduced over mesh axis {a!r} by JAX ({{R:{a}}}"
        f"{source}), but its annotation {annotation_str(lf.dtype, lf.spec)} does not say "
        f"'={a}', and JAX returns a value typed reduced over {a!r} only as reduced; {fix}"
    )


def _check_tree(
    value: Any, flat: tuple[Leaf, ...], treedef: Any, s: Scope, what: str, fname: str
) -> None:
    vals = flatten_to(
        treedef,
        value,
        lambda: (
            f"{what} of {fname}() does not have the annotated structure: expected "
            f"{_structure_text(flat, treedef)}, got {describe_value(value)}"
        ),
    )
    where = f"{what} of {fname}()"
    manual = _context.manual_axis_items()  # read once for every leaf
    for lf, v in zip(flat, vals, strict=True):
        check_block(v, lf.spec, s, manual, where, lf.dtype)
