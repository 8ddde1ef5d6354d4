"""Per-device memory implied by the types: the `MemoryEstimate` of `shardlib.explain`.

A liveness walk over the traced program (the equations that run: dead code, which JAX drops
when it lowers, holds nothing), in trace order: every value is kept from the
equation that makes it to its last use (the program's results to its end; f's arguments for
the whole call), at the size of its per-device block (inside ``shard_map`` the block itself,
outside it the block its layout gives it). An equation with sub-programs (``jit``,
``shard_map``, a checkpointed call, ``cond``) adds the peak of its biggest one while it runs; a
``scan`` adds its body's peak once, because the body runs one iteration (one layer) at a time,
next to the stacked results it fills. The same walk keeps a second count for ``all_gather``
results only: the gathered weights live at once.

What it is not: XLA's buffer assignment. XLA fuses elementwise chains (their values never
exist), reorders, rematerialises and adds scratch buffers around collectives, so its peak can
be lower or higher; `MemoryEstimate.caveats` says where the types do not say enough for a
number at all (values whose layout XLA's partitioner chooses, on a mesh with Auto axes).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
from jax.extend.core import Literal

from .._check.format import byte_str
from .._env import programs
from . import hlo as _hlo
from .liveness import live_equations
from .moves import layout_of
from .report import MemoryEstimate, XlaMemory
from .walk import source_of

__all__ = ["estimate_memory", "local_bytes", "xla_memory"]

_GATHERS = ("all_gather", "all_gather_invariant")
_CALLS = ("pjit", "jit", "closed_call", "shard_map")


def local_bytes(aval: Any) -> int:
    """Bytes of one device's block of a traced value (0 for non-arrays and extended dtypes)."""
    try:
        return _cached_local_bytes(aval)
    except TypeError:  # an abstract value JAX does not hash
        return _local_bytes(aval)


@functools.lru_cache(maxsize=1 << 16)
def _cached_local_bytes(aval: Any) -> int:
    # A pure function of the abstract value (its shape, dtype and sharding): a step's trace
    # asks for the same few hundred types tens of thousands of times (a plan, per mesh).
    return _local_bytes(aval)


def _local_bytes(aval: Any) -> int:
    shape = getattr(aval, "shape", None)
    if shape is None:
        return 0
    try:
        dtype = np.dtype(aval.dtype).name
        per = _hlo.element_bytes(dtype)
    except (TypeError, ValueError):  # PRNG keys and other extended dtypes
        return 0
    layout = layout_of(aval)
    if layout is not None:
        shape = tuple(e - s for s, e in layout.block(tuple(shape), {}))
    return _hlo.array_bytes(dtype, tuple(shape)) if per else 0


@dataclasses.dataclass
class _Peak:
    """Peaks reached in one jaxpr, above what was live when it started."""

    total: int = 0
    end: int = 0  # live when the jaxpr ends (its results), above what was live at its start
    gathered: int = 0
    gathered_at: str | None = None
    gathered_in_scan: bool = False  # that most includes one iteration of a scan's body


