"""Tests for jax_extra: explicit activation checkpointing, fold_in_str, make_dataclass_from_dict."""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import re
from collections.abc import Sequence
from typing import Any, Literal, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.ad_checkpoint import checkpoint_name, print_saved_residuals

from jax_extra import (
    DataclassFromDictError,
    UnknownKeyWarning,
    explicit_activation_checkpointing,
    fold_in_str,
    make_dataclass_from_dict,
    save_for_backward,
)
from tests._tiers import examples

# ---------------------------------------------------------------------------------------------
# explicit_activation_checkpointing / save_for_backward
# ---------------------------------------------------------------------------------------------


def _saved_residuals(capsys: pytest.CaptureFixture[str], f, *args) -> list[str]:
    """Lines printed by `jax.ad_checkpoint.print_saved_residuals`, one per saved value.

    Each line looks like `f32[4,8] from the argument x`, `f32[4,8] named 'name' from file:line (f)`
    or `f32[4,8] output of tanh from file:line (f)`.
    """
    capsys.readouterr()  # drop anything printed before
    print_saved_residuals(f, *args)
    return [line for line in capsys.readouterr().out.splitlines() if line.strip()]


def _marked(line: str) -> bool:
    """A saved value marked by save_for_backward (its source is the marking call).

    jax >= 0.10 prints `named 'jax_extra.save_for_backward' from ...`; older releases print
    `output of reduce_precision from ...`; both end with the function name.
    """
    return line.rstrip().endswith("(save_for_backward)")


def _unmarked_intermediates(lines: list[str]) -> list[str]:
    return [ln for ln in lines if "from the argument" not in ln and not _marked(ln)]


def _args():
    kx, k1, k2 = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (4, 8))
    w1 = jax.random.normal(k1, (8, 16)) / 8
    w2 = jax.random.normal(k2, (16, 8)) / 16
    return x, w1, w2


def _two_layers_marked(x, w1, w2):
    h = save_for_backward(jnp.tanh(x @ w1))  # f32[4,16]: saved
    y = jnp.tanh(h @ w2)  # f32[4,8]: not marked, recomputed
    return jnp.sum(y * y)


def _two_layers_unmarked(x, w1, w2):
    h = jnp.tanh(x @ w1)
    y = jnp.tanh(h @ w2)
    return jnp.sum(y * y)


def test_undecorated_function_saves_intermediates(capsys):
    # Baseline showing the residual listing is meaningful: plain autodiff keeps intermediates.
    lines = _saved_residuals(capsys, _two_layers_unmarked, *_args())
    assert any("output of" in line for line in lines), lines


def test_saves_exactly_arguments_and_marked_values(capsys):
    f = explicit_activation_checkpointing(_two_layers_marked)
    lines = _saved_residuals(capsys, f, *_args())
    assert sorted(lines[:3]) == sorted(
        [
            "f32[4,8] from the argument x",
            "f32[8,16] from the argument w1",
            "f32[16,8] from the argument w2",
        ]
    )
    rest = lines[3:]
    assert len(rest) == 1, lines
    assert _marked(rest[0]) and rest[0].startswith("f32[4,16] "), rest
    assert not _unmarked_intermediates(lines), lines


def test_nothing_marked_saves_only_arguments(capsys):
    f = explicit_activation_checkpointing(_two_layers_unmarked)
    lines = _saved_residuals(capsys, f, *_args())
    assert sorted(lines) == sorted(
        [
            "f32[4,8] from the argument x",
            "f32[8,16] from the argument w1",
            "f32[16,8] from the argument w2",
        ]
    )


def test_save_for_backward_pytree(capsys):
    @explicit_activation_checkpointing
    def f(x, w1, w2):
        a, b = save_for_backward((jnp.sin(x @ w1), jnp.cos(x @ w1)))
        c = jnp.tanh((a * b) @ w2)  # not marked
        return jnp.sum(c)

    lines = _saved_residuals(capsys, f, *_args())
    named = [line for line in lines if _marked(line)]
    assert len(named) == 2 and all(line.startswith("f32[4,16] ") for line in named), lines
    assert len(lines) == 5  # 3 arguments + 2 marked values
    assert not _unmarked_intermediates(lines), lines


