"""The memory-bounded pipeline schedules against GPipe: temp bytes by ``m``, ticks, HLO, step time.

Part of the pipeline part of ``python -m benchmarks`` (:mod:`benchmarks.pipeline_bench` runs
it). One training step (``value_and_grad`` of the summed loss + SGD, one ``jit``) of ``L``
residual MLP layers (``h + relu(h @ w_in) @ w_out``, unrolled inside the stage) on a
``(4, 2)`` mesh ``('p', 'd')`` with Auto axes: ``p = 4`` stages, each microbatch's rows
split over ``d``; the loss of a microbatch (its squared error, summed over ``d``) is taken on
the last stage by ``pipeline.pipeline_loss(..., schedule=...)``, for ``gpipe``, ``1f1b``,
``interleaved`` (``v = 2`` layer groups per stage) and ``zb-h1``. For each schedule:

1. :func:`structure_sweep`, at ``m = 2p, 8p, 32p``: the compiled step's temp bytes
   (``memory_analysis().temp_size_in_bytes``), its ``while`` loops and their trip counts,
   and its collective-permutes (instructions and runs per step, loop trip counts applied,
   read by :mod:`shardlib._explain.hlo`), beside the tick count of the schedule's formula and
   of ``pipeline.timeline``;
2. :func:`step_times`, at one ``m``: interleaved pairs ``X / gpipe`` for each new schedule
   and a ``gpipe' / gpipe`` control (a second compiled copy of the GPipe step), the house
   method of :func:`benchmarks.measures.step_times` (order alternating, garbage collector
   off, median of per-pair ratios with a bootstrap 95% interval).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from benchmarks import _pipeline as pp
from benchmarks._pipeline import DATA_SPEC, Stack
from benchmarks.measures import paired_step_times
from shardlib import pipeline, shardops
from shardlib._explain.hlo import collectives, parse_module
from shardlib._pipeline.tables import schedule_table
from shardlib.shardtypes import Array, f32, make_shardings, pytree_dataclass, typed_shard_map

__all__ = [
    "COMPARISONS",
    "MESH_AXES",
    "MESH_SHAPE",
    "NEW",
    "PERMUTES_PER_TICK",
    "SCHEDULES",
    "SIZES",
    "TARGETS",
    "V",
    "Groups",
    "compiled_structure",
    "flatness",
    "inputs",
    "linear",
    "loops_ok",
    "make_mesh",
    "run",
    "sgd_step",
    "render_paths",
    "step_times",
    "structure_sweep",
    "tick_formula",
]

MESH_SHAPE = (4, 2)
MESH_AXES = ("p", "d")
V = 2  # layer groups per stage: interleaved
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-v")
NEW = SCHEDULES[1:]
GROUPED = ("interleaved", "zb-v")
# collective-permutes per tick of the schedule's loop: GPipe sends the activation on in its
# forward loop and the cotangent back in the transposed loop (one each, two loops); the
# training loop of the others sends both at every tick (ZB-H1's W ticks too: one program).
PERMUTES_PER_TICK = {"gpipe": 1, "1f1b": 2, "interleaved": 2, "zb-h1": 2, "zb-v": 2}
TARGETS = {"flat": 1.10}  # temp bytes at m = 8p and 32p / at m = 2p, memory-bounded schedules


SIZES: dict[str, dict[str, Any]] = {
    "tiny": {
        "config": pp.PipelineConfig(layers=8, d_model=16, d_ff=32, rows=8, microbatches=8),
        "per_stage": (2, 8),
        "step_per_stage": 2,
    },
    "full": {  # the microbatch count is set per measurement
        "config": pp.PipelineConfig(layers=8, d_model=128, d_ff=512, rows=32, microbatches=8),
        "per_stage": (2, 8, 32),  # temp bytes etc. at m = 2p, 8p, 32p
        "step_per_stage": 2,  # step time at m = 2p
    },
}


@pytree_dataclass
class Groups:  # interleaved's layout: v layer groups per stage
    w_in: f32[Array, b"v layers/p M F"]
    w_out: f32[Array, b"v layers/p F M"]


def tick_formula(schedule: str, p: int, m: int, v: int = V) -> int:
    """Ticks of the schedule's loop (GPipe: of each of its two loops): GPipe ``m + p - 1``,
    1F1B ``m + 2p - 2`` (fused ticks), the tables' length for interleaved and ZB-H1."""
    if schedule == "gpipe":
        return m + p - 1
    if schedule == "1f1b":
        return m + 2 * p - 2
    return schedule_table(schedule, p, m, v if schedule in GROUPED else 1).ticks


