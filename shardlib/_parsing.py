"""The shape-spec language: a pure-Python parser (no JAX import).

A *shape spec* is a space-separated list of dims such as ``'batch/d len'``: each dim is a
size (a name that binds per scope, or a literal non-negative integer) followed by the mesh
axes it is split over, separated by ``/``. An *op spec* (used by ``shardops``) is one or
more comma-separated shape specs, an arrow ``->`` and one output shape spec.

Parsing is cached: the same string is parsed once per process.
"""

from __future__ import annotations

import difflib
import functools
from dataclasses import dataclass

__all__ = [
    "DimSpec",
    "OpSpec",
    "ShapeSpec",
    "SpecError",
    "parse_op_spec",
]


class SpecError(ValueError):
    """A malformed shape spec or op spec.

    The message shows the spec with a caret under the fault and a hint on how to fix it.
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
            lines.append(f"    {self.spec!r}")
            if self.pos is not None:
                # +5: four spaces of indent and the opening quote of the repr.
                lines.append(" " * (self.pos + 5) + "^" * self.width)
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
    """A parsed shape spec: a tuple of :class:`DimSpec`.

    Example:
        >>> ShapeSpec.parse('batch/d len').partition_spec()
        PartitionSpec('d', None)
    """

    dims: tuple[DimSpec, ...]

    @staticmethod
    def parse(spec: str | bytes) -> ShapeSpec:
        """Parse ``spec`` (``str`` or ``bytes``); raises :class:`SpecError` when malformed."""
        if isinstance(spec, ShapeSpec):
            return spec
        return _parse_shape_cached(_as_str(spec))

    def __str__(self) -> str:
        return " ".join(str(d) for d in self.dims)

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
    ``index_unreduced``) or ``None``.
    """

    text: str
    inputs: tuple[ShapeSpec, ...]
    output: ShapeSpec
    bracketed: tuple[int | None, ...]
    # Character offsets of each dim in `text`, for carets in later (semantic) errors:
    # input_positions[i][j] is the offset of dim j of input i; output_positions likewise.
    input_positions: tuple[tuple[int, ...], ...]
    output_positions: tuple[int, ...]

    def error(self, message: str, *, operand: int | None, dim: int | None, hint=None) -> SpecError:
        """A SpecError with a caret under dim ``dim`` of input ``operand`` (None: the output)."""
        if dim is None:
            return SpecError(message, self.text, None, hint=hint)
        if operand is None:
            pos = self.output_positions[dim]
            width = len(str(self.output.dims[dim]))
        else:
            pos = self.input_positions[operand][dim]
            width = len(str(self.inputs[operand].dims[dim]))
        return SpecError(message, self.text, pos, width, hint)


def _as_str(spec: str | bytes) -> str:
    if isinstance(spec, bytes):
        return spec.decode("ascii", errors="replace")
    if isinstance(spec, str):
        return spec
    raise TypeError(f"a shape spec must be str or bytes, got {type(spec).__name__}: {spec!r}")


_ALLOWED_PUNCT_HINTS = {
    ",": "separate dims with spaces, not commas (commas separate operands in shardops specs)",
    "-": "arrows '->' belong in shardops op specs, not in a shape spec",
    ">": "arrows '->' belong in shardops op specs, not in a shape spec",
    "[": "brackets mark the indexed dim in index_unreduced specs only",
    "]": "brackets mark the indexed dim in index_unreduced specs only",
    ".": "ellipses and dots are not supported; name every dim",
    "*": "write the size as a name or an integer; products are not supported",
    "(": "parentheses are not supported; name every dim",
    ")": "parentheses are not supported; name every dim",
    ":": "write 'name/axis' to shard a dim over a mesh axis",
    "@": "write 'name/axis' to shard a dim over a mesh axis",
}


def _is_identifier(s: str) -> bool:
    return s.isidentifier() and s.isascii()


def _is_int(s: str) -> bool:
    return s.isascii() and s.isdigit()


