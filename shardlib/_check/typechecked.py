"""``typechecked``: check a function's annotated arguments and result, in a scope of its own.

No source is read and nothing is instrumented: the decorator binds the arguments with the
function's signature, pushes a fresh `Scope` for the call (the one ``shardops`` and
``check`` in the body read), checks each annotated argument with typeguard
(``typeguard.check_type_internal``, so shardlib's types, pytree dataclasses, stacks and any
type typeguard knows are checked), runs the function, checks its result and pops the scope.

Generators keep their scope across ``next()``/``send()``: it is pushed each time the
generator's own code runs and popped when it yields, and yielded, sent and returned values
are checked against ``Generator[Y, S, R]`` (or ``Iterator[Y]``/``Iterable[Y]``). Coroutines
push it for the whole ``await``; asyncio gives each task its own context, hence its own
bindings.
"""

from __future__ import annotations

import collections.abc
import contextlib
import functools
import inspect
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

from typeguard import TypeCheckError, check_type_internal

from .._env import frames as _frames
from .._env.annotations import resolve_hints, unresolved
from .checking import check_value, seen_before, seen_prefix
from .scopes import CallMemo, Scope, pop, push
from .types import ArrayType

__all__ = ["typechecked"]

_F = TypeVar("_F", bound=Callable[..., Any])
_ANY = object()  # "not annotated": nothing to check
_GENERATORS = (
    collections.abc.Generator,
    collections.abc.Iterator,
    collections.abc.Iterable,
    collections.abc.AsyncGenerator,
    collections.abc.AsyncIterator,
    collections.abc.AsyncIterable,
)


@dataclass(frozen=True)
class _Checks:
    """What to check on each call: resolved once, on the first call at the latest."""

    params: tuple[tuple[str, Any, Any], ...]  # (name, kind, annotation) of annotated params
    positional: tuple[str, ...]  # names that positional arguments fill, in order
    result: Any  # the return annotation, or _ANY
    yields: Any = _ANY  # for generators: the annotations of yielded, sent, returned values
    sends: Any = _ANY
    returns: Any = _ANY
    # The fast path: when every parameter is positional and annotated with an array type
    # (``f32[Array, b"..."]``), its ('argument "name"', dtype, spec) in order; None otherwise.
    arrays: tuple[tuple[str, Any, Any], ...] | None = None


def _generator_parts(ann: Any) -> tuple[Any, Any, Any]:
    """``(yield, send, return)`` annotations of a generator's return annotation."""
    origin = typing.get_origin(ann)
    if origin not in _GENERATORS:
        return _ANY, _ANY, _ANY
    args = [_ANY if a is Any else a for a in typing.get_args(ann)] + [_ANY] * 3
    if origin in (collections.abc.Generator, collections.abc.AsyncGenerator):
        return args[0], args[1], args[2] if origin is collections.abc.Generator else _ANY
    return args[0], _ANY, _ANY


def _make_checks(f: Callable, sig: inspect.Signature, hints: dict[str, Any]) -> _Checks:
    params = tuple(
        (p.name, p.kind, hints[p.name])
        for p in sig.parameters.values()
        if p.name in hints and hints[p.name] is not Any
    )
    positional = tuple(
        p.name
        for p in sig.parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    )
    result = hints.get("return", _ANY)
    result = _ANY if result is Any else result
    if inspect.isgeneratorfunction(f) or inspect.isasyncgenfunction(f):
        y, s, r = _generator_parts(result)
        return _Checks(params, positional, _ANY, y, s, r)
    arrays = None
    if len(params) == len(sig.parameters) == len(positional) and all(
        _is_plain_array(ann) for _, _, ann in params
    ):
        arrays = tuple((f'argument "{name}"', ann.dtype, ann.spec) for name, _, ann in params)
    return _Checks(params, positional, result, arrays=arrays)


def _is_plain_array(ann: Any) -> bool:
    return isinstance(ann, type) and issubclass(ann, ArrayType) and ann.spec is not None


