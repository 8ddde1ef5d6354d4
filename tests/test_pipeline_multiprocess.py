"""GPipe across processes: two local processes (4 CPU devices each, gloo collectives).

The (2, 2, 2) mesh ('p', 'd', 't') puts pipeline stage 0 on process 0's devices and stage 1
on process 1's, so each tick's ``collective-permute`` crosses the processes. A few SGD steps
of a pipelined loss (``jax.checkpoint`` on the stage, under ``jit``) give the same losses,
gradients and weights as the same run on 8 devices in this process, whose first step also
matches a plain jax.numpy loop over all layers.
"""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import pytest

from tests import _pipeline_model as pm
from tests import pipeline_multiprocess_worker as worker
from tests._multiprocess_util import run_workers

pytestmark = pytest.mark.slow  # multi-process: `pytest --runslow`


def _run_workers(tmp_path: Path) -> list[dict]:
    return run_workers("pipeline_multiprocess_worker.py", tmp_path)


def _reference_loss_and_grads() -> tuple[float, dict[str, np.ndarray]]:
    """The first step on the global arrays: all layers in order, no mesh."""
    x, coef = worker.data()
    val, g = jax.value_and_grad(lambda w: pm.loss(pm.reference(w, x), coef))(worker.weights())
    return float(val), {k: np.asarray(v) for k, v in g.items()}


def _assert_close(got, want, what: str) -> None:
    np.testing.assert_allclose(
        np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6, err_msg=what
    )


def test_stages_on_two_processes_match_one_process(tmp_path):
    results = _run_workers(tmp_path)
    expected = worker.train(worker.stage_mesh(jax.devices()))
    ref_loss, ref_grads = _reference_loss_and_grads()
    np.testing.assert_allclose(expected["losses"][0], ref_loss, rtol=1e-5)
    for name, want in ref_grads.items():
        got = np.asarray(expected["grads"][name])
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5, err_msg=name)
    assert expected["losses"][-1] < expected["losses"][0]  # the SGD steps train
    for r in results:
        assert (r["devices"], r["local_devices"]) == (8, 4)
        assert r["stage_processes"] == [[0], [1]]  # stage s lives on process s only
        assert r["fully_addressable"] is False
        _assert_close(r["losses"], expected["losses"], f"losses of process {r['process']}")
        for key in ("grads", "params"):
            for name, want in expected[key].items():
                _assert_close(r[key][name], want, f"{key}.{name} of process {r['process']}")
    assert results[0]["losses"] == results[1]["losses"]
