"""Errors that say what to do: the texts of shardlib's errors, and the tracebacks they carry.

- A forgotten reduction is reported by shardlib alone (not after JAX's ``out_specs`` text),
  with the reduction to add written out: the spec of the value, the axes.
- An operand whose per-device block reads as the expected one divided (multiplied) by a mesh
  axis size gets a "Likely:" line (still split: gather it; a misplaced ``/t``), and an
  operand that is an argument of the body, or a field of one, is named with its annotation.
- Tracebacks out of ``typed_shard_map`` show the user's frames, not shardlib's (as JAX hides
  its own), unless ``JAX_TRACEBACK_FILTERING=off``.

Where a suggested fix is a program, the test runs it and compares the result with an
unsharded jax.numpy reference, eagerly and under ``jax.jit``.
"""

from __future__ import annotations

import contextlib
import re
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from typeguard import TypeCheckError

import shardlib
from shardlib import shardops
from shardlib._analysis.facts import Pend, made_spec, reduce_hint
from shardlib._env.frames import RAISED_BY_SHARDLIB
from shardlib.shardops import PendingReductionError
from shardlib.shardtypes import f32, pytree_dataclass, typechecked, typed_shard_map
from tests._mesh_util import make_mesh

SHARDLIB_DIR = str(Path(shardlib.__file__).resolve().parent)
RUNS = [pytest.param(lambda f: f, id="eager"), pytest.param(jax.jit, id="jit")]


def normal(seed: int, shape: tuple[int, ...]) -> jax.Array:
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32)


@contextlib.contextmanager
def filtering(mode: str) -> Iterator[None]:
    old = jax.config.jax_traceback_filtering
    jax.config.update("jax_traceback_filtering", mode)
    try:
        yield
    finally:
        jax.config.update("jax_traceback_filtering", old)


def raised(fn: Callable[[], Any], exc: type[BaseException]) -> BaseException:
    with pytest.raises(exc) as info:
        fn()
    return info.value


def frame_files(e: BaseException) -> list[str]:
    return [f.filename for f in traceback.extract_tb(e.__traceback__)]


def shardlib_frames(e: BaseException) -> list[str]:
    return [f for f in frame_files(e) if str(Path(f).resolve()).startswith(SHARDLIB_DIR)]


# ---------------------------------------------------------------------------------------------
# A forgotten reduction: shardlib's error alone, with the reduction written out
# ---------------------------------------------------------------------------------------------


def attn(x: f32[b"B/d L M"], w: f32[b"M H/t"], wo: f32[b"H/t M"]) -> f32[b"B/d L M"]:
    h = shardops.einsum_unreduced("B/d L M, M H/t -> B/d L H/t", x, w)
    return shardops.einsum_unreduced("B/d L H/t, H/t M -> B/d L M", h, wo)  # forgot the psum


def attn_fixed(x: f32[b"B/d L M"], w: f32[b"M H/t"], wo: f32[b"H/t M"]) -> f32[b"B/d L M"]:
    h = shardops.einsum_unreduced("B/d L M, M H/t -> B/d L H/t", x, w)
    y = shardops.einsum_unreduced("B/d L H/t, H/t M -> B/d L M", h, wo)
    return shardops.psum("B/d L M", y, axes="t")  # the fix the error writes out


def attn_flat(x: f32[b"B/d L M"], w: f32[b"M H/t"], wo: f32[b"H/t M"]) -> f32[b"B/d N"]:
    h = shardops.einsum_unreduced("B/d L M, M H/t -> B/d L H/t", x, w)
    y = shardops.einsum_unreduced("B/d L H/t, H/t M -> B/d L M", h, wo)
    return y.reshape(y.shape[0], -1)  # linear: still a partial sum, now 'B/d N'


def attn_relu(x: f32[b"B/d L M"], w: f32[b"M H/t"], wo: f32[b"H/t M"]) -> f32[b"B/d L M"]:
    h = shardops.einsum_unreduced("B/d L M, M H/t -> B/d L H/t", x, w)
    y = shardops.einsum_unreduced("B/d L H/t, H/t M -> B/d L M {+t}", h, wo)
    return shardops.psum("B/d L M", jax.nn.relu(y), axes="t")


ATTN_ARGS = ((8, 4, 16), (16, 8), (8, 16))


