"""Edges of `shardlib.explain` a reviewer found (issue 38, items 13 to 15).

- The memory rows `arguments` and `results` equal XLA's ``compiled.memory_analysis()`` (less
  the 8-byte pointer per result of the tuple holding several) for what the trace shows in other
  forms than an array argument: a constant result, a Python scalar argument, an array f closes
  over (a constant of XLA's program, in none of its counts), a value returned twice or an
  argument returned. The peak holds at least the arguments and the results.
- `compare_hlo` takes a row flagged ``duplicate`` that XLA ran together with another (``q``,
  ``k`` and ``v`` of ``attention.ring`` the same array) as merged, not missing, whichever of
  the two rows the pairing meets first; a ring of one step (a ``scan`` of one iteration, which
  XLA unrolls) flags the K and V shifts of the same array as duplicates; a row that runs 0
  times (a loop of zero iterations, which XLA drops) is ``never_run``, not missing.
- A report's pipeline schedule is named as `shardlib.pipeline` spells it (``zb-h1``), so it
  can be passed back to ``pipeline.timeline``, ``pipeline.bubble_fraction`` and
  ``pipeline.critical_path``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import shardlib
from shardlib import attention, pipeline
from shardlib._explain.explain import HloComparison
from shardlib._pipeline.tables import schedule_table
from shardlib.shardtypes import Array, f32, make_shardings, typed_shard_map
from tests import _pipeline_model as pm
from tests._mesh_util import make_mesh
from tests._pipeline_model import B, M, Stack

_CONST = jnp.arange(64.0)  # closed over by one of the programs below


def _y(x: jax.Array) -> jax.Array:
    return x * 2


# name -> (f, extra arguments after x)
_PROGRAMS: dict[str, tuple[Callable[..., Any], tuple[Any, ...]]] = {
    "constant result": (lambda x: (_y(x), jnp.float32(1.0)), ()),
    "constant only": (lambda x: jnp.float32(3.0), ()),
    "int8 and Python constants": (lambda x: (_y(x), jnp.int8(1), 2.0), ()),
    "Python float argument": (lambda x, s: x * s, (2.0,)),
    "Python int argument": (lambda x, s: x * s, (2,)),
    "Python bool argument": (lambda x, s: x * s, (True,)),
    "Python float returned": (lambda x, s: (x * s, s), (2.0,)),
    "NumPy scalar argument": (lambda x, s: x * s, (np.float16(2),)),
    "closed-over array": (lambda x: x + _CONST, ()),
    "value returned twice": (lambda x: (lambda y: (y, y))(_y(x)), ()),
    "argument returned": (lambda x: (x, _y(x)), ()),
}


@pytest.mark.parametrize("name", list(_PROGRAMS))
def test_memory_rows_equal_xla(name: str) -> None:
    f, extra = _PROGRAMS[name]
    mesh = jax.make_mesh((8,), ("d",))
    with jax.set_mesh(mesh):
        x = jax.device_put(jnp.ones((64,)), NamedSharding(mesh, P("d")))  # 8 floats a device
        compiled = jax.jit(f).lower(x, *extra).compile()
        report = shardlib.explain(f, x, *extra, compiled=compiled)
    mem, xla = report.memory, compiled.memory_analysis()
    assert xla is not None
    n_results = len(jax.tree.leaves(jax.eval_shape(f, x, *extra)))
    tuple_table = 8 * n_results if n_results > 1 else 0  # one pointer per result
    assert mem.arguments == xla.argument_size_in_bytes, (name, mem)
    assert mem.outputs == xla.output_size_in_bytes - tuple_table, (name, mem)
    assert mem.peak is not None and mem.outputs is not None
    assert mem.peak >= mem.arguments + mem.outputs, (name, mem)
    closes = any("closes over arrays" in c for c in mem.caveats)
    assert closes == (name == "closed-over array"), mem.caveats


def test_python_float_argument_is_four_bytes() -> None:
    """The reviewer's case: 32 floats and a Python float, 132 B as XLA counts them."""
    x = jnp.ones((32,))
    f = lambda x, s: x * s  # noqa: E731
    compiled = jax.jit(f).lower(x, 2.0).compile()
    mem, xla = shardlib.explain(f, x, 2.0, compiled=compiled).memory, compiled.memory_analysis()
    assert xla is not None
    assert mem.arguments == 32 * 4 + 4 == xla.argument_size_in_bytes


# -- compare_hlo and rows XLA merged -------------------------------------------------------------

_SPEC = b"B L/c H D"


