"""The headline model, written once in roles, trained on meshes of other shapes and axis names.

``examples/transformer_model.py`` names roles after ``/`` (``B/batch``, ``M/fsdp``, ``K/tensor``,
``L/seq``); only the axis rules change with the mesh (``transformer_model.rules_for``). On each
mesh a few SGD steps must give, at every step, the loss of the unsharded reference
(``transformer_model.reference_loss``, plain ``jax.numpy`` on the same weights, the same SGD
steps): f32, rtol 1e-5.

On the ``(4, 2)`` ``('d', 't')`` mesh the compiled step must be today's physical-axis model's:
that model is the module's own source with every role replaced by the mesh axis it stood for
before (``B/batch`` and ``M/fsdp`` -> ``/d``, ``K/tensor`` -> ``/t``, ``L/seq`` -> ``L``; the
axis arguments ``axes="tensor"`` -> ``"t"``), imported from a temporary file, so there is no
second copy of the model. The two compiled steps are compared the way the benchmark's structure
check compares shardlib with the hand-written step (``benchmarks.structure.analyse``): the
collective census and traffic, ``cost_analysis``, ``memory_analysis`` and the canonical HLO text
(metadata, source tables and value names removed), plus the canonical jaxpr and StableHLO.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import jax
import numpy as np
import pytest

import shardlib
from examples import transformer_model as tm
from shardlib.shardtypes import Array, i32, make_shardings
from tests._mesh_util import make_mesh

# Splits over every mesh below: tensor <= 4 divides the 4 key/value heads, d_ff and vocab.
CONFIG = tm.Config(
    vocab=64, d_model=32, n_heads=8, n_kv_heads=4, d_head=4, d_ff=64, n_layers=2, seq_len=16
)
BATCH, STEPS, LR = 8, 3, 0.5

# Shapes and axis names; the rules of each are tm.rules_for(names).
MESHES = {
    "data2_fsdp2_tensor2": ((2, 2, 2), ("data", "fsdp", "tensor")),
    "fsdp8": ((8,), ("fsdp",)),
    "d4_t2": ((4, 2), ("d", "t")),
    "data2_tensor4": ((2, 4), ("data", "tensor")),
    "d2_c2_t2": ((2, 2, 2), ("d", "c", "t")),
    "one_device": ((1, 1), ("fsdp", "tensor")),
}


def _weights() -> tm.Model:
    return tm.init_model(CONFIG, jax.random.key(0, impl="rbg"))


def _tokens() -> np.ndarray:
    rng = np.random.default_rng(0)
    return rng.integers(0, CONFIG.vocab, size=(BATCH, CONFIG.seq_len), dtype=np.int32)


@functools.cache
def _reference_losses() -> tuple[float, ...]:
    """The loss before each of ``STEPS`` SGD steps, unsharded."""
    value_and_grad = jax.jit(jax.value_and_grad(tm.reference_loss), static_argnums=2)
    model, tokens, losses = _weights(), _tokens(), []
    for _ in range(STEPS):
        value, grads = value_and_grad(model, tokens, CONFIG)
        model = tm.sgd_update(model, grads, LR)
        losses.append(float(value))
    return tuple(losses)


def _sgd_step(module: ModuleType, model: Any, tokens: jax.Array) -> tuple[Any, jax.Array]:
    config = module.Config(**dataclasses.asdict(CONFIG))  # the module's own Config class
    value, grads = module.loss_and_grad(config, model, tokens)
    return module.sgd_update(model, grads, LR), value


def _step(module: ModuleType) -> Any:
    # A new function, so a new jit: jax.jit caches by function and argument layouts, not by
    # the axis rules in force, and each test traces under its own rules.
    return jax.jit(functools.partial(_sgd_step, module))


def _train(names: tuple[str, ...], shape: tuple[int, ...]) -> list[float]:
    """``STEPS`` SGD steps of the role model on this mesh under its rules; the losses."""
    mesh = make_mesh(shape, names)
    rules = tm.rules_for(mesh)
    with jax.set_mesh(mesh), shardlib.axis_rules(rules):
        model = tm.place_model(_weights())
        tokens = jax.device_put(_tokens(), make_shardings(i32[Array, b"B/batch L"]))
        step, losses = _step(tm), []
        for _ in range(STEPS):
            model, value = step(model, tokens)
            losses.append(float(value))
    # The weights stay split as the rules say: over every axis of fsdp and tensor.
    split = math.prod(mesh.shape[a] for r in ("fsdp", "tensor") for a in rules[r] or ())
    for path, w in jax.tree_util.tree_leaves_with_path(model):
        assert w.addressable_shards[0].data.size * split == w.size, jax.tree_util.keystr(path)
    return losses


def _check(losses: list[float]) -> None:
    ref = _reference_losses()
    assert ref[-1] < ref[0] - 0.1, ref  # the steps learn something: the comparison means it
    np.testing.assert_allclose(losses, ref, rtol=1e-5)


def test_rules_for_reads_the_roles_off_the_axis_names():
    assert tm.rules_for(("d", "t")) == {"batch": ("d",), "fsdp": ("d",), "tensor": ("t",),
                                        "seq": None, "stage": None}  # fmt: skip
    assert tm.rules_for(("data", "fsdp", "tensor"))["batch"] == ("data", "fsdp")
    assert tm.rules_for(("fsdp",))["tensor"] is None
    assert tm.rules_for(("d", "c", "t"))["seq"] == ("c",)
    assert tm.rules_for(("d", "c", "t"))["fsdp"] == ("d", "c")  # weights split over c too
    assert tm.rules_for(("p", "d", "t")) == {**tm.rules_for(("d", "t")), "stage": ("p",)}
    with pytest.raises(ValueError, match=r"rules_for: .*'fsdp' is itself an axis of the mesh"):
        tm.rules_for(("d", "fsdp"))


@pytest.mark.slow  # about 10 s; tests/test_axis_rules.py trains a small model fast
def test_trains_on_data_fsdp_tensor_like_the_reference():
    """The fast case: three axes of other names, the batch split over two of them."""
    shape, names = MESHES["data2_fsdp2_tensor2"]
    _check(_train(names, shape))


@pytest.mark.slow
@pytest.mark.parametrize("mesh", [m for m in MESHES if m != "data2_fsdp2_tensor2"])
def test_trains_on_every_mesh_like_the_reference(mesh):
    shape, names = MESHES[mesh]
    _check(_train(names, shape))


# ---------------------------------------------------------------------------------------------
# The compiled step on (4, 2) equals today's physical-axis model's.
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def physical() -> Iterator[ModuleType]:
    """The model's source with every role replaced by the ('d', 't') mesh axes of today
    (`benchmarks.roles_cost.physical_model`, shared with the benchmark), as a module."""
    from benchmarks.roles_cost import physical_model

    module = physical_model(tm.rules_for(("d", "t")))
    try:
        yield module
    finally:
        del sys.modules[module.__name__]


def _analysis(module: ModuleType, rules: dict[str, Any]) -> dict[str, Any]:
    from benchmarks.structure import analyse

    mesh = make_mesh((4, 2), ("d", "t"))
    with jax.set_mesh(mesh), shardlib.axis_rules(rules):
        model = module.place_model(module.init_model(CONFIG, jax.random.key(0, impl="rbg")))
        tokens = jax.device_put(_tokens(), make_shardings(i32[Array, b"B/d L"]))
        traced = _step(module).trace(model, tokens)
        lowered = traced.lower()
        return analyse(traced, lowered, lowered.compile())


def _same(a: dict[str, Any], b: dict[str, Any]) -> dict[str, bool]:
    same = {k: a[k] == b[k] for k in ("census", "traffic", "cost", "memory")}
    same.update({k: a["_texts"][k] == b["_texts"][k] for k in ("hlo", "lowered", "jaxpr")})
    return same


@pytest.fixture(scope="module")
def physical_step(physical) -> dict[str, Any]:
    source = Path(physical.__file__).read_text()
    assert not re.search(r"\b[A-Z]/(batch|fsdp|tensor|seq)\b", source)  # no role left
    # The physical model runs under no roles at all: empty rules (with none in force its
    # entry points would put rules_for(mesh) in force).
    return _analysis(physical, {})


@pytest.mark.slow
def test_compiled_step_on_4x2_is_the_physical_models(physical_step):
    got = _analysis(tm, tm.rules_for(("d", "t")))
    assert physical_step["census"], physical_step  # it communicates: the check means something
    same = _same(got, physical_step)
    assert same == dict.fromkeys(same, True), same


@pytest.mark.slow
def test_a_wrong_rule_changes_the_compiled_step(physical_step):
    """The control: with tensor -> None on the same mesh, the program differs."""
    got = _analysis(tm, {**tm.rules_for(("d", "t")), "tensor": None})
    same = _same(got, physical_step)
    assert not same["census"] and not same["hlo"], same


# ---------------------------------------------------------------------------------------------
# examples/transformer.py --mesh: other shapes and axis names by switching rules only.
# ---------------------------------------------------------------------------------------------

try:
    from examples import transformer as T
except ImportError:  # the `examples` extra (optax) is not installed
    T = None  # type: ignore[assignment]
needs_optax = pytest.mark.skipif(T is None, reason="needs the examples extra (optax)")

TINY = [
    "--d-model", "32", "--layers", "2", "--heads", "16", "--kv-heads", "8", "--d-head", "4",
    "--d-ff", "64", "--vocab", "64", "--seq-len", "16", "--batch", "8",
    "--steps", "16", "--warmup", "2", "--lr", "1e-2", "--log-every", "1", "--seed", "3",
]  # fmt: skip


@needs_optax
def test_mesh_flag_forms():
    assert T is not None
    assert T.parse_mesh("4x2") == (("d", "t"), (4, 2))
    assert T.parse_mesh("8") == (("fsdp",), (8,))
    assert T.parse_mesh("1x1") == (("d", "t"), (1, 1))
    assert T.parse_mesh("2x2x2") == (("d", "c", "t"), (2, 2, 2))  # context parallel, as before
    want = (("data", "fsdp", "tensor"), (2, 2, 2))
    assert T.parse_mesh("data=2,fsdp=2,tensor=2") == want
    assert T.role_sizes(*want) == {"batch": 4, "fsdp": 2, "tensor": 2, "seq": 1, "stage": 1}
    with pytest.raises(SystemExit, match=r"--mesh 'dta=2': axis names .* got dta"):
        T.parse_mesh("dta=2")
    with pytest.raises(SystemExit, match=r"--mesh must be N, DxT, DxCxT or name=size"):
        T.parse_mesh("2x2x2x1")
    with pytest.raises(SystemExit, match=r"--batch 6 is not a multiple of 4 \(the batch is "):
        T.main([*TINY[:-2], "--batch", "6", "--mesh", "data=2,fsdp=2,tensor=2"])


@pytest.fixture(scope="module")
def default_mesh_run() -> dict[str, Any]:
    assert T is not None
    return T.main([*TINY, "--mesh", "4x2", "--stop-after", "3"])


@needs_optax
@pytest.mark.slow
@pytest.mark.parametrize("mesh", ["8", "data=2,fsdp=2,tensor=2", "1x1"])
def test_example_trains_the_same_on_other_meshes(mesh, default_mesh_run):
    assert T is not None
    got = T.main([*TINY, "--mesh", mesh, "--stop-after", "3"])
    want = default_mesh_run
    np.testing.assert_allclose(got["losses"], want["losses"], rtol=2e-5)
    np.testing.assert_allclose(got["grad_norms"], want["grad_norms"], rtol=2e-5)
