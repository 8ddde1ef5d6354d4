"""The op skeleton: what every ``shardops`` op does around the JAX call it emits.

`run` takes an op's recipe (`shardlib._ops.recipe.Recipe`, cached per spec) and its operands, and

1. finds the binding scope and checks that the mesh axes the op needs are manual;
2. checks each operand against its spec (a ``{+t}`` clause is left as an ``expect`` note,
   checked after tracing), then the op's own size/dtype checks;
3. notes the axes a reduction sums over (``sum``: refused after tracing if the value is the
   same on every device of them);
4. emits the op's JAX call (`shardlib._ops.emit`), collectives under the named scope
   ``shardops.OP[SPEC]``; an exception JAX raises there is re-raised naming the op, its
   spec and its operands, as an instance of JAX's exception type too;
5. notes the axes the result is a partial sum over (``mark``) and checks the output.

Outside the analysis trace (no notes kept), an op whose recipe, manual axis sizes and operand
shapes and dtypes are those of a call that passed every check replays that call's result
instead of steps 1-2 (`_OP_MEMO`): it binds the names that call bound, or takes the full
path when one is bound to another size, and after emitting compares the result's shape and
dtype with the one that call checked (the full check runs on any difference).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import jax
from jax import lax
from typeguard import TypeCheckError

from .._analysis.notes import Note, note, op_started
from .._check.checking import TRACER_TYPES, bind_sizes, check_block, format_sizes
from .._check.format import short_value
from .._check.scopes import op_scope
from .._env import context as _context
from .._env import rules as _rules
from .._env.frames import user_location
from .._lang.parsing import ShapeSpec, SpecError, did_you_mean
from .collective_recipes import AxesRecipe
from .emit import EMITTERS, axis_arg
from .recipe import Recipe

__all__ = ["axis_index", "axis_size", "declare", "run"]


def run(recipe: Recipe, *operands: Any, **kwargs: Any) -> Any:
    """Run the op ``recipe`` describes on ``operands`` (see the module docstring).

    Runs on every op while a body is traced, so it reads the context once (the scope, the
    manual axes) and builds notes only while they are left in the program (`notes_on`).
    """
    on = op_started(recipe)  # recorded; whether notes are left (the analysis trace)
    way = EMITTERS[type(recipe)]
    scope = op_scope()
    manual, items = _context.manual_axes()
    memo = _memo_key(recipe, operands, items) if not on and items else None
    if memo is not None:
        hit = _OP_MEMO.get(memo)
        if (
            hit is not None
            and hit[0] is recipe
            and (hit[1].items() <= scope.bindings.items() or bind_sizes(scope.bindings, hit[1]))
        ):
            y = _emit(recipe, way, list(operands), kwargs)
            if type(y) not in TRACER_TYPES or (y.aval.shape, y.aval.dtype) != hit[2]:
                check_block(y, recipe.spec.output, scope, items, recipe.labels[-1])
            return y
    for a in recipe.needs:
        if a not in manual:
            _manual(recipe.op, recipe.spec.text, recipe.needs)  # raises: names the axis
    spec, labels = recipe.spec, recipe.labels
    xs, bound = [], []  # bound: the names each check bound (what a replay binds)
    for k, (x, s) in enumerate(zip(operands, spec.inputs, strict=True)):
        bound.append(check_block(x, s, scope, items, labels[k]))
        xs.append(declare(x, s, recipe, recipe.roles[k]) if s.pending and on else x)
    if way.check is not None:
        way.check(recipe, xs, manual)
    if recipe.sums and on:
        xs[0] = note(xs[0], Note("sum", recipe.sums, recipe.op, spec.text))
    y = _emit(recipe, way, xs, kwargs)
    if recipe.marks and on:
        origin = f"{recipe.op}({spec.text!r}) at {user_location()}"
        y = note(y, Note("mark", recipe.marks, origin=origin))
    bound.append(check_block(y, spec.output, scope, items, labels[-1]))
    if spec.output.pending and on:
        y = declare(y, spec.output, recipe, "output", recipe.why)
    if memo is not None:
        _remember(memo, recipe, bound, y)
    return y


def _emit(recipe: Recipe, way: Any, xs: list[Any], kwargs: Mapping[str, Any]) -> Any:
    """Step 4: the op's JAX call, a collective under its named scope; what JAX raises there
    is re-raised in shardops' words (`_op_failure`)."""
    try:
        if way.scoped:
            with jax.named_scope(recipe.scope_name):
                return way.emit(recipe, xs, kwargs)
        return way.emit(recipe, xs, kwargs)
    except (SpecError, TypeCheckError, _OpFailure, StopIteration):
        raise
    except Exception as e:
        err = _op_failure(recipe, way.call, xs, kwargs, e)
        if err is e:  # pragma: no cover - an exception type we cannot build: keep JAX's
            raise
        raise err from e


# (id(recipe), manual axis items, (shape, dtype) of each operand) -> (recipe, the names the
# passing call bound, (shape, dtype) of its result). The recipe is held, so its id is not reused.
_OP_MEMO: dict[tuple, tuple[Recipe, dict[str, int], tuple[Any, Any]]] = {}
_OP_MEMO_MAX = 4096


