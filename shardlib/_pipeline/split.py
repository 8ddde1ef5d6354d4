"""A stage's backward split into its input half (B) and its weight half (W), for ZB-H1.

`split_backward` traces ``backward(leaves, ct) -> (dgroup, dh)`` once and partitions its
program so that B + W cost exactly one backward:

- Call-like equations (checkpoints, ``jit``, ``closed_call``...; not ``shard_map`` nor the
  custom-derivative calls) are inlined, recursively: a stage differentiated under
  ``jax.checkpoint`` is one ``remat2`` equation, its layers inside.
- B is every equation the input cotangent ``dh`` depends on; W every other equation the
  weight gradients ``dgroup`` depend on. An equation whose results feed both is B's; the
  values it defines that W reads are what B keeps for W (``kept``).
- A ``scan`` whose results both halves need is split in two scans of the same length and
  direction: B's computes the carries B needs (a fixpoint: a carry is needed if its result
  is, or if B's body reads it) and its results, and stacks the body values W's body reads
  (values B's body defines, B's carries at that iteration) as extra outputs; W's scans
  those as extra inputs and computes its own carries (the weight gradients accumulated
  over the layers) and results. Bodies split the same way, nested scans included.
- Other equations (``while``, ``cond``, custom-derivative calls) are placed whole.

Both halves run by an interpreter of the partitioned program (each scan part by
``jax.lax.scan`` with a Python body). It imports only `shardlib._env.programs` (every read
of JAX's program representation goes through it) and JAX.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax

from .._env import programs

__all__ = ["SplitBackward", "split_backward"]

# Calls inlined: their body takes the equation's trailing inputs and gives its results.
_INLINED = frozenset(
    k for k in programs.CALL_PRIMITIVES if k != "shard_map" and not k.startswith("custom")
)


@dataclasses.dataclass(frozen=True)
class _Const:
    """A value the program itself holds: a literal, or a constant JAX attached to it."""

    value: Any


# A variable of the flattened program is a key (an int, unique across inlined bodies).
_Atom = int | _Const


@dataclasses.dataclass(frozen=True)
class _Eqn:
    """An equation placed whole, its inputs and results as keys (None: a dropped result)."""

    eqn: Any
    ins: tuple[_Atom, ...]
    outs: tuple[int | None, ...]


@dataclasses.dataclass(frozen=True)
class _Scan:
    """A ``scan`` equation with its body flattened: the body's inputs are ``n_consts``
    consts, ``n_carry`` carries then the scanned slices; its outputs the carries, then the
    stacked results."""

    ins: tuple[_Atom, ...]
    outs: tuple[int | None, ...]
    body_ins: tuple[int, ...]
    body_outs: tuple[_Atom, ...]
    body: tuple[Any, ...]  # units
    n_consts: int
    n_carry: int
    length: int
    reverse: bool
    unroll: Any


@dataclasses.dataclass(frozen=True)
class _Loop:
    """One part of a (split) scan, run by ``jax.lax.scan``: pairs of a body key and the
    outer value it is (``consts``, ``xs``), carries as (body input, body output, outer
    initial value, outer result), stacked results as (body value, outer key)."""

    units: tuple[Any, ...]
    consts: tuple[tuple[int, _Atom], ...]
    carries: tuple[tuple[int, _Atom, _Atom, int | None], ...]
    xs: tuple[tuple[int, _Atom], ...]
    ys: tuple[tuple[_Atom, int | None], ...]
    length: int
    reverse: bool
    unroll: Any


class _Keys:
    """Fresh keys, each with its type: leading (stacked) dimensions and an abstract value."""

    def __init__(self) -> None:
        self._next = itertools.count()
        self.types: dict[int, tuple[tuple[int, ...], Any]] = {}

    def new(self, aval: Any, lead: tuple[int, ...] = ()) -> int:
        key = next(self._next)
        self.types[key] = (lead, aval)
        return key

    def stacked(self, key: int, length: int) -> int:
        lead, aval = self.types[key]
        return self.new(aval, (length, *lead))


# -- flattening -------------------------------------------------------------------------------


def _complete(program: programs.Program) -> bool:
    """Whether ``program`` holds the values of all its constants (else it is run whole)."""
    return len(program.consts) == len(program.constvars)


def _flatten(
    program: programs.Program, ins: Sequence[_Atom], keys: _Keys
) -> tuple[list[Any], list[_Atom]]:
    """``program``'s units (calls inlined, scans flattened) on inputs ``ins``, and its
    outputs."""
    consts: list[_Atom] = [_Const(c) for c in program.consts]
    # Constants whose values JAX did not attach: only in programs counted, never run.
    consts += [keys.new(v.aval) for v in program.constvars[len(consts) :]]
    env = {id(v): a for v, a in zip(program.constvars, consts, strict=True)}
    env.update((id(v), a) for v, a in zip(program.invars, ins, strict=True))

    def read(v: Any) -> _Atom:
        return _Const(programs.literal_value(v)) if programs.is_literal(v) else env[id(v)]

    units: list[Any] = []
    for eqn in program.eqns:
        args = tuple(read(v) for v in eqn.invars)
        outs = _inline(eqn, args, keys, units)
        if outs is None:
            unit = _unit(eqn, args, keys)
            units.append(unit)
            outs = list(unit.outs)
        for v, a in zip(eqn.outvars, outs, strict=True):
            if a is not None and not programs.is_dropped(v):
                env[id(v)] = a
    return units, [read(v) for v in program.outvars]


def _inline(eqn: Any, args: tuple[_Atom, ...], keys: _Keys, units: list) -> list | None:
    """A call's body, flattened into ``units``, and its outputs; None: not inlined."""
    if eqn.primitive.name not in _INLINED:
        return None
    body = programs.call_body(eqn)
    if not _complete(body):
        return None
    inner, outs = _flatten(body, args[len(args) - len(body.invars) :], keys)
    units.extend(inner)
    return list(outs)


