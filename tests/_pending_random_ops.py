"""The ops of the random suite's issue-22 families (`tests._pending_random_families` draws them).

Each op runs in the body (``jax``) and in the oracle's two interpreters (``sim``), as the ops
of `tests.test_pending_random` do:

- `Control`: a partial sum made inside ``lax.cond`` / ``lax.switch`` / ``fori_loop`` /
  ``while_loop`` whose branch index or trip count comes from ``axis_index`` or from a value
  split over a mesh axis (or is the same on every device);
- `Chain`: a ``lax.scan`` whose carry passes the value down ``k`` slots before an op meets it;
- `JvpStart`: a partial sum made as a tangent (``jax.jvp`` / ``linearize`` / ``jacfwd``);
- `IntStart`, `IntUse`, `IntArith`: integer partial sums, used as a ``select_n`` selector or
  gather / scatter indices, divided with integer division, cast narrower or wider;
- `Branch`, `Coll`: a collective (psum, pmean, all_gather, all_to_all, psum_scatter,
  ppermute, ``shardops.shift``, or the reduction of a partial sum) inside a branch of a
  ``cond`` / ``switch`` whose index may differ across devices, or outside it (its twin).

The ops on each device's block (folds, linear look-alikes, layout ops) are in
`tests._pending_random_local`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from shardlib import shardops
from tests.test_pending_random import (
    Mesh,
    Op,
    Program,
    Start,
    State,
    each,
    rnd,
    spec_of,
)


def varying(x: jax.Array) -> set[str]:
    """The manual axes JAX types ``x`` as varying over (none without ``check_vma``)."""
    aval = jax.typeof(x)
    mat = getattr(aval, "manual_axis_type", None)  # jax >= 0.10
    return set(mat.varying) if mat is not None else set(getattr(aval, "vma", ()))


def like_vma(z: jax.Array, *refs: jax.Array) -> jax.Array:
    """``z`` typed as varying over what ``refs`` vary over (a loop carry keeps its type)."""
    want: set[str] = set()
    for r in refs:
        want |= varying(r)
    want -= varying(z)
    return lax.pcast(z, tuple(sorted(want)), to="varying") if want else z


def at0(m: Mesh, c: tuple[int, ...], axis: str) -> tuple[int, ...]:
    """Device ``c`` moved to index 0 of ``axis``."""
    d = list(c)
    d[m.names.index(axis)] = 0
    return tuple(d)


def both(st: State, fn: Any, **kw: Any) -> State:
    """``fn(blocks, which)`` on both interpreters' blocks (``which``: 'A' or 'T')."""
    return replace(st, A=fn(st.A, "A"), T=fn(st.T, "T"), **kw)


# ---------------------------------------------------------------------------------------------
# 1. Per-device control flow around partial sums made inside it
# ---------------------------------------------------------------------------------------------


