"""What ``pipeline.gpipe`` and ``pipeline.circular`` refuse, and the messages they give.

Each refused case used to run and return a wrong answer, or stop in a message from inside
the schedule: microbatches split over the stage axis (or a stage axis the microbatches are
split over), a ``stage_fn`` that communicates over the stage axis, a misspelled ``axis=``, a
``stage_fn`` returning a tuple or a block of another shape. Each is checked with ``check_vma``
on and off. The cases the rules must let through (microbatches gathered over the stage axis,
``axis_index`` over it in the stage) are compared with all layers applied in order on the
global arrays. Also: ``shardlib.pipeline`` after a bare ``import shardlib``, and
``shardtypes.device_put_checked``, the checked form of ``jax.device_put(w, make_shardings(T))``.
"""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from typeguard import TypeCheckError

from shardlib import pipeline, shardops
from shardlib.shardtypes import (
    Array,
    device_put_checked,
    f32,
    make_shardings,
    pytree_dataclass,
    typed_shard_map,
)
from tests._mesh_util import make_mesh

L, M, B, M_BATCHES = 4, 8, 8, 4  # layers, width, rows per microbatch, microbatches
SCHEDULES = ["gpipe", "circular"]
VMA = pytest.mark.parametrize("vma", [True, False], ids=["check_vma", "no_check_vma"])
BOTH = pytest.mark.parametrize("schedule", SCHEDULES)


def _stage(w: jax.Array, h: jax.Array) -> jax.Array:
    """This stage's layers (``'layers M M'`` block) in order on one microbatch block."""
    h, _ = lax.scan(lambda h, wi: (jnp.tanh(h @ wi), None), h, w)
    return h


def _reference(w: np.ndarray, x: np.ndarray) -> np.ndarray:
    h = jnp.asarray(x)
    for i in range(w.shape[0]):
        h = jnp.tanh(h @ w[i])
    return np.asarray(h)


