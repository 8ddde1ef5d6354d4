"""JAX's unreduced (``{U:t}``) and reduced (``{R:t}``) types at a ``typed_shard_map``'s edges.

- An argument whose JAX type is unreduced over an axis its annotation's clause does not type
  it unreduced over is refused before JAX sees it (JAX would sum it on the way in under
  ``jit``, refuse it eagerly, or abort inside XLA): these calls run in one child process
  (`tests/_jax_type_args_child.py`), read here once per module.
- A body that takes ``{+t}`` and returns ``{+t}`` through a linear op runs with ``check_vma``
  on; where JAX's own types refuse the op, the message says the refusal is JAX's.
- A result typed reduced returned without ``=t``, a collective in a per-device branch, and a
  ``{=t}`` argument whose gradient cannot be unreduced get messages that name what the user
  wrote.

Values are compared with ``numpy``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from typeguard import TypeCheckError

from shardlib import shardops
from shardlib.shardops import PendingReductionError
from shardlib.shardtypes import Array, f32, typed_shard_map
from tests import _jax_type_args_child as child_cases

ROOT = Path(__file__).resolve().parent.parent
CHILD_TIMEOUT_S = 120

# -- arguments typed unreduced, in a child process ---------------------------------------------

# Refused cases: the axes the message names, the reshard it suggests and the annotation that
# takes the partial sum as it is (None: the annotation splits a dim over the axis).
REFUSED = {
    "2d U:t for +d": ("'t'", "P(None, None)", "M N {+d+t}"),
    "2d U:t for plain": ("'t'", "P(None, None)", "M N {+t}"),
    "2d U:d for =d": ("'d'", "P(None, None, reduced={'d'})", "M N {+d}"),
    "2d U:t for =t": ("'t'", "P(None, None, reduced={'t'})", "M N {+t}"),
    "2d U:t for +d=t": ("'t'", "P(None, None, reduced={'t'})", "M N {+d+t}"),
    "2d U:t/d for +t": ("'d'", "P(None, None)", "M N {+t+d}"),
    "2d U:t for split": ("'t'", "P('t', None)", None),
    "1d U:t for plain": ("'t'", "P(None, None)", "M N {+t}"),
    "1d U:t for =t": ("'t'", "P(None, None, reduced={'t'})", "M N {+t}"),
}
CALLS = [(case, mode) for case in child_cases.CASES for mode in ("eager", "jit")]


@pytest.fixture(scope="module")
def child() -> dict[tuple[str, str], dict]:
    """Every case's outcome, by (case, mode); a case the process did not reach has none (the
    test of that case then shows the end of the process's output)."""
    env = dict(os.environ)  # the tests' XLA_FLAGS (8 CPU devices) and compilation cache
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "_jax_type_args_child.py")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT_S,
    )
    out: dict[tuple[str, str], dict] = {}
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            got = json.loads(line)
            out[got["case"], got["mode"]] = got
    out["returncode", ""] = {"code": proc.returncode, "tail": proc.stderr[-3000:]}
    return out


def _ended(child: dict) -> str:
    end = child["returncode", ""]
    last = end["tail"].strip().splitlines()[-1:] or [""]
    return f"the child process ended (exit code {end['code']}) before this case: {last[0][:300]}"


@pytest.mark.parametrize(("case", "mode"), CALLS, ids=[f"{c}-{m}" for c, m in CALLS])
def test_an_argument_typed_unreduced(child, case: str, mode: str) -> None:
    got = child.get((case, mode))
    assert got is not None, _ended(child)
    _, value, annotation = child_cases.CASES[case]
    if case not in REFUSED:
        assert "error" not in got, f"{got.get('error')}: {got.get('message')}\n{got.get('where')}"
        assert got["max_err"] < 1e-4, got
        return
    assert got.get("error") == "TypeCheckError", got
    axis, target, taking = REFUSED[case]
    msg = got["message"]
    assert msg.startswith(f"argument 'y' of take() is annotated f32['{annotation}'] but "), msg
    assert f"the array's JAX type {got['type']} is unreduced over mesh axis {axis}" in msg
    assert "an all-reduce shardlib never inserts implicitly" in msg
    assert f"reduce it first (jax.reshard(y, {target}), or shardops.psum over {axis}" in msg
    if taking is None:
        assert "or annotate it" not in msg
    else:
        assert msg.endswith(f"or annotate it f32['{taking}'] to take the partial sum as it is")


