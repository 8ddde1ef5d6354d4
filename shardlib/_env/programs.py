"""The one adapter for JAX's program representation (jaxprs), across JAX 0.9 to 0.12.

Every module of shardlib that reads a traced program (the partial-sum analysis, explain's
walk and liveness, the pipeline's stage checks, the refusal explainer) reads it through this
module: no other module reads an equation's parameters by name or tells closed from open
jaxprs. What changed in JAX, and is absorbed here:

- JAX 0.11 merged ``ClosedJaxpr`` into ``Jaxpr``: a jaxpr carries the values of its leading
  inputs (its ``constvars``/``consts``), ``.jaxpr`` is a legacy accessor returning itself, and
  ``jax.extend.core.ClosedJaxpr`` is ``Jaxpr``. Before, a ``ClosedJaxpr`` wrapped an open
  ``Jaxpr`` whose ``constvars`` paired with the wrapper's ``consts``. `open_program` gives
  both as one `Program`.
- JAX 0.11 replaced ``scan``'s ``num_consts``/``num_carry`` by ``ft_in``/``ft_out`` (flat
  trees of the consts, the carry and the scanned inputs). `scan_parts` reads either.
- After 0.11 ``closed_call``/``core_call`` equations became ``eval_jaxpr`` equations; the
  custom-derivative calls name their body ``call_jaxpr`` (newer) or ``fun_jaxpr`` (older).
  `call_body` knows every call-like primitive's body.
- JAX 0.10 made ``get_bind_params`` give the parameters alone, not ``(subfuns, params)``,
  and public ``DropVar``; `bind_eqn` and `is_dropped` read either (for shardlib's own
  interpreters of a program: the pipeline's split backward).

A parameter that is missing where shardlib needs it is an error that names the primitive,
the parameter and the JAX version (`param`), never a default that could be silently wrong.
The few parameters that are optional in JAX itself are read with `optional_param`, each
listed in ``_OPTIONAL`` with what its absence means.

The rest of JAX's internals (``jax._src``) shardlib touches are here too, for the same reason
(they change between releases and have no public equivalent), each behind a function that
says so: the thread-local resources of the legacy ``with mesh:`` context
(`thread_resources`), a config state in ``jax.jit``'s cache key (`jit_key_state`), the tracer
classes of ``jvp``/``linearize`` and ``vmap`` (`transform_tracer_types`) and shard_map's
``check_vma`` setting (`vma_checked`). `shardlib._env.context` uses them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import warnings
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import jax

__all__ = [
    "jit_key_state",
    "thread_resources",
    "transform_tracer_types",
    "vma_checked",
    "all_params",
    "bind_eqn",
    "CALL_PRIMITIVES",
    "JaxprFormatError",
    "Program",
    "ScanParts",
    "WhileParts",
    "call_body",
    "collective_axes",
    "cond_branches",
    "dot_flops",
    "is_program",
    "is_dropped",
    "is_literal",
    "iter_eqns",
    "literal_value",
    "open_program",
    "optional_param",
    "param",
    "prunes_dead_while_carries",
    "scan_parts",
    "sub_programs",
    "value_type",
    "while_parts",
]


class JaxprFormatError(RuntimeError):
    """A traced program is not in any form this shardlib knows (a newer JAX changed it)."""


def _jaxpr_types() -> tuple[type, ...]:
    from jax.extend import core as _core

    types = {_core.Jaxpr, getattr(_core, "ClosedJaxpr", _core.Jaxpr)}
    return tuple(types)


_JAXPR_TYPES = _jaxpr_types()


def is_program(x: Any) -> bool:
    """Whether ``x`` is a jaxpr, closed (JAX < 0.11) or not."""
    return isinstance(x, _JAXPR_TYPES)


@dataclasses.dataclass(frozen=True)
class Program:
    """A jaxpr, opened: its equations, its inputs (the constants' variables excluded), its
    outputs, and the constants' variables paired with their values where JAX attached them
    (``consts`` may be shorter than ``constvars`` when it did not: those are plain inputs
    whose values the program does not know). ``key`` identifies the underlying program."""

    eqns: Sequence[Any]
    invars: Sequence[Any]
    outvars: Sequence[Any]
    constvars: Sequence[Any]
    consts: Sequence[Any]
    key: int
    debug_info: Any


def open_program(j: Any) -> Program:
    """The `Program` of a jaxpr of any JAX version (``ClosedJaxpr`` or ``Jaxpr``); a
    `Program` as it is."""
    if isinstance(j, Program):
        return j
    if not is_program(j):
        raise JaxprFormatError(
            f"shardlib expected a jaxpr, got {type(j).__name__} (JAX {jax.__version__}); "
            "this JAX's program representation is not one shardlib knows"
        )
    inner = getattr(j, "jaxpr", j)  # a ClosedJaxpr's Jaxpr (< 0.11); itself on >= 0.11
    consts = list(getattr(j, "consts", ()) or ())
    return Program(
        eqns=inner.eqns,
        invars=inner.invars,
        outvars=inner.outvars,
        constvars=inner.constvars,
        consts=consts,
        key=id(inner.eqns),  # shared by the copies JAX >= 0.11 makes with other consts
        debug_info=getattr(inner, "debug_info", None),
    )


# -- evaluating programs ------------------------------------------------------------------------


def is_literal(atom: Any) -> bool:
    """Whether an equation's input (or a program's output) is a literal, not a variable."""
    from jax.extend import core as _core

    return isinstance(atom, _core.Literal)


def literal_value(atom: Any) -> Any:
    """The value of a literal (see `is_literal`)."""
    return atom.val


def _drop_var_type() -> type:
    from jax.extend import core as _core

    found = getattr(_core, "DropVar", None)  # public from JAX 0.10
    if found is None:  # JAX 0.9: only in jax._src
        from jax._src.core import DropVar as found
    return found


def is_dropped(var: Any) -> bool:
    """Whether an equation's output is dropped (a ``DropVar``: nothing reads it)."""
    return isinstance(var, _drop_var_type())


