"""``shardops.reduce`` and ``shardops.repeat`` patterns: parsed and checked once per text.

The pattern language is `shardlib._ops.rearrange_recipe`'s, and so is the rule for the dims
both sides have: each factor keeps its mesh axes. ``reduce`` removes dims, but only dims that are not
split over any mesh axis: a device's reduction over its block of a split dim is its part of
the result, not a block of it, so that is refused, naming the local reduction and the
all-reduce that finish the job. ``repeat`` adds dims, unsplit or split over mesh axes the
input does not use: the input is then the same on every device of those axes, and each
device materialises only its block of the new dim (its global size over the axes' devices).
The runtime part is `shardlib._ops.rearrange_run`.
"""

from __future__ import annotations

import functools

from .._lang.op_spec import find_arrow
from .._lang.parsing import SpecError, as_str
from .rearrange_recipe import (
    RearrangeRecipe,
    Term,
    check_side,
    make_recipe,
    parse_side,
    render_term,
    side_error,
)

__all__ = ["REDUCTIONS", "reduce_recipe", "repeat_recipe"]

# Each einops reduction and the shardops all-reduce that finishes it over devices.
REDUCTIONS: dict[str, str | None] = {
    "sum": "psum",
    "mean": "pmean",
    "max": "pmax",
    "min": "pmin",
    "prod": None,
}


def reduce_recipe(pattern: str | bytes, reduction: str) -> RearrangeRecipe:
    """The recipe of ``shardops.reduce(pattern, x, reduction)``; `SpecError` when refused."""
    text = as_str(pattern)
    if not isinstance(reduction, str) or reduction not in REDUCTIONS:
        raise ValueError(
            f"reduce({text!r}, reduction={reduction!r}): the reduction must be one of "
            f"{', '.join(map(repr, REDUCTIONS))}"
        )
    return _reduce_recipe(text, reduction)


def repeat_recipe(pattern: str | bytes) -> RearrangeRecipe:
    """The recipe of ``shardops.repeat(pattern, x)``; `SpecError` when refused."""
    return _repeat_recipe(as_str(pattern))


def _renamed(e: SpecError, op: str) -> SpecError:
    """``e`` (raised by the shared parser as ``rearrange: ...``) as an error of ``op``."""
    msg = e.message.removeprefix("rearrange: ")
    return SpecError(f"{op}: {msg}", e.spec, e.pos, e.width, e.hint)


def _sides(text: str, op: str) -> tuple[tuple[Term, ...], tuple[Term, ...]]:
    """Both sides, each factor and mesh axis at most once a side (repeat: new axes free)."""
    arrow = find_arrow(text)
    ins = parse_side(text, 0, arrow)
    outs = parse_side(text, arrow + 2, len(text))
    check_side(text, ins, "input")
    if op == "repeat":
        _new_axes_are_free(text, ins, outs)
    check_side(text, outs, "output")
    return ins, outs


def _sharding(terms: tuple[Term, ...]) -> dict[str, tuple[str, ...]]:
    return {n: a for t in terms for n, a in t.sharding().items()}


@functools.lru_cache(maxsize=1024)
def _reduce_recipe(text: str, reduction: str) -> RearrangeRecipe:
    try:
        ins, outs = _sides(text, "reduce")
        have, want = _sharding(ins), _sharding(outs)
        _all_on(text, outs, have, "output", "reduce only removes dims; repeat adds them")
        for t in ins:
            for f in t.factors:
                if f.name not in want and have[f.name]:
                    raise _split_reduced(text, ins, outs, t, f.name, reduction)
        _kept(text, "reduce", ins, outs, have, want)
        return make_recipe(text, ins, outs, have, op="reduce")
    except SpecError as e:
        raise _renamed(e, "reduce") from None


@functools.lru_cache(maxsize=1024)
def _repeat_recipe(text: str) -> RearrangeRecipe:
    try:
        ins, outs = _sides(text, "repeat")
        have, want = _sharding(ins), _sharding(outs)
        _all_on(text, ins, want, "input", "repeat keeps every dim; reduce removes dims")
        _kept(text, "repeat", ins, outs, have, want)
        new = tuple(n for n in want if n not in have)
        return make_recipe(text, ins, outs, {**have, **want}, op="repeat", new=new)
    except SpecError as e:
        raise _renamed(e, "repeat") from None


