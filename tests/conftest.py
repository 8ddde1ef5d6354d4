"""Test setup: 8 simulated CPU devices, set before JAX is imported anywhere.

XLA:CPU runs a collective as a rendezvous of one thread per participating device. A thread
that waits too long is reported ("may be stuck") and, past a termination timeout, XLA ends the
process ("Expected 4 threads to join the rendezvous, but only 3 of them arrived"). On a loaded
machine (``pytest -n auto`` on 2 cores, 8 devices each) a device's thread can simply be late,
so the tests raise those timeouts to `RENDEZVOUS_TIMEOUT_S` (`XLA_TIMEOUT_FLAGS`, in the same
``XLA_FLAGS`` string as the device count, so XLA reads both or neither). Every jaxlib the
project supports (0.9.0 and later) accepts these flags; an unknown flag would make XLA abort,
so `xla_timeout_flags` gives none for an older one.
"""

import os
from importlib import metadata

RENDEZVOUS_TIMEOUT_S = 600
# openxla/xla #32115: the stuck warning and the termination of the first call of a collective,
# and the timeout of every rendezvous after it. (`xla_cpu_collective_call_warn_stuck_seconds`,
# also in the binary, is a proto field, not a flag: XLA aborts on it.)
_TIMEOUT_FLAG_NAMES = (
    "xla_cpu_collective_call_warn_stuck_timeout_seconds",
    "xla_cpu_collective_call_terminate_timeout_seconds",
    "xla_cpu_collective_timeout_seconds",
)
_FIRST_JAXLIB_WITH_TIMEOUT_FLAGS = (0, 9, 0)


def xla_timeout_flags(jaxlib_version: str | None = None) -> tuple[str, ...]:
    """The rendezvous-timeout flags for ``jaxlib_version`` (default: the installed one)."""
    version = jaxlib_version or metadata.version("jaxlib")
    parts = tuple(int(p) for p in version.split(".")[:3] if p.isdigit())
    if parts < _FIRST_JAXLIB_WITH_TIMEOUT_FLAGS:
        return ()
    return tuple(f"--{name}={RENDEZVOUS_TIMEOUT_S}" for name in _TIMEOUT_FLAG_NAMES)


XLA_TIMEOUT_FLAGS = xla_timeout_flags()

os.environ["XLA_FLAGS"] = " ".join(
    [
        os.environ.get("XLA_FLAGS", ""),
        "--xla_force_host_platform_device_count=8",
        *XLA_TIMEOUT_FLAGS,
    ]
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

settings.register_profile("ci", max_examples=60, deadline=None, derandomize=True)
settings.register_profile("dev", max_examples=20, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

assert jax.device_count() == 8, "tests need 8 simulated CPU devices"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--runslow",
        action="store_true",
        default=False,
        help="also run the tests marked slow (parity grids, multi-process runs, random rounds, "
        "example and benchmark runs); `pytest --runslow -m slow` runs only those",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Without --runslow, tests marked slow are skipped (and listed by -ra), not deselected:
    running a slow file alone says why nothing ran."""
    if config.getoption("--runslow"):
        return
    skip = pytest.mark.skip(reason="marked slow: `pytest --runslow` runs it")
    for item in items:
        if item.get_closest_marker("slow") is not None:
            item.add_marker(skip)
