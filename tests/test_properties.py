"""Property tests over random meshes, specs and reductions (hypothesis, seeded by the "ci" profile).

What ``test_shardops.py`` already samples (each op on the three standard meshes) is not
repeated here. These tests add:

* random meshes: every way of splitting the 8 devices into 1 to 3 axes, size-1 axes
  included, with random axis names, Explicit or Auto;
* ``einsum_unreduced`` of random specs (up to 3 operands, random dim subsets, consistent
  random sharding, random output subset) run through ``typed_shard_map`` with annotations,
  whose pending axes are reduced in one or two steps (``psum`` / ``psum_scatter`` over
  subsets, with linear operations on the partial sums in between, and the ``{+axes}``
  clause written out or inferred), against ``np.einsum`` on the global arrays;
* ``psum_scatter`` onto several dims at once then ``all_gather`` equals ``psum``, on
  partial sums;
* ``all_to_all`` there and back is the identity, also on partial sums (their pending axes
  travel with them);
* shape specs with a pending clause round-trip through ``parse``/``str``, and a spec's
  PartitionSpec puts on each device the block the spec describes (checked against a plain
  numpy slicing rule), on random meshes.

Each example compiles a small program under ``jit``; ``max_examples`` are kept small (see
``MAX_EXAMPLES``) and ``test_example_counts`` checks and reports how many ran.
"""

from __future__ import annotations

import functools
import inspect
import math
import string
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st
from typeguard import TypeCheckError

from shardlib import shardops
from shardlib._lang.op_spec import parse_op_spec
from shardlib._lang.parsing import ShapeSpec
from shardlib.shardtypes import check, f32, typed_shard_map
from tests._mesh_util import blocks, expect_pending, make_mesh, place

# Every ordered way of writing 8 as a product of 1 to 3 factors (size-1 axes included).
SHAPES = [
    (8,),
    (1, 8),
    (8, 1),
    (2, 4),
    (4, 2),
    (2, 2, 2),
    (1, 2, 4),
    (2, 1, 4),
    (4, 2, 1),
    (1, 1, 8),
    (8, 1, 1),
    (2, 4, 1),
]
AXIS_NAMES = ["d", "t", "x", "y", "fsdp", "tp"]

MAX_EXAMPLES = {
    "test_spec_round_trip_and_placement": 100,
    "test_einsum_unreduced_then_reduce_equals_einsum": 150,
    "test_psum_scatter_several_dims_then_all_gather_equals_psum": 40,
    "test_all_to_all_there_and_back_keeps_pending_axes": 40,
}
EXAMPLES: Counter = Counter()  # examples that ran to completion, per test

pytestmark = pytest.mark.slow  # random rounds (hypothesis): `pytest --runslow`