def _all_on(text: str, terms: tuple[Term, ...], other: dict, side: str, hint: str) -> None:
    """Every factor of ``terms`` (one side) is on the other side (``other``) too."""
    for t in terms:
        for f in t.factors:
            if f.name not in other:
                where = "input" if side == "output" else "output"
                msg = f"dim {f.name!r} of the {side} is not in the {where}"
                raise side_error(text, msg, f.span, hint)


def _split_words(axes: tuple[str, ...]) -> str:
    return f"split over {'/'.join(axes)!r}" if axes else "not split"


def _kept(text: str, op: str, ins, outs, have, want) -> None:
    """Each dim both sides have keeps its mesh axes (``op`` moves no data between devices)."""
    for t in outs:
        for f in t.factors:
            n = f.name
            if n not in have or have[n] == want[n]:
                continue
            msg = (
                f"dim {n} is {_split_words(have[n])} in the input but {_split_words(want[n])} "
                f"in the output; {op} moves no data between devices, so a dim it keeps keeps "
                "its mesh axes"
            )
            if any(u.group and n in (g.name for g in u.factors) for u in (*ins, *outs)):
                msg += " (a group's axes go to its leading factor)"
            kept = [render_term(u, {**want, **have}) for u in outs]
            side_in = " ".join(u.text for u in ins)
            hint = "change the layout with shardops.reshard or shardops.rearrange first"
            if None not in kept:
                fixed = side_in + " -> " + " ".join(k for k in kept if k is not None)
                hint = f"write {fixed!r} (each dim keeps its axes), then " + hint.replace(
                    " first", " after"
                )
            raise side_error(text, msg, t.span, hint)


def _bare(t: Term) -> str:
    """``t`` as written, without its mesh axes."""
    return t.text.rsplit(")", 1)[0] + ")" if t.group else t.text.split("/")[0]


def _spec(terms: tuple[Term, ...], drop: frozenset[str] = frozenset()) -> str:
    """``terms`` as a shape spec: a group named by its factors (``HD/t``); ``drop``: unsplit."""
    out = []
    for t in terms:
        name = "".join(f.name for f in t.factors) or "1"
        axes = () if t.factors and t.factors[0].name in drop else t.axes
        out.append("/".join([name, *axes]))
    return " ".join(out)


def _split_reduced(text: str, ins, outs, t: Term, name: str, reduction: str) -> SpecError:
    """The error for reducing over ``name``, a dim split over mesh axes, with the fix."""
    kept = _sharding(outs)
    reduced = frozenset(f.name for u in ins for f in u.factors if f.name not in kept)
    axes = "/".join(a for u in ins for a in u.axes if u.factors[0].name in reduced)
    msg = (
        f"dim {name} is split over {'/'.join(t.axes)!r} ({t.text!r}), so a per-device "
        f"{reduction!r} over it is this device's part of the result, not a block of it"
    )
    collective = REDUCTIONS[reduction]
    if collective is not None:
        local = " ".join(map(_bare, ins)) + " -> " + " ".join(map(_bare, outs))
        hint = (
            f"reduce the block with y = einops.reduce(x, {local!r}, {reduction!r}), then "
            f"shardops.{collective}({_spec(outs)!r}, y, axes={axes!r})"
        )
    else:
        unsplit = " ".join(
            _bare(u) if u.factors and u.factors[0].name in reduced else u.text for u in ins
        )
        outs_text = " ".join(u.text for u in outs)
        hint = (
            "no all-reduce multiplies: gather first, x = shardops.all_gather("
            f"{_spec(ins) + ' -> ' + _spec(ins, reduced)!r}, x), then shardops.reduce("
            f"{unsplit + ' -> ' + outs_text!r}, x, 'prod')"
        )
    return side_error(text, msg, t.span, hint)


def _new_axes_are_free(text: str, ins: tuple[Term, ...], outs: tuple[Term, ...]) -> None:
    """A new dim of ``repeat`` is split only over mesh axes the input does not use."""
    have = _sharding(ins)
    used = {a: t for t in ins for a in t.axes}
    for t in outs:
        if not t.factors or t.factors[0].name in have:
            continue
        for a in t.axes:
            if a in used:
                msg = (
                    f"the new dim {t.factors[0].name} is split over {a!r} ({t.text!r}), which "
                    f"the input already uses ({used[a].text!r}): the input differs between the "
                    f"devices of {a!r}, so their blocks are not blocks of one repeated array"
                )
                hint = (
                    f"split {t.factors[0].name} over a mesh axis the input does not use, or "
                    "leave it unsplit"
                )
                raise side_error(text, msg, t.span, hint)
