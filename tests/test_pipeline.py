"""``pipeline.gpipe`` and ``pipeline.circular``, compared with applying all layers in order.

A stack of MLP layers (``(relu(h @ w_in) @ w_out + bias) * gain``; the bias makes a stage's
output on a zero input non-zero, so a bubble value leaking into the results or the gradients
would show) is split over mesh axis ``p``: ``'layers/p M F'`` for GPipe, and for the circular
schedule the same stack reshaped to ``(v, L / v, ...)`` and split on its second dim,
``'v layers/p M F'``. On meshes of 2, 4 and 8 stages, with ``m = p`` and ``m = 2p``
microbatches, with and without ``jax.checkpoint`` on the stage function, and with data and
tensor parallelism inside each stage ((p, d, t) in (2, 2, 2), (4, 2, 1), (8, 1, 1)), the
pipelined outputs, loss and every gradient under ``jit`` equal a plain jax.numpy loop over all
layers on the global arrays.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import shardlib
from jax_extra import explicit_activation_checkpointing
from shardlib import pipeline
from shardlib.pipeline import gpipe, gpipe_bubble_fraction
from shardlib.shardtypes import Array, f32, make_shardings, pytree_dataclass, typed_shard_map
from tests import _pipeline_model as pm
from tests._mesh_util import count_collectives, make_mesh
from tests._pipeline_model import B, Groups3, M, Stack, Stack3

L = 8  # layers


def _forward(stage_fn, tp: bool, schedule: str = "gpipe"):
    run = getattr(pipeline, schedule)
    if schedule == "circular":

        @typed_shard_map
        def forward_circular(s: Groups3, x: f32[Array, b"m B/d M"]) -> f32[Array, b"m B/d M"]:
            return run(stage_fn, s, x, spec="B/d M", axis="p")

        return forward_circular
    if tp:

        @typed_shard_map
        def forward3(s: Stack3, x: f32[Array, b"m B/d M"]) -> f32[Array, b"m B/d M"]:
            return run(stage_fn, s, x, spec="B/d M", axis="p")

        return forward3

    @typed_shard_map
    def forward(s: Stack, x: f32[Array, b"m B M"]) -> f32[Array, b"m B M"]:
        return run(stage_fn, s, x, spec="B M", axis="p")

    return forward


def _check_against_reference(
    mesh, m: int, *, remat: bool, tp: bool, seed: int, schedule: str = "gpipe", v: int = 1
) -> None:
    p = mesh.shape["p"]
    w = pm.weights(seed, max(L, v * p))
    x, coef = pm.microbatches(seed + 100, m)
    cls, fn = (Stack3, pm.stage3) if tp else (Stack, pm.stage)
    if schedule == "circular":  # (L, ...) in model order -> (v, L / v, ...)
        cls, w_in = Groups3, pm.groups(w, v)
    else:
        w_in = w
    # Remat: jax.checkpoint on a GPipe stage; on a circular stage, whose ticks run under the
    # schedule's own checkpoint (the outermost policy decides), the policy of
    # explicit_activation_checkpointing, which circular applies.
    if remat:
        fn = explicit_activation_checkpointing(fn) if schedule == "circular" else jax.checkpoint(fn)
    forward = _forward(fn, tp, schedule)
    params = jax.device_put(cls(**w_in), make_shardings(cls, mesh=mesh))

    def loss(s, x):
        return pm.loss(forward(s, x), coef)

    with jax.set_mesh(mesh):
        y = jax.jit(forward)(params, x)
        val, (g, gx) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(params, x)
    np.testing.assert_allclose(np.asarray(y), pm.reference(w, x), rtol=1e-5, atol=1e-5)
    ref_val, (ref_g, ref_gx) = jax.value_and_grad(
        lambda w, x: pm.loss(pm.reference(w, x), coef), argnums=(0, 1)
    )(w, x)
    np.testing.assert_allclose(val, ref_val, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(gx), ref_gx, rtol=1e-4, atol=1e-5, err_msg="x")
    for name in ("w_in", "w_out", "bias", "gain"):
        got = np.asarray(getattr(g, name)).reshape(ref_g[name].shape)
        np.testing.assert_allclose(got, ref_g[name], rtol=1e-4, atol=1e-5, err_msg=name)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("p", "per_stage", "remat"),
    [(2, 1, False), (2, 2, True), (4, 1, True), (4, 2, False), (8, 1, False), (8, 2, True)],
)
def test_gpipe_matches_all_layers_in_order(p: int, per_stage: int, remat: bool) -> None:
    """m = p and m = 2p microbatches on p stages, with and without remat on the stage."""
    mesh = make_mesh((p,), ("p",))
    m = per_stage * p
    _check_against_reference(mesh, m, remat=remat, tp=False, seed=p + m)


# The grid: (p, d, t) meshes, m in {p, 2p}, both schedules, under jit, remat on.
_GRID = [(2, 2, 2), (4, 2, 1), (8, 1, 1)]


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["gpipe", "circular"])
@pytest.mark.parametrize("shape", _GRID, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("per_stage", [1, 2])
def test_schedules_with_data_and_tensor_parallel_stages(
    schedule: str, shape: tuple[int, int, int], per_stage: int
) -> None:
    """Each stage's MLP split over 'd' and 't'; circular with v = 2 layer groups per stage."""
    mesh = make_mesh(shape, ("p", "d", "t"))
    p = shape[0]
    v = 2 if schedule == "circular" else 1
    _check_against_reference(
        mesh,
        per_stage * p,
        remat=True,
        tp=True,
        seed=sum(shape) + per_stage,
        schedule=schedule,
        v=v,
    )


