"""Where each piece of a schedule's work goes: the tick of every F, B and W (pure Python).

A piece of work is ``(kind, stage, microbatch, group)``: kind ``F`` (forward), ``B``
(backward, or its input half in the zero-bubble schedules) or ``W`` (weight half). Two
routes take a microbatch through the layer groups:

- **ring** (1F1B, interleaved, ZB-H1): group ``r`` runs on stages ``0 .. p-1`` in order; the
  last stage sends group ``r``'s output round the ring to stage 0 for group ``r + 1``; the
  loss follows the last group on the last stage; cotangents run the other way.
- **V** (ZB-V): two groups (chunks) per stage; chunk 0 runs down stages ``0 .. p-1``, the
  last stage goes straight on to its chunk 1, which runs back up to stage 0, where the loss
  is; the backward retraces the V. Stage ``s`` holds layer groups ``s`` and ``2p - 1 - s``.

`place` (`lay_out`) puts every piece at a tick (the table's layout: `shardlib._pipeline.tables`);
`dependency` and `source` say what a piece waits for and where its input comes from. No JAX.
"""

from __future__ import annotations

from collections import deque

from .registry import schedule_named

__all__ = ["FROM_NEXT", "FROM_PREV", "FROM_SELF", "Placement", "dependency", "lay_out",
           "loss_here", "place", "source"]  # fmt: skip

Placement = dict[tuple[str, int, int, int], int]  # (kind letter, stage, microbatch, group)

# Where an arriving block comes from: the stage before (the shift towards higher stages),
# the stage after (the shift towards lower ones), or the stage's own output of the tick before.
FROM_PREV, FROM_NEXT, FROM_SELF = range(3)


def loss_here(route: str, s: int, r: int, p: int, v: int) -> bool:
    """Whether stage ``s``'s forward of group ``r`` ends in the loss."""
    return (s, r) == ((0, 1) if route == "v" else (p - 1, v - 1))


def place(schedule: str, p: int, m: int, v: int) -> Placement:
    """``{(kind, stage, microbatch, group): tick}`` for every piece of work of the schedule
    called ``schedule`` (one `shardlib._pipeline.registry` knows)."""
    s = schedule_named(schedule, "place")
    return lay_out(s.route, p, m, v, backward=True, split=s.split)


def lay_out(route: str, p: int, m: int, v: int, *, backward: bool, split: bool) -> Placement:
    """`place` on ``route`` (``'ring'`` or ``'v'``): forwards only unless ``backward``, and
    with ``split`` each backward's weight half ``W`` placed apart from its ``B``."""
    if route == "v":
        done = _place_v(p, m, forward_only=not backward)
    else:
        done = _place_ring(p, m, v, forward_only=not backward)
    if split:
        done.update(_place_weights(p, done, lag=p - 1))
    return done


def _place_ring(p: int, m: int, v: int, *, forward_only: bool) -> Placement:
    """Forward item ``k`` (Megatron's order, `_orders`) on stage ``s`` at tick ``k + s``,
    backward item ``k`` at ``k + D - s``, ``D`` the least delay at which every item's
    backward on the last stage comes no earlier than its loss (same tick: the loss's forward
    runs first) and after its group after's backward on stage 0."""
    fwd, bwd = _orders(p, m, v)
    done: Placement = {}
    for k, (i, r) in enumerate(fwd):
        for s in range(p):
            done[("F", s, i, r)] = k + s
    if forward_only:
        return done
    at_f = {it: k for k, it in enumerate(fwd)}
    delay = max(at_f[(i, v - 1)] - k for k, (i, r) in enumerate(bwd) if r == v - 1) + 2 * p - 2
    for k, (i, r) in enumerate(bwd):
        for s in range(p):
            done[("B", s, i, r)] = k + delay - s
    return done


def _place_v(p: int, m: int, *, forward_only: bool) -> Placement:
    """Microbatch ``j``'s forward at position ``q`` of the V (``q < p``: stage ``q``, chunk 0;
    else stage ``2p - 1 - q``, chunk 1) at tick ``2j + q``; its backward at position ``q``
    of the reversed V (chunk 1 up from stage 0, then chunk 0 down) at ``2j + 2p - 1 + q``.
    A stage's two chunks fall on ticks of opposite parity, so every stage runs one forward
    and one backward per tick in the steady state, and in one tick its forward output and
    its cotangent go opposite ways."""
    done: Placement = {}
    for j in range(m):
        for q in range(2 * p):
            s = q if q < p else 2 * p - 1 - q
            done[("F", s, j, int(q >= p))] = 2 * j + q
            if not forward_only:
                done[("B", s, j, int(q < p))] = 2 * j + 2 * p - 1 + q
    return done


