"""The rules the arguments of `shardlib.sampling.sample` keep, and the bytes of its exchange
(pure Python, no JAX).

`check_spec` parses and checks the logits' spec once per distinct text (cached);
`check_settings` checks and normalises the temperature, ``top_k`` and ``top_p``; the functions
named ``*_error`` return the message of a broken rule, or None. Every message names the
function, the argument, what was expected and what was given.
"""

from __future__ import annotations

import functools
import math
import numbers
import operator
from dataclasses import dataclass
from typing import Any

from .._lang.parsing import DimSpec, ShapeSpec, SpecError

__all__ = [
    "CheckedSample",
    "Settings",
    "check_settings",
    "check_spec",
    "exchange_width",
    "sample_bytes",
    "top_k_error",
]

FN = "sampling.sample"


@dataclass(frozen=True)
class CheckedSample:
    """The logits' spec, checked: ``'B/d V/t'`` (rows, then the vocabulary)."""

    spec: ShapeSpec

    @property
    def batch(self) -> DimSpec:
        """The rows' dim."""
        return self.spec.dims[0]

    @property
    def vocab(self) -> DimSpec:
        """The vocabulary's dim."""
        return self.spec.dims[1]

    @property
    def tokens_text(self) -> str:
        """The spec of the result, one token id per row: the rows' dim."""
        return str(self.batch)

    def exchange_text(self, n: int, width: int) -> str:
        """The spec of the exchange's ``psum``: ``(n, B, width)`` int32, one slot per device of
        the vocabulary's axes (literal sizes: no dim name of the caller's can clash)."""
        return f"{n} {self.batch} {width}"


@dataclass(frozen=True)
class Settings:
    """The sampler's settings, checked: ``temperature`` 0 is greedy; ``top_k`` None keeps
    every token; ``top_p`` None keeps every token (1.0 is normalised to None)."""

    temperature: float
    top_k: int | None
    top_p: float | None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def restricted(self, vocab: int) -> bool:
        """Whether the settings keep fewer than all ``vocab`` tokens (top-k below V or a
        nucleus): then the candidates are gathered, else one (score, id) per device is."""
        if self.greedy:
            return False
        return self.top_p is not None or (self.top_k is not None and self.top_k < vocab)


def _spec_error(text: str, message: str) -> SpecError:
    return SpecError(f"{FN}: argument `spec` {message}", text, 0, max(1, len(text)))


@functools.lru_cache(maxsize=256)
def check_spec(text: str, axis: tuple[str, ...] | None, inside: bool) -> CheckedSample:
    """Parse and check the logits' spec ``text`` (``'B/d V/t'``): two dims, no pending sums,
    the vocabulary split over exactly ``axis`` when given; outside a ``shard_map`` body
    (``inside`` False) no mesh axis at all. Raises `SpecError` naming the rule."""
    spec = ShapeSpec.parse(text)
    if len(spec.dims) != 2 or spec.pending or spec.reduced:
        raise _spec_error(
            text,
            f"must give the logits two dims, rows then the vocabulary ('B/d V/t'), with no "
            f"{{...}} clause; got {text!r} ({len(spec.dims)} dims)",
        )
    checked = CheckedSample(spec)
    if axis is not None and checked.vocab.sharding != axis:
        want = "/".join(axis) if axis else None
        fix = "/".join((str(checked.vocab.shape), *axis))
        raise _spec_error(
            text,
            f"must split the vocabulary dim over exactly argument `axis` ({want!r}); got "
            f"{str(checked.vocab)!r}: split it as {fix!r}, or drop `axis` (the spec says "
            "which axes split the vocabulary)",
        )
    if not inside and spec.mesh_axes():
        raise _spec_error(
            text,
            f"names mesh axes {spec.mesh_axes()!r}, but no mesh axis is manual here: outside a "
            "shard_map body the logits are the global array, spec 'B V'; or call "
            f"{FN} inside a typed_shard_map body",
        )
    return checked


def _real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def check_settings(temperature: Any, top_k: Any, top_p: Any) -> Settings:
    """The settings as plain Python numbers; ``ValueError`` naming the argument for a
    temperature that is not a finite real ``>= 0``, a ``top_k`` that is not an int ``>= 1``,
    a ``top_p`` outside ``(0, 1]``."""
    if not _real(temperature) or not math.isfinite(float(temperature)) or temperature < 0:
        raise ValueError(
            f"{FN}: argument `temperature` must be a finite number >= 0 (0: greedy) as a "
            f"Python or NumPy scalar; got {temperature!r}"
        )
    k = None
    if top_k is not None:
        if not isinstance(top_k, numbers.Integral) or isinstance(top_k, bool) or top_k < 1:
            raise ValueError(
                f"{FN}: argument `top_k` must be None or an int >= 1 (the tokens kept); got "
                f"{top_k!r}"
            )
        k = operator.index(top_k)
    p = None
    if top_p is not None:
        if not _real(top_p) or not 0.0 < float(top_p) <= 1.0:
            raise ValueError(
                f"{FN}: argument `top_p` must be None or a number in (0, 1] (the nucleus' "
                f"probability mass); got {top_p!r}"
            )
        p = None if float(top_p) == 1.0 else float(top_p)
    return Settings(float(temperature), k, p)


def top_k_error(top_k: int | None, vocab: int, checked: CheckedSample) -> str | None:
    """Why ``top_k`` cannot be kept from a vocabulary of ``vocab`` tokens, or None."""
    if top_k is None or top_k <= vocab:
        return None
    return (
        f"{FN}: argument `top_k` must be at most the vocabulary's size, dim "
        f"{str(checked.vocab)!r} = {vocab}; got {top_k}"
    )


def exchange_width(settings: Settings, vocab: int, n: int) -> int:
    """The int32 words per row that each of the ``n`` devices of the vocabulary's axes puts in
    the exchange (its local block holds ``vocab / n`` ids): 3 (its best score's bits, its id, a
    NaN flag) when nothing is restricted; ``2 k' + 1`` for its top ``k' = min(k, V/n)``
    candidates (``k = V`` for top-p alone); ``V/n + 1`` when they are its whole block (the ids
    are then implied)."""
    local = vocab // n
    if not settings.restricted(vocab):
        return 3
    k = min(settings.top_k or vocab, local)
    return local + 1 if k == local else 2 * k + 1


def sample_bytes(
    batch: int,
    vocab: int,
    n: int,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
) -> int:
    """Bytes one device sends in `shardlib.sampling.sample`'s one exchange: an all-reduce over
    the ``n`` devices of the vocabulary's axes of an ``(n, batch, width)`` int32 array
    (`exchange_width`), ``2 (n - 1) * batch * width * 4``; 0 when ``n`` is 1.

    **Arguments:** `batch` the rows per device; `vocab` the whole vocabulary ``V``; `n` the
    devices it is split over; the sampler's settings.

    Examples:
        >>> sample_bytes(8, 32000, 8)  # greedy: 3 words per row
        1344
        >>> sample_bytes(8, 32000, 8, temperature=0.7, top_k=50)
        45248
    """
    for arg, value in (("batch", batch), ("vocab", vocab), ("n", n)):
        if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 1:
            raise ValueError(
                f"sampling.sample_bytes: argument `{arg}` must be an int >= 1; got {value!r}"
            )
    if vocab % n:
        raise ValueError(
            f"sampling.sample_bytes: argument `vocab` must be divisible by `n` ({n}); got {vocab}"
        )
    settings = check_settings(temperature, top_k, top_p)
    return 2 * (n - 1) * batch * exchange_width(settings, vocab, n) * 4