def _weights(schedule: str) -> np.ndarray:
    w = (np.random.default_rng(0).standard_normal((L, M, M)) / np.sqrt(M)).astype(np.float32)
    return w.reshape(2, L // 2, M, M) if schedule == "circular" else w


def _x(rows: int = B) -> np.ndarray:
    return np.random.default_rng(1).standard_normal((M_BATCHES, rows, M)).astype(np.float32)


def _run(schedule: str, stage_fn, w, x, **kw):
    """``pipeline.<schedule>``; for circular, ``w`` holds the v = 2 layer groups first."""
    return getattr(pipeline, schedule)(stage_fn, w, x, **kw)


def _w_annotation(schedule: str):
    return f32[Array, b"v layers/p M M"] if schedule == "circular" else f32[Array, b"layers/p M M"]


def _forward(
    schedule: str,
    stage_fn=_stage,
    *,
    vma: bool | None = None,
    x: bytes = b"m B M",
    out: bytes | None = None,
    spec: str = "B M",
    axis: str = "p",
    prepare=None,
):
    """``forward(w, x)``: the schedule in a ``typed_shard_map(check_vma=vma)`` body, its
    microbatches annotated ``x`` (its result ``out``, by default ``x``), ``prepare`` run on
    them first."""
    x_type, out_type = f32[Array, x], f32[Array, out or x]

    @typed_shard_map(check_vma=vma)
    def forward(w: _w_annotation(schedule), x: x_type) -> out_type:
        x = prepare(x) if prepare is not None else x
        return _run(schedule, stage_fn, w, x, spec=spec, axis=axis)

    return forward


def _assert_refused(forward, schedule: str, msg: str, mesh_shape: tuple[int, ...] = (2,)) -> None:
    """``forward`` on the test's weights and microbatches raises a ValueError matching ``msg``,
    on a mesh ``('p',)`` or ``('p', 'd')``."""
    mesh = make_mesh(mesh_shape, ("p", "d")[: len(mesh_shape)])
    with jax.set_mesh(mesh), pytest.raises(ValueError, match=msg):
        forward(_weights(schedule), _x())


REPLICATED = r"microbatches must be replicated over the stage axis 'p' \(2 stages\)"


# -- microbatches split over the stage axis --------------------------------------------------


@BOTH
@VMA
def test_microbatches_split_over_the_stage_axis_are_refused(schedule: str, vma: bool) -> None:
    """'m/p B M': each stage holds m/p microbatches; stage 0's would run and be returned
    everywhere. Refused by the body's analysis (JAX's types cannot tell without check_vma)."""
    _assert_refused(_forward(schedule, vma=vma, x=b"m/p B M"), schedule, REPLICATED)


@BOTH
@VMA
def test_microbatches_computed_from_the_stage_index_are_refused(schedule: str, vma: bool):
    """Microbatches that differ from stage to stage without any annotation saying so."""
    forward = _forward(schedule, vma=vma, prepare=lambda x: x * (1 + shardops.axis_index("p")))
    _assert_refused(forward, schedule, REPLICATED)


@BOTH
@VMA
def test_data_axis_as_the_stage_axis_is_refused(schedule: str, vma: bool) -> None:
    """axis='d' while each microbatch's rows are split over 'd' (it used to stop in the
    broadcast's psum, with a message about psum)."""
    forward = _forward(schedule, vma=vma, x=b"m B/d M", spec="B/d M", axis="d")
    msg = (
        r"microbatches must be replicated over the stage axis 'd' \(2 stages\).*"
        r"argument `spec` 'B/d M' splits dim 'B/d' of each microbatch over 'd'"
    )
    _assert_refused(forward, schedule, msg, (2, 2))


@BOTH
@VMA
def test_microbatches_gathered_over_the_stage_axis_run(schedule: str, vma: bool) -> None:
    """Gathered over 'p' in the body, the microbatches are the same on every stage (JAX's
    check_vma types still call them varying): accepted, and equal to the reference."""
    mesh = make_mesh((2,), ("p",))
    gather = lambda x: shardops.all_gather("m/p B M -> m B M", x)
    forward = _forward(schedule, vma=vma, x=b"m/p B M", out=b"m B M", prepare=gather)
    w, x = _weights(schedule), _x()
    with jax.set_mesh(mesh):
        got = jax.jit(forward)(w, x)
    np.testing.assert_allclose(np.asarray(got), _reference(w.reshape(L, M, M), x), rtol=1e-5)


# -- stage_fn communicating over the stage axis ----------------------------------------------


def _psum_shardops(w, h):
    return shardops.psum("B M", _stage(w, h), axes="p") / 2


def _psum_lax(w, h):
    return lax.psum(_stage(w, h), "p") / 2


def _pmean_in_checkpointed_scan(w, h):
    def layer(h, wi):
        return jax.checkpoint(lambda h: lax.pmean(jnp.tanh(h @ wi), "p"))(h), None

    return lax.scan(layer, h, w)[0]


def _ppermute(w, h):
    return lax.ppermute(_stage(w, h), "p", [(0, 1), (1, 0)])


def _all_gather_over_both(w, h):
    return lax.all_gather(_stage(w, h), ("p",), tiled=True)[: h.shape[0]]


COLLECTIVES = {
    "shardops.psum": (_psum_shardops, r"shardops\.psum\('B M'\) \(`psum"),
    "lax.psum": (_psum_lax, r"`psum"),
    "pmean in checkpoint in scan": (_pmean_in_checkpointed_scan, r"`psum"),
    "ppermute": (_ppermute, r"`ppermute`"),
    "all_gather": (_all_gather_over_both, r"`all_gather`"),
}


@BOTH
@VMA
@pytest.mark.parametrize("case", list(COLLECTIVES))
def test_stage_fn_collective_over_the_stage_axis_is_refused(schedule: str, vma: bool, case: str):
    stage_fn, what = COLLECTIVES[case]
    msg = (
        rf"{schedule}: `stage_fn` must not communicate over the stage axis 'p', but it runs "
        rf"{what}.* at test_pipeline_checks\.py:\d+"
    )
    _assert_refused(_forward(schedule, stage_fn, vma=vma), schedule, msg)


@pytest.mark.slow
@BOTH
def test_stage_fn_may_read_its_stage_index(schedule: str) -> None:
    """axis_index over the stage axis moves no data: allowed in stage_fn."""
    mesh = make_mesh((2,), ("p",))

    def stage_fn(w, h):
        return _stage(w, h) * (shardops.axis_index("p") >= 0)

    forward = _forward(schedule, stage_fn)
    w, x = _weights(schedule), _x()
    with jax.set_mesh(mesh):
        got = forward(w, x)
    np.testing.assert_allclose(np.asarray(got), _reference(w.reshape(L, M, M), x), rtol=1e-5)


class _UnhashableStage:
    """A stage function object with ``__eq__`` and so no hash (``jax.jit`` needs one)."""

    def __eq__(self, other: object) -> bool:
        return self is other

    def __call__(self, w: jax.Array, h: jax.Array) -> jax.Array:
        return _stage(w, h)


@VMA
def test_unhashable_stage_fn_is_traced_for_the_checks(vma: bool) -> None:
    mesh = make_mesh((2,), ("p",))

    @typed_shard_map(check_vma=vma)
    def forward(w: f32[Array, b"layers/p M M"], x: f32[Array, b"m B M"]) -> f32[Array, b"m B M"]:
        return pipeline.gpipe(_UnhashableStage(), w, x, spec="B M", axis="p")

    w, x = _weights("gpipe"), _x()
    with jax.set_mesh(mesh):
        got = forward(w, x)
    np.testing.assert_allclose(np.asarray(got), _reference(w, x), rtol=1e-5)


# -- axis=, stage_fn's result -----------------------------------------------------------------


@BOTH
@VMA
def test_misspelled_axis_is_named_as_the_schedules_argument(schedule: str, vma: bool) -> None:
    msg = (
        rf"^{schedule}: argument `axis` must name the stage mesh axis.*got 'pp', which the "
        r"mesh does not have \(mesh axes: p=2\) \(did you mean 'p'\?\)"
    )
    _assert_refused(_forward(schedule, vma=vma, axis="pp"), schedule, msg)


def test_axis_that_is_not_manual_in_the_body_is_named() -> None:
    mesh = make_mesh((2, 2), ("p", "d"))

    @typed_shard_map(axis_names="p")
    def forward(w: f32[Array, b"layers/p M M"], x: f32[Array, b"m B M"]) -> f32[Array, b"m B M"]:
        return pipeline.gpipe(_stage, w, x, spec="B M", axis="d")

    msg = r"gpipe: argument `axis` .*got 'd', a mesh axis that this body is not manual over"
    with jax.set_mesh(mesh), pytest.raises(ValueError, match=msg):
        forward(_weights("gpipe"), _x())


@BOTH
@VMA
def test_stage_fn_returning_a_tuple(schedule: str, vma: bool) -> None:
    forward = _forward(schedule, lambda w, h: (_stage(w, h), h), vma=vma)
    msg = (
        rf"{schedule}: `stage_fn` must return one block of its input's shape and dtype, spec "
        r"'B M' .*expected float32\[8, 8\], got tuple of 2 items \(f32\[8, 8\], f32\[8, 8\]\); "
        r"return only the block"
    )
    _assert_refused(forward, schedule, msg)


@BOTH
@VMA
def test_stage_fn_shape_message_speaks_in_global_sizes(schedule: str, vma: bool) -> None:
    """Rows split over 'd' (2 devices): the block is [8, 8] globally, [4, 8] per device."""
    forward = _forward(schedule, lambda w, h: h[:, :1], vma=vma, x=b"m B/d M", spec="B/d M")
    msg = (
        r"expected float32\[8, 8\] \(global; per device \[4, 8\]\), "
        r"got float32\[8, 1\] \(global; per device \[4, 1\]\)"
    )
    _assert_refused(forward, schedule, msg, (2, 2))


# -- import shardlib; shardlib.pipeline ------------------------------------------------------


@pytest.mark.slow
def test_pipeline_is_an_attribute_of_a_bare_import_shardlib() -> None:
    """As the README writes it (a fresh interpreter: here the test imports pipeline itself)."""
    code = "import shardlib; print(shardlib.pipeline.gpipe.__name__)"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=False
    )
    assert out.returncode == 0 and out.stdout.strip() == "gpipe", out.stderr[-2000:]