def _ring_report(c: int, grad: bool) -> tuple[shardlib.ExplainReport, HloComparison]:
    """``attention.ring`` with ``q``, ``k`` and ``v`` the same array, against the compiled HLO."""

    @typed_shard_map
    def attend(
        q: f32[Array, _SPEC], k: f32[Array, _SPEC], v: f32[Array, _SPEC]
    ) -> f32[Array, _SPEC]:
        return attention.ring("B L/c H D, B L/c H D", q, k, v, "c")

    def fwd(q: jax.Array) -> jax.Array:
        return attend(q, q, q)

    f = jax.grad(lambda q: fwd(q).sum()) if grad else fwd
    with jax.set_mesh(jax.make_mesh((c,), ("c",))):
        q = jax.device_put(jnp.ones((2, 64, 2, 8)), make_shardings(f32[Array, _SPEC]))
        report = shardlib.explain(f, q)
        return report, report.compare_hlo(jax.jit(f).lower(q).compile().as_text())


@pytest.mark.slow
@pytest.mark.parametrize("c", [4, 8])
def test_duplicate_row_xla_merged_is_merged(c: int) -> None:
    report, cmp = _ring_report(c, grad=True)
    flagged = [r for r in report.collectives if r.xla_may and r.xla_may.startswith("duplicate")]
    assert flagged, report.render(max_rows=None)
    assert cmp.n_hlo == len(report.collectives) - len(flagged)  # XLA ran each with its twin
    assert cmp.merged == flagged and not cmp.only_in_report, str(cmp)
    assert cmp.identical, str(cmp)
    assert "merged by XLA (duplicate)" in str(cmp)


def test_one_step_ring_flags_the_shifts_of_the_same_array() -> None:
    """c = 2: one ring step, a scan of one iteration that XLA unrolls; K and V are the same
    array, so XLA runs their shifts as one, as the report's flag says it may."""
    report, cmp = _ring_report(2, grad=False)
    first, second = report.collectives
    assert first.xla_may is None
    assert second.xla_may is not None and second.xla_may.startswith("duplicate")
    assert second.min_calls == 0
    assert cmp.identical and cmp.merged == [second], str(cmp)


def test_rows_of_a_loop_of_zero_iterations_never_run() -> None:
    """c = 2 under grad: the backward's inner ring loop runs c - 2 = 0 times, and XLA drops it."""
    report, cmp = _ring_report(2, grad=True)
    zero = [r for r in report.collectives if r.calls == 0]
    assert zero, report.render(max_rows=None)
    assert cmp.never_run == zero, str(cmp)
    assert cmp.identical, str(cmp)
    assert "never runs (a loop of 0 iterations, which XLA drops)" in str(cmp)


# -- pipeline schedule names ---------------------------------------------------------------------


def _head(scale: jax.Array, y: jax.Array, coef: jax.Array) -> jax.Array:
    return scale * jnp.sum(jnp.tanh(y) * coef)


def _schedule_report(schedule: str, p: int, m: int) -> shardlib.ExplainReport:
    @typed_shard_map
    def loss(
        s: Stack, scale: f32[Array, b""], x: f32[Array, b"m B M"], c: f32[Array, b"m B M"]
    ) -> f32[Array, b""]:
        return pipeline.pipeline_loss(
            pm.stage, s, x, spec="B M", loss_fn=_head, loss_params=scale, targets=c,
            schedule=schedule,
        )  # fmt: skip

    mesh = make_mesh((p,), ("p",))
    w: dict[str, Any] = pm.weights(0, 8)
    params = jax.device_put(Stack(**w), make_shardings(Stack, mesh=mesh))
    x = np.zeros((m, B, M), np.float32)
    with jax.set_mesh(mesh):
        return shardlib.explain(jax.grad(loss), params, np.float32(1), x, x)


@pytest.mark.parametrize("schedule", ["zb-h1", "1f1b"])
def test_schedule_name_round_trips(schedule: str) -> None:
    p, m = 4, 8
    report = _schedule_report(schedule, p, m)
    (info,) = report.schedules
    assert info.schedule == schedule
    # The name goes back into shardlib.pipeline, and the report's numbers are the schedule's.
    picture = pipeline.timeline(info.schedule, p, m).splitlines()
    assert info.bubble_fraction == pytest.approx(pipeline.bubble_fraction(info.schedule, p, m))
    path = pipeline.critical_path(info.schedule, p, m)
    assert info.bubble_fraction == pytest.approx(1 - 3 * m / path.lockstep)
    table = schedule_table(schedule, p, m, 1)
    assert info.ticks == len(table.actions[0]) == len(picture[0].split()) - 1
    assert info.peak_in_flight == tuple(table.in_flight(s) for s in range(p))
    rows = report.render().splitlines()
    (row,) = [line for line in rows if line.startswith(f"{schedule} ")]
    cell = f"{path.lockstep:g} / {path.asynchronous:g} / {path.gpipe:g}"
    assert f"{info.bubble_fraction:.1%}  {cell} ({path.against_gpipe:.2f}x GPipe)" in row
    assert f"pipeline: {schedule} over p" in report.short()
