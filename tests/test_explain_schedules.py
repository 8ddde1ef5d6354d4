"""`shardlib.explain`'s pipeline and context-parallel sections (`shardlib._explain.sections`).

Pipelines (``pipeline.pipeline_loss`` under each schedule, on ``tests/_pipeline_model.py``'s
stack of MLP layers): the bubble cell is ``pipeline.bubble_fraction``, the critical path
cell ``pipeline.critical_path`` at equal unit times (lockstep / without lockstep / GPipe's,
and lockstep over GPipe's), the in-flight column is ``ScheduleInfo.peak_in_flight`` per stage,
and the stage transfers that carry cotangents upstream are ``shift (cotangent)`` rows, the
others plain ``shift`` rows.
Context parallelism (``attention.ring`` and ``gathered``): one row per call with its steps and
bytes, equal to ``attention.ring_bytes``; layers of a ``scan`` multiply the runs.
"""

from __future__ import annotations

import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import shardlib
from shardlib import attention, pipeline
from shardlib._check.format import byte_str
from shardlib._pipeline.tables import schedule_table
from shardlib.shardtypes import Array, f32, make_shardings, pytree_dataclass, typed_shard_map
from tests import _pipeline_model as pm
from tests._mesh_util import make_mesh, place
from tests._pipeline_model import B, M, Stack

L = 8  # layers


@pytree_dataclass
class Groups:  # 'v layers/p ...': the interleaved schedule's layout
    w_in: f32[Array, b"v layers/p M F"]
    w_out: f32[Array, b"v layers/p F M"]
    bias: f32[Array, b"v layers/p M"]
    gain: f32[Array, b"v layers/p M"]


def _head(scale: jax.Array, y: jax.Array, coef: jax.Array) -> jax.Array:
    return scale * jnp.sum(jnp.tanh(y) * coef)


def _report(schedule: str, p: int, m: int, v: int = 1) -> shardlib.ExplainReport:
    """explain of ``jax.grad`` of the pipelined loss on ``p`` stages, ``m`` microbatches."""
    cls = Groups if v > 1 else Stack

    @typed_shard_map
    def loss(
        s: cls,  # pyright: ignore[reportInvalidTypeForm] - the class of this schedule's weights
        scale: f32[Array, b""],
        x: f32[Array, b"m B M"],
        c: f32[Array, b"m B M"],
    ) -> f32[Array, b""]:
        return pipeline.pipeline_loss(
            pm.stage, s, x, spec="B M", loss_fn=_head, loss_params=scale, targets=c,
            schedule=schedule,
        )  # fmt: skip

    mesh = make_mesh((p,), ("p",))
    w: dict[str, Any] = pm.weights(0, L) if v == 1 else pm.groups(pm.weights(0, L), v)
    params = jax.device_put(cls(**w), make_shardings(cls, mesh=mesh))
    x = np.zeros((m, B, M), np.float32)
    with jax.set_mesh(mesh):
        return shardlib.explain(jax.grad(loss), params, np.float32(1), x, x)


def _section(text: str, title: str) -> list[str]:
    lines = text.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith(title))
    end = next((i for i in range(start, len(lines)) if not lines[i].strip()), len(lines))
    return lines[start:end]


TABLED = [("1f1b", 4, 8, 1), ("zb-h1", 4, 8, 1), ("interleaved", 4, 8, 2)]


# The cells at p = 4, m = 8 (T_F = T_B = T_W = 1 unit): 1F1B at GPipe's 3 (m + p - 1) = 33
# units, 9 of them idle; ZB-H1 at 3m + 2 (p - 1) = 30, 29 without lockstep; interleaved and
# circular (v = 2) at 3 (m + (p - 1) / v) = 28.5.
CELLS = {
    "1f1b": ("27.3%", "33 / 33 / 33 (1.00x GPipe)"),
    "zb-h1": ("20.0%", "30 / 29 / 33 (0.91x GPipe)"),
    "interleaved": ("15.8%", "28.5 / 28.5 / 33 (0.86x GPipe)"),
    "gpipe": ("27.3%", "33 / 33 / 33 (1.00x GPipe)"),
    "circular": ("15.8%", "28.5 / 28.5 / 33 (0.86x GPipe)"),
}


