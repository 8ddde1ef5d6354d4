"""Part of the attention section of ``python -m benchmarks``: the headline model's weight
memory per device with context parallelism, weights split over ``d x c`` against replicated
over ``c``.

``examples/transformer_model.py`` on ``('d', 'c', 't')`` meshes of the 8 host devices: its
``AXIS_ROLES`` give ``c`` the roles ``seq`` and ``fsdp``, so FSDP runs over ``d x c``. The
other layout is the same model under the rules with ``fsdp = ('d',)`` (what the model did
before: weights replicated over ``c``). For each mesh the value-and-grad step is compiled
(not run) both ways and XLA's ``memory_analysis()`` gives the argument bytes per device; the
tokens are counted apart so that the ratio is of the weights alone.

:func:`run` measures, :func:`targets` and :func:`render` give :mod:`benchmarks.report` its
rows and Markdown (the attention part calls them).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

import shardlib
from benchmarks._tables import row as _row
from examples import transformer_model as tm
from shardlib.shardtypes import i32, make_shardings

__all__ = ["MESHES", "SIZES", "render", "run", "targets"]

MESHES = ((2, 2, 2), (1, 4, 2), (1, 8, 1))  # ('d', 'c', 't'): c = 2, 4, 8
SIZES: dict[str, tuple[tm.Config, int]] = {  # (config, global batch)
    "tiny": (
        tm.Config(
            vocab=64, d_model=32, n_heads=8, n_kv_heads=4, d_head=4, d_ff=64, n_layers=2, seq_len=32
        ),
        8,
    ),
    "full": (  # the suite's transformer workload at full size, with a longer sequence
        tm.Config(
            vocab=512,
            d_model=128,
            n_heads=8,
            n_kv_heads=4,
            d_head=16,
            d_ff=512,
            n_layers=4,
            seq_len=256,
        ),
        16,
    ),
}


def _argument_bytes(config: tm.Config, batch: int, mesh: jax.sharding.Mesh, rules: dict) -> dict:
    """The compiled step's argument bytes per device under ``rules``, and the tokens' part."""
    abstract = jax.eval_shape(lambda key: tm.init_model(config, key), jax.random.key(0))
    with jax.set_mesh(mesh), shardlib.axis_rules(rules):
        model = jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
            abstract,
            make_shardings(tm.Model),
        )
        token_sharding = make_shardings(i32["B/batch L"])
        tokens = jax.ShapeDtypeStruct((batch, config.seq_len), np.int32, sharding=token_sharding)
        step = jax.jit(tm.loss_and_grad, static_argnums=0)
        exe = step.lower(config, model, tokens).compile()
    token_bytes = 4 * int(np.prod(token_sharding.shard_shape(tokens.shape)))
    return {
        "arguments": int(exe.memory_analysis().argument_size_in_bytes),
        "tokens": token_bytes,
    }


def run(size: str = "full", log: Callable[[str], None] = print) -> dict[str, Any]:
    """Weight bytes per device of each mesh, split over ``d x c`` and replicated over ``c``."""
    config, batch = SIZES[size]
    rows = []
    for shape in MESHES:
        mesh = jax.make_mesh(shape, ("d", "c", "t"))
        rules = tm.rules_for(mesh)
        split = _argument_bytes(config, batch, mesh, rules)
        replicated = _argument_bytes(config, batch, mesh, {**rules, "fsdp": ("d",)})
        rows.append(
            {
                "mesh": list(shape),
                "c": shape[1],
                "split": split["arguments"] - split["tokens"],
                "replicated": replicated["arguments"] - replicated["tokens"],
            }
        )
        log(f"  weights over d x c on {shape}: {rows[-1]}")
    return {"config": dataclasses.asdict(config), "batch": batch, "rows": rows}


def targets(rec: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per mesh: weight bytes split over ``d x c`` times ``c`` equal the replicated."""
    return [
        _row(
            f"attention: the headline model's weight bytes per device over d x c = 1/c of "
            f"replicated over c (mesh {'x'.join(map(str, r['mesh']))}, c = {r['c']})",
            f"{r['split']:,} vs {r['replicated']:,} bytes ({r['replicated'] / r['split']:.2f}x)",
            r["split"] * r["c"] == r["replicated"],
        )
        for r in rec["rows"]
    ]


def render(rec: dict[str, Any], w: Callable[[str], None]) -> None:
    """The Markdown table of :func:`run`'s rows."""
    c = rec["config"]
    w("### Weights over d x c (the headline model with context parallelism)")
    w("")
    w(
        f"Config: d_model {c['d_model']}, {c['n_layers']} layers, d_ff {c['d_ff']}, vocab "
        f"{c['vocab']}, seq {c['seq_len']}, batch {rec['batch']}, f32. Weight bytes per device "
        "= the compiled step's `memory_analysis()` argument bytes less the tokens'."
    )
    w("")
    w("| mesh (d, c, t) | c | replicated over c | split over d x c | ratio |")
    w("|---|---:|---:|---:|---:|")
    for r in rec["rows"]:
        ratio = r["replicated"] / r["split"]
        mesh = "x".join(map(str, r["mesh"]))
        w(f"| {mesh} | {r['c']} | {r['replicated']:,} | {r['split']:,} | {ratio:.2f} |")
    w("")
