"""Orbax checkpoints of a pipelined train state: saved under one schedule and mesh, resumed
under another.

The model is ``tests/_pipeline_model.py``'s stack of MLP layers with FSDP and tensor
parallelism inside each stage (`Stack3`, ``'layers/p M/d F/t'``) and a scalar head, trained
with optax's Adam through ``pipeline.pipeline_loss``. Two steps run with ``schedule='1f1b'``
on a (p, d, t) = (2, 2, 2) mesh, the whole train state (weights, Adam's moments and count,
the step) is saved with Orbax, and restored with ``restore_target(jax.eval_shape(init_state))``
onto the same mesh and onto meshes of other shapes with the same axis names. Training goes on
there under another schedule; the losses of every step equal those of the uninterrupted 1F1B
run and of plain autodiff of the unpipelined model with the same optimizer (rtol 1e-5), and
every restored leaf has the sharding its annotation gives on the new mesh.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec

from shardlib import pipeline, shardops
from shardlib.shardtypes import (
    Array,
    f32,
    make_partition_specs,
    make_shardings,
    restore_target,
    typed_shard_map,
)
from tests import _pipeline_model as pm
from tests._mesh_util import make_mesh
from tests._pipeline_model import Groups3, Stack3

optax = pytest.importorskip("optax")
ocp = pytest.importorskip("orbax.checkpoint")

L, MICRO, V = 8, 4, 2  # layers, microbatches per step, layer groups of interleaved
BEFORE, AFTER = 2, 2  # steps before the checkpoint, steps after it
NAMES = ("p", "d", "t")
OPTIMIZER = optax.adam(1e-2)


def _head(scale: jax.Array, y: jax.Array, coef: jax.Array) -> jax.Array:
    """One microbatch's loss on a 'B/d M' block, its rows' sum completed over 'd'."""
    return scale * shardops.psum("", jnp.sum(jnp.tanh(y) * coef), axes="d")


def _make_loss(schedule: str) -> Any:
    """The pipelined loss ``(stages, scale, x, coef) -> scalar`` under ``schedule``."""
    cls = Groups3 if schedule in ("circular", "interleaved") else Stack3

    @typed_shard_map
    def loss(
        s: cls,  # pyright: ignore[reportInvalidTypeForm]  (a class chosen per schedule)
        scale: f32[Array, b""],
        x: f32[Array, b"m B/d M"],
        c: f32[Array, b"m B/d M"],
    ) -> f32[Array, b""]:
        return pipeline.pipeline_loss(
            pm.stage3, s, x, spec="B/d M", loss_fn=_head, loss_params=scale, targets=c,
            schedule=schedule,
        )  # fmt: skip

    return loss


def _train_step(loss: Any) -> Any:
    """One Adam step on ``{"params", "opt_state", "step"}``; returns the state and the loss."""

    def step(state: dict[str, Any], x: jax.Array, c: jax.Array) -> tuple[dict[str, Any], Any]:
        params = state["params"]
        value, grads = jax.value_and_grad(lambda q: loss(q["stages"], q["scale"], x, c))(params)
        updates, opt_state = OPTIMIZER.update(grads, state["opt_state"], params)
        new = {"params": optax.apply_updates(params, updates), "opt_state": opt_state}
        return {**new, "step": state["step"] + 1}, value

    return jax.jit(step)


STEPS = {s: _train_step(_make_loss(s)) for s in ("1f1b", "zb-h1", "interleaved")}


def _host_weights() -> dict[str, jax.Array]:
    return {k: jnp.asarray(a) for k, a in pm.weights(0, L).items()}


def init_state() -> dict[str, Any]:
    """The train state in the annotated layout of the mesh in force."""
    stages = jax.sharding.reshard(Stack3(**_host_weights()), make_shardings(Stack3))
    params = {"stages": stages, "scale": jnp.float32(0.7)}
    return {"params": params, "opt_state": OPTIMIZER.init(params), "step": jnp.int32(0)}


def _batch(i: int) -> tuple[np.ndarray, np.ndarray]:
    return pm.microbatches(1000 + i, MICRO)


def _run(state: dict[str, Any], schedule: str, steps: range, mesh: Any) -> tuple[Any, list]:
    losses = []
    with jax.set_mesh(mesh):
        for i in steps:
            state, value = STEPS[schedule](state, *_batch(i))
            losses.append(float(value))
    return state, losses


def _reference_losses(steps: int) -> list[float]:
    """Plain autodiff of all layers in order on one device, the same Adam."""

    def loss(q: dict[str, Any], x: jax.Array, c: jax.Array) -> jax.Array:
        return q["scale"] * jnp.sum(jnp.tanh(pm.reference(q["w"], x)) * c)

    @jax.jit
    def step(q: dict[str, Any], opt_state: Any, x: jax.Array, c: jax.Array) -> Any:
        value, grads = jax.value_and_grad(loss)(q, x, c)
        updates, opt_state = OPTIMIZER.update(grads, opt_state, q)
        return optax.apply_updates(q, updates), opt_state, value

    q = {"w": _host_weights(), "scale": np.float32(0.7)}
    opt_state, losses = OPTIMIZER.init(q), []
    for i in range(steps):
        q, opt_state, value = step(q, opt_state, *_batch(i))
        losses.append(float(value))
    return losses


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Two 1F1B steps on (2, 2, 2), saved; the uninterrupted run goes on for two more."""
    mesh = make_mesh((2, 2, 2), NAMES)
    with jax.set_mesh(mesh):
        state = jax.jit(init_state)()
    state, before = _run(state, "1f1b", range(BEFORE), mesh)
    path = tmp_path_factory.mktemp("pipeline") / "state"
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(path, state)
    host = jax.device_get(state)
    _, after = _run(state, "1f1b", range(BEFORE, BEFORE + AFTER), mesh)
    reference = _reference_losses(BEFORE + AFTER)
    np.testing.assert_allclose(before + after, reference, rtol=1e-5)
    return {"path": path, "host": host, "losses": before + after}


