"""Every public name imports, and every public function or class documents an example."""

import inspect
from pathlib import Path

import pytest

import jax_extra
import shardlib
from shardlib import attention, moe, pipeline, sampling, shardops, shardtypes
from shardlib._check.types import DTYPES as _DTYPES

MODULES = [shardlib, shardtypes, shardops, pipeline, attention, moe, sampling, jax_extra]
# Annotation classes (f32, bf16, ...) are documented together in the API reference.
DTYPE_NAMES = {n for n in shardtypes.__all__ if n in _DTYPES}


def _public():
    for mod in MODULES:
        for name in mod.__all__:
            yield mod, name


@pytest.mark.parametrize("mod, name", list(_public()), ids=lambda v: getattr(v, "__name__", v))
def test_public_name_imports(mod, name):
    assert getattr(mod, name) is not None


@pytest.mark.parametrize(
    "mod, name",
    [
        (m, n)
        for m, n in _public()
        if n not in DTYPE_NAMES
        and (inspect.isfunction(getattr(m, n)) or inspect.isclass(getattr(m, n)))
    ],
    ids=lambda v: getattr(v, "__name__", v),
)
def test_public_callable_has_docstring_with_example(mod, name):
    obj = getattr(mod, name)
    doc = inspect.getdoc(obj) or ""
    assert doc.strip(), f"{mod.__name__}.{name} has no docstring"
    if inspect.isfunction(obj):
        assert "Example" in doc, f"{mod.__name__}.{name}'s docstring has no example"


# -- the contract: every public name's signature, as released ------------------------------

SNAPSHOT = Path(__file__).resolve().parent / "public_api.txt"


def _surface() -> list[str]:
    """One line per public name: ``module.name(signature)`` for functions and classes (the
    per-dtype annotation classes aside: which float8 types exist depends on JAX), else
    ``module.name: type``."""
    lines = []
    for mod in MODULES:
        for name in sorted(mod.__all__):
            if mod is shardtypes and name in DTYPE_NAMES:
                continue
            obj = getattr(mod, name)
            if inspect.isfunction(obj) or inspect.isclass(obj):
                try:
                    lines.append(f"{mod.__name__}.{name}{inspect.signature(obj)}")
                except (TypeError, ValueError):
                    lines.append(f"{mod.__name__}.{name}(no signature)")
            else:
                lines.append(f"{mod.__name__}.{name}: {type(obj).__name__}")
    return lines


def test_public_signatures_are_the_released_ones():
    """Every public function's and class's signature equals `tests/public_api.txt` (names,
    parameters, defaults, annotations): a refactoring keeps them; an intended change of the
    API edits the file in the same commit, so the diff shows it."""
    want = SNAPSHOT.read_text().splitlines()
    got = _surface()
    missing = sorted(set(want) - set(got))
    extra = sorted(set(got) - set(want))
    assert not missing and not extra, (
        f"the public API changed: removed or changed {missing}; added or changed {extra}; "
        "if intended, regenerate tests/public_api.txt (python -m tests.test_public_api)"
    )


if __name__ == "__main__":
    SNAPSHOT.write_text("\n".join(_surface()) + "\n")