class _Walk:
    def __init__(self, live: frozenset[int]) -> None:
        self.auto: list[str] = []  # where a value's layout is XLA's choice (Auto mesh axes)
        # Values laid out on Explicit axes were seen: the Auto ones are local (a gather that
        # JAX runs on Auto axes inside an Explicit program), counted whole.
        self.explicit = False
        self.live = live  # ids of the equations that run (dead code is dropped by JAX)

    def peak(self, jaxpr: Any, in_shard_map: bool, freeable: Iterable[Any] = ()) -> _Peak:
        """The peak of the values ``jaxpr`` makes (its inputs belong to the caller, except
        ``freeable`` ones: the donated arguments of a ``jit``)."""
        eqns = [e for e in jaxpr.eqns if id(e) in self.live]
        last = _last_uses(jaxpr, eqns)
        own = {id(v): v for v in freeable}
        gathered_vars: set[int] = set()
        live = gathered = 0
        out = _Peak()
        for i, eqn in enumerate(eqns):
            gather = eqn.primitive.name in _GATHERS
            inner = self._inner(eqn, in_shard_map)
            made = sum(local_bytes(v.aval) for v in eqn.outvars)
            if eqn.primitive.name == "scan":  # the stacked results, and one iteration
                extra = made + inner.total
            elif any(
                programs.optional_param(eqn, "donated_invars") or ()
            ):  # results may reuse donated buffers
                extra = inner.total
            else:
                extra = max(made, inner.total)
            out.total = max(out.total, live + extra)
            now = gathered + (made if gather else inner.gathered)
            if now > out.gathered:
                out.gathered = now
                out.gathered_at = source_of(eqn) if gather else inner.gathered_at
                out.gathered_in_scan = not gather and (
                    eqn.primitive.name == "scan" or inner.gathered_in_scan
                )
            if not in_shard_map:
                self._check_layouts(eqn)
            for v in eqn.outvars:
                if id(v) in last:
                    own[id(v)] = v
                    live += local_bytes(v.aval)
                    if gather:
                        gathered_vars.add(id(v))
                        gathered += local_bytes(v.aval)
            for v in {id(v): v for v in eqn.invars if not isinstance(v, Literal)}.values():
                if id(v) in own and last.get(id(v)) == i:
                    del own[id(v)]
                    live -= local_bytes(v.aval)
                    if id(v) in gathered_vars:
                        gathered_vars.discard(id(v))
                        gathered -= local_bytes(v.aval)
        out.end = live
        return out

    def _inner(self, eqn: Any, in_shard_map: bool) -> _Peak:
        """The biggest peak of ``eqn``'s sub-programs."""
        inside = in_shard_map or eqn.primitive.name == "shard_map"
        donated = programs.optional_param(eqn, "donated_invars") or ()
        best = _Peak()
        for sub in programs.sub_programs(eqn):
            freeable = [w for w, d in zip(sub.invars, donated, strict=False) if d]
            p = self.peak(sub, inside, freeable)
            if p.total > best.total:
                best.total = p.total
            if p.gathered > best.gathered:
                best.gathered, best.gathered_at = p.gathered, p.gathered_at
                best.gathered_in_scan = p.gathered_in_scan
        return best

    def _check_layouts(self, eqn: Any) -> None:
        for v in eqn.outvars:
            mesh = getattr(getattr(v.aval, "sharding", None), "mesh", None)
            types = getattr(mesh, "axis_types", ()) or ()
            if not getattr(v.aval, "ndim", 0):
                continue
            if any(str(t).endswith("Auto") for t in types):
                self.auto.append(source_of(eqn) or "?")
            elif any(str(t).endswith("Explicit") for t in types):
                self.explicit = True


def _last_uses(jaxpr: Any, eqns: list[Any]) -> dict[int, int]:
    """``{id(var): index in eqns of the last equation reading it}``; the results: past the
    end."""
    last: dict[int, int] = {}
    for i, eqn in enumerate(eqns):
        for v in eqn.invars:
            if not isinstance(v, Literal):
                last[id(v)] = i
    for v in jaxpr.outvars:
        if not isinstance(v, Literal):
            last[id(v)] = len(eqns)
    return last


def _copied_results(jaxpr: Any) -> int:
    """Bytes of the results of ``jaxpr`` that no equation of it makes: literals, its inputs
    and consts, and a value returned a second time (XLA writes each result to a buffer of its
    own)."""
    made = {id(v) for e in jaxpr.eqns for v in e.outvars}
    seen: set[int] = set()
    out = 0
    for v in jaxpr.outvars:
        if isinstance(v, Literal) or id(v) not in made or id(v) in seen:
            out += local_bytes(v.aval)
        else:
            seen.add(id(v))
    return out


def _used(jaxpr: Any, live: frozenset[int]) -> set[int]:
    """Ids of the variables of ``jaxpr`` that its result depends on in some way: read by a
    live equation (into a ``jit``: only if its body reads them) or returned."""
    used = {id(v) for v in jaxpr.outvars if not isinstance(v, Literal)}
    for eqn in jaxpr.eqns:
        if id(eqn) not in live:
            continue
        subs = programs.sub_programs(eqn)
        if (
            eqn.primitive.name in _CALLS
            and len(subs) == 1
            and len(subs[0].invars) == len(eqn.invars)
        ):
            inner = _used(subs[0], live)
            used |= {
                id(v) for v, w in zip(eqn.invars, subs[0].invars, strict=True) if id(w) in inner
            }
        else:
            used |= {id(v) for v in eqn.invars if not isinstance(v, Literal)}
    return used


