"""`shardlib.explain`'s MoE section (`shardlib._explain.moe_calls`).

Each ``moe.layer`` call is one row of **Mixture of experts**: its expert axis and size, experts,
capacity, ``k``, runs (layers of a ``scan``), and the bytes of its two all-to-alls each way,
which equal ``moe.all_to_all_bytes`` of the capacity arithmetic. ``ExplainReport.expert_load``
draws the histogram of a ``moe.Stats.load`` the user passes.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import shardlib
from shardlib import moe
from shardlib._check.format import byte_str
from shardlib._explain import render as _render
from shardlib._explain.moe_calls import MoeCall, moe_lines
from shardlib._lang.scope_codec import MoeLayerScope
from shardlib.shardtypes import Array, f32, typed_shard_map
from tests._mesh_util import make_mesh

B, L, M, E, F = 16, 4, 8, 8, 16  # global batch, length, width, experts, hidden


def _report(mesh: tuple, cap: int | None, layers: int = 0, grad: bool = True) -> Any:
    """explain of a MoE layer (``layers`` > 0: that many under a ``scan``) on ``mesh``."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((B, L, M)).astype(np.float32)
    wr = rng.standard_normal((M, E)).astype(np.float32)
    wi = rng.standard_normal((E, M, F)).astype(np.float32)
    wo = rng.standard_normal((E, F, M)).astype(np.float32)

    def one(x: jax.Array, wr: jax.Array, wi: jax.Array, wo: jax.Array) -> jax.Array:
        return moe.layer(x, wr, wi, wo, k=2, axis="e", capacity=cap)[0]

    @typed_shard_map
    def f(
        x: f32[Array, b"B/d/e L M"],
        wr: f32[Array, b"M E"],
        wi: f32[Array, b"E/e M F"],
        wo: f32[Array, b"E/e F M"],
    ) -> f32[Array, b"B/d/e L M"]:
        if not layers:
            return one(x, wr, wi, wo)

        def body(h: jax.Array, _: Any) -> tuple[jax.Array, None]:
            return jnp.tanh(one(h, wr, wi, wo)), None

        return jax.lax.scan(body, x, None, length=layers)[0]

    fn = jax.grad(lambda *a: jnp.sum(f(*a) ** 2), argnums=(0, 1, 2, 3)) if grad else f
    with jax.set_mesh(make_mesh(*mesh)):
        return shardlib.explain(fn, x, wr, wi, wo)


def _section(text: str, title: str) -> list[str]:
    lines = text.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith(title))
    end = next((i for i in range(start, len(lines)) if not lines[i].strip()), len(lines))
    return lines[start:end]


def test_scope_round_trips() -> None:
    text = MoeLayerScope("e", 4, 8, 20, 2, 64, 4).text()
    ((found, scope),) = MoeLayerScope.find(f"transpose(jvp({text}))/shardops.all_to_all[x]")
    assert found == text
    assert (scope.axis, scope.e, scope.experts, scope.capacity, scope.k) == ("e", 4, 8, 20, 2)
    call = MoeCall(scope, "here")
    assert call.formula_bytes == moe.all_to_all_bytes(8, 20, 64, 4, 4)


def test_matches_formula_flags_other_bytes_or_counts() -> None:
    """Two all-to-alls per run each way, each the formula's bytes; anything else is ``NO``."""
    scope = MoeLayerScope("e", 4, 8, 20, 2, 64, 4)
    one = MoeCall(scope, "here").formula_bytes
    ok = MoeCall(scope, "here", runs=2, forward_bytes=4 * one, forward_calls=4)
    assert ok.matches_formula
    assert not dataclasses.replace(ok, forward_bytes=4 * one + 4).matches_formula
    assert not dataclasses.replace(ok, forward_calls=3, forward_bytes=3 * one).matches_formula
    assert not dataclasses.replace(ok, backward_calls=4, backward_bytes=4 * one - 4).matches_formula
    bad = dataclasses.replace(ok, backward_calls=4, backward_bytes=8 * one)
    (row,) = moe_lines([bad], _render._table)[3:]  # pyright: ignore[reportPrivateUsage]
    assert row.split()[-2:] == ["NO", "here"]