@pytest.mark.slow
@pytest.mark.parametrize(("p", "v", "m"), [(2, 1, 2), (2, 4, 2), (2, 2, 3), (4, 2, 6)])
def test_circular_group_counts_and_uneven_microbatches(p: int, v: int, m: int) -> None:
    """v = 1 (GPipe's order with a wrap-around), v = 4, and m not a multiple of p (the
    buffer holds microbatches for more than one tick before their next pass)."""
    mesh = make_mesh((p, 1, 1), ("p", "d", "t"))
    _check_against_reference(
        mesh, m, remat=False, tp=True, seed=10 * v + m, schedule="circular", v=v
    )


def test_gpipe_one_permute_per_tick_and_one_all_reduce() -> None:
    """The scan body holds the one shift; the broadcast of the outputs is one all-reduce."""
    mesh = make_mesh((4,), ("p",))
    forward = _forward(pm.stage, tp=False)
    params = jax.device_put(Stack(**pm.weights(0, L)), make_shardings(Stack, mesh=mesh))
    x = np.zeros((16, B, M), np.float32)
    with jax.set_mesh(mesh):
        text = jax.jit(forward).lower(params, x).as_text()
    counts = count_collectives(text)
    assert counts.get("collective_permute") == 1 and counts.get("all_reduce") == 1, counts
    assert text.count("stablehlo.while") >= 1


