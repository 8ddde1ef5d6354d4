"""The benchmark report: targets met or not, and the Markdown of ``results.md``.

Pure formatting and comparison of the results :func:`benchmarks.suite.run` gathered; nothing
here measures.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from benchmarks import (
    attention_bench,
    context_strategies,
    decode_bench,
    moe_bench,
    overlap_bench,
    pipeline_bench,
    plan_bench,
    roles_cost,
)
from benchmarks import workloads as wls
from benchmarks._tables import mb, traffic_kind_rows
from benchmarks._tables import row as _row
from benchmarks.measures import COMPARISONS, STAGES
from benchmarks.structure import COST_KEYS, MEMORY_KEYS

__all__ = ["DEFINITIONS", "TARGETS", "evaluate_targets", "render_markdown"]

# Targets the run must show (see docs/performance.md).
TARGETS = {
    "step_ratio_tolerance": 0.03,  # |median shardlib/hand - 1| <= 0.03
    "step_ci": (0.95, 1.05),  # the 95% interval inside this range
    "extra_trace_share_of_compile": 0.03,  # (shardlib - hand) trace+lower <= 3% of compile
    "self_time_ms": 2.0,  # shardlib/ self-time per traced step, by sampling
    "trace_ratio": 1.03,  # unprofiled trace CPU time, shardlib / hand (mean over alignments)
    "check_us": 2.0,  # eager checked argument over an unannotated call
}

Row = dict[str, Any]


def evaluate_targets(results: dict[str, Any]) -> list[Row]:
    """Each target with the measured value and whether it is met (None: not measured)."""
    rows: list[Row] = []
    for name, rec in results["workloads"].items():
        rows += _structure_targets(name, rec)
        rows += _timing_targets(name, rec)
        ta = rec["structure"]["variants"]["shardlib"]["traffic"]["total"]
        tb = rec["structure"]["variants"]["auto"]["traffic"]["total"]
        rows.append(
            _row(
                f"{name}: bytes per device per step, shardlib ≤ auto",
                f"wire {mb(ta['wire_bytes_per_step'])} vs {mb(tb['wire_bytes_per_step'])} MB; "
                f"payload {mb(ta['payload_bytes_per_step'])} vs "
                f"{mb(tb['payload_bytes_per_step'])} MB",
                ta["wire_bytes_per_step"] <= tb["wire_bytes_per_step"]
                and ta["payload_bytes_per_step"] <= tb["payload_bytes_per_step"],
            )
        )
    if "pipeline" in results:
        rows += pipeline_bench.targets(results["pipeline"])
    if "attention" in results:
        rows += attention_bench.targets(results["attention"])
        rows += context_strategies.sections(results["attention"], "targets")
    if "moe" in results:
        rows += moe_bench.targets(results["moe"])
    for key, part in (("overlap", overlap_bench), ("plan", plan_bench), ("decode", decode_bench)):
        if key in results:
            rows += part.targets(results[key])
    if "checking" in results:
        e = results["checking"]["eager_us"]
        extra = e.get("shardlib.typechecked", e["shardlib"]) - e["unannotated"]
        rows.append(
            _row(
                f"eager check of one typed argument (shardlib.typechecked) ≤ "
                f"{TARGETS['check_us']:.0f} µs over unannotated",
                f"{extra:+.2f} µs (median; typeguard.typechecked: "
                f"{e['shardlib'] - e['unannotated']:+.2f} µs)",
                extra <= TARGETS["check_us"],
            )
        )
    if "roles" in results:
        rows += roles_cost.targets(results["roles"])
    return rows


def _structure_targets(name: str, rec: dict[str, Any]) -> list[Row]:
    s = rec["structure"]["same"]
    return [
        _row(
            f"{name}: identical collective census, flops, memory (shardlib vs hand)",
            f"census {_yn(s['census'])}, cost {_yn(s['cost'])}, memory {_yn(s['memory'])}",
            s["census"] and s["cost"] and s["memory"],
        ),
        _row(
            f"{name}: identical canonical compiled HLO",
            f"HLO {_yn(s['hlo'])} (StableHLO {_yn(s['lowered'])}, jaxpr {_yn(s['jaxpr'])})",
            s["hlo"],
        ),
    ]


def _timing_targets(name: str, rec: dict[str, Any]) -> list[Row]:
    rows = []
    if "steps" in rec:
        tol = TARGETS["step_ratio_tolerance"]
        lo_ok, hi_ok = TARGETS["step_ci"]
        r = rec["steps"]["ratios"]["shardlib/hand"]
        c = rec["steps"]["ratios"]["hand'/hand"]
        ok = abs(r["median"] - 1) <= tol and lo_ok <= r["ci95"][0] and r["ci95"][1] <= hi_ok
        rows.append(
            _row(
                f"{name}: step time shardlib/hand 1.00 ± {tol:.2f}, 95% CI in "
                f"[{lo_ok:.2f}, {hi_ok:.2f}]",
                f"{r['median']:.3f} [{r['ci95'][0]:.3f}, {r['ci95'][1]:.3f}] (control "
                f"{c['median']:.3f} [{c['ci95'][0]:.3f}, {c['ci95'][1]:.3f}])",
                ok,
            )
        )
    if "stages" in rec:
        share = rec["stages"]["summary"]["extra_share_of_compile"]
        rows.append(
            _row(
                f"{name}: shardlib's extra trace+lower ≤ "
                f"{100 * TARGETS['extra_trace_share_of_compile']:.0f}% of compile",
                f"{100 * share:+.2f}%",
                share <= TARGETS["extra_trace_share_of_compile"],
            )
        )
    if "stages" in rec:
        rows.append(_trace_ratio_target(name, rec))
    if "self_time_ms" in rec:
        rows.append(_self_time_target(name, rec))
    return rows


def _self_time_target(name: str, rec: dict[str, Any]) -> Row:
    """shardlib's own time per trace: by sampling when measured (cProfile inflates it)."""
    ms = rec["self_time_ms"]["shardlib"].get("shardlib", 0.0)
    measured = f"{ms:.2f} ms (cProfile, thread CPU time)"
    if "sampled_self_time_ms" in rec:
        ms = rec["sampled_self_time_ms"].get("shardlib", 0.0)
        measured = f"{ms:.2f} ms by sampling; " + measured
    return _row(
        f"{name}: shardlib self-time ≤ {TARGETS['self_time_ms']:.0f} ms per trace",
        measured,
        ms <= TARGETS["self_time_ms"],
    )