def _error(e: TypeCheckError, owner: str, what: str, value: Any) -> TypeCheckError:
    """``in f(): argument "x" ...``: ``e`` naming the function and the value checked."""
    shown = what if hasattr(value, "shape") else f"{what} ({type(value).__qualname__})"
    e.append_path_element(shown)
    msg = f"in {owner}(): {e}"
    try:
        new = type(e)(msg)  # keep the class (a PendingReductionError stays one)
    except Exception:  # pragma: no cover - a subclass with another constructor
        new = TypeCheckError(msg)
    return new


def _check_array(value: Any, dtype: Any, spec: Any, s: Scope, owner: str, what: str) -> None:
    """`_check` for a plain array annotation, already taken apart (the fast path)."""
    if seen_before(value, dtype, spec, s):  # before building the message's closure
        return
    try:
        check_value(value, dtype, spec, s, where="", describe=lambda: f"{what} in {owner}()")
    except TypeCheckError as e:
        raise _error(e, owner, what, value) from None


def _check(value: Any, ann: Any, memo: CallMemo, what: str) -> None:
    """Check one value against ``ann`` in ``memo``'s scope; raise naming the function."""
    memo.what = what
    try:
        if _is_plain_array(ann):
            # The common case, without typeguard's dispatch: the same check and message.
            check_value(
                value,
                ann.dtype,
                ann.spec,
                memo.scope,
                where="",
                describe=lambda: f"{what} in {memo.owner}()",
            )
        else:
            check_type_internal(value, ann, memo)
    except TypeCheckError as e:
        raise _error(e, memo.owner, what, value) from None


