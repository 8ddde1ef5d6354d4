"""The headline transformer trained with pipeline parallelism: stages over ``p``, FSDP + tensor
parallelism inside each stage.

Run from the repository root (it simulates 8 CPU devices)::

    python examples/pipeline.py                                  # mesh 2x2x2, GPipe
    python examples/pipeline.py --schedule circular --mesh 4x2x1 # 4 stages, 2 groups each
    python examples/pipeline.py --mesh 8x1x1 --microbatches 16   # all pipeline
    python examples/pipeline.py --schedule 1f1b --microbatches 8 # 1F1B (also zb-h1, interleaved)
    python examples/pipeline.py --schedule zb-v --microbatches 4 # ZB-V: two chunks per stage

The model is ``examples/transformer_model.py``'s, unchanged: its ``Layer`` type, and its
``checkpointed_layer`` (``layer_forward`` under ``explicit_activation_checkpointing``) runs
every layer. Only where the stacked layers live changes:

- **Mesh** ``--mesh PxDxT``, axes ``('p', 'd', 't')``: ``p`` pipeline stages; inside each
  stage ``d`` splits the batch and every weight (FSDP) and ``t`` splits heads, MLP hidden
  units and the vocabulary (tensor parallelism), exactly as in the headline example. The
  specs name the headline model's roles (``batch``, ``fsdp``, ``tensor``) and ``stage`` for
  the pipeline; ``transformer_model.rules_for(mesh)`` maps them (``stage`` -> ``p``).
- **GPipe** (``--schedule gpipe``): the ``(L, ...)`` layer stack is split over ``p`` on its
  layer dim, ``Stacked[Layer, b'layers/stage']``: stage ``s`` holds layers ``s*L/p .. (s+1)*L/p``.
  `shardlib.pipeline.gpipe` runs ``m`` microbatches through the stages; the bubble fraction
  is ``(p-1)/(m+p-1)``.
- **Circular** (``--schedule circular --groups V``): the stack is reshaped to
  ``(V, L/V, ...)`` and split over ``p`` on its second dim, ``Stacked[Layer, b'v layers/stage']``:
  stage ``s`` holds ``V`` non-adjacent groups of layers and each microbatch goes round the
  ring of stages ``V`` times (`shardlib.pipeline.circular`); the bubble fraction is
  ``(p-1)/(V*m+p-1)``. Needs ``m >= p``.
- **1F1B, ZB-H1, interleaved** (``--schedule 1f1b | zb-h1 | interleaved``):
  `shardlib.pipeline.pipeline_loss` runs forward and backward work in one loop, so it
  computes the loss itself, on the last stage: the loss head (final norm, unembedding,
  cross-entropy of one microbatch over ``m``) is the ``loss_fn`` passed in, its weights
  ``loss_params``, the tokens the ``targets``. ``interleaved`` takes the circular layout.
  A stage holds the residuals of at most ``p`` microbatches (interleaved: a bounded number
  of groups), whatever ``m`` is.
- **ZB-V** (``--schedule zb-v``): as ZB-H1, with two layer chunks per stage in a V, the
  stack laid out by ``pipeline.to_groups(layers, route='v', stages=P)``
  (``Stacked[Layer, b'v layers/stage']`` with ``v = 2``, in the V's order: stage ``s`` holds
  layer groups ``s`` and ``2P - 1 - s``). The V ends on stage 0, so the loss head runs there.
- **Microbatches**: the tokens come already cut into ``m`` microbatches, ``i32['m B/batch L']``
  (``B`` rows each, split over ``d``); one microbatch block is ``f32['B/batch L M']``, the
  residual stream ``layer_forward`` takes.

Where the embedding and the loss run: on **every stage**, replicated over ``p`` (the
embedding, final norm and unembedding weights are not split over ``p``). The embedding
gives the microbatches, replicated over ``p`` as the schedules want them (only stage 0 reads
them); the schedule's ``broadcast=True`` sums the last stage's outputs over ``p`` (one
all-reduce of the activations) so that every stage holds them and computes the same loss.
The alternative, embedding on stage 0 and the loss on the last stage only, saves ``p - 1``
copies of that (small) work but needs the loss masked to the last stage and its value and
gradient routed back; replicating keeps the code the headline model's, and ``jax.grad``
sums the replicated weights' gradients over ``p`` by itself.

The script prints the weights' sharding summary, `shardlib.explain`'s report of one training
step (every collective-permute the schedule makes, the pipeline schedule table with its
bubble fraction), the schedule's timeline (`shardlib.pipeline.timeline`) and the loss per SGD
step on one fixed batch of random tokens (which the model learns by heart, so it falls).
``main(argv)`` returns them for the tests, which check the pipelined loss and every gradient
against the plain ``jax.numpy`` model and against the headline model on a ``('d', 't')`` mesh.
"""