def attn_inputs() -> list[jax.Array]:
    return [normal(k, s) for k, s in enumerate(ATTN_ARGS)]


@pytest.mark.parametrize("run", RUNS)
@pytest.mark.parametrize("check_vma", [True, False])
def test_forgotten_psum_is_shardlibs_error_alone_with_the_concrete_fix(run, check_vma) -> None:
    f = run(typed_shard_map(attn, check_vma=check_vma))
    with jax.set_mesh(make_mesh((4, 2), ("d", "t"))):
        e = raised(lambda: f(*attn_inputs()), PendingReductionError)
    msg = str(e)
    assert msg.startswith("in attn(): the return value is a partial sum still owing a reduction ")
    assert (
        "made by einsum_unreduced('B/d L H/t, H/t M -> B/d L M') at test_error_messages.py:" in msg
    )
    assert "Reduce it first: shardops.psum('B/d L M', x, axes='t')" in msg
    assert "psum(spec" not in msg and "SPEC" not in msg
    # JAX's out_specs refusal is neither the cause nor in the text: it named only the specs
    # and a functools.partial of shardlib's body.
    assert e.__cause__ is None and (e.__context__ is None or e.__suppress_context__)
    assert "functools.partial" not in msg and "out_specs" not in msg


@pytest.mark.parametrize("run", RUNS)
def test_the_written_out_fix_gives_the_unsharded_result(run) -> None:
    x, w, wo = attn_inputs()
    with jax.set_mesh(make_mesh((4, 2), ("d", "t"))):
        got = run(typed_shard_map(attn_fixed))(x, w, wo)
    np.testing.assert_allclose(np.asarray(got), np.asarray(x @ w @ wo), rtol=1e-5, atol=1e-5)


def test_a_returned_partial_sum_gets_the_return_annotations_spec() -> None:
    """The spec in the fix is the return annotation's, not that of the op that made the sum."""
    with jax.set_mesh(make_mesh((4, 2), ("d", "t"))):
        e = raised(lambda: typed_shard_map(attn_flat)(*attn_inputs()), PendingReductionError)
    assert "shardops.psum('B/d N', x, axes='t')" in str(e), str(e)


def test_a_misused_partial_sum_gets_the_spec_of_the_op_that_made_it() -> None:
    with jax.set_mesh(make_mesh((4, 2), ("d", "t"))):
        e = raised(lambda: typed_shard_map(attn_relu)(*attn_inputs()), PendingReductionError)
    msg = str(e)
    assert "`max` at test_error_messages.py:" in msg
    assert "Reduce it first: shardops.psum('B/d L M', x, axes='t')" in msg, msg


@pytest.mark.parametrize(
    ("origin", "spec"),
    [
        ("einsum_unreduced('B/d L H/t, H/t M -> B/d L M') at f.py:3", "B/d L M"),
        ("einsum_unreduced('a b/t, b/t c -> a c {+t}') at f.py:3", "a c"),
        ("index_unreduced('V/t D, B -> B D') at <stdin>:1", "B D"),
        ("einsum_unreduced('a/t, a/t -> ') at f.py:3", None),  # a scalar: no spec to show
        ("a value", None),
    ],
)
def test_made_spec_reads_the_output_spec_of_an_origin(origin: str, spec: str | None) -> None:
    assert made_spec(origin) == spec


# ---------------------------------------------------------------------------------------------
# The reduction a fix names: psum_scatter under a split spec, pmean first for a loss
# ---------------------------------------------------------------------------------------------


def mlp_unscattered(h: f32[b"B/d F/t"], w: f32[b"F/t M"]) -> f32[b"B/d M/t"]:
    return shardops.einsum_unreduced("B/d F/t, F/t M -> B/d M", h, w)  # forgot psum_scatter


def mlp_resharded(h: f32[b"B/d F/t"], w: f32[b"F/t M"]) -> f32[b"B/d M/t"]:
    y = shardops.einsum_unreduced("B/d F/t, F/t M -> B/d M", h, w)
    return shardops.reshard("B/d M -> B/d M/t", y)  # the reshard the shape hint offers


