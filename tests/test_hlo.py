"""shardlib._explain.hlo, the one HLO reader: bytes per dtype, replica groups, ring cost, collectives.

Read on real HLO from the 8-device CPU mesh wherever XLA prints the form: compiled HLO
(``compiled.as_text()``) and HLO before optimisation (``lowered.as_text(dialect="hlo")``, which
keeps float8, bf16 and 4-bit dtypes that the CPU backend widens when it compiles). Forms the CPU
backend does not print (async pairs, ``{}`` groups, sub-axes) are read from hand-written text.
``shardlib.explain`` and the benchmarks' counter must agree, float8 and mesh groups included.
"""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import shardlib
from benchmarks import _hlo as bench_hlo
from shardlib import shardops
from shardlib._explain import hlo as _hlo
from shardlib.shardtypes import f8_e4m3fn, typed_shard_map

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
def test_explicit_list_groups_on_compiled_hlo(mesh, axes, size):
    g = jax.shard_map(
        lambda x: jax.lax.psum(x, axes), mesh=mesh, in_specs=P("d", "t"), out_specs=P(),
        check_vma=False,
    )  # fmt: skip
    arg = jax.ShapeDtypeStruct((16, 8), jnp.float32, sharding=NamedSharding(mesh, P("d", "t")))
    text = jax.jit(g).lower(arg).compile().as_text()
    (c,) = _hlo.collectives(text)[0]
    assert "replica_groups={{" in c.line
    assert (c.kind, c.group, c.in_bytes) == ("all-reduce", size, 4 * 4 * 4)
    assert c.wire == 2 * c.in_bytes * (size - 1) / size


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
        ("replica_groups={}", 8),  # every device
        ("dimensions={0}", 8),  # no groups: every device
    ],
)
def test_group_size_of_every_form(attrs, size):
    assert _hlo.group_size(attrs, num_devices=8) == size


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
    # The CPU backend writes shard_map's groups as lists; the partitioner's mesh form of the
    # same groups (devices along 't') must read the same.
    listed = "replica_groups={{0,1},{2,3},{4,5},{6,7}}"
    assert listed in text
    _agree(report, text)
    _agree(report, text.replace(listed, "replica_groups=mesh['d'=4,'t'=2] {'t'}"))
    _agree(report, text.replace(listed, "replica_groups=[4,2]<=[8]"))
