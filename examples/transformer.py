"""Train a decoder-only transformer with FSDP + tensor parallelism: shardlib's headline example.

Run from the repository root (it simulates 8 CPU devices; about two minutes on two cores)::

    python examples/transformer.py                    # mesh 4x2: d=4 (data + FSDP), t=2 (tensor)
    python examples/transformer.py --mesh 1x8         # the same math, all tensor parallel
    python examples/transformer.py --mesh 8           # one axis fsdp=8: pure FSDP, no tensor
    python examples/transformer.py --mesh data=2,fsdp=2,tensor=2  # data x FSDP x tensor
    python examples/transformer.py --mesh 2x2x2       # d=2, c=2 (sequence: ring attention), t=2
    python examples/transformer.py --mesh 2x4 --overlap ring  # collective matmuls over t
    python examples/transformer.py --steps 300 --checkpoint-dir /tmp/ckpt --stop-after 150
    python examples/transformer.py --steps 300 --checkpoint-dir /tmp/ckpt --resume

What it puts together:

- **Model** (``examples/transformer_model.py``): token embedding through ``index_unreduced``,
  RMSNorm, grouped-query attention with RoPE, a SwiGLU MLP, ``lax.scan`` over the stacked
  ``Stacked[Layer, b'layers']`` under ``explicit_activation_checkpointing``. Per-device code with
  explicit collectives, written in roles (``B/batch``, ``M/fsdp``, ``K/tensor``, ``L/seq``).
- **One model, any mesh** (``--mesh``): the mesh's axis names give the axis rules
  (``transformer_model.rules_for``), put in force beside the mesh with ``shardlib.axis_rules``;
  nothing else changes. ``DxT`` (axes ``d``, ``t``): ``d`` splits the batch and, at rest,
  every weight (FSDP); ``t`` splits heads, MLP hidden units and the vocabulary (tensor
  parallelism). ``N`` (one axis ``fsdp``): pure FSDP, the ``tensor`` role maps to nothing and
  its collectives vanish. ``name=size,...`` names the axes, each from
  ``transformer_model.AXIS_ROLES``: ``data=2,fsdp=2,tensor=2`` splits the batch over ``data``
  and ``fsdp`` and the weights over ``fsdp`` and ``tensor`` (replicated over ``data``).
  Changing the mesh changes who computes what, not the numbers: the losses agree to float
  rounding.
- **Context parallelism** (``--mesh DxCxT``): ``c`` (role ``seq``) splits the sequence too. The tokens go
  into the balanced layout (device ``i`` holds chunks ``i`` and ``2c - 1 - i`` of ``2c``, so
  the causal work is even), RoPE turns by the original positions, and attention is
  ``shardlib.attention.ring``: the K/V blocks go round the ``c`` devices. The weights are
  split over ``c`` as well as ``d`` (``c`` carries role ``fsdp`` too: FSDP over ``d x c``, so
  each device holds ``1/c`` of the weight memory it would hold with them replicated over
  ``c``); the loss and the gradients equal the run without ``c``.
- **Collective matmuls** (``--overlap ring`` or ``bidirectional``): the tensor-parallel
  layout turns sequence parallel. Between the blocks the residual stream is split over the
  sequence on ``t`` (``B/batch L/tensor M``); each block's first matmul all-gathers it and its
  output projection reduce-scatters back into it, each as a ring of ``ppermute``s beside block
  matmuls (``shardops.einsum(..., overlap=)``) instead of the ``psum``s. Same losses and
  gradients; not with context parallelism (``--mesh DxCxT``).
- **Weights created sharded**: ``init_model(..., sharded=True)`` inside ``jax.jit`` gives every
  random array ``out_sharding=`` its annotated layout, so no device builds a full copy.
- **Optimizer**: optax AdamW with linear warmup and cosine decay, after clipping the gradient
  to a global norm. It runs on the global (sharded) arrays under ``jax.jit``; each update is
  elementwise, so every device updates only its own blocks and Adam's moments take the
  weights' layout (the script checks that against ``make_shardings(Model)``). The global norm
  needs every block: ``optax.clip_by_global_norm`` on global arrays gets it (the compiler adds
  the all-reduce), and :func:`grad_norm` computes it per device, by hand: each device sums
  the squares of its blocks and one ``psum`` over the ``fsdp`` and ``tensor`` axes adds them up
  (every weight is split over all of them, so each element is counted once).
- **Data**: a synthetic language made here, nothing downloaded: a fixed random Markov chain
  in which every token is followed by one of four successors. A model that learns the chain
  reaches the chain's own entropy, printed at the start as the best possible loss. Batch ``s``
  depends only on ``--seed`` and ``s``, so a resumed run sees the same data.
- **Checkpoints** (``--checkpoint-dir``, ``--resume``; needs ``orbax-checkpoint``): the
  model, the optimizer state and the step are saved shard by shard and restored straight into
  the layout of the current mesh (``jax.ShapeDtypeStruct(..., sharding=...)`` targets), never
  gathered onto one device. The mesh may change between save and resume.

``main(argv)`` returns the loss history (and more) for the tests.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
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
import optax  # noqa: E402

import shardlib  # noqa: E402
import shardlib.shardops as shardops  # noqa: E402
from examples import transformer_model as tm  # noqa: E402
from shardlib.shardtypes import (  # noqa: E402
    Array,
    f32,
    i32,
    make_partition_specs,
    make_shardings,
    restore_target,
    sharding_summary,
    typed_shard_map,
)

__all__ = [
    "MESH_AXES",
    "MarkovLanguage",
    "TrainConfig",
    "grad_norm",
    "init_state",
    "main",
    "make_mesh",
    "make_optimizer",
    "parse_mesh",
    "role_sizes",
    "train_step",
]

# ``--mesh`` by its number of sizes: N, DxT, DxCxT. ``name=size,...`` names the axes instead.
MESH_AXES = {1: ("fsdp",), 2: ("d", "t"), 3: ("d", "c", "t")}


def parse_mesh(spec: str) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """``--mesh`` text -> (axis names, sizes): ``'4x2'`` -> ``(('d', 't'), (4, 2))``,
    ``'8'`` -> ``(('fsdp',), (8,))``, ``'2x2x2'`` -> ``(('d', 'c', 't'), (2, 2, 2))``,
    ``'data=2,fsdp=2,tensor=2'`` -> ``(('data', 'fsdp', 'tensor'), (2, 2, 2))``; exits with a
    message naming the flag when the text is not one of those."""
    if "=" not in spec:
        names = MESH_AXES.get(spec.count("x") + 1)
        if names is None:
            raise SystemExit(
                f"--mesh must be N, DxT, DxCxT or name=size,... (such as 8, 4x2, 2x2x2 or "
                f"data=2,fsdp=2,tensor=2), got {spec!r}"
            )
        return names, _devices.mesh_shape(spec, names)
    pairs = [part.partition("=") for part in spec.split(",")]
    names = tuple(name.strip() for name, _, _ in pairs)
    known = ", ".join(tm.AXIS_ROLES)
    bad = [n for n in names if n not in tm.AXIS_ROLES]
    if bad or len(set(names)) != len(names):
        raise SystemExit(
            f"--mesh {spec!r}: axis names must be distinct, each one of {known} (what each "
            f"does: transformer_model.AXIS_ROLES); got {', '.join(names)}"
        )
    sizes = tuple(size.strip() for _, _, size in pairs)
    if not all(size.isdigit() and int(size) > 0 for size in sizes):
        raise SystemExit(
            f"--mesh {spec!r}: each axis needs a positive size, as in data=2,fsdp=2,tensor=2"
        )
    try:
        tm.rules_for(names)
    except ValueError as e:
        raise SystemExit(f"--mesh {spec!r}: {e}") from None
    return names, tuple(int(size) for size in sizes)


def role_sizes(names: tuple[str, ...], sizes: tuple[int, ...]) -> dict[str, int]:
    """How many devices each role of the model splits over on this mesh (1: none)."""
    size = dict(zip(names, sizes, strict=True))
    rules = tm.rules_for(names)
    return {role: math.prod(size[a] for a in rules[role] or ()) for role in tm.ROLES}


# ---------------------------------------------------------------------------------------------
# Data: a synthetic language with structure a model can learn.
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, eq=False)
class MarkovLanguage:
    """A fixed random Markov chain over ``vocab`` tokens, each followed by one of ``branching``.

    The first token of a sequence is uniform; token ``i + 1`` is drawn from the successors of
    token ``i`` with probabilities from a Dirichlet(1) draw per token.
    """

    successors: np.ndarray  # vocab x branching token ids
    probs: np.ndarray  # vocab x branching, rows sum to 1

    @classmethod
    def make(cls, vocab: int, seed: int, branching: int = 4) -> MarkovLanguage:
        rng = np.random.default_rng([seed, 0x1A26])
        successors = np.stack([rng.choice(vocab, branching, replace=False) for _ in range(vocab)])
        probs = rng.dirichlet(np.ones(branching), size=vocab)
        return cls(successors.astype(np.int32), probs)

    @property
    def vocab(self) -> int:
        return self.successors.shape[0]

    def batch(self, step: int, batch: int, seq_len: int, seed: int) -> np.ndarray:
        """The ``batch x seq_len`` int32 tokens of training step ``step`` (a pure function)."""
        rng = np.random.default_rng([seed, 0xBA7C, step])
        cdf = np.cumsum(self.probs, axis=-1)
        token = rng.integers(0, self.vocab, size=batch)
        out = [token]
        for _ in range(seq_len - 1):
            pick = (rng.random(batch)[:, None] > cdf[token]).sum(axis=-1)
            token = self.successors[token, np.minimum(pick, self.successors.shape[1] - 1)]
            out.append(token)
        return np.stack(out, axis=1).astype(np.int32)

    def best_loss(self, seq_len: int) -> float:
        """The expected next-token loss of the chain itself: no model can do better on average."""
        entropy = -np.sum(self.probs * np.log(self.probs), axis=-1)  # per current token
        p = np.full(self.vocab, 1.0 / self.vocab)  # distribution of the token at position i
        total = 0.0
        for _ in range(seq_len - 1):
            total += float(p @ entropy)
            p = np.bincount(
                self.successors.ravel(),
                weights=(p[:, None] * self.probs).ravel(),
                minlength=self.vocab,
            )
        return total / (seq_len - 1)


# ---------------------------------------------------------------------------------------------
# Optimizer and the training step.
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Optimizer settings (hashable: a static argument of the jitted functions)."""

    steps: int
    lr: float
    warmup: int
    weight_decay: float = 0.1
    clip_norm: float = 1.0
    final_lr_ratio: float = 0.1