def _parse_dims(
    text: str, start: int, end: int, *, allow_brackets: bool
) -> tuple[list[DimSpec], list[int], int | None]:
    """Parse dims in ``text[start:end]``; positions refer to ``text``."""
    dims: list[DimSpec] = []
    positions: list[int] = []
    bracketed: int | None = None
    seen_axes: dict[str, int] = {}
    i = start
    while i < end:
        c = text[i]
        if c.isspace():
            i += 1
            continue
        tok_start = i
        while i < end and not text[i].isspace():
            i += 1
        tok = text[tok_start:i]
        off = tok_start
        if allow_brackets and tok.startswith("["):
            if not tok.endswith("]") or len(tok) < 2:
                raise SpecError(
                    "unclosed bracket: the indexed dim must be written as one token '[NAME/axis]'",
                    text,
                    tok_start,
                    len(tok),
                    hint="close the bracket right after the dim, with no spaces inside",
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
        dims.append(_parse_dim(text, tok, off, seen_axes))
        positions.append(tok_start)
    return dims, positions, bracketed


def _parse_dim(text: str, tok: str, off: int, seen_axes: dict[str, int]) -> DimSpec:
    for j, ch in enumerate(tok):
        if not (ch.isalnum() or ch == "_" or ch == "/"):
            hint = _ALLOWED_PUNCT_HINTS.get(ch, "dims are NAME or NAME/axis/axis, separated by spaces")
            raise SpecError(f"unexpected character {ch!r} in dim {tok!r}", text, off + j, 1, hint)
    parts = tok.split("/")
    pos = off
    part_positions = []
    for p in parts:
        part_positions.append(pos)
        pos += len(p) + 1
    for p, ppos in zip(parts, part_positions, strict=True):
        if p == "":
            if ppos == off:
                msg, hint = "missing dim size before '/'", "write NAME/axis, e.g. 'batch/d'"
            elif ppos == off + len(tok):
                msg, hint = "missing mesh axis after '/'", "remove the trailing '/' or name an axis"
            else:
                msg, hint = "empty mesh axis between '/' and '/'", "remove the extra '/'"
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
                hint=f"remove one of the two '/{a}' (first use at column {seen_axes[a]})",
            )
        seen_axes[a] = apos
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
    dims, _, _ = _parse_dims(text, 0, len(text), allow_brackets=False)
    return ShapeSpec(tuple(dims))


def parse_op_spec(
    spec: str | bytes, *, op: str, n_inputs: int | None = None, brackets: bool = False
) -> OpSpec:
    """Parse an op spec ``'a b/d, b c -> a c'`` for the shardops function ``op``.

    ``n_inputs`` is the required number of comma-separated inputs (``None``: any, at least
    one). ``brackets`` allows one ``[dim]`` per input (``index_unreduced``).
    """
    try:
        return _parse_op_cached(_as_str(spec), n_inputs, brackets)
    except SpecError as e:
        raise e.with_context(op) from None


@functools.lru_cache(maxsize=4096)
def _parse_op_cached(text: str, n_inputs: int | None, brackets: bool) -> OpSpec:
    count = text.count("->")
    if count == 0:
        raise SpecError(
            "missing '->': an op spec reads 'INPUT -> OUTPUT'",
            text,
            len(text),
            1,
            hint="write the layout before and after, e.g. 'a b/d -> a b'",
        )
    if count > 1:
        second = text.index("->", text.index("->") + 2)
        raise SpecError("more than one '->' in op spec", text, second, 2)
    arrow = text.index("->")
    lhs_end = arrow
    # Split inputs on commas.
    pieces: list[tuple[int, int]] = []
    s = 0
    for j in range(lhs_end):
        if text[j] == ",":
            pieces.append((s, j))
            s = j + 1
    pieces.append((s, lhs_end))
    if n_inputs is not None and len(pieces) != n_inputs:
        raise SpecError(
            f"expected {n_inputs} input spec{'s' if n_inputs != 1 else ''} before '->', "
            f"got {len(pieces)}",
            text,
            0,
            lhs_end,
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
        )
    inputs = []
    brack = []
    in_pos = []
    for a, b in pieces:
        dims, positions, bracketed = _parse_dims(text, a, b, allow_brackets=brackets)
        inputs.append(ShapeSpec(tuple(dims)))
        brack.append(bracketed)
        in_pos.append(tuple(positions))
    out_dims, out_pos, _ = _parse_dims(text, arrow + 2, len(text), allow_brackets=False)
    return OpSpec(
        text=text,
        inputs=tuple(inputs),
        output=ShapeSpec(tuple(out_dims)),
        bracketed=tuple(brack),
        input_positions=tuple(in_pos),
        output_positions=tuple(out_pos),
    )


def did_you_mean(name: str, options) -> str:
    """A ' (did you mean 'x'?)' suffix for the closest of ``options``, or ''."""
    close = difflib.get_close_matches(name, list(options), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""
