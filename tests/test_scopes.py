"""Binding scopes: each checked call owns its bindings, in every way code can run.

``shardlib.typechecked`` (and a ``typed_shard_map`` body, ``Scope``, ``@scope``) push a
fresh scope for the call and pop it when the call ends; ``shardops`` and ``check`` read the
current one. Threads, asyncio tasks, recursion, generators and nested checked calls of
every kind keep their own: a dim bound to 3 in one call never leaks into another, and a
mismatch inside one call is still caught against that call's own bindings.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncGenerator, AsyncIterator, Generator, Iterator

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import typeguard
from typeguard import TypeCheckError

from shardlib import shardops
from shardlib._check import scopes as _scopes
from shardlib._check.typechecked import typechecked
from shardlib.shardtypes import (
    Array,
    Scope,
    check,
    f32,
    i32,
    pytree_dataclass,
    scope,
    typed_shard_map,
)
from tests._mesh_util import make_mesh

MESH = make_mesh((8,), ("d",))


def zeros(*shape: int) -> jax.Array:
    return jnp.zeros(shape, jnp.float32)


def arange(*shape: int) -> np.ndarray:
    return np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape)


# ---------------------------------------------------------------------------------------------
# The decorator itself: arguments, result, messages
# ---------------------------------------------------------------------------------------------


@typechecked
def matvec(x: f32["n k"], w: f32["k"]) -> f32["n"]:  # noqa: F821, UP037 - str specs work
    return shardops.einsum_unreduced("n k, k -> n", x, w)


@typechecked
def contradicts(x: f32[b"a b"], y: f32[b"c d"]) -> f32[b"b a"]:
    return shardops.einsum_unreduced("c d -> d c", x)  # x's dims called c d: y bound them


def test_arguments_result_and_body_share_one_scope() -> None:
    x, w = arange(3, 4), arange(4)
    np.testing.assert_allclose(np.asarray(matvec(jnp.asarray(x), jnp.asarray(w))), x @ w)
    with pytest.raises(TypeCheckError) as e:
        matvec(zeros(3, 4), zeros(5))
    msg = str(e.value)
    assert msg.startswith("in matvec(): argument \"w\" does not match f32['k']"), msg
    assert "expected size 4 (k=4 is already bound), got 5" in msg
    with pytest.raises(TypeCheckError) as e:
        contradicts(zeros(2, 3), zeros(3, 4))
    assert "c=3 is already bound" in str(e.value) and "einsum_unreduced" in str(e.value)
    # the same body with consistent sizes runs and returns the transpose
    out = contradicts(jnp.asarray(arange(2, 3)), zeros(2, 3))
    np.testing.assert_array_equal(np.asarray(out), arange(2, 3).T)


@typechecked
def wrong_return(x: f32[b"n"]) -> f32[b"n"]:
    return x[:1]


@typechecked
def plain_types(n: int, name: str = "x") -> list[int]:
    return [n] * len(name)


def test_return_and_other_types_are_checked() -> None:
    with pytest.raises(TypeCheckError) as e:
        wrong_return(zeros(3))
    assert str(e.value).startswith("in wrong_return(): the return value does not match")
    assert "expected size 3 (n=3 is already bound), got 1" in str(e.value)
    assert plain_types(2, "ab") == [2, 2]
    with pytest.raises(TypeCheckError, match=r'in plain_types\(\): argument "n" \(str\)'):
        plain_types("2")  # type: ignore[arg-type]
    with pytest.raises(TypeCheckError, match=r'argument "name" \(int\)'):
        plain_types(2, name=3)  # type: ignore[arg-type]


@pytree_dataclass
class Pair:
    a: f32[b"n k"]
    b: f32[b"k"]


@typechecked
def pair_sum(p: Pair, stack: Array[b"layers", f32[b"k"]]) -> f32[b"n"]:
    return p.a @ p.b + stack.sum()


def test_pytree_dataclasses_and_stacks() -> None:
    p = Pair(a=jnp.asarray(arange(2, 3)), b=jnp.ones(3))
    out = pair_sum(p, jnp.ones((5, 3)))
    np.testing.assert_allclose(np.asarray(out), arange(2, 3).sum(1) + 15)
    with pytest.raises(TypeCheckError) as e:
        pair_sum(Pair(a=zeros(2, 3), b=zeros(4)), zeros(5, 3))
    msg = str(e.value)
    assert 'field "b" of argument "p"' in msg and "k=3 is already bound" in msg, msg
    with pytest.raises(TypeCheckError, match=r"stack(.|\n)*k=3 is already bound"):
        pair_sum(p, zeros(5, 4))


def test_function_defined_with_exec() -> None:
    source = (
        "def scaled(x: f32['n'], y: f32['n']) -> f32['n']:\n"
        "    check(jnp.float32, 'n', y)\n"
        "    return x * y\n"
    )
    ns = {"f32": f32, "check": check, "jnp": jnp}
    exec(compile(source, "<repl>", "exec"), ns)
    scaled = typechecked(ns["scaled"])
    np.testing.assert_array_equal(np.asarray(scaled(jnp.arange(3.0), jnp.full(3, 2.0))), [0, 2, 4])
    with pytest.raises(TypeCheckError, match=r"in scaled\(\): argument \"y\"(.|\n)*n=3"):
        scaled(zeros(3), zeros(4))


class Model:
    def __init__(self, k: float) -> None:
        self.k = k

    @typechecked
    def apply(self, x: f32[b"n"]) -> f32[b"n"]:
        check(jnp.float32, "n", x)
        return x * self.k

    @staticmethod
    @typechecked
    def twice(x: f32[b"n"]) -> f32[b"n"]:
        return 2 * x

    @classmethod
    @typechecked
    def build(cls, x: f32[b"n"]) -> Model:
        return cls(float(x.shape[0]))


def test_methods() -> None:
    m = Model(3.0)
    np.testing.assert_array_equal(np.asarray(m.apply(jnp.ones(2))), [3, 3])
    np.testing.assert_array_equal(np.asarray(Model.twice(jnp.ones(2))), [2, 2])
    assert Model.build(jnp.ones(4)).k == 4.0
    with pytest.raises(TypeCheckError, match=r"Model.apply\(\): argument \"x\""):
        m.apply(jnp.ones(2, jnp.int32))


@typechecked
def uses_later(x: LaterType) -> LaterType:  # noqa: F821 - defined below, resolved lazily
    return x


LaterType = f32["z"]


def test_annotations_resolved_lazily_and_from_the_decorating_scope() -> None:
    assert uses_later(zeros(3)).shape == (3,)
    local = f32["q"]  # a local used in a string annotation: not in the closure

    @typechecked
    def k(x: local) -> local:
        return x[:1]

    with pytest.raises(TypeCheckError, match=r"q=3 is already bound"):
        k(zeros(3))

    @typechecked
    def missing(x: NotDefinedAnywhere) -> None:  # noqa: F821
        pass

    with pytest.raises(TypeError) as e:
        missing(zeros(3))
    msg = str(e.value)
    assert "missing" in msg and "parameter 'x'" in msg and "'NotDefinedAnywhere'" in msg, msg


# ---------------------------------------------------------------------------------------------
# Threads, tasks, recursion, generators
# ---------------------------------------------------------------------------------------------


@typechecked
def bind_wait_check(x: f32[b"n"], barrier: threading.Barrier) -> f32[b"n"]:
    barrier.wait()  # every thread has bound its own n
    check(jnp.float32, "n", jnp.zeros(x.shape[0]))
    with pytest.raises(TypeCheckError) as e:
        check(jnp.float32, "n", jnp.zeros(x.shape[0] + 1))
    assert f"n={x.shape[0]} is already bound" in str(e.value)
    barrier.wait()
    return x + 1


def test_threads_keep_their_own_bindings() -> None:
    barrier = threading.Barrier(4, timeout=60)
    results: dict[int, np.ndarray] = {}
    errors: list[BaseException] = []

    def work(n: int) -> None:
        try:
            results[n] = np.asarray(bind_wait_check(jnp.arange(float(n)), barrier))
        except BaseException as e:  # noqa: BLE001 - handed to the main thread
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=work, args=(n,)) for n in (2, 3, 5, 7)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    assert not errors, errors
    for n in (2, 3, 5, 7):
        np.testing.assert_array_equal(results[n], np.arange(n) + 1)


@typechecked
async def bind_await_check(x: f32[b"n"]) -> f32[b"n"]:
    for _ in range(3):
        await asyncio.sleep(0)  # the other tasks run and bind their own n
        check(jnp.float32, "n", jnp.zeros(x.shape[0]))
    try:
        check(jnp.float32, "n", jnp.zeros(x.shape[0] + 1))
    except TypeCheckError as e:
        assert f"n={x.shape[0]} is already bound" in str(e)
    else:  # pragma: no cover - the assertion fails the test
        raise AssertionError("mismatch not caught")
    return x * 2


@typechecked
async def bad_async(x: f32[b"n"]) -> f32[b"n"]:
    await asyncio.sleep(0)
    return x[:1]


def test_asyncio_tasks_keep_their_own_bindings() -> None:
    async def main() -> list[jax.Array]:
        return await asyncio.gather(*(bind_await_check(jnp.arange(float(n))) for n in (2, 3, 4)))

    for n, out in zip((2, 3, 4), asyncio.run(main()), strict=True):
        np.testing.assert_array_equal(np.asarray(out), 2 * np.arange(n))
    with pytest.raises(TypeCheckError, match=r"in bad_async\(\): the return value"):
        asyncio.run(bad_async(zeros(3)))
    assert _scopes._CURRENT.get() is None  # nothing left pushed


@typechecked
def recurse(x: f32[b"n"], depth: int) -> f32[b"n"]:
    if depth:
        inner = recurse(x[:-1], depth - 1)  # binds its own, smaller n
        assert inner.shape[0] == x.shape[0] - 1
    check(jnp.float32, "n", jnp.zeros(x.shape[0]))  # this call's n, after the inner returned
    return x + depth


def test_recursion() -> None:
    np.testing.assert_array_equal(np.asarray(recurse(jnp.arange(5.0), 3)), np.arange(5) + 3)


@typechecked
def rows(x: f32[b"n k"]) -> Iterator[f32[b"k"]]:
    for row in x:
        check(jnp.float32, "n k", jnp.zeros((x.shape[0], x.shape[1])))  # own n, k every time
        yield row


@typechecked
def bad_rows(x: f32[b"n k"]) -> Iterator[f32[b"k"]]:
    yield x[0]
    yield x[0, :1]


@typechecked
def echo(x: f32[b"k"]) -> Generator[f32[b"k"], int, str]:
    got = yield x
    while got:
        got = yield x * got
    return "done"


def test_generators_keep_their_own_scope_across_next() -> None:
    a, b = jnp.asarray(arange(3, 4)), jnp.asarray(arange(2, 5))
    ga, gb = rows(a), rows(b)
    first = next(ga)
    # The consumer is not in the generator's scope between yields.
    check(jnp.float32, "n k", zeros(7, 7))
    with Scope() as s:
        check(jnp.float32, "n", zeros(9))
    assert s.bindings == {"n": 9}
    # Two generators of different sizes, interleaved: each resumes in its own scope.
    pairs = list(zip(ga, gb, strict=False))
    assert len(pairs) == 2
    np.testing.assert_array_equal(np.asarray(first), arange(3, 4)[0])
    np.testing.assert_array_equal(np.asarray(pairs[1][0]), arange(3, 4)[2])
    np.testing.assert_array_equal(np.asarray(pairs[1][1]), arange(2, 5)[1])
    with pytest.raises(TypeCheckError, match=r"in bad_rows\(\): a yielded value(.|\n)*k=2"):
        list(bad_rows(zeros(3, 2)))
    g = echo(jnp.ones(2))
    np.testing.assert_array_equal(np.asarray(next(g)), [1, 1])
    np.testing.assert_array_equal(np.asarray(g.send(3)), [3, 3])
    with pytest.raises(StopIteration) as stop:
        g.send(0)
    assert stop.value.value == "done"
    g = echo(jnp.ones(2))
    next(g)
    with pytest.raises(TypeCheckError, match=r"a sent value \(str\)"):
        g.send("x")


@typechecked
def catching(x: f32[b"k"], log: list[str]) -> Generator[f32[b"k"], None, str]:
    """Yields ``x``; after a ValueError thrown in, yields ``2x`` in its own scope; logs its end."""
    try:
        yield x
    except ValueError as e:
        log.append(f"caught {e}")
        check(jnp.float32, "k", jnp.zeros(x.shape[0]))  # its own k, after the throw
        yield 2 * x
    finally:
        log.append("closed")
    return "unreachable"


def test_generators_pass_throw_and_close_on() -> None:
    log: list[str] = []
    g = catching(jnp.ones(2), log)
    next(g)
    np.testing.assert_array_equal(np.asarray(g.throw(ValueError("boom"))), [2, 2])
    g.close()
    assert log == ["caught boom", "closed"]
    g = catching(jnp.ones(2), log)
    next(g)
    with pytest.raises(KeyError):  # not caught by the generator: it ends, and says so
        g.throw(KeyError("other"))
    assert log[-1] == "closed"
    assert _scopes._CURRENT.get() is None  # nothing left pushed


@typechecked
async def arows(x: f32[b"n k"]) -> AsyncGenerator[f32[b"k"], int | None]:
    """Row ``i`` times what was sent (1 at first), checking its own n, k at every step."""
    scale = 1
    for row in x:
        await asyncio.sleep(0)  # the other generators run and bind their own n, k
        try:
            check(jnp.float32, "k", jnp.zeros(x.shape[1] + 1))
        except TypeCheckError:
            pass  # k is bound in this call's scope, at every step
        else:  # pragma: no cover - the assertion fails the test
            raise AssertionError("the generator does not run in its own scope")
        check(jnp.float32, "n k", jnp.zeros((x.shape[0], x.shape[1])))
        got = yield row * scale
        scale = 1 if got is None else got


@typechecked
async def acatching(x: f32[b"k"], log: list[str]) -> AsyncIterator[f32[b"k"]]:
    """As `catching`, asynchronously."""
    try:
        yield x
    except ValueError as e:
        log.append(f"caught {e}")
        check(jnp.float32, "k", jnp.zeros(x.shape[0]))
        yield 2 * x
    finally:
        log.append("closed")


@typechecked
async def bad_arows(x: f32[b"n k"]) -> AsyncIterator[f32[b"k"]]:
    yield x[0]
    yield x[0, :1]


def test_async_generators_keep_their_own_scope_and_check_their_values() -> None:
    async def rows_of(n: int, k: int) -> list[np.ndarray]:
        return [np.asarray(r) async for r in arows(jnp.asarray(arange(n, k)))]

    async def main() -> list[list[np.ndarray]]:
        return await asyncio.gather(rows_of(3, 4), rows_of(2, 5), rows_of(4, 1))

    for (n, k), got in zip(((3, 4), (2, 5), (4, 1)), asyncio.run(main()), strict=True):
        np.testing.assert_array_equal(np.stack(got), arange(n, k))

    async def sends() -> None:
        g = arows(jnp.asarray(arange(3, 2)))
        np.testing.assert_array_equal(np.asarray(await g.asend(None)), [0, 1])
        np.testing.assert_array_equal(np.asarray(await g.asend(3)), [6, 9])
        with pytest.raises(TypeCheckError, match=r"in arows\(\): a sent value \(str\)"):
            await g.asend("x")
        g = arows(jnp.asarray(arange(3, 2)))
        await g.asend(None)
        with pytest.raises(KeyError):  # thrown in, passed on, not caught
            await g.athrow(KeyError("stop"))
        with pytest.raises(StopAsyncIteration):
            await g.asend(None)
        log: list[str] = []
        g = acatching(jnp.ones(2), log)
        await g.asend(None)
        np.testing.assert_array_equal(np.asarray(await g.athrow(ValueError("boom"))), [2, 2])
        await g.aclose()
        assert log == ["caught boom", "closed"]
        with pytest.raises(TypeCheckError, match=r"in bad_arows\(\): a yielded value(.|\n)*k=2"):
            _ = [r async for r in bad_arows(zeros(3, 2))]

    asyncio.run(sends())
    assert _scopes._CURRENT.get() is None  # nothing left pushed


# ---------------------------------------------------------------------------------------------
# Nested checked calls of every kind
# ---------------------------------------------------------------------------------------------


@typechecked
def per_device(y: f32[b"m/d j"]) -> f32[b"m/d"]:
    check(jnp.float32, "m/d j", y)  # its own m and j
    return y.sum(-1)


@typed_shard_map
def tsm_body(x: f32[b"n/d k"]) -> f32[b"n/d"]:
    part = per_device(x[:, :2])  # j=2 inside, while this body has k=4
    check(jnp.float32, "n/d k", x)  # the body's own bindings, after per_device returned
    return part + x[:, 2]


@typechecked
def outer(x: f32[b"n k"]) -> f32[b"n/d"]:
    out = tsm_body(x)
    check(jnp.float32, "k", zeros(x.shape[1]))  # outer's k survives the nested calls
    return out


@typechecked
def outer_mismatch(x: f32[b"n k"]) -> f32[b"n/d"]:
    out = tsm_body(x)
    check(jnp.float32, "k", zeros(2))  # j=2 was bound in per_device; here k=4
    return out


def test_typechecked_in_typed_shard_map_in_typechecked() -> None:
    x = arange(16, 4)
    with jax.set_mesh(MESH):
        np.testing.assert_allclose(np.asarray(outer(jnp.asarray(x))), x[:, :3].sum(1))
        np.testing.assert_allclose(np.asarray(jax.jit(outer)(x)), x[:, :3].sum(1))
        with pytest.raises(TypeCheckError) as e:
            outer_mismatch(jnp.asarray(x))
    assert "expected size 4 (k=4 is already bound), got 2" in str(e.value)


@typeguard.typechecked
def bare_outer(x: f32[b"n"]) -> f32[b"n"]:
    inner = shardlib_inner(jnp.ones(x.shape[0] + 2))  # its own n
    check(jnp.float32, "n", x)  # the bare call's n
    return x + inner.sum()


@typechecked
def shardlib_inner(y: f32[b"n"]) -> f32[b"n"]:
    check(jnp.float32, "n", jnp.zeros(y.shape[0]))  # its own n, not the bare caller's
    return y


@typechecked
def shardlib_outer(x: f32[b"n"]) -> f32[b"n"]:
    out = bare_inner(jnp.ones(x.shape[0] + 1))
    check(jnp.float32, "n", x)
    return x + out.sum()


@typeguard.typechecked
def bare_inner(y: f32[b"n"]) -> f32[b"n"]:
    check(jnp.float32, "n", y)  # the bare call's own n (found through its memo)
    with Scope():
        check(jnp.float32, "n", jnp.zeros(1))  # an explicit scope inside it: its own again
    return y


@typeguard.typechecked
def bare_mismatch(x: f32[b"n"]) -> f32[b"n"]:
    check(jnp.float32, "n", jnp.zeros(x.shape[0] + 1))
    return x


def test_bare_typeguard_and_shardlib_typechecked_nest() -> None:
    np.testing.assert_array_equal(np.asarray(bare_outer(jnp.ones(3))), np.ones(3) + 5)
    np.testing.assert_array_equal(np.asarray(shardlib_outer(jnp.ones(3))), np.ones(3) + 4)
    with pytest.raises(TypeCheckError, match=r"n=3 is already bound"):
        bare_mismatch(jnp.ones(3))
    with Scope():
        check(jnp.float32, "n", jnp.ones(3))
        bare_inner(jnp.ones(5))  # its own n=5: no conflict with the scope's n=3
        with pytest.raises(TypeCheckError, match=r"n=3 is already bound"):
            check(jnp.float32, "n", jnp.ones(4))


def test_typeguard_check_type_uses_the_current_scope() -> None:
    with Scope() as s:
        typeguard.check_type(zeros(3), f32[b"n"])
        assert s.bindings == {"n": 3}
        with pytest.raises(TypeCheckError, match="n=3 is already bound"):
            typeguard.check_type(zeros(4), f32[b"n"])
    # outside any scope, one check_type call is consistent with itself only
    typeguard.check_type((zeros(2), zeros(2)), tuple[f32[b"n"], f32[b"n"]])
    typeguard.check_type((zeros(5), zeros(5)), tuple[f32[b"n"], f32[b"n"]])
    with pytest.raises(TypeCheckError, match="n=2 is already bound"):
        typeguard.check_type((zeros(2), zeros(3)), tuple[f32[b"n"], f32[b"n"]])


@scope
def scoped_pair(a: jax.Array, b: jax.Array) -> None:
    check(jnp.float32, "n", a)
    check(jnp.float32, "n", b)


def test_scope_decorator_and_no_frame_walk_without_bare_typeguard(monkeypatch) -> None:
    scoped_pair(zeros(2), zeros(2))
    with pytest.raises(TypeCheckError, match="n=2 is already bound"):
        scoped_pair(zeros(2), zeros(3))

    def no_walk(*a: object, **k: object) -> None:
        raise AssertionError("walked the stack with no bare typeguard call in the process")

    monkeypatch.setattr(_scopes._Fallback, "seen", False)
    monkeypatch.setattr(_scopes._frames, "find_memo", no_walk)
    x = jnp.asarray(arange(3, 4))
    np.testing.assert_allclose(np.asarray(matvec(x, jnp.ones(4))), arange(3, 4).sum(1))
    with Scope():
        check(jnp.float32, "n", zeros(3))
    with jax.set_mesh(MESH):
        out = outer(jnp.asarray(arange(16, 4)))
    np.testing.assert_allclose(np.asarray(out), arange(16, 4)[:, :3].sum(1))
    scoped_pair(zeros(4), zeros(4))


@typechecked
def int_counts(x: i32[b"n"]) -> i32[b""]:
    return x.sum()


def test_dtype_checked() -> None:
    assert int(int_counts(jnp.arange(4, dtype=jnp.int32))) == 6
    with pytest.raises(TypeCheckError, match=r'argument "x"(.|\n)*int32'):
        int_counts(jnp.arange(4.0))


# ---------------------------------------------------------------------------------------------
# The identity fast path: an array that passed a check before is not re-read, but its names
# still bind in each call's scope, and any change of spec, dtype or mesh re-checks it.
# ---------------------------------------------------------------------------------------------


@typechecked
def pair_sharded(x: f32[Array, b"n/d"], y: f32[Array, b"n/d"]) -> f32[Array, b"n/d"]:
    return x + y


@typechecked
def one_replicated(x: f32[Array, b"n"]) -> f32[Array, b"n"]:
    return x * 2


@typechecked
def one_sharded(x: f32[Array, b"n/d"]) -> f32[Array, b"n/d"]:
    return x * 3


@pytest.mark.parametrize("repeat", [1, 3])
def test_arrays_seen_before_still_bind_and_conflict(repeat: int) -> None:
    with jax.set_mesh(MESH):
        a = jax.device_put(jnp.arange(8.0), jax.NamedSharding(MESH, jax.P("d")))
        b = jax.device_put(jnp.arange(16.0), jax.NamedSharding(MESH, jax.P("d")))
        for _ in range(repeat):  # a and b pass alone: seen before from the second time on
            np.testing.assert_array_equal(np.asarray(pair_sharded(a, a)), 2 * np.arange(8.0))
            np.testing.assert_array_equal(np.asarray(pair_sharded(b, b)), 2 * np.arange(16.0))
            with pytest.raises(TypeCheckError, match=r'(?s)argument "y".*n=8 is already bound'):
                pair_sharded(a, b)


def test_array_seen_with_one_spec_is_checked_again_against_another() -> None:
    with jax.set_mesh(MESH):
        a = jax.device_put(jnp.arange(8.0), jax.NamedSharding(MESH, jax.P("d")))
        for _ in range(3):  # alternating: the last passing check must not answer the other
            np.testing.assert_array_equal(np.asarray(one_sharded(a)), 3 * np.arange(8.0))
            with pytest.raises(TypeCheckError, match=r'argument "x" does not match'):
                one_replicated(a)
    u = jnp.arange(8.0)  # on one device: its layout is read against the mesh in force
    for _ in range(2):
        np.testing.assert_array_equal(np.asarray(one_sharded(u)), 3 * np.arange(8.0))
        # the same array, another mesh in force: checked again
        with jax.set_mesh(MESH), pytest.raises(TypeCheckError, match=r'argument "x" does not'):
            one_sharded(u)