def test_the_whole_refusal_of_the_issue_s_first_case(child) -> None:
    got = child.get(("2d U:t for +d", "jit"))
    assert got is not None, _ended(child)
    assert got["message"] == (
        "argument 'y' of take() is annotated f32['M N {+d}'] but the array's JAX type "
        "float32[4,6]{U:t} is unreduced over mesh axis 't' (clause '{+t}': a partial sum still "
        "owing a sum over 't'), which the annotation's clause '{+d}' does not say: taking it as "
        "annotated would sum it on the way in, an all-reduce shardlib never inserts "
        "implicitly; reduce it first (jax.reshard(y, P(None, None)), or shardops.psum over 't' "
        "in the typed_shard_map that made it), or annotate it f32['M N {+d+t}'] to take the "
        "partial sum as it is"
    )
    reduced = child[("2d U:d for =d", "eager")].get("message", "")
    assert "which the annotation's clause '{=d}' contradicts ('=d': the same on every device" in (
        reduced
    )


def test_the_child_process_ran_every_case(child) -> None:
    assert child["returncode", ""]["code"] == 0, child["returncode", ""]["tail"]


# -- linear bodies on unreduced values, with check_vma on ---------------------------------------

RNG = np.random.default_rng(3)
A = RNG.standard_normal((4, 16)).astype(np.float32)
B = RNG.standard_normal((16, 6)).astype(np.float32)
MASK = np.arange(24).reshape(4, 6) % 3 == 0
LINEAR = {
    "identity": lambda y: y,
    "negation": lambda y: -y,
    "reshape": lambda y: y.reshape(24).reshape(4, 6),
    "where": lambda y: jnp.where(MASK, y, 0.0),
    "scale": lambda y: y * 2.0,
}


def _mesh(shape: tuple[int, ...], names: tuple[str, ...]):
    return jax.make_mesh(shape, names, axis_types=(AxisType.Explicit,) * len(names))


@typed_shard_map
def matmul(a: f32[Array, b"M K/t"], b: f32[Array, b"K/t N"]) -> f32[Array, b"M N {+t}"]:
    return shardops.einsum_unreduced("M K/t, K/t N -> M N {+t}", a, b)


def _partial_sum(mesh) -> jax.Array:
    a = jax.device_put(A, NamedSharding(mesh, P(None, "t")))
    b = jax.device_put(B, NamedSharding(mesh, P("t", None)))
    return jax.jit(matmul)(a, b)


def _summed(y: jax.Array) -> np.ndarray:
    return np.asarray(jax.jit(lambda y: jax.reshard(y, P()))(y))


def _linear(op: str, check_vma: bool):
    def linear(y: f32[Array, b"M N {+t}"]) -> f32[Array, b"M N {+t}"]:
        return LINEAR[op](y)

    return typed_shard_map(linear, check_vma=check_vma)


# What JAX's own types refuse (with check_vma on): scaling an unreduced value by a constant
# typed otherwise than reduced (0.10 and 0.12); negating one where JAX has no unreduced rule
# for neg (0.10; 0.12 has one). JAX 0.9 types a {+t} argument unreduced with check_vma off
# too: it refuses every op here but the identity, either way, and returns nothing unreduced
# with check_vma off (shardlib refuses that at decoration). On other versions negation may
# go either way.
_JAX = jax.__version_info__[:2]
JAX_09 = _JAX < (0, 10)
JAX_REFUSES = (
    {"scale"}
    | ({"negation"} if _JAX == (0, 10) else set())
    | ({"negation", "reshape", "where"} if JAX_09 else set())
)
EITHER = {"negation"} if _JAX not in ((0, 9), (0, 10), (0, 12)) else set()


@pytest.mark.parametrize("op", list(LINEAR))
def test_a_linear_body_returns_an_unreduced_argument_as_unreduced(op: str) -> None:
    mesh = _mesh((4, 2), ("t", "d"))
    with jax.set_mesh(mesh):
        y = _partial_sum(mesh)
        ref = LINEAR[op](A @ B)
        if JAX_09:
            with pytest.raises(ValueError, match=r"only with check_vma on .*JAX 0\.10 or later"):
                _linear(op, False)
        else:
            np.testing.assert_allclose(
                _summed(jax.jit(_linear(op, False))(y)), ref, rtol=1e-5, atol=1e-5
            )
        typed = _linear(op, True)
        if op in EITHER:
            try:
                out = jax.jit(typed)(y)
            except Exception as e:  # noqa: BLE001 - JAX's class
                assert "the refusal is JAX's, not shardlib's" in str(e)
            else:
                np.testing.assert_allclose(_summed(out), ref, rtol=1e-5, atol=1e-5)
            return
        if op not in JAX_REFUSES:
            out = jax.jit(typed)(y)
            assert jax.typeof(out).sharding.spec == P(None, None, unreduced={"t"})
            np.testing.assert_allclose(_summed(out), ref, rtol=1e-5, atol=1e-5)
            return
        with pytest.raises(Exception, match="the refusal is JAX's, not shardlib's") as e:  # noqa: B017, PT011 - JAX's class
            jax.jit(typed)(y)
        msg = str(e.value)
        assert msg.startswith("in _linear.<locals>.linear(): JAX "), msg
        if JAX_09:
            assert "check_vma=False does not help" in msg, msg
            assert "use JAX 0.10 or later" in msg
            assert "JAX's message: " in msg
            return
        assert "Pass check_vma=False to typed_shard_map" in msg
        assert "multiply it by jax.lax.pcast(c, 't', to='reduced')" in msg
        assert "JAX's message: " in msg