def make_optimizer(
    train: TrainConfig,
) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """Global-norm clipping, then AdamW with linear warmup and cosine decay; and its schedule.

    No weight decay on the norm gains.
    """
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=train.lr,
        warmup_steps=train.warmup,
        decay_steps=max(train.steps, train.warmup + 1),
        end_value=train.lr * train.final_lr_ratio,
    )

    def decay_mask(model: tm.Model) -> tm.Model:
        mask = jax.tree.map(lambda _: True, model)
        layers = dataclasses.replace(mask.layers, ln1=False, ln2=False)
        return dataclasses.replace(mask, layers=layers, final_norm=False)

    optimizer = optax.chain(
        optax.clip_by_global_norm(train.clip_norm),
        optax.adamw(schedule, weight_decay=train.weight_decay, mask=decay_mask),
    )
    return optimizer, schedule


@tm.model_rules
@typed_shard_map
def grad_norm(grads: tm.Model) -> f32[Array, b""]:
    """The global L2 norm of the gradients, per device: local sums of squares, one ``psum``.

    Exact because every weight of ``Model`` is split over every mesh axis of the roles
    ``fsdp`` and ``tensor`` (no device holds a replica of another's block along them), which
    :func:`main` checks; the devices along the other axes (``data``, ``c``) hold the same
    blocks and compute the same norm.
    """
    local = sum((jnp.sum(jnp.square(g)) for g in jax.tree.leaves(grads)), jnp.zeros(()))
    return jnp.sqrt(shardops.psum("", local, axes=("fsdp", "tensor")))


