"""The strategies a plan searches besides meshes: the step's keyword arguments, and which of
their combinations trace to the same program.

A step that exposes a choice as a keyword argument (``remat: bool``, ``context: str``, a
pipeline schedule, a microbatch count) is planned over every combination of the values given
(``strategies={'remat': (False, True), 'context': ('ring', 'gathered')}``: their product, in
the order given, the last name varying fastest), each passed as ``step(*args, **strategy)``.
`combinations` checks and enumerates them; `bind` makes the step of one combination (one
callable per combination, so JAX's trace cache serves `shardlib.explain` and the roofline one
trace); `fingerprint` identifies a traced program exactly, so that combinations tracing to the
same program on a mesh are priced once.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import itertools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from .._env import programs
from .._env.frames import name_stack_of

__all__ = ["bind", "combinations", "fingerprint", "outline", "strategy_str"]

Strategy = dict[str, Any]


def combinations(
    step: Callable[..., Any], n_args: int, strategies: Mapping[str, Sequence[Any]] | None
) -> list[Strategy]:
    """Every combination of ``strategies``' values (their product, names in the order given,
    the last varying fastest), after checking that ``step`` takes each name as a keyword; one
    empty combination without strategies."""
    if strategies is None:
        return [{}]
    if not isinstance(strategies, Mapping):
        raise TypeError(
            f"plan: strategies={strategies!r} must map the step's keyword arguments to the "
            "values to try, e.g. {'remat': (False, True), 'context': ('ring', 'gathered')}"
        )
    for name, values in strategies.items():
        _check_values(name, values)
    _check_keywords(step, n_args, list(strategies))
    names = list(strategies)
    return [
        dict(zip(names, combo, strict=True))
        for combo in itertools.product(*(tuple(strategies[n]) for n in names))
    ]


def _check_values(name: Any, values: Any) -> None:
    if not isinstance(name, str) or not name.isidentifier():
        raise TypeError(
            f"plan: strategies names {name!r}; each name must be a keyword argument of the "
            "step (a Python identifier)"
        )
    if isinstance(values, str | bytes) or not isinstance(values, Sequence):
        raise TypeError(
            f"plan: strategies[{name!r}] = {values!r} must be a sequence (a tuple or a list, "
            f"in the order to try) of the values of {name!r}, e.g. {{{name!r}: ({values!r},)}}"
            if isinstance(values, str | bytes)
            else f"plan: strategies[{name!r}] = {values!r} must be a sequence (a tuple or a "
            f"list, in the order to try) of the values of {name!r}"
        )
    if not values:
        raise ValueError(
            f"plan: strategies[{name!r}] is empty: give at least one value of {name!r} to "
            "try, or leave the name out"
        )
    twice = [v for i, v in enumerate(values) if any(_same(v, w) for w in values[:i])]
    if twice:
        raise ValueError(
            f"plan: strategies[{name!r}] = {values!r} gives {twice[0]!r} more than once; "
            "list each value once"
        )


def _same(a: Any, b: Any) -> bool:
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:  # noqa: BLE001 - an array compares elementwise: not a plain value
        return a is b


def _check_keywords(step: Callable[..., Any], n_args: int, names: list[str]) -> None:
    """Each name is a parameter of ``step`` that can be given by keyword, and not one the
    positional arguments already fill (where ``inspect.signature`` can read the step)."""
    try:
        params = inspect.signature(step).parameters
    except (TypeError, ValueError):  # a builtin or a callable without a signature: unchecked
        return
    kinds = [p.kind for p in params.values()]
    takes_any = inspect.Parameter.VAR_KEYWORD in kinds
    positional = [
        n
        for n, p in params.items()
        if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    ]
    keywords = [
        n
        for n, p in params.items()
        if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    ]
    filled = positional[:n_args]
    step_name = getattr(step, "__qualname__", None) or type(step).__name__
    for name in names:
        if name in filled:
            raise ValueError(
                f"plan: strategies names {name!r}, which {step_name} already gets as its "
                f"positional argument {filled.index(name)} of *args; a strategy is passed by "
                "keyword, so give it a parameter after the arguments"
            )
        if name in params and params[name].kind is inspect.Parameter.POSITIONAL_ONLY:
            raise ValueError(
                f"plan: strategies names {name!r}, a positional-only parameter of {step_name}; "
                "a strategy is passed by keyword (step(*args, **strategy))"
            )
        if name not in params and not takes_any:
            raise ValueError(
                f"plan: strategies names {name!r}, which {step_name} does not take as a "
                f"keyword argument (it takes {', '.join(keywords) or 'none'}); the step "
                "receives each strategy as step(*args, **strategy)"
            )


def bind(step: Callable[..., Any], strategy: Strategy) -> Callable[..., Any]:
    """``step`` with ``strategy``'s keyword arguments given (the step itself when there are
    none). Make it once per combination: JAX's trace cache knows a callable by identity."""
    return functools.partial(step, **strategy) if strategy else step