def _unit(eqn: Any, args: tuple[_Atom, ...], keys: _Keys) -> _Eqn | _Scan:
    outs = tuple(None if programs.is_dropped(v) else keys.new(v.aval) for v in eqn.outvars)
    if eqn.primitive.name == "scan":
        parts = programs.scan_parts(eqn)
        if _complete(parts.body):
            body_ins = tuple(keys.new(v.aval) for v in parts.body.invars)
            body, body_outs = _flatten(parts.body, body_ins, keys)
            return _Scan(
                args, outs, body_ins, tuple(body_outs), tuple(body), parts.n_consts,
                parts.n_carry, parts.length, parts.reverse, programs.param(eqn, "unroll"),
            )  # fmt: skip
    return _Eqn(eqn, args, outs)


# -- partitioning -----------------------------------------------------------------------------


def _keys_of(atoms: Iterable[Any]) -> set[int]:
    return {a for a in atoms if isinstance(a, int)}


@dataclasses.dataclass
class _Parts:
    """A block's units split: B's and W's (program order), and the keys each half reads or
    gives (``need_b``, ``need_w``; W's may be values B defines: kept)."""

    b: list[Any]
    w: list[Any]
    need_b: set[int]
    need_w: set[int]


def _partition(units: Sequence[Any], need_b: set[int], need_w: set[int], keys: _Keys) -> _Parts:
    """B: the units that give ``need_b`` (and what they read); W: the other units that give
    ``need_w``. Walked backwards, so every reader of a unit's results is placed first."""
    need_b, need_w = set(need_b), set(need_w)
    b: list[Any] = []
    w: list[Any] = []
    for u in reversed(units):
        if isinstance(u, _Scan):
            loop_b, loop_w = _split_scan(u, need_b, need_w, keys)
            b += [loop_b] if loop_b is not None else []
            w += [loop_w] if loop_w is not None else []
        elif any(o in need_b for o in u.outs):
            b.append(u)
            need_b |= _keys_of(u.ins)
        elif any(o in need_w for o in u.outs):
            w.append(u)
            need_w |= _keys_of(u.ins)
    return _Parts(b[::-1], w[::-1], need_b, need_w)


