"""Which tier this run is (not collected by pytest): property tests size themselves by it.

`tests/conftest.py` sets `RUNSLOW` from ``--runslow`` before any test module is imported.
A property test written ``@settings(max_examples=examples(20))`` draws 20 examples in a run
with the slow tier (`.ci/run` runs it on the newest JAX) and a tenth of them, at least 2, in the
fast tier alone: the same property, its first cases on every change, all of them in CI.

`JAX_VERSION_FILES` are the test files whose outcome can change with JAX's version: the
adapter over jaxprs and HLO, the partial-sum analysis, explain and its equality with the
compiled HLO, shard_map layouts and the typed_shard_map/shardops emission, JAX's own
unreduced/reduced types, the XLA flags each jaxlib must know, and the multi-process runs
(jax.distributed, gloo). `tests/conftest.py` marks their tests ``jax_version``; CI runs them,
both tiers, on every JAX it tests (`noxfile.py`), and the other files' slow tier once, on the
JAX the README's command installs. The rest (the spec language, the pure-Python schedules and
cost models, the plan's enumeration, the docs pages, examples and benchmarks) composes the
same JAX APIs that these files check on each version.
"""

RUNSLOW = False


def examples(n: int) -> int:
    """``n`` with the slow tier, else ``max(2, n // 10)``."""
    return n if RUNSLOW else max(2, n // 10)


JAX_VERSION_FILES = (
    "tests/test_programs.py",
    "tests/test_hlo.py",
    "tests/test_jax_types.py",
    "tests/test_jax_type_args.py",
    "tests/test_pending.py",
    "tests/test_pending_control.py",
    "tests/test_pending_holes.py",
    "tests/test_pending_rings.py",
    "tests/test_pending_primitives.py",
    "tests/test_primitive_coverage.py",
    "tests/test_explain.py",
    "tests/test_explain_xla.py",
    "tests/test_explain_schedules.py",
    "tests/test_explain_abstract.py",
    "tests/test_attention_decode.py",
    "tests/test_plan_strategies.py",
    "tests/test_calibrate.py",
    "tests/test_plan_screen.py",
    "tests/test_shard_map.py",
    "tests/test_shardops.py",
    "tests/test_layout_holes.py",
    "tests/test_branch_collectives.py",
    "tests/test_pipeline_split.py",
    "tests/test_seqax_compat.py",
    "tests/test_jax_extra.py",
    "tests/test_xla_flags.py",
    "tests/test_multiprocess.py",
    "tests/test_pipeline_multiprocess.py",
)
