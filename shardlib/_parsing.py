"""The shape-spec language: a pure-Python parser (no JAX import).

A *shape spec* is a space-separated list of dims such as ``'batch/d len'``: each dim is a
size (a name that binds per scope, or a literal non-negative integer) followed by the mesh
axes it is split over, separated by ``/``. An *op spec* (used by ``shardops``) is one or
more comma-separated shape specs, an arrow ``->`` and one output shape spec.

Specs are ASCII. Parsing is cached: the same string is parsed once per process.
"""

from __future__ import annotations

import difflib
import functools
import unicodedata
from dataclasses import dataclass

__all__ = [
    "DimSpec",
    "OpSpec",
    "ShapeSpec",
    "SpecError",
    "parse_annotation_spec",
    "parse_op_spec",
]

# Characters that separate dims. Only ASCII whitespace: a non-ASCII space (say a no-break
# space pasted from a web page) is reported as an error rather than silently accepted.
_SPACES = frozenset(" \t\n\r\x0b\x0c")
# Characters a dim token may contain.
_TOKEN_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_/")


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
    """

    shape: str | int
    sharding: tuple[str, ...] = ()

    @staticmethod
    def parse(text: str | bytes) -> DimSpec:
        spec = ShapeSpec.parse(text)
        if len(spec.dims) != 1:
            raise SpecError(
                f"expected exactly one dimension, got {len(spec.dims)}",
                _as_str(text),
                0,
                max(1, len(_as_str(text))),
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

    Examples:
        >>> ShapeSpec.parse('batch/d len').partition_spec()
        P('d', None)
    """

    dims: tuple[DimSpec, ...]
    # Mesh axes this value still owes a sum over (a partial sum), written '{+t}' / '{+t+d}'
    # after the dims. Only shardops specs use it; annotations describe reduced values.
    pending: tuple[str, ...] = ()

    @staticmethod
    def parse(spec: str | bytes | ShapeSpec) -> ShapeSpec:
        """Parse ``spec`` (``str`` or ``bytes``); raises `SpecError` when malformed.

        An already parsed ``ShapeSpec`` is returned as is.
        """
        if isinstance(spec, ShapeSpec):
            return spec
        return _parse_shape_cached(_as_str(spec))

    def __str__(self) -> str:
        dims = " ".join(str(d) for d in self.dims)
        if not self.pending:
            return dims
        clause = "{" + "".join("+" + a for a in self.pending) + "}"
        return f"{dims} {clause}" if dims else clause

    def without_pending(self) -> ShapeSpec:
        return ShapeSpec(self.dims) if self.pending else self

    def __len__(self) -> int:
        return len(self.dims)

    def mesh_axes(self) -> tuple[str, ...]:
        """Every mesh axis the spec shards over, in order of appearance."""
        return tuple(a for d in self.dims for a in d.sharding)

    def partition_spec(self):
        """The ``jax.sharding.PartitionSpec`` of this spec (imports JAX lazily)."""
        from jax.sharding import PartitionSpec

        return PartitionSpec(*self.partition_entries())

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


