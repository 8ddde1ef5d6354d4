"""The rules a pipeline schedule's arguments keep, and the message of each broken one (pure Python).

Plain functions of names, sizes and shapes: the counts ``p``, ``m``, ``v`` (positive ints;
the layer groups a schedule runs, `group_count_error`; ``m >= p`` where the schedule needs
it, `too_few_microbatches`), the stage axis (a manual axis), the microbatches (the same on
every stage), ``stage_fn``'s output (one block like its input) and its collectives (none over
the stage axis; `shardlib._pipeline.stage` reads a traced ``stage_fn``'s equations for that).
Each rule returns the message of a broken rule (or None); `check_counts` and `check_enough`
raise it. The schedules come from `shardlib._pipeline.registry`. No JAX here.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from typing import Any

from .._lang.fixes import manual_axis_error
from .._lang.parsing import ShapeSpec
from .._lang.scope_codec import OpScope
from .registry import Schedule

__all__ = [
    "axis_error",
    "chunk_count_error",
    "check_counts",
    "check_enough",
    "group_count_error",
    "microbatch_count_error",
    "op_name",
    "replicated_rule",
    "spec_split_error",
    "stage_collective_error",
    "stage_output_error",
    "too_few_microbatches",
]


def check_counts(fn: str, **counts: int) -> tuple[int, ...]:
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


def check_enough(fn: str, schedule: Schedule, p: int, m: int) -> None:
    """Refuse ``m < p`` where the schedule function does (circular, interleaved)."""
    bad = too_few_microbatches(fn, schedule, p, m)
    if bad is not None:
        raise ValueError(bad)


def group_count_error(fn: str, schedule: Schedule, v: int) -> str | None:
    """Why ``v`` layer groups per stage do not suit ``schedule`` (None: they do): circular
    and interleaved take any ``v``, zb-v two chunks, the others one group."""
    want = schedule.groups
    if want is None or v == want:
        return None
    if want == 2:
        return (
            f"{fn}: the {schedule.name} schedule has two layer chunks per stage, so argument "
            f"`v` must be 2 (its default for {schedule.name!r}: leave it out), got v={v}"
        )
    return f"{fn}: the {schedule.name} schedule has one layer group per stage, got v={v}"


def too_few_microbatches(fn: str, schedule: Schedule, p: int, m: int) -> str | None:
    """Why ``schedule`` cannot run ``m`` microbatches on ``p`` stages, or None: circular and
    interleaved send a microbatch's output of one layer group back to stage 0 for the next,
    ``p`` ticks after it left, so they need ``m >= p``, as `shardlib.pipeline.circular` and
    `shardlib.pipeline.interleaved` say (here for ``fn``'s arguments ``p`` and ``m``)."""
    if not schedule.needs_m_at_least_p or m >= p:
        return None
    return (
        f"{fn}: argument `m` must be at least `p` for the {schedule.name} schedule (at least "
        f"as many microbatches as stages, p={p}), got m={m}; use more microbatches or "
        f"{schedule.fallback}"
    )


def microbatch_count_error(schedule: Schedule, axis: str, n: int, m: int) -> str | None:
    """`too_few_microbatches` as the schedule function says it of its own arguments (the
    microbatches' leading dim ``m`` against the ``n`` devices of the stage ``axis``)."""
    if not schedule.needs_m_at_least_p or m >= n:
        return None
    return (
        f"{schedule.function}: argument `microbatches` must hold at least as many microbatches "
        f"as stages (axis {axis!r} has {n}), got m={m}; use more microbatches or "
        f"{schedule.fallback}"
    )


def chunk_count_error(schedule: Schedule, v: int | None) -> str | None:
    """Why ``stage_params`` with ``v`` groups on their leading dim do not suit a schedule of a
    fixed number of chunks (zb-v's two in a V), or None."""
    if schedule.groups is None or schedule.groups == 1 or v == schedule.groups:
        return None
    return (
        f"{schedule.function}: every leaf of argument `stage_params` must hold the stage's two "
        f"layer chunks on its leading dim ('v layers/p ...' with v = 2; see pipeline.to_groups "
        f"with route='v'), got v={v}"
    )


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
    scope = OpScope.innermost(name_stack)
    if scope is not None:
        what = f"{scope.PREFIX}{scope.op}({scope.spec!r}) ({what})"
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
