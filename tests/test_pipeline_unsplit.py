"""Whether ZB-H1 and ZB-V split a stage's backward into B and W, made visible.

A stage whose backward the split cannot cut (`shardlib._pipeline.split`: its weight gradient
comes out of equations the input's cotangent needs too, a ``cond`` in a scanned layer here;
or halves JAX's varying-axis types refuse to replay apart, a ``psum`` over 'c' in a scanned
layer) runs whole in B: the values stay right (checked against a dense reference), and the
schedule warns (`pipeline.UnsplitBackwardWarning`: why, and the critical path it then has)
and `explain` says so in its schedules table (the ``backward`` column, the critical path at
``T_B = 2, T_W = 0``) and in its short summary. A stage that splits says so too, without a
warning; a table with no zero-bubble schedule has no such column.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import shardlib
from shardlib import pipeline, shardops
from shardlib._pipeline.scopes import parse_schedule_scopes, schedule_scope
from shardlib.shardtypes import Array, f32, pytree_dataclass, typed_shard_map
from tests._mesh_util import make_mesh

B, M, LAYERS, MICRO = 4, 8, 4, 4


@pytree_dataclass
class Stack:
    w: f32[Array, b"layers/p M M"]


@pytree_dataclass
class Chunks:
    w: f32[Array, b"v layers/p M M"]


def _layer(kind: str):
    def layer(h: jax.Array, w: jax.Array) -> tuple[jax.Array, None]:
        if kind == "cond":  # taken on every device; its backward is one cond, placed whole
            return lax.cond(jnp.sum(h) > -1e30, lambda: jnp.tanh(h @ w), lambda: h), None
        return jnp.tanh(h @ w), None

    return layer


def _loss(kind: str, schedule: str):
    cls = Chunks if schedule == "zb-v" else Stack

    def head(_, y, t):
        return jnp.sum((y - t) ** 2)

    @typed_shard_map
    def loss(s: cls, x: f32[Array, b"m B M"], t: f32[Array, b"m B M"]) -> f32[Array, b""]:
        return pipeline.pipeline_loss(
            lambda s, h: lax.scan(_layer(kind), h, s.w)[0], s, x, spec="B M", loss_fn=head,
            targets=t, schedule=schedule,
        )  # fmt: skip

    return cls, loss


def _reference(w, x, t):
    total = 0.0
    for i in range(x.shape[0]):
        h = x[i]
        for layer in w:
            h = jnp.tanh(h @ layer)
        total = total + jnp.sum((h - t[i]) ** 2)
    return total


def _data(schedule: str, cls):
    rng = np.random.default_rng(len(schedule))
    w = (0.3 * rng.standard_normal((LAYERS, M, M))).astype(np.float32)
    x = rng.standard_normal((MICRO, B, M)).astype(np.float32)
    t = rng.standard_normal((MICRO, B, M)).astype(np.float32)
    params = Stack(w=w)
    if cls is Chunks:
        params = Chunks(**vars(pipeline.to_groups(params, route="v", stages=2)))
    return w, params, x, t


def _schedules_table(report) -> list[str]:
    text = report.render()
    return text[text.index("Pipeline schedules") :].split("\n\n")[0].splitlines()


def _explain(kind: str, schedule: str):
    cls, loss = _loss(kind, schedule)
    _, params, x, t = _data(schedule, cls)
    with jax.set_mesh(make_mesh((2,), ("p",))):
        return shardlib.explain(jax.grad(loss), params, x, t)


@pytest.mark.parametrize("schedule", ["zb-h1", "zb-v"])
def test_a_split_stage_shows_b_and_w(schedule: str) -> None:
    report = _explain("plain", schedule)  # no warning: pytest's filterwarnings is "error"
    (info,) = report.schedules
    assert info.backward == "split"
    table = _schedules_table(report)
    assert "backward" in table[1]
    (row,) = [ln for ln in table[3:] if ln.startswith(schedule + " ")]
    path = pipeline.critical_path(schedule, 2, MICRO)
    assert f"{path.lockstep:g} / {path.asynchronous:g} / {path.gpipe:g}" in row
    assert "split in B + W" in row, row
    assert any(ln.startswith("backward: zb-h1/zb-v split each stage's backward") for ln in table)
    assert "backward split in B + W" in report.short()


@pytest.mark.parametrize("schedule", ["zb-h1", "zb-v"])
def test_a_stage_that_does_not_split_warns_and_shows_whole_in_b(schedule: str) -> None:
    """The cond stage: explain's row and summary say 'whole in B', with the critical path
    it then has (T_B = 2, T_W = 0: 1F1B's), and the schedule warns, saying why and what it
    costs; the values stay right."""
    fn = schedule.replace("-", "_")
    whole = pipeline.critical_path(schedule, 2, MICRO, t_b=2, t_w=0)
    split = pipeline.critical_path(schedule, 2, MICRO)
    assert whole.lockstep == pipeline.critical_path("1f1b", 2, MICRO).lockstep > split.lockstep
    expected = (
        rf"{fn}: the stage's backward could not be split into B .* and W .*, so it runs whole "
        rf"in B: its weight gradient comes out of `scan`, which the input's cotangent needs "
        rf"too .* the lockstep critical path is {whole.lockstep:g} units of a stage's "
        rf"forward, not {split.lockstep:g} .* Use schedule '1f1b'"
    )
    with pytest.warns(pipeline.UnsplitBackwardWarning, match=expected):
        report = _explain("cond", schedule)
    (info,) = report.schedules
    assert info.backward == "whole"
    table = _schedules_table(report)
    (row,) = [ln for ln in table[3:] if ln.startswith(schedule + " ")]
    assert "whole in B" in row, row
    assert f"{whole.lockstep:g} / {whole.asynchronous:g} / {whole.gpipe:g}" in row, row
    assert f"({schedule} at " in table[-2] or f"({schedule} at " in table[-1], table
    assert "backward whole in B" in report.short()

    cls, loss = _loss("cond", schedule)
    w, params, x, t = _data(schedule, cls)
    with jax.set_mesh(make_mesh((2,), ("p",))), pytest.warns(pipeline.UnsplitBackwardWarning):
        value, grads = jax.jit(jax.value_and_grad(loss))(params, x, t)
    ref_value, ref = jax.value_and_grad(_reference)(w, x, t)
    np.testing.assert_allclose(value, ref_value, rtol=2e-5)
    got = pipeline.from_groups(grads, route="v").w if schedule == "zb-v" else grads.w
    np.testing.assert_allclose(got, ref, rtol=2e-5, atol=1e-6)


def test_a_stage_whose_halves_the_types_refuse_warns() -> None:
    """A mean over 'c' in a scanned layer (the guide's example, `test_pipeline_branches`):
    the split's halves do not replay apart under check_vma."""

    @typed_shard_map
    def loss(s: Stack, x: f32[Array, b"m B/c M"], t: f32[Array, b"m B/c M"]) -> f32[Array, b""]:  # fmt: skip
        def layer(h, w):
            return jnp.tanh((h + shardops.psum("M", jnp.sum(h, axis=0), axes="c") / B) @ w), None

        return pipeline.pipeline_loss(
            lambda s, h: lax.scan(layer, h, s.w)[0], s, x, spec="B/c M", targets=t,
            loss_fn=lambda _, y, t: shardops.psum("", jnp.sum(y * t), axes="c"),
            schedule="zb-h1",
        )  # fmt: skip

    _, params, x, t = _data("zb-h1", Stack)
    mesh = make_mesh((2, 2), ("p", "c"))
    with jax.set_mesh(mesh), pytest.warns(pipeline.UnsplitBackwardWarning, match="varying-axis"):
        jax.jit(jax.grad(loss)).trace(params, x, t)


def test_tables_without_a_zero_bubble_schedule_have_no_backward_column() -> None:
    report = _explain("cond", "1f1b")  # 1F1B runs every backward whole: nothing to warn
    (info,) = report.schedules
    assert info.backward is None
    assert "backward" not in _schedules_table(report)[1]
    assert "backward" not in report.short()


def test_the_scope_carries_the_split() -> None:
    for backward in ("split", "whole", None):
        scope = schedule_scope("zb_h1", "p", 2, 4, 1, 640, backward)
        (info,) = parse_schedule_scopes(f"jit(f)/{scope}/while", "x.py:1")
        assert (info.schedule, info.slot_bytes, info.backward) == ("zb_h1", 640, backward)