@dataclass(repr=False)
class Control(Op):
    """v + c[k] * E, E a partial sum made inside the control flow, k chosen per device: a
    branch of ``cond`` / ``switch``, or the trip count of ``fori`` / ``while`` / ``while_carry``
    (the predicate reads a carry slot the body sets). The chooser ``r`` is
    ``axis_index(axis)`` (``via='index'``), an int split over ``axis`` (``via='input'``) or a
    replicated int (``axis=None``). With ``carry`` v goes through as operand or carry."""

    kind: str
    start: Start
    axis: str | None
    via: str
    src: str
    coefs: tuple[float, ...]
    carry: bool

    def __repr__(self) -> str:
        r = f"axis_index({self.axis!r})" if self.via == "index" else f"{self.src}[0]"
        what = {"cond": f"cond({r} % 2 == 0)", "switch": f"switch({r} % {len(self.coefs)})"}
        how = what.get(self.kind, f"{self.kind}(trip count {r} % 3 + 1)")
        return f"v + {how} of {self.coefs} * {self.start!r}" + (" [v inside]" if self.carry else "")

    def chooser(self, a: dict[str, Any]) -> jax.Array:
        if self.via == "index":
            return lax.axis_index(self.axis)
        return a[self.src].reshape(-1)[0]

    def jax(self, v, a):
        r, cs = self.chooser(a), self.coefs

        def E():
            return self.start.jax(None, a)

        if self.kind in ("cond", "switch"):
            branches = [
                (lambda u, k=k: u + cs[k] * E()) if self.carry else (lambda k=k: cs[k] * E())
                for k in range(len(cs))
            ]
            ops = (v,) if self.carry else ()
            if self.kind == "cond":
                out = lax.cond(r % 2 == 0, branches[0], branches[1], *ops)
            else:
                out = lax.switch(r % len(cs), branches, *ops)
            return out if self.carry else v + out
        names = self.start.names
        init = v if self.carry else like_vma(jnp.zeros(v.shape), v, a[names[0]], a[names[1]], r)
        n = r % 3 + 1
        if self.kind == "fori":
            out = lax.fori_loop(0, n, lambda i, acc: acc + cs[0] * E(), init)
        elif self.kind == "while":
            body = lambda s: (s[0] + 1, s[1] + cs[0] * E())
            out = lax.while_loop(lambda s: s[0] < n, body, (0, init))[1]
        else:
            body = lambda s: (s[0] + 1, n, s[2] + cs[0] * E())
            out = lax.while_loop(lambda s: s[0] < s[1], body, (0, 1, init))[2]
        return out if self.carry else v + out

    def coef(self, pg: Program, c: tuple[int, ...]) -> float:
        m = pg.mesh
        if self.axis is not None and self.via == "index":
            r = m.lin(c, (self.axis,))
        else:
            arr, dims = pg.array(self.src)
            r = int(m.block(arr, dims, c).reshape(-1)[0])
        if self.kind == "cond":
            return self.coefs[0] if r % 2 == 0 else self.coefs[1]
        if self.kind == "switch":
            return self.coefs[r % len(self.coefs)]
        return self.coefs[0] * (r % 3 + 1)

    def sim(self, st, pg):
        uA, uT = self.start.make(pg)
        k = {c: self.coef(pg, c) for c in pg.mesh.coords}
        A = {c: rnd(b + k[c] * uA[c], "f32") for c, b in st.A.items()}
        T = {c: rnd(b + k[c] * uT[c], "f32") for c, b in st.T.items()}
        return replace(st, A=A, T=T, dt="f32", P=st.P | frozenset(self.start.P))


# ---------------------------------------------------------------------------------------------
# 2. A scan carry that passes the value down k slots before an op meets it
# ---------------------------------------------------------------------------------------------


@dataclass(repr=False)
class Chain(Op):
    """``lax.scan`` over k + 1 + extra steps: slot 0 takes v (closed over), slot i+1 takes
    slot i (negated when ``neg``), and ``end`` meets the last slot; returns ``end``'s result
    at the last step, ``end((-1)^(k-1) v)`` when ``neg`` (zeros start the carry)."""

    k: int
    extra: int
    neg: bool
    end: Op | None  # None: the last slot itself

    def __repr__(self) -> str:
        hop = "-slot" if self.neg else "slot"
        return f"scan: {self.k} carry slots ({hop} each hop), then {self.end!r} on the last"

    def jax(self, v, a):
        z = like_vma(jnp.zeros_like(v), v)
        end = self.end

        def step(c, _):
            moved = tuple(-x for x in c[:-1]) if self.neg else c[:-1]
            return (v, *moved), (c[-1] if end is None else end.jax(c[-1], a))

        _, ys = lax.scan(step, (z,) * self.k, None, length=self.k + 1 + self.extra)
        return ys[-1]

    def sim(self, st, pg):
        if self.neg and self.k % 2 == 0:
            st = each(st, lambda b, c, w: -b, st.dt)
        return st if self.end is None else self.end.sim(st, pg)


# ---------------------------------------------------------------------------------------------
# 3. Forward-mode AD of a function that makes a partial sum
# ---------------------------------------------------------------------------------------------


