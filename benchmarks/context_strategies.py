"""Part of the attention section of ``python -m benchmarks``: the context-parallel strategies
side by side (issue 41): bytes each device sends per step and temp memory.

For ``c`` in 2, 4, 8 on a 1-D mesh ``('c',)``, causal attention in the balanced layout,
forward and backward (``jax.grad`` of the sum), one jitted step per strategy:

- ``ring``: `shardlib.attention.ring`, K/V blocks round the ring (collective-permutes);
- ``gathered``: `shardlib.attention.gathered`, K/V all-gathered (backward: reduce-scatters);
- ``ulysses``: `shardlib.attention.ulysses`, all-to-alls between the sequence split and a head
  split (two forward, two backward);
- ``ring_ulysses``: `shardlib.attention.ring_ulysses` on a 2-D mesh ``('r', 'u')`` of ``2 x
  c/2`` devices (from ``c = 4``): Ulysses over ``u``, the ring over ``r``.

Each strategy's bytes come three ways: the formula (:func:`formula`, from the per-device
sizes), ``shardlib.explain``'s total, and the compiled HLO's (:func:`benchmarks._hlo.
collective_traffic`, wire bytes per device per step). Temp bytes are the compiled program's
``memory_analysis()``.

:func:`run` measures, :func:`targets` and :func:`render` give :mod:`benchmarks.report` its
rows and Markdown (the attention part calls them).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import jax
import numpy as np
from jax import Array
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import shardlib
from benchmarks import attention_bench as ab
from benchmarks import context_weights
from benchmarks._hlo import collective_traffic
from benchmarks._tables import row as _row
from shardlib.shardtypes import f32, typed_shard_map

__all__ = [
    "CS",
    "SIZES",
    "STRATEGIES",
    "formula",
    "measure",
    "render",
    "run",
    "sections",
    "targets",
]

STRATEGIES = ("ring", "gathered", "ulysses", "ring_ulysses")
CS = (2, 4, 8)
# Heads divide every c (Ulysses splits them over c); GQA with 2 query heads per kv head.
SIZES = {"tiny": ab.Shape(1, 256, 16, 8, 8), "full": ab.Shape(1, 2048, 16, 8, 32)}


def formula(strategy: str, s: ab.Shape, c: int) -> int:
    """Bytes each device sends per forward + backward step (f32), from the block sizes.

    - ring: ``c - 1`` K/V blocks forward, ``c - 1`` K/V blocks and ``c - 1`` dK/dV blocks
      backward (`attention.ring_bytes`; at ``c = 2`` the compiled program sends the two
      rings' one K/V transfer once, :func:`deduplicated`);
    - gathered: the all-gather of K and V sends ``c - 1`` K/V blocks per device, the
      reduce-scatter of their gradients ``c - 1`` more;
    - ulysses: each all-to-all keeps ``1/c`` of what it moves: forward q, k, v in and the
      output back, backward the output's gradient in and q, k, v's back
      (`attention.ulysses_bytes`), less the output's forward all-to-all: the step is
      ``jax.grad`` of the sum, whose gradient does not need the output, and JAX drops it;
    - ring_ulysses: Ulysses's bytes over ``u``, then the ring's over ``r`` with blocks of
      ``L/r`` positions and ``K/u`` heads (the same bytes as a ``L/c`` block of ``K`` heads).
    """
    local = s.b * (s.length // c) * s.d * 4  # one head's block, f32
    kv = 2 * s.kh * local
    if strategy == "ring":
        return sum(shardlib.attention.ring_bytes(kv, kv, c))
    if strategy == "gathered":
        return 2 * (c - 1) * kv
    if strategy == "ulysses":
        return _ulysses_grad_bytes(s.h * local, kv, c)
    if strategy == "ring_ulysses":  # the all-to-alls over u; then the ring over r moves
        r, u = _ring_ulysses_sizes(c)  # blocks of L/r positions and K/u heads: kv bytes again
        ring = sum(shardlib.attention.ring_bytes(kv, kv, r))
        return _ulysses_grad_bytes(s.h * local, kv, u) + ring
    raise ValueError(f"formula: unknown strategy {strategy!r}; expected one of {STRATEGIES}")


def _ulysses_grad_bytes(q_block: int, kv_block: int, c: int) -> int:
    """`attention.ulysses_bytes` forward + backward, less the output's forward all-to-all
    (``q_block * (c - 1) / c``), which ``jax.grad`` of a sum leaves dead."""
    return sum(shardlib.attention.ulysses_bytes(q_block, kv_block, c)) - q_block * (c - 1) // c


def _ring_ulysses_sizes(c: int) -> tuple[int, int]:
    """The ``(r, u)`` sizes of the 2-D mesh at ``c`` devices: a ring of 2, Ulysses over the rest."""
    return 2, c // 2


def deduplicated(strategy: str, s: ab.Shape, c: int) -> int:
    """Bytes of the program that XLA sends once where the program sends them twice: with a
    ring of 2 the ring's forward and backward K/V transfer are the same collective-permute of
    the same blocks, and XLA keeps one."""
    ring = {"ring": c, "ring_ulysses": _ring_ulysses_sizes(c)[0]}.get(strategy)
    return 2 * s.kh * s.b * (s.length // c) * s.d * 4 if ring == 2 else 0


def _ring_ulysses_step(mesh: jax.sharding.Mesh, s: ab.Shape) -> tuple[Any, tuple[jax.Array, ...]]:
    """The 2-D strategy's jitted grad step and its inputs (in the ring's balanced layout for
    ``c = |r|``, split over ``r`` then ``u``; values do not matter here) on ``mesh``."""
    q_spec, kv_spec = "B L/r/u H D", "B L/r/u K D"

    @typed_shard_map
    def attend(
        q: f32[Array, q_spec.encode()],
        k: f32[Array, kv_spec.encode()],
        v: f32[Array, kv_spec.encode()],
    ) -> f32[Array, q_spec.encode()]:
        spec = f"{q_spec}, {kv_spec}"
        return shardlib.attention.ring_ulysses(spec, q, k, v, "r", "u", layout="balanced")

    rng = np.random.default_rng(0)
    split = jax.sharding.NamedSharding(mesh, P(None, ("r", "u")))
    args = tuple(
        jax.device_put(rng.standard_normal((s.b, s.length, h, s.d), np.float32), split)
        for h in (s.h, s.kh, s.kh)
    )
    return jax.jit(ab._grad(attend)), args


def measure(strategy: str, s: ab.Shape, c: int) -> dict[str, Any]:
    """One strategy's compiled step at ``c``: HLO bytes by kind, explain's bytes, temp bytes."""
    if strategy == "ring_ulysses":
        mesh = jax.make_mesh(
            _ring_ulysses_sizes(c),
            ("r", "u"),
            axis_types=(AxisType.Auto,) * 2,
            devices=jax.devices()[:c],
        )
    else:
        mesh = ab.make_mesh(c)
    with jax.set_mesh(mesh):
        if strategy == "ring_ulysses":
            step, args = _ring_ulysses_step(mesh, s)
        else:
            args = ab.inputs(s, mesh)
            step = jax.jit(ab._grad(ab._sharded(strategy)))
        exe = step.lower(*args).compile()
        report = shardlib.explain(step, *args)
    traffic = collective_traffic(exe.as_text() or "")
    return {
        "strategy": strategy,
        "c": c,
        "formula": formula(strategy, s, c),
        "deduplicated": deduplicated(strategy, s, c),
        "hlo": traffic["total"]["wire_bytes_per_step"],
        "kinds": sorted(traffic["kinds"]),
        "explain": int(sum(v[1] for v in report.totals_by_axes().values())),
        "temp_bytes": int(exe.memory_analysis().temp_size_in_bytes),
        "unknown_trip_counts": traffic["unknown_trip_counts"],
    }


def run(
    size: str = "full",
    cs: Iterable[int] = CS,
    strategies: Iterable[str] = STRATEGIES,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Every strategy at every ``c``."""
    s = SIZES[size]
    rows = []
    for c in cs:
        for strategy in (x for x in strategies if c >= 4 or x != "ring_ulysses"):
            rows.append(measure(strategy, s, c))
            log(f"  context strategy {strategy} at c = {c}: {rows[-1]}")
    return {"shape": s.text(), "rows": rows}