@dataclass(frozen=True)
class OpSpec:
    """A parsed op spec ``'in0, in1 -> out'``.

    ``bracketed[i]`` is the index of the dim of input ``i`` written in ``[...]`` (used by
    ``index_unreduced``) or ``None``. ``str()`` gives the canonical form of the spec.
    """

    text: str
    inputs: tuple[ShapeSpec, ...]
    output: ShapeSpec
    bracketed: tuple[int | None, ...]
    # Character offsets of each dim in `text`, for carets in later (semantic) errors:
    # input_positions[i][j] is the offset of dim j of input i (inside its brackets, if any);
    # output_positions likewise.
    input_positions: tuple[tuple[int, ...], ...]
    output_positions: tuple[int, ...]
    # (start, end) offsets of each input's text and of the output's text, spaces stripped.
    input_spans: tuple[tuple[int, int], ...] = ()
    output_span: tuple[int, int] = (0, 0)

    def __str__(self) -> str:
        ins = []
        for s, b in zip(self.inputs, self.bracketed, strict=True):
            txt = " ".join(f"[{d}]" if j == b else str(d) for j, d in enumerate(s.dims))
            if s.pending:
                txt = f"{txt} {str(ShapeSpec((), s.pending))}".strip()
            ins.append(txt)
        return f"{', '.join(ins)} -> {self.output}"

    def error(
        self, message: str, *, operand: int | None, dim: int | None, hint: str | None = None
    ) -> SpecError:
        """A SpecError with a caret under dim ``dim`` of input ``operand`` (None: the output).

        With ``dim=None`` the caret underlines the whole operand (or the whole output).
        """
        if dim is None:
            start, end = self.output_span if operand is None else self.input_spans[operand]
            return SpecError(message, self.text, start, end - start, hint)
        positions = self.output_positions if operand is None else self.input_positions[operand]
        pos = positions[dim]
        end = pos
        while end < len(self.text) and self.text[end] in _TOKEN_CHARS:
            end += 1
        return SpecError(message, self.text, pos, end - pos, hint)

    def spec_error(self, message: str, *, hint: str | None = None) -> SpecError:
        """A SpecError about the spec as a whole (no caret)."""
        return SpecError(message, self.text, None, hint=hint)


def _as_str(spec: str | bytes) -> str:
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


_ARROW_HINT = "arrows '->' belong in shardops op specs such as 'a/d b -> a b', not in a shape spec"
_BRACKET_HINT = "brackets mark the looked-up dim in index_unreduced op specs only"
_PUNCT_HINTS = {
    ",": "separate dims with spaces, not commas (commas separate operands in shardops op specs)",
    ">": _ARROW_HINT,
    "[": _BRACKET_HINT,
    "]": _BRACKET_HINT,
    ".": "ellipses and dots are not supported; name every dim",
    "*": "write the size as a name or an integer; products are not supported",
    "(": "parentheses are not supported; name every dim",
    ")": "parentheses are not supported; name every dim",
    ":": "write 'name/axis' to shard a dim over a mesh axis",
    "@": "write 'name/axis' to shard a dim over a mesh axis",
}


def _is_arrow(ch: str) -> bool:
    """Whether ``ch`` is a non-ASCII arrow (``→``, ``⟶``, ``⇒``...), often pasted for '->'."""
    return not ch.isascii() and "ARROW" in unicodedata.name(ch, "")


def _ascii_arrows(text: str) -> str:
    """``text`` with every non-ASCII arrow replaced by ``->``."""
    return "".join("->" if _is_arrow(c) else c for c in text)


def _is_identifier(s: str) -> bool:
    return s.isidentifier() and s.isascii()


def _is_int(s: str) -> bool:
    return s.isascii() and s.isdigit()


def _fixed(text: str, tok: str, off: int, new_tok: str) -> str:
    """``text`` with the dim token ``tok`` at offset ``off`` replaced by ``new_tok``."""
    return text[:off] + new_tok + text[off + len(tok) :]


def _char_error(text: str, tok: str, off: int, j: int, *, in_op_spec: bool) -> SpecError:
    """The error for character ``tok[j]``, which cannot appear in a dim."""
    ch = tok[j]
    pos = off + j
    if not ch.isascii():
        name = unicodedata.name(ch, "")
        what = f"U+{ord(ch):04X}" + (f" {name}" if name else "")
        if ch.isspace():
            hint = "separate dims with ordinary ASCII spaces"
        elif _is_arrow(ch):
            hint = (
                f"write the arrow as ASCII '->': did you mean {_ascii_arrows(text)!r}?"
                if in_op_spec
                else _ARROW_HINT
            )
        else:
            hint = "specs are ASCII: dim names and mesh axes are ASCII identifiers"
        return SpecError(f"non-ASCII character {ch!r} ({what}) in dim {tok!r}", text, pos, 1, hint)
    if ch == "-":
        before = tok[j - 1] if j > 0 else ""
        after = tok[j + 1] if j + 1 < len(tok) else ""
        if j == 0 and after.isdigit():
            hint = "a dim size is a name or a non-negative integer"
        elif (before.isalnum() or before == "_") and (after.isalnum() or after == "_"):
            hint = (
                "'-' cannot appear in names: "
                f"did you mean {_fixed(text, tok, off, tok.replace('-', '_'))!r}?"
            )
        elif after in ("", ">"):
            hint = _ARROW_HINT
        else:
            hint = "'-' cannot appear in dims; dims are NAME or NAME/axis/axis"
    elif ch in ":@":
        hint = f"{_PUNCT_HINTS[ch]}: did you mean {_fixed(text, tok, off, tok.replace(ch, '/'))!r}?"
    elif ch == ",":
        hint = f"{_PUNCT_HINTS[ch]}: did you mean {' '.join(text.replace(',', ' ').split())!r}?"
    elif ch in "[]" and in_op_spec:
        hint = "only index_unreduced specs bracket a dim, written as one token: '[vocab/t]'"
    else:
        hint = _PUNCT_HINTS.get(ch, "dims are NAME or NAME/axis/axis, separated by spaces")
    return SpecError(f"unexpected character {ch!r} in dim {tok!r}", text, pos, 1, hint)


