"""The MoE part of ``python -m benchmarks``: shardlib's expert-parallel layer vs XLA's own partitioning.

One forward and backward pass (``jax.grad`` of the summed output with respect to the tokens,
the router and both expert weights) of a top-2 mixture-of-experts FFN, the batch split over
every device and the experts over ``e``, on a ``(2, 4)`` mesh ``('d', 'e')`` and an ``(8,)``
mesh ``('e',)`` with Auto axes, three ways:

- ``moe``: ``shardlib.moe.layer`` inside ``typed_shard_map`` (capacity ``C`` per expert per
  device), tokens ``'B/d/e L M'``, experts ``'E/e M F'``;
- ``dropless``: the same with ``dropless=True`` (``C = T``, the tokens per device);
- ``xla``: the same global math in plain jax.numpy under ``jax.jit`` with ``in_shardings``
  only (tokens over every device, expert weights over ``e``): the tokens in ``G`` groups (one
  per device), the same router and drop rule per group, and the dispatch and combine as
  one-hot einsums ``(G, T, k, E, C)`` (GShard's dense-by-capacity formulation). XLA
  partitions it.

Measured: per-device bytes of the all-to-alls, the formula (each all-to-all moves the
``(E, C, M)`` buffer but the ``1/e`` that stays home, `moe.all_to_all_bytes`; two forward,
two backward) against the compiled HLO (:mod:`shardlib._explain.hlo`); every variant's
collective traffic and temp memory side by side; the largest gradient difference between
``moe`` and ``xla``; and step time as interleaved pairs moe/xla, xla/xla (control) and
dropless/xla (:func:`benchmarks.measures.step_times`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from benchmarks._hlo import collective_traffic, collectives
from benchmarks._tables import row as _row
from benchmarks._tables import side_by_side
from benchmarks.measures import step_times
from benchmarks.workloads import Workload
from shardlib import moe
from shardlib.shardtypes import Array, f32, typed_shard_map

__all__ = [
    "MESHES",
    "SIZES",
    "VARIANT_NAMES",
    "Shape",
    "bytes_check",
    "compiled",
    "global_moe",
    "render",
    "run",
    "targets",
]


@dataclass(frozen=True)
class Shape:
    """Global sizes: batch, sequence, model width, experts, expert hidden width, top-k,
    capacity factor."""

    b: int
    length: int
    m: int
    e: int
    f: int
    k: int = 2
    factor: float = 1.25

    def tokens(self, devices: int) -> int:
        return self.b * self.length // devices

    def capacity(self, devices: int, dropless: bool = False) -> int:
        t = self.tokens(devices)
        return (
            moe.dropless_capacity(t) if dropless else moe.capacity(t, self.k, self.e, self.factor)
        )

    def text(self) -> str:
        return (
            f"B={self.b}, L={self.length}, M={self.m}, E={self.e}, F={self.f}, "
            f"top-{self.k}, capacity factor {self.factor}, f32"
        )


SIZES = {"tiny": Shape(8, 16, 16, 8, 32), "full": Shape(16, 128, 128, 8, 256)}
# mesh name -> (shape, axis names); the first is the one step time and the table use
MESHES: dict[str, tuple[tuple[int, ...], tuple[str, ...]]] = {
    "(2, 4) d x e": ((2, 4), ("d", "e")),
    "(8,) e": ((8,), ("e",)),
}
# step_times' variant names -> ours (the XLA-partitioned step is the baseline, "hand")
VARIANT_NAMES = {"shardlib": "moe", "hand": "xla", "auto": "dropless"}
TOK_DE, TOK_E = "B/d/e L M", "B/e L M"


def make_mesh(name: str) -> jax.sharding.Mesh:
    shape, axes = MESHES[name]
    return jax.make_mesh(shape, axes, axis_types=(AxisType.Auto,) * len(axes))


def global_moe(x, wr, wi, wo, *, k: int, cap: int, groups: int) -> jax.Array:
    """The capacity MoE layer on global arrays: ``groups`` token blocks (one per device, in
    device order), each routed and dropped on its own, dispatch and combine as one-hot
    einsums."""
    b, length, m = x.shape
    ne = wr.shape[1]
    t = x.reshape(groups, -1, m)  # (G, T, M)
    probs = jax.nn.softmax(t @ wr, axis=-1)
    top, ids = jax.lax.top_k(probs, k)  # (G, T, k)
    gates = top / jnp.sum(top, axis=-1, keepdims=True)
    slots = jax.vmap(lambda i: moe.assign(i.astype(jnp.int32), ne, cap))(ids)
    mask = jax.nn.one_hot(slots.slot, ne * cap + 1, dtype=x.dtype)[..., :-1]
    mask = mask.reshape(*ids.shape, ne, cap)  # (G, T, k, E, C); dropped pairs all zero
    buf = jnp.einsum("gtkec,gtm->egcm", mask, t)
    h = jax.nn.gelu(jnp.einsum("egcm,emf->egcf", buf, wi))
    y = jnp.einsum("egcf,efm->egcm", h, wo)
    out = jnp.einsum("gtkec,gtk,egcm->gtm", mask, gates, y)
    return out.reshape(b, length, m)


@functools.partial(typed_shard_map, static_argnames=("cap",))
def _layer_de(
    x: f32[Array, TOK_DE.encode()],
    wr: f32[Array, b"M E"],
    wi: f32[Array, b"E/e M F"],
    wo: f32[Array, b"E/e F M"],
    cap: int,
) -> f32[Array, TOK_DE.encode()]:
    return moe.layer(x, wr, wi, wo, k=2, axis="e", capacity=cap)[0]


@functools.partial(typed_shard_map, static_argnames=("cap",))
def _layer_e(
    x: f32[Array, TOK_E.encode()],
    wr: f32[Array, b"M E"],
    wi: f32[Array, b"E/e M F"],
    wo: f32[Array, b"E/e F M"],
    cap: int,
) -> f32[Array, TOK_E.encode()]:
    return moe.layer(x, wr, wi, wo, k=2, axis="e", capacity=cap)[0]


def _grad(fn: Callable[..., jax.Array], backward: bool) -> Callable[..., Any]:
    if not backward:
        return fn
    return jax.grad(lambda *a: fn(*a).sum(), argnums=(0, 1, 2, 3))


def steps(s: Shape, mesh: jax.sharding.Mesh, backward: bool = True) -> dict[str, Callable[[], Any]]:
    """Fresh jitted steps per variant: forward + backward (or the forward alone)."""
    n = mesh.size
    layer = _layer_de if "d" in mesh.axis_names else _layer_e
    cap, whole = s.capacity(n), s.capacity(n, dropless=True)
    tok = NamedSharding(mesh, P(tuple(mesh.axis_names)))
    rep, ex = NamedSharding(mesh, P()), NamedSharding(mesh, P("e"))

    def xla(x, wr, wi, wo):
        return global_moe(x, wr, wi, wo, k=s.k, cap=cap, groups=n)

    return {
        "moe": lambda: jax.jit(_grad(lambda *a: layer(*a, cap=cap), backward)),
        "dropless": lambda: jax.jit(_grad(lambda *a: layer(*a, cap=whole), backward)),
        "xla": lambda: jax.jit(_grad(xla, backward), in_shardings=(tok, rep, ex, ex)),
    }


def inputs(s: Shape, mesh: jax.sharding.Mesh, seed: int = 0) -> tuple[jax.Array, ...]:
    """Tokens over every device, the router replicated, the experts over ``e``."""
    rng = np.random.default_rng(seed)
    shapes = ((s.b, s.length, s.m), (s.m, s.e), (s.e, s.m, s.f), (s.e, s.f, s.m))
    specs = (P(tuple(mesh.axis_names)), P(), P("e"), P("e"))
    scales = (1.0, 1.0, 0.3, 0.3)
    return tuple(
        jax.device_put((rng.standard_normal(sh) * c).astype(np.float32), NamedSharding(mesh, sp))
        for sh, sp, c in zip(shapes, specs, scales, strict=True)
    )


def compiled(variant: str, s: Shape, mesh_name: str, backward: bool = True) -> dict[str, Any]:
    """Temp bytes, collective traffic and all-to-all bytes sent of one compiled step."""
    mesh = make_mesh(mesh_name)
    with jax.set_mesh(mesh):
        args = inputs(s, mesh)
        exe = steps(s, mesh, backward)[variant]().lower(*args).compile()
    text = exe.as_text()
    found, unknown = collectives(text)
    a2a = [x for x in found if x.kind == "all-to-all"]
    return {
        "temp_bytes": int(exe.memory_analysis().temp_size_in_bytes),
        "traffic": collective_traffic(text),
        "a2a_sent_bytes": int(round(sum(x.wire * x.runs for x in a2a))),
        "a2a_runs": sum(x.runs for x in a2a),
        "a2a_groups": sorted({x.group for x in a2a}),
        "unknown_trip_counts": unknown,
    }


def bytes_check(s: Shape, variant: str = "moe") -> list[dict[str, Any]]:
    """Per mesh: all-to-all bytes sent per device by the formula and in the compiled HLO."""
    rows = []
    for name, (shape, axes) in MESHES.items():
        n, e = int(np.prod(shape)), shape[axes.index("e")]
        cap = s.capacity(n, dropless=variant == "dropless")
        one = moe.all_to_all_bytes(s.e, cap, s.m, 4, e)
        fwd, both = compiled(variant, s, name, False), compiled(variant, s, name)
        rows.append(
            {
                "mesh": name,
                "e": e,
                "capacity": cap,
                "buffer_bytes": s.e * cap * s.m * 4,
                "formula_forward": 2 * one,
                "formula_total": 4 * one,
                "hlo_forward": fwd["a2a_sent_bytes"],
                "hlo_total": both["a2a_sent_bytes"],
                "a2a_runs": [fwd["a2a_runs"], both["a2a_runs"]],
                "a2a_groups": both["a2a_groups"],
                "unknown_trip_counts": fwd["unknown_trip_counts"] + both["unknown_trip_counts"],
            }
        )
    return rows


def _max_grad_difference(s: Shape, mesh_name: str) -> float:
    """max |moe gradient - xla gradient| / max |xla gradient| over the four inputs."""
    mesh = make_mesh(mesh_name)
    with jax.set_mesh(mesh):
        made, args = steps(s, mesh), inputs(s, mesh)
        ours, theirs = made["moe"]()(*args), made["xla"]()(*args)
    worst = 0.0
    for a, b in zip(ours, theirs, strict=True):
        a, b = np.asarray(a), np.asarray(b)
        worst = max(worst, float(np.abs(a - b).max() / np.abs(b).max()))
    return worst


def _step_times(s: Shape, mesh_name: str, pairs: int, warmup: int, seed: int) -> dict[str, Any]:
    mesh = make_mesh(mesh_name)
    with jax.set_mesh(mesh):
        made = steps(s, mesh)
        w = Workload(
            name="moe",
            title="moe",
            description="",
            args=inputs(s, mesh, seed),
            steps={k: made[v] for k, v in VARIANT_NAMES.items()},
            shape=s.text(),
        )
        raw = step_times(w, pairs, warmup, seed)
    return {
        "pairs": raw["pairs"],
        "median_ms": {_name(k): v for k, v in raw["median_ms"].items()},
        "ratios": {_name(k): v for k, v in raw["ratios"].items()},
    }


def run(
    size: str = "full",
    *,
    pairs: int = 120,
    warmup: int = 5,
    seed: int = 0,
    skip: Iterable[str] = (),
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Bytes (formula vs HLO), the side-by-side traffic and memory, and (unless ``skip`` has
    ``'steps'``) step time on the first mesh of :data:`MESHES`."""
    s = SIZES[size]
    main = next(iter(MESHES))
    log("[moe] bytes: formula vs compiled HLO")
    rec: dict[str, Any] = {"shape": s.text(), "mesh": main, "bytes": bytes_check(s)}
    rec["bytes_dropless"] = bytes_check(s, "dropless")
    rec["variants"] = {}
    for name in ("moe", "dropless", "xla"):
        x = compiled(name, s, main)
        rec["variants"][name] = {"temp_bytes": x["temp_bytes"], "traffic": x["traffic"]}
    rec["max_grad_rel_diff_moe_xla"] = _max_grad_difference(s, main)
    if "steps" not in skip:
        log(f"[moe] step time, {pairs} pairs")
        rec["steps"] = _step_times(s, main, pairs, warmup, seed)
    return rec