@functools.partial(jax.jit, static_argnames=("config", "train"))
def init_state(config: tm.Config, train: TrainConfig, key: jax.Array) -> dict[str, Any]:
    """Weights created in their sharded layout, the optimizer state (same layout), step 0."""
    # optax types its trees as arrays or containers; a pytree_dataclass is a pytree too.
    model: Any = tm.init_model(config, key, sharded=True)
    optimizer, _ = make_optimizer(train)
    return {"model": model, "opt_state": optimizer.init(model), "step": jnp.zeros((), jnp.int32)}


@functools.partial(jax.jit, static_argnames=("config", "train"))
def train_step(
    config: tm.Config, train: TrainConfig, state: dict[str, Any], tokens: jax.Array
) -> tuple[dict[str, Any], dict[str, jax.Array]]:
    """One optimizer step; returns the new state and the loss, gradient norm and learning rate."""
    loss, model_grads = tm.loss_and_grad(config, state["model"], tokens)
    grads: Any = model_grads  # optax types its trees as arrays or containers
    optimizer, schedule = make_optimizer(train)
    updates, opt_state = optimizer.update(grads, state["opt_state"], state["model"])
    model = optax.apply_updates(state["model"], updates)
    metrics = {"loss": loss, "grad_norm": grad_norm(grads), "lr": schedule(state["step"])}
    return {"model": model, "opt_state": opt_state, "step": state["step"] + 1}, metrics