def test_gpipe_without_broadcast_leaves_outputs_on_last_stage() -> None:
    p, m = 4, 4
    mesh = make_mesh((p,), ("p",))
    w = pm.weights(3, L)
    x = np.random.default_rng(4).standard_normal((m, B, M)).astype(np.float32)

    @typed_shard_map
    def forward(s: Stack, x: f32[Array, b"m B M"]) -> f32[Array, b"S/p m B M"]:
        return gpipe(pm.stage, s, x, spec=b"B M", axis="p", broadcast=False)[None]

    params = jax.device_put(Stack(**w), make_shardings(Stack, mesh=mesh))
    with jax.set_mesh(mesh):
        got = np.asarray(jax.jit(forward)(params, x))
    np.testing.assert_allclose(got[p - 1], pm.reference(w, x), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(got[: p - 1], 0.0)


def test_gpipe_stage_output_shape_error() -> None:
    mesh = make_mesh((2,), ("p",))

    @typed_shard_map
    def forward(s: Stack, x: f32[Array, b"m B M"]) -> f32[Array, b"m B M"]:
        return gpipe(lambda s, h: h[:, :1], s, x, spec="B M")

    params = jax.device_put(Stack(**pm.weights(0, L)), make_shardings(Stack, mesh=mesh))
    with jax.set_mesh(mesh), pytest.raises(ValueError, match=r"gpipe: `stage_fn` must return"):
        forward(params, np.zeros((2, B, M), np.float32))


@pytest.mark.parametrize(("p", "m"), [(1, 1), (2, 2), (4, 4), (4, 8), (8, 16), (8, 1)])
def test_bubble_fraction_formula(p: int, m: int) -> None:
    """(p - 1) / (m + p - 1): each stage idles p - 1 of the m + p - 1 ticks."""
    ticks = m + p - 1
    idle = [sum(not (0 <= t - s < m) for t in range(ticks)) for s in range(p)]
    assert idle == [p - 1] * p
    assert gpipe_bubble_fraction(p, m) == pytest.approx((p - 1) / (m + p - 1))
    assert gpipe_bubble_fraction(p, m) == pytest.approx(idle[0] / ticks)


@pytest.mark.parametrize(("p", "m"), [(0, 4), (4, 0), (2.0, 4), (True, 4)])
def test_bubble_fraction_rejects_bad_counts(p, m) -> None:
    with pytest.raises(ValueError, match="gpipe_bubble_fraction: argument `[pm]` must be"):
        gpipe_bubble_fraction(p, m)


def test_circular_one_permute_per_tick_and_one_all_reduce() -> None:
    """The circular loop's transfer (wrap-around included) is one collective-permute; the
    all-reduces are the stage's psum over 't' and the broadcast of the outputs."""
    mesh = make_mesh((4, 1, 1), ("p", "d", "t"))
    forward = _forward(pm.stage3, tp=True, schedule="circular")
    w = pm.groups(pm.weights(0, L), 2)
    params = jax.device_put(Groups3(**w), make_shardings(Groups3, mesh=mesh))
    with jax.set_mesh(mesh):
        text = jax.jit(forward).lower(params, np.zeros((8, B, M), np.float32)).as_text()
    counts = count_collectives(text)
    assert counts.get("collective_permute") == 1 and counts.get("all_reduce") == 2, counts


def test_circular_needs_as_many_microbatches_as_stages() -> None:
    mesh = make_mesh((4, 1, 1), ("p", "d", "t"))
    forward = _forward(pm.stage3, tp=True, schedule="circular")
    w = pm.groups(pm.weights(0, L), 2)
    params = jax.device_put(Groups3(**w), make_shardings(Groups3, mesh=mesh))
    with (
        jax.set_mesh(mesh),
        pytest.raises(ValueError, match=r"circular: argument `microbatches` must hold at least"),
    ):
        forward(params, np.zeros((3, B, M), np.float32))


def test_circular_groups_must_agree() -> None:
    mesh = make_mesh((2,), ("p",))

    @typed_shard_map
    def forward(a: f32[Array, b"v layers/p M M"], b: f32[Array, b"u layers/p M M"],
                x: f32[Array, b"m B M"]) -> f32[Array, b"m B M"]:  # fmt: skip
        return pipeline.circular(lambda w, h: h @ w[0][0] @ w[1][0], (a, b), x, spec="B M")

    a, b = np.zeros((2, 2, M, M), np.float32), np.zeros((3, 2, M, M), np.float32)
    with (
        jax.set_mesh(mesh),
        pytest.raises(ValueError, match=r"circular: every leaf of argument `stage_params`.*\[1\]"),
    ):
        forward(a, b, np.zeros((2, B, M), np.float32))


def _explained(schedule: str, p: int, m: int, v: int = 1, *, eac: bool = False):
    """The explain report of the gradient of a pipelined loss."""
    mesh = make_mesh((p, 1, 1), ("p", "d", "t"))
    stage = explicit_activation_checkpointing(_stage3_marked) if eac else jax.checkpoint(pm.stage3)
    forward = _forward(stage, tp=True, schedule=schedule)
    w = pm.weights(0, max(L, v * p))
    cls = Groups3 if schedule == "circular" else Stack3
    if schedule == "circular":
        w = pm.groups(w, v)
    params = jax.device_put(cls(**w), make_shardings(cls, mesh=mesh))
    x = np.zeros((m, B, M), np.float32)
    with jax.set_mesh(mesh):
        return shardlib.explain(jax.grad(lambda s, x: forward(s, x).sum()), params, x)


@pytest.mark.parametrize(
    ("schedule", "p", "m", "v"),
    [("gpipe", 2, 2, 1), ("gpipe", 4, 8, 1), ("circular", 2, 4, 2), ("circular", 4, 4, 2)],
)
def test_explain_reports_the_schedule_and_its_bubble(schedule: str, p: int, m: int, v: int):
    report = _explained(schedule, p, m, v)
    (info,) = report.schedules  # forward and backward are one schedule
    assert (info.schedule, info.axis, info.stages, info.microbatches, info.groups) == (
        schedule,
        "p",
        p,
        m,
        v,
    )
    assert info.ticks == v * m + p - 1
    assert info.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1))
    formula = (
        pipeline.gpipe_bubble_fraction(p, m)
        if schedule == "gpipe"
        else pipeline.circular_bubble_fraction(p, m, v)
    )
    assert info.bubble_fraction == pytest.approx(formula)
    assert info.location.startswith("test_pipeline.py:")
    # Every transfer is a row: the shift forward and its transpose, once per tick.
    shifts = [c for c in report.collectives if c.op == "shift"]
    assert sorted(c.backward for c in shifts) == [False, True]
    assert all(c.calls == info.ticks and c.kind == "collective-permute" for c in shifts)
    assert all(c.sent_bytes == B * M * 4 and c.location == info.location for c in shifts)
    text = str(report)
    # The bubble cell, then the critical path cell: (v m + p - 1) / v ticks of the step's
    # three units (forward, input half, weight half of the backward), against GPipe's.
    lockstep, gpipe = 3 * (m + (p - 1) / v), 3 * (m + p - 1)
    cells = (
        f"{formula:.1%}  {lockstep:g} / {lockstep:g} / {gpipe:g} ({lockstep / gpipe:.2f}x GPipe)"
    )
    assert "Pipeline schedules" in text and cells in text
    assert pipeline.critical_path(schedule, p, m, v) == pipeline.CriticalPath(
        lockstep, lockstep, gpipe
    )


