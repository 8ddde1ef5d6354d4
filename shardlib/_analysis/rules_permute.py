"""The partial-sum rule of ``ppermute`` (``shardops.ppermute``, ``shardops.shift``, rings).

A permutation is linear, and a *full* one over the axes a value is pending over keeps the sum:
every device's share still lands on exactly one device of the same group, so the shares that
``psum`` adds up are the same ones, moved. Permuting a partial sum over its pending axes is
therefore allowed when shardlib can prove that:

- the permutation is full over its axes: each device index ``0 .. n - 1`` (``n``: the product
  of the axes' sizes, known from the mesh, `Ctx.sizes`) is a source once and a destination
  once. A device that receives nothing gets zeros and a block sent nowhere is dropped, so a
  partial permutation loses shares of the sum;
- it maps each *fiber* onto a fiber: the devices that share their coordinates on the
  permuted axes that are not pending (the devices one sum runs over) all send to devices of
  one such group, so no group's sum gets another group's shares.

``ppermute`` over several axes numbers the devices row-major over them. Older JAX orders
them as the mesh does, newer as the equation names them (and refuses a difference unless
told not to): where the two differ, the fibers must map onto fibers in both numberings.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .._env.programs import optional_param, param
from .facts import Ctx, Pend, St, axes_text, fail

__all__ = ["MOVE_FIX_PERMUTE", "ppermute_rule"]

MOVE_FIX_PERMUTE = (
    "Send it round a full cycle instead (every device of the axes sends once and receives "
    "once, as shardops.shift(..., wrap=True) does), which keeps it a partial sum of the same "
    "total, or reduce it first (psum over those axes) and send the reduced value"
)

Pairs = tuple[tuple[int, int], ...]


def ppermute_rule(eqn: Any, states: Sequence[St], ctx: Ctx) -> list[St]:
    """``ppermute``: the result varies over its axes; a partial sum over some of them stays
    one when the permutation keeps its sums (see the module docstring), else it is refused.
    A known-zero value stays known zero (and passes any permutation: zeros moved or
    dropped are zeros)."""
    axes = _ordered_axes(eqn)
    named = frozenset(axes)
    outs = []
    for s in states:
        if s.pend is not None and s.pend.axes & named and not s.zero:
            _check_keeps_sum(eqn, s.pend, axes, ctx)
        outs.append(St(s.pend, s.zero, s.vary | named))
    return outs


def _ordered_axes(eqn: Any) -> tuple[Any, ...]:
    """The equation's axis names in the order it names them (non-str entries kept, so that
    their unknown size refuses the permutation)."""
    name = optional_param(eqn, "axis_name")
    if name is None:
        name = optional_param(eqn, "axes")
    return tuple(name) if isinstance(name, tuple | list) else (name,)


def _check_keeps_sum(eqn: Any, pend: Pend, axes: tuple[Any, ...], ctx: Ctx) -> None:
    """Raise unless the permutation of ``eqn`` over ``axes`` keeps every sum over
    ``pend.axes``: full, and mapping fibers onto fibers in every numbering JAX may use."""
    unknown = [a for a in axes if not isinstance(a, str) or a not in ctx.sizes]
    if unknown:
        raise fail(
            ctx,
            eqn,
            pend,
            f"permutes over {_axes_words(axes)}, whose size{'s' if len(axes) > 1 else ''} "
            f"shardlib does not know (no mesh size for {', '.join(map(repr, unknown))}), so "
            "shardlib cannot prove the permutation is full (that every device sends once and "
            "receives once), which keeping the sum needs; it moves",
            MOVE_FIX_PERMUTE,
        )
    names = tuple(str(a) for a in axes)
    pairs: Pairs = tuple((int(s), int(d)) for s, d in param(eqn, "perm"))
    sizes = [ctx.sizes[a] for a in names]
    missing = _missing(pairs, int(np.prod(sizes)))
    if missing is not None:
        raise _partial(eqn, pend, names, sizes, missing, ctx)
    for order in _numberings(names, ctx.sizes):
        mixed = _mixed_fiber(pairs, order, [ctx.sizes[a] for a in order], pend.axes)
        if mixed is not None:
            raise _mixes(eqn, pend, order, mixed, ctx)


def _numberings(axes: tuple[str, ...], sizes: Mapping[str, int]) -> list[tuple[str, ...]]:
    """The orders JAX may number the devices of ``axes`` in: as named, and as in the mesh."""
    mesh_order = tuple(a for a in sizes if a in axes)
    return [axes] if mesh_order == axes else [axes, mesh_order]


def _missing(pairs: Pairs, n: int) -> tuple[list[int], list[int]] | None:
    """(devices that receive nothing, devices whose block is sent nowhere), or None when the
    permutation is full over ``n`` devices."""
    sources = {s for s, _ in pairs}
    dests = {d for _, d in pairs}
    deaf = [k for k in range(n) if k not in dests]
    mute = [k for k in range(n) if k not in sources]
    return (deaf, mute) if deaf or mute else None


def _coords(k: int, sizes: Sequence[int]) -> tuple[int, ...]:
    return tuple(int(c) for c in np.unravel_index(k, tuple(sizes)))


def _mixed_fiber(
    pairs: Pairs, order: tuple[str, ...], sizes: Sequence[int], pending: frozenset[str]
) -> tuple[dict[str, int], list[dict[str, int]]] | None:
    """A fiber (its coordinates on the permuted axes that are not pending) whose devices send
    to several fibers, with those fibers; or None when every fiber maps onto one fiber."""
    keep = [i for i, a in enumerate(order) if a not in pending]
    if not keep:
        return None

    def fiber(k: int) -> tuple[int, ...]:
        c = _coords(k, sizes)
        return tuple(c[i] for i in keep)

    image: dict[tuple[int, ...], set[tuple[int, ...]]] = {}
    for s, d in pairs:
        image.setdefault(fiber(s), set()).add(fiber(d))
    names = [order[i] for i in keep]
    for src, dsts in sorted(image.items()):
        if len(dsts) > 1:
            named = [dict(zip(names, f, strict=True)) for f in (src, *sorted(dsts))]
            return named[0], named[1:]
    return None


def _axes_words(axes: tuple[Any, ...]) -> str:
    return axes_text(axes) if all(isinstance(a, str) for a in axes) else repr(axes)


def _device(k: int, axes: tuple[str, ...], sizes: Sequence[int]) -> str:
    """How a message names device ``k`` of the permutation: ``0 of 'i'``, ``5 (d=1, i=1)``."""
    if len(axes) == 1:
        return f"{k} of {axes[0]!r}"
    where = ", ".join(f"{a}={c}" for a, c in zip(axes, _coords(k, sizes), strict=True))
    return f"{k} ({where}) of {axes!r}"


def _listed(ks: list[int], axes: tuple[str, ...], sizes: Sequence[int]) -> str:
    shown = [_device(k, axes, sizes) for k in ks[:4]]
    more = f" and {len(ks) - 4} more" if len(ks) > 4 else ""
    return ", ".join(shown) + more


def _partial(
    eqn: Any,
    pend: Pend,
    axes: tuple[str, ...],
    sizes: Sequence[int],
    missing: tuple[list[int], list[int]],
    ctx: Ctx,
) -> Exception:
    deaf, mute = missing
    s_deaf = "s" if len(deaf) > 1 else ""
    parts = []
    if deaf:
        verb = "receive" if len(deaf) > 1 else "receives"
        parts.append(f"device{s_deaf} {_listed(deaf, axes, sizes)} {verb} nothing")
    if mute:
        whose = "the blocks of devices" if len(mute) > 1 else "the block of device"
        verb = "are" if len(mute) > 1 else "is"
        parts.append(f"{whose} {_listed(mute, axes, sizes)} {verb} sent nowhere")
    return fail(
        ctx,
        eqn,
        pend,
        f"is not a full permutation over {axes_text(axes)} ({' and '.join(parts)}): a device "
        "that receives no block gets zeros and a block that is not sent is dropped, so the "
        f"sum over {axes_text(pend.axes & set(axes))} would lose those shares; it moves",
        MOVE_FIX_PERMUTE,
    )


def _mixes(
    eqn: Any,
    pend: Pend,
    order: tuple[str, ...],
    mixed: tuple[dict[str, int], list[dict[str, int]]],
    ctx: Ctx,
) -> Exception:
    src, dsts = mixed

    def text(f: dict[str, int]) -> str:
        return "(" + ", ".join(f"{a}={c}" for a, c in f.items()) + ")"

    summed = axes_text(pend.axes & set(order))
    return fail(
        ctx,
        eqn,
        pend,
        f"permutes over {axes_text(order)} (devices numbered row-major over {order!r}) and "
        f"sends the devices of group {text(src)}, whose shares make one sum over {summed}, "
        f"to several groups ({', '.join(map(text, dsts))}), so each group's sum would mix "
        "shares of different sums; it moves",
        "Keep each group together: every device of a group (the same coordinates on the "
        f"permuted axes other than {summed}) must send into one group, e.g. a cycle over "
        f"{summed} alone; or reduce it first (psum over those axes) and send the reduced value",
    )
