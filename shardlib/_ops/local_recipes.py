"""Recipes of the local ``shardops`` ops, ``einsum_unreduced`` and ``index_unreduced`` (no JAX).

Neither communicates; both may leave a partial sum (a contracted or looked-up dim split over
mesh axes), which their recipe records in ``marks``. See `shardlib._ops.recipe.Recipe`. The
einsum spec checks (`einsum_parts`) serve the reducing ``einsum`` too
(`shardlib._ops.reduced_einsum_recipe`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from .._lang.op_spec import OpSpec, parse_op_spec
from .._lang.parsing import DimSpec, as_str
from .recipe import Recipe, axes_list

__all__ = [
    "EinsumParts",
    "EinsumRecipe",
    "IndexRecipe",
    "einsum_parts",
    "einsum_recipe",
    "index_recipe",
]

_LETTERS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"


@dataclass(frozen=True)
class EinsumRecipe(Recipe):
    equation: str  # jnp.einsum equation with single letters
    unreduced: tuple[str, ...]  # mesh axes of contracted sharded dims: the caller must reduce


def einsum_recipe(spec: str | bytes, n_operands: int) -> EinsumRecipe:
    """The recipe of ``einsum_unreduced(spec, *operands)`` with ``n_operands`` operands."""
    text = spec if type(spec) is str else as_str(spec)
    if not n_operands:
        raise TypeError(f"einsum_unreduced({text!r}) needs at least one operand")
    return _einsum_recipe(text, n_operands)


class _Dims:
    """The dims of an einsum's inputs by name: their letter, first sharding and mesh axes."""

    def __init__(self, ops: OpSpec, op: str):
        self.ops, self.op = ops, op
        self.letters: dict[str, str] = {}
        self.first: dict[str, tuple[tuple[str, ...], int, int]] = {}  # name -> (sharding, k, j)
        self.axis_owner: dict[str, tuple[str, int, int]] = {}  # mesh axis -> (name, k, j)

    def add(self, d: DimSpec, k: int, j: int) -> str:
        """Record dim ``j`` of operand ``k``; its letter. Errors for inconsistent shardings."""
        ops, op, name = self.ops, self.op, str(d.shape)
        prev = self.first.setdefault(name, (d.sharding, k, j))
        if prev[0] != d.sharding:
            raise ops.error(
                f"{op}: dim {name!r} is {str(ops.inputs[prev[1]].dims[prev[2]])!r} in operand "
                f"{prev[1]} but {str(d)!r} in operand {k}; a dim shared by operands must be "
                "split the same way",
                operand=k,
                dim=j,
                hint="all_gather or psum_scatter one operand first",
            )
        for ax in d.sharding:
            owner = self.axis_owner.setdefault(ax, (name, k, j))
            if owner[0] != name:
                raise ops.error(
                    f"{op}: mesh axis {ax!r} splits dim "
                    f"{str(ops.inputs[owner[1]].dims[owner[2]])!r} in operand {owner[1]} and dim "
                    f"{str(d)!r} in operand {k}; the local einsum would pair blocks of different "
                    "dims",
                    operand=k,
                    dim=j,
                    hint="all_gather one of them first, or split them over different mesh axes",
                )
        if name not in self.letters:
            if len(self.letters) >= len(_LETTERS):
                raise ops.error(f"{op}: more than {len(_LETTERS)} distinct dims", operand=k, dim=j)
            self.letters[name] = _LETTERS[len(self.letters)]
        return self.letters[name]


@dataclass(frozen=True)
class EinsumParts:
    """An einsum spec, checked: what ``einsum_unreduced`` and ``einsum`` share.

    ``equation``: the ``jnp.einsum`` equation with single letters; ``axes``: the mesh axes of
    the contracted split dims (each device's local einsum is a partial sum over them);
    ``contracted``: those dims as written; ``scatters``: ``(output dim, axes)`` for each output
    dim split over contracted axes beyond its input's layout (only for ``reduces=True``), and
    ``sources``: ``(operand, dim)`` of the input dim each of them comes from.
    """

    ops: OpSpec
    equation: str
    axes: tuple[str, ...]
    contracted: tuple[str, ...]
    scatters: tuple[tuple[int, tuple[str, ...]], ...] = ()
    sources: tuple[tuple[int, int], ...] = ()


