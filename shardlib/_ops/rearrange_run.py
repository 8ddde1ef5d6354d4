"""``shardops.rearrange``/``reduce``/``repeat`` at trace time: sizes, checks, the einops call.

The recipe (`shardlib._ops.rearrange_recipe`) fixes each factor's mesh axes; here the array's
shape is checked against the input pattern in the current binding scope, the global sizes of the
factors of each input group are found (``**sizes`` or the scope's bindings; at most one
unknown per group), each leading factor of a split group is checked to divide evenly over
the group's axes, and the einops op runs on the local block with the local sizes (a new dim
of ``repeat`` at its global size over its axes' devices). The factors' global sizes are then
bound in the scope, like any checked dim.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import einops
import jax
import numpy as np
from typeguard import TypeCheckError

from .._analysis.notes import Note, note, notes_on
from .._check.checking import check_value, format_sizes
from .._check.scopes import Scope, current_scope
from .._env import context as _context
from .._lang.scope_codec import OpScope
from .rearrange_recipe import RearrangeRecipe, Term, rearrange_recipe
from .reduce_repeat_recipe import reduce_recipe, repeat_recipe

__all__ = ["rearrange", "reduce", "repeat"]


def rearrange(pattern: str | bytes, x: Any, sizes: Mapping[str, int]) -> Any:
    """``shardops.rearrange(pattern, x, **sizes)`` (see its docstring)."""
    return _run(rearrange_recipe(pattern), x, sizes)


def reduce(pattern: str | bytes, x: Any, reduction: str, sizes: Mapping[str, int]) -> Any:
    """``shardops.reduce(pattern, x, reduction, **sizes)`` (see its docstring)."""
    return _run(reduce_recipe(pattern, reduction), x, sizes, reduction)


def repeat(pattern: str | bytes, x: Any, sizes: Mapping[str, int]) -> Any:
    """``shardops.repeat(pattern, x, **sizes)`` (see its docstring)."""
    return _run(repeat_recipe(pattern), x, sizes)


def _run(recipe: RearrangeRecipe, x: Any, sizes: Mapping[str, int], reduction: str = "") -> Any:
    """Check ``x``, run the einops op of ``recipe`` on the block, check and bind the result."""
    call = f"{recipe.op}({recipe.text!r}{', ' + repr(reduction) if reduction else ''})"
    manual = _manual(recipe, call)
    scope = current_scope()
    work = Scope(scope.owner)
    work.bindings = dict(scope.bindings)
    _bind_sizes(recipe, call, sizes, work)
    check_value(x, None, recipe.in_spec, work, where=f"{call} input", check_sharding=False)
    local = {}
    for t in recipe.split_groups:
        local.update(_group_sizes(recipe, call, t, work, manual))
    for name in recipe.new:
        local[recipe.names[name]] = _new_size(recipe, call, name, work, manual)
    x = _same(recipe, x)
    try:
        if recipe.op == "reduce":
            y = einops.reduce(x, recipe.local, reduction, **local)
        elif recipe.op == "repeat":
            y = einops.repeat(x, recipe.local, **local)
        else:
            y = einops.rearrange(x, recipe.local, **local)
    except einops.EinopsError as e:  # pragma: no cover - the checks above should catch it
        raise ValueError(
            f"{call}: einops refused the per-device pattern {recipe.local!r}: {e}"
        ) from e
    check_value(y, None, recipe.out_spec, work, where=f"{call} output", check_sharding=False)
    for name in recipe.sharding:
        scope.bindings.setdefault(name, work.bindings[name])
    return y


def _same(recipe: RearrangeRecipe, x: Any) -> Any:
    """``repeat``'s claim, checked by the analysis: ``x`` is the same on every device of the
    mesh axes its new dims are split over (each device makes only its block of them) and owes
    no sum over them."""
    split = [n for n in recipe.new if recipe.sharding[n]]
    if not split or not notes_on():
        return x
    axes = tuple(a for n in split for a in recipe.sharding[n])
    dims = ", ".join("/".join((n, *recipe.sharding[n])) for n in split)
    word = "dim" if len(split) == 1 else "dims"
    why = (
        f"(The new {word} {dims} is split over {'/'.join(axes)!r}: each device makes only its "
        "block of the repeats, which are blocks of one array only if the input is the same on "
        f"every device of {'/'.join(axes)!r}.) "
    )
    with jax.named_scope(OpScope(recipe.op, recipe.text).text()):
        return note(x, Note("same", axes, op=recipe.op, text=recipe.text, why=why))


def _new_size(
    recipe: RearrangeRecipe, call: str, name: str, work: Scope, manual: Mapping[str, int]
) -> int:
    """The local size of ``repeat``'s new dim ``name`` (its global size must be known)."""
    size = work.bindings.get(name)
    if size is None:
        raise TypeError(
            f"{call}: the size of the new dim {name} is unknown; pass its global size as a "
            f"keyword, e.g. {name}=4"
        )
    axes = recipe.sharding[name]
    n = math.prod(manual[a] for a in axes)
    if size % n:
        split = _devices(axes, manual)
        raise TypeCheckError(
            f"{call}: the new dim {name}={size} is split over {split}, but {size} is not "
            f"divisible by {n}; make {name} a multiple of {n}"
        )
    return size // n


