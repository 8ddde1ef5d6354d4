"""The benchmarked training steps, each in three variants with the same global math.

A :class:`Workload` holds placed inputs and, per variant, a factory that returns a *fresh*
jitted step (a new closure, so nothing is served from JAX's tracing caches). Every step takes
``(params, *data, lr)`` and returns ``(new params, loss)``: forward, gradient and SGD update
in one ``jax.jit``.

Variants:

- ``shardlib``: ``typed_shard_map`` + ``shardops`` (the transformer is
  ``examples/transformer_model.py``'s ``loss``);
- ``hand``: ``jax.shard_map`` + ``jax.lax`` collectives, einsum letters in shardlib's order;
- ``auto``: the global math under ``jax.jit`` with ``in_shardings``/``out_shardings`` only (no
  ``shard_map``): the partitioner chooses the communication.

Build workloads inside ``with jax.set_mesh(mesh):`` on a mesh with axes ``('d', 't')``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from benchmarks import _mlp
from benchmarks import _transformer as tr
from benchmarks._mlp import MLPConfig
from examples import transformer_model as tm
from examples.transformer_model import Config

__all__ = [
    "NAMES",
    "SIZES",
    "VARIANTS",
    "Workload",
    "build",
    "build_all",
    "data_parallel",
    "fsdp_mlp",
    "transformer",
    "transformer_inputs",
    "transformer_step",
]

VARIANTS = ("shardlib", "hand", "auto")
NAMES = ("fsdp_mlp", "transformer", "data_parallel")

SIZES: dict[str, dict[str, Any]] = {
    "tiny": {
        "mlp": MLPConfig(batch=16, d_in=16, hidden1=32, hidden2=16),
        "transformer": (
            Config(
                vocab=64,
                d_model=32,
                n_heads=4,
                n_kv_heads=2,
                d_head=8,
                d_ff=64,
                n_layers=2,
                seq_len=16,
            ),
            8,
        ),
    },
    "full": {
        "mlp": MLPConfig(batch=256, d_in=256, hidden1=1024, hidden2=256),
        "transformer": (
            Config(
                vocab=512,
                d_model=128,
                n_heads=8,
                n_kv_heads=4,
                d_head=16,
                d_ff=512,
                n_layers=4,
                seq_len=64,
            ),
            16,
        ),
    },
}


@dataclasses.dataclass
class Workload:
    name: str
    title: str
    description: str
    args: tuple[Any, ...]
    steps: dict[str, Callable[[], Any]]  # variant -> () -> a fresh jax.jit-wrapped step
    shape: str  # sizes, for the report

    def fresh(self, variant: str) -> Any:
        """A new jitted step of ``variant`` (nothing cached for it yet)."""
        return self.steps[variant]()


def _sgd(params: Any, grads: Any, lr: jax.Array) -> Any:
    return jax.tree.map(lambda w, g: w - lr * g, params, grads)


def _shardings_of(tree: Any) -> Any:
    return jax.tree.map(lambda a: a.sharding, tree)


def _auto(step: Callable[..., Any], args: tuple[Any, ...]) -> Any:
    """``jax.jit(step)`` with the inputs' shardings in and the params' shardings out."""
    mesh = jax.sharding.get_mesh()
    replicated = NamedSharding(mesh, P())
    ins = tuple(_shardings_of(a) for a in args)
    return jax.jit(step, in_shardings=ins, out_shardings=(ins[0], replicated))


def fsdp_mlp(c: MLPConfig, seed: int = 0) -> Workload:
    """The FSDP MLP workload of sizes ``c``."""
    mesh = jax.sharding.get_mesh()
    x, y, w = _mlp.init(c, jax.random.key(seed), _mlp.FSDPWeights)
    w = jax.device_put(w, jax.tree.map(lambda s: NamedSharding(mesh, s), _mlp.FSDP_SPECS))
    x = jax.device_put(x, NamedSharding(mesh, _mlp.X_SPEC))
    y = jax.device_put(y, NamedSharding(mesh, _mlp.BATCH_SPEC))
    args = (w, x, y, jnp.float32(0.1))

    def make(loss: Callable[..., jax.Array]) -> Callable[[], Any]:
        def factory() -> Any:
            def step(w, x, y, lr):
                value, g = jax.value_and_grad(lambda w: loss(x, y, w))(w)
                return _sgd(w, g, lr), value

            return step

        return factory

    sl, hd, gl = (
        make(_mlp.fsdp_loss_shardlib),
        make(_mlp.fsdp_loss_hand),
        make(_mlp.fsdp_loss_global),
    )
    return Workload(
        name="fsdp_mlp",
        title="FSDP MLP",
        description=(
            "3-layer MLP, mean squared error; batch and every weight split 8 ways over "
            "('d', 't') together, weights all-gathered before use (gradients reduce-scattered); "
            "value_and_grad + SGD outside the shard_map, in one jit"
        ),
        args=args,
        steps={
            "shardlib": lambda: jax.jit(sl()),
            "hand": lambda: jax.jit(hd()),
            "auto": lambda: _auto(gl(), args),
        },
        shape=f"batch {c.batch}, {c.d_in} → {c.hidden1} → {c.hidden2} → 1",
    )


def data_parallel(c: MLPConfig, seed: int = 0) -> Workload:
    """The data-parallel MLP workload of sizes ``c``."""
    mesh = jax.sharding.get_mesh()
    x, y, w = _mlp.init(c, jax.random.key(seed + 1), _mlp.DPWeights)
    w = jax.device_put(w, NamedSharding(mesh, P()))
    x = jax.device_put(x, NamedSharding(mesh, _mlp.X_SPEC))
    y = jax.device_put(y, NamedSharding(mesh, _mlp.BATCH_SPEC))
    args = (w, x, y, jnp.float32(0.1))

    def make(step_fn: Callable[..., Any]) -> Callable[[], Any]:
        def factory() -> Any:
            def step(w, x, y, lr):
                return step_fn(x, y, w, lr)

            return step

        return factory

    sl, hd, gl = (
        make(_mlp.dp_step_shardlib),
        make(_mlp.dp_step_hand),
        make(_mlp.dp_step_global),
    )
    return Workload(
        name="data_parallel",
        title="Data-parallel MLP",
        description=(
            "the same MLP with replicated weights; batch split 8 ways over ('d', 't') (both "
            "mesh axes are data axes); per-device value_and_grad, gradients averaged with pmean "
            "over ('d', 't'), SGD, all inside the shard_map"
        ),
        args=args,
        steps={
            "shardlib": lambda: jax.jit(sl()),
            "hand": lambda: jax.jit(hd()),
            "auto": lambda: _auto(gl(), args),
        },
        shape=f"batch {c.batch}, {c.d_in} → {c.hidden1} → {c.hidden2} → 1",
    )


def transformer_inputs(config: Config, batch: int, seed: int = 0) -> tuple[Any, ...]:
    """Placed weights, tokens and learning rate (call under ``jax.set_mesh``)."""
    key = jax.random.key(seed, impl="rbg")  # compiles much faster on CPU than threefry
    model = tm.place_model(tm.init_model(config, key))
    tokens = jax.random.randint(
        jax.random.fold_in(key, 1), (batch, config.seq_len), 0, config.vocab, dtype=jnp.int32
    )
    tokens = jax.device_put(tokens, NamedSharding(jax.sharding.get_mesh(), tr.TOKENS_SPEC))
    return model, tokens, jnp.float32(0.1)


def transformer_step(loss: Callable[..., jax.Array], config: Config) -> Callable[..., Any]:
    """An (unjitted) SGD step of ``loss(config, tokens, model)``."""

    def step(model, tokens, lr):
        value, grads = jax.value_and_grad(lambda m: loss(config, tokens, m))(model)
        return _sgd(model, grads, lr), value

    return step


def transformer(config: Config, batch: int, seed: int = 0) -> Workload:
    """The FSDP+TP transformer workload."""
    args = transformer_inputs(config, batch, seed)
    return Workload(
        name="transformer",
        title="FSDP+TP transformer",
        description=(
            "examples/transformer_model.py: FSDP over 'd', tensor parallelism over 't' "
            "(attention by kv-head, MLP by hidden dim, embeddings by vocabulary), layers under "
            "lax.scan with explicit activation checkpointing; value_and_grad + SGD in one jit"
        ),
        args=args,
        steps={
            "shardlib": lambda: jax.jit(transformer_step(tm.loss, config)),
            "hand": lambda: jax.jit(transformer_step(tr.hand_loss, config)),
            "auto": lambda: _auto(transformer_step(tr.global_loss, config), args),
        },
        shape=(
            f"batch {batch}, seq {config.seq_len}, d_model {config.d_model}, "
            f"{config.n_layers} layers, {config.n_heads} heads ({config.n_kv_heads} kv), "
            f"d_ff {config.d_ff}, vocab {config.vocab}"
        ),
    )


def build(name: str, size: str = "full", seed: int = 0) -> Workload:
    """Build one workload (inside ``jax.set_mesh`` of a ``('d', 't')`` mesh)."""
    sizes = SIZES[size]
    if name == "fsdp_mlp":
        return fsdp_mlp(sizes["mlp"], seed)
    if name == "data_parallel":
        return data_parallel(sizes["mlp"], seed)
    if name == "transformer":
        return transformer(*sizes["transformer"], seed=seed)
    raise ValueError(f"unknown workload {name!r}; choose one of {NAMES}")


def build_all(size: str = "full", seed: int = 0) -> list[Workload]:
    return [build(n, size, seed) for n in NAMES]
