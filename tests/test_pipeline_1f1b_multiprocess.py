"""1F1B across processes: two local processes (4 CPU devices each), stage s on process s.

A few SGD steps of ``pipeline.one_f_one_b`` (FSDP and tensor parallelism inside each stage,
``jax.checkpoint`` on the stage, under ``jit``) give the same losses, gradients and weights
as the same run on 8 devices in this process, whose first step matches plain autodiff of
all layers in order.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from tests import _pipeline_model as pm
from tests import pipeline_1f1b_multiprocess_worker as worker
from tests import pipeline_multiprocess_worker as base
from tests._multiprocess_util import run_workers

pytestmark = pytest.mark.slow  # multi-process: `pytest --runslow`


def test_1f1b_stages_on_two_processes_match_one_process(tmp_path) -> None:
    results = run_workers("pipeline_1f1b_multiprocess_worker.py", tmp_path)
    expected = worker.train(base.stage_mesh(jax.devices()))
    x, coef = base.data()
    ref_loss, ref = jax.value_and_grad(lambda w: pm.loss(pm.reference(w, x), coef))(base.weights())
    np.testing.assert_allclose(expected["losses"][0], ref_loss, rtol=1e-5)
    for name, want in ref.items():
        got = np.asarray(expected["grads"][name])
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=name)
    for r in results:
        np.testing.assert_allclose(r["losses"], expected["losses"], rtol=1e-5, atol=1e-6)
        for key in ("grads", "params"):
            for name, want in expected[key].items():
                np.testing.assert_allclose(
                    np.asarray(r[key][name]), np.asarray(want), rtol=1e-5, atol=1e-6,
                    err_msg=f"{key}.{name} of process {r['process']}",
                )  # fmt: skip
