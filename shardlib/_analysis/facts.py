"""What the partial-sum walk (`shardlib._analysis.walk`) knows per value, and how it says no.

Per value: ``pend`` (the mesh axes it still owes a sum over, and the op that made it),
``zero`` (known to be all zeros) and ``vary`` (the manual mesh axes over which it may
differ from device to device). Errors name the function, the op as the user wrote it
(its ``shardops`` name, read from its named scope, else the primitive), its line and the op
that made the partial sum.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from .._env import frames as _frames
from .._env.collectives import written_name
from .._lang.parsing import DimSpec, ShapeSpec, SpecError
from .._lang.scope_codec import OpScope
from .notes import Note, PendingReductionError


@dataclass(frozen=True)
class Pend:
    axes: frozenset[str]
    origin: str

    def text(self) -> str:
        return axes_text(self.axes)


class St(NamedTuple):
    pend: Pend | None = None
    zero: bool = False
    vary: frozenset[str] = frozenset()


PLAIN = St()


def axes_text(axes: Any) -> str:
    axes = sorted(axes)
    word = "axes" if len(axes) > 1 else "axis"
    return f"mesh {word} " + ", ".join(repr(a) for a in axes)


def axes_arg(axes: Any) -> str:
    return "/".join(sorted(axes))


class Ctx:
    """The function whose body is analysed, and the equations (calls, loops) we are inside:
    messages about an equation without a name or line of its own use theirs.

    ``trial``: a loop body is being iterated towards its fixpoint. Checks that could fail on
    a fact that a later round grows out of (a sum over an axis the value does not vary over
    *yet*, a sum of a carry that is still known zero) wait for the final round.

    ``sizes``: the sizes of the mesh axes the body runs over, in mesh order (a collective
    names only its manual ones), for the rules that need them (is a ``ppermute`` full?);
    an axis not in it has an unknown size.
    """

    def __init__(
        self,
        fname: str,
        outer: tuple[Any, ...] = (),
        trial: bool = False,
        sizes: Mapping[str, int] | None = None,
    ):
        self.fname = fname
        self.outer = outer
        self.trial = trial
        self.sizes: Mapping[str, int] = sizes if sizes is not None else {}

    def inside(self, eqn: Any) -> Ctx:
        return Ctx(self.fname, (*self.outer, eqn), self.trial, self.sizes)

    def rounds(self, eqn: Any) -> Ctx:
        """The context of a loop body's rounds before its fixpoint."""
        return Ctx(self.fname, (*self.outer, eqn), True, self.sizes)


def _shardops_name(eqn: Any) -> str | None:
    """``shardops.psum('B M')`` when ``eqn`` ran under a shardops op's named scope."""
    stack = _frames.name_stack_of(eqn)
    scope = OpScope.innermost(stack)  # 'shardops.OP[SPEC]', perhaps followed by '/inner'
    return None if scope is None else f"{scope.PREFIX}{scope.op}({scope.spec!r})"


def _location(eqn: Any) -> str | None:
    return _frames.location_of_traceback(getattr(eqn.source_info, "traceback", None))


def _op_name(eqn: Any, ctx: Ctx | None = None) -> str:
    """How the user wrote the op: its shardops name (its own, or that of the call it is in),
    else the primitive (``max``, ``mul``...)."""
    for e in (eqn, *reversed(ctx.outer if ctx else ())):
        name = _shardops_name(e)
        if name:
            return name
    return f"`{written_name(eqn.primitive.name)}`"


def _where(eqn: Any, ctx: Ctx | None = None) -> str:
    for e in (eqn, *reversed(ctx.outer if ctx else ())):
        loc = _location(e)
        if loc:
            return f" at {loc}"
    return ""


def fail(ctx: Ctx, eqn: Any, pend: Pend, what: str, hint: str) -> PendingReductionError:
    return PendingReductionError(
        f"in {ctx.fname}(): {_op_name(eqn, ctx)}{_where(eqn, ctx)} {what} a partial sum still "
        f"owing a reduction over {pend.text()} (made by {pend.origin}). {hint}"
    )