def _parse_dims(
    text: str, start: int, end: int, *, allow_brackets: bool, in_op_spec: bool = False
) -> tuple[list[DimSpec], list[int], int | None, tuple[str, ...]]:
    """Parse dims (and a trailing ``{+axis}`` clause) in ``text[start:end]``.

    Positions refer to ``text``.
    """
    dims: list[DimSpec] = []
    positions: list[int] = []
    bracketed: int | None = None
    seen_axes: dict[str, str] = {}
    pending: tuple[str, ...] | None = None
    i = start
    while i < end:
        if text[i] in _SPACES:
            i += 1
            continue
        tok_start = i
        while i < end and text[i] not in _SPACES:
            i += 1
        tok = text[tok_start:i]
        off = tok_start
        if pending is not None:
            raise SpecError(
                "the pending-reduction clause '{+axis}' must come after all dims",
                text,
                tok_start,
                len(tok),
                hint="move the '{+...}' clause to the end of the spec",
            )
        if tok.startswith("{"):
            pending = _parse_pending(text, tok, tok_start, seen_axes)
            continue
        if allow_brackets and tok.startswith("["):
            if not tok.endswith("]") or len(tok) < 2:
                raise SpecError(
                    "unclosed bracket: the looked-up dim must be written as one token "
                    "'[NAME/axis]'",
                    text,
                    tok_start,
                    len(tok),
                    hint="close the bracket right after the dim, with no spaces inside",
                )
            if len(tok) == 2:
                raise SpecError(
                    "empty brackets: write the looked-up dim inside them",
                    text,
                    tok_start,
                    2,
                    hint="e.g. '[vocab/t] d, batch -> batch d'",
                )
            if bracketed is not None:
                raise SpecError(
                    "more than one bracketed dim: index_unreduced looks up exactly one dim",
                    text,
                    tok_start,
                    len(tok),
                    hint="bracket only the dim that the indices address",
                )
            bracketed = len(dims)
            tok = tok[1:-1]
            off = tok_start + 1
        dims.append(_parse_dim(text, tok, off, seen_axes, in_op_spec=in_op_spec))
        positions.append(off)
    if pending is not None:
        # Checked after all dims: a pending axis cannot also split a dim.
        for a in pending:
            if a in seen_axes:
                raise SpecError(
                    f"mesh axis {a!r} both splits dim {seen_axes[a]!r} and is pending; a value "
                    "cannot be split over an axis it still owes a sum over",
                    text,
                    text.index("{", start),
                    1,
                    hint=f"remove '+{a}' from the clause, or '/{a}' from the dim",
                )
    return dims, positions, bracketed, pending or ()


def _parse_pending(text: str, tok: str, off: int, seen_axes: dict[str, str]) -> tuple[str, ...]:
    """Parse a pending-reduction clause ``{+t}`` or ``{+t+d}``."""
    if not tok.endswith("}") or len(tok) < 3 or tok[1] != "+":
        raise SpecError(
            f"malformed pending-reduction clause {tok!r}",
            text,
            off,
            len(tok),
            hint="write the mesh axes still to be summed over as '{+t}' or '{+t+d}', no spaces",
        )
    axes = tok[2:-1].split("+")
    out: list[str] = []
    pos = off + 2
    for a in axes:
        if not _is_identifier(a):
            raise SpecError(
                f"invalid mesh axis {a!r} in pending-reduction clause",
                text,
                pos,
                max(1, len(a)),
                hint="write '{+t}' or '{+t+d}' with mesh axis names",
            )
        if a in out:
            raise SpecError(f"mesh axis {a!r} is pending twice", text, pos, len(a))
        out.append(a)
        pos += len(a) + 1
    return tuple(out)


