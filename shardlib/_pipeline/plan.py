"""The arithmetic of pipeline schedules, and the rules their arguments must keep.

Pure Python, no JAX: `work_items` is the rule `shardlib.pipeline`'s schedules apply on the
devices, `timeline` draws it, and the bubble fractions count its idle ticks. Public names are
re-exported by `shardlib.pipeline`. The schedules' argument rules live here too, as plain
functions of names, sizes and shapes that return the message of a broken rule (or None):
the stage axis must be a manual axis, the microbatches must be the same on every stage,
``stage_fn`` returns one block like its input and does not communicate over the stage axis
(`shardlib._pipeline.schedules` reads a traced ``stage_fn``'s equations for that). The named
scopes the schedules run under, which `shardlib.explain` reads, are `shardlib._pipeline.scopes`'s
(re-exported here).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .._lang.fixes import manual_axis_error
from .._lang.op_spec import SCOPE_PREFIX
from .._lang.parsing import ShapeSpec
from .scopes import SCHEDULE_SCOPE_PREFIX, ScheduleInfo, parse_schedule_scopes, schedule_scope
from .tables import SCHEDULES as TABLED_SCHEDULES
from .tables import bubble_fraction as _tabled_bubble
from .tables import (
    default_groups,
    group_count_error,
    schedule_table,
    table_timeline,
    too_few_microbatches,
)

__all__ = [
    "SCHEDULE_SCOPE_PREFIX",
    "SELECTING",
    "ScheduleInfo",
    "bubble_fraction",
    "circular_bubble_fraction",
    "gpipe_bubble_fraction",
    "axis_error",
    "parse_schedule_scopes",
    "replicated_rule",
    "schedule_scope",
    "spec_split_error",
    "stage_collective_error",
    "stage_output_error",
    "tick_policy",
    "timeline",
    "work_items",
]


def gpipe_bubble_fraction(p: int, m: int) -> float:
    """The fraction of GPipe's ticks in which a stage is idle: ``(p - 1) / (m + p - 1)``.

    GPipe runs ``m + p - 1`` ticks; each of the ``p`` stages works on ``m`` of them (one per
    microbatch) and idles on the other ``p - 1``, the bubble.

    **Arguments:** `p` the number of stages (>= 1); `m` the number of microbatches (>= 1).

    **Returns:** a float in ``[0, 1)``; ``0.0`` for one stage.

    Examples:
        >>> gpipe_bubble_fraction(4, 8)  # 3 idle ticks out of 11
        0.2727272727272727
    """
    p, m = _check_counts("gpipe_bubble_fraction", p=p, m=m)
    return (p - 1) / (m + p - 1)


def circular_bubble_fraction(p: int, m: int, v: int) -> float:
    """The fraction of the circular schedule's ticks in which a stage is idle.

    ``(p - 1) / (v * m + p - 1)``: the schedule runs ``v * m + p - 1`` ticks, each stage works
    on ``v * m`` of them (each microbatch once per layer group it holds) and idles ``p - 1``.
    With ``v = 1`` it is GPipe's.

    **Arguments:** `p` stages, `m` microbatches (``m >= p``, as `circular` needs), `v`
    layer groups per stage (all >= 1).

    **Returns:** a float in ``[0, 1)``.

    **Raises:** ``ValueError`` for ``m < p``, which `circular` refuses.

    Examples:
        >>> circular_bubble_fraction(4, 8, 2)  # 3 idle ticks out of 19
        0.15789473684210525
    """
    p, m, v = _check_counts("circular_bubble_fraction", p=p, m=m, v=v)
    _check_enough("circular_bubble_fraction", "circular", p, m)
    return (p - 1) / (v * m + p - 1)


def timeline(schedule: str, p: int, m: int, v: int | None = None) -> str:
    """What each stage works on at each tick, as a text table (bubbles ``.``).

    Rows are stages, columns ticks. For ``'gpipe'`` and ``'circular'`` a cell is the
    microbatch index of the forward (``jax.grad`` runs the picture backwards), with a letter
    for the pass round the ring in the circular schedule (``a`` the first layer group...).
    For the others a cell is the tick's work, fused: ``F3`` (forward of microbatch 3), ``B3``
    (its backward; zero bubble: the input cotangent), ``W3`` (the weight gradient), or several
    at once (``F4B0``, ``F5B1W0``), with the group letter where a stage holds several (``F3b``).

    **Arguments:** `schedule` one of ``'gpipe'``, ``'circular'``, ``'1f1b'``,
    ``'interleaved'``, ``'zb-h1'``, ``'zb-v'``; `p` stages; `m` microbatches; `v` layer groups
    per stage (None: 2 for ``'zb-v'``, which always has two chunks, else 1).

    **Returns:** the table, one line per stage after a header of tick numbers.

    **Raises:** ``ValueError`` for what the schedule itself refuses: ``m < p`` for
    ``'circular'`` and ``'interleaved'``, ``v != 2`` for zb-v, ``v > 1`` for the others.
    Examples:
        >>> print(timeline('gpipe', 2, 3))
        tick     0  1  2  3
        stage 0  0  1  2  .
        stage 1  .  0  1  2
        >>> print(timeline('1f1b', 2, 2))
        tick       0    1    2    3
        stage 0   F0   F1   B0   B1
        stage 1    . F0B0 F1B1    .
    """
    names = ("gpipe", "circular", *TABLED_SCHEDULES)
    if schedule not in names:
        raise ValueError(
            f"timeline: `schedule` must be one of {', '.join(map(repr, names))}, got {schedule!r}"
        )
    p, m, v = _check_counts("timeline", p=p, m=m, v=default_groups(schedule, v))
    bad = group_count_error("timeline", schedule, v)
    if bad:
        raise ValueError(bad)
    _check_enough("timeline", schedule, p, m)
    if schedule in TABLED_SCHEDULES:
        return table_timeline(schedule_table(schedule, p, m, v))
    rows = _items(p, m, v)
    ticks = len(rows[0])
    cell = 2 + max(len(str(ticks - 1)), len(str(m - 1)) + (schedule == "circular"))

    def label(item: tuple[int, int] | None) -> str:
        if item is None:
            return "."
        mb, r = item
        return f"{mb}{chr(ord('a') + r)}" if schedule == "circular" else str(mb)

    width = len(f"stage {p - 1}")
    lines = [f"{'tick':<{width}}" + "".join(f"{t:>{cell}}" for t in range(ticks))]
    for s, row in enumerate(rows):
        lines.append(f"{f'stage {s}':<{width}}" + "".join(f"{label(i):>{cell}}" for i in row))
    return "\n".join(line.rstrip() for line in lines)


def bubble_fraction(schedule: str, p: int, m: int, v: int | None = None) -> float:
    """The share of the step a stage idles under ``schedule`` (at ``T_F = T_B = T_W``, see
    `critical_path`): ``gpipe`` and ``1f1b`` ``(p-1)/(m+p-1)``; ``circular`` and
    ``interleaved`` ``(p-1)/(v m+p-1)``; ``zb-h1`` less than 1F1B (``2 (p-1)/(3 m+2 (p-1))``
    for ``m >= p``): one less the stage's work over the lockstep critical path.

    **Arguments:** `schedule` as for `timeline`; `p`, `m`, `v` (all >= 1; `v` as `timeline`'s).

    **Returns:** a float in ``[0, 1)``.

    **Raises:** ``ValueError`` as `timeline` does (``m < p`` for ``'circular'`` and
    ``'interleaved'``, which refuse it).

    Examples:
        >>> bubble_fraction('zb-h1', 4, 8)  # 6 idle units of 30
        0.2
    """
    p, m, v = _check_counts("bubble_fraction", p=p, m=m, v=default_groups(schedule, v))
    _check_enough("bubble_fraction", schedule, p, m)
    bad = group_count_error("bubble_fraction", schedule, v)
    if bad:
        raise ValueError(bad)
    if schedule == "gpipe":
        return gpipe_bubble_fraction(p, m)
    if schedule == "circular":
        return circular_bubble_fraction(p, m, v)
    if schedule in TABLED_SCHEDULES:
        return _tabled_bubble(schedule, p, m, v)
    names = ", ".join(map(repr, ("gpipe", "circular", *TABLED_SCHEDULES)))
    raise ValueError(f"bubble_fraction: `schedule` must be one of {names}, got {schedule!r}")


def work_items(p: int, m: int, v: int = 1) -> list[list[tuple[int, int] | None]]:
    """``[stage][tick]``: the (microbatch, pass) a stage works on, or None in a bubble tick.

    Stage ``s`` at tick ``t`` works on item ``k = t - s`` when ``0 <= k < v * m``: microbatch
    ``k % m`` in pass ``k // m`` (GPipe is ``v = 1``). This is the rule `gpipe` and `circular`
    apply on the devices.

    **Arguments:** `p` stages, `m` microbatches, `v` layer groups per stage (all >= 1;
    ``m >= p`` when ``v > 1``, as `circular` needs).

    **Returns:** a list of ``p`` rows of ``v * m + p - 1`` entries.

    **Raises:** ``ValueError`` for ``v > 1`` with ``m < p``: `circular` refuses it (pass
    ``v`` of microbatch ``i`` would start on stage 0 before its pass ``v - 1`` has left the
    last stage).

    Examples:
        >>> work_items(2, 2)  # GPipe, 2 stages, 2 microbatches
        [[(0, 0), (1, 0), None], [None, (0, 0), (1, 0)]]
    """
    p, m, v = _check_counts("work_items", p=p, m=m, v=v)
    if v > 1:
        _check_enough("work_items", "circular", p, m)
    return _items(p, m, v)


def _items(p: int, m: int, v: int) -> list[list[tuple[int, int] | None]]:
    ticks = v * m + p - 1
    return [
        [((t - s) % m, (t - s) // m) if 0 <= t - s < v * m else None for t in range(ticks)]
        for s in range(p)
    ]


def _check_enough(fn: str, schedule: str, p: int, m: int) -> None:
    """Refuse ``m < p`` where the schedule function does (circular, interleaved)."""
    bad = too_few_microbatches(fn, schedule, p, m)
    if bad is not None:
        raise ValueError(bad)


def _check_counts(fn: str, **counts: int) -> tuple[int, ...]:
    """The counts as Python ints (NumPy integers accepted, as `to_groups` does), in the
    order given; a bool, a float or a count below 1 refused."""
    what = {"p": "stages", "m": "microbatches", "v": "layer groups per stage"}
    out = []
    for name, value in counts.items():
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
            raise ValueError(
                f"{fn}: argument `{name}` must be a positive int (number of {what[name]}), "
                f"got {value!r}"
            )
        out.append(int(value))
    return tuple(out)


# ---------------------------------------------------------------------------------------------
# The rules a schedule's arguments keep: each returns the message of a broken rule, or None
# ---------------------------------------------------------------------------------------------


def axis_error(
    fn: str, axis: Any, manual: Mapping[str, int], mesh: Mapping[str, int]
) -> str | None:
    """Why ``axis`` cannot be ``fn``'s stage axis (it must be a manual axis here), or None."""
    must = "name the stage mesh axis, manual in this shard_map body"
    return manual_axis_error(fn, "axis", axis, manual, mesh, must=must, example="p")


def replicated_rule(axis: str, n: int) -> str:
    """The rule the microbatches keep, and how to keep it (a sentence to follow ``fn: ``)."""
    return (
        f"microbatches must be replicated over the stage axis {axis!r} ({n} stages): stage 0 "
        f"feeds every microbatch into the pipeline, so every device of {axis!r} must hold all "
        f"of them, the same; annotate them without {axis!r} (such as 'm B M', not "
        f"'m/{axis} B M'), or gather them over {axis!r} before the call (shardops.all_gather), "
        f"and take as the stage axis a mesh axis the microbatches are not split over"
    )


def spec_split_error(fn: str, spec: ShapeSpec, axis: str, n: int) -> str | None:
    """Why ``spec`` (one microbatch block) breaks the rule: it is split over the stage axis."""
    for d in spec.dims:
        if axis in d.sharding:
            return (
                f"{fn}: {replicated_rule(axis, n)}. Here argument `spec` {str(spec)!r} splits "
                f"dim {str(d)!r} of each microbatch over {axis!r}"
            )
    return None


def stage_output_error(
    fn: str,
    spec: ShapeSpec,
    manual: Mapping[str, int],
    want: tuple[Sequence[int], str],
    got: tuple[Sequence[int], str] | str,
) -> str | None:
    """Why ``stage_fn``'s output ``got`` (per-device shape and dtype name, or a description of
    a value that is not one array) is not a block like its input ``want``, or None."""
    if not isinstance(got, str) and tuple(got[0]) == tuple(want[0]) and got[1] == want[1]:
        return None
    head = (
        f"{fn}: `stage_fn` must return one block of its input's shape and dtype, spec "
        f"{str(spec)!r} (it is the next stage's input): expected {_block(spec, manual, *want)}"
    )
    if isinstance(got, str):
        return f"{head}, got {got}; return only the block"
    return f"{head}, got {_block(spec, manual, *got)}"


def _block(spec: ShapeSpec, manual: Mapping[str, int], shape: Sequence[int], dtype: str) -> str:
    """``float32[8, 16] (global; per device [4, 16])``: global sizes under ``spec``."""
    local = "[" + ", ".join(str(k) for k in shape) + "]"
    if len(shape) != len(spec.dims):
        return f"{dtype} of per-device shape {local} (rank {len(shape)}, not the spec's)"
    sizes = [
        k * math.prod(manual.get(a, 1) for a in d.sharding)
        for k, d in zip(shape, spec.dims, strict=True)
    ]
    if list(sizes) == list(shape):
        return f"{dtype}{local}"
    return f"{dtype}[{', '.join(map(str, sizes))}] (global; per device {local})"


def op_name(primitive: str, name_stack: str) -> str:
    """How a message names an equation: its ``primitive``, under the ``shardops`` op as
    written when its ``name_stack`` has a ``shardops.OP[SPEC]`` scope."""
    what = f"`{primitive}`"
    at = name_stack.rfind(SCOPE_PREFIX)
    if at >= 0:
        op, _, rest = name_stack[at:].partition("[")
        if "]" in rest:
            what = f"{op}({rest[: rest.rfind(']')]!r}) ({what})"
    return what


def stage_collective_error(
    fn: str, axis: str, primitive: str, name_stack: str, where: str | None
) -> str:
    """The message for a ``stage_fn`` that runs a collective over the stage axis: the
    ``primitive``, under its ``shardops`` name when its ``name_stack`` has one, at ``where``."""
    what = op_name(primitive, name_stack)
    return (
        f"{fn}: `stage_fn` must not communicate over the stage axis {axis!r}, but it runs "
        f"{what}{f' at {where}' if where else ''}: at each tick every stage works on a "
        f"different microbatch (or none), so a collective over {axis!r} inside the stage "
        f"mixes microbatches and stages. Use collectives over the other mesh axes only in "
        f"`stage_fn` (the schedule moves blocks between stages itself), and run any "
        f"collective over {axis!r} before or after the schedule"
    )


# Primitives that only select or rearrange elements: cheap to recompute from their input.
SELECTING = frozenset(
    {
        "dynamic_slice",
        "slice",
        "squeeze",
        "reshape",
        "gather",
        "transpose",
        "broadcast_in_dim",
        "convert_element_type",
        "copy",
        "expand_dims",
    }
)


def tick_policy(stage_fn: Callable, policy: Callable[..., bool] | None) -> Callable[..., bool]:
    """The checkpoint policy of one circular tick: ``policy`` (or the one
    `jax_extra.explicit_activation_checkpointing` gave ``stage_fn``; else: save every value),
    except that selections of elements (weight slices above all) are never saved."""
    chosen = policy if policy is not None else getattr(stage_fn, "checkpoint_policy", None)

    def keep(prim: Any, *args: Any, **params: Any) -> bool:
        if prim.name in SELECTING:
            return False
        return True if chosen is None else bool(chosen(prim, *args, **params))

    return keep
