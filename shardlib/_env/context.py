"""Where are we? The active mesh and the manual axes of an enclosing ``shard_map``.

The JAX internals this needs (the legacy ``with mesh:`` context, a state in ``jax.jit``'s
cache key, the transformations' tracer classes, shard_map's ``check_vma`` setting) are read
through the adapter `shardlib._env.programs`, the one module that touches ``jax._src``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import jax
from jax import lax
from jax.core import Tracer
from jax.interpreters import ad
from jax.sharding import AxisType

from .programs import jit_key_state, thread_resources, transform_tracer_types, vma_checked

__all__ = [
    "abstract_mesh",
    "EAGER_UNREDUCED",
    "UNCHECKED_UNREDUCED",
    "aval_reduced",
    "aval_unreduced",
    "spec_entries",
    "axis_types",
    "concrete_mesh",
    "estimates_wanted",
    "estimating",
    "in_jit_key",
    "manual_axes",
    "manual_axis_sizes",
    "mesh_axis_sizes",
    "spec_clause",
    "spec_text",
    "type_clause",
    "type_clause_of",
    "unwrap_tracer",
    "vma_checked",
]


_THREAD_RESOURCES = thread_resources()


# ``jax.jit`` caches a trace by its arguments and JAX's own context (mesh, dtypes...), not by
# shardlib's axis rules: a function traced under one set of rules, called under another with
# arguments of the same layout, would run the first program. So the rules in force are a
# state in the key.
_RULES_STATE = jit_key_state(
    "string_or_object_state",
    "shardlib_axis_rules",
    None,
    "The axis rules in force (shardlib.axis_rules); part of jax.jit's cache key.",
)

# Whether `shardlib.explain` is tracing: estimates only the report prints (a pipeline's
# residual bytes per slot) are worked out then, not on every trace. In the key, an explained
# trace is not the cached one of an earlier call, nor it theirs.
_ESTIMATING_STATE = jit_key_state(
    "bool_state",
    "shardlib_estimating",
    False,
    "Whether shardlib.explain is tracing; part of jax.jit's cache key.",
)


def in_jit_key(value: Any) -> contextlib.AbstractContextManager[None]:
    """Put ``value`` (the axis rules in force, as their plain tuple) into ``jax.jit``'s cache
    key while the block runs, so a jitted function called under other rules is traced again.

    JAX hashes its trace context from C++ many times per trace (about 1,100 times for the
    transformer), so ``value`` should be something hashed there, like a tuple of strings: an
    object with a Python ``__hash__`` is called back on each of them."""
    return _holding(_RULES_STATE, value)


def estimating() -> contextlib.AbstractContextManager[None]:
    """Ask for the report's estimates while the block runs (`shardlib.explain`'s trace)."""
    return _holding(_ESTIMATING_STATE, True)


@contextlib.contextmanager
def _holding(state: Any | None, value: Any) -> Iterator[None]:
    """``state`` set to ``value`` while the block runs (nothing where JAX has no state)."""
    if state is None:  # pragma: no cover
        yield
        return
    with state(value):
        yield


def estimates_wanted() -> bool:
    """Whether to work out the report's estimates now (always, where JAX has no state)."""
    return _ESTIMATING_STATE is None or bool(_ESTIMATING_STATE.value)


def _legacy_physical_mesh() -> Any | None:
    """The mesh entered with the deprecated ``with mesh:`` form, or None.

    JAX offers no public accessor for it (``jax.sharding.get_mesh()`` only sees
    ``jax.set_mesh``), so we read the thread-local resource env. Internal API: isolated here.
    """
    if _THREAD_RESOURCES is None:  # pragma: no cover
        return None
    try:
        m = _THREAD_RESOURCES.env.physical_mesh
    except Exception:  # pragma: no cover - layout of internals changed
        return None
    if m is None or getattr(m, "empty", True):
        return None
    return m


def concrete_mesh() -> Any | None:
    """The concrete ``Mesh`` from ``jax.set_mesh`` or the legacy ``with mesh:``, or None."""
    try:
        m = jax.sharding.get_mesh()
    except Exception:  # under jit get_mesh may refuse; fall back to the legacy context
        m = None
    if m is not None and not getattr(m, "empty", True):
        return m
    return _legacy_physical_mesh()


def abstract_mesh() -> Any | None:
    """The abstract mesh in force (works under jit and inside shard_map), or None."""
    am = jax.sharding.get_abstract_mesh()
    if am is not None and not am.empty:
        return am
    m = _legacy_physical_mesh()
    if m is not None:
        return m.abstract_mesh
    return None


def mesh_axis_sizes(mesh: Any | None = None) -> dict[str, int]:
    """``{axis name: size}`` of ``mesh`` (default: the mesh in force), in mesh order."""
    if mesh is None:
        mesh = abstract_mesh()
    if mesh is None:
        return {}
    return dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))


