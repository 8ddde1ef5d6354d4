"""Op specs ``'in0, in1 -> out'`` for ``shardops``: the parsed node and its parser (no JAX).

An op spec is one or more comma-separated shape specs (`shardlib._lang.parsing`), an arrow
``->`` and one output shape spec. Parsing is cached per (text, inputs, brackets).
"""

from __future__ import annotations

import functools
import unicodedata
from dataclasses import dataclass

from .fixes import ascii_arrows, is_arrow
from .parsing import ShapeSpec, Span, SpecError, as_str, parse_dims, strip_span

__all__ = ["OpSpec", "find_arrow", "parse_op_spec"]


@dataclass(frozen=True)
class OpSpec:
    """A parsed op spec ``'in0, in1 -> out'``.

    ``bracketed[i]`` is the index of the dim of input ``i`` written in ``[...]`` (used by
    ``index_unreduced``) or ``None``. ``str()`` gives the canonical form of the spec. The
    inputs, the output and their dims carry their spans in ``text``.
    """

    text: str
    inputs: tuple[ShapeSpec, ...]
    output: ShapeSpec
    bracketed: tuple[int | None, ...]

    def __str__(self) -> str:
        ins = []
        for s, b in zip(self.inputs, self.bracketed, strict=True):
            txt = " ".join(f"[{d}]" if j == b else str(d) for j, d in enumerate(s.dims))
            if s.pending:
                txt = f"{txt} {str(ShapeSpec((), s.pending))}".strip()
            ins.append(txt)
        return f"{', '.join(ins)} -> {self.output}"

    def part(self, operand: int | None) -> ShapeSpec:
        """Input ``operand``, or the output for None."""
        return self.output if operand is None else self.inputs[operand]

    def error(
        self, message: str, *, operand: int | None, dim: int | None, hint: str | None = None
    ) -> SpecError:
        """A SpecError with a caret under dim ``dim`` of input ``operand`` (None: the output).

        With ``dim=None`` the caret underlines the whole operand (or the whole output).
        """
        part = self.part(operand)
        span = part.span if dim is None else part.dims[dim].span
        return SpecError.at(message, self.text, span, hint)

    def spec_error(self, message: str, *, hint: str | None = None) -> SpecError:
        """A SpecError about the spec as a whole (no caret)."""
        return SpecError(message, self.text, None, hint=hint)


def parse_op_spec(
    spec: str | bytes, *, op: str, n_inputs: int | None = None, brackets: bool = False
) -> OpSpec:
    """Parse an op spec ``'a b/d, b c -> a c'`` for the shardops function ``op``.

    ``n_inputs`` is the required number of comma-separated inputs (``None``: any, at least
    one). ``brackets`` allows one ``[dim]`` per input (``index_unreduced``). Errors name
    ``op``.
    """
    try:
        return _parse_op_cached(as_str(spec), n_inputs, brackets)
    except SpecError as e:
        raise e.with_context(op) from None


def find_arrow(text: str) -> int:
    """The offset of the one ``->`` of ``text``; an error says what stands in for it."""
    count = text.count("->")
    if count == 1:
        return text.index("->")
    if count > 1:
        second = text.index("->", text.index("->") + 2)
        raise SpecError(
            "more than one '->' in op spec",
            text,
            second,
            2,
            hint="an op spec has one arrow: 'INPUT, INPUT -> OUTPUT'",
        )
    arrow_like = next((i for i, c in enumerate(text) if is_arrow(c)), None)
    if arrow_like is not None:
        ch = text[arrow_like]
        raise SpecError(
            f"missing '->': {ch!r} (U+{ord(ch):04X} {unicodedata.name(ch)}) is not an "
            "arrow shardops reads; an op spec reads 'INPUT -> OUTPUT'",
            text,
            arrow_like,
            1,
            hint=f"write the arrow as ASCII '->': did you mean {ascii_arrows(text)!r}?",
        )
    if "=>" in text:
        raise SpecError(
            "missing '->': '=>' is not an arrow shardops reads; an op spec reads 'INPUT -> OUTPUT'",
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


def _input_pieces(text: str, arrow: int, n_inputs: int | None) -> list[Span]:
    """The ``(start, end)`` of each comma-separated input before the arrow."""
    pieces: list[Span] = []
    s = 0
    for j in range(arrow):
        if text[j] == ",":
            pieces.append((s, j))
            s = j + 1
    pieces.append((s, arrow))
    if n_inputs is not None and len(pieces) != n_inputs:
        raise SpecError.at(
            f"expected {n_inputs} input spec{'s' if n_inputs != 1 else ''} before '->', "
            f"got {len(pieces)}",
            text,
            strip_span(text, 0, arrow),
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
    return pieces


@functools.lru_cache(maxsize=4096)
def _parse_op_cached(text: str, n_inputs: int | None, brackets: bool) -> OpSpec:
    arrow = find_arrow(text)
    inputs = []
    bracketed = []
    for a, b in _input_pieces(text, arrow, n_inputs):
        spec, at = parse_dims(text, a, b, allow_brackets=brackets, in_op_spec=True)
        inputs.append(spec)
        bracketed.append(at)
    output, out_at = parse_dims(
        text, arrow + 2, len(text), allow_brackets=brackets, in_op_spec=True
    )
    if out_at is not None:
        dim = output.dims[out_at].span
        assert dim is not None  # parsed: every dim has a span
        raise SpecError.at(
            "the output has no bracketed dim: brackets mark the looked-up dim of the table",
            text,
            (dim[0] - 1, dim[1] + 1),
            hint="remove the brackets from the output",
        )
    return OpSpec(text, tuple(inputs), output, tuple(bracketed))