def _name(key: str) -> str:
    """A step_times key (``'shardlib/hand'``, ``"hand'"``) with our variant names."""
    return "/".join(VARIANT_NAMES[p.rstrip("'")] + "'" * p.endswith("'") for p in key.split("/"))


# ---------------------------------------------------------------------------------------------
# Report.
# ---------------------------------------------------------------------------------------------


def _bytes_met(b: dict[str, Any]) -> bool:
    return (
        b["hlo_forward"] == b["formula_forward"] > 0
        and b["hlo_total"] == b["formula_total"]
        and b["a2a_groups"] == [b["e"]]
        and b["unknown_trip_counts"] == 0
    )


def targets(rec: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 26's numbers as report rows."""
    rows = []
    for label, key in (("moe", "bytes"), ("dropless moe", "bytes_dropless")):
        for b in rec[key]:
            rows.append(
                _row(
                    f"moe: {label} all-to-all bytes per device on mesh {b['mesh']} = formula "
                    "= compiled HLO (forward; forward + backward)",
                    f"formula {b['formula_forward']:,}; {b['formula_total']:,}, HLO "
                    f"{b['hlo_forward']:,}; {b['hlo_total']:,}",
                    _bytes_met(b),
                )
            )
    if "steps" in rec:
        r = rec["steps"]["ratios"]["moe/xla"]
        rows.append(
            _row(
                "moe: step time moe / XLA's automatic partitioning (no target)",
                f"{r['median']:.3f} [{r['ci95'][0]:.3f}, {r['ci95'][1]:.3f}]",
                None,
            )
        )
    return rows


def render(rec: dict[str, Any], w: Callable[[str], None]) -> None:
    """The MoE section of ``results.md``."""
    w("## Mixture of experts (`moe`)")
    w("")
    w(
        "A top-2 MoE FFN, forward + backward (`jax.grad` of the summed output with respect to "
        "tokens, router and experts), tokens over every device, experts over 'e', Auto axes: "
        "`moe` is shardlib.moe.layer (capacity), `dropless` the same with C = T; `xla` is "
        "the same global math (per-device token groups, the same drop rule, one-hot dispatch "
        "and combine einsums) under `jax.jit` with `in_shardings` only."
    )
    w("")
    w(f"All-to-all bytes sent per device ({rec['shape']}; formula: 2 per pass × E·C·M·4·(e−1)/e):")
    w("")
    w("| variant | mesh | C | formula forward | HLO forward | formula fwd + bwd | HLO fwd + bwd |")
    w("|---|---|---:|---:|---:|---:|---:|")
    for label, key in (("moe", "bytes"), ("dropless", "bytes_dropless")):
        for b in rec[key]:
            w(
                f"| {label} | {b['mesh']} | {b['capacity']} | {b['formula_forward']:,} | "
                f"{b['hlo_forward']:,} | {b['formula_total']:,} | {b['hlo_total']:,} |"
            )
    w("")
    side_by_side(
        rec,
        w,
        ["moe", "dropless", "xla"],
        f"Per device, one step on mesh {rec['mesh']}:",
        "max_grad_rel_diff_moe_xla",
    )
