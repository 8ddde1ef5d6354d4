"""The attention part of ``python -m benchmarks``: ring vs all-gather vs XLA's own partitioning.

One forward and backward pass (``jax.grad`` of the summed output with respect to q, k and v)
of causal attention over a sequence split over a 1-D mesh ``('c',)`` with Auto axes, three ways:

- ``ring``: ``shardlib.attention.ring`` in the balanced layout (``typed_shard_map``);
- ``gathered``: ``shardlib.attention.gathered``, K/V all-gathered (what MaxText does);
- ``xla``: the same global attention (K/V repeated per query head, a dense causal mask) under
  ``jax.jit`` with ``in_shardings`` only, the sequence split over ``c``: XLA partitions it.

Measured (issue 25's numbers):

1. per-device temp memory of the compiled program (``memory_analysis().temp_size_in_bytes``):
   ring vs gathered at ``c = 8``, and the ring at ``c = 4`` vs ``c = 8`` for the same ``L/c``;
2. bytes per device per step: the ring's collective-permutes in the compiled HLO (read by
   :mod:`shardlib._explain.hlo`, loop trip counts applied) against `attention.ring_bytes`, at
   ``c = 4`` and ``c = 8``, forward alone and forward + backward; every variant's collective
   traffic side by side;
3. step time: interleaved pairs ring/xla, xla/xla (control) and gathered/xla
   (:func:`benchmarks.measures.step_times`), and how far the gradients of ring and xla differ;
4. packed sequences (:mod:`benchmarks.attention_packed`): 8 documents per row (segment ids), the ring's
   forward + backward step with the blocks whose segments cannot meet skipped against the
   same ring computing them (an internal switch), interleaved pairs with an A/A control, and
   the score blocks each device computes either way (`attention.score_blocks`).

:func:`targets` and :func:`render` give :mod:`benchmarks.report` its rows and Markdown.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from benchmarks import attention_packed
from benchmarks._hlo import collective_traffic, collectives
from benchmarks._tables import row as _row
from benchmarks._tables import side_by_side
from benchmarks.measures import step_times
from benchmarks.workloads import Workload
from shardlib import attention
from shardlib.shardtypes import Array, f32, typed_shard_map

__all__ = [
    "SIZES",
    "TARGETS",
    "VARIANT_NAMES",
    "Shape",
    "bytes_check",
    "compiled",
    "memory_check",
    "render",
    "run",
    "targets",
]


@dataclass(frozen=True)
class Shape:
    """Global sizes: batch, sequence, query heads, key/value heads, head width."""

    b: int
    length: int
    h: int
    kh: int
    d: int

    def text(self) -> str:
        return f"B={self.b}, L={self.length}, H={self.h}, K={self.kh}, D={self.d}, f32"


SIZES: dict[str, dict[str, Shape]] = {
    "tiny": {"memory": Shape(1, 1024, 4, 2, 16), "step": Shape(1, 128, 4, 2, 8)},
    "full": {"memory": Shape(1, 8192, 8, 2, 64), "step": Shape(1, 1024, 4, 2, 32)},
}
TARGETS = {"memory_ratio": 0.25, "flat_tolerance": 0.10}
# step_times' variant names -> ours (the XLA-partitioned step is the baseline, "hand")
VARIANT_NAMES = {"shardlib": "ring", "hand": "xla", "auto": "gathered"}
Q_SPEC, KV_SPEC = "B L/c H D", "B L/c K D"


def make_mesh(c: int) -> jax.sharding.Mesh:
    """A 1-D mesh ``('c',)`` of the first ``c`` devices, Auto axes."""
    return jax.make_mesh((c,), ("c",), axis_types=(AxisType.Auto,), devices=jax.devices()[:c])


def reference(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """Global causal attention in plain jax.numpy (what XLA partitions by itself)."""
    length, h, d = q.shape[1:]
    k = jnp.repeat(k, h // k.shape[2], axis=2)
    v = jnp.repeat(v, h // v.shape[2], axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d)
    keep = jnp.tril(jnp.ones((length, length), bool))[None, None]
    p = jax.nn.softmax(jnp.where(keep, s, -jnp.inf), axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", p, v)


def _grad(attend: Callable[..., jax.Array]) -> Callable[..., Any]:
    return jax.grad(lambda q, k, v: attend(q, k, v).sum(), argnums=(0, 1, 2))


def _sharded(fn: str) -> Callable[..., jax.Array]:
    op = getattr(attention, fn)

    @typed_shard_map
    def attend(
        q: f32[Array, Q_SPEC.encode()],
        k: f32[Array, KV_SPEC.encode()],
        v: f32[Array, KV_SPEC.encode()],
    ) -> f32[Array, Q_SPEC.encode()]:
        return op(f"{Q_SPEC}, {KV_SPEC}", q, k, v, "c", layout="balanced")

    return attend


def steps(mesh: jax.sharding.Mesh, backward: bool = True) -> dict[str, Callable[[], Any]]:
    """Fresh jitted steps per variant: forward + backward (or the forward alone)."""
    split = NamedSharding(mesh, P(None, "c"))
    wrap = _grad if backward else (lambda f: f)
    return {
        "ring": lambda: jax.jit(wrap(_sharded("ring"))),
        "gathered": lambda: jax.jit(wrap(_sharded("gathered"))),
        "xla": lambda: jax.jit(wrap(reference), in_shardings=(split,) * 3),
    }


def inputs(
    s: Shape, mesh: jax.sharding.Mesh, seed: int = 0, layout: str = "balanced"
) -> tuple[jax.Array, ...]:
    """q, k, v in ``layout`` (``'contiguous'`` is the original order), split over ``c``."""
    rng = np.random.default_rng(seed)
    order = attention.positions(s.length, mesh.shape["c"], layout)
    split = NamedSharding(mesh, P(None, "c"))
    return tuple(
        jax.device_put(rng.standard_normal((s.b, s.length, h, s.d), np.float32)[:, order], split)
        for h in (s.h, s.kh, s.kh)
    )


def compiled(variant: str, s: Shape, c: int, backward: bool = True) -> dict[str, Any]:
    """Temp bytes, collective traffic and collective-permute bytes sent of one compiled step."""
    mesh = make_mesh(c)
    with jax.set_mesh(mesh):
        args = inputs(s, mesh)
        exe = steps(mesh, backward)[variant]().lower(*args).compile()
    text = exe.as_text()
    found, unknown = collectives(text)
    return {
        "temp_bytes": int(exe.memory_analysis().temp_size_in_bytes),
        "traffic": collective_traffic(text),
        "permute_sent_bytes": sum(
            x.in_bytes * x.runs for x in found if x.kind == "collective-permute"
        ),
        "other_kinds": sorted({x.kind for x in found} - {"collective-permute"}),
        "unknown_trip_counts": unknown,
    }


def memory_check(s: Shape, c: int = 8) -> dict[str, Any]:
    """Temp bytes of ring and gathered at ``c`` and length ``L``, and of the ring at ``c/2``
    and ``L/2`` (the same ``L/c``)."""
    half = Shape(s.b, s.length // 2, s.h, s.kh, s.d)
    rec = {
        "c": c,
        "shape": s.text(),
        "ring": compiled("ring", s, c)["temp_bytes"],
        "gathered": compiled("gathered", s, c)["temp_bytes"],
        "ring_half_c": compiled("ring", half, c // 2)["temp_bytes"],
    }
    rec["ratio"] = rec["ring"] / rec["gathered"]
    rec["flat_change"] = abs(rec["ring_half_c"] - rec["ring"]) / rec["ring"]
    return rec


def bytes_check(s: Shape, cs: Iterable[int] = (4, 8)) -> list[dict[str, Any]]:
    """Per ``c``: the ring's bytes sent per device by the formula and in the compiled HLO."""
    rows = []
    for c in cs:
        block = 2 * s.b * (s.length // c) * s.kh * s.d * 4  # one K + one V block, f32
        fwd, bwd = attention.ring_bytes(block, block, c)
        f, both = compiled("ring", s, c, backward=False), compiled("ring", s, c)
        rows.append(
            {
                "c": c,
                "formula_forward": fwd,
                "formula_backward": bwd,
                # at c = 2 the two rings' one transfer of K/V is the same, and XLA does it once
                "formula_total": fwd + bwd - (block if c == 2 else 0),
                "hlo_forward": f["permute_sent_bytes"],
                "hlo_total": both["permute_sent_bytes"],
                "only_permutes": not (f["other_kinds"] or both["other_kinds"]),
                "unknown_trip_counts": f["unknown_trip_counts"] + both["unknown_trip_counts"],
            }
        )
    return rows


def _max_grad_difference(s: Shape, c: int) -> float:
    """max |ring gradient - xla gradient| / max |xla gradient| over q, k and v."""
    mesh = make_mesh(c)
    back = np.argsort(attention.positions(s.length, c))
    with jax.set_mesh(mesh):
        made = steps(mesh)
        ring = made["ring"]()(*inputs(s, mesh))
        xla = made["xla"]()(*inputs(s, mesh, layout="contiguous"))
    worst = 0.0
    for r, x in zip(ring, xla, strict=True):
        r, x = np.asarray(r)[:, back], np.asarray(x)
        worst = max(worst, float(np.abs(r - x).max() / np.abs(x).max()))
    return worst


def run(
    size: str = "full",
    *,
    pairs: int = 120,
    warmup: int = 5,
    seed: int = 0,
    skip: Iterable[str] = (),
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Memory, bytes, the side-by-side traffic and (unless ``skip`` has ``'steps'``) step time."""
    sizes, c = SIZES[size], 8
    log("[attention] temp memory")
    rec: dict[str, Any] = {"memory": memory_check(sizes["memory"], c)}
    log("[attention] bytes: formula vs compiled HLO")
    rec["bytes"] = bytes_check(sizes["step"])
    st = sizes["step"]
    rec["step_shape"] = st.text()
    rec["variants"] = {}
    for name in ("ring", "gathered", "xla"):
        x = compiled(name, st, c)
        rec["variants"][name] = {"temp_bytes": x["temp_bytes"], "traffic": x["traffic"]}
    rec["max_grad_rel_diff_ring_xla"] = _max_grad_difference(st, c)
    if "steps" not in skip:
        log(f"[attention] step time, {pairs} pairs")
        mesh = make_mesh(c)
        with jax.set_mesh(mesh):
            made = steps(mesh)
            w = Workload(
                name="attention",
                title="attention",
                description="",
                args=inputs(st, mesh, seed),
                steps={k: made[v] for k, v in VARIANT_NAMES.items()},
                shape=st.text(),
            )
            raw = step_times(w, pairs, warmup, seed)
        rec["steps"] = {
            "pairs": raw["pairs"],
            "median_ms": {_name(k): v for k, v in raw["median_ms"].items()},
            "ratios": {_name(k): v for k, v in raw["ratios"].items()},
        }
    log("[attention] packed sequences: segment skipping")
    timed = 0 if "steps" in skip else pairs
    rec["packed"] = attention_packed.packed_check(st, c, pairs=timed, warmup=warmup, seed=seed)
    return rec


def _name(key: str) -> str:
    """A step_times key (``'shardlib/hand'``, ``"hand'"``) with our variant names."""
    return "/".join(VARIANT_NAMES[p.rstrip("'")] + "'" * p.endswith("'") for p in key.split("/"))


# ---------------------------------------------------------------------------------------------
# Report.
# ---------------------------------------------------------------------------------------------


def targets(rec: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 25's numbers as report rows (see :data:`TARGETS`)."""
    m = rec["memory"]
    rows = [
        _row(
            f"attention: ring temp memory ≤ {TARGETS['memory_ratio']:.2f}× gathered's at c = "
            f"{m['c']} ({m['shape']})",
            f"{m['ring']:,} vs {m['gathered']:,} bytes ({m['ratio']:.3f}×)",
            m["ratio"] <= TARGETS["memory_ratio"],
        ),
        _row(
            f"attention: ring temp memory flat in c at fixed L/c (c = {m['c'] // 2} vs "
            f"{m['c']}, within {TARGETS['flat_tolerance']:.0%})",
            f"{m['ring_half_c']:,} vs {m['ring']:,} bytes ({m['flat_change']:+.1%})",
            m["flat_change"] <= TARGETS["flat_tolerance"],
        ),
    ]
    for b in rec["bytes"]:
        rows.append(
            _row(
                f"attention: ring bytes per device at c = {b['c']} = formula = compiled HLO "
                "(forward; forward + backward)",
                f"formula {b['formula_forward']:,}; {b['formula_total']:,}, HLO "
                f"{b['hlo_forward']:,}; {b['hlo_total']:,}"
                + ("" if b["only_permutes"] else " (other collectives too)"),
                b["hlo_forward"] == b["formula_forward"]
                and b["hlo_total"] == b["formula_total"]
                and b["only_permutes"]
                and b["unknown_trip_counts"] == 0,
            )
        )
    if "steps" in rec:
        r = rec["steps"]["ratios"]["ring/xla"]
        rows.append(
            _row(
                "attention: step time ring / XLA's automatic partitioning (no target)",
                f"{r['median']:.3f} [{r['ci95'][0]:.3f}, {r['ci95'][1]:.3f}]",
                None,
            )
        )
    if "packed" in rec:
        rows += attention_packed.targets(rec["packed"])
    return rows


def render(rec: dict[str, Any], w: Callable[[str], None]) -> None:
    """The attention section of ``results.md``."""
    w("## Context-parallel attention (`attention`)")
    w("")
    w(
        "Causal attention, forward + backward (`jax.grad` of the summed output), sequence split "
        "over a 1-D mesh ('c',) with Auto axes: `ring` and `gathered` are shardlib.attention in "
        "the balanced layout; `xla` is the global jax.numpy attention under `jax.jit` with "
        "`in_shardings` only (sequence over 'c')."
    )
    w("")
    m = rec["memory"]
    w(f"Temp memory per device ({m['shape']}, compiled `memory_analysis`):")
    w("")
    w("| | bytes |")
    w("|---|---:|")
    w(f"| ring, c = {m['c']} | {m['ring']:,} |")
    w(f"| gathered, c = {m['c']} | {m['gathered']:,} |")
    w(f"| ring, c = {m['c'] // 2}, L/2 (same L/c) | {m['ring_half_c']:,} |")
    w("")
    w("Ring bytes sent per device (collective-permute, loop trip counts applied):")
    w("")
    w("| c | formula forward | HLO forward | formula fwd + bwd | HLO fwd + bwd |")
    w("|---:|---:|---:|---:|---:|")
    for b in rec["bytes"]:
        w(
            f"| {b['c']} | {b['formula_forward']:,} | {b['hlo_forward']:,} | "
            f"{b['formula_total']:,} | {b['hlo_total']:,} |"
        )
    w("")
    side_by_side(
        rec,
        w,
        ["ring", "gathered", "xla"],
        f"Per device, one step at c = 8 ({rec['step_shape']}):",
        "max_grad_rel_diff_ring_xla",
    )
    if "packed" in rec:
        attention_packed.render(rec["packed"], w)
