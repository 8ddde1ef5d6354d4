"""Which of this JAX's primitives the partial-sum analysis and explain know (issue 51 item 7).

The analysis (`shardlib._analysis.walk`) refuses a partial sum that reaches a primitive it
has no rule for ("is not linear (or not known to be)"): safe, but a new JAX that emits a new
primitive for an old linear operation turns accepted programs into refusals (JAX 0.12's
``unstack``, which ``list(y)`` binds). explain reports only the collectives it knows: a new
collective would be silently left out of the report. So the primitives each has no rule for
are listed here, per JAX version, and a JAX whose list differs fails with the new names.

This JAX's primitives: every ``jax.extend.core.Primitive`` alive after importing jax, its
public modules and shardlib, in a fresh interpreter (the tests' own imports do not change the
list). Its communicating primitives: those of its module of collectives
(``jax._src.lax.parallel``; private, read here only) but the type casts and ``axis_index``.
JAX 0.12's "hijax" primitives (``jnp.ldexp``, ``frexp``, ``searchsorted``...) all bind one
primitive, ``call_hi_primitive``, listed below.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from jax import lax

import shardlib
from shardlib._analysis.nonlinear import NOT_LINEAR
from shardlib._analysis.rules import RULES
from shardlib._analysis.walk import primitives_with_rules
from shardlib._env.collectives import NOT_COMMUNICATING
from shardlib._explain.walk import COLLECTIVE_PRIMITIVES
from shardlib.shardtypes import f32, typed_shard_map
from tests._mesh_util import make_mesh

ROOT = Path(__file__).resolve().parent.parent
JAX = jax.__version_info__[:2]


def _names(text: str) -> frozenset[str]:
    return frozenset(text.split())


# -- what the analysis has no rule for (it refuses a partial sum there), per JAX version -------

# Callbacks, effects and debugging; mutable references; calls and transformations (their
# bodies are followed as `walk._unknown` follows any body); layout and memory placement;
# opaque kernels (cuDNN, FFI, exported functions); collectives without a rule; shape checks.
_WITHOUT_RULE_IN_ALL = _names("""
    debug_callback debug_print inspect_sharding io_callback pure_callback
    accum_grad_in_ref addupdate broadcast_to freeze get new_ref pin swap tie unpin run_state
    composite create_linear custom_jvp_call_jaxpr custom_lin custom_linear_solve
    custom_partitioning custom_vmap_call linear_call remat_opt
    layout_constraint call_exported cudnn_fusion ffi_call ragged_dot_general scaled_matmul
    scaled_matmul_wrapper dot_product_attention_bwd dot_product_attention_bwd_wrapper
    dot_product_attention_fp8_bwd dot_product_attention_fp8_bwd_wrapper
    dot_product_attention_fp8_fwd dot_product_attention_fp8_fwd_wrapper
    dot_product_attention_fwd dot_product_attention_fwd_wrapper
    precv psend ragged_all_to_all select_and_scatter
    dce_sink from_edtype to_edtype shape_assertion unreachable zeros_like
""")
# Asynchronous collectives (JAX 0.10 and later: ``jax.lax.psum_scatter_start`` in 0.12).
_ASYNC = _names("""
    all_gather_done all_gather_reduced_start all_gather_start all_to_all_done all_to_all_start
    ppermute_done ppermute_start psum_done psum_invariant_start reduce_scatter_done
    reduce_scatter_start
""")
_NEWER = _names("""
    call_hi_primitive call_hi_primitive_linearized check empty_ref free_ref scaled_dot stage
    with_memory_space_constraint
""")
WITHOUT_RULE: dict[tuple[int, int], frozenset[str]] = {
    (0, 9): _WITHOUT_RULE_IN_ALL
    | _names("call custom_transpose_call full_to_shard pgather shard_to_full xla_pmap"),
    (0, 10): _WITHOUT_RULE_IN_ALL
    | _ASYNC
    | _NEWER
    | _names("""
        call core_map box_get box_set new_box log_extend log_read new_log pbroadcast_done
        pbroadcast_start psum_start unreduced_psum_start unreduced_reduce_scatter_start
    """),
    (0, 12): _WITHOUT_RULE_IN_ALL | _ASYNC | _NEWER | _names("relayout"),
}

# -- the communicating primitives explain does not report, per JAX version ----------------------

NOT_REPORTED: dict[tuple[int, int], frozenset[str]] = {
    (0, 9): _names("pgather precv psend"),
    (0, 10): _names("precv psend pbroadcast_done pbroadcast_start psum_start")
    | _names("unreduced_psum_start unreduced_reduce_scatter_start")
    | _ASYNC,
    (0, 12): _names("precv psend") | _ASYNC,
}

_PROBE = """
import gc, json, sys
import jax, jax.numpy, jax.lax, jax.nn, jax.random, jax.ad_checkpoint
import jax.scipy.linalg, jax.scipy.special, jax.scipy.signal
import shardlib
from jax.extend.core import Primitive
names = lambda objs: sorted({o.name for o in objs if isinstance(o, Primitive)})
parallel = sys.modules.get("jax._src.lax.parallel")
print(json.dumps({
    "all": names(gc.get_objects()),
    "parallel": None if parallel is None else names(vars(parallel).values()),
}))
"""


@functools.cache
def _primitives() -> dict[str, list[str] | None]:
    """This JAX's primitives, and those of its collectives' module (None: no such module)."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    out = subprocess.run(
        [sys.executable, "-c", _PROBE], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.splitlines()[-1])


