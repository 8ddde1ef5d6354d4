"""`Recipe`: what one ``shardops`` call does, worked out once per spec (pure Python, no JAX).

The ``*_recipe`` functions (`shardlib._ops.collective_recipes`, `shardlib._ops.local_recipes`,
and one module per other op family, each named ``*_recipe`` or ``*_recipes``) build one per
distinct spec; the op skeleton (`shardlib._ops.run`) reads nothing else. Each op's subclass is
named for its op (`AllGatherRecipe`, `ReshardRecipe`, ...). A recipe, as in einops' cached
transformation recipes: what to run, fixed before any array is seen. The word "plan" is kept
for `shardlib.plan`, the layout planner.
"""

from __future__ import annotations

import functools
from dataclasses import KW_ONLY, dataclass

from .._lang.op_spec import OpSpec
from .._lang.scope_codec import OpScope

__all__ = ["Recipe", "axes_list"]


@dataclass(frozen=True)
class Recipe:
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
        return OpScope(self.op, self.spec.text).text()

    @functools.cached_property
    def labels(self) -> tuple[str, ...]:
        """``"psum('B M') input"``: how messages name each operand, then the output."""
        return tuple(f"{self.op}({self.spec.text!r}) {r}" for r in (*self.roles, "output"))


def axes_list(axes: tuple[str, ...]) -> str:
    """``"'d', 't'"`` (or ``'no axis'``), for messages."""
    return ", ".join(repr(a) for a in axes) if axes else "no axis"
