"""The replica groups of compiled HLO's collectives: part of the one HLO reader
(`shardlib._explain.hlo`, which re-exports `replica_groups`, `group_size`, `group_axes` and
`groups_attr`).

Replica groups come in every form XLA prints, and `replica_groups` reads each into the device
ids of every group (`group_size` just their size):

- explicit lists ``{{0,2,4,6},{1,3,5,7}}``: what JAX up to 0.10 writes for every collective in
  ``shard_map`` (here ``psum`` over ``'d'`` of a ``('d'=4, 't'=2)`` mesh);
- the iota form ``[2,4]<=[8]`` (2 groups of 4: ``iota(8)`` reshaped ``[2,4]``), with an
  optional transpose ``[2,4]<=[4,2]T(1,0)`` (``iota(8).reshape(4,2).T``, then 2 groups of 4):
  XLA's SPMD partitioner writes it for jit's automatic partitioning;
- the mesh form ``mesh['d'=4,'t'=2] {'d'}``: the devices that share their coordinates on every
  axis but the listed ones, ordered by the listed axes (the first the most major), groups in
  row-major order of the others -- ``{{0,2,4,6},{1,3,5,7}}`` again. JAX from 0.11 writes it
  for every collective in ``shard_map`` (``{'t','d'}`` for ``psum(x, ('t','d'))``); the
  partitioner writes it too (``mesh['axis_0'=4,'axis_1'=2] {'axis_1'}``, since JAX 0.10). A
  listed sub-axis ``'a':(2)2`` is a digit of axis ``a``'s index (radix 2, with sub-axes of
  total size 2 more major than it); the mesh may give its own device order, ``mesh[..],
  device_ids=(0,2,1,3) {..}`` or ``device_ids=([2,4]T(1,0))``;
- ``{}``, or no groups at all: one group of every device of the module (``num_partitions`` x
  ``replica_count`` in its header).

A form none of these is an error: a guessed group size would be silently wrong bytes.
`group_axes` says whether groups are whole mesh axes, and which; `groups_attr` gives the
attribute's text as written (to find or replace it in a module's text).
"""

from __future__ import annotations

import math
import re

import numpy as np

__all__ = ["group_axes", "group_size", "groups_attr", "replica_groups"]

_GROUPS_ATTR = re.compile(r"\breplica_groups=")
_LIST_FORM = re.compile(r"\{((?:\s*\{[0-9,\s]*\}\s*,?)*)\s*\}")
_IOTA_FORM = re.compile(r"\[(\d+),(\d+)\]<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?")
# mesh['a'=4,'b'=2] {'b'}, or with the mesh's own device order: mesh[...], device_ids=(...) {...}
_MESH_FORM = re.compile(
    r"mesh\[([^\]]*)\](?:\s*,\s*device_ids=\(((?:[^()]|\([^()]*\))*)\))?\s*\{([^}]*)\}"
)
_MESH_SIZE = re.compile(r"'([^']+)'\s*=\s*(\d+)")
_MESH_REF = re.compile(r"'([^']+)'(?::\((\d+)\)(\d+))?")  # 'a', or sub-axis 'a':(pre)size
_DEVICE_IOTA = re.compile(r"^(?:\[[0-9,]*\]<=)?\[([0-9,]+)\](?:T\(([0-9,]+)\))?$")


def _ints(text: str) -> list[int]:
    return [int(t) for t in re.findall(r"\d+", text)]


def _iota(total: int, reshape: list[int], perm: list[int] | None) -> np.ndarray:
    """``iota(total)`` reshaped to ``reshape``, transposed by ``perm``, flattened: the device
    order of XLA's iota tile assignments (``[..]<=[reshape]T(perm)``)."""
    if math.prod(reshape) != total:
        raise ValueError(f"replica groups: iota dims {reshape} do not hold {total} devices")
    ids = np.arange(total).reshape(reshape)
    return (ids.transpose(perm) if perm else ids).reshape(-1)


