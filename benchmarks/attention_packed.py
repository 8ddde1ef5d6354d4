"""The packed-sequence part of the attention benchmark (:mod:`benchmarks.attention_bench`).

Packed sequences: ``DOCS`` documents per row (segment ids, cut at random places), the ring in
the balanced layout on a 1-D mesh ``('c',)``, forward + backward (``jax.grad`` of the summed
output with respect to q, k and v). ``skip``: the blocks whose segments cannot meet are not
computed (what `shardlib.attention.ring` does); ``full``: they are, masked (the ring's
internal switch ``segment_skip=False``, for this comparison and the tests only). Measured:
the score blocks each device computes either way (`attention.score_blocks`), how far the two
steps' gradients differ, and step time in interleaved pairs skip/full with the A/A control
full'/full (:func:`benchmarks.measures.paired_step_times`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from benchmarks._tables import row as _row
from benchmarks.measures import paired_step_times
from shardlib import attention
from shardlib._attention import ring as _ring
from shardlib.shardtypes import Array, f32, i32, typed_shard_map

__all__ = ["DOCS", "packed_check", "packed_ids", "render", "targets"]

DOCS = 8  # documents packed into each row
Q_SPEC, KV_SPEC = "B L/c H D", "B L/c K D"


def packed_ids(s: Any, docs: int = DOCS, seed: int = 0) -> np.ndarray:
    """Global segment ids ``(B, L)``, original order: ``docs`` documents per row, cut at
    random places (ids ``0 .. docs-1``, non-decreasing)."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(s.b):
        starts = np.zeros(s.length, np.int32)
        starts[rng.choice(np.arange(1, s.length), size=docs - 1, replace=False)] = 1
        rows.append(np.cumsum(starts))
    return np.stack(rows).astype(np.int32)


def _packed_step(segment_skip: bool) -> Callable[[], Any]:
    """A fresh jitted forward + backward of the balanced ring with segment ids; with
    ``segment_skip=False`` it computes the blocks only the segment ids mask (the switch is
    internal, for this comparison)."""

    @typed_shard_map
    def attend(
        q: f32[Array, Q_SPEC.encode()],
        k: f32[Array, KV_SPEC.encode()],
        v: f32[Array, KV_SPEC.encode()],
        ids: i32[Array, b"B L/c"],
    ) -> f32[Array, Q_SPEC.encode()]:
        spec = f"{Q_SPEC}, {KV_SPEC}"
        return _ring.ring_attention(
            spec, q, k, v, "c", layout="balanced", segment_ids=ids, segment_skip=segment_skip
        )

    grad = jax.grad(lambda q, k, v, ids: attend(q, k, v, ids).sum(), argnums=(0, 1, 2))
    return lambda: jax.jit(grad)


def packed_check(
    s: Any,
    c: int = 8,
    *,
    docs: int = DOCS,
    pairs: int = 0,
    warmup: int = 5,
    seed: int = 0,
) -> dict[str, Any]:
    """Packed sequences, balanced layout: the score blocks per device with and without the
    segment rule, how far the two steps' gradients differ, and (``pairs > 0``) their step
    times, interleaved pairs skip/full and full'/full (the A/A control)."""
    ids = packed_ids(s, docs, seed)
    skip = attention.score_blocks(c, "balanced", segment_ids=ids)
    full = attention.score_blocks(c, "balanced")
    rec: dict[str, Any] = {
        "c": c,
        "docs": docs,
        "shape": s.text(),
        "blocks_skip": skip,
        "blocks_full": full,
        "block_fraction": sum(skip) / sum(full),
    }
    mesh = jax.make_mesh((c,), ("c",), axis_types=(AxisType.Auto,), devices=jax.devices()[:c])
    with jax.set_mesh(mesh):
        rng = np.random.default_rng(seed)
        order = attention.positions(s.length, c)
        split = NamedSharding(mesh, P(None, "c"))
        qkv = (rng.standard_normal((s.b, s.length, h, s.d), np.float32) for h in (s.h, s.kh, s.kh))
        args = (
            *(jax.device_put(x[:, order], split) for x in qkv),
            jax.device_put(ids[:, order], split),
        )
        made = {"skip": _packed_step(True), "full": _packed_step(False)}
        a, b = (made[k]()(*args) for k in ("skip", "full"))
        rec["max_grad_rel_diff"] = max(
            float(jnp.max(jnp.abs(x - y)) / jnp.max(jnp.abs(y))) for x, y in zip(a, b, strict=True)
        )
        if pairs > 0:
            steps = {"skip": made["skip"](), "full": made["full"](), "full'": made["full"]()}
            for f in steps.values():
                for _ in range(max(warmup, 1)):
                    jax.block_until_ready(f(*args))
            rec["steps"] = paired_step_times(
                {k: (f, args) for k, f in steps.items()},
                [("skip", "full"), ("full'", "full")],
                pairs,
                seed,
            )
    return rec


def targets(p: dict[str, Any]) -> list[dict[str, Any]]:
    """The report rows of a :func:`packed_check` record."""
    rows = [
        _row(
            f"attention: packed sequences ({p['docs']} documents per row, c = {p['c']}, "
            "balanced): the ring computes fewer score blocks, the same gradients",
            f"{sum(p['blocks_skip'])} of {sum(p['blocks_full'])} blocks "
            f"({p['block_fraction']:.2f}), max gradient difference "
            f"{p['max_grad_rel_diff']:.1e}",
            sum(p["blocks_skip"]) < sum(p["blocks_full"]) and p["max_grad_rel_diff"] < 1e-5,
        )
    ]
    if "steps" in p:
        r = p["steps"]["ratios"]["skip/full"]
        rows.append(
            _row(
                "attention: packed sequences, step time with segment skipping / without "
                "(no target)",
                f"{r['median']:.3f} [{r['ci95'][0]:.3f}, {r['ci95'][1]:.3f}]",
                None,
            )
        )
    return rows


def render(p: dict[str, Any], w: Callable[[str], None]) -> None:
    """The packed-sequence table: blocks per device and step time, skipping or not."""
    w("")
    w(
        f"Packed sequences: {p['docs']} documents per row (segment ids), the ring in the "
        f"balanced layout at c = {p['c']} ({p['shape']}), forward + backward. `skip`: the "
        "blocks whose segments cannot meet are not computed; `full`: they are (masked)."
    )
    w("")
    w("| | score blocks per device | step ms (median) |")
    w("|---|---|---:|")
    ms = p.get("steps", {}).get("median_ms", {})
    for name, blocks in (("skip", p["blocks_skip"]), ("full", p["blocks_full"])):
        t = f"{ms[name]:.2f}" if name in ms else "n/a"
        w(f"| {name} | {', '.join(map(str, blocks))} | {t} |")
    if "steps" in p:
        w("")
        w("| ratio | median | 95% CI |")
        w("|---|---:|---:|")
        for key, r in p["steps"]["ratios"].items():
            w(f"| {key} | {r['median']:.3f} | [{r['ci95'][0]:.3f}, {r['ci95'][1]:.3f}] |")