def make_mesh(spec: str, devices: list | None = None) -> jax.sharding.Mesh:
    """The mesh of ``--mesh`` text (:func:`parse_mesh`), Explicit axes: ``'4x2'`` -> axes
    ``('d', 't')`` of sizes 4 and 2; ``'2x2x2'`` -> ``('d', 'c', 't')``; ``'8'`` ->
    ``('fsdp',)``; ``'data=2,fsdp=2,tensor=2'`` -> those axes.

    Uses the default devices when there are enough of them, else the (simulated) CPU devices.
    """
    names, sizes = parse_mesh(spec)
    return _devices.make_mesh("x".join(map(str, sizes)), names, devices)


def _layouts_match(tree: Any, shardings: Any) -> bool:
    return all(
        a.sharding.is_equivalent_to(s, a.ndim)
        for a, s in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings), strict=True)
    )


# ---------------------------------------------------------------------------------------------
# Checkpoints (orbax-checkpoint, imported only when asked for).
# ---------------------------------------------------------------------------------------------


def _orbax():
    try:
        import orbax.checkpoint as ocp
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise SystemExit(
            f"--checkpoint-dir needs orbax-checkpoint ({e}); install it with "
            "pip install -e '.[examples]'"
        ) from None
    return ocp


def _checkpoint_manager(directory: str):
    ocp = _orbax()
    options = ocp.CheckpointManagerOptions(max_to_keep=2, create=True)
    return ocp.CheckpointManager(Path(directory).resolve(), options=options)


def save_checkpoint(manager, state: dict[str, Any], meta: dict[str, Any]) -> None:
    """Save ``state`` (each device writes its own blocks) and the run's settings as JSON."""
    ocp = _orbax()
    step = int(state["step"])
    manager.save(
        step,
        args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)),
    )


