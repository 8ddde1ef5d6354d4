"""shardlib._explain.hlo, the one HLO reader: bytes per dtype, replica groups, ring cost, collectives.

Read on real HLO from the 8-device CPU mesh wherever XLA prints the form: compiled HLO
(``compiled.as_text()``) and HLO before optimisation (``lowered.as_text(dialect="hlo")``, which
keeps float8, bf16 and 4-bit dtypes that the CPU backend widens when it compiles). Forms the CPU
backend does not print (async pairs, ``{}`` groups, sub-axes) are read from hand-written text.
``shardlib.explain`` and the benchmarks' counter must agree, float8 and mesh groups included.

Replica groups in ``shard_map`` are printed as explicit lists up to JAX 0.10 and in the mesh form
from JAX 0.11: the tests on real HLO assert the form the installed JAX prints, and the tests on
literal text (copied from what JAX 0.10.2 and 0.12.0.1 printed) read both whatever is installed.
"""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import shardlib
from benchmarks import _hlo as bench_hlo
from shardlib import shardops
from shardlib._explain import hlo as _hlo
from shardlib.shardtypes import f8_e4m3fn, typed_shard_map
from tests import _explain_hlo_reader as test_reader

# Bytes per element of each dtype family, written out (4-bit types count half a byte).
DTYPES = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2fnuz": 1,
    "float8_e4m3b11fnuz": 1,
    "float8_e4m3": 1,
    "float8_e3m4": 1,
    "float8_e8m0fnu": 1,
    "int8": 1,
    "uint8": 1,
    "int16": 2,
    "int32": 4,
    "uint32": 4,
    "bool": 1,
    "int4": 0.5,
    "uint4": 0.5,
    "float4_e2m1fn": 0.5,
}
# The HLO names of the same types.
HLO_NAMES = {
    "f32": 4, "f16": 2, "bf16": 2, "f64": 8, "c64": 8, "c128": 16, "s8": 1, "u8": 1,
    "s16": 2, "u16": 2, "s32": 4, "u32": 4, "s64": 8, "u64": 8, "pred": 1, "token": 0,
    "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3b11fnuz": 1, "f8e4m3fnuz": 1, "f8e5m2fnuz": 1,
    "f8e4m3": 1, "f8e3m4": 1, "f8e8m0fnu": 1, "s4": 0.5, "u4": 0.5, "f4e2m1fn": 0.5,
    "s2": 0.25, "u2": 0.25,
}  # fmt: skip

MESH_SHAPE = (4, 2)

# JAX up to 0.10 writes the replica groups of shard_map's collectives as explicit lists
# ({{0,2,4,6},{1,3,5,7}}); from 0.11 it writes the mesh form (mesh['d'=4,'t'=2] {'d'}).
SHARD_MAP_MESH_FORM = jax.__version_info__ >= (0, 11)


def _shard_map_form(mesh_names: tuple[str, ...], mesh_shape, axes: tuple[str, ...]) -> str:
    """The replica groups the installed JAX prints for a shard_map collective over ``axes``."""
    if SHARD_MAP_MESH_FORM:
        sizes = ",".join(f"'{a}'={n}" for a, n in zip(mesh_names, mesh_shape, strict=True))
        return f"mesh[{sizes}] {{{','.join(repr(a) for a in axes)}}}"
    groups = _groups_along(mesh_names, mesh_shape, axes)
    return "{" + ",".join("{" + ",".join(map(str, g)) + "}" for g in groups) + "}"


def _groups_along(mesh_names, mesh_shape, axes) -> tuple[tuple[int, ...], ...]:
    """The devices that share their coordinates on every axis but ``axes``, ordered by
    ``axes`` (the first the most major): what a shard_map collective over ``axes`` runs on."""
    ids = np.arange(math.prod(mesh_shape)).reshape(mesh_shape)
    others = [k for k, a in enumerate(mesh_names) if a not in axes]
    order = others + [mesh_names.index(a) for a in axes]
    size = math.prod(mesh_shape[mesh_names.index(a)] for a in axes)
    return tuple(map(tuple, ids.transpose(order).reshape(-1, size).tolist()))


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh(MESH_SHAPE, ("d", "t"), axis_types=(AxisType.Auto,) * 2)


def _available(name: str):
    try:
        return jnp.dtype(name)
    except TypeError:
        return None


# -- bytes ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name, size", sorted(HLO_NAMES.items()))
def test_element_bytes_of_hlo_names(name, size):
    assert _hlo.element_bytes(name) == size


@pytest.mark.parametrize("name, size", sorted(DTYPES.items()))
def test_element_bytes_of_numpy_and_jaxpr_names(name, size):
    assert _hlo.element_bytes(name) == size
    short = name.replace("float", "f").replace("uint", "u").replace("int", "i")
    assert _hlo.element_bytes(short) == size  # as print_saved_residuals writes it


def test_shape_bytes_rounds_packed_arrays_up_and_sums_tuples():
    assert _hlo.shape_bytes("s4[3]{0}") == 2  # 1.5 bytes of packed int4
    assert _hlo.shape_bytes("(f8e4m3fn[4,8]{1,0}, bf16[2])") == 32 + 4
    assert _hlo.shape_bytes("token[]") == 0


