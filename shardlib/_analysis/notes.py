"""Pending reductions, as notes in the traced program.

``einsum_unreduced`` with a split contracted dim and ``index_unreduced`` with a split table
return each device's *partial sum*: an ordinary JAX array whose true value is its sum over
some mesh axes. shardlib does not wrap it. Instead it leaves a *note* in the traced program:
an identity primitive, ``shardlib_pending``, that carries what is pending and where it was
made (it lowers to nothing, so the compiled program is the hand-written one). After the body
of a ``typed_shard_map`` is traced, `shardlib._analysis.walk` follows every noted value through
the jaxpr and refuses the program if one reaches anything but a linear op or a reduction over
its axes (``lax.psum``/``psum_scatter``/``pmean`` or the ``shardops`` ones).

The notes come in six kinds:

- ``mark``: the value is a partial sum over ``axes`` (made by ``origin``);
- ``expect``: a ``{+t}`` clause in a shardops spec declares the value's pending axes;
- ``sum``: a ``shardops`` reduction sums the value over ``axes`` (checked for invariance);
- ``clear``: `assume_reduced` drops the pending axes;
- ``relink``: `linear` gives its result the pending axes of its input;
- ``same``: a layout op (``reshard``, ``repeat``...) keeps each device's slice over ``axes``,
  so its input must be the same on every device of them and not a partial sum over them.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir
from typeguard import TypeCheckError

__all__ = [
    "Note",
    "PendingReductionError",
    "assume_reduced",
    "linear",
    "note",
    "notes_on",
    "op_started",
    "pending_p",
    "record",
    "recording",
]


class PendingReductionError(TypeCheckError, TypeError):
    """A value that still owes a reduction (a partial sum) was used as if it were reduced."""

    __module__ = "shardlib.shardops"


@dataclass(frozen=True)
class Note:
    """What a ``shardlib_pending`` equation says (hashable: it is a primitive parameter).

    ``op``/``text``: the shardops call that left the note; ``origin``: ``OP('SPEC') at
    file.py:LINE`` for a ``mark``; ``part``/``role``/``pos``/``width``/``why`` place a
    ``{+t}`` clause for an ``expect`` error.
    """

    kind: str
    axes: tuple[str, ...] = ()
    op: str = ""
    text: str = ""
    origin: str = ""
    role: str = ""
    pos: int | None = None
    width: int = 1
    why: str = ""

    def __repr__(self) -> str:  # how it prints in a jaxpr
        axes = "+".join(self.axes)
        return f"{self.kind}{{+{axes}}}" if axes else self.kind


pending_p = Primitive("shardlib_pending")


def _identity(x: Any, *sources: Any, note: Note) -> Any:
    return x


pending_p.def_impl(_identity)
pending_p.def_abstract_eval(_identity)
mlir.register_lowering(pending_p, lambda ctx, x, *sources, note: [x])


def _jvp(primals: Any, tangents: Any, *, note: Note) -> tuple[Any, Any]:
    # The tangent of a partial sum is a partial sum over the same axes (the op that made it is
    # linear in it), so it carries the same note; the sources stay the primal ones.
    t = tangents[0]
    if type(t) is ad.Zero:
        return pending_p.bind(*primals, note=note), t
    return pending_p.bind(*primals, note=note), pending_p.bind(t, *primals[1:], note=note)


def _transpose(ct: Any, x: Any, *sources: Any, note: Note) -> list[Any]:
    # A cotangent is not a partial sum (reverse mode sums shares where the forward reduced):
    # the note's transpose passes it through and leaves no note.
    return [ct, *(None for _ in sources)]


def _batch(args: Any, dims: Any, *, note: Note) -> tuple[Any, Any]:
    return pending_p.bind(*args, note=note), dims[0]


ad.primitive_jvps[pending_p] = _jvp
ad.primitive_transposes[pending_p] = _transpose
batching.primitive_batchers[pending_p] = _batch


# Off while typed_shard_map traces a body the second time, for the program that runs.
_EMIT: contextvars.ContextVar[bool] = contextvars.ContextVar("shardlib_notes", default=True)


# The shardops calls a body makes, in order, while a typed_shard_map traces it: the analysed
# trace and the run trace must make the same ones (else the run is analysed again).
_OPS: contextvars.ContextVar[list[Any] | None] = contextvars.ContextVar(
    "shardlib_ops", default=None
)


def record(recipe: Any) -> None:
    """Note that the body being traced runs the shardops op of ``recipe``."""
    ops = _OPS.get()
    if ops is not None:
        ops.append(recipe)


def op_started(recipe: Any) -> bool:
    """`record` ``recipe``, then `notes_on`: the op skeleton's one call here per op."""
    ops = _OPS.get()
    if ops is not None:
        ops.append(recipe)
    return _EMIT.get()


def recording(notes: bool | None = None) -> _Recording:
    """``with recording() as ops:`` collects in the list ``ops`` the shardops ops traced
    inside (`record`); ``recording(notes=False)`` also traces without notes (the program is
    then exactly the one the user wrote).

    One context manager without a generator frame: it runs on every typed_shard_map call.
    """
    return _Recording(notes)


class _Recording:
    __slots__ = ("_notes", "_tokens")

    def __init__(self, notes: bool | None) -> None:
        self._notes = notes

    def __enter__(self) -> list[Any]:
        ops: list[Any] = []
        emit = None if self._notes is None else _EMIT.set(self._notes)
        self._tokens = (_OPS.set(ops), emit)
        return ops

    def __exit__(self, *exc: object) -> None:
        ops, emit = self._tokens
        _OPS.reset(ops)
        if emit is not None:
            _EMIT.reset(emit)


def note(x: Any, n: Note, *sources: Any) -> Any:
    """``x``, with the note ``n`` left in the traced program (unless notes are off)."""
    return pending_p.bind(x, *sources, note=n) if _EMIT.get() else x


def notes_on() -> bool:
    """Whether this trace is the analysis trace (notes are left in the program)."""
    return _EMIT.get()


_CLEAR = Note("clear", op="assume_reduced")
_RELINK = Note("relink", op="linear")


def linear(fn: Callable[..., Any], x: Any, *args: Any, **kwargs: Any) -> Any:
    """Apply ``fn``, linear in ``x``, to a possibly pending ``x``; the result owes what ``x`` owes.

    shardlib already knows the common linear operations (``+``, ``-``, scaling by a value
    that is the same on every device of the pending axes, casts between float types,
    reshapes, transposes, slices, sums over local dims, ``jnp.where(mask, x, 0)``...). Use
    ``linear`` for any other operation you know is linear in ``x``: shardlib trusts it and
    does not look inside. The other arguments must not be partial sums.

    Examples:
        >>> y = shardops.einsum_unreduced('B/d F/t, F/t M -> B/d M', h, w)  # pending over t
        >>> y = shardops.linear(jnp.fft.fft, y)                              # still pending
        >>> y = shardops.psum('B/d M', y, axes='t')
    """
    out = fn(note(x, _CLEAR), *args, **kwargs)
    if not hasattr(out, "shape"):
        raise TypeError(
            f"shardops.linear: fn returned {type(out).__name__}, not an array; fn must map the "
            "partial sum to one array"
        )
    return note(out, _RELINK, x)


def assume_reduced(x: Any) -> Any:
    """Drop the pending axes of ``x`` without communicating (expert escape hatch).

    Use it when you know each device already holds the full sum (the axes have size 1, or
    you reduced by other means). For a value that is not pending it changes nothing.

    Examples:
        >>> y = shardops.assume_reduced(y)
    """
    return note(x, _CLEAR)
