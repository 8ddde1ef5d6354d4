"""Every public name imports, and every public function or class documents an example."""

import inspect

import pytest

import jax_extra
import shardlib
from shardlib import attention, moe, pipeline, shardops, shardtypes
from shardlib._check.types import DTYPES as _DTYPES

MODULES = [shardlib, shardtypes, shardops, pipeline, attention, moe, jax_extra]
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
