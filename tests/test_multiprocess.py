"""Two local processes (4 CPU devices each, gloo collectives) run one (4, 2) mesh."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import jax

from examples import transformer_model as tm
from tests import multiprocess_worker as worker

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT_S = 300


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    port = _free_port()
    env = dict(os.environ)
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    outs = [tmp_path / f"p{i}.json" for i in range(2)]
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(ROOT / "tests" / "multiprocess_worker.py"),
                str(i),
                "2",
                str(port),
                str(outs[i]),
            ],
            env=env,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=TIMEOUT_S)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for i, p in enumerate(procs):
        assert p.returncode == 0, f"process {i} failed:\n{logs[i][-4000:]}"
    results = [json.loads(o.read_text()) for o in outs]
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