def _defined(units: Iterable[Any]) -> set[int]:
    """The keys ``units`` define."""
    out: set[int] = set()
    for u in units:
        if isinstance(u, _Loop):
            out |= _keys_of(c[3] for c in u.carries) | _keys_of(k for _, k in u.ys)
        else:
            out |= _keys_of(u.outs)
    return out


def _reads(units: Iterable[Any]) -> set[int]:
    """The keys ``units`` read (a loop: its outer inputs)."""
    out: set[int] = set()
    for u in units:
        if isinstance(u, _Loop):
            out |= _keys_of(a for _, a in u.consts + u.xs) | _keys_of(c[2] for c in u.carries)
        else:
            out |= _keys_of(u.ins)
    return out


def _body_parts(s: _Scan, o_b: set[int], o_w: set[int], keys: _Keys) -> tuple[_Parts, set, set]:
    """The split of ``s``'s body for its results ``o_b`` (B's) and ``o_w`` (W's), and the
    carries of B's and of W's loop: a fixpoint, a carry being needed if its result is or
    if the body part reads it (W's carries are those B does not carry)."""
    carry_in = s.body_ins[s.n_consts : s.n_consts + s.n_carry]
    cb = {i for i in o_b if i < s.n_carry}
    cw: set[int] = set()
    while True:
        need_b = _keys_of(s.body_outs[i] for i in cb | {i for i in o_b if i >= s.n_carry})
        need_w = _keys_of(s.body_outs[i] for i in cw | {i for i in o_w if i >= s.n_carry})
        parts = _partition(s.body, need_b, need_w, keys)
        nb = cb | {i for i, k in enumerate(carry_in) if k in parts.need_b}
        nw = {i for i in o_w if i < s.n_carry}
        nw = (nw | {i for i, k in enumerate(carry_in) if k in parts.need_w}) - nb
        if nb == cb and nw == cw:
            return parts, cb, cw
        cb, cw = nb, nw


def _split_scan(
    s: _Scan, need_b: set[int], need_w: set[int], keys: _Keys
) -> tuple[_Loop | None, _Loop | None]:
    """``s`` as B's loop and W's loop (either None where that half needs none of it);
    ``need_b``/``need_w`` get the outer keys each loop reads."""
    o_b = {i for i, o in enumerate(s.outs) if o is not None and o in need_b}
    o_w = {i for i, o in enumerate(s.outs) if o is not None and o in need_w} - o_b
    if not o_b and not o_w:
        return None, None
    parts, cb, cw = _body_parts(s, o_b, o_w, keys)
    if o_b and o_w and not parts.w:  # W's body would be empty: B's loop gives W's results too
        parts, cb, cw = _body_parts(s, o_b | o_w, set(), keys)
        o_b, o_w = o_b | o_w, set()
    nc, nk = s.n_consts, s.n_carry
    carry_in = s.body_ins[nc : nc + nk]
    from_b = _defined(parts.b) | {carry_in[i] for i in cb}
    extras = sorted(parts.need_w & from_b)
    stacked = [keys.stacked(k, s.length) for k in extras]
    loop_b = _loop(s, parts.b, parts.need_b, cb, o_b, ((), ()))
    loop_w = _loop(s, parts.w, parts.need_w, cw, o_w, (extras, stacked))
    loop_b = dataclasses.replace(loop_b, ys=loop_b.ys + tuple(zip(extras, stacked, strict=True)))
    need_b |= _reads([loop_b])
    need_w |= _reads([loop_w])
    return (loop_b if o_b else None), (loop_w if o_w else None)