def _memo_key(recipe: Recipe, operands: tuple[Any, ...], items: tuple) -> tuple | None:
    """`_OP_MEMO`'s key for this call; None when an operand is no traced block. (One and two
    operands, most ops, without a loop: this runs on every op.)"""
    n = len(operands)
    if n == 1:
        x = operands[0]
        if type(x) not in TRACER_TYPES:
            return None
        a = x.aval
        return (id(recipe), items, a.shape, a.dtype)
    if n == 2:
        x, z = operands
        if type(x) not in TRACER_TYPES or type(z) not in TRACER_TYPES:
            return None
        a, b = x.aval, z.aval
        return (id(recipe), items, a.shape, a.dtype, b.shape, b.dtype)
    if not all(type(x) in TRACER_TYPES for x in operands):
        return None
    return (id(recipe), items, *((x.aval.shape, x.aval.dtype) for x in operands))


def _remember(memo: tuple, recipe: Recipe, bound: list[dict[str, int] | None], y: Any) -> None:
    """After a call passed every check: the names its checks bound, and its result's type."""
    names: dict[str, int] = {}
    for b in bound:
        if b is None:  # passed without its names known: replaying would skip a check
            return
        names.update(b)
    if type(y) not in TRACER_TYPES:
        return
    if len(_OP_MEMO) >= _OP_MEMO_MAX:
        _OP_MEMO.clear()
    _OP_MEMO[memo] = (recipe, names, (y.aval.shape, y.aval.dtype))


def declare(x: Any, spec: ShapeSpec, recipe: Recipe, role: str, why: str = "") -> Any:
    """Leave an ``expect`` note when ``spec`` has a ``{+t}`` clause (checked after tracing)."""
    if not spec.pending:
        return x
    at = spec.pending_span
    pos, width = (at[0], at[1] - at[0]) if at else (None, 1)
    n = Note(
        "expect",
        spec.pending,
        recipe.op,
        recipe.spec.text,
        role=role,
        pos=pos,
        width=width,
        why=why,
    )
    return note(x, n)


def _manual(op: str, text: str, axes: tuple[str, ...]) -> dict[str, int]:
    """The manual axes, after checking that ``axes`` are among them."""
    manual = _context.manual_axis_sizes()
    for a in axes:
        if a not in manual:
            if not manual:
                raise ValueError(
                    f"{op}({text!r}) communicates over mesh axis {a!r}, so it must run inside a "
                    "shard_map body (use typed_shard_map); here no mesh axis is manual"
                )
            raise ValueError(
                f"{op}({text!r}): mesh axis {a!r} is not a manual axis of the enclosing "
                f"shard_map (manual axes: {format_sizes(manual)}){did_you_mean(a, manual)}"
                f"{_rules.role_hint(a)}"
            )
    return manual


def axis_size(recipe: AxesRecipe) -> int:
    """The size of the manual mesh axes ``recipe`` names (their product), as a Python int."""
    manual = _manual(recipe.op, recipe.text, recipe.axes)
    return math.prod(manual[a] for a in recipe.axes)


def axis_index(recipe: AxesRecipe) -> jax.Array:
    """This device's index along the manual mesh axes ``recipe`` names (row-major)."""
    _manual(recipe.op, recipe.text, recipe.axes)
    return lax.axis_index(axis_arg(recipe.axes))


class _OpFailure(Exception):
    """Base of the errors a shardops op raises for an exception JAX (or Python) raised in it.

    Each is also an instance of the original exception's type (a generated subclass), so
    ``except TypeError`` still catches it; the message names the op, its spec and its
    arguments, then keeps the original text.
    """

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


_FAILURE_TYPES: dict[type, type] = {}


def _failure_type(t: type) -> type:
    """A subclass of ``_OpFailure`` and ``t`` (or of TypeError/ValueError when ``t`` is final)."""
    cls = _FAILURE_TYPES.get(t)
    if cls is None:
        attrs = {
            "__module__": "shardlib.shardops",
            "__qualname__": t.__name__,
            "__init__": Exception.__init__,
        }
        try:
            cls = type(t.__name__, (_OpFailure, t), attrs)
        except TypeError:  # a type that cannot be subclassed (or laid out with ours)
            fallback = next((b for b in (ValueError, TypeError) if issubclass(t, b)), TypeError)
            cls = type(t.__name__, (_OpFailure, fallback), attrs)
        _FAILURE_TYPES[t] = cls
    return cls


def _describe_args(args: Mapping[str, Any]) -> str:
    """``"input f32[1, 4] per device"``: each argument with its dtype and shape."""
    where = " per device" if _context.manual_axis_sizes() else ""
    parts = []
    for name, v in args.items():
        if name.endswith("keyword arguments"):
            if v:
                parts.append(f"{name} " + ", ".join(f"{k}={w!r}" for k, w in v.items()))
        else:
            shown = short_value(v)
            parts.append(f"{name} {shown}{where if hasattr(v, 'shape') else ''}")
    return ", ".join(parts)


def _op_failure(
    recipe: Recipe, call: str, xs: list[Any], kwargs: Mapping[str, Any], e: Exception
) -> Exception:
    """What JAX raised (``e``) while ``recipe``'s op emitted ``call``, in shardops' words."""
    args: dict[str, Any] = dict(zip(recipe.roles, xs, strict=True))
    args["keyword arguments"] = kwargs
    msg = (
        f"{recipe.op}({recipe.spec.text!r}) on {_describe_args(args)}: {call.format(op=recipe.op)} "
        f"refused it; fix the spec or the arguments so that they agree. {type(e).__name__}: {e}"
    )
    try:
        return _failure_type(type(e))(msg)
    except Exception:  # pragma: no cover - see run()
        return e
