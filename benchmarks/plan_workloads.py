"""The three examples as workloads for `shardlib.plan`: step, abstract arguments, specs, axes.

A :class:`PlanWorkload` holds what ``shardlib.plan(step, *args, axes=, in_specs=, roles=)``
takes: the training step (loss and gradients), its arguments as ``jax.ShapeDtypeStruct``
(global shapes, no sharding: nothing is allocated, so an 8B-parameter model plans on a
laptop), the arguments' specs naming roles (``make_partition_specs`` of the model's type with
no rules in force), the mesh axes the model offers with the roles each carries, and the roles
it names that no axis carries.

- :func:`transformer`: ``examples/transformer_model.py``'s ``loss_and_grad`` (context
  parallel, ring attention, where an axis carries ``seq``); axes ``data`` (batch), ``d``
  (batch and FSDP), ``c`` (sequence and FSDP), ``t`` (tensor): the model's ``AXIS_ROLES``.
- :func:`moe`: ``examples/moe.py``'s loss (with the load-balancing term) and gradients; axes
  ``d`` (batch) and ``e`` (batch and experts), its ``RULES`` ``{'batch': ('d', 'e'),
  'expert': 'e'}`` on the full mesh.
- :func:`pipeline`: ``examples/pipeline.py``'s pipelined loss and gradients (a schedule of
  `shardlib.pipeline`); axes ``p`` (stages), ``d`` (batch and FSDP), ``t`` (tensor).

:data:`TRANSFORMER_SIZES` names the headline transformer's sizes: ``cpu`` (every 8-device
candidate compiles in seconds on CPU), ``wide`` (the same small model with a batch that
divides 1024 devices), ``timed`` (large enough that matmuls fill a CPU step) and the paper
page's 1B and 8B models at sequence 8k and 128k. The MoE and the pipeline have ``cpu`` and
``wide`` sizes. Every example traces on abstract meshes (``shardlib.plan``); the pipeline
refuses meshes without a stage axis (its schedule needs the role), and the MoE those without
an expert axis, with their errors as the reasons.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from examples import transformer_model as tm
from shardlib.shardtypes import make_partition_specs

__all__ = [
    "MOE_SIZES",
    "PIPELINE_SIZES",
    "TRANSFORMER_SIZES",
    "PlanWorkload",
    "build",
    "moe",
    "parameters",
    "pipeline",
    "transformer",
]


@dataclasses.dataclass(frozen=True)
class PlanWorkload:
    """One model as ``shardlib.plan`` takes it: ``plan(w.step, *w.args, axes=w.axes,
    in_specs=w.in_specs, roles=w.roles, devices=N)``."""

    name: str
    step: Callable[..., Any]
    args: tuple
    in_specs: tuple
    axes: dict[str, tuple[str, ...]]
    roles: tuple[str, ...]
    description: str = ""

    def plan(self, **kw: Any) -> Any:
        """``shardlib.plan`` of this workload; ``kw``: ``devices=`` or ``mesh_shapes=``,
        ``hardware=``, ..."""
        import shardlib

        return shardlib.plan(
            self.step, *self.args, axes=self.axes, in_specs=self.in_specs, roles=self.roles, **kw
        )


def parameters(w: PlanWorkload) -> int:
    """The model's parameter count (its first argument's leaves)."""
    return sum(int(x.size) for x in jax.tree.leaves(w.args[0]) if hasattr(x, "size"))


def _shapes(tree: Any) -> Any:
    """Every array leaf as a ``jax.ShapeDtypeStruct`` without sharding."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


# ---------------------------------------------------------------------------------------------
# The headline transformer.
# ---------------------------------------------------------------------------------------------