# -- device_put_checked ------------------------------------------------------------------------


@pytree_dataclass
class Stack:
    w_in: f32[Array, b"layers/p M F"]
    w_out: f32[Array, b"layers/p F M"]


def test_device_put_checked_places_like_make_shardings() -> None:
    mesh = make_mesh((4,), ("p",))
    rng = np.random.default_rng(2)
    host = Stack(
        rng.standard_normal((8, M, 16)).astype(np.float32),
        rng.standard_normal((8, 16, M)).astype(np.float32),
    )
    with jax.set_mesh(mesh):
        placed = device_put_checked(host)
        expected = jax.device_put(host, make_shardings(Stack))
    for name in ("w_in", "w_out"):
        got, want = getattr(placed, name), getattr(expected, name)
        assert got.sharding == want.sharding
        np.testing.assert_array_equal(np.asarray(got), getattr(host, name))
    placed = device_put_checked(host.w_in, f32[Array, b"layers/p M F"], mesh=mesh)
    assert placed.sharding.spec == jax.sharding.PartitionSpec("p", None, None)


def test_device_put_checked_names_the_field_and_dim_that_does_not_divide() -> None:
    """6 layers on 4 stages: jax.device_put would say 'does not evenly divide' about an
    anonymous shape; this names every leaf that does not fit."""
    mesh = make_mesh((4,), ("p",))
    host = Stack(np.zeros((6, M, 16), np.float32), np.zeros((6, 16, M), np.float32))
    msg = (
        r"device_put_checked\(Stack\): the arrays do not fit their annotations on the mesh "
        r"\(p=4\):\n  - field Stack\.w_in, dim 0 'layers/p': global size 6 is not divisible by "
        r"the size of mesh axis p=4; pad or resize it to a multiple of 4.*\n  - field Stack\.w_out, dim 0 'layers/p'"
    )
    with jax.set_mesh(mesh), pytest.raises(TypeCheckError, match=msg):
        device_put_checked(host)


def test_device_put_checked_rank_names_and_structure() -> None:
    mesh = make_mesh((4,), ("p",))
    bad = Stack(np.zeros((8, M), np.float32), np.zeros((8, 17, M), np.float32))
    with jax.set_mesh(mesh):
        with pytest.raises(TypeCheckError, match=r"field Stack\.w_in: expected 3 dims"):
            device_put_checked(bad)
        bad = Stack(np.zeros((8, M, 16), np.float32), np.zeros((8, 17, M), np.float32))
        with pytest.raises(
            TypeCheckError, match=r"dim 1 'F': size 17, but F=16 at field Stack\.w_in"
        ):
            device_put_checked(bad)
        with pytest.raises(TypeCheckError, match=r"`tree` must have the structure of Stack"):
            device_put_checked((np.zeros((8, M, 16)),), Stack)
        with pytest.raises(TypeError, match=r"argument `t` \(the annotation\) is needed"):
            device_put_checked(np.zeros((8, M, 16)))