def _restore(path: Any, mesh: Any) -> dict[str, Any]:
    with jax.set_mesh(mesh):
        target = restore_target(jax.eval_shape(init_state))
    with ocp.StandardCheckpointer() as ckptr:
        return ckptr.restore(path, target)


def _check_restored(restored: dict[str, Any], host: dict[str, Any], mesh: Any) -> None:
    """Every leaf equal to what was saved and laid out as annotated on ``mesh``: the stage
    weights and Adam's moments as `Stack3`'s fields, the head, count and step replicated."""
    assert jax.tree.structure(restored) == jax.tree.structure(host)
    specs = {
        jax.tree_util.keystr(p[-1:], simple=True): s
        for p, s in jax.tree_util.tree_leaves_with_path(make_partition_specs(Stack3))
    }
    for path, leaf in jax.tree_util.tree_leaves_with_path(restored):
        in_stack = any(getattr(k, "key", None) == "stages" for k in path)
        want = specs[jax.tree_util.keystr(path[-1:], simple=True)] if in_stack else PartitionSpec()
        assert leaf.sharding.mesh == mesh, path
        assert leaf.sharding.spec == want, (path, leaf.sharding.spec, want)
    for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(host), strict=True):
        np.testing.assert_array_equal(np.asarray(got), want)
    adam = restored["opt_state"][0]
    assert adam.nu["stages"].w_in.sharding.spec == PartitionSpec("p", "d", "t")
    assert int(adam.count) == BEFORE and int(restored["step"]) == BEFORE


def _to_groups(state: dict[str, Any], mesh: Any) -> dict[str, Any]:
    """The one-group state in interleaved's layout: every `Stack3` (the weights and Adam's
    moments) regrouped by `pipeline.to_groups` into a `Groups3`, laid out as annotated."""

    def split(n: Any) -> Any:
        if not isinstance(n, Stack3):
            return n  # the head, Adam's count, the step
        return Groups3(**vars(pipeline.to_groups(n, V)))

    with jax.set_mesh(mesh):
        return jax.tree.map(split, state, is_leaf=lambda n: isinstance(n, Stack3))


@pytest.mark.slow
def test_restore_onto_the_same_mesh_and_go_on_with_zb_h1(saved: dict[str, Any]) -> None:
    mesh = make_mesh((2, 2, 2), NAMES)
    restored = _restore(saved["path"], mesh)
    _check_restored(restored, saved["host"], mesh)
    _, after = _run(restored, "zb-h1", range(BEFORE, BEFORE + AFTER), mesh)
    np.testing.assert_allclose(after, saved["losses"][BEFORE:], rtol=1e-5)


@pytest.mark.slow  # the fast case restores onto the same mesh
@pytest.mark.parametrize(
    ("shape", "schedule"),
    [((4, 2, 1), "interleaved"), ((2, 4, 1), "zb-h1"), ((4, 1, 2), "1f1b")],
    ids=str,
)
def test_restore_onto_another_mesh_and_schedule(
    saved: dict[str, Any], shape: tuple[int, ...], schedule: str
) -> None:
    """Other stage, FSDP and tensor-parallel sizes; interleaved after regrouping the layers."""
    mesh = make_mesh(shape, NAMES)
    restored = _restore(saved["path"], mesh)
    _check_restored(restored, saved["host"], mesh)
    if schedule == "interleaved":
        restored = _to_groups(restored, mesh)
        assert restored["opt_state"][0].mu["stages"].w_out.sharding.spec == PartitionSpec(
            None, "p", "t", "d"
        )
    state, after = _run(restored, schedule, range(BEFORE, BEFORE + AFTER), mesh)
    np.testing.assert_allclose(after, saved["losses"][BEFORE:], rtol=1e-5)
    assert int(state["step"]) == BEFORE + AFTER