from __future__ import annotations

import argparse
import functools
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the `examples` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from examples import _devices  # noqa: E402

_devices.simulate_cpu_devices(8)  # sets XLA_FLAGS: 8 simulated CPU devices, before JAX starts

import jax  # noqa: E402
from jax import lax  # noqa: E402

import shardlib  # noqa: E402
from examples import transformer_model as tm  # noqa: E402
from shardlib import pipeline  # noqa: E402
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

__all__ = [
    "CircularModel",
    "GPipeModel",
    "VModel",
    "build_parser",
    "interleaved_loss",
    "headline_model",
    "loss",
    "loss_and_grad",
    "main",
    "make_mesh",
    "pipeline_model",
    "stacked_loss",
    "train_step",
    "zb_v_loss",
]

SCHEDULES = ("gpipe", "circular", "1f1b", "interleaved", "zb-h1", "zb-v")
GROUPED = ("circular", "interleaved", "zb-v")  # schedules whose stages hold v layer groups
TOKENS = i32[Array, b"m B/batch L"]  # m microbatches of B rows; a microbatch block is 'B/batch L'


@pytree_dataclass
class GPipeModel:
    """`transformer_model.Model` with the layer stack split over the stages ``p``."""

    embed: f32[Array, b"V/tensor M/fsdp"]
    layers: Stacked[tm.Layer, b"layers/stage"]
    final_norm: f32[Array, b"M/tensor/fsdp"]
    unembed: f32[Array, b"M/fsdp V/tensor"]


@pytree_dataclass
class CircularModel:
    """As `GPipeModel`, the ``(L, ...)`` stack reshaped to ``(v, L/v, ...)``, split on dim 1."""

    embed: f32[Array, b"V/tensor M/fsdp"]
    layers: Stacked[tm.Layer, b"v layers/stage"]
    final_norm: f32[Array, b"M/tensor/fsdp"]
    unembed: f32[Array, b"M/fsdp V/tensor"]


@pytree_dataclass
class VModel:
    """As `CircularModel`, the two chunks of every stage in zb-v's V order
    (``pipeline.to_groups(layers, route='v')``): stage ``s`` holds groups ``s`` and ``2p-1-s``."""

    embed: f32[Array, b"V/tensor M/fsdp"]
    layers: Stacked[tm.Layer, b"v layers/stage"]
    final_norm: f32[Array, b"M/tensor/fsdp"]
    unembed: f32[Array, b"M/fsdp V/tensor"]


PipeModel = GPipeModel | CircularModel | VModel


def pipeline_model(
    model: tm.Model, schedule: str, groups: int = 1, stages: int | None = None
) -> PipeModel:
    """The headline model's global weights in the pipeline's types (same values, no copy of
    embeddings); for ``'circular'`` and ``'interleaved'`` the layer stack is reshaped to
    ``(groups, L/groups, ...)``, for ``'zb-v'`` to zb-v's two chunks per stage in the V's
    order, which depends on the number of ``stages`` (required then; ``groups`` must be 2).
    Place the result with ``make_shardings(type(result))``."""
    if schedule == "zb-v":
        if stages is None or groups != 2:
            raise ValueError(
                f"pipeline_model: schedule 'zb-v' takes two layer chunks per stage in a V that "
                f"depends on the stage count: pass groups=2 and stages=P, got groups={groups}, "
                f"stages={stages}"
            )
        layers = pipeline.to_groups(model.layers, route="v", stages=stages)
        return VModel(model.embed, layers, model.final_norm, model.unembed)
    if schedule not in GROUPED:
        return GPipeModel(model.embed, model.layers, model.final_norm, model.unembed)
    layers = pipeline.to_groups(model.layers, groups)  # (L, ...) -> (groups, L/groups, ...)
    return CircularModel(model.embed, layers, model.final_norm, model.unembed)


