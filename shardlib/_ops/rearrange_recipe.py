"""``shardops.rearrange`` patterns: parsed, checked and worked out once per text (no JAX import).

A pattern is an einops pattern whose dims carry mesh axes like shape specs:
``'B/d L (H D)/t -> B/d L H/t D'``. A parenthesised group ``(H D)/t`` is one dim of the
array, the merge of its factors, split over ``t``: each device holds a contiguous block of
it, which is a block of the *leading* factor ``H`` (with all of ``D``). So every factor of a
pattern has one sharding on each side: a plain dim ``H/t`` gives ``H`` the axes written
after it; a group gives its axes to its leading factor and none to the others. A
rearrangement is a per-device reshape/transpose exactly when each factor has the same
sharding on both sides; anything else would change which elements a device holds, and is
refused here with the pattern that keeps each factor's axes and the ``reshard`` that
changes them. The runtime part (sizes, checks, the einops call) is in
`shardlib._ops.rearrange_run`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from .._lang.op_spec import find_arrow
from .._lang.parsing import DimSpec, ShapeSpec, Span, SpecError, as_str, is_identifier, is_int

__all__ = [
    "Factor",
    "RearrangeRecipe",
    "Term",
    "check_side",
    "make_recipe",
    "parse_side",
    "rearrange_recipe",
    "render_term",
    "side_error",
]

_OP = "rearrange"
_SPACES = " \t\n\r"


@dataclass(frozen=True)
class Factor:
    """One named factor of a pattern (``H`` in ``(H D)/t``) and where it was written."""

    name: str
    span: Span


@dataclass(frozen=True)
class Term:
    """One dim of one side: a plain dim, a group ``(H D)/t``, or a unit dim (``1``, ``()``)."""

    factors: tuple[Factor, ...]
    axes: tuple[str, ...]
    group: bool
    span: Span
    text: str  # as written, e.g. '(H D)/t'

    def sharding(self) -> dict[str, tuple[str, ...]]:
        """Each factor's mesh axes: the group's go to its leading factor."""
        return {f.name: (self.axes if i == 0 else ()) for i, f in enumerate(self.factors)}

    def checked_dim(self) -> DimSpec:
        """The dim the array's shape is checked against (a group: by its text, unbound)."""
        if not self.factors:
            return DimSpec(1, self.axes, span=self.span)
        name = self.factors[0].name if not self.group else self.text.rsplit(")", 1)[0] + ")"
        return DimSpec(name, self.axes, span=self.span)


def render_term(t: Term, axes: dict[str, tuple[str, ...]]) -> str | None:
    """``t`` written with each factor's axes from ``axes`` (None: a group cannot say so)."""
    if not t.factors:
        return t.text
    names = [f.name for f in t.factors]
    if t.group:
        if any(axes[n] for n in names[1:]):
            return None
        return "(" + " ".join(names) + ")" + "".join("/" + a for a in axes[names[0]])
    return "/".join([names[0], *axes[names[0]]])


def side_error(text: str, msg: str, at: Span, hint: str | None = None) -> SpecError:
    return SpecError.at(f"{_OP}: {msg}", text, at, hint)


def _read_word(text: str, i: int, end: int) -> int:
    while i < end and (text[i].isalnum() or text[i] in "_/."):
        i += 1
    return i


def _split_axes(text: str, word: str, off: int) -> tuple[str, tuple[str, ...]]:
    """``'H/t/d'`` → ``('H', ('t', 'd'))``, each part checked."""
    parts = word.split("/")
    pos = off
    for k, p in enumerate(parts):
        if not (is_identifier(p) or (k == 0 and is_int(p))):
            what = "mesh axis" if k else "dim name"
            hint = "write 'name/axis', e.g. 'H/t' or '(H D)/t'"
            if "." in p:
                hint = "ellipses are not supported; name every dim"
            raise side_error(text, f"invalid {what} {p!r}", (pos, pos + max(1, len(p))), hint)
        pos += len(p) + 1
    return parts[0], tuple(parts[1:])


def _term(text: str, start: int, end: int, group: bool, names: list[tuple[str, int]]) -> Term:
    """The term ``text[start:end]``; ``names``: its factors and their offsets."""
    word = text[start:end]
    axes: tuple[str, ...] = ()
    if group:
        close = word.rindex(")")
        if close + 1 < len(word):
            _, axes = _split_axes(text, "G" + word[close + 1 :], start + close)
    factors = []
    for n, off in names:
        if n == "1":
            continue
        if is_int(n):
            raise side_error(
                text,
                f"literal size {n!r}: a pattern may only use 1 for a unit dim",
                (off, off + len(n)),
                "name the dim and pass its size as a keyword, e.g. H=4",
            )
        factors.append(Factor(n, (off, off + len(n))))
    if axes and not factors:
        raise side_error(text, f"the unit dim {word!r} cannot be split", (start, end))
    return Term(tuple(factors), axes, group, (start, end), word)


