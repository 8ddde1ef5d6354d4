"""When a ``typed_shard_map`` body fails to trace: shardlib's explanation first.

`check_traced` runs the partial-sum analysis on a traced ``shard_map``; `explain_jax_refusal`
turns JAX's refusal of a body (a forgotten reduction often shows up there first, as an
``out_specs`` or loop-carry type error) into shardlib's error, which names the op and line
that made the partial sum and the fix; `name_operands` traces a failing body once more so
that an op's error names the argument (or pytree field) its operand came from;
`check_reduced_gradients` traces the body's gradient once where an argument annotated
reduced (``{=t}``) is differentiated, to say what the clause needs where JAX's transpose
refuses it. All of it runs only on the error path (or once per analysed trace, for
`check_traced`, and per differentiated trace, for `check_reduced_gradients`).
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
from .._env.context import (
    UNCHECKED_UNREDUCED,
    differentiated,
    manual_axis_sizes,
    mesh_axis_sizes,
    spec_clause,
    spec_entries,
    type_clause,
)
from .._env.frames import raised_by_shardlib
from .._lang.parsing import ShapeSpec, SpecError
from .signature import ShardMapSignature, is_leaf

__all__ = [
    "check_reduced_gradients",
    "check_traced",
    "explain_jax_refusal",
    "name_operands",
    "replication_hint",
]


def check_traced(
    closed: Any,
    fname: str,
    out_specs: tuple[str, ...] = (),
    out_unreduced: list[frozenset[str]] | None = None,
) -> None:
    """Analyse each ``shard_map`` body of the traced jaxpr ``closed`` (``out_specs``: the
    annotated specs of the body's outputs, for the fix a message suggests; ``out_unreduced``:
    the axes each output is annotated unreduced over, where the traced ``out_specs`` lack
    them)."""
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
                out_unreduced=(
                    out_unreduced
                    if out_unreduced is not None
                    else _unreduced(programs.optional_param(eqn, "out_specs"))
                ),
                axis_sizes=_axis_sizes(eqn),
            )


def explain_jax_refusal(
    smap: Callable[..., Callable],
    args: list[Any],
    fname: str,
    e: Exception,
    out_specs: tuple[str, ...] = (),
    out_pspecs: Any = None,
) -> None:
    """Raise the partial-sum error behind JAX's refusal ``e``, if there is one.

    shardlib's error replaces JAX's (``from None``): it names the op and line that made the
    partial sum and the reduction to add, where JAX's ``out_specs`` text names only the
    specs and an internal ``functools.partial`` of the body. ``out_pspecs``: the body's
    ``out_specs``; on a JAX whose ``shard_map`` returns nothing unreduced with ``check_vma``
    off (JAX 0.9), the body is traced again without their ``unreduced`` axes, which the
    analysis is told instead.
    """
    unchecked: dict[str, Any] = {"check_vma": False}
    out_unreduced = None
    if not UNCHECKED_UNREDUCED and out_pspecs is not None:
        flat = jax.tree.leaves(out_pspecs, is_leaf=_is_pspec)
        if any(spec_clause(p)[0] for p in flat):
            out_unreduced = [spec_clause(p)[0] for p in flat]
            unchecked["out_specs"] = jax.tree.map(
                lambda p: p.update(unreduced=frozenset()), out_pspecs, is_leaf=_is_pspec
            )
    try:
        closed = jax.make_jaxpr(smap(**unchecked))(*args)
    except Exception as other:  # the body fails without check_vma too
        same = type(other) is type(e) and str(other) == str(e)
        if not same and (
            isinstance(other, TypeCheckError | SpecError)
            or raised_by_shardlib(other)  # its own frames, or a nested typed_shard_map's
        ):
            raise other.with_traceback(None) from None  # shardlib's error further on says more
        if not UNCHECKED_UNREDUCED and "unreduced" in str(other):
            raise _unchecked_unreduced_refusal(args, fname, other) from None
        return
    try:
        check_traced(closed, fname, out_specs, out_unreduced)
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
    if "unreduced" in str(e):
        raise _unreduced_refusal(closed, fname, e) from None


def _unreduced_refusal(closed: Any, fname: str, e: Exception) -> Exception:
    """JAX's refusal ``e`` of an op on a value its types call unreduced, in a body whose
    partial sums the analysis found right (``closed``: the body traced with ``check_vma``
    off), said to be JAX's: JAX has no rule for some linear ops on unreduced values (``neg``
    on JAX 0.10) and wants a constant that scales a partial sum typed reduced. The same
    class as ``e`` where it can be made from a message."""
    axes = sorted(
        {
            a
            for eqn in programs.open_program(closed).eqns
            if eqn.primitive.name == "shard_map"
            for key in ("in_specs", "out_specs")
            for u in _unreduced(programs.optional_param(eqn, key))
            for a in u
        }
    )
    arg = repr(axes[0]) if len(axes) == 1 else repr(tuple(axes)) if axes else "AXES"
    text = (
        f"in {fname}(): JAX {jax.__version__} refused an op of the body on a value its types "
        f"call unreduced (a partial sum, {{U:...}}) with check_vma on, and shardlib's analysis "
        "of the same body (traced again with check_vma off) finds every partial sum used "
        "linearly and reduced right: the refusal is JAX's, not shardlib's. Pass "
        "check_vma=False to typed_shard_map (the analysis still checks every partial sum), or "
        "write the op as JAX's types allow it (to scale a partial sum by a constant c, "
        f"multiply it by jax.lax.pcast(c, {arg}, to='reduced'); negate it so too, with c = "
        f"-1).\n\nJAX's message: {e}"
    )
    try:
        return type(e)(text)
    except Exception:  # pragma: no cover - a class not made from one message
        return TypeError(text)


def _unchecked_unreduced_refusal(args: list[Any], fname: str, e: Exception) -> Exception:
    """JAX's refusal ``e`` of an op of the body on an argument typed unreduced, on a JAX that
    types it so with ``check_vma`` off too (JAX 0.9): no option of shardlib's runs it. The
    same class as ``e`` where it can be made from a message."""
    axes = sorted({a for x in jax.tree.leaves(args) for a in type_clause(x)[0]})
    arg = repr(axes[0]) if len(axes) == 1 else repr(tuple(axes)) if axes else "AXES"
    text = (
        f"in {fname}(): JAX {jax.__version__} refused an op of the body on a value its types "
        "call unreduced (a partial sum, {U:...}): this JAX types an argument annotated "
        "unreduced ('{+...}') so with check_vma off too, and has no rule for that op on it "
        "(or none that runs), so check_vma=False does not help: the refusal is JAX's, not "
        f"shardlib's. Reduce the argument before the call (shardops.psum over {arg} in the "
        "typed_shard_map that made it, and drop the '{+...}' clause), or use JAX 0.10 or "
        f"later, where check_vma=False runs the body.\n\nJAX's message: {e}"
    )
    try:
        return type(e)(text)
    except Exception:  # pragma: no cover - a class not made from one message
        return TypeError(text)


def _is_pspec(x: Any) -> bool:
    return isinstance(x, jax.sharding.PartitionSpec)


def check_reduced_gradients(
    smap: Callable[..., Callable], args: list[Any], sig: ShardMapSignature, key: Any
) -> None:
    """Where an argument annotated reduced (``{=t}``) is being differentiated: trace the
    body's VJP once per trace ``key``, and where JAX refuses its cotangent (JAX wants the
    gradient of a ``{=t}`` argument typed unreduced over ``t``, which it is only where the
    body's use of the argument varies over ``t``), raise what the clause needs.

    Anything else that goes wrong in this trace is left to the program's own run (JAX's
    own error then, if any): the check is only here to name the clause.
    """
    if key is not None and key in sig.grads_checked:
        return
    reduced = [
        (p, lf, v)
        for p, value in zip(sig.dynamic, args, strict=True)
        for lf, v in zip(p.flat, p.treedef.flatten_up_to(value), strict=True)
        if lf.spec.reduced
    ]
    if not any(differentiated(v) for _, _, v in reduced) or manual_axis_sizes():
        return
    try:
        structs = [jax.tree.map(_struct, a) for a in args]
        jax.make_jaxpr(functools.partial(_pull, smap()))(*structs)
    except ValueError as e:
        m = _COTANGENT.search(str(e))
        if m is None:
            return
        raise _reduced_gradient_error(sig, reduced, m.group(1), m.group(2)) from None
    except Exception:  # not this check's business
        return
    if key is not None:
        if len(sig.grads_checked) >= 256:
            sig.grads_checked.clear()
        sig.grads_checked.add(key)


def _struct(x: Any) -> jax.ShapeDtypeStruct:
    aval = jax.typeof(x)
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype, sharding=aval.sharding)


def _pull(f: Callable, *args: Any) -> Any:
    """The gradient of ``f`` at ``args`` for zero cotangents of its outputs' cotangent types
    (an unreduced output's is reduced, and the other way round)."""
    out, vjp = jax.vjp(f, *args)
    return vjp(jax.tree.map(_zero_cotangent, out))


def _zero_cotangent(o: Any) -> Any:
    aval = jax.typeof(o)
    spec = aval.sharding.spec
    unreduced, reduced = spec_clause(spec)
    swapped = jax.sharding.PartitionSpec(*spec_entries(spec), unreduced=reduced, reduced=unreduced)
    zero = jax.numpy.zeros(aval.shape, aval.dtype)
    return jax.reshard(zero, jax.sharding.NamedSharding(aval.sharding.mesh, swapped))


def _reduced_gradient_error(
    sig: ShardMapSignature, reduced: list[tuple[Any, Any, Any]], want: str, got: str
) -> TypeCheckError:
    """What a ``{=t}`` clause needs, where JAX wants its argument's cotangent typed ``want``
    (unreduced over ``t``) and the body's transpose makes it ``got``."""
    missing = _unreduced_in(want) - _unreduced_in(got)
    hits = [(p, lf) for p, lf, _ in reduced if missing & set(lf.spec.reduced)] or [
        (p, lf) for p, lf, _ in reduced
    ]
    p, lf = hits[0]
    axes = sorted(missing & set(lf.spec.reduced)) or list(lf.spec.reduced)
    a = axes[0]
    plain = ShapeSpec(lf.spec.dims, lf.spec.pending, tuple(r for r in lf.spec.reduced if r != a))
    return TypeCheckError(
        f"argument {p.name!r} of {sig.name}() is annotated {annotation_str(lf.dtype, lf.spec)}, "
        f"reduced over mesh axis {a!r}: its gradient is left unreduced over {a!r}, each device "
        f"holding its part of a sum over {a!r}, which needs the body's use of it to vary over "
        f"{a!r} (to meet data split over {a!r}), but nothing it meets in the body does, so each "
        f"device's gradient is the whole sum and JAX cannot differentiate the call (it wants "
        f"the cotangent typed {want} and the body makes it {got}); drop '={a}' from the "
        f"annotation, {annotation_str(lf.dtype, plain)} (its gradient then comes back summed, "
        f"as an ordinary argument's), or split the data it meets over {a!r}"
    )


def _unreduced_in(jax_type: str) -> set[str]:
    """The axes a JAX type's text (``float32[4,6]{V:d, U:(t,x)}``) says are unreduced."""
    m = _UNREDUCED_TYPE.search(jax_type)
    return {a.strip() for a in m.group(1).split(",")} if m else set()


def replication_hint(sig: ShardMapSignature, e: ValueError) -> ValueError | None:
    """shardlib's explanation of JAX's refusal ``e`` to return a value as replicated, if it
    is that refusal: the axes, and the reduction with the return annotation's spec filled in.
    Of JAX's text only its sentence per output is kept (its name for the body is a
    ``functools.partial`` of shardlib's)."""
    text = str(e)
    if "require replication" not in text:
        return None
    one = _REPLICATED_ONE.findall(text)
    axes = sorted(
        set(one) | {a.strip(" '") for m in _REPLICATED_SOME.findall(text) for a in m.split(",")}
    )
    axes = [a for a in axes if a]
    if not axes:  # JAX names none ("{} and not {}"): not a replication shardlib can explain
        return None
    where = ", ".join(map(repr, axes))
    word = "axes" if len(axes) > 1 else "axis"
    spec = str(sig.out_flat[0].spec) if len(sig.out_flat) == 1 else "SPEC"
    arg = "/".join(axes)
    fix = f"shardops.psum({spec!r}, x, axes={arg!r})"
    lines = _IMPLIES.findall(text)  # JAX's sentences, without its name for the body
    jax_says = "\n\nJAX's message: " + ("\n".join(lines) if lines else text)
    return ValueError(
        _REPLICATION_HINT.format(
            name=sig.name, ann=sig.out_text, where=f"mesh {word} {where}", fix=fix
        )
        + jax_says
    )


def out_spec_texts(sig: ShardMapSignature) -> tuple[str, ...]:
    """The return annotation's specs, one per output leaf (``'B/d L M'``)."""
    return tuple(str(lf.spec) for lf in sig.out_flat)


def name_operands(
    smap: Callable[..., Callable], args: list[Any], sig: ShardMapSignature, e: TypeCheckError
) -> TypeCheckError:
    """``e`` (a body's op refused an operand) as it reads when the body is traced once more
    with its arguments named: an operand that is an argument, or a field of one, is named
    with its path and annotation (``w.wo``, annotated ``f32['H D/t M']``). Error path only.
    """
    try:
        jax.make_jaxpr(smap(wrap=functools.partial(_naming_body, sig)))(*args)
    except TypeCheckError as again:
        if type(again) is type(e) and str(again) != str(e):
            return again
    except Exception:  # the retrace failed otherwise: keep the first error
        pass
    return e


def _naming_body(sig: ShardMapSignature, body: Callable, *dyn_vals: Any) -> Any:
    """Run ``body`` with a table from each argument leaf (by identity) to its name."""
    table: dict[int, tuple[Any, str]] = {}
    for p, value in zip(sig.dynamic, dyn_vals, strict=True):
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


# JAX's transpose of a shard_map whose reduced input's cotangent lacks the unreduced type.
_COTANGENT = re.compile(r"Expected cotangent type (.+?) but got (.+?)$", re.M)
_UNREDUCED_TYPE = re.compile(r"U:\(?([\w, ]+?)\)?(?:, [A-Z]:|\})")
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
