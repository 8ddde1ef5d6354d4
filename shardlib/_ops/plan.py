"""`Plan`: what one ``shardops`` call does, worked out once per spec (pure Python, no JAX).

The ``plan_*`` functions (`shardlib._ops.collective_plans`, `shardlib._ops.local_plans`) build one per
distinct spec; the op skeleton (`shardlib._ops.run`) reads nothing else.
"""

from __future__ import annotations

import functools
from dataclasses import KW_ONLY, dataclass

from .._lang.op_spec import SCOPE_PREFIX, OpSpec

__all__ = ["SCOPE_PREFIX", "Plan", "axes_list"]


@dataclass(frozen=True)
class Plan:
    """What one shardops call does: all the op skeleton needs, besides the op's own fields.

    ``spec``: the parsed spec (its inputs and output carry their text spans); ``op``: the
    shardops function; ``roles``: how messages name the operands; ``needs``: the mesh axes
    that must be manual; ``sums``: the axes the op sums its input over (checked for
    invariance after tracing); ``marks``: the axes the result is a partial sum over;
    ``why``: what the output's pending axes come from, for a mismatched ``{+t}`` clause.
    """

    spec: OpSpec
    _: KW_ONLY
    op: str
    roles: tuple[str, ...] = ("input",)
    needs: tuple[str, ...] = ()
    sums: tuple[str, ...] = ()
    marks: tuple[str, ...] = ()
    why: str = ""

    @property
    def text(self) -> str:
        return self.spec.text

    @functools.cached_property
    def scope_name(self) -> str:
        """``'shardops.OP[SPEC]'``: the named scope the op's collectives run under."""
        return f"{SCOPE_PREFIX}{self.op}[{self.spec.text}]"

    @functools.cached_property
    def labels(self) -> tuple[str, ...]:
        """``"psum('B M') input"``: how messages name each operand, then the output."""
        return tuple(f"{self.op}({self.spec.text!r}) {r}" for r in (*self.roles, "output"))


def axes_list(axes: tuple[str, ...]) -> str:
    """``"'d', 't'"`` (or ``'no axis'``), for messages."""
    return ", ".join(repr(a) for a in axes) if axes else "no axis"
