"""The named scopes shardlib runs its work under, written and read in one place (pure Python).

A ``shardops`` op, a pipeline schedule, an attention call and an MoE layer each run under a
``jax.named_scope`` whose text says what they are, and `shardlib.explain` reads that text back
from the equations' name stacks to group collectives, count bytes and report schedules. Each
kind is one frozen dataclass here: `text` writes its scope, `find` reads every scope of that
kind in a name stack (outermost first, each with its own text, so that a caller can tell an
enclosing scope from one an equation opens), `innermost` the last of them, and `present`
says whether a stack is inside one at all. The subsystems write with these classes and
`shardlib._explain` reads with them; no other module spells a scope's prefix or its pattern.

Formats (the texts are what profiles and compiled HLO metadata show):

- `OpScope`: ``shardops.OP[SPEC]``
- `ScheduleScope`: ``shardlib.pipeline.NAME[axis=A p=P m=M v=V res_bytes=N backward=K]``
  (``res_bytes`` and ``backward`` optional)
- `AttentionScope`: ``shardlib.attention.FN[axis=A c=C layout=L]`` (ring, gathered, ulysses,
  decode)
- `AttentionGridScope`: ``shardlib.attention.FN[ring=R ulysses=U]`` (2-D context parallelism)
- `MoeLayerScope`: ``shardlib.moe.layer[axis=A e=E_AXIS E=EXPERTS C=CAPACITY k=K M=WIDTH
  itemsize=BYTES]``
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields
from typing import ClassVar, TypeVar

__all__ = [
    "ATTENTION_PREFIX",
    "AttentionGridScope",
    "AttentionScope",
    "MoeLayerScope",
    "OpScope",
    "ScheduleScope",
    "ScopeKind",
]

ATTENTION_PREFIX = "shardlib.attention."

_S = TypeVar("_S", bound="ScopeKind")


class ScopeKind:
    """What every kind of scope shares: its prefix and pattern, and reading it back.

    A subclass is a frozen dataclass whose fields are the pattern's groups, in order;
    ``_INTS`` names the fields read as integers (``None`` where an optional group is absent).
    """

    PREFIX: ClassVar[str]
    _PATTERN: ClassVar[re.Pattern[str]]
    _INTS: ClassVar[frozenset[str]] = frozenset()

    def text(self) -> str:  # pragma: no cover - every kind defines it
        raise NotImplementedError

    @classmethod
    def find(cls: type[_S], stack: str) -> list[tuple[str, _S]]:
        """Every scope of this kind in the name stack ``stack``, outermost first, each with
        the text it matched."""
        return [(m.group(0), cls._of(m.groups())) for m in cls._PATTERN.finditer(stack)]

    @classmethod
    def innermost(cls: type[_S], stack: str) -> _S | None:
        """The innermost scope of this kind in ``stack`` (None: not inside one)."""
        found = cls.find(stack)
        return found[-1][1] if found else None

    @classmethod
    def present(cls, stack: str) -> bool:
        """Whether ``stack`` has this kind's prefix at all (a cheap test before `find`)."""
        return cls.PREFIX in stack

    @classmethod
    def _of(cls: type[_S], groups: tuple[str | None, ...]) -> _S:
        values = [
            (int(g) if g else None) if f.name in cls._INTS else g
            for f, g in zip(fields(cls), groups, strict=True)  # type: ignore[arg-type]
        ]
        return cls(*values)


@dataclass(frozen=True)
class OpScope(ScopeKind):
    """A ``shardops`` call: ``op`` (``"psum"``) and its ``spec`` as written."""

    op: str
    spec: str

    PREFIX: ClassVar[str] = "shardops."
    # The spec runs to the ``]`` that closes the scope's ``[``: a spec may hold bracketed
    # dims (``[L/c]``, one level), never a bracket inside those.
    _PATTERN: ClassVar[re.Pattern[str]] = re.compile(
        r"shardops\.(\w+)\[((?:[^\[\]]|\[[^\[\]]*\])*)\]"
    )

    def text(self) -> str:
        """The scope's text.

        Examples:
            >>> OpScope("psum", "B M").text()
            'shardops.psum[B M]'
            >>> OpScope.innermost("jit(f)/shardops.all_gather[B/d -> B]/transpose(jvp(x))")
            OpScope(op='all_gather', spec='B/d -> B')
        """
        return f"{self.PREFIX}{self.op}[{self.spec}]"