def einsum_parts(spec: str, n_operands: int, op: str, *, reduces: bool) -> EinsumParts:
    """Parse and check the einsum ``spec`` of ``op`` with ``n_operands`` operands.

    Every output dim is an input dim, once; with ``reduces=False`` it keeps its input's
    layout, with ``reduces=True`` it may also gain, at its end, mesh axes of contracted split
    dims (the op then reduce-scatters over them). Errors name ``op``.
    """
    ops = parse_op_spec(spec, op=op, n_inputs=n_operands)
    dims = _Dims(ops, op)
    terms = []
    for k, s in enumerate(ops.inputs):
        term = ""
        for j, d in enumerate(s.dims):
            if any(e.shape == d.shape for e in s.dims[:j]):
                raise ops.error(
                    f"{op}: dim {str(d.shape)!r} appears twice in operand {k}; traces and "
                    "diagonals are not supported",
                    operand=k,
                    dim=j,
                    hint=f"a square operand (a weight {d.shape} x {d.shape}) takes two names of "
                    f"the same size: write its second dim as another name, such as "
                    f"'{d.shape}2', and use that name where the einsum means that dim",
                )
            term += dims.add(d, k, j)
        terms.append(term)
    out_names = {str(d.shape) for d in ops.output.dims}
    axes: list[str] = []
    contracted: list[str] = []  # as written, for messages
    for name, (sh, k, j) in dims.first.items():
        if name not in out_names and sh:
            axes.extend(a for a in sh if a not in axes)
            contracted.append(str(ops.inputs[k].dims[j]))
    out, scatters, sources = _einsum_output(ops, op, dims, tuple(axes) if reduces else None)
    eq = ",".join(terms) + "->" + out
    return EinsumParts(ops, eq, tuple(axes), tuple(contracted), scatters, sources)


def _einsum_output(ops: OpSpec, op: str, dims: _Dims, axes: tuple[str, ...] | None):
    """The output term, the scattered output dims and their sources.

    Every output dim is an input dim, once, split as in the input or (``axes`` not None: the
    op reduces over the contracted split axes ``axes``) over some of ``axes`` at its end.
    """
    out, scatters, sources = "", [], []
    for j, d in enumerate(ops.output.dims):
        name = str(d.shape)
        if name not in dims.first:
            raise ops.error(
                f"{op}: output dim {name!r} does not appear in any input",
                operand=None,
                dim=j,
                hint=f"inputs have {', '.join(repr(n) for n in dims.first)}",
            )
        if dims.letters[name] in out:
            raise ops.error(f"{op}: output dim {name!r} appears twice", operand=None, dim=j)
        sharding, k, jj = dims.first[name]
        if sharding != d.sharding:
            src = ops.inputs[k].dims[jj]
            if axes is None:
                raise ops.error(
                    f"{op}: output dim {str(d)!r} is split differently from input dim "
                    f"{str(src)!r}; a local einsum cannot change a layout",
                    operand=None,
                    dim=j,
                    hint="change the layout afterwards with all_gather/psum_scatter/all_to_all",
                )
            scatters.append((j, _gained(ops, op, dims, j, src, axes)))
            sources.append((k, jj))
        out += dims.letters[name]
    return out, tuple(scatters), tuple(sources)


def _gained(
    ops: OpSpec, op: str, dims: _Dims, j: int, src: DimSpec, axes: tuple[str, ...]
) -> tuple[str, ...]:
    """The contracted axes ``axes`` that output dim ``j`` adds after input dim ``src``'s."""
    d = ops.output.dims[j]
    have, want = src.sharding, d.sharding
    if want[: len(have)] != have:
        lost = [a for a in have if a not in want]
        if lost:
            msg = (
                f"{op}: output dim {str(d)!r} drops mesh axis {lost[0]!r} of input dim "
                f"{str(src)!r}; {op} sums over contracted dims but does not gather"
            )
            hint = f"keep {str(src)!r} in the output and all_gather the result afterwards"
        else:
            msg = (
                f"{op}: output dim {str(d)!r} puts mesh axes before those of input dim "
                f"{str(src)!r}; the output keeps the input's axes first, then the contracted "
                "axes it is split over"
            )
            hint = f"write {'/'.join((str(src), *(a for a in want if a not in have)))!r}"
        raise ops.error(msg, operand=None, dim=j, hint=hint)
    extra = want[len(have) :]
    for a in extra:
        if a in axes:
            continue
        owner = dims.axis_owner.get(a)
        if owner is not None:
            msg = (
                f"{op}: output dim {str(d)!r} is split over mesh axis {a!r}, which splits input "
                f"dim {str(ops.inputs[owner[1]].dims[owner[2]])!r}, not a contracted dim; {op} "
                "does not move mesh axes between dims"
            )
            hint = "keep the input's layout and all_to_all the result afterwards"
        else:
            msg = (
                f"{op}: output dim {str(d)!r} is split over mesh axis {a!r}, which splits no "
                f"input dim, so {op} has no partial sum to scatter over it (contracted split "
                f"axes: {axes_list(axes)})"
            )
            hint = f"write {str(src)!r}, or split a contracted dim over {a!r}"
        raise ops.error(msg, operand=None, dim=j, hint=hint)
    return extra