def manual_axis_sizes() -> dict[str, int]:
    """``{axis: size}`` for the Manual axes of the enclosing shard_map body ({} outside).

    Asked by every check and op while a body is traced: cached per abstract mesh object (the
    same object while one body is traced). The dict is shared: read it, do not change it.
    """
    return manual_axes()[0]


def manual_axis_items() -> tuple[tuple[str, int], ...]:
    """``tuple(manual_axis_sizes().items())``, cached the same way (a hashable key)."""
    return manual_axes()[1]


def manual_axes() -> tuple[dict[str, int], tuple[tuple[str, int], ...]]:
    """``(manual_axis_sizes(), manual_axis_items())`` in one call (the op skeleton's)."""
    am = jax.sharding.get_abstract_mesh()
    hit = _MANUAL.get(id(am))
    if hit is not None and hit[0] is am:  # looked up before asking the mesh anything
        return hit[1]
    if am is None or am.empty:
        entry = _NO_MANUAL
    else:
        sizes = {
            name: size
            for name, size, t in zip(am.axis_names, am.axis_sizes, am.axis_types, strict=True)
            if t == AxisType.Manual
        }
        entry = (sizes, tuple(sizes.items()))
    if len(_MANUAL) >= 64:
        _MANUAL.clear()
    _MANUAL[id(am)] = (am, entry)  # the mesh is kept, so its id cannot be reused meanwhile
    return entry


_MANUAL: dict[int, tuple[Any, tuple[dict[str, int], tuple[tuple[str, int], ...]]]] = {}
_NO_MANUAL: tuple[dict[str, int], tuple[tuple[str, int], ...]] = ({}, ())


def axis_types(mesh: Any) -> dict[str, Any]:
    """``{axis: AxisType}`` of a mesh."""
    return dict(zip(mesh.axis_names, mesh.axis_types, strict=True))


_PRIMAL_TRACERS, _BATCH_TRACERS = transform_tracer_types()


def unwrap_tracer(x: Any) -> tuple[Any, tuple[int, ...]] | None:
    """See through ``jvp``/``grad``/``vmap`` tracers to the value they wrap.

    Returns ``(base, batch_dims)``: ``base`` is a concrete array (eager transformations) or
    the tracer of an enclosing ``jit`` (or another trace we cannot see through); ``batch_dims``
    are the dims each enclosing ``vmap`` added, innermost first: remove them from ``base``'s
    dims in reverse order to get ``x``'s dims. None when a vmap batches in a way we cannot
    describe (e.g. ragged).
    """
    bdims: list[int] = []
    while isinstance(x, Tracer):
        if _PRIMAL_TRACERS and isinstance(x, _PRIMAL_TRACERS):
            x = x.primal  # type: ignore[attr-defined]
        elif _BATCH_TRACERS and isinstance(x, _BATCH_TRACERS):
            bd = x.batch_dim  # type: ignore[attr-defined]
            if isinstance(bd, int):
                bdims.append(bd)
            elif bd is not None:
                return None
            x = x.val  # type: ignore[attr-defined]
        else:
            break
    return x, tuple(bdims)


def varying_axes(x: Any) -> frozenset[str] | None:
    """The manual axes ``x`` varies over, when JAX tracks them (``check_vma=True``); else None."""
    if not vma_checked():
        return None
    return aval_varying(jax.typeof(x))


def spec_entries(spec: Any) -> tuple[Any, ...]:
    """A PartitionSpec's dim entries (``spec.partitions`` where JAX has it: JAX refuses
    ``*spec`` on a spec with unreduced or reduced axes)."""
    return tuple(getattr(spec, "partitions", spec))


def aval_varying(aval: Any) -> frozenset[str] | None:
    """The manual axes an abstract value's type says it varies over (None: not typed so)."""
    mat = getattr(aval, "manual_axis_type", None)  # jax >= 0.10
    if mat is not None:
        return frozenset(mat.varying)
    vma = getattr(aval, "vma", None)  # jax 0.9
    return frozenset(vma) if vma is not None else None


def aval_unreduced(aval: Any) -> frozenset[str]:
    """The manual axes an abstract value inside a ``shard_map`` body is typed unreduced over
    (``{U:t}``): JAX 0.10 and later keep them in ``manual_axis_type.unreduced``; before, in its
    type spec's ``unreduced`` field. None of them on a JAX without unreduced types."""
    mat = getattr(aval, "manual_axis_type", None)  # jax >= 0.10
    if mat is not None:
        return frozenset(getattr(mat, "unreduced", None) or ())
    return type_clause_of(aval)[0]


def aval_reduced(aval: Any) -> frozenset[str]:
    """The manual axes an abstract value inside a ``shard_map`` body is typed reduced over
    (``{R:t}``), as `aval_unreduced` reads them."""
    mat = getattr(aval, "manual_axis_type", None)  # jax >= 0.10
    if mat is not None:
        return frozenset(getattr(mat, "reduced", None) or ())
    return type_clause_of(aval)[1]


