"""Collectives inside a pipeline stage, the targets' gradient, forward mode and closures.

The memory-bounded schedules (1f1b, zb-h1, interleaved) run a stage's work in a ``lax.switch``
branch only that stage's devices take (`shardlib._pipeline.branches`). Grouped collectives over
another axis (all_gather, psum, all_to_all, psum_scatter) are right there: checked against a
jax.numpy reference on a (p, c) = (2, 2) mesh, values and every gradient, the targets'
included. A collective-permute (``shardops.shift``, ``attention.ring``) is paired by XLA with
the other stages' permutes there (a wrong loss, or a deadlock): refused at trace time (in a
custom_vjp's backward rule too, read from the traced backward program), as is a
``loss_fn`` that communicates over the stage axis (a deadlock; under gpipe and circular a
loss mixing unfinished blocks, refused too), a closure over a value being
differentiated (its gradient would be lost) and forward-mode AD; gpipe and circular, which run
every stage at every tick, compute all of them right.
"""

from __future__ import annotations

from contextlib import nullcontext

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from shardlib import attention, pipeline, shardops
from shardlib.shardtypes import Array, f32, i32, pytree_dataclass, typed_shard_map
from tests._mesh_util import make_mesh

B, M, LAYERS = 8, 8, 4  # rows per microbatch (split over 'c'), width, layers (over 'p')
TABLES = ("1f1b", "zb-h1", "interleaved")
EVERY = ("gpipe", "circular", *TABLES)
GROUPED = ("circular", "interleaved")


@pytree_dataclass
class Stack:
    w: f32[Array, b"layers/p M M"]


@pytree_dataclass
class Groups:
    w: f32[Array, b"v layers/p M M"]


def _mix(kind: str, h: jax.Array) -> jax.Array:
    """One layer's collective over 'c' on a 'B/c M' block; `_mix_ref` on the global rows."""
    if kind == "gather":  # every row sees the mean of all rows
        return h + jnp.mean(shardops.all_gather("B/c M -> B M", h), axis=0)
    if kind == "psum":
        return h + shardops.psum("M", jnp.sum(h, axis=0), axes="c") / B
    if kind == "all_to_all":  # a running sum down all rows, one column slice per device
        cols = shardops.all_to_all("B/c M -> B M/c", h)
        return shardops.all_to_all("B M/c -> B/c M", jnp.cumsum(cols, axis=0) / B)
    if kind == "scatter":  # the column sums, summed over 'c' and scattered back over rows
        full = jnp.broadcast_to(jnp.sum(h, axis=0), (B, M)) / B
        return h + shardops.psum_scatter("B M -> B/c M", full)
    if kind == "shift":
        return shardops.shift("B/c M", h, "c")
    raise AssertionError(kind)