def _path_cell(schedule: str, p: int, m: int, v: int) -> str:
    """The critical path cell, from ``pipeline.critical_path`` at unit times."""
    path = pipeline.critical_path(schedule, p, m, v)
    return (
        f"{path.lockstep:g} / {path.asynchronous:g} / {path.gpipe:g} "
        f"({path.against_gpipe:.2f}x GPipe)"
    )


@pytest.mark.parametrize(("schedule", "p", "m", "v"), TABLED)
def test_bubble_and_critical_path_cells(schedule: str, p: int, m: int, v: int) -> None:
    """ "27.3%" and "33 / 33 / 33 (1.00x GPipe)" for 1F1B at p=4, m=8: the bubble cell is
    `pipeline.bubble_fraction` (no idle-tick count: a tick is no longer one unit of work),
    the critical path cell `pipeline.critical_path`'s, in the table and the short summary."""
    report = _report(schedule, p, m, v)
    (info,) = report.schedules
    assert info.ticks == schedule_table(schedule, p, m, v).ticks
    assert info.bubble_fraction == pytest.approx(pipeline.bubble_fraction(schedule, p, m, v))
    bubble, path = CELLS[schedule]
    assert f"{info.bubble_fraction:.1%}" == bubble and _path_cell(schedule, p, m, v) == path
    table = _section(report.render(), "Pipeline schedules")
    assert "critical path: the step in units of one stage's forward" in table[0]
    head = table[1].split("  ")
    assert [h.strip() for h in head if h.strip()][6:8] == ["bubble", "critical path"]
    (row,) = [ln for ln in table[3:] if ln.startswith(info.schedule + " ")]
    assert f"{bubble}  {path}" in row
    assert re.search(r"\(\d+/\d+\)", row) is None, row  # the old "(6/22)" idle ticks
    assert f"bubble {bubble}, critical path {path}, in flight" in report.short()


@pytest.mark.parametrize("schedule", ["gpipe", "circular", "1f1b", "zb_h1", "interleaved"])
def test_schedule_rows_without_running_a_pipeline(schedule: str) -> None:
    """`schedule_lines` of a `ScheduleInfo` as explain reads it from a scope (the scope's
    name, ``zb_h1``): the bubble and critical path cells, whatever the schedule."""
    from shardlib._explain.render import _table
    from shardlib._explain.sections import path_cell, schedule_lines
    from shardlib._pipeline.scopes import ScheduleInfo

    name = schedule.replace("_", "-")
    v = 2 if name in ("circular", "interleaved") else 1
    info = ScheduleInfo(schedule, "p", 4, 8, v)
    bubble, path = CELLS[name]
    assert path_cell(info) == path == _path_cell(name, 4, 8, v)
    lines = schedule_lines([info], _table)
    (row,) = [ln for ln in lines[3:] if ln.startswith(schedule + " ")]
    assert f"{bubble}  {path}" in row
    assert f" {' '.join(map(str, info.peak_in_flight))} " in row


@pytest.mark.parametrize(
    ("schedule", "p", "m", "v"), [*TABLED, ("gpipe", 4, 8, 1), ("circular", 4, 8, 2)]
)
def test_in_flight_column_is_the_peak_per_stage(schedule: str, p: int, m: int, v: int) -> None:
    report = _report(schedule, p, m, v)
    (info,) = report.schedules
    if schedule == "1f1b":
        assert info.peak_in_flight == (7, 5, 3, 1)  # stage s holds 2 (p - s) - 1 microbatches
    if schedule in ("gpipe", "circular"):  # autodiff of the loop keeps every tick's slot
        assert info.peak_in_flight == (v * m + p - 1,) * p
    table = _section(report.render(), "Pipeline schedules")
    assert "in flight" in table[1]
    (row,) = [ln for ln in table[3:] if ln.startswith(info.schedule + " ")]
    assert " ".join(map(str, info.peak_in_flight)) in row
    slot = info.slot_bytes
    assert slot is not None
    assert info.peak_bytes == tuple(n * slot for n in info.peak_in_flight)
    assert "not estimated" not in "\n".join(table)
    (note,) = [ln for ln in table if ln.startswith("slot: ")]
    looped = schedule in ("gpipe", "circular")
    assert (f"{info.schedule}: one tick's" in note) == looped
    assert (f"{info.schedule}: one microbatch's" in note) == (not looped)
    assert f"in flight {max(info.peak_in_flight)} per stage at most" in report.short()


