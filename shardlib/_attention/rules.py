"""The rules the arguments of context-parallel attention keep (no JAX).

The argument rules are plain functions of specs, names and sizes: `check_call` parses
and checks the spec once per distinct text (cached), `check_decode` the same for
`shardlib.attention.decode`'s (one query token per row against a cache), and the functions
named ``*_error`` return the message of a broken rule, or None. The arithmetic of the layouts is
`shardlib._attention.chunks`.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .._lang.fixes import did_you_mean, manual_axis_error
from .._lang.parsing import DimSpec, ShapeSpec, SpecError
from .chunks import LAYOUTS

__all__ = [
    "CheckedCall",
    "CheckedDecode",
    "axis_error",
    "heads_error",
    "heads_error_text",
    "check_call",
    "check_decode",
    "sequence_error",
    "ulysses_heads_error",
]

_ROLES = ("batch", "sequence", "heads", "head width")


@dataclass(frozen=True)
class CheckedCall:
    """One attention call's specs and settings, checked: q ``'B L/c H D'``, k/v ``'B L/c K D'``."""

    fn: str
    q: ShapeSpec
    kv: ShapeSpec
    axis: str
    layout: str
    causal: bool

    @property
    def q_heads(self) -> DimSpec:
        """q's heads dim."""
        return self.q.dims[2]

    @property
    def kv_heads(self) -> DimSpec:
        """k's and v's heads dim."""
        return self.kv.dims[2]

    @property
    def kv_text(self) -> str:
        """The spec of a K or V block (and of its gradient travelling with it)."""
        return str(self.kv)

    @property
    def ids_text(self) -> str:
        """The spec of a segment-id block: the batch and sequence dims of q."""
        return f"{self.q.dims[0]} {self.q.dims[1]}"

    @property
    def gathered_kv_text(self) -> str:
        """The all-gather spec of a K or V block: its sequence dim loses the ring axis."""
        b, s, k, d = self.kv.dims
        return f"{self.kv_text} -> {b} {s.shape} {k} {d}"


def _spec_error(fn: str, text: str, message: str, at: int = 0, width: int = 0) -> SpecError:
    return SpecError(f"{fn}: argument `spec` {message}", text, at, max(1, width or len(text)))


@functools.lru_cache(maxsize=256)
def check_call(fn: str, spec: str, axis: str, layout: str, causal: bool) -> CheckedCall:
    """Parse and check ``spec`` (``'B/d L/c H/t D'`` or ``'B/d L/c H/t D, B/d L/c K/t D'``:
    q's, then k's and v's) for attention over mesh ``axis``; raises `SpecError` or
    ``ValueError`` naming the rule."""
    if layout not in LAYOUTS:
        raise ValueError(
            f"{fn}: argument `layout` must be one of {', '.join(map(repr, LAYOUTS))}, got "
            f"{layout!r}{did_you_mean(str(layout), LAYOUTS)}"
        )
    parts = spec.split(",")
    if len(parts) > 2:
        raise _spec_error(
            fn, spec, "must be q's shape spec, optionally followed by ', ' and k's and v's"
        )
    q = ShapeSpec.parse(parts[0])
    kv = ShapeSpec.parse(parts[-1])
    for role, s in (("q", q), ("k and v", kv)):
        if len(s.dims) != 4 or s.pending:
            raise _spec_error(
                fn,
                spec,
                f"must give {role} four dims, batch sequence heads width ('B L/c H D'); got "
                f"{str(s)!r}",
            )
    for k in (0, 1, 3):
        if q.dims[k] != kv.dims[k]:
            raise _spec_error(
                fn,
                spec,
                f"gives q and k/v different {_ROLES[k]} dims: q {str(q.dims[k])!r}, k/v "
                f"{str(kv.dims[k])!r}; they must be the same dim with the same mesh axes",
            )
    if q.dims[2].sharding != kv.dims[2].sharding:
        raise _spec_error(
            fn,
            spec,
            f"splits the heads of q and k/v over different mesh axes: q {str(q.dims[2])!r}, k/v "
            f"{str(kv.dims[2])!r}; split both over the same axes (each device then holds the "
            "query heads of its own key/value heads)",
        )
    if q.dims[1].sharding != (axis,):
        raise _spec_error(
            fn,
            spec,
            f"must split the sequence dim over exactly argument `axis` {axis!r} (such as "
            f"'L/{axis}'); got {str(q.dims[1])!r}",
        )
    if q.dims[3].sharding:
        raise _spec_error(
            fn,
            spec,
            f"must not split the head width dim {str(q.dims[3])!r} (scores sum over it); "
            "split the heads instead",
        )
    h, kh = q.dims[2].shape, kv.dims[2].shape
    if isinstance(h, int) and isinstance(kh, int) and h % kh:
        raise _spec_error(fn, spec, heads_error_text(h, kh))
    return CheckedCall(fn, q, kv, axis, layout, bool(causal))


@dataclass(frozen=True)
class CheckedDecode:
    """One decode call's specs, checked: q ``'B H D'`` (one token per row), the cache's k/v
    ``'B S/c K D'``, and the mesh ``axis`` the cache's sequence is split over (None: not)."""

    fn: str
    q: ShapeSpec
    kv: ShapeSpec
    axis: str | None

    @property
    def q_heads(self) -> DimSpec:
        """q's heads dim."""
        return self.q.dims[1]

    @property
    def kv_heads(self) -> DimSpec:
        """The cache's heads dim."""
        return self.kv.dims[2]

    @property
    def lengths_text(self) -> str:
        """The spec of the per-row lengths: q's batch dim."""
        return str(self.q.dims[0])

    def combine_text(self, c: int, width: int) -> str:
        """The spec of the combine's ``psum``: the stacked ``(max, sum, weighted values)`` of
        each row and head, in one slot per device of ``axis``, ``(c, B, H, width)`` (literal
        sizes: no dim name of the caller's can clash)."""
        return f"{c} {self.q.dims[0]} {self.q.dims[1]} {width}"


