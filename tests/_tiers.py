"""Which tier this run is (not collected by pytest): property tests size themselves by it.

`tests/conftest.py` sets `RUNSLOW` from ``--runslow`` before any test module is imported.
A property test written ``@settings(max_examples=examples(20))`` draws 20 examples in a run
with the slow tier (`.ci/run` runs it on the newest JAX) and a tenth of them, at least 2, in the
fast tier alone: the same property, its first cases on every change, all of them in CI.
"""

RUNSLOW = False


def examples(n: int) -> int:
    """``n`` with the slow tier, else ``max(2, n // 10)``."""
    return n if RUNSLOW else max(2, n // 10)