def bind_eqn(eqn: Any, invals: Sequence[Any]) -> list[Any]:
    """``eqn`` applied to ``invals`` (arrays or tracers) as ``jax.core.eval_jaxpr`` applies it
    (under the equation's context), its results as a list. ``get_bind_params`` gives
    ``(subfuns, params)`` in JAX < 0.10, the params alone (subfuns among them) after."""
    got = eqn.primitive.get_bind_params(eqn.params)
    subfuns, params = got if isinstance(got, tuple) else ((), got)
    ctx = getattr(eqn, "ctx", None)
    with ctx.manager if ctx is not None else contextlib.nullcontext():
        out = eqn.primitive.bind(*subfuns, *invals, **params)
    return list(out) if eqn.primitive.multiple_results else [out]


def value_type(aval: Any, lead: tuple[int, ...] = ()) -> jax.ShapeDtypeStruct:
    """The ``jax.ShapeDtypeStruct`` of a value of abstract value ``aval`` with leading
    dimensions ``lead`` (``aval`` stacked), keeping the manual axes it varies over where JAX
    types them (``manual_axis_type`` from JAX 0.10, ``vma`` before)."""
    shape = (*lead, *aval.shape)
    mat = getattr(aval, "manual_axis_type", None)
    if mat is not None:
        return jax.ShapeDtypeStruct(shape, aval.dtype, manual_axis_type=mat)
    vma = getattr(aval, "vma", None)
    if vma:
        return jax.ShapeDtypeStruct(shape, aval.dtype, vma=vma)  # pyright: ignore[reportCallIssue]
    return jax.ShapeDtypeStruct(shape, aval.dtype)


# -- parameters -----------------------------------------------------------------------------

# Parameters JAX itself leaves out in some equations, with what their absence means.
_OPTIONAL: dict[str, str] = {
    "axes": "a collective that names its axes `axis_name` instead",
    "axis_name": "a collective that names its axes `axes` instead",
    "mesh": "a shard_map of an older JAX (mesh sizes then come from the context)",
    "in_specs": "a shard_map of an older JAX (it has `in_names`)",
    "in_names": "a shard_map of a newer JAX (it has `in_specs`)",
    "out_specs": "a shard_map of an older JAX (it has `out_names`)",
    "fill_value": "a gather that fills with JAX's default (NaN for floats, 0 otherwise)",
    "mode": "a gather or scatter without an out-of-bounds mode",
    "differentiated": "a checkpoint that is not yet differentiated",
    "policy": "a checkpoint without a saving policy (saves nothing)",
    "donated_invars": "a call that donates nothing",
    "name": "an equation without a name",
    "perm": "a collective that is not a permute",
    "axis_size": "a collective whose group size comes from the mesh",
}


def param(eqn: Any, key: str) -> Any:
    """The parameter ``key`` of ``eqn``; an error naming the primitive, the parameter and the
    JAX version where the equation has none (a JAX whose programs shardlib does not know)."""
    try:
        return eqn.params[key]
    except KeyError:
        raise JaxprFormatError(
            f"shardlib reads parameter {key!r} of the {eqn.primitive.name!r} equation, which "
            f"JAX {jax.__version__} does not give it (parameters: {sorted(eqn.params)}); this "
            "JAX's program representation is newer than shardlib knows: please report it"
        ) from None