def _loop(s: _Scan, units: list, need: set[int], carries: set[int], outs: set[int],
          extra_xs: tuple[Sequence[int], Sequence[int]]) -> _Loop:  # fmt: skip
    """The part of ``s`` that runs ``units`` (which read ``need``), carries ``carries`` and
    gives the stacked results among ``outs``; ``extra_xs``: more (body, outer) slices."""
    nc, nk = s.n_consts, s.n_carry
    xs = range(nc + nk, len(s.body_ins))
    return _Loop(
        units=tuple(units),
        consts=tuple((s.body_ins[i], s.ins[i]) for i in range(nc) if s.body_ins[i] in need),
        carries=tuple(
            (s.body_ins[nc + i], s.body_outs[i], s.ins[nc + i], s.outs[i]) for i in sorted(carries)
        ),
        xs=tuple((s.body_ins[i], s.ins[i]) for i in xs if s.body_ins[i] in need)
        + tuple(zip(*extra_xs, strict=True)),
        ys=tuple((s.body_outs[i], s.outs[i]) for i in sorted(outs) if i >= nk),
        length=s.length,
        reverse=s.reverse,
        unroll=s.unroll,
    )


# -- running ----------------------------------------------------------------------------------


def _value(env: dict[int, Any], a: _Atom) -> Any:
    return a.value if isinstance(a, _Const) else env[a]


def _run(units: Iterable[Any], env: dict[int, Any]) -> None:
    """Evaluate ``units`` in program order, writing their results into ``env``."""
    for u in units:
        if isinstance(u, _Loop):
            _run_loop(u, env)
            continue
        outs = programs.bind_eqn(u.eqn, [_value(env, a) for a in u.ins])
        env.update((k, v) for k, v in zip(u.outs, outs, strict=True) if k is not None)


def _run_loop(loop: _Loop, env: dict[int, Any]) -> None:
    consts = {k: _value(env, a) for k, a in loop.consts}

    def body(carry: list, x: list) -> tuple[list, list]:
        inner = dict(consts)
        inner.update(zip([c[0] for c in loop.carries], carry, strict=True))
        inner.update(zip([k for k, _ in loop.xs], x, strict=True))
        _run(loop.units, inner)
        return [_value(inner, c[1]) for c in loop.carries], [_value(inner, a) for a, _ in loop.ys]

    init = [_value(env, c[2]) for c in loop.carries]
    xs = [_value(env, a) for _, a in loop.xs]
    carry, ys = jax.lax.scan(
        body, init, xs, length=loop.length, reverse=loop.reverse, unroll=loop.unroll
    )
    outs = [c[3] for c in loop.carries] + [k for _, k in loop.ys]
    env.update((k, v) for k, v in zip(outs, [*carry, *ys], strict=True) if k is not None)


# -- cost -------------------------------------------------------------------------------------


def _flops(units: Iterable[Any]) -> int:
    """The ``dot_general`` FLOPs of ``units``: a scan's body counted ``length`` times, the
    programs inside an opaque equation (``while``, ``cond``...) once."""
    total = 0
    for u in units:
        if isinstance(u, _Loop | _Scan):
            total += u.length * _flops(u.units if isinstance(u, _Loop) else u.body)
            continue
        total += programs.dot_flops(u.eqn)
        for sub in programs.sub_programs(u.eqn):
            keys = _Keys()
            total += _flops(_flatten(sub, [keys.new(v.aval) for v in sub.invars], keys)[0])
    return total


