"""JAX's collective primitives: which communicate, which have replica groups, and how a
user writes each.

A traced program names a collective by the primitive JAX binds, which is not always the
function the user called: with ``check_vma`` on, ``jax.lax.psum`` of a value typed
invariant binds ``psum_invariant``, of one typed unreduced ``unreduced_psum``, and
``psum_scatter`` binds ``reduce_scatter`` (JAX 0.9 to 0.12). The checks that refuse a
collective (in a per-device branch, in a pipeline stage) ask here whether it communicates
(`collectives`, `first_collective_over`) and whether it is grouped (`GROUPED`); their
messages name it as written (`written_name`). Parameters are read through
`shardlib._env.programs`, the adapter.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from .programs import open_program, optional_param, sub_programs

__all__ = [
    "GROUPED",
    "NOT_COMMUNICATING",
    "axis_names",
    "collectives",
    "first_collective_over",
    "written_name",
]


# Primitives that name mesh axes without moving data between devices (casts between JAX's
# varying, reduced and unreduced types; named with a stray ``_p`` before JAX 0.11).
NOT_COMMUNICATING = frozenset(
    {
        "axis_index",
        "pvary",
        "pcast",
        "preduced",
        "reduced_vary_cast",
        "reduced_vary_cast_p",
        "vary_unreduced_cast",
        "vary_unreduced_cast_p",
    }
)


# Collectives with replica groups (JAX's primitive names across 0.9 to 0.12; ``pbroadcast``
# is ``jax.lax.pbroadcast``, a collective-broadcast from one device of each group, not a type
# cast): a group is the devices that differ only in the collective's own axes. Inside a
# branch that only some devices take (a ``cond``/``switch`` whose index differs across
# devices of some axes), such a collective is right when its axes are none of those: each of
# its groups lies inside devices that take the same branch, and XLA meets them in one group.
# Every other communicating primitive (a ``collective-permute``: ``ppermute``,
# ``shardops.shift``, ``attention.ring``) has no replica groups: XLA pairs it with whatever
# permute the devices of the other branches run at that moment. Shared by the partial-sum
# analysis's per-device ``cond`` rule and the pipeline schedules' stage checks.
GROUPED = frozenset(
    {
        "psum",
        "psum2",
        "psum_invariant",
        "unreduced_psum",
        "pmax",
        "pmin",
        "unreduced_pmax",
        "unreduced_pmin",
        "reduce_scatter",
        "unreduced_reduce_scatter",
        "all_gather",
        "all_gather_invariant",
        "all_gather_reduced",
        "all_to_all",
        "pbroadcast",
    }
)


# The names JAX binds for an op whose user-facing name is another (JAX 0.9 to 0.12): with
# check_vma on, ``jax.lax.psum`` of a value typed invariant binds ``psum_invariant``, and of
# one typed unreduced ``unreduced_psum``; ``psum_scatter`` binds ``reduce_scatter``; and
# ``pbroadcast`` with a traced source binds ``pbroadcast_dynamic`` (JAX 0.12).
_WRITTEN = {
    "psum_invariant": "psum",
    "psum2": "psum",
    "unreduced_psum": "psum",
    "unreduced_pmax": "pmax",
    "unreduced_pmin": "pmin",
    "reduce_scatter": "psum_scatter",
    "unreduced_reduce_scatter": "psum_scatter",
    "all_gather_invariant": "all_gather",
    "all_gather_reduced": "all_gather",
    "pbroadcast_dynamic": "pbroadcast",
}


def written_name(primitive: str) -> str:
    """How a user writes the op that binds ``primitive`` (``psum`` for ``psum_invariant``):
    what a message names, for the primitive the program holds."""
    return _WRITTEN.get(primitive, primitive)


def axis_names(eqn: Any) -> list[str]:
    """The mesh axis names an equation's parameters name (``axes``, ``axis_name``)."""
    out: list[str] = []
    for key in ("axes", "axis_name"):
        value = optional_param(eqn, key)
        out += [
            a
            for a in (value if isinstance(value, tuple | list) else (value,))
            if isinstance(a, str)
        ]
    return out


def collectives(program: Any) -> Iterator[Any]:
    """Every equation of ``program`` (nested programs included, in program order) that
    communicates over some mesh axis: a primitive with axis names that is not a pure type
    cast or ``axis_index``."""
    for eqn in open_program(program).eqns:
        if eqn.primitive.name not in NOT_COMMUNICATING and axis_names(eqn):
            yield eqn
        for sub in sub_programs(eqn):
            yield from collectives(sub)


def first_collective_over(program: Any, axis: str) -> Any | None:
    """The first equation of ``program`` (nested programs included) that communicates over
    mesh axis ``axis``, or None."""
    return next((eqn for eqn in collectives(program) if axis in axis_names(eqn)), None)