def mlp_scattered(h: f32[b"B/d F/t"], w: f32[b"F/t M"]) -> f32[b"B/d M/t"]:
    y = shardops.einsum_unreduced("B/d F/t, F/t M -> B/d M", h, w)
    return shardops.psum_scatter("B/d M -> B/d M/t", y)  # the fix the hints write out


def proj_unscattered(h: f32[b"B/d F/t"], w: f32[b"F/t N"]) -> f32[b"B/d M/t"]:
    # M is bound by the return value alone, so its shape check passes: the analysis refuses.
    return shardops.einsum_unreduced("B/d F/t, F/t N -> B/d N", h, w)


def proj_scattered(h: f32[b"B/d F/t"], w: f32[b"F/t N"]) -> f32[b"B/d M/t"]:
    y = shardops.einsum_unreduced("B/d F/t, F/t N -> B/d N", h, w)
    return shardops.psum_scatter("B/d M -> B/d M/t", y)


MLP_SCATTER = "shardops.psum_scatter('B/d M -> B/d M/t', x)"


def mlp_inputs() -> tuple[jax.Array, jax.Array]:
    return normal(0, (8, 16)), normal(1, (16, 4))


@pytest.mark.parametrize("run", RUNS)
def test_a_partial_sum_returned_under_a_split_annotation_is_told_to_reduce_scatter(run) -> None:
    h, w = mlp_inputs()
    with jax.set_mesh(make_mesh((4, 2), ("d", "t"))):
        e = raised(lambda: run(typed_shard_map(mlp_unscattered))(h, w), TypeCheckError)
        again = raised(lambda: run(typed_shard_map(mlp_resharded))(h, w), PendingReductionError)
        got = run(typed_shard_map(mlp_scattered))(h, w)
    assert (
        "shardops.reshard('B/d M -> B/d M/t', x); or, if it is a partial sum over 't' (e.g. "
        f"from einsum_unreduced), reduce-scatter it: {MLP_SCATTER}"
    ) in str(e), str(e)
    # The reshard the hint also offers is refused, and that refusal names the same fix.
    assert f"Reduce-scatter it first: {MLP_SCATTER}" in str(again), str(again)
    np.testing.assert_allclose(np.asarray(got), np.asarray(h @ w), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("run", RUNS)
def test_a_pending_value_under_a_split_spec_gets_psum_scatter_not_psum(run) -> None:
    h, w = mlp_inputs()
    with jax.set_mesh(make_mesh((4, 2), ("d", "t"))):
        e = raised(lambda: run(typed_shard_map(proj_unscattered))(h, w), PendingReductionError)
        got = run(typed_shard_map(proj_scattered))(h, w)
    msg = str(e)
    assert f"Reduce-scatter it first: {MLP_SCATTER} (psum cannot reduce over" in msg, msg
    assert "shardops.psum('B/d M/t'" not in msg  # that fix would itself raise SpecError
    np.testing.assert_allclose(np.asarray(got), np.asarray(h @ w), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("axes", "spec", "fix"),
    [
        ("t", "B/d M/t", "shardops.psum('B/d M/t'"),
        ("t", "B/d M", None),  # nothing split over t: psum is right
        ("dt", "B M/t", "shardops.psum_scatter('B M -> B M/t', shardops.psum('B M', x, "),
        ("t", "B/d/t M", "shardops.psum_scatter('B/d M -> B/d/t M', x)"),
    ],
)
def test_reduce_hint_scatters_only_over_axes_the_spec_splits(axes, spec, fix) -> None:
    hint = reduce_hint(Pend(frozenset(axes), "einsum_unreduced('a b/t, b/t c -> a c')"), spec)
    if fix is None:
        assert hint.startswith(f"Reduce it first: shardops.psum({spec!r}, x, axes='t')"), hint
    elif fix.startswith("shardops.psum("):
        assert fix not in hint and "psum_scatter(" in hint, hint
    else:
        assert hint.startswith(f"Reduce-scatter it first: {fix}"), hint


def loss_unreduced(x: f32[b"B/d F"], w: f32[b"F"]) -> f32[b""]:
    return shardops.einsum_unreduced("B/d F, F -> ", x, w) / x.shape[0]  # a local mean


def loss_reduced(x: f32[b"B/d F"], w: f32[b"F"]) -> f32[b""]:
    local = shardops.einsum_unreduced("B/d F, F -> ", x, w) / x.shape[0]
    return shardops.pmean("", local, axes="d")  # the fix the error writes out first


@pytest.mark.parametrize("run", RUNS)
def test_a_pending_loss_is_told_pmean_first(run) -> None:
    x, w = normal(0, (8, 16)), normal(1, (16,))
    with jax.set_mesh(make_mesh((4, 2), ("d", "t"))):
        e = raised(lambda: run(typed_shard_map(loss_unreduced))(x, w), PendingReductionError)
        got = run(typed_shard_map(loss_reduced))(x, w)
    want = (
        "Reduce it first: shardops.pmean('', x, axes='d') for a mean (a loss), "
        "shardops.psum('', x, axes='d') for a sum"
    )
    assert want in str(e), str(e)
    # The same without a return annotation's spec: a scalar made by the op itself.
    origin = "einsum_unreduced('B/d F, F -> ') at f.py:3"
    assert reduce_hint(Pend(frozenset("d"), origin)).startswith(want)
    np.testing.assert_allclose(np.asarray(got), np.asarray(jnp.mean(x @ w)), rtol=1e-5, atol=1e-5)


def rowsum(x: f32[b"batch/d model/t"]) -> f32[b"batch/d"]:
    return x.sum(1)  # each t-device has only its part of the sum


def rowsum_fixed(x: f32[b"batch/d model/t"]) -> f32[b"batch/d"]:
    return shardops.psum("batch/d", x.sum(1), axes="t")


@pytest.mark.parametrize("run", RUNS)
def test_replication_refusal_names_the_axis_and_the_reduction(run) -> None:
    x = normal(0, (8, 4))
    with jax.set_mesh(make_mesh((4, 2), ("d", "t"))):
        e = raised(lambda: run(typed_shard_map(rowsum))(x), ValueError)
        fixed = run(typed_shard_map(rowsum_fixed))(x)
    msg = str(e)
    assert msg.startswith(
        "typed_shard_map(rowsum): the return annotation f32['batch/d'] says the result is "
        "replicated over mesh axis 't', and JAX cannot prove it is"
    ), msg
    assert "Reduce the value (shardops.psum('batch/d', x, axes='t'), or pmean/pmax)" in msg
    # JAX's sentence stays, its long preamble (naming shardlib's partial) does not.
    # (JAX 0.9 spells the spec PartitionSpec('d',), 0.10 P('d',).)
    assert re.search(
        r"\n\nJAX's message: out_specs is (P|PartitionSpec)\('d',\) which implies", msg
    )
    assert "functools.partial" not in msg and "shard_map applied to" not in msg
    np.testing.assert_allclose(np.asarray(fixed), np.asarray(x.sum(1)), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# Layout mismatches inside a body: what likely happened, and where the operand came from
# ---------------------------------------------------------------------------------------------


@pytree_dataclass
class Weights:
    wi: f32[b"M H/t D"]
    wo: f32[b"H D/t M"]


def weights() -> Weights:
    return Weights(normal(1, (16, 4, 6)), normal(2, (4, 6, 16)))


def still_split(x: f32[b"B/d M"], w: Weights) -> f32[b"B/d M"]:
    return shardops.einsum("B/d M, H D M -> B/d M", x, w.wo)  # w.wo is split over t on D


def still_split_fixed(x: f32[b"B/d M"], w: Weights) -> f32[b"B/d M"]:
    wo = shardops.all_gather("H D/t M -> H D M", w.wo)  # the fix the error writes out
    return shardops.einsum("B/d M, H D M -> B/d M", x, wo)


def misplaced(x: f32[b"B/d M"], w: Weights) -> f32[b"B/d M"]:
    return shardops.einsum("B/d M, H/t D M -> B/d M", x, w.wo)  # the /t is on D, not H


def not_split(x: f32[b"B/d M"], w: Weights) -> f32[b"B M"]:
    whole = shardops.all_gather("B/d M -> B M", x)
    return shardops.all_gather("B/d M -> B M", whole)  # gathered twice


def derived(x: f32[b"B/d M"], w: Weights) -> f32[b"B/d M"]:
    return shardops.einsum("B/d M, H D M -> B/d M", x, w.wo * 2)  # not an argument itself


def in_a_tuple(x: f32[b"B/d M"], ws: tuple[f32[b"M/t F"], f32[b"M/t F"]]) -> f32[b"B/d F"]:
    return shardops.einsum("B/d M, M F -> B/d F", x, ws[1])


def wrong_size(x: f32[b"B/d M"], w: Weights) -> f32[b"B/d M"]:
    return shardops.einsum("B/d M, H D M -> B/d M", x, w.wo[:, :2])  # 2 of 3: no axis size


def layout_error(body: Callable, run: Callable, *args: Any) -> str:
    x = normal(0, (8, 16))
    with jax.set_mesh(make_mesh((4, 2), ("d", "t"))):
        e = raised(lambda: run(typed_shard_map(body))(x, *(args or (weights(),))), TypeCheckError)
    return str(e)


@pytest.mark.parametrize("run", RUNS)
def test_still_split_operand_says_gather_it_and_names_the_field(run) -> None:
    msg = layout_error(still_split, run)
    assert msg.startswith(
        "in still_split(): einsum('B/d M, H D M -> B/d M') operand 1 (w.wo, annotated "
        "f32['H D/t M']) does not match spec 'H D M':\n"
        "  - dim 1 'D': expected size 6 (D=6 is already bound), got 3\n"
        "  Likely: dim 1 'D' is 3 per device, 2 times smaller than expected: the value is "
        "likely still split over 't' on that dim; gather it first, "
        "shardops.all_gather('H D/t M -> H D M', x), or write 'H D/t M' in the spec if it "
        "should stay split\n"
    ), msg


@pytest.mark.parametrize("run", RUNS)
def test_the_suggested_gather_gives_the_unsharded_result(run) -> None:
    x, w = normal(0, (8, 16)), weights()
    with jax.set_mesh(make_mesh((4, 2), ("d", "t"))):
        # check_vma off: JAX types an all_gather result as varying over 't' (troubleshooting.md)
        got = run(typed_shard_map(still_split_fixed, check_vma=False))(x, w)
    want = jnp.einsum("bm,hdm->bm", x, w.wo)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-4)


def test_misplaced_axis_says_which_dim_it_belongs_on() -> None:
    msg = layout_error(misplaced, jax.jit)
    assert "operand 1 (w.wo, annotated f32['H D/t M']) does not match spec 'H/t D M'" in msg
    assert (
        "  Likely: the /t looks misplaced: the value is split over 't' on dim 1 'D', not on "
        "dim 0 'H/t'; write 'H D/t M' (or move the split with "
        "shardops.all_to_all('H D/t M -> H/t D M', x))\n"
    ) in msg, msg


def test_a_value_not_split_where_the_spec_says_so() -> None:
    msg = layout_error(not_split, lambda f: f)
    assert "all_gather('B/d M -> B M') input does not match spec 'B/d M'" in msg
    assert (
        "  Likely: dim 0 'B/d' is 8 per device, 4 times larger than the spec says: the value "
        "is not split over 'd' there (already gathered, or is the /d on the wrong dim?); "
        "write 'B M', or take this device's part first, shardops.reshard('B M -> B/d M', x)"
    ) in msg, msg
    assert "annotated" not in msg  # a computed value: no argument to name


def test_only_arguments_are_named() -> None:
    msg = layout_error(derived, lambda f: f)
    assert "operand 1 does not match spec 'H D M'" in msg, msg
    assert "Likely: dim 1 'D' is 3 per device" in msg


@pytest.mark.parametrize("run", RUNS)
def test_an_item_of_a_tuple_argument_is_named_by_its_index(run) -> None:
    ws = (normal(1, (16, 4)), normal(2, (16, 4)))
    msg = layout_error(in_a_tuple, run, ws)
    assert "einsum('B/d M, M F -> B/d F') operand 1 (ws[1], annotated f32['M/t F'])" in msg, msg
    assert "shardops.all_gather('M/t F -> M F', x)" in msg


def test_a_size_that_no_axis_explains_gets_no_guess() -> None:
    msg = layout_error(wrong_size, lambda f: f)
    assert "dim 1 'D': expected size 6 (D=6 is already bound), got 2" in msg
    assert "Likely" not in msg


def test_layout_hints_name_every_axis_of_the_same_size() -> None:
    def body(x: f32[b"B/d M/t"]) -> f32[b"B/d M/t"]:
        return shardops.psum("B M/t", x, axes="u")  # B is split over d (or u: same size)

    with jax.set_mesh(make_mesh((2, 2, 2), ("d", "t", "u"))):
        e = raised(lambda: typed_shard_map(body)(normal(0, (8, 16))), Exception)
    assert "Likely: dim 0 'B' is 4 per device, 2 times smaller than expected: the value is " in str(
        e
    ), str(e)
    assert "still split over 'd' (or 'u') on that dim" in str(e)


# ---------------------------------------------------------------------------------------------
# Tracebacks: the user's frames, as JAX shows its own
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("run", RUNS)
def test_traceback_of_a_body_error_shows_no_shardlib_frame(run) -> None:
    f = run(typed_shard_map(still_split))
    with jax.set_mesh(make_mesh((4, 2), ("d", "t"))):
        e = raised(lambda: f(normal(0, (8, 16)), weights()), TypeCheckError)
    assert not shardlib_frames(e), frame_files(e)
    files = frame_files(e)
    assert files[0] == __file__  # where the test called it
    assert files[-1] == __file__  # the body's line that made the failing op call
    assert getattr(e, RAISED_BY_SHARDLIB) is True


def test_traceback_of_a_forgotten_psum_and_of_a_decoration_error() -> None:
    with jax.set_mesh(make_mesh((4, 2), ("d", "t"))):
        e = raised(lambda: typed_shard_map(attn)(*attn_inputs()), PendingReductionError)
    assert not shardlib_frames(e), frame_files(e)

    def unannotated(x):  # noqa: ANN001 - the error under test
        return x

    e = raised(lambda: typed_shard_map(unannotated), TypeError)
    assert "parameter 'x' has no annotation" in str(e)
    assert not shardlib_frames(e), frame_files(e)


def test_an_error_of_the_users_own_code_keeps_its_frames() -> None:
    def body(x: f32[b"B/d"]) -> f32[b"B/d"]:
        raise ZeroDivisionError("the user's own")

    with jax.set_mesh(make_mesh((8,), ("d",))):
        e = raised(lambda: typed_shard_map(body)(jnp.zeros(8)), ZeroDivisionError)
    assert not shardlib_frames(e)
    assert traceback.extract_tb(e.__traceback__)[-1].name == "body"
    assert getattr(e, RAISED_BY_SHARDLIB) is False


def test_traceback_filtering_off_shows_every_frame() -> None:
    with filtering("off"), jax.set_mesh(make_mesh((4, 2), ("d", "t"))):
        e = raised(lambda: typed_shard_map(still_split)(normal(0, (8, 16)), weights()), Exception)
    files = shardlib_frames(e)
    assert any(f.endswith("_shard_map/decorator.py") for f in files), files
    assert any(f.endswith("_check/checking.py") for f in files), files


def test_tracebackhide_mode_marks_shardlibs_frames_instead() -> None:
    with filtering("tracebackhide"), jax.set_mesh(make_mesh((4, 2), ("d", "t"))):
        e = raised(lambda: typed_shard_map(still_split)(normal(0, (8, 16)), weights()), Exception)
    tb = e.__traceback__
    marked, ours = [], []
    while tb is not None:
        if str(Path(tb.tb_frame.f_code.co_filename).resolve()).startswith(SHARDLIB_DIR):
            ours.append(tb.tb_frame)
            marked.append(tb.tb_frame.f_locals.get("__tracebackhide__", False))
        tb = tb.tb_next
    assert ours and all(marked)


def test_traceback_of_a_typechecked_argument_error_shows_no_shardlib_frame() -> None:
    @typechecked
    def scale(x: f32[b"n"], y: f32[b"n"]) -> f32[b"n"]:
        return x * y

    e = raised(lambda: scale(jnp.zeros(4), jnp.zeros(5)), TypeCheckError)
    assert "n=4 is already bound" in str(e), str(e)
    assert not shardlib_frames(e), frame_files(e)
    assert set(frame_files(e)) == {__file__}  # only the test's own lines
    with filtering("off"):
        e = raised(lambda: scale(jnp.zeros(4), jnp.zeros(5)), TypeCheckError)
    assert any(f.endswith("_check/typechecked.py") for f in shardlib_frames(e))
