"""The decode part of ``python -m benchmarks``: the typed decode step against a hand-written one.

``examples/decoding.py``'s :func:`~examples.decoding.decode_step` (one token per row against a
key/value cache ``'layers B/batch S/seq K/tensor D'``, `shardlib.attention.decode` combining
the cache chunks' softmax states over ``c``) on meshes ``('d', 'c', 't')`` with Explicit axes
and the model's own roles (batch over ``d``, fsdp over ``d`` and ``c``, tensor over ``t``, the
cache's positions over ``c``), beside :func:`hand_decode_step`: the same per-device program in
a plain ``jax.shard_map`` with ``jax.lax`` collectives (``all_gather``, ``psum``,
``axis_index``), ``PartitionSpec`` literals and no shardlib: the weights gathered over
fsdp, the new token's key and value scattered into this device's chunk (masked), each chunk's
``(max, sum, weighted values)`` per row and query head put in its own slot of a ``(c, B, H,
D + 2)`` array of zeros and ``psum``-ed over ``c`` (as `attention.decode` does), the local
combine, and each device's slice of its vocabulary block of the logits.

Measured per mesh, on a cache half full (rows of different lengths, random keys and values):

- the logits and the updated cache of both steps (equal to ``RTOL``; checked before timing);
- the compiled HLO of both: collectives per kind, executions per step and bytes per device
  (equal), and whether the canonical texts are identical;
- the cache's bytes per device from its arrays' shards: ``total / (d c t)``, i.e. each device
  holds ``1/(c t)`` of its rows' cache, exactly;
- the combine's bytes per device per token and layer three ways: the formula
  `attention.decode_bytes`, ``shardlib.explain``'s decode row (its bytes over its runs, the
  layers) and the compiled HLO's all-reduce over ``c`` (its ring wire bytes);
- step time typed / hand (interleaved pairs, median of per-pair ratios, bootstrap 95%
  interval) beside an A/A control (hand' / hand); target: within ``STEP_TOLERANCE``.

:func:`targets` and :func:`render` give :mod:`benchmarks.report` its rows and Markdown.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

import shardlib
from benchmarks import _hlo
from benchmarks._tables import row as _row
from benchmarks.measures import paired_step_times
from examples import decoding as dec
from examples import transformer_model as tm
from examples.transformer_model import Config, Layer, Model
from shardlib import attention

__all__ = [
    "CACHE_SPEC",
    "LOGITS_SPEC",
    "MODEL_SPECS",
    "RTOL",
    "SIZES",
    "STEP_TOLERANCE",
    "hand_decode_step",
    "render",
    "run",
    "targets",
]

AXES = ("d", "c", "t")
RTOL = 1e-5
STEP_TOLERANCE = 0.05  # |median typed/hand - 1| <= 5%
COMPARISONS = [("typed", "hand"), ("hand'", "hand")]

# size: (config, global batch, cache length S, meshes d x c x t)
SIZES: dict[str, tuple[Config, int, int, tuple[tuple[int, int, int], ...]]] = {
    "tiny": (
        Config(
            vocab=64, d_model=32, n_heads=4, n_kv_heads=2, d_head=8, d_ff=64, n_layers=2, seq_len=16
        ),
        8,
        16,
        ((2, 2, 2),),
    ),
    "full": (
        Config(
            vocab=2048,
            d_model=256,
            n_heads=8,
            n_kv_heads=4,
            d_head=32,
            d_ff=1024,
            n_layers=4,
            seq_len=1024,
        ),
        8,
        1024,
        ((2, 2, 2), (1, 4, 2)),
    ),
}

# The layouts `examples.transformer_model.rules_for` gives on a ('d', 'c', 't') mesh, written
# out: batch -> d, fsdp -> (d, c), tensor -> t, seq -> c (checked against the typed ones).
_FSDP = ("d", "c")
_NORM = ("t", "d", "c")


def _p(*axes: Any) -> Any:
    """A ``PartitionSpec`` standing in for a weight of `Layer` / `Model` (typed as arrays)."""
    return P(*axes)


LAYER_SPECS = Layer(
    ln1=_p(None, _NORM),
    w_q=_p(None, _FSDP, "t", None, None),
    w_k=_p(None, _FSDP, "t", None),
    w_v=_p(None, _FSDP, "t", None),
    w_o=_p(None, "t", None, None, _FSDP),
    ln2=_p(None, _NORM),
    w_gate=_p(None, _FSDP, "t"),
    w_up=_p(None, _FSDP, "t"),
    w_down=_p(None, "t", _FSDP),
)
MODEL_SPECS = Model(
    embed=_p("t", _FSDP), layers=LAYER_SPECS, final_norm=_p(_NORM), unembed=_p(_FSDP, "t")
)
CACHE_SPEC = P(None, "d", "c", "t", None)  # layers B/d S/c K/t D
ROWS_SPEC = P("d")
LOGITS_SPEC = P("d", ("t", "c"))  # B/d V/t/c


# ---------------------------------------------------------------------------------------------
# The hand-written decode step.
# ---------------------------------------------------------------------------------------------


def _rms_norm(x: jax.Array, gain: jax.Array, eps: float) -> jax.Array:
    return x * lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * gain


def _rope(x: jax.Array, positions: jax.Array, base: float) -> jax.Array:
    """RoPE of one token per row ``x`` ``(B, ..., D)`` at ``positions`` ``(B,)``."""
    half = x.shape[-1] // 2
    inv_freq = base ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angle = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # B, D/2
    angle = angle.reshape((x.shape[0],) + (1,) * (x.ndim - 2) + (half,))
    cos, sin = jnp.cos(angle), jnp.sin(angle)
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def _embed(embed: jax.Array, tokens: jax.Array) -> jax.Array:
    """``(B, 1, M)``: each device looks up its vocabulary block, psum over ``t``."""
    table = lax.all_gather(embed, _FSDP, axis=1, tiled=True)
    block = table.shape[0]
    local = tokens - lax.axis_index("t") * block
    ok = (local >= 0) & (local < block)
    got = jnp.take(table, jnp.where(ok, local, 0), axis=0, mode="clip")
    x = jnp.where(ok.reshape(tokens.shape + (1,)), got, jnp.zeros((), table.dtype))
    return lax.psum(x, "t")


def _project_qkv(config: Config, x: jax.Array, w: Layer) -> tuple[jax.Array, ...]:
    h = _rms_norm(x, lax.all_gather(w.ln1, _NORM, axis=0, tiled=True), config.norm_eps)
    q = jnp.einsum("abc,cdef->abdef", h, lax.all_gather(w.w_q, _FSDP, axis=0, tiled=True))
    k = jnp.einsum("abc,cde->abde", h, lax.all_gather(w.w_k, _FSDP, axis=0, tiled=True))
    v = jnp.einsum("abc,cde->abde", h, lax.all_gather(w.w_v, _FSDP, axis=0, tiled=True))
    return q, k, v


def _finish_layer(config: Config, x: jax.Array, o: jax.Array, w: Layer) -> jax.Array:
    w_o = lax.all_gather(w.w_o, _FSDP, axis=3, tiled=True)
    x = x + lax.psum(jnp.einsum("abcde,cdef->abf", o, w_o), "t")  # B L K G D, K G D M -> B L M
    h = _rms_norm(x, lax.all_gather(w.ln2, _NORM, axis=0, tiled=True), config.norm_eps)
    gate = jnp.einsum("abc,cd->abd", h, lax.all_gather(w.w_gate, _FSDP, axis=0, tiled=True))
    up = jnp.einsum("abc,cd->abd", h, lax.all_gather(w.w_up, _FSDP, axis=0, tiled=True))
    w_down = lax.all_gather(w.w_down, _FSDP, axis=1, tiled=True)
    mlp = jnp.einsum("abc,cd->abd", jax.nn.silu(gate) * up, w_down)
    return x + lax.psum(mlp, "t")


def _chunk_state(
    q: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array, start: jax.Array
) -> jax.Array:
    """This device's ``(max, sum, weighted values)`` per row and query head, ``(B, H, D + 2)``."""
    b, h, d = q.shape
    qg = q.reshape(b, k.shape[2], h // k.shape[2], d)
    s = jnp.einsum("bkgd,bskd->bkgs", qg, k, preferred_element_type=jnp.float32)
    s = s * d**-0.5
    keep = (start + jnp.arange(k.shape[1]))[None, :] < lengths[:, None]
    s = jnp.where(keep[:, None, None, :], s, -jnp.inf)
    m = lax.stop_gradient(jnp.max(s, axis=-1))
    p = jnp.exp(s - jnp.where(m == -jnp.inf, 0.0, m)[..., None])
    total = jnp.sum(p, axis=-1)
    o = jnp.einsum("bkgs,bskd->bkgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return jnp.concatenate([m[..., None], total[..., None], o], axis=-1).reshape(b, h, d + 2)


def _combine(states: jax.Array) -> jax.Array:
    m, total, o = states[..., 0], states[..., 1], states[..., 2:]
    top = lax.stop_gradient(jnp.max(m, axis=0))
    w = jnp.exp(m - jnp.where(top == -jnp.inf, 0.0, top))
    total = jnp.sum(w * total, axis=0)
    out = jnp.sum(w[..., None] * o, axis=0)
    return out / jnp.where(total == 0, 1.0, total)[..., None]


def _attend(q: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array, c: int) -> jax.Array:
    """Attention of ``q`` ``(B, H, D)`` over the cache split over ``c``: one psum of slots."""
    me = lax.axis_index("c")
    state = _chunk_state(q, k, v, lengths, me * k.shape[1])
    slots = jnp.where((jnp.arange(c) == me)[:, None, None, None], state[None], 0.0)
    out = _combine(lax.psum(slots, "c"))
    bad = (lengths < 0) | (lengths > c * k.shape[1])
    return jnp.where(bad[:, None, None], jnp.nan, out).astype(q.dtype)


def _logits(config: Config, model: Model, x: jax.Array, c: int) -> jax.Array:
    """``(B, V/t/c)``: this device's slice of its vocabulary block."""
    h = _rms_norm(x, lax.all_gather(model.final_norm, _NORM, axis=0, tiled=True), config.norm_eps)
    unembed = lax.all_gather(model.unembed, _FSDP, axis=0, tiled=True)
    block = unembed.shape[1] // c
    unembed = lax.dynamic_slice_in_dim(unembed, lax.axis_index("c") * block, block, 1)
    return jnp.einsum("ab,bc->ac", h, unembed)


def _hand_body(
    config: Config, c: int, model: Model, k_cache: jax.Array, v_cache: jax.Array,
    lengths: jax.Array, tokens: jax.Array,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:  # fmt: skip
    chunk = k_cache.shape[2]
    slot = lengths - lax.axis_index("c") * chunk
    slot = jnp.where((slot >= 0) & (slot < chunk), slot, chunk)  # not this chunk: dropped
    rows = jnp.arange(tokens.shape[0])

    def body(x: jax.Array, layer: tuple[Layer, jax.Array, jax.Array]):
        w, kc, vc = layer
        q, k, v = _project_qkv(config, x, w)  # B 1 K G D, B 1 K D
        q = _rope(q[:, 0], lengths, config.rope_base)
        k = _rope(k[:, 0], lengths, config.rope_base)
        kc = kc.at[rows, slot].set(k, mode="drop")
        vc = vc.at[rows, slot].set(v[:, 0], mode="drop")
        b, heads, group, width = q.shape
        o = _attend(q.reshape(b, heads * group, width), kc, vc, lengths + 1, c)
        return _finish_layer(config, x, o.reshape(b, 1, heads, group, width), w), (kc, vc)

    x = _embed(model.embed, tokens[:, None])
    x, (k, v) = lax.scan(body, x, (model.layers, k_cache, v_cache))
    return k, v, lengths + 1, _logits(config, model, x[:, 0], c)


def hand_decode_step(
    config: Config, model: Model, cache: dec.KVCache, tokens: jax.Array
) -> tuple[dec.KVCache, jax.Array]:
    """`examples.decoding.decode_step` as a plain ``jax.shard_map`` (under ``jax.set_mesh`` of
    a ``('d', 'c', 't')`` mesh): ``(cache, logits)``."""
    c = dict(zip(*_mesh_axes(), strict=True))["c"]
    k, v, lengths, logits = jax.shard_map(
        functools.partial(_hand_body, config, c),
        in_specs=(MODEL_SPECS, CACHE_SPEC, CACHE_SPEC, ROWS_SPEC, ROWS_SPEC),
        out_specs=(CACHE_SPEC, CACHE_SPEC, ROWS_SPEC, LOGITS_SPEC),
    )(model, cache.k, cache.v, cache.lengths, tokens)
    return dec.KVCache(k=k, v=v, lengths=lengths), logits


def _mesh_axes() -> tuple[tuple[str, ...], tuple[int, ...]]:
    mesh = jax.sharding.get_abstract_mesh()
    return tuple(mesh.axis_names), tuple(mesh.axis_sizes)


# ---------------------------------------------------------------------------------------------
# Measuring.
# ---------------------------------------------------------------------------------------------


def _typed_step(config: Config) -> Any:
    return jax.jit(lambda model, cache, tokens: dec.decode_step(config, model, cache, tokens))


def _hand_step(config: Config) -> Any:
    return jax.jit(lambda model, cache, tokens: hand_decode_step(config, model, cache, tokens))


def _inputs(config: Config, batch: int, max_len: int, seed: int) -> tuple[Any, ...]:
    """Placed weights, a half-full cache (random keys and values, rows of different lengths)
    and one token per row (under the mesh and the model's rules)."""
    key = jax.random.key(seed)
    model = tm.place_model(tm.init_model(config, key))
    cache = dec.empty_cache(config, batch, max_len)
    rng = np.random.default_rng(seed)
    lengths = rng.integers(max_len // 4, 3 * max_len // 4, size=batch).astype(np.int32)
    cache = dec.KVCache(
        k=jax.device_put(rng.standard_normal(cache.k.shape, np.float32), cache.k.sharding),
        v=jax.device_put(rng.standard_normal(cache.v.shape, np.float32), cache.v.sharding),
        lengths=jax.device_put(lengths, cache.lengths.sharding),
    )
    tokens = rng.integers(0, config.vocab, size=batch).astype(np.int32)
    tokens = jax.device_put(tokens, cache.lengths.sharding)
    return jax.block_until_ready((model, cache, tokens))


def _cache_bytes(cache: dec.KVCache, sizes: dict[str, int]) -> dict[str, Any]:
    """The cache's keys and values per device, read from their shards, against the total."""
    total = cache.k.nbytes + cache.v.nbytes
    per_device = [
        a.data.nbytes + b.data.nbytes
        for a, b in zip(cache.k.addressable_shards, cache.v.addressable_shards, strict=True)
    ]
    split = sizes["d"] * sizes["c"] * sizes["t"]
    return {
        "total": int(total),
        "per_device": sorted(set(per_device)),
        "of_rows": int(total // sizes["d"]),  # the cache of one device's rows (its d group)
        "exact": len(set(per_device)) == 1 and per_device[0] * split == total,
    }


def _combine_bytes(
    config: Config, batch: int, sizes: dict[str, int], typed_text: str, hand_text: str,
    report: Any,
) -> dict[str, Any]:  # fmt: skip
    """The combine's bytes per device per token and layer: formula, explain, both HLOs."""
    c, t, d = sizes["c"], sizes["t"], sizes["d"]
    formula = attention.decode_bytes(
        batch=batch // d, heads=config.n_heads // t, width=config.d_head, c=c
    )
    (ring,) = [r for r in report.rings if r.fn == "decode"]
    slot_shape = (c, batch // d, config.n_heads // t, config.d_head + 2)

    def hlo_bytes(text: str) -> list[float]:
        # The all-reduce of the (c, B, H, D + 2) slots over the c groups (the residual's psums
        # over t have another shape and other groups).
        c_groups = _axis_groups(sizes, "c")
        found = [
            col for col in _hlo.collectives(text)[0]
            if col.kind == "all-reduce" and col.in_bytes == 4 * math.prod(slot_shape)
            and {tuple(sorted(g)) for g in col.groups} == c_groups
        ]  # fmt: skip
        return [col.wire for col in found for _ in range(col.runs)]

    typed, hand = hlo_bytes(typed_text), hlo_bytes(hand_text)
    return {
        "formula": formula,
        "explain": ring.forward_bytes / ring.runs,
        "explain_runs": ring.runs,
        "hlo_typed": typed,
        "hlo_hand": hand,
        "layers": config.n_layers,
    }


def _axis_groups(sizes: dict[str, int], axis: str) -> set[tuple[int, ...]]:
    """The replica groups of a collective over ``axis`` alone (device ids in mesh order)."""
    shape = tuple(sizes[a] for a in AXES)
    ids = np.arange(math.prod(shape)).reshape(shape)
    i = AXES.index(axis)
    return {tuple(sorted(g)) for g in np.moveaxis(ids, i, -1).reshape(-1, shape[i]).tolist()}


def _max_relative(a: Any, b: Any) -> float:
    worst = 0.0
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        worst = max(worst, float(np.abs(x - y).max() / max(np.abs(y).max(), 1e-30)))
    return worst


def measure_mesh(
    shape: tuple[int, int, int], size: str, *, pairs: int, warmup: int, seed: int,
    steps: bool, log: Callable[[str], None],
) -> dict[str, Any]:  # fmt: skip
    """Everything of one mesh ``d x c x t``."""
    config, batch, max_len, _ = SIZES[size]
    mesh = jax.make_mesh(shape, AXES)
    sizes: dict[str, int] = dict(zip(AXES, shape, strict=True))
    name = "x".join(map(str, shape))
    rec: dict[str, Any] = {"mesh": list(shape)}
    with jax.set_mesh(mesh), shardlib.axis_rules(tm.rules_for(mesh)):
        specs = shardlib.shardtypes.make_partition_specs(Model)
        cache_specs = shardlib.shardtypes.make_partition_specs(dec.KVCache)
        if specs != MODEL_SPECS or cache_specs.k != CACHE_SPEC:  # the hand step's literals
            raise AssertionError(f"the model's layouts changed: {specs}, {cache_specs}")
        args = _inputs(config, batch, max_len, seed)
        log(f"[decode] {name}: compile both steps")
        typed = _typed_step(config).lower(*args).compile()
        hand = _hand_step(config).lower(*args).compile()
        texts = {"typed": typed.as_text() or "", "hand": hand.as_text() or ""}
        out_typed = jax.block_until_ready(typed(*args))
        out_hand = jax.block_until_ready(hand(*args))
        diff = {
            "logits": _max_relative(out_typed[1], out_hand[1]),
            "cache": _max_relative(out_typed[0], out_hand[0]),
        }
        np.testing.assert_allclose(  # before anything is timed
            np.asarray(out_typed[1]), np.asarray(out_hand[1]), rtol=RTOL, atol=RTOL
        )
        lengths = np.asarray(out_typed[0].lengths)
        np.testing.assert_array_equal(lengths, np.asarray(args[1].lengths) + 1)
        rec["differences"] = diff
        a, b = (_hlo.canonicalize(texts[n]) for n in ("typed", "hand"))
        rec["structure"] = {
            n: {
                "census": _hlo.collective_census(texts[n]),
                "traffic": _hlo.collective_traffic(texts[n]),
            }
            for n in ("typed", "hand")
        }
        rec["identical_hlo"] = a == b
        rec["first_difference"] = _hlo.first_difference(a, b)
        rec["cache_bytes"] = _cache_bytes(args[1], sizes)
        log(f"[decode] {name}: explain")
        report = shardlib.explain(
            lambda model, cache, tokens: dec.decode_step(config, model, cache, tokens), *args
        )
        rec["combine"] = _combine_bytes(config, batch, sizes, texts["typed"], texts["hand"], report)
        if steps:
            log(f"[decode] {name}: step time, {pairs} pairs")
            control = _hand_step(config).lower(*args).compile()
            fns = {"typed": typed, "hand": hand, "hand'": control}
            for f in fns.values():
                for _ in range(max(warmup, 1)):
                    jax.block_until_ready(f(*args))
            raw = paired_step_times(
                {n: (f, args) for n, f in fns.items()}, COMPARISONS, pairs, seed
            )
            rec["steps"] = {k: raw[k] for k in ("pairs", "median_ms", "ratios")}
    return rec


def shape_text(size: str) -> str:
    c, batch, max_len, _ = SIZES[size]
    return (
        f"B={batch}, cache S={max_len} (half full, rows of different lengths), M={c.d_model}, "
        f"heads {c.n_heads} ({c.n_kv_heads} kv) x {c.d_head}, F={c.d_ff}, V={c.vocab}, "
        f"{c.n_layers} layers, f32"
    )


def run(
    size: str = "full",
    *,
    pairs: int = 120,
    warmup: int = 5,
    seed: int = 0,
    skip: Iterable[str] = (),
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Every mesh of ``size``; step time unless ``skip`` has ``'steps'``."""
    steps = "steps" not in set(skip)
    meshes = {}
    for shape in SIZES[size][3]:
        meshes["x".join(map(str, shape))] = measure_mesh(
            shape, size, pairs=pairs, warmup=warmup, seed=seed, steps=steps, log=log
        )
    return {"shape": shape_text(size), "meshes": meshes}


# ---------------------------------------------------------------------------------------------
# Report.
# ---------------------------------------------------------------------------------------------


def _bytes_agree(comb: dict[str, Any]) -> bool:
    hlo = comb["hlo_typed"]
    return (
        len(hlo) == comb["layers"] == len(comb["hlo_hand"]) == comb["explain_runs"]
        and all(round(x) == comb["formula"] for x in (*hlo, *comb["hlo_hand"]))
        and comb["explain"] == comb["formula"]
    )


def targets(rec: dict[str, Any]) -> list[dict[str, Any]]:
    """The decode part's claims as report rows, per mesh."""
    rows = []
    for name, m in rec["meshes"].items():
        st, d = m["structure"], m["differences"]
        same = st["typed"]["census"] == st["hand"]["census"]
        tt, th = st["typed"]["traffic"]["total"], st["hand"]["traffic"]["total"]
        same_bytes = tt == th
        rows.append(
            _row(
                f"decode {name}: typed step's collectives (census, bytes) = hand-written "
                "shard_map's",
                f"census {'equal' if same else 'differs'} {st['typed']['census']}, payload "
                f"{tt['payload_bytes_per_step']:,} vs {th['payload_bytes_per_step']:,} B/step; "
                f"canonical HLO {'identical' if m['identical_hlo'] else 'differs'}",
                same and same_bytes,
            )
        )
        rows.append(
            _row(
                f"decode {name}: logits and cache equal the hand step's (rtol {RTOL:g})",
                f"logits {d['logits']:.1e}, cache {d['cache']:.1e}",
                d["logits"] <= RTOL and d["cache"] <= RTOL,
            )
        )
        cb = m["cache_bytes"]
        rows.append(
            _row(
                f"decode {name}: cache bytes per device = its rows' / (c·t) exactly",
                f"{'/'.join(f'{x:,}' for x in cb['per_device'])} of {cb['of_rows']:,} "
                f"(total {cb['total']:,})",
                cb["exact"],
            )
        )
        comb = m["combine"]
        hlo = "/".join(f"{x:,}" for x in sorted({round(x) for x in comb["hlo_typed"]})) or "none"
        rows.append(
            _row(
                f"decode {name}: combine bytes per token and layer: formula = explain = HLO",
                f"{comb['formula']:,} = {comb['explain']:,.0f} = {hlo} "
                f"(x{len(comb['hlo_typed'])} layers)",
                _bytes_agree(comb),
            )
        )
        if "steps" in m:
            r = m["steps"]["ratios"]["typed/hand"]
            c = m["steps"]["ratios"]["hand'/hand"]
            rows.append(
                _row(
                    f"decode {name}: step time typed/hand within {100 * STEP_TOLERANCE:.0f}%",
                    f"{r['median']:.3f} [{r['ci95'][0]:.3f}, {r['ci95'][1]:.3f}] (control "
                    f"{c['median']:.3f} [{c['ci95'][0]:.3f}, {c['ci95'][1]:.3f}])",
                    abs(r["median"] - 1) <= STEP_TOLERANCE,
                )
            )
    return rows


def render(rec: dict[str, Any], w: Callable[[str], None]) -> None:
    """The decode section of ``results.md``."""
    names = list(rec["meshes"])
    ms = rec["meshes"]
    w("## Decoding: the typed decode step vs a hand-written shard_map (`decode`)")
    w("")
    w(
        f"examples/decoding.py's `decode_step` ({rec['shape']}) on meshes d x c x t "
        f"({', '.join(names)}; the cache's positions over c, its heads over t) against the same "
        "step in a plain `jax.shard_map` with `jax.lax` collectives. Per device, per step:"
    )
    w("")
    cols = [f"{n} {v}" for n in names for v in ("typed", "hand")]
    w("| | " + " | ".join(cols) + " |")
    w("|---|" + "---:|" * len(cols))
    kinds = sorted(
        {k for n in names for v in ("typed", "hand") for k in ms[n]["structure"][v]["census"]}
    )
    for k in kinds:
        cells = []
        for n in names:
            for v in ("typed", "hand"):
                r = ms[n]["structure"][v]["traffic"]["kinds"].get(k)
                cells.append(
                    "0" if r is None else f"{r['count']} ({r['runs']}/step) "
                    f"{r['payload_bytes_per_step']:,} B"
                )  # fmt: skip
        w(f"| {k} | " + " | ".join(cells) + " |")
    cells = [
        f"{ms[n]['structure'][v]['traffic']['total']['wire_bytes_per_step']:,}"
        for n in names
        for v in ("typed", "hand")
    ]
    w("| wire bytes/step (est.) | " + " | ".join(cells) + " |")
    if all("steps" in ms[n] for n in names):
        cells = [f"{ms[n]['steps']['median_ms'][v]:.3f}" for n in names for v in ("typed", "hand")]
        w("| median step ms | " + " | ".join(cells) + " |")
    w("")
    for n in names:
        _mesh_notes(n, ms[n], w)
    w("")
    if all("steps" in ms[n] for n in names):
        _step_table(ms, w)


def _mesh_notes(n: str, m: dict[str, Any], w: Callable[[str], None]) -> None:
    """One mesh's line: HLO, differences, cache bytes, the combine's bytes three ways."""
    cb, comb = m["cache_bytes"], m["combine"]
    hlo = sorted({round(x) for x in comb["hlo_typed"]})
    w(
        f"- {n}: canonical compiled HLO {'identical' if m['identical_hlo'] else 'differs'}; "
        f"max relative difference typed vs hand: logits {m['differences']['logits']:.1e}, "
        f"cache {m['differences']['cache']:.1e}. Cache (keys and values): "
        f"{cb['per_device'][0]:,} bytes per device of {cb['total']:,} "
        f"({cb['of_rows']:,} for one device's rows, /(c·t) = "
        f"{cb['of_rows'] // (m['mesh'][1] * m['mesh'][2]):,}). The combine per token and "
        f"layer: `attention.decode_bytes` {comb['formula']:,} B, explain "
        f"{comb['explain']:,.0f} B (x{comb['explain_runs']} runs), HLO all-reduce over c "
        f"{'/'.join(f'{x:,}' for x in hlo)} B (x{len(comb['hlo_typed'])} per step)."
    )
    if not m["identical_hlo"]:
        w("")
        w("  First difference of the canonical HLO (typed -, hand +):")
        w("")
        w("  ```")
        for line in m["first_difference"].splitlines():
            w("  " + line)
        w("  ```")


def _step_table(ms: dict[str, Any], w: Callable[[str], None]) -> None:
    """The step-time ratios of every mesh: typed / hand and the control hand' / hand."""
    names = list(ms)
    w(
        f"Step time ({ms[names[0]]['steps']['pairs']} interleaved pairs per comparison; "
        "`hand'` is a second, separately compiled hand step):"
    )
    w("")
    w("| mesh | | median step ms | ratio (median of pairs) | 95% bootstrap CI |")
    w("|---|---|---:|---:|---|")
    for n in names:
        st = ms[n]["steps"]
        for a, b in COMPARISONS:
            r = st["ratios"][f"{a}/{b}"]
            w(
                f"| {n} | {a} / {b} | {st['median_ms'][a]:.3f} / {st['median_ms'][b]:.3f} | "
                f"{r['median']:.4f} | [{r['ci95'][0]:.4f}, {r['ci95'][1]:.4f}] |"
            )
    w("")