def _stage3_marked(s: Stack3, h: jax.Array) -> jax.Array:
    """`pm.stage3` with each layer's hidden activation marked with ``save_for_backward``."""
    return pm.stage3(s, h, mark=True)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["gpipe", "circular"])
def test_explicit_activation_checkpointing_on_the_stage(schedule: str) -> None:
    """The stage under `explicit_activation_checkpointing`: same gradients as the reference,
    and the saved values explain lists grow with the ticks, so with m."""
    mesh = make_mesh((2, 2, 2), ("p", "d", "t"))
    stage = explicit_activation_checkpointing(_stage3_marked)
    w = pm.weights(5, L)
    v = 2 if schedule == "circular" else 1
    cls = Groups3 if schedule == "circular" else Stack3
    w_in = pm.groups(w, v) if v > 1 else w
    forward = _forward(stage, tp=True, schedule=schedule)
    params = jax.device_put(cls(**w_in), make_shardings(cls, mesh=mesh))
    x = np.random.default_rng(6).standard_normal((4, B, M)).astype(np.float32)
    with jax.set_mesh(mesh):
        g = jax.jit(jax.grad(lambda s, x: forward(s, x).sum()))(params, x)
    ref = jax.grad(lambda w: pm.reference(w, x).sum())(w)
    for name in ref:
        got = np.asarray(getattr(g, name)).reshape(ref[name].shape)
        np.testing.assert_allclose(got, ref[name], rtol=1e-4, atol=1e-5, err_msg=name)

    per_tick = {}
    for m in (2, 4, 8):
        report = _explained(schedule, 2, m, v, eac=True)
        (info,) = report.schedules
        marked = [s for s in report.saved if s.what == "marked"]
        assert marked and all(s.calls == info.ticks * L // (v * 2) for s in marked), marked
        per_tick[m] = report.saved_bytes / info.ticks
    # The same bytes per tick; the total grows with the ticks, v * m + p - 1.
    assert per_tick[2] == per_tick[4] == per_tick[8]


@pytest.mark.parametrize(("p", "m", "v"), [(1, 1, 1), (2, 2, 1), (4, 8, 1), (4, 4, 2), (8, 8, 3)])
def test_work_items_idle_ticks_match_the_formulas(p: int, m: int, v: int) -> None:
    """Every stage idles p - 1 of v * m + p - 1 ticks and sees each (microbatch, pass) once,
    passes in order; stage s + 1 works on an item one tick after stage s."""
    rows = pipeline.work_items(p, m, v)
    ticks = v * m + p - 1
    assert all(len(r) == ticks for r in rows)
    for s, row in enumerate(rows):
        assert sum(i is None for i in row) == p - 1
        items = [i for i in row if i is not None]
        assert items == [(k % m, k // m) for k in range(v * m)]
        if s + 1 < p:
            assert rows[s + 1][1:] == row[:-1]
    assert pipeline.circular_bubble_fraction(p, m, v) == pytest.approx((p - 1) / ticks)
    if v == 1:
        assert pipeline.gpipe_bubble_fraction(p, m) == pytest.approx((p - 1) / ticks)


def test_timeline_pictures() -> None:
    assert pipeline.timeline("gpipe", 2, 3) == (
        "tick     0  1  2  3\nstage 0  0  1  2  .\nstage 1  .  0  1  2"
    )
    circ = pipeline.timeline("circular", 2, 2, 2).splitlines()
    assert circ[1].split() == ["stage", "0", "0a", "1a", "0b", "1b", "."]
    assert circ[2].split() == ["stage", "1", ".", "0a", "1a", "0b", "1b"]
    with pytest.raises(ValueError, match="timeline: `schedule` must be one of 'gpipe'"):
        pipeline.timeline("pipedream", 2, 2)
    with pytest.raises(ValueError, match="timeline: the gpipe schedule has one layer group"):
        pipeline.timeline("gpipe", 2, 2, 2)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["gpipe", "circular"])
def test_weights_replicated_over_data_axis_sum_their_gradient_once(schedule: str) -> None:
    """Stage weights the same on every 'd' device: their gradient is summed over 'd' once,
    after the loop, not at every tick (the schedules make the weights vary over 'd')."""
    mesh = make_mesh((2, 4, 1), ("p", "d", "t"))
    v = 2 if schedule == "circular" else 1

    @pytree_dataclass
    class Plain:  # no 'd' in the weights' layout: data parallelism inside each stage
        w_in: f32[Array, b"v layers/p M F"]
        w_out: f32[Array, b"v layers/p F M"]
        bias: f32[Array, b"v layers/p M"]
        gain: f32[Array, b"v layers/p M"]

    @typed_shard_map
    def forward(s: Plain, x: f32[Array, b"m B/d M"]) -> f32[Array, b"m B/d M"]:
        if schedule == "gpipe":
            s = jax.tree.map(lambda a: a[0], s)
        return getattr(pipeline, schedule)(pm.stage, s, x, spec="B/d M")

    w = pm.weights(2, L)
    params = Plain(**pm.groups(w, v))
    params = jax.device_put(params, make_shardings(Plain, mesh=mesh))
    x = np.random.default_rng(3).standard_normal((4, B, M)).astype(np.float32)
    grad = jax.grad(lambda s, x: pm.loss(forward(s, x), x))
    with jax.set_mesh(mesh):
        report = shardlib.explain(grad, params, x)
        g = jax.jit(grad)(params, x)
    over_d = [c for c in report.collectives if c.axes == ("d",)]
    assert over_d and all(c.calls == 1 for c in over_d), [(c.op, c.calls) for c in over_d]
    ref = jax.grad(lambda w: pm.loss(pm.reference(w, x), x))(w)
    for name in ref:
        got = np.asarray(getattr(g, name)).reshape(ref[name].shape)
        np.testing.assert_allclose(got, ref[name], rtol=1e-4, atol=1e-5, err_msg=name)


def _circular_temp_bytes(m: int, policy=None) -> int:
    """Temporary bytes XLA plans for the gradient of a circular pipeline (p = 2, v = 2)."""
    mesh = make_mesh((2, 1, 1), ("p", "d", "t"))
    big_m, big_f = 64, 256  # a layer group (2 layers) is 256 KiB, an activation block 1 KiB

    @pytree_dataclass
    class Big:
        w_in: f32[Array, b"v layers/p M F"]
        w_out: f32[Array, b"v layers/p F M"]

    def stage(s, h):
        for i in range(s.w_in.shape[0]):
            h = h + jnp.tanh(h @ s.w_in[i]) @ s.w_out[i]
        return h

    @typed_shard_map
    def forward(s: Big, x: f32[Array, b"m B M"]) -> f32[Array, b"m B M"]:
        return pipeline.circular(stage, s, x, spec="B M", policy=policy)

    params = Big(
        np.zeros((2, 4, big_m, big_f), np.float32), np.zeros((2, 4, big_f, big_m), np.float32)
    )
    with jax.set_mesh(mesh):
        params = jax.device_put(params, make_shardings(Big, mesh=mesh))
        x = np.zeros((m, B, big_m), np.float32)
        step = jax.jit(jax.grad(lambda s, x: forward(s, x).sum()))
        return step.lower(params, x).compile().memory_analysis().temp_size_in_bytes


@pytest.mark.slow
def test_circular_keeps_no_weight_copy_per_tick() -> None:
    """The tick's layer group is sliced again in the backward pass: 24 more ticks (m 4 -> 16)
    cost activations only, not 24 copies of a 256 KiB group."""
    group = 2 * 2 * 64 * 256 * 4
    grown = _circular_temp_bytes(16) - _circular_temp_bytes(4)
    assert grown < 2 * group, (grown, group)
    lean = _circular_temp_bytes(16, policy=jax.checkpoint_policies.nothing_saveable)
    assert lean <= _circular_temp_bytes(16)