def _mix_ref(kind: str, h: jax.Array) -> jax.Array:
    if kind in ("gather", "psum"):
        return h + jnp.mean(h, axis=0)
    if kind == "all_to_all":
        return jnp.cumsum(h, axis=0) / B
    if kind == "scatter":
        return h + jnp.sum(h, axis=0) / (B // 2) / 2 * 2 / 2  # each of the 2 devices' share
    if kind == "shift":
        return jnp.roll(h, B // 2, axis=0)
    raise AssertionError(kind)


def _stage(kind: str):
    def layer(h: jax.Array, w: jax.Array) -> tuple[jax.Array, None]:
        return jnp.tanh(_mix(kind, h) @ w), None

    return lambda s, h: lax.scan(layer, h, s.w)[0]


def _head(lp: jax.Array, y: jax.Array, t: jax.Array) -> jax.Array:
    return lp * shardops.psum("", jnp.sum(jnp.tanh(y) * t), axes="c")


def _pipelined(kind: str, schedule: str, head=_head):
    cls = Groups if schedule in GROUPED else Stack

    @typed_shard_map
    def loss(
        s: cls, lp: f32[Array, b""], x: f32[Array, b"m B/c M"], t: f32[Array, b"m B/c M"]
    ) -> f32[Array, b""]:
        return pipeline.pipeline_loss(
            _stage(kind), s, x, spec="B/c M", loss_fn=head, loss_params=lp, targets=t,
            schedule=schedule,
        )  # fmt: skip

    return cls, loss


def _data(seed: int, m: int = 4):
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((LAYERS, M, M)) / np.sqrt(M)).astype(np.float32)
    x = rng.standard_normal((m, B, M)).astype(np.float32)
    t = rng.standard_normal((m, B, M)).astype(np.float32)
    return w, np.float32(0.7), x, t


def _reference(kind: str):
    def loss(w, lp, x, t):
        def one(h, tt):
            for layer in w:
                h = jnp.tanh(_mix_ref(kind, h) @ layer)
            return lp * jnp.sum(jnp.tanh(h) * tt)

        return sum(one(x[i], t[i]) for i in range(x.shape[0]))

    return loss


def _weights(schedule: str, w: np.ndarray, cls):
    if schedule not in GROUPED:
        return cls(w=w)
    v, p = 2, 2  # layer l = (group r, stage s, k) in model order: (v, p * per) layout
    return cls(w=w.reshape(v, p * (LAYERS // (v * p)), M, M))


def _grad_w(schedule: str, g) -> np.ndarray:
    return np.asarray(g.w).reshape(LAYERS, M, M)


@pytest.fixture(scope="module")
def mesh():
    return make_mesh((2, 2), ("p", "c"))


@pytest.mark.slow
@pytest.mark.parametrize("schedule", EVERY)
@pytest.mark.parametrize("kind", ["gather", "psum", "all_to_all"])
def test_grouped_collectives_in_a_stage_match_the_reference(mesh, kind, schedule) -> None:
    """A psum over 'c' in a scanned layer leaves values whose varying types the B/W split
    cannot replay apart: zb-h1 runs that stage's backward whole in B, and says so."""
    cls, loss = _pipelined(kind, schedule)
    w, lp, x, t = _data(seed=len(kind) + len(schedule))
    whole = pytest.warns(pipeline.UnsplitBackwardWarning, match="varying-axis types")
    with jax.set_mesh(mesh), whole if (kind, schedule) == ("psum", "zb-h1") else nullcontext():
        value, grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))(
            _weights(schedule, w, cls), lp, x, t
        )
    ref_value, ref = jax.value_and_grad(_reference(kind), argnums=(0, 1, 2, 3))(w, lp, x, t)
    np.testing.assert_allclose(value, ref_value, rtol=2e-5)
    np.testing.assert_allclose(_grad_w(schedule, grads[0]), ref[0], rtol=2e-5, atol=1e-5)
    for got, want, name in zip(grads[1:], ref[1:], ("loss_params", "x", "targets"), strict=True):
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-5, err_msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["gpipe", "circular"])
def test_a_shift_in_a_stage_is_right_where_every_stage_runs_every_tick(mesh, schedule) -> None:
    cls, loss = _pipelined("shift", schedule)
    w, lp, x, t = _data(seed=5)
    with jax.set_mesh(mesh):
        value, grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 2)))(
            _weights(schedule, w, cls), lp, x, t
        )
    ref_value, ref = jax.value_and_grad(_reference("shift"), argnums=(0, 2))(w, lp, x, t)
    np.testing.assert_allclose(value, ref_value, rtol=2e-5)
    np.testing.assert_allclose(_grad_w(schedule, grads[0]), ref[0], rtol=2e-5, atol=1e-6)
    np.testing.assert_allclose(grads[1], ref[1], rtol=2e-5, atol=1e-6)


@pytest.mark.parametrize("schedule", TABLES)
def test_a_shift_in_a_stage_is_refused_under_the_table_schedules(mesh, schedule) -> None:
    cls, loss = _pipelined("shift", schedule)
    w, lp, x, t = _data(seed=6)
    with jax.set_mesh(mesh), pytest.raises(ValueError) as e:
        jax.jit(loss)(_weights(schedule, w, cls), lp, x, t)  # forward only: wrong there too
    msg = str(e.value)
    for part in ("`stage_fn` runs shardops.shift('B/c M') (`ppermute`) over 'c'",
                 "collective-permute", "schedule 'gpipe' or 'circular'", "attention.gathered"):  # fmt: skip
        assert part in msg, (part, msg)


