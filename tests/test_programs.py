"""The adapter for JAX's program representation (`shardlib._env.programs`): scan, while and
call equations of the installed JAX read right, a missing parameter an error naming the JAX
version, and the analysis following a body through each kind of call."""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from shardlib import shardops
from shardlib._env import programs
from shardlib.shardops import PendingReductionError
from shardlib.shardtypes import Array, f32, typed_shard_map
from tests._mesh_util import make_mesh


def _eqn(f, *args, name: str):
    jaxpr = jax.make_jaxpr(f)(*args)
    return next(
        e for e in programs.iter_eqns(programs.open_program(jaxpr)) if e.primitive.name == name
    )


def test_scan_parts_count_consts_carries_and_xs() -> None:
    """A scan with two consts (w, b), one carry and one scanned input, on this JAX (JAX 0.11
    replaced num_consts/num_carry by the flat tree ft_in)."""

    def f(c, xs, w, b):
        return lax.scan(lambda c, x: (c * w + x * b, c), c, xs)

    eqn = _eqn(f, 1.0, jnp.ones(3), 2.0, 3.0, name="scan")
    parts = programs.scan_parts(eqn)
    assert (parts.n_consts, parts.n_carry, parts.length, parts.reverse) == (2, 1, 3, False)
    assert len(parts.body.invars) == len(eqn.invars) == 4


def test_scan_parts_read_both_parameter_forms() -> None:
    """The old form (num_consts, num_carry) and the new (ft_in) give the same parts."""
    eqn = _eqn(
        lambda c, xs, w: lax.scan(lambda c, x: (c * w + x, c), c, xs),
        1.0,
        jnp.ones(3),
        2.0,
        name="scan",
    )
    body = eqn.params["jaxpr"]
    old = types.SimpleNamespace(
        primitive=eqn.primitive,
        invars=eqn.invars,
        params={"num_consts": 1, "num_carry": 1, "jaxpr": body, "length": 3, "reverse": False},
    )
    a, b = programs.scan_parts(eqn), programs.scan_parts(old)
    assert (a.n_consts, a.n_carry) == (b.n_consts, b.n_carry) == (1, 1)


def test_a_missing_parameter_names_the_primitive_and_the_jax_version() -> None:
    broken = types.SimpleNamespace(
        primitive=types.SimpleNamespace(name="scan"), invars=[], params={"jaxpr": None}
    )
    with pytest.raises(programs.JaxprFormatError, match=rf"'scan'.*JAX {jax.__version__}"):
        programs.scan_parts(broken)
    with pytest.raises(KeyError, match="not an optional parameter"):
        programs.optional_param(broken, "num_consts")


def test_closed_and_open_jaxprs_open_alike() -> None:
    closed = jax.make_jaxpr(lambda x: jnp.sin(x) + np.float32(2.0) * jnp.ones(3))(jnp.ones(3))
    p = programs.open_program(closed)
    assert [v.aval.shape for v in p.invars] == [(3,)]
    assert programs.open_program(p) is p
    assert len(p.constvars) >= len(p.consts)


@pytest.mark.parametrize("call", ["jit", "traced", "checkpoint", "custom_jvp"])
def test_the_analysis_follows_a_partial_sum_into_every_kind_of_call(call: str) -> None:
    """A non-linear op on a partial sum inside a call is refused, whatever the call is (an
    ``eval_jaxpr`` equation for a called ``Traced`` on JAX >= 0.11, a pjit before)."""
    example = jnp.ones((8, 4), jnp.float32)

    if call == "jit":
        inner = jax.jit(jnp.tanh)
    elif call == "traced":
        inner = jax.jit(jnp.tanh).trace(example)
    elif call == "checkpoint":
        inner = jax.checkpoint(jnp.tanh)
    else:

        @jax.custom_jvp
        def inner(y):
            return jnp.tanh(y)

        inner.defjvp(lambda p, t: (jnp.tanh(p[0]), t[0] * (1 - jnp.tanh(p[0]) ** 2)))

    @typed_shard_map
    def f(x: f32[Array, b"B F/t"], w: f32[Array, b"F/t M"]) -> f32[Array, b"B M"]:
        y = shardops.einsum_unreduced("B F/t, F/t M -> B M {+t}", x, w)
        return shardops.psum("B M {+t}", inner(y), axes="t")

    x, w = np.ones((8, 16), np.float32), np.ones((16, 4), np.float32)
    with jax.set_mesh(make_mesh((8,), ("t",))), pytest.raises(PendingReductionError, match="tanh"):
        jax.jit(f)(x, w)