def optional_param(eqn: Any, key: str) -> Any | None:
    """A parameter JAX leaves out in some equations (listed in ``_OPTIONAL``), or None."""
    if key not in _OPTIONAL:
        raise KeyError(f"{key!r} is not an optional parameter; read it with param()")
    return eqn.params.get(key)


def collective_axes(eqn: Any) -> tuple[str, ...]:
    """The mesh axes a collective equation names (``axis_name`` or ``axes``, whichever JAX
    gives it; positional axes of a ``vmap`` left out)."""
    axes = optional_param(eqn, "axis_name")
    if axes is None:
        axes = optional_param(eqn, "axes") or ()
    return (axes,) if isinstance(axes, str) else tuple(a for a in axes if isinstance(a, str))


def all_params(eqn: Any) -> Mapping[str, Any]:
    """All of ``eqn``'s parameters, for JAX APIs that take them as keywords (a checkpoint
    policy) or to tell two equations apart; never to read one by name."""
    return eqn.params


def sub_programs(eqn: Any) -> list[Program]:
    """Every jaxpr among ``eqn``'s parameters (a cond's branches included), opened, in
    parameter order."""
    out = []
    for v in eqn.params.values():
        for j in v if isinstance(v, tuple | list) else (v,):
            if is_program(j):
                out.append(open_program(j))
    return out


# -- calls, loops, branches -------------------------------------------------------------------

# Call-like primitives and the parameters that may hold their body (newest name first): it
# takes the equation's (trailing) inputs and gives its outputs.
CALL_PRIMITIVES: Mapping[str, tuple[str, ...]] = {
    "pjit": ("jaxpr",),
    "jit": ("jaxpr",),
    "closed_call": ("call_jaxpr",),
    "core_call": ("call_jaxpr",),
    "eval_jaxpr": ("call_jaxpr",),
    "remat": ("jaxpr",),
    "remat2": ("jaxpr",),
    "checkpoint": ("jaxpr",),
    "shard_map": ("jaxpr",),
    "custom_jvp_call": ("call_jaxpr",),
    "custom_vjp_call": ("call_jaxpr", "fun_jaxpr"),
    "custom_vjp_call_jaxpr": ("fun_jaxpr",),
}


def call_body(eqn: Any) -> Program:
    """The body of a call-like equation (a primitive of ``CALL_PRIMITIVES``)."""
    keys = CALL_PRIMITIVES.get(eqn.primitive.name, ())
    for key in keys:
        if key in eqn.params:
            return open_program(eqn.params[key])
    raise JaxprFormatError(
        f"shardlib reads the body of the {eqn.primitive.name!r} equation from parameter "
        f"{' or '.join(map(repr, keys)) or '(none known)'}, which JAX {jax.__version__} does "
        f"not give it (parameters: {sorted(eqn.params)}); please report it"
    )


@dataclasses.dataclass(frozen=True)
class ScanParts:
    """A ``scan`` equation: its body takes ``n_consts`` loop-invariant inputs, ``n_carry``
    carries, then the scanned slices; it gives the carries, then the stacked outputs."""

    body: Program
    n_consts: int
    n_carry: int
    length: int
    reverse: bool


def _flat_count(tree: Any) -> int:
    return len(list(tree))


def scan_parts(eqn: Any) -> ScanParts:
    """The parts of a ``scan`` equation, from ``num_consts``/``num_carry`` (JAX < 0.11) or
    from the flat tree ``ft_in`` of (consts, carry, xs) (JAX >= 0.11)."""
    p = eqn.params
    if "num_consts" in p and "num_carry" in p:
        n_consts, n_carry = int(p["num_consts"]), int(p["num_carry"])
    elif "ft_in" in p:
        parts = p["ft_in"].unpack()
        if len(parts) != 3:
            raise JaxprFormatError(
                f"shardlib reads a scan's inputs as (consts, carry, xs), but JAX "
                f"{jax.__version__}'s ft_in has {len(parts)} parts; please report it"
            )
        n_consts, n_carry = _flat_count(parts[0]), _flat_count(parts[1])
    else:
        param(eqn, "num_consts")  # raises, naming the version
        raise AssertionError  # pragma: no cover
    body = open_program(param(eqn, "jaxpr"))
    if n_consts + n_carry > len(body.invars) or len(body.invars) != len(eqn.invars):
        raise JaxprFormatError(
            f"shardlib read a scan with {n_consts} consts and {n_carry} carries, but its body "
            f"takes {len(body.invars)} inputs and the equation {len(eqn.invars)} "
            f"(JAX {jax.__version__}); please report it"
        )
    return ScanParts(
        body, n_consts, n_carry, int(param(eqn, "length")), bool(param(eqn, "reverse"))
    )