@pytest.mark.slow
def test_ring_attention_in_a_stage_is_refused_and_gathered_is_right(mesh) -> None:
    """Context parallelism inside 1F1B stages: the ring (permutes) refused, the gathered form
    (all_gather) computing the reference attention. A microbatch is one sequence of B tokens
    ('L/c M' there), split over 'c'."""

    def stage(attend):
        def layer(h, w):
            q, kv = (h @ w)[None, :, None], h[None, :, None]  # one sequence of T tokens
            return h + attend("b T/c H D", q, kv, kv, "c", causal=True)[0, :, 0], None

        return lambda s, h: lax.scan(layer, h, s.w)[0]

    def run(attend):
        @typed_shard_map
        def loss(
            s: Stack, lp: f32[Array, b""], x: f32[Array, b"m B/c M"], t: f32[Array, b"m B/c M"]
        ) -> f32[Array, b""]:
            return pipeline.pipeline_loss(
                stage(attend), s, x, spec="B/c M", loss_fn=_head, loss_params=lp, targets=t,
                schedule="1f1b",
            )  # fmt: skip

        return loss

    def attend_ref(q, k, v):
        s = q @ k.T / np.sqrt(M)
        s = jnp.where(jnp.tril(jnp.ones((B, B), bool)), s, -jnp.inf)
        return jax.nn.softmax(s, axis=-1) @ v

    def reference(w, lp, x, t):
        total = 0.0
        for i in range(x.shape[0]):
            h = x[i]
            for layer in w:
                h = h + attend_ref(h @ layer, h, h)
            total = total + lp * jnp.sum(jnp.tanh(h) * t[i])
        return total

    ring = lambda spec, q, k, v, axis, causal: attention.ring(spec, q, k, v, axis, causal=causal)  # noqa: E731
    gathered = lambda spec, q, k, v, axis, causal: attention.gathered(  # noqa: E731
        spec, q, k, v, axis, causal=causal
    )
    w, lp, x, t = _data(seed=7)
    w = w * 0.3
    with jax.set_mesh(mesh):
        with pytest.raises(ValueError, match=r"runs .*ppermute.* over 'c'.*collective-permute"):
            jax.jit(run(ring))(Stack(w=w), lp, x, t)
        value, grads = jax.jit(jax.value_and_grad(run(gathered), argnums=(0, 2)))(
            Stack(w=w), lp, x, t
        )
    ref_value, ref = jax.value_and_grad(reference, argnums=(0, 2))(w, lp, x, t)
    np.testing.assert_allclose(value, ref_value, rtol=5e-5)
    np.testing.assert_allclose(grads[0].w, ref[0], rtol=5e-5, atol=1e-5)
    np.testing.assert_allclose(grads[1], ref[1], rtol=5e-5, atol=1e-5)


@pytest.mark.parametrize("schedule", EVERY)
def test_a_loss_fn_over_the_stage_axis_is_refused(mesh, schedule) -> None:
    """Under the table schedules it would deadlock: the loss runs on the last stage only.
    Under gpipe and circular every stage applies it to its own outputs: a sum over 'p' would
    mix the other stages' unfinished blocks into the loss (silently wrong)."""

    def head(lp, y, t):
        return lp * shardops.psum("", jnp.sum(y * t), axes=("c", "p"))

    cls, loss = _pipelined("gather", schedule, head)
    w, lp, x, t = _data(seed=8)
    with jax.set_mesh(mesh), pytest.raises(ValueError) as e:
        jax.jit(loss)(_weights(schedule, w, cls), lp, x, t)
    msg = str(e.value)
    assert "`loss_fn` must not communicate over the stage axis 'p'" in msg, msg
    assert "Reduce over 'p' after the schedule" in msg, msg
    why = "unfinished blocks" if schedule in ("gpipe", "circular") else "deadlock"
    assert why in msg, msg


@pytest.mark.parametrize("schedule", TABLES)
def test_a_shift_in_loss_fn_is_refused(mesh, schedule) -> None:
    def head(lp, y, t):
        return _head(lp, shardops.shift("B/c M", y, "c"), t)

    cls, loss = _pipelined("gather", schedule, head)
    w, lp, x, t = _data(seed=9)
    with jax.set_mesh(mesh), pytest.raises(ValueError, match=r"`loss_fn` runs shardops.shift"):
        jax.jit(loss)(_weights(schedule, w, cls), lp, x, t)


