"""Greedy generation with the headline transformer: train it briefly (or restore it), then
decode with the typed key/value cache of ``examples/decoding.py``.

Run from the repository root (it simulates 8 CPU devices)::

    python examples/generate.py                   # mesh 4x2: batch over d=4, heads over t=2
    python examples/generate.py --mesh 1x8        # all tensor parallel
    python examples/generate.py --mesh 2x2x2      # d=2, c=2 (the cache's positions), t=2
    python examples/generate.py --checkpoint-dir /tmp/gen   # train once, save ...
    python examples/generate.py --checkpoint-dir /tmp/gen --mesh 2x2x2   # ... restore elsewhere

The weights come from ``examples/transformer.py`` (its ``main``: the synthetic Markov language,
AdamW; with ``--checkpoint-dir`` it resumes from the latest checkpoint there, so a finished
run is only restored, into this mesh's layout). Prompts are unseen sentences of the same
language; the script prefills them, decodes ``--new-tokens`` tokens per row greedily (argmax of
the logits) and prints the decode rate (tokens per second over all rows, after the first
step, which compiles), the cache's bytes per device and in all, and how many generated tokens
are a possible successor of the one before in the language (a trained model: nearly all).

``main(argv)`` returns the tokens and those numbers (for the tests).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the `examples` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from examples import _devices  # noqa: E402

_devices.simulate_cpu_devices(8)  # sets XLA_FLAGS: 8 simulated CPU devices, before JAX starts

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import shardlib  # noqa: E402
from examples import decoding as dec  # noqa: E402
from examples import transformer as T  # noqa: E402
from examples import transformer_model as tm  # noqa: E402

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    """The command line: ``--help`` lists every flag with its help and default."""
    p = argparse.ArgumentParser(
        description="Train (or restore) the headline transformer, then generate greedily with "
        "a typed key/value cache.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--mesh",
        default="4x2",
        help="DxT (axes d, t) or DxCxT (d x context x t: the cache's positions over c), as "
        "examples/transformer.py's --mesh",
    )
    p.add_argument("--steps", type=int, default=150, help="training steps (transformer.py's)")
    p.add_argument("--d-model", type=int, default=128, help="model width M")
    p.add_argument("--layers", type=int, default=2, help="transformer blocks")
    p.add_argument("--heads", type=int, default=16, help="query heads")
    p.add_argument(
        "--kv-heads", type=int, default=8, help="key/value heads (GQA; t must divide them)"
    )
    p.add_argument("--d-ff", type=int, default=128, help="SwiGLU hidden width")
    p.add_argument("--vocab", type=int, default=64, help="vocabulary size V")
    p.add_argument("--seq-len", type=int, default=32, help="training sequence length")
    p.add_argument("--batch", type=int, default=16, help="rows, in training and generating")
    p.add_argument("--prompt-len", type=int, default=8, help="prompt tokens per row")
    p.add_argument("--new-tokens", type=int, default=24, help="tokens generated per row")
    p.add_argument("--seed", type=int, default=0, help="seeds the weights and the data")
    p.add_argument(
        "--checkpoint-dir",
        default=None,
        help="train into (and resume from) checkpoints here (orbax); None: train from scratch",
    )
    return p


def _train_argv(args: argparse.Namespace) -> list[str]:
    """``examples/transformer.py``'s command line for the weights."""
    argv = [
        *("--mesh", args.mesh, "--steps", str(args.steps), "--seed", str(args.seed)),
        *("--d-model", str(args.d_model), "--layers", str(args.layers)),
        *("--heads", str(args.heads), "--kv-heads", str(args.kv_heads)),
        *("--d-ff", str(args.d_ff), "--vocab", str(args.vocab)),
        *("--seq-len", str(args.seq_len), "--batch", str(args.batch)),
        *("--log-every", str(max(1, args.steps // 3))),
    ]
    if args.checkpoint_dir:
        argv += ["--checkpoint-dir", args.checkpoint_dir]
        directory = Path(args.checkpoint_dir)
        if directory.is_dir() and any(directory.iterdir()):
            argv.append("--resume")
    return argv


def _greedy_step(
    config: tm.Config, model: tm.Model, cache: dec.KVCache, logits: jax.Array
) -> tuple[jax.Array, dec.KVCache, jax.Array]:
    """The argmax of ``logits`` (the next token of each row), then one decode step of it."""
    tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    cache, logits = dec.decode_step(config, model, cache, tokens)
    return tokens, cache, logits


def generate(
    config: tm.Config, model: tm.Model, prompts: np.ndarray, new_tokens: int
) -> dict[str, Any]:
    """Greedy tokens ``(B, new_tokens)`` after ``prompts`` ``(B, P)``, under the mesh and rules
    in force; with the decode rate and the cache's bytes.

    One program per step (the argmax inside it) and its tokens fetched before the next: as a
    generator streaming its output does, and XLA:CPU's simulated devices need it (two programs
    with collectives in flight at once can wait on each other's threads)."""
    batch, length = prompts.shape
    c = tm.context_size()
    max_len = -(-(length + new_tokens) // c) * c  # a multiple of the context axis
    donate = jax.default_backend() != "cpu"  # XLA:CPU cannot reuse donated buffers
    prefill = jax.jit(dec.prefill, static_argnums=0, donate_argnums=(4,) if donate else ())
    step = jax.jit(_greedy_step, static_argnums=0, donate_argnums=(2,) if donate else ())
    cache = dec.empty_cache(config, batch, max_len)
    per_device = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(cache))
    total = sum(x.nbytes for x in jax.tree.leaves(cache))
    lengths = jnp.full((batch,), length, jnp.int32)
    cache, logits = prefill(config, model, jnp.asarray(prompts), lengths, cache)
    jax.block_until_ready(logits)
    out = []
    start = 0.0
    for i in range(new_tokens):
        if i == 1:  # the first step compiled: time the rest
            start = time.perf_counter()
        tokens, cache, logits = step(config, model, cache, logits)
        out.append(np.asarray(tokens))  # waits for the step
    steps = new_tokens - 1
    rate = batch * steps / (time.perf_counter() - start) if steps > 0 else float("nan")
    return {
        "tokens": np.stack(out, axis=1),
        "tokens_per_s": rate,
        "cache_bytes_per_device": per_device,
        "cache_bytes": total,
        "max_len": max_len,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Train or restore, generate; return the tokens, the rate, the cache's bytes and the
    fraction of generated tokens the language allows after the one before."""
    args = build_parser().parse_args(argv)
    trained = T.main(_train_argv(args))
    model = trained["state"]["model"]
    config = tm.Config(
        vocab=args.vocab,
        d_model=args.d_model,
        n_heads=args.heads,
        n_kv_heads=args.kv_heads,
        d_head=args.d_model // args.heads,
        d_ff=args.d_ff,
        n_layers=args.layers,
        seq_len=args.seq_len,
    )
    language = T.MarkovLanguage.make(args.vocab, args.seed)
    prompts = language.batch(10**9, args.batch, args.prompt_len, args.seed)  # never trained on
    mesh = T.make_mesh(args.mesh)
    with jax.set_mesh(mesh), shardlib.axis_rules(tm.rules_for(mesh)):
        out = generate(config, model, prompts, args.new_tokens)
    seq = np.concatenate([prompts, out["tokens"]], axis=1)
    prev, nxt = seq[:, args.prompt_len - 1 : -1], seq[:, args.prompt_len :]
    allowed = (language.successors[prev] == nxt[..., None]).any(-1)
    out["allowed"] = float(allowed.mean())
    print(
        f"generated {args.new_tokens} tokens x {args.batch} rows on mesh {args.mesh}: "
        f"{out['tokens_per_s']:.0f} tok/s after the first step; cache (max_len "
        f"{out['max_len']}) {out['cache_bytes_per_device']} bytes per device, "
        f"{out['cache_bytes']} in all; {100 * out['allowed']:.1f}% of the new tokens are "
        f"possible successors in the language"
    )
    print("row 0:", " ".join(map(str, seq[0])))
    return out


if __name__ == "__main__":
    main()
