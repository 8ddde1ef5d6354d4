"""Tests for ``typed_shard_map``: specs from annotations, mesh sources, layouts, checking.

Every value test compares against an unsharded NumPy / jax.numpy reference on 1-D, 2-D and
3-D meshes of the 8 simulated CPU devices, eagerly and under ``jax.jit``. Bodies that add
the device's position (``axis_index``) prove that each device saw the block the annotation
describes, whatever the input's layout.
"""

import functools
import inspect
import math
import typing
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import typeguard
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from typeguard import TypeCheckError

from shardlib import shardops
from shardlib._env import context as _context
from shardlib._lang.parsing import ShapeSpec
from shardlib.shardtypes import (
    Array,
    check,
    f32,
    i32,
    make_shardings,
    pytree_dataclass,
    register_with_typeguard,
    typed_shard_map,
)
from tests._mesh_util import make_mesh, place
from tests._tiers import examples

register_with_typeguard()

M1 = make_mesh((8,), ("d",))
M2 = make_mesh((4, 2), ("x", "y"))
M3 = make_mesh((2, 2, 2), ("x", "y", "z"))
A1 = make_mesh((8,), ("d",), auto=True)
A2 = make_mesh((4, 2), ("x", "y"), auto=True)
A3 = make_mesh((2, 2, 2), ("x", "y", "z"), auto=True)


