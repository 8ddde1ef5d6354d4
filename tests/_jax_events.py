"""JAX's compile-time events, tallied per test (not collected by pytest).

One listener for the two test plugins that read them: `tests/_cost_plugin.py` (seconds spent
tracing, lowering and compiling) and `tests/_budget_plugin.py` (how many programs XLA
compiled or loaded). Public JAX API only (``jax.monitoring``); the event names are JAX's own
and the same in 0.9 to 0.12.
"""

from __future__ import annotations

from collections import Counter

TRACE = "/jax/core/compile/jaxpr_trace_duration"
LOWER = "/jax/core/compile/jaxpr_to_mlir_module_duration"
COMPILE = "/jax/core/compile/backend_compile_duration"
CACHE_HIT = "/jax/compilation_cache/cache_hits"


class Tally:
    """Counts every JAX event and sums every duration event since the last `reset`."""

    def __init__(self) -> None:
        import jax.monitoring

        self.counts: Counter[str] = Counter()
        self.seconds: Counter[str] = Counter()
        jax.monitoring.register_event_listener(self._on_event)
        jax.monitoring.register_event_duration_secs_listener(self._on_duration)

    def _on_event(self, event: str, **_: object) -> None:
        self.counts[event] += 1

    def _on_duration(self, event: str, duration: float, **_: object) -> None:
        self.counts[event] += 1
        self.seconds[event] += duration

    def reset(self) -> None:
        self.counts.clear()
        self.seconds.clear()

    def programs(self) -> int:
        """Programs XLA compiled, or loaded from the persistent compilation cache."""
        return self.counts[COMPILE] + self.counts[CACHE_HIT]
