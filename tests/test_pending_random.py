"""A seeded random differential suite for pending reductions (partial sums).

Each case is a small random program run in a ``typed_shard_map`` body. It starts from an
``einsum_unreduced`` or ``index_unreduced`` result that is pending (a partial sum) over a
random non-empty subset of the mesh axes, then applies a random sequence of ops: scaling (by
a Python constant, a replicated array, a per-device mask that varies over a pending, split or
other axis), adding, subtracting, multiplying or ``jnp.where``-selecting a second partial sum
over the same or other axes, adding a reduced value (also on one device, through
``shardops.linear``), ``@`` with a weight that is replicated, split over a pending or another
axis, or contracted over a split dim (``einsum_unreduced`` of a pending operand), casts to
bf16/f32/int32, ``relu``/``tanh``, ``jnp.where`` with a mask, all-gathers (``shardops`` and
``lax``, over split axes, or over pending or other axes then summed or indexed) and
reductions (``psum``, ``pmean``, ``psum_scatter``, ``pmax``, from ``jax.lax`` and
``shardops``, some with ``{+axes}`` declarations) over random axis subsets: exactly the
pending axes, a subset, a superset with an axis the value varies over or one it does not,
any. Some ops run inside ``jax.jit``, ``jax.checkpoint``, ``lax.cond``, ``lax.scan`` or
``lax.while_loop``. The program returns, with or without a final reduction. Every program
runs on a 1-D, 2-D and 3-D mesh of the 8 CPU devices, with ``check_vma`` off and on.

The oracle is independent of shardlib: two numpy interpreters of the program over the
per-device blocks of the global inputs.

- ``A`` (actual) does what each device does: what the sharded program computes.
- ``T`` (true values) is the same program in which every partial sum is replaced, where it
  is made, by its true value (its sum over the devices of its pending axes) on every device,
  and a reduction over the pending axes of a value *completes* it (keeps the true value)
  instead of summing copies. Everything else (reductions over other axes, gathers, per-device
  masks) does what JAX does. ``T`` also tracks which axes are still owed.

A program is mathematically correct when ``A`` equals ``T`` on every device at the return
(within the tolerance of the dtypes it went through), and after every op ``A`` summed over
the axes still owed equals ``T`` (otherwise a mistake was made and erased later, e.g. by a
multiplication by zero: such a program is "ambiguous" and may go either way).

Families of programs aimed at one rule each (issue 22; ``tests/_pending_random_families.py``,
their ops in ``tests/_pending_random_ops.py``) start the same way and run one family op, half
the time as a mistake and half the time as its correct twin: per-device ``cond`` / ``switch`` /
``fori_loop`` / ``while_loop`` around a partial sum made inside; a ``scan`` carry chain of up
to 12 slots; tangents (``jvp`` / ``linearize`` / ``jacfwd``); integer partial sums as
selectors, gather / scatter indices, under integer division and narrowing or widening casts;
``reduce`` / ``reduce_window`` / gather fills; scatter-multiply, concatenation with host
zeros, ``tile``; ``reshard`` / ``repeat`` of a value that varies over the axis they split
over; a collective (psum, pmean, all_gather, all_to_all, psum_scatter, ppermute,
``shardops.shift``, or the reduction of a partial sum flowing in) inside a branch of a
per-device ``cond`` / ``switch`` or outside it (``branches``: where the devices that take
different branches would not meet, XLA pairs the collective wrongly or deadlocks, and the
oracle's ``A`` is NaN). Its mutation check only traces the programs: run, such a program
may deadlock XLA. A slow test switches each family's rule off (``tests/_pending_random_mutations.py``)
and checks that the family then catches an accepted wrong answer.

The property checked for each case: the program is refused while tracing with a shardlib
error (``PendingReductionError``, ``SpecError``, or a ``ValueError``/``TypeError`` raised by
shardlib), or it runs, its result equals ``A``, and it is correct. A refused program the
oracle calls correct must be a documented refusal: the generator tags them (``design:*``, see
``DESIGN_MESSAGES``) and the error must say so. With ``check_vma``, JAX's own refusals of
correct programs are allowed too (``jax:*``; a return JAX cannot prove replicated).
"""

from __future__ import annotations

import functools
import itertools
import math
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec
from typeguard import TypeCheckError

from shardlib import SpecError, shardops
from shardlib._env.frames import RAISED_BY_SHARDLIB
from shardlib.shardops import PendingReductionError
from shardlib.shardtypes import bf16, f32, i16, i32, typed_shard_map

pytestmark = pytest.mark.slow  # random rounds: `pytest --runslow`
MESHES = (((8,), ("d",)), ((4, 2), ("x", "y")), ((2, 2, 2), ("x", "y", "z")))
N_PROGRAMS = 56  # per mesh; each runs with check_vma off and on: 3 * 2 * 56 = 336 cases
SEED = 20240611

# The value is always 'B M' (B = 8 rows, M = 16 columns); contracted dims K, V, M are 16.

NP_DTYPE = {"f32": np.float32, "bf16": ml_dtypes.bfloat16, "i32": np.int32}
JNP_DTYPE = {"f32": jnp.float32, "bf16": jnp.bfloat16, "i32": jnp.int32}
ANN = {"f32": f32, "bf16": bf16, "i32": i32, "i16": i16}  # i16: inputs only

Layout = tuple[tuple[str, ...], tuple[str, ...]]  # the mesh axes splitting B and M
Blocks = dict[tuple[int, ...], np.ndarray]  # mesh coordinates -> the block on that device


def dim(name: str, axes: tuple[str, ...]) -> str:
    return "/".join((name, *axes))


def spec_of(lay: Layout, names: tuple[str, str] = ("B", "M")) -> str:
    return " ".join(dim(n, a) for n, a in zip(names, lay, strict=True))


def split_axes(lay: Layout) -> set[str]:
    return {a for axes in lay for a in axes}


def clause(axes: tuple[str, ...]) -> str:
    return " {+" + "+".join(axes) + "}" if axes else ""


def axis_arg(axes: tuple[str, ...]) -> str | tuple[str, ...]:
    return axes[0] if len(axes) == 1 else tuple(axes)


def rnd(x: np.ndarray, dt: str) -> np.ndarray:
    """Round float64 values to what dtype ``dt`` holds (kept as float64)."""
    if dt == "i32":
        return np.trunc(x)
    return np.asarray(x).astype(NP_DTYPE[dt]).astype(np.float64)


def promote(dt: str, other: str) -> str:
    return {np.dtype(v): k for k, v in NP_DTYPE.items()}[
        np.dtype(jnp.promote_types(JNP_DTYPE[dt], JNP_DTYPE[other]))
    ]


# ---------------------------------------------------------------------------------------------
# The mesh, in numpy
# ---------------------------------------------------------------------------------------------