def _trace_ratio_target(name: str, rec: dict[str, Any]) -> Row:
    """The unprofiled trace, shardlib against the hand-written step: CPU time, averaged over
    the stack alignments (`benchmarks.alignment`) when measured, else minimums at one depth."""
    title = (
        f"{name}: unprofiled trace ≤ {100 * (TARGETS['trace_ratio'] - 1):.0f}% over the hand step's"
    )
    summ = rec["stages"]["summary"]
    a, b = summ["shardlib"]["trace_cpu_min_s"], summ["hand"]["trace_cpu_min_s"]
    one_depth = f"{1e3 * a:.1f} vs {1e3 * b:.1f} ms CPU ({100 * (a / b - 1):+.1f}%)"
    if "aligned_trace" not in rec:
        return _row(title, one_depth, a / b <= TARGETS["trace_ratio"])
    al = rec["aligned_trace"]["summary"]
    mean_a, mean_b = al["shardlib"]["mean_s"], al["hand"]["mean_s"]
    ratio = al["ratio_of_means"]
    measured = (
        f"mean over {al['shardlib']['offsets']} stack alignments {1e3 * mean_a:.1f} vs "
        f"{1e3 * mean_b:.1f} ms CPU ({100 * (ratio - 1):+.1f}%); best alignment "
        f"{100 * (al['ratio_of_minimums'] - 1):+.1f}%; at one depth {one_depth}"
    )
    if "trace_work" in rec:
        tw = rec["trace_work"]
        n_a, n_b = tw["shardlib"]["bytecodes"], tw["hand"]["bytecodes"]
        measured += f"; Python bytecodes per trace {100 * (n_a / n_b - 1):+.1f}% (not timed)"
    return _row(title, measured, ratio <= TARGETS["trace_ratio"])


def _yn(b: bool) -> str:
    return "identical" if b else "differs"


def _fmt_int(n: float) -> str:
    return f"{int(n):,}"


