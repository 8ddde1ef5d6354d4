"""The partial-sum analysis sees the user's code that the memory-bounded schedules run.

`one_f_one_b`, `zb_h1` and `interleaved` trace ``stage_fn`` and ``loss_fn`` twice: in the
forward-only run (the primal of their ``jax.custom_vjp``), and in the training run (each
forward a ``jax.vjp``, each backward the VJP applied), which JAX traces only when a gradient
is taken. A partial sum that reaches a non-linear use in either function is refused at trace
time whether the gradient is taken outside the ``typed_shard_map`` (the body's traced program
is then the forward-only run, which calls the same two functions on the same block types) or
inside it (the body's program is the training run itself); a correct program inside is not
refused and gives plain autodiff's gradients. Mesh (p, d, t) = (2, 2, 2).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from shardlib import pipeline, shardops
from shardlib.shardtypes import Array, f32, make_shardings, typed_shard_map
from tests import _pipeline_model as pm
from tests._mesh_util import make_mesh
from tests._pipeline_model import Groups3, Stack3

SCHEDULES = ["1f1b", "zb-h1", "interleaved"]
PENDING = r"PendingReductionError|is a partial sum still owing a reduction over mesh axis"


def _stage_unreduced(s: Stack3, h: jax.Array) -> jax.Array:
    """`pm.stage3` with the psum over 't' after the second matmul forgotten."""

    def layer(h, lw):
        w_in, w_out, bias, gain = lw
        z = jax.nn.relu(shardops.einsum_unreduced("B/d M, M F/t -> B/d F/t", h, w_in))
        y = shardops.einsum_unreduced("B/d F/t, F/t M -> B/d M", z, w_out)
        return (jnp.tanh(y) + bias) * gain, None  # tanh of a sum still owed over 't'

    w_in = shardops.all_gather("layers/p M/d F/t -> layers/p M F/t", s.w_in)
    w_out = shardops.all_gather("layers/p F/t M/d -> layers/p F/t M", s.w_out)
    return lax.scan(layer, h, (w_in, w_out, s.bias, s.gain))[0]


def _head(scale: jax.Array, y: jax.Array, coef: jax.Array) -> jax.Array:
    return scale * shardops.psum("", jnp.sum(jnp.tanh(y) * coef), axes="d")


def _head_unreduced(scale: jax.Array, y: jax.Array, coef: jax.Array) -> jax.Array:
    """The rows' sum left owing its reduction over 'd', then squared."""
    part = shardops.einsum_unreduced("B/d M, B/d M ->", jnp.tanh(y), coef)
    return scale * jnp.square(part)


def _run(schedule: str, stage_fn, head, *, inside: bool):
    """``jit`` of the gradient of the pipelined loss, taken inside or outside the body."""
    mesh = make_mesh((2, 2, 2), ("p", "d", "t"))
    v = 2 if schedule == "interleaved" else 1
    cls = Groups3 if v > 1 else Stack3
    w = pm.weights(3, 8)
    x, coef = pm.microbatches(4, 2)

    def pipelined(s, scale, x, c):
        return pipeline.pipeline_loss(
            stage_fn, s, x, spec="B/d M", loss_fn=head, loss_params=scale, targets=c,
            schedule=schedule,
        )  # fmt: skip

    @typed_shard_map
    def loss(s: cls, scale: f32[Array, b""], x: f32[Array, b"m B/d M"], c: f32[Array, b"m B/d M"]) -> f32[Array, b""]:  # fmt: skip
        return pipelined(s, scale, x, c)

    @typed_shard_map
    def grad_inside(s: cls, scale: f32[Array, b""], x: f32[Array, b"m B/d M"], c: f32[Array, b"m B/d M"]) -> cls:  # fmt: skip
        return jax.grad(pipelined)(s, scale, x, c)

    placed = pm.groups(w, v) if v > 1 else w
    params = jax.device_put(cls(**placed), make_shardings(cls, mesh=mesh))
    step = grad_inside if inside else jax.grad(loss)
    with jax.set_mesh(mesh):
        grads = jax.jit(step)(params, np.float32(0.5), x, coef)
    return w, x, coef, grads


@pytest.mark.parametrize("inside", [False, True], ids=["grad-outside", "grad-inside"])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_a_partial_sum_in_the_stage_is_refused(schedule: str, inside: bool) -> None:
    with pytest.raises(Exception, match=PENDING) as info:
        _run(schedule, _stage_unreduced, _head, inside=inside)
    assert "einsum_unreduced('B/d F/t, F/t M -> B/d M')" in str(info.value)
    assert "`tanh`" in str(info.value)


@pytest.mark.parametrize("inside", [False, True], ids=["grad-outside", "grad-inside"])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_a_partial_sum_in_the_loss_is_refused(schedule: str, inside: bool) -> None:
    with pytest.raises(Exception, match=PENDING) as info:
        _run(schedule, pm.stage3, _head_unreduced, inside=inside)
    assert "einsum_unreduced('B/d M, B/d M ->')" in str(info.value)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_a_correct_training_run_in_the_body_is_not_refused(schedule: str) -> None:
    """The analysis walks the training run (vjp per forward, switch per tick, rings) without
    a false refusal; the gradients equal plain autodiff's."""
    w, x, coef, grads = _run(schedule, pm.stage3, _head, inside=True)

    def reference(w):
        return 0.5 * jnp.sum(jnp.tanh(pm.reference(w, x)) * coef)

    for name, want in jax.grad(reference)(w).items():
        got = np.asarray(getattr(grads, name)).reshape(want.shape)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=name)
