"""When a ``typed_shard_map`` body fails to trace: shardlib's explanation first.

`check_traced` runs the partial-sum analysis on a traced ``shard_map``; `explain_jax_refusal`
turns JAX's refusal of a body (a forgotten reduction often shows up there first, as an
``out_specs`` or loop-carry type error) into shardlib's error, which names the op and line
that made the partial sum and the fix; `name_operands` traces a failing body once more so
that an op's error names the argument (or pytree field) its operand came from. All of it
runs only on the error path (or once per analysed trace, for `check_traced`).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import Any

import jax
from jax.extend.core import Literal
from typeguard import TypeCheckError

from .._analysis.notes import PendingReductionError
from .._analysis.walk import check_body, const_state
from .._check.format import annotation_str, naming_operands
from .._env import programs
from .._env.context import mesh_axis_sizes, spec_entries
from .._env.frames import raised_by_shardlib
from .._lang.parsing import SpecError
from .plan import Plan, is_leaf

__all__ = ["check_traced", "explain_jax_refusal", "name_operands", "replication_hint"]


def check_traced(closed: Any, fname: str, out_specs: tuple[str, ...] = ()) -> None:
    """Analyse each ``shard_map`` body of the traced jaxpr ``closed`` (``out_specs``: the
    annotated specs of the body's outputs, for the fix a message suggests)."""
    program = programs.open_program(closed)
    consts = dict(zip(program.constvars, program.consts, strict=True))
    for eqn in program.eqns:
        if eqn.primitive.name == "shard_map":
            # An input that is a constant (a host np.zeros the body closed over) may be zero.
            values = [v.val if isinstance(v, Literal) else consts.get(v) for v in eqn.invars]
            zero = [c is not None and const_state(c).zero for c in values]
            body = programs.call_body(eqn)
            check_body(
                body,
                _in_axes(eqn),
                fname,
                zero,
                out_specs,
                in_unreduced=_unreduced(programs.optional_param(eqn, "in_specs")),
                out_unreduced=_unreduced(programs.optional_param(eqn, "out_specs")),
                axis_sizes=_axis_sizes(eqn),
            )


def explain_jax_refusal(
    smap: Callable[..., Callable],
    args: list[Any],
    fname: str,
    e: Exception,
    out_specs: tuple[str, ...] = (),
) -> None:
    """Raise the partial-sum error behind JAX's refusal ``e``, if there is one.

    shardlib's error replaces JAX's (``from None``): it names the op and line that made the
    partial sum and the reduction to add, where JAX's ``out_specs`` text names only the
    specs and an internal ``functools.partial`` of the body.
    """
    try:
        closed = jax.make_jaxpr(smap(check_vma=False))(*args)
    except Exception as other:  # the body fails without check_vma too
        same = type(other) is type(e) and str(other) == str(e)
        if not same and (
            isinstance(other, TypeCheckError | SpecError)
            or raised_by_shardlib(other)  # its own frames, or a nested typed_shard_map's
        ):
            raise other.with_traceback(None) from None  # shardlib's error further on says more
        return
    try:
        check_traced(closed, fname, out_specs)
    except (PendingReductionError, SpecError) as mine:
        raise mine.with_traceback(None) from None
    carry = _SCAN_CARRY.search(str(e))
    if isinstance(e, TypeError) and carry:
        name, in_type, out_type = carry.groups()
        fix = _PCAST.search(str(e))
        axes = fix.group(1) if fix else "AXES"
        raise TypeError(
            f"in {fname}(): the loop carry {name!r} of a lax.scan/fori_loop/while_loop in the "
            f"body starts as {in_type} and the loop body returns it as {out_type}: with "
            "check_vma on, JAX types a value by the mesh axes it may vary over, and the body "
            "makes the carry vary over more (shardops.all_gather results count as varying "
            "although every device holds the same block). Fix: start it varying, "
            f"`{name} = jax.lax.pcast({name}, {axes}, to='varying')` before the loop, or pass "
            f"check_vma=False to typed_shard_map.\n\nJAX's message: {e}"
        ) from None


def replication_hint(plan: Plan, e: ValueError) -> ValueError | None:
    """shardlib's explanation of JAX's refusal ``e`` to return a value as replicated, if it
    is that refusal: the axes, and the reduction with the return annotation's spec filled in.
    Of JAX's text only its sentence per output is kept (its name for the body is a
    ``functools.partial`` of shardlib's)."""
    text = str(e)
    if "require replication" not in text:
        return None
    one = _REPLICATED_ONE.findall(text)
    axes = sorted(set(one) | {a for m in _REPLICATED_SOME.findall(text) for a in m.split(",")})
    where = ", ".join(map(repr, axes)) if axes else "a mesh axis"
    word = "axes" if len(axes) > 1 else "axis"
    spec = str(plan.out_flat[0].spec) if len(plan.out_flat) == 1 else "SPEC"
    arg = "/".join(axes) if axes else "AXES"
    fix = f"shardops.psum({spec!r}, x, axes={arg!r})"
    lines = _IMPLIES.findall(text)  # JAX's sentences, without its name for the body
    jax_says = "\n\nJAX's message: " + ("\n".join(lines) if lines else text)
    return ValueError(
        _REPLICATION_HINT.format(
            name=plan.name, ann=plan.out_text, where=f"mesh {word} {where}", fix=fix
        )
        + jax_says
    )


def out_spec_texts(plan: Plan) -> tuple[str, ...]:
    """The return annotation's specs, one per output leaf (``'B/d L M'``)."""
    return tuple(str(lf.spec) for lf in plan.out_flat)


def name_operands(
    smap: Callable[..., Callable], args: list[Any], plan: Plan, e: TypeCheckError
) -> TypeCheckError:
    """``e`` (a body's op refused an operand) as it reads when the body is traced once more
    with its arguments named: an operand that is an argument, or a field of one, is named
    with its path and annotation (``w.wo``, annotated ``f32['H D/t M']``). Error path only.
    """
    try:
        jax.make_jaxpr(smap(wrap=functools.partial(_naming_body, plan)))(*args)
    except TypeCheckError as again:
        if type(again) is type(e) and str(again) != str(e):
            return again
    except Exception:  # the retrace failed otherwise: keep the first error
        pass
    return e


def _naming_body(plan: Plan, body: Callable, *dyn_vals: Any) -> Any:
    """Run ``body`` with a table from each argument leaf (by identity) to its name."""
    table: dict[int, tuple[Any, str]] = {}
    for p, value in zip(plan.dynamic, dyn_vals, strict=True):
        paths = jax.tree_util.tree_flatten_with_path(p.leaves, is_leaf=is_leaf)[0]
        try:
            leaves = p.treedef.flatten_up_to(value)
        except Exception:  # pragma: no cover - checked before the body runs
            continue
        for (path, lf), v in zip(paths, leaves, strict=True):
            name = p.name + "".join(map(_key_text, path))
            table[id(v)] = (v, f"{name}, annotated {annotation_str(lf.dtype, lf.spec)}")
    with naming_operands(table):
        return body(*dyn_vals)


def _key_text(key: Any) -> str:
    """``.wo`` for a field or attribute, ``[0]`` / ``['a']`` for an item."""
    name = getattr(key, "name", None)
    return f".{name}" if isinstance(name, str) else str(key)


def _unreduced(specs: Any) -> list[frozenset[str]]:
    """The axes each of a ``shard_map``'s in/out specs is typed unreduced over (JAX's
    PartitionSpec ``unreduced`` field; none on a JAX without it)."""
    return [frozenset(getattr(spec, "unreduced", None) or ()) for spec in specs or ()]


def _axis_sizes(eqn: Any) -> dict[str, int]:
    """The sizes of the mesh axes of a ``shard_map`` equation, in mesh order (its ``mesh``;
    on a JAX whose equation has none, the mesh in force)."""
    mesh = programs.optional_param(eqn, "mesh")
    return mesh_axis_sizes(mesh) if mesh is not None else mesh_axis_sizes()


def _in_axes(eqn: Any) -> list[frozenset[str]]:
    """For each body input of a ``shard_map`` equation, the mesh axes it is split over."""
    specs = programs.optional_param(eqn, "in_specs")
    if specs is not None:
        return [
            frozenset(
                a
                for entry in spec_entries(spec)
                for a in ((entry,) if isinstance(entry, str) else (entry or ()))
            )
            for spec in specs
        ]
    names = programs.param(eqn, "in_names")
    return [frozenset(a for axes in n.values() for a in axes) for n in names]


_SCAN_CARRY = re.compile(
    r"input carry (\S+) has type (\S+) but the corresponding output carry component has "
    r"type (\S+),"
)
_PCAST = re.compile(r"pcast\(\.\.\., (\([^)]*\)), to='varying'\)")
# JAX's out_specs refusal: which output, and over which axes it cannot prove replication.
_IMPLIES = re.compile(r"out_specs\S* is .*? which implies that .*?(?=\n|$)")
_REPLICATED_ONE = re.compile(r"replicated across mesh axis '([^']+)'")
_REPLICATED_SOME = re.compile(r"and not \{([^}]*)\}")

_REPLICATION_HINT = """typed_shard_map({name}): the return annotation {ann} says the result is \
replicated over {where}, and JAX cannot prove it is: with check_vma on, a value computed from \
split inputs stays 'varying' over their axes until psum/pmean/pmax (or psum_scatter) makes it \
invariant, and lax.all_gather results stay varying. Reduce the value ({fix}, or pmean/pmax), \
return it split (gathering outside), or pass check_vma=False to typed_shard_map."""