@functools.lru_cache(maxsize=256)
def check_decode(fn: str, spec: str, axis: str | None) -> CheckedDecode:
    """Parse and check ``spec`` (``'B/d H/t D, B/d S/c K/t D'``: q's, then the cache's k's and
    v's) for decoding against a cache whose sequence is split over mesh ``axis`` (None: not
    split); raises `SpecError` naming the rule."""
    parts = spec.split(",")
    if len(parts) != 2:
        raise _spec_error(
            fn,
            spec,
            "must be q's shape spec, ', ' and the cache's (k's and v's), such as "
            "'B H D, B S/c K D'",
        )
    q, kv = ShapeSpec.parse(parts[0]), ShapeSpec.parse(parts[1])
    for role, s, n, example in (
        ("q", q, 3, "batch heads width ('B H D': one token per row)"),
        ("k and v", kv, 4, "batch sequence heads width ('B S/c K D')"),
    ):
        if len(s.dims) != n or s.pending:
            raise _spec_error(fn, spec, f"must give {role} {n} dims, {example}; got {str(s)!r}")
    for role, a, b in (("batch", q.dims[0], kv.dims[0]), ("head width", q.dims[2], kv.dims[3])):
        if a != b:
            raise _spec_error(
                fn,
                spec,
                f"gives q and k/v different {role} dims: q {str(a)!r}, k/v {str(b)!r}; they "
                "must be the same dim with the same mesh axes",
            )
    if q.dims[1].sharding != kv.dims[2].sharding:
        raise _spec_error(
            fn,
            spec,
            f"splits the heads of q and k/v over different mesh axes: q {str(q.dims[1])!r}, k/v "
            f"{str(kv.dims[2])!r}; split both over the same axes (each device then holds the "
            "query heads of its own key/value heads)",
        )
    seq = kv.dims[1]
    want = () if axis is None else (axis,)
    if seq.sharding != want:
        if axis is None:
            must = (
                f"must not split the cache's sequence dim when argument `axis` is None; got "
                f"{str(seq)!r}: pass axis={seq.sharding[-1]!r}"
                if len(seq.sharding) == 1
                else f"must not split the cache's sequence dim {str(seq)!r} over several axes"
            )
        else:
            must = (
                f"must split the cache's sequence dim over exactly argument `axis` {axis!r} "
                f"(such as 'S/{axis}'); got {str(seq)!r}"
            )
        raise _spec_error(fn, spec, must)
    if q.dims[2].sharding:
        raise _spec_error(
            fn,
            spec,
            f"must not split the head width dim {str(q.dims[2])!r} (scores sum over it); "
            "split the heads instead",
        )
    h, kh = q.dims[1].shape, kv.dims[2].shape
    if isinstance(h, int) and isinstance(kh, int) and h % kh:
        raise _spec_error(fn, spec, heads_error_text(h, kh))
    return CheckedDecode(fn, q, kv, axis)


def heads_error_text(h: int, k: int) -> str:
    return (
        f"needs the query heads H to be a multiple of the key/value heads K (each K head "
        f"serves H/K query heads); expected H divisible by K={k}, got H={h}"
    )


def axis_error(
    fn: str, axis: Any, manual: Mapping[str, int], mesh: Mapping[str, int]
) -> str | None:
    """Why ``axis`` cannot be the ring axis (it must be a manual mesh axis here), or None."""
    must = "name the mesh axis the sequence is split over, manual here"
    return manual_axis_error(fn, "axis", axis, manual, mesh, must=must, example="c")


def heads_error(
    fn: str, checked: CheckedCall | CheckedDecode, h_local: int, k_local: int, n: int
) -> str | None:
    """Why the per-device query heads ``h_local`` cannot be grouped over the key/value heads
    ``k_local`` (``n`` devices share the heads dim), or None."""
    if k_local and h_local % k_local == 0:
        return None
    h, k = checked.q_heads, checked.kv_heads
    return (
        f"{fn}: argument `q` dim {str(h)!r} (query heads) must be a multiple of argument `k` "
        f"dim {str(k)!r} (key/value heads): expected a multiple of {k_local * n}, got "
        f"{h_local * n} (per device {h_local} and {k_local})"
    )


def sequence_error(fn: str, checked: CheckedCall, local: int, c: int) -> str | None:
    """Why a per-device sequence block of ``local`` positions does not fit the layout."""
    if checked.layout != "balanced" or local % 2 == 0:
        return None
    seq = checked.q.dims[1]
    return (
        f"{fn}: argument `q` dim {str(seq)!r} (sequence) must be divisible by 2*c = {2 * c} in "
        f"the balanced layout (each device holds two chunks of L/(2c)); expected a multiple of "
        f"{2 * c}, got {local * c}; pad the sequence or use layout='contiguous'"
    )


def ulysses_heads_error(fn: str, checked: CheckedCall, h_local: int, c: int) -> str | None:
    """Why ``h_local`` query heads per device cannot be split over the ``c`` devices of the
    sequence axis (Ulysses gives each device ``h_local / c`` of them), or None."""
    if h_local % c == 0:
        return None
    h = checked.q.dims[2]
    return (
        f"{fn}: argument `q` dim {str(h)!r} (query heads) must be divisible by the {c} devices "
        f"of axis {checked.axis!r} (each device attends with H/c of the heads over the whole "
        f"sequence); expected a multiple of c={c} heads per device, got {h_local}; use "
        "attention.ring, which has no head constraint"
    )