def render_markdown(results: dict[str, Any]) -> str:
    """The report: environment, targets, then one section per measurement."""
    out: list[str] = []
    w = out.append
    _header(results, w)
    for name, rec in results["workloads"].items():
        w(f"## {rec['title']} (`{name}`)")
        w("")
        w(f"{rec['description']}. Sizes: {rec['shape']}.")
        w("")
        _structure_table(rec["structure"], w)
        if "stages" in rec:
            _stage_table(rec, w)
        if "steps" in rec:
            _step_table(rec["steps"], w)
    if "fsdp_batch_sweep" in results:
        _sweep_table(results["fsdp_batch_sweep"], w)
    if "remat" in results:
        _remat_table(results["remat"], w)
    if "pipeline" in results:
        pipeline_bench.render(results["pipeline"], w)
    if "attention" in results:
        attention_bench.render(results["attention"], w)
        context_strategies.sections(results["attention"], "render", w)
    if "moe" in results:
        moe_bench.render(results["moe"], w)
    for key, part in (("overlap", overlap_bench), ("plan", plan_bench), ("decode", decode_bench)):
        if key in results:
            part.render(results[key], w)
    if "checking" in results:
        w("## Checking cost")
        w("")
        # checking_cost's report is Markdown with its own '## ' sections: nest them here.
        for line in results["checking"]["report"].rstrip().splitlines():
            w("#" + line if line.startswith("## ") else line)
        w("")
    if "roles" in results:
        w(results["roles"]["report"].rstrip())
        w("")
    w("## Definitions")
    w("")
    for line in DEFINITIONS:
        w(f"- {line}")
    w("")
    return "\n".join(out) + "\n"


def _header(results: dict[str, Any], w: Callable[[str], None]) -> None:
    env = results["environment"]
    load = env["load_average"]
    load_end = env.get("load_average_end", [math.nan] * 3)
    meshes = ["mesh (4, 2) ('d', 't') with Auto axes"] if results.get("workloads") else []
    if "pipeline" in results:
        meshes.append("the pipeline on mesh (2, 4) ('p', 'd') with Auto axes")
    if "attention" in results:
        meshes.append("attention on 1-D meshes ('c',) of 4 and 8 devices with Auto axes")
    if "moe" in results:
        meshes.append("MoE on meshes (2, 4) ('d', 'e') and (8,) ('e',) with Auto axes")
    if "overlap" in results:
        meshes.append("the overlap part on mesh (2, 4) ('d', 't') with Explicit axes")
    if "decode" in results:
        meshes.append("decoding on meshes ('d', 'c', 't') with Explicit axes")
    mesh = ", ".join(meshes) or "no mesh"
    w("# shardlib vs hand-written shard_map vs auto-sharding")
    w("")
    w(
        f"{env['date']}; {env['cpu']}, {env['cores']} cores, {env['devices']} simulated "
        f"{env['platform']} devices, {mesh}; Python "
        f"{env['python']}, JAX {env['jax']} (jaxlib {env['jaxlib']}), typeguard "
        f"{env['typeguard']}. Load average (1/5/15 min) at start {load[0]:.2f} / {load[1]:.2f} / "
        f"{load[2]:.2f}, at end {load_end[0]:.2f} / {load_end[1]:.2f} / {load_end[2]:.2f}. "
        f"Settings: {results['settings']}. Run time {results.get('runtime_s', 0):.0f} s."
    )
    w("")
    w("## Targets")
    w("")
    w("| target | measured | met |")
    w("|---|---|:-:|")
    for t in results.get("targets", []):
        met = "n/a" if t["met"] is None else ("yes" if t["met"] else "**no**")
        w(f"| {t['target']} | {t['measured']} | {met} |")
    w("")


def _sweep_table(sweep: list[dict[str, Any]], w: Callable[[str], None]) -> None:
    w("## FSDP MLP: bytes per device per step as the batch grows")
    w("")
    w("| batch | shardlib wire MB | auto wire MB | shardlib payload MB | auto payload MB |")
    w("|---:|---:|---:|---:|---:|")
    for row in sweep:
        a, b = row["shardlib"], row["auto"]
        w(
            f"| {row['batch']} | {mb(a['wire_bytes_per_step'])} | "
            f"{mb(b['wire_bytes_per_step'])} | {mb(a['payload_bytes_per_step'])} | "
            f"{mb(b['payload_bytes_per_step'])} |"
        )
    w("")


