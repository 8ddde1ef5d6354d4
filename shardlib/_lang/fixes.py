"""What is wrong with malformed spec text, and how to fix it (pure Python, no JAX import).

The parsers (`shardlib._lang.parsing`, `shardlib._lang.op_spec`) find *where* a spec goes wrong;
this module says *what* is wrong: a message, the span to put the caret under, and a hint,
often a "did you mean" with the corrected spec. The parsers raise them as `SpecError`.
"""

from __future__ import annotations

import difflib
import unicodedata
from typing import NamedTuple

__all__ = [
    "ARROW_HINT",
    "Diagnosis",
    "ascii_arrows",
    "bad_char",
    "did_you_mean",
    "empty_part",
    "is_arrow",
    "manual_axis_error",
    "sizes_text",
]


class Diagnosis(NamedTuple):
    """A fault in spec text: the message, the caret's position and width, and a hint."""

    message: str
    pos: int
    width: int
    hint: str


def did_you_mean(name: str, options) -> str:
    """A ' (did you mean 'x'?)' suffix for the closest of ``options``, or ''."""
    close = difflib.get_close_matches(name, list(options), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def sizes_text(sizes) -> str:
    """``{axis: size}`` as ``'d=4, t=2'`` (``'none'`` when empty)."""
    return ", ".join(f"{k}={v}" for k, v in sizes.items()) if sizes else "none"


def manual_axis_error(
    fn: str, arg: str, axis: object, manual, mesh, *, must: str, example: str
) -> str | None:
    """Why argument ``arg`` of ``fn`` (``axis``) is not a manual mesh axis here, or None.

    ``manual`` and ``mesh`` are ``{axis: size}`` of the manual axes and of the mesh in force;
    ``must`` says what the axis is for (``'name the stage mesh axis, manual in this
    shard_map body'``), ``example`` an axis name to show.
    """
    if isinstance(axis, str) and axis in manual:
        return None
    head = f"{fn}: argument `{arg}` must {must}"
    if not isinstance(axis, str):
        return f"{head}; got {axis!r}, not an axis name (a str such as {example!r})"
    if not manual:
        return (
            f"{head}; got {axis!r}, but no mesh axis is manual here: call {fn} inside a "
            "typed_shard_map (or jax.shard_map) body"
        )
    if axis in mesh:
        return (
            f"{head}; got {axis!r}, a mesh axis that this body is not manual over (manual "
            f"axes: {sizes_text(manual)}): include {axis!r} in the shard_map's manual axes"
        )
    return (
        f"{head}; got {axis!r}, which the mesh does not have (mesh axes: "
        f"{sizes_text(mesh or manual)}){did_you_mean(axis, manual)}"
    )


ARROW_HINT = "arrows '->' belong in shardops op specs such as 'a/d b -> a b', not in a shape spec"
_BRACKET_HINT = "brackets mark the looked-up dim in index_unreduced op specs only"
_PUNCT_HINTS = {
    ",": "separate dims with spaces, not commas (commas separate operands in shardops op specs)",
    ">": ARROW_HINT,
    "[": _BRACKET_HINT,
    "]": _BRACKET_HINT,
    ".": "ellipses and dots are not supported; name every dim",
    "*": "write the size as a name or an integer; products are not supported",
    "(": "parentheses are not supported; name every dim",
    ")": "parentheses are not supported; name every dim",
    ":": "write 'name/axis' to shard a dim over a mesh axis",
    "@": "write 'name/axis' to shard a dim over a mesh axis",
}


def is_arrow(ch: str) -> bool:
    """Whether ``ch`` is a non-ASCII arrow (``→``, ``⟶``, ``⇒``...), often pasted for '->'."""
    return not ch.isascii() and "ARROW" in unicodedata.name(ch, "")


def ascii_arrows(text: str) -> str:
    """``text`` with every non-ASCII arrow replaced by ``->``."""
    return "".join("->" if is_arrow(c) else c for c in text)


def fixed(text: str, tok: str, off: int, new_tok: str) -> str:
    """``text`` with the dim token ``tok`` at offset ``off`` replaced by ``new_tok``."""
    return text[:off] + new_tok + text[off + len(tok) :]


def _non_ascii(text: str, tok: str, pos: int, in_op_spec: bool) -> Diagnosis:
    ch = text[pos]
    name = unicodedata.name(ch, "")
    what = f"U+{ord(ch):04X}" + (f" {name}" if name else "")
    if ch.isspace():
        hint = "separate dims with ordinary ASCII spaces"
    elif is_arrow(ch):
        hint = (
            f"write the arrow as ASCII '->': did you mean {ascii_arrows(text)!r}?"
            if in_op_spec
            else ARROW_HINT
        )
    else:
        hint = "specs are ASCII: dim names and mesh axes are ASCII identifiers"
    return Diagnosis(f"non-ASCII character {ch!r} ({what}) in dim {tok!r}", pos, 1, hint)


def _dash_hint(text: str, tok: str, off: int, j: int) -> str:
    before = tok[j - 1] if j > 0 else ""
    after = tok[j + 1] if j + 1 < len(tok) else ""
    if j == 0 and after.isdigit():
        return "a dim size is a name or a non-negative integer"
    if (before.isalnum() or before == "_") and (after.isalnum() or after == "_"):
        new = fixed(text, tok, off, tok.replace("-", "_"))
        return f"'-' cannot appear in names: did you mean {new!r}?"
    if after in ("", ">"):
        return ARROW_HINT
    return "'-' cannot appear in dims; dims are NAME or NAME/axis/axis"


def bad_char(text: str, tok: str, off: int, j: int, *, in_op_spec: bool) -> Diagnosis:
    """Character ``tok[j]`` cannot appear in a dim (``tok`` is at offset ``off`` of ``text``)."""
    ch = tok[j]
    if not ch.isascii():
        return _non_ascii(text, tok, off + j, in_op_spec)
    if ch == "-":
        hint = _dash_hint(text, tok, off, j)
    elif ch in ":@":
        hint = f"{_PUNCT_HINTS[ch]}: did you mean {fixed(text, tok, off, tok.replace(ch, '/'))!r}?"
    elif ch == ",":
        hint = f"{_PUNCT_HINTS[ch]}: did you mean {' '.join(text.replace(',', ' ').split())!r}?"
    elif ch in "[]" and in_op_spec:
        hint = "only index_unreduced specs bracket a dim, written as one token: '[vocab/t]'"
    else:
        hint = _PUNCT_HINTS.get(ch, "dims are NAME or NAME/axis/axis, separated by spaces")
    return Diagnosis(f"unexpected character {ch!r} in dim {tok!r}", off + j, 1, hint)


def empty_part(text: str, tok: str, off: int, parts: list[str], ppos: int) -> Diagnosis:
    """An empty part of dim ``tok`` (at offset ``ppos``): ``/d``, ``a/`` or ``a//d``."""
    new = fixed(text, tok, off, "/".join(q for q in parts if q))
    if ppos == off:
        msg, hint = "missing dim size before '/'", "write NAME/axis, e.g. 'batch/d'"
    elif ppos == off + len(tok):
        msg = "missing mesh axis after '/'"
        hint = f"remove the trailing '/' or name an axis: did you mean {new!r}?"
    else:
        msg = "empty mesh axis between '/' and '/'"
        hint = f"remove the extra '/': did you mean {new!r}?"
    caret = ppos - 1 if ppos == off + len(tok) else ppos
    return Diagnosis(msg, caret, 1, hint)