def _group_end(text: str, i: int, end: int) -> tuple[int, list[tuple[str, int]]]:
    """After ``(`` at ``i``: where the group's text ends and its factors."""
    j, names = i + 1, []
    while j < end and text[j] != ")":
        if text[j] in _SPACES:
            j += 1
            continue
        if text[j] == "(":
            raise side_error(text, "nested parentheses", (j, j + 1), "groups do not nest")
        k = _read_word(text, j, end)
        if k == j:
            raise side_error(text, f"unexpected {text[j]!r} in a group", (j, j + 1))
        word = text[j:k]
        if "/" in word:
            raise side_error(
                text,
                f"a factor inside a group cannot carry mesh axes ({word!r})",
                (j, k),
                "split the whole group: write '(H D)/t', whose axes go to its leading factor",
            )
        names.append((_split_axes(text, word, j)[0], j))
        j = k
    if j >= end:
        raise side_error(text, "unclosed parenthesis", (i, i + 1), "close the group with ')'")
    return _read_word(text, j + 1, end), names


def parse_side(text: str, start: int, end: int) -> tuple[Term, ...]:
    """The terms of one side of a pattern, ``text[start:end]``."""
    terms, i = [], start
    while i < end:
        c = text[i]
        if c in _SPACES:
            i += 1
        elif c == "(":
            k, names = _group_end(text, i, end)
            terms.append(_term(text, i, k, True, names))
            i = k
        else:
            k = _read_word(text, i, end)
            if k == i:
                hint = "commas: the op takes one array" if c == "," else None
                raise side_error(text, f"unexpected {c!r}", (i, i + 1), hint)
            name, axes = _split_axes(text, text[i:k], i)
            t = _term(text, i, k, False, [(name, i)])
            terms.append(Term(t.factors, axes, False, t.span, t.text) if axes else t)
            if axes and not t.factors:
                raise side_error(text, f"the unit dim {text[i:k]!r} cannot be split", (i, k))
            i = k
    return tuple(terms)


def check_side(text: str, terms: tuple[Term, ...], side: str) -> None:
    """Each factor and each mesh axis at most once on a side."""
    seen: set[str] = set()
    axes: set[str] = set()
    for t in terms:
        for f in t.factors:
            if f.name in seen:
                raise side_error(text, f"dim {f.name!r} appears twice in the {side}", f.span)
            seen.add(f.name)
        for a in t.axes:
            if a in axes:
                raise side_error(
                    text,
                    f"mesh axis {a!r} is used twice in the {side}",
                    t.span,
                    "an axis can split at most one dim",
                )
            axes.add(a)


@dataclass(frozen=True)
class RearrangeRecipe:
    """What ``rearrange(text, x)`` does on each device (see the module docstring).

    ``sharding``: each factor's mesh axes (the same on both sides); ``local``: the einops
    pattern of the per-device op, its factors renamed ``a0, a1...`` (``names``);
    ``in_spec``/``out_spec``: the array's dims as checked, a group by its text. ``op`` is the
    einops function; for ``repeat``, ``new`` names the factors only the output has.
    """

    text: str
    inputs: tuple[Term, ...]
    output: tuple[Term, ...]
    sharding: dict[str, tuple[str, ...]]
    names: dict[str, str]
    local: str
    in_spec: ShapeSpec
    out_spec: ShapeSpec
    op: str = _OP
    new: tuple[str, ...] = ()

    @property
    def needs(self) -> tuple[str, ...]:
        """The mesh axes the pattern names (each must be a manual axis)."""
        return tuple(dict.fromkeys(a for t in (*self.inputs, *self.output) for a in t.axes))

    @property
    def split_groups(self) -> tuple[Term, ...]:
        """The input's groups: their factors' sizes must be known (einops splits them)."""
        return tuple(t for t in self.inputs if t.group and t.factors)


def _local_side(terms: tuple[Term, ...], names: dict[str, str]) -> str:
    out = []
    for t in terms:
        inner = " ".join(names[f.name] for f in t.factors)
        out.append(f"({inner})" if t.group or not t.factors else inner)
    return " ".join(out)


def rearrange_recipe(pattern: str | bytes) -> RearrangeRecipe:
    """The recipe of ``shardops.rearrange(pattern, x)``; `SpecError` when it is refused."""
    return _recipe(as_str(pattern))


@functools.lru_cache(maxsize=1024)
def _recipe(text: str) -> RearrangeRecipe:
    try:
        arrow = find_arrow(text)
    except SpecError as e:
        raise e.with_context(_OP) from None
    ins = parse_side(text, 0, arrow)
    outs = parse_side(text, arrow + 2, len(text))
    check_side(text, ins, "input")
    check_side(text, outs, "output")
    have = {n: a for t in ins for n, a in t.sharding().items()}
    want = {n: a for t in outs for n, a in t.sharding().items()}
    _same_factors(text, ins, outs, have, want)
    if have != want:
        raise _mismatch(text, ins, outs, have, want)
    return make_recipe(text, ins, outs, have)