def headline_model(model: PipeModel) -> tm.Model:
    """Back to `transformer_model.Model`, layers in model order, as global numpy arrays (used
    to compare gradients with the unsharded and non-pipelined models). A `VModel`'s layers
    must be placed (split over the stages), which gives the V's stage count."""
    host = jax.device_get(model)
    layers = host.layers
    if isinstance(model, VModel):  # the V's order depends on p: read from the placed layers
        layers = jax.device_get(pipeline.from_groups(model.layers, route="v"))
    elif isinstance(model, CircularModel):
        layers = pipeline.from_groups(layers)
    return tm.Model(host.embed, layers, host.final_norm, host.unembed)


# ---------------------------------------------------------------------------------------------
# Per-device code: the headline model's embedding and loss head (`transformer_model.embed_tokens`
# and `next_token_loss`, with the microbatch dim m in front), the stages in between.
# ---------------------------------------------------------------------------------------------

MICROBATCHES = "m B/batch"  # the token dims before L: m microbatches of B rows


def _stage(config: tm.Config) -> Callable[[tm.Layer, jax.Array], jax.Array]:
    """One stage (or layer group): its stacked layers in order on one microbatch block."""
    layer = tm.checkpointed_layer(config)

    def stage(layers: tm.Layer, h: jax.Array) -> jax.Array:
        h, _ = lax.scan(lambda h, w: (layer(h, w), None), h, layers)
        return h

    return stage


@typed_shard_map(static_argnames=("config",))
def gpipe_loss(config: tm.Config, tokens: TOKENS, model: GPipeModel) -> f32[Array, b""]:
    """The loss with the layers run by `shardlib.pipeline.gpipe` over ``p``."""
    x = tm.embed_tokens(model.embed, tokens, batch=MICROBATCHES)
    x = pipeline.gpipe(_stage(config), model.layers, x, spec="B/batch L M", axis="stage")
    return tm.next_token_loss(config, model.final_norm, model.unembed, x, tokens, MICROBATCHES)


@typed_shard_map(static_argnames=("config",))
def circular_loss(config: tm.Config, tokens: TOKENS, model: CircularModel) -> f32[Array, b""]:
    """The loss with the layers run by `shardlib.pipeline.circular` over ``p``."""
    x = tm.embed_tokens(model.embed, tokens, batch=MICROBATCHES)
    x = pipeline.circular(_stage(config), model.layers, x, spec="B/batch L M", axis="stage")
    return tm.next_token_loss(config, model.final_norm, model.unembed, x, tokens, MICROBATCHES)


def _head(config: tm.Config, m: int) -> Callable[[Any, jax.Array, jax.Array], jax.Array]:
    """The loss of one microbatch on the last stage: its mean next-token cross-entropy over
    ``m`` (so the sum over microbatches is the batch's mean), from the head's weights
    ``(final_norm, unembed)``, its residual stream ``'B/batch L M'`` and its tokens ``'B/batch L'``."""

    def head(w: tuple[jax.Array, jax.Array], y: jax.Array, tokens: jax.Array) -> jax.Array:
        return tm.next_token_loss(config, w[0], w[1], y, tokens, "B/batch") / m

    return head


@typed_shard_map(static_argnames=("config", "schedule"))
def stacked_loss(
    config: tm.Config, schedule: str, tokens: TOKENS, model: GPipeModel
) -> f32[Array, b""]:
    """The loss with the layers run by `shardlib.pipeline.pipeline_loss` (1F1B or ZB-H1): the
    loss head runs on the last stage, inside the schedule."""
    x = tm.embed_tokens(model.embed, tokens, batch=MICROBATCHES)
    return pipeline.pipeline_loss(
        _stage(config), model.layers, x, spec="B/batch L M", axis="stage", loss_fn=_head(config, x.shape[0]),
        loss_params=(model.final_norm, model.unembed), targets=tokens, schedule=schedule,
    )  # fmt: skip


@typed_shard_map(static_argnames=("config",))
def interleaved_loss(config: tm.Config, tokens: TOKENS, model: CircularModel) -> f32[Array, b""]:
    """As `stacked_loss`, interleaved 1F1B over the circular layout's ``v`` layer groups."""
    x = tm.embed_tokens(model.embed, tokens, batch=MICROBATCHES)
    return pipeline.interleaved(
        _stage(config), model.layers, x, spec="B/batch L M", axis="stage", loss_fn=_head(config, x.shape[0]),
        loss_params=(model.final_norm, model.unembed), targets=tokens,
    )  # fmt: skip