def targets(rec: dict[str, Any]) -> list[dict[str, Any]]:
    """Per strategy and ``c``: bytes formula = explain = compiled HLO (less what XLA sends
    once for two identical transfers, :func:`deduplicated`)."""
    return [
        _row(
            f"attention: {r['strategy']} bytes per device at c = {r['c']} = formula = explain "
            "= compiled HLO (forward + backward)",
            f"formula {r['formula']:,}, explain {r['explain']:,}, HLO {r['hlo']:,}"
            + (f" (+ {r['deduplicated']:,} sent once)" if r["deduplicated"] else ""),
            r["formula"] == r["explain"] == r["hlo"] + r["deduplicated"]
            and r["unknown_trip_counts"] == 0,
        )
        for r in rec["rows"]
    ]


def render(rec: dict[str, Any], w: Callable[[str], None]) -> None:
    """The strategies' table: bytes per device and temp memory per ``c``."""
    w("### Context-parallel strategies side by side")
    w("")
    w(
        f"{rec['shape']}, causal, balanced layout, forward + backward. Bytes each device sends "
        "per step (formula / explain / compiled HLO) and the compiled temp bytes. At c = 2 "
        "the ring's forward and backward K/V transfers are one identical collective-permute, "
        "which XLA runs once: the HLO has one K/V block less."
    )
    w("")
    w("| c | strategy | collectives | bytes: formula | explain | HLO | temp bytes |")
    w("|---:|---|---|---:|---:|---:|---:|")
    for r in rec["rows"]:
        w(
            f"| {r['c']} | {r['strategy']} | {', '.join(r['kinds'])} | {r['formula']:,} | "
            f"{r['explain']:,} | {r['hlo']:,} | {r['temp_bytes']:,} |"
        )
    w("")


def sections(rec: dict[str, Any], what: str, *args: Any) -> list[dict[str, Any]]:
    """The attention part's issue-41 sections (``rec['strategies']``, this module's;
    ``rec['weights']``, :mod:`benchmarks.context_weights`'): their target rows
    (``what='targets'``) or their Markdown (``what='render'``, with ``w``)."""
    parts = {
        "strategies": {"targets": targets, "render": render},
        "weights": {"targets": context_weights.targets, "render": context_weights.render},
    }
    rows: list[dict[str, Any]] = []
    for key, fns in parts.items():
        if key in rec:
            rows += fns[what](rec[key], *args) or []
    return rows
