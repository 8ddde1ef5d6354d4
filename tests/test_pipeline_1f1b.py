"""The loss-returning schedules (``pipeline.one_f_one_b``, ``zb_h1``, ``interleaved`` and
``pipeline_loss``, whose ``schedule=`` also runs gpipe and circular), compared with plain
autodiff of the unpipelined model.

The model is ``tests/_pipeline_model.py``'s stack of MLP layers (the bias makes a bubble value
that leaked show); the loss of one microbatch, on the last stage, is
``sum(tanh(y) * coef)`` with ``coef`` the microbatch's target. Under ``jit`` the loss and every
gradient (the stage weights, the head's weight, the microbatches) equal
``jax.value_and_grad`` of the same loss over all layers in order on the global arrays and the
targets (rtol 1e-5, f32), on ``p`` in {2, 4, 8} stages with ``m`` in {p, 2p, 4p}, and with FSDP and tensor
parallelism inside each stage on (p, d, t) = (2, 2, 2), (4, 2, 1), (8, 1, 1). Then the
compiled programs' temporary bytes: flat in ``m`` for the memory-bounded schedules, growing
for GPipe; and the tick tables against their formulas.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from shardlib import pipeline, shardops
from shardlib._pipeline.tables import schedule_table
from shardlib.shardtypes import Array, f32, make_shardings, pytree_dataclass, typed_shard_map
from tests import _pipeline_model as pm
from tests._mesh_util import count_collectives, make_mesh
from tests._pipeline_model import B, Groups3, M, Stack, Stack3

L = 8  # layers
GROUPED = ("circular", "interleaved")  # schedules whose weights are 'v layers/p ...'


@pytree_dataclass
class Groups:  # 'v layers/p ...' without data or tensor parallelism
    w_in: f32[Array, b"v layers/p M F"]
    w_out: f32[Array, b"v layers/p F M"]
    bias: f32[Array, b"v layers/p M"]
    gain: f32[Array, b"v layers/p M"]


def _head(scale: jax.Array, y: jax.Array, coef: jax.Array) -> jax.Array:
    """One microbatch's loss on a 'B M' block: ``scale * sum(tanh(y) * coef)``."""
    return scale * jnp.sum(jnp.tanh(y) * coef)


def _head3(scale: jax.Array, y: jax.Array, coef: jax.Array) -> jax.Array:
    """As `_head` on a 'B/d M' block: the rows' sum completed over 'd'."""
    return scale * shardops.psum("", jnp.sum(jnp.tanh(y) * coef), axes="d")


def _loss_fn(schedule: str, tp: bool, stage_fn):
    """The pipelined loss ``(weights, scale, x, coef) -> scalar`` under ``schedule``."""
    head = _head3 if tp else _head
    grouped = schedule in GROUPED
    cls = (Groups3 if grouped else Stack3) if tp else (Groups if grouped else Stack)
    if tp:

        @typed_shard_map
        def loss3(
            s: cls, scale: f32[Array, b""], x: f32[Array, b"m B/d M"], c: f32[Array, b"m B/d M"]
        ) -> f32[Array, b""]:
            return pipeline.pipeline_loss(
                stage_fn, s, x, spec="B/d M", loss_fn=head, loss_params=scale, targets=c,
                schedule=schedule,
            )  # fmt: skip

        return cls, loss3

    @typed_shard_map
    def loss(
        s: cls, scale: f32[Array, b""], x: f32[Array, b"m B M"], c: f32[Array, b"m B M"]
    ) -> f32[Array, b""]:
        return pipeline.pipeline_loss(
            stage_fn, s, x, spec="B M", loss_fn=head, loss_params=scale, targets=c,
            schedule=schedule,
        )  # fmt: skip

    return cls, loss