@typed_shard_map(static_argnames=("config",))
def zb_v_loss(config: tm.Config, tokens: TOKENS, model: VModel) -> f32[Array, b""]:
    """As `stacked_loss`, ZB-V over the V layout's two chunks per stage (the loss on stage 0)."""
    x = tm.embed_tokens(model.embed, tokens, batch=MICROBATCHES)
    return pipeline.zb_v(
        _stage(config), model.layers, x, spec="B/batch L M", axis="stage", loss_fn=_head(config, x.shape[0]),
        loss_params=(model.final_norm, model.unembed), targets=tokens,
    )  # fmt: skip


def loss(
    config: tm.Config, tokens: jax.Array, model: PipeModel, schedule: str | None = None
) -> jax.Array:
    """Mean next-token cross-entropy of ``tokens`` (``'m B/batch L'``), pipelined by ``schedule``
    (None: gpipe or circular, as the model's type says; a `VModel` runs zb-v)."""
    if isinstance(model, VModel):
        return zb_v_loss(config, tokens, model)
    if schedule == "interleaved" and isinstance(model, CircularModel):
        return interleaved_loss(config, tokens, model)
    if schedule in ("1f1b", "zb-h1") and isinstance(model, GPipeModel):
        return stacked_loss(config, schedule, tokens, model)
    if isinstance(model, CircularModel):
        return circular_loss(config, tokens, model)
    return gpipe_loss(config, tokens, model)


def loss_and_grad(
    config: tm.Config, model: PipeModel, tokens: jax.Array, schedule: str | None = None
) -> tuple[jax.Array, Any]:
    """``(loss, d loss / d model)``; the gradients come out in the weights' sharded layout."""
    return jax.value_and_grad(lambda w: loss(config, tokens, w, schedule))(model)


@functools.partial(jax.jit, static_argnames=("config", "schedule"))
def train_step(
    config: tm.Config,
    model: PipeModel,
    tokens: jax.Array,
    lr: float | jax.Array,
    schedule: str | None = None,
) -> tuple[Any, jax.Array]:
    """One SGD step: the updated weights and the loss before the update."""
    value, grads = loss_and_grad(config, model, tokens, schedule)
    return jax.tree.map(lambda w, g: w - lr * g, model, grads), value


# ---------------------------------------------------------------------------------------------
# The script.
# ---------------------------------------------------------------------------------------------


def make_mesh(spec: str) -> jax.sharding.Mesh:
    """``'2x2x2'`` -> a mesh with axes ``('p', 'd', 't')`` (Explicit axes) on CPU devices if
    the default ones are too few."""
    return _devices.make_mesh(spec, ("p", "d", "t"))