@pytree_dataclass
class One:  # one 'M M' layer per stage (and group): the slot is countable by hand
    w: f32[Array, b"layers/p M M"]


@pytree_dataclass
class OneGroups:
    w: f32[Array, b"v layers/p M M"]


@pytest.mark.parametrize("policy", ["nothing", "default"])
def test_a_checkpointed_stage_keeps_what_its_policy_says(policy: str) -> None:
    """A stage given as one ``jax.checkpoint`` (JAX names it ``remat2`` in the jaxpr) is
    differentiated as given: under ``nothing_saveable`` a slot holds the stage input only; a
    stage that is not one checkpoint is wrapped in the schedule's own, which keeps every
    non-selection value (here the two ``tanh`` inputs' products too)."""
    p, m = 2, 4

    def layers(s: Any, h: jax.Array) -> jax.Array:
        return jnp.tanh(jnp.tanh(h @ s.w[0]) @ s.w[0])

    stage = (
        jax.checkpoint(layers, policy=jax.checkpoint_policies.nothing_saveable)
        if policy == "nothing"
        else layers
    )

    @typed_shard_map
    def loss(
        s: One, scale: f32[Array, b""], x: f32[Array, b"m B M"], c: f32[Array, b"m B M"]
    ) -> f32[Array, b""]:
        return pipeline.pipeline_loss(
            stage, s, x, spec="B M", loss_fn=_head, loss_params=scale, targets=c,
            schedule="1f1b",
        )  # fmt: skip

    mesh = make_mesh((p,), ("p",))
    w = jnp.asarray(np.eye(M, dtype=np.float32) * np.ones((p, M, M), np.float32))
    params = jax.device_put(One(w=w), make_shardings(One, mesh=mesh))
    x = np.zeros((m, B, M), np.float32)
    with jax.set_mesh(mesh):
        report = shardlib.explain(jax.grad(loss), params, np.float32(1), x, x)
    (info,) = report.schedules
    block = B * M * 4
    if policy == "nothing":
        assert info.slot_bytes == block  # the stage input alone
    else:
        assert info.slot_bytes is not None and info.slot_bytes > block