TRANSFORMER_AXES = {"data": ("batch",), "d": ("batch", "fsdp"), "c": ("seq", "fsdp"), "t": ("tensor",)}  # fmt: skip
_TINY = tm.Config(
    vocab=64, d_model=32, n_heads=8, n_kv_heads=4, d_head=4, d_ff=64, n_layers=2, seq_len=16
)
_1B = dict(vocab=32768, d_model=2048, n_heads=16, n_kv_heads=8, d_head=128, d_ff=8192, n_layers=16)
_8B = dict(vocab=128256, d_model=4096, n_heads=32, n_kv_heads=8, d_head=128, d_ff=14336, n_layers=32)  # fmt: skip
_ALL, _SHORT, _LONG = ("data", "d", "c", "t"), ("data", "d", "t"), ("d", "c", "t")
# name -> (config, global batch, the axes offered). The scale sizes keep about 4M tokens per
# step, over all four axes at 8k (286 meshes for 1024 devices: the plan's screen traces about
# 30 of them); at 128k the batch of 32 leaves pure data parallelism (``data``, weights
# replicated) nothing to do.
TRANSFORMER_SIZES: dict[str, tuple[tm.Config, int, tuple[str, ...]]] = {
    "cpu": (_TINY, 8, _ALL),
    "wide": (_TINY, 1024, _SHORT),
    # Big enough that its matmuls, not per-op overheads, take most of a CPU step.
    "timed": (
        tm.Config(
            vocab=256,
            d_model=128,
            n_heads=8,
            n_kv_heads=4,
            d_head=16,
            d_ff=512,
            n_layers=2,
            seq_len=64,
        ),
        16,
        _ALL,
    ),
    "1B-8k": (tm.Config(**_1B, seq_len=8192), 512, _ALL),
    "1B-128k": (tm.Config(**_1B, seq_len=131072), 32, _LONG),
    "8B-8k": (tm.Config(**_8B, seq_len=8192), 512, _ALL),
    "8B-128k": (tm.Config(**_8B, seq_len=131072), 32, _LONG),
}


def transformer(config: tm.Config, batch: int, axes: tuple[str, ...] = _ALL) -> PlanWorkload:
    """``examples/transformer_model.py``'s loss and gradients on ``batch`` sequences, over
    ``axes`` of `TRANSFORMER_AXES` (``data``, ``d``, ``c``: the sequence split over it, ring
    attention; ``t``)."""
    model = jax.eval_shape(lambda: tm.init_model(config, jax.random.key(0)))

    def step(
        model: tm.Model, tokens: jax.Array, *, context: str = config.context
    ) -> tuple[jax.Array, tm.Model]:
        """The loss and gradients; ``context`` (a strategy: ``plan(strategies={'context':
        ...})``) the attention over a split sequence."""
        return tm.loss_and_grad(dataclasses.replace(config, context=context), model, tokens)

    offered = {a: r for a, r in TRANSFORMER_AXES.items() if a in axes}
    tokens = jax.ShapeDtypeStruct((batch, config.seq_len), jnp.int32)
    return PlanWorkload(
        name="transformer",
        step=step,
        args=(_shapes(model), tokens),
        in_specs=(make_partition_specs(tm.Model), P("batch", None)),
        axes=offered,
        roles=tuple(r for r in tm.ROLES if not any(r in v for v in offered.values())),
        description=(
            f"transformer d_model {config.d_model}, {config.n_layers} layers, {config.n_heads} "
            f"heads ({config.n_kv_heads} kv), d_ff {config.d_ff}, vocab {config.vocab}, "
            f"sequence {config.seq_len}, batch {batch}"
        ),
    )


# ---------------------------------------------------------------------------------------------
# Mixture of experts.
# ---------------------------------------------------------------------------------------------

MOE_AXES = {"d": ("batch",), "e": ("batch", "expert")}


def _moe_sizes() -> dict[str, tuple[Any, int]]:
    from examples import moe as ex

    return {"cpu": (ex.Config(), 16), "wide": (ex.Config(), 1024)}


MOE_SIZES = ("cpu", "wide")