def _check(mesh, schedule: str, m: int, *, tp: bool, seed: int, v: int = 2, remat=False):
    """Loss and every gradient under jit against plain autodiff of all layers in order."""
    p = mesh.shape["p"]
    v = v if schedule in GROUPED else 1
    w = pm.weights(seed, max(L, v * p))
    x, coef = pm.microbatches(seed + 100, m)
    stage_fn = pm.stage3 if tp else pm.stage
    stage_fn = jax.checkpoint(stage_fn) if remat else stage_fn
    cls, loss = _loss_fn(schedule, tp, stage_fn)
    placed = pm.groups(w, v) if schedule in GROUPED else w
    params = jax.device_put(cls(**placed), make_shardings(cls, mesh=mesh))
    scale = np.float32(0.7)
    with jax.set_mesh(mesh):
        every = jax.value_and_grad(loss, argnums=(0, 1, 2, 3))
        value, grads = jax.jit(every)(params, scale, x, coef)
        plain = jax.jit(loss)(params, scale, x, coef)  # no gradient: the forwards only

    def reference(w, scale, x, coef):
        return scale * jnp.sum(jnp.tanh(pm.reference(w, x)) * coef)

    ref_value, ref_grads = jax.value_and_grad(reference, argnums=(0, 1, 2, 3))(w, scale, x, coef)
    np.testing.assert_allclose(value, ref_value, rtol=1e-5)
    np.testing.assert_allclose(plain, ref_value, rtol=1e-5)
    g, g_scale, g_x, g_coef = grads
    np.testing.assert_allclose(g_scale, ref_grads[1], rtol=1e-5, err_msg="loss_params")
    np.testing.assert_allclose(g_x, ref_grads[2], rtol=1e-5, atol=1e-6, err_msg="microbatches")
    np.testing.assert_allclose(g_coef, ref_grads[3], rtol=1e-5, atol=1e-6, err_msg="targets")
    for name, ref in ref_grads[0].items():
        got = np.asarray(getattr(g, name)).reshape(ref.shape)
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6, err_msg=name)


NEW = ["1f1b", "zb-h1", "interleaved"]


@pytest.mark.slow
@pytest.mark.parametrize("schedule", NEW)
def test_small_case_matches_plain_autodiff(schedule: str) -> None:
    """The fast case: p = 2 stages, m = 4 microbatches."""
    _check(make_mesh((2,), ("p",)), schedule, 4, tp=False, seed=1)


@pytest.mark.slow
def test_gpipe_and_circular_through_the_same_entry() -> None:
    """``pipeline_loss(schedule='gpipe' | 'circular')``: the same call, the same numbers."""
    for schedule in ("gpipe", "circular"):
        _check(make_mesh((2,), ("p",)), schedule, 4, tp=False, seed=2)


# Plain stages: a Latin square over (schedule, p, m / p), so each pair of the three appears
# once (9 cases); the full product runs with FSDP + TP stages below.
PLAIN_GRID = [
    (schedule, p, per_stage)
    for i, schedule in enumerate(NEW)
    for j, p in enumerate([2, 4, 8])
    for per_stage in [[1, 2, 4][(i + j) % 3]]
]


@pytest.mark.slow
@pytest.mark.parametrize(("schedule", "p", "per_stage"), PLAIN_GRID)
def test_parity_grid(schedule: str, p: int, per_stage: int) -> None:
    """p in {2, 4, 8}, m in {p, 2p, 4p}, plain stages (no data or tensor parallelism)."""
    m = per_stage * p
    _check(make_mesh((p,), ("p",)), schedule, m, tp=False, seed=p + m)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", NEW)
@pytest.mark.parametrize("shape", [(2, 2, 2), (4, 2, 1), (8, 1, 1)], ids=str)
@pytest.mark.parametrize("per_stage", [1, 2, 4])
def test_parity_with_fsdp_and_tensor_parallel_stages(schedule, shape, per_stage) -> None:
    """Each stage's MLP gathered over 'd' (FSDP) with its hidden dim split over 't'."""
    m = per_stage * shape[0]
    _check(make_mesh(shape, ("p", "d", "t")), schedule, m, tp=True, seed=sum(shape) + m)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_fsdp_and_tensor_parallel_fast_case(schedule: str) -> None:
    """(p, d, t) = (2, 2, 2), m = 4, the stage under jax.checkpoint."""
    _check(make_mesh((2, 2, 2), ("p", "d", "t")), schedule, 4, tp=True, seed=3, remat=True)


