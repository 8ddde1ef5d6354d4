"""A table schedule's loss that varies over a mesh axis besides the stage axis, with
``check_vma=True`` (`shardlib._pipeline.branches.check_loss_axes`, `cotangents.scaled`).

The table schedules (1f1b, zb-h1, zb-v) compute their gradients while they run, before the
loss's cotangent is known, and scale them by it in their custom_vjp's backward. When
``loss_fn`` leaves each device of an axis its own share of the loss (``'c'`` of a context
split, ``'d'`` of a data split) and the body combines the shares after the schedule:

- over an axis nothing in the stage or the loss communicates over (a data axis), each
  device's gradient is its own share's: it is scaled by that device's cotangent, then summed
  over the axis. Right for any cotangent, a weighted sum of the shares included: checked
  against ``jax.grad`` of a dense reference, with ``check_vma`` on and off.
- over an axis the stage communicates over (``attention.gathered`` or ``attention.ulysses``
  over ``'c'``), a device's gradient mixes every device's share: right only if the cotangent
  is the same on all of them, which JAX's types cannot show. Refused, with the fix: reduce
  the loss over that axis in ``loss_fn``. Done so, gathered and ulysses attention inside
  the stages of all three schedules match the dense reference, values and every gradient.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from shardlib import attention, pipeline, shardops
from shardlib.shardtypes import Array, f32, pytree_dataclass, typed_shard_map
from tests._mesh_util import make_mesh

T, M, H, LAYERS, MICRO = 8, 8, 2, 4, 4  # tokens per microbatch (over 'c'), width, heads
SCHEDULES = ("1f1b", "zb-h1", "zb-v")
ATTENTION = {"gathered": attention.gathered, "ulysses": attention.ulysses}


@pytree_dataclass
class Stack:
    w: f32[Array, b"layers/p M M"]


@pytree_dataclass
class Chunks:  # zb-v's two chunks per stage (pipeline.to_groups(..., route="v"))
    w: f32[Array, b"v layers/p M M"]


def _weights(schedule: str, w: np.ndarray):
    return Chunks(**vars(pipeline.to_groups(Stack(w=w), route="v", stages=2))) if schedule == "zb-v" else Stack(w=w)  # fmt: skip


def _grad_w(schedule: str, g) -> np.ndarray:
    return np.asarray(pipeline.from_groups(g, route="v").w if schedule == "zb-v" else g.w)


def _data(seed: int):
    rng = np.random.default_rng(seed)
    w = (0.3 * rng.standard_normal((LAYERS, M, M))).astype(np.float32)
    x = rng.standard_normal((MICRO, T, M)).astype(np.float32)
    t = rng.standard_normal((MICRO, T, M)).astype(np.float32)
    return w, np.float32(0.7), x, t


# -- attention over 'c' inside the stage ------------------------------------------------------


def _attention_stage(kind: str):
    def layer(h: jax.Array, w: jax.Array) -> tuple[jax.Array, None]:
        q = (h @ w).reshape(1, h.shape[0], H, M // H)  # one sequence, its tokens over 'c'
        kv = h.reshape(1, h.shape[0], H, M // H)
        out = ATTENTION[kind]("b T/c H D", q, kv, kv, "c", causal=True)
        return h + out.reshape(h.shape), None

    return lambda s, h: lax.scan(layer, h, s.w)[0]


def _attend_ref(h: jax.Array, w: jax.Array) -> jax.Array:
    q, kv = (h @ w).reshape(T, H, M // H), h.reshape(T, H, M // H)
    s = jnp.einsum("qhd,khd->hqk", q, kv) / np.sqrt(M // H)
    s = jnp.where(jnp.tril(jnp.ones((T, T), bool)), s, -jnp.inf)
    return jnp.einsum("hqk,khd->qhd", jax.nn.softmax(s, axis=-1), kv).reshape(T, M)


def _attention_reference(w, lp, x, t):
    total = 0.0
    for i in range(x.shape[0]):
        h = x[i]
        for layer in w:
            h = h + _attend_ref(h, layer)
        total = total + lp * jnp.sum(jnp.tanh(h) * t[i])
    return total


def _attention_loss(kind: str, schedule: str, *, reduce_in_loss_fn: bool):
    """The loss under ``schedule``; ``loss_fn`` reduces over 'c' itself, or leaves each
    device its share and the body sums the shares after the schedule."""

    def head(lp, y, t):
        share = lp * jnp.sum(jnp.tanh(y) * t)
        return shardops.psum("", share, axes="c") if reduce_in_loss_fn else share

    cls = Chunks if schedule == "zb-v" else Stack

    @typed_shard_map
    def loss(
        s: cls, lp: f32[Array, b""], x: f32[Array, b"m T/c M"], t: f32[Array, b"m T/c M"]
    ) -> f32[Array, b""]:
        out = pipeline.pipeline_loss(
            _attention_stage(kind), s, x, spec="T/c M", loss_fn=head, loss_params=lp,
            targets=t, schedule=schedule,
        )  # fmt: skip
        return out if reduce_in_loss_fn else shardops.psum("", out, axes="c")

    return loss


@pytest.fixture(scope="module")
def mesh_pc():
    return make_mesh((2, 2), ("p", "c"))


CHEAP = {("gathered", "1f1b")}  # the fast tier's case; the rest of the grid is slow
GRID = [
    pytest.param(kind, schedule, marks=() if (kind, schedule) in CHEAP else pytest.mark.slow)
    for kind in ATTENTION
    for schedule in SCHEDULES
]


@pytest.mark.parametrize(("kind", "schedule"), GRID)
def test_grouped_attention_in_a_stage_matches_the_reference(mesh_pc, kind, schedule) -> None:
    """The guide's advice for context parallelism inside table-schedule stages: gathered or
    ulysses attention over 'c', the loss reduced over 'c' in ``loss_fn``."""
    loss = _attention_loss(kind, schedule, reduce_in_loss_fn=True)
    w, lp, x, t = _data(seed=len(kind) + len(schedule))
    with jax.set_mesh(mesh_pc):
        value, grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))(
            _weights(schedule, w), lp, x, t
        )
    ref_value, ref = jax.value_and_grad(_attention_reference, argnums=(0, 1, 2, 3))(w, lp, x, t)
    np.testing.assert_allclose(value, ref_value, rtol=5e-5)
    # float32 sums of a few hundred terms, the weights' gradient of order 5: atol 1e-4
    np.testing.assert_allclose(_grad_w(schedule, grads[0]), ref[0], rtol=1e-4, atol=1e-4)
    for got, want, name in zip(grads[1:], ref[1:], ("loss_params", "x", "targets"), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4, err_msg=name)


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("kind", list(ATTENTION))
def test_shares_of_the_loss_over_an_axis_the_stage_mixes_are_refused(mesh_pc, kind, schedule):
    """Each device's share of the loss, summed over 'c' after the schedule: the gradients
    would be right only for a cotangent the same on every device of 'c'. Refused when
    differentiated, naming the collective and the fix; the forward alone runs right."""
    loss = _attention_loss(kind, schedule, reduce_in_loss_fn=False)
    w, lp, x, t = _data(seed=3)
    with jax.set_mesh(mesh_pc), pytest.raises(ValueError) as e:
        jax.jit(jax.grad(loss))(_weights(schedule, w), lp, x, t)
    msg = str(e.value)
    fn = schedule.replace("-", "_").replace("1f1b", "one_f_one_b")
    collective = "all_gather" if kind == "gathered" else "all_to_all"
    for part in (
        f"{fn}: `loss_fn` returns a loss that varies over 'c'",
        f"while `stage_fn` runs shardops.{collective}(",
        "right only if that cotangent is the same on every device of 'c'",
        "Reduce the loss over 'c' in `loss_fn` (e.g. return shardops.psum('', loss, axes='c'))",
    ):
        assert part in msg, (part, msg)


@pytest.mark.slow
def test_the_forward_of_a_loss_in_shares_runs(mesh_pc) -> None:
    loss = _attention_loss("gathered", "1f1b", reduce_in_loss_fn=False)
    w, lp, x, t = _data(seed=4)
    with jax.set_mesh(mesh_pc):
        value = jax.jit(loss)(Stack(w=w), lp, x, t)
    np.testing.assert_allclose(value, _attention_reference(w, lp, x, t), rtol=5e-5)


def test_a_backward_that_alone_mixes_the_shares_is_refused(mesh_pc) -> None:
    """A custom_vjp stage whose backward rule alone sums over 'c' (its forward does not
    communicate): seen in the backward program, and refused the same way."""

    @jax.custom_vjp
    def mix(h):
        return h

    mix.defvjp(lambda h: (h, None), lambda _, g: (lax.psum(g, "c") / 2 + 0 * g,))

    def head(lp, y, t):
        return lp * jnp.sum(jnp.tanh(y) * t)

    @typed_shard_map
    def loss(s: Stack, lp: f32[Array, b""], x: f32[Array, b"m T/c M"], t: f32[Array, b"m T/c M"]) -> f32[Array, b""]:  # fmt: skip
        out = pipeline.pipeline_loss(
            lambda s, h: mix(jnp.tanh(h @ s.w[0])), s, x, spec="T/c M", loss_fn=head,
            loss_params=lp, targets=t, schedule="1f1b",
        )  # fmt: skip
        return shardops.psum("", out, axes="c")

    w, lp, x, t = _data(seed=5)
    with jax.set_mesh(mesh_pc), pytest.raises(ValueError) as e:
        jax.jit(jax.grad(loss))(Stack(w=w), lp, x, t)
    assert "returns a loss that varies over 'c'" in str(e.value), str(e.value)
    assert "while `stage_fn`'s backward runs `psum`" in str(e.value)


# -- a data axis: each device's share its own -------------------------------------------------


def _data_axis_loss(schedule: str, check_vma: bool, weighted: bool):
    """Microbatch rows over 'd', no collective in the stage or the loss: ``loss_fn`` leaves
    each device of 'd' its rows' share, and the body sums the shares after the schedule, each
    times ``1 + d`` when ``weighted`` (a cotangent that differs across 'd')."""

    def stage(s, h):
        return lax.scan(lambda h, w: (jnp.tanh(h @ w), None), h, s.w)[0]

    def head(lp, y, t):
        return lp * jnp.sum(jnp.tanh(y) * t)

    cls = Chunks if schedule == "zb-v" else Stack

    @typed_shard_map(check_vma=check_vma)
    def loss(
        s: cls, lp: f32[Array, b""], x: f32[Array, b"m T/d M"], t: f32[Array, b"m T/d M"]
    ) -> f32[Array, b""]:
        share = pipeline.pipeline_loss(
            stage, s, x, spec="T/d M", loss_fn=head, loss_params=lp, targets=t,
            schedule=schedule,
        )  # fmt: skip
        weight = 1.0 + shardops.axis_index("d").astype(jnp.float32) if weighted else 1.0
        return shardops.psum("", share * weight, axes="d")

    return loss


def _data_axis_reference(weighted: bool):
    def loss(w, lp, x, t):
        total = 0.0
        for i in range(x.shape[0]):
            h = x[i]
            for layer in w:
                h = jnp.tanh(h @ layer)
            rows = jnp.tanh(h) * t[i]
            for k in range(2):  # the two devices of 'd', T/2 rows each
                weight = 1.0 + k if weighted else 1.0
                total = total + weight * lp * jnp.sum(rows[k * T // 2 : (k + 1) * T // 2])
        return total

    return loss


DATA_GRID = [
    pytest.param(schedule, vma, weighted, marks=() if (schedule, vma) == ("1f1b", True) else pytest.mark.slow)
    for schedule in SCHEDULES
    for vma in (True, False)
    for weighted in (False, True)
]  # fmt: skip


@pytest.mark.parametrize(("schedule", "check_vma", "weighted"), DATA_GRID)
def test_shares_of_the_loss_over_a_data_axis_match_the_reference(schedule, check_vma, weighted):
    """Each device of 'd' scales its own gradients by its own cotangent, then they are
    summed over 'd': right for a plain sum of the shares and for a weighted one."""
    loss = _data_axis_loss(schedule, check_vma, weighted)
    w, lp, x, t = _data(seed=6 + weighted)
    with jax.set_mesh(make_mesh((2, 2), ("p", "d"))):
        value, grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))(
            _weights(schedule, w), lp, x, t
        )
    reference = _data_axis_reference(weighted)
    ref_value, ref = jax.value_and_grad(reference, argnums=(0, 1, 2, 3))(w, lp, x, t)
    np.testing.assert_allclose(value, ref_value, rtol=2e-5)
    np.testing.assert_allclose(_grad_w(schedule, grads[0]), ref[0], rtol=2e-5, atol=1e-6)
    for got, want, name in zip(grads[1:], ref[1:], ("loss_params", "x", "targets"), strict=True):
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-6, err_msg=name)