@pytest.mark.skipif(
    JAX_09,
    reason="JAX 0.9's mul of a value typed unreduced by a constant typed reduced fails an "
    "assertion inside JAX (_mul_unreduced_rule's out_sharding check); 0.10 and later run it",
)
def test_the_scaling_jax_s_types_allow_runs() -> None:
    """The fix the refusal suggests (a constant typed reduced) runs, eager and under jit."""
    mesh = _mesh((8,), ("t",))
    with jax.set_mesh(mesh):
        y = _partial_sum(mesh)

        @typed_shard_map
        def scale(y: f32[Array, b"M N {+t}"]) -> f32[Array, b"M N {+t}"]:
            return y * jax.lax.pcast(jnp.float32(-2.0), "t", to="reduced")

        np.testing.assert_allclose(_summed(scale(y)), -2 * (A @ B), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(_summed(jax.jit(scale)(y)), -2 * (A @ B), rtol=1e-5, atol=1e-5)


def test_an_identity_body_runs_on_a_1d_mesh() -> None:
    mesh = _mesh((8,), ("t",))
    with jax.set_mesh(mesh):
        y = _partial_sum(mesh)

        @typed_shard_map
        def identity(y: f32[Array, b"M N {+t}"]) -> f32[Array, b"M N {+t}"]:
            return y

        np.testing.assert_allclose(_summed(identity(y)), A @ B, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(_summed(jax.jit(identity)(y)), A @ B, rtol=1e-5, atol=1e-5)


UNCHECKED_09 = pytest.mark.skipif(
    JAX_09,
    reason="JAX 0.9's shard_map returns nothing unreduced with check_vma=False (shardlib "
    "refuses the decoration: test_a_linear_body_returns_an_unreduced_argument_as_unreduced)",
)


@pytest.mark.parametrize("check_vma", [True, pytest.param(False, marks=UNCHECKED_09)])
def test_a_value_the_same_on_every_device_is_still_not_an_unreduced_result(check_vma) -> None:
    """The casts above trust the analysis, not JAX's types, to say what a partial sum is: a
    replicated value returned as ``{+t}`` is refused with ``check_vma`` on as off."""
    mesh = _mesh((4, 2), ("t", "d"))
    with jax.set_mesh(mesh):
        w = jax.device_put(A @ B, NamedSharding(mesh, P()))

        @typed_shard_map(check_vma=check_vma)
        def same(w: f32[Array, b"M N"]) -> f32[Array, b"M N {+t}"]:
            return jnp.where(MASK, w, 0.0)

        with pytest.raises(PendingReductionError, match="but it is not a partial sum over them"):
            jax.jit(same)(w)


# -- messages -------------------------------------------------------------------------------------


def test_a_reduced_result_returned_without_its_clause() -> None:
    mesh = _mesh((4, 2), ("t", "d"))
    with jax.set_mesh(mesh):
        y = jax.jit(lambda x: jax.reshard(x, P(None, None, unreduced={"t"}, reduced={"d"})))(
            jax.device_put(A @ B, NamedSharding(mesh, P()))
        )

        @typed_shard_map
        def reduce_t(y: f32[Array, b"M N {+t=d}"]) -> f32[Array, b"M N"]:
            return shardops.psum("M N {+t}", y, axes="t")

        @typed_shard_map
        def reduce_t_kept(y: f32[Array, b"M N {+t=d}"]) -> f32[Array, b"M N {=d}"]:
            return shardops.psum("M N {+t}", y, axes="t")

        with pytest.raises(TypeCheckError) as e:
            jax.jit(reduce_t)(y)
        assert str(e.value) == (
            "in test_a_reduced_result_returned_without_its_clause.<locals>.reduce_t(): the "
            "return value is typed reduced over mesh axis 'd' by JAX ({R:d} as computed from "
            "argument 'y', annotated f32['M N {+t=d}']), but its annotation f32['M N'] does not "
            "say '=d', and JAX returns a value typed reduced over 'd' only as reduced; annotate "
            "it f32['M N {=d}'] (the same on every device of 'd', its gradient left unreduced "
            "there), or drop '=d' from the argument's annotation"
        )
        out = jax.jit(reduce_t_kept)(y)  # the fix
        assert jax.typeof(out).sharding.spec == P(None, None, reduced={"d"})
        np.testing.assert_allclose(_summed(out), A @ B, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("check_vma", [True, False])
def test_a_collective_in_a_per_device_branch_is_named_as_written(check_vma: bool) -> None:
    """With check_vma on, ``jax.lax.psum``/``pmean`` of a value typed invariant is JAX's
    ``psum_invariant``; the refusal names the ``psum`` the user wrote."""
    mesh = _mesh((4, 2), ("t", "d"))
    with jax.set_mesh(mesh):
        x = jax.device_put(np.ones((8, 6), np.float32), NamedSharding(mesh, P("t", None)))
        w = jax.device_put(np.ones((8, 6), np.float32), NamedSharding(mesh, P()))

        @typed_shard_map(check_vma=check_vma)
        def branchy(x: f32[Array, b"M/t N"], w: f32[Array, b"K N"]) -> f32[Array, b"M/t N"]:
            first = jax.lax.axis_index("t") == 0
            return jax.lax.cond(
                first, lambda x, w: x + jax.lax.pmean(w, "t")[:2], lambda x, w: x, x, w
            )

        with pytest.raises(
            ValueError,
            match=r"\): `psum` at test_jax_type_args\.py:\d+ runs over mesh axis 't' inside a branch",
        ) as e:
            jax.jit(branchy)(x, w)
        assert "psum_invariant" not in str(e.value)


def _layer_grad(split: str, annotation: bytes, mesh):
    @typed_shard_map
    def layer(
        x: f32[Array, b"B/" + split.encode() + b" M"], w: f32[Array, annotation]
    ) -> f32[Array, b"B/" + split.encode() + b" N"]:
        return jnp.tanh(shardops.einsum(f"B/{split} M, M N -> B/{split} N", x, w))

    return jax.grad(lambda x, w: jnp.sum(layer(x, w)), argnums=1)


@pytest.mark.skipif(
    JAX_09,
    reason="JAX 0.9's pvary refuses an argument typed reduced ('pvary cannot accept args "
    "which are reduced'), which jnp.einsum binds to meet data varying over another axis",
)
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_a_reduced_weight_whose_use_does_not_vary_over_its_axis(jit: bool) -> None:
    mesh = _mesh((4, 2), ("t", "d"))
    X = RNG.standard_normal((8, 4)).astype(np.float32)
    W = RNG.standard_normal((4, 6)).astype(np.float32)
    ref = jax.grad(lambda x, w: jnp.sum(jnp.tanh(x @ w)), argnums=1)(X, W)
    with jax.set_mesh(mesh):
        x = jax.device_put(X, NamedSharding(mesh, P("d", None)))
        w = jax.device_put(W, NamedSharding(mesh, P(None, None, reduced={"t"})))
        grad = _layer_grad("d", b"M N {=t}", mesh)
        with pytest.raises(TypeCheckError) as e:
            (jax.jit(grad) if jit else grad)(x, w)
        assert str(e.value) == (
            "argument 'w' of _layer_grad.<locals>.layer() is annotated f32['M N {=t}'], reduced "
            "over mesh axis 't': its gradient is left unreduced over 't', each device holding "
            "its part of a sum over 't', which needs the body's use of it to vary over 't' (to "
            "meet data split over 't'), but nothing it meets in the body does, so each device's "
            "gradient is the whole sum and JAX cannot differentiate the call (it wants the "
            "cotangent typed float32[4,6]{V:d, U:t} and the body makes it float32[4,6]{V:d}); "
            "drop '=t' from the annotation, f32['M N'] (its gradient then comes back summed, as "
            "an ordinary argument's), or split the data it meets over 't'"
        )
        # Its forward pass runs; each fix the message names gives the reference gradient.
        plain = jax.device_put(W, NamedSharding(mesh, P()))
        np.testing.assert_allclose(
            _layer_grad("d", b"M N", mesh)(x, plain), ref, rtol=1e-5, atol=1e-5
        )
        xt = jax.device_put(X, NamedSharding(mesh, P("t", None)))
        g = jax.jit(_layer_grad("t", b"M N {=t}", mesh))(xt, w)
        assert jax.typeof(g).sharding.spec.unreduced == {"t"}
        np.testing.assert_allclose(_summed(g), ref, rtol=1e-5, atol=1e-5)
