"""`shardlib.explain` under a ``jax.sharding.AbstractMesh``: no devices behind the mesh.

A planner traces a training step for a mesh far larger than the machine it runs on
(``jax.sharding.use_abstract_mesh``, arguments ``jax.ShapeDtypeStruct`` with shardings on
the abstract mesh). The three example models (`examples/moe.py`, `examples/pipeline.py` for
each of its schedules, `examples/transformer_model.py` with a context axis and with
``Config(overlap='ring')``) are explained on abstract meshes of 8, 256 and 1024 devices; on
8 devices the report must be the one explain gives on the real 8-CPU-device mesh of the same
shape (collectives, memory estimate, flops, schedules), and only the abstract one carries
the note that XLA's numbers need a real mesh.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AbstractMesh, AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import shardlib
from examples import moe as moe_ex
from examples import pipeline as pipe_ex
from examples import transformer_model as tm
from shardlib._explain.explain import ABSTRACT_NOTE
from shardlib.shardtypes import make_partition_specs
from tests._mesh_util import make_mesh

# Builds a case on a mesh (abstract or real): f and its arguments, placed on that mesh.
Build = Callable[[Any], tuple[Callable[..., Any], tuple[Any, ...]]]


def _abstract(shape: tuple[int, ...], names: tuple[str, ...]) -> AbstractMesh:
    return AbstractMesh(shape, names, axis_types=(AxisType.Explicit,) * len(shape))


@contextlib.contextmanager
def _on(mesh: Any, rules: dict) -> Iterator[None]:
    """``mesh`` in force (``jax.set_mesh`` refuses an AbstractMesh) with ``rules``."""
    if isinstance(mesh, AbstractMesh):
        entered = jax.sharding.use_abstract_mesh(mesh)
    else:
        entered = jax.set_mesh(mesh)
    with entered, shardlib.axis_rules(rules):
        yield


def _placed(mesh: Any, shapes: Any, specs: Any) -> Any:
    """``jax.ShapeDtypeStruct`` leaves of ``shapes`` with ``NamedSharding(mesh, spec)``."""
    return jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, s)),
        shapes,
        specs,
    )


def _explain(mesh: Any, rules: Callable[[Any], dict], build: Build) -> shardlib.ExplainReport:
    with _on(mesh, rules(mesh)):
        f, args = build(mesh)
        return shardlib.explain(f, *args)


# -- the models ------------------------------------------------------------------------------


def _moe(mesh: Any) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """`examples/moe.py`'s loss and gradient (its train_step adds optax's update)."""
    d, e = mesh.axis_sizes
    c = moe_ex.Config(experts=max(8, e))
    model = jax.eval_shape(lambda: moe_ex.init_model(c, 0))
    model = _placed(mesh, model, make_partition_specs(moe_ex.Model))
    tokens = _placed(
        mesh, jax.ShapeDtypeStruct((2 * d * e, c.seq_len), jnp.int32), P(("d", "e"), None)
    )

    def loss_and_grad(model: Any, tokens: jax.Array) -> Any:
        return jax.value_and_grad(lambda m: moe_ex.loss_fn(c, tokens, m)[0])(model)

    return loss_and_grad, (model, tokens)


def _pipeline(schedule: str) -> Build:
    """`examples/pipeline.py`'s loss and gradient under ``schedule`` on a ``('p', 'd', 't')``
    mesh: ``m = 2p`` microbatches, two layers per stage (per group: circular, interleaved)."""

    def build(mesh: Any) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        p, d, t = mesh.axis_sizes
        v = 2 if schedule in pipe_ex.GROUPED else 1
        cfg = tm.Config(vocab=64 * t, d_model=max(32, 8 * d * t), n_heads=4 * t,
                        n_kv_heads=2 * t, d_head=8, d_ff=64 * t, n_layers=2 * v * p, seq_len=16)  # fmt: skip
        weights = jax.eval_shape(
            lambda: pipe_ex.pipeline_model(
                tm.init_model(cfg, jax.random.key(0)), schedule, v, stages=p
            )
        )
        model = _placed(mesh, weights, make_partition_specs(type(weights)))
        tokens = jax.ShapeDtypeStruct((2 * p, 2 * d, cfg.seq_len), jnp.int32)
        tokens = _placed(mesh, tokens, make_partition_specs(pipe_ex.TOKENS))

        def loss_and_grad(model: Any, tokens: jax.Array) -> Any:
            return pipe_ex.loss_and_grad(cfg, model, tokens, schedule)

        return loss_and_grad, (model, tokens)

    return build


def _transformer(context: str = "ring", overlap: str | None = None) -> Build:
    """`examples/transformer_model.loss_and_grad` on ``('d', 'c', 't')`` (context parallel,
    ``Config.context``) or on ``('d', 't')`` (``Config.overlap``)."""

    def build(mesh: Any) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        sizes = dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))
        d, c, t = sizes["d"], sizes.get("c", 1), sizes["t"]
        kv = max(2, c) * t  # Ulysses splits each tensor device's heads over c
        cfg = tm.Config(vocab=64 * t, d_model=max(32, d * c * t), n_heads=2 * kv, n_kv_heads=kv,
                        d_head=8, d_ff=64 * t, n_layers=2, seq_len=16 * c * t, context=context,
                        overlap=overlap)  # fmt: skip
        weights = jax.eval_shape(lambda: tm.init_model(cfg, jax.random.key(0)))
        model = _placed(mesh, weights, make_partition_specs(tm.Model))
        tokens = jax.ShapeDtypeStruct((2 * d, cfg.seq_len), jnp.int32)
        tokens = _placed(mesh, tokens, P("d", None))
        return (lambda m, x: tm.loss_and_grad(cfg, m, x)), (model, tokens)

    return build


# name -> (mesh axis names, the axis rules of a mesh, the builder). The pipeline example's
# schedules are pipe_ex.SCHEDULES.
CASES: dict[str, tuple[tuple[str, ...], Callable[[Any], dict], Build]] = {
    "moe": (("d", "e"), lambda mesh: moe_ex.RULES, _moe),
    **{f"pipeline-{s}": (("p", "d", "t"), tm.rules_for, _pipeline(s)) for s in pipe_ex.SCHEDULES},
    **{
        f"transformer-{c}": (("d", "c", "t"), tm.rules_for, _transformer(context=c))
        for c in ("ring", "gathered", "ulysses")
    },
    "transformer-overlap": (("d", "t"), tm.rules_for, _transformer(overlap="ring")),
}
# The mesh shapes by axis count: 8 devices (also real), 256 and 1024 (abstract only).
SHAPES = {
    2: {8: (4, 2), 256: (32, 8), 1024: (64, 16)},
    3: {8: (2, 2, 2), 256: (4, 8, 8), 1024: (8, 16, 8)},
}
SHAPES_CONTEXT = {8: (2, 2, 2), 256: (16, 4, 4), 1024: (32, 8, 4)}
SHAPES_OVERLAP = {8: (4, 2), 256: (32, 8), 1024: (128, 8)}
FAST = ("moe", "pipeline-gpipe", "pipeline-1f1b", "transformer-ring", "transformer-overlap")


def _shape(case: str, devices: int) -> tuple[int, ...]:
    if case.startswith("transformer-"):
        return (SHAPES_OVERLAP if case.endswith("overlap") else SHAPES_CONTEXT)[devices]
    return SHAPES[len(CASES[case][0])][devices]


def _params(devices: tuple[int, ...]) -> list[Any]:
    return [
        pytest.param(case, n, marks=() if case in FAST and n != 256 else pytest.mark.slow)
        for case in CASES
        for n in devices
    ]


def _summary(report: shardlib.ExplainReport) -> dict[str, Any]:
    """What must not depend on devices: the collectives (kind, axes, operand bytes, calls),
    the memory estimate, the flops and the pipeline schedules."""
    rows = sorted((c.kind, c.axes, c.operand_bytes, c.calls) for c in report.collectives)
    return {
        "collectives": rows,
        "peak": report.memory.peak,
        "arguments": report.memory.arguments,
        "argument_bytes": report.argument_bytes,
        "flops": report.flops,
        "schedules": report.schedules,
        "rings": len(report.rings),
        "moes": len(report.moes),
    }


@pytest.mark.parametrize(
    "case", [pytest.param(c, marks=() if c in FAST else pytest.mark.slow) for c in CASES]
)
def test_abstract_report_equals_the_real_meshs(case: str) -> None:
    names, rules, build = CASES[case]
    shape = _shape(case, 8)
    abstract = _explain(_abstract(shape, names), rules, build)
    real = _explain(make_mesh(shape, names), rules, build)
    assert _summary(abstract) == _summary(real)
    assert abstract.collectives, f"{case}: no collectives traced"
    assert ABSTRACT_NOTE in abstract.notes
    assert ABSTRACT_NOTE not in real.notes


@pytest.mark.parametrize(("case", "devices"), _params((256, 1024)))
def test_explain_on_a_large_abstract_mesh(case: str, devices: int) -> None:
    names, rules, build = CASES[case]
    mesh = _abstract(_shape(case, devices), names)
    report = _explain(mesh, rules, build)
    assert report.collectives and report.memory.peak and report.flops > 0
    assert ABSTRACT_NOTE in report.notes and ABSTRACT_NOTE in report.render()
    if case.startswith("pipeline-"):
        (info,) = report.schedules
        assert info.stages == mesh.axis_sizes[0] and 0 < info.bubble_fraction < 1


def test_note_from_the_arguments_alone() -> None:
    """No mesh in force, but the arguments' shardings are on an AbstractMesh: the note too."""
    mesh = _abstract((4, 2), ("d", "t"))
    x = jax.ShapeDtypeStruct((8, 4), jnp.float32, sharding=NamedSharding(mesh, P("d", "t")))
    report = shardlib.explain(lambda a: a * 2, x)
    assert ABSTRACT_NOTE in report.notes


def test_moe_train_step_with_optax_state_on_1024_devices() -> None:
    """The example's own jitted step, Adam's state made by ``jax.eval_shape``."""
    mesh = _abstract(SHAPES[2][1024], ("d", "e"))
    with _on(mesh, moe_ex.RULES):
        (_, (model, tokens)) = _moe(mesh)
        state = {"model": model, "opt": jax.eval_shape(moe_ex.make_optimizer(0.01).init, model)}
        c = moe_ex.Config(experts=16)
        report = shardlib.explain(lambda s, t: moe_ex.train_step(c, 0.01, s, t), state, tokens)
    assert {(m.scope.axis, m.scope.e, m.scope.experts) for m in report.moes} == {("e", 16, 16)}
    assert ABSTRACT_NOTE in report.notes