@pytest.mark.parametrize(("mesh", "cap", "layers"), [(((4, 2), ("d", "e")), 3, 0),
                                                     (((2, 4), ("d", "e")), None, 3)])  # fmt: skip
def test_moe_row_equals_all_to_all_bytes(mesh: tuple, cap: int | None, layers: int) -> None:
    """Per run two all-to-alls each way, each ``moe.all_to_all_bytes(E, C, M, 4, e)`` (the
    capacity from the factor where none is given); a ``scan`` of layers multiplies the runs."""
    report = _report(mesh, cap, layers)
    e = mesh[0][1]
    tokens = B // (mesh[0][0] * e) * L  # one device's tokens
    c = cap if cap is not None else moe.capacity(tokens, 2, E, 1.25)
    one = moe.all_to_all_bytes(E, c, M, 4, e)
    (call,) = report.moes
    runs = max(layers, 1)
    assert (call.scope.axis, call.scope.e, call.scope.experts) == ("e", e, E)
    assert (call.scope.capacity, call.scope.k, call.runs) == (c, 2, runs)
    assert (call.forward_calls, call.backward_calls) == (2 * runs, 2 * runs)
    assert (call.forward_bytes, call.backward_bytes) == (2 * runs * one, 2 * runs * one)
    assert call.formula_bytes == one and call.matches_formula
    table = _section(report.render(), "Mixture of experts")
    (row,) = table[3:]
    cell = f"2 x {byte_str(one, 1)}"
    assert row.split()[:6] == ["e", f"({e})", str(E), str(c), "2", f"x{runs}"]
    assert row.count(cell) == 2 and " yes " in row
    assert f"moe.layer over e (E={E}, C={c}) x{runs}" in report.short()


def test_forward_only_has_no_backward_all_to_alls() -> None:
    report = _report(((4, 2), ("d", "e")), 3, grad=False)
    (call,) = report.moes
    assert (call.forward_calls, call.backward_calls, call.backward_bytes) == (2, 0, 0)
    assert call.matches_formula
    (row,) = _section(report.render(), "Mixture of experts")[3:]
    assert " - " in row  # no backward


def test_no_moe_no_section() -> None:
    @typed_shard_map
    def f(x: f32[Array, b"B/e M"]) -> f32[Array, b"B/e M"]:
        return x * 2

    with jax.set_mesh(make_mesh((8,), ("e",))):
        report = shardlib.explain(f, np.zeros((8, 4), np.float32))
    assert report.moes == [] and "Mixture of experts" not in report.render()


def test_expert_load_histogram() -> None:
    """Counts, shares and bars per expert (leading dims summed), imbalance, per device."""
    report = _report(((4, 2), ("d", "e")), 3, grad=False)
    load = np.array([[5, 0, 2, 2, 1, 1, 3, 2], [5, 0, 2, 2, 1, 1, 3, 2]], np.int32)
    text = report.expert_load(load).splitlines()
    assert text[0].endswith("before drops; 32)")  # the total
    assert text[1].split() == ["expert", "0", "10", "31.2%", "#" * 40]
    assert text[2].split() == ["expert", "1", "0", "0.0%"]
    assert text[3].split() == ["expert", "2", "4", "12.5%", "#" * 16]
    assert text[9] == "  max / mean: 2.50 (1.00: even)"
    assert text[10] == "  per device of e (experts 4 each): 0: 18, 1: 14"


@pytest.mark.parametrize(
    ("load", "msg"),
    [
        (np.ones(6, np.int32), "dim -1 (experts) must be 8 (the experts of the report's MoE"),
        (np.int32(3), "got a scalar"),
        (np.ones(8, np.float32), "must hold counts (integers >= 0"),
        (-np.ones(8, np.int32), "min -1"),
    ],
)
def test_expert_load_bad_input(load: Any, msg: str) -> None:
    report = _report(((4, 2), ("d", "e")), 3, grad=False)
    with pytest.raises(ValueError, match="ExplainReport.expert_load: argument `load`") as e:
        report.expert_load(load)
    assert msg in str(e.value)