def branch_collective_error(
    ctx: Ctx, eqn: Any, axes: frozenset[str], varying: frozenset[str], loop: bool = False
) -> ValueError:
    """The refusal of a collective ``eqn`` over ``axes`` in a branch of a ``cond``/``switch``
    (the innermost of ``ctx.outer``) whose index differs across the devices of ``varying``, or
    (``loop``) in a ``while_loop`` whose trip count does."""
    name = written_name(eqn.primitive.name)
    written = _op_name(eqn, ctx)
    what = written if written == f"`{name}`" else f"{written} (`{name}`)"
    over = axes & varying
    if over:
        why = (
            f"it communicates over {axes_text(over)}, across which the devices take different "
            f"{'numbers of iterations' if loop else 'branches'}, so some devices of each of its "
            "groups never run it (a deadlock) or run another collective in its place (wrong "
            "values)"
        )
    elif "permute" in name:
        why = (
            "a collective-permute (ppermute, shardops.shift, attention.ring) has no groups: XLA "
            "pairs it with whatever permute the devices that take another branch run at that "
            "moment (wrong values or a deadlock)"
        )
    else:
        why = (
            "it is not a collective known to be safe there (psum, pmax/pmin, all_gather, "
            "psum_scatter, all_to_all over axes the index does not vary over are)"
        )
    if loop:
        return ValueError(
            f"in {ctx.fname}(): {what}{_where(eqn, ctx)} runs over {axes_text(axes)} inside a "
            f"lax.while_loop whose number of iterations differs across the devices of "
            f"{axes_text(varying)} (its predicate depends on axis_index or on a value split "
            f"over them), so some devices run it more often than others: {why}. Give the "
            f"loop the same trip count on every device (reduce the predicate over "
            f"{axes_text(varying)}, e.g. shardops.pmax, and mask the extra iterations' "
            f"updates with jnp.where), or use a grouped collective (psum, all_gather, "
            f"psum_scatter, all_to_all) over axes the predicate does not vary over"
        )
    return ValueError(
        f"in {ctx.fname}(): {what}{_where(eqn, ctx)} runs over {axes_text(axes)} inside a "
        f"branch of a lax.cond/lax.switch whose index differs across the devices of "
        f"{axes_text(varying)} (it depends on axis_index or on a value split over them), so "
        f"only some devices run it: {why}. Move the collective out of the branch: run it on "
        f"every device before or after the cond and select its result with jnp.where (or "
        f"pass it into the branch), or use a grouped collective (psum, all_gather, "
        f"psum_scatter, all_to_all) over axes the index does not vary over"
    )


def made_spec(origin: str) -> str | None:
    """The output spec of the op an origin names (``OP('... -> B/d M {+t}') at f.py:3`` gives
    ``'B/d M'``), or None (also for a scalar output). Read only to write an error."""
    return _made(origin) or None


def _made(origin: str) -> str | None:
    """`made_spec`, but ``''`` for an op whose output is a scalar."""
    m = _ORIGIN_SPEC.match(origin)
    if m is None:
        return None
    return _CLAUSE.sub("", m.group(1).rpartition("->")[2]).strip()


_ORIGIN_SPEC = re.compile(r"\w+\('(.*)'\)(?: at .*)?$")
_CLAUSE = re.compile(r"\{[^}]*\}")
_LINEAR = "or, if the operation is linear, apply it with shardops.linear(fn, x)"


def reduce_hint(pend: Pend, spec: str | None = None) -> str:
    """The fix for a partial sum ``pend``: its reduction, with ``spec`` (default: the output
    spec of the op that made it) filled in. A spec that splits a dim over a pending axis
    gets a ``psum_scatter`` (``psum`` cannot reduce over an axis a dim is split over); a
    scalar (a loss) gets ``pmean`` first."""
    spec = spec if spec is not None else _made(pend.origin)
    axes = axes_arg(pend.axes)
    if spec is None:
        return (
            f"Reduce it first: shardops.psum(SPEC, x, axes={axes!r}) (or jax.lax.psum(x, "
            f"{tuple(sorted(pend.axes))!r}), or psum_scatter), {_LINEAR}"
        )
    if not spec.strip():
        return (
            f"Reduce it first: shardops.pmean('', x, axes={axes!r}) for a mean (a loss), "
            f"shardops.psum('', x, axes={axes!r}) for a sum; {_LINEAR}"
        )
    try:
        dims = ShapeSpec.parse(spec).dims
    except SpecError:  # not a spec we can rewrite: show it as it is
        dims = ()
    scattered = {a for d in dims for a in d.sharding} & pend.axes
    if not scattered:
        return (
            f"Reduce it first: shardops.psum({spec!r}, x, axes={axes!r}) (or jax.lax.psum(x, "
            f"{tuple(sorted(pend.axes))!r}), or psum_scatter), {_LINEAR}"
        )
    src = " ".join(
        str(DimSpec(d.shape, tuple(a for a in d.sharding if a not in pend.axes))) for d in dims
    )
    rest = pend.axes - scattered
    x = f"shardops.psum({src!r}, x, axes={axes_arg(rest)!r})" if rest else "x"
    return (
        f"Reduce-scatter it first: shardops.psum_scatter('{src} -> {' '.join(map(str, dims))}', "
        f"{x}) (psum cannot reduce over {axes_text(scattered)}: the spec splits a dim over "
        f"it), {_LINEAR}"
    )