def restore_checkpoint(manager, target: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The latest checkpoint, read straight into ``target``'s shapes and shardings."""
    ocp = _orbax()
    step = manager.latest_step()
    if step is None:
        raise SystemExit(f"--resume: no checkpoint in {manager.directory}")
    restored = manager.restore(
        step,
        args=ocp.args.Composite(
            state=ocp.args.StandardRestore(target), meta=ocp.args.JsonRestore()
        ),
    )
    return restored.state, restored.meta


# ---------------------------------------------------------------------------------------------
# The script.
# ---------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    """The command line: ``--help`` lists every flag with its help and default."""
    p = argparse.ArgumentParser(
        description="Train a small transformer with FSDP + tensor parallelism (shardlib).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--mesh",
        default="4x2",
        help="N: pure FSDP (axis fsdp); DxT: data/FSDP x tensor (axes d, t); DxCxT: d x context "
        "(sequence) x t; or name=size,... with names from transformer_model.AXIS_ROLES, e.g. "
        "data=2,fsdp=2,tensor=2",
    )
    p.add_argument("--d-model", type=int, default=128, help="model width M")
    p.add_argument("--layers", type=int, default=4, help="transformer blocks")
    p.add_argument("--heads", type=int, default=16, help="query heads")
    p.add_argument("--kv-heads", type=int, default=8, help="key/value heads (GQA)")
    p.add_argument("--d-head", type=int, default=None, help="head width D; None: d_model // heads")
    p.add_argument("--d-ff", type=int, default=512, help="SwiGLU hidden width")
    p.add_argument("--vocab", type=int, default=256, help="vocabulary size V")
    p.add_argument("--seq-len", type=int, default=64, help="tokens per sequence")
    p.add_argument(
        "--overlap",
        choices=["ring", "bidirectional"],
        default=None,
        help="run the tensor-parallel matmuls as collective matmuls (sequence-parallel "
        "residual, rings of ppermutes); None: psums over a replicated residual",
    )
    p.add_argument(
        "--context",
        choices=list(tm.CONTEXTS),
        default="ring",
        help="with a context axis (--mesh DxCxT): attend with shardlib.attention.ring (K/V "
        "round the devices), .gathered (K/V all-gathered) or .ulysses (all-to-alls to a head "
        "split; the key/value heads per tensor device must divide by C); ring_ulysses needs "
        "two context axes (--mesh d=D,c=C,u=U,t=T: the ring over c, Ulysses over u)",
    )
    p.add_argument("--batch", type=int, default=32, help="global batch (sequences per step)")
    p.add_argument("--steps", type=int, default=300, help="total steps (the schedule's length)")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    p.add_argument("--warmup", type=int, default=None, help="warmup steps; None: steps // 10")
    p.add_argument("--weight-decay", type=float, default=0.1, help="AdamW weight decay")
    p.add_argument("--clip-norm", type=float, default=1.0, help="global gradient-norm clip")
    p.add_argument("--seed", type=int, default=0, help="seeds the weights and the data")
    p.add_argument("--log-every", type=int, default=10, help="print metrics every N steps")
    p.add_argument(
        "--checkpoint-dir", default=None, help="save checkpoints here (orbax); None: no checkpoints"
    )
    p.add_argument("--save-every", type=int, default=0, help="also save every N steps")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    p.add_argument(
        "--stop-after",
        type=int,
        default=None,
        help="stop (and save) after this step; None: run all steps",
    )
    return p


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    if args.resume and not args.checkpoint_dir:
        p.error("--resume needs --checkpoint-dir")
    names, sizes = parse_mesh(args.mesh)  # exits naming --mesh when the text is not a mesh
    if args.overlap and role_sizes(names, sizes)["seq"] > 1:
        p.error(
            f"--overlap {args.overlap} needs a mesh without context parallelism (--mesh "
            f"{args.mesh} splits the sequence over role seq): use N, DxT or name=size,..."
        )
    if args.warmup is None:
        args.warmup = max(1, args.steps // 10)
    if args.d_head is None:
        args.d_head = args.d_model // args.heads
    return args


def _over(rules: dict[str, tuple[str, ...] | None], role: str) -> str:
    return " and ".join(rules[role] or ()) or "no axis"


def _check_divisibility(
    args: argparse.Namespace, names: tuple[str, ...], sizes: tuple[int, ...]
) -> None:
    """Clear messages for sizes the mesh cannot split evenly (before shardlib's own checks),
    each naming the mesh axes its role splits over."""
    r, rules = role_sizes(names, sizes), tm.rules_for(names)
    tensor = _over(rules, "tensor")
    need = [
        (
            "--seq-len",
            args.seq_len,
            2 * r["seq"] if r["seq"] > 1 else 1,
            f"the balanced layout cuts it into 2 x {_over(rules, 'seq')} chunks",
        ),
        ("--kv-heads", args.kv_heads, r["tensor"], f"key/value heads are split over {tensor}"),
        *_overlap_needs(args, r["tensor"], tensor),
        *_ulysses_needs(args, r["tensor"], rules, dict(zip(names, sizes, strict=True))),
        ("--d-ff", args.d_ff, r["tensor"], f"the MLP hidden units are split over {tensor}"),
        ("--vocab", args.vocab, r["tensor"], f"the vocabulary is split over {tensor}"),
        ("--batch", args.batch, r["batch"], f"the batch is split over {_over(rules, 'batch')}"),
        (
            "--d-model",
            args.d_model,
            r["fsdp"] * r["tensor"],
            f"norm gains are split over {_over(rules, 'fsdp')} and {tensor}",
        ),
    ]
    bad = [
        f"{flag} {value} is not a multiple of {k} ({why})"
        for flag, value, k, why in need
        if value % k
    ]
    if bad:
        shown = ", ".join(f"{n}={k}" for n, k in zip(names, sizes, strict=True))
        raise SystemExit(f"--mesh {args.mesh} ({shown}): " + "; ".join(bad))


def _overlap_needs(args: argparse.Namespace, t: int, tensor: str) -> list[tuple]:
    """With ``--overlap``: the sequence split over tensor, each block in halves if
    bidirectional (the ring sends half of each block each way)."""
    if not args.overlap:
        return []
    k = 2 * t if args.overlap == "bidirectional" else t
    why = f"--overlap {args.overlap} splits the sequence over {tensor}"
    return [("--seq-len", args.seq_len, k, why + (", each block in halves" if k > t else ""))]


def _ulysses_needs(
    args: argparse.Namespace, tensor: int, rules: dict, sizes: dict[str, int]
) -> list[tuple]:
    """With ``--context ulysses`` (or ``ring_ulysses``) on context axes: the key/value heads
    split over tensor and the Ulysses axes (all of seq's; ``ring_ulysses``: the second)."""
    seq = rules.get("seq") or ()
    if args.context not in ("ulysses", "ring_ulysses") or not seq:
        return []
    if args.context == "ring_ulysses" and len(seq) != 2:
        raise SystemExit(
            f"--context ring_ulysses needs two context axes (--mesh d=D,c=C,u=U,t=T: the ring "
            f"over c, Ulysses over u); --mesh {args.mesh} splits the sequence over "
            f"{' and '.join(seq)}"
        )
    over = seq[1:] if args.context == "ring_ulysses" else seq
    n = tensor * math.prod(sizes[a] for a in over)
    why = f"--context {args.context} splits the key/value heads over {_over(rules, 'tensor')} and "
    return [("--kv-heads", args.kv_heads, n, why + " and ".join(over))]


def _settings(args: argparse.Namespace) -> tuple[tm.Config, TrainConfig, dict[str, Any]]:
    config = tm.config_from_flags(args)
    train = TrainConfig(
        steps=args.steps,
        lr=args.lr,
        warmup=args.warmup,
        weight_decay=args.weight_decay,
        clip_norm=args.clip_norm,
    )
    model = dataclasses.asdict(config)
    del model["overlap"], model["context"]  # how it runs, not the model: a run may resume
    # either way
    meta = {  # what a resumed run must agree on (the mesh and --overlap may change)
        "model": model,
        "train": dataclasses.asdict(train),
        "data": {"seed": args.seed, "batch": args.batch},
        "mesh": args.mesh,
    }
    return config, train, meta


def _resume(args, manager, config, train, meta, mesh) -> dict[str, Any]:
    """Restore the latest checkpoint into this mesh's layout, after checking the settings."""
    # The target: the state's shapes and dtypes, with the shardings init_state would give it
    # on this mesh. Orbax reads each device's blocks straight into place.
    target = restore_target(
        jax.eval_shape(init_state, config, train, jax.random.key(args.seed)), mesh
    )
    state, saved = restore_checkpoint(manager, target)
    for part in ("model", "train", "data"):
        if saved[part] != meta[part]:
            raise SystemExit(
                f"--resume: the checkpoint was written with other {part} settings: "
                f"{saved[part]} (this run: {meta[part]}); pass the same flags"
            )
    print(
        f"resumed from step {int(state['step'])} in {args.checkpoint_dir} "
        f"(saved on mesh {saved['mesh']}, restored into mesh {args.mesh})"
    )
    return state


def _describe(state: dict[str, Any], config: tm.Config, train: TrainConfig) -> None:
    """Print the model's sharding summary and check that Adam's moments share its layout."""
    model = state["model"]
    n_params = sum(x.size for x in jax.tree.leaves(model))
    print(
        f"model: {config.n_layers} layers, d_model {config.d_model}, {config.n_heads} heads "
        f"({config.n_kv_heads} key/value heads), d_ff {config.d_ff}, vocab {config.vocab}: "
        f"{n_params / 1e6:.2f}M parameters"
    )
    if config.overlap:
        print(
            f"tensor parallelism: residual split over the sequence on tensor, collective "
            f"matmuls (overlap={config.overlap}): rings of ppermutes instead of psums"
        )
    print(sharding_summary(model))
    # Adam's moments are elementwise functions of the weights: the same layout, checked here.
    weight_shardings = make_shardings(tm.Model)
    moments = [optax.tree_utils.tree_get(state["opt_state"], k) for k in ("mu", "nu")]
    same = all(_layouts_match(m, weight_shardings) for m in moments)
    print(
        f"optimizer: AdamW (peak lr {train.lr:g}, warmup {train.warmup}, cosine to "
        f"{train.lr * train.final_lr_ratio:g} at step {train.steps}), global-norm clip "
        f"{train.clip_norm:g}; Adam mu and nu in the weights' layout (make_shardings(Model)): "
        f"{same}"
    )
    if not same:
        raise AssertionError("the optimizer state is not in the weights' layout")


def _cost_report(args, config, train, language, state) -> None:
    """Print shardlib.explain's summary of one training step (traced, not run)."""
    tokens = jax.device_put(
        language.batch(0, args.batch, args.seq_len, args.seed),
        make_shardings(i32[Array, b"B/batch L"]),
    )

    def one_step(state, tokens):
        return train_step(config, train, state, tokens)

    one_step.__qualname__ = "train_step"
    report = shardlib.explain(one_step, state, tokens, hardware="h100")
    print("cost of one step, from the types (shardlib.explain):")
    print("  " + report.short().replace("\n", "\n  "))


_ROLE_TEXT = {
    "batch": "the batch",
    "fsdp": "every weight (FSDP)",
    "tensor": "heads, MLP and vocabulary (tensor parallel)",
    "seq": "the sequence (ring attention, balanced layout)",
}


def _print_mesh(spec: str, mesh: jax.sharding.Mesh, rules: dict[str, Any]) -> None:
    """What each mesh axis splits under the axis rules (the sharding summary prints the rules)."""
    jobs = [
        f"{name}={size} splits "
        + (" and ".join(_ROLE_TEXT[r] for r in tm.ROLES if name in (rules[r] or ())) or "nothing")
        for name, size in mesh.shape.items()
    ]
    print(f"mesh {spec} on {mesh.size} {mesh.devices.flat[0].platform} devices: " + ", ".join(jobs))


def _check_weights_split(rules: dict[str, Any]) -> None:
    """grad_norm needs every weight split over every axis of fsdp and tensor (no block counted
    twice); over the other axes (data, c) the weights and their summed gradients are
    replicated, the same on each."""
    need = {a for role in ("fsdp", "tensor") for a in rules[role] or ()}
    specs = jax.tree.leaves(make_partition_specs(tm.Model))
    if not all(need <= set(jax.tree.leaves(tuple(s))) for s in specs):
        raise AssertionError(f"grad_norm needs every weight split over {sorted(need)}")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Train; return the history (``losses``: one per step run, from ``start_step + 1``) etc."""
    args = parse_args(argv)
    names, shape = parse_mesh(args.mesh)
    _check_divisibility(args, names, shape)
    config, train, meta = _settings(args)
    language = MarkovLanguage.make(args.vocab, args.seed)
    best = language.best_loss(args.seq_len)

    mesh = make_mesh(args.mesh)
    rules = tm.rules_for(mesh)  # the only thing that changes with the mesh
    _print_mesh(args.mesh, mesh, rules)
    manager = _checkpoint_manager(args.checkpoint_dir) if args.checkpoint_dir else None
    try:
        with jax.set_mesh(mesh), shardlib.axis_rules(rules):
            _check_weights_split(rules)
            if args.resume:
                state = _resume(args, manager, config, train, meta, mesh)
            else:
                state = init_state(config, train, jax.random.key(args.seed))
            _describe(state, config, train)
            _cost_report(args, config, train, language, state)
            print(
                f"data: Markov chain over {args.vocab} tokens, 4 successors each; "
                f"{args.batch} x {args.seq_len} tokens per step; loss of a uniform guess "
                f"{math.log(args.vocab):.3f}, best possible (the chain's entropy) {best:.3f}"
            )
            state, history = _train(args, config, train, language, state, manager, meta)
    finally:
        if manager is not None:
            manager.close()

    if history["step"]:
        print(
            f"done: steps {history['start'] + 1}-{history['step'][-1]} in "
            f"{history['seconds']:.1f} s ({history['tokens_per_s']:.0f} tok/s after the first "
            f"step); loss {history['loss'][0]:.3f} -> {history['loss'][-1]:.3f} "
            f"(best possible {best:.3f})"
        )
    return {
        "losses": history["loss"],
        "steps": history["step"],
        "grad_norms": history["grad_norm"],
        "lrs": history["lr"],
        "start_step": history["start"],
        "best_possible_loss": best,
        "uniform_loss": math.log(args.vocab),
        "seconds": history["seconds"],
        "tokens_per_s": history["tokens_per_s"],
        "mesh": shape,
        "state": state,
    }


def _train(args, config, train, language, state, manager, meta) -> tuple[dict, dict[str, Any]]:
    """The training loop: one jitted step per batch, a log line every ``--log-every`` steps."""
    token_sharding = make_shardings(i32[Array, b"B/batch L"])
    start = int(state["step"])
    stop = args.steps if args.stop_after is None else min(args.steps, args.stop_after)
    tokens_per_step = args.batch * args.seq_len
    history: dict[str, Any] = {"start": start, "step": [], "loss": [], "grad_norm": [], "lr": []}
    pending: list[tuple[int, dict[str, jax.Array]]] = []  # metrics not yet fetched
    t_start = t_mark = time.perf_counter()
    mark_step, first_step_s = start, None
    for step in range(start, stop):
        batch = language.batch(step, args.batch, args.seq_len, args.seed)
        tokens = jax.device_put(batch, token_sharding)  # each device gets its rows
        state, metrics = train_step(config, train, state, tokens)
        done = step + 1
        pending.append((done, metrics))
        if done == start + 1 or done % args.log_every == 0 or done == stop:
            for s, m in jax.device_get(pending):  # waits for the steps to finish
                history["step"].append(s)
                for k in ("loss", "grad_norm", "lr"):
                    history[k].append(float(m[k]))
            pending = []
            now = time.perf_counter()
            line = (
                f"step {done:5d}/{args.steps}  loss {history['loss'][-1]:.4f}  "
                f"grad-norm {history['grad_norm'][-1]:.3f}  lr {history['lr'][-1]:.2e}  "
            )
            if first_step_s is None:
                first_step_s = now - t_mark
                line += f"first step (compiles) {first_step_s:.1f} s"
            else:
                per_step = (now - t_mark) / (done - mark_step)
                line += f"{tokens_per_step / per_step:8.0f} tok/s  {per_step * 1e3:6.1f} ms/step"
            print(line, flush=True)
            t_mark, mark_step = now, done
        if manager is not None and args.save_every and done % args.save_every == 0:
            save_checkpoint(manager, state, meta)
    history["seconds"] = elapsed = time.perf_counter() - t_start
    ran = stop - start
    history["tokens_per_s"] = (
        (ran - 1) * tokens_per_step / (elapsed - first_step_s)
        if ran > 1 and first_step_s is not None and elapsed > first_step_s
        else float("nan")
    )
    if manager is not None:
        if manager.latest_step() != int(state["step"]):
            save_checkpoint(manager, state, meta)
        manager.wait_until_finished()
        print(f"checkpoint: step {manager.latest_step()} in {args.checkpoint_dir}")
    return state, history


if __name__ == "__main__":
    main()