# -- the split --------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SplitBackward:
    """A backward split in its input half and its weight half (see the module docstring).

    - `inputs(leaves, ct) -> (dh, kept)`: B: the input cotangent, and the values W reads
      that B's equations define (a list of arrays, of types `kept_avals`).
    - `weights(leaves, ct, kept) -> dgroup`: W: the weight gradients (backward's structure).
    - `kept_avals`: the types of ``kept`` (varying manual axes kept where JAX types them).
    - `flops_split`: ``(b, w, total)``: the ``dot_general`` FLOPs (2 per multiply-add; scan
      bodies times their length; convolutions not counted) of B, of W and of the whole
      backward as traced. ``b + w == total`` but for equations nothing reads.
    """

    kept_avals: list[jax.ShapeDtypeStruct]
    flops_split: tuple[int, int, int]
    _b: tuple[Any, ...] = dataclasses.field(repr=False)
    _w: tuple[Any, ...] = dataclasses.field(repr=False)
    _ins: tuple[int, ...] = dataclasses.field(repr=False)
    _kept: tuple[int, ...] = dataclasses.field(repr=False)
    _outs: tuple[_Atom, ...] = dataclasses.field(repr=False)
    _n_dgroup: int = dataclasses.field(repr=False)
    _out_tree: Any = dataclasses.field(repr=False)

    def _start(self, leaves: list, ct: Any) -> dict[int, Any]:
        return dict(zip(self._ins, jax.tree.leaves((leaves, ct)), strict=True))

    def _outputs(self, env: dict[int, Any], atoms: Sequence[_Atom]) -> list[Any]:
        return [jax.numpy.asarray(_value(env, a)) for a in atoms]

    def inputs(self, leaves: list, ct: Any) -> tuple[Any, list[jax.Array]]:
        env = self._start(leaves, ct)
        _run(self._b, env)
        flat = [None] * self._n_dgroup + self._outputs(env, self._outs[self._n_dgroup :])
        _, dh = jax.tree.unflatten(self._out_tree, flat)
        return dh, [env[k] for k in self._kept]

    def weights(self, leaves: list, ct: Any, kept: Sequence[jax.Array]) -> Any:
        env = self._start(leaves, ct)
        env.update(zip(self._kept, kept, strict=True))
        _run(self._w, env)
        atoms = self._outs[: self._n_dgroup]
        flat = self._outputs(env, atoms) + [None] * (len(self._outs) - self._n_dgroup)
        dgroup, _ = jax.tree.unflatten(self._out_tree, flat)
        return dgroup


def split_backward(
    backward: Callable, leaves: list, ct: jax.Array, why: list[str] | None = None
) -> SplitBackward | None:
    """``backward(leaves, ct) -> (dgroup, dh)`` split in its input half and its weight half;
    None where the weight half would have no equation, or none that reads a value of the
    program (zeros for weights the stage does not use): then the whole runs as the input half,
    and ``why`` (if given) gets the reason. Traced here with ``jax.make_jaxpr`` (inside a
    ``shard_map`` body, values keep their varying types)."""
    closed, shapes = jax.make_jaxpr(backward, return_shape=True)(leaves, ct)
    program = programs.open_program(closed)
    if not _complete(program):
        return None
    keys = _Keys()
    ins = tuple(keys.new(v.aval) for v in program.invars)
    units, outs = _flatten(program, ins, keys)
    n_dgroup = len(jax.tree.leaves(shapes[0]))
    parts = _partition(units, _keys_of(outs[n_dgroup:]), _keys_of(outs[:n_dgroup]), keys)
    kept = tuple(sorted(parts.need_w & _defined(parts.b)))
    if not _reads(parts.w) & (set(ins) | set(kept)):  # W has no equation, or only constants
        (why if why is not None else []).append(_whole(parts, _keys_of(outs[:n_dgroup])))
        return None
    return SplitBackward(
        kept_avals=[programs.value_type(keys.types[k][1], keys.types[k][0]) for k in kept],
        flops_split=(_flops(parts.b), _flops(parts.w), _flops(units)),
        _b=tuple(parts.b),
        _w=tuple(parts.w),
        _ins=ins,
        _kept=kept,
        _outs=tuple(outs),
        _n_dgroup=n_dgroup,
        _out_tree=jax.tree.structure(shapes),
    )


def _whole(parts: _Parts, dgroup: set[int]) -> str:
    """Why a backward split into ``parts`` has no weight half (``dgroup``: its keys)."""
    names = sorted({"scan" if isinstance(u, _Loop) else u.eqn.primitive.name
                    for u in parts.b if _defined([u]) & dgroup})  # fmt: skip
    if parts.w or not names:
        return "its weight gradient reads nothing of the program: the stage ignores its weights"
    return (f"its weight gradient comes out of {', '.join(f'`{n}`' for n in names)}, which "
            "the input's cotangent needs too and the split places whole")  # fmt: skip