def union(states: Sequence[St]) -> frozenset[str]:
    out: frozenset[str] = frozenset()
    for s in states:
        out |= s.vary
    return out


def plain_outs(eqn: Any, states: Sequence[St], zero: bool = False) -> list[St]:
    vary = union(states)
    return [St(None, zero, vary) for _ in eqn.outvars]


def first_pending(states: Sequence[St]) -> Pend | None:
    return next((s.pend for s in states if s.pend is not None), None)


def check_static_operands(
    eqn: Any, first: St, others: Sequence[St], ctx: Ctx, role: str = "an index, a size or a mask"
) -> None:
    """``others`` (indices, sizes, masks, selectors) must not be partial sums, and must be the
    same on every device of the axes ``first`` is pending over."""
    for s in others:
        if s.pend is not None:
            raise fail(
                ctx,
                eqn,
                s.pend,
                f"uses as {role} (a non-linear use: each device would choose by its own share)",
                reduce_hint(s.pend),
            )
        if first.pend is not None and s.vary & first.pend.axes:
            axes = s.vary & first.pend.axes
            raise fail(
                ctx,
                eqn,
                first.pend,
                f"uses an index or mask that differs across the devices of {axes_text(axes)} on",
                "Each device would select a different part of its share, which does not add "
                "up to the part of the sum. Reduce first, or make the index the same on every "
                "device of those axes",
            )


def declared_mismatch(ctx: Ctx, n: Note, pend: Pend | None) -> SpecError:
    declared = tuple(n.axes)
    clause = str(ShapeSpec((), declared))
    if pend is not None:
        axes = tuple(sorted(pend.axes))
        actual = f"it is pending over {', '.join(map(repr, axes))} ({str(ShapeSpec((), axes))})"
        if not n.why:
            actual += f", made by {pend.origin}"
        fix = f"write {str(ShapeSpec((), axes))!r}, or leave the clause out to have it inferred"
    else:
        actual = "it is not a partial sum (nothing is pending)"
        fix = f"remove {clause!r}"
    return SpecError(
        f"in {ctx.fname}(): {n.op}: the {n.role} is declared pending over "
        f"{', '.join(map(repr, declared))} ({clause}) but {actual}"
        + (f": {n.why}" if n.why else ""),
        n.text,
        n.pos,
        n.width,
        hint=fix,
    )


def invariant_sum(ctx: Ctx, eqn: Any, n: Note, same: list[str]) -> ValueError:
    effect = "return it unchanged" if n.op == "pmean" else "multiply it by the axis size"
    return ValueError(
        f"in {ctx.fname}(): {n.op}({n.text!r}){_where(eqn, ctx)}: the input is the same on every "
        f"device of mesh axis {'/'.join(same)!r} (it does not vary over it), so {n.op} would "
        f"{effect}. If it is a gradient taken inside the body with respect to a replicated "
        "value, JAX has already summed it over that axis: drop the reduction (or take the "
        "gradient of jax.lax.pcast(w, axis, to='varying') to get per-device parts). If you "
        "really want size x value, multiply by shardops.axis_size(axis)"
    )


def same_varies(ctx: Ctx, eqn: Any, n: Note, axes: frozenset[str]) -> ValueError:
    """A layout op's input differs across devices of ``axes``, over which its spec says it is
    the same (replicated), so each device would slice a different array (or, for a note
    with ``role="rule"``, break the rule ``n.why`` states)."""
    if n.role == "rule":
        return ValueError(
            f"in {ctx.fname}(): {n.op}({n.text!r}){_where(eqn, ctx)}: {n.why.strip().rstrip('.')} (the "
            f"value differs across the devices of {axes_text(axes)}: it was computed from values "
            "split over or indexed by them)"
        )
    return ValueError(
        f"in {ctx.fname}(): {n.op}({n.text!r}){_where(eqn, ctx)}: the input differs across the "
        f"devices of {axes_text(axes)} (it was computed from values split over or indexed by "
        f"{'/'.join(sorted(axes))!r}), but the spec says it is the same on every device of that "
        f"axis: {n.op} would keep each device's slice of a different array. {n.why or ''}"
        "Reduce it (shardops.psum / pmean), gather it, or write the spec with the axis the "
        "input is really split over"
    )