def _permuting_backward(axis: str):
    """``tanh(h @ w)`` as a custom_vjp whose backward alone communicates: the cotangent goes
    round 'c' and back (a round trip: the values are the plain layer's), or is summed over
    the stage axis ``axis`` (and divided back: the same values, where every stage runs)."""

    @jax.custom_vjp
    def layer(w: jax.Array, h: jax.Array) -> jax.Array:
        return jnp.tanh(h @ w)

    def fwd(w: jax.Array, h: jax.Array) -> tuple[jax.Array, tuple]:
        y = jnp.tanh(h @ w)
        return y, (w, h, y)

    def bwd(res: tuple, dy: jax.Array) -> tuple[jax.Array, jax.Array]:
        w, h, y = res
        dz = dy * (1 - y * y)
        if axis == "c":
            dz = shardops.shift("B/c M", shardops.shift("B/c M", dz, "c"), "c", offset=-1)
        else:
            dz = lax.psum(dz, axis) * 0 + dz
        return h.T @ dz, dz @ w.T

    layer.defvjp(fwd, bwd)
    return lambda s, h: lax.scan(lambda h, w: (layer(w, h), None), h, s.w)[0]


def _custom_pipelined(schedule: str, stage, head=_head):
    cls = Groups if schedule in GROUPED else Stack

    @typed_shard_map
    def loss(s: cls, lp: f32[Array, b""], x: f32[Array, b"m B/c M"], t: f32[Array, b"m B/c M"]) -> f32[Array, b""]:  # fmt: skip
        return pipeline.pipeline_loss(
            stage, s, x, spec="B/c M", loss_fn=head, loss_params=lp, targets=t,
            schedule=schedule,
        )  # fmt: skip

    return cls, loss


@pytest.mark.parametrize("schedule", TABLES)
def test_a_permute_in_a_custom_vjp_backward_is_refused(mesh, schedule) -> None:
    """A stage whose forward does not communicate, its custom_vjp's backward rule a
    collective-permute over 'c': the schedules read the backward program too (traced, not
    run: the program would pair the permutes of different stages). The forward alone runs."""
    cls, loss = _custom_pipelined(schedule, _permuting_backward("c"))
    w, lp, x, t = _data(seed=18)
    params = _weights(schedule, w, cls)
    with jax.set_mesh(mesh):
        jax.jit(loss).trace(params, lp, x, t)  # no backward: nothing to refuse
        with pytest.raises(ValueError) as e:
            jax.jit(jax.grad(loss)).trace(params, lp, x, t)
    msg = str(e.value)
    for part in ("`stage_fn`'s backward runs shardops.shift('B/c M') (`ppermute`) over 'c'",
                 "a collective-permute, which is not safe", "schedule 'gpipe' or 'circular'"):  # fmt: skip
        assert part in msg, (part, msg)


def test_a_custom_vjp_backward_over_the_stage_axis_is_refused(mesh) -> None:
    cls, loss = _custom_pipelined("1f1b", _permuting_backward("p"))
    w, lp, x, t = _data(seed=19)
    with jax.set_mesh(mesh), pytest.raises(ValueError) as e:
        jax.jit(jax.grad(loss)).trace(Stack(w=w), lp, x, t)
    msg = str(e.value)
    assert "`stage_fn`'s backward must not communicate over the stage axis 'p'" in msg, msg


def test_a_permute_in_a_loss_fn_backward_is_refused(mesh) -> None:
    @jax.custom_vjp
    def through(y: jax.Array) -> jax.Array:
        return y

    def back(_: None, g: jax.Array) -> tuple[jax.Array]:
        return (shardops.shift("B/c M", shardops.shift("B/c M", g, "c"), "c", offset=-1),)

    through.defvjp(lambda y: (y, None), back)
    head = lambda lp, y, t: _head(lp, through(y), t)  # noqa: E731
    cls, loss = _custom_pipelined("zb-h1", _stage("gather"), head)
    w, lp, x, t = _data(seed=20)
    with jax.set_mesh(mesh), pytest.raises(ValueError) as e:
        jax.jit(jax.grad(loss)).trace(Stack(w=w), lp, x, t)
    assert "`loss_fn`'s backward runs shardops.shift('B/c M') (`ppermute`)" in str(e.value)


@pytest.mark.slow
def test_a_permute_in_a_custom_vjp_backward_is_right_under_gpipe(mesh) -> None:
    """The refused stage, where every stage runs every tick: the reference's gradients."""
    _, loss = _custom_pipelined("gpipe", _permuting_backward("c"))
    w, lp, x, t = _data(seed=21)
    with jax.set_mesh(mesh):
        value, grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 2)))(Stack(w=w), lp, x, t)
    ref_value, ref = jax.value_and_grad(_reference_plain, argnums=(0, 2))(w, lp, x, t)
    np.testing.assert_allclose(value, ref_value, rtol=2e-5)
    np.testing.assert_allclose(grads[0].w, ref[0], rtol=2e-5, atol=1e-6)
    np.testing.assert_allclose(grads[1], ref[1], rtol=2e-5, atol=1e-6)