def type_clause(x: Any) -> tuple[frozenset[str], frozenset[str]]:
    """The mesh axes a global array's JAX type says it is unreduced over (``{U:t}``, a partial
    sum) and reduced over (``{R:t}``): its type spec's ``unreduced`` and ``reduced`` fields
    (``jax.typeof(x).sharding.spec``, a concrete array's sharding's spec where JAX cannot type
    it); none for a host value, or on a JAX without those fields."""
    try:
        return type_clause_of(jax.typeof(x))
    except Exception:  # not a value JAX can type: a concrete array's sharding, if any
        sharding = getattr(x, "sharding", None)
        return spec_clause(getattr(sharding, "spec", None))


def type_clause_of(aval: Any) -> tuple[frozenset[str], frozenset[str]]:
    """`type_clause` of an abstract value (``jax.typeof(x)``)."""
    return spec_clause(getattr(getattr(aval, "sharding", None), "spec", None))


def spec_clause(spec: Any) -> tuple[frozenset[str], frozenset[str]]:
    """A PartitionSpec's ``unreduced`` and ``reduced`` axes (none on a JAX without them)."""
    unreduced = frozenset(getattr(spec, "unreduced", None) or ())
    return unreduced, frozenset(getattr(spec, "reduced", None) or ())


def spec_text(spec: Any) -> str:
    """A PartitionSpec as a user writes it, ``P(None, 't', reduced={'d'})``, the same on
    every JAX (its ``repr`` is ``PartitionSpec(...)`` before JAX 0.10)."""
    unreduced, reduced = spec_clause(spec)
    parts = [repr(e) for e in spec_entries(spec)]
    parts += [
        f"{name}={{{', '.join(map(repr, sorted(axes)))}}}"
        for name, axes in (("unreduced", unreduced), ("reduced", reduced))
        if axes
    ]
    return f"P({', '.join(parts)})"


def _jax_at_least(major: int, minor: int) -> bool:
    return jax.__version_info__[:2] >= (major, minor)


# Whether this JAX runs a ``shard_map`` eagerly (outside ``jax.jit``) on an argument or
# result typed unreduced, and ``jax.device_put``s a concrete array to an unreduced sharding.
# JAX 0.9 does neither: its eager ``shard_map`` (``_shard_map_impl``'s ``_unmatch``) refuses
# the unreduced result ("out_specs passed to shard_map should be equal to the unreduced
# present on the out_aval"), and ``device_put`` raises "device_indices_map doesn't work with
# unreduced"; under ``jax.jit`` (and eager ``jax.reshard``) both work. A version check: a
# trial would run a program on the devices at import.
EAGER_UNREDUCED = _jax_at_least(0, 10)

# Whether this JAX's ``shard_map`` with ``check_vma=False`` returns a result as unreduced
# (``out_specs`` with ``unreduced``) and leaves the body's arguments untyped. JAX 0.9 types
# the arguments unreduced with ``check_vma`` off too (its linear ops without an unreduced
# rule, ``neg``, ``reshape``, ``select_n``, refuse them) and wants an unreduced result typed
# so, which only a ``pcast`` with ``check_vma`` on makes ("Unsupported pcast from=invarying,
# to='unreduced'").
UNCHECKED_UNREDUCED = _jax_at_least(0, 10)


def forward_mode(tree: Any) -> bool:
    """Whether a leaf of ``tree`` is being differentiated in forward mode (``jax.jvp``,
    ``jax.jacfwd``): JAX's forward-mode tracer, public as ``jax.interpreters.ad.JVPTracer``.
    Reverse mode (``jax.grad``, ``vjp``, ``linearize``) traces with another tracer."""
    kind = getattr(ad, "JVPTracer", None)
    return kind is not None and any(isinstance(x, kind) for x in jax.tree.leaves(tree))


def differentiated(x: Any) -> bool:
    """Whether ``x`` is a value JAX is differentiating: a tracer of forward mode
    (``jax.interpreters.ad.JVPTracer``) or of reverse mode (JAX's ``LinearizeTracer``, which
    ``jax.grad``, ``vjp`` and ``linearize`` use from JAX 0.9 to 0.12 and which JAX does not
    export: matched by its class name, here only)."""
    kind = getattr(ad, "JVPTracer", None)
    return isinstance(x, Tracer) and (
        (kind is not None and isinstance(x, kind)) or type(x).__name__ == "LinearizeTracer"
    )


def vary_over(x: Any, axes: frozenset[str]) -> Any:
    """``x`` made to vary over ``axes`` too (``jax.lax.pcast``), when JAX tracks varying axes
    (``check_vma=True``); otherwise ``x``."""
    have = varying_axes(x)
    if have is None:
        return x
    missing = tuple(sorted(axes - have))
    return lax.pcast(x, missing, to="varying") if missing else x
