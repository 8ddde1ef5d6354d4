"""Structure of the compiled steps (deterministic): collectives, cost, memory, saved residuals.

Each variant of a workload is traced, lowered and compiled once; the collectives of its compiled
HLO are counted by :mod:`benchmarks._hlo` (which reads HLO through :mod:`shardlib._explain.hlo`), beside
``cost_analysis()``, ``memory_analysis()`` and the canonical jaxpr, StableHLO and HLO texts of
``shardlib`` and ``hand``. :func:`remat_report` lists what the transformer step saves for the
backward pass under each remat policy.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import re
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from benchmarks import _hlo
from benchmarks import _transformer as tr
from benchmarks import workloads as wls
from examples import transformer_model as tm
from shardlib._explain.hlo import array_bytes

__all__ = [
    "COST_KEYS",
    "MEMORY_KEYS",
    "analyse",
    "compare_structure",
    "fsdp_batch_sweep",
    "parse_residuals",
    "per_device_residuals",
    "remat_report",
]

COST_KEYS = ("flops", "bytes accessed", "transcendentals")
MEMORY_KEYS = (
    "argument_size_in_bytes",
    "output_size_in_bytes",
    "alias_size_in_bytes",
    "temp_size_in_bytes",
)
# Primitives that only wrap other equations (their contents are compared anyway).
_WRAPPERS = {"custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr", "pjit", "jit"}


def _cost(compiled: Any) -> dict[str, float]:
    cost = compiled.cost_analysis()
    if isinstance(cost, list | tuple):  # older JAX: one dict per device program
        cost = cost[0] if cost else {}
    cost = cost or {}
    return {k: float(cost[k]) for k in COST_KEYS if k in cost}


def _memory(compiled: Any) -> dict[str, int]:
    mem = compiled.memory_analysis()
    return {k: int(getattr(mem, k)) for k in MEMORY_KEYS if mem is not None and hasattr(mem, k)}


def analyse(traced: Any, lowered: Any, compiled: Any) -> dict[str, Any]:
    """The deterministic facts about one compiled step (texts under ``'_texts'``)."""
    hlo = compiled.as_text()
    return {
        "census": _hlo.collective_census(hlo),
        "traffic": _hlo.collective_traffic(hlo, jax.device_count()),
        "cost": _cost(compiled),
        "memory": _memory(compiled),
        "_texts": {
            "jaxpr": _hlo.canonicalize_jaxpr(traced.jaxpr),
            "lowered": _hlo.canonicalize_mlir(lowered.as_text()),
            "hlo": _hlo.canonicalize(hlo),
        },
    }


def _max_abs_diff(a: Any, b: Any) -> float:
    leaves = zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in leaves)


def compare_structure(workload: wls.Workload) -> dict[str, Any]:
    """Compile every variant once; compare shardlib with hand (and report auto beside them).

    Returns ``{'variants': {name: analysis}, 'same': {...}, 'outputs': {...}}`` where
    ``same`` holds the shardlib-vs-hand equalities and first differences.
    """
    variants: dict[str, Any] = {}
    outputs: dict[str, Any] = {}
    for v in wls.VARIANTS:
        step = workload.fresh(v)
        traced = step.trace(*workload.args)
        lowered = traced.lower()
        compiled = lowered.compile()
        variants[v] = analyse(traced, lowered, compiled)
        outputs[v] = jax.device_get(compiled(*workload.args))
    a, b = variants["shardlib"], variants["hand"]
    same: dict[str, Any] = {
        "census": a["census"] == b["census"] and a["traffic"] == b["traffic"],
        "cost": a["cost"] == b["cost"],
        "memory": a["memory"] == b["memory"],
    }
    for key in ("jaxpr", "lowered", "hlo"):
        ta, tb = a["_texts"][key], b["_texts"][key]
        same[key] = ta == tb
        same[f"{key}_first_difference"] = _hlo.first_difference(ta, tb)
    pa = _hlo.primitive_census(a["_texts"]["jaxpr"])
    pb = _hlo.primitive_census(b["_texts"]["jaxpr"])
    same["jaxpr_primitives_only_in_shardlib"] = dict(pa - pb)
    same["jaxpr_primitives_only_in_hand"] = dict(pb - pa)
    same["jaxpr_same_up_to_wrappers"] = all(k in _WRAPPERS for k in {**(pa - pb), **(pb - pa)})
    losses = {v: float(outputs[v][1]) for v in wls.VARIANTS}
    return {
        "variants": variants,
        "same": same,
        "outputs": outputs,
        "losses": losses,
        "max_abs_diff_params": {
            "hand": _max_abs_diff(outputs["shardlib"][0], outputs["hand"][0]),
            "auto": _max_abs_diff(outputs["shardlib"][0], outputs["auto"][0]),
        },
    }


def fsdp_batch_sweep(batches: Sequence[int], seed: int = 0) -> list[dict[str, Any]]:
    """Bytes per device per step of the FSDP MLP (shardlib vs auto) as the batch grows."""
    base = wls.SIZES["full"]["mlp"]
    rows = []
    for n in batches:
        w = wls.fsdp_mlp(dataclasses.replace(base, batch=n), seed)
        row: dict[str, Any] = {"batch": n}
        for v in ("shardlib", "auto"):
            text = w.fresh(v).trace(*w.args).lower().compile().as_text()
            row[v] = _hlo.collective_traffic(text, jax.device_count())["total"]
        rows.append(row)
    return rows


# ---------------------------------------------------------------------------------------------
# Remat: saved residuals of the transformer step.
# ---------------------------------------------------------------------------------------------

_RESIDUAL = re.compile(r"^\s*([a-z][a-z0-9_]*)\[([0-9,\s]*)\](?:\{[^}]*\})?\s+(.*)$")


def parse_residuals(text: str) -> list[dict[str, Any]]:
    """Parse ``jax.ad_checkpoint.print_saved_residuals`` output into shape/bytes/source rows."""
    rows = []
    for line in text.splitlines():
        m = _RESIDUAL.match(line)
        if not m:
            continue
        dtype, dims, source = m.groups()
        shape = tuple(int(d) for d in dims.replace(" ", "").split(",") if d)
        if source.startswith("from the argument"):
            kind = "argument"
        elif source.startswith(("from a literal", "from a constant")):
            kind = "constant"
        else:
            kind = "activation"
        rows.append(
            {
                "dtype": dtype,
                "shape": shape,
                "bytes": array_bytes(dtype, shape),
                "kind": kind,
                "source": source,
            }
        )
    return rows


def _residual_text(f: Callable[..., Any], *args: Any) -> str:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        jax.ad_checkpoint.print_saved_residuals(f, *args)
    return buf.getvalue()


def per_device_residuals(config: Any, tokens: Any, model: Any, policy: str) -> list[dict]:
    """Residuals of the hand-written per-device loss, listed inside ``shard_map`` (so the
    shapes are per device)."""
    found: list[str] = []

    def probe(tokens, model):
        found.append(_residual_text(lambda m: tr.hand_loss_body(config, tokens, m, policy), model))
        return jax.numpy.zeros(())

    smap = jax.shard_map(
        probe, in_specs=(tr.TOKENS_SPEC, tr.MODEL_SPECS), out_specs=P(), check_vma=False
    )
    jax.jit(smap).trace(tokens, model)
    return parse_residuals(found[0])


def remat_report(size: str = "full", seed: int = 0, compile_steps: bool = True) -> dict[str, Any]:
    """Saved residuals per device under each remat policy (hand-written step), and shardlib's
    residuals compared with the hand-written step's under the same (explicit) policy."""
    config, batch = wls.SIZES[size]["transformer"]
    model, tokens, lr = wls.transformer_inputs(config, batch, seed)
    rows: dict[str, Any] = {}
    for policy in tr.POLICIES:
        res = per_device_residuals(config, tokens, model, policy)
        row: dict[str, Any] = {
            kind: {
                "count": sum(1 for r in res if r["kind"] == kind),
                "bytes": sum(r["bytes"] for r in res if r["kind"] == kind),
            }
            for kind in ("activation", "argument", "constant")
        }
        # Residuals the layer loop saves (stacked over layers by lax.scan) vs the rest.
        in_scan = [r for r in res if r["kind"] == "activation" and "output of scan" in r["source"]]
        row["layer_scan"] = {"count": len(in_scan), "bytes": sum(r["bytes"] for r in in_scan)}
        if compile_steps:
            loss = functools.partial(tr.hand_loss, policy=policy)
            step = jax.jit(wls.transformer_step(loss, config))
            row["memory"] = _memory(step.trace(model, tokens, lr).lower().compile())
        rows[policy] = row

    def global_shapes(loss: Callable[..., Any]) -> list[str]:
        text = _residual_text(lambda m: loss(config, tokens, m), model)
        return sorted(f"{r['dtype']}{list(r['shape'])}" for r in parse_residuals(text))

    out: dict[str, Any] = {
        "policies": rows,
        "shardlib_residuals_match_hand_explicit": global_shapes(tm.loss)
        == global_shapes(tr.hand_loss),
    }
    if compile_steps:
        step = jax.jit(wls.transformer_step(tm.loss, config))
        out["shardlib_memory"] = _memory(step.trace(model, tokens, lr).lower().compile())
    return out
