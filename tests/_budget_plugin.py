"""The fast tier's budget: the next feature cannot quietly double the README's test run.

Time on a shared two-core machine is too noisy to assert, so the budget counts what time is
made of. A run of the whole fast tier (``pytest -n auto`` with no paths, ``-k`` or ``-m``)
fails at its end, with a message that says what to do, when it

- collects more than `FAST_TESTS` tests that run (not skipped), or
- asks XLA for more than `FAST_COMPILES` compilations (programs compiled or loaded from the
  run's compilation cache: XLA compilation is most of the suite's time; docs/contributing.md).

Both limits stand about 10% over what the suite measured when they were last set, so a few
tests fit; a new grid does not. Raising a limit is a decision: say in the commit why the new
tests cannot trace instead of compile, share a compiled program, or go to the slow tier.
"""

from __future__ import annotations

import pytest

from tests import _jax_events as events

# Last set 2026-12-02 from the fast tier's measured ~2,880 tests and 6,200 (JAX 0.12) to 6,700
# (JAX 0.10) compilations (docs/contributing.md, "The budget").
FAST_TESTS = 3150
FAST_COMPILES = 7400

_PROPERTY = "xla_compilations"


class CompileCounter:
    """Counts the programs a test has XLA compile or load from the run's compilation cache
    (`tests/_jax_events.py`) into its user_properties."""

    def __init__(self) -> None:
        self.tally = events.Tally()

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: pytest.Item | None):
        self.tally.reset()
        yield

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_teardown(self, item: pytest.Item, nextitem: pytest.Item | None):
        yield
        # Before the teardown report is made, which carries it to the xdist controller.
        item.user_properties.append((_PROPERTY, self.tally.programs()))


class Budget:
    """In the process that reports (the xdist controller, or the only process)."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.ran = 0
        self.compiles = 0

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.when == "call" or (report.when == "setup" and report.failed):
            self.ran += 1
        if report.when == "teardown":
            self.compiles += sum(v for k, v in report.user_properties if k == _PROPERTY)

    def _whole_fast_tier(self) -> bool:
        opt = self.config.option
        testpaths = self.config.getini("testpaths")
        args = [a.rstrip("/") for a in self.config.args]
        whole = not args or args == [str(self.config.rootpath / p) for p in testpaths]
        whole = whole or args == list(testpaths)
        return whole and not opt.keyword and not opt.markexpr and not opt.runslow

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        if not self._whole_fast_tier() or exitstatus not in (0, 1):
            return
        over = []
        if self.ran > FAST_TESTS:
            over.append(f"it ran {self.ran} tests, over its budget of {FAST_TESTS}")
        if self.compiles > FAST_COMPILES:
            over.append(
                f"it asked XLA for {self.compiles} compilations, over its budget of {FAST_COMPILES}"
            )
        reporter = self.config.pluginmanager.get_plugin("terminalreporter")
        line = (
            f"fast-tier budget (tests/_budget_plugin.py): {self.ran} tests run "
            f"(limit {FAST_TESTS}), {self.compiles} XLA compilations (limit {FAST_COMPILES})"
        )
        if reporter is not None:
            reporter.write_line(line)
        if over:
            message = (
                "The fast tier is over its budget: "
                + "; ".join(over)
                + ". Trace instead of compiling where compiling checks nothing more, share one "
                "compiled program between tests, or mark grids @pytest.mark.slow (the slow tier "
                "runs in .ci/run); raise the limit in tests/_budget_plugin.py only with a reason."
            )
            if reporter is not None:
                reporter.write_line(message, red=True, bold=True)
            session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(CompileCounter(), "shardlib-compile-counter")
    if not hasattr(config, "workerinput"):  # not an xdist worker
        config.pluginmanager.register(Budget(config), "shardlib-budget")
