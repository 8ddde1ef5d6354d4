"""The split of a stage's backward into its input half and its weight half (ZB-H1):
`shardlib._pipeline.split.split_backward`, against ``jax.vjp`` of the same stage, and its cost
(B + W is one backward, not two)."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from shardlib._env import programs
from shardlib._env.context import aval_varying
from shardlib._pipeline.residuals import keeping
from shardlib._pipeline.split import SplitBackward, split_backward
from tests._mesh_util import make_mesh

# -- helpers ------------------------------------------------------------------------------------


def _vjp_parts(stage: Callable, group: Any, h: jax.Array) -> tuple[Callable, list, jax.Array]:
    """The stage's backward as the pipeline differentiates it: ``backward(leaves, ct)``, the
    VJP object's leaves, and an output cotangent."""
    run, _ = keeping(stage, group, h)
    y, vjp = jax.vjp(run, group, h)
    leaves, treedef = jax.tree.flatten(vjp)

    def backward(ls: list, ct: jax.Array) -> Any:
        return jax.tree.unflatten(treedef, ls)(ct)

    return backward, leaves, jnp.cos(y) + 0.5


def _halves(backward: Callable, leaves: list, ct: jax.Array) -> tuple[Any, Any]:
    """(dgroup, dh) of the whole backward and of the split; the split must exist."""
    split = split_backward(backward, leaves, ct)
    assert split is not None
    dh, kept = split.inputs(leaves, ct)
    assert len(kept) == len(split.kept_avals)
    for k, a in zip(kept, split.kept_avals, strict=True):
        assert (k.shape, k.dtype) == (a.shape, a.dtype)
    return backward(leaves, ct), (split.weights(leaves, ct, kept), dh)


def _assert_close(want: Any, got: Any) -> None:
    (dg, dh), (dg2, dh2) = want, got
    assert jax.tree.structure(dg) == jax.tree.structure(dg2)
    np.testing.assert_allclose(np.asarray(dh2), np.asarray(dh), rtol=1e-5, atol=1e-5)
    for a, b in zip(jax.tree.leaves(dg), jax.tree.leaves(dg2), strict=True):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-5)


def _check(stage: Callable, group: Any, h: jax.Array) -> SplitBackward:
    backward, leaves, ct = _vjp_parts(stage, group, h)
    _assert_close(*_halves(backward, leaves, ct))
    split = split_backward(backward, leaves, ct)
    assert split is not None
    b, w, total = split.flops_split
    assert w > 0 and b + w == total, split.flops_split  # W computes weight gradients
    return split


def _dots(program: Any) -> int:
    """The ``dot_general`` equations of a program: a scan's body ``length`` times, other
    nested programs once."""
    count = 0
    for eqn in programs.open_program(program).eqns:
        count += eqn.primitive.name == "dot_general"
        if eqn.primitive.name == "scan":
            parts = programs.scan_parts(eqn)
            count += parts.length * _dots(parts.body)
        else:
            count += sum(_dots(sub) for sub in programs.sub_programs(eqn))
    return count


def _keys(n: int, seed: int = 0) -> list[jax.Array]:
    return list(jax.random.split(jax.random.key(seed), n))


def _mlp_group(depth: int = 3, width: int = 4, seed: int = 0) -> tuple[Any, jax.Array]:
    k = _keys(3, seed)
    w = jax.random.normal(k[0], (depth, width, width)) * 0.5
    b = jax.random.normal(k[1], (depth, width)) * 0.1
    return (w, b), jax.random.normal(k[2], (2, width))


# -- stages -------------------------------------------------------------------------------------


def mlp(group: Any, h: jax.Array) -> jax.Array:
    w, b = group
    for k in range(w.shape[0]):
        h = jnp.tanh(h @ w[k] + b[k])
    return h


def scanned(group: Any, h: jax.Array) -> jax.Array:
    @jax.checkpoint
    def layer(h: jax.Array, wb: Any) -> tuple[jax.Array, None]:
        return jnp.tanh(h @ wb[0] + wb[1]), None

    return jax.lax.scan(layer, h, group)[0]