def test_save_for_backward_is_identity():
    x = jnp.arange(6.0).reshape(2, 3)
    np.testing.assert_array_equal(save_for_backward(x), x)
    tree = {"a": x, "b": (x + 1,)}
    out = save_for_backward(tree)
    assert jax.tree.structure(out) == jax.tree.structure(tree)
    for got, want in zip(jax.tree.leaves(out), jax.tree.leaves(tree), strict=True):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("body", [_two_layers_marked, _two_layers_unmarked])
def test_values_and_gradients_match_undecorated(body):
    args = _args()
    f = explicit_activation_checkpointing(body)
    want_val, want_grads = jax.value_and_grad(body, argnums=(0, 1, 2))(*args)
    got_val, got_grads = jax.value_and_grad(f, argnums=(0, 1, 2))(*args)
    np.testing.assert_allclose(got_val, want_val, rtol=1e-6)
    for got, want in zip(got_grads, want_grads, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_gradients_match_under_jit():
    args = _args()
    f = explicit_activation_checkpointing(_two_layers_marked)
    want = jax.grad(_two_layers_marked, argnums=(1, 2))(*args)
    got = jax.jit(jax.grad(f, argnums=(1, 2)))(*args)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


def test_decorator_with_static_argnums(capsys):
    @explicit_activation_checkpointing(static_argnums=(2,))
    def stack(x, w, n_layers: int):
        for i in range(n_layers):
            x = jnp.tanh(x @ w)
            if i < n_layers - 1:  # marks the inputs of the next matmul
                x = save_for_backward(x)
        return jnp.sum(x)

    def reference(x, w, n_layers):
        for _ in range(n_layers):
            x = jnp.tanh(x @ w)
        return jnp.sum(x)

    x = jnp.ones((2, 8)) / 3
    w = jnp.eye(8) * 0.9
    np.testing.assert_allclose(
        jax.grad(stack, argnums=1)(x, w, 3), jax.grad(reference, argnums=1)(x, w, 3), rtol=1e-5
    )
    lines = _saved_residuals(capsys, lambda x, w: stack(x, w, 3), x, w)
    # The outputs of layers 0 and 1 are marked and saved; layer 2 is recomputed.
    assert sum(_marked(line) for line in lines) == 2, lines
    assert not _unmarked_intermediates(lines), lines


def test_decorator_with_empty_parentheses_and_static_argnames():
    @explicit_activation_checkpointing()
    def f(x):
        return jnp.sum(jnp.sin(x))

    @explicit_activation_checkpointing(static_argnames="power")
    def g(x, *, power: int):
        return jnp.sum(x**power)

    x = jnp.arange(3.0)
    np.testing.assert_allclose(jax.grad(f)(x), jnp.cos(x), rtol=1e-6)
    np.testing.assert_allclose(jax.grad(lambda x: g(x, power=3))(x), 3 * x**2, rtol=1e-6)


def test_wraps_metadata():
    def my_layer(x):
        """My docstring."""
        return x

    f = explicit_activation_checkpointing(my_layer)
    assert f.__name__ == "my_layer"
    assert f.__doc__ == "My docstring."
    assert f.__wrapped__ is my_layer  # type: ignore[attr-defined]


def test_non_callable_raises():
    with pytest.raises(TypeError, match="expects a callable"):
        explicit_activation_checkpointing((1,))  # type: ignore[call-overload]
    with pytest.raises(TypeError, match=r"only_save_for_backward=\.\.\.\) takes True or False"):
        explicit_activation_checkpointing(only_save_for_backward="yes")  # type: ignore[call-overload]


def _marked_and_named(x, w1, w2):
    h = save_for_backward(jnp.tanh(x @ w1))  # f32[4,16], marked
    g = checkpoint_name(jnp.sin(h @ w2), "library_name")  # f32[4,8], named by other code
    return jnp.sum(jnp.tanh(g @ w2.T))  # the tanh output, f32[4,16], is recomputed


def test_default_saves_every_named_value_as_seqax(capsys):
    # seqax's policy is save_any_names_but_these(): a value named by any checkpoint_name is kept.
    lines = _saved_residuals(capsys, explicit_activation_checkpointing(_marked_and_named), *_args())
    intermediates = [ln for ln in lines if "from the argument" not in ln]
    assert len(lines) == 5 and len(intermediates) == 2, lines
    assert sum(_marked(ln) for ln in intermediates) == 1, lines
    # The value named with checkpoint_name (JAX before 0.10 prints it without its name).
    assert [ln for ln in intermediates if not _marked(ln)][0].startswith("f32[4,8] "), lines


def test_only_save_for_backward_saves_only_marked_values(capsys):
    f = explicit_activation_checkpointing(only_save_for_backward=True)(_marked_and_named)
    lines = _saved_residuals(capsys, f, *_args())
    intermediates = [ln for ln in lines if "from the argument" not in ln]
    assert len(lines) == 4 and len(intermediates) == 1, lines
    assert _marked(intermediates[0]) and intermediates[0].startswith("f32[4,16] "), lines
    # Both policies compute the same values and gradients as the undecorated function.
    args = _args()
    want = jax.value_and_grad(_marked_and_named, argnums=(0, 1, 2))(*args)
    for g in (f, explicit_activation_checkpointing(_marked_and_named)):
        got = jax.value_and_grad(g, argnums=(0, 1, 2))(*args)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# fold_in_str
# ---------------------------------------------------------------------------------------------

KEY_MAKERS = [
    pytest.param(jax.random.PRNGKey, id="raw-uint32"),
    pytest.param(jax.random.key, id="typed"),
]


def _data(key) -> np.ndarray:
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.key_data(key)
    return np.asarray(key)


@pytest.mark.parametrize("make_key", KEY_MAKERS)
def test_fold_in_str_is_deterministic(make_key):
    key = make_key(0)
    a = fold_in_str(key, "layers.0.w")
    b = fold_in_str(key, "layers.0.w")
    c = fold_in_str(make_key(0), "layers.0.w")
    np.testing.assert_array_equal(_data(a), _data(b))
    np.testing.assert_array_equal(_data(a), _data(c))


@pytest.mark.parametrize("make_key", KEY_MAKERS)
def test_fold_in_str_keeps_key_kind(make_key):
    key = make_key(0)
    out = fold_in_str(key, "x")
    assert out.dtype == key.dtype
    assert out.shape == key.shape
    assert not np.array_equal(_data(out), _data(key))


@pytest.mark.parametrize("make_key", KEY_MAKERS)
def test_fold_in_str_different_strings_different_keys(make_key):
    key = make_key(42)
    names = ["", "a", "b", "ab", "ba", "w", "w ", "layers.0.w", "layers.1.w", "é", "e", "日本"]
    names += [f"block_{i}" for i in range(200)]
    datas = {tuple(_data(fold_in_str(key, n)).tolist()) for n in names}
    assert len(datas) == len(names)
    # And the random numbers drawn from them differ too.
    x = jax.random.normal(fold_in_str(key, "a"), (8,))
    y = jax.random.normal(fold_in_str(key, "b"), (8,))
    assert not np.allclose(x, y)


def test_fold_in_str_different_base_keys_differ():
    a = fold_in_str(jax.random.key(0), "w")
    b = fold_in_str(jax.random.key(1), "w")
    assert not np.array_equal(_data(a), _data(b))


def test_fold_in_str_raw_and_typed_agree():
    raw = fold_in_str(jax.random.PRNGKey(7), "embedding")
    typed = fold_in_str(jax.random.key(7), "embedding")
    np.testing.assert_array_equal(_data(raw), _data(typed))


def test_fold_in_str_uses_seqax_hash():
    # seqax: fold_in(key, int(hashlib.md5(string.encode()).hexdigest()[:8], base=16))
    for string in ["layers.0.attention.w_q", "embed", "", "ünïcode"]:
        h = int(hashlib.md5(string.encode()).hexdigest()[:8], base=16)
        for key in (jax.random.key(0), jax.random.PRNGKey(0)):
            expected = jax.random.fold_in(key, h)
            np.testing.assert_array_equal(_data(fold_in_str(key, string)), _data(expected))


@pytest.mark.parametrize("make_key", KEY_MAKERS)
def test_fold_in_str_under_jit(make_key):
    key = make_key(3)

    @jax.jit
    def f(key):
        return fold_in_str(key, "dropout"), fold_in_str(key, "init")

    got_dropout, got_init = f(key)
    np.testing.assert_array_equal(_data(got_dropout), _data(fold_in_str(key, "dropout")))
    np.testing.assert_array_equal(_data(got_init), _data(fold_in_str(key, "init")))
    assert got_dropout.dtype == key.dtype


def test_fold_in_str_under_vmap():
    keys = jax.random.split(jax.random.key(0), 4)
    out = jax.vmap(lambda k: fold_in_str(k, "w"))(keys)
    for i in range(4):
        np.testing.assert_array_equal(_data(out[i]), _data(fold_in_str(keys[i], "w")))


def test_fold_in_str_rejects_non_strings():
    with pytest.raises(TypeError, match=r"fold_in_str\(key, string\): string must be a str"):
        fold_in_str(jax.random.key(0), 3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="must be a str, got bytes"):
        fold_in_str(jax.random.key(0), b"bytes")  # type: ignore[arg-type]


@settings(max_examples=examples(60))
@given(st.text(max_size=20), st.text(max_size=20))
def test_fold_in_str_property(s1, s2):
    key = jax.random.PRNGKey(0)
    a = _data(fold_in_str(key, s1))
    np.testing.assert_array_equal(a, _data(fold_in_str(key, s1)))
    if s1 != s2:
        assert not np.array_equal(a, _data(fold_in_str(key, s2)))


# ---------------------------------------------------------------------------------------------
# make_dataclass_from_dict
# ---------------------------------------------------------------------------------------------


class Activation(enum.Enum):
    RELU = "relu"
    GELU = "gelu"


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    d_model: int
    n_layers: int = 2
    dropout: float = 0.0
    activation: Activation = Activation.RELU


@dataclasses.dataclass(frozen=True)
class AdamConfig:
    lr: float
    b1: float = 0.9


@dataclasses.dataclass(frozen=True)
class SgdConfig:
    lr: float
    momentum: float


@dataclasses.dataclass
class Config:
    model: ModelConfig
    optimizer: Union[SgdConfig, AdamConfig]  # noqa: UP007 - exercise typing.Union
    seed: int | None = None
    eval_model: Optional[ModelConfig] = None  # noqa: UP045 - exercise typing.Optional
    layers: list[ModelConfig] = dataclasses.field(default_factory=list)
    stages: tuple[ModelConfig, ...] = ()
    named: dict[str, ModelConfig] = dataclasses.field(default_factory=dict)
    shape: tuple[int, str] = (1, "a")
    label: int | str = 0
    mode: Literal["train", "eval"] = "train"
    tags: list[str] = dataclasses.field(default_factory=list)
    derived: int = dataclasses.field(default=0, init=False)


BASE = {"model": {"d_model": 64}, "optimizer": {"lr": 1e-3}}


def _cfg(strict: bool = False, **overrides) -> Config:
    return make_dataclass_from_dict(Config, {**BASE, **overrides}, strict=strict)


def _error(strict: bool = False, **overrides) -> str:
    with pytest.raises(DataclassFromDictError) as info:
        _cfg(strict=strict, **overrides)
    assert isinstance(info.value, ValueError)
    return str(info.value)


def test_nested_with_defaults():
    cfg = _cfg()
    assert cfg == Config(model=ModelConfig(d_model=64), optimizer=AdamConfig(lr=1e-3))
    assert cfg.seed is None and cfg.layers == [] and cfg.named == {}


def test_all_fields():
    cfg = _cfg(
        model={"d_model": 128, "n_layers": 4, "dropout": 0.1, "activation": "gelu"},
        optimizer={"lr": 0.1, "momentum": 0.9},
        seed=3,
        eval_model={"d_model": 32},
        layers=[{"d_model": 1}, {"d_model": 2, "n_layers": 5}],
        stages=[{"d_model": 7}],
        named={"enc": {"d_model": 8}, "dec": {"d_model": 9}},
        shape=[3, "b"],
        label="x",
        mode="eval",
        tags=["a", "b"],
    )
    assert cfg.model == ModelConfig(
        d_model=128, n_layers=4, dropout=0.1, activation=Activation.GELU
    )
    assert cfg.optimizer == SgdConfig(lr=0.1, momentum=0.9)
    assert cfg.seed == 3
    assert cfg.eval_model == ModelConfig(d_model=32)
    assert cfg.layers == [ModelConfig(d_model=1), ModelConfig(d_model=2, n_layers=5)]
    assert cfg.stages == (ModelConfig(d_model=7),)
    assert cfg.named == {"enc": ModelConfig(d_model=8), "dec": ModelConfig(d_model=9)}
    assert cfg.shape == (3, "b")
    assert cfg.label == "x" and cfg.mode == "eval" and cfg.tags == ["a", "b"]


def test_int_accepted_for_float_and_converted():
    cfg = _cfg(model={"d_model": 4, "dropout": 0}, optimizer={"lr": 1})
    assert cfg.model.dropout == 0.0 and type(cfg.model.dropout) is float
    assert cfg.optimizer == AdamConfig(lr=1.0) and type(cfg.optimizer.lr) is float


def test_optional_accepts_none_and_dict():
    assert _cfg(seed=None, eval_model=None).eval_model is None
    assert _cfg(eval_model={"d_model": 5}).eval_model == ModelConfig(d_model=5)


def test_union_picks_first_fitting_member():
    # SgdConfig is tried first but needs `momentum`; AdamConfig fits.
    assert _cfg(optimizer={"lr": 0.5}).optimizer == AdamConfig(lr=0.5)
    assert _cfg(optimizer={"lr": 0.5, "momentum": 0.0}).optimizer == SgdConfig(lr=0.5, momentum=0.0)
    assert _cfg(label=5).label == 5 and _cfg(label="five").label == "five"


def test_instances_are_passed_through():
    model = ModelConfig(d_model=3)
    assert _cfg(model=model).model is model
    assert make_dataclass_from_dict(ModelConfig, {"d_model": 3}) == model


def test_wrong_primitive_type_names_path_type_and_value():
    message = _error(model={"d_model": "big"})
    assert message.startswith("Config.model.d_model: ")
    assert "expected int" in message
    assert "'big'" in message and "str" in message


def test_float_for_int_and_bool_for_int_rejected():
    assert "Config.model.n_layers: expected int, got 2.5" in _error(
        model={"d_model": 1, "n_layers": 2.5}
    )
    assert "Config.model.d_model: expected int, got True" in _error(model={"d_model": True})


def test_error_paths_in_containers():
    message = _error(layers=[{"d_model": 1}, {"d_model": "x"}])
    assert message.startswith("Config.layers[1].d_model: expected int, got 'x'")
    message = _error(named={"enc": {"d_model": 1.5}})
    assert message.startswith("Config.named['enc'].d_model: expected int, got 1.5")
    message = _error(stages=({"d_model": 1}, {"d_model": 2, "dropout": "high"}))
    assert message.startswith("Config.stages[1].dropout: expected float, got 'high'")
    message = _error(tags=["a", 3])
    assert message.startswith("Config.tags[1]: expected str, got 3")


def test_container_type_mismatch():
    assert _error(layers={"d_model": 1}).startswith(
        "Config.layers: expected list[ModelConfig], got {"
    )
    assert _error(tags="abc").startswith("Config.tags: expected list[str], got 'abc'")
    message = _error(shape=[1, "a", 2])
    assert message.startswith("Config.shape: expected tuple[int, str] with 2 items, got 3 items")
    assert _error(named=[1]).startswith("Config.named: expected dict[str, ModelConfig], got [1]")


def test_optional_mismatch():
    message = _error(seed="0")
    assert message.startswith("Config.seed: expected int | None, got '0'")
    message = _error(eval_model=7)
    assert message.startswith("Config.eval_model: expected ModelConfig | None, got 7")


def test_union_error_explains_each_member():
    message = _error(strict=True, optimizer={"momentum": 0.9})
    assert message.startswith(
        "Config.optimizer: expected SgdConfig | AdamConfig, got {'momentum': 0.9}"
    )
    assert "as SgdConfig: Config.optimizer: missing required field(s) for SgdConfig: " in message
    assert "Config.optimizer.lr (float)" in message
    assert "as AdamConfig: Config.optimizer: unknown key(s) 'momentum' for AdamConfig" in message
    assert _error(label=1.5).startswith("Config.label: expected int | str, got 1.5")
    # Not strict: AdamConfig would ignore 'momentum', but it still lacks 'lr'.
    message = _error(optimizer={"momentum": 0.9})
    assert "as AdamConfig: Config.optimizer: missing required field(s) for AdamConfig" in message


@dataclasses.dataclass
class Holder:
    opt: Union[AdamConfig, SgdConfig]  # noqa: UP007


def test_union_prefers_the_member_that_ignores_fewest_keys():
    # AdamConfig fits by ignoring 'momentum'; SgdConfig fits exactly and wins.
    got = make_dataclass_from_dict(Holder, {"opt": {"lr": 0.5, "momentum": 0.1}})
    assert got.opt == SgdConfig(lr=0.5, momentum=0.1)
    # Neither fits exactly: SgdConfig ignores one key, AdamConfig two; only the keys the chosen
    # member ignored are reported.
    with pytest.warns(UnknownKeyWarning) as record:
        got = make_dataclass_from_dict(
            Holder, {"opt": {"lr": 0.5, "momentum": 0.1, "nesterov": True}}
        )
    assert got.opt == SgdConfig(lr=0.5, momentum=0.1)
    assert [str(w.message).split(":")[1] for w in record] == [
        " ignoring key 'nesterov' at Holder.opt.nesterov"
    ]
    # Only one member fits: it wins even though it ignores a key.
    with pytest.warns(UnknownKeyWarning, match="ignoring key 'nesterov' at Holder.opt.nesterov"):
        got = make_dataclass_from_dict(Holder, {"opt": {"lr": 0.5, "nesterov": True}})
    assert got.opt == AdamConfig(lr=0.5)


def test_literal_and_enum():
    assert _error(mode="test").startswith(
        "Config.mode: expected Literal['train', 'eval'], got 'test'"
    )
    message = _error(model={"d_model": 1, "activation": "swish"})
    assert message.startswith("Config.model.activation: expected Activation, got 'swish'")
    assert (
        _cfg(model={"d_model": 1, "activation": Activation.GELU}).model.activation
        is Activation.GELU
    )


def test_unknown_keys_ignored_with_one_warning_each():
    with pytest.warns(UnknownKeyWarning) as record:
        cfg = _cfg(model={"d_model": 1, "d_modle": 2, "heads": 4})
    assert cfg.model == ModelConfig(d_model=1)
    assert [str(w.message) for w in record] == [
        f"make_dataclass_from_dict(Config, data): ignoring key {key!r} at Config.model.{key}: "
        "ModelConfig has no such field (the fields it takes are: d_model, n_layers, dropout, "
        "activation); pass strict=True to make this an error"
        for key in ("d_modle", "heads")
    ]
    assert all(issubclass(w.category, UserWarning) for w in record)
    assert all(w.filename == __file__ for w in record)  # points at the caller


def test_unknown_key_in_many_items_warned_once():
    layers = [{"d_model": i, "p_threshold": 0.0} for i in range(5)]
    with pytest.warns(UnknownKeyWarning) as record:
        cfg = _cfg(layers=layers)
    assert [m.d_model for m in cfg.layers] == list(range(5))
    assert len(record) == 1
    assert (
        "ignoring key 'p_threshold' at Config.layers[0].p_threshold, "
        "Config.layers[1].p_threshold, Config.layers[2].p_threshold and 2 more: "
        "ModelConfig has no such field"
    ) in str(record[0].message)


def test_strict_unknown_keys_listed_with_valid_fields():
    message = _error(strict=True, model={"d_model": 1, "d_modle": 2, "heads": 4})
    assert message.startswith("Config.model: unknown key(s) 'd_modle', 'heads' for ModelConfig")
    assert "valid fields are: d_model, n_layers, dropout, activation" in message


def test_init_false_field_is_unknown_key():
    message = _error(strict=True, derived=3)
    assert message.startswith("Config: unknown key(s) 'derived' for Config")
    assert "derived" not in message.split("valid fields are:")[1]
    with pytest.warns(UnknownKeyWarning, match=r"Config\.derived is a field with init=False"):
        assert _cfg(derived=3).derived == 0


def test_strict_must_be_a_bool():
    with pytest.raises(TypeError, match=r"strict takes True or False, got strict='yes'"):
        make_dataclass_from_dict(Config, BASE, strict="yes")  # type: ignore[arg-type]


def test_missing_required_fields_named():
    with pytest.raises(DataclassFromDictError) as info:
        make_dataclass_from_dict(Config, {"model": {"n_layers": 3}, "optimizer": {"lr": 1.0}})
    message = str(info.value)
    # `model` is present, so the first problem found is inside it.
    assert message.startswith("Config.model: missing required field(s) for ModelConfig: ")
    assert "Config.model.d_model (int)" in message
    assert info.value.path == "Config.model"

    with pytest.raises(DataclassFromDictError) as info:
        make_dataclass_from_dict(Config, {})
    assert "Config.model (ModelConfig)" in str(info.value)
    assert "Config.optimizer (SgdConfig | AdamConfig)" in str(info.value)


def test_top_level_not_a_mapping():
    with pytest.raises(
        DataclassFromDictError, match=re.escape("Config: expected Config, got [1, 2]")
    ):
        make_dataclass_from_dict(Config, [1, 2])  # type: ignore[arg-type]
    with pytest.raises(
        DataclassFromDictError, match=re.escape("Config.model: expected ModelConfig, got 3")
    ):
        make_dataclass_from_dict(Config, {"model": 3, "optimizer": {"lr": 1.0}})


def test_not_a_dataclass():
    with pytest.raises(TypeError, match="expects a dataclass type"):
        make_dataclass_from_dict(dict, {})  # type: ignore[type-var]
    with pytest.raises(TypeError, match="expects a dataclass type"):
        make_dataclass_from_dict(ModelConfig(d_model=1), {})  # type: ignore[arg-type]


def test_long_values_are_truncated_in_messages():
    message = _error(model={"d_model": "x" * 1000})
    assert len(message) < 300
    assert "..." in message


@dataclasses.dataclass
class Misc:
    ids: set[int] = dataclasses.field(default_factory=set)
    models: Sequence[ModelConfig] = ()
    empty: tuple[()] = ()
    anything: Any = None


def test_sets_sequences_empty_tuple_and_any():
    misc = make_dataclass_from_dict(
        Misc, {"ids": [1, 2, 2], "models": [{"d_model": 1}], "empty": [], "anything": object}
    )
    assert misc == Misc(ids={1, 2}, models=[ModelConfig(d_model=1)], empty=(), anything=object)
    with pytest.raises(DataclassFromDictError, match=re.escape("Misc.empty: expected tuple[()]")):
        make_dataclass_from_dict(Misc, {"empty": [1]})
    with pytest.raises(
        DataclassFromDictError, match=re.escape("Misc.models: expected Sequence[ModelConfig]")
    ):
        make_dataclass_from_dict(Misc, {"models": "abc"})
