"""Train a small mixture-of-experts decoder with expert parallelism (``shardlib.moe``).

Run from the repository root (it simulates 8 CPU devices)::

    python examples/moe.py                 # mesh 4x2: d=4 (data), e=2 (experts)
    python examples/moe.py --mesh 2x4      # d=2, e=4: two experts per device

The model: token embedding, then pairs of layers, each a dense block (causal attention with
RoPE and a GELU MLP) and a MoE block (the same attention, then ``shardlib.moe.layer``: 8
experts, top-2, capacity factor 1.25, the load-balancing loss added to the loss), on the
headline example's synthetic language (a random Markov chain, ``examples/transformer.py``).
The specs name roles, mapped by `RULES` (``shardlib.axis_rules``): the batch is split over
``d`` and ``e`` together (``'B/batch L'``, ``batch`` -> ``('d', 'e')``: every device routes its
own tokens); the experts' weights are split over ``e`` (``'E/expert M F'``, ``expert`` ->
``e``) and the other weights are replicated (their gradients are summed over the mesh). Each step prints the loss, the
(token, choice) pairs dropped at the experts' capacity, and every few steps the experts' load.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import sys
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # run as a script: simulate 8 CPU devices (never on import)
    if __package__ in (None, ""):
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from examples import _devices

    _devices.simulate_cpu_devices(8)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax import lax  # noqa: E402

import shardlib  # noqa: E402
from examples import transformer_model as tm  # noqa: E402
from examples.transformer import MarkovLanguage  # noqa: E402
from shardlib import moe, shardops  # noqa: E402
from shardlib.shardtypes import (  # noqa: E402
    Array,
    Stacked,
    f32,
    i32,
    make_shardings,
    pytree_dataclass,
    sharding_summary,
    typed_shard_map,
)

# The roles the specs name, on the ('d', 'e') mesh: tokens over both axes, experts over 'e'.
RULES = {"batch": ("d", "e"), "expert": "e"}


@dataclasses.dataclass(frozen=True)
class Config:
    """Hyperparameters (hashable: a static argument of the jitted step)."""

    vocab: int = 64
    d_model: int = 32
    heads: int = 4
    d_head: int = 8
    d_ff: int = 64
    pairs: int = 2  # layers = 2 * pairs, every other one MoE
    experts: int = 8
    k: int = 2
    capacity_factor: float = 1.25
    aux_weight: float = 0.1
    seq_len: int = 32
    eps: float = 1e-6


@pytree_dataclass
class Attention:
    ln: f32[Array, b"M"]
    w_qkv: f32[Array, b"M three H D"]
    w_o: f32[Array, b"H D M"]


@pytree_dataclass
class Pair:
    attn1: Attention
    ln_mlp: f32[Array, b"M"]
    w_up: f32[Array, b"M F"]
    w_down: f32[Array, b"F M"]
    attn2: Attention
    ln_moe: f32[Array, b"M"]
    w_router: f32[Array, b"M E"]
    w_in: f32[Array, b"E/expert M F"]
    w_out: f32[Array, b"E/expert F M"]


@pytree_dataclass
class Model:
    embed: f32[Array, b"V M"]
    pairs: Stacked[Pair, b"pairs"]
    final_norm: f32[Array, b"M"]


def init_model(c: Config, seed: int) -> Model:
    """Global weights (numpy normal, scaled by fan-in), norm gains 1."""
    rng = np.random.default_rng(seed)
    n, m, f, e, h, d = c.pairs, c.d_model, c.d_ff, c.experts, c.heads, c.d_head

    def w(*shape: int, fan: int) -> jax.Array:
        return jnp.asarray(rng.standard_normal((n, *shape)) / math.sqrt(fan), jnp.float32)

    def attn() -> Attention:
        return Attention(jnp.ones((n, m)), w(m, 3, h, d, fan=m), w(h, d, m, fan=h * d))

    pair = Pair(attn(), jnp.ones((n, m)), w(m, f, fan=m), w(f, m, fan=f), attn(),
                jnp.ones((n, m)), w(m, e, fan=m), w(e, m, f, fan=m), w(e, f, m, fan=f))  # fmt: skip
    embed = jnp.asarray(rng.standard_normal((c.vocab, m)) / math.sqrt(m), jnp.float32)
    return Model(embed, pair, jnp.ones(m))


def _attention(c: Config, x: jax.Array, w: Attention) -> jax.Array:
    h = tm._rms_norm(x, w.ln, c.eps)
    q, k, v = jnp.unstack(jnp.einsum("blm,mthd->tblhd", h, w.w_qkv))
    q, k = tm._rope(q, 1, 10000.0), tm._rope(k, 1, 10000.0)
    s = jnp.einsum("blhd,bshd->bhls", q, k) / math.sqrt(c.d_head)
    causal = jnp.tril(jnp.ones((x.shape[1], x.shape[1]), bool))
    p = tm._softmax(jnp.where(causal, s, -jnp.inf))
    return x + jnp.einsum("bhls,bshd,hdm->blm", p, v, w.w_o)


def _pair(c: Config, x: jax.Array, w: Pair) -> tuple[jax.Array, tuple]:
    x = _attention(c, x, w.attn1)
    x = x + jax.nn.gelu(tm._rms_norm(x, w.ln_mlp, c.eps) @ w.w_up) @ w.w_down
    x = _attention(c, x, w.attn2)
    y, stats = moe.layer(
        tm._rms_norm(x, w.ln_moe, c.eps), w.w_router, w.w_in, w.w_out, k=c.k, axis="expert",
        capacity_factor=c.capacity_factor, stats_axes="batch",
    )  # fmt: skip
    return x + y, (stats.aux_loss, stats.dropped, stats.load)


@typed_shard_map(static_argnames=("c",))
def loss_fn(
    c: Config, tokens: i32[Array, b"B/batch L"], model: Model
) -> tuple[f32[Array, b""], f32[Array, b""], i32[Array, b"pairs"], i32[Array, b"pairs E"]]:
    """(loss with the aux term, cross-entropy, dropped pairs per MoE layer, expert loads)."""
    x = model.embed[tokens]
    x, (aux, dropped, load) = lax.scan(functools.partial(_pair, c), x, model.pairs)
    logits = tm._rms_norm(x, model.final_norm, c.eps) @ model.embed.T
    nll = (
        jax.nn.logsumexp(logits, axis=-1)
        - jnp.take_along_axis(logits, jnp.roll(tokens, -1, axis=1)[..., None], axis=-1)[..., 0]
    )
    ce = shardops.pmean("", jnp.mean(nll[:, :-1]), "batch")
    dropped = shardops.psum("pairs", dropped, "batch")
    load = shardops.psum("pairs E", load, "batch")
    return ce + c.aux_weight * jnp.sum(aux), ce, dropped, load


def make_optimizer(lr: float) -> optax.GradientTransformation:
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adam(lr))


@functools.partial(jax.jit, static_argnames=("c", "lr"))
def train_step(c: Config, lr: float, state: dict, tokens: jax.Array) -> tuple[dict, tuple]:
    def total(model: Model) -> tuple[jax.Array, tuple]:
        loss, ce, dropped, load = loss_fn(c, tokens, model)
        return loss, (ce, dropped, load)

    (_, metrics), grads = jax.value_and_grad(total, has_aux=True)(state["model"])
    updates, opt = make_optimizer(lr).update(grads, state["opt"], state["model"])
    return {"model": optax.apply_updates(state["model"], updates), "opt": opt}, metrics


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Train a small MoE decoder with expert parallelism.")
    p.add_argument("--mesh", default="4x2", help="DxE: data x expert axis sizes (default 4x2)")
    p.add_argument("--steps", type=int, default=60, help="training steps (default 60)")
    p.add_argument("--batch", type=int, default=16, help="sequences per step (default 16)")
    p.add_argument("--lr", type=float, default=1e-2, help="Adam learning rate (default 1e-2)")
    p.add_argument("--seed", type=int, default=0, help="data and init seed (default 0)")
    return p


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Train; return the losses, the dropped pairs and the loads per step."""
    args = build_parser().parse_args(argv)
    dims = tuple(int(s) for s in args.mesh.split("x"))
    mesh = jax.make_mesh(dims, ("d", "e"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    c = Config()
    language = MarkovLanguage.make(c.vocab, args.seed)
    history: dict[str, Any] = {"losses": [], "dropped": [], "load": []}
    with jax.set_mesh(mesh), shardlib.axis_rules(RULES):
        model = jax.device_put(init_model(c, args.seed), make_shardings(Model))
        state = {"model": model, "opt": make_optimizer(args.lr).init(model)}
        print(sharding_summary(model))
        put = functools.partial(jax.device_put, device=make_shardings(i32[Array, b"B/batch L"]))
        first = put(language.batch(0, args.batch, c.seq_len, args.seed))
        report = shardlib.explain(lambda s, t: train_step(c, args.lr, s, t), state, first)
        print("cost of one step (shardlib.explain):\n  " + report.short().replace("\n", "\n  "))
        for step in range(args.steps):
            tokens = put(language.batch(step, args.batch, c.seq_len, args.seed))
            state, (ce, dropped, load) = train_step(c, args.lr, state, tokens)
            history["losses"].append(float(ce))
            history["dropped"].append(np.asarray(dropped).tolist())
            history["load"].append(np.asarray(load))
            print(f"step {step + 1:3d}  loss {float(ce):.3f}  dropped per MoE layer "
                  f"{history['dropped'][-1]} of {args.batch * c.seq_len * c.k}")  # fmt: skip
            if step % 20 == 0 or step == args.steps - 1:
                print("  expert load (pairs per expert, per MoE layer):", load.tolist())
    history["best_possible_loss"] = language.best_loss(c.seq_len)
    print(f"final loss {history['losses'][-1]:.3f}; the chain's entropy "
          f"{history['best_possible_loss']:.3f}")  # fmt: skip
    return history


if __name__ == "__main__":
    main()
