"""The zero-bubble V schedule (``pipeline.zb_v``, ``pipeline_loss(schedule='zb-v')``).

Each stage holds two layer chunks in a V (stage ``s``: layer groups ``s`` and ``2p - 1 - s``),
laid out by ``pipeline.to_groups(stack, 2, route='v')``. Under ``jit`` the loss and every
gradient equal ``jax.value_and_grad`` of the same loss over all layers in order (the stage
weights' gradient brought back to model order by ``from_groups(route='v')``), on 1-D meshes of
2, 4 and 8 stages and with FSDP and tensor parallelism inside the stages; the layout helper
round-trips exactly; the table's critical path is below 1F1B's and ZB-H1's with memory flat in
``m``; the refusals name the function and the argument.
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
from tests._mesh_util import make_mesh


@pytree_dataclass
class VGroups:
    w_in: f32[Array, b"v layers/p M F"]
    w_out: f32[Array, b"v layers/p F M"]
    bias: f32[Array, b"v layers/p M"]
    gain: f32[Array, b"v layers/p M"]


def _head(scale, y, coef):
    return scale * jnp.sum(jnp.tanh(y) * coef)


def _head3(scale, y, coef):
    return scale * shardops.psum("", jnp.sum(jnp.tanh(y) * coef), axes="d")


def _loss(tp: bool):
    cls, head, spec = (pm.Groups3, _head3, "B/d M") if tp else (VGroups, _head, "B M")
    stage = pm.stage3 if tp else pm.stage
    x_type = f32[Array, b"m B/d M"] if tp else f32[Array, b"m B M"]

    @typed_shard_map
    def loss(s: cls, scale: f32[Array, b""], x: x_type, c: x_type) -> f32[Array, b""]:
        return pipeline.pipeline_loss(
            stage, s, x, spec=spec, loss_fn=head, loss_params=scale, targets=c, schedule="zb-v"
        )

    return cls, loss


def _check(mesh, m: int, *, tp: bool, seed: int, layers: int = 8) -> None:
    p = mesh.shape["p"]
    w = pm.weights(seed, max(layers, 2 * p))
    x, coef = pm.microbatches(seed + 100, m)
    cls, loss = _loss(tp)
    grouped = pipeline.to_groups(w, 2, route="v", stages=p)
    params = jax.device_put(cls(**grouped), make_shardings(cls, mesh=mesh))
    scale = np.float32(0.7)
    with jax.set_mesh(mesh):
        value, grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))(
            params, scale, x, coef
        )
        plain = jax.jit(loss)(params, scale, x, coef)

    def reference(w, scale, x, coef):
        return scale * jnp.sum(jnp.tanh(pm.reference(w, x)) * coef)

    ref_value, ref = jax.value_and_grad(reference, argnums=(0, 1, 2, 3))(w, scale, x, coef)
    np.testing.assert_allclose(value, ref_value, rtol=1e-5)
    np.testing.assert_allclose(plain, ref_value, rtol=1e-5)
    for got, want, name in zip(grads[1:], ref[1:], ("loss_params", "x", "targets"), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=name)
    host = {k: np.asarray(getattr(grads[0], k)) for k in ref[0]}
    back = pipeline.from_groups(host, route="v", stages=p)
    for name, want in ref[0].items():
        np.testing.assert_allclose(back[name], want, rtol=1e-5, atol=1e-6, err_msg=name)


@pytest.mark.slow
def test_small_case_matches_plain_autodiff() -> None:
    _check(make_mesh((2,), ("p",)), 4, tp=False, seed=1)


@pytest.mark.slow
def test_fewer_microbatches_than_stages() -> None:
    """The V needs no ``m >= p``: one microbatch on four stages."""
    _check(make_mesh((4,), ("p",)), 1, tp=False, seed=2)


@pytest.mark.slow
def test_fsdp_and_tensor_parallel_stages() -> None:
    """(p, d, t) = (2, 2, 2): weights gathered over 'd' in the stage, hidden dim over 't'."""
    _check(make_mesh((2, 2, 2), ("p", "d", "t")), 4, tp=True, seed=3)


@pytest.mark.slow
@pytest.mark.parametrize(("p", "per_stage"), [(2, 1), (4, 2), (8, 1), (4, 4)])
def test_parity_grid(p: int, per_stage: int) -> None:
    _check(make_mesh((p,), ("p",)), per_stage * p, tp=False, seed=p + per_stage)


@pytest.mark.slow
@pytest.mark.parametrize("shape", [(4, 2, 1), (2, 2, 2)], ids=str)
def test_parity_with_fsdp_and_tensor_parallel_grid(shape) -> None:
    _check(make_mesh(shape, ("p", "d", "t")), 2 * shape[0], tp=True, seed=sum(shape))


def test_v_layout_round_trips_and_puts_chunks_in_the_v() -> None:
    """Stage ``s`` gets groups ``s`` and ``2p - 1 - s``; ``from_groups`` undoes it exactly."""
    p, k = 4, 2
    stack = np.arange(2 * p * k, dtype=np.float32)[:, None] * np.ones((1, 3), np.float32)
    grouped = pipeline.to_groups(stack, 2, route="v", stages=p)
    assert grouped.shape == (2, p * k, 3)
    for s in range(p):
        np.testing.assert_array_equal(
            grouped[0, s * k : (s + 1) * k, 0], np.arange(s * k, (s + 1) * k)
        )
        g = 2 * p - 1 - s
        np.testing.assert_array_equal(
            grouped[1, s * k : (s + 1) * k, 0], np.arange(g * k, (g + 1) * k)
        )
    np.testing.assert_array_equal(pipeline.from_groups(grouped, route="v", stages=p), stack)


def test_v_layout_of_traced_values_equals_numpys() -> None:
    """Under ``jit`` (traced leaves, as under ``jax.eval_shape`` of an init), ``route='v'``
    with ``stages=`` gives numpy's V order, and ``from_groups`` undoes it."""
    stack = np.arange(16, dtype=np.float32).reshape(16, 1) * np.ones((1, 2), np.float32)
    want = pipeline.to_groups(stack, 2, route="v", stages=4)
    got = jax.jit(lambda s: pipeline.to_groups(s, route="v", stages=4))(stack)
    np.testing.assert_array_equal(np.asarray(got), want)
    back = jax.jit(lambda g: pipeline.from_groups(g, route="v", stages=4))(got)
    np.testing.assert_array_equal(np.asarray(back), stack)


