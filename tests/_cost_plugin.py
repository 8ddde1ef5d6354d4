"""Where the test suite's time goes: a pytest plugin behind ``--cost-log=DIR``.

For each test it writes one JSON line (to ``DIR/jax<version>-<worker>-<pid>.jsonl``) with the
test's JAX version and wall time
(setup + call + teardown, so a module fixture's cost lands on the first test that uses it) and
how much of that was:

- ``trace``: JAX tracing to a jaxpr (``/jax/core/compile/jaxpr_trace_duration``);
- ``lower``: jaxpr to MLIR (``/jax/core/compile/jaxpr_to_mlir_module_duration``);
- ``compile``: XLA compilation (``/jax/core/compile/backend_compile_duration``);
- ``child``: CPU time of subprocesses that ended during the test (``RUSAGE_CHILDREN``):
  multi-process runs, pyright, example scripts;
- ``cache_hits``: programs loaded from JAX's persistent compilation cache instead of compiled.

The rest of the wall time is execution and Python. ``tests/cost_report.py`` runs the suite with
this plugin and turns the lines into the tables in ``docs/contributing.md``. The JAX events come
from `tests/_jax_events.py`.
"""

from __future__ import annotations

import json
import os
import resource
import time
from pathlib import Path

import pytest

from tests import _jax_events as events

_KINDS = {"trace": events.TRACE, "lower": events.LOWER, "compile": events.COMPILE}


class CostLog:
    """Accumulates JAX's compile-time events per test and writes one line per test."""

    def __init__(self, directory: Path) -> None:
        import jax

        directory.mkdir(parents=True, exist_ok=True)
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        self._jax = jax.__version__
        name = f"jax{self._jax}-{worker}-{os.getpid()}.jsonl"
        self._out = open(directory / name, "a", encoding="utf-8")  # noqa: SIM115
        self._tally = events.Tally()

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: pytest.Item | None):
        self._tally.reset()
        child0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        yield
        wall = time.perf_counter() - t0
        child1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        child = (child1.ru_utime + child1.ru_stime) - (child0.ru_utime + child0.ru_stime)
        slow = item.get_closest_marker("slow") is not None
        row = {
            "end": round(time.time(), 2),
            "jax": self._jax,
            "id": item.nodeid,
            "slow": slow,
            "wall": round(wall, 4),
            "child": round(child, 4),
            "cache_hits": self._tally.counts[events.CACHE_HIT],
        }
        row.update({k: round(self._tally.seconds[e], 4) for k, e in _KINDS.items()})
        self._out.write(json.dumps(row) + "\n")
        self._out.flush()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--cost-log",
        default=os.environ.get("SHARDLIB_COST_LOG"),
        metavar="DIR",
        help="write each test's wall time and its tracing, lowering, XLA compilation and "
        "subprocess CPU time to DIR/jax<version>-<worker>-<pid>.jsonl (default: "
        "$SHARDLIB_COST_LOG; python -m tests.cost_report renders them)",
    )


def pytest_configure(config: pytest.Config) -> None:
    directory = config.getoption("--cost-log")
    if directory:
        config.pluginmanager.register(CostLog(Path(directory)), "shardlib-cost-log")