# ---------------------------------------------------------------------------------------------
# Memory: the compiled program's temporary bytes, m = 2p against m = 8p at p = 4
# ---------------------------------------------------------------------------------------------

BIG_M, BIG_F, BIG_B = 64, 256, 16  # a layer is 128 KiB of weights, a block 4 KiB


@pytree_dataclass
class Big:
    w_in: f32[Array, b"layers/p M F"]
    w_out: f32[Array, b"layers/p F M"]


@pytree_dataclass
class BigGroups:
    w_in: f32[Array, b"v layers/p M F"]
    w_out: f32[Array, b"v layers/p F M"]


def _big_stage(s, h):
    for i in range(s.w_in.shape[0]):  # w[i]: a slice of the weights, not kept per microbatch
        h = h + jnp.tanh(h @ s.w_in[i]) @ s.w_out[i]
    return h


def _temp_bytes(schedule: str, m: int, p: int = 4, v: int = 2) -> int:
    """``temp_size_in_bytes`` of ``jit(grad(loss))`` for ``m`` microbatches on ``p`` stages."""
    grouped = schedule in GROUPED
    cls = BigGroups if grouped else Big
    mesh = make_mesh((p,), ("p",))

    @typed_shard_map
    def loss(s: cls, x: f32[Array, b"m B M"], c: f32[Array, b"m B M"]) -> f32[Array, b""]:
        return pipeline.pipeline_loss(
            _big_stage, s, x, spec="B M", loss_fn=lambda _, y, c: jnp.sum(y * c), targets=c,
            schedule=schedule,
        )  # fmt: skip

    layers = (v, 2 * p // v) if grouped else (2 * p,)
    params = cls(
        np.zeros((*layers, BIG_M, BIG_F), np.float32), np.zeros((*layers, BIG_F, BIG_M), np.float32)
    )
    x = np.zeros((m, BIG_B, BIG_M), np.float32)
    with jax.set_mesh(mesh):
        params = jax.device_put(params, make_shardings(cls, mesh=mesh))
        compiled = jax.jit(jax.grad(loss)).lower(params, x, x).compile()
    return compiled.memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize(
    "schedule", ["1f1b", pytest.param("zb-h1", marks=pytest.mark.slow), "interleaved"]
)
def test_temp_bytes_flat_in_microbatches(schedule: str) -> None:
    """p = 4: m = 8 and m = 32 within 10% (the rings' sizes do not depend on m)."""
    small, large = _temp_bytes(schedule, 8), _temp_bytes(schedule, 32)
    assert large <= 1.1 * small, (small, large)


@pytest.mark.slow
def test_gpipe_temp_bytes_grow_with_microbatches() -> None:
    """The control: GPipe keeps every tick's activations, so 4x the microbatches cost about
    twice the bytes here, and more than 1F1B's at m = 8p."""
    small, large = _temp_bytes("gpipe", 8), _temp_bytes("gpipe", 32)
    assert large > 1.5 * small, (small, large)
    # 1F1B is below GPipe already at m = 2p: its residual slots hold no slices of the
    # weights (w[i]), which are taken again from the weights, kept once.
    assert _temp_bytes("1f1b", 8) < small


# ---------------------------------------------------------------------------------------------
# The tick tables: formulas, dependencies, memory bound, the timeline
# ---------------------------------------------------------------------------------------------

TABLE_CASES = [(s, p, k * p, v) for s, v in (("1f1b", 1), ("zb-h1", 1), ("interleaved", 2),
               ("interleaved", 3)) for p in (1, 2, 4, 8) for k in (1, 2, 4)]  # fmt: skip


@pytest.mark.parametrize(("schedule", "p", "m", "v"), TABLE_CASES)
def test_table_ticks_and_bubble_equal_the_formulas(schedule: str, p: int, m: int, v: int):
    """Tick count (1F1B ``m + 2p - 2``, ZB-H1 ``p - 1`` more for the last ``W``s), the
    picture's size, the lockstep critical path and the bubble fraction equal the formulas;
    the table is a valid schedule (`tests.test_pipeline_tables.check_schedule`: every F, B
    and W once, after what it depends on, every slot read holding its item), and no stage
    holds more residuals than the schedule's bound, the residual ring as many as the most."""
    from tests.test_pipeline_tables import _interleaved_bound, check_schedule

    table = schedule_table(schedule, p, m, v)
    check_schedule(table)
    ticks = {"1f1b": m + 2 * p - 2, "zb-h1": m + 3 * p - 3}.get(schedule, table.ticks)
    assert table.ticks == ticks
    picture = pipeline.timeline(schedule, p, m, v).splitlines()
    assert len(picture) == p + 1 and len(picture[0].split()) == ticks + 1
    cost = {"1f1b": 3 * (m + p - 1), "zb-h1": 3 * m + 2 * (p - 1)}.get(
        schedule, 3 * (m + (p - 1) / v)
    )
    assert table.cost() == pytest.approx(cost)
    assert pipeline.bubble_fraction(schedule, p, m, v) == pytest.approx((cost - 3 * m) / cost)
    for row, cells in zip(picture[1:], table.actions, strict=True):  # a dot: an idle tick
        assert row.split()[2:].count(".") == sum(not c for c in cells)
    bound = {"1f1b": lambda s: min(m, 2 * (p - s) - 1), "zb-h1": lambda s: min(m, 2 * p - 1 - s)}
    held = bound.get(schedule, lambda s: _interleaved_bound(p, m, v, s))
    assert all(table.in_flight(s) <= held(s) for s in range(p))
    if schedule == "1f1b":
        assert all(table.in_flight(s) == held(s) for s in range(p))
    assert table.slots[1] == max(table.in_flight(s) for s in range(p))


def test_timeline_pictures_of_the_new_schedules() -> None:
    """Fused cells: the last stage runs the loss's forward and its backward in one tick
    (``F0B0``); ZB-H1 a ``W`` beside a ``B`` (its own: ``B0W0``); ``.`` an idle tick."""
    assert pipeline.timeline("1f1b", 2, 2).splitlines() == [
        "tick       0    1    2    3",
        "stage 0   F0   F1   B0   B1",
        "stage 1    . F0B0 F1B1    .",
    ]
    zb = pipeline.timeline("zb-h1", 2, 2).splitlines()
    assert zb[1].split() == ["stage", "0", "F0", "F1", "B0W0", "B1", "W1"]
    assert zb[2].split() == ["stage", "1", ".", "F0B0", "F1B1W0", "W1", "."]
    inter = pipeline.timeline("interleaved", 2, 2, 2).splitlines()
    assert inter[1].split()[2:] == ["F0a", "F1a", "F0b", "F1b", "B0b", "B1b", "B0a", "B1a"]
    assert inter[2].split()[2:] == [".", "F0a", "F1a", "F0bB0b", "F1bB1b", "B0a", "B1a", "."]
    with pytest.raises(ValueError, match="timeline: the 1f1b schedule has one layer group"):
        pipeline.timeline("1f1b", 2, 2, 2)
    with pytest.raises(ValueError, match="bubble_fraction: `schedule` must be one of"):
        pipeline.bubble_fraction("pipedream", 2, 2)
    # At T_F = T_B = T_W, 1F1B idles GPipe's 3 (p - 1) units, ZB-H1 2 (p - 1): the Ws fill
    # a third of 1F1B's bubble.
    for p, m in ((4, 8), (8, 32)):
        one = pipeline.bubble_fraction("1f1b", p, m) * 3 * (m + p - 1)
        zb_cost = 3 * m + 2 * (p - 1)
        assert one == pytest.approx(3 * (p - 1))
        assert pipeline.bubble_fraction("zb-h1", p, m) * zb_cost == pytest.approx(2 * (p - 1))
        assert pipeline.critical_path("zb-h1", p, m).lockstep == zb_cost


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_two_permutes_per_tick_and_one_loop(schedule: str) -> None:
    """The training loop sends activations on and cotangents back: two collective-permutes,
    in one while loop whatever m is."""
    mesh = make_mesh((4,), ("p",))
    cls, loss = _loss_fn(schedule, False, pm.stage)
    params = jax.device_put(cls(**pm.weights(0, L)), make_shardings(cls, mesh=mesh))
    texts = []
    for m in (4, 16):
        x = np.zeros((m, B, M), np.float32)
        with jax.set_mesh(mesh):
            texts.append(jax.jit(jax.grad(loss)).lower(params, np.float32(1), x, x).as_text())
    for text in texts:
        counts = count_collectives(text)
        assert counts.get("collective_permute") == 2, counts
        assert "stablehlo.case" in text  # idle ticks skip the work: a switch on the action
        assert text.count("stablehlo.while") == texts[0].count("stablehlo.while")


def test_explain_reports_the_table_schedule() -> None:
    import shardlib

    mesh = make_mesh((4,), ("p",))
    cls, loss = _loss_fn("zb-h1", False, pm.stage)
    params = jax.device_put(cls(**pm.weights(0, L)), make_shardings(cls, mesh=mesh))
    x = np.zeros((8, B, M), np.float32)
    with jax.set_mesh(mesh):
        report = shardlib.explain(jax.grad(loss), params, np.float32(1), x, x)
    (info,) = report.schedules
    assert (info.schedule, info.stages, info.microbatches) == ("zb-h1", 4, 8)
    assert info.ticks == 8 + 3 * 4 - 3  # 1F1B's m + 2p - 2, then p - 1 ticks of the last Ws
    assert info.bubble_fraction == pytest.approx(pipeline.bubble_fraction("zb-h1", 4, 8))
    assert info.bubble_fraction == pytest.approx(6 / 30)  # 2 (p - 1) idle units of 3m + 2 (p - 1)
    assert info.peak_in_flight == (7, 6, 5, 4)  # ZB-H1: at most 2p - 1 - s on stage s


def test_refusals_name_the_argument() -> None:
    """A loss_fn that does not return a scalar, interleaved with m < p, an unknown schedule."""
    mesh = make_mesh((2,), ("p",))
    params = jax.device_put(Stack(**pm.weights(0, L)), make_shardings(Stack, mesh=mesh))
    groups = jax.device_put(Groups(**pm.groups(pm.weights(0, L), 2)), make_shardings(Groups, mesh=mesh))  # fmt: skip

    def run(s, x, **kw):
        @typed_shard_map
        def f(s: type(s), x: f32[Array, b"m B M"]) -> f32[Array, b""]:
            return pipeline.pipeline_loss(pm.stage, s, x, spec="B M", **kw)

        with jax.set_mesh(mesh):
            return jax.jit(jax.grad(f))(s, x)

    x = np.zeros((4, B, M), np.float32)
    with pytest.raises(ValueError, match=r"one_f_one_b: `loss_fn\(loss_params, y, target\)` must"):
        run(params, x, loss_fn=lambda _, y, t: y, schedule="1f1b")
    with pytest.raises(
        ValueError, match=r"interleaved: argument `microbatches` must hold at least"
    ):
        run(groups, x[:1], loss_fn=lambda _, y, t: y.sum(), schedule="interleaved")
    with pytest.raises(ValueError, match=r"pipeline_loss: argument `schedule` must be one of"):
        run(params, x, loss_fn=lambda _, y, t: y.sum(), schedule="1F1B")


def _stage3_marked(s: Stack3, h: jax.Array) -> jax.Array:
    return pm.stage3(s, h, mark=True)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["1f1b", "interleaved"])
