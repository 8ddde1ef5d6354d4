"""Pending reductions: a value that still owes a sum over some mesh axes.

``einsum_unreduced`` with a sharded contracted dim and ``index_unreduced`` with a sharded
table return each device's *partial sum*; the true value is the sum over some mesh axes.
shardlib returns such a value wrapped in `Unreduced`, which remembers the axes and
where it was made. Reductions (``psum``, ``psum_scatter``, ``pmean``) over those axes give
back a plain array; linear operations keep the wrapper; anything else fails at trace time
with a message naming the op that created it, instead of silently computing a wrong answer.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from typeguard import TypeCheckError

__all__ = [
    "PendingReductionError",
    "Unreduced",
    "assume_reduced",
    "caller_location",
    "linear",
    "pending_axes",
]

_HERE = os.path.dirname(__file__)


class PendingReductionError(TypeCheckError, TypeError):
    """A value that still owes a reduction (a partial sum) was used as if it were reduced."""

    __module__ = "shardlib.shardops"


def caller_location() -> str:
    """``file.py:LINE`` of the innermost frame outside shardlib."""
    f = sys._getframe(1)
    while f is not None and f.f_code.co_filename.startswith(_HERE):
        f = f.f_back
    if f is None:
        return "<unknown>"
    return f"{os.path.basename(f.f_code.co_filename)}:{f.f_lineno}"


def _axes_text(axes: tuple[str, ...]) -> str:
    return ", ".join(repr(a) for a in axes)


# Python and JAX name the *type* of a value they cannot use ("got <class '...'>" in
# jnp.where, jax.nn.relu, lax primitives, lax.scan, jax.checkpoint, jit arguments) and not its
# repr. So each pending sum gets a subclass of Unreduced whose name says what is pending and
# where it was made: whichever JAX error it meets then names the op that created it. One
# class per (axes, origin), cached; ``isinstance(x, Unreduced)`` holds for all of them.
_CLASSES: dict[tuple[tuple[str, ...], str], type] = {}
_CLASSES_MAX = 4096


def _class_for(axes: tuple[str, ...], origin: str) -> type:
    key = (axes, origin)
    cls = _CLASSES.get(key)
    if cls is None:
        if len(_CLASSES) >= _CLASSES_MAX:
            _CLASSES.clear()
        name = f"Unreduced[pending sum over {_axes_text(axes)} from {origin}]"
        cls = type(name, (Unreduced,), {"__slots__": (), "__module__": Unreduced.__module__})
        cls.__qualname__ = name
        _CLASSES[key] = cls
    return cls


class Unreduced:
    """A per-device partial sum: the real value is the sum of ``value`` over ``axes``.

    Not a JAX type: pass it to ``shardops.psum``/``psum_scatter`` (over ``axes``) to get an
    array. Linear operations keep the pending axes: ``+``/``-`` with another ``Unreduced``
    over the same axes, negation, multiplication or division by a value that is not
    pending, ``astype``, ``reshape``, ``transpose``/``.T``, indexing, ``sum``, and
    ``shardops.linear(fn, x)`` for any other linear ``fn``.

    Its type prints as ``Unreduced[pending sum over 't' from OP('SPEC') at FILE:LINE]``, so
    JAX's own errors (``jax.nn.relu(x)``, ``lax.scan`` carries) name where it was made.
    """

    __slots__ = ("axes", "origin", "value")
    __module__ = "shardlib.shardops"  # where users meet it (and what JAX's errors will print)
    __array_ufunc__ = None  # NumPy binary ops defer to ours (np.float32(2) * x is scaling)

    def __new__(cls, value: Any, axes: tuple[str, ...], origin: str) -> Unreduced:
        return object.__new__(_class_for(tuple(axes), origin))

    def __init__(self, value: Any, axes: tuple[str, ...], origin: str):
        self.value = value
        self.axes = tuple(axes)
        self.origin = origin

    def __reduce__(self) -> Any:  # copy.copy / pickle: rebuild through Unreduced
        return (Unreduced, (self.value, self.axes, self.origin))

    # -- what it looks like -------------------------------------------------------------
    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.value.shape)

    @property
    def dtype(self) -> Any:
        return self.value.dtype

    @property
    def ndim(self) -> int:
        return len(self.value.shape)

    def describe(self) -> str:
        return (
            f"a partial sum still owing a reduction over mesh "
            f"{'axes' if len(self.axes) > 1 else 'axis'} {_axes_text(self.axes)} "
            f"(made by {self.origin})"
        )

    def __repr__(self) -> str:
        return (
            f"Unreduced(pending sum over {_axes_text(self.axes)} from {self.origin}; reduce it "
            f"with shardops.psum/psum_scatter before using it, shape={self.shape}, "
            f"dtype={np.dtype(self.dtype).name})"
        )

    # -- refusing non-linear use ----------------------------------------------------------
    def _refuse(self, what: str, hint: str | None = None) -> PendingReductionError:
        return PendingReductionError(
            f"{what}: the value is {self.describe()}. "
            + (
                hint
                or f"Reduce it first (shardops.psum(spec, x, axes={'/'.join(self.axes)!r}) or "
                "psum_scatter), or, if the operation is linear, apply it with "
                "shardops.linear(fn, x)"
            )
        )

    def __array__(self, *args: Any, **kwargs: Any) -> Any:
        raise self._refuse("converted to an array (np.asarray or jnp.asarray)")

    def __bool__(self) -> bool:
        raise self._refuse("used as a Python bool")

    def __float__(self) -> float:
        raise self._refuse("used as a Python float")

    def __int__(self) -> int:
        raise self._refuse("used as a Python int")

    __hash__ = None  # type: ignore[assignment]

    def _compare(self, op: str) -> PendingReductionError:
        return self._refuse(
            f"compared with {op}",
            "Comparing a partial sum compares one device's share, not the value. Reduce "
            f"it first (shardops.psum(spec, x, axes={'/'.join(self.axes)!r}))",
        )

    def __lt__(self, other: Any) -> Any:
        raise self._compare("<")

    def __le__(self, other: Any) -> Any:
        raise self._compare("<=")

    def __gt__(self, other: Any) -> Any:
        raise self._compare(">")

    def __ge__(self, other: Any) -> Any:
        raise self._compare(">=")

    def __eq__(self, other: Any) -> Any:  # elementwise for arrays: refused like the others
        raise self._compare("==")

    def __ne__(self, other: Any) -> Any:
        raise self._compare("!=")

    def __abs__(self) -> Any:
        raise self._refuse("passed to abs()", "|x| of a partial sum is not linear. Reduce first.")

    def __getattr__(self, name: str) -> Any:
        # Only called for attributes Unreduced lacks (x.max(), x.mean(), x.clip(), ...).
        # Python cuts type names to 50 characters in its own message, so say it in full.
        if name.startswith("__") or name in Unreduced.__slots__:
            raise AttributeError(name)
        raise AttributeError(
            f"Unreduced has no attribute {name!r}: the value is {self.describe()}. Reduce it "
            f"first (shardops.psum(spec, x, axes={'/'.join(self.axes)!r})), or, if the "
            f"operation is linear, apply it with shardops.linear(lambda v: v.{name}(...), x)"
        )

    def __len__(self) -> int:
        return self.shape[0]

    def __iter__(self) -> Any:  # rows of a partial sum are partial sums
        return (self[i] for i in range(self.shape[0]))

    # -- linear operations --------------------------------------------------------------
    def _with(self, value: Any) -> Unreduced:
        return Unreduced(value, self.axes, self.origin)

    def _add(self, other: Any, sign: float, op: str, reverse: bool = False) -> Unreduced:
        if isinstance(other, Unreduced):
            if set(other.axes) != set(self.axes):
                raise self._refuse(
                    f"{op} with another partial sum, owing {_axes_text(other.axes)} (made by "
                    f"{other.origin})",
                    "Both operands must owe the same reduction. Reduce one of them first.",
                )
            a, b = (other.value, self.value) if reverse else (self.value, other.value)
            return Unreduced(a + b if sign > 0 else a - b, self.axes, self.origin)
        if type(other) in (int, float) and other == 0:  # 0 + x, so sum([x, y]) works
            return -self if reverse and sign < 0 else self
        ax = "/".join(self.axes)
        raise self._refuse(
            f"{op} with a value that is not a partial sum",
            f"Adding a reduced value to a partial sum adds it once per device of "
            f"{_axes_text(self.axes)}. Reduce first and add after, or add it on one device "
            f"only: shardops.linear(lambda v: v + b * (shardops.axis_index({ax!r}) == 0), x)",
        )

    def __add__(self, other: Any) -> Unreduced:
        return self._add(other, 1, "+")

    def __radd__(self, other: Any) -> Unreduced:
        return self._add(other, 1, "+", reverse=True)

    def __sub__(self, other: Any) -> Unreduced:
        return self._add(other, -1, "-")

    def __rsub__(self, other: Any) -> Unreduced:
        return self._add(other, -1, "-", reverse=True)

    def __neg__(self) -> Unreduced:
        return self._with(-self.value)

    def __pos__(self) -> Unreduced:
        return self

    def _scale(self, other: Any, op: str) -> Any:
        if isinstance(other, Unreduced):
            raise self._refuse(
                f"{op} of two partial sums",
                "The product of two partial sums is not a partial sum of the product. "
                "Reduce at least one of them first.",
            )
        return other

    def __mul__(self, other: Any) -> Unreduced:
        return self._with(self.value * self._scale(other, "*"))

    def __rmul__(self, other: Any) -> Unreduced:
        return self._with(self._scale(other, "*") * self.value)

    def __truediv__(self, other: Any) -> Unreduced:
        return self._with(self.value / self._scale(other, "/"))

    def __rtruediv__(self, other: Any) -> Unreduced:
        raise self._refuse("divided into", "1/x of a partial sum is not linear. Reduce first.")

    def __pow__(self, other: Any) -> Unreduced:
        raise self._refuse("raised to a power", "x**n of a partial sum is not linear.")

    def __matmul__(self, other: Any) -> Unreduced:
        return self._with(self.value @ self._scale(other, "@"))

    def __rmatmul__(self, other: Any) -> Unreduced:
        return self._with(self._scale(other, "@") @ self.value)

    def __getitem__(self, idx: Any) -> Unreduced:
        return self._with(self.value[idx])

    def astype(self, dtype: Any) -> Unreduced:
        return self._with(self.value.astype(dtype))

    def reshape(self, *shape: Any) -> Unreduced:
        return self._with(self.value.reshape(*shape))

    def transpose(self, *axes: Any) -> Unreduced:
        return self._with(self.value.transpose(*axes))

    @property
    def T(self) -> Unreduced:  # noqa: N802 - mirrors jax.Array.T
        return self._with(self.value.T)

    def sum(self, *args: Any, **kwargs: Any) -> Unreduced:
        return self._with(self.value.sum(*args, **kwargs))


def pending_axes(x: Any) -> tuple[str, ...]:
    """The mesh axes ``x`` still owes a reduction over (``()`` for an ordinary array).

    Examples:
        >>> y = shardops.einsum_unreduced('B/d F/t, F/t M -> B/d M', h, w)
        >>> shardops.pending_axes(y)
        ('t',)
    """
    return x.axes if isinstance(x, Unreduced) else ()


def linear(fn: Callable[..., Any], x: Any, *args: Any, **kwargs: Any) -> Any:
    """Apply ``fn`` (linear in ``x``) to a partial sum, keeping its pending axes.

    ``fn(x, *args, **kwargs)`` must be linear in ``x`` (scaling, casting, transposing,
    ``jnp.where(mask, x, 0)``, slicing, a sum over local dims...); the other arguments must
    not be partial sums. For an ordinary array this is just ``fn(x, ...)``.

    Examples:
        >>> y = shardops.einsum_unreduced('B/d F/t, F/t M -> B/d M', h, w)  # pending over t
        >>> y = shardops.linear(lambda v: jnp.where(mask, v, 0), y)          # still pending
        >>> y = shardops.psum('B/d M', y, axes='t')
    """
    for a in (*args, *kwargs.values()):
        if isinstance(a, Unreduced):
            raise a._refuse("passed as an extra argument to shardops.linear")
    if not isinstance(x, Unreduced):
        return fn(x, *args, **kwargs)
    out = fn(x.value, *args, **kwargs)
    if isinstance(out, Unreduced):  # fn itself used shardlib ops on the inner value
        out = out.value
    if not hasattr(out, "shape"):
        raise TypeError(
            f"shardops.linear: fn returned {type(out).__name__}, not an array; fn must map the "
            "partial sum to one array"
        )
    return Unreduced(out, x.axes, x.origin)


def assume_reduced(x: Any) -> Any:
    """Drop the pending axes of ``x`` without communicating (expert escape hatch).

    Use it when you know each device already holds the full sum (e.g. the axes have size 1 or
    you reduced by other means). For an ordinary array it returns ``x``.

    Examples:
        >>> y = shardops.assume_reduced(y)
    """
    return x.value if isinstance(x, Unreduced) else x


def unwrap(x: Any) -> tuple[Any, tuple[str, ...], str | None]:
    """``(array, pending axes, origin)`` of a possibly pending value."""
    if isinstance(x, Unreduced):
        return x.value, x.axes, x.origin
    return x, (), None


def is_array(x: Any) -> bool:
    return isinstance(x, jax.Array | np.ndarray) or hasattr(x, "shape")