def test_v_layout_reads_the_stage_count_from_a_placed_array() -> None:
    mesh = make_mesh((4,), ("p",))
    stack = np.arange(16, dtype=np.float32).reshape(16, 1) * np.ones((1, 2), np.float32)
    placed = jax.device_put(
        stack, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("p"))
    )
    grouped = pipeline.to_groups(placed, 2, route="v")
    want = pipeline.to_groups(stack, 2, route="v", stages=4)
    np.testing.assert_array_equal(np.asarray(grouped), want)


_V_MUST_BE_2 = (
    r"{}: the zb-v schedule has two layer chunks per stage, so argument `v` must be 2 \(its "
    r"default for 'zb-v': leave it out\), got v={}"
)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: pipeline.to_groups(np.zeros((8, 2)), 3, route="v", stages=2),
         r"to_groups: route='v' takes two layer chunks per stage, so argument `v` must be 2 "
         r"\(or left out\), got v=3"),
        (lambda: pipeline.to_groups(np.zeros((8, 2))), r"to_groups: argument `v` must be a "
         r"positive int .*got None"),
        (lambda: pipeline.to_groups(np.zeros((6, 2)), 2, route="v", stages=2), "multiple of 2p"),
        (lambda: pipeline.to_groups(np.zeros((8, 2)), 2, route="w"), "`route` must be"),
        (lambda: pipeline.timeline("zb-v", 4, 8, 1), _V_MUST_BE_2.format("timeline", 1)),
        (lambda: pipeline.critical_path("zb-v", 4, 8, 3), _V_MUST_BE_2.format("critical_path", 3)),
        (lambda: pipeline.bubble_fraction("zb-v", 4, 8, v=4),
         _V_MUST_BE_2.format("bubble_fraction", 4)),
    ],
)  # fmt: skip
def test_refusals_name_the_function_and_argument(call, match) -> None:
    with pytest.raises(ValueError, match=match):
        call()


def test_zb_v_defaults_to_its_two_chunks() -> None:
    """ZB-V always has two chunks per stage: `timeline`, `critical_path`, `bubble_fraction`
    and `to_groups(route='v')` take ``v = 2`` when it is left out, the same as passing it."""
    for p, m in ((2, 4), (4, 8), (3, 2)):
        drawn = pipeline.timeline("zb-v", p=p, m=m)
        assert drawn == pipeline.timeline("zb-v", p, m, 2)
        # Two chunks per microbatch: chunk 1's forward of microbatch 0 ('F0b') is drawn.
        assert "F0b" in drawn and drawn.count("F") == 2 * m * p
        assert pipeline.critical_path("zb-v", p, m) == pipeline.critical_path("zb-v", p, m, 2)
        assert pipeline.bubble_fraction("zb-v", p, m) == pipeline.bubble_fraction("zb-v", p, m, 2)
    stack = np.arange(8, dtype=np.float32).reshape(8, 1)
    np.testing.assert_array_equal(
        pipeline.to_groups(stack, route="v", stages=2),
        pipeline.to_groups(stack, 2, route="v", stages=2),
    )
    # The one-group schedules keep v = 1 by default.
    assert pipeline.critical_path("1f1b", 4, 8) == pipeline.critical_path("1f1b", 4, 8, 1)


def test_stage_params_without_two_chunks_are_refused() -> None:
    mesh = make_mesh((2,), ("p",))
    w = pm.weights(0, 6)
    params = jax.device_put(VGroups(**pm.groups(w, 3)), make_shardings(VGroups, mesh=mesh))
    x, c = pm.microbatches(1, 2)
    _, loss = _loss(False)
    with (
        jax.set_mesh(mesh),
        pytest.raises(ValueError, match="zb_v: every leaf of argument `stage_params`"),
    ):
        jax.jit(loss)(params, np.float32(1), x, c)