def estimate_memory(
    jaxpr: Any,
    blocks: Sequence[int | None],
    host_arguments: list[str],
    compiled: Any = None,
    shape_arguments: Sequence[str] = (),
) -> MemoryEstimate:
    """The `MemoryEstimate` of a traced program (``jaxpr``: ``jax.jit(f).trace(...).jaxpr.jaxpr``).

    ``blocks``: per-device bytes of f's arguments (flattened; by their own shardings, which
    on a mesh with Auto axes the trace does not show; None for a Python scalar: the bytes of
    the dtype the trace gives it, as XLA counts it); ``host_arguments`` and
    ``shape_arguments``: the names of those that have no layout (NumPy arrays, and
    ``jax.ShapeDtypeStruct`` given no ``sharding=``): counted whole on every device, where XLA
    may split them, and a caveat says so. ``compiled``: XLA's program, for its
    ``memory_analysis()`` beside the estimate.
    """
    jaxpr = programs.open_program(jaxpr)
    live = live_equations(jaxpr)
    walk = _Walk(live)
    used = _used(jaxpr, live)  # jax.jit passes XLA only the arguments f uses
    if len(blocks) != len(jaxpr.invars):  # pragma: no cover - arguments jit flattens otherwise
        blocks = [None] * len(jaxpr.invars)
    # XLA's arguments are the arrays f uses; the arrays f closes over (the trace's consts) are
    # constants of its program, in none of its argument, result or temporary bytes.
    args = sum(
        local_bytes(v.aval) if b is None else b
        for v, b in zip(jaxpr.invars, blocks, strict=True)
        if id(v) in used
    )
    peak = walk.peak(jaxpr, in_shard_map=False)
    # Every result is a buffer of its own, a constant one (`return y, jnp.float32(1)`) too.
    outputs = sum(local_bytes(v.aval) for v in jaxpr.outvars)
    # At the end the results are live, and those f does not make (constants, its arguments, a
    # value returned twice) are copies made then, next to the values it made.
    copies = _copied_results(jaxpr)
    if copies:
        peak.total = max(peak.total, peak.end + copies)
    caveats = _auto_caveats(walk)
    caveats += _unplaced_caveats(host_arguments, shape_arguments)
    consts = sum(local_bytes(v.aval) for v in jaxpr.constvars)
    if consts:
        caveats.append(
            f"f closes over arrays ({byte_str(consts, 1)} per device): XLA makes them constants "
            "of the program, outside its argument, result and temporary bytes, so no row "
            "counts them; pass them as arguments to count them"
        )
    xla, why = xla_memory(compiled)
    if why:
        caveats.append(why)
    known = not walk.auto or walk.explicit
    return MemoryEstimate(
        arguments=args,
        outputs=outputs if known else None,
        peak=args + peak.total if known else None,
        gathered=peak.gathered,
        gathered_location=peak.gathered_at,
        gathered_in_scan=peak.gathered_in_scan,
        caveats=tuple(caveats),
        xla=xla,
    )


def _auto_caveats(walk: _Walk) -> list[str]:
    """Why Auto-typed values make the peak an upper bound, or leave it unestimated."""
    if walk.auto and walk.explicit:
        return [
            "values whose layout XLA's partitioner chooses (JAX runs some ops, e.g. a gather, on "
            f"Auto axes inside this Explicit program; first at {walk.auto[0]}) are counted "
            "whole, unsplit: the peak is an upper bound for them"
        ]
    if walk.auto:
        return [
            "the peak and the results are not estimated: the mesh has Auto axes, so outside "
            "shard_map XLA's partitioner chooses the layouts (first such value at "
            f"{walk.auto[0]}); use a mesh whose axes are Explicit (jax.make_mesh's default)"
        ]
    return []


def _unplaced_caveats(host: Sequence[str], shapes: Sequence[str]) -> list[str]:
    """One caveat per kind of argument without a layout (counted whole on every device)."""

    def names(found: Sequence[str]) -> str:
        return ", ".join(found[:3]) + (" ..." if len(found) > 3 else "")

    out = []
    if host:
        out.append(
            f"{names(host)}: host arrays without a layout, counted whole on every device (XLA "
            "may split them); device_put them with make_shardings for exact argument bytes"
        )
    if shapes:
        out.append(
            f"{names(shapes)}: jax.ShapeDtypeStruct without a sharding, counted whole on every "
            "device (XLA may split them); give them sharding= (make_shardings of their type) "
            "for exact argument bytes"
        )
    return out


def xla_memory(compiled: Any) -> tuple[XlaMemory | None, str | None]:
    """XLA's ``memory_analysis()`` of ``compiled`` (None when not given), or why not."""
    if compiled is None:
        return None, None
    try:
        m = compiled.memory_analysis()
    except Exception as e:  # pragma: no cover - a backend without the analysis
        return None, f"XLA's memory_analysis is not available here ({type(e).__name__}: {e})"
    if m is None:  # pragma: no cover - a backend without the analysis
        return None, "XLA's memory_analysis is not available for this backend"
    return (
        XlaMemory(
            arguments=int(m.argument_size_in_bytes),
            outputs=int(m.output_size_in_bytes),
            aliased=int(m.alias_size_in_bytes),
            temporaries=int(m.temp_size_in_bytes),
        ),
        None,
    )