@dataclass(repr=False)
class JvpStart(Start):
    """The partial sum E(dx) made as a tangent: ``jax.jvp`` / ``jax.linearize`` of
    ``a -> E(a)`` at the operand ``names[0]`` with tangent ``tangent``, or ``jax.jacfwd`` of
    ``s -> E(a + s * tangent)`` at 0; ``mode='primal'``: E(a), the primal output of the jvp."""

    mode: str = "jvp"
    tangent: str = ""

    def __repr__(self) -> str:
        return f"{self.mode} of {Start.__repr__(self)} along {self.tangent}"

    def jax(self, v, a):
        f = shardops.einsum_unreduced if self.kind == "einsum" else shardops.index_unreduced
        x0, other, dx = a[self.names[0]], a[self.names[1]], a[self.tangent]
        g = lambda u: f(self.spec(), u, other)
        if self.mode == "jvp":
            return jax.jvp(g, (x0,), (dx,))[1]
        if self.mode == "primal":
            return jax.jvp(g, (x0,), (dx,))[0]
        if self.mode == "linearize":
            return jax.linearize(g, x0)[1](dx)
        return jax.jacfwd(lambda s: g(x0 + s * dx))(jnp.float32(0.0))

    def make(self, pg):
        names = self.names if self.mode == "primal" else (self.tangent, self.names[1])
        base = Start(self.kind, names, self.s, self.P, self.q, self.declare)
        return base.make(pg)


# ---------------------------------------------------------------------------------------------
# 4. Integer partial sums in non-linear roles; reductions and fills; linear look-alikes
# ---------------------------------------------------------------------------------------------


@dataclass(repr=False)
class IntStart(Start):
    """``einsum_unreduced`` of integer operands (``dtype`` int32 or int16)."""

    dtype: str = "i32"

    def __repr__(self) -> str:
        return f"{self.dtype} {Start.__repr__(self)}"

    def make(self, pg):
        A, T = Start.make(self, pg)
        return (
            {c: np.round(b) for c, b in A.items()},
            {c: np.round(b) for c, b in T.items()},
        )


_ROWS = lax.GatherDimensionNumbers(
    offset_dims=(1,), collapsed_slice_dims=(0,), start_index_map=(0,)
)
_SCATTER_ROWS = lax.ScatterDimensionNumbers((1,), (0,), (0,))


@dataclass(repr=False)
class IntUse(Op):
    """The int value (first column for rows) used as ``select_n(v, a0, a1)``'s selector, or
    as the row indices of ``lax.gather(a0, ...)`` / ``lax.scatter_add(a0, ..., a1)``
    (``mode='clip'``); a0 and a1 are f32 inputs laid out like v. The result is f32, owes
    nothing (in the truth: the index is the true value)."""

    how: str  # 'select' | 'gather' | 'scatter'
    names: tuple[str, str]

    def __repr__(self) -> str:
        a0, a1 = self.names
        return {
            "select": f"lax.select_n(v, {a0}, {a1})",
            "gather": f"lax.gather({a0}, v[:, :1], rows, mode='clip')",
            "scatter": f"lax.scatter_add({a0}, v[:, :1], {a1}, rows, mode='clip')",
        }[self.how]

    def jax(self, v, a):
        a0, a1 = a[self.names[0]], a[self.names[1]]
        if self.how == "select":
            return lax.select_n(v, a0, a1)
        if self.how == "gather":
            return lax.gather(a0, v[:, :1], _ROWS, (1, a0.shape[1]), mode="clip")
        return lax.scatter_add(a0, v[:, :1], a1, _SCATTER_ROWS, mode="clip")

    def sim(self, st, pg):
        def fn(b, c, w):
            a0, a1 = pg.block(self.names[0], c), pg.block(self.names[1], c)
            if self.how == "select":
                return np.where(b != 0, a1, a0)
            rows = np.clip(b[:, 0].astype(np.int64), 0, a0.shape[0] - 1)
            if self.how == "gather":
                return a0[rows]
            out = a0.copy()
            np.add.at(out, rows, a1)
            return out

        return replace(each(st, fn, "f32"), P=frozenset())


def wrap_int(x: np.ndarray, bits: int) -> np.ndarray:
    half = 1 << (bits - 1)
    return (x.astype(np.int64) + half) % (2 * half) - half


