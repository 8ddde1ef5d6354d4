"""The pipeline part of ``python -m benchmarks``: GPipe with shardlib, by hand, and by GSPMD.

One training step (forward, loss, gradient, SGD) of stacked MLP layers on a ``(2, 4)`` mesh
``('p', 'd')`` with Auto axes: 2 pipeline stages, data parallelism over ``d`` inside each stage
(the workload and its three variants are :mod:`benchmarks._pipeline`). Measured side by side in
one run, with the suite's own tools:

1. structure (:func:`benchmarks.structure.compare_structure`): collectives per kind and their
   bytes per device (read by :mod:`shardlib._explain.hlo`), flops, memory, and whether the canonical
   compiled HLO of ``shardlib`` and ``hand`` is identical;
2. step time (:func:`benchmarks.measures.step_times`): interleaved pairs shardlib/hand, the
   hand/hand control and gspmd/hand, median ratio with a bootstrap 95% interval;
3. compile time of the shardlib step at several microbatch counts
   (:func:`benchmarks.measures.stage_times`): the schedule is a ``lax.scan``, so it should not
   grow with ``m``;
4. the memory-bounded schedules (1F1B, interleaved 1F1B, ZB-H1) against GPipe on a ``(4, 2)``
   mesh: compiled temp bytes at ``m = 2p, 8p, 32p``, ticks against each schedule's formula,
   loops and collective-permutes of the compiled step, step time side by side
   (:mod:`benchmarks.pipeline_schedules`; reported by :func:`schedule_targets` and
   :func:`render_schedules`).

:func:`targets` and :func:`render` turn the record into report rows and Markdown for
:mod:`benchmarks.report`. The GSPMD variant is the suite's ``auto`` variant, renamed ``gspmd``
in the record.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from benchmarks import _pipeline as pp
from benchmarks import pipeline_idle as pi
from benchmarks import pipeline_schedules as ps
from benchmarks._tables import mb, traffic_kind_rows
from benchmarks._tables import row as _row
from benchmarks.measures import stage_times, step_times
from benchmarks.structure import compare_structure
from benchmarks.workloads import Workload
from shardlib import pipeline
from shardlib.pipeline import gpipe_bubble_fraction

__all__ = ["MESH_AXES", "MESH_SHAPE", "SIZES", "TARGETS", "build", "make_mesh", "render", "run"]

MESH_SHAPE = (2, 4)
MESH_AXES = ("p", "d")
SIZES: dict[str, dict[str, Any]] = {
    "tiny": {
        "config": pp.PipelineConfig(layers=4, d_model=8, d_ff=16, rows=8, microbatches=4),
        "compile_microbatches": (2, 4),
    },
    "full": {
        "config": pp.PipelineConfig(layers=8, d_model=128, d_ff=512, rows=64, microbatches=8),
        "compile_microbatches": (2, 8, 32),
    },
}
TARGETS = {
    "step_ratio_tolerance": 0.03,  # |median shardlib/hand - 1| <= 0.03
    "step_ci": (0.95, 1.05),
    # compile CPU time at the most microbatches / at the fewest (CPU time: XLA compiles on
    # several threads, and other jobs on a shared machine inflate the wall clock far more)
    "compile_growth": 1.25,
}
VARIANT_NAMES = {"shardlib": "shardlib", "hand": "hand", "auto": "gspmd"}


def make_mesh() -> jax.sharding.Mesh:
    """The ``(2, 4)`` mesh ``('p', 'd')`` with Auto axes (needs 8 devices)."""
    return jax.make_mesh(MESH_SHAPE, MESH_AXES, axis_types=(AxisType.Auto,) * 2)


def _gspmd_jit(step: Callable[..., Any], args: tuple[Any, ...]) -> Any:
    """``jax.jit(step)`` with the inputs' shardings in and the params' shardings out."""
    ins = jax.tree.map(lambda a: a.sharding, args)
    replicated = NamedSharding(jax.sharding.get_mesh(), P())
    return jax.jit(step, in_shardings=ins, out_shardings=(ins[0], replicated))


def build(c: pp.PipelineConfig, seed: int = 0) -> Workload:
    """The pipeline workload of sizes ``c`` (inside ``jax.set_mesh(make_mesh())``)."""
    s, x, target = pp.place(*pp.init(c, jax.random.key(seed)))
    args = (s, x, target, jnp.float32(0.1))
    p = MESH_SHAPE[0]
    return Workload(
        name="pipeline",
        title="GPipe pipeline",
        description=(
            f"{c.layers} residual MLP layers split over {p} stages ('layers/p M F'), GPipe "
            f"schedule of {c.microbatches} microbatches under lax.scan, rows split over 'd' "
            "inside each stage; mean squared error, value_and_grad + SGD in one jit. shardlib: "
            "typed_shard_map + pipeline.gpipe; hand: jax.shard_map + lax.ppermute + lax.scan + "
            "jnp.where masks; gspmd: MaxText style, jax.vmap over a stage dim sharded over 'p', "
            "with_sharding_constraint, jnp.roll of the state each tick, no shard_map"
        ),
        args=args,
        steps={
            "shardlib": lambda: jax.jit(pp.sgd_step(pp.forward_shardlib)),
            "hand": lambda: jax.jit(pp.sgd_step(pp.forward_hand)),
            "auto": lambda: _gspmd_jit(pp.sgd_step(pp.forward_gspmd), args),
        },
        shape=(
            f"{c.layers} layers, d_model {c.d_model}, d_ff {c.d_ff}, {c.microbatches} "
            f"microbatches of {c.rows} rows, mesh {MESH_SHAPE} {MESH_AXES}, bubble fraction "
            f"{gpipe_bubble_fraction(p, c.microbatches):.3f}"
        ),
    )


def _renamed(d: dict[str, Any]) -> dict[str, Any]:
    """Keys naming variants (``'auto'``, ``'auto/hand'``) with the GSPMD variant's name."""
    return {k.replace("auto", VARIANT_NAMES["auto"]): v for k, v in d.items()}


