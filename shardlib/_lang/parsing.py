"""The shape-spec language: parsed nodes and a pure-Python parser (no JAX import).

A *shape spec* is a space-separated list of dims such as ``'batch/d len'``: each dim is a
size (a name that binds per scope, or a literal non-negative integer) followed by the mesh
axes it is split over, separated by ``/``. An *op spec* (used by ``shardops``, parsed by
`shardlib._lang.op_spec`) is one or more comma-separated shape specs, an arrow ``->`` and one
output shape spec.

Parsed nodes carry their spans, ``(start, end)`` offsets into the text they were parsed
from, so that later (semantic) errors put a caret under the dim or clause at fault.

Specs are ASCII. Parsing is cached: the same string is parsed once per process.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass, field

from .clauses import clause_partition_spec, parse_clause
from .fixes import bad_char, did_you_mean, empty_part

__all__ = [
    "DimSpec",
    "ShapeSpec",
    "Span",
    "SpecError",
    "as_str",
    "did_you_mean",
    "is_identifier",
    "is_int",
    "parse_annotation_spec",
]

# Characters that separate dims. Only ASCII whitespace: a non-ASCII space (say a no-break
# space pasted from a web page) is reported as an error rather than silently accepted.
_SPACES = frozenset(" \t\n\r\x0b\x0c")
# Characters a dim token may contain.
_TOKEN_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_/")

Span = tuple[int, int]  # (start, end) offsets of a node in the text it was parsed from


def _shown_width(text: str, quote: str) -> int:
    """How many columns ``text`` takes inside ``repr()`` of a string quoted with ``quote``."""
    width = 0
    for c in text:
        # repr() escapes the quote character only when it is the one delimiting the string.
        width += 2 if c == quote else len(repr(c)) - 2
    return width


class SpecError(ValueError):
    """A malformed shape spec or op spec.

    The message shows the spec with a caret under the fault and a hint on how to fix it::

        empty mesh axis between '/' and '/'
            'a//d'
               ^
        hint: remove the extra '/': did you mean 'a/d'?
    """

    __module__ = "shardlib"  # where users import it from (tracebacks print this path)

    def __init__(
        self,
        message: str,
        spec: str = "",
        pos: int | None = None,
        width: int = 1,
        hint: str | None = None,
    ):
        self.message = message
        self.spec = spec
        self.pos = pos
        self.width = max(1, width)
        self.hint = hint
        super().__init__(self._format())

    @classmethod
    def at(cls, message: str, spec: str, span: Span | None, hint: str | None = None) -> SpecError:
        """The error with a caret under ``span`` of ``spec`` (no caret when None)."""
        if span is None:
            return cls(message, spec, None, hint=hint)
        return cls(message, spec, span[0], span[1] - span[0], hint)

    def _format(self) -> str:
        lines = [self.message]
        if self.spec or self.pos is not None:
            shown = repr(self.spec)
            lines.append(f"    {shown}")
            if self.pos is not None:
                # The caret goes under the character as repr() shows it (a tab is '\t'):
                # four spaces of indent, the opening quote, then the escaped prefix.
                quote = shown[0]
                col = 5 + _shown_width(self.spec[: self.pos], quote)
                under = self.spec[self.pos : self.pos + self.width]
                lines.append(" " * col + "^" * max(1, _shown_width(under, quote)))
        if self.hint:
            lines.append(f"hint: {self.hint}")
        return "\n".join(lines)

    def with_context(self, context: str) -> SpecError:
        """The same error with ``context`` (e.g. the op name) prepended to the message."""
        return SpecError(f"{context}: {self.message}", self.spec, self.pos, self.width, self.hint)


@dataclass(frozen=True)
class DimSpec:
    """One dimension of a shape spec: its size (a name or an int) and its mesh axes.

    ``DimSpec.parse('batch/d/t')`` is ``DimSpec(shape='batch', sharding=('d', 't'))``.
    ``span`` (not compared) is where the dim was written, inside its brackets if any.
    """

    shape: str | int
    sharding: tuple[str, ...] = ()
    span: Span | None = field(default=None, compare=False, repr=False)

    @staticmethod
    def parse(text: str | bytes) -> DimSpec:
        spec = ShapeSpec.parse(text)
        if len(spec.dims) != 1:
            raise SpecError(
                f"expected exactly one dimension, got {len(spec.dims)}",
                as_str(text),
                0,
                max(1, len(as_str(text))),
            )
        return spec.dims[0]

    @property
    def is_literal(self) -> bool:
        return isinstance(self.shape, int)

    def __str__(self) -> str:
        return "/".join([str(self.shape), *self.sharding])


@dataclass(frozen=True)
class ShapeSpec:
    """A parsed shape spec: a tuple of `DimSpec`.

    ``span`` (the spec's text, spaces stripped) and ``pending_span`` (its ``{+t}`` clause)
    are where they were written; they are not compared. The clause names the mesh axes the
    value is *unreduced* over (``+t``: a partial sum, still owing a sum over ``t``) and those
    it is *reduced* over (``=t``: the same on every device of ``t``, its gradient left
    unreduced over ``t``): JAX's ``unreduced`` and ``reduced`` PartitionSpec fields.

    Examples:
        >>> ShapeSpec.parse('batch/d len').partition_spec()
        P('d', None)
    """

    dims: tuple[DimSpec, ...]
    # Mesh axes this value still owes a sum over (a partial sum), written '{+t}' / '{+t+d}'
    # after the dims; and the axes it is reduced over, '{=t}' (both: '{+t=d}').
    pending: tuple[str, ...] = ()
    reduced: tuple[str, ...] = ()
    span: Span | None = field(default=None, compare=False, repr=False)
    pending_span: Span | None = field(default=None, compare=False, repr=False)

    @staticmethod
    def parse(spec: str | bytes | ShapeSpec) -> ShapeSpec:
        """Parse ``spec`` (``str`` or ``bytes``); raises `SpecError` when malformed.

        An already parsed ``ShapeSpec`` is returned as is.
        """
        if isinstance(spec, ShapeSpec):
            return spec
        return _parse_shape_cached(as_str(spec))

    def __str__(self) -> str:
        dims = " ".join(str(d) for d in self.dims)
        if not self.pending and not self.reduced:
            return dims
        clause = "{" + "".join("+" + a for a in self.pending)
        clause += "".join("=" + a for a in self.reduced) + "}"
        return f"{dims} {clause}" if dims else clause

    def without_pending(self) -> ShapeSpec:
        if not self.pending and not self.reduced:
            return self
        return ShapeSpec(self.dims, span=self.span)

    def __len__(self) -> int:
        return len(self.dims)

    def mesh_axes(self) -> tuple[str, ...]:
        """Every mesh axis the spec shards over, in order of appearance."""
        return tuple(a for d in self.dims for a in d.sharding)

    def partition_spec(self):
        """The ``jax.sharding.PartitionSpec`` of this spec (imports JAX lazily), with the
        clause's axes as its ``unreduced`` and ``reduced`` fields."""
        from jax.sharding import PartitionSpec

        if not self.pending and not self.reduced:
            return PartitionSpec(*self.partition_entries())
        return clause_partition_spec(PartitionSpec, self, SpecError)

    def partition_entries(self) -> tuple[None | str | tuple[str, ...], ...]:
        """The entries of the PartitionSpec without importing JAX."""
        out: list[None | str | tuple[str, ...]] = []
        for d in self.dims:
            if not d.sharding:
                out.append(None)
            elif len(d.sharding) == 1:
                out.append(d.sharding[0])
            else:
                out.append(d.sharding)
        return tuple(out)


def as_str(spec: str | bytes) -> str:
    if isinstance(spec, bytes):
        try:
            return spec.decode("ascii")
        except UnicodeDecodeError as e:
            raise SpecError(
                f"non-ASCII byte 0x{spec[e.start]:02x} in a bytes spec",
                spec.decode("ascii", errors="replace"),  # one U+FFFD per byte: same offsets
                e.start,
                1,
                hint="specs are ASCII: dim names and mesh axes are ASCII identifiers",
            ) from None
    if isinstance(spec, str):
        return spec
    raise TypeError(f"a shape spec must be str or bytes, got {type(spec).__name__}: {spec!r}")


def is_identifier(s: str) -> bool:
    return s.isidentifier() and s.isascii()


def is_int(s: str) -> bool:
    return s.isascii() and s.isdigit()


def strip_span(text: str, a: int, b: int) -> Span:
    """``(a, b)`` without the spaces at either end of ``text[a:b]``."""
    while a < b and text[a] in _SPACES:
        a += 1
    while b > a and text[b - 1] in _SPACES:
        b -= 1
    return a, b


def _tokens(text: str, start: int, end: int) -> Iterator[tuple[int, str]]:
    """``(offset, token)`` for each space-separated token of ``text[start:end]``."""
    i = start
    while i < end:
        if text[i] in _SPACES:
            i += 1
            continue
        tok_start = i
        while i < end and text[i] not in _SPACES:
            i += 1
        yield tok_start, text[tok_start:i]


def parse_dims(
    text: str, start: int, end: int, *, allow_brackets: bool, in_op_spec: bool = False
) -> tuple[ShapeSpec, int | None]:
    """Parse the dims (and a trailing ``{+axis}`` clause) in ``text[start:end]``.

    Returns the spec, its spans referring to ``text``, and the index of its bracketed dim
    (``[vocab/t]``, allowed by ``allow_brackets``) or None.
    """
    dims: list[DimSpec] = []
    bracketed: int | None = None
    seen_axes: dict[str, str] = {}
    pending: tuple[str, ...] = ()
    reduced: tuple[str, ...] = ()
    clause: Span | None = None
    for off, tok in _tokens(text, start, end):
        if clause is not None:
            raise SpecError(
                "the pending-reduction clause '{+axis}' must come after all dims",
                text,
                off,
                len(tok),
                hint="move the '{+...}' clause to the end of the spec",
            )
        if tok.startswith("{"):
            pending, reduced = parse_clause(text, tok, off, SpecError)
            clause = (off, off + len(tok))
            continue
        if allow_brackets and tok.startswith("["):
            _check_brackets(text, tok, off, twice=bracketed is not None)
            bracketed = len(dims)
            tok, off = tok[1:-1], off + 1
        dims.append(_parse_dim(text, tok, off, seen_axes, in_op_spec=in_op_spec))
    if clause is not None:
        # Checked after all dims: a pending axis cannot also split a dim.
        for a in pending + reduced:
            if a in seen_axes:
                raise SpecError(
                    f"mesh axis {a!r} both splits dim {seen_axes[a]!r} and is named in the "
                    "clause; a value cannot be split over an axis it is unreduced or reduced "
                    "over",
                    text,
                    clause[0],
                    1,
                    hint=f"remove {a!r} from the clause, or '/{a}' from the dim",
                )
    span = strip_span(text, start, end)
    spec = ShapeSpec(tuple(dims), pending, reduced, span=span, pending_span=clause)
    if in_op_spec:
        refuse_reduced(spec, text)
    return spec, bracketed


def refuse_reduced(spec: ShapeSpec, text: str) -> None:
    """A shardops spec names partial sums ('{+t}'); 'reduced' is a type for annotations."""
    if spec.reduced and spec.pending_span is not None:
        raise SpecError.at(
            f"a shardops spec cannot say a value is reduced ('{{={spec.reduced[0]}}}'): that is "
            "a type for annotations of typed_shard_map arguments",
            text,
            spec.pending_span,
            hint="remove the '=axis' part of the clause",
        )


def _check_brackets(text: str, tok: str, off: int, *, twice: bool) -> None:
    """A bracketed dim is one token ``[NAME/axis]``, not empty, and the only one."""
    if not tok.endswith("]") or len(tok) < 2:
        raise SpecError(
            "unclosed bracket: the looked-up dim must be written as one token '[NAME/axis]'",
            text,
            off,
            len(tok),
            hint="close the bracket right after the dim, with no spaces inside",
        )
    if len(tok) == 2:
        raise SpecError(
            "empty brackets: write the looked-up dim inside them",
            text,
            off,
            2,
            hint="e.g. '[vocab/t] d, batch -> batch d'",
        )
    if twice:
        raise SpecError(
            "more than one bracketed dim: index_unreduced looks up exactly one dim",
            text,
            off,
            len(tok),
            hint="bracket only the dim that the indices address",
        )


def _parse_dim(
    text: str, tok: str, off: int, seen_axes: dict[str, str], *, in_op_spec: bool
) -> DimSpec:
    for j, ch in enumerate(tok):
        if ch not in _TOKEN_CHARS:
            d = bad_char(text, tok, off, j, in_op_spec=in_op_spec)
            raise SpecError(d.message, text, d.pos, d.width, d.hint)
    parts = tok.split("/")
    starts = [off]
    for p in parts[:-1]:
        starts.append(starts[-1] + len(p) + 1)
    for p, ppos in zip(parts, starts, strict=True):
        if p == "":
            d = empty_part(text, tok, off, parts, ppos)
            raise SpecError(d.message, text, d.pos, d.width, d.hint)
    size_text = parts[0]
    size: str | int
    if is_int(size_text):
        size = int(size_text)
    elif is_identifier(size_text):
        size = size_text
    else:
        raise SpecError(
            f"invalid dim size {size_text!r}: a dim size is a Python identifier or a "
            "non-negative integer",
            text,
            off,
            len(size_text),
            hint="names start with a letter or '_' (e.g. 'len2', not '2len')",
        )
    axes = parts[1:]
    for a, apos in zip(axes, starts[1:], strict=True):
        if not is_identifier(a):
            raise SpecError(
                f"invalid mesh axis name {a!r}: mesh axes are Python identifiers",
                text,
                apos,
                len(a),
                hint="write the mesh axis name as given to the Mesh, e.g. 'batch/d'",
            )
        if a in seen_axes:
            raise SpecError(
                f"mesh axis {a!r} is used twice: an axis can shard at most one dim, once",
                text,
                apos,
                len(a),
                hint=f"remove one of the two '/{a}' (first used by dim {seen_axes[a]!r})",
            )
        seen_axes[a] = tok
    return DimSpec(size, tuple(axes), span=(off, off + len(tok)))


@functools.lru_cache(maxsize=4096)
def _parse_shape_cached(text: str) -> ShapeSpec:
    if "->" in text:
        pos = text.index("->")
        raise SpecError(
            "an arrow '->' is not allowed in a shape spec",
            text,
            pos,
            2,
            hint="arrows belong in shardops op specs such as 'a/d b -> a b'",
        )
    return parse_dims(text, 0, len(text), allow_brackets=False)[0]


def parse_annotation_spec(spec: str | bytes | ShapeSpec, *, what: str) -> ShapeSpec:
    """Parse the spec of an array annotation ``what`` (``f32[...]``). Its clause, if any,
    is the value's JAX type: ``{+t}`` an unreduced value (a partial sum over ``t``), ``{=t}``
    a reduced one."""
    del what  # every spec is a valid annotation now; kept for the callers' messages
    return ShapeSpec.parse(spec)
