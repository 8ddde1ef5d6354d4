"""See the cost before you run: communication, memory and a roofline estimate from a trace.

``explain(f, *args)`` traces ``f`` once (``jax.jit(f).trace``; nothing runs or compiles) and
walks the jaxpr: every collective, with the shardops op and spec that emitted it (read from
the ``shardops.OP[SPEC]`` named scope), the mesh axes, the user's source line, per-device
bytes, and how many times it runs (``lax.scan`` bodies count once per iteration); the values
that ``explicit_activation_checkpointing`` saves for the backward pass (its arguments and, under
its default policy, every value named with ``checkpoint_name``, ``save_for_backward`` marks
included); the per-device bytes of the arguments (parameters, optimizer state); every layout
move outside ``shard_map`` (an argument ``typed_shard_map`` moves to its annotated layout, and
its gradient moving back); the per-device memory the types imply, beside XLA's
``memory_analysis`` when a compiled program is given; the pipeline schedules (ticks, bubble,
microbatches in flight) and context-parallel attention calls (ring steps and bytes); and,
given a hardware model, estimated times.

The work is split in rooms: `shardlib._explain.walk` (the jaxpr walk), `shardlib._explain.moves`
(layout moves), `shardlib._explain.memory` (the memory estimate), `shardlib._explain.report`
(the report and its totals, and the comparison with XLA's HLO, read by
`shardlib._explain.hlo`) and `shardlib._explain.render` (the text).
"""

from __future__ import annotations

import inspect
from typing import Any

import jax

from .._check.pytree import keypath_str
from .._env import context as _context
from .._env import rules as _rules
from . import render as _render  # noqa: F401 - gives reports their text forms
from .hardware import hardware_of
from .memory import estimate_memory
from .moves import LayoutMove
from .report import (
    HARDWARE,
    CollectiveCall,
    ExplainReport,
    Hardware,
    HloComparison,
    MemoryEstimate,
    RingCall,
    SavedValue,
    XlaMemory,
)
from .walk import argument_bytes, walk_program

__all__ = [
    "HARDWARE",
    "CollectiveCall",
    "ExplainReport",
    "Hardware",
    "HloComparison",
    "LayoutMove",
    "MemoryEstimate",
    "RingCall",
    "SavedValue",
    "XlaMemory",
    "explain",
]


def explain(
    f: Any,
    *args: Any,
    hardware: str | Hardware | None = None,
    compiled: Any = None,
    **kwargs: Any,
) -> ExplainReport:
    """Trace ``f(*args, **kwargs)`` once (nothing runs) and report its communication.

    **Arguments:**


    - `f`: a function using shardlib (a ``typed_shard_map``, or a training step calling one,
      eager or ``jax.jit``-ed).
    - `*args`, `**kwargs`: its arguments: arrays or ``jax.ShapeDtypeStruct`` with shardings.
    - `hardware`: a name from ``HARDWARE`` (``'h100'``, ``'h200'``, ``'b200'``, ``'a100'``,
      ``'tpu-v5e'``, ``'tpu-v5p'``, ``'tpu-v4'``, ``'cpu'``) or a ``Hardware`` for the
      roofline estimate (optional).
    - `compiled`: ``jax.jit(f).lower(*args).compile()`` (optional): its ``memory_analysis()``
      is shown beside the memory the types imply (``report.memory.xla``). Under an
      ``AbstractMesh`` (``jax.sharding.use_abstract_mesh``: no devices, e.g. planning for
      1024 devices on a laptop) there is none to give: the report says so in its notes.

    **Returns:** an ``ExplainReport``; ``print()`` it for the tables, ``.short()`` for a
    summary, ``.compare_hlo(compiled.as_text())`` to check it against XLA.

    Examples:
        ```python
        report = shardlib.explain(train_step, model, tokens, hardware="h100")
        print(report)
        ```
    """
    hw = None if hardware is None else hardware_of(hardware, "explain")
    if compiled is not None and not hasattr(compiled, "memory_analysis"):
        raise TypeError(
            "explain: compiled= must be a compiled program, jax.jit(f).lower(*args).compile(), "
            f"got {type(compiled).__name__}; leave it out to see the estimate alone"
        )
    with _context.estimating():  # the pipelines' slot bytes (part of jit's cache key)
        traced = jax.jit(f).trace(*args, **kwargs)
    names, blocks, host, shapes = _arguments(f, args, kwargs)
    report = ExplainReport(
        name=getattr(f, "__qualname__", None) or repr(f),
        hardware=hw,
        memory=estimate_memory(traced.jaxpr.jaxpr, blocks, host, compiled, shapes),
    )
    walk_program(traced.jaxpr.jaxpr, report, names)
    report.argument_bytes = argument_bytes(args, kwargs)
    rules = _rules.current()
    if rules is not None and rules.rules:
        report.notes.append(
            f"traced under the axis rules {rules}: the specs shown name the mesh axes the "
            "roles resolved to"
        )
    if compiled is None and _abstract_only(args, kwargs):
        report.notes.append(ABSTRACT_NOTE)
    if report.saved and all(s.what != "argument" for s in report.saved):
        report.notes.append(
            "f is differentiated, so only the named values (save_for_backward marks and "
            "checkpoint_name values) are listed; the arguments of each checkpointed call are "
            "saved too (explain the forward function to list them)"
        )
    return report