@functools.lru_cache(maxsize=1024)
def _einsum_recipe(spec: str, n_operands: int) -> EinsumRecipe:
    op = "einsum_unreduced"
    parts = einsum_parts(spec, n_operands, op, reduces=False)
    contracted, n = parts.contracted, len(parts.contracted)
    why = (
        f"the contracted dim{'s' if n != 1 else ''} {', '.join(map(repr, contracted))} "
        f"{'are' if n != 1 else 'is'} split, so each device holds a partial sum"
        if contracted
        else "no contracted dim is split"
    )
    red = parts.axes
    roles = tuple(f"operand {k}" for k in range(n_operands))
    return EinsumRecipe(
        parts.ops, parts.equation, red, op=op, roles=roles, needs=red, marks=red, why=why
    )


@dataclass(frozen=True)
class IndexRecipe(Recipe):
    table_dim: int  # the bracketed dim of the table
    axes: tuple[str, ...]  # its mesh axes: the caller reduces over them
    shared: tuple[tuple[int, int], ...]  # (table dim, index dim) pairs vmapped together
    perm: tuple[int, ...]  # transpose from the computed order to the output order
    # How the lookup is vmapped over the shared dims: (table, index) in_axes for each
    # jax.vmap, innermost first; and the bracketed dim's position inside all the vmaps.
    vmaps: tuple[tuple[int, int], ...] = ()
    inner_dim: int = 0


def index_recipe(spec: str | bytes) -> IndexRecipe:
    """The recipe of ``index_unreduced(spec, table, indices)``."""
    return _index_recipe(as_str(spec))


def _index_names(ops: OpSpec, op: str) -> tuple[list[str], list[str], int]:
    """The table's and the indices' dim names and the bracketed dim, after checking them."""
    tbl, idx = ops.inputs
    b = ops.bracketed[0]
    if ops.bracketed[1] is not None:
        raise ops.error(
            f"{op}: only the table (first operand) has a bracketed dim",
            operand=1,
            dim=ops.bracketed[1],
            hint="remove the brackets from the indices; bracket the table dim they address",
        )
    if b is None:
        raise ops.error(
            f"{op}: the table spec needs one bracketed dim, the one the indices address",
            operand=0,
            dim=None,
            hint="write e.g. '[vocab/t] d, batch len -> batch len d'",
        )
    tnames = [str(d.shape) for d in tbl.dims]
    inames = [str(d.shape) for d in idx.dims]
    for k, (role, names) in enumerate((("table", tnames), ("indices", inames))):
        for j, n in enumerate(names):
            if n in names[:j]:
                raise ops.error(
                    f"{op}: dim {n!r} appears twice in the {role}",
                    operand=k,
                    dim=j,
                    hint="give each dim of an operand its own name",
                )
    key = tnames[b]
    if key in inames:
        raise ops.error(
            f"{op}: the looked-up dim {key!r} also appears in the indices",
            operand=1,
            dim=inames.index(key),
            hint="the indices address the bracketed dim; give the index dims other names",
        )
    return tnames, inames, b