class _Checker:
    """Per decorated function: its signature, and its annotations once they resolve."""

    def __init__(self, f: Callable, decorating_locals: dict[str, Any] | None) -> None:
        self.f = f
        self.owner = getattr(f, "__qualname__", None) or repr(f)
        self.sig = inspect.signature(f)
        self.locals = decorating_locals
        self.globals: dict[str, Any] = getattr(f, "__globals__", {})
        self.checks: _Checks | None = None
        # Copies of ``checks.arrays`` and ``checks.result`` once resolved (read on each call).
        self.arrays: tuple[tuple[str, Any, Any], ...] | None = None
        self.result: Any = _ANY

    def resolve(self) -> _Checks:
        """The checks, resolving the annotations now if that was not possible before."""
        if self.checks is None:
            try:
                hints = resolve_hints(self.f, self.locals, include_extras=True)
            except NameError:
                what, name = unresolved(self.f, self.locals) or ("an annotation", "?")
                raise TypeError(
                    f"typechecked({self.owner}): cannot resolve the annotation of {what}: name "
                    f"{name!r} is not defined in {self.owner}'s module, its closure or the "
                    "scope that decorated it; define it before the first call (at module "
                    "level, or in the decorating function before decorating)"
                ) from None
            self.checks = _make_checks(self.f, self.sig, hints)
            self.arrays, self.result = self.checks.arrays, self.checks.result
            self.locals = None
        return self.checks

    def arguments(self, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
        """Argument name -> value for this call (defaults included)."""
        checks = self.resolve()
        if not kwargs and len(args) <= len(checks.positional) and not self._varargs:
            given = dict(zip(checks.positional, args, strict=False))
            for name, _, _ in checks.params:
                if name not in given:
                    default = self.sig.parameters[name].default
                    if default is not inspect.Parameter.empty:
                        given[name] = default
            return given
        try:
            bound = self.sig.bind(*args, **kwargs)
        except TypeError as e:
            raise TypeError(f"{self.owner}(): {e}") from None
        bound.apply_defaults()
        return bound.arguments

    @functools.cached_property
    def _varargs(self) -> bool:
        return any(
            p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in self.sig.parameters.values()
        )

    def enter(self, args: tuple, kwargs: dict[str, Any]) -> CallMemo:
        """A fresh scope for a call (in a memo), with the call's arguments checked in it."""
        checks = self.resolve()
        memo = CallMemo(self.globals, Scope(self.owner), "", self.owner)
        if not checks.params:
            return memo
        arguments = self.arguments(args, kwargs)
        for name, kind, ann in checks.params:
            if name not in arguments:
                continue
            value = arguments[name]
            if kind == inspect.Parameter.VAR_POSITIONAL:
                for i, v in enumerate(value):
                    _check(v, ann, memo, f'argument "{name}[{i}]"')
            elif kind == inspect.Parameter.VAR_KEYWORD:
                for k, v in value.items():
                    _check(v, ann, memo, f'argument "{k}"')
            else:
                _check(value, ann, memo, f'argument "{name}"')
        return memo


def _plain(c: _Checker) -> Callable:
    @_frames.pusher
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:  # free until something is raised (CPython 3.11)
            memo: CallMemo | None = None
            arrays = c.arrays
            if arrays is not None and not kwargs and len(args) == len(arrays):
                # The common case, inline (each call level costs): all arguments plain arrays,
                # most of them checked before (by identity).
                s = Scope(c.owner)
                n = seen_prefix(args, arrays, s.bindings)
                if n < len(args):
                    for (what, dtype, spec), value in zip(arrays[n:], args[n:], strict=True):
                        _check_array(value, dtype, spec, s, c.owner, what)
            else:
                memo = c.enter(args, kwargs)
                s = memo.scope
            token = push((s, None))
            try:
                out = c.f(*args, **kwargs)
            finally:
                pop(token)
            result = c.result
            if result is _ANY:
                return out
            if memo is None and _is_plain_array(result):
                _check_array(out, result.dtype, result.spec, s, c.owner, "the return value")
            else:
                if memo is None:
                    memo = CallMemo(c.globals, s, "", c.owner)
                _check(out, result, memo, "the return value")
            return out
        except Exception as e:  # the user's frames only, as JAX shows them
            _frames.hide_library_frames(e)
            raise

    return wrapper


def _coroutine(c: _Checker) -> Callable:
    @_frames.pusher
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        memo = c.enter(args, kwargs)
        # Pushed in this task's context: other tasks, and this one once it returns, do not
        # see it; while the coroutine awaits, only this task resumes it.
        token = push((memo.scope, None))
        try:
            out = await c.f(*args, **kwargs)
        finally:
            pop(token)
        if c.result is not _ANY:
            _check(out, c.result, memo, "the return value")
        return out

    return wrapper


class _GeneratorCall:
    """One call of a checked generator or async generator: its scope, its checks, and what the
    consumer sent or threw in last. The two wrappers below share it; they differ only in how
    they resume the generator (``send``/``throw``, or ``asend``/``athrow`` awaited) and close it.
    """

    def __init__(self, c: _Checker, args: tuple, kwargs: dict[str, Any]) -> None:
        self.memo = c.enter(args, kwargs)
        self.checks: _Checks = c.checks  # type: ignore[assignment]
        self.sent: Any = None
        self.thrown: BaseException | None = None
        self.finished = False
        self.value: Any = None  # what the generator returned, once finished

    def check(self, value: Any, ann: Any, what: str) -> None:
        if ann is not _ANY:
            _check(value, ann, self.memo, what)

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """Around one step: the generator's own code runs in its scope (the consumer's, between
        yields, does not); its end is recorded and its return value checked."""
        token = push((self.memo.scope, None))
        try:
            yield
        except (StopIteration, StopAsyncIteration) as stop:
            self.finished = True
            self.value = getattr(stop, "value", None)  # StopAsyncIteration carries none
            self.check(self.value, self.checks.returns, "the return value")
        finally:
            pop(token)

    @contextlib.contextmanager
    def consumer(self) -> Iterator[None]:
        """Around a yield: what the consumer sends is checked; what it throws in is kept for
        the next step (all but ``GeneratorExit``, which closes the generator)."""
        self.thrown = None
        try:
            yield
        except GeneratorExit:
            raise
        except BaseException as e:  # noqa: BLE001 - thrown in by the consumer: pass it on
            self.thrown = e
        else:
            self.check(self.sent, self.checks.sends, "a sent value")


def _generator(c: _Checker) -> Callable:
    @_frames.pusher
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        call = _GeneratorCall(c, args, kwargs)
        gen = c.f(*args, **kwargs)
        while True:
            with call.running():
                y = gen.throw(call.thrown) if call.thrown is not None else gen.send(call.sent)
                call.check(y, call.checks.yields, "a yielded value")
            if call.finished:
                return call.value
            try:
                with call.consumer():
                    call.sent = yield y
            except GeneratorExit:
                gen.close()
                raise

    return wrapper


def _async_generator(c: _Checker) -> Callable:
    @_frames.pusher
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        call = _GeneratorCall(c, args, kwargs)
        gen = c.f(*args, **kwargs)
        while True:
            with call.running():
                thrown = call.thrown
                y = await (gen.athrow(thrown) if thrown is not None else gen.asend(call.sent))
                call.check(y, call.checks.yields, "a yielded value")
            if call.finished:
                return
            try:
                with call.consumer():
                    call.sent = yield y
            except GeneratorExit:
                await gen.aclose()
                raise

    return wrapper


def typechecked(f: _F) -> _F:
    """Decorator: check ``f``'s annotated arguments and result, each call in its own scope.

    Each call gets a fresh binding scope, shared by all its annotations and by the
    ``shardops`` and ``check`` calls in its body, and checks every annotated argument and
    the return value with typeguard: shardlib array types (``f32[b'batch/d len']`` or
    ``f32['batch/d len']``), pytree dataclasses, ``Array['layers', T]``, and any type
    typeguard knows. Every item of a ``list``, ``tuple[X, ...]``, ``Sequence``, ``dict`` or
    ``Mapping`` whose item type holds a shardlib type is checked (typeguard alone checks only
    the first), each at about the cost of one argument, with the names bound across items.
    Works for functions without source (``exec``, a REPL), methods, generators
    (yielded/sent/returned values are checked; the scope is the generator's own across
    ``next()``) and ``async`` functions (each call, hence each task, its own bindings).
    Annotated local variables are not checked: call ``shardtypes.check(dtype, spec, value)``
    in the body for that.

    **Raises:** ``typeguard.TypeCheckError`` naming the function and the argument, e.g.
    ``in step(): argument "x" does not match f32['batch len']: ...``; ``TypeError`` on the
    first call if an annotation names something that is not defined.

    Examples:
        >>> @typechecked
        ... def f(x: f32['batch len'], w: f32['len out']) -> f32['batch out']:
        ...     return shardops.einsum_unreduced('batch len, len out -> batch out', x, w)
    """
    if isinstance(f, staticmethod | classmethod):
        return type(f)(typechecked(f.__func__))  # type: ignore[return-value]
    if not callable(f):
        raise TypeError(f"typechecked: expected a function, got {type(f).__qualname__}")
    c = _Checker(f, None)
    try:
        c.resolve()
    except TypeError:
        # Names local to the decorating function, used in string annotations: read them
        # now (the frame is gone later); the first call resolves, or says what is missing.
        c.checks = None
        c.locals = _frames.frame_locals(_frames.caller_frame(1))
        try:
            c.resolve()
        except TypeError:
            c.checks = None
    if inspect.isasyncgenfunction(f):
        wrapper = _async_generator(c)
    elif inspect.isgeneratorfunction(f):
        wrapper = _generator(c)
    elif inspect.iscoroutinefunction(f):
        wrapper = _coroutine(c)
    else:
        wrapper = _plain(c)
    return functools.wraps(f)(wrapper)  # type: ignore[return-value]