@pytest.mark.parametrize(
    ("schedule", "v", "matmuls"),
    [("1f1b", 1, 1), ("zb-h1", 1, 2), ("interleaved", 2, 1), ("interleaved", 2, 2)],
)
def test_in_flight_bytes_are_peak_times_one_slot(schedule: str, v: int, matmuls: int) -> None:
    """A slot holds one microbatch's residuals: a linear stage ``h @ w @ w ...`` (``matmuls``
    products by its one 'M M' weight) keeps each product's left operand, a 'B M' f32 block
    (the stage input first); the weight, and its slice ``w[0]``, are kept once, not per
    slot. The in-flight bytes of each stage are its peak in flight times that."""
    p, m = 4, 8
    cls = OneGroups if v > 1 else One

    def stage(s: Any, h: jax.Array) -> jax.Array:
        for _ in range(matmuls):
            h = h @ s.w[0]
        return h

    @typed_shard_map
    def loss(
        s: cls,  # pyright: ignore[reportInvalidTypeForm] - the class of this schedule's weights
        scale: f32[Array, b""],
        x: f32[Array, b"m B M"],
        c: f32[Array, b"m B M"],
    ) -> f32[Array, b""]:
        return pipeline.pipeline_loss(
            stage, s, x, spec="B M", loss_fn=_head, loss_params=scale, targets=c,
            schedule=schedule,
        )  # fmt: skip

    mesh = make_mesh((p,), ("p",))
    shape = (v, p, M, M) if v > 1 else (p, M, M)
    w = jnp.asarray(np.eye(M, dtype=np.float32) * np.ones(shape, np.float32))
    params = jax.device_put(cls(w=w), make_shardings(cls, mesh=mesh))
    x = np.zeros((m, B, M), np.float32)
    with jax.set_mesh(mesh):
        report = shardlib.explain(jax.grad(loss), params, np.float32(1), x, x)
    (info,) = report.schedules
    slot = matmuls * B * M * 4
    assert info.slot_bytes == slot
    assert info.peak_bytes == tuple(n * slot for n in info.peak_in_flight)
    table = schedule_table(schedule, p, m, v)
    assert info.peak_bytes == tuple(table.in_flight(s) * slot for s in range(p))
    (row,) = [
        r
        for r in _section(report.render(), "Pipeline schedules")
        if r.startswith(info.schedule + " ")
    ]
    assert " / ".join(byte_str(b, 1) for b in info.peak_bytes or ()) in row
    assert f" {byte_str(slot, 1)} " in row


@pytest.mark.parametrize(
    ("schedule", "p", "v"),
    [
        ("1f1b", 4, 1),
        ("zb-h1", 4, 1),
        ("interleaved", 4, 2),
        ("interleaved", 2, 2),
        ("gpipe", 4, 1),
    ],
)
def test_cotangent_shifts_are_labelled(schedule: str, p: int, v: int) -> None:
    """Every stage transfer is a shift row with its bytes: the activations sent on are
    ``shift``, the cotangents sent back ``shift (cotangent)``, as many and as large. On 2
    stages with wrap-around (interleaved) the two shifts have the same pairs: the cotangent
    is told by where its operand is computed (a VJP), not by its direction."""
    report = _report(schedule, p, 2 * p, v)
    shifts = [c for c in report.collectives if c.op == "shift"]
    forward = [c for c in shifts if not c.cotangent]
    back = [c for c in shifts if c.cotangent]
    assert len(forward) == len(back) == 1, shifts
    assert (forward[0].calls, forward[0].sent_bytes) == (back[0].calls, back[0].sent_bytes)
    assert forward[0].sent_bytes == B * M * 4
    comm = _section(report.render(max_rows=None), "Communication")
    ops = [" ".join(ln.split()[1:3]) for ln in comm[3:]]
    assert ops.count("shift (cotangent)") == 1
    assert sum(op.split()[0] == "shift" and "(" not in op for op in ops) == 1


def test_shifts_outside_a_pipeline_are_not_cotangents() -> None:
    """A shift outside a schedule, and its transpose, are plain shift rows."""
    mesh = make_mesh((4,), ("p",))

    @typed_shard_map
    def f(x: f32[Array, b"p/p M"]) -> f32[Array, b"p/p M"]:
        return shardlib.shardops.shift("p/p M", x, "p", offset=-1)

    with jax.set_mesh(mesh):
        x = place(np.ones((4, M), np.float32), mesh, "p/p M")
        report = shardlib.explain(jax.grad(lambda x: f(x).sum()), x)
    assert [(c.backward, c.cotangent) for c in report.collectives] == [(True, False)]
    assert "shift (grad)" in report.render()


# -- context parallelism --------------------------------------------------------------------------

BATCH, LENGTH, H, KH, D = 2, 64, 4, 2, 8