ABSTRACT_NOTE = (
    "traced on an abstract mesh (no devices): the numbers are shardlib's, from the trace; "
    "XLA's (memory_analysis, compare_hlo) need compiled=, which needs a real mesh"
)


def _abstract_only(args: tuple, kwargs: dict) -> bool:
    """Whether ``f`` was traced with no devices behind its mesh: no concrete mesh in force,
    and an abstract one in force (``jax.sharding.use_abstract_mesh``) or on an argument's
    ``NamedSharding``."""
    if _context.concrete_mesh() is not None:
        return False
    if _context.abstract_mesh() is not None:
        return True
    leaves = jax.tree_util.tree_leaves((args, kwargs))
    meshes = (getattr(getattr(x, "sharding", None), "mesh", None) for x in leaves)
    return any(isinstance(m, jax.sharding.AbstractMesh) for m in meshes)


def _arguments(
    f: Any, args: tuple, kwargs: dict
) -> tuple[list[str], list[int | None], list[str], list[str]]:
    """The leaves of f's arguments as ``jax.jit`` flattens them: their names (``w.w1``: the
    parameter's name where ``f``'s signature gives it, else ``[1].w1``), their per-device
    bytes (by their shardings; None for a Python scalar, which has no dtype until ``jax.jit``
    gives it one: the trace's), and the names of the leaves without a layout, counted whole:
    host arrays, then ``jax.ShapeDtypeStruct`` given no ``sharding=``."""
    try:
        params = list(inspect.signature(f).parameters.values())
    except (TypeError, ValueError):
        params = []
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    positional = [p.name for p in params if p.kind in kinds]
    names: list[str] = []
    blocks: list[int | None] = []
    host: list[str] = []
    shapes: list[str] = []
    for path, leaf in jax.tree_util.tree_flatten_with_path((args, kwargs))[0]:
        head, rest = path[1], keypath_str(path[2:])
        i = getattr(head, "idx", None)
        if getattr(path[0], "idx", 0) == 1:  # a keyword argument: its name
            top = str(getattr(head, "key", head))
        elif isinstance(i, int) and i < len(positional):
            top = positional[i]
        else:
            top = keypath_str(path[1:2])
        names.append(top + ("" if not rest else rest if rest.startswith("[") else "." + rest))
        scalar = not hasattr(leaf, "shape")  # a Python bool, int, float or complex
        blocks.append(None if scalar else sum(b for _, b in argument_bytes((leaf,), {})))
        if hasattr(leaf, "shape") and getattr(leaf, "sharding", None) is None:
            (shapes if isinstance(leaf, jax.ShapeDtypeStruct) else host).append(names[-1])
    return names, blocks, host, shapes