def build_parser() -> argparse.ArgumentParser:
    """The command line: ``--help`` lists every flag with its help and default."""
    a = argparse.ArgumentParser(
        description="Train the headline transformer with pipeline parallelism (shardlib).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    a.add_argument("--mesh", default="2x2x2", help="PxDxT: stages x data/FSDP x tensor")
    a.add_argument("--schedule", default="gpipe", choices=SCHEDULES, help="pipeline schedule")
    a.add_argument("--microbatches", type=int, default=None, help="m; None: 2 * P")
    a.add_argument(
        "--groups",
        type=int,
        default=2,
        help="layer groups per stage V (circular and interleaved; zb-v uses 2, the others 1)",
    )
    a.add_argument("--layers", type=int, default=None, help="None: a multiple of V*P, >= 4")
    a.add_argument("--d-model", type=int, default=32, help="model width M")
    a.add_argument("--heads", type=int, default=4, help="query heads")
    a.add_argument("--kv-heads", type=int, default=2, help="key/value heads (GQA)")
    a.add_argument("--d-head", type=int, default=8, help="head width D")
    a.add_argument("--d-ff", type=int, default=64, help="SwiGLU hidden width")
    a.add_argument("--vocab", type=int, default=64, help="vocabulary size V")
    a.add_argument("--seq-len", type=int, default=16, help="tokens per sequence")
    a.add_argument("--batch", type=int, default=None, help="global batch; None: 2 * m * D")
    a.add_argument("--steps", type=int, default=6, help="SGD steps")
    a.add_argument("--lr", type=float, default=0.5, help="SGD learning rate")
    a.add_argument("--seed", type=int, default=0, help="seeds the weights and the tokens")
    return a


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, tuple[int, int, int]]:
    """The arguments with their defaults filled in, and the mesh sizes ``(p, d, t)``; exits
    with a message naming the flag when a size does not divide."""
    args = build_parser().parse_args(argv)
    p, d, t = _devices.mesh_shape(args.mesh, ("p", "d", "t"))
    if args.schedule == "zb-v" and args.groups != 2:
        raise SystemExit(
            f"--groups {args.groups}: the zb-v schedule has two layer chunks per stage; "
            "leave --groups out (or pass 2)"
        )
    v = args.groups if args.schedule in GROUPED else 1
    args.groups = v
    if args.microbatches is None:
        args.microbatches = 2 * p
    if args.layers is None:
        args.layers = v * p * math.ceil(4 / (v * p))
    if args.batch is None:
        args.batch = 2 * args.microbatches * d
    m = args.microbatches
    need = [
        ("--layers", args.layers, v * p, "each of the P stages holds V groups of layers"),
        ("--kv-heads", args.kv_heads, t, "key/value heads are split over t"),
        ("--d-ff", args.d_ff, t, "the MLP hidden units are split over t"),
        ("--vocab", args.vocab, t, "the vocabulary is split over t"),
        ("--d-model", args.d_model, d * t, "norm gains are split over d and t"),
        ("--batch", args.batch, m * d, "m microbatches, each split over d"),
    ]
    bad = [f"{f} {x} is not a multiple of {k} ({why})" for f, x, k, why in need if x % k]
    if args.schedule in ("circular", "interleaved") and m < p:
        bad.append(f"--microbatches {m} must be at least P={p} for the {args.schedule} schedule")
    if bad:
        raise SystemExit(f"--mesh {args.mesh} (p={p}, d={d}, t={t}): " + "; ".join(bad))
    return args, (p, d, t)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Train; return the losses (one per step), the explain report, the timeline and more."""
    args, (p, d, t) = parse_args(argv)
    config, m, v = tm.config_from_flags(args), args.microbatches, args.groups
    mesh = make_mesh(args.mesh)
    print(
        f"mesh {args.mesh} on {mesh.size} {mesh.devices.flat[0].platform} devices: p={p} "
        f"pipeline stages, d={d} data/FSDP and t={t} tensor parallel inside each stage; "
        f"schedule {args.schedule}, m={m} microbatches of {args.batch // m} rows"
        + (f", v={v} layer groups per stage" if args.schedule in GROUPED else "")
    )
    # The headline model's specs name roles: its axis rules on this mesh ('p' carries none).
    with jax.set_mesh(mesh), shardlib.axis_rules(tm.rules_for(mesh)):
        init = tm.init_model(config, jax.random.key(args.seed))
        weights = pipeline_model(init, args.schedule, v, stages=p)
        model = jax.device_put(weights, make_shardings(type(weights)))
        shape = (m, args.batch // m, args.seq_len)
        tokens = jax.random.randint(jax.random.key(args.seed + 1), shape, 0, args.vocab)
        tokens = jax.device_put(tokens, make_shardings(TOKENS))
        print(f"model: {config.n_layers} layers, d_model {config.d_model}, vocab {config.vocab}")
        print(sharding_summary(model))

        def one_step(model: Any, tokens: jax.Array) -> Any:
            return train_step(config, model, tokens, args.lr, args.schedule)

        one_step.__qualname__ = "train_step"
        report = shardlib.explain(one_step, model, tokens, hardware="h100")
        print(report.render())
        bubble = pipeline.bubble_fraction(args.schedule, p, m, v)
        chart = pipeline.timeline(args.schedule, p, m, v)
        print(f"\ntimeline (stage x tick; '.' is the bubble, {bubble:.1%} of each stage's ticks):")
        print(chart)
        losses: list[float] = []
        start = time.perf_counter()
        for step in range(args.steps):
            model, value = train_step(config, model, tokens, args.lr, args.schedule)
            losses.append(float(value))
            print(f"step {step}: loss {losses[-1]:.4f}", flush=True)
    print(f"done: {args.steps} steps in {time.perf_counter() - start:.1f} s")
    return {
        "losses": losses,
        "mesh": (p, d, t),
        "schedule": args.schedule,
        "microbatches": m,
        "groups": v,
        "bubble_fraction": bubble,
        "timeline": chart,
        "report": report,
        "model": model,
    }


if __name__ == "__main__":
    main(sys.argv[1:])