@dataclass(frozen=True)
class ScheduleScope(ScopeKind):
    """A pipeline schedule: its scope ``name`` (``"gpipe"``, ``"zb_h1"``), the stage
    ``axis``, ``p`` stages, ``m`` microbatches, ``v`` groups per stage; ``res_bytes`` (one
    residual slot's bytes per device) and ``backward`` (``"split"``/``"whole"``, ZB-H1 and
    ZB-V) where stated."""

    name: str
    axis: str
    p: int
    m: int
    v: int
    res_bytes: int | None = None
    backward: str | None = None

    PREFIX: ClassVar[str] = "shardlib.pipeline."
    _PATTERN: ClassVar[re.Pattern[str]] = re.compile(
        r"shardlib\.pipeline\.(\w+)\[axis=(\w+) p=(\d+) m=(\d+) v=(\d+)(?: res_bytes=(\d+))?"
        r"(?: backward=(split|whole))?\]"
    )
    _INTS: ClassVar[frozenset[str]] = frozenset({"p", "m", "v", "res_bytes"})

    def text(self) -> str:
        """The scope's text.

        Examples:
            >>> ScheduleScope("zb_h1", "p", 2, 4, 1, 640, "split").text()
            'shardlib.pipeline.zb_h1[axis=p p=2 m=4 v=1 res_bytes=640 backward=split]'
            >>> ScheduleScope.find("jit(f)/shardlib.pipeline.gpipe[axis=p p=2 m=4 v=1]/while")
            [('shardlib.pipeline.gpipe[axis=p p=2 m=4 v=1]', ScheduleScope(name='gpipe', axis='p', p=2, m=4, v=1, res_bytes=None, backward=None))]
        """  # noqa: E501
        tail = "" if self.res_bytes is None else f" res_bytes={self.res_bytes}"
        tail += "" if self.backward is None else f" backward={self.backward}"
        head = f"{self.PREFIX}{self.name}[axis={self.axis} p={self.p} m={self.m} v={self.v}"
        return f"{head}{tail}]"


@dataclass(frozen=True)
class AttentionScope(ScopeKind):
    """A context-parallel attention call: ``fn`` (``"ring"``, ``"gathered"``, ``"ulysses"``
    or ``"decode"``), its sequence ``axis`` of size ``c``, and the sequence ``layout``
    (``decode``'s cache: ``"contiguous"``)."""

    fn: str
    axis: str
    c: int
    layout: str

    PREFIX: ClassVar[str] = ATTENTION_PREFIX
    _PATTERN: ClassVar[re.Pattern[str]] = re.compile(
        r"shardlib\.attention\.(ring|gathered|ulysses|decode)\[axis=(\w+) c=(\d+) layout=(\w+)\]"
    )
    _INTS: ClassVar[frozenset[str]] = frozenset({"c"})

    def text(self) -> str:
        """The scope's text.

        Examples:
            >>> AttentionScope("ring", "c", 4, "balanced").text()
            'shardlib.attention.ring[axis=c c=4 layout=balanced]'
        """
        return f"{self.PREFIX}{self.fn}[axis={self.axis} c={self.c} layout={self.layout}]"


@dataclass(frozen=True)
class AttentionGridScope(ScopeKind):
    """2-D context parallelism: ``fn`` (``"ring_ulysses"``) over the ``ring`` and
    ``ulysses`` axes (its inner ring and Ulysses calls have their own `AttentionScope`)."""

    fn: str
    ring: str
    ulysses: str

    PREFIX: ClassVar[str] = ATTENTION_PREFIX
    _PATTERN: ClassVar[re.Pattern[str]] = re.compile(
        r"shardlib\.attention\.(\w+)\[ring=(\w+) ulysses=(\w+)\]"
    )

    def text(self) -> str:
        """The scope's text.

        Examples:
            >>> AttentionGridScope("ring_ulysses", "r", "u").text()
            'shardlib.attention.ring_ulysses[ring=r ulysses=u]'
        """
        return f"{self.PREFIX}{self.fn}[ring={self.ring} ulysses={self.ulysses}]"


@dataclass(frozen=True)
class MoeLayerScope(ScopeKind):
    """One MoE layer's dispatch (per device): the expert ``axis`` of size ``e``,
    ``experts`` (E), ``capacity`` (C, slots per expert per device), ``k`` experts per token,
    the token ``width`` (M) and the tokens' ``itemsize`` in bytes."""

    axis: str
    e: int
    experts: int
    capacity: int
    k: int
    width: int
    itemsize: int

    PREFIX: ClassVar[str] = "shardlib.moe.layer"
    _PATTERN: ClassVar[re.Pattern[str]] = re.compile(
        r"shardlib\.moe\.layer\[axis=(\w+) e=(\d+) E=(\d+) C=(\d+) k=(\d+) M=(\d+) "
        r"itemsize=(\d+)\]"
    )
    _INTS: ClassVar[frozenset[str]] = frozenset(
        {"e", "experts", "capacity", "k", "width", "itemsize"}
    )

    def text(self) -> str:
        """The scope's text.

        Examples:
            >>> MoeLayerScope("e", 4, 8, 20, 2, 64, 4).text()
            'shardlib.moe.layer[axis=e e=4 E=8 C=20 k=2 M=64 itemsize=4]'
        """
        return (
            f"{self.PREFIX}[axis={self.axis} e={self.e} E={self.experts} "
            f"C={self.capacity} k={self.k} M={self.width} itemsize={self.itemsize}]"
        )
