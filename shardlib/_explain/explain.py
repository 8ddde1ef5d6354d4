"""See the cost before you run: communication, memory and a roofline estimate from a trace.

``explain(f, *args)`` traces ``f`` once (``jax.jit(f).trace``; nothing runs or compiles) and
walks the jaxpr: every collective, with the shardops op and spec that emitted it (read from
the ``shardops.OP[SPEC]`` named scope), the mesh axes, the user's source line, per-device
bytes, and how many times it runs (``lax.scan`` bodies count once per iteration); the values
that ``explicit_activation_checkpointing`` saves for the backward pass (its arguments and, under
its default policy, every value named with ``checkpoint_name``, ``save_for_backward`` marks
included); the per-device bytes of the arguments (parameters, optimizer state); and, given a
hardware model, estimated times.

The work is split in three rooms: `shardlib._explain.walk` (the jaxpr walk),
`shardlib._explain.report` (the report and its totals, and the comparison with XLA's HLO,
read by `shardlib._explain.hlo`) and `shardlib._explain.render` (the text).
"""

from __future__ import annotations

from typing import Any

import jax

from . import render as _render  # noqa: F401 - gives reports their text forms
from .report import (
    HARDWARE,
    CollectiveCall,
    ExplainReport,
    Hardware,
    HloComparison,
    SavedValue,
)
from .walk import argument_bytes, walk_program

__all__ = [
    "HARDWARE",
    "CollectiveCall",
    "ExplainReport",
    "Hardware",
    "HloComparison",
    "SavedValue",
    "explain",
]


def explain(
    f: Any,
    *args: Any,
    hardware: str | Hardware | None = None,
    **kwargs: Any,
) -> ExplainReport:
    """Trace ``f(*args, **kwargs)`` once (nothing runs) and report its communication.

    **Arguments:**


    - `f`: a function using shardlib (a ``typed_shard_map``, or a training step calling one,
      eager or ``jax.jit``-ed).
    - `*args`, `**kwargs`: its arguments: arrays or ``jax.ShapeDtypeStruct`` with shardings.
    - `hardware`: a name from ``HARDWARE`` (``'h100'``, ``'a100'``, ``'tpu-v5e'``,
      ``'tpu-v4'``, ``'cpu'``) or a ``Hardware`` for the roofline estimate (optional).

    **Returns:** an ``ExplainReport``; ``print()`` it for the tables, ``.short()`` for a
    summary, ``.compare_hlo(compiled.as_text())`` to check it against XLA.

    Examples:
        ```python
        report = shardlib.explain(train_step, model, tokens, hardware="h100")
        print(report)
        ```
    """
    if isinstance(hardware, str) and hardware not in HARDWARE:
        raise ValueError(
            f"explain: unknown hardware {hardware!r}; known: {', '.join(HARDWARE)}, or pass "
            "shardlib.Hardware(name, link_bytes_per_s, flops_per_s)"
        )
    hw = HARDWARE[hardware] if isinstance(hardware, str) else hardware
    traced = jax.jit(f).trace(*args, **kwargs)
    report = ExplainReport(name=getattr(f, "__qualname__", None) or repr(f), hardware=hw)
    walk_program(traced.jaxpr.jaxpr, report)
    report.argument_bytes = argument_bytes(args, kwargs)
    if report.saved and all(s.what != "argument" for s in report.saved):
        report.notes.append(
            "f is differentiated, so only the named values (save_for_backward marks and "
            "checkpoint_name values) are listed; the arguments of each checkpointed call are "
            "saved too (explain the forward function to list them)"
        )
    return report
