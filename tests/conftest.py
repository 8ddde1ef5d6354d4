"""Test setup: 8 simulated CPU devices, set before JAX is imported anywhere."""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
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