def make_recipe(
    text: str,
    ins: tuple[Term, ...],
    outs: tuple[Term, ...],
    sharding: dict[str, tuple[str, ...]],
    op: str = _OP,
    new: tuple[str, ...] = (),
) -> RearrangeRecipe:
    """The recipe of a checked pattern: ``sharding`` has every factor of either side."""
    names = {n: f"a{k}" for k, n in enumerate(sharding)}
    local = f"{_local_side(ins, names)} -> {_local_side(outs, names)}"
    in_spec = ShapeSpec(tuple(t.checked_dim() for t in ins))
    out_spec = ShapeSpec(tuple(t.checked_dim() for t in outs))
    return RearrangeRecipe(text, ins, outs, sharding, names, local, in_spec, out_spec, op, new)


def _same_factors(text: str, ins, outs, have, want) -> None:
    """Every factor of each side is on the other side too."""
    for side, other, terms in (("output", have, outs), ("input", want, ins)):
        for t in terms:
            for f in t.factors:
                if f.name not in other:
                    raise side_error(
                        text,
                        f"dim {f.name!r} of the {side} is not in the "
                        f"{'input' if side == 'output' else 'output'}",
                        f.span,
                        "rearrange keeps every dim: sum it out first (jnp.sum over a dim that is not split, "
                        "then shardops.psum over the axes of one that is)"
                        if side == "input"
                        else "rearrange keeps the dims it is given; a new dim needs repeat",
                    )


def _where(terms: tuple[Term, ...], ax: str) -> tuple[Term, str] | None:
    """The term whose axes include ``ax`` and the factor that carries them."""
    for t in terms:
        if ax in t.axes:
            return t, t.factors[0].name
    return None


def _factor(terms: tuple[Term, ...], ax: str) -> str | None:
    at = _where(terms, ax)
    return at[1] if at else None


def _mismatch(text, ins, outs, have, want) -> SpecError:
    """The error for factors whose sharding differs between the sides, with the fixes."""
    bad = [n for n in have if have[n] != want[n]]
    axes = [a for n in bad for a in (*have[n], *want[n])]
    moved = [a for a in axes if _factor(ins, a) != _factor(outs, a)]
    ax = (moved or axes)[0]
    src, dst = _where(ins, ax), _where(outs, ax)
    if src is None or dst is None:
        side, at = ("output", dst) if src is None else ("input", src)
        assert at is not None  # the axis is on one side at least
        t, f = at
        what = "split" if src is None else "gather"
        msg = (
            f"mesh axis {ax!r} splits {f} ({t.text!r}) in the {side} only; rearrange moves "
            f"no data between devices, so it cannot {what} a dim"
        )
        return side_error(text, msg, t.span, _fix(text, ins, outs, have, want, keep=False))
    if src[1] == dst[1]:
        msg = (
            f"the mesh axes of {src[1]} are {have[src[1]]} in the input but {want[src[1]]} "
            "in the output; their order fixes which block each device holds"
        )
    elif src[0].group:
        msg = (
            f"the axis {ax!r} of {src[0].text!r} lands on its leading factor {src[1]}, but the "
            f"output splits {dst[1]} over {ax!r}"
        )
    elif dst[0].group:
        msg = (
            f"the axis {ax!r} of {dst[0].text!r} would land on its leading factor {dst[1]}, "
            f"but the input splits {src[1]} over {ax!r}"
        )
    else:
        msg = f"mesh axis {ax!r} splits {src[1]} in the input but {dst[1]} in the output"
    msg += "; a per-device rearrange would change which elements each device holds"
    span = dst[0].span
    return side_error(text, msg, span, _fix(text, ins, outs, have, want))


def _fix(text, ins, outs, have, want, keep: bool = True) -> str:
    """The hint: the pattern that keeps each factor's axes, and the reshard that moves them."""
    side_in = " ".join(t.text for t in ins)
    side_out = " ".join(t.text for t in outs)
    kept_terms = [render_term(t, have) for t in outs]
    kept = " ".join(k for k in kept_terms if k is not None)
    expressible = None not in kept_terms
    hint = ""
    if keep and expressible:
        hint = f"write {side_in + ' -> ' + kept!r} (each factor keeps its axes), or "
    if not any(t.group for t in ins):
        mid = " ".join(render_term(t, want) or t.text for t in ins)
        if mid == side_out:
            return hint + f"change the layout with shardops.reshard({side_in + ' -> ' + mid!r}, x)"
        return hint + (
            f"reshard first: x = shardops.reshard({side_in + ' -> ' + mid!r}, x), then "
            f"shardops.rearrange({mid + ' -> ' + side_out!r}, x)"
        )
    if not any(t.group for t in outs) and expressible:
        return hint + (
            f"reshard after: y = shardops.rearrange({side_in + ' -> ' + kept!r}, x), then "
            f"shardops.reshard({kept + ' -> ' + side_out!r}, y)"
        )
    flat = [f.name for t in ins for f in t.factors]
    a = " ".join("/".join([n, *have[n]]) for n in flat)
    b = " ".join("/".join([n, *want[n]]) for n in flat)
    return hint + (
        f"split the groups first: shardops.rearrange({side_in + ' -> ' + a!r}, x), then "
        f"shardops.reshard({a + ' -> ' + b!r}, ...), then shardops.rearrange("
        f"{b + ' -> ' + side_out!r}, ...)"
    )