def _reference_plain(w, lp, x, t):
    total = 0.0
    for i in range(x.shape[0]):
        h = x[i]
        for layer in w:
            h = jnp.tanh(h @ layer)
        total = total + lp * jnp.sum(jnp.tanh(h) * t[i])
    return total


@pytest.mark.slow
def test_integer_and_mixed_targets(mesh) -> None:
    """Targets with an integer leaf (class labels) and a float one (weights): the float
    leaf's gradient against the reference, the integer one's float0, under 1f1b."""

    @pytree_dataclass
    class Targets:
        label: i32[Array, b"m B/c"]
        weight: f32[Array, b"m B/c"]

    def head(lp, y, t):
        picked = jnp.take_along_axis(jax.nn.log_softmax(y, axis=-1), t.label[:, None], axis=1)
        return lp * shardops.psum("", jnp.sum(picked[:, 0] * t.weight), axes="c")

    @typed_shard_map
    def loss(s: Stack, lp: f32[Array, b""], x: f32[Array, b"m B/c M"], t: Targets) -> f32[Array, b""]:  # fmt: skip
        return pipeline.pipeline_loss(
            _stage("gather"), s, x, spec="B/c M", loss_fn=head, loss_params=lp, targets=t,
            schedule="1f1b",
        )  # fmt: skip

    w, lp, x, _ = _data(seed=10)
    rng = np.random.default_rng(11)
    labels = rng.integers(0, M, (4, B)).astype(np.int32)
    weights = rng.standard_normal((4, B)).astype(np.float32)

    def reference(w, lp, x, weights):
        total = 0.0
        for i in range(4):
            h = x[i]
            for layer in w:
                h = jnp.tanh(_mix_ref("gather", h) @ layer)
            picked = jnp.take_along_axis(jax.nn.log_softmax(h, -1), labels[i][:, None], axis=1)
            total = total + lp * jnp.sum(picked[:, 0] * weights[i])
        return total

    with jax.set_mesh(mesh):
        f = jax.value_and_grad(loss, argnums=(0, 3), allow_int=True)
        value, (gw, gt) = jax.jit(f)(Stack(w=w), lp, x, Targets(label=labels, weight=weights))
    ref_value, (rw, rt) = jax.value_and_grad(reference, argnums=(0, 3))(w, lp, x, weights)
    np.testing.assert_allclose(value, ref_value, rtol=2e-5)
    np.testing.assert_allclose(gw.w, rw, rtol=2e-5, atol=1e-6)
    np.testing.assert_allclose(gt.weight, rt, rtol=2e-5, atol=1e-6)
    assert gt.label.dtype == jax.dtypes.float0


@pytest.mark.parametrize("schedule", TABLES)
def test_forward_mode_is_refused_with_what_to_use(mesh, schedule) -> None:
    cls, loss = _pipelined("gather", schedule)
    w, lp, x, t = _data(seed=12)
    params = _weights(schedule, w, cls)
    with jax.set_mesh(mesh):
        for how in (
            lambda: jax.jvp(lambda x: loss(params, lp, x, t), (x,), (np.ones_like(x),)),
            lambda: jax.jacfwd(lambda lp: loss(params, lp, x, t))(lp),
        ):
            with pytest.raises(TypeError, match=r"forward-mode differentiation .* jax\.grad"):
                how()