def rand(*shape: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def spec_of(y: jax.Array) -> tuple:
    """The layout of a result, padded to its rank (P('d') and P('d', None) are the same)."""
    s = tuple(y.sharding.spec)
    return s + (None,) * (y.ndim - len(s))


def allclose(actual, expected, tol: float = 1e-5) -> None:
    np.testing.assert_allclose(np.asarray(actual), np.asarray(expected), rtol=tol, atol=tol)


# ---------------------------------------------------------------------------------------------
# Per-mesh bodies: a matmul whose contraction may be sharded (reduced with shardops.psum)
# ---------------------------------------------------------------------------------------------


@typed_shard_map
def mm_1d(x: f32[b"batch/d in"], w: f32[b"in out"]) -> f32[b"batch/d out"]:
    return shardops.einsum_unreduced("batch/d in, in out -> batch/d out", x, w)


@typed_shard_map
def mm_2d(x: f32[b"batch/x in/y"], w: f32[b"in/y out"]) -> f32[b"batch/x out"]:
    y = shardops.einsum_unreduced("batch/x in/y, in/y out -> batch/x out", x, w)
    return shardops.psum("batch/x out", y, axes="y")


@typed_shard_map
def mm_3d(x: f32[b"batch/x/y in/z"], w: f32[b"in/z out"]) -> f32[b"batch/x/y out"]:
    y = shardops.einsum_unreduced("batch/x/y in/z, in/z out -> batch/x/y out", x, w)
    return shardops.psum("batch/x/y out", y, axes="z")


MATMULS = [
    pytest.param(mm_1d, M1, ("batch/d in", "in out"), ("d", None), id="1d"),
    pytest.param(mm_2d, M2, ("batch/x in/y", "in/y out"), ("x", None), id="2d"),
    pytest.param(mm_3d, M3, ("batch/x/y in/z", "in/z out"), (("x", "y"), None), id="3d"),
]


@pytest.mark.parametrize("fn, mesh, specs, out_layout", MATMULS)
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_matmul_matches_numpy(fn, mesh, specs, out_layout, jit):
    x, w = rand(16, 8, seed=1), rand(8, 4, seed=2)
    with jax.set_mesh(mesh):
        xs, ws = place(x, mesh, specs[0]), place(w, mesh, specs[1])
        y = (jax.jit(fn) if jit else fn)(xs, ws)
    assert y.shape == (16, 4)
    allclose(y, x @ w)
    assert spec_of(y) == out_layout


# ---------------------------------------------------------------------------------------------
# Specs from annotations: pytree dataclasses (nested), Array['layers', T] with scan, tuples
# ---------------------------------------------------------------------------------------------


@pytree_dataclass
class Layer:
    w: f32[b"hidden hidden2/x"]  # FSDP: stored split over x, gathered before use
    b: f32[b"hidden2"]


@pytree_dataclass
class Head:
    proj: f32[b"hidden2 classes/y"]


@pytree_dataclass
class Model:
    layers: Array[b"layers", Layer]
    head: Head


@typed_shard_map
def model_forward(x: f32[b"batch/x hidden"], model: Model) -> f32[b"batch/x classes/y"]:
    def step(h, layer: Layer):
        w = shardops.all_gather("hidden hidden2/x -> hidden hidden2", layer.w)
        return jnp.tanh(h @ w + layer.b), None

    h, _ = jax.lax.scan(step, x, model.layers)
    return shardops.einsum_unreduced(
        "batch/x hidden2, hidden2 classes/y -> batch/x classes/y", h, model.head.proj
    )


@typed_shard_map
def model_loss(x: f32[b"batch/x hidden"], model: Model) -> f32[b""]:
    logits = model_forward.__wrapped__(x, model)
    local = jnp.sum(jnp.tanh(logits) ** 2)
    return shardops.psum("", local, axes=("x", "y"))


def model_reference(x, model: Model):
    h = x
    for i in range(model.layers.w.shape[0]):
        h = jnp.tanh(h @ model.layers.w[i] + model.layers.b[i])
    return h @ model.head.proj


def make_model(n_layers=3, hidden=8, classes=6, seed=0) -> Model:
    return Model(
        layers=Layer(
            w=rand(n_layers, hidden, hidden, seed=seed) / np.sqrt(hidden),
            b=rand(n_layers, hidden, seed=seed + 1),
        ),
        head=Head(proj=rand(hidden, classes, seed=seed + 2)),
    )


def test_specs_read_from_annotations():
    plan = model_forward.__shardlib_signature__
    assert plan.in_specs == (
        P("x", None),
        Model(layers=Layer(w=P(None, None, "x"), b=P(None, None)), head=Head(proj=P(None, "y"))),
    )
    assert plan.out_specs == P("x", "y")


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_stacked_layers_scanned_in_body(jit):
    model, x = make_model(), rand(8, 8, seed=7)
    with jax.set_mesh(M2):
        # The weights arrive replicated (and x as NumPy): each leaf is moved to its layout.
        y = (jax.jit(model_forward) if jit else model_forward)(x, jax.tree.map(jnp.asarray, model))
    allclose(y, model_reference(x, model), tol=1e-4)
    assert spec_of(y) == ("x", "y")


def test_gradient_matches_reference_and_keeps_weight_layout():
    model, x = make_model(seed=3), rand(8, 8, seed=4)

    def reference_loss(model):
        return jnp.sum(jnp.tanh(model_reference(x, model)) ** 2)

    ref_loss, ref_grad = jax.value_and_grad(reference_loss)(model)
    with jax.set_mesh(M2):
        shardings = make_shardings(Model)
        placed = jax.tree.map(jax.device_put, model, shardings)
        xs = place(x, M2, "batch/x hidden")
        loss, grad = jax.jit(jax.value_and_grad(model_loss, argnums=1))(xs, placed)
    allclose(loss, ref_loss, tol=1e-4)
    jax.tree.map(lambda g, r: allclose(g, r, tol=1e-4), grad, ref_grad)
    got = jax.tree.map(lambda g: spec_of(g), grad)
    want = jax.tree.map(
        lambda s, g: tuple(s.spec) + (None,) * (g.ndim - len(s.spec)), shardings, grad
    )
    assert got == want
    assert got.layers.w == (None, None, "x") and got.head.proj == (None, "y")


@pytest.mark.parametrize("fn, mesh, specs, out_layout", MATMULS)
def test_matmul_gradients_match_and_keep_the_annotated_layout(fn, mesh, specs, out_layout):
    x, w = rand(16, 8, seed=1), rand(8, 4, seed=2)

    def loss(f, x, w):
        return jnp.sum(jnp.sin(f(x, w)))

    ref_gx, ref_gw = jax.grad(functools.partial(loss, jnp.matmul), argnums=(0, 1))(x, w)
    with jax.set_mesh(mesh):
        xs, ws = place(x, mesh, specs[0]), place(w, mesh, specs[1])
        gx, gw = jax.jit(jax.grad(functools.partial(loss, fn), argnums=(0, 1)))(xs, ws)
    allclose(gx, ref_gx, tol=1e-4)
    allclose(gw, ref_gw, tol=1e-4)
    for g, s in ((gx, specs[0]), (gw, specs[1])):
        assert g.sharding.is_equivalent_to(
            NamedSharding(mesh, ShapeSpec.parse(s).partition_spec()), 2
        ), (g.sharding, s)


@typed_shard_map
def tuples(
    pair: tuple[f32[b"a/x b"], f32[b"b c/y"]],
    nested: typing.Tuple[f32[b"a/x"], tuple[f32[b"c/y"], i32[b""]]],  # noqa: UP006
) -> typing.Tuple[f32[b"a/x c/y"], tuple[f32[b"a/x"], i32[b""]]]:  # noqa: UP006
    x, w = pair
    v, (u, k) = nested
    return x @ w + u[None, :], (v * k.astype(jnp.float32), k + 1)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_tuple_and_nested_tuple_args_and_returns(jit):
    plan = tuples.__shardlib_signature__
    assert plan.in_specs == ((P("x", None), P(None, "y")), (P("x"), (P("y"), P())))
    assert plan.out_specs == (P("x", "y"), (P("x"), P()))
    x, w, v, u = rand(8, 3), rand(3, 4, seed=1), rand(8, seed=2), rand(4, seed=3)
    with jax.set_mesh(M3):
        out, (scaled, k1) = (jax.jit(tuples) if jit else tuples)((x, w), (v, (u, np.int32(3))))
    allclose(out, x @ w + u[None, :])
    allclose(scaled, 3 * v)
    assert int(k1) == 4 and k1.dtype == jnp.int32
    assert spec_of(out) == ("x", "y") and spec_of(scaled) == ("x",)


# ---------------------------------------------------------------------------------------------
# The plan is built once; decoration-time errors
# ---------------------------------------------------------------------------------------------


def test_wrapper_keeps_the_functions_identity():
    assert mm_2d.__name__ == "mm_2d" and mm_2d.__qualname__ == "mm_2d"
    assert mm_2d.__module__ == __name__
    assert list(inspect.signature(affine).parameters) == ["x", "w", "bias", "scale"]
    assert inspect.signature(affine).parameters["x"].kind is inspect.Parameter.POSITIONAL_ONLY


def test_plan_built_once(monkeypatch):
    """Annotations are resolved once, at decoration; the body is never instrumented."""
    hints, instrumented = [], []
    real_hints = typing.get_type_hints

    def count_hints(obj, *a, **k):
        hints.append(obj)
        return real_hints(obj, *a, **k)

    monkeypatch.setattr(typing, "get_type_hints", count_hints)
    monkeypatch.setattr(typeguard, "typechecked", instrumented.append)

    def double(x: f32[b"batch/d len"]) -> f32[b"batch/d len"]:
        return x * 2

    g = typed_shard_map(double)
    assert double in hints and instrumented == []
    hints.clear()
    with jax.set_mesh(M1):
        for n in (8, 16):
            allclose(g(rand(n, 2)), 2 * rand(n, 2))
            allclose(jax.jit(g)(rand(n, 3)), 2 * rand(n, 3))
    assert double not in hints and instrumented == []


def _no_return(x: f32[b"a/d"]):
    return x


def _unannotated(x: f32[b"a/d"], scale) -> f32[b"a/d"]:
    return x * scale


def _star_args(x: f32[b"a/d"], *rest: f32[b"a/d"]) -> f32[b"a/d"]:
    return x


def _star_kwargs(x: f32[b"a/d"], **rest: f32[b"a/d"]) -> f32[b"a/d"]:
    return x


def _int_param(x: f32[b"a/d"], steps: int) -> f32[b"a/d"]:
    return x


def _unresolvable(x: "NoSuchType") -> f32[b"a/d"]:  # noqa: F821
    return x


def _var_tuple(x: tuple[f32[b"a/d"], ...]) -> f32[b"a/d"]:
    return x[0]


def _bare_dtype(x: f32) -> f32[b"a/d"]:
    return x


@pytest.mark.parametrize(
    "fn, kwargs, err, words",
    [
        (_no_return, {}, TypeError, ["_no_return", "return type"]),
        (
            _unannotated,
            {},
            TypeError,
            ["_unannotated", "'scale'", "no annotation", "static_argnames"],
        ),
        (_star_args, {}, TypeError, ["_star_args", "*rest"]),
        (_star_kwargs, {}, TypeError, ["_star_kwargs", "**rest"]),
        (_int_param, {}, TypeError, ["_int_param", "'steps'", "int", "static_argnames"]),
        (_int_param, {"static_argnames": ("step",)}, ValueError, ["_int_param", "'step'"]),
        (_unresolvable, {}, TypeError, ["_unresolvable", "NoSuchType"]),
        (_var_tuple, {}, TypeError, ["_var_tuple", "variable-length"]),
        (_bare_dtype, {}, TypeError, ["_bare_dtype", "'x'", "no shape spec"]),
        (_no_return, {"in_specs": P("d")}, TypeError, ["_no_return", "in_specs", "annotations"]),
        (_int_param, {"chek_vma": False}, TypeError, ["_int_param", "chek_vma"]),
        (
            _int_param,
            {"check_rep": True, "check_vma": False},
            ValueError,
            ["_int_param", "check_rep=True", "check_vma=False"],
        ),
    ],
    ids=lambda v: getattr(v, "__name__", None),
)
def test_decoration_time_errors(fn, kwargs, err, words):
    with pytest.raises(err) as e:
        typed_shard_map(fn, **kwargs)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


@functools.partial(typed_shard_map, static_argnames=("power", "mode"))
def powers(x: f32[b"batch/d len"], power: int, mode: str = "sum") -> f32[b"batch/d"]:
    y = x**power
    return y.sum(-1) if mode == "sum" else y.max(-1)


def test_static_argnames_reach_the_body():
    x = rand(16, 4)
    with jax.set_mesh(M1):
        allclose(powers(x, 2), (x**2).sum(-1))
        jitted = jax.jit(powers, static_argnames=("power", "mode"))
        for power, mode in [(1, "sum"), (3, "sum"), (2, "max")]:
            want = (x**power).sum(-1) if mode == "sum" else (x**power).max(-1)
            allclose(jitted(x, power=power, mode=mode), want, tol=1e-4)
            allclose(jitted(x, power, mode), want, tol=1e-4)


def test_static_argnames_as_a_single_string():
    def scale(x: f32[b"n/d"], factor: float) -> f32[b"n/d"]:
        return x * factor

    g = typed_shard_map(scale, static_argnames="factor")
    with jax.set_mesh(M1):
        allclose(jax.jit(g, static_argnames="factor")(rand(8), factor=2.5), 2.5 * rand(8))


# ---------------------------------------------------------------------------------------------
# Keyword arguments, defaults, positional-only parameters
# ---------------------------------------------------------------------------------------------

DEFAULT_BIAS = np.arange(4, dtype=np.float32)
DEFAULT_SCALE = np.float32(0.5)


@typed_shard_map
def affine(
    x: f32[b"batch/x in/y"],
    /,
    w: f32[b"in/y out"],
    *,
    bias: f32[b"out"] = DEFAULT_BIAS,
    scale: f32[b""] = DEFAULT_SCALE,
) -> f32[b"batch/x out"]:
    y = shardops.psum("batch/x out", x @ w, axes="y")
    return y * scale + bias


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_keywords_defaults_positional_only(jit):
    x, w, b = rand(8, 6), rand(6, 4, seed=1), rand(4, seed=2)
    g = jax.jit(affine) if jit else affine
    with jax.set_mesh(M2):
        allclose(g(x, w), (x @ w) * 0.5 + DEFAULT_BIAS)
        allclose(g(x, w=w, bias=b), (x @ w) * 0.5 + b)
        allclose(g(x, w, scale=np.float32(2), bias=b), (x @ w) * 2 + b)


def test_call_errors_name_the_function():
    x, w = rand(8, 6), rand(6, 4, seed=1)
    with jax.set_mesh(M2):
        with pytest.raises(TypeError, match=r"affine\(\).*positional"):
            affine(x=x, w=w)
        with pytest.raises(TypeError, match=r"affine\(\).*'w'"):
            affine(x)
        with pytest.raises(TypeError, match=r"affine\(\).*(unexpected|got an)"):
            affine(x, w, b=w)


# ---------------------------------------------------------------------------------------------
# Mesh sources: jax.set_mesh, legacy `with mesh:`, mesh=; none is an error naming f
# ---------------------------------------------------------------------------------------------


def test_legacy_with_mesh():
    legacy = jax.sharding.Mesh(np.array(jax.devices()).reshape(4, 2), ("x", "y"))
    x, w = rand(16, 8, seed=1), rand(8, 4, seed=2)
    with warnings.catch_warnings():
        # Deprecated in favour of jax.set_mesh (a DeprecationWarning on newer JAX).
        warnings.filterwarnings("ignore", r".*with mesh", DeprecationWarning)
        with legacy:
            eager = mm_2d(x, w)
            jitted = jax.jit(mm_2d)(x, w)
    for y in (eager, jitted):
        allclose(y, x @ w)
        assert y.sharding.mesh.shape == {"x": 4, "y": 2}
        assert spec_of(y) == ("x", None)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("as_numpy", [False, True], ids=["jnp", "numpy"])
def test_mesh_argument_without_context(jit, as_numpy):
    g = typed_shard_map(mm_3d.__wrapped__, mesh=M3)
    x, w = rand(16, 8, seed=1), rand(8, 4, seed=2)
    args = (x, w) if as_numpy else (jnp.asarray(x), jnp.asarray(w))
    assert _context.concrete_mesh() is None
    y = (jax.jit(g) if jit else g)(*args)
    allclose(y, x @ w)
    assert y.sharding.mesh == M3 and spec_of(y) == (("x", "y"), None)


def test_decorator_with_keywords():
    @typed_shard_map(mesh=M1, check_vma=True)
    def neg(x: f32[b"n/d"]) -> f32[b"n/d"]:
        return -x

    allclose(jax.jit(neg)(rand(16)), -rand(16))


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_no_mesh_is_an_error_naming_f(jit):
    with pytest.raises(ValueError, match=r"typed_shard_map\(mm_1d\) needs a mesh.*set_mesh"):
        (jax.jit(mm_1d) if jit else mm_1d)(rand(8, 2), rand(2, 2))


# ---------------------------------------------------------------------------------------------
# Inputs in any layout: resharded on Explicit meshes, moved by shard_map on Auto meshes
# ---------------------------------------------------------------------------------------------


@typed_shard_map
def tag_1d(t: f32[b"rows/d cols"]) -> f32[b"rows/d cols"]:
    return t + (10 * shardops.axis_index("d")).astype(jnp.float32)


@typed_shard_map
def tag_2d(t: f32[b"rows/x cols/y"]) -> f32[b"rows/x cols/y"]:
    return t + (10 * shardops.axis_index("x") + shardops.axis_index("y")).astype(jnp.float32)


@typed_shard_map
def tag_3d(t: f32[b"rows/x/y cols/z"]) -> f32[b"rows/x/y cols/z"]:
    return t + (10 * shardops.axis_index("x/y") + shardops.axis_index("z")).astype(jnp.float32)


def block_tags(shape: tuple[int, int], row_blocks: int, col_blocks: int) -> np.ndarray:
    """10 * (row block) + (column block) of every element: what the tag bodies add."""
    r = np.arange(shape[0])[:, None] // (shape[0] // row_blocks)
    c = np.arange(shape[1])[None, :] // (shape[1] // col_blocks)
    return (10 * r + c).astype(np.float32)


TAGS = {
    1: (tag_1d, "rows/d cols", (8, 1), P(None, "d")),
    2: (tag_2d, "rows/x cols/y", (4, 2), P("y", "x")),
    3: (tag_3d, "rows/x/y cols/z", (4, 2), P("z", ("y", "x"))),
}
EXPLICIT = {1: M1, 2: M2, 3: M3}
LAYOUTS = ["annotated", "replicated", "other", "numpy"]
AUTO = {1: A1, 2: A2, 3: A3}


def _inputs(layout: str, t: np.ndarray, mesh, annotated: str, other: P):
    if layout == "numpy":
        return t
    if layout == "replicated":
        return jax.device_put(t, NamedSharding(mesh, P()))
    if layout == "other":
        return jax.device_put(t, NamedSharding(mesh, other))
    if layout == "single-device":
        return jax.device_put(t, jax.devices()[3])
    return place(t, mesh, annotated)


@pytest.mark.slow
@pytest.mark.parametrize("dims", [1, 2, 3])
@pytest.mark.parametrize("auto", [False, True], ids=["explicit", "auto"])
@pytest.mark.parametrize(
    "layout, jit",
    [
        *[(layout, jit) for layout in LAYOUTS for jit in (False, True)],
        # Under jit a value committed to one device is refused by jax.jit itself.
        ("single-device", False),
    ],
)
def test_inputs_in_any_layout(dims, auto, layout, jit):
    fn, annotated, (rb, cb), other = TAGS[dims]
    mesh = (AUTO if auto else EXPLICIT)[dims]
    t = rand(16, 8, seed=dims)
    with jax.set_mesh(mesh):
        y = (jax.jit(fn) if jit else fn)(_inputs(layout, t, mesh, annotated, other))
    allclose(y, t + block_tags(t.shape, rb, cb))
    assert y.sharding.is_equivalent_to(
        NamedSharding(mesh, ShapeSpec.parse(annotated).partition_spec()), 2
    )


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_mixed_explicit_and_auto_axes(layout, jit):
    mesh = jax.make_mesh((4, 2), ("x", "y"), axis_types=(AxisType.Explicit, AxisType.Auto))
    t = rand(16, 8, seed=5)
    with jax.set_mesh(mesh):
        y = (jax.jit(tag_2d) if jit else tag_2d)(
            _inputs(layout, t, mesh, "rows/x cols/y", P(None, "x"))
        )
    allclose(y, t + block_tags(t.shape, 4, 2))


def _primitives(jaxpr) -> list[str]:
    return [e.primitive.name for e in jaxpr.eqns]


@pytest.mark.parametrize("fn, mesh, specs, out_layout", MATMULS)
def test_hlo_identical_to_hand_written_when_layouts_match(fn, mesh, specs, out_layout):
    hand = jax.shard_map(
        fn.__wrapped__,
        in_specs=tuple(ShapeSpec.parse(s).partition_spec() for s in specs),
        out_specs=P(*out_layout),
    )
    x, w = rand(16, 8, seed=1), rand(8, 4, seed=2)
    with jax.set_mesh(mesh):
        xs, ws = place(x, mesh, specs[0]), place(w, mesh, specs[1])
        typed_jit, hand_jit = jax.jit(fn), jax.jit(hand)
        assert typed_jit.lower(xs, ws).as_text() == hand_jit.lower(xs, ws).as_text()
        assert "reshard" not in _primitives(typed_jit.trace(xs, ws).jaxpr)
        # One argument in another layout: exactly one reshard, for it.
        xr = jax.device_put(x, NamedSharding(mesh, P()))
        assert _primitives(typed_jit.trace(xr, ws).jaxpr).count("reshard") == 1
        allclose(typed_jit(xr, ws), x @ w)


def test_composed_under_jit_reshards_between_calls():
    """One typed function's output feeds another that wants a different layout."""
    x, w = rand(16, 8, seed=1), rand(8, 8, seed=2)

    @jax.jit
    def both(x, w):
        y = mm_2d(x, w)  # 'batch/x out': P('x', None)
        return tag_2d(y)  # wants 'rows/x cols/y'

    with jax.set_mesh(M2):
        out = both(place(x, M2, "batch/x in/y"), place(w, M2, "in/y out"))
    allclose(out, x @ w + block_tags((16, 8), 4, 2), tol=1e-4)
    assert spec_of(out) == ("x", "y")


def test_size_one_mesh_axis():
    """JAX compares specs with size-1 axes kept: 'cols/u' needs P(..., 'u') exactly."""
    mesh = make_mesh((8, 1), ("d", "u"))

    @typed_shard_map
    def shift(t: f32[b"rows/d cols/u"]) -> f32[b"rows/d cols/u"]:
        return t + (10 * shardops.axis_index("d")).astype(jnp.float32)

    t = rand(16, 4)
    with jax.set_mesh(mesh):
        for arg in (place(t, mesh, "rows/d cols"), place(t, mesh, "rows/d cols/u"), t):
            allclose(shift(arg), t + block_tags(t.shape, 8, 1))
            allclose(jax.jit(shift)(arg), t + block_tags(t.shape, 8, 1))


def _spec_text(assign: dict[str, int], order: list[str]) -> str:
    """A 2-D shape spec from {mesh axis: dim (0, 1) or -1}, axes of a dim in `order`."""
    dims = []
    for i, name in enumerate(("rows", "cols")):
        axes = [a for a in order if assign[a] == i]
        dims.append("/".join([name, *axes]))
    return " ".join(dims)


@st.composite
def layouts(draw):
    dims = draw(st.sampled_from([1, 2, 3]))
    mesh = EXPLICIT[dims]
    names = list(mesh.axis_names)

    def one():
        assign = {a: draw(st.sampled_from([-1, 0, 1])) for a in names}
        return _spec_text(assign, draw(st.permutations(names)))

    return mesh, one(), one()


@settings(max_examples=examples(25))
@given(layouts())
def test_property_any_input_layout_reaches_the_annotated_blocks(case):
    """Random annotation and random input layout: each device sees its annotated block."""
    mesh, annotated, given_layout = case
    spec = ShapeSpec.parse(annotated)
    axes = [d.sharding for d in spec.dims]
    t_type = f32[annotated.encode()]

    def tag(t: t_type) -> t_type:
        r = shardops.axis_index(axes[0]) if axes[0] else 0
        c = shardops.axis_index(axes[1]) if axes[1] else 0
        return t + jnp.asarray(10 * r + c, jnp.float32)

    sizes = dict(mesh.shape)
    t = rand(16, 8)
    with jax.set_mesh(mesh):
        y = jax.jit(typed_shard_map(tag))(place(t, mesh, given_layout))
    blocks_per_dim = [math.prod(sizes[a] for a in ax) for ax in axes]
    allclose(y, t + block_tags(t.shape, *blocks_per_dim))
    assert y.sharding.is_equivalent_to(NamedSharding(mesh, spec.partition_spec()), 2)


# ---------------------------------------------------------------------------------------------
# check_vma / check_rep / axis_names pass-through
# ---------------------------------------------------------------------------------------------


def _gathered_total(x: f32[b"n/d"]) -> f32[b""]:
    # Replicated in fact, but the all_gather result is typed as varying over d.
    return jnp.sum(shardops.all_gather("n/d -> n", x))


def _shard_map_params(g, *args) -> dict:
    eqns = [e for e in jax.make_jaxpr(g)(*args).eqns if e.primitive.name == "shard_map"]
    assert len(eqns) == 1
    return eqns[0].params


@pytest.mark.parametrize(
    "kwargs",
    [{"check_vma": False}, {"check_rep": False}, {"check_rep": False, "check_vma": False}],
    ids=["check_vma", "check_rep", "both"],
)
def test_check_vma_false_passes_through(kwargs):
    g = typed_shard_map(_gathered_total, **kwargs)
    x = rand(16)
    with jax.set_mesh(M1):
        assert _shard_map_params(g, x)["check_vma"] is False
        allclose(g(x), x.sum(), tol=1e-4)
        allclose(jax.jit(g)(x), x.sum(), tol=1e-4)


@pytest.mark.parametrize("kwargs", [{}, {"check_vma": True}, {"check_rep": True}])
def test_check_vma_true_is_enforced(kwargs):
    g = typed_shard_map(_gathered_total, **kwargs)
    with jax.set_mesh(M1), pytest.raises(ValueError, match="_gathered_total(.|\n)*out_specs"):
        jax.jit(g)(rand(16))


@pytest.mark.parametrize("axis_names", [{"x"}, "x", ("x",)], ids=["set", "str", "tuple"])
@pytest.mark.parametrize("layout", ["annotated", "replicated", "other", "numpy"])
def test_axis_names_partial_manual(axis_names, layout):
    seen = {}

    def rowsum(t: f32[b"rows/x cols"]) -> f32[b"rows/x"]:
        seen["manual"] = _context.manual_axis_sizes()
        return t.sum(-1) + shardops.axis_index("x").astype(jnp.float32)

    g = typed_shard_map(rowsum, axis_names=axis_names)
    t = rand(16, 8)
    with jax.set_mesh(M2):
        y = jax.jit(g)(_inputs(layout, t, M2, "rows/x cols", P(None, ("y", "x"))))
    assert seen["manual"] == {"x": 4}
    allclose(y, t.sum(-1) + np.arange(16) // 4, tol=1e-4)


# ---------------------------------------------------------------------------------------------
# Body typechecking: per-device shapes, bindings shared with shardops, fresh scope per call
# ---------------------------------------------------------------------------------------------


@typed_shard_map
def bad_return(x: f32[b"batch/d len"]) -> f32[b"batch/d len"]:
    return x[:, :1]


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_wrong_per_device_return_shape(jit):
    with jax.set_mesh(M1), pytest.raises(TypeCheckError) as e:
        (jax.jit(bad_return) if jit else bad_return)(rand(16, 4))
    msg = str(e.value)
    for w in ("bad_return", "return value", "f32['batch/d len']", "len", "4", "1"):
        assert w in msg, (w, msg)


@typed_shard_map
def two_batches(x: f32[b"batch/d len"], y: f32[b"batch/d"]) -> f32[b"batch/d"]:
    return x.sum(-1) + y


def test_conflicting_argument_dims():
    with jax.set_mesh(M1), pytest.raises(TypeCheckError) as e:
        jax.jit(two_batches)(rand(16, 4), rand(8))
    msg = str(e.value)
    for w in ("two_batches", "'y'", "batch", "16", "8", "f32['batch/d']"):
        assert w in msg, (w, msg)


def test_argument_dtype_and_structure_errors():
    with jax.set_mesh(M2):
        with pytest.raises(TypeCheckError, match=r"'x' of model_forward\(\)(.|\n)*float32"):
            model_forward(rand(8, 8).astype(np.int32), make_model())
        with pytest.raises(TypeCheckError, match=r"'model' of model_forward\(\).*Model"):
            model_forward(rand(8, 8), rand(8, 8))


@typed_shard_map
def swapped_names(x: f32[b"batch/d len"], w: f32[b"len out"]) -> f32[b"batch/d out"]:
    # Consistent shapes, wrong names: `out` and `len` are swapped relative to the arguments.
    return shardops.einsum_unreduced("batch/d out, out len -> batch/d len", x, w)


def test_shardops_share_the_bodys_bindings():
    """Alone the einsum spec is fine (out=4, len=6); only the body's bindings make it wrong."""
    with jax.set_mesh(M1), pytest.raises(TypeCheckError) as e:
        jax.jit(swapped_names)(rand(16, 4), rand(4, 6))
    msg = str(e.value)
    for w in ("swapped_names()", "einsum_unreduced", "'batch/d out'", "out", "6", "4"):
        assert w in msg, (w, msg)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_fresh_scope_per_call(jit):
    g = jax.jit(mm_1d) if jit else mm_1d
    with jax.set_mesh(M1):
        for batch, d_in, d_out in [(16, 8, 4), (32, 2, 6), (8, 8, 8)]:
            x, w = rand(batch, d_in, seed=batch), rand(d_in, d_out, seed=d_out)
            allclose(g(x, w), x @ w)


@typed_shard_map
def checked_local(x: f32[b"batch/d len"]) -> f32[b"batch/d"]:
    total = x.sum(-1)
    check(jnp.float32, "batch/d len", total)  # wrong: rank 1; an explicit check in the body
    return total


@typed_shard_map
def checked_local_binding(x: f32[b"batch/d len"]) -> f32[b"batch/d"]:
    total = x.sum(-1)
    check(jnp.float32, "len", total)  # rank fine; len is bound to x's per-call size by now
    return total


@typed_shard_map
@typeguard.typechecked
def annotated_local(x: f32[b"batch/d len"]) -> f32[b"batch/d"]:
    total: f32[b"batch/d len"] = x.sum(-1)  # wrong: typeguard checks annotated assignments
    return total


def test_local_in_body_is_checked_explicitly():
    """typed_shard_map does not instrument the body: a local is checked by `check(...)`."""
    x = rand(16, 4)
    with jax.set_mesh(M1):
        with pytest.raises(TypeCheckError, match=r"checked_local(.|\n)*rank"):
            jax.jit(checked_local).trace(x)
        with pytest.raises(TypeCheckError) as e:
            checked_local_binding(x)
        # per device: total has 16/8 = 2 rows, but len=4 was bound by argument x
        assert "expected size 4 (len=4 is already bound), got 2" in str(e.value)
        assert "checked_local_binding" in str(e.value)
        # with a matching local size the same check passes and the result is right
        allclose(checked_local_binding(rand(16, 2)), rand(16, 2).sum(-1))


def test_annotated_assignment_in_typeguard_body_is_checked():
    """A body decorated with typeguard.typechecked (bytes specs) has its locals checked."""
    with jax.set_mesh(M1), pytest.raises(TypeCheckError, match=r"total(.|\n)*rank"):
        jax.jit(annotated_local)(rand(16, 4))


def test_annotations_using_local_names_are_checked():
    """typeguard ignores annotations naming locals of the enclosing function; we do not."""
    rows = f32[b"batch/d len"]
    vec = f32[b"batch/d"]

    @pytree_dataclass
    class Pair:
        a: f32[b"batch/d len"]
        b: f32[b"batch/d"]

    @typed_shard_map
    def wrong(x: rows) -> vec:
        return x

    def string_annotated(p: "Pair") -> "Pair":
        return Pair(a=p.a, b=p.b[:1])  # wrong size for b

    with jax.set_mesh(M1):
        with pytest.raises(TypeCheckError, match=r"wrong(.|\n)*rank"):
            jax.jit(wrong)(rand(16, 4))
        g = typed_shard_map(string_annotated)
        with pytest.raises(TypeCheckError, match=r"string_annotated(.|\n)*batch"):
            jax.jit(g)(Pair(a=rand(16, 4), b=rand(16)))


EXEC_SOURCE = """
def exec_matmul(x: f32[b"batch/d len"], w: f32[b"len out"]) -> f32[b"batch/d out"]:
    return shardops.einsum_unreduced(SPEC, x, w)
"""


def _exec_defined(spec: str):
    """A function with no source file (nothing reads source: it is checked like any other)."""
    ns = {"f32": f32, "shardops": shardops, "SPEC": spec}
    exec(compile(EXEC_SOURCE, "<generated>", "exec"), ns)
    return ns["exec_matmul"]


def test_function_without_source_is_checked():
    f = _exec_defined("batch/d len, len out -> batch/d out")
    g = typed_shard_map(f)
    assert g.__shardlib_signature__.body.__wrapped__ is f  # the body runs f itself, uninstrumented
    x, w = rand(16, 4), rand(4, 6, seed=1)
    with jax.set_mesh(M1):
        allclose(g(x, w), x @ w)
        allclose(jax.jit(g)(x, w), x @ w)
        with pytest.raises(TypeCheckError, match=r"'w' of exec_matmul\(\)(.|\n)*len"):
            jax.jit(g)(rand(16, 4), rand(5, 6))
        # Wrong return (rank 1 instead of 2): named with the function and the annotation.
        bad = typed_shard_map(_exec_defined("batch/d len, len out -> batch/d"))
        with pytest.raises(TypeCheckError) as e:
            jax.jit(bad)(x, w)
        assert "exec_matmul" in str(e.value)
        # The shardops in the body share the body's scope.
        swapped = typed_shard_map(_exec_defined("batch/d out, out len -> batch/d len"))
        with pytest.raises(TypeCheckError, match=r"einsum_unreduced(.|\n)*len"):
            jax.jit(swapped)(x, w)


# ---------------------------------------------------------------------------------------------
# Divisibility: a shardlib error naming the dim, the axis and both sizes
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fn, mesh, shape, words",
    [
        (mm_1d, M1, (12, 8), ["'x'", "batch/d", "12", "d=8"]),
        (mm_2d, M2, (10, 8), ["'x'", "batch/x", "10", "x=4"]),
        (mm_3d, M3, (10, 8), ["'x'", "batch/x/y", "10", "x=2", "y=2", "4"]),
    ],
    ids=["1d", "2d", "3d"],
)
@pytest.mark.parametrize("source", ["set_mesh", "mesh="])
def test_divisibility_error(fn, mesh, shape, words, source):
    x, w = rand(*shape), rand(8, 4)
    with pytest.raises(TypeCheckError) as e:
        if source == "set_mesh":
            with jax.set_mesh(mesh):
                fn(x, w)
        else:
            typed_shard_map(fn.__wrapped__, mesh=mesh)(x, w)
    msg = str(e.value)
    assert "divisible" in msg and fn.__name__ in msg, msg
    for w_ in words:
        assert w_ in msg, (w_, msg)


def test_unknown_mesh_axis_is_named():
    with jax.set_mesh(M1), pytest.raises(TypeCheckError) as e:
        mm_2d(rand(16, 8), rand(8, 4))
    msg = str(e.value)
    assert "mm_2d" in msg and "'x'" in msg and "d=8" in msg, msg


def test_explicit_mesh_is_the_default():
    """The premise of the reshard tests: jax.make_mesh gives Explicit axes."""
    assert all(t == AxisType.Explicit for t in jax.make_mesh((8,), ("d",)).axis_types)


def test_scan_carry_that_gains_varying_axes_is_explained():
    """A carry replicated over 't' that the loop makes 'varying' (a gathered weight multiplies
    it): JAX refuses it under check_vma; shardlib names the carry, both types and the fixes,
    and the program runs with check_vma=False."""
    from jax import lax

    mesh = jax.make_mesh((4, 2), ("d", "t"))

    def make(check_vma: bool):
        @typed_shard_map(check_vma=check_vma)
        def f(x: f32[b"B/d M"], ln: f32[b"K M/t/d"]) -> f32[b"B/d M"]:
            def body(x, ln):
                return x * shardops.all_gather("M/t/d -> M", ln), ()

            return lax.scan(body, x, ln)[0]

        return f

    x = np.arange(8 * 16, dtype=np.float32).reshape(8, 16)
    ln = np.full((2, 16), 2.0, np.float32)
    with jax.set_mesh(mesh):
        with pytest.raises(TypeError) as info:
            jax.jit(make(True)).trace(x, ln)
        out = jax.jit(make(False))(x, ln)
    msg = str(info.value)
    assert msg.startswith("in test_scan_carry_that_gains_varying_axes_is_explained.<locals>"), msg
    assert "loop carry 'x'" in msg and "{V:d}" in msg and "{V:(d,t)}" in msg, msg
    assert "x = jax.lax.pcast(x, ('t',), to='varying')" in msg, msg
    assert "check_vma=False" in msg, msg
    np.testing.assert_allclose(np.asarray(out), x * 4.0)


# ---------------------------------------------------------------------------------------------
# Partial-manual bodies on Explicit meshes: the layout jax.shard_map accepts, nothing more
# ---------------------------------------------------------------------------------------------

# 'x' Explicit and manual in the body; 'y' left to the compiler (Explicit, or Auto).
MIXED = jax.make_mesh((4, 2), ("x", "y"), axis_types=(AxisType.Explicit, AxisType.Auto))
PARTIAL_MESHES = pytest.mark.parametrize("mesh", [M2, MIXED], ids=["explicit", "explicit-auto"])


def _scaled_rowsum(t: f32[b"rows/x cols"], w: f32[b"cols"]) -> f32[b"rows/x"]:
    return jnp.sum(t * w, -1) + shardops.axis_index("x").astype(jnp.float32)


def _hand_scaled_rowsum(t, w):
    return jnp.sum(t * w, -1) + jax.lax.axis_index("x").astype(jnp.float32)


_PARTIAL_IN_SPECS = (P("x", None), P(None))


def _partial_typed():
    return typed_shard_map(_scaled_rowsum, axis_names={"x"})


def _partial_hand(reshard: bool = False):
    f = jax.shard_map(
        _hand_scaled_rowsum,
        in_specs=_PARTIAL_IN_SPECS,
        out_specs=P("x"),
        axis_names={"x"},
    )
    if not reshard:
        return f
    return lambda t, w: f(jax.reshard(t, _PARTIAL_IN_SPECS[0]), w)


def _program(f, *args) -> str:
    from benchmarks._hlo import canonicalize  # noqa: PLC0415 - only these tests read HLO

    return canonicalize(jax.jit(f).lower(*args).compile().as_text())


@PARTIAL_MESHES
@pytest.mark.parametrize("given_spec", [P("x", None), P("x", "y")], ids=["annotated", "x-y"])
def test_partial_manual_argument_in_an_accepted_layout_compiles_to_the_hand_written_program(
    mesh, given_spec
):
    """An argument whose layout over the manual axis is the annotated one is passed as it
    is (over 'y' it may be split too): no reshard, the compiled program is the one the
    hand-written ``jax.shard_map`` with the same specs gives (on every JAX version)."""
    t, w = rand(16, 8, seed=1), rand(8, seed=2)
    with jax.set_mesh(mesh):
        args = (jax.device_put(t, NamedSharding(mesh, given_spec)), jnp.asarray(w))
        typed, hand = _partial_typed(), _partial_hand()
        assert "reshard" not in str(jax.make_jaxpr(typed)(*args))
        assert _program(typed, *args) == _program(hand, *args)
        allclose(jax.jit(typed)(*args), jax.jit(hand)(*args))


@PARTIAL_MESHES
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize(
    "given", ["replicated", "rows/y", "cols/(y,x)", "numpy"], ids=lambda g: g.replace("/", "-")
)
def test_partial_manual_argument_in_another_layout_is_moved(mesh, jit, given):
    """An argument in a layout JAX 0.12 refuses for a partial-manual body (its manual part
    is not the in_spec, or not even one JAX can take apart: 'cols/(y,x)') is resharded to
    the annotated layout: the values are right, and the program is the one a user writes
    (``jax.reshard`` first where this JAX refuses the argument, the plain ``shard_map``
    where it accepts it)."""
    t, w = rand(16, 8, seed=3), rand(8, seed=4)
    with jax.set_mesh(mesh):
        given_spec = {
            "replicated": P(),
            "rows/y": P("y", None),
            "cols/(y,x)": P(None, ("y", "x")),
        }.get(given)
        ts = t if given_spec is None else jax.device_put(t, NamedSharding(mesh, given_spec))
        args = (ts, jnp.asarray(w))
        typed = _partial_typed()
        y = (jax.jit(typed) if jit else typed)(*args)
        if jit:
            try:
                hand = _program(_partial_hand(), *args)
            except ValueError:  # JAX >= 0.12 refuses it: the user reshards first
                hand = _program(_partial_hand(reshard=True), *args)
            assert _program(typed, *args) == hand
    expected = jnp.sum(jnp.asarray(t) * jnp.asarray(w), -1) + jnp.arange(16) // 4
    allclose(y, expected, tol=1e-4)
