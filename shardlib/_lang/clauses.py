"""The clause after a spec's dims: the mesh axes a value is unreduced or reduced over.

``{+t}`` (or ``{+t+d}``): the value is a partial sum over ``t``, still owing a sum over it
(JAX's ``unreduced``); ``{=t}``: the value is the same on every device of ``t`` and its
gradient is left unreduced over ``t`` (JAX's ``reduced``); ``{+t=d}`` both. Pure Python: the
PartitionSpec is built by the caller's JAX class.
"""

from __future__ import annotations

from typing import Any

__all__ = ["clause_partition_spec", "parse_clause"]

_SIGNS = "+="
_HINT = "write the clause as '{+t}' (unreduced over t), '{=t}' (reduced over t) or '{+t=d}'"


def parse_clause(
    text: str, tok: str, off: int, _error: Any
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``(unreduced axes, reduced axes)`` of a clause token ``{+t}``, ``{=t}``, ``{+t=d}``;
    ``_error`` is the parser's error class (`shardlib._lang.parsing.SpecError`)."""
    if not tok.endswith("}") or len(tok) < 3 or tok[1] not in _SIGNS:
        raise _error(f"malformed clause {tok!r}", text, off, len(tok), hint=_HINT + ", no spaces")
    pending: list[str] = []
    reduced: list[str] = []
    pos, i = off + 1, 1
    body = tok[:-1]
    while i < len(body):
        sign = body[i]
        j = i + 1
        while j < len(body) and body[j] not in _SIGNS:
            j += 1
        a = body[i + 1 : j]
        if not (a.isidentifier() and a.isascii()):
            raise _error(
                f"invalid mesh axis {a!r} in the clause {tok!r}",
                text,
                pos + 1,
                max(1, len(a)),
                hint=_HINT + " with mesh axis names",
            )
        if a in pending or a in reduced:
            raise _error(f"mesh axis {a!r} is named twice in the clause", text, pos + 1, len(a))
        (pending if sign == "+" else reduced).append(a)
        pos += j - i
        i = j
    return tuple(pending), tuple(reduced)


def clause_partition_spec(partition_spec_cls: Any, spec: Any, _error: Any) -> Any:
    """``PartitionSpec(*entries, unreduced=..., reduced=...)`` of ``spec``; a `SpecError`
    naming the JAX version where its PartitionSpec has no such fields."""
    kw: dict[str, Any] = {}
    if spec.pending:
        kw["unreduced"] = set(spec.pending)
    if spec.reduced:
        kw["reduced"] = set(spec.reduced)
    try:
        return partition_spec_cls(*spec.partition_entries(), **kw)
    except TypeError:
        import jax

        raise _error(
            f"{str(spec)!r}: JAX {jax.__version__}'s PartitionSpec has no unreduced/reduced "
            "fields, so a value cannot be typed unreduced ('{+t}') or reduced ('{=t}')",
            str(spec),
            0,
            len(str(spec)),
            hint="upgrade JAX, or reduce the value (shardops.psum) before it reaches this "
            "annotation and annotate it without the clause",
        ) from None