def test_explicit_activation_checkpointing_on_the_stage(schedule: str) -> None:
    """The stage under `explicit_activation_checkpointing` (its policy decides what the
    residual slots hold): the same loss and gradients, on (p, d, t) = (2, 2, 2)."""
    from jax_extra import explicit_activation_checkpointing

    mesh = make_mesh((2, 2, 2), ("p", "d", "t"))
    stage = explicit_activation_checkpointing(_stage3_marked)
    m, v, seed = 4, 2 if schedule == "interleaved" else 1, 11
    w = pm.weights(seed, L)
    x, coef = pm.microbatches(seed, m)
    cls, loss = _loss_fn(schedule, True, stage)
    placed = pm.groups(w, v) if v > 1 else w
    params = jax.device_put(cls(**placed), make_shardings(cls, mesh=mesh))
    with jax.set_mesh(mesh):
        value, g = jax.jit(jax.value_and_grad(loss))(params, np.float32(1), x, coef)
    ref_value, ref = jax.value_and_grad(lambda w: pm.loss(pm.reference(w, x), coef))(w)
    np.testing.assert_allclose(value, ref_value, rtol=1e-5)
    for name, want in ref.items():
        got = np.asarray(getattr(g, name)).reshape(want.shape)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=name)


def test_the_forward_schedules_rules_hold() -> None:
    """As gpipe: a stage_fn that communicates over the stage axis and microbatches split
    over it are refused (the analysis reads the forward run of the custom_vjp)."""
    mesh = make_mesh((2,), ("p",))
    params = jax.device_put(Stack(**pm.weights(0, L)), make_shardings(Stack, mesh=mesh))

    def mixing(s, h):
        return shardops.psum("B M", pm.stage(s, h), axes="p")

    @typed_shard_map
    def mixed(s: Stack, x: f32[Array, b"m B M"]) -> f32[Array, b""]:
        return pipeline.one_f_one_b(mixing, s, x, spec="B M", loss_fn=lambda _, y, t: y.sum())

    @typed_shard_map
    def split(s: Stack, x: f32[Array, b"m/p B M"]) -> f32[Array, b""]:
        return pipeline.one_f_one_b(pm.stage, s, x, spec="B M", loss_fn=lambda _, y, t: y.sum())

    x = np.zeros((4, B, M), np.float32)
    with jax.set_mesh(mesh):
        with pytest.raises(ValueError, match=r"one_f_one_b: `stage_fn` must not communicate"):
            jax.grad(mixed)(params, x)
        with pytest.raises(ValueError, match=r"For one_f_one_b, microbatches must be replicated"):
            jax.grad(split)(params, x)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["1f1b", "interleaved"])