def counted(fn: Callable[..., None]) -> Callable[..., None]:
    """Count the completed examples of a property test (for ``test_example_counts``)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> None:
        fn(*args, **kwargs)
        EXAMPLES[fn.__name__] += 1

    return wrapper


def examples(name: str) -> Any:
    return settings(max_examples=MAX_EXAMPLES[name], deadline=None)


_MESHES: dict[tuple, Any] = {}


def draw_mesh(data: st.DataObject) -> Any:
    shape = data.draw(st.sampled_from(SHAPES), label="mesh shape")
    names = tuple(data.draw(st.permutations(AXIS_NAMES), label="axis names")[: len(shape)])
    auto = data.draw(st.booleans(), label="auto")
    key = (shape, names, auto)
    if key not in _MESHES:
        _MESHES[key] = make_mesh(shape, names, auto=auto)
    return _MESHES[key]


def sizes_of(mesh: Any) -> dict[str, int]:
    return dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))


def factor(mesh: Any, axes: Sequence[str]) -> int:
    s = sizes_of(mesh)
    return math.prod(s[a] for a in axes)


def draw_layout(data: st.DataObject, axes: Sequence[str], n_dims: int) -> list[tuple[str, ...]]:
    """Each axis to one of ``n_dims`` dims or to none, in a random order within each dim."""
    if n_dims == 0:
        return []
    where = [data.draw(st.integers(-1, n_dims - 1), label=f"dim of {a}") for a in axes]
    return [
        tuple(data.draw(st.permutations([a for a, w in zip(axes, where, strict=True) if w == i])))
        for i in range(n_dims)
    ]


def dim_str(name: str, axes: Sequence[str]) -> str:
    return "/".join([name, *axes])


def spec_str(names: Sequence[str], layout: dict[str, tuple[str, ...]]) -> str:
    return " ".join(dim_str(n, layout[n]) for n in names)


def typed(
    body: Callable[..., Any], args: dict[str, str], ret: Any, check_vma: bool = True
) -> Callable[..., Any]:
    """``typed_shard_map(body)`` with f32 annotations built from the spec strings."""
    body.__annotations__ = {k: f32[v.encode()] for k, v in args.items()}
    body.__annotations__["return"] = (
        tuple[tuple(f32[r.encode()] for r in ret)] if isinstance(ret, tuple) else f32[ret.encode()]
    )
    return typed_shard_map(body, check_vma=check_vma)


def positional(fn: Callable[..., Any], names: Sequence[str]) -> Callable[..., Any]:
    """``fn(*xs)`` seen as a function of positional-only parameters ``names``."""
    kind = inspect.Parameter.POSITIONAL_ONLY
    fn.__signature__ = inspect.Signature([inspect.Parameter(n, kind) for n in names])
    return fn


def normal(seed: int, shape: Sequence[int]) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(tuple(shape)).astype(np.float32)


# ---------------------------------------------------------------------------------------------
# Shape specs: round trip, and the placement a spec's PartitionSpec gives
# ---------------------------------------------------------------------------------------------


def canonical(layout: Sequence[tuple[str, ...]], sizes: dict[str, int]) -> tuple:
    """A layout up to size-1 axes (which split nothing)."""
    return tuple(tuple(a for a in axes if sizes[a] > 1) for axes in layout)


@examples("test_spec_round_trip_and_placement")
@given(data=st.data())
@counted
def test_spec_round_trip_and_placement(data):
    mesh = draw_mesh(data)
    sizes = sizes_of(mesh)
    rank = data.draw(st.integers(0, 3), label="rank")
    layout = draw_layout(data, mesh.axis_names, rank)
    shape = [factor(mesh, axes) * data.draw(st.integers(1, 2), label="k") for axes in layout]
    # A dim is named, or written as its (literal) size.
    names = [
        str(n) if data.draw(st.booleans(), label="literal") else f"{'abc'[i]}{i}"
        for i, n in enumerate(shape)
    ]
    free = [a for a in mesh.axis_names if all(a not in axes for axes in layout)]
    pending = tuple(data.draw(st.permutations(free), label="pending"))
    pending = pending[: data.draw(st.integers(0, len(pending)), label="n pending")]
    dims_text = " ".join(dim_str(n, axes) for n, axes in zip(names, layout, strict=True))
    clause = "{" + "".join("+" + a for a in pending) + "}" if pending else ""
    text = f"{dims_text} {clause}".strip()

    spec = ShapeSpec.parse(text)
    assert str(spec) == text and ShapeSpec.parse(str(spec)) == spec
    assert ShapeSpec.parse(text.encode()) is spec  # bytes and str share the cache
    assert spec.pending == pending
    assert spec.mesh_axes() == tuple(a for axes in layout for a in axes)
    assert spec.without_pending() == ShapeSpec.parse(dims_text)
    ops = parse_op_spec(f"{text}, {dims_text} -> {dims_text}", op="test")
    again = parse_op_spec(str(ops), op="test")
    assert (again.inputs, again.output) == (ops.inputs, ops.output)

    # Placement: every device holds the block the spec describes (plain numpy slicing).
    x = np.arange(math.prod(shape), dtype=np.float32).reshape(shape)
    placed = place(x, mesh, dims_text)
    want = blocks(x, mesh, dims_text)
    for shard in placed.addressable_shards:
        coords = tuple(int(c) for c in np.argwhere(mesh.devices == shard.device)[0])
        np.testing.assert_array_equal(np.asarray(shard.data), want[coords])
    with jax.set_mesh(mesh):
        check(jnp.float32, dims_text, placed)  # an annotation accepts its own layout
        # ... and refuses any layout that splits the array differently.
        other = draw_layout(data, mesh.axis_names, rank)
        fits = all(n % factor(mesh, a) == 0 for n, a in zip(shape, other, strict=True))
        if fits and canonical(other, sizes) != canonical(layout, sizes):
            wrong = place(x, mesh, " ".join(dim_str(f"n{i}", a) for i, a in enumerate(other)))
            with pytest.raises(TypeCheckError, match="layout: the annotation wants"):
                check(jnp.float32, dims_text, wrong)


# ---------------------------------------------------------------------------------------------
# einsum_unreduced, then reduce the pending axes
# ---------------------------------------------------------------------------------------------

DIM_NAMES = ["a", "b", "c", "hid", "seq"]
# Linear maps applied to the partial sums between reductions; each is the identity in exact
# arithmetic, so the reduced result must still be the einsum.
LINEAR: list[Callable[[Any], Any]] = [
    lambda y: y,
    lambda y: (y + y) * 0.5,
    lambda y: -(y * -1.0),
    lambda y: shardops.linear(lambda v: v * 4.0, y) / 4.0,
    lambda y: (2.0 * y - y).astype(jnp.float32),
]


@examples("test_einsum_unreduced_then_reduce_equals_einsum")
@given(data=st.data())
@counted
def test_einsum_unreduced_then_reduce_equals_einsum(data):
    mesh = draw_mesh(data)
    n_ops = data.draw(st.integers(1, 3), label="n operands")
    operands = [
        data.draw(st.lists(st.sampled_from(DIM_NAMES), min_size=1, max_size=3, unique=True))
        for _ in range(n_ops)
    ]
    used = list(dict.fromkeys(n for o in operands for n in o))
    out = data.draw(st.permutations(used), label="out")
    out = out[: data.draw(st.integers(0, len(used)), label="n out")]
    layout = dict(zip(used, draw_layout(data, mesh.axis_names, len(used)), strict=True))
    # The axes of the contracted dims are pending, in order of first appearance.
    pending = tuple(a for n in used if n not in out for a in layout[n])

    # Reduce them in one or two steps, each a psum or a psum_scatter onto an output dim.
    order = data.draw(st.permutations(pending), label="reduction order")
    cut = data.draw(st.integers(1, len(order)), label="cut") if len(order) > 1 else len(order)
    steps = []
    for group in (order[:cut], order[cut:]):
        if not group:
            continue
        scatter = bool(out) and data.draw(st.sampled_from([True, True, False]), label="scatter")
        target = data.draw(st.sampled_from(out), label="target") if scatter else None
        lin = data.draw(st.integers(0, len(LINEAR) - 1), label="linear op")
        steps.append((tuple(group), target, lin))
    size = {n: factor(mesh, layout[n]) * data.draw(st.integers(1, 3), label="k") for n in used}
    final = {n: layout[n] for n in out}
    for group, target, _ in steps:
        if target is not None:
            final[target] += group
            size[target] *= factor(mesh, group)

    event(f"{len(steps)} reduction step(s)")
    event(f"{sum(t is not None for _, t, _ in steps)} psum_scatter step(s)")
    event(f"{n_ops} operand(s)")
    text = ", ".join(spec_str(o, layout) for o in operands) + " -> " + spec_str(out, layout)
    if pending and data.draw(st.booleans(), label="declare pending"):
        text += " {" + "".join("+" + a for a in data.draw(st.permutations(pending))) + "}"

    def body(*xs):
        y = shardops.einsum_unreduced(text, *xs)
        left = set(pending)
        y = expect_pending(y, left)
        now = {n: layout[n] for n in out}
        for group, target, lin in steps:
            y = LINEAR[lin](y)
            if target is None:
                y = shardops.psum(spec_str(out, now), y, axes=group)
            else:
                before = spec_str(out, now)
                now = {**now, target: now[target] + group}
                y = shardops.psum_scatter(f"{before} -> {spec_str(out, now)}", y)
            left -= set(group)
            y = expect_pending(y, left)
        return y

    names = [f"x{k}" for k in range(n_ops)]
    args = {n: spec_str(o, layout) for n, o in zip(names, operands, strict=True)}
    f = typed(positional(body, names), args, spec_str(out, final))
    seed = data.draw(st.integers(0, 2**16), label="seed")
    xs = [normal(seed + k, [size[n] for n in o]) for k, o in enumerate(operands)]
    letters = {n: string.ascii_letters[i] for i, n in enumerate(used)}
    eq = ",".join("".join(letters[n] for n in o) for o in operands)
    eq += "->" + "".join(letters[n] for n in out)
    want = np.einsum(eq, *(x.astype(np.float64) for x in xs))
    scale = np.einsum(eq, *(np.abs(x.astype(np.float64)) for x in xs))
    with jax.set_mesh(mesh):
        y = jax.jit(f)(*xs)
    assert y.shape == want.shape and y.dtype == jnp.float32
    np.testing.assert_allclose(
        np.asarray(y, np.float64), want, rtol=0, atol=1e-5 * (scale.max() + 1)
    )
    if out:
        got = tuple(e if isinstance(e, tuple) else (e,) if e else () for e in y.sharding.spec)
        got = got + ((),) * (len(out) - len(got))
        assert canonical(got, sizes_of(mesh)) == canonical([final[n] for n in out], sizes_of(mesh))


# ---------------------------------------------------------------------------------------------
# Partial sums through psum_scatter + all_gather, and through all_to_all
# ---------------------------------------------------------------------------------------------


def partial_sums(mesh: Any, axes: tuple[str, ...], spec: str) -> tuple[str, Callable]:
    """Per-device partial values owing a sum over ``axes``, built in the body.

    The input is stacked: a leading ``rep/axes`` dim holds one value per device of
    ``axes``. Contracting it with ones (``einsum_unreduced``) leaves each device its own
    value, pending over ``axes``; the true value is the sum over ``rep``.
    """
    rep = dim_str("rep", axes)
    n = factor(mesh, axes)

    def make(u: Any) -> Any:
        ones = jnp.ones((n // factor(mesh, axes),), u.dtype)
        y = shardops.einsum_unreduced(f"{rep} {spec}, {rep} -> {spec}".replace(" ,", ","), u, ones)
        return expect_pending(y, axes)

    return f"{rep} {spec}".strip(), make


@examples("test_psum_scatter_several_dims_then_all_gather_equals_psum")
@given(data=st.data())
@counted
def test_psum_scatter_several_dims_then_all_gather_equals_psum(data):
    mesh = draw_mesh(data)
    rank = data.draw(st.sampled_from([3, 2, 1]), label="rank")
    order = data.draw(st.permutations(mesh.axis_names), label="axes")
    n_sum = data.draw(st.sampled_from(range(len(order), 0, -1)), label="n summed")
    summed, rest = tuple(order[:n_sum]), order[n_sum:]
    names = ["a", "b", "c"][:rank]
    layout = dict(zip(names, draw_layout(data, rest, rank), strict=True))
    # Each summed axis is scattered onto the end of some dim (several dims may gain axes).
    scattered = dict(layout)
    for a in summed:
        n = data.draw(st.sampled_from(names), label=f"dim gaining {a}")
        scattered[n] += (a,)
    event(f"{sum(scattered[n] != layout[n] for n in names)} dim(s) scattered")
    spec, split = spec_str(names, layout), spec_str(names, scattered)
    shape = [factor(mesh, scattered[n]) * data.draw(st.integers(1, 2)) for n in names]
    in_spec, make = partial_sums(mesh, summed, spec)

    def body(u):
        p = make(u)
        s = shardops.psum_scatter(f"{spec} -> {split}", p)
        s = expect_pending(s, ())
        gathered = shardops.all_gather(f"{split} -> {spec}", s)
        return gathered, shardops.psum(spec, p, axes=summed), s

    # lax.all_gather's result is not known to be replicated (JAX's varying-axes check), so
    # returning it replicated needs check_vma=False; the values are compared below.
    f = typed(body, {"u": in_spec}, (spec, spec, split), check_vma=False)
    u = normal(data.draw(st.integers(0, 2**16), label="seed"), [factor(mesh, summed), *shape])
    want = u.astype(np.float64).sum(0)
    with jax.set_mesh(mesh):
        gathered, reduced, s = jax.jit(f)(u)
    for name, y in (("all_gather(psum_scatter)", gathered), ("psum", reduced), ("scatter", s)):
        np.testing.assert_allclose(np.asarray(y), want, rtol=1e-5, atol=1e-5, err_msg=name)
    np.testing.assert_array_equal(np.asarray(gathered), np.asarray(s))


@examples("test_all_to_all_there_and_back_keeps_pending_axes")
@given(data=st.data())
@counted
def test_all_to_all_there_and_back_keeps_pending_axes(data):
    mesh = draw_mesh(data)
    rank = data.draw(st.integers(2, 3), label="rank")
    order = data.draw(st.permutations(mesh.axis_names), label="axes")
    n_sum = data.draw(st.sampled_from(range(len(order) - 1, -1, -1)), label="n summed")
    summed, rest = tuple(order[:n_sum]), order[n_sum:]
    names = ["a", "b", "c"][:rank]
    layout = dict(zip(names, draw_layout(data, rest, rank), strict=True))
    if not any(layout.values()):
        layout["a"] = (rest[0],)
    src = data.draw(st.sampled_from([n for n in names if layout[n]]), label="src")
    dst = data.draw(st.sampled_from([n for n in names if n != src]), label="dst")
    m = data.draw(st.integers(1, len(layout[src])), label="n moved")
    moved = layout[src][len(layout[src]) - m :]
    there = {**layout, src: layout[src][: len(layout[src]) - m], dst: layout[dst] + moved}
    event(f"pending over {len(summed)} axis/axes")
    spec, spec_there = spec_str(names, layout), spec_str(names, there)
    shape = [
        factor(mesh, layout[n]) * factor(mesh, there[n]) * data.draw(st.integers(1, 2))
        for n in names
    ]
    in_spec, make = partial_sums(mesh, summed, spec) if summed else (spec, lambda u: u)

    def body(u):
        p = make(u)
        z = shardops.all_to_all(f"{spec} -> {spec_there}", p)
        z = expect_pending(z, summed)
        back = expect_pending(shardops.all_to_all(f"{spec_there} -> {spec}", z), summed)
        if summed:
            return shardops.psum(spec_there, z, summed), shardops.psum(spec, back, summed)
        return z, back

    f = typed(body, {"u": in_spec}, (spec_there, spec))
    lead = [factor(mesh, summed)] if summed else []
    u = normal(data.draw(st.integers(0, 2**16), label="seed"), lead + shape)
    want = u.astype(np.float64).sum(0) if summed else u
    with jax.set_mesh(mesh):
        z, back = jax.jit(f)(u)
    np.testing.assert_allclose(np.asarray(z), want, rtol=1e-5, atol=1e-5, err_msg="there")
    np.testing.assert_allclose(np.asarray(back), want, rtol=1e-5, atol=1e-5, err_msg="back")


def test_example_counts(record_property):
    """Every property test that ran did its configured number of examples; report the total."""
    ran = {name: EXAMPLES[name] for name in MAX_EXAMPLES if EXAMPLES[name]}
    for name, n in ran.items():
        assert n == MAX_EXAMPLES[name], (name, n)
    record_property("hypothesis_examples", sum(ran.values()))
    print(f"\nproperty examples run: {sum(ran.values())} ({ran})")