def _stage(s: Any, h: jax.Array) -> jax.Array:
    """One stage's layers in order, unrolled (no inner loop: the program's loops are the
    schedule's); ``s.w_in[i]`` is a slice of the weights, not a copy kept per microbatch."""
    for i in range(s.w_in.shape[0]):
        h = h + jax.nn.relu(h @ s.w_in[i]) @ s.w_out[i]
    return h


def _head(_: Any, y: jax.Array, t: jax.Array) -> jax.Array:
    """One microbatch's squared error on the last stage, its rows' sum completed over 'd'."""
    return shardops.psum("", jnp.sum((y - t) ** 2), axes="d")


def _losses(schedule: str) -> Callable[..., jax.Array]:
    """The typed_shard_map loss ``(weights, x, target) -> scalar`` under ``schedule``."""
    if schedule in GROUPED:

        @typed_shard_map
        def grouped(
            s: Groups, x: f32[Array, b"m B/d M"], t: f32[Array, b"m B/d M"]
        ) -> f32[Array, b""]:
            return pipeline.pipeline_loss(
                _stage, s, x, spec="B/d M", loss_fn=_head, targets=t, schedule=schedule
            )

        return grouped

    @typed_shard_map
    def stacked(s: Stack, x: f32[Array, b"m B/d M"], t: f32[Array, b"m B/d M"]) -> f32[Array, b""]:
        return pipeline.pipeline_loss(
            _stage, s, x, spec="B/d M", loss_fn=_head, targets=t, schedule=schedule
        )

    return stacked


def sgd_step(schedule: str) -> Callable[..., tuple[Any, jax.Array]]:
    """An (unjitted) step ``(params, x, target, lr) -> (new params, mean loss)``."""
    loss = _losses(schedule)

    def step(s: Any, x: jax.Array, t: jax.Array, lr: jax.Array) -> tuple[Any, jax.Array]:
        value, g = jax.value_and_grad(lambda s: loss(s, x, t) / x.size)(s)
        return jax.tree.map(lambda w, gw: w - lr * gw, s, g), value

    return step


def make_mesh() -> jax.sharding.Mesh:
    """The ``(4, 2)`` mesh ``('p', 'd')`` with Auto axes (needs 8 devices)."""
    return jax.make_mesh(MESH_SHAPE, MESH_AXES, axis_types=(AxisType.Auto,) * 2)


def inputs(schedule: str, c: pp.PipelineConfig, m: int, seed: int = 0) -> tuple[Any, ...]:
    """``(params, x, target, lr)`` of `benchmarks._pipeline.init` for ``m`` microbatches,
    placed on the current mesh; interleaved's and zb-v's weights are the same stack regrouped
    to ``(v, L / v, ...)`` (`pipeline.to_groups`), so every schedule computes the same step."""
    s, x, t = pp.init(dataclasses.replace(c, microbatches=m), jax.random.key(seed))
    mesh = jax.sharding.get_mesh()
    w: Any = s
    if schedule in GROUPED:  # the same stack, in interleaved's groups or zb-v's V
        route = "v" if schedule == "zb-v" else "ring"
        w = Groups(*pipeline.to_groups((s.w_in, s.w_out), V, route=route, stages=MESH_SHAPE[0]))
    w = jax.device_put(w, make_shardings(type(w), mesh=mesh))
    data = NamedSharding(mesh, DATA_SPEC)
    lr = jax.device_put(jnp.float32(0.1), NamedSharding(mesh, P()))
    return w, jax.device_put(x, data), jax.device_put(t, data), lr


# ---------------------------------------------------------------------------------------------
# Memory, ticks and loops of the compiled step.
# ---------------------------------------------------------------------------------------------


_TRIP_COUNT = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"')


