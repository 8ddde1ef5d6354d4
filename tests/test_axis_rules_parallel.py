"""Axis roles (issue 27) in the parallel layers: ``shardlib.pipeline``, ``shardlib.attention``,
``shardlib.moe`` and ``shardlib.explain``, on real meshes of the 8 CPU devices.

Each layer is written once in roles (``layers/stage``, ``B/batch``, ``L/seq``, ``E/expert``,
``F/tensor``; ``axis='stage'``, ``axis='seq'``, ``axis='expert'``, ``hidden_axis='tensor'``,
``stats_axes='batch'``) and run under ``shardlib.axis_rules``. Its values and gradients must
equal the same program written with mesh axes (the existing suites' code: ``tests/
_pipeline_model.py``, ``tests/test_pipeline_1f1b.py``, ``tests/test_moe.py``; compared
exactly: the roles resolve to the same program) and the unsharded ``jax.numpy`` references of
those suites (f32, rtol 1e-5). A role that resolves to nothing (``tensor=None``) leaves a dim
or the hidden axis unsplit. A stage role resolving to two mesh axes or to none is refused,
naming the function and its argument ``axis``. ``explain`` names the rules in force and shows
mesh axes in its specs, schedules, rings and MoE rows.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import shardlib
from shardlib import SpecError, attention, axis_rules, moe, pipeline, shardops
from shardlib.shardtypes import Array, f32, i32, make_shardings, pytree_dataclass, typed_shard_map
from tests import _pipeline_model as pm
from tests import test_attention as ta
from tests import test_moe as tmoe
from tests import test_pipeline_1f1b as t1f1b
from tests._mesh_util import jaxpr_scopes, make_mesh, place

L = 8  # layers
RTOL, ATOL = 1e-5, 1e-6
PDT = ((2, 2, 2), ("p", "d", "t"))
# The roles of the pipeline below, on the (p, d, t) mesh: the mesh-axis model's layout.
PIPE_RULES = dict(stage="p", batch="d", fsdp="d", tensor="t")
ROLES = ("stage", "batch", "fsdp", "tensor", "seq", "expert")

# ---------------------------------------------------------------------------------------------
# The pipeline's stack of layers (tests/_pipeline_model.py's Stack3 and stage3) in roles
# ---------------------------------------------------------------------------------------------


@pytree_dataclass
class RoleStack3:
    w_in: f32[Array, b"layers/stage M/fsdp F/tensor"]
    w_out: f32[Array, b"layers/stage F/tensor M/fsdp"]
    bias: f32[Array, b"layers/stage M"]
    gain: f32[Array, b"layers/stage M"]


def role_stage3(s: RoleStack3, h: jax.Array) -> jax.Array:
    """`pm.stage3` in roles: the weights gathered over fsdp, the hidden dim split over tensor."""

    up = "B/batch M, M F/tensor -> B/batch F/tensor"
    down = "B/batch F/tensor, F/tensor M -> B/batch M"

    def layer(h: jax.Array, lw: Any) -> tuple[jax.Array, None]:
        w_in, w_out, bias, gain = lw
        z = jax.nn.relu(shardops.einsum_unreduced(up, h, w_in))
        y = shardops.einsum_unreduced(down, z, w_out)
        return (shardops.psum("B/batch M", y, axes="tensor") + bias) * gain, None

    w_in = shardops.all_gather("layers/stage M/fsdp F/tensor -> layers/stage M F/tensor", s.w_in)
    w_out = shardops.all_gather("layers/stage F/tensor M/fsdp -> layers/stage F/tensor M", s.w_out)
    h, _ = lax.scan(layer, h, (w_in, w_out, s.bias, s.gain))
    return h


@typed_shard_map
def role_gpipe(s: RoleStack3, x: f32[Array, b"m B/batch M"]) -> f32[Array, b"m B/batch M"]:
    return pipeline.gpipe(role_stage3, s, x, spec="B/batch M", axis="stage")


@typed_shard_map
def mesh_gpipe(s: pm.Stack3, x: f32[Array, b"m B/d M"]) -> f32[Array, b"m B/d M"]:
    return pipeline.gpipe(pm.stage3, s, x, spec="B/d M", axis="p")


def role_head(scale: jax.Array, y: jax.Array, coef: jax.Array) -> jax.Array:
    """`t1f1b._head3` in roles: one microbatch's loss, its rows' sum completed over batch."""
    return scale * shardops.psum("", jnp.sum(jnp.tanh(y) * coef), axes="batch")


def role_pipeline_loss(schedule: str) -> Callable[..., jax.Array]:
    @typed_shard_map
    def loss(
        s: RoleStack3,
        scale: f32[Array, b""],
        x: f32[Array, b"m B/batch M"],
        c: f32[Array, b"m B/batch M"],
    ) -> f32[Array, b""]:
        return pipeline.pipeline_loss(
            role_stage3, s, x, spec="B/batch M", loss_fn=role_head, loss_params=scale,
            targets=c, axis="stage", schedule=schedule,
        )  # fmt: skip

    return loss


def _pipeline_inputs(m: int, seed: int = 3) -> tuple[dict, Any, Any]:
    return pm.weights(seed, L), *pm.microbatches(seed + 100, m)


def _close(got: Any, want: Any, name: str) -> None:
    want = np.asarray(want)
    scale = float(np.max(np.abs(want))) or 1.0
    np.testing.assert_allclose(np.asarray(got), want, rtol=RTOL, atol=ATOL * scale, err_msg=name)


def _same(got: Any, want: Any, name: str) -> None:
    """Role program vs mesh-axis program: the same program, so the same numbers."""
    for (path, g), w in zip(
        jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=f"{name}{path}")


def _gpipe_value_and_grad(
    forward: Callable, cls: type, w: dict, x: Any, coef: Any, rules: dict | None
) -> tuple[Any, Any, Any]:
    """Outputs, loss and gradients (weights, microbatches) of ``forward`` under jit, traced
    under ``rules``."""
    mesh = make_mesh(*PDT)

    def loss(s: Any, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        y = forward(s, x)
        return pm.loss(y, coef), y

    with jax.set_mesh(mesh), axis_rules(rules) if rules else contextlib.nullcontext():
        params = jax.device_put(cls(**w), make_shardings(cls))
        (value, y), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(
            params, x
        )
    return y, value, grads


@jax.jit
def _pipeline_reference(w: dict, x: Any, coef: Any, scale: Any = 1.0) -> Any:
    """Plain jax.numpy over all layers on the global arrays (jitted: one compile, not an
    op-by-op dispatch): outputs, ``scale * loss`` and its gradients (weights, microbatches)."""

    def ref(w: dict, x: jax.Array) -> jax.Array:
        return scale * pm.loss(pm.reference(w, x), coef)

    return pm.reference(w, x), *jax.value_and_grad(ref, argnums=(0, 1))(w, x)


def _check_grads(grads: Any, ref_grads: Any) -> None:
    g_w, g_x = grads
    _close(g_x, ref_grads[1], "microbatches")
    for name, ref in ref_grads[0].items():
        _close(np.asarray(getattr(g_w, name)).reshape(ref.shape), ref, name)


@pytest.mark.slow
def test_gpipe_in_roles_equals_the_mesh_axis_pipeline_and_the_reference():
    """gpipe with ``layers/stage``, ``m B/batch M``, spec ``B/batch M``, axis ``stage`` under
    stage=p, batch=fsdp=d, tensor=t: values and gradients equal the mesh-axis gpipe's, and
    plain jax.numpy over all layers."""
    w, x, coef = _pipeline_inputs(4)
    role = _gpipe_value_and_grad(role_gpipe, RoleStack3, w, x, coef, PIPE_RULES)
    phys = _gpipe_value_and_grad(mesh_gpipe, pm.Stack3, w, x, coef, None)
    _same(role, phys, "role vs mesh axes")
    ref_y, ref_value, ref_grads = _pipeline_reference(w, x, coef)
    _close(role[0], ref_y, "outputs")
    _close(role[1], ref_value, "loss")
    _check_grads(role[2], ref_grads)


@pytest.mark.slow
def test_gpipe_in_roles_with_tensor_none_equals_the_reference():
    """The same role program on other rules: batch over (d, t), weights unsplit over tensor
    (tensor=None: the psum over tensor is no collective), stage still p."""
    w, x, coef = _pipeline_inputs(4, seed=5)
    rules = dict(stage="p", batch=("d", "t"), fsdp="d", tensor=None)
    y, value, grads = _gpipe_value_and_grad(role_gpipe, RoleStack3, w, x, coef, rules)
    assert y.sharding.spec[1] == ("d", "t")  # 'm B/batch M': B over d then t
    ref_y, ref_value, ref_grads = _pipeline_reference(w, x, coef)
    _close(y, ref_y, "outputs")
    _close(value, ref_value, "loss")
    _check_grads(grads, ref_grads)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_pipeline_loss_in_roles_equals_the_mesh_axis_schedule(schedule: str):
    """pipeline_loss(schedule=) in roles (the loss head's psum over batch too) equals
    tests/test_pipeline_1f1b.py's mesh-axis program and plain autodiff of all layers."""
    m = 4
    w, x, coef = _pipeline_inputs(m, seed=7)
    scale = np.float32(0.7)
    mesh = make_mesh(*PDT)
    grad = jax.value_and_grad
    cls, mesh_loss = t1f1b._loss_fn(schedule, True, pm.stage3)
    with jax.set_mesh(mesh):
        params = jax.device_put(cls(**w), make_shardings(cls))
        phys = jax.jit(grad(mesh_loss, argnums=(0, 1, 2)))(params, scale, x, coef)
    with jax.set_mesh(mesh), axis_rules(PIPE_RULES):
        params = jax.device_put(RoleStack3(**w), make_shardings(RoleStack3))
        loss = role_pipeline_loss(schedule)
        role = jax.jit(grad(loss, argnums=(0, 1, 2)))(params, scale, x, coef)
    _same(role, phys, "role vs mesh axes")
    _, ref_value, (ref_w, ref_x) = _pipeline_reference(w, x, coef, scale)
    _close(role[0], ref_value, "loss")
    _check_grads((role[1][0], role[1][2]), (ref_w, ref_x))
    _close(role[1][1], ref_value / scale, "loss_params")


def test_the_schedule_scope_and_explain_name_the_resolved_stage_axis():
    """The named scope the schedule runs under, and explain's schedule table, read ``p``."""
    w, x, _ = _pipeline_inputs(4)
    with jax.set_mesh(make_mesh(*PDT)), axis_rules(PIPE_RULES):
        params = jax.device_put(RoleStack3(**w), make_shardings(RoleStack3))
        jaxpr = jax.make_jaxpr(role_gpipe)(params, x).jaxpr
        report = shardlib.explain(role_gpipe, params, x)
    scopes = " ".join(jaxpr_scopes(jaxpr))
    assert "shardlib.pipeline.gpipe[axis=p p=2 m=4 v=1]" in scopes, scopes[:2000]  # no estimate
    assert "axis=stage" not in scopes
    (s,) = report.schedules
    assert (s.schedule, s.axis, s.stages, s.microbatches) == ("gpipe", "p", 2, 4)
    row = next(ln for ln in str(report).splitlines() if ln.lstrip().startswith("gpipe"))
    assert row.split()[:3] == ["gpipe", "p", "2"], row


REFUSED = [
    # stage over two mesh axes: the annotations are fine (M, F unsplit; batch on t)
    (dict(stage=("p", "d"), batch="t", fsdp=None, tensor=None), "2 mesh axes ('p', 'd')"),
    # stage replicated: 'layers/stage' is plain 'layers', the stage axis names no mesh axis
    (dict(stage=None, batch="d", fsdp=None, tensor="t"), "no mesh axis (None: replicated)"),
]


@pytest.mark.parametrize(("rules", "said"), REFUSED, ids=["two-axes", "none"])
@pytest.mark.parametrize(("schedule", "fn"), [("gpipe", "gpipe"), ("1f1b", "one_f_one_b")])
def test_a_stage_role_that_is_not_one_mesh_axis_is_refused(
    rules: dict, said: str, schedule: str, fn: str
):
    w, x, coef = _pipeline_inputs(4)
    with jax.set_mesh(make_mesh(*PDT)), axis_rules(rules):
        params = jax.device_put(RoleStack3(**w), make_shardings(RoleStack3))
        with pytest.raises(SpecError) as err:
            if schedule == "gpipe":
                jax.make_jaxpr(role_gpipe)(params, x)
            else:
                jax.make_jaxpr(role_pipeline_loss(schedule))(params, np.float32(1), x, coef)
    msg = str(err.value)
    assert f"{fn}: argument `axis` is 'stage'" in msg, msg
    assert f"resolve to {said}" in msg and f"{fn} needs exactly one mesh axis" in msg, msg


def test_a_spec_role_split_over_the_stage_axis_is_refused_as_resolved():
    """``spec='B/batch M'`` with batch=p splits each microbatch over the stage axis: refused,
    the message showing the resolved spec (so the schedule resolved ``spec``, not only the
    shardops inside it). The same function traced first under the good rules, with the same
    argument types: jax.jit's cache must not hand back that trace."""
    w, x, _ = _pipeline_inputs(4)
    mesh = make_mesh(*PDT)
    with jax.set_mesh(mesh), axis_rules(PIPE_RULES):
        params = jax.device_put(RoleStack3(**w), make_shardings(RoleStack3))
        jax.make_jaxpr(role_gpipe)(params, x)
    rules = dict(stage="p", batch="p", fsdp="d", tensor="t")
    with jax.set_mesh(mesh), axis_rules(rules):
        params = jax.device_put(RoleStack3(**w), make_shardings(RoleStack3))
        with pytest.raises(ValueError, match=r"gpipe: .*argument `spec` 'B/p M' splits dim 'B/p'"):
            jax.make_jaxpr(role_gpipe)(params, x)


# ---------------------------------------------------------------------------------------------
# attention.ring / gathered
# ---------------------------------------------------------------------------------------------


def _attention_run(fn: str, qs: str, kvs: str, axis: str) -> Callable:
    """A new ``(q, k, v, ids, ct) -> (out, (dq, dk, dv))`` (balanced layout, causal, segment
    ids) calling ``attention.<fn>`` with ``spec=qs, kvs`` along ``axis``."""
    ids_spec = " ".join(qs.split()[:2])

    @typed_shard_map
    def f(
        q: f32[Array, qs.encode()],
        k: f32[Array, kvs.encode()],
        v: f32[Array, kvs.encode()],
        ids: i32[Array, ids_spec.encode()],
    ) -> f32[Array, qs.encode()]:
        op = getattr(attention, fn)
        return op(f"{qs}, {kvs}", q, k, v, axis, layout="balanced", segment_ids=ids)

    def run(q: Any, k: Any, v: Any, ids: Any, ct: Any) -> Any:
        out, pull = jax.vjp(lambda q, k, v: f(q, k, v, ids), q, k, v)
        return out, pull(ct)

    return run


@jax.jit
def _attention_reference(q: Any, k: Any, v: Any, seg: Any, ct: Any) -> Any:
    """test_attention's causal softmax oracle with segments: output and dq, dk, dv."""
    out, pull = jax.vjp(lambda q, k, v: ta.reference(q, k, v, True, seg), q, k, v)
    return out, *pull(ct)


def _attention_case(
    fn: str, mesh_shape: tuple, mesh_specs: tuple[str, str], role_specs: tuple[str, str], rules
) -> None:
    """The role call equals the mesh-axis call exactly and the reference to rtol 1e-5."""
    shape, names = mesh_shape
    mesh = make_mesh(shape, names)
    c = shape[names.index("c")]
    q, k, v, ct, seg = ta._inputs(4, 2, seed=1)
    order = attention.positions(ta.L_, c, "balanced")
    qs, kvs = mesh_specs
    ids_spec = " ".join(qs.split()[:2])
    with jax.set_mesh(mesh):
        args = (
            place(q[:, order], mesh, qs),
            place(k[:, order], mesh, kvs),
            place(v[:, order], mesh, kvs),
            place(seg[:, order], mesh, ids_spec),
            place(ct[:, order], mesh, qs),
        )
        phys = jax.jit(_attention_run(fn, qs, kvs, "c"))(*args)
        with axis_rules(rules):
            role = jax.jit(_attention_run(fn, *role_specs, "seq"))(*args)
    _same(role, phys, "role vs mesh axes")
    back = np.argsort(order)
    got = [np.asarray(a)[:, back] for a in (role[0], *role[1])]
    ta._assert_close(got, [np.asarray(a) for a in _attention_reference(q, k, v, seg, ct)])


ROLE_QKV = ("B/batch L/seq H/tensor D", "B/batch L/seq K/tensor D")


@pytest.mark.slow
def test_ring_in_roles_equals_the_mesh_axis_ring_and_the_reference():
    """ring with ``L/seq`` specs and axis='seq' under seq=c (batch=d, tensor=t on heads)."""
    rules = dict(batch="d", seq="c", tensor="t")
    _attention_case("ring", ta.DCT[:2], ta.DCT[2:], ROLE_QKV, rules)


@pytest.mark.slow
def test_gathered_in_roles_with_tensor_none_leaves_the_heads_unsplit():
    """gathered with ``H/tensor`` heads under tensor=None on a (d, c) mesh: the mesh-axis
    call's specs have plain ``H`` and ``K``."""
    rules = dict(batch="d", seq="c", tensor=None)
    _attention_case("gathered", ta.DC[:2], ta.DC[2:], ROLE_QKV, rules)


def test_ring_refuses_a_seq_role_over_two_mesh_axes():
    mesh = make_mesh(*ta.DCT[:2])
    q, k, v, _, seg = ta._inputs(4, 2)
    run = _attention_run("ring", *ROLE_QKV, "seq")
    said = r"ring: argument `axis` is 'seq'.* 2 mesh axes \('c', 'd'\)"
    rules = axis_rules(batch=None, seq=("c", "d"), tensor="t")
    with jax.set_mesh(mesh), rules, pytest.raises(SpecError, match=said):
        jax.make_jaxpr(run)(q, k, v, seg, q)


# ---------------------------------------------------------------------------------------------
# moe.layer
# ---------------------------------------------------------------------------------------------


def _role_moe(hidden_axis: str | None, hid: str) -> Callable:
    """A new jitted ``(x, wr, wi, wo, ct) -> value_and_grad`` of the MoE loss as
    `tmoe._layer` computes it, in roles (k=2, dropless), ``hid`` the hidden dim's spec."""
    wi_spec, wo_spec = f"E/expert M {hid}".encode(), f"E/expert {hid} M".encode()

    @typed_shard_map
    def f(
        x: f32[Array, b"B/batch L M"],
        wr: f32[Array, b"M E"],
        wi: f32[Array, wi_spec],
        wo: f32[Array, wo_spec],
    ) -> tuple[f32[Array, b"B/batch L M"], f32[Array, b""], f32[Array, b""], i32[Array, b""]]:
        y, s = moe.layer(
            x, wr, wi, wo, k=2, axis="expert", hidden_axis=hidden_axis, dropless=True,
            stats_axes="batch",
        )  # fmt: skip
        return y, s.aux_loss, s.z_loss, shardops.psum("", s.dropped, "batch")

    def run(x: Any, wr: Any, wi: Any, wo: Any, ct: Any) -> Any:
        def loss(*args: Any) -> Any:
            y, aux, z, dropped = f(*args)
            return jnp.sum(y * ct) + 0.3 * aux + 0.1 * z, (y, aux, z, dropped)

        return jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(x, wr, wi, wo)

    return jax.jit(run)


def _moe_args(case: tuple, specs: tuple[str, ...]) -> list[jax.Array]:
    mesh = make_mesh(*case)
    return [place(a, mesh, s) for a, s in zip(tmoe._inputs(0), specs, strict=True)]


@jax.jit
def _moe_reference(x: Any, wr: Any, wi: Any, wo: Any, ct: Any) -> Any:
    """test_moe's dense oracle (k=2, nothing dropped): (output, aux, z) and the gradients
    of the loss `tmoe._layer` differentiates (jitted: one compile)."""

    def loss(x: Any, wr: Any, wi: Any, wo: Any) -> Any:
        out, aux, z, _ = tmoe.reference(x, wr, wi, wo, 2, 1)
        return jnp.sum(out * ct) + 0.3 * aux + 0.1 * z, (out, aux, z)

    (_, values), grads = jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(x, wr, wi, wo)
    return values, grads


def _check_moe_reference(out: Any) -> None:
    """Output, aux and z losses and every gradient against the dense oracle of test_moe
    (global statistics: the stats axes cover every token)."""
    (_, (y, aux, z, dropped)), grads = out
    want, want_grads = _moe_reference(*tmoe._inputs(0))
    for name, g, w in zip(("y", "aux", "z"), (y, aux, z), want, strict=True):
        _close(g, w, name)
    for name, g, w in zip(("dx", "dwr", "dwi", "dwo"), grads, want_grads, strict=True):
        _close(g, w, name)
    assert int(dropped) == 0


@pytest.mark.slow
def test_moe_layer_in_roles_equals_the_mesh_axis_layer_and_the_reference():
    """``E/expert`` weights, axis='expert', hidden_axis='tensor', stats_axes='batch' under
    batch=(d, e), expert=e, tensor=t equal test_moe's mesh-axis layer on (d, e, t)."""
    case = tmoe.DET
    specs = ("B/d/e L M", "M E", "E/e M F/t", "E/e F/t M", "B/d/e L M")
    with jax.set_mesh(make_mesh(*case)):
        args = _moe_args(case, specs)
        phys = tmoe._layer(case, 2, None, True)(*args)
        with axis_rules(batch=("d", "e"), expert="e", tensor="t"):
            role = _role_moe("tensor", "F/tensor")(*args)
    _same(role, phys, "role vs mesh axes")
    _check_moe_reference(role)


@pytest.mark.slow
def test_moe_hidden_axis_role_resolving_to_none_is_hidden_axis_none():
    """tensor=None on a (d, e) mesh: hidden_axis='tensor' is hidden_axis=None (the hidden dim
    unsplit), equal to it and to the reference."""
    case = tmoe.DE
    specs = ("B/d/e L M", "M E", "E/e M F", "E/e F M", "B/d/e L M")
    with jax.set_mesh(make_mesh(*case)):
        args = _moe_args(case, specs)
        with axis_rules(batch=("d", "e"), expert="e", tensor=None):
            by_role = _role_moe("tensor", "F/tensor")(*args)
            unsplit = _role_moe(None, "F")(*args)
    _same(by_role, unsplit, "hidden_axis='tensor' vs None")
    _check_moe_reference(by_role)


MOE_REFUSED = [
    (dict(batch=("d", "e"), expert=("d", "e"), tensor="t"), "axis", "expert", "('d', 'e')"),
    (dict(batch=("d", "e"), expert="e", tensor=("t", "d")), "hidden_axis", "tensor", "('t', 'd')"),
]


@pytest.mark.parametrize(("rules", "arg", "role", "axes"), MOE_REFUSED, ids=["axis", "hidden"])
def test_moe_refuses_an_axis_role_over_two_mesh_axes(rules: dict, arg: str, role: str, axes: str):
    x, wr, wi, wo, _ = tmoe._inputs(0)
    with jax.set_mesh(make_mesh(*tmoe.DET)), axis_rules(rules), pytest.raises(SpecError) as err:
        jax.make_jaxpr(_role_moe("tensor", "F/tensor"))(x, wr, wi, wo, x)
    msg = str(err.value)
    assert f"moe.layer: argument `{arg}` is {role!r}" in msg, msg
    assert f"resolve to 2 mesh axes {axes}" in msg, msg


# ---------------------------------------------------------------------------------------------
# explain under rules
# ---------------------------------------------------------------------------------------------


def _no_roles(text: str | None) -> bool:
    return text is None or not any(f"/{r}" in text for r in ROLES)


def test_explain_names_the_rules_and_shows_mesh_axes():
    """The pipeline's gradient explained under rules: a note names the rules; every
    collective's spec names mesh axes (the fsdp gather: 'M/d'); the schedule's axis is p."""
    w, x, coef = _pipeline_inputs(4)

    def loss(s: Any, x: jax.Array) -> jax.Array:
        return pm.loss(role_gpipe(s, x), coef)

    with jax.set_mesh(make_mesh(*PDT)), axis_rules(PIPE_RULES):
        params = jax.device_put(RoleStack3(**w), make_shardings(RoleStack3))
        report = shardlib.explain(jax.grad(loss), params, x)
    (note,) = [n for n in report.notes if "axis rules" in n]
    for shown in ("stage -> 'p'", "batch -> 'd'", "fsdp -> 'd'", "tensor -> 't'"):
        assert shown in note, note
    specs = [c.spec for c in report.collectives]
    assert all(_no_roles(s) for s in specs), specs
    assert any(c.op == "all_gather" and "M/d" in (c.spec or "") for c in report.collectives)
    assert {a for c in report.collectives for a in c.axes} <= {"p", "d", "t"}
    assert [s.axis for s in report.schedules] == ["p"]
    assert all(f"/{r}" not in str(report) for r in ROLES), str(report)


def test_explain_rings_and_moe_rows_show_the_mesh_axes():
    """Under rules, the context-parallel row's axis is c and the MoE row's expert axis e."""
    mesh = make_mesh(*ta.DCT[:2])
    q, k, v, ct, seg = ta._inputs(4, 2)
    with jax.set_mesh(mesh), axis_rules(batch="d", seq="c", tensor="t"):
        rings = shardlib.explain(_attention_run("ring", *ROLE_QKV, "seq"), q, k, v, seg, ct)
    assert [(r.fn, r.axis, r.c) for r in rings.rings] == [("ring", "c", 2)]
    assert any("seq -> 'c'" in n for n in rings.notes), rings.notes

    x, wr, wi, wo, _ = tmoe._inputs(0)
    role = _role_moe("tensor", "F/tensor")
    with jax.set_mesh(make_mesh(*tmoe.DET)), axis_rules(batch=("d", "e"), expert="e", tensor="t"):
        moes = shardlib.explain(role, x, wr, wi, wo, x)
    assert [(c.scope.axis, c.scope.e) for c in moes.moes] == [("e", 2)]
    assert all(_no_roles(c.spec) for c in moes.collectives)
    assert any("expert -> 'e'" in n for n in moes.notes), moes.notes


def test_explain_under_empty_rules_has_no_blank_rules_note():
    w, x, _ = _pipeline_inputs(4)
    with jax.set_mesh(make_mesh(*PDT)), axis_rules():
        params = jax.device_put(pm.Stack3(**w), make_shardings(pm.Stack3))
        report = shardlib.explain(mesh_gpipe, params, x)
    assert not any("axis rules :" in n for n in report.notes), report.notes
