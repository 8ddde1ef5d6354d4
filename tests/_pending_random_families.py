"""Generator families of the random suite for the rules of issue 22 (their ops:
`tests._pending_random_ops`, `tests._pending_random_local`).

A family's program starts like the suite's others (a partial sum over a random non-empty subset
of the mesh axes; for some families a tangent or an integer partial sum), may run one safe op
of the suite, then the family's op, drawn half the time as a mistake and half the time as its
correct twin, then perhaps one more op of the suite and a final reduction. The oracle of
`tests.test_pending_random` decides which programs are right.

- ``control``: per-device ``cond`` / ``switch`` / ``fori_loop`` / ``while_loop`` around a
  partial sum made inside (chooser over a pending axis: wrong; over another axis: right);
- ``chain``: a ``scan`` carry passing the value down k <= 12 slots to a per-device mask or a
  non-linear op (wrong) or a reduction, a mask over another axis, nothing (right);
- ``jvp``: the partial sum made as a tangent, then a non-linear op (wrong) or reduced first;
- ``index``: an integer partial sum as a ``select_n`` selector or gather / scatter indices,
  reduced first (right) or not (wrong);
- ``int``: integer division, narrowing casts (wrong unless reduced first), widening (right);
- ``fold``: ``lax.reduce`` / ``reduce_window`` with a non-add computation or a non-zero
  initial value, a gather with a non-zero fill (wrong), their additive zero twins (right);
- ``lookalike``: scatter-multiply by a factor the same everywhere, concatenation with host
  zeros, ``jnp.tile`` (right); by a per-device factor, with host ones (wrong);
- ``layout``: ``reshard`` / ``repeat`` splitting a value over an axis it varies over (wrong)
  or not (right);
- ``branches``: a collective in a branch of a ``cond`` / ``switch`` whose index comes from
  ``axis_index`` or a value split over an axis: a collective-permute, or a collective over
  that axis (wrong: the devices that take different branches do not meet), or its twins (a
  grouped collective over other axes, the collective run before the cond, a replicated
  index: right). The value is a reduced partial sum, or the partial sum itself flowing in,
  reduced over its pending axes in every branch.
"""

from __future__ import annotations

import numpy as np

from tests._pending_random_local import Fold, Layout, LookAlike, Vary
from tests._pending_random_ops import (
    Branch,
    Chain,
    Coll,
    Control,
    IntArith,
    IntStart,
    IntUse,
    JvpStart,
)
from tests.test_pending_random import (
    FAMILIES,
    MESHES,
    SEED,
    AddPartial,
    Cast,
    Gen,
    Mask,
    Mesh,
    Nonlin,
    Op,
    Program,
    Reduce,
    Start,
    State,
    dim,
    spec_of,
    split_axes,
)