def moe(config: Any, batch: int) -> PlanWorkload:
    """``examples/moe.py``'s loss (cross-entropy plus the load-balancing term) and
    gradients on ``batch`` sequences of ``config.seq_len`` tokens."""
    from examples import moe as ex

    model = jax.eval_shape(lambda: ex.init_model(config, 0))

    def step(model: Any, tokens: jax.Array) -> tuple[jax.Array, Any]:
        return jax.value_and_grad(lambda m: ex.loss_fn(config, tokens, m)[0])(model)

    tokens = jax.ShapeDtypeStruct((batch, config.seq_len), jnp.int32)
    return PlanWorkload(
        name="moe",
        step=step,
        args=(_shapes(model), tokens),
        in_specs=(make_partition_specs(ex.Model), P("batch", None)),
        axes=dict(MOE_AXES),
        roles=(),
        description=(
            f"MoE d_model {config.d_model}, {2 * config.pairs} layers, {config.experts} "
            f"experts top-{config.k}, sequence {config.seq_len}, batch {batch}"
        ),
    )


# ---------------------------------------------------------------------------------------------
# Pipeline.
# ---------------------------------------------------------------------------------------------

PIPELINE_AXES = {"p": ("stage",), "d": ("batch", "fsdp"), "t": ("tensor",)}
_PIPE_TINY = tm.Config(
    vocab=64, d_model=32, n_heads=4, n_kv_heads=2, d_head=8, d_ff=64, n_layers=4, seq_len=16
)
# name -> (config, microbatches, rows per microbatch)
PIPELINE_SIZES: dict[str, tuple[tm.Config, int, int]] = {
    "cpu": (_PIPE_TINY, 4, 8),
    "wide": (  # p x d x t up to 8 x 32 x 4: wide enough for 1024 devices
        tm.Config(
            vocab=256,
            d_model=128,
            n_heads=8,
            n_kv_heads=4,
            d_head=16,
            d_ff=256,
            n_layers=8,
            seq_len=16,
        ),
        8,
        128,
    ),
}


def pipeline(
    config: tm.Config, batch: tuple[int, int], schedule: str = "gpipe", groups: int = 2
) -> PlanWorkload:
    """``examples/pipeline.py``'s pipelined loss and gradients (``schedule``; circular and
    interleaved hold ``groups`` layer groups per stage) on ``batch = (microbatches, rows)``."""
    from examples import pipeline as ex

    m, rows = batch
    plain = jax.eval_shape(lambda: tm.init_model(config, jax.random.key(0)))
    model = jax.eval_shape(lambda: ex.pipeline_model(plain, schedule, groups))

    def step(model: Any, tokens: jax.Array) -> tuple[jax.Array, Any]:
        return ex.loss_and_grad(config, model, tokens, schedule)

    tokens = jax.ShapeDtypeStruct((m, rows, config.seq_len), jnp.int32)
    return PlanWorkload(
        name="pipeline",
        step=step,
        args=(_shapes(model), tokens),
        in_specs=(make_partition_specs(type(model)), P(None, "batch", None)),
        axes=dict(PIPELINE_AXES),
        roles=tuple(r for r in tm.ROLES if not any(r in v for v in PIPELINE_AXES.values())),
        description=(
            f"pipeline ({schedule}) of the transformer, d_model {config.d_model}, "
            f"{config.n_layers} layers, {m} microbatches of {rows} x {config.seq_len} tokens"
        ),
    )


def build(name: str, size: str = "cpu", schedule: str = "gpipe") -> PlanWorkload:
    """The workload ``name`` (``'transformer'``, ``'moe'``, ``'pipeline'``) at ``size``."""
    if name == "transformer":
        return transformer(*TRANSFORMER_SIZES[size])
    if name == "moe":
        return moe(*_moe_sizes()[size])
    if name == "pipeline":
        config, m, rows = PIPELINE_SIZES[size]
        return pipeline(config, (m, rows), schedule)
    raise ValueError(f"build: unknown workload {name!r}; known: transformer, moe, pipeline")