DEFINITIONS = (
    "Collectives are read from the compiled (SPMD-partitioned, per-device) HLO: instructions "
    "per kind, async start/done pairs once; *runs/step* multiplies instructions inside loops "
    "by the loop's known trip count.",
    "*Payload* of one collective = the larger of its operand and result sizes on one device "
    "(the gathered result of an all-gather, the unscattered input of a reduce-scatter, the "
    "buffer of an all-reduce or all-to-all). *Wire* = estimated bytes one device sends with "
    "ring algorithms over a group of g devices: all-gather out·(g-1)/g, reduce-scatter and "
    "all-to-all in·(g-1)/g, all-reduce 2·in·(g-1)/g, collective-permute in (pairs that leave "
    "the device). Both are summed over one step.",
    "flops and bytes accessed: `compiled.cost_analysis()`; argument/output/alias/temp bytes: "
    "`compiled.memory_analysis()` (per device).",
    "Canonical texts: jaxpr printed without source info or name stacks (variables are named "
    "in order of appearance), object addresses removed; StableHLO without `loc(...)` and the "
    "module name; compiled HLO without source tables, `metadata={...}` and with every "
    "instruction/computation name renamed in order of first appearance.",
    "Trace/lower/compile: a fresh jitted closure per measurement, variants in random order, "
    "garbage collected before and not during; minimum over repetitions.",
    "Step time: single steps with `block_until_ready`, pairs run A,B then B,A alternately; "
    "ratio = median of per-pair ratios, 95% percentile bootstrap interval (2000 resamples); "
    "`hand'` is a second, separately compiled copy of the hand step (the A/A control).",
)


def _structure_table(s: dict[str, Any], w: Callable[[str], None]) -> None:
    vs = s["variants"]
    names = list(vs)
    w("Structure of the compiled step (per device; see Definitions at the end):")
    w("")
    w("| | " + " | ".join(names) + " |")
    w("|---|" + "---:|" * len(names))
    for k, cells in traffic_kind_rows(vs, names):
        w(f"| {k}: instructions (runs/step) payload/step | " + " | ".join(cells) + " |")
    for label, key in (
        ("collective payload MB/step", "payload_bytes_per_step"),
        ("collective wire MB/step (est.)", "wire_bytes_per_step"),
    ):
        w(f"| {label} | " + " | ".join(mb(vs[n]["traffic"]["total"][key]) for n in names) + " |")
    for key in COST_KEYS:
        if all(key in vs[n]["cost"] for n in names):
            w(
                f"| cost_analysis {key} | "
                + " | ".join(_fmt_int(vs[n]["cost"][key]) for n in names)
                + " |"
            )
    for key in MEMORY_KEYS:
        if all(key in vs[n]["memory"] for n in names):
            label = key.removesuffix("_size_in_bytes")
            w(
                f"| memory_analysis {label} bytes | "
                + " | ".join(_fmt_int(vs[n]["memory"][key]) for n in names)
                + " |"
            )
    w("| loss (first step) | " + " | ".join(f"{s['losses'][n]:.6f}" for n in names) + " |")
    w("")
    same = s["same"]
    jaxpr_note = ""
    if not same["jaxpr"]:
        only_s = same["jaxpr_primitives_only_in_shardlib"]
        only_h = same["jaxpr_primitives_only_in_hand"]
        jaxpr_note = (
            f" (primitives only in shardlib: {only_s or 'none'}; only in hand: {only_h or 'none'})"
        )
    d = s["max_abs_diff_params"]
    w(
        f"shardlib vs hand: census {_yn(same['census'])}, cost {_yn(same['cost'])}, memory "
        f"{_yn(same['memory'])}; canonical jaxpr {_yn(same['jaxpr'])}{jaxpr_note}, StableHLO "
        f"{_yn(same['lowered'])}, compiled HLO {_yn(same['hlo'])}. Updated weights: max |shardlib - "
        f"hand| = {d['hand']:.1e}, max |shardlib - auto| = {d['auto']:.1e}."
    )
    w("")