def test_unknown_dtype_is_an_error_naming_it():
    with pytest.raises(ValueError, match="element_bytes: unknown dtype 'weird'"):
        _hlo.element_bytes("weird")


def _gather(mesh, dtype, axis="d"):
    def f(x):
        return jax.lax.all_gather(x, axis, tiled=True)

    g = jax.shard_map(f, mesh=mesh, in_specs=P("d", "t"), out_specs=P(), check_vma=False)
    arg = jax.ShapeDtypeStruct((16, 8), dtype, sharding=NamedSharding(mesh, P("d", "t")))
    return jax.jit(g).lower(arg)


@pytest.mark.parametrize("name", sorted(DTYPES))
def test_collective_bytes_on_real_hlo_for_every_dtype(mesh, name):
    dtype = _available(name)
    if dtype is None:
        pytest.skip(f"this JAX has no {name}")
    lowered = _gather(mesh, dtype)
    (c,) = _hlo.collectives(lowered.as_text(dialect="hlo"))[0]
    block = (16 // 4) * (8 // 2)  # one device's elements
    assert c.kind == "all-gather" and c.group == 4
    assert (c.in_bytes, c.out_bytes) == (block * DTYPES[name], 4 * block * DTYPES[name])
    # Compiled: the CPU backend may widen a narrow type (f8 -> f16, bf16 -> f32): the bytes
    # follow the dtype the compiled instruction names.
    (c,) = _hlo.collectives(lowered.compile().as_text())[0]
    printed = re.search(r"= (\w+)\[", c.line)
    assert printed is not None
    assert c.in_bytes == block * _hlo.element_bytes(printed.group(1))
    if name in ("float32", "float16", "int8", "uint8", "int16", "int32", "uint32", "bool"):
        assert c.in_bytes == block * DTYPES[name]  # kept as is


# -- replica groups ---------------------------------------------------------------------------


@pytest.mark.parametrize("axes, size", [("t", 2), ("d", 4), (("d", "t"), 8), (("t", "d"), 8)])
def test_shard_map_groups_on_compiled_hlo(mesh, axes, size):
    g = jax.shard_map(
        lambda x: jax.lax.psum(x, axes), mesh=mesh, in_specs=P("d", "t"), out_specs=P(),
        check_vma=False,
    )  # fmt: skip
    arg = jax.ShapeDtypeStruct((16, 8), jnp.float32, sharding=NamedSharding(mesh, P("d", "t")))
    text = jax.jit(g).lower(arg).compile().as_text()
    (c,) = _hlo.collectives(text)[0]
    named = (axes,) if isinstance(axes, str) else axes
    # Lists up to JAX 0.10 ({{0,2,4,6},{1,3,5,7}} for 'd'), the mesh form from 0.11.
    assert f"replica_groups={_shard_map_form(('d', 't'), MESH_SHAPE, named)}," in c.line
    assert (c.kind, c.group, c.in_bytes) == ("all-reduce", size, 4 * 4 * 4)
    assert c.wire == 2 * c.in_bytes * (size - 1) / size
    assert c.groups == _groups_along(("d", "t"), MESH_SHAPE, named)
    assert _hlo.group_axes(c.groups, {"d": 4, "t": 2}) == named


_COLLECTIVES = {
    "psum": lambda ax, n: lambda x: jax.lax.psum(x, ax),
    "all_gather": lambda ax, n: lambda x: jax.lax.all_gather(x, ax, tiled=True),
    "psum_scatter": lambda ax, n: lambda x: jax.lax.psum_scatter(x, ax, tiled=True),
    "all_to_all": lambda ax, n: lambda x: jax.lax.all_to_all(x, ax, 0, 0, tiled=True),
    "ppermute": lambda ax, n: lambda x: jax.lax.ppermute(x, ax, _ring(n)),
}  # fmt: skip


def _ring(n: int) -> list[tuple[int, int]]:
    return [(i, (i + 1) % n) for i in range(n)]


_KINDS = {
    "psum": "all-reduce",
    "all_gather": "all-gather",
    "psum_scatter": "reduce-scatter",
    "all_to_all": "all-to-all",
    "ppermute": "collective-permute",
}


@pytest.mark.parametrize(
    "shape, names, axes",
    [
        ((4, 2), ("d", "t"), ("d",)),
        ((4, 2), ("d", "t"), ("t",)),
        ((4, 2), ("d", "t"), ("d", "t")),
        ((4, 2), ("d", "t"), ("t", "d")),
        ((2, 2, 2), ("a", "b", "c"), ("b",)),
        ((2, 2, 2), ("a", "b", "c"), ("a", "c")),
        ((2, 2, 2), ("a", "b", "c"), ("c", "a")),
        ((2, 2, 2), ("a", "b", "c"), ("a", "b", "c")),
    ],
)
def test_every_shard_map_collective_reads_its_groups(shape, names, axes):
    """psum, all_gather, psum_scatter, all_to_all and ppermute over one, two and three axes:
    each instruction's groups (or a permute's pairs) are the devices along ``axes``, in the
    form the installed JAX prints, before and after XLA compiles (a tuple all-to-all then)."""
    mesh = jax.make_mesh(shape, names, axis_types=(AxisType.Explicit,) * len(names))
    spec = P(*names)
    arg = jax.ShapeDtypeStruct(tuple(8 * n for n in shape), jnp.float32,
                               sharding=NamedSharding(mesh, spec))  # fmt: skip
    n = math.prod(shape[names.index(a)] for a in axes)
    ax = axes if len(axes) > 1 else axes[0]
    expected = _groups_along(names, shape, axes)
    for op, make in _COLLECTIVES.items():
        if op == "ppermute" and list(axes) != sorted(axes, key=names.index):
            continue  # JAX wants ppermute's axes in mesh order
        g = jax.shard_map(make(ax, n), mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False)
        lowered = jax.jit(g).lower(arg)
        for text in (lowered.as_text(dialect="hlo"), lowered.compile().as_text()):
            (c,) = _hlo.collectives(text)[0]
            assert c.kind == _KINDS[op], c.line
            if op == "ppermute":  # pairs, no groups: each device sends to its next along axes
                assert c.groups == () and c.moving == 1.0 and "source_target_pairs=" in c.line
                continue
            assert f"replica_groups={_shard_map_form(names, shape, axes)}" in c.line
            assert (c.group, c.groups) == (n, expected), c.line
            assert _hlo.group_axes(c.groups, dict(zip(names, shape, strict=True))) == axes
            assert [tuple(g) for g in test_reader._groups(c.line)] == list(expected)


def _auto_partitioned_text(mesh) -> str:
    """The gradient of a matmul under jit's automatic partitioning: XLA's SPMD partitioner
    writes its collectives' groups in the iota and mesh forms."""

    def f(x, w):
        return jnp.sum(jnp.tanh(x @ w) ** 2)

    spec = NamedSharding(mesh, P("d", "t"))
    x = jax.ShapeDtypeStruct((16, 8), jnp.float32, sharding=spec)
    w = jax.ShapeDtypeStruct((8, 32), jnp.float32, sharding=spec)
    return jax.jit(jax.grad(f, argnums=1), out_shardings=spec).lower(x, w).compile().as_text()


@pytest.mark.parametrize("form", ["<=[", "T(", "mesh["])
def test_iota_and_mesh_groups_on_compiled_hlo(mesh, form):
    found = [c for c in _hlo.collectives(_auto_partitioned_text(mesh))[0] if form in c.line]
    if not found:
        pytest.skip(f"this XLA wrote no replica groups in the {form!r} form")
    for c in found:
        assert c.group in (2, 4, 8)
        # The shapes say the group size too: a gather multiplies, a scatter divides by it.
        if c.kind == "all-gather":
            assert c.out_bytes == c.group * c.in_bytes, c.line
        elif c.kind == "reduce-scatter":
            assert c.in_bytes == c.group * c.out_bytes, c.line


@pytest.mark.parametrize(
    "attrs, size",
    [
        ("replica_groups={{0,1},{2,3},{4,5},{6,7}}", 2),
        ("replica_groups={{0,1,2,3,4,5,6,7}}", 8),
        ("replica_groups=[2,4]<=[8]", 4),
        ("replica_groups=[4,2]<=[2,4]T(1,0)", 2),
        ("replica_groups=mesh['a'=4,'b'=2] {'b'}", 2),
        ("replica_groups=mesh['a'=4,'b'=2] {'a','b'}", 8),
        ("replica_groups=mesh['a'=4,'b'=2] {'a':(2)2}", 2),  # a sub-axis of size 2
        ("replica_groups=mesh['a'=4,'b'=2], device_ids=(0,2,4,6,1,3,5,7) {'a'}", 4),
        ("replica_groups={}", 8),  # every device
        ("dimensions={0}", 8),  # no groups: every device
    ],
)
def test_group_size_of_every_form(attrs, size):
    assert _hlo.group_size(attrs, num_devices=8) == size


# The devices of each group, in XLA's order (a device's position is its rank). The mesh forms
# without device_ids were checked on XLA:CPU (JAX 0.12.0.1): an all-gather of each device's id
# under these groups returns exactly these lists. XLA:CPU drops a mesh's device_ids on the way
# through StableHLO, so those follow XLA's MeshAxesReplicaGroupList::flattened_replica_groups.
GROUPS = [
    ("{{0,2,4,6},{1,3,5,7}}", ((0, 2, 4, 6), (1, 3, 5, 7))),
    ("{{0,1}, {2,3}}", ((0, 1), (2, 3))),
    ("{}", ((0, 1, 2, 3, 4, 5, 6, 7),)),
    ("[2,4]<=[8]", ((0, 1, 2, 3), (4, 5, 6, 7))),
    ("[4,2]<=[2,4]T(1,0)", ((0, 4), (1, 5), (2, 6), (3, 7))),
    ("[2,4]<=[4,2]T(1,0)", ((0, 2, 4, 6), (1, 3, 5, 7))),
    ("[2,4]<=[2,2,2]T(2,1,0)", ((0, 4, 2, 6), (1, 5, 3, 7))),
    ("mesh['d'=4,'t'=2] {'d'}", ((0, 2, 4, 6), (1, 3, 5, 7))),
    ("mesh['d'=4,'t'=2] {'t'}", ((0, 1), (2, 3), (4, 5), (6, 7))),
    ("mesh['d'=4,'t'=2] {'d','t'}", ((0, 1, 2, 3, 4, 5, 6, 7),)),
    ("mesh['d'=4,'t'=2] {'t','d'}", ((0, 2, 4, 6, 1, 3, 5, 7),)),  # 't' major
    ("mesh['a'=2,'b'=2,'c'=2] {'c','a'}", ((0, 4, 1, 5), (2, 6, 3, 7))),
    ("mesh['axis_0'=2,'axis_1'=4,'axis_2'=1] {'axis_1'}", ((0, 1, 2, 3), (4, 5, 6, 7))),
    # Sub-axes 'a':(pre)size: the digit of radix size below sub-axes of total size pre.
    ("mesh['a'=8] {'a':(1)2}", ((0, 4), (1, 5), (2, 6), (3, 7))),
    ("mesh['a'=8] {'a':(2)2}", ((0, 2), (1, 3), (4, 6), (5, 7))),
    ("mesh['a'=8] {'a':(4)2}", ((0, 1), (2, 3), (4, 5), (6, 7))),
    ("mesh['a'=8] {'a':(1)4}", ((0, 2, 4, 6), (1, 3, 5, 7))),
    ("mesh['a'=8] {'a':(2)4}", ((0, 1, 2, 3), (4, 5, 6, 7))),
    ("mesh['a'=8] {'a':(1)2,'a':(4)2}", ((0, 1, 4, 5), (2, 3, 6, 7))),
    ("mesh['a'=8] {'a':(4)2,'a':(1)2}", ((0, 4, 1, 5), (2, 6, 3, 7))),
    ("mesh['a'=4,'b'=2] {'a':(2)2,'b'}", ((0, 1, 2, 3), (4, 5, 6, 7))),
    ("mesh['a'=4,'b'=2] {'b','a':(1)2}", ((0, 4, 1, 5), (2, 6, 3, 7))),
    ("mesh['a'=2,'b'=1,'c'=4] {'c':(2)2,'a'}", ((0, 4, 1, 5), (2, 6, 3, 7))),
    # A mesh with its own device order: positions on the mesh hold these device ids.
    ("mesh['a'=4,'b'=2], device_ids=(0,2,4,6,1,3,5,7) {'a'}", ((0, 4, 1, 5), (2, 6, 3, 7))),
    ("mesh['a'=4,'b'=2], device_ids=([2,4]T(1,0)) {'a'}", ((0, 1, 2, 3), (4, 5, 6, 7))),
    ("mesh['a'=4,'b'=2], device_ids=(7,6,5,4,3,2,1,0) {'b','a'}", ((7, 5, 3, 1, 6, 4, 2, 0),)),
]


@pytest.mark.parametrize("form, groups", GROUPS)
def test_replica_groups_of_every_form(form, groups):
    attrs = f"channel_id=1, replica_groups={form}, dimensions={{0}}, use_global_device_ids=true"
    assert _hlo.replica_groups(attrs, num_devices=8) == groups
    assert _hlo.group_size(attrs, num_devices=8) == len(groups[0])
    assert _hlo.groups_attr(attrs) == f"replica_groups={form}"  # as written, and no more
    if form != "{}":  # the differential test's own reader (no code shared) reads the same
        assert [tuple(g) for g in test_reader._groups(attrs)] == list(groups)


@pytest.mark.parametrize(
    "attrs",
    [
        "replica_groups=mesh['a'=4] {'b'}",  # no such axis
        "replica_groups=mesh['a'=4] {'a','a':(2)2}",  # an axis and a part of it
        "replica_groups=mesh['a'=4,'b'=2], device_ids=(0,1,2) {'a'}",  # not every device
        "replica_groups={{0,1},{2}}",  # groups of different sizes
        "replica_groups=<some future form>",
    ],
)
def test_a_form_the_reader_cannot_read_is_an_error_not_a_guess(attrs):
    with pytest.raises(ValueError, match="replica groups"):
        _hlo.group_size(attrs, num_devices=8)
    if attrs.endswith("future form>"):
        with pytest.raises(ValueError, match="replica groups"):
            _hlo.groups_attr(attrs)


def test_groups_attr_is_none_without_groups():
    assert _hlo.groups_attr("channel_id=1, dimensions={0}") is None


def test_group_axes_names_whole_mesh_axes_only():
    mesh = {"a": 2, "b": 2, "c": 2}
    assert _hlo.group_axes(((0, 4, 1, 5), (2, 6, 3, 7)), mesh) == ("c", "a")
    assert _hlo.group_axes(((2, 6, 3, 7), (0, 4, 1, 5)), mesh) == ("c", "a")  # any group order
    assert _hlo.group_axes(((0, 1, 4, 5), (2, 3, 6, 7)), mesh) == ("a", "c")
    assert _hlo.group_axes(tuple((d,) for d in range(8)), mesh) == ()
    assert _hlo.group_axes(((0, 1, 2, 3, 4, 5, 6, 7),), {"d": 4, "t": 2}) == ("d", "t")
    assert _hlo.group_axes(((0, 3), (1, 2), (4, 7), (5, 6)), mesh) is None  # not along axes
    assert _hlo.group_axes(((0, 1), (2, 3)), mesh) is None  # not every device
    # A sub-axis of a (4,) mesh is no whole axis; as a whole axis of a (2, 2) mesh it is.
    sub = _hlo.replica_groups("replica_groups=mesh['a'=4] {'a':(1)2}", 4)
    assert _hlo.group_axes(sub, {"a": 4}) is None
    assert _hlo.group_axes(sub, {"a0": 2, "a1": 2}) == ("a0",)


# One instruction of each form, copied from what JAX printed for a shard_map collective or
# jit's automatic partitioning (metadata dropped), with the operand's shape, the groups and the
# whole mesh axes they are on. Meshes: (4, 2) ('d', 't') and (2, 2, 2) ('a', 'b', 'c') for
# shard_map; (4, 2) and (2, 4) for the partitioner, which names its axes 'axis_0', ...
_G_D = ((0, 2, 4, 6), (1, 3, 5, 7))
_G_T = ((0, 1), (2, 3), (4, 5), (6, 7))
_G_TD = ((0, 2, 4, 6, 1, 3, 5, 7),)
_G_AC = ((0, 1, 4, 5), (2, 3, 6, 7))
_G_BA = ((0, 4, 2, 6), (1, 5, 3, 7))
_DT, _ABC = {"d": 4, "t": 2}, {"a": 2, "b": 2, "c": 2}
LITERAL = [
    # -- JAX 0.10.2 (jaxlib 0.10.2): shard_map writes explicit lists.
    ("0.10.2", "f32[8,8]", "ROOT %psum.7 = f32[8,8]{1,0} all-reduce(%param.1), channel_id=1, replica_groups={{0,2,4,6},{1,3,5,7}}, use_global_device_ids=true, to_apply=%region_0.0", _G_D, _DT, ("d",)),
    ("0.10.2", "f32[8,8]", "ROOT %all_gather.3 = f32[16,8]{1,0} all-gather(%param.1), channel_id=1, replica_groups={{0,1},{2,3},{4,5},{6,7}}, dimensions={0}, use_global_device_ids=true", _G_T, _DT, ("t",)),
    ("0.10.2", "f32[8,8]", "ROOT %reduce_scatter.7 = f32[1,8]{1,0} reduce-scatter(%param.1), channel_id=1, replica_groups={{0,2,4,6,1,3,5,7}}, use_global_device_ids=true, dimensions={0}, to_apply=%region_0.0", _G_TD, _DT, ("t", "d")),
    ("0.10.2", "f32[8,8]", "ROOT all_to_all.1 = f32[8,8]{1,0} all-to-all(shard_map.2), channel_id=1, replica_groups={{0,2,4,6},{1,3,5,7}}, dimensions={0}", _G_D, _DT, ("d",)),
    ("0.10.2", "f32[8,8]", "%all-to-all = (f32[4,8]{1,0}, f32[4,8]{1,0}) all-to-all(%wrapped_slice, %wrapped_slice), channel_id=1, replica_groups={{0,1},{2,3},{4,5},{6,7}}", _G_T, _DT, ("t",)),
    ("0.10.2", "f32[8,8,8]", "ROOT %psum.7 = f32[8,8,8]{2,1,0} all-reduce(%param.1), channel_id=1, replica_groups={{0,1,4,5},{2,3,6,7}}, use_global_device_ids=true, to_apply=%region_0.0", _G_AC, _ABC, ("a", "c")),
    ("0.10.2", "f32[8,8,8]", "ROOT %all_gather.3 = f32[32,8,8]{2,1,0} all-gather(%param.1), channel_id=1, replica_groups={{0,4,2,6},{1,5,3,7}}, dimensions={0}, use_global_device_ids=true", _G_BA, _ABC, ("b", "a")),
    # -- JAX 0.10.2, jit's automatic partitioning: the iota and mesh forms.
    ("0.10.2", "f32[4,8]", "%all-reduce = f32[16,8]{1,0} all-reduce(%dot.1), channel_id=3, replica_groups=[2,4]<=[4,2]T(1,0), use_global_device_ids=true, to_apply=%add.clone", _G_D, _DT, ("d",)),
    ("0.10.2", "f32[4,4]", "%all-gather = f32[4,8]{0,1} all-gather(%wrapped_copy), channel_id=1, replica_groups=mesh['axis_0'=4,'axis_1'=2] {'axis_1'}, dimensions={1}, use_global_device_ids=true", _G_T, _DT, ("t",)),
    ("0.10.2", "f32[1,1,8]", "%all-gather = f32[1,4,8]{2,0,1} all-gather(%bitcast), channel_id=1, replica_groups=mesh['axis_0'=2,'axis_1'=4,'axis_2'=1] {'axis_1'}, dimensions={1}, use_global_device_ids=true", ((0, 1, 2, 3), (4, 5, 6, 7)), {"p": 2, "q": 4}, ("q",)),
    # -- JAX 0.12.0.1 (jaxlib 0.12.0.1): shard_map writes the mesh form.
    ("0.12.0.1", "f32[8,8]", "ROOT %psum.7 = f32[8,8]{1,0} all-reduce(%param.1), channel_id=1, replica_groups=mesh['d'=4,'t'=2] {'d'}, use_global_device_ids=true, to_apply=%region_0.0", _G_D, _DT, ("d",)),
    ("0.12.0.1", "f32[8,8]", "ROOT %all_gather.3 = f32[16,8]{1,0} all-gather(%param.1), channel_id=1, replica_groups=mesh['d'=4,'t'=2] {'t'}, dimensions={0}, use_global_device_ids=true", _G_T, _DT, ("t",)),
    ("0.12.0.1", "f32[8,8]", "ROOT %reduce_scatter.7 = f32[1,8]{1,0} reduce-scatter(%param.1), channel_id=1, replica_groups=mesh['d'=4,'t'=2] {'t','d'}, use_global_device_ids=true, dimensions={0}, to_apply=%region_0.0", _G_TD, _DT, ("t", "d")),
    ("0.12.0.1", "f32[8,8]", "ROOT all_to_all.1 = f32[8,8]{1,0} all-to-all(shard_map.2), channel_id=1, replica_groups=mesh['d'=4,'t'=2] {'d'}, dimensions={0}", _G_D, _DT, ("d",)),
    ("0.12.0.1", "f32[8,8]", "%all-to-all = (f32[4,8]{1,0}, f32[4,8]{1,0}) all-to-all(%wrapped_slice, %wrapped_slice), channel_id=1, replica_groups=mesh['d'=4,'t'=2] {'t'}", _G_T, _DT, ("t",)),
    ("0.12.0.1", "f32[8,8,8]", "ROOT %psum.7 = f32[8,8,8]{2,1,0} all-reduce(%param.1), channel_id=1, replica_groups=mesh['a'=2,'b'=2,'c'=2] {'a','c'}, use_global_device_ids=true, to_apply=%region_0.0", _G_AC, _ABC, ("a", "c")),
    ("0.12.0.1", "f32[8,8,8]", "ROOT %all_gather.3 = f32[32,8,8]{2,1,0} all-gather(%param.1), channel_id=1, replica_groups=mesh['a'=2,'b'=2,'c'=2] {'b','a'}, dimensions={0}, use_global_device_ids=true", _G_BA, _ABC, ("b", "a")),
    # -- JAX 0.12.0.1, jit's automatic partitioning: the iota and mesh forms.
    ("0.12.0.1", "f32[4,8]", "%all-reduce = f32[16,8]{1,0} all-reduce(%dot.1), channel_id=3, replica_groups=[2,4]<=[4,2]T(1,0), use_global_device_ids=true, to_apply=%add.clone, frontend_attributes={is_spmd_generated=\"true\"}", _G_D, _DT, ("d",)),
    ("0.12.0.1", "f32[4,4]", "%all-gather = f32[4,8]{0,1} all-gather(%wrapped_copy), channel_id=1, replica_groups=mesh['axis_0'=4,'axis_1'=2] {'axis_1'}, dimensions={1}, use_global_device_ids=true, frontend_attributes={is_spmd_generated=\"true\"}", _G_T, _DT, ("t",)),
    ("0.12.0.1", "f32[4,8]", "ROOT %all-reduce = f32[4,8]{1,0} all-reduce(%select_dynamic-update-slice_fusion), channel_id=3, replica_groups=mesh['a'=8] {'a'}, use_global_device_ids=true, to_apply=%add.clone, frontend_attributes={is_spmd_generated=\"true\"}", (tuple(range(8)),), {"a": 8}, ("a",)),
]  # fmt: skip


def _module_around(operand_shape: str, line: str) -> str:
    """An HLO module of 8 devices whose one operand (of ``operand_shape``) feeds ``line``."""
    operand = re.search(r"\w[\w-]*\(%?([\w.\-]+)", line.split("=", 1)[1])
    assert operand is not None
    return (
        "HloModule m, num_partitions=8\n\nENTRY %main {\n"
        f"  %{operand.group(1)} = {operand_shape} parameter(0)\n  {line}\n}}\n"
    )


@pytest.mark.parametrize("version, operand, line, groups, mesh_axes, axes", LITERAL)
def test_literal_hlo_of_each_jax_version(version, operand, line, groups, mesh_axes, axes):
    """Whatever JAX is installed, the text either version prints reads the same way."""
    (c,) = _hlo.collectives(_module_around(operand, line))[0]
    assert (c.group, c.groups) == (len(groups[0]), groups), version
    assert _hlo.group_axes(c.groups, mesh_axes) == axes
    assert [tuple(g) for g in test_reader._groups(line)] == list(groups)
    if c.kind == "all-gather":  # the shapes say the group size too
        assert c.out_bytes == c.group * c.in_bytes
    elif c.kind == "reduce-scatter":
        assert c.in_bytes == c.group * c.out_bytes
    elif c.kind == "all-to-all" and "dimensions=" not in line:  # tuple: a block per device
        assert len(c.operand_bytes) == c.group and c.parts == (c.in_bytes,)


def test_literal_permute_pairs_of_both_versions():
    # JAX 0.10.2 and 0.12.0.1 print a shard_map ppermute the same: pairs, no groups.
    line = "ROOT %ppermute.3 = f32[8,8]{1,0} collective-permute(%param.1), channel_id=1, source_target_pairs={{0,2},{2,4},{4,6},{6,0},{1,3},{3,5},{5,7},{7,1}}"  # fmt: skip
    (c,) = _hlo.collectives(_module_around("f32[8,8]", line))[0]
    assert (c.kind, c.groups, c.moving, c.wire) == ("collective-permute", (), 1.0, 256)


_ASYNC = """\
HloModule m, is_scheduled=true, num_partitions=8

ENTRY %main (x: f8e5m2[4,8]) -> f8e5m2[4,8] {
  %x = f8e5m2[4,8]{1,0} parameter(0)
  %ags = (f8e5m2[4,8]{1,0}, f8e5m2[32,8]{1,0}) all-gather-start(f8e5m2[4,8]{1,0} %x), channel_id=1, replica_groups={}, dimensions={0}
  %agd = f8e5m2[32,8]{1,0} all-gather-done(%ags)
  %ars = f8e5m2[32,8]{1,0} all-reduce-start(%agd), channel_id=2, replica_groups=[4,2]<=[8], to_apply=%add
  %ard = f8e5m2[32,8]{1,0} all-reduce-done(%ars)
  %cps = (f8e5m2[4,8]{1,0}, f8e5m2[4,8]{1,0}, u32[], u32[]) collective-permute-start(%x), channel_id=3, source_target_pairs={{0,1},{1,0},{2,2},{3,3}}
  %cpd = f8e5m2[4,8]{1,0} collective-permute-done(%cps)
  %a2a = (f8e5m2[2,8]{1,0}, f8e5m2[2,8]{1,0}) all-to-all(%x, %x), channel_id=4, replica_groups=mesh['d'=4,'t'=2] {'t'}
  ROOT %rs = f8e5m2[4,8]{1,0} reduce-scatter(%ard), channel_id=5, replica_groups=mesh['d'=4,'t'=2] {'d','t'}, dimensions={0}, to_apply=%add
}
"""


def test_async_pairs_count_once_with_the_done_result():
    found, unknown = _hlo.collectives(_ASYNC)  # num_partitions=8 in the header
    assert unknown == 0
    got = {c.kind: (c.in_bytes, c.out_bytes, c.group) for c in found}
    assert got == {
        "all-gather": (32, 256, 8),  # '{}' is every device of the module
        "all-reduce": (256, 256, 2),
        "collective-permute": (32, 32, 8),
        "all-to-all": (64, 32, 2),  # a tuple all-to-all: one block per device of its group
        "reduce-scatter": (256, 32, 8),
    }
    by_kind = {c.kind: c for c in found}
    assert by_kind["all-to-all"].operand_bytes == (32, 32)
    assert by_kind["all-to-all"].parts == (64,)  # one all-to-all, not two combined
    assert all(c.parts == c.operand_bytes for c in found if c.kind != "all-to-all")
    # Two of four pairs leave their device: the busiest device sends its one block.
    assert by_kind["collective-permute"].wire == 32
    assert by_kind["all-gather"].wire == 256 * 7 / 8
    assert by_kind["all-reduce"].wire == 2 * 256 * 1 / 2
    assert by_kind["reduce-scatter"].wire == 256 * 7 / 8


_TUPLES = """\
HloModule m, num_partitions=4

ENTRY %main (a: f32[2], b: f32[3]) -> f32[2] {
  %a = f32[2]{0} parameter(0)
  %b = f32[3]{0} parameter(1)
  %ar = (f32[2]{0}, f32[3]{0}, f32[2]{0}, f32[3]{0}, f32[2]{0}, /*index=5*/f32[3]{0}) all-reduce(%a, %b, %a, %b, %a, /*index=5*/%b), channel_id=1, replica_groups={{0,1},{2,3}}, to_apply=%add
  %t4 = (f32[2]{0}, f32[2]{0}, f32[2]{0}, f32[2]{0}) all-to-all(%a, %a, %a, %a), channel_id=2, replica_groups={{0,1,2,3}}
  %t2x2 = (f32[2]{0}, f32[2]{0}, f32[3]{0}, f32[3]{0}) all-to-all(%a, %a, %b, %b), channel_id=3, replica_groups={{0,1},{2,3}}
  ROOT %arr = f32[2]{0} all-to-all(%a), channel_id=4, replica_groups={{0,1}, {2,3}}, dimensions={0}
}
"""


def test_parts_split_combined_instructions_but_not_a_tuple_all_to_all():
    found, _ = _hlo.collectives(_TUPLES)
    parts = {c.line.removeprefix("ROOT ").split()[0]: (c.group, c.parts) for c in found}
    assert parts == {
        "%ar": (2, (8, 12, 8, 12, 8, 12)),  # six all-reduces, '/*index=5*/' read past
        "%t4": (4, (32,)),  # one all-to-all: a block for each of 4 devices
        "%t2x2": (2, (16, 24)),  # group 2: two all-to-alls of two blocks each
        "%arr": (2, (8,)),  # an array all-to-all (split dimension): one operand
    }


def test_instructions_read_both_printers(mesh):
    lowered = _gather(mesh, jnp.float32)
    for text in (lowered.as_text(dialect="hlo"), lowered.compile().as_text()):
        ops = [op for _, op in _hlo.instructions(text)]
        assert ops.count("all-gather") == 1 and "parameter" in ops
        module = _hlo.parse_module(text)
        assert module.entry in module.computations


@pytest.mark.parametrize(
    "kind, expected",
    [
        ("all-gather", 64 * 3 / 4),
        ("reduce-scatter", 100 * 3 / 4),
        ("all-to-all", 100 * 3 / 4),
        ("all-reduce", 2 * 100 * 3 / 4),
        ("collective-permute", 100 * 0.5),
        ("collective-broadcast", 100),
    ],
)
def test_ring_bytes(kind, expected):
    assert _hlo.ring_bytes(kind, 100, 64, 4, moving=0.5) == expected


# -- explain and the benchmarks count the same bytes -----------------------------------------


def _agree(report, text):
    """explain's collectives and the benchmark counter's, on the same HLO text."""
    found, _ = bench_hlo.collectives(text)
    assert report.compare_hlo(text).identical, str(report.compare_hlo(text))
    traffic = bench_hlo.collective_traffic(text)
    assert len(found) == len(report.collectives)
    for ours, theirs in zip(report.collectives, found, strict=True):
        assert (ours.kind, ours.group, ours.operand_bytes) == (
            theirs.kind,
            theirs.group,
            theirs.in_bytes,
        )
        assert ours.sent_bytes == math.ceil(theirs.wire)  # never truncated
    assert traffic["total"]["wire_bytes_per_step"] == round(sum(c.wire for c in found))


def test_explain_and_benchmarks_agree_on_a_float8_all_gather(mesh):
    @typed_shard_map(check_vma=False)  # JAX types an all_gather result as still varying
    def f(x: f8_e4m3fn[b"B/d M/t"]) -> f8_e4m3fn[b"B M/t"]:
        return shardops.all_gather("B/d M/t -> B M/t", x)

    x = jax.ShapeDtypeStruct((16, 8), jnp.float8_e4m3fn, sharding=NamedSharding(mesh, P("d", "t")))
    with jax.set_mesh(mesh):
        report = shardlib.explain(f, x)
        text = jax.jit(f).lower(x).as_text(dialect="hlo")  # keeps f8 (CPU widens it)
    (c,) = report.collectives
    assert c.dtype == "float8_e4m3fn" and c.operand_bytes == 4 * 4 * 1  # 1 byte, not 4
    assert c.sent_bytes == 16 * 3
    assert "f8e4m3fn" in text
    _agree(report, text)


def test_explain_and_benchmarks_agree_on_a_tuple_all_to_all():
    @typed_shard_map
    def f(x: shardlib.shardtypes.f32[b"B/d L"]) -> shardlib.shardtypes.f32[b"B L/d"]:
        return shardops.all_to_all("B/d L -> B L/d", x)

    with jax.set_mesh(jax.make_mesh((8,), ("d",))):
        report = shardlib.explain(f, jnp.ones((16, 16)))
        text = jax.jit(f).lower(jnp.ones((16, 16))).compile().as_text()
    assert "/*index=5*/%" in text  # eight operands, one block of 2x2 floats per device
    (c,) = report.collectives
    assert c.operand_bytes == 2 * 16 * 4 and c.sent_bytes == 128 * 7 // 8
    _agree(report, text)


def test_explain_and_benchmarks_agree_on_a_mesh_group(mesh):
    @typed_shard_map(check_vma=False)  # JAX types an all_gather result as still varying
    def f(x: shardlib.shardtypes.f32[b"B/d M/t"]) -> shardlib.shardtypes.f32[b"B/d M"]:
        return shardops.all_gather("B/d M/t -> B/d M", x)

    x = jax.ShapeDtypeStruct((16, 8), jnp.float32, sharding=NamedSharding(mesh, P("d", "t")))
    with jax.set_mesh(mesh):
        report = shardlib.explain(f, x)
        text = jax.jit(f).lower(x).compile().as_text()
    # JAX writes shard_map's groups as lists up to 0.10 and in the mesh form from 0.11; every
    # form of the same groups (devices along 't') must read the same.
    forms = [
        "replica_groups={{0,1},{2,3},{4,5},{6,7}}",
        "replica_groups=mesh['d'=4,'t'=2] {'t'}",
        "replica_groups=[4,2]<=[8]",
        "replica_groups=[4,2]<=[4,2]T(0,1)",
    ]
    printed = forms[1] if SHARD_MAP_MESH_FORM else forms[0]
    assert printed in text
    for form in forms:
        _agree(report, text.replace(printed, form))