def _parse_dim(
    text: str, tok: str, off: int, seen_axes: dict[str, str], *, in_op_spec: bool
) -> DimSpec:
    for j, ch in enumerate(tok):
        if ch not in _TOKEN_CHARS:
            raise _char_error(text, tok, off, j, in_op_spec=in_op_spec)
    parts = tok.split("/")
    pos = off
    part_positions = []
    for p in parts:
        part_positions.append(pos)
        pos += len(p) + 1
    for p, ppos in zip(parts, part_positions, strict=True):
        if p == "":
            fixed = _fixed(text, tok, off, "/".join(q for q in parts if q))
            if ppos == off:
                msg, hint = "missing dim size before '/'", "write NAME/axis, e.g. 'batch/d'"
            elif ppos == off + len(tok):
                msg = "missing mesh axis after '/'"
                hint = f"remove the trailing '/' or name an axis: did you mean {fixed!r}?"
            else:
                msg = "empty mesh axis between '/' and '/'"
                hint = f"remove the extra '/': did you mean {fixed!r}?"
            caret = ppos - 1 if ppos == off + len(tok) else ppos
            raise SpecError(msg, text, caret, 1, hint)
    size_text = parts[0]
    size: str | int
    if _is_int(size_text):
        size = int(size_text)
    elif _is_identifier(size_text):
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
    for a, apos in zip(axes, part_positions[1:], strict=True):
        if not _is_identifier(a):
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
    return DimSpec(size, tuple(axes))


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
    dims, _, _, pending = _parse_dims(text, 0, len(text), allow_brackets=False)
    return ShapeSpec(tuple(dims), pending)


def parse_annotation_spec(spec: str | bytes | ShapeSpec, *, what: str) -> ShapeSpec:
    """Parse the spec of an array annotation ``what`` (``f32[...]``): no ``{+t}`` clause.

    A pending-reduction clause describes a partial sum, which only a ``shardops`` spec may
    name; an annotation describes a reduced value. Raises `SpecError` with a caret under the
    clause.
    """
    parsed = ShapeSpec.parse(spec)
    if not parsed.pending:
        return parsed
    text = str(parsed) if isinstance(spec, ShapeSpec) else _as_str(spec)
    start = text.find("{")
    end = text.find("}", start)
    width = end - start + 1 if start >= 0 and end >= 0 else 1
    clause = text[start : start + width] if start >= 0 else str(ShapeSpec((), parsed.pending))
    axes = "/".join(parsed.pending)
    raise SpecError(
        f"{what}: the pending-reduction clause {clause!r} cannot appear in an array "
        "annotation: an annotation describes a reduced value, and only shardops specs may "
        "name the mesh axes a partial sum still owes",
        text,
        start if start >= 0 else None,
        width,
        hint=f"remove {clause!r} and reduce the value before it reaches this annotation "
        f"(shardops.psum(spec, x, axes={axes!r}) or psum_scatter); to declare a partial sum, "
        f"write the clause in the shardops spec that makes it ('... -> B M {clause}')",
    )


def parse_op_spec(
    spec: str | bytes, *, op: str, n_inputs: int | None = None, brackets: bool = False
) -> OpSpec:
    """Parse an op spec ``'a b/d, b c -> a c'`` for the shardops function ``op``.

    ``n_inputs`` is the required number of comma-separated inputs (``None``: any, at least
    one). ``brackets`` allows one ``[dim]`` per input (``index_unreduced``). Errors name
    ``op``.
    """
    try:
        return _parse_op_cached(_as_str(spec), n_inputs, brackets)
    except SpecError as e:
        raise e.with_context(op) from None