def scanned_const(group: Any, h: jax.Array) -> jax.Array:
    w, b = group

    @jax.checkpoint
    def layer(h: jax.Array, k: jax.Array) -> tuple[jax.Array, None]:
        return jnp.tanh(h @ w[0] * k + b[0]), None

    return jax.lax.scan(layer, h, jnp.arange(1.0, 4.0))[0]


@jax.jit
def _mix(h: jax.Array, w: jax.Array) -> jax.Array:
    return jnp.sin(h @ w) + h


def nested(group: Any, h: jax.Array) -> jax.Array:
    w, b = group

    @jax.checkpoint
    def layer(h: jax.Array, wb: Any) -> tuple[jax.Array, jax.Array]:
        wk, bk = wb

        def inner(g: jax.Array, s: jax.Array) -> tuple[jax.Array, jax.Array]:
            return jnp.tanh(g @ wk * s + bk), jnp.sum(g)

        g, sums = jax.lax.scan(inner, h, jnp.array([1.0, 0.5]))
        return _mix(g, wk), sums

    return jax.lax.scan(layer, h, (w, b))[0]


def two_carries(group: Any, h: jax.Array) -> jax.Array:
    """Two carries: the activation and a running sum that also reads the weights (unrolled)."""

    @jax.checkpoint
    def layer(carry: Any, wb: Any) -> tuple[Any, None]:
        h, acc = carry
        h = jnp.tanh(h @ wb[0] + wb[1])
        return (h, acc * wb[1] + h), None

    h, acc = jax.lax.scan(layer, (h, jnp.zeros_like(h)), group, unroll=2)[0]
    return h + acc


def unused(group: Any, h: jax.Array) -> jax.Array:
    return jnp.tanh(h) * 2.0


# -- cases --------------------------------------------------------------------------------------


@pytest.mark.slow
def test_unrolled_mlp_under_a_checkpoint_splits() -> None:
    group, h = _mlp_group()
    split = _check(mlp, group, h)
    assert split.kept_avals  # the cotangents at the weight uses
    b, w, total = split.flops_split
    assert w > 0 and b < total and b + w == total


@pytest.mark.slow
@pytest.mark.parametrize("stage", [scanned, scanned_const], ids=["xs", "const"])
def test_scanned_stage_splits_its_scan(stage: Callable) -> None:
    group, h = _mlp_group()
    split = _check(stage, group, h)
    assert split.kept_avals and all(a.shape[0] == 3 for a in split.kept_avals)


@pytest.mark.slow
def test_nested_scan_and_jit() -> None:
    group, h = _mlp_group()
    _check(nested, group, h)


@pytest.mark.slow
def test_scan_with_two_carries() -> None:
    group, h = _mlp_group()
    _check(two_carries, group, h)


def test_stage_without_weights_does_not_split() -> None:
    group, h = _mlp_group()
    backward, leaves, ct = _vjp_parts(unused, group, h)
    assert split_backward(backward, leaves, ct) is None


@pytest.mark.parametrize("stage", [mlp, scanned, nested], ids=["mlp", "scan", "nested"])
def test_one_backward_in_dot_generals(stage: Callable) -> None:
    """B + W has as many dot_generals as the whole backward: W recomputes nothing."""
    group, h = _mlp_group()
    backward, leaves, ct = _vjp_parts(stage, group, h)
    split = split_backward(backward, leaves, ct)
    assert split is not None
    full = _dots(jax.make_jaxpr(backward)(leaves, ct))
    b = _dots(jax.make_jaxpr(split.inputs)(leaves, ct))
    _, kept = split.inputs(leaves, ct)
    w = _dots(jax.make_jaxpr(split.weights)(leaves, ct, kept))
    assert b + w == full, (b, w, full)
    assert w > 0 and b < full
    assert kept
    flops_b, flops_w, flops = split.flops_split
    assert flops_b + flops_w == flops and flops_w > 0