def test_without_check_vma(schedule: str) -> None:
    """typed_shard_map(check_vma=False): the loss's psum over the stage axis transposes to a
    psum there, and the custom_vjp does the same; loss, weights', head's and input's
    gradients equal plain autodiff on (p, d, t) = (2, 2, 2)."""
    mesh = make_mesh((2, 2, 2), ("p", "d", "t"))
    v = 2 if schedule == "interleaved" else 1
    cls = Groups3 if v > 1 else Stack3

    @typed_shard_map(check_vma=False)
    def loss(
        s: cls, scale: f32[Array, b""], x: f32[Array, b"m B/d M"], c: f32[Array, b"m B/d M"]
    ) -> f32[Array, b""]:
        return pipeline.pipeline_loss(
            pm.stage3, s, x, spec="B/d M", loss_fn=_head3, loss_params=scale, targets=c,
            schedule=schedule,
        )  # fmt: skip

    w = pm.weights(4, L)
    x, coef = pm.microbatches(5, 4)
    placed = pm.groups(w, v) if v > 1 else w
    params = jax.device_put(cls(**placed), make_shardings(cls, mesh=mesh))
    with jax.set_mesh(mesh):
        value, (g, g_scale, g_x) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(
            params, np.float32(0.7), x, coef
        )

    def reference(w, scale, x):
        return scale * jnp.sum(jnp.tanh(pm.reference(w, x)) * coef)

    ref_value, (ref_g, ref_scale, ref_x) = jax.value_and_grad(reference, argnums=(0, 1, 2))(
        w, np.float32(0.7), x
    )
    np.testing.assert_allclose(value, ref_value, rtol=1e-5, atol=1e-6)  # a small sum
    np.testing.assert_allclose(g_scale, ref_scale, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(g_x, ref_x, rtol=1e-5, atol=1e-6)
    for name, want in ref_g.items():
        got = np.asarray(getattr(g, name)).reshape(want.shape)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=name)