def _span_args(span: tuple[int, int]) -> tuple[int, int]:
    return span[0], span[1] - span[0]


def _strip_span(text: str, a: int, b: int) -> tuple[int, int]:
    while a < b and text[a] in _SPACES:
        a += 1
    while b > a and text[b - 1] in _SPACES:
        b -= 1
    return a, b


@functools.lru_cache(maxsize=4096)
def _parse_op_cached(text: str, n_inputs: int | None, brackets: bool) -> OpSpec:
    count = text.count("->")
    if count == 0:
        arrow_like = next((i for i, c in enumerate(text) if _is_arrow(c)), None)
        if arrow_like is not None:
            ch = text[arrow_like]
            raise SpecError(
                f"missing '->': {ch!r} (U+{ord(ch):04X} {unicodedata.name(ch)}) is not an "
                "arrow shardops reads; an op spec reads 'INPUT -> OUTPUT'",
                text,
                arrow_like,
                1,
                hint=f"write the arrow as ASCII '->': did you mean {_ascii_arrows(text)!r}?",
            )
        if "=>" in text:
            raise SpecError(
                "missing '->': '=>' is not an arrow shardops reads; an op spec reads "
                "'INPUT -> OUTPUT'",
                text,
                text.index("=>"),
                2,
                hint=f"write the arrow as '->': did you mean {text.replace('=>', '->')!r}?",
            )
        raise SpecError(
            "missing '->': an op spec reads 'INPUT -> OUTPUT'",
            text,
            len(text),
            1,
            hint="write the layout before and after, e.g. 'a b/d -> a b'",
        )
    if count > 1:
        second = text.index("->", text.index("->") + 2)
        raise SpecError(
            "more than one '->' in op spec",
            text,
            second,
            2,
            hint="an op spec has one arrow: 'INPUT, INPUT -> OUTPUT'",
        )
    arrow = text.index("->")
    # Split inputs on commas.
    pieces: list[tuple[int, int]] = []
    s = 0
    for j in range(arrow):
        if text[j] == ",":
            pieces.append((s, j))
            s = j + 1
    pieces.append((s, arrow))
    if n_inputs is not None and len(pieces) != n_inputs:
        raise SpecError(
            f"expected {n_inputs} input spec{'s' if n_inputs != 1 else ''} before '->', "
            f"got {len(pieces)}",
            text,
            *_span_args(_strip_span(text, 0, arrow)),
            hint="separate operands with commas: 'a b, b c -> a c'"
            if n_inputs and n_inputs > 1
            else "this op takes one operand",
        )
    if "," in text[arrow + 2 :]:
        raise SpecError(
            "an op has exactly one output spec",
            text,
            text.index(",", arrow + 2),
            1,
            hint="list the output dims separated by spaces after '->'",
        )
    inputs = []
    brack = []
    in_pos = []
    for a, b in pieces:
        dims, positions, bracketed, pending = _parse_dims(
            text, a, b, allow_brackets=brackets, in_op_spec=True
        )
        inputs.append(ShapeSpec(tuple(dims), pending))
        brack.append(bracketed)
        in_pos.append(tuple(positions))
    out_dims, out_pos, out_bracketed, out_pending = _parse_dims(
        text, arrow + 2, len(text), allow_brackets=brackets, in_op_spec=True
    )
    if out_bracketed is not None:
        pos = out_pos[out_bracketed] - 1
        raise SpecError(
            "the output has no bracketed dim: brackets mark the looked-up dim of the table",
            text,
            pos,
            text.index("]", pos) + 1 - pos,
            hint="remove the brackets from the output",
        )
    return OpSpec(
        text=text,
        inputs=tuple(inputs),
        output=ShapeSpec(tuple(out_dims), out_pending),
        bracketed=tuple(brack),
        input_positions=tuple(in_pos),
        output_positions=tuple(out_pos),
        input_spans=tuple(_strip_span(text, a, b) for a, b in pieces),
        output_span=_strip_span(text, arrow + 2, len(text)),
    )


def did_you_mean(name: str, options) -> str:
    """A ' (did you mean 'x'?)' suffix for the closest of ``options``, or ''."""
    close = difflib.get_close_matches(name, list(options), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""