def _attention_report(fn: str, c: int, layers: int = 0, ids: bool = False) -> Any:
    """explain of the gradient of attention over ``c`` devices (``layers`` > 0: inside a
    ``lax.scan`` over that many layers; ``ids``: with segment ids)."""
    mesh = make_mesh((c,), ("c",))
    op = getattr(attention, fn)

    @typed_shard_map
    def f(
        q: f32[Array, b"B L/c H D"], k: f32[Array, b"B L/c K D"], v: f32[Array, b"B L/c K D"]
    ) -> f32[Array, b"B L/c H D"]:
        if not layers:
            seg = (q[:, :, 0, 0] * 0).astype(jnp.int32) if ids else None  # varies over c
            return op("B L/c H D, B L/c K D", q, k, v, "c", layout="balanced", segment_ids=seg)

        def layer(carry, _):  # K/V change per layer (else JAX hoists their ring out)
            h, k, v = carry
            return (op("B L/c H D, B L/c K D", h, k, v, "c", layout="balanced"), k + 1, v * 2), None

        return lax.scan(layer, (q, k, v), None, length=layers)[0][0]

    with jax.set_mesh(mesh):
        q = place(np.ones((BATCH, LENGTH, H, D), np.float32), mesh, "B L/c H D")
        k = place(np.ones((BATCH, LENGTH, KH, D), np.float32), mesh, "B L/c K D")
        grad = jax.grad(lambda q, k, v: f(q, k, v).sum(), argnums=(0, 1, 2))
        return shardlib.explain(grad, q, k, k)


@pytest.mark.parametrize(("c", "layers"), [(2, 0), (4, 0), (4, 3)])
def test_ring_row_equals_ring_bytes(c: int, layers: int) -> None:
    report = _attention_report("ring", c, layers)
    (ring,) = report.rings
    runs = max(layers, 1)
    block = 2 * BATCH * (LENGTH // c) * KH * D * 4  # one K and one V block, f32
    forward, backward = attention.ring_bytes(block, block, c)
    assert (ring.fn, ring.axis, ring.c, ring.layout, ring.runs) == (
        "ring",
        "c",
        c,
        "balanced",
        runs,
    )
    assert (ring.forward_steps, ring.backward_steps) == (c - 1, c - 1)
    assert (ring.forward_bytes, ring.backward_bytes) == (runs * forward, runs * backward)
    assert ring.step_bytes(False) == block and ring.step_bytes(True) == 2 * block
    assert ring.forward_bytes + ring.backward_bytes == report.bytes_sent  # every row is the ring's
    table = _section(report.render(), "Context parallelism")
    (row,) = table[3:]
    assert row.split()[:4] == ["ring", "c", f"({c})", "balanced"]
    assert f"x{runs}" in row and f"{c - 1} x " in row
    assert "attention.ring over c" in report.short()


def test_gathered_row_gives_the_all_gather_bytes() -> None:
    c = 4
    report = _attention_report("gathered", c)
    (row,) = report.rings
    block = 2 * BATCH * (LENGTH // c) * KH * D * 4
    gathers = [x for x in report.collectives if x.kind == "all-gather"]
    assert len(gathers) == 2 and row.forward_bytes == sum(x.total_sent for x in gathers)
    assert row.forward_bytes == (c - 1) * block  # each device receives the c - 1 other blocks
    assert row.backward_bytes == (c - 1) * block  # the reduce-scatters of dK and dV
    assert (row.forward_steps, row.backward_steps, row.step_bytes(False)) == (0, 0, None)
    assert "all-gather" in _section(report.render(), "Context parallelism")[3]


def test_ring_steps_with_segment_ids() -> None:
    """Segment ids travel with K and V: their bytes are in the totals, the steps stay c - 1."""
    c = 4
    report = _attention_report("ring", c, ids=True)
    (ring,) = report.rings
    block = 2 * BATCH * (LENGTH // c) * KH * D * 4
    ids = BATCH * (LENGTH // c) * 4  # one int32 block of segment ids
    forward, _ = attention.ring_bytes(block, block, c)
    assert (ring.forward_steps, ring.backward_steps) == (c - 1, c - 1)
    assert ring.forward_bytes == forward + (c - 1) * ids
    assert ring.forward_bytes + ring.backward_bytes == report.bytes_sent