class Mesh:
    def __init__(self, shape: tuple[int, ...], names: tuple[str, ...]):
        self.names = names
        self.size = dict(zip(names, shape, strict=True))
        self.coords = list(itertools.product(*(range(n) for n in shape)))
        self.jmesh = jax.make_mesh(shape, names)
        self._groups: dict[Any, list[tuple[int, ...]]] = {}

    def n(self, axes: Any) -> int:
        return math.prod(self.size[a] for a in axes)

    def lin(self, c: tuple[int, ...], axes: tuple[str, ...]) -> int:
        """Row-major index of device ``c`` over ``axes`` (as PartitionSpec and JAX order it)."""
        at = dict(zip(self.names, c, strict=True))
        j = 0
        for a in axes:
            j = j * self.size[a] + at[a]
        return j

    def group(self, c: tuple[int, ...], axes: tuple[str, ...]) -> list[tuple[int, ...]]:
        """The devices a collective over ``axes`` joins ``c`` with, in collective order."""
        key = (c, axes)
        if key not in self._groups:
            fixed = [i for i, a in enumerate(self.names) if a not in axes]
            members = [d for d in self.coords if all(d[i] == c[i] for i in fixed)]
            self._groups[key] = sorted(members, key=lambda d: self.lin(d, axes))
        return self._groups[key]

    def block(self, arr: np.ndarray, dims: tuple[tuple[str, ...], ...], c: tuple[int, ...]):
        index = []
        for n, axes in zip(arr.shape, dims, strict=True):
            k, j = self.n(axes), self.lin(c, axes)
            index.append(slice(j * (n // k), (j + 1) * (n // k)))
        return arr[tuple(index)]

    def varies(self, blocks: Blocks, a: str) -> bool:
        return any(
            not np.array_equal(blocks[c], blocks[d])
            for c in self.coords
            for d in self.group(c, (a,))
        )

    def pspec(self, dims: tuple[tuple[str, ...], ...]) -> PartitionSpec:
        return PartitionSpec(*(axis_arg(a) if a else None for a in dims))


# ---------------------------------------------------------------------------------------------
# Program state, as the two interpreters see it
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class State:
    A: Blocks  # what each device holds
    T: Blocks  # what it would hold if partial sums were their true values
    P: frozenset[str]  # the axes the value (intended) still owes a sum over
    lay: Layout
    dt: str
    bf16: bool = False  # went through bf16 somewhere: looser tolerance
    float_int: bool = False  # a float value was cast to int32 (truncation)
    noisy_int: bool = False  # ... after bf16 rounding: an off-by-one is noise, not an error

    def local_shape(self) -> tuple[int, ...]:
        return next(iter(self.A.values())).shape


def each(st: State, fn: Callable[[np.ndarray, tuple[int, ...], str], np.ndarray], dt: str):
    """Apply ``fn(block, coords, which)`` on every device, in both interpreters; round."""
    A = {c: rnd(fn(b, c, "A"), dt) for c, b in st.A.items()}
    T = {c: rnd(fn(b, c, "T"), dt) for c, b in st.T.items()}
    return replace(st, A=A, T=T, dt=dt, bf16=st.bf16 or dt == "bf16")


def reduce_blocks(
    m: Mesh, blocks: Blocks, R: tuple[str, ...], complete: frozenset[str], dt: str
) -> Blocks:
    """psum over ``R``; for the axes in ``complete`` (intended interpreter, pending axes) the
    copies of the true value are averaged instead of summed (the reduction completes it)."""
    div = m.n([a for a in R if a in complete])
    return {c: rnd(sum(blocks[d] for d in m.group(c, R)) / div, dt) for c in m.coords}


# ---------------------------------------------------------------------------------------------
# Ops: each knows how to run in the body (jax) and in the two interpreters (sim)
# ---------------------------------------------------------------------------------------------


class Program:
    """Inputs, ops and the oracle's verdict of one random program."""

    def __init__(self, mesh: Mesh, name: str):
        self.mesh = mesh
        self.name = name
        self.inputs: list[tuple[str, str, str, np.ndarray]] = []  # name, dtype, spec, global
        self.ops: list[Op] = []
        self.tags: set[str] = set()
        self.final: State | None = None
        self.linear_on_pending = 0  # ops applied to a value while it was a partial sum
        self.mistake: int | None = None  # the first op after which A and T disagree

    def add_input(self, prefix: str, dt: str, spec: str, arr: np.ndarray) -> str:
        name = f"{prefix}{len(self.inputs)}"
        self.inputs.append((name, dt, spec, arr))
        return name

    def array(self, name: str) -> tuple[np.ndarray, tuple[tuple[str, ...], ...]]:
        for n, _, spec, arr in self.inputs:
            if n == name:
                dims = tuple(tuple(d.split("/")[1:]) for d in spec.split())
                return arr, dims
        raise KeyError(name)

    def block(self, name: str, c: tuple[int, ...]) -> np.ndarray:
        arr, dims = self.array(name)
        return self.mesh.block(arr, dims, c).astype(np.float64)

    def describe(self) -> str:
        ins = ", ".join(f"{n}: {dt}[{spec!r}]" for n, dt, spec, _ in self.inputs)
        ops = "\n    ".join(f"{o!r}" + (f"  [in {o.wrap}]" if o.wrap else "") for o in self.ops)
        return f"{self.name}({ins}) on mesh {self.mesh.size}:\n    {ops}"


class Op:
    tags: frozenset[str] = frozenset()
    wrap: str | None = None  # run inside jax.jit / checkpoint / lax.cond / scan / while_loop

    def call(self, v: Any, a: dict[str, Any]) -> Any:
        if self.wrap is None:
            return self.jax(v, a)
        f = functools.partial(self.jax, a=a)
        if self.wrap == "jit":
            return jax.jit(f)(v)
        if self.wrap == "checkpoint":
            return jax.checkpoint(f)(v)
        if self.wrap == "scan":  # one iteration, the value as the carry
            return lax.scan(lambda c, _: (f(c), None), v, None, length=1)[0]
        if self.wrap == "while":
            return lax.while_loop(lambda s: s[0] < 1, lambda s: (s[0] + 1, f(s[1])), (0, v))[1]
        return lax.cond(jnp.bool_(True), f, f, v)

    def jax(self, v: Any, a: dict[str, Any]) -> Any:
        raise NotImplementedError

    def sim(self, st: State, pg: Program) -> State:
        raise NotImplementedError


@dataclass(repr=False)
class Start(Op):
    """A partial sum from fresh inputs: einsum_unreduced or index_unreduced."""

    kind: str  # 'einsum' | 'index'
    names: tuple[str, str]
    s: tuple[str, ...]
    P: tuple[str, ...]
    q: tuple[str, ...]
    declare: bool

    def spec(self) -> str:
        b, p, m = dim("B", self.s), self.P, dim("M", self.q)
        if self.kind == "einsum":
            text = f"{b} {dim('K', p)}, {dim('K', p)} {m} -> {b} {m}"
        else:
            text = f"[{dim('V', p)}] {m}, {b} -> {b} {m}"
        return text + (clause(p) if self.declare else "")

    def __repr__(self) -> str:
        op = "einsum_unreduced" if self.kind == "einsum" else "index_unreduced"
        return f"{op}({self.spec()!r}, {self.names[0]}, {self.names[1]})"

    def jax(self, v: Any, a: dict[str, Any]) -> Any:
        f = shardops.einsum_unreduced if self.kind == "einsum" else shardops.index_unreduced
        return f(self.spec(), a[self.names[0]], a[self.names[1]])

    def make(self, pg: Program) -> tuple[Blocks, Blocks]:
        m = pg.mesh
        local = {}
        for c in m.coords:
            x, y = pg.block(self.names[0], c), pg.block(self.names[1], c)
            if self.kind == "einsum":
                local[c] = x @ y
            else:  # x: the table block, y: the indices
                off = m.lin(c, self.P) * x.shape[0]
                k = y.astype(np.int64) - off
                ok = (k >= 0) & (k < x.shape[0])
                local[c] = np.where(ok[:, None], x[np.where(ok, k, 0)], 0.0)
        A = {c: rnd(b, "f32") for c, b in local.items()}
        T = {c: rnd(sum(local[d] for d in m.group(c, self.P)), "f32") for c in m.coords}
        return A, T


@dataclass(repr=False)
class Scale(Op):
    c: float | int
    how: str = "mul"  # 'mul' | 'div' | 'neg'

    def __repr__(self) -> str:
        return {"mul": f"v * {self.c!r}", "div": f"v / {self.c!r}", "neg": "-v"}[self.how]

    def jax(self, v, a):
        return {"mul": lambda: v * self.c, "div": lambda: v / self.c, "neg": lambda: -v}[self.how]()

    def sim(self, st, pg):
        if self.how == "neg":
            return each(st, lambda b, c, w: -b, st.dt)
        to_float = isinstance(self.c, float) or self.how == "div"
        dt = "f32" if st.dt == "i32" and to_float else st.dt
        if self.how == "div":
            return each(st, lambda b, c, w: b / self.c, dt)
        return each(st, lambda b, c, w: b * self.c, dt)


@dataclass(repr=False)
class ScaleArr(Op):
    """By a replicated scalar f32[''] or a vector f32['M/q'] split like the value's M."""

    name: str

    def __repr__(self) -> str:
        return f"v * {self.name}"

    def jax(self, v, a):
        return v * a[self.name]

    def sim(self, st, pg):
        return each(st, lambda b, c, w: b * pg.block(self.name, c), promote(st.dt, "f32"))


@dataclass(repr=False)
class Mask(Op):
    """A random per-device mask: jax.random with fold_in(axis_index(axis)) (same on every
    device when axis is None), applied by multiplying or with jnp.where."""

    seed: int
    axis: str | None
    how: str  # 'mul' | 'where0' | 'where0r' | 'wherec'
    c: int = 0

    def __repr__(self) -> str:
        m = f"mask(seed={self.seed}, varies over {self.axis or 'nothing'})"
        if self.how == "mul":
            return f"v * {m}"
        if self.how == "where0r":
            return f"jnp.where({m}, 0, v)"
        return f"jnp.where({m}, v, {self.c})"

    def jax(self, v, a):
        m = draw_mask(self.seed, self.axis, v.shape)
        if self.how == "mul":
            return v * m.astype(v.dtype)
        if self.how == "where0r":
            return jnp.where(m, 0, v)
        return jnp.where(m, v, self.c)

    def sim(self, st, pg):
        def fn(b, c, w):
            m = mask_at(pg.mesh, self.seed, self.axis, b.shape, c)
            if self.how == "where0r":
                return np.where(m, 0.0, b)
            return b * m if self.how == "mul" else np.where(m, b, self.c)

        return each(st, fn, st.dt)


def draw_mask(seed: int, axis: str | None, shape: tuple[int, ...]) -> jax.Array:
    """In the body: a random boolean mask that varies over ``axis`` (or is the same on every
    device)."""
    key = jax.random.key(seed)
    if axis is not None:
        key = jax.random.fold_in(key, lax.axis_index(axis))
    return jax.random.bernoulli(key, 0.5, shape)


@functools.cache
def mask_table(seed: int, n: int, shape: tuple[int, ...]) -> list[np.ndarray]:
    """The masks the body draws, computed the same way outside it (one per axis index)."""
    key = jax.random.key(seed)
    keys = [jax.random.fold_in(key, i) for i in range(n)] if n else [key]
    return [np.asarray(jax.random.bernoulli(k, 0.5, shape)) for k in keys]


def mask_at(m: Mesh, seed: int, axis: str | None, shape: tuple[int, ...], c: tuple[int, ...]):
    table = mask_table(seed, m.size[axis] if axis else 0, tuple(shape))
    return table[m.lin(c, (axis,)) if axis else 0]


@dataclass(repr=False)
class Cast(Op):
    to: str

    def __repr__(self) -> str:
        return f"v.astype({self.to})"

    def jax(self, v, a):
        return v.astype(JNP_DTYPE[self.to])

    def sim(self, st, pg):
        out = each(st, lambda b, c, w: b, self.to)
        if self.to == "i32" and st.dt != "i32":
            out = replace(out, float_int=True, noisy_int=st.noisy_int or st.bf16)
        return out


@dataclass(repr=False)
class Nonlin(Op):
    fn: str  # 'relu' | 'tanh'

    def __repr__(self) -> str:
        return "jax.nn.relu(v)" if self.fn == "relu" else "jnp.tanh(v)"

    def jax(self, v, a):
        return jax.nn.relu(v) if self.fn == "relu" else jnp.tanh(v)

    def sim(self, st, pg):
        if self.fn == "relu":
            return each(st, lambda b, c, w: np.maximum(b, 0), st.dt)
        return each(st, lambda b, c, w: np.tanh(b), "f32" if st.dt == "i32" else st.dt)


@dataclass(repr=False)
class AddPartial(Op):
    """v + another partial sum (einsum_unreduced / index_unreduced) laid out like v."""

    start: Start
    how: str = "+"  # '+' | '-' | '*' | 'where' (jnp.where(mask, v, u))
    seed: int = 0
    axis: str | None = None  # the mask of 'where' varies over it

    def __repr__(self) -> str:
        if self.how == "where":
            m = f"mask(seed={self.seed}, varies over {self.axis or 'nothing'})"
            return f"jnp.where({m}, v, {self.start!r})"
        return f"v {self.how} {self.start!r}"

    def jax(self, v, a):
        u = self.start.jax(None, a)
        if self.how == "where":
            return jnp.where(draw_mask(self.seed, self.axis, v.shape), v, u)
        return {"+": lambda: v + u, "-": lambda: v - u, "*": lambda: v * u}[self.how]()

    def sim(self, st, pg):
        uA, uT = self.start.make(pg)
        dt = promote(st.dt, "f32")
        m = pg.mesh
        f = {"+": np.add, "-": np.subtract, "*": np.multiply}.get(self.how)

        def g(b: np.ndarray, u: np.ndarray, c: tuple[int, ...]) -> np.ndarray:
            if f is not None:
                return f(b, u)
            return np.where(mask_at(m, self.seed, self.axis, b.shape, c), b, u)

        A = {c: rnd(g(b, uA[c], c), dt) for c, b in st.A.items()}
        T = {c: rnd(g(b, uT[c], c), dt) for c, b in st.T.items()}
        return replace(st, A=A, T=T, dt=dt, P=st.P | frozenset(self.start.P))


@dataclass(repr=False)
class AddReduced(Op):
    name: str
    sub: bool = False

    def __repr__(self) -> str:
        return f"v {'-' if self.sub else '+'} {self.name}"

    def jax(self, v, a):
        return v - a[self.name] if self.sub else v + a[self.name]

    def sim(self, st, pg):
        sign = -1.0 if self.sub else 1.0
        return each(st, lambda b, c, w: b + sign * pg.block(self.name, c), promote(st.dt, "f32"))


@dataclass(repr=False)
class AddOnOneDevice(Op):
    """v + b on the devices at index 0 of the pending axes (the documented way to add a
    bias to a partial sum), inside shardops.linear or (refused by design) without it."""

    name: str
    axes: tuple[str, ...]
    linear: bool

    def __repr__(self) -> str:
        f = f"v + {self.name} * all(axis_index(a) == 0 for a in {self.axes})"
        return f"shardops.linear(lambda v: {f}, v)" if self.linear else f

    @property
    def tags(self):  # type: ignore[override]
        return frozenset() if self.linear else frozenset({"design:one_device_add"})

    def jax(self, v, a):
        b = a[self.name]

        def fn(t):
            first = functools.reduce(
                jnp.logical_and, [shardops.axis_index(ax) == 0 for ax in self.axes]
            )
            return t + b * first.astype(b.dtype)

        return shardops.linear(fn, v) if self.linear else fn(v)

    def sim(self, st, pg):
        def fn(b, c, w):
            first = all(pg.mesh.lin(c, (ax,)) == 0 for ax in self.axes)
            return b + pg.block(self.name, c) * (1.0 if w == "T" or first else 0.0)

        return each(st, fn, promote(st.dt, "f32"))


@dataclass(repr=False)
class MatMul(Op):
    """v @ w: w is 'M N' (replicated), 'M N/a' (columns split over a), or 'M/q N' with v's M
    split over q (then einsum_unreduced, which makes a new partial sum over q)."""

    name: str
    kind: str  # 'repl' | 'split_out' | 'contract'
    lay: Layout
    a: str | None = None
    declare: tuple[str, ...] | None = None  # the operand's pending axes, in the spec

    def espec(self) -> str:
        s, q = self.lay
        if self.declare is None:
            c_in = c_out = ""
        else:
            c_in, c_out = clause(self.declare), clause((*self.declare, *q))
        n = dim("N", (self.a,) if self.a else ())
        return f"{dim('B', s)} {dim('M', q)}{c_in}, {dim('M', q)} {n} -> {dim('B', s)} {n}{c_out}"

    def __repr__(self) -> str:
        if self.kind == "contract":
            return f"shardops.einsum_unreduced({self.espec()!r}, v, {self.name})"
        return f"v @ {self.name}"

    def jax(self, v, a):
        if self.kind == "contract":
            return shardops.einsum_unreduced(self.espec(), v, a[self.name])
        return v @ a[self.name]

    def sim(self, st, pg):
        m = pg.mesh
        s, q = st.lay
        local = {
            w: {c: blk @ pg.block(self.name, c) for c, blk in bl.items()}
            for w, bl in (("A", st.A), ("T", st.T))
        }
        A = {c: rnd(b, "f32") for c, b in local["A"].items()}
        if self.kind == "contract":
            T = {c: rnd(sum(local["T"][d] for d in m.group(c, q)), "f32") for c in m.coords}
            lay = (s, (self.a,) if self.a else ())
            return replace(st, A=A, T=T, dt="f32", P=st.P | frozenset(q), lay=lay)
        T = {c: rnd(b, "f32") for c, b in local["T"].items()}
        lay = (s, (self.a,)) if self.kind == "split_out" else st.lay
        return replace(st, A=A, T=T, dt="f32", lay=lay)


@dataclass(repr=False)
class GatherSplit(Op):
    """All-gather (tiled) over trailing axes R of the axes splitting dim ``d``."""

    d: int
    R: tuple[str, ...]
    lay: Layout
    use_shardops: bool
    declare: tuple[str, ...] = ()

    def new_lay(self) -> Layout:
        dims = list(self.lay)
        dims[self.d] = dims[self.d][: len(dims[self.d]) - len(self.R)]
        return (dims[0], dims[1])

    def gspec(self) -> str:
        c = clause(self.declare)
        return f"{spec_of(self.lay)}{c} -> {spec_of(self.new_lay())}{c}"

    def __repr__(self) -> str:
        if self.use_shardops:
            return f"shardops.all_gather({self.gspec()!r}, v)"
        return f"lax.all_gather(v, {axis_arg(self.R)!r}, axis={self.d}, tiled=True)"

    def jax(self, v, a):
        if self.use_shardops:
            return shardops.all_gather(self.gspec(), v)
        return lax.all_gather(v, axis_arg(self.R), axis=self.d, tiled=True)

    def sim(self, st, pg):
        m = pg.mesh

        def gather(bl: Blocks) -> Blocks:
            return {
                c: np.concatenate([bl[g] for g in m.group(c, self.R)], axis=self.d)
                for c in m.coords
            }

        return replace(st, A=gather(st.A), T=gather(st.T), lay=self.new_lay())


@dataclass(repr=False)
class GatherStack(Op):
    """All-gather over axes R that do not split the value (pending or free), then sum the
    gathered copies (an all-reduce written as a gather) or keep the first one."""

    R: tuple[str, ...]
    then: str  # 'sum' | 'first'
    use_shardops: bool
    k: int  # for a fresh dim name
    lay: Layout
    P: frozenset[str]

    @property
    def tags(self):  # type: ignore[override]
        return frozenset({"design:gather_pending"}) if set(self.R) & self.P else frozenset()

    def gspec(self) -> str:
        g = f"G{self.k}"
        m = dim("M", self.lay[1])
        return f"{dim(g, self.R)} {m} -> {g} {m}"

    def __repr__(self) -> str:
        if self.use_shardops:
            g = f"shardops.all_gather({self.gspec()!r}, v).reshape(n, *v.shape)"
        else:
            g = f"lax.all_gather(v, {axis_arg(self.R)!r}, axis=0, tiled=False)"
        return f"{g}.sum(0)" if self.then == "sum" else f"{g}[0]"

    def jax(self, v, a):
        if self.use_shardops:
            g = shardops.all_gather(self.gspec(), v)
            g = g.reshape((-1, *v.shape))
        else:
            g = lax.all_gather(v, axis_arg(self.R), axis=0, tiled=False)
        return g.sum(0) if self.then == "sum" else g[0]

    def sim(self, st, pg):
        m = pg.mesh
        if self.then == "sum":
            A = reduce_blocks(m, st.A, self.R, frozenset(), st.dt)
            T = reduce_blocks(m, st.T, self.R, st.P, st.dt)
            return replace(st, A=A, T=T, P=st.P - set(self.R))
        A = {c: st.A[m.group(c, self.R)[0]] for c in m.coords}
        T = {c: st.T[m.group(c, self.R)[0]] for c in m.coords}
        return replace(st, A=A, T=T)


@dataclass(repr=False)
class Reduce(Op):
    """psum / pmean / psum_scatter (jax.lax or shardops) over axes R."""

    kind: str  # 'psum' | 'pmean' | 'psum_scatter' | 'pmax'
    lib: str  # 'lax' | 'shardops'
    R: tuple[str, ...]
    lay: Layout
    d: int = 0  # scatter dim
    declare: tuple[str, ...] = ()
    tuple_axes: bool = False
    tags: frozenset[str] = frozenset()

    def new_lay(self) -> Layout:
        if self.kind != "psum_scatter":
            return self.lay
        dims = list(self.lay)
        dims[self.d] = (*dims[self.d], *self.R)
        return (dims[0], dims[1])

    def sspec(self) -> str:
        text = spec_of(self.lay) + clause(self.declare)
        if self.kind == "psum_scatter":
            left = tuple(a for a in self.declare if a not in self.R)
            text += f" -> {spec_of(self.new_lay())}{clause(left)}"
        return text

    def __repr__(self) -> str:
        if self.lib == "shardops":
            if self.kind == "psum_scatter":
                return f"shardops.psum_scatter({self.sspec()!r}, v)"
            return f"shardops.{self.kind}({self.sspec()!r}, v, axes={self.axes()!r})"
        extra = f", scatter_dimension={self.d}, tiled=True" if self.kind == "psum_scatter" else ""
        return f"lax.{self.kind}(v, {axis_arg(self.R)!r}{extra})"

    def axes(self) -> str | tuple[str, ...]:
        return tuple(self.R) if self.tuple_axes else "/".join(self.R)

    def jax(self, v, a):
        if self.lib == "shardops":
            if self.kind == "psum_scatter":
                return shardops.psum_scatter(self.sspec(), v)
            return getattr(shardops, self.kind)(self.sspec(), v, axes=self.axes())
        if self.kind == "psum_scatter":
            return lax.psum_scatter(v, axis_arg(self.R), scatter_dimension=self.d, tiled=True)
        return getattr(lax, self.kind)(v, axis_arg(self.R))

    def sim(self, st, pg):
        m = pg.mesh
        if self.kind == "pmax":
            A, T = (
                {c: np.max([bl[d] for d in m.group(c, self.R)], axis=0) for c in m.coords}
                for bl in (st.A, st.T)
            )
            return replace(st, A=A, T=T, P=st.P - set(self.R))
        A = reduce_blocks(m, st.A, self.R, frozenset(), st.dt)
        T = reduce_blocks(m, st.T, self.R, st.P, st.dt)
        if self.kind == "pmean":
            A = {c: rnd(b / m.n(self.R), st.dt) for c, b in A.items()}
            T = {c: rnd(b / m.n(self.R), st.dt) for c, b in T.items()}
        if self.kind == "psum_scatter":
            n = m.n(self.R)

            def chunk(bl: Blocks) -> Blocks:
                return {c: np.split(b, n, axis=self.d)[m.lin(c, self.R)] for c, b in bl.items()}

            A, T = chunk(A), chunk(T)
        return replace(st, A=A, T=T, P=st.P - set(self.R), lay=self.new_lay())


# ---------------------------------------------------------------------------------------------
# The generator
# ---------------------------------------------------------------------------------------------


class Gen:
    """Builds one random program and runs both interpreters as it goes (the choices of
    axes, 'varies over' or not, use the interpreters' state)."""

    def __init__(self, mesh: Mesh, rng: np.random.RandomState, name: str):
        self.m = mesh
        self.rng = rng
        self.pg = Program(mesh, name)
        self.k = 0

    # -- helpers ---------------------------------------------------------------------------

    def pick(self, seq: Any) -> Any:
        seq = list(seq)
        return seq[self.rng.randint(len(seq))]

    def perm(self, axes: Any) -> tuple[str, ...]:
        axes = sorted(axes)  # not the order of a set: it changes with the string hash seed
        return tuple(axes[i] for i in self.rng.permutation(len(axes)))

    def subset(self, axes: Any, nonempty: bool = True) -> tuple[str, ...]:
        axes = list(axes)
        while True:
            keep = tuple(a for a in self.perm(axes) if self.rng.rand() < 0.5)
            if keep or not nonempty or not axes:
                return keep

    def normal(self, shape: tuple[int, ...], scale: float = 1.0) -> np.ndarray:
        return (self.rng.normal(size=shape) * scale).astype(np.float32)

    def start(self, s: tuple[str, ...], P: tuple[str, ...], q: tuple[str, ...]) -> Start:
        add = self.pg.add_input
        declare = self.rng.rand() < 0.3
        if self.rng.rand() < 0.7:
            x = add("x", "f32", f"{dim('B', s)} {dim('K', P)}", self.normal((8, 16)))
            w = add("w", "f32", f"{dim('K', P)} {dim('M', q)}", self.normal((16, 16), 0.5))
            return Start("einsum", (x, w), s, P, q, declare)
        t = add("t", "f32", f"{dim('V', P)} {dim('M', q)}", self.normal((16, 16), 2.0))
        idx = self.rng.randint(0, 16, size=(8,)).astype(np.int32)
        i = add("i", "i32", dim("B", s), idx)
        return Start("index", (t, i), s, P, q, declare)

    # -- op proposals: (op, safe) or None when not applicable --------------------------------

    def proposals(self, st: State) -> list[tuple[float, Callable[[], tuple[Op, bool] | None]]]:
        return [
            (1.0, lambda: self.p_scale(st)),
            (1.0, lambda: self.p_scale_arr(st)),
            (2.0, lambda: self.p_mask(st)),
            (1.0, lambda: self.p_cast(st)),
            (1.0, lambda: self.p_nonlin(st)),
            (1.5, lambda: self.p_add_partial(st)),
            (1.0, lambda: self.p_add_reduced(st)),
            (1.0, lambda: self.p_add_one_device(st)),
            (2.0, lambda: self.p_matmul(st)),
            (1.0, lambda: self.p_gather_split(st)),
            (1.0, lambda: self.p_gather_stack(st)),
            (4.0, lambda: self.p_reduce(st)),
        ]

    def p_scale(self, st):
        if self.rng.rand() < 0.05:
            return Scale(0), True
        c = self.pick([0.5, -2.0, 3.0, 2, -1])
        return Scale(c, self.pick(["mul", "mul", "div", "neg"])), True

    def p_scale_arr(self, st):
        if self.rng.rand() < 0.5:
            name = self.pg.add_input("s", "f32", "", self.normal(()) + np.float32(1.5))
        else:
            vec = self.rng.uniform(0.5, 1.5, size=16) * self.rng.choice([-1, 1], size=16)
            name = self.pg.add_input("r", "f32", dim("M", st.lay[1]), vec.astype(np.float32))
        return ScaleArr(name), True

    def p_mask(self, st):
        split = split_axes(st.lay)
        free = [a for a in self.m.names if a not in split and a not in st.P]
        axis = self.pick([None, *sorted(split), *free, *sorted(st.P)])
        how = self.pick(["mul", "mul", "where0", "where0r", "wherec"])
        c = self.pick([1, -2]) if how == "wherec" else 0
        safe = axis not in st.P and (how != "wherec" or not st.P)
        return Mask(int(self.rng.randint(1 << 20)), axis, how, c), safe

    def p_cast(self, st):
        to = self.pick(["f32", "bf16", "i32"])
        return Cast(to), to != "i32" or st.dt == "i32" or not st.P

    def p_nonlin(self, st):
        return Nonlin(self.pick(["relu", "tanh"])), not st.P

    def p_add_partial(self, st):
        s, q = st.lay
        avail = [a for a in self.m.names if a not in split_axes(st.lay)]
        if not avail:
            return None
        if st.P and set(avail) >= st.P and self.rng.rand() < 0.6:
            P2 = self.perm(st.P)
        else:
            P2 = self.subset(avail)
        how = self.pick(["+", "+", "-", "*", "where"])
        if how == "where":  # selecting between two partial sums: right if the mask is the
            # same on every device of their axes
            split = split_axes(st.lay)
            free = [a for a in self.m.names if a not in split and a not in st.P | set(P2)]
            axis = self.pick([None, *sorted(split), *free, *sorted(st.P | set(P2))])
            op = AddPartial(self.start(s, P2, q), how, int(self.rng.randint(1 << 20)), axis)
            return op, set(P2) == st.P and axis not in st.P
        if how == "*":  # a product: linear in u only if v is not pending and the same over P2
            vary = {a for a in P2 if self.m.varies(st.A, a)}
            op = AddPartial(self.start(s, P2, q), how)
            if st.P:  # right when the axes are disjoint, but refused by design
                op.tags = frozenset({"design:product_of_partials"})
            return op, not st.P and not vary
        return AddPartial(self.start(s, P2, q), how), set(P2) == st.P

    def p_add_reduced(self, st):
        name = self.pg.add_input("b", "f32", spec_of(st.lay), self.normal((8, 16)))
        return AddReduced(name, self.rng.rand() < 0.3), not st.P

    def p_add_one_device(self, st):
        if not st.P:
            return None
        name = self.pg.add_input("b", "f32", spec_of(st.lay), self.normal((8, 16)))
        linear = self.rng.rand() < 0.7
        return AddOnOneDevice(name, self.perm(st.P), linear), linear

    def p_matmul(self, st):
        s, q = st.lay
        w = self.normal((16, 16), 0.25)
        if q:
            outs = [a for a in self.m.names if a not in s and a not in q]
            a = self.pick(outs) if outs and self.rng.rand() < 0.4 else None
            n = dim("N", (a,) if a else ())
            name = self.pg.add_input("W", "f32", f"{dim('M', q)} {n}", w)
            declare = self.perm(st.P) if self.rng.rand() < 0.3 else None
            op = MatMul(name, "contract", st.lay, a, declare)
            return op, not (set(q) & st.P) and a not in st.P
        outs = [a for a in self.m.names if a not in s]
        if outs and self.rng.rand() < 0.5:
            a = self.pick(outs)
            name = self.pg.add_input("W", "f32", f"M {dim('N', (a,))}", w)
            return MatMul(name, "split_out", st.lay, a), a not in st.P
        name = self.pg.add_input("W", "f32", "M N", w)
        return MatMul(name, "repl", st.lay), True

    def p_gather_split(self, st):
        dims = [d for d in (0, 1) if st.lay[d]]
        if not dims:
            return None
        d = self.pick(dims)
        n = 1 + self.rng.randint(len(st.lay[d]))
        R = st.lay[d][len(st.lay[d]) - n :]
        use_shardops = self.rng.rand() < 0.5
        declare: tuple[str, ...] = ()
        if use_shardops and st.P and self.rng.rand() < 0.4:
            declare = self.perm(st.P) if self.rng.rand() < 0.8 else self.subset(self.m.names)
        op = GatherSplit(d, R, st.lay, use_shardops, declare)
        if declare and set(declare) != st.P:
            op.tags = frozenset({"design:wrong_declaration"})
        return op, True

    def p_gather_stack(self, st):
        avail = [a for a in self.m.names if a not in split_axes(st.lay)]
        if not avail:
            return None
        R = self.subset(avail)
        self.k += 1
        op = GatherStack(
            R, self.pick(["sum", "first"]), self.rng.rand() < 0.5, self.k, st.lay, st.P
        )
        return op, not (set(R) & st.P)

    def p_reduce(self, st, final: bool = False):
        m = self.m
        split = split_axes(st.lay)
        vary = {a for a in m.names if m.varies(st.A, a)}
        P = sorted(st.P)
        others = [a for a in m.names if a not in st.P]
        choices = []
        if P:
            choices += ["exact", "exact"]
            if len(P) > 1:
                choices.append("subset")
        if [a for a in others if a in vary]:
            choices.append("super_vary")
        if [a for a in others if a not in vary]:
            choices.append("super_invariant")
        choices.append("random")
        how = "final" if final else self.pick(choices)
        if how == "final":
            R = self.perm(set(P) | {a for a in vary if a not in split and a not in st.P})
        elif how == "exact":
            R = self.perm(P)
        elif how == "subset":
            R = self.subset(P)
            R = R if len(R) < len(P) else R[:-1]
        elif how == "super_vary":
            extra = self.subset([a for a in others if a in vary])
            R = self.perm([*P, *extra])
        elif how == "super_invariant":
            extra = self.subset([a for a in others if a not in vary])
            R = self.perm([*P, *extra])
        else:
            R = self.subset(m.names)
        if not R:
            return None
        kinds = ["psum", "psum"]
        if st.dt != "i32":
            kinds.append("pmean")
        local = st.local_shape()
        scatter_dims = [d for d in (0, 1) if local[d] % m.n(R) == 0 and not (set(R) & split)]
        if scatter_dims:
            kinds += ["psum_scatter", "psum_scatter"]
        if not final:
            kinds.append("pmax")
        kind = self.pick(kinds)
        lib = self.pick(["lax", "shardops"])
        d = self.pick(scatter_dims) if kind == "psum_scatter" else 0
        tags = set()
        invariant = {a for a in R if a not in st.P and a not in vary}
        if invariant and (lib == "shardops" or st.P) and kind != "pmax":
            tags.add("design:invariant_sum")
        if invariant and lib == "lax" and kind != "pmax":
            # JAX may see the other axes as varying (all_gather results stay varying)
            tags.add("jax:sum_mixed_varying")
        if lib == "shardops" and kind != "psum_scatter" and set(R) & split:
            tags.add("design:shardops_reduce_split")
        declare: tuple[str, ...] = ()
        if lib == "shardops" and self.rng.rand() < 0.35:
            right = st.P and self.rng.rand() < 0.75
            declare = self.perm(st.P) if right else self.subset(m.names)
            if set(declare) != st.P:
                tags.add("design:wrong_declaration")
        op = Reduce(kind, lib, R, st.lay, d, declare, self.rng.rand() < 0.3, frozenset(tags))
        safe = how in ("exact", "subset", "super_vary", "final") and not tags
        safe = safe and not (kind == "pmax" and st.P)
        return op, safe

    # -- the program -------------------------------------------------------------------------

    def apply(self, op: Op, st: State) -> State:
        new = op.sim(st, self.pg)
        if self.rng.rand() < 0.25:
            wraps = ["jit", "checkpoint", "cond"]
            if isinstance(op, Scale | ScaleArr | Mask | MatMul | AddReduced | Cast) and (
                self.same_type(st, new)
            ):  # a loop carry must keep its type (and its pending axes)
                wraps += ["scan", "while"]
            op.wrap = self.pick(wraps)
            if op.wrap in ("scan", "while"):  # JAX may type the carry as varying over more
                self.pg.tags.add("jax:carry_vma")
        self.pg.ops.append(op)
        self.pg.tags |= set(op.tags)
        if st.P and (
            isinstance(op, Nonlin)
            or (isinstance(op, Reduce) and op.kind == "pmax")
            or (isinstance(op, Cast) and op.to == "i32" and st.dt != "i32")
            or (isinstance(op, Mask) and op.how == "wherec")
        ):
            # Wrong for an einsum_unreduced partial sum, but right for an index_unreduced one
            # (each element has one non-zero share, and f(0) = 0): refused by design.
            self.pg.tags.add("design:nonlinear_on_pending")
        if st.P and not isinstance(op, Reduce | GatherStack):
            self.pg.linear_on_pending += 1
        if self.pg.mistake is None and not consistent(self.m, new):
            self.pg.mistake = len(self.pg.ops) - 1
        return new

    def same_type(self, st: State, new: State) -> bool:
        vary = [{a for a in self.m.names if self.m.varies(x.A, a)} for x in (st, new)]
        return (st.dt, st.lay, st.P, st.local_shape()) == (
            new.dt,
            new.lay,
            new.P,
            new.local_shape(),
        ) and vary[0] == vary[1]

    def build(self) -> Program:
        rng, m = self.rng, self.m
        role = {a: self.pick("PPsqr") for a in m.names}
        if "P" not in role.values():
            role[self.pick(m.names)] = "P"
        s, P, q = (self.perm(a for a in m.names if role[a] == r) for r in "sPq")
        first = self.start(s, P, q)
        self.pg.ops.append(first)
        A, T = first.make(self.pg)
        st = State(A, T, frozenset(P), (s, q), "f32")
        p_bad = self.pick([0.0, 0.0, 0.15, 0.4, 0.8])
        for _ in range(1 + rng.randint(5)):
            risky = rng.rand() < p_bad
            props = self.proposals(st)
            weights = np.array([w for w, _ in props])
            for _attempt in range(20):
                _, make = props[rng.choice(len(props), p=weights / weights.sum())]
                n_inputs = len(self.pg.inputs)
                got = make()
                if got is not None and (risky or got[1]):
                    break
                del self.pg.inputs[n_inputs:]  # the inputs of a rejected proposal
            else:
                continue
            st = self.apply(got[0], st)
        r = rng.rand()
        if r < 0.65 or (r < 0.8 and p_bad == 0):
            got = self.p_reduce(st, final=True)
        elif r < 0.85:
            got = self.p_reduce(st)
        else:
            got = None
        if got is not None:
            st = self.apply(got[0], st)
        self.pg.final = st
        return self.pg


# ---------------------------------------------------------------------------------------------
# The oracle's verdict
# ---------------------------------------------------------------------------------------------


def tolerance(st: State) -> float:
    return 2e-2 if st.bf16 else 2e-4


def compare(st: State, A: Blocks, T: Blocks) -> tuple[str, str]:
    """('correct' | 'ambiguous' | 'wrong', why): do A and T agree on every device?"""
    scale = max(1.0, max(float(np.abs(b).max()) for b in T.values()))
    err = max(float(np.abs(A[c] - T[c]).max()) for c in A)
    tol = tolerance(st) * scale
    if err <= tol:
        return "correct", ""
    slack = 1.0 if st.noisy_int else 0.0  # bf16 noise before a truncation: off by one
    if err <= 5 * tol + slack:
        return "ambiguous", f"max |A - T| = {err:.3g} (tolerance {tol:.3g})"
    return "wrong", f"max |A - T| = {err:.3g} (scale {scale:.3g})"


def consistent(m: Mesh, st: State) -> bool:
    """After each op of a correct program, A summed over the pending axes equals T (where
    the true values are): a step that breaks this is a mistake, even if a later op (a
    multiplication by zero, a mask) happens to erase its effect on the result."""
    R = tuple(sorted(st.P))
    A = reduce_blocks(m, st.A, R, frozenset(), st.dt) if R else st.A
    T = reduce_blocks(m, st.T, R, st.P, st.dt) if R else st.T
    return compare(st, A, T)[0] != "wrong"


def verdict(pg: Program) -> tuple[str, str]:
    """('correct' | 'wrong' | 'ambiguous', why), from the two interpreters."""
    st = pg.final
    assert st is not None
    truth, why = compare(st, st.A, st.T)
    if truth == "wrong" and st.P:
        why += f"; returns a value still pending over {sorted(st.P)}"
    if truth == "correct" and pg.mistake is not None:
        return "ambiguous", f"right result, but op {pg.mistake} was a mistake (erased later)"
    return truth, why


def vma_bad(pg: Program) -> list[str]:
    """Axes the result varies over although the return annotation says it is replicated."""
    st = pg.final
    assert st is not None
    split = split_axes(st.lay)
    return [a for a in pg.mesh.names if a not in split and pg.mesh.varies(st.A, a)]


def assemble(pg: Program) -> np.ndarray:
    st = pg.final
    assert st is not None
    out = np.zeros((8, 16))
    m = pg.mesh
    for c in m.coords:
        b = st.A[c]
        j0, j1 = m.lin(c, st.lay[0]), m.lin(c, st.lay[1])
        out[j0 * b.shape[0] : (j0 + 1) * b.shape[0], j1 * b.shape[1] : (j1 + 1) * b.shape[1]] = b
    return out


# ---------------------------------------------------------------------------------------------
# Running a case
# ---------------------------------------------------------------------------------------------


def body_function(pg: Program) -> Callable:
    """A function with one annotated parameter per input that runs the ops on them."""
    names = [n for n, _, _, _ in pg.inputs]

    def run(args: dict[str, Any]) -> Any:
        v = None
        for op in pg.ops:
            v = op.call(v, args)
        return v

    src = f"def {pg.name}({', '.join(names)}):\n    return _run(dict({', '.join(f'{n}={n}' for n in names)}))\n"
    ns: dict[str, Any] = {}
    exec(src, {"_run": run}, ns)
    fn = ns[pg.name]
    st = pg.final
    assert st is not None
    fn.__annotations__ = {n: ANN[dt][spec.encode()] for n, dt, spec, _ in pg.inputs}
    fn.__annotations__["return"] = ANN[st.dt][spec_of(st.lay).encode()]
    return fn


def from_shardlib(e: BaseException) -> bool:
    if hasattr(e, RAISED_BY_SHARDLIB):  # typed_shard_map hid its frames from the traceback
        return bool(getattr(e, RAISED_BY_SHARDLIB))
    tb = e.__traceback__
    last = None
    while tb is not None:
        last, tb = tb, tb.tb_next
    return last is not None and "/shardlib/" in last.tb_frame.f_code.co_filename


@dataclass
class Outcome:
    kind: str
    detail: str = ""
    program: str = ""


def placed_inputs(pg: Program) -> list[jax.Array]:
    """``pg``'s global inputs, each placed on its mesh in the layout of its spec."""
    m = pg.mesh
    args = []
    for _, _, spec, arr in pg.inputs:
        dims = tuple(tuple(d.split("/")[1:]) for d in spec.split())
        args.append(jax.device_put(arr, NamedSharding(m.jmesh, m.pspec(dims))))
    return args


def run_case(pg: Program, check_vma: bool) -> Outcome:
    truth, why = verdict(pg)
    bad_axes = vma_bad(pg)
    fn = typed_shard_map(body_function(pg), check_vma=check_vma)
    m = pg.mesh
    args = placed_inputs(pg)
    with jax.set_mesh(m.jmesh):
        try:
            traced = jax.jit(fn).trace(*args)
        except (PendingReductionError, SpecError) as e:
            return refused(pg, truth, why, check_vma, e)
        except (ValueError, TypeError) as e:
            if from_shardlib(e):
                return refused(pg, truth, why, check_vma, e)
            known = [t for t in pg.tags if t.startswith("jax:")]
            if truth != "wrong" and any(p in str(e) for t in known for p in DESIGN_MESSAGES[t]):
                return Outcome("refused_by_jax", f"{type(e).__name__}: {e}")
            return Outcome("raw_error", f"{type(e).__name__}: {e}")
        except TypeCheckError as e:
            return Outcome("typecheck_error", f"{type(e).__name__}: {e}")
        except Exception as e:
            return Outcome("raw_error", f"{type(e).__name__}: {e}")
        try:
            out = np.asarray(traced.lower().compile()(*args)).astype(np.float64)
        except Exception as e:
            return Outcome("raw_error_at_run", f"{type(e).__name__}: {e}")
    if truth == "wrong":
        return Outcome("accepted_wrong", why)
    if bad_axes:
        if check_vma:
            return Outcome("accepted_vma_wrong", f"result varies over {bad_axes}")
        return Outcome("unchecked_vma", f"result varies over {bad_axes} (check_vma=False)")
    st = pg.final
    assert st is not None
    want = assemble(pg)
    scale = max(1.0, float(np.abs(want).max()))
    err = float(np.abs(out - want).max())
    slack = 1.0 if st.float_int else 0.0
    if err > tolerance(st) * scale + slack:
        return Outcome("mismatch", f"max |jax - A| = {err:.3g} (scale {scale:.3g})")
    if truth == "ambiguous":
        return Outcome("accepted_ambiguous", why)
    return Outcome("pass")


# The documented refusals of correct programs, and what their messages say.
DESIGN_MESSAGES = {
    "design:gather_pending": ("moves data across the devices",),
    "design:one_device_add": ("combines a value that is not a partial sum",),
    "design:product_of_partials": ("multiplies two partial sums",),
    "design:invariant_sum": (
        "over which the value does not vary",
        "is the same on every device",
        # with check_vma, JAX's own check of the same mistake (wrapped by shardops)
        "can only accept axis_name which corresponds to one of varying",
    ),
    "design:shardops_reduce_split": ("is split over it", "both splits dim"),
    "design:wrong_declaration": ("is declared pending over", "both splits dim"),
    "design:nonlinear_on_pending": (
        "is not linear",
        "combines a value that is not a partial sum",
        "takes the max/min across devices",
    ),
    # The families of issue 22 (tests/_pending_random_families.py): refusals of programs that
    # are right only by coincidence (equal branch factors, indices whose shares agree...).
    "design:per_device_control": ("differs across the devices", "factors that differ across"),
    "design:pending_index": ("(a non-linear use: each device would choose by its own share)",),
    "design:int_nonlinear": ("integer division", "which is not linear"),
    "design:fold": ("that is not an addition", "other than zero", "fills out-of-bounds"),
    "design:layout_varies": ("but the spec says it is the same on every device",),
    # With check_vma, JAX refuses a lax sum over axes some of which the value varies over and
    # some not (a raw JAX error, not about partial sums: shardlib lets it stand).
    "jax:sum_mixed_varying": ("can only accept axis_name which corresponds to one of varying",),
    # With check_vma, a loop carry must keep its JAX type, which a zero value (numerically the
    # same everywhere) multiplied by a per-device mask does not; typed_shard_map says so.
    "jax:carry_vma": ("the loop carry",),
}
# With check_vma, JAX cannot prove a gathered value replicated; typed_shard_map says so.
VMA_MESSAGES = ("require replication", "JAX cannot prove it is")


def refused(pg: Program, truth: str, why: str, check_vma: bool, e: Exception) -> Outcome:
    msg = f"{type(e).__name__}: {e}"
    if truth == "wrong":
        return Outcome("refused_wrong", msg)
    if truth == "ambiguous":
        return Outcome("refused_ambiguous", msg)
    for tag in sorted(pg.tags):
        if any(p in str(e) for p in DESIGN_MESSAGES[tag]):
            kind = {"design": "refused_by_design", "jax": "refused_by_jax"}[tag.split(":")[0]]
            return Outcome(kind, f"{tag}: {msg}")
    if check_vma and any(p in str(e) for p in VMA_MESSAGES):
        return Outcome("refused_by_design", f"check_vma: {msg}")
    return Outcome("refused_correct", f"tags {sorted(pg.tags)}: {msg}")


# ---------------------------------------------------------------------------------------------
# The tests
# ---------------------------------------------------------------------------------------------

_PROGRAMS: dict[int, list[Program]] = {}


def programs(mesh_i: int) -> list[Program]:
    if mesh_i not in _PROGRAMS:
        mesh = Mesh(*MESHES[mesh_i])
        rng = np.random.RandomState(SEED + mesh_i)
        _PROGRAMS[mesh_i] = [
            Gen(mesh, rng, f"prog_m{mesh_i}_{k}").build() for k in range(N_PROGRAMS)
        ]
    return _PROGRAMS[mesh_i]


# Outcomes that break the property: a wrong program accepted, a result that differs from what
# the devices compute, an error that is not shardlib's (or a shape error: a generator bug), a
# correct program refused for no documented reason.
BUGS = (
    "accepted_wrong",
    "accepted_vma_wrong",
    "mismatch",
    "raw_error",
    "raw_error_at_run",
    "typecheck_error",
    "refused_correct",
)


@pytest.mark.parametrize("check_vma", [False, True], ids=["vma_off", "vma_on"])
@pytest.mark.parametrize("mesh_i", [0, 1, 2], ids=["1d", "2d", "3d"])
def test_random_pending_programs(mesh_i: int, check_vma: bool) -> None:
    t0 = time.perf_counter()
    outcomes = []
    for pg in programs(mesh_i):
        o = run_case(pg, check_vma)
        o.program = pg.describe()
        outcomes.append(o)
    counts = Counter(o.kind for o in outcomes)
    linear = sum(
        1
        for pg, o in zip(programs(mesh_i), outcomes, strict=True)
        if o.kind == "pass" and pg.linear_on_pending
    )
    print(
        f"\nmesh {MESHES[mesh_i][0]} check_vma={check_vma}: {len(outcomes)} cases in "
        f"{time.perf_counter() - t0:.1f}s: {dict(sorted(counts.items()))}; {linear} passes "
        "ran ops on a value while it was a partial sum"
    )
    bad = [o for o in outcomes if o.kind in BUGS]
    assert not bad, "\n\n".join(f"{o.kind}: {o.detail}\n  {o.program}" for o in bad[:5])
    assert counts["pass"] > 0, counts
    assert counts["refused_wrong"] > 0, counts  # mistakes caught, not only design refusals


# ---------------------------------------------------------------------------------------------
# The families of issue 22 (tests/_pending_random_families.py): per-device control flow, deep
# loop carries, forward mode, non-linear roles, linear look-alikes, layout ops
# ---------------------------------------------------------------------------------------------

FAMILIES = ("control", "chain", "jvp", "index", "int", "fold", "lookalike", "layout", "branches")
N_FAMILY = 12  # programs per family and mesh, each with check_vma off and on


def family_cases(family: str) -> list[Program]:
    from tests._pending_random_families import family_programs

    return [pg for i in range(len(MESHES)) for pg in family_programs(family, i, N_FAMILY)]


@pytest.mark.parametrize("check_vma", [False, True], ids=["vma_off", "vma_on"])
@pytest.mark.parametrize("family", FAMILIES)
def test_random_pending_family(family: str, check_vma: bool) -> None:
    """Each family's programs, half of them mistakes, on the three meshes: no wrong answer
    accepted, no correct program refused without a documented reason."""
    t0 = time.perf_counter()
    outcomes = []
    for pg in family_cases(family):
        o = run_case(pg, check_vma)
        o.program = pg.describe()
        outcomes.append(o)
    counts = Counter(o.kind for o in outcomes)
    print(
        f"\nfamily {family} check_vma={check_vma}: {len(outcomes)} cases in "
        f"{time.perf_counter() - t0:.1f}s: {dict(sorted(counts.items()))}"
    )
    bad = [o for o in outcomes if o.kind in BUGS]
    assert not bad, "\n\n".join(f"{o.kind}: {o.detail}\n  {o.program}" for o in bad[:5])
    assert counts["pass"] > 0 and counts["refused_wrong"] > 0, counts


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_random_family_catches_its_rule_switched_off(
    family: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the family's rule switched off (tests/_pending_random_mutations.py), one of its
    programs is accepted and computes a wrong answer, which the oracle sees."""
    from tests._pending_random_mutations import OFF

    OFF[family](monkeypatch)
    seen: Counter[str] = Counter()
    for pg in family_cases(family):
        o = run_case(pg, check_vma=False)
        seen[o.kind] += 1
        if o.kind == "accepted_wrong":
            print(f"\n{family} rule off: case {seen.total()} accepted, {o.detail}\n{pg.describe()}")
            return
    pytest.fail(f"no accepted wrong answer with the {family} rule off: {dict(seen)}")
