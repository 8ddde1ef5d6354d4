"""The overlap part of ``python -m benchmarks``: the transformer step with collective matmuls.

``examples/transformer_model.py``'s SGD train step (value_and_grad + update in one
``jax.jit``) on a ``(2, 4)`` mesh ``('d', 't')`` (Explicit axes, the model's own roles: batch
and FSDP over ``d``, tensor over ``t``) three ways:

- ``plain``: ``Config.overlap=None``, Megatron tensor parallelism: the residual replicated
  over ``t``, a ``psum`` after each row-parallel matmul;
- ``ring``: ``Config.overlap='ring'``: the residual split over the sequence on ``t`` between
  the blocks; the q/k/v and gate/up matmuls all-gather it and the output projections
  reduce-scatter into it, each as ``|t|`` ring steps of ``ppermute`` + block einsum;
- ``bidirectional``: the same with half of each block sent each way round the ring.

Measured: the compiled HLO's collectives per kind (instructions, executions per step and
payload bytes per device, loop trip counts applied), the all-gathers and reduce-scatters over
``t`` alone (the activations'; none with overlap), bytes sent per device by
``shardlib.explain`` (per mesh axes and in total), temp bytes, how far the losses and the
gradients differ from ``plain``, and step time (interleaved pairs, median of per-pair
ratios). On CPU the collectives are memory copies that run in turn with the compute, so
overlap cannot show a speedup here (:data:`NOTE`).

:func:`targets` and :func:`render` give :mod:`benchmarks.report` its rows and Markdown.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable
from typing import Any

import jax
import numpy as np

import shardlib
from benchmarks import workloads as wls
from benchmarks._hlo import collective_traffic, collectives
from benchmarks._tables import mb
from benchmarks._tables import row as _row
from benchmarks.measures import paired_step_times
from examples import transformer_model as tm
from examples.transformer_model import Config

__all__ = [
    "MESH",
    "SIZES",
    "VARIANTS",
    "compiled",
    "make_mesh",
    "render",
    "run",
    "targets",
    "tensor_gathers",
]

MESH = ((2, 4), ("d", "t"))
VARIANTS: dict[str, str | None] = {"plain": None, "ring": "ring", "bidirectional": "bidirectional"}
SIZES: dict[str, tuple[Config, int]] = {  # (config, global batch); t = 4 splits K, F, V and L
    "tiny": (
        Config(
            vocab=64, d_model=32, n_heads=8, n_kv_heads=4, d_head=4, d_ff=64, n_layers=2, seq_len=16
        ),
        8,
    ),
    "full": wls.SIZES["full"]["transformer"],  # the suite's transformer workload
}
COMPARISONS = [("ring", "plain"), ("bidirectional", "plain"), ("plain'", "plain")]
NOTE = (
    "On CPU the simulated devices' collectives are memory copies that run in turn with the "
    "compute: no transfer overlaps a matmul, so these step times cannot show the speedup "
    "collective matmuls are for. What they show is the rest: the ring's extra steps and "
    "messages against what the sequence-parallel layout saves (the norms, residual adds and "
    "the loss's elementwise work on L/t positions per device instead of all L). No GPU was "
    "available for these numbers."
)


def make_mesh() -> jax.sharding.Mesh:
    """The ``(2, 4)`` mesh ``('d', 't')`` (Explicit axes)."""
    return jax.make_mesh(*MESH)


def shape_text(config: Config, batch: int) -> str:
    c = config
    return (
        f"B={batch}, L={c.seq_len}, M={c.d_model}, heads {c.n_heads} ({c.n_kv_heads} kv) x "
        f"{c.d_head}, F={c.d_ff}, V={c.vocab}, {c.n_layers} layers, f32"
    )


def _step(config: Config, overlap: str | None) -> Any:
    """A fresh jitted SGD step ``(model, tokens, lr) -> (model, loss, gradients)`` (the
    gradients too, to compare the variants' exactly: the updated weights round them)."""
    c = dataclasses.replace(config, overlap=overlap)

    def step(model: Any, tokens: jax.Array, lr: jax.Array) -> tuple[Any, jax.Array, Any]:
        value, grads = jax.value_and_grad(lambda m: tm.loss(c, tokens, m))(model)
        return tm.sgd_update(model, grads, lr), value, grads

    return jax.jit(step)


def tensor_gathers(text: str, mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh) -> int:
    """Executions per step of all-gathers and reduce-scatters over the tensor axis ``t`` alone
    (the activations'; the weights gather over ``d``, the norm gains over ``t`` and ``d``)."""
    ids = np.arange(math.prod(mesh.axis_sizes)).reshape(mesh.axis_sizes)
    t = mesh.axis_names.index("t")
    groups = {tuple(g) for g in np.moveaxis(ids, t, -1).reshape(-1, ids.shape[t]).tolist()}
    return sum(
        c.runs
        for c in collectives(text)[0]
        if c.kind in ("all-gather", "reduce-scatter")
        and {tuple(sorted(g)) for g in c.groups} == groups
    )


def compiled(config: Config, overlap: str | None, args: tuple[Any, ...]) -> dict[str, Any]:
    """One variant's HLO census, explain's bytes and outputs (under the mesh and its rules)."""
    step = _step(config, overlap)
    exe = step.lower(*args).compile()
    text = exe.as_text() or ""
    report = shardlib.explain(step, *args)
    _, loss, grads = exe(*args)
    by_axes = {"/".join(k) or "-": v[1] for k, v in sorted(report.totals_by_axes().items())}
    return {
        "traffic": collective_traffic(text),
        "temp_bytes": int(exe.memory_analysis().temp_size_in_bytes),
        "tensor_gathers": tensor_gathers(text, jax.sharding.get_abstract_mesh()),
        "explain_sent": report.bytes_sent,
        "explain_sent_by_axes": by_axes,
        "_outputs": (float(loss), jax.device_get(grads)),
    }


def _differences(recs: dict[str, dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per overlap variant: |loss - plain's| / plain's, and the largest over the weights of
    max |gradient - plain's| / max |plain's gradient|."""
    loss0, grads0 = recs["plain"]["_outputs"]
    out = {}
    for name in ("ring", "bidirectional"):
        loss, grads = recs[name]["_outputs"]
        worst = 0.0
        for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(grads0), strict=True):
            a, b = np.float64(a), np.float64(b)
            worst = max(worst, float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30)))
        out[name] = {"loss": abs(loss - loss0) / abs(loss0), "gradient": worst}
    return out


def run(
    size: str = "full",
    *,
    pairs: int = 120,
    warmup: int = 5,
    seed: int = 0,
    skip: Iterable[str] = (),
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Census, bytes and differences of the three variants; step time unless ``skip`` has
    ``'steps'``."""
    config, batch = SIZES[size]
    mesh = make_mesh()
    rec: dict[str, Any] = {"mesh": [list(MESH[0]), list(MESH[1])], "note": NOTE}
    rec["shape"] = shape_text(config, batch)
    with jax.set_mesh(mesh), shardlib.axis_rules(tm.rules_for(mesh)):
        args = wls.transformer_inputs(config, batch, seed)
        variants = {}
        for name, overlap in VARIANTS.items():
            log(f"[overlap] {name}: compile, census, explain")
            variants[name] = compiled(config, overlap, args)
        rec["differences"] = _differences(variants)
        rec["variants"] = {
            n: {k: v for k, v in r.items() if k[0] != "_"} for n, r in variants.items()
        }
        if "steps" not in skip:
            log(f"[overlap] step time, {pairs} pairs")
            steps = {n: _step(config, o) for n, o in VARIANTS.items()}
            steps["plain'"] = _step(config, None)  # the A/A control: a second plain step
            for f in steps.values():
                for _ in range(max(warmup, 1)):
                    jax.block_until_ready(f(*args))
            raw = paired_step_times(
                {n: (f, args) for n, f in steps.items()}, COMPARISONS, pairs, seed
            )
            rec["steps"] = {k: raw[k] for k in ("pairs", "median_ms", "ratios")}
    return rec


# ---------------------------------------------------------------------------------------------
# Report.
# ---------------------------------------------------------------------------------------------


def _permutes(v: dict[str, Any]) -> int:
    row = v["traffic"]["kinds"].get("collective-permute")
    return 0 if row is None else int(row["runs"])


def targets(rec: dict[str, Any]) -> list[dict[str, Any]]:
    """The overlap part's claims as report rows: no all-gather or reduce-scatter over ``t``
    with overlap, the ring's permutes instead, the same numbers; step time (no target)."""
    vs, diff = rec["variants"], rec["differences"]
    rows = []
    for name in ("ring", "bidirectional"):
        v = vs[name]
        rows.append(
            _row(
                f"overlap: {name} step has no all-gather / reduce-scatter over t alone and "
                "runs collective-permutes instead",
                f"{v['tensor_gathers']} over t, {_permutes(v)} permutes/step",
                v["tensor_gathers"] == 0 and _permutes(v) > 0,
            )
        )
        d = diff[name]
        rows.append(
            _row(
                f"overlap: {name} loss and gradients equal plain's (relative difference ≤ 1e-5)",
                f"loss {d['loss']:.1e}, gradients {d['gradient']:.1e}",
                d["loss"] <= 1e-5 and d["gradient"] <= 1e-5,
            )
        )
    if "steps" in rec:
        for name in ("ring", "bidirectional"):
            r = rec["steps"]["ratios"][f"{name}/plain"]
            rows.append(
                _row(
                    f"overlap: step time {name} / plain on CPU (no target: nothing overlaps)",
                    f"{r['median']:.3f} [{r['ci95'][0]:.3f}, {r['ci95'][1]:.3f}]",
                    None,
                )
            )
    return rows


def render(rec: dict[str, Any], w: Callable[[str], None]) -> None:
    """The overlap section of ``results.md``."""
    names = list(VARIANTS)
    vs = rec["variants"]
    w("## Collective matmuls in the transformer step (`overlap`)")
    w("")
    w(
        f"examples/transformer_model.py's SGD step on mesh {tuple(rec['mesh'][0])} "
        f"{tuple(rec['mesh'][1])} ({rec['shape']}): `plain` (psums over a replicated residual) "
        "vs `Config.overlap` 'ring' and 'bidirectional' (sequence-parallel residual, collective "
        "matmuls). Per device, per step:"
    )
    w("")
    w("| | " + " | ".join(names) + " |")
    w("|---|" + "---:|" * len(names))
    for k in sorted({k for n in names for k in vs[n]["traffic"]["kinds"]}):
        cells = []
        for n in names:
            r = vs[n]["traffic"]["kinds"].get(k)
            cells.append(
                "0"
                if r is None
                else f"{r['count']} ({r['runs']}/step) {mb(r['payload_bytes_per_step'])} MB"
            )
        w(f"| {k} | " + " | ".join(cells) + " |")
    w(
        "| all-gather + reduce-scatter over t alone | "
        + " | ".join(str(vs[n]["tensor_gathers"]) for n in names)
        + " |"
    )
    for label, key in (("payload", "payload_bytes_per_step"), ("wire", "wire_bytes_per_step")):
        cells = [mb(vs[n]["traffic"]["total"][key]) for n in names]
        w(f"| HLO {label} MB | " + " | ".join(cells) + " |")
    axes = sorted({a for n in names for a in vs[n]["explain_sent_by_axes"]})
    for a in axes:
        cells = [mb(vs[n]["explain_sent_by_axes"].get(a, 0)) for n in names]
        w(f"| explain: MB sent over {a} | " + " | ".join(cells) + " |")
    w("| explain: MB sent, total | " + " | ".join(mb(vs[n]["explain_sent"]) for n in names) + " |")
    w("| temp bytes | " + " | ".join(f"{vs[n]['temp_bytes']:,}" for n in names) + " |")
    if "steps" in rec:
        med = rec["steps"]["median_ms"]
        w("| median step ms | " + " | ".join(f"{med[n]:.2f}" for n in names) + " |")
    w("")
    d = rec["differences"]
    w(
        "Relative difference from plain: loss "
        + ", ".join(f"{n} {d[n]['loss']:.1e}" for n in ("ring", "bidirectional"))
        + "; gradients (largest over the weights of max |difference| / max |plain's|) "
        + ", ".join(f"{n} {d[n]['gradient']:.1e}" for n in ("ring", "bidirectional"))
        + "."
    )
    w("")
    if "steps" in rec:
        _step_table(rec["steps"], w)
    w(rec["note"])
    w("")


def _step_table(st: dict[str, Any], w: Callable[[str], None]) -> None:
    w(
        f"Step time ({st['pairs']} interleaved pairs per comparison; `plain'` is a second plain step):"
    )
    w("")
    w("| | median step ms | ratio (median of pairs) | 95% bootstrap CI |")
    w("|---|---:|---:|---|")
    for a, b in COMPARISONS:
        r = st["ratios"][f"{a}/{b}"]
        w(
            f"| {a} / {b} | {st['median_ms'][a]:.2f} / {st['median_ms'][b]:.2f} | "
            f"{r['median']:.4f} | [{r['ci95'][0]:.4f}, {r['ci95'][1]:.4f}] |"
        )
    w("")