def _expected(table: dict[tuple[int, int], frozenset[str]]) -> tuple[str, frozenset[str]]:
    """The list for this JAX, or (a JAX not listed) the newest one's before it."""
    known = max((v for v in table if v <= JAX), default=min(table))
    return ".".join(map(str, known)), table[known]


def _differs(what: str, listed: str, got: set[str], want: frozenset[str], fix: str) -> str:
    new, gone = sorted(got - want), sorted(want - got)
    return (
        f"JAX {jax.__version__}: {what} differ from the list for JAX {listed} "
        f"(tests/test_primitive_coverage.py). New: {new or 'none'}; no longer there (or now "
        f"known): {gone or 'none'}. {fix}, then write this JAX's list under "
        f"{tuple(JAX)!r} in this file"
    )


def test_every_primitive_the_analysis_has_no_rule_for_is_listed_for_this_jax() -> None:
    got = set(_primitives()["all"] or ()) - primitives_with_rules()
    listed, want = _expected(WITHOUT_RULE)
    assert got == want, _differs(
        "the primitives the partial-sum analysis has no rule for",
        listed,
        got,
        want,
        "Give each new one a rule (shardlib/_analysis/rules*.py: linear, a collective, a "
        "layout change...) with a test, or list it in shardlib/_analysis/nonlinear.py if it "
        "is not linear",
    )


def test_every_collective_explain_does_not_report_is_listed_for_this_jax() -> None:
    parallel = _primitives()["parallel"]
    assert parallel is not None, (
        f"JAX {jax.__version__} has no module jax._src.lax.parallel: find where its "
        "collectives moved and read them there"
    )
    got = set(parallel) - NOT_COMMUNICATING - COLLECTIVE_PRIMITIVES
    listed, want = _expected(NOT_REPORTED)
    assert got == want, _differs(
        "the communicating primitives explain does not report",
        listed,
        got,
        want,
        "Map each new collective to its HLO kind in shardlib/_explain/walk.py's _KINDS (and "
        "give it an analysis rule), or add a type cast to NOT_COMMUNICATING "
        "(shardlib/_env/collectives.py)",
    )


def test_the_analysis_tables_are_disjoint_and_its_known_set_is_theirs() -> None:
    """A primitive is either ruled or known not linear, never both (a rule would win)."""
    assert not NOT_LINEAR & set(RULES), sorted(NOT_LINEAR & set(RULES))
    assert NOT_LINEAR | set(RULES) <= primitives_with_rules()
    assert {"unstack", "scatter-sub", "complex", "pbroadcast"} <= set(RULES)


# -- explain reports the collectives it now knows -----------------------------------------------


def _report(body, *args):
    with jax.set_mesh(make_mesh((4, 2), ("d", "t"))):
        return shardlib.explain(typed_shard_map(body), *args)


X = np.arange(64, dtype=np.float32).reshape(8, 8)


def broadcast_int(x: f32[b"B/d M/t"]) -> f32[b"B/d M/t"]:
    return lax.pbroadcast(x, "d", 0)


def broadcast_traced(x: f32[b"B/d M/t"]) -> f32[b"B/d M/t"]:
    return lax.pbroadcast(x, "d", jax.numpy.int32(0) + 0 * lax.axis_index("d"))


@pytest.mark.parametrize(
    "body,primitive",
    [
        (broadcast_int, "pbroadcast"),
        pytest.param(
            broadcast_traced,
            "pbroadcast_dynamic",
            marks=pytest.mark.skipif(JAX < (0, 12), reason="JAX 0.12"),
        ),
    ],
)
def test_explain_reports_a_collective_broadcast(body, primitive: str) -> None:
    (row,) = _report(body, X).collectives
    block = (8 // 4) * (8 // 2) * 4  # a device's f32 block, in bytes: what the source sends
    assert (row.kind, row.primitive, row.axes, row.group) == (
        "collective-broadcast",
        primitive,
        ("d",),
        4,
    )
    assert (row.operand_bytes, row.sent_bytes) == (block, block)


def ragged_exchange(x: f32[b"B/d M"]) -> f32[b"B/d M"]:
    offsets = jax.numpy.zeros((4,), jax.numpy.int32)
    sizes = offsets.at[0].set(1)  # one row to device 0 of 'd'
    return lax.ragged_all_to_all(
        x, jax.numpy.zeros_like(x), offsets, sizes, offsets, sizes, axis_name="d"
    )


def test_explain_reports_a_ragged_all_to_all() -> None:
    (row,) = _report(ragged_exchange, X).collectives
    assert (row.kind, row.primitive, row.axes, row.group) == (
        "ragged-all-to-all",
        "ragged_all_to_all",
        ("d",),
        4,
    )
    assert row.operand_bytes == (8 // 4) * 8 * 4