def _loops(text: str) -> list[int | None]:
    """Known trip counts of every ``while`` of a compiled HLO module (None: unknown)."""
    module = parse_module(text)
    trips: list[int | None] = []
    for ins in (i for body in module.computations.values() for i in body):
        if ins.opcode == "while":
            found = _TRIP_COUNT.search(ins.attrs)
            trips.append(int(found.group(1)) if found else None)
    return sorted(trips, key=lambda n: -1 if n is None else n, reverse=True)


def _timeline_ticks(schedule: str, p: int, m: int) -> int:
    """Ticks of ``pipeline.timeline``'s picture (its header row numbers them)."""
    picture = pipeline.timeline(schedule, p, m, V if schedule in GROUPED else 1)
    return len(picture.splitlines()[0].split()) - 1


def compiled_structure(
    schedule: str, c: pp.PipelineConfig, m: int, seed: int = 0
) -> dict[str, Any]:
    """Temp bytes, loops and collective-permutes of the compiled step (inside the mesh)."""
    args = inputs(schedule, c, m, seed)
    compiled: Any = jax.jit(sgd_step(schedule)).lower(*args).compile()
    text = compiled.as_text()
    permutes = [k for k in collectives(text)[0] if k.kind == "collective-permute"]
    p = MESH_SHAPE[0]
    ticks = tick_formula(schedule, p, m)
    runs = sum(k.runs for k in permutes)
    loops = _loops(text)
    return {
        "microbatches": m,
        "temp_bytes": compiled.memory_analysis().temp_size_in_bytes,
        "loops": len(loops),
        "trip_counts": loops,
        "ticks_formula": ticks,
        "ticks_timeline": _timeline_ticks(schedule, p, m),
        "ticks_hlo": loops[0] if loops else None,
        "permute_instructions": len(permutes),
        "permute_runs": runs,
        "permutes_per_tick": runs / (ticks * (2 if schedule == "gpipe" else 1)),
    }


def structure_sweep(
    c: pp.PipelineConfig,
    per_stage: Sequence[int],
    seed: int = 0,
    log: Callable[[str], None] = print,
) -> dict[str, list[dict[str, Any]]]:
    """:func:`compiled_structure` of every schedule at ``m = k p`` for each ``k``."""
    p = MESH_SHAPE[0]
    out: dict[str, list[dict[str, Any]]] = {}
    for schedule in SCHEDULES:
        ms = ", ".join(str(k * p) for k in per_stage)
        log(f"[pipeline] {schedule}: compiled step at m = {ms}")
        out[schedule] = [compiled_structure(schedule, c, k * p, seed) for k in per_stage]
    return out


# ---------------------------------------------------------------------------------------------
# Step time.
# ---------------------------------------------------------------------------------------------

COMPARISONS = (*((s, "gpipe") for s in NEW), ("zb-h1", "1f1b"), ("zb-v", "1f1b"),
               ("gpipe'", "gpipe"))  # fmt: skip
# Issue 39's targets, for 8 devices running in parallel.
STEP_TARGETS = {"1f1b/gpipe": 1.05, "zb-h1/1f1b": 1.0, "zb-v/1f1b": 1.0}
PATH_GRID = tuple((p, m) for p in (2, 4, 8) for m in (p, 2 * p, 8 * p))


def critical_paths() -> list[dict[str, Any]]:
    """The lockstep critical path of every schedule from its table (`pipeline.critical_path`,
    ``T_F = T_B = T_W``; interleaved with ``v = 2``) on the grid ``p`` in {2, 4, 8}, ``m`` in
    {p, 2p, 8p}, with the issue's targets: 1F1B = GPipe, interleaved <= 1F1B, ZB-H1 < 1F1B."""
    rows = []
    for p, m in PATH_GRID:
        path = {
            s: pipeline.critical_path(s, p, m, V if s in GROUPED else 1).lockstep for s in SCHEDULES
        }
        ok = {
            "1f1b": path["1f1b"] == path["gpipe"],
            "interleaved": path["interleaved"] <= path["1f1b"],
            "zb-h1": path["zb-h1"] < path["1f1b"],
            "zb-v": path["zb-v"] < path["1f1b"],
        }
        rows.append({"p": p, "m": m, "path": path, "ok": ok})
    return rows