def strategy_str(strategy: Strategy) -> str:
    """``"remat=True, context='ring'"``: a strategy as the plan's table shows it."""
    return ", ".join(f"{k}={v!r}" for k, v in strategy.items())


def outline(jaxpr: Any) -> tuple[str, ...]:
    """The primitives of a traced program and of the programs nested in it, in order: equal
    for the same program, and cheap (a tenth of `fingerprint`'s time), so `fingerprint` runs
    only for programs whose outlines agree."""
    return tuple(e.primitive.name for e in programs.iter_eqns(programs.open_program(jaxpr)))


def fingerprint(jaxpr: Any) -> bytes:
    """A digest that two traced programs share exactly when they are the same program: the
    same equations in the same order (each one's primitive, parameters, types and named
    scopes: explain reads ops from the scopes), the same literals and constants (by value) and
    the same inputs and outputs. Not the source lines, which change no cost.

    Parameters are compared by their ``repr`` (a program inside a parameter by its own
    digest; an array by its bytes). The caller keeps every program it compares alive while it
    compares, so two distinct objects never share a default ``repr`` (its address)."""
    h = hashlib.sha256()
    _digest(programs.open_program(jaxpr), h, {})
    return h.digest()


def _digest(program: programs.Program, h: Any, seen: dict[tuple[int, ...], bytes]) -> None:
    names: dict[Any, int] = {}

    def atom(a: Any) -> str:
        if programs.is_literal(a):
            return "lit " + _value(programs.literal_value(a)) + " " + str(a.aval)
        if programs.is_dropped(a):
            return "_"
        return str(names.setdefault(a, len(names)))

    def bound(v: Any) -> str:
        if programs.is_dropped(v):
            return "_:" + str(v.aval)
        names[v] = len(names)
        return f"{names[v]}:{v.aval}"

    h.update(
        f"in {[bound(v) for v in program.constvars]} {[bound(v) for v in program.invars]}".encode()
    )
    h.update(f"consts {[_value(c) for c in program.consts]}".encode())
    for eqn in program.eqns:
        params = [f"{k}={_param(v, seen)}" for k, v in sorted(programs.all_params(eqn).items())]
        ins = [atom(a) for a in eqn.invars]
        outs = [bound(v) for v in eqn.outvars]
        h.update(
            f"\n{outs} = {eqn.primitive.name}[{' '.join(params)}] {ins} # {name_stack_of(eqn)}".encode()
        )
    h.update(f"\nout {[atom(a) for a in program.outvars]}".encode())


def _param(v: Any, seen: dict[tuple[int, ...], bytes]) -> str:
    if programs.is_program(v):
        sub = programs.open_program(v)
        key = (sub.key, *map(id, sub.consts))  # the same equations may close over other values
        if key not in seen:
            h = hashlib.sha256()
            _digest(sub, h, seen)
            seen[key] = h.digest()
        return "{" + seen[key].hex() + "}"
    if isinstance(v, tuple | list):
        return ("(" if isinstance(v, tuple) else "[") + ",".join(_param(x, seen) for x in v) + ")"
    if isinstance(v, np.ndarray):
        return _value(v)
    return repr(v)


def _value(x: Any) -> str:
    """A literal's or a constant's value, exactly: its type and its bytes."""
    try:
        a = np.asarray(x)
    except Exception:  # noqa: BLE001 - a value without a host copy (a key array): its identity
        return f"<{type(x).__name__} {id(x)}>"
    if a.dtype == object:
        return f"<{type(x).__name__} {id(x)}>"
    return f"{a.dtype.str}{a.shape}:{hashlib.sha256(a.tobytes()).hexdigest()}"
