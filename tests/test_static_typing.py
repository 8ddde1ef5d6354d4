"""Static typing: pyright accepts code written the way the docs show, and still catches errors.

Runs pyright (the venv's, else the one on PATH) on ``tests/typing_sample/user_model.py``, on
a file in the documented ``str`` spelling, and on a file of deliberate mistakes whose errors
it must report. The sample also runs, against a NumPy reference.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
SAMPLE = ROOT / "tests" / "typing_sample" / "user_model.py"

# The documented spelling: str specs after the array type, Stacked for stacks, frozen and
# keyword options on pytree_dataclass, the three forms of typed_shard_map (bare, called with
# options, and JAX's ``functools.partial`` idiom).
GOOD = """
from functools import partial

import jax
import jax.numpy as jnp

from shardlib import shardops
from shardlib.shardtypes import (
    Array, Stacked, bf16, f32, i32, make_shardings, pytree_dataclass, typed_shard_map,
)


@pytree_dataclass
class Layer:
    w: f32[Array, "in out/d"]
    b: bf16[Array, "out"]


@pytree_dataclass(frozen=True, keys="attr")
class Model:
    layers: Stacked[Layer, "layers"]
    embed: f32[Array, "V in"]


@typed_shard_map
def apply(x: f32[Array, "batch/d in"], w: Layer) -> f32[Array, "batch/d out"]:
    w_out = shardops.all_gather("in out/d -> in out", w.w)
    return shardops.einsum_unreduced("batch/d in, in out -> batch/d out", x, w_out)


@typed_shard_map(static_argnames=("scale",))
def scaled(x: f32[Array, "batch/d"], scale: float) -> f32[Array, "batch/d"]:
    return x * scale


@partial(typed_shard_map, check_rep=False, static_argnames="scale")
def shifted(x: f32[Array, "batch/d"], scale: float) -> f32[Array, "batch/d"]:
    return x + scale


def use(model: Model, tokens: i32[Array, "batch"]) -> jax.Array:
    first: Layer = jax.tree.map(lambda a: a[0], model.layers)
    y: jax.Array = apply(model.embed[tokens], first)
    specs = make_shardings(Model)
    del specs
    return shifted(scaled(jnp.sum(y, axis=1), 2.0), 1.0)
"""

# Each line marked `# error: <text>` must get an error whose message contains <text>.
BAD = """
from functools import partial

import jax

from shardlib.shardtypes import Array, Stacked, f32, pytree_dataclass, typed_shard_map


@pytree_dataclass
class Layer:
    w: f32[Array, "a b"]


@pytree_dataclass
class Model:
    layers: Stacked[Layer, "layers"]


@typed_shard_map
def f(x: f32[Array, "batch/d a"]) -> f32[Array, "batch/d"]:
    return x.sum(1)


@partial(typed_shard_map, check_rep=False)
def g(x: f32[Array, "batch/d a"]) -> f32[Array, "batch/d"]:
    return x.sum(1)


y = f(3)  # error: "Literal[3]" cannot be assigned to parameter "x"
n: int = f(jax.numpy.zeros(3))  # error: "Array" is not assignable to declared type "int"
Layer(1.0)  # error: "float" cannot be assigned to parameter "w"
Layer(jax.numpy.zeros(3), jax.numpy.zeros(3))  # error: Expected 1 positional argument
Model(layers=jax.numpy.zeros(3))  # error: "Array" cannot be assigned to parameter "layers"
z: str = g(jax.numpy.zeros(3))  # error: "Array" is not assignable to declared type "str"
"""


def _pyright() -> str | None:
    here = Path(sys.executable).parent / ("pyright.exe" if os.name == "nt" else "pyright")
    return str(here) if here.exists() else shutil.which("pyright")


PYRIGHT = _pyright()
needs_pyright = pytest.mark.skipif(
    PYRIGHT is None,
    reason="pyright is not installed (pip install -e '.[dev]' installs it)",
)


def _diagnostics(*files: Path) -> dict[str, list[dict]]:
    """pyright's errors per file (run from the repository root, so it reads pyproject.toml)."""
    cmd = [PYRIGHT, "--outputjson", "--pythonpath", sys.executable, *map(str, files)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    try:
        report = json.loads(proc.stdout)
    except json.JSONDecodeError:
        pytest.fail(f"pyright gave no JSON report (exit {proc.returncode}): {proc.stderr}")
    out: dict[str, list[dict]] = {str(f): [] for f in files}
    for d in report["generalDiagnostics"]:
        if d["severity"] == "error":
            out.setdefault(d["file"], []).append(d)
    return out


def _shown(diags: list[dict]) -> str:
    return "\n".join(f"{d['range']['start']['line'] + 1}: {d['message']}" for d in diags)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("typing")
    good, bad = tmp / "good.py", tmp / "bad.py"
    good.write_text(textwrap.dedent(GOOD))
    bad.write_text(textwrap.dedent(BAD))
    diags = _diagnostics(SAMPLE, good, bad)
    return {"sample": diags[str(SAMPLE)], "good": diags[str(good)], "bad": diags[str(bad)]}


@pytest.mark.slow
@needs_pyright
def test_sample_has_no_type_errors(results):
    assert results["sample"] == [], _shown(results["sample"])


@pytest.mark.slow
@needs_pyright
def test_documented_str_spelling_has_no_type_errors(results):
    assert results["good"] == [], _shown(results["good"])


@pytest.mark.slow
@needs_pyright
def test_pyright_reports_each_deliberate_mistake(results):
    lines = textwrap.dedent(BAD).splitlines()
    expected = {
        i + 1: line.split("# error: ", 1)[1] for i, line in enumerate(lines) if "# error: " in line
    }
    got: dict[int, list[str]] = {}
    for d in results["bad"]:
        got.setdefault(d["range"]["start"]["line"] + 1, []).append(" ".join(d["message"].split()))
    for line, text in expected.items():
        assert any(text in m for m in got.get(line, [])), (
            f"line {line} ({lines[line - 1].strip()}): expected an error containing {text!r}, "
            f"pyright said: {got.get(line)}"
        )
    unexpected = sorted(set(got) - set(expected))
    assert not unexpected, {n: got[n] for n in unexpected}


@pytest.mark.slow
def test_sample_runs_and_matches_numpy():
    from tests.typing_sample import user_model

    err = user_model.main()
    assert np.isfinite(err) and err < 1e-4, err
