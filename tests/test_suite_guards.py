"""The suite's own guards: a hung test fails fast by name, and the fast tier keeps its budget.

- A test that hangs inside XLA (a device thread that never reaches its collective) is ended
  by pytest-timeout's thread method, from its limit, with its name in the report: the
  rendezvous timeouts in tests/conftest.py (600 s) never come into it.
- `tests/_budget_plugin.py` fails a whole fast-tier run that runs too many tests or asks XLA
  for too many compilations, and only such a run.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests import _budget_plugin as budget
from tests.conftest import XLA_TEST_FLAGS

ROOT = Path(__file__).resolve().parent.parent

# Device 0 never reaches the psum: its host callback sleeps past any limit.
HUNG_TEST = """
import time

import jax
import jax.numpy as jnp
import pytest
from jax import lax
from jax.experimental import io_callback
from jax.sharding import NamedSharding, PartitionSpec as P


@pytest.mark.timeout(5)
def test_a_collective_that_never_completes():
    mesh = jax.make_mesh((2,), ("x",))
    x = jax.device_put(jnp.ones((2,)), NamedSharding(mesh, P("x")))

    def stuck(x):
        shape = jax.ShapeDtypeStruct(x.shape, x.dtype)
        return io_callback(lambda y: (time.sleep(3600), y)[1], shape, x)

    def body(x):
        return lax.psum(lax.cond(lax.axis_index("x") == 0, stuck, lambda x: x, x), "x")

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False))
    f(x).block_until_ready()
"""


@pytest.mark.slow
def test_a_hung_collective_fails_in_seconds_and_names_the_test(tmp_path):
    (tmp_path / "test_hang.py").write_text(HUNG_TEST)
    env = dict(os.environ)
    env["XLA_FLAGS"] = " ".join(["--xla_force_host_platform_device_count=2", *XLA_TEST_FLAGS])
    env["JAX_PLATFORMS"] = "cpu"
    t0 = time.perf_counter()
    proc = subprocess.run(
        # The project's pytest settings (timeout_method), one xdist worker as `-n auto` has.
        [
            sys.executable,
            "-m",
            "pytest",
            "-c",
            str(ROOT / "pyproject.toml"),
            "-p",
            "no:cacheprovider",
            "-n",
            "1",
            "--rootdir",
            str(tmp_path),
            str(tmp_path / "test_hang.py"),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    took = time.perf_counter() - t0
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    # The worker is ended from its 5 s limit (its stacks go to its own stderr) and the
    # controller names the test it was running.
    assert "crashed while running 'test_hang.py::test_a_collective_that_never_completes'" in out, (
        out[-3000:]
    )
    assert 5 <= took < 60, took


def _budget(*, args=(), keyword="", markexpr="", runslow=False) -> budget.Budget:
    root = Path("/repo")
    config = SimpleNamespace(
        option=SimpleNamespace(keyword=keyword, markexpr=markexpr, runslow=runslow),
        args=list(args),
        rootpath=root,
        getini=lambda name: ["tests"],
        pluginmanager=SimpleNamespace(get_plugin=lambda name: None),
    )
    return budget.Budget(config)  # type: ignore[arg-type]


def _finish(plugin: budget.Budget, tests: int, compiles: int) -> int:
    for _ in range(tests):
        plugin.pytest_runtest_logreport(
            SimpleNamespace(when="call", failed=False, user_properties=[])
        )  # type: ignore[arg-type]
    teardown = SimpleNamespace(
        when="teardown", failed=False, user_properties=[("xla_compilations", compiles)]
    )
    plugin.pytest_runtest_logreport(teardown)  # type: ignore[arg-type]
    session = SimpleNamespace(exitstatus=0)
    plugin.pytest_sessionfinish(session, 0)  # type: ignore[arg-type]
    return session.exitstatus


def test_a_whole_fast_run_over_its_budget_fails():
    assert _finish(_budget(), budget.FAST_TESTS, budget.FAST_COMPILES) == 0
    assert _finish(_budget(), budget.FAST_TESTS + 1, 0) == pytest.ExitCode.TESTS_FAILED
    assert _finish(_budget(), 1, budget.FAST_COMPILES + 1) == pytest.ExitCode.TESTS_FAILED
    # `pytest tests` and `pytest -n auto` are both the whole fast tier.
    over = budget.FAST_COMPILES + 1
    assert _finish(_budget(args=["/repo/tests"]), 1, over) == pytest.ExitCode.TESTS_FAILED


@pytest.mark.parametrize(
    "kwargs",
    [
        {"args": ["/repo/tests/test_shardops.py"]},
        {"keyword": "gather"},
        {"markexpr": "not slow"},
        {"runslow": True},
    ],
    ids=["a-file", "-k", "-m", "--runslow"],
)
def test_a_partial_or_slow_run_is_not_held_to_the_fast_budget(kwargs):
    over = budget.FAST_COMPILES + 1
    assert _finish(_budget(**kwargs), budget.FAST_TESTS + 1, over) == 0


def test_the_budget_counts_this_run():
    """The plugin is loaded in every test process and counts compilations."""
    import jax
    import jax.numpy as jnp

    counter = budget.CompileCounter()
    jax.jit(lambda x: x * 3 + 1)(jnp.arange(5.0)).block_until_ready()
    assert counter.tally.programs() >= 1


def test_property_tests_draw_a_tenth_of_their_examples_in_the_fast_tier(monkeypatch):
    from tests import _tiers

    monkeypatch.setattr(_tiers, "RUNSLOW", False)
    assert [_tiers.examples(n) for n in (60, 25, 20, 8, 3)] == [6, 2, 2, 2, 2]
    monkeypatch.setattr(_tiers, "RUNSLOW", True)
    assert [_tiers.examples(n) for n in (60, 20, 3)] == [60, 20, 3]


def test_every_test_runs_in_ci_and_the_jax_version_files_exist() -> None:
    """CI's two halves of the slow tier: `.ci/run`'s step 2b selects what `nox -s slow` does,
    `nox -s tests-3.12` the complement (fast tier + the JAX-version files' slow tier), and
    every file `tests/_tiers.py` names as JAX-version dependent exists."""
    import ast

    from tests import _tiers

    nox_text = (ROOT / "noxfile.py").read_text()
    values = {}
    assigns = [n for n in ast.parse(nox_text).body if isinstance(n, ast.Assign)]
    for node in assigns:
        target = node.targets[0]
        if isinstance(target, ast.Name) and target.id in ("VERSION_TIERS", "OTHER_SLOW"):
            values[target.id] = ast.literal_eval(node.value)
    assert values["OTHER_SLOW"] == ["--runslow", "-m", "slow and not jax_version"]
    assert values["VERSION_TIERS"] == ["--runslow", "-m", "not slow or jax_version"]
    ci = (ROOT / ".ci" / "run").read_text()
    assert '--runslow -m "slow and not jax_version")' in ci, "step 2b and nox -s slow differ"
    missing = [f for f in _tiers.JAX_VERSION_FILES if not (ROOT / f).is_file()]
    assert not missing, f"tests/_tiers.py names JAX-version files that do not exist: {missing}"