class FamilyGen(Gen):
    """Builds one program of ``family``."""

    def __init__(self, mesh: Mesh, rng: np.random.RandomState, name: str, family: str):
        super().__init__(mesh, rng, name)
        self.family = family
        self.use = "select"  # the index family's use of its integer partial sum

    # -- the program -------------------------------------------------------------------------

    def build(self) -> Program:
        m, rng = self.m, self.rng
        role = {a: self.pick("PPsqr") for a in m.names}
        if "P" not in role.values():
            role[self.pick(m.names)] = "P"
        s, P, q = (self.perm(a for a in m.names if role[a] == r) for r in "sPq")
        make_start = {"jvp": self.jvp_start, "index": self.int_start, "int": self.int_start}
        first = make_start.get(self.family, self.start)(s, P, q)
        self.pg.ops.append(first)
        A, T = first.make(self.pg)
        st = State(A, T, frozenset(P), (s, q), "i32" if isinstance(first, IntStart) else "f32")
        if self.family not in ("index", "int") and rng.rand() < 0.4:
            st = self.some_op(st, safe_only=True)
        st = getattr(self, f"f_{self.family}")(st)
        if rng.rand() < 0.3:
            st = self.some_op(st, safe_only=False)
        r = rng.rand()
        got = self.p_reduce(st, final=True) if r < 0.85 else self.p_reduce(st) if r < 0.92 else None
        if got is not None:
            st = self.apply(got[0], st)
        self.pg.final = st
        return self.pg

    def some_op(self, st: State, safe_only: bool) -> State:
        """One op of the suite that keeps the value f32 (``safe_only``: a right one)."""
        makers = [self.p_scale, self.p_scale_arr, self.p_mask, self.p_add_partial, self.p_matmul]
        if not safe_only:
            makers += [self.p_nonlin, self.p_cast, self.p_add_reduced]
        for _ in range(20):
            n_inputs = len(self.pg.inputs)
            got = self.pick(makers)(st)
            if got is not None and (got[1] or not safe_only) and st.dt == "f32":
                return self.apply(got[0], st)
            del self.pg.inputs[n_inputs:]
        return st

    def index_input(self, axis: str | None) -> str:
        """A new i32 input a branch index is read from: split over ``axis`` (one random value
        per device of it), or a replicated scalar."""
        n = self.m.size[axis] if axis else 1
        vals = self.rng.randint(0, 6, size=n).astype(np.int32)
        spec = dim("Q", (axis,)) if axis else ""
        return self.pg.add_input("k", "i32", spec, vals.reshape(-1) if axis else vals[0])

    def reduce_exact(self, st: State, subset: bool = False) -> State:
        R = self.subset(sorted(st.P)) if subset else self.perm(st.P)
        lib = self.pick(["lax", "shardops"])
        return self.apply(Reduce("psum", lib, R, st.lay), st)

    def free(self, st: State) -> list[str]:
        return [a for a in self.m.names if a not in split_axes(st.lay) and a not in st.P]

    def tag(self, op: Op, tag: str, when: bool) -> Op:
        if when:
            op.tags = frozenset({tag})
        return op

    # -- starts ------------------------------------------------------------------------------

    def jvp_start(self, s, P, q) -> Start:
        base = self.start(s, P, q)
        arr, _ = self.pg.array(base.names[0])
        spec = next(sp for n, _, sp, _ in self.pg.inputs if n == base.names[0])
        tangent = self.pg.add_input("dx", "f32", spec, self.normal(arr.shape))
        mode = self.pick(["jvp", "jvp", "linearize", "jacfwd", "primal"])
        return JvpStart(base.kind, base.names, s, P, q, base.declare, mode, tangent)

    def int_start(self, s, P, q) -> Start:
        add = self.pg.add_input
        k = f"{dim('K', P)}"
        if self.family == "index":  # one-hot rows: each element has one non-zero share
            self.use = (
                self.pick(["select", "gather", "scatter"]) if 8 // self.m.n(s) > 1 else "select"
            )
            hi = 2 if self.use == "select" else 8 // self.m.n(s)
            x = np.eye(16, dtype=np.int32)[self.rng.randint(0, 16, size=8)]
            w = self.rng.randint(0, hi, size=(16, 16)).astype(np.int32)
            dt = "i32"
        else:
            dt = self.pick(["i32", "i32", "i16"])
            x = self.rng.randint(-3, 4, size=(8, 16)).astype(dt.replace("i", "int"))
            w = self.rng.randint(-40, 41, size=(16, 16)).astype(dt.replace("i", "int"))
        xn = add("x", dt, f"{dim('B', s)} {k}", x)
        wn = add("w", dt, f"{k} {dim('M', q)}", w)
        return IntStart("einsum", (xn, wn), s, P, q, self.rng.rand() < 0.3, dt)

    # -- the families ------------------------------------------------------------------------

    def f_control(self, st: State) -> State:
        m, rng = self.m, self.rng
        avail = [a for a in m.names if a not in split_axes(st.lay)]
        P2 = self.perm(st.P) if st.P and rng.rand() < 0.8 else self.subset(avail)
        wrong = rng.rand() < 0.5
        others = [a for a in m.names if a not in P2]
        axis = self.pick(P2) if wrong else self.pick([None, *others])
        kind = self.pick(["cond", "switch", "fori", "while", "while_carry"])
        via = "input" if axis is None or rng.rand() < 0.4 else "index"
        src = self.index_input(axis) if via == "input" else ""
        pool = [1.0, 2.0, -1.0, 0.5, 3.0]
        coefs = tuple(pool[i] for i in rng.permutation(5)[: 3 if kind == "switch" else 2])
        carry = set(P2) == st.P and rng.rand() < 0.4
        op = Control(kind, self.start(st.lay[0], P2, st.lay[1]), axis, via, src, coefs, carry)
        return self.apply(self.tag(op, "design:per_device_control", axis in P2), st)

    def f_chain(self, st: State) -> State:
        m, rng = self.m, self.rng
        ends: list[tuple[Op | None, bool]] = [
            (None, True),
            (Nonlin(self.pick(["tanh", "relu"])), False),
        ]
        if st.P:
            # lax only: shardops.psum on a carry slot that starts as zeros is refused (a false
            # alarm: the walk sees the slot's first round, the same on every device)
            ends.append((Reduce("psum", "lax", self.perm(st.P), st.lay), True))
            ends.append((Mask(int(rng.randint(1 << 20)), self.pick(sorted(st.P)), "mul"), False))
        others = [a for a in m.names if a not in st.P]
        if others:
            ends.append((Mask(int(rng.randint(1 << 20)), self.pick(others), "mul"), True))
        end, _ = self.pick(ends)
        op = Chain(1 + rng.randint(12), rng.randint(2), rng.rand() < 0.3, end)
        # relu of an index_unreduced partial sum is right (one non-zero share) but refused
        return self.apply(
            self.tag(op, "design:nonlinear_on_pending", isinstance(end, Nonlin) and bool(st.P)), st
        )

    def f_jvp(self, st: State) -> State:
        """A non-linear op on the tangent (wrong), or after reducing it, or adding a second
        tangent (right)."""
        nonlin = self.pick([Nonlin("tanh"), Nonlin("relu"), Cast("i32")])
        if self.rng.rand() < 0.5:  # relu of an index_unreduced tangent is right, but refused
            return self.apply(self.tag(nonlin, "design:nonlinear_on_pending", bool(st.P)), st)
        if self.rng.rand() < 0.5:
            return self.apply(nonlin, self.reduce_exact(st))
        first = self.pg.ops[0]
        assert isinstance(first, JvpStart)
        other = self.jvp_start(st.lay[0], self.perm(st.P) or first.P, st.lay[1])
        return self.apply(AddPartial(other), st)

    def f_index(self, st: State) -> State:
        r = self.rng.rand()
        if r < 0.6:
            st = self.reduce_exact(st, subset=r < 0.15)
        names = tuple(
            self.pg.add_input("a", "f32", spec_of(st.lay), self.normal((8, 16))) for _ in range(2)
        )
        op = IntUse(self.use, (names[0], names[1]))
        return self.apply(self.tag(op, "design:pending_index", bool(st.P)), st)

    def f_int(self, st: State) -> State:
        first = self.pg.ops[0]
        assert isinstance(first, IntStart)
        if first.dtype == "i16":
            return self.apply(IntArith("widen"), st)
        if self.rng.rand() < 0.4:
            st = self.reduce_exact(st, subset=self.rng.rand() < 0.3)
        how = self.pick(["floordiv", "div", "narrow"])
        op = IntArith(how, int(self.pick([2, 3, 7])))
        st = self.apply(self.tag(op, "design:int_nonlinear", bool(st.P)), st)
        if self.rng.rand() < 0.3:
            st = self.apply(Cast("f32"), st)
        return st

    def f_fold(self, st: State) -> State:
        rng = self.rng
        if st.P and rng.rand() < 0.25:
            st = self.reduce_exact(st)
        kind = self.pick(["reduce", "window", "fill"])
        if kind == "fill":
            b = st.local_shape()[0]
            rows = tuple(int(i) for i in rng.randint(0, b + 3, size=b))
            init = float(self.pick([0.0, 1.0, -2.0]))
            op = Fold(kind, "add", init, rows)
            linear = init == 0.0
        else:
            comp, init = self.pick(
                [
                    ("add", 0.0),
                    ("add_fn", 0.0),
                    ("add", 1.0),
                    ("add_fn", -2.0),
                    ("mul", 2.0),
                    ("max", 0.0),
                ]
            )
            if kind == "window" and comp == "mul":
                init = 1.0
            op = Fold(kind, comp, init)
            linear = comp in ("add", "add_fn") and init == 0.0
        return self.apply(self.tag(op, "design:fold", bool(st.P) and not linear), st)

    def f_lookalike(self, st: State) -> State:
        b, n = st.local_shape()
        how = self.pick(["scatter_mul", "scatter_mul", "concat_zeros", "concat_ones", "tile"])
        if how == "scatter_mul":
            axis = self.pick([None, *self.m.names])
            op = LookAlike(how, float(self.pick([2.0, -0.5])), axis, int(self.rng.randint(b)))
            return self.apply(self.tag(op, "design:per_device_control", axis in st.P), st)
        if how == "tile" and n % 2:
            how = "concat_zeros"
        return self.apply(LookAlike(how, k=int(self.rng.randint(n))), st)

    def f_layout(self, st: State) -> State:
        m, rng = self.m, self.rng
        if not self.free(st):
            st = self.reduce_exact(st)
        free = self.free(st)
        if not free:
            return st
        t = self.pick(free)
        wrong = rng.rand() < 0.5
        vary_on = (
            t if wrong else self.pick([None, *(a for a in m.names if a != t and a not in st.P)])
        )
        if vary_on is not None:
            src = ""
            if rng.rand() < 0.4:
                vals = rng.uniform(0.5, 2.0, size=m.size[vary_on]).astype(np.float32)
                src = self.pg.add_input("k", "f32", dim("S", (vary_on,)), vals)
            st = self.apply(Vary(vary_on, src), st)
        local = st.local_shape()
        dims = [d for d in (0, 1) if local[d] % m.size[t] == 0]
        how = "reshard" if dims and rng.rand() < 0.6 else "repeat"
        declare = self.perm(st.P) if how == "reshard" and st.P and rng.rand() < 0.3 else ()
        op = Layout(how, t, self.pick(dims) if dims else 0, st.lay, declare, m.size[t])
        return self.apply(self.tag(op, "design:layout_varies", vary_on == t), st)

    def f_branches(self, st: State) -> State:
        m, rng = self.m, self.rng
        wrong = rng.rand() < 0.5
        pending = bool(st.P) and rng.rand() < 0.35  # the partial sum flows into the branch
        if st.P and not pending:
            st = self.reduce_exact(st)
        axis = self.pick(m.names) if wrong or rng.rand() < 0.8 else None
        via = "index" if axis is not None and rng.rand() < 0.6 else "input"
        src = self.index_input(axis) if via == "input" else ""
        kind = self.pick(["cond", "switch"])
        coefs = tuple(
            float(c) for c in rng.permutation([1.0, 2.0, 3.0, 0.5])[: 2 + (kind == "switch")]
        )
        others = [a for a in m.names if a != axis]
        if pending:
            # the reduction over the pending axes, in every branch: wrong when the index
            # varies over one of them
            coll: Op = Reduce(
                self.pick(["psum", "pmean"]),
                self.pick(["lax", "shardops"]),
                self.perm(st.P),
                st.lay,
            )
            runs = tuple(range(len(coefs)))
            inside = wrong or axis not in st.P or rng.rand() < 0.5
        else:
            kinds = ["psum", "pmean", "gather", "all_to_all", "scatter", "ppermute", "shift"]
            ck = self.pick(kinds)
            one = ck in ("all_to_all", "ppermute", "shift")  # one axis
            if wrong and axis is not None and rng.rand() < 0.5 and ck not in ("ppermute", "shift"):
                R = (axis,) if one else self.perm({axis, *self.subset(m.names, nonempty=False)})
            elif wrong or not others:
                R = (self.pick(m.names),) if one else self.subset(m.names)
                if not wrong:
                    ck = self.pick(["psum", "pmean", "gather"])
            else:
                R = (self.pick(others),) if one else self.subset(others)
            if ck == "all_to_all" and st.local_shape()[1] % m.n(R):
                ck = "psum"
            coll = Coll(ck, R, st.lay, m.n(R))
            if ck in ("psum", "pmean", "scatter") and len(R) > 1:
                self.pg.tags.add("jax:sum_mixed_varying")
            runs = tuple(j for j in range(len(coefs)) if j == 0 or rng.rand() < 0.3)
            safe = axis is None or (coll.grouped() and axis not in R)
            inside = wrong or safe or rng.rand() < 0.3
        op = Branch(kind, axis, via, src, coefs, coll, runs, "inside" if inside else "outside")
        # refused whatever the index's values: right only when the devices happen to take
        # the same branch (an index read from an input)
        grouped = not isinstance(coll, Coll) or coll.grouped()
        refused = inside and axis is not None and (not grouped or axis in coll.R)
        return self.apply(self.tag(op, "design:per_device_control", refused), st)


_FAMILY_PROGRAMS: dict[tuple[str, int], list[Program]] = {}


def family_programs(family: str, mesh_i: int, n: int) -> list[Program]:
    """``n`` programs of ``family`` on mesh ``MESHES[mesh_i]`` (seeded; built once)."""
    key = (family, mesh_i)
    if len(_FAMILY_PROGRAMS.get(key, ())) < n:
        mesh = Mesh(*MESHES[mesh_i])
        rng = np.random.RandomState(SEED + 1000 * (1 + FAMILIES.index(family)) + mesh_i)
        _FAMILY_PROGRAMS[key] = [
            FamilyGen(mesh, rng, f"{family}_m{mesh_i}_{k}", family).build() for k in range(n)
        ]
    return _FAMILY_PROGRAMS[key][:n]