def _stage_table(rec: dict[str, Any], w: Callable[[str], None]) -> None:
    summ = rec["stages"]["summary"]
    names = [n for n in wls.VARIANTS if n in summ]
    reps = len(rec["stages"]["raw_s"][names[0]]["trace"])
    w(
        f"Trace / lower / compile, ms (minimum of {reps} fresh closures per variant, in random "
        "order; wall clock, CPU time of this process in parentheses):"
    )
    w("")
    w("| stage | " + " | ".join(names) + " | shardlib/hand (ratio of minimums) |")
    w("|---|" + "---:|" * (len(names) + 1))
    ratio = summ["ratio_of_minimums"]
    for stage in STAGES:
        w(
            f"| {stage} | "
            + " | ".join(
                f"{1e3 * summ[n][f'{stage}_min_s']:.1f} ({1e3 * summ[n][f'{stage}_cpu_min_s']:.1f})"
                for n in names
            )
            + f" | {ratio[stage]:.3f} ({ratio[f'{stage}_cpu']:.3f}) |"
        )
    w("")
    line = (
        f"shardlib's extra trace+lower time: {1e3 * summ['extra_trace_lower_s']:+.1f} ms wall = "
        f"{100 * summ['extra_share_of_compile']:+.2f}% of the hand step's compile time "
        f"(CPU time: {1e3 * summ['extra_trace_lower_cpu_s']:+.1f} ms = "
        f"{100 * summ['extra_share_of_compile_cpu']:+.2f}%)."
    )
    if "self_time_ms" in rec:
        st = rec["self_time_ms"]
        sl, hd = st["shardlib"], st["hand"]
        line += (
            f" cProfile self-time per trace (thread CPU time): shardlib/ "
            f"{sl.get('shardlib', 0):.2f} ms, typeguard {sl.get('typeguard', 0):.2f} ms, "
            f"jax_extra {sl.get('jax_extra', 0):.2f} ms, of {sl['total']:.1f} ms in all under "
            f"the profiler (the hand step's trace: {hd['total']:.1f} ms)."
        )
    if "sampled_self_time_ms" in rec:
        sm = rec["sampled_self_time_ms"]
        line += (
            f" Sampled instead ({sm['samples']:.0f} samples, unprofiled trace "
            f"{sm['total']:.1f} ms CPU): shardlib/ {sm.get('shardlib', 0):.2f} ms, typeguard "
            f"{sm.get('typeguard', 0):.2f} ms per trace."
        )
    w(line)
    w("")


def _step_table(st: dict[str, Any], w: Callable[[str], None]) -> None:
    med = st["median_ms"]
    w(
        f"Step time ({st['pairs']} interleaved pairs per comparison; `hand'` is a second, "
        "separately compiled hand step):"
    )
    w("")
    w("| | median step ms | ratio to hand (median of pairs) | 95% bootstrap CI |")
    w("|---|---:|---:|---|")
    for a, b in COMPARISONS:
        r = st["ratios"][f"{a}/{b}"]
        w(
            f"| {a} / {b} | {med[a]:.2f} / {med[b]:.2f} | {r['median']:.4f} | "
            f"[{r['ci95'][0]:.4f}, {r['ci95'][1]:.4f}] |"
        )
    w("")


def _remat_table(r: dict[str, Any], w: Callable[[str], None]) -> None:
    w("## Remat: what the transformer step saves for the backward pass (per device)")
    w("")
    w(
        "| policy | saved activations | bytes | of which from the layer scan | weight arguments "
        "kept (already resident) | temp bytes (compiled step) |"
    )
    w("|---|---:|---:|---:|---:|---:|")
    labels = {
        "explicit": "explicit_activation_checkpointing (save_only_these_names)",
        "none": "no remat",
        "nothing_saveable": "jax.checkpoint_policies.nothing_saveable",
    }
    for policy, row in r["policies"].items():
        temp = row.get("memory", {}).get("temp_size_in_bytes")
        w(
            f"| {labels.get(policy, policy)} | {row['activation']['count']} | "
            f"{_fmt_int(row['activation']['bytes'])} | {_fmt_int(row['layer_scan']['bytes'])} | "
            f"{_fmt_int(row['argument']['bytes'])} | "
            f"{'' if temp is None else _fmt_int(temp)} |"
        )
    w("")
    sm = r.get("shardlib_memory", {}).get("temp_size_in_bytes")
    w(
        "shardlib's step (explicit_activation_checkpointing) saves the same residuals as the "
        f"hand-written explicit policy: {'yes' if r['shardlib_residuals_match_hand_explicit'] else 'no'}"
        + (f"; its compiled temp bytes: {_fmt_int(sm)}." if sm is not None else ".")
    )
    w("")