def step_times(
    c: pp.PipelineConfig, m: int, pairs: int, warmup: int = 5, seed: int = 0
) -> dict[str, Any]:
    """Interleaved pairs ``X / gpipe`` (order A,B then B,A) and the ``gpipe' / gpipe``
    control; median step ms, median ratio and its bootstrap 95% interval, and each loss."""
    steps: dict[str, tuple[Any, tuple[Any, ...]]] = {}
    losses: dict[str, float] = {}
    for name in ("gpipe", "gpipe'", *NEW):
        schedule = name.rstrip("'")
        args = inputs(schedule, c, m, seed)
        f = jax.jit(sgd_step(schedule))
        _, value = jax.block_until_ready(f(*args))
        for _ in range(warmup - 1):
            jax.block_until_ready(f(*args))
        steps[name] = (f, args)
        losses[name] = float(value)

    out = paired_step_times(steps, COMPARISONS, pairs, seed)
    return {"microbatches": m, **out, "losses": losses}


def run(
    size: str = "full",
    *,
    pairs: int = 120,
    warmup: int = 5,
    seed: int = 0,
    skip: Iterable[str] = (),
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """The structure sweep and (unless ``skip`` holds ``'steps'``) the step times."""
    sizes = SIZES[size]
    c: pp.PipelineConfig = sizes["config"]
    p = MESH_SHAPE[0]
    rec: dict[str, Any] = {
        "mesh": {"shape": list(MESH_SHAPE), "axes": list(MESH_AXES), "axis_types": "Auto"},
        "config": {k: v for k, v in dataclasses.asdict(c).items() if k != "microbatches"},
        "v": V,
    }
    rec["paths"] = critical_paths()
    with jax.set_mesh(make_mesh()):
        rec["structure"] = structure_sweep(c, sizes["per_stage"], seed, log)
        if "steps" not in skip:
            m = sizes["step_per_stage"] * p
            log(f"[pipeline] schedules' step time at m = {m}, {pairs} pairs")
            rec["steps"] = step_times(c, m, pairs, warmup, seed)
    return rec


def flatness(rows: Sequence[dict[str, Any]]) -> list[float]:
    """Temp bytes at each ``m`` over those at the first."""
    return [r["temp_bytes"] / rows[0]["temp_bytes"] for r in rows]


def loops_ok(schedule: str, rows: Sequence[dict[str, Any]]) -> bool:
    """The same loops whatever ``m``, the main one running the formula's ticks, and the
    collective-permutes per tick the schedule implies."""
    return all(
        r["loops"] == rows[0]["loops"]
        and r["ticks_hlo"] == r["ticks_formula"] == r["ticks_timeline"]
        and r["permutes_per_tick"] == PERMUTES_PER_TICK[schedule]
        for r in rows
    )


def linear(rows: Sequence[dict[str, Any]]) -> bool:
    """Temp bytes more than double from the first ``m`` to the last and the middle figures
    lie within 10% of the straight line through the two ends (GPipe: ~linear in ``m``)."""
    (m0, b0), (m1, b1) = ((r["microbatches"], r["temp_bytes"]) for r in (rows[0], rows[-1]))
    line = [b0 + (b1 - b0) * (r["microbatches"] - m0) / (m1 - m0) for r in rows]
    return b1 > 2 * b0 and all(
        abs(r["temp_bytes"] / y - 1) <= 0.1 for r, y in zip(rows, line, strict=True)
    )


def render_paths(rows: Sequence[dict[str, Any]], w: Callable[[str], None]) -> None:
    """The critical-path table (markdown), from `critical_paths`."""
    names = list(rows[0]["path"])
    w("Lockstep critical path from each schedule's table (`pipeline.critical_path`, units of")
    w(f"T_F = T_B = T_W; interleaved and zb-v v = {V}), and the issue's targets:")
    w("")
    heads = ("1f1b = gpipe", "interleaved ≤ 1f1b", "zb-h1 < 1f1b", "zb-v < 1f1b")
    w("| p | m | " + " | ".join(names) + " | " + " | ".join(heads) + " |")
    w("|---:|---:|" + "---:|" * len(names) + ":-:|" * len(heads))
    for r in rows:
        ok = " | ".join(
            "yes" if r["ok"][s] else "no" for s in ("1f1b", "interleaved", "zb-h1", "zb-v")
        )
        cells = " | ".join(f"{r['path'][s]:g}" for s in names)
        w(f"| {r['p']} | {r['m']} | {cells} | {ok} |")
    w("")
