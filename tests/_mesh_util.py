"""Small shared helpers for tests on the 8 simulated CPU devices (not collected by pytest).

Stable API (other test files import it):

- ``MESHES``: the standard ``(shape, names)`` of a 1-D, 2-D and 3-D mesh of 8 devices.
- ``make_mesh(shape, names, auto=False)``: Explicit axes by default, Auto with ``auto=True``.
- ``place(x, mesh, spec)``: put a global array on ``mesh`` in the layout of a shape spec.
- ``blocks(x, mesh, spec)``: ``{mesh coordinates: numpy block}`` the spec gives each device.
- ``count_collectives(text)``: ``{kind: count}`` of the collectives in StableHLO text.
- ``jaxpr_scopes(jaxpr)``: every name stack of a jaxpr's equations, nested jaxprs included.
"""

from __future__ import annotations

import itertools
import math
import re
from collections import Counter
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, NamedSharding

from shardlib._env import programs
from shardlib._lang.parsing import ShapeSpec

__all__ = [
    "COLLECTIVES",
    "MESHES",
    "blocks",
    "count_collectives",
    "jaxpr_scopes",
    "make_mesh",
    "place",
]

MESHES: tuple[tuple[tuple[int, ...], tuple[str, ...]], ...] = (
    ((8,), ("d",)),
    ((4, 2), ("x", "y")),
    ((2, 2, 2), ("x", "y", "z")),
)

COLLECTIVES = (
    "all_gather",
    "all_reduce",
    "reduce_scatter",
    "all_to_all",
    "collective_permute",
    "collective_broadcast",
)

_COLLECTIVE_RE = re.compile(r'"?stablehlo\.(' + "|".join(COLLECTIVES) + r')"?[ (]')


def make_mesh(shape: tuple[int, ...], names: tuple[str, ...], auto: bool = False) -> Any:
    """A mesh over the first ``prod(shape)`` devices; Explicit axes unless ``auto``."""
    kind = AxisType.Auto if auto else AxisType.Explicit
    return jax.make_mesh(shape, names, axis_types=(kind,) * len(shape))


def place(x: Any, mesh: Any, spec: str | bytes) -> jax.Array:
    """``x`` (global) on ``mesh`` in the layout of the shape spec ``spec``."""
    return jax.device_put(x, NamedSharding(mesh, ShapeSpec.parse(spec).partition_spec()))


def blocks(x: Any, mesh: Any, spec: str | bytes) -> dict[tuple[int, ...], np.ndarray]:
    """The block of global ``x`` each device holds under ``spec``, keyed by mesh coordinates.

    Computed in plain numpy from the PartitionSpec rule (axes of one dim are major to minor
    in the order written), independently of JAX's placement.
    """
    x = np.asarray(x)
    dims = ShapeSpec.parse(spec).dims
    assert len(dims) == x.ndim, (spec, x.shape)
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))
    out = {}
    for coords in itertools.product(*(range(n) for n in mesh.axis_sizes)):
        at = dict(zip(mesh.axis_names, coords, strict=True))
        index = []
        for d, n in zip(dims, x.shape, strict=True):
            k = math.prod(sizes[a] for a in d.sharding)
            j = 0
            for a in d.sharding:
                j = j * sizes[a] + at[a]
            index.append(slice(j * (n // k), (j + 1) * (n // k)))
        out[coords] = x[tuple(index)]
    return out


def count_collectives(text: str) -> Counter:
    """``Counter`` of collective ops (``all_gather``, ``all_reduce``, ...) in StableHLO text."""
    return Counter(m.group(1) for m in _COLLECTIVE_RE.finditer(text))


def expect_pending(y: Any, axes: Any) -> Any:
    """``y``, asserting (when the typed_shard_map body is analysed) it owes a sum over ``axes``.

    Use the returned value. A mismatch fails the trace with a SpecError naming both sets.
    """
    from shardlib._analysis.notes import Note, note

    return note(y, Note("expect", tuple(axes), op="expect_pending", role="value"))


def jaxpr_scopes(jaxpr: Any) -> set[str]:
    """Every name stack in ``jaxpr`` and the jaxprs nested in it (a nested one prefixed with
    its equation's)."""
    out = set()
    for eqn in jaxpr.eqns:
        out.add(str(eqn.source_info.name_stack))
        for sub in programs.sub_programs(eqn):
            out |= {f"{eqn.source_info.name_stack}/{s}" for s in jaxpr_scopes(sub)}
    return out
