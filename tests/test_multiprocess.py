"""Two local processes (4 CPU devices each, gloo collectives) run one (4, 2) mesh."""

from pathlib import Path

import jax
import pytest

from examples import transformer_model as tm
from tests import multiprocess_worker as worker
from tests._multiprocess_util import run_workers

pytestmark = pytest.mark.slow  # multi-process: `pytest --runslow`
ROOT = Path(__file__).resolve().parent.parent
TIMEOUT_S = 300


def _single_process_losses() -> list[float]:
    mesh = jax.make_mesh((4, 2), ("d", "t"))
    with jax.set_mesh(mesh):
        model = tm.place_model(tm.init_model(worker.CONFIG, jax.random.key(0)))
        tokens = jax.device_put(
            worker.global_tokens(), jax.sharding.NamedSharding(mesh, jax.P("d", None))
        )
        losses = []
        for _ in range(worker.STEPS):
            model, loss = tm.train_step(worker.CONFIG, model, tokens, worker.LR)
            losses.append(float(loss))
    return losses


def test_two_processes_match_one(tmp_path):
    results = run_workers("multiprocess_worker.py", tmp_path)
    expected = _single_process_losses()
    for r in results:
        assert r["devices"] == 8 and r["local_devices"] == 4
        assert r["fully_addressable"] is False
        assert r["wrong_layout_error"] is not None and "layout" in r["wrong_layout_error"]
        assert len(r["losses"]) == worker.STEPS
        for got, want in zip(r["losses"], expected, strict=True):
            assert abs(got - want) <= 1e-5 * max(1.0, abs(want)), (r["losses"], expected)
    # Both processes see the same (global) loss, and training moved it.
    assert results[0]["losses"] == results[1]["losses"]
    assert expected[1] < expected[0]
