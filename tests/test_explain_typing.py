"""The explain guide as a user reads it: its code type-checks, and its promises hold.

- docs/static-typing.md promises that code written as the docs show passes pyright with zero
  errors: the ```python blocks of docs/guide/explain.md, run as one script, must too (they
  use ``compare_hlo(compiled.as_text())``, typed ``str | None`` by JAX, and the optional
  fields of the report).
- ``compare_hlo(None)`` says what to pass instead.
- An argument without a layout (a NumPy array, a ``jax.ShapeDtypeStruct`` with no
  ``sharding=``) is counted whole and a ``memory:`` line says so, as the guide's memory table
  states.
- ``short()`` of a program without collectives says so (no empty census).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import shardlib
from shardlib.shardtypes import Array, f32, typed_shard_map
from tests.test_docs_snippets import ROOT, python_blocks
from tests.test_static_typing import _diagnostics, _shown, needs_pyright

GUIDE = ROOT / "docs" / "guide" / "explain.md"


@pytest.mark.slow
@needs_pyright
def test_explain_guide_blocks_type_check(tmp_path):
    script = tmp_path / "explain_guide.py"
    script.write_text("\n\n".join(code for _, code in python_blocks(GUIDE)), encoding="utf-8")
    errors = _diagnostics(script)[str(script)]
    assert errors == [], f"pyright on the python blocks of {GUIDE.name}:\n{_shown(errors)}"


@typed_shard_map
def sine(x: f32[Array, b"batch/d in"]) -> f32[Array, b"batch/d in"]:
    return jnp.sin(x)


def test_compare_hlo_rejects_none_and_non_text():
    mesh = jax.make_mesh((8,), ("d",))
    with jax.set_mesh(mesh):
        x = jax.device_put(jnp.ones((16, 4)), NamedSharding(mesh, P("d")))
        report = shardlib.explain(sine, x)
        compiled = jax.jit(sine).lower(x).compile()
    with pytest.raises(
        ValueError, match=r"compare_hlo: hlo_text is None.*as_text\(dialect='hlo'\)"
    ):
        report.compare_hlo(None)
    with pytest.raises(TypeError, match=r"compare_hlo: hlo_text must be HLO text \(str\), got"):
        report.compare_hlo(compiled)  # type: ignore[arg-type]  # the object, not its text
    assert report.compare_hlo(compiled.as_text()).identical


def test_memory_is_always_estimated_with_optional_parts():
    with jax.set_mesh(jax.make_mesh((8,), ("d",))):
        x = jax.ShapeDtypeStruct((16, 4), jnp.float32, sharding=P("d"))
        report = shardlib.explain(sine, x)
    assert report.memory.arguments == 16 * 4 * 4 // 8
    assert report.memory.xla is None  # no compiled=
    assert report.mfu_ceiling() is None  # no hardware=
    assert not report.memory.caveats


@pytest.mark.parametrize("kind", ["ShapeDtypeStruct", "numpy"])
def test_argument_without_a_layout_is_counted_whole_and_said(kind):
    whole = jax.ShapeDtypeStruct((16, 4), jnp.float32)
    arg = whole if kind == "ShapeDtypeStruct" else np.ones((16, 4), np.float32)
    with jax.set_mesh(jax.make_mesh((8,), ("d",))):
        report = shardlib.explain(sine, arg)
    assert report.memory.arguments == 16 * 4 * 4  # whole, on every device
    lines = [ln for ln in str(report).splitlines() if ln.startswith("memory: ")]
    assert len(lines) == 1, str(report)
    # The line names the argument and what to do about its kind of value.
    fix = "give them sharding=" if kind == "ShapeDtypeStruct" else "device_put them"
    assert lines[0].startswith("memory: x: ") and "counted whole" in lines[0], lines
    assert fix in lines[0], lines


def test_short_without_collectives_has_no_empty_census():
    with jax.set_mesh(jax.make_mesh((8,), ("d",))):
        x = jax.ShapeDtypeStruct((16, 4), jnp.float32, sharding=P("d"))
        report = shardlib.explain(sine, x)
    assert report.collectives == []
    first = report.short().splitlines()[0]
    assert first == "sine: no collectives in the program", report.short()
    assert "in the program: )" not in report.short()
