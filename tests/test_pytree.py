"""Pytree dataclasses, stacked types, specs and shardings derived from annotations."""

import dataclasses
import inspect
import typing
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from jax.tree_util import GetAttrKey
from typeguard import TypeCheckError, typechecked

from shardlib._check.pytree import FieldKey, keypath_str
from shardlib.shardtypes import (
    Array,
    SpecError,
    bf16,
    f32,
    i32,
    is_fully_sharded,
    make_partition_specs,
    make_shardings,
    pytree_dataclass,
    register_with_typeguard,
)
from tests._mesh_util import MESHES, make_mesh

register_with_typeguard()


@pytree_dataclass
class Layer:
    w: f32[b"d_in d_out/d"]
    b: f32[b"d_out/d"]


@pytree_dataclass
class Model:
    emb: bf16[b"vocab/d d_in"]
    layers: Array[b"layers", Layer]
    head: Layer


def _model(L=3, vocab=16, d_in=8, d_out=8, dtype=np.float32):
    r = np.random.default_rng(0)
    return Model(
        emb=jnp.asarray(r.standard_normal((vocab, d_in)), jnp.bfloat16),
        layers=Layer(
            w=jnp.asarray(r.standard_normal((L, d_in, d_out)), dtype),
            b=jnp.asarray(r.standard_normal((L, d_out)), dtype),
        ),
        head=Layer(
            w=jnp.asarray(r.standard_normal((d_in, d_out)), dtype),
            b=jnp.asarray(r.standard_normal(d_out), dtype),
        ),
    )


# ------------------------------------------------------------------ pytree_dataclass