def _orders(p: int, m: int, v: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """The items in forward order and in backward order: Megatron's interleaved order,
    by chunks of microbatches (`chunks`), each chunk group by group (the backward with
    the groups reversed); with ``v = 1`` microbatch order."""
    sizes = chunks(p, m)
    return _by_chunks(sizes, range(v)), _by_chunks(sizes, range(v - 1, -1, -1))


def chunks(p: int, m: int) -> list[int]:
    """The sizes of the runs of consecutive microbatches the interleaved order takes group
    by group: ``m // p`` chunks (one if ``m < p``), as even as can be, the larger first.

    Megatron's chunks of ``p`` when ``p`` divides ``m``. No chunk may be smaller than ``p``:
    a microbatch's next group on stage 0 (its forward, and the backward of its group before
    on the last stage) waits for its previous one to come round the ring of ``p`` stages."""
    n = max(1, m // p)
    return [m // n + (k < m % n) for k in range(n)]


def _by_chunks(sizes: list[int], groups: range) -> list[tuple[int, int]]:
    """Items ``(microbatch, group)`` chunk by chunk, each chunk's items group by group."""
    out: list[tuple[int, int]] = []
    start = 0
    for size in sizes:
        out += [(i, r) for r in groups for i in range(start, start + size)]
        start += size
    return out


def _place_weights(p: int, done: Placement, lag: int) -> Placement:
    """Each stage's ``W`` in its ``B`` order, at the first tick from its ``B`` on where one
    more unit makes no tick longer than its busiest stage's ``F`` and ``B`` already make it,
    or at ``lag`` ticks after its ``B`` (the deadline that bounds the residuals held), one
    ``W`` per stage and tick; after the last ``B`` every stage runs one a tick."""
    load: dict[tuple[int, int], int] = {}
    for (_, s, _, _), t in done.items():
        load[(s, t)] = load.get((s, t), 0) + 1
    end = max(done.values()) + 1
    queue = [
        deque(sorted((t, i, r) for (k, s_, i, r), t in done.items() if k == "B" and s_ == s))
        for s in range(p)
    ]
    waiting: list[deque[tuple[int, int, int]]] = [deque() for _ in range(p)]
    out: Placement = {}
    t = 0
    while any(queue) or any(waiting):
        for s in range(p):
            while queue[s] and queue[s][0][0] <= t:
                waiting[s].append(queue[s].popleft())
        budget = max(load.get((s, t), 0) for s in range(p))
        for s in range(p):
            if waiting[s] and (t >= end or waiting[s][0][0] + lag <= t):
                budget = max(budget, load.get((s, t), 0) + 1)
        for s in range(p):
            if waiting[s] and load.get((s, t), 0) + 1 <= budget:
                _, i, r = waiting[s].popleft()
                out[("W", s, i, r)] = t
        t += 1
    return out


def source(route: str, kind: str, s: int, i: int, r: int, p: int, v: int
           ) -> tuple[tuple[str, int, int, int], int] | None:  # fmt: skip
    """Where the input (``kind`` F) or the cotangent (B) of item (i, r) on stage ``s`` comes
    from: the piece that makes it and the direction (`FROM_PREV`, `FROM_NEXT`, `FROM_SELF`);
    None for stage 0's microbatches and for the loss's own cotangent."""
    if route == "v":
        if kind == "F":
            if r == 0:
                return None if s == 0 else (("F", s - 1, i, 0), FROM_PREV)
            return (("F", s, i, 0), FROM_SELF) if s == p - 1 else (("F", s + 1, i, 1), FROM_NEXT)
        if r == 1:
            return None if s == 0 else (("B", s - 1, i, 1), FROM_PREV)
        return (("B", s, i, 1), FROM_SELF) if s == p - 1 else (("B", s + 1, i, 0), FROM_NEXT)
    if kind == "F":
        if s > 0:
            return ("F", s - 1, i, r), FROM_PREV
        return None if r == 0 else (("F", p - 1, i, r - 1), FROM_PREV)
    if loss_here(route, s, r, p, v):
        return None
    return (("B", s + 1, i, r) if s < p - 1 else ("B", 0, i, r + 1)), FROM_NEXT


def dependency(route: str, kind: str, s: int, i: int, r: int, p: int, v: int
               ) -> tuple[str, int, int, int] | None:  # fmt: skip
    """What must have finished before ``kind`` of item (i, r) on stage s: in a table, at an
    earlier tick, or the loss's forward and a ``W``'s ``B`` earlier in the same tick."""
    if kind == "W":
        return ("B", s, i, r)
    if kind == "B" and loss_here(route, s, r, p, v):
        return ("F", s, i, r)
    found = source(route, kind, s, i, r, p, v)
    return None if found is None else found[0]