def compile_sweep(
    c: pp.PipelineConfig, microbatches: Iterable[int], reps: int, seed: int = 0
) -> list[dict[str, Any]]:
    """Minimum trace / lower / compile seconds of fresh shardlib steps at each ``m``."""
    rows = []
    for m in microbatches:
        w = build(dataclasses.replace(c, microbatches=m), seed)
        times = stage_times(w, reps, seed, variants=("shardlib",))["shardlib"]
        rows.append({"microbatches": m, **{f"{k}_min_s": min(v) for k, v in times.items()}})
    return rows


def run(
    size: str = "full",
    *,
    pairs: int = 120,
    warmup: int = 5,
    compile_reps: int = 8,
    seed: int = 0,
    skip: Iterable[str] = (),
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Structure, step time and compile sweep (``skip`` may hold ``'steps'``, ``'stages'``)."""
    skip = set(skip)
    sizes = SIZES[size]
    with jax.set_mesh(make_mesh()):
        w = build(sizes["config"], seed)
        rec: dict[str, Any] = {
            "title": w.title,
            "description": w.description,
            "shape": w.shape,
            "mesh": {"shape": list(MESH_SHAPE), "axes": list(MESH_AXES), "axis_types": "Auto"},
        }
        log("[pipeline] structure")
        s = compare_structure(w)
        rec["structure"] = {
            "variants": _renamed(s["variants"]),
            "same": s["same"],
            "losses": _renamed(s["losses"]),
            "max_abs_diff_params": _renamed(s["max_abs_diff_params"]),
        }
        if "steps" not in skip:
            log(f"[pipeline] step time, {pairs} pairs")
            st = step_times(w, pairs, warmup, seed)
            rec["steps"] = {**st, "median_ms": _renamed(st["median_ms"])}
            rec["steps"]["ratios"] = _renamed(st["ratios"])
        if "stages" not in skip:
            ms = sizes["compile_microbatches"]
            log(f"[pipeline] compile time at m = {', '.join(map(str, ms))}, x{compile_reps}")
            rec["compile_vs_microbatches"] = compile_sweep(sizes["config"], ms, compile_reps, seed)
    if "schedules" not in skip:
        rec["schedules"] = ps.run(size, pairs=pairs, warmup=warmup, seed=seed, skip=skip, log=log)
    if "schedules" not in skip and "idle" not in skip:
        rec["idle"] = pi.run(size, pairs=max(pairs // 2, 2), warmup=warmup, seed=seed, log=log)
    return rec


# ---------------------------------------------------------------------------------------------
# Report.
# ---------------------------------------------------------------------------------------------


def targets(rec: dict[str, Any]) -> list[dict[str, Any]]:
    """The pipeline's targets as report rows (see :data:`TARGETS`)."""
    same = rec["structure"]["same"]
    rows = [
        _row(
            "pipeline: identical canonical compiled HLO, census, flops, memory (shardlib vs hand)",
            f"HLO {'identical' if same['hlo'] else 'differs'}, census "
            f"{'identical' if same['census'] else 'differs'}, cost "
            f"{'identical' if same['cost'] else 'differs'}, memory "
            f"{'identical' if same['memory'] else 'differs'}",
            same["hlo"] and same["census"] and same["cost"] and same["memory"],
        )
    ]
    if "steps" in rec:
        tol, (lo_ok, hi_ok) = TARGETS["step_ratio_tolerance"], TARGETS["step_ci"]
        r = rec["steps"]["ratios"]["shardlib/hand"]
        c = rec["steps"]["ratios"]["hand'/hand"]
        rows.append(
            _row(
                f"pipeline: step time shardlib/hand 1.00 ± {tol:.2f}, 95% CI in "
                f"[{lo_ok:.2f}, {hi_ok:.2f}]",
                f"{r['median']:.3f} [{r['ci95'][0]:.3f}, {r['ci95'][1]:.3f}] (control "
                f"{c['median']:.3f} [{c['ci95'][0]:.3f}, {c['ci95'][1]:.3f}])",
                abs(r["median"] - 1) <= tol and lo_ok <= r["ci95"][0] and r["ci95"][1] <= hi_ok,
            )
        )
    if rec.get("compile_vs_microbatches"):
        sweep = rec["compile_vs_microbatches"]
        first, last = sweep[0], sweep[-1]
        growth = last["compile_cpu_min_s"] / first["compile_cpu_min_s"]
        rows.append(
            _row(
                f"pipeline: shardlib compile CPU time at m = {last['microbatches']} ≤ "
                f"{TARGETS['compile_growth']:.2f}× that at m = {first['microbatches']} (lax.scan)",
                f"{1e3 * last['compile_cpu_min_s']:.0f} vs {1e3 * first['compile_cpu_min_s']:.0f} "
                f"ms CPU ({growth:.2f}×; wall {1e3 * last['compile_min_s']:.0f} vs "
                f"{1e3 * first['compile_min_s']:.0f} ms)",
                growth <= TARGETS["compile_growth"],
            )
        )
    if "schedules" in rec:
        rows += schedule_targets(rec["schedules"])
    return rows


def render(rec: dict[str, Any], w: Callable[[str], None]) -> None:
    """The pipeline section of ``results.md``."""
    w(f"## {rec['title']} (`pipeline`)")
    w("")
    w(f"{rec['description']}. Sizes: {rec['shape']}.")
    w("")
    _render_structure(rec["structure"], w)
    if "steps" in rec:
        st = rec["steps"]
        med = st["median_ms"]
        w(
            f"Step time ({st['pairs']} interleaved pairs per comparison; `hand'` is a second hand step):"
        )
        w("")
        w("| | median step ms | ratio (median of pairs) | 95% bootstrap CI |")
        w("|---|---:|---:|---|")
        for key in ("shardlib/hand", "hand'/hand", "gspmd/hand"):
            r = st["ratios"][key]
            a, b = key.split("/")
            w(
                f"| {a} / {b} | {med[a]:.2f} / {med[b]:.2f} | {r['median']:.4f} | "
                f"[{r['ci95'][0]:.4f}, {r['ci95'][1]:.4f}] |"
            )
        w("")
    if rec.get("compile_vs_microbatches"):
        w("Trace / lower / compile of the shardlib step by number of microbatches (ms, minimum")
        w("of fresh closures; wall clock, CPU time in parentheses):")
        w("")
        w("| microbatches | trace | lower | compile |")
        w("|---:|---:|---:|---:|")
        for row in rec["compile_vs_microbatches"]:
            cells = " | ".join(
                f"{1e3 * row[f'{k}_min_s']:.1f} ({1e3 * row[f'{k}_cpu_min_s']:.1f})"
                for k in ("trace", "lower", "compile")
            )
            w(f"| {row['microbatches']} | {cells} |")
        w("")
    if "schedules" in rec:
        render_schedules(rec["schedules"], w)
    if "idle" in rec:
        pi.render(rec["idle"], w)


def _render_structure(s: dict[str, Any], w: Callable[[str], None]) -> None:
    vs = s["variants"]
    names = [n for n in VARIANT_NAMES.values() if n in vs]  # fixed order (JSON sorts keys)
    w("| per device, one step | " + " | ".join(names) + " |")
    w("|---|" + "---:|" * len(names))
    for k, cells in traffic_kind_rows(vs, names):
        w(f"| {k}: instructions (runs/step) payload | " + " | ".join(cells) + " |")
    for label, key in (
        ("payload MB", "payload_bytes_per_step"),
        ("wire MB", "wire_bytes_per_step"),
    ):
        cells = " | ".join(mb(vs[n]["traffic"]["total"][key]) for n in names)
        w(f"| collective {label}/step | {cells} |")
    if all("flops" in vs[n]["cost"] for n in names):  # loop bodies counted once
        w(
            "| cost_analysis flops | "
            + " | ".join(f"{int(vs[n]['cost']['flops']):,}" for n in names)
            + " |"
        )
    if all("temp_size_in_bytes" in vs[n]["memory"] for n in names):
        cells = " | ".join(f"{vs[n]['memory']['temp_size_in_bytes']:,}" for n in names)
        w(f"| temp bytes | {cells} |")
    w("| loss | " + " | ".join(f"{s['losses'][n]:.6f}" for n in names) + " |")
    w("")
    same, d = s["same"], s["max_abs_diff_params"]
    w(
        f"shardlib vs hand: compiled HLO {'identical' if same['hlo'] else 'differs'} (canonical "
        f"text), StableHLO {'identical' if same['lowered'] else 'differs'}. Updated weights: "
        f"max |shardlib - hand| = {d['hand']:.1e}, max |shardlib - gspmd| = {d['gspmd']:.1e}."
    )
    if not same["hlo"]:
        w("")
        w("```text\n" + same["hlo_first_difference"] + "\n```")
    w("")


# ---------------------------------------------------------------------------------------------
# The memory-bounded schedules' report.
# ---------------------------------------------------------------------------------------------


def _ms(rows: Sequence[dict[str, Any]]) -> str:
    return ", ".join(str(r["microbatches"]) for r in rows)


def schedule_targets(rec: dict[str, Any]) -> list[dict[str, Any]]:
    """The schedules' rows: temp bytes flat (new ones) or linear (GPipe), ticks, loops, steps."""
    st, p = rec["structure"], rec["mesh"]["shape"][0]
    rows = []
    for schedule, sweep in st.items():
        kb = " / ".join(f"{r['temp_bytes'] / 1024:.0f}" for r in sweep)
        ratios = ", ".join(f"{x:.2f}×" for x in ps.flatness(sweep)[1:])
        if schedule == "gpipe":
            target, met = f"grow ~linearly in m (the control), p = {p}", ps.linear(sweep)
        else:
            target = (
                f"≤ {ps.TARGETS['flat']:.2f}× their m = {sweep[0]['microbatches']} figure, p = {p}"
            )
            met = max(ps.flatness(sweep)) <= ps.TARGETS["flat"]
        rows.append(
            _row(f"pipeline: {schedule} temp bytes at m = {_ms(sweep)} {target}",
                 f"{kb} KiB ({ratios})", met)
        )  # fmt: skip
    ok = {s: ps.loops_ok(s, sweep) for s, sweep in st.items()}
    loops = "; ".join(f"{s} {sweep[0]['loops']}" for s, sweep in st.items())
    rows.append(
        _row(
            "pipeline: each schedule's loop runs its formula's ticks (= pipeline.timeline), the "
            "same loops whatever m, collective-permutes per tick as the schedule implies",
            f"loops {loops}; "
            + ", ".join(f"{s} {'ok' if v else 'differs'}" for s, v in ok.items()),
            all(ok.values()) and all(st[s][0]["loops"] == 1 for s in ps.NEW if s in st),
        )
    )
    wants = (("1f1b", "= gpipe"), ("interleaved", "≤ 1f1b"), ("zb-h1", "< 1f1b"),
             ("zb-v", "< 1f1b"))  # fmt: skip
    for name, want in wants:
        got = [r for r in rec.get("paths", []) if name in r["ok"]]
        rows.append(
            _row(
                f"pipeline: {name}'s lockstep critical path {want}, p in {{2, 4, 8}}, m in "
                "{p, 2p, 8p} (T_F = T_B = T_W)",
                ", ".join(f"{r['path'][name]:g}" for r in got),
                bool(got) and all(r["ok"][name] for r in got),
            )
        )
    if "steps" in rec:
        r, c = rec["steps"]["ratios"], rec["steps"]["ratios"]["gpipe'/gpipe"]
        control = f"control {c['median']:.3f} [{c['ci95'][0]:.3f}, {c['ci95'][1]:.3f}]"
        for key in (*(f"{s}/gpipe" for s in ps.NEW), "zb-h1/1f1b", "zb-v/1f1b"):
            x, target = r[key], ps.STEP_TARGETS.get(key)
            want = f"≤ {target:.2f} (on 8 devices in parallel)" if target else "no target"
            rows.append(
                _row(
                    f"pipeline: step time {key.replace('/', ' / ')} at m = "
                    f"{rec['steps']['microbatches']}, {want}; measured here",
                    f"{x['median']:.3f} [{x['ci95'][0]:.3f}, {x['ci95'][1]:.3f}] ({control})",
                    None if target is None else x["median"] <= target,
                )
            )
    return rows


def render_schedules(rec: dict[str, Any], w: Callable[[str], None]) -> None:
    """The schedules' part of the pipeline section of ``results.md``."""
    c, p, st = rec["config"], rec["mesh"]["shape"][0], rec["structure"]
    w("### Memory-bounded schedules against GPipe")
    w("")
    w(
        f"{c['layers']} residual MLP layers (d_model {c['d_model']}, d_ff {c['d_ff']}, "
        f"{c['rows']} rows per microbatch split over 'd') on {p} stages, mesh "
        f"{tuple(rec['mesh']['shape'])} {tuple(rec['mesh']['axes'])}; interleaved with v = "
        f"{rec['v']}; `pipeline.pipeline_loss(..., schedule=...)`, value_and_grad + SGD in "
        "one jit."
    )
    w("")
    names = list(st)
    ms = [r["microbatches"] for r in st[names[0]]]
    w("Compiled temp bytes per device (`memory_analysis().temp_size_in_bytes`), KiB, and the")
    w(f"ratio to m = {ms[0]}:")
    w("")
    w("| schedule | " + " | ".join(f"m = {m}" for m in ms) + " |")
    w("|---|" + "---:|" * len(ms))
    for s in names:
        f = ps.flatness(st[s])
        cells = [f"{r['temp_bytes'] / 1024:.1f} ({x:.2f}×)" for r, x in zip(st[s], f, strict=True)]
        w(f"| {s} | " + " | ".join(cells) + " |")
    w("")
    w("Ticks (formula / `pipeline.timeline` / the compiled loop's trip count), loops in the")
    w("compiled step, collective-permutes (instructions; runs per step; per tick of the loop):")
    w("")
    w("| schedule | m | ticks | loops (trip counts) | permutes | runs | per tick |")
    w("|---|---:|---|---|---:|---:|---:|")
    for s in names:
        for r in st[s]:
            trips = ", ".join(str(t) for t in r["trip_counts"])
            w(
                f"| {s} | {r['microbatches']} | {r['ticks_formula']} / {r['ticks_timeline']} / "
                f"{r['ticks_hlo']} | {r['loops']} ({trips}) | {r['permute_instructions']} | "
                f"{r['permute_runs']} | {r['permutes_per_tick']:g} |"
            )
    w("")
    if rec.get("paths"):
        ps.render_paths(rec["paths"], w)
    if "steps" in rec:
        _render_steps(rec["steps"], p, w)


def _render_steps(st: dict[str, Any], p: int, w: Callable[[str], None]) -> None:
    m, med = st["microbatches"], st["median_ms"]
    w(f"Step time at m = {m} ({st['pairs']} interleaved pairs per comparison; `gpipe'` is a")
    w("second compiled GPipe step, the control):")
    w("")
    w("| | ticks | bubble | median step ms | ratio (median of pairs) | 95% bootstrap CI | loss |")
    w("|---|---:|---:|---:|---:|---|---:|")
    for key, r in st["ratios"].items():
        a, b = key.split("/")
        s = a.rstrip("'")
        v = ps.V if s in ps.GROUPED else 1
        w(
            f"| {a} / {b} | {ps.tick_formula(s, p, m)} | {pipeline.bubble_fraction(s, p, m, v):.3f} "
            f"| {med[a]:.2f} / {med[b]:.2f} | {r['median']:.4f} | "
            f"[{r['ci95'][0]:.4f}, {r['ci95'][1]:.4f}] | {st['losses'][a]:.6f} |"
        )
    w("")