def _index_shared(ops: OpSpec, op: str, tnames: list[str], inames: list[str], b: int):
    """``(table dim, index dim)`` of each dim named in both (split alike, not by the key's axes)."""
    tbl, idx = ops.inputs
    for ax in tbl.dims[b].sharding:
        for j, d in enumerate(idx.dims):
            if ax in d.sharding:
                raise ops.error(
                    f"{op}: mesh axis {ax!r} splits both the looked-up dim "
                    f"{str(tbl.dims[b])!r} and index dim {str(d)!r}; the result is summed "
                    f"over {ax!r} afterwards, which would add up different blocks of "
                    f"{str(d.shape)!r}",
                    operand=1,
                    dim=j,
                    hint=f"all_gather the indices over {ax!r} first, or split the table over "
                    "another mesh axis",
                )
    shared = []
    for j, n in enumerate(inames):
        if n in tnames:
            i = tnames.index(n)
            if tbl.dims[i].sharding != idx.dims[j].sharding:
                raise ops.error(
                    f"{op}: dim {n!r} is {str(tbl.dims[i])!r} in the table but "
                    f"{str(idx.dims[j])!r} in the indices; a dim shared by both must be split "
                    "the same way",
                    operand=1,
                    dim=j,
                    hint="all_gather or psum_scatter one operand first",
                )
            shared.append((i, j))
    return tuple(shared)


def _index_perm(ops: OpSpec, op: str, spec: str, computed: list[str]) -> tuple[int, ...]:
    """The transpose from the computed order to the output's (same dims, same layouts)."""
    onames = [str(d.shape) for d in ops.output.dims]
    if sorted(onames) != sorted(computed):
        missing = [n for n in computed if n not in onames]
        extra = [n for n in onames if n not in computed]
        raise ops.error(
            f"{op}: the output must have every non-bracketed table dim and every index dim, "
            f"once each"
            + (f"; missing {missing}" if missing else "")
            + (f"; unexpected {extra}" if extra else ""),
            operand=None,
            dim=onames.index(extra[0]) if extra else None,
            hint=f"e.g. '{spec.split('->')[0].strip()} -> {' '.join(computed)}'",
        )
    sharding = {str(d.shape): d.sharding for s in ops.inputs for d in s.dims}
    for j, d in enumerate(ops.output.dims):
        if d.sharding != sharding[str(d.shape)]:
            raise ops.error(
                f"{op}: output dim {str(d)!r} must keep the input's layout "
                f"{str(d.shape) + ''.join('/' + a for a in sharding[str(d.shape)])!r}",
                operand=None,
                dim=j,
            )
    return tuple(computed.index(n) for n in onames)


def _vmaps(shared: tuple[tuple[int, int], ...]) -> tuple[tuple[int, int], ...]:
    """in_axes of the nested vmaps over the shared dims, innermost first (first outermost)."""
    positions = []
    for n, (t_dim, i_dim) in enumerate(shared):
        before = shared[:n]  # dims already removed by the outer vmaps
        positions.append(
            (
                t_dim - sum(1 for t, _ in before if t < t_dim),
                i_dim - sum(1 for _, i in before if i < i_dim),
            )
        )
    return tuple(reversed(positions))


@functools.lru_cache(maxsize=1024)
def _index_recipe(spec: str) -> IndexRecipe:
    op = "index_unreduced"
    ops = parse_op_spec(spec, op=op, n_inputs=2, brackets=True)
    tnames, inames, b = _index_names(ops, op)
    shared = _index_shared(ops, op, tnames, inames, b)
    # Computed order: shared dims (in index order), then the table dims before the bracket,
    # then the remaining index dims, then the table dims after the bracket.
    shared_names = [inames[j] for _, j in shared]
    computed = (
        shared_names
        + [n for n in tnames[:b] if n not in shared_names]
        + [n for n in inames if n not in shared_names]
        + [n for n in tnames[b + 1 :] if n not in shared_names]
    )
    perm = _index_perm(ops, op, spec, computed)
    key = ops.inputs[0].dims[b]
    axes = key.sharding
    why = (
        f"the looked-up dim {str(key)!r} is split, so each device finds only its own rows"
        if axes
        else f"the looked-up dim {str(key)!r} is not split"
    )
    return IndexRecipe(
        ops,
        b,
        axes,
        shared,
        perm,
        vmaps=_vmaps(shared),
        inner_dim=b - sum(1 for t, _ in shared if t < b),
        op=op,
        roles=("table", "indices"),
        needs=axes,
        marks=axes,
        why=why,
    )
