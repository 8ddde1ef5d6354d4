"""``python -m benchmarks``: shardlib vs hand-written shard_map vs auto-sharding.

Simulates 8 CPU devices (set before JAX is imported) and writes ``results.md`` and
``results.json`` to ``benchmarks/results/`` (or ``--out DIR``). ``--help`` lists the options.
"""

import os
import sys

if "jax" not in sys.modules:  # only effective before JAX is imported
    _flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in _flags:
        os.environ["XLA_FLAGS"] = f"{_flags} --xla_force_host_platform_device_count=8".strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

from benchmarks.suite import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