def _stage_remat_layers(s: Stack, h: jax.Array) -> jax.Array:
    """`pm.stage` with each layer under its own ``jax.checkpoint`` (inside the scan)."""

    @jax.checkpoint
    def layer(h, lw):
        w_in, w_out, bias, gain = lw
        return (jax.nn.relu(h @ w_in) @ w_out + bias) * gain, None

    return jax.lax.scan(layer, h, (s.w_in, s.w_out, s.bias, s.gain))[0]


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1", "interleaved"])
def test_checkpoints_inside_the_stage_decide_what_is_kept(schedule: str) -> None:
    """A stage that checkpoints each layer itself keeps one input block per layer per
    microbatch (the schedule adds no checkpoint of its own over it, whose policy would keep
    every activation), and still gives plain autodiff's loss and gradients."""
    import shardlib

    p, m, seed = 2, 4, 5
    v = 2 if schedule in GROUPED else 1
    mesh = make_mesh((p,), ("p",))
    w = pm.weights(seed, L)
    x, coef = pm.microbatches(seed, m)
    placed = pm.groups(w, v) if v > 1 else w

    def run(stage_fn):
        cls, loss = _loss_fn(schedule, False, stage_fn)
        params = jax.device_put(cls(**placed), make_shardings(cls, mesh=mesh))
        with jax.set_mesh(mesh):
            value, g = jax.jit(jax.value_and_grad(loss))(params, np.float32(1), x, coef)
            report = shardlib.explain(jax.grad(loss), params, np.float32(1), x, coef)
        return value, g, report.schedules[0].slot_bytes

    value, g, slot = run(_stage_remat_layers)
    ref_value, ref = jax.value_and_grad(lambda w: pm.loss(pm.reference(w, x), coef))(w)
    np.testing.assert_allclose(value, ref_value, rtol=1e-5)
    for name, want in ref.items():
        got = np.asarray(getattr(g, name)).reshape(want.shape)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=name)
    layers_per_item = L // (p * v)
    assert slot == layers_per_item * B * M * 4  # each layer's input block, nothing else
    assert slot < run(pm.stage)[2]  # below what the stage without checkpoints keeps