def _mesh_form(sizes_text: str, device_ids: str | None, refs_text: str) -> np.ndarray:
    """The groups (one per row) of the mesh form ``mesh[<sizes>](, device_ids=(..))? {<refs>}``
    (see `_mesh_groups`)."""
    axes = [(name, int(n)) for name, n in _MESH_SIZE.findall(sizes_text)]
    if not axes:
        raise ValueError(f"replica groups: no mesh axes in mesh[{sizes_text}]")
    total = math.prod(n for _, n in axes)
    if device_ids is None or not device_ids.strip():
        devices = np.arange(total)
    elif m := _DEVICE_IOTA.match(device_ids.replace(" ", "")):
        perm = _ints(m.group(2)) if m.group(2) else None
        devices = _iota(total, _ints(m.group(1)), perm)
    else:
        devices = np.array(_ints(device_ids))
        if devices.size != total:
            raise ValueError(
                f"replica groups: device_ids=({device_ids}) is not {total} devices of the mesh"
            )
    refs = [
        (name, (int(pre), int(size)) if size else None)
        for name, pre, size in _MESH_REF.findall(refs_text)
    ]
    return _mesh_groups(axes, devices, refs)


def _mesh_groups(
    axes: list[tuple[str, int]],
    devices: np.ndarray,
    refs: list[tuple[str, tuple[int, int] | None]],
) -> np.ndarray:
    """The groups (one per row) of a mesh (``axes``: names and sizes; ``devices``: the device
    at each position, row-major) along ``refs``, computed as XLA computes them
    (``MeshAxesReplicaGroupList::flattened_replica_groups``).

    A ref is a whole axis (``'a'``: ``(name, None)``) or a sub-axis (``'a':(pre)size``:
    ``(name, (pre, size))``) -- the digit of radix ``size`` and stride ``axis_size / (pre *
    size)`` of the axis index, ``pre`` being the product of the sizes of the sub-axes more
    major than it. A group is the devices that share every coordinate but the grouped ones;
    within a group, devices are ordered by the refs in the order listed, the first the most
    major; the groups are ordered by the remaining coordinates, row-major.
    """
    index = {name: i for i, (name, _) in enumerate(axes)}
    for name, _ in refs:
        if name not in index:
            raise ValueError(f"replica groups: axis {name!r} is not one of the mesh's {axes}")
    # Each mesh axis becomes the dimensions its grouped sub-axes cut it into (major first),
    # with a dimension for each part of it between and around them that is not grouped.
    dims: list[int] = []
    grouped_dim: dict[tuple[str, tuple[int, int] | None], int] = {}
    for name, n in axes:
        whole = any(r == name and sub is None for r, sub in refs)
        subs = sorted(sub for r, sub in refs if r == name and sub is not None)
        if whole:
            if subs:
                raise ValueError(f"replica groups: axis {name!r} and a sub-axis of it")
            grouped_dim[(name, None)] = len(dims)
            dims.append(n)
            continue
        done = 1  # the product of the sizes laid out so far, major first
        for pre, size in subs:
            if pre % done or n % (pre * size):
                raise ValueError(
                    f"replica groups: sub-axis {name!r}:({pre}){size} does not fit size {n}"
                )
            if pre != done:
                dims.append(pre // done)
            grouped_dim[(name, (pre, size))] = len(dims)
            dims.append(size)
            done = pre * size
        if done != n:
            dims.append(n // done)
    grouped = [grouped_dim[ref] for ref in refs]
    order = [k for k in range(len(dims)) if k not in grouped] + grouped
    group = math.prod(dims[k] for k in grouped)
    return devices.reshape(dims).transpose(order).reshape(-1, group)


def _form(attrs: str) -> tuple[str, re.Match[str], int] | None:
    """The form of ``attrs``'s ``replica_groups=`` (``'mesh'``, ``'iota'`` or ``'list'``), its
    match (on the text just after ``replica_groups=``) and where that text starts in
    ``attrs``; None where ``attrs`` names no groups. An unknown form is an error."""
    at = _GROUPS_ATTR.search(attrs)
    if at is None:
        return None
    text = attrs[at.end() :]
    for kind, form in (("mesh", _MESH_FORM), ("iota", _IOTA_FORM), ("list", _LIST_FORM)):
        if m := form.match(text):
            return kind, m, at.end()
    raise ValueError(
        "replica groups in a form this reader does not know (expected {{0,1},{2,3}}, "
        f"[2,4]<=[8], [4,2]<=[2,4]T(1,0) or mesh['a'=4,'b'=2] {{'b'}}): {text[:120]!r}"
    )


def groups_attr(attrs: str) -> str | None:
    """The ``replica_groups=...`` attribute of an instruction's attributes exactly as written,
    in any form XLA prints (see the module docstring); None where there is none."""
    found = _form(attrs)
    if found is None:
        return None
    _, m, start = found
    return attrs[start - len("replica_groups=") : start + m.end()]


def _groups_array(attrs: str, num_devices: int) -> np.ndarray:
    """`replica_groups` as an array of one group per row."""
    found = _form(attrs)
    if found is None:
        return np.arange(num_devices).reshape(1, -1)
    kind, m, _ = found
    if kind == "mesh":
        return _mesh_form(m.group(1), m.group(2), m.group(3))
    if kind == "iota":
        ngroups, size = int(m.group(1)), int(m.group(2))
        perm = _ints(m.group(4)) if m.group(4) else None
        return _iota(ngroups * size, _ints(m.group(3)), perm).reshape(ngroups, size)
    groups = [_ints(g) for g in re.findall(r"\{([0-9,\s]*)\}", m.group(1))]
    if not groups:  # '{}': every device of the module
        return np.arange(num_devices).reshape(1, -1)
    if len({len(g) for g in groups}) != 1:
        raise ValueError(f"replica groups of different sizes: {m.group(0)}")
    return np.array(groups).reshape(len(groups), -1)


def replica_groups(attrs: str, num_devices: int) -> tuple[tuple[int, ...], ...]:
    """The device groups of an instruction's attributes, as XLA orders them (a device's
    position in its group is its rank in the collective), in any form XLA prints (see the
    module docstring); one group of every device where it names none (``{}`` or no
    ``replica_groups=``). An unknown form is an error, not a guess."""
    return tuple(tuple(int(d) for d in g) for g in _groups_array(attrs, num_devices))


def group_size(attrs: str, num_devices: int) -> int:
    """Devices per replica group of an instruction's attributes, in any form XLA prints (see
    the module docstring); ``num_devices`` where it names no group."""
    return int(_groups_array(attrs, num_devices).shape[1])


def group_axes(groups: tuple[tuple[int, ...], ...], mesh: dict[str, int]) -> tuple[str, ...] | None:
    """The axes of ``mesh`` (``{name: size}`` in mesh order, devices numbered row-major) whose
    devices each group gathers -- the groups being the devices that share their coordinates on
    every other axis, ordered by these axes, the first the most major -- or None if
    ``groups`` are not such a grouping (sub-axes, another order, an irregular list).
    ``()`` is a grouping of single devices."""
    names, sizes = list(mesh), list(mesh.values())
    total = math.prod(sizes)
    if sorted(d for g in groups for d in g) != list(range(total)):
        return None  # not every device of the mesh once
    if len({len(g) for g in groups}) != 1:
        return None
    coords = np.array(np.unravel_index(list(groups[0]), sizes)).T  # (members, axes)
    varying = [a for k, a in enumerate(names) if len(set(coords[:, k])) > 1]
    # The order inside a group: the axis whose coordinate changes least often is the major.
    changes = {a: int(np.count_nonzero(np.diff(coords[:, names.index(a)]))) for a in varying}
    axes = tuple(sorted(varying, key=lambda a: changes[a]))
    expected = _mesh_groups(list(mesh.items()), np.arange(total), [(a, None) for a in axes])
    same = sorted(map(tuple, expected.tolist())) == sorted(map(tuple, groups))
    return axes if same else None  # the order of the groups themselves does not matter