@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize(
    "stage", [mlp, scanned, scanned_const, nested], ids=["mlp", "scan", "const", "nested"]
)
def test_inside_shard_map(stage: Callable, check_vma: bool) -> None:
    """Inside a shard_map body, the stage weights and input varying over the axis (as in a
    pipeline, whose stages differ per device), the halves match
    the whole backward, and ``kept_avals`` carry the kept values' varying axes."""
    mesh = make_mesh((2,), ("s",), auto=True)
    (w, b), h = _mlp_group()
    w2, b2, h2 = jnp.stack([w, w * 0.5]), jnp.stack([b, -b]), jnp.stack([h, 2 * h])
    kinds: list[Any] = []

    def body(w: jax.Array, b: jax.Array, h: jax.Array) -> Any:
        backward, leaves, ct = _vjp_parts(stage, (w[0], b[0]), h[0])
        split = split_backward(backward, leaves, ct)
        assert split is not None
        dh, kept = split.inputs(leaves, ct)
        for k, a in zip(kept, split.kept_avals, strict=True):
            kinds.append((aval_varying(jax.typeof(k)), a, k.shape, k.dtype))
        got = (split.weights(leaves, ct, kept), dh)
        return jax.tree.map(lambda x: x[None], (backward(leaves, ct), got))

    smap = jax.shard_map(
        body, mesh=mesh, in_specs=(P("s"), P("s"), P("s")), out_specs=P("s"), check_vma=check_vma
    )
    want, got = jax.jit(smap)(w2, b2, h2)
    for d in range(2):
        _assert_close(*jax.tree.map(lambda x: x[d], (want, got)))  # noqa: B023
    assert kinds
    for vary, a, shape, dtype in kinds:
        assert (a.shape, a.dtype) == (shape, dtype)
        if check_vma:
            assert vary == frozenset({"s"})
            assert aval_varying(a) == vary


# -- seeded random stages -----------------------------------------------------------------------

_ACTS: dict[str, Callable[[jax.Array, jax.Array], jax.Array]] = {
    "tanh": lambda x, _: jnp.tanh(x),
    "relu": lambda x, _: jax.nn.relu(x),
    "mul": lambda x, v: x * v,
}


def _random_stage(rng: random.Random) -> tuple[Callable, Any, jax.Array]:
    depth = rng.randint(1, 4)
    widths = [rng.choice([2, 3, 5]) for _ in range(depth + 1)]
    acts = [rng.choice(sorted(_ACTS)) for _ in range(depth)]
    keys = _keys(2 * depth + 1, rng.randrange(1 << 16))
    group = [
        (
            jax.random.normal(keys[2 * k], (widths[k], widths[k + 1])),
            jax.random.normal(keys[2 * k + 1], (widths[k + 1],)),
        )
        for k in range(depth)
    ]

    def stage(group: Any, h: jax.Array) -> jax.Array:
        for (w, v), act in zip(group, acts, strict=True):
            h = _ACTS[act](h @ w, v)
        return h

    return stage, group, jax.random.normal(keys[-1], (3, widths[0]))


@pytest.mark.parametrize(
    "seed", [*range(5), *(pytest.param(s, marks=pytest.mark.slow) for s in range(5, 20))]
)
def test_random_stages(seed: int) -> None:
    stage, group, h = _random_stage(random.Random(seed))
    backward, leaves, ct = _vjp_parts(stage, group, h)
    split = split_backward(backward, leaves, ct)
    assert split is not None
    _assert_close(*_halves(backward, leaves, ct))
    b, w, total = split.flops_split
    assert b + w == total and w > 0


def test_split_is_deterministic() -> None:
    """Two traces give the same kept types (the pipeline traces the split twice)."""
    group, h = _mlp_group()
    backward, leaves, ct = _vjp_parts(nested, group, h)
    one, two = (split_backward(backward, leaves, ct) for _ in range(2))
    assert one is not None and two is not None
    assert [(a.shape, a.dtype) for a in one.kept_avals] == [
        (a.shape, a.dtype) for a in two.kept_avals
    ]