def test_forward_mode_through_gpipe_matches_the_reference(mesh) -> None:
    cls, loss = _pipelined("gather", "gpipe")
    w, lp, x, t = _data(seed=13)
    tangent = np.random.default_rng(14).standard_normal(x.shape).astype(np.float32)
    with jax.set_mesh(mesh):
        value, dot = jax.jit(lambda x, tx: jax.jvp(lambda x: loss(cls(w=w), lp, x, t), (x,), (tx,)))(
            x, tangent
        )  # fmt: skip
    ref_value, ref_dot = jax.jvp(lambda x: _reference("gather")(w, lp, x, t), (x,), (tangent,))
    np.testing.assert_allclose(value, ref_value, rtol=2e-5)
    np.testing.assert_allclose(dot, ref_dot, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("schedule", TABLES)
def test_closures_over_a_differentiated_value_are_refused(mesh, schedule) -> None:
    cls = Groups if schedule in GROUPED else Stack
    w, lp, x, t = _data(seed=15)

    def loss_closing(s, lp, x, t):
        return pipeline.pipeline_loss(
            _stage("gather"), s, x, spec="B/c M", targets=t, schedule=schedule,
            loss_fn=lambda _, y, t: _head(lp, y, t),
        )  # fmt: skip

    def stage_closing(s, lp, x, t):
        stage = lambda s, h: _stage("gather")(s, h) * lp  # noqa: E731
        return pipeline.pipeline_loss(
            stage, s, x, spec="B/c M", targets=t, schedule=schedule,
            loss_fn=lambda _, y, t: _head(1.0, y, t),
        )  # fmt: skip

    for body, arg, where in ((loss_closing, "loss_fn", "loss_params"),
                             (stage_closing, "stage_fn", "stage_params")):  # fmt: skip
        body.__annotations__ = {
            "s": cls, "lp": f32[Array, b""], "x": f32[Array, b"m B/c M"],
            "t": f32[Array, b"m B/c M"], "return": f32[Array, b""],
        }  # fmt: skip
        f = typed_shard_map(body)
        with jax.set_mesh(mesh):
            jax.jit(f)(_weights(schedule, w, cls), lp, x, t)  # not differentiated: runs
            with pytest.raises(ValueError) as e:
                jax.jit(jax.grad(f, argnums=1))(_weights(schedule, w, cls), lp, x, t)
        msg = str(e.value)
        assert f"`{arg}` closes over a value being differentiated (float32[])" in msg, msg
        assert f"Pass it in `{where}`" in msg, msg


def test_a_closure_is_differentiated_through_gpipe(mesh) -> None:
    w, lp, x, t = _data(seed=16)

    @typed_shard_map
    def loss(s: Stack, lp: f32[Array, b""], x: f32[Array, b"m B/c M"], t: f32[Array, b"m B/c M"]) -> f32[Array, b""]:  # fmt: skip
        return pipeline.pipeline_loss(
            _stage("gather"), s, x, spec="B/c M", targets=t, schedule="gpipe",
            loss_fn=lambda _, y, t: _head(lp, y, t),
        )  # fmt: skip

    with jax.set_mesh(mesh):
        g = jax.jit(jax.grad(loss, argnums=1))(Stack(w=w), lp, x, t)
    ref = jax.grad(_reference("gather"), argnums=1)(w, lp, x, t)
    np.testing.assert_allclose(g, ref, rtol=2e-5)


@pytest.mark.slow
@pytest.mark.parametrize("check_vma", [True, False], ids=["vma", "no-vma"])
@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_target_gradients_with_a_data_axis_and_check_vma_off(schedule, check_vma) -> None:
    """Microbatches split over a data axis 'd', the loss summed over it; the targets'
    gradient (written on the last stage, zero elsewhere) summed over the stages once, by
    the custom_vjp with check_vma on and by shard_map's transpose with it off."""
    mesh = make_mesh((2, 2), ("p", "d"))

    def stage(s, h):
        return lax.scan(lambda h, w: (jnp.tanh(h @ w), None), h, s.w)[0]

    def head(lp, y, t):
        return lp * shardops.psum("", jnp.sum(jnp.tanh(y) * t), axes="d")

    @typed_shard_map(check_vma=check_vma)
    def loss(s: Stack, lp: f32[Array, b""], x: f32[Array, b"m B/d M"], t: f32[Array, b"m B/d M"]) -> f32[Array, b""]:  # fmt: skip
        return pipeline.pipeline_loss(
            stage, s, x, spec="B/d M", targets=t, schedule=schedule, loss_params=lp,
            loss_fn=head,
        )  # fmt: skip

    w, lp, x, t = _data(seed=17)
    with jax.set_mesh(mesh):
        grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(Stack(w=w * 0.3), lp, x, t)
    ref = jax.grad(_reference_plain, argnums=(0, 1, 2, 3))(w * 0.3, lp, x, t)
    np.testing.assert_allclose(grads[0].w, ref[0], rtol=2e-5, atol=1e-6)
    for got, want, name in zip(grads[1:], ref[1:], ("loss_params", "x", "targets"), strict=True):
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-6, err_msg=name)