@dataclass(repr=False)
class IntArith(Op):
    """On an int value: ``v // c``, ``lax.div(v, c)`` (rounds toward zero), ``v.astype(int8)
    .astype(int32)`` (wraps), or ``v.astype(int32)`` of an int16 value (widening)."""

    how: str  # 'floordiv' | 'div' | 'narrow' | 'widen'
    c: int = 3

    def __repr__(self) -> str:
        return {
            "floordiv": f"v // {self.c}",
            "div": f"lax.div(v, {self.c})",
            "narrow": "v.astype(int8).astype(int32)",
            "widen": "v.astype(int32)  # from int16",
        }[self.how]

    def jax(self, v, a):
        if self.how == "floordiv":
            return v // self.c
        if self.how == "div":
            return lax.div(v, jnp.int32(self.c))
        if self.how == "narrow":
            return v.astype(jnp.int8).astype(jnp.int32)
        return v.astype(jnp.int32)

    def sim(self, st, pg):
        fn = {
            "floordiv": lambda b, c, w: np.floor_divide(b, self.c),
            "div": lambda b, c, w: np.trunc(b / self.c),
            "narrow": lambda b, c, w: wrap_int(b, 8).astype(np.float64),
            "widen": lambda b, c, w: b,
        }[self.how]
        return each(st, fn, "i32")


# ---------------------------------------------------------------------------------------------
# 5. Collectives inside a per-device branch
# ---------------------------------------------------------------------------------------------


@dataclass(repr=False)
class Coll(Op):
    """A collective over axes ``R`` that keeps the local block's shape (``jax.lax`` unless
    said): ``psum``, ``pmean``, ``gather`` (an all_gather over ``R`` of which every device
    keeps the block of the group's first device), ``all_to_all`` (column chunks, one axis),
    ``scatter`` (``psum_scatter`` of the block tiled k times along the columns: the group's
    sum), ``ppermute`` (one step along one axis) and ``shift`` (``shardops.shift``)."""

    kind: str
    R: tuple[str, ...]
    lay: tuple[tuple[str, ...], tuple[str, ...]]
    k: int  # the number of devices in a group

    def grouped(self) -> bool:
        return self.kind not in ("ppermute", "shift")

    def __repr__(self) -> str:
        if self.kind == "shift":
            return f"shardops.shift({spec_of(self.lay)!r}, v, {self.R[0]!r})"
        return f"{self.kind}(v, {self.R!r})"

    def jax(self, v, a):
        ax = self.R[0] if len(self.R) == 1 else tuple(self.R)
        if self.kind in ("psum", "pmean"):
            return getattr(lax, self.kind)(v, ax)
        if self.kind == "gather":
            return lax.all_gather(v, ax, axis=0, tiled=True)[: v.shape[0]]
        if self.kind == "all_to_all":
            return lax.all_to_all(v, ax, split_axis=1, concat_axis=1, tiled=True)
        if self.kind == "scatter":
            tiled = jnp.tile(v, (1, self.k))
            return lax.psum_scatter(tiled, ax, scatter_dimension=1, tiled=True)
        if self.kind == "ppermute":
            return lax.ppermute(v, ax, [(i, (i + 1) % self.k) for i in range(self.k)])
        return shardops.shift(spec_of(self.lay), v, self.R[0])

    def blocks(self, m: Mesh, bl: dict) -> dict:
        """Every device's result, all of them running it (no pending axes)."""
        out = {}
        for c in m.coords:
            g = m.group(c, self.R)
            i = g.index(c)
            if self.kind in ("psum", "pmean", "scatter"):
                s = sum(bl[d] for d in g)
                out[c] = s / len(g) if self.kind == "pmean" else s
            elif self.kind == "gather":
                out[c] = bl[g[0]]
            elif self.kind == "all_to_all":
                w = bl[c].shape[1] // self.k
                out[c] = np.concatenate([bl[d][:, i * w : (i + 1) * w] for d in g], axis=1)
            else:  # ppermute / shift: device i receives from i - 1
                out[c] = bl[g[(i - 1) % len(g)]]
        return out