def _stage_remat_sliced_outside(s: Stack, h: jax.Array) -> jax.Array:
    """As `_stage_remat_layers`, but a Python loop slicing ``w[i]`` outside the checkpoint."""
    layer = jax.checkpoint(lambda h, w_in, w_out, bias, gain: (jax.nn.relu(h @ w_in) @ w_out + bias) * gain)  # fmt: skip
    for i in range(s.w_in.shape[0]):
        h = layer(h, s.w_in[i], s.w_out[i], s.bias[i], s.gain[i])
    return h


def test_weight_slices_kept_by_inner_checkpoints_are_reported() -> None:
    """Slices of the weights taken outside the stage's own checkpoints are residuals, one copy
    per microbatch in flight: a warning says so and how to avoid it; the scan form is quiet."""
    import warnings

    mesh = make_mesh((2,), ("p",))
    w = pm.weights(0, L)
    x, coef = pm.microbatches(0, 2)

    def grad_of(stage_fn):
        cls, loss = _loss_fn("1f1b", False, stage_fn)
        params = jax.device_put(cls(**w), make_shardings(cls, mesh=mesh))
        with jax.set_mesh(mesh):
            return jax.jit(jax.grad(loss)).lower(params, np.float32(1), x, coef)

    with pytest.warns(UserWarning, match=r"one_f_one_b: argument `stage_fn` keeps 16 slices of "
                      r"its weights per microbatch in flight \(.*\): they are taken outside"):  # fmt: skip
        grad_of(_stage_remat_sliced_outside)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        grad_of(_stage_remat_layers)
