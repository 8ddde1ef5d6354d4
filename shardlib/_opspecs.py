"""What each ``shardops`` op spec means: validated, cached plans (pure Python, no JAX).

Each ``plan_*`` function takes the op spec string, parses it, checks that it describes the
collective the op names, and returns a small frozen plan that ``shardops`` executes.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from ._parsing import OpSpec, ShapeSpec, SpecError, _is_identifier, parse_op_spec

__all__ = [
    "AllGatherPlan",
    "AllToAllPlan",
    "EinsumPlan",
    "IndexPlan",
    "ReduceScatterPlan",
    "plan_all_gather",
    "plan_all_to_all",
    "plan_einsum",
    "plan_index",
    "plan_psum_scatter",
    "parse_axes",
]

_LETTERS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"


def _same_rank(ops: OpSpec, op: str, fix: str) -> None:
    a, b = ops.inputs[0], ops.output
    if len(a.dims) != len(b.dims):
        raise ops.error(
            f"{op}: input has {len(a.dims)} dims but output has {len(b.dims)}; {op} keeps the rank",
            operand=None,
            dim=None,  # underline the whole output
            hint=fix,
        )


def _same_names(ops: OpSpec, op: str) -> None:
    for i, (a, b) in enumerate(zip(ops.inputs[0].dims, ops.output.dims, strict=True)):
        if a.shape != b.shape:
            raise ops.error(
                f"{op}: dim {i} is {a.shape!r} in the input but {b.shape!r} in the output; "
                f"{op} does not rename or reorder dims",
                operand=None,
                dim=i,
                hint="write the same dim names in the same order on both sides",
            )


def _moved_hint(other: ShapeSpec, dim: int, axes: tuple[str, ...], *, into: bool) -> str:
    """A hint naming all_to_all when ``axes`` shard another dim of ``other``, else ''.

    ``into=True``: dim ``dim`` gains ``axes`` and ``other`` is the input; ``into=False``: it
    loses them and ``other`` is the output.
    """
    for j, d in enumerate(other.dims):
        hit = [x for x in axes if x in d.sharding]
        if j != dim and hit:
            src, dst = (j, dim) if into else (dim, j)
            return f"this moves mesh axis {hit[0]!r} from dim {src} to dim {dst}: use all_to_all"
    return ""


def _trailing_changes(
    ops: OpSpec, op: str, *, removes: bool, other_hint: str, order_hint: str
) -> tuple[tuple[int, tuple[str, ...]], ...]:
    """``(dim, axes)`` for each dim whose trailing mesh axes ``op`` removes (or adds).

    all_gather (``removes=True``) needs each output dim's axes to be a prefix of the input's;
    psum_scatter the reverse. Anything else is an error saying what the spec does instead.
    """
    verb = "remove" if removes else "add"
    changes = []
    for i, (a, b) in enumerate(zip(ops.inputs[0].dims, ops.output.dims, strict=True)):
        short, long = (b.sharding, a.sharding) if removes else (a.sharding, b.sharding)
        if long[: len(short)] != short:
            if short[: len(long)] == long:
                what = "adds sharding" if removes else "removes sharding"
                moved = short[len(long) :]
                hint = (
                    _moved_hint(ops.inputs[0] if removes else ops.output, i, moved, into=removes)
                    or other_hint
                )
            elif set(short) <= set(long):
                what = f"does not {verb} trailing mesh axes"
                hint = order_hint
            else:
                what = "replaces mesh axes"
                hint = f"{op} only {verb}s trailing mesh axes; to move an axis between dims "
                hint += "use all_to_all"
            raise ops.error(
                f"{op}: dim {i} goes from {str(a)!r} to {str(b)!r}, which {what}",
                operand=None,
                dim=i,
                hint=hint,
            )
        if len(long) > len(short):
            changes.append((i, long[len(short) :]))
    return tuple(changes)


@dataclass(frozen=True)
class AllGatherPlan:
    spec: OpSpec
    gathers: tuple[tuple[int, tuple[str, ...]], ...]  # (dim, mesh axes removed)


@functools.lru_cache(maxsize=1024)
def plan_all_gather(spec: str) -> AllGatherPlan:
    op = "all_gather"
    ops = parse_op_spec(spec, op=op, n_inputs=1)
    _same_rank(ops, op, "all_gather only removes mesh axes: 'a/d b -> a b'")
    _same_names(ops, op)
    gathers = _trailing_changes(
        ops,
        op,
        removes=True,
        other_hint="all_gather only removes mesh axes; psum_scatter adds them (summing over them)",
        order_hint="all_gather removes axes from the end: 'a/x/y -> a/x', not 'a/x/y -> a/y'",
    )
    if not gathers:
        raise ops.spec_error(
            f"{op}: the spec gathers nothing (input and output layouts are equal)",
            hint="remove the call, or remove a '/axis' from the output",
        )
    return AllGatherPlan(ops, gathers)


@dataclass(frozen=True)
class ReduceScatterPlan:
    spec: OpSpec
    scatters: tuple[tuple[int, tuple[str, ...]], ...]  # (dim, mesh axes added)


@functools.lru_cache(maxsize=1024)
def plan_psum_scatter(spec: str) -> ReduceScatterPlan:
    op = "psum_scatter"
    ops = parse_op_spec(spec, op=op, n_inputs=1)
    _same_rank(ops, op, "psum_scatter only adds mesh axes: 'a b -> a/d b'")
    _same_names(ops, op)
    scatters = _trailing_changes(
        ops,
        op,
        removes=False,
        other_hint="psum_scatter only adds mesh axes; all_gather removes them",
        order_hint="psum_scatter adds axes at the end: 'a/x -> a/x/y', not 'a/x -> a/y/x'",
    )
    if not scatters:
        raise ops.spec_error(
            f"{op}: the spec scatters nothing (input and output layouts are equal)",
            hint="to sum without scattering use psum(spec, x, axes=...)",
        )
    return ReduceScatterPlan(ops, scatters)


@dataclass(frozen=True)
class AllToAllPlan:
    spec: OpSpec
    axes: tuple[str, ...]
    split_dim: int  # the dim that gains the axes (split into blocks)
    concat_dim: int  # the dim that loses the axes (blocks concatenated)


@functools.lru_cache(maxsize=1024)
def plan_all_to_all(spec: str) -> AllToAllPlan:
    op = "all_to_all"
    ops = parse_op_spec(spec, op=op, n_inputs=1)
    _same_rank(ops, op, "all_to_all moves a mesh axis between dims: 'a/d b -> a b/d'")
    _same_names(ops, op)
    src = dst = None
    moved_from: tuple[str, ...] = ()
    moved_to: tuple[str, ...] = ()
    for i, (a, b) in enumerate(zip(ops.inputs[0].dims, ops.output.dims, strict=True)):
        if a.sharding == b.sharding:
            continue
        n = len(b.sharding)
        if n < len(a.sharding) and a.sharding[:n] == b.sharding:
            if src is not None:
                raise ops.error(
                    f"{op}: dims {src} and {i} both lose mesh axes; all_to_all moves axes out "
                    "of one dim into one other dim",
                    operand=None,
                    dim=i,
                    hint="split it into several all_to_all calls",
                )
            src, moved_from = i, a.sharding[n:]
        elif len(a.sharding) < n and b.sharding[: len(a.sharding)] == a.sharding:
            if dst is not None:
                raise ops.error(
                    f"{op}: dims {dst} and {i} both gain mesh axes; all_to_all moves axes out "
                    "of one dim into one other dim",
                    operand=None,
                    dim=i,
                    hint="split it into several all_to_all calls",
                )
            dst, moved_to = i, b.sharding[len(a.sharding) :]
        else:
            raise ops.error(
                f"{op}: dim {i} goes from {str(a)!r} to {str(b)!r}; all_to_all removes trailing "
                "axes from one dim and appends them to another",
                operand=None,
                dim=i,
            )
    if src is None and dst is None:
        raise ops.spec_error(
            f"{op}: the spec moves nothing (input and output layouts are equal)",
            hint="all_to_all moves mesh axes from one dim to another, e.g. 'a/d b -> a b/d'",
        )
    if dst is None:
        raise ops.error(
            f"{op}: dim {src} loses {'/'.join(moved_from)!r} but no dim gains it; removing "
            "sharding is all_gather",
            operand=None,
            dim=src,
            hint="use all_gather, or append the axis to another dim: 'a/d b -> a b/d'",
        )
    if src is None:
        raise ops.error(
            f"{op}: dim {dst} gains {'/'.join(moved_to)!r} but no dim loses it; adding "
            "sharding is psum_scatter",
            operand=None,
            dim=dst,
            hint="use psum_scatter, or take the axis from another dim: 'a/d b -> a b/d'",
        )
    if moved_from != moved_to:
        raise ops.error(
            f"{op}: dim {src} loses {'/'.join(moved_from)!r} but dim {dst} gains "
            f"{'/'.join(moved_to)!r}; the same axes must move",
            operand=None,
            dim=dst,
        )
    return AllToAllPlan(ops, moved_from, split_dim=dst, concat_dim=src)


@dataclass(frozen=True)
class EinsumPlan:
    spec: OpSpec
    equation: str  # jnp.einsum equation with single letters
    unreduced: tuple[str, ...]  # mesh axes of contracted sharded dims: the caller must reduce


@functools.lru_cache(maxsize=1024)
def plan_einsum(spec: str, n_operands: int) -> EinsumPlan:
    op = "einsum_unreduced"
    ops = parse_op_spec(spec, op=op, n_inputs=n_operands)
    letters: dict[str, str] = {}
    sharding_of: dict[str, tuple[tuple[str, ...], int, int]] = {}
    axis_owner: dict[str, tuple[str, int, int]] = {}  # mesh axis -> (dim name, operand, dim)

    def letter(name: str, operand: int | None, dim: int) -> str:
        if name not in letters:
            if len(letters) >= len(_LETTERS):
                raise ops.error(
                    f"{op}: more than {len(_LETTERS)} distinct dims", operand=operand, dim=dim
                )
            letters[name] = _LETTERS[len(letters)]
        return letters[name]

    terms = []
    for k, s in enumerate(ops.inputs):
        term = ""
        seen: set[str] = set()
        for j, d in enumerate(s.dims):
            name = str(d.shape)
            if name in seen:
                raise ops.error(
                    f"{op}: dim {name!r} appears twice in operand {k}; traces and diagonals "
                    "are not supported",
                    operand=k,
                    dim=j,
                )
            seen.add(name)
            prev = sharding_of.get(name)
            if prev is not None and prev[0] != d.sharding:
                pk, pj = prev[1], prev[2]
                raise ops.error(
                    f"{op}: dim {name!r} is {str(ops.inputs[pk].dims[pj])!r} in operand {pk} but "
                    f"{str(d)!r} in operand {k}; a dim shared by operands must be split the "
                    "same way",
                    operand=k,
                    dim=j,
                    hint="all_gather or psum_scatter one operand first",
                )
            sharding_of.setdefault(name, (d.sharding, k, j))
            for ax in d.sharding:
                owner = axis_owner.setdefault(ax, (name, k, j))
                if owner[0] != name:
                    pk, pj = owner[1], owner[2]
                    raise ops.error(
                        f"{op}: mesh axis {ax!r} splits dim {str(ops.inputs[pk].dims[pj])!r} "
                        f"in operand {pk} and dim {str(d)!r} in operand {k}; the local einsum "
                        "would pair blocks of different dims",
                        operand=k,
                        dim=j,
                        hint="all_gather one of them first, or split them over different mesh axes",
                    )
            term += letter(name, k, j)
        terms.append(term)
    out = ""
    out_names: set[str] = set()
    for j, d in enumerate(ops.output.dims):
        name = str(d.shape)
        if name not in sharding_of:
            raise ops.error(
                f"{op}: output dim {name!r} does not appear in any input",
                operand=None,
                dim=j,
                hint=f"inputs have {', '.join(repr(n) for n in sharding_of)}",
            )
        if name in out_names:
            raise ops.error(f"{op}: output dim {name!r} appears twice", operand=None, dim=j)
        out_names.add(name)
        if sharding_of[name][0] != d.sharding:
            k, jj = sharding_of[name][1], sharding_of[name][2]
            raise ops.error(
                f"{op}: output dim {str(d)!r} is split differently from input dim "
                f"{str(ops.inputs[k].dims[jj])!r}; a local einsum cannot change a layout",
                operand=None,
                dim=j,
                hint="change the layout afterwards with all_gather/psum_scatter/all_to_all",
            )
        out += letters[name]
    unreduced: list[str] = []
    for name, (sh, _, _) in sharding_of.items():
        if name not in out_names:
            unreduced.extend(a for a in sh if a not in unreduced)
    eq = ",".join(terms) + "->" + out
    return EinsumPlan(ops, eq, tuple(unreduced))


@dataclass(frozen=True)
class IndexPlan:
    spec: OpSpec
    table_dim: int  # the bracketed dim of the table
    axes: tuple[str, ...]  # its mesh axes: the caller reduces over them
    shared: tuple[tuple[int, int], ...]  # (table dim, index dim) pairs vmapped together
    perm: tuple[int, ...]  # transpose from the computed order to the output order


@functools.lru_cache(maxsize=1024)
def plan_index(spec: str) -> IndexPlan:
    op = "index_unreduced"
    ops = parse_op_spec(spec, op=op, n_inputs=2, brackets=True)
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
    # Computed order: shared dims (in index order), then the table dims before the bracket,
    # then the remaining index dims, then the table dims after the bracket.
    shared_names = [inames[j] for _, j in shared]
    computed = (
        shared_names
        + [n for n in tnames[:b] if n not in shared_names]
        + [n for n in inames if n not in shared_names]
        + [n for n in tnames[b + 1 :] if n not in shared_names]
    )
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
    sharding = {str(d.shape): d.sharding for d in (*tbl.dims, *idx.dims)}
    for j, d in enumerate(ops.output.dims):
        if d.sharding != sharding[str(d.shape)]:
            raise ops.error(
                f"{op}: output dim {str(d)!r} must keep the input's layout "
                f"{str(d.shape) + ''.join('/' + a for a in sharding[str(d.shape)])!r}",
                operand=None,
                dim=j,
            )
    perm = tuple(computed.index(n) for n in onames)
    return IndexPlan(ops, b, tbl.dims[b].sharding, tuple(shared), perm)


def parse_axes(
    axes: str | tuple[str, ...] | list[str],
    op: str,
    spec: str | None = None,
    *,
    arg: str = "axes",
) -> tuple[str, ...]:
    """``'d'``, ``'d/t'``, ``'d t'`` or ``('d', 't')`` -> ``('d', 't')``.

    ``spec`` (the op's spec) and ``arg`` (the argument's name) only go into messages:
    ``psum('B M'): ...``. A value that is not a str, tuple or list is a ``TypeError``;
    a malformed name list is a `SpecError`.
    """
    label = op if spec is None else f"{op}({spec!r})"
    if isinstance(axes, str):
        parts = tuple(p for p in axes.replace("/", " ").split() if p)
    elif isinstance(axes, tuple | list):
        parts = tuple(axes)
    else:
        raise TypeError(
            f"{label}: {arg}={axes!r} does not name mesh axes: expected a str such as 'd' or "
            f"'d/t', or a tuple of str such as ('d', 't'), got {type(axes).__name__}"
        )
    if not parts:
        what = " to reduce over" if arg == "axes" else ""
        raise SpecError(f"{label}: name at least one mesh axis{what}", str(axes))
    for p in parts:
        if not isinstance(p, str) or not _is_identifier(p):
            raise SpecError(f"{label}: {p!r} is not a mesh axis name", str(axes))
    if len(set(parts)) != len(parts):
        raise SpecError(f"{label}: a mesh axis is named twice in {arg}={axes!r}", str(axes))
    return parts