def _keystrs(tree, **kw) -> list[str]:
    return [jax.tree_util.keystr(p, **kw) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def test_keys_are_field_names():
    m = _model()
    # seqax's keys: the bare field names, so keystr joins them with nothing in between.
    assert _keystrs(m) == ["emb", "layersw", "layersb", "headw", "headb"]
    assert _keystrs(m, simple=True, separator="/") == [
        "emb",
        "layers/w",
        "layers/b",
        "head/w",
        "head/b",
    ]
    path = jax.tree_util.tree_flatten_with_path(m)[0][1][0]
    assert path == (GetAttrKey("layers"), GetAttrKey("w"))  # attribute keys, as orbax needs
    assert [type(k) for k in path] == [FieldKey, FieldKey]
    assert repr(path[0]) == "FieldKey(name='layers')"
    leaves = jax.tree.leaves(m)
    assert [x.shape for x in leaves] == [(16, 8), (3, 8, 8), (3, 8), (8, 8), (8,)]


def test_keypath_str_dotted_for_either_key_style():
    m = _model()
    tree = {"m": m, "attr": [AttrKeyed(inner=m.head, c=jnp.zeros(()))]}
    got = [keypath_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
    assert got[:2] == ["['attr'][0].inner.w", "['attr'][0].inner.b"]
    assert got[3:] == [
        "['m'].emb",
        "['m'].layers.w",
        "['m'].layers.b",
        "['m'].head.w",
        "['m'].head.b",
    ]
    assert [keypath_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(m)[0]] == [
        "emb",
        "layers.w",
        "layers.b",
        "head.w",
        "head.b",
    ]


@pytree_dataclass(keys="attr")
class AttrKeyed:
    inner: Layer
    c: f32[b""]


def test_attr_keys_opt_in():
    t = AttrKeyed(inner=Layer(w=jnp.zeros((2, 2)), b=jnp.zeros(2)), c=jnp.zeros(()))
    # The opted-in class prints '.name'; the nested Layer keeps the default (bare) keys.
    assert _keystrs(t) == [".innerw", ".innerb", ".c"]
    assert type(jax.tree_util.tree_flatten_with_path(t)[0][2][0][0]) is GetAttrKey
    with pytest.raises(ValueError, match=r"pytree_dataclass\(keys=\.\.\.\) takes 'name'"):
        pytree_dataclass(keys="dotted")  # type: ignore[call-overload]


def test_mutable_by_default_and_a_dataclass():
    m = _model()
    assert dataclasses.is_dataclass(m)
    assert [f.name for f in dataclasses.fields(Model)] == ["emb", "layers", "head"]
    new_emb = jnp.zeros((2, 2), jnp.bfloat16)
    m.emb = new_emb  # as in seqax: fields can be assigned to
    assert m.emb is new_emb
    assert jax.tree.leaves(m)[0] is new_emb
    m2 = dataclasses.replace(m, emb=jnp.ones((3, 3), jnp.bfloat16))
    assert m2.emb.shape == (3, 3) and m.emb.shape == (2, 2)


@pytree_dataclass(frozen=True)
class FrozenLayer:
    w: f32[b"d_in d_out/d"]


def test_frozen_opt_in():
    layer = FrozenLayer(w=jnp.zeros((2, 2)))
    with pytest.raises(dataclasses.FrozenInstanceError):
        layer.w = jnp.ones((2, 2))  # type: ignore[misc]
    assert jax.tree.map(lambda x: x + 1, layer).w[0, 0] == 1  # unflattening bypasses __init__
    assert make_partition_specs(FrozenLayer) == FrozenLayer(w=P(None, "d"))
    # A stacked frozen type is frozen too.
    stack = Array[b"layers", FrozenLayer](w=jnp.zeros((3, 2, 2)))
    with pytest.raises(dataclasses.FrozenInstanceError):
        stack.w = jnp.ones((3, 2, 2))  # type: ignore[misc]


def test_pytree_dataclass_argument_errors():
    with pytest.raises(TypeError, match=r"pytree_dataclass\(cls\) decorates a class, got 3"):
        pytree_dataclass(3)  # type: ignore[call-overload]
    with pytest.raises(TypeError, match=r"frozen=\.\.\.\) takes True or False, got frozen=1"):
        pytree_dataclass(frozen=1)  # type: ignore[call-overload]


def test_tree_map_jit_and_grad():
    m = _model()
    doubled = jax.tree.map(lambda x: x * 2, m)
    assert isinstance(doubled, Model) and isinstance(doubled.layers, Layer)
    np.testing.assert_array_equal(np.asarray(doubled.head.w), 2 * np.asarray(m.head.w))

    def loss(m: Model, x):
        h = x @ m.head.w + m.head.b
        for i in range(m.layers.w.shape[0]):
            h = h @ m.layers.w[i] + m.layers.b[i]
        return (h**2).sum() + m.emb.astype(jnp.float32).sum()

    x = jnp.ones((2, 8))
    np.testing.assert_allclose(float(jax.jit(loss)(m, x)), float(loss(m, x)), rtol=1e-5)
    g = jax.jit(jax.grad(loss))(m, x)
    assert isinstance(g, Model)
    assert jax.tree.map(jnp.shape, g) == jax.tree.map(jnp.shape, m)
    # d/d emb of emb.sum() is 1 everywhere; d/d head.b against a finite difference
    np.testing.assert_array_equal(np.asarray(g.emb, np.float32), np.ones((16, 8)))
    eps = 1e-2
    bumped = dataclasses.replace(m, head=dataclasses.replace(m.head, b=m.head.b.at[0].add(eps)))
    fd = (loss(bumped, x) - loss(m, x)) / eps
    np.testing.assert_allclose(float(g.head.b[0]), float(fd), rtol=2e-2)


def test_array_of_array_type_is_the_flat_type():
    assert Array["layers", f32["a b"]] is f32[b"layers a b"]
    assert Array[b"layers", f32[b"a b/d"]] is f32[b"layers a b/d"]
    assert Array[b"l", Array[b"k", f32[b"a"]]] is f32[b"l k a"]
    assert Array[b"l", Array[b"k", Layer]] is Array[b"l k", Layer]
    assert repr(Array[b"layers", Layer]).endswith("Array['layers', Layer]'>")
    with pytest.raises(TypeError, match=r"Array takes a spec and a type"):
        Array[b"layers"]
    with pytest.raises(TypeError, match=r"needs an array type such as f32\['a b'\] or a pytree"):
        Array[b"layers", int]


def _spec_error(make) -> SpecError:
    with pytest.raises(SpecError) as e:
        make()
    return e.value


def test_array_joined_spec_is_validated():
    direct = _spec_error(lambda: f32[b"layers/d d_in d_out/d"])
    assert "mesh axis 'd' is used twice" in str(direct)
    # The joined spec raises exactly the error of writing it out, caret included.
    assert str(_spec_error(lambda: Array[b"layers/d", f32[b"d_in d_out/d"]])) == str(direct)
    assert str(_spec_error(lambda: Array[b"layers/d", Layer])) == str(direct)
    # ... and names the clashing field in a note.
    notes = _spec_error(lambda: Array[b"layers/d", Layer]).__notes__
    assert notes == [
        "Array['layers/d', Layer]: field 'w' of Layer is f32['d_in d_out/d'], and the stacked "
        "dims 'layers/d' go in front of it"
    ]
    nested = _spec_error(lambda: Array[b"l/d", Array[b"k/d", f32[b"a"]]])
    assert str(nested) == str(_spec_error(lambda: f32[b"l/d k/d a"]))
    # Prefix dims on their own sharded differently than the fields are fine.
    assert Array[b"layers/x", Layer] is Array[b"layers/x", Layer]


@pytree_dataclass
class Attn:
    q: f32[b"d_in heads/d"]


@pytree_dataclass
class Block:
    attn: Attn
    norms: Array[b"2", Layer]
    scale: f32[b""]


def test_stacked_type_builds_the_inner_class_with_nested_fields():
    Stack = Array[b"layers/x", Block]
    assert issubclass(Stack, Block) and Stack.inner is Block  # type: ignore[attr-defined]
    assert {f.name: f.type for f in dataclasses.fields(Stack)} == {
        "attn": Array[b"layers/x", Attn],
        "norms": Array[b"layers/x 2", Layer],
        "scale": f32[b"layers/x"],
    }
    specs = make_partition_specs(Stack)
    assert specs == Block(
        attn=Attn(q=P("x", None, "d")),
        norms=Layer(w=P("x", None, None, "d"), b=P("x", None, "d")),
        scale=P("x"),
    )
    value = Stack(
        attn=Array[b"layers/x", Attn](q=jnp.zeros((3, 4, 2))),
        norms=Layer(w=jnp.zeros((3, 2, 4, 4)), b=jnp.zeros((3, 2, 4))),
        scale=jnp.ones(3),
    )
    assert type(value) is Block and type(value.attn) is Attn
    assert jax.tree.structure(value) == jax.tree.structure(specs)
    assert isinstance(value, Stack) and isinstance(Layer(w=1, b=2), Array[b"l", Layer])
    assert not isinstance(value, Array[b"l", Layer])
    assert inspect.signature(Stack) == inspect.signature(Block)


@pytree_dataclass
class WithCount:
    w: f32[b"a"]
    n: int


def test_stacking_a_field_that_is_not_an_array_type():
    with pytest.raises(TypeError) as e:
        Array[b"layers", WithCount]
    assert str(e.value) == (
        "Array['layers', WithCount]: field 'n' is annotated <class 'int'>, which cannot be "
        "stacked: expected an array type such as f32['a b'], a pytree_dataclass or Array[...]"
    )


@pytree_dataclass
class Later:
    w: "LaterSpec"  # noqa: UP037 - defined only after the stacked type below


StackOfLater = Array[b"layers", Later]  # Later's annotation cannot be resolved yet
LaterSpec = f32[b"a/d"]


def test_stacked_type_of_a_class_with_forward_references():
    assert make_partition_specs(StackOfLater) == Later(w=P(None, "d"))
    assert issubclass(StackOfLater, Later)


# ------------------------------------------------------------------ typeguard on pytrees


@typechecked
def apply_stack(layers: Array[b"layers", Layer], x: f32[b"batch d_in"]) -> f32[b"batch d_out"]:
    def step(h, layer):
        return h @ layer.w + layer.b, None

    h, _ = jax.lax.scan(step, x, layers)
    return h


@typechecked
def take_model(m: Model) -> bf16[b"vocab d_in"]:
    return m.emb


def test_stacked_dataclass_checked_through_typeguard():
    m = _model(L=3, d_in=8, d_out=8)
    x = jnp.ones((2, 8))
    want = np.ones((2, 8), np.float32)
    for i in range(3):
        want = want @ np.asarray(m.layers.w[i]) + np.asarray(m.layers.b[i])
    np.testing.assert_allclose(np.asarray(apply_stack(m.layers, x)), want, rtol=1e-5)
    # the layers dim of two fields disagrees
    bad = Layer(w=m.layers.w, b=m.layers.b[:2])
    with pytest.raises(TypeCheckError) as e:
        apply_stack(bad, x)
    msg = str(e.value)
    assert msg.startswith('field "b" of argument "layers"')
    assert "in apply_stack(): does not match f32['layers d_out/d']" in msg
    assert "dim 0 'layers': expected size 3 (layers=3 is already bound), got 2" in msg
    # an unstacked layer is missing the layers dim
    with pytest.raises(TypeCheckError, match=r"rank: expected 3 dims \(layers d_in d_out/d\)"):
        apply_stack(m.head, x)
    with pytest.raises(TypeCheckError, match="is not an instance of Layer"):
        apply_stack({"w": m.layers.w, "b": m.layers.b}, x)


def test_nested_dataclass_checked_through_typeguard():
    m = _model()
    assert take_model(m) is m.emb
    bad = dataclasses.replace(m, head=Layer(w=m.head.w, b=m.head.b.astype(jnp.bfloat16)))
    with pytest.raises(TypeCheckError) as e:
        take_model(bad)
    msg = str(e.value)
    assert msg.startswith('field "b" of field "head" of argument "m"')
    assert "dtype: expected float32, got bfloat16" in msg
    # d_out of head.b must agree with head.w and the stacked layers
    bad = dataclasses.replace(m, head=Layer(w=m.head.w, b=jnp.zeros(5)))
    with pytest.raises(TypeCheckError, match="d_out=8 is already bound"):
        take_model(bad)


# ------------------------------------------------------------------ partition specs


@pytree_dataclass
class StrFields:  # str specs work in pytree_dataclass fields (ruff reads them as forward refs)
    w: f32["a/d b"]  # noqa: F722
    s: Array["layers", Layer]  # noqa: F821


def test_str_field_specs():
    assert make_partition_specs(StrFields) == StrFields(
        w=P("d", None), s=Layer(w=P(None, None, "d"), b=P(None, "d"))
    )


def test_make_partition_specs():
    assert make_partition_specs(f32[b"batch/d len"]) == P("d", None)
    assert make_partition_specs(f32[b"a/t/d 2 c"]) == P(("t", "d"), None, None)
    assert make_partition_specs(f32[b""]) == P()
    assert make_partition_specs(Layer) == Layer(w=P(None, "d"), b=P("d"))
    assert make_partition_specs(Array[b"layers", Layer]) == Layer(
        w=P(None, None, "d"), b=P(None, "d")
    )
    assert make_partition_specs(Array[b"l/x", f32[b"a/d"]]) == P("x", "d")
    assert make_partition_specs(Model) == Model(
        emb=P("d", None),
        layers=Layer(w=P(None, None, "d"), b=P(None, "d")),
        head=Layer(w=P(None, "d"), b=P("d")),
    )
    assert make_partition_specs(tuple[f32[b"a/d"], Layer]) == (P("d"), Layer(P(None, "d"), P("d")))
    assert make_partition_specs(typing.Tuple[i32[b"a"], tuple[f32[b"b/d"]]]) == (P(None), (P("d"),))  # noqa: UP006
    assert make_partition_specs(tuple[()]) == ()


def test_make_partition_specs_errors():
    with pytest.raises(TypeError, match="variable-length tuples have no fixed layout"):
        make_partition_specs(tuple[f32[b"a"], ...])
    with pytest.raises(TypeError, match=r"f32 has no shape spec; write e.g. f32\['batch len'\]"):
        make_partition_specs(f32)
    with pytest.raises(
        TypeError, match=r"is not an array type \(f32\['a b'\]\), a pytree_dataclass"
    ):
        make_partition_specs(int)
    with pytest.raises(TypeError, match=r"\[1\]: .*is not an array type"):
        make_partition_specs(tuple[f32[b"a"], str])


# ------------------------------------------------------------------ shardings


def _expected_shardings(mesh):
    return jax.tree.map(lambda p: NamedSharding(mesh, p), make_partition_specs(Model))


def test_make_shardings_with_set_mesh_and_mesh_argument():
    mesh = make_mesh((8,), ("d",))
    with jax.set_mesh(mesh):
        got = make_shardings(Model)
    assert got == _expected_shardings(mesh)
    assert make_shardings(Model, mesh=mesh) == _expected_shardings(mesh)
    assert make_shardings(f32[b"a b/d"], mesh=mesh) == NamedSharding(mesh, P(None, "d"))
    # mesh= wins over the mesh in force
    other = make_mesh((4, 2), ("d", "t"))
    with jax.set_mesh(mesh):
        assert make_shardings(f32[b"a/d"], mesh=other).mesh == other


def test_make_shardings_with_legacy_with_mesh():
    mesh = Mesh(np.array(jax.devices()), ("d",))
    with warnings.catch_warnings():
        # deprecated in newer JAX in favour of jax.set_mesh
        warnings.filterwarnings("ignore", message=r".*with mesh", category=DeprecationWarning)
        mesh.__enter__()
    try:
        got = make_shardings(Model)
    finally:
        mesh.__exit__(None, None, None)
    assert got == _expected_shardings(mesh)


def test_make_shardings_without_a_mesh():
    with pytest.raises(ValueError) as e:
        make_shardings(Model)
    msg = str(e.value)
    assert msg.startswith("make_shardings(Model) needs a mesh")
    assert "with jax.set_mesh(mesh):" in msg and "mesh=" in msg


def test_make_shardings_unknown_axis():
    mesh = make_mesh((4, 2), ("x", "y"))
    with pytest.raises(ValueError) as e:
        make_shardings(Model, mesh=mesh)
    assert str(e.value) == (
        "make_shardings(Model): Model.emb: spec 'vocab/d d_in' uses mesh axis 'd', which the "
        "mesh does not have (mesh axes: x=4, y=2); if 'd' is a role (a logical axis), put axis "
        "rules in force around the call: with shardlib.axis_rules(d=<mesh axes>)"
    )
    with pytest.raises(ValueError, match=r"uses mesh axis 'xx'.* \(did you mean 'x'\?\)"):
        make_shardings(f32[b"a/xx"], mesh=mesh)


# One model type per mesh, with the layouts sharding propagation gives x @ w + b.
@pytree_dataclass
class Dense1:
    w: f32[b"din dout/d"]
    b: f32[b"dout/d"]


@pytree_dataclass
class Dense2:
    w: f32[b"din dout/y"]
    b: f32[b"dout/y"]


@pytree_dataclass
class Dense3:
    w: f32[b"din dout/z"]
    b: f32[b"dout/z"]


@typechecked
def dense1(p: Dense1, x: f32[b"batch din"]) -> f32[b"batch dout/d"]:
    return x @ p.w + p.b


@typechecked
def dense2(p: Dense2, x: f32[b"batch/x din"]) -> f32[b"batch/x dout/y"]:
    return x @ p.w + p.b


@typechecked
def dense3(p: Dense3, x: f32[b"batch/x/y din"]) -> f32[b"batch/x/y dout/z"]:
    return x @ p.w + p.b


X_SPECS = {1: "batch din", 2: "batch/x din", 3: "batch/x/y din"}
DENSE = {1: (Dense1, dense1), 2: (Dense2, dense2), 3: (Dense3, dense3)}


@pytest.mark.parametrize("auto", [False, True], ids=["explicit", "auto"])
@pytest.mark.parametrize(("shape", "names"), MESHES, ids=["1d", "2d", "3d"])
def test_place_with_make_shardings_then_check(shape, names, auto):
    cls, fn = DENSE[len(shape)]
    mesh = make_mesh(shape, names, auto=auto)
    r = np.random.default_rng(len(shape))
    w = r.standard_normal((16, 8)).astype(np.float32)
    b = r.standard_normal(8).astype(np.float32)
    x = r.standard_normal((8, 16)).astype(np.float32)
    with jax.set_mesh(mesh):
        p = jax.tree.map(jax.device_put, cls(w=w, b=b), make_shardings(cls))
        xs = jax.device_put(x, make_shardings(f32[X_SPECS[len(shape)]]))
        assert p.w.sharding.spec == make_partition_specs(cls).w
        # atol: a sharded matmul sums in another order; an entry near 0 differs by ~1e-7.
        np.testing.assert_allclose(np.asarray(fn(p, xs)), x @ w + b, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np.asarray(jax.jit(fn)(p, xs)), x @ w + b, rtol=1e-5, atol=1e-5)
        # the same values placed replicated are caught, naming the field
        rep = jax.tree.map(lambda v: jax.device_put(v, NamedSharding(mesh, P())), p)
        with pytest.raises(TypeCheckError) as e:
            fn(rep, xs)
    assert str(e.value).startswith('field "w" of argument "p"')
    assert "but the array is laid out as P(None, None)" in str(e.value)


# ------------------------------------------------------------------ is_fully_sharded


def test_is_fully_sharded_outside_uses_the_mesh_in_force():
    with pytest.raises(ValueError, match="is_fully_sharded needs a mesh"):
        is_fully_sharded("a/d")
    with jax.set_mesh(make_mesh((4, 2), ("d", "t"))):
        assert is_fully_sharded("a/d b/t")
        assert is_fully_sharded(b"a/t/d b")
        assert is_fully_sharded(f32[b"a/d b/t"])
        assert is_fully_sharded(P("d", "t"))
        assert is_fully_sharded(P(("d", "t")))
        assert not is_fully_sharded("a/d b")
        assert not is_fully_sharded(P(None, "t"))
        assert not is_fully_sharded(f32[b"a b"])
        with pytest.raises(TypeError, match="is_fully_sharded takes a PartitionSpec"):
            is_fully_sharded(3)
    # size-1 axes need no sharding
    with jax.set_mesh(make_mesh((8, 1), ("d", "t"))):
        assert is_fully_sharded("a/d b")


def test_is_fully_sharded_inside_uses_the_manual_axes():
    mesh = make_mesh((4, 2), ("d", "t"))
    seen = {}

    def body(x):
        seen["d"] = is_fully_sharded("a/d b")
        seen["dt"] = is_fully_sharded("a/d b/t")
        seen["none"] = is_fully_sharded("a b")
        return x

    with jax.set_mesh(mesh):
        x = jnp.zeros((8, 8))
        jax.jit(jax.shard_map(body, in_specs=P(), out_specs=P(), axis_names={"d"})).trace(x)
        assert seen == {"d": True, "dt": True, "none": False}  # only d is manual
        jax.jit(jax.shard_map(body, in_specs=P(), out_specs=P())).trace(x)
        assert seen == {"d": False, "dt": True, "none": False}