def _devices(axes: tuple[str, ...], manual: Mapping[str, int]) -> str:
    """``'t=2'``, or ``'d=4 × t=2 = 8'``: the devices a dim is split over."""
    factor = " × ".join(f"{a}={manual[a]}" for a in axes)
    return factor + f" = {math.prod(manual[a] for a in axes)}" if len(axes) > 1 else factor


def _manual(recipe: RearrangeRecipe, call: str) -> dict[str, int]:
    """The manual mesh axes, after checking that the pattern's axes are among them."""
    manual = _context.manual_axis_sizes()
    for a in recipe.needs:
        if a not in manual:
            where = (
                f"the manual axes are {format_sizes(manual)}"
                if manual
                else "here no mesh axis is manual: run it inside a typed_shard_map body"
            )
            raise ValueError(
                f"{call}: the pattern splits a dim over mesh axis {a!r}, which is not a manual "
                f"axis of the enclosing shard_map; {where}"
            )
    return manual


def _bind_sizes(recipe: RearrangeRecipe, call: str, sizes: Mapping[str, int], work: Scope) -> None:
    """Add the keyword sizes (global) to ``work``; each must name a factor and agree."""
    for name, size in sizes.items():
        if name not in recipe.sharding:
            raise TypeError(
                f"{call}: keyword size {name}={size!r} names no dim of the pattern; pattern "
                f"dims: {', '.join(recipe.sharding)}"
            )
        size = _size_arg(call, name, size)
        bound = work.bindings.get(name)
        if bound is not None and bound != size:
            raise TypeCheckError(
                f"{call}: keyword size {name}={size} disagrees with the binding {name}={bound} "
                f"of the current scope ({work.describe()}); pass the global size"
            )
        work.bindings[name] = size


def _size_arg(call: str, name: str, size: Any) -> int:
    """A keyword size as a Python int: any Python or NumPy integer but a bool, at least 0."""
    if isinstance(size, bool | np.bool_) or not isinstance(size, int | np.integer):
        whole = isinstance(size, float | np.floating) and float(size).is_integer()
        raise TypeError(
            f"{call}: keyword size {name}={size!r} is a {type(size).__name__}; it must be a "
            "non-negative int (a Python or NumPy integer, not a bool), the global size of the "
            f"dim, e.g. {name}={int(size) if whole else 8}"
        )
    if size < 0:
        raise TypeError(
            f"{call}: keyword size {name}={size!r} is negative; it must be a non-negative int "
            "(the global size of the dim)"
        )
    return int(size)


def _group_sizes(
    recipe: RearrangeRecipe, call: str, t: Term, work: Scope, manual: Mapping[str, int]
) -> dict[str, int]:
    """The local size of each factor of input group ``t``, its global sizes bound in ``work``."""
    total = work.bindings[str(t.checked_dim().shape)]
    names = [f.name for f in t.factors]
    unknown = [n for n in names if n not in work.bindings]
    known = math.prod(work.bindings[n] for n in names if n not in unknown)
    if len(unknown) > 1:
        raise TypeCheckError(
            f"{call}: cannot split {t.text!r} (global size {total}): the sizes of "
            f"{', '.join(unknown)} are unknown; pass all but one as keywords (global sizes), "
            f"e.g. {unknown[0]}=..."
        )
    if unknown:
        if known == 0 or total % known:
            raise TypeCheckError(
                f"{call}: {t.text!r} has global size {total}, which is not a multiple of "
                f"{known} (the product of the known factors); check the keyword sizes"
            )
        work.bindings[unknown[0]] = total // known
    elif known != total:
        sizes = " × ".join(f"{n}={work.bindings[n]}" for n in names)
        raise TypeCheckError(
            f"{call}: {t.text!r} has global size {total}, but {sizes} = {known}; check the "
            "keyword sizes"
        )
    n = math.prod(manual[a] for a in t.axes)
    lead = names[0]
    if work.bindings[lead] % n:
        axes = _devices(t.axes, manual)
        raise TypeCheckError(
            f"{call}: {t.text!r} is split over {axes}, which puts the axes on its leading "
            f"factor {lead}; {lead}={work.bindings[lead]} is not divisible by {n}, so a "
            f"device's block is not a block of {lead}: pad {lead}, or reshard the merged dim "
            "to a layout the split keeps"
        )
    return {recipe.names[m]: work.bindings[m] // (n if i == 0 else 1) for i, m in enumerate(names)}