@dataclass(repr=False)
class Branch(Op):
    """``lax.cond`` / ``lax.switch`` on ``r % n`` (``r``: ``axis_index(axis)``, an int split over
    ``axis``, or a replicated int when ``axis`` is None): branch j returns ``coefs[j] * u_j``,
    ``u_j = coll(v)`` for the branches in ``runs``, else v. ``where='inside'``: the collective
    runs in those branches, only on the devices that take them; ``'outside'``: it runs on every
    device before the cond and its result is passed in (the correct twin). ``coll`` is a
    `Coll`, or a `Reduce` over the value's pending axes (then every branch runs it).

    What each device does: a collective inside a branch is right when each of its groups lies
    within devices that take the same branch (a grouped collective whose groups agree), or when
    every device takes the same branch; otherwise XLA pairs it with other devices' collectives
    or waits for devices that never come (a deadlock): the oracle's ``A`` is then NaN."""

    kind: str  # 'cond' | 'switch'
    axis: str | None
    via: str  # 'index' | 'input'
    src: str
    coefs: tuple[float, ...]
    coll: Op
    runs: tuple[int, ...]
    where: str

    def __repr__(self) -> str:
        r = f"axis_index({self.axis!r})" if self.via == "index" else f"{self.src}[0]"
        head = f"{self.kind}({r} % {len(self.coefs)})"
        return (
            f"{head}: branch j -> coefs[j] * ({self.coll!r} if j in {self.runs} else v), "
            f"coefs {self.coefs}, collective {self.where} the branch"
        )

    def chooser(self, a: dict[str, Any]) -> jax.Array:
        if self.via == "index":
            return lax.axis_index(self.axis)
        return a[self.src].reshape(-1)[0]

    def out_vma(self, v: jax.Array) -> set[str]:
        """What JAX types the branches' results as varying over, joined (with check_vma)."""
        R = set(self.coll.R)
        sums = not isinstance(self.coll, Coll) or self.coll.kind in ("psum", "pmean")
        made = varying(v) - R if sums else varying(v) | R
        if len(self.runs) < len(self.coefs):
            made |= varying(v)
        return made

    def jax(self, v, a):
        n, cs = len(self.coefs), self.coefs
        r = self.chooser(a) % n
        # JAX types a cond's results by its branches' only, not by its index: typed as
        # varying over what the index varies over too, a per-device result cannot be returned
        # as replicated with check_vma on
        want = self.out_vma(v) | varying(r)

        def typed(z: jax.Array) -> jax.Array:  # every branch's result with the same type
            more = want - varying(z)
            return lax.pcast(z, tuple(sorted(more)), to="varying") if more else z

        if self.where == "outside":  # v goes in only where a branch uses it
            y = self.coll.call(v, a)
            if len(self.runs) == n:
                branches = [(lambda y, j=j: typed(cs[j] * y)) for j in range(n)]
                ops: tuple = (y,)
            else:
                branches = [
                    (lambda v, y, j=j: typed(cs[j] * (y if j in self.runs else v)))
                    for j in range(n)
                ]
                ops = (v, y)
        else:
            branches = [
                (lambda v, j=j: typed(cs[j] * (self.coll.jax(v, a) if j in self.runs else v)))
                for j in range(n)
            ]
            ops = (v,)
        if self.kind == "cond":
            return lax.cond(r == 0, branches[0], branches[1], *ops)
        return lax.switch(r, branches, *ops)

    def branch_of(self, pg: Program, c: tuple[int, ...]) -> int:
        m = pg.mesh
        if self.via == "index":
            r = m.lin(c, (self.axis,))
        else:
            arr, dims = pg.array(self.src)
            r = int(m.block(arr, dims, c).reshape(-1)[0])
        r %= len(self.coefs)
        return r if self.kind == "switch" else (0 if r == 0 else 1)

    def well_defined(self, pg: Program) -> bool:
        """Whether the devices that run the collective inside a branch meet right."""
        m = pg.mesh
        j = {c: self.branch_of(pg, c) for c in m.coords}
        if self.where == "outside" or len(set(j.values())) == 1:
            return True
        if isinstance(self.coll, Coll) and not self.coll.grouped():
            return False
        R = self.coll.R
        return all(j[d] == j[c] for c in m.coords for d in m.group(c, R))

    def sim(self, st, pg):
        m = pg.mesh
        if isinstance(self.coll, Coll):
            y = replace(st, A=self.coll.blocks(m, st.A), T=self.coll.blocks(m, st.T))
        else:
            y = self.coll.sim(st, pg)
        j = {c: self.branch_of(pg, c) for c in m.coords}

        def pick(w: str) -> dict:
            ys, vs = (y.A, st.A) if w == "A" else (y.T, st.T)
            return {
                c: rnd(self.coefs[j[c]] * (ys[c] if j[c] in self.runs else vs[c]), "f32")
                for c in m.coords
            }

        A, T = pick("A"), pick("T")
        if not self.well_defined(pg):
            A = {c: np.full_like(b, np.nan) for c, b in A.items()}
        return replace(y, A=A, T=T, dt="f32")