@pytest.mark.parametrize("p", [2, 4, 8])
def test_critical_path_below_zb_h1_and_1f1b_with_flat_memory(p: int) -> None:
    for m in (p, 2 * p, 8 * p):
        v = pipeline.critical_path("zb-v", p, m, 2).lockstep
        assert (
            v
            < pipeline.critical_path("zb-h1", p, m).lockstep
            < pipeline.critical_path("1f1b", p, m).lockstep
        )
    small, large = schedule_table("zb-v", p, 2 * p, 2), schedule_table("zb-v", p, 32 * p, 2)
    assert small.slots == large.slots
    assert [small.in_flight(s) for s in range(p)] == [large.in_flight(s) for s in range(p)]
    # In stage-activations (a chunk is half a stage), every stage of the V holds less than
    # 1F1B's stage 0 does.
    one = schedule_table("1f1b", p, 32 * p)
    assert max(large.in_flight(s) for s in range(p)) / 2 < one.in_flight(0) or p == 2


def _replay_v(table) -> None:
    """Replay a V table as the devices run it (`shardlib._pipeline.tick`): at each tick's
    start what the neighbours (or the stage itself) sent at the end of the last tick enters
    the ring slot the table names, from the side it names; then F, B, W in order. Chunk 0's
    forward output goes to the next stage (the last stage keeps it for its chunk 1), chunk
    1's to the stage before (stage 0 ends in the loss); cotangents retrace the V. Every
    read holds the item it is about, nothing is overwritten while needed, every piece runs
    once, and the tick's direction flag matches what it sends."""
    from shardlib._pipeline.placement import FROM_NEXT, FROM_PREV, FROM_SELF
    from shardlib._pipeline.tables import BWD_INPUT, FWD, FWD_LOSS, WGRAD

    p, m = table.p, table.m
    held = [{"inp": {}, "res": {}, "ct": {}} for _ in range(p)]
    sent: dict[tuple[int, int], list] = {}  # (stage, tick) -> [(kind, item, direction)]
    done = set()
    for t in range(table.ticks):
        for s in range(p):
            for kind, ring, slots, sources in (("F", "inp", table.recv_fwd, table.fwd_from),
                                               ("B", "ct", table.recv_bwd, table.bwd_from)):  # fmt: skip
                came = [(item, src) for src, n in ((FROM_PREV, s - 1), (FROM_NEXT, s + 1),
                        (FROM_SELF, s)) for k, item, to in sent.get((n, t - 1), [])
                        if k == kind and to == s]  # fmt: skip
                assert len(came) <= 1, (t, s, came)
                slot = slots[s][t]
                assert (slot >= 0) == bool(came), (kind, t, s, came)
                if came:
                    assert sources[s][t] == came[0][1], (kind, t, s)
                    assert slot not in held[s][ring], (kind, t, s, slot)
                    held[s][ring][slot] = came[0][0]
        for s in range(p):
            out = []
            for a in table.actions[s][t]:
                item, key = (a.microbatch, a.group), (a.kind, s, a.microbatch, a.group)
                assert key not in done, key
                done.add(key)
                if a.kind in (FWD, FWD_LOSS):
                    assert (a.kind == FWD_LOSS) == ((s, a.group) == (0, 1)), (t, s, a)
                    if (s, a.group) != (0, 0):
                        assert held[s]["inp"].pop(a.inp) == item, (t, s, a)
                    held[s]["res"][a.res] = item
                    if a.kind == FWD_LOSS:
                        held[s]["ct"][a.ct] = item
                    elif a.group == 0:
                        out.append(("F", (a.microbatch, 0 if s < p - 1 else 1), min(s + 1, p - 1)))
                    else:
                        out.append(("F", item, s - 1))
                    continue
                assert held[s]["res"][a.res] == item and held[s]["ct"][a.ct] == item, (t, s, a)
                if a.kind == WGRAD:
                    assert (BWD_INPUT, s, *item) in done, (t, s, a)
                    del held[s]["res"][a.res], held[s]["ct"][a.ct]
                elif a.group == 1:
                    out.append(("B", (a.microbatch, 1 if s < p - 1 else 0), min(s + 1, p - 1)))
                elif s > 0:
                    out.append(("B", item, s - 1))
            for a in table.actions[s][t]:  # chunk 1's forward output goes down, its
                if a.kind != WGRAD:  # cotangent up: the flag that swaps the two shifts
                    assert table.reverse[s][t] == (a.group == 1), (t, s, a)
            sent[(s, t)] = out
    assert len(done) == 3 * 2 * p * m
    assert all(not any(h.values()) for h in held), held


@pytest.mark.parametrize("p", [1, 2, 3, 4, 6, 8])
def test_every_v_table_replays_as_the_devices_run_it(p: int) -> None:
    for m in range(1, 3 * p + 2):
        _replay_v(schedule_table("zb-v", p, m, 2))