@dataclasses.dataclass(frozen=True)
class WhileParts:
    """A ``while`` equation: inputs are the condition's consts, the body's consts, then the
    carries; the condition takes its consts and the carries, the body its consts and the
    carries and gives the carries."""

    cond: Program
    cond_nconsts: int
    body: Program
    body_nconsts: int


def while_parts(eqn: Any) -> WhileParts:
    return WhileParts(
        open_program(param(eqn, "cond_jaxpr")),
        int(param(eqn, "cond_nconsts")),
        open_program(param(eqn, "body_jaxpr")),
        int(param(eqn, "body_nconsts")),
    )


def cond_branches(eqn: Any) -> list[Program]:
    """The branches of a ``cond`` equation (its first input is the branch index; the rest
    are every branch's inputs)."""
    return [open_program(b) for b in param(eqn, "branches")]


def iter_eqns(program: Program) -> Iterator[Any]:
    """Every equation of ``program`` and of the programs nested in it, in program order."""
    for e in program.eqns:
        yield e
        for sub in sub_programs(e):
            yield from iter_eqns(sub)


def prunes_dead_while_carries() -> bool:
    """Whether this JAX, when it lowers a program, drops the carries of a live ``while`` loop
    that nothing uses, with the body's equations that only compute them (JAX 0.12 does: its
    dead-code rule for ``while`` keeps a carry that is a used result, that the condition reads
    or that the body needs for a kept carry; JAX 0.10 has no such rule and keeps a live loop
    whole). Found by behaviour, not version: a tiny loop whose second carry (a float32 ``[3]``
    nothing reads) is dead is lowered, and the answer is whether that carry is gone. It does
    not change within a process: callers may cache it."""

    def loop(n: Any) -> Any:
        init = (0, jax.numpy.zeros(3, jax.numpy.float32))
        return jax.lax.while_loop(lambda c: c[0] < n, lambda c: (c[0] + 1, c[1] + 1.0), init)[0]

    return "3xf32" not in jax.jit(loop).lower(3).as_text()


def dot_flops(eqn: Any) -> int:
    """The FLOPs of a ``dot_general`` (2 per multiply-add); 0 for any other primitive."""
    if eqn.primitive.name != "dot_general":
        return 0
    (contracting, _), _ = param(eqn, "dimension_numbers")
    lhs, out = eqn.invars[0].aval.shape, eqn.outvars[0].aval.shape
    return 2 * math.prod(out) * math.prod(lhs[d] for d in contracting)


# -- JAX internals (``jax._src``): used nowhere else in shardlib -------------------------------


def thread_resources() -> Any | None:
    """JAX's thread-local resource env holder (where ``with mesh:`` puts the mesh), or None."""
    try:
        from jax._src import mesh as _mesh_lib  # internal: legacy `with mesh:` context

        return _mesh_lib.thread_resources
    except Exception:  # pragma: no cover - layout of internals changed
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)
                from jax.interpreters import pxla

                return pxla.thread_resources
        except Exception:
            return None


def jit_key_state(kind: str, name: str, default: Any, text: str) -> Any | None:
    """A JAX config state of ``kind`` (``bool_state``, ``string_or_object_state``) that is part
    of ``jax.jit``'s cache key (None where this JAX has no such state). JAX has no public way to
    add to the key. Internal API: isolated here."""
    try:
        from jax._src import config as _config  # internal: the only way to key jit's cache

        make = getattr(_config, kind)
        return make(name, default, text, include_in_jit_key=True, include_in_trace_context=True)
    except Exception:  # pragma: no cover - layout of internals changed
        return None


def transform_tracer_types() -> tuple[tuple[type, ...], tuple[type, ...]]:
    """(tracer types with a ``.primal``, tracer types with ``.val``/``.batch_dim``)."""
    try:  # internal: the tracer classes of jvp/linearize and vmap
        from jax._src.interpreters import ad, batching

        primal = tuple(
            t for t in (getattr(ad, "JVPTracer", None), getattr(ad, "LinearizeTracer", None)) if t
        )
        batch = (batching.BatchTracer,)
    except Exception:  # pragma: no cover - layout of internals changed
        return (), ()
    return primal, batch


def vma_checked() -> bool:
    """Whether the enclosing shard_map tracks varying manual axes (``check_vma=True``).

    JAX exposes no public accessor for this trace-time setting, so it is read from its
    config state. Internal API: isolated here.
    """
    try:
        from jax._src import config as _config  # internal: shard_map's check_vma setting

        return bool(_config._check_vma.value)
    except Exception:  # pragma: no cover - layout of internals changed
        return False
