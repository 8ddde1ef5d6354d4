"""Test setup: 8 simulated CPU devices, set before JAX is imported anywhere.

XLA:CPU runs a collective as a rendezvous of one thread per participating device. A thread
that waits too long is reported ("may be stuck") and, past a termination timeout, XLA ends the
process ("Expected 4 threads to join the rendezvous, but only 3 of them arrived"). On a loaded
machine (``pytest -n auto`` on 2 cores, 8 devices each) a device's thread can simply be late,
so the tests raise those timeouts to `RENDEZVOUS_TIMEOUT_S` (`XLA_TIMEOUT_FLAGS`, in the same
``XLA_FLAGS`` string as the device count, so XLA reads both or neither). Every jaxlib the
project supports (0.9.0 and later) accepts these flags; an unknown flag would make XLA abort,
so `xla_timeout_flags` gives none for an older one.

What makes the suite fast without checking less (docs/contributing.md has the measurements):

- `XLA_COMPILE_FLAGS`: XLA:CPU's LLVM back end at optimization level 0 with its expensive
  passes off. LLVM is most of an 8-device program's compile time; the flags change no HLO
  (what explain and the HLO tests read: the compiled text, `memory_analysis()` and the losses
  are bit-identical with and without them), only how fast the machine code runs.
- `XLA_FUSION_FLAGS`: on jaxlib 0.9 and 0.10, XLA:CPU's older elementwise emitters (about 2.5
  times quicker to compile). They change which elementwise ops are fused (and so the last bit
  of some sums), not the collectives or their bytes; the newest JAX, which has no such flag,
  runs every test as compiled for a user.
- One JAX persistent compilation cache per run, shared by the xdist workers and the
  subprocesses they start (`SHARDLIB_TEST_JAX_CACHE`, made by the first process and removed
  by it at the end): a program two tests (or a test and a docs page) compile alike is compiled
  once. Set the variable to a folder of your own to keep the cache across runs.
- A hang fails fast: pytest-timeout ends a test past `FAST_TEST_TIMEOUT_S` (a slow-tier one
  past `SLOW_TEST_TIMEOUT_S`, a test marked ``timeout(N)`` past N) and names it, long before
  the rendezvous timeouts above would.
"""

import os
import shutil
import tempfile
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
# Every supported jaxlib knows both (checked in tests/test_xla_flags.py).
XLA_COMPILE_FLAGS = (
    "--xla_backend_optimization_level=0",
    "--xla_llvm_disable_expensive_passes=true",
)
# jaxlib 0.9 and 0.10 still have XLA:CPU's older elementwise emitters, which compile an
# 8-device train step about 2.5 times as fast as the fusion emitters they default to. They
# change which elementwise ops XLA:CPU fuses (so the HLO text, a few hundred temp bytes and the
# last bit of some sums), not the collectives or the bytes they move (tests/test_xla_flags.py
# checks them, the loss and the updated parameters on the headline model's step). jaxlib 0.11 dropped the flag (0.12 has no such emitters; an
# unknown flag makes XLA abort), so the newest JAX compiles as a user's does.
_LAST_JAXLIB_WITH_OLD_EMITTERS = (0, 10)


def xla_fusion_flags(jaxlib_version: str | None = None) -> tuple[str, ...]:
    """The old-emitter flag for ``jaxlib_version`` (default: the installed one), if it has it."""
    version = jaxlib_version or metadata.version("jaxlib")
    parts = tuple(int(p) for p in version.split(".")[:2] if p.isdigit())
    if parts > _LAST_JAXLIB_WITH_OLD_EMITTERS:
        return ()
    return ("--xla_cpu_use_fusion_emitters=false",)


XLA_FUSION_FLAGS = xla_fusion_flags()
# The flags the test process and every JAX subprocess it starts (docs pages, multi-process
# workers) run with, besides their device count.
XLA_TEST_FLAGS = (*XLA_TIMEOUT_FLAGS, *XLA_COMPILE_FLAGS, *XLA_FUSION_FLAGS)

os.environ["XLA_FLAGS"] = " ".join(
    [
        os.environ.get("XLA_FLAGS", ""),
        "--xla_force_host_platform_device_count=8",
        *XLA_TEST_FLAGS,
    ]
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# The run's compilation cache: made by the first process that imports this file (pytest's
# controller), inherited through the environment by the xdist workers and subprocesses.
CACHE_ENV = "SHARDLIB_TEST_JAX_CACHE"
_OWN_CACHE = CACHE_ENV not in os.environ
if _OWN_CACHE:
    os.environ[CACHE_ENV] = tempfile.mkdtemp(prefix="shardlib-jax-cache-")
os.environ["JAX_COMPILATION_CACHE_DIR"] = os.environ[CACHE_ENV]
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"

FAST_TEST_TIMEOUT_S = 60
SLOW_TEST_TIMEOUT_S = 900

import jax  # noqa: E402
import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

from tests import _tiers  # noqa: E402

pytest_plugins = ["tests._cost_plugin", "tests._budget_plugin"]

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


def pytest_configure(config: pytest.Config) -> None:
    """The tier, for the property tests' example counts (tests/_tiers.py)."""
    _tiers.RUNSLOW = bool(config.getoption("--runslow"))


@pytest.hookimpl(tryfirst=True)  # before pytest's own -m selection reads the marks
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Without --runslow, tests marked slow are skipped (and listed by -ra), not deselected:
    running a slow file alone says why nothing ran. Each test gets its hang limit, and the
    tests of `_tiers.JAX_VERSION_FILES` the ``jax_version`` mark."""
    runslow = config.getoption("--runslow")
    skip = pytest.mark.skip(reason="marked slow: `pytest --runslow` runs it")
    version_files = {str(config.rootpath / f) for f in _tiers.JAX_VERSION_FILES}
    for item in items:
        if str(item.path) in version_files:
            item.add_marker(pytest.mark.jax_version)
        slow = item.get_closest_marker("slow") is not None
        if slow and not runslow:
            item.add_marker(skip)
        if item.get_closest_marker("timeout") is None:
            item.add_marker(
                pytest.mark.timeout(SLOW_TEST_TIMEOUT_S if slow else FAST_TEST_TIMEOUT_S)
            )


def pytest_unconfigure(config: pytest.Config) -> None:
    """The process that made the run's compilation cache removes it."""
    if _OWN_CACHE and "PYTEST_XDIST_WORKER" not in os.environ:
        shutil.rmtree(os.environ[CACHE_ENV], ignore_errors=True)
