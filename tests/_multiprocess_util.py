"""Launching a test's worker script as several local processes (gloo CPU collectives).

Each process runs ``python SCRIPT PROCESS_ID NUM_PROCESSES PORT OUT_JSON`` with
``devices_per_process`` simulated CPU devices, connects to the others through
``jax.distributed`` on 127.0.0.1 and writes its results to ``OUT_JSON``: `run_workers` is
the test's side, `worker_main` the worker script's.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT_S = 300


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_workers(
    script: str, tmp_path: Path, processes: int = 2, devices_per_process: int = 4
) -> list[dict[str, Any]]:
    """Run ``tests/SCRIPT`` as ``processes`` processes; their JSON results, in process order.

    Fails the test, with the end of the process's output, if a process exits non-zero.
    """
    port = free_port()
    env = dict(os.environ)
    # The workers' device count, and the test process's other flags: the collective timeouts
    # of tests/conftest.py (a worker slowed by a loaded machine is waited for, not aborted).
    count = "--xla_force_host_platform_device_count"
    kept = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith(count)]
    env["XLA_FLAGS"] = " ".join([f"{count}={devices_per_process}", *kept])
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    outs = [tmp_path / f"p{i}.json" for i in range(processes)]
    path = str(ROOT / "tests" / script)
    procs = [
        subprocess.Popen(
            [sys.executable, path, str(i), str(processes), str(port), str(outs[i])],
            env=env,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(processes)
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
    return [json.loads(o.read_text()) for o in outs]


def worker_main(work: Callable[[], dict[str, Any]]) -> None:
    """A worker script's ``main``: join the other processes (the command line of `run_workers`),
    run ``work()`` and write its result, with this process's index and device counts, to
    ``OUT_JSON``; leave the distributed system at the end, also on failure."""
    pid, nproc, port, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=nproc, process_id=pid)
    try:
        where = {"devices": jax.device_count(), "local_devices": jax.local_device_count()}
        result = {"process": pid, **where, **work()}
        Path(out).write_text(json.dumps(result))
    finally:
        jax.distributed.shutdown()
