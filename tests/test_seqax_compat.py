"""seqax programs run unedited: the behaviours seqax's code relies on, one test per item.

The models below follow seqax's ``train.py`` (``TransformerLayer``, ``Transformer =
Array['layers', TransformerLayer]``, ``Model.init``, ``State``) and its configs
(``configs/*.yaml``); expected values are computed here independently, the way seqax does.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from typing import Any, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.ad_checkpoint import checkpoint_name, print_saved_residuals
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from typeguard import typechecked

import jax_extra
from jax_extra import (
    DataclassFromDictError,
    UnknownKeyWarning,
    explicit_activation_checkpointing,
    fold_in_str,
    save_for_backward,
)
from shardlib.shardtypes import (
    Array,
    SpecError,
    f32,
    make_partition_specs,
    make_shardings,
    pytree_dataclass,
    register_with_typeguard,
    typed_shard_map,
)
from tests import _seqax_fixtures as seqax
from tests._seqax_fixtures import Hparams, MeshConfig

register_with_typeguard()


# ---------------------------------------------------------------------------------------------
# A cut-down seqax model (train.py): same field specs, same init, same RNG names; seqax's
# Hparams (tests/_seqax_fixtures.py).
# ---------------------------------------------------------------------------------------------


@pytree_dataclass
class TransformerLayer:
    ln1: f32[b"d_model/t/d"]
    w_q: f32[b"d_model/d n_q_per_kv n_kv/t d_head"]
    w_kv: f32[b"2 d_model/d n_kv/t d_head"]
    w_gate: f32[b"d_model/d d_ff/t"]


Transformer = Array["layers", TransformerLayer]


@pytree_dataclass
class Model:
    embed: f32[b"vocab/t d_model/d"]
    transformer: Transformer
    final_layer_norm: f32[b"d_model/d/t"]

    @staticmethod
    def init(h: Hparams, rng: Any) -> Model:
        # As seqax's Model.init: named keys, truncated normals, a stack built with Transformer(...)
        embed = jax.random.normal(fold_in_str(rng, "embed"), (h.vocab, h.d_model), jnp.float32)
        ln1 = jnp.ones((h.layers, h.d_model), dtype=jnp.float32)
        scale = 1 / (math.sqrt(h.d_model) * 0.87962566103423978)
        w_q_shape = (h.layers, h.d_model, h.n_q_per_kv, h.n_kv, h.d_head)
        w_q = scale * jax.random.truncated_normal(fold_in_str(rng, "w_q"), -2, 2, w_q_shape)
        w_kv_shape = (h.layers, 2, h.d_model, h.n_kv, h.d_head)
        w_kv = scale * jax.random.truncated_normal(fold_in_str(rng, "w_kv"), -2, 2, w_kv_shape)
        ff_shape = (h.layers, h.d_model, h.d_ff)
        w_gate = scale * jax.random.truncated_normal(fold_in_str(rng, "w_gate"), -2, 2, ff_shape)
        arrays = Model(
            embed=embed,
            transformer=Transformer(ln1=ln1, w_q=w_q, w_kv=w_kv, w_gate=w_gate),
            final_layer_norm=jnp.ones((h.d_model,), dtype=jnp.float32),
        )
        shardings = make_shardings(Model)
        return jax.tree.map(lax.with_sharding_constraint, arrays, shardings)


@pytree_dataclass
class State:
    weights: Model
    adam_mu: Model


H = Hparams(
    d_model=16, n_q_per_kv=1, n_kv=2, d_head=4, layers=3, vocab=32, d_ff=24, rope_max_timescale=8
)


def _mesh():
    # seqax builds its mesh with Mesh(...), whose axes are Auto: with_sharding_constraint in
    # Model.init places values (on Explicit axes it would only assert the layout).
    return jax.make_mesh((4, 2), ("d", "t"), axis_types=(AxisType.Auto, AxisType.Auto))


# ---------------------------------------------------------------------------------------------
# 1. Array['layers', Layer] is a dataclass subclass of Layer that user code instantiates
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_stacked_type_is_instantiable_scannable_and_carries_stacked_specs():
    assert issubclass(Transformer, TransformerLayer)
    assert Array["layers", TransformerLayer] is Transformer  # cached
    assert dataclasses.is_dataclass(Transformer)
    assert {f.name: f.type for f in dataclasses.fields(Transformer)} == {
        "ln1": f32["layers d_model/t/d"],
        "w_q": f32["layers d_model/d n_q_per_kv n_kv/t d_head"],
        "w_kv": f32["layers 2 d_model/d n_kv/t d_head"],
        "w_gate": f32["layers d_model/d d_ff/t"],
    }
    assert make_partition_specs(Transformer) == TransformerLayer(
        ln1=P(None, ("t", "d")),
        w_q=P(None, "d", None, "t", None),
        w_kv=P(None, None, "d", "t", None),
        w_gate=P(None, "d", "t"),
    )
    # Arrays keep working as before.
    assert Array["layers", f32["a b"]] is f32[b"layers a b"]

    with jax.set_mesh(_mesh()):
        model = jax.jit(Model.init, static_argnums=0)(H, jax.random.PRNGKey(0))
        stack = model.transformer
        # The value is a TransformerLayer with the pytree structure of one.
        assert isinstance(stack, Transformer) and isinstance(stack, TransformerLayer)
        one = TransformerLayer(ln1=0, w_q=0, w_kv=0, w_gate=0)
        assert jax.tree.structure(stack) == jax.tree.structure(one)
        assert stack.w_q.shape == (3, 16, 1, 2, 4)
        assert stack.w_gate.sharding == NamedSharding(_mesh(), P(None, "d", "t"))
        assert jax.tree.map(lambda s: s.spec, make_shardings(Model)) == make_partition_specs(Model)

        # typed_shard_map reads the stacked specs from Model's field annotation.
        @typed_shard_map
        def doubled_gates(m: Model) -> f32[b"layers d_model/d d_ff/t"]:
            def body(c, layer: TransformerLayer):
                assert layer.w_gate.shape == (16 // 4, 24 // 2)  # per device, one layer
                return c, layer.w_gate * 2

            return jax.lax.scan(body, 0, m.transformer)[1]

        out = jax.jit(doubled_gates)(model)
        np.testing.assert_allclose(out, 2 * np.asarray(stack.w_gate), rtol=1e-6)
        assert out.sharding.spec == P(None, "d", "t")

    # lax.scan over the stack hands the body one (checked) TransformerLayer per layer (no mesh
    # in force here, so the checks are of dtypes and sizes only).
    @typechecked
    def step(carry: f32[b""], layer: TransformerLayer) -> tuple[f32[b""], f32[b"d_ff"]]:
        assert type(layer) is TransformerLayer
        return carry + jnp.sum(layer.w_q), jnp.sum(layer.w_gate, axis=0)

    total, per_layer = jax.lax.scan(step, jnp.float32(0), jax.device_get(stack))
    np.testing.assert_allclose(total, np.sum(np.asarray(stack.w_q)), rtol=1e-5)
    np.testing.assert_allclose(per_layer, np.sum(np.asarray(stack.w_gate), axis=1), rtol=1e-5)


@pytree_dataclass
class Clashing:
    w: f32[b"a/d"]


def test_stacked_spec_clash_raises_the_spec_error_of_the_joined_spec():
    with pytest.raises(SpecError) as direct:
        f32[b"layers/d a/d"]
    with pytest.raises(SpecError) as via_array:
        Array["layers/d", f32["a/d"]]
    assert str(via_array.value) == str(direct.value)
    assert "\n    'layers/d a/d'\n" in str(direct.value) and "^" in str(direct.value)

    with pytest.raises(SpecError) as via_field:
        Array["layers/d", Clashing]
    assert str(via_field.value) == str(direct.value)
    assert via_field.value.__notes__ == [
        "Array['layers/d', Clashing]: field 'w' of Clashing is f32['a/d'], and the stacked dims "
        "'layers/d' go in front of it"
    ]


# ---------------------------------------------------------------------------------------------
# 3. Key paths print as seqax's: keystr gives 'weightsembed'
# ---------------------------------------------------------------------------------------------


def _seqax_registered(name: str, field_names: list[str]) -> type:
    """A class registered the way seqax's pytree_dataclass registers it (field names as keys)."""
    cls = dataclasses.make_dataclass(name, field_names)

    def flatten_with_keys(value):
        return [(f.name, getattr(value, f.name)) for f in dataclasses.fields(cls)], ()

    jax.tree_util.register_pytree_with_keys(cls, flatten_with_keys, lambda _, c: cls(*c))
    return cls


def test_keystr_matches_seqax():
    with jax.set_mesh(_mesh()):
        model = jax.jit(Model.init, static_argnums=0)(H, jax.random.PRNGKey(0))
    state = State(weights=model, adam_mu=jax.tree.map(jnp.zeros_like, model))
    ours = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(state)]

    SModel = _seqax_registered("SModel", ["embed", "transformer", "final_layer_norm"])
    SLayer = _seqax_registered("SLayer", ["ln1", "w_q", "w_kv", "w_gate"])
    SState = _seqax_registered("SState", ["weights", "adam_mu"])

    def seqax_model(m):
        t = m.transformer
        return SModel(m.embed, SLayer(t.ln1, t.w_q, t.w_kv, t.w_gate), m.final_layer_norm)

    theirs = SState(seqax_model(state.weights), seqax_model(state.adam_mu))
    expected = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(theirs)]
    assert ours == expected
    assert ours[:6] == [
        "weightsembed",
        "weightstransformerln1",
        "weightstransformerw_q",
        "weightstransformerw_kv",
        "weightstransformerw_gate",
        "weightsfinal_layer_norm",
    ]
    assert ours[-1] == "adam_mufinal_layer_norm"


# ---------------------------------------------------------------------------------------------
# 4. fold_in_str derives seqax's keys (same seed, same weights)
# ---------------------------------------------------------------------------------------------


def _seqax_fold_in_str(key, string: str):
    # seqax's jax_extra.fold_in_str, written out.
    return jax.random.fold_in(key, int(hashlib.md5(string.encode()).hexdigest()[:8], base=16))


def _key_data(k):
    return np.asarray(jax.random.key_data(k) if jnp.issubdtype(k.dtype, jax.dtypes.prng_key) else k)


@pytest.mark.slow
def test_fold_in_str_gives_seqax_keys_and_weights():
    # The 32-bit hashes themselves, pinned ('init' is above 2**31).
    assert int(hashlib.md5(b"embed").hexdigest()[:8], 16) == 647366100
    assert int(hashlib.md5(b"init").hexdigest()[:8], 16) == 3816751414
    root = jax.random.PRNGKey(0)  # seqax: jax.random.PRNGKey(config.training.seed)
    for name in ["init", "embed", "w_q", "w_kv", "w_gate", "unembed", "pretrain"]:
        np.testing.assert_array_equal(
            _key_data(fold_in_str(root, name)), _key_data(_seqax_fold_in_str(root, name))
        )
    typed = jax.random.key(0)
    np.testing.assert_array_equal(
        _key_data(fold_in_str(typed, "init")), _key_data(_seqax_fold_in_str(typed, "init"))
    )
    # Same seed -> same weights: seqax's `State.init(fold_in_str(root_rng, 'init'))`.
    rng = fold_in_str(root, "init")
    with jax.set_mesh(_mesh()):
        model = jax.jit(Model.init, static_argnums=0)(H, rng)
    seqax_rng = _seqax_fold_in_str(root, "init")
    want_embed = jax.random.normal(
        _seqax_fold_in_str(seqax_rng, "embed"), (H.vocab, H.d_model), jnp.float32
    )
    # The keys are equal bit for bit (above); the values to an ulp: JAX 0.12 compiles the
    # sampler under jit (sharded) with other rounding than the eager, unsharded call here.
    np.testing.assert_allclose(
        np.asarray(model.embed), np.asarray(want_embed), rtol=1e-6, atol=1e-6
    )
    scale = 1 / (math.sqrt(H.d_model) * 0.87962566103423978)
    want_gate = scale * jax.random.truncated_normal(
        _seqax_fold_in_str(seqax_rng, "w_gate"), -2, 2, (H.layers, H.d_model, H.d_ff)
    )
    np.testing.assert_allclose(np.asarray(model.transformer.w_gate), want_gate, rtol=1e-6)


# ---------------------------------------------------------------------------------------------
# 5. make_dataclass_from_dict ignores keys the dataclass lacks (with a warning)
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TokenBatchParams:
    len: int
    batch: int


@dataclasses.dataclass(frozen=True)
class FlatTokensParams:
    filespec: str
    streams: int
    read_blocks_per_shuffle_buffer: int
    sequences_per_read_block: int
    seed: int
    sequence_packing: bool


@dataclasses.dataclass(frozen=True)
class HuggingFaceDataParams:
    path: str
    tokenizer: str
    num_workers: int
    sequences_packed_per_batch: int
    name: Optional[str] = None  # noqa: UP045 - as seqax writes it


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainingHparams(seqax.TrainingHparams):
    """seqax's whole training block: the AdamW fields, its learning-rate schedule and batch."""

    warmup_steps: int
    steps_for_lr: int
    cosine_learning_rate_final_fraction: float
    tokens: TokenBatchParams


@dataclasses.dataclass(frozen=True)
class Paths:
    root_working_dir: str
    model_name: str


@dataclasses.dataclass
class IOConfig:
    max_io_threads: int


@dataclasses.dataclass(frozen=True)
class Config:
    model: Hparams
    training: TrainingHparams
    paths: Paths
    num_hosts: int
    checkpoint_interval: int
    mesh: MeshConfig
    io: IOConfig
    flat_tokens: Optional[FlatTokensParams] = None  # noqa: UP045
    hf_dataset: Optional[HuggingFaceDataParams] = None  # noqa: UP045

    @property
    def training_data(self) -> Union[FlatTokensParams, HuggingFaceDataParams]:  # noqa: UP007
        data = self.flat_tokens or self.hf_dataset
        assert data is not None
        return data


# configs/huggingface_c4_a100x1_84m.yaml as Hydra composes it (with +paths.model_name=hf_84m),
# and with the model block of configs/local_test_synthetic.yaml's era: p_threshold and
# p_threshold_steps_fraction, which the current Hparams no longer has.
SEQAX_CONFIG = {
    "training": {
        "seed": 0,
        "tokens": {"batch": 64, "len": 1024},
        "adam_b1": 0.9,
        "adam_b2": 0.95,
        "adam_eps": 1.0e-8,
        "adam_eps_root": 0.0,
        "weight_decay": 0.1,
        "warmup_steps": 2600,
        "steps": 26000,
        "steps_for_lr": 26000,
        "learning_rate": 3.0e-4,
        "cosine_learning_rate_final_fraction": 0.1,
    },
    "model": {
        "d_model": 512,
        "n_q_per_kv": 1,
        "n_kv": 8,
        "d_head": 128,
        "layers": 8,
        "d_ff": 4096,
        "vocab": 32768,
        "rope_max_timescale": 10000,
        "p_threshold": 0.0,
        "p_threshold_steps_fraction": 0.0,
    },
    "paths": {"root_working_dir": "~/seqax_outputs", "model_name": "hf_84m"},
    "num_hosts": 1,
    "io": {"max_io_threads": 1024},
    "hf_dataset": {
        "path": "allenai/c4",
        "name": "en",
        "num_workers": 64,
        "tokenizer": "mistralai/Mistral-7B-v0.1",
        "sequences_packed_per_batch": 120,
    },
    "mesh": {"d": 1, "t": 1},
    "checkpoint_interval": 100,
}


def test_config_with_extra_keys_builds_and_warns_once_per_key():
    with pytest.warns(UnknownKeyWarning) as record:
        config = jax_extra.make_dataclass_from_dict(Config, SEQAX_CONFIG)
    assert config.model == Hparams(
        d_model=512,
        n_q_per_kv=1,
        n_kv=8,
        d_head=128,
        layers=8,
        vocab=32768,
        d_ff=4096,
        rope_max_timescale=10000,
    )
    assert config.training.tokens == TokenBatchParams(len=1024, batch=64)
    assert config.training.adam_eps_root == 0.0 and config.training.queue is None
    assert config.training_data == HuggingFaceDataParams(
        path="allenai/c4",
        tokenizer="mistralai/Mistral-7B-v0.1",
        num_workers=64,
        sequences_packed_per_batch=120,
        name="en",
    )
    assert config.flat_tokens is None and config.io == IOConfig(max_io_threads=1024)
    messages = [str(w.message) for w in record]
    assert len(messages) == 2
    assert messages[0].startswith(
        "make_dataclass_from_dict(Config, data): ignoring key 'p_threshold' at "
        "Config.model.p_threshold: Hparams has no such field (the fields it takes are: d_model, "
    )
    assert "ignoring key 'p_threshold_steps_fraction' at Config.model." in messages[1]
    assert all(m.endswith("pass strict=True to make this an error") for m in messages)

    with pytest.raises(DataclassFromDictError) as e:
        jax_extra.make_dataclass_from_dict(Config, SEQAX_CONFIG, strict=True)
    assert str(e.value).startswith(
        "Config.model: unknown key(s) 'p_threshold', 'p_threshold_steps_fraction' for Hparams"
    )


# ---------------------------------------------------------------------------------------------
# 6. pytree_dataclass instances can be assigned to
# ---------------------------------------------------------------------------------------------


def test_pytree_dataclass_fields_can_be_assigned():
    with jax.set_mesh(_mesh()):
        model = jax.jit(Model.init, static_argnums=0)(H, jax.random.PRNGKey(0))
        state = State(weights=model, adam_mu=jax.tree.map(jnp.zeros_like, model))
        new_gate = state.weights.transformer.w_gate + 1
        state.weights.transformer.w_gate = new_gate
        state.adam_mu = jax.tree.map(lambda x: x + 2, state.adam_mu)
        assert state.weights.transformer.w_gate is new_gate
        assert float(state.adam_mu.embed[0, 0]) == 2.0
        total = jax.jit(lambda s: sum(jnp.sum(x) for x in jax.tree.leaves(s)))(state)
    want = sum(np.sum(np.asarray(x)) for x in jax.tree.leaves(state))
    np.testing.assert_allclose(float(total), want, rtol=1e-5)

    @pytree_dataclass(frozen=True)
    class Frozen:
        w: f32[b"a"]

    with pytest.raises(dataclasses.FrozenInstanceError):
        Frozen(w=jnp.zeros(2)).w = jnp.ones(2)  # type: ignore[misc]


# ---------------------------------------------------------------------------------------------
# 7. explicit_activation_checkpointing saves every named value, as seqax's policy does
# ---------------------------------------------------------------------------------------------


def _saved(capsys: pytest.CaptureFixture[str], f, *args) -> list[str]:
    capsys.readouterr()
    print_saved_residuals(f, *args)
    return [ln for ln in capsys.readouterr().out.splitlines() if ln.strip()]


def _ffn(x, w_gate, w_up, w_down):
    # seqax's FFN: marked projections, plus a value a library named with checkpoint_name.
    gate = save_for_backward(x @ w_gate)
    up = save_for_backward(x @ w_up)
    y = checkpoint_name(jax.nn.swish(gate) * up, "ffn_hidden")
    return jnp.sum(jnp.tanh(y @ w_down))


@pytest.mark.slow
def test_remat_saves_named_values_like_seqax(capsys):
    keys = jax.random.split(jax.random.key(1), 4)
    args = (
        jax.random.normal(keys[0], (4, 8)),
        jax.random.normal(keys[1], (8, 16)) / 4,
        jax.random.normal(keys[2], (8, 16)) / 4,
        jax.random.normal(keys[3], (16, 8)) / 4,
    )
    ours = _saved(capsys, explicit_activation_checkpointing(_ffn), *args)
    seqax = jax.checkpoint(_ffn, policy=jax.checkpoint_policies.save_any_names_but_these())
    assert ours == _saved(capsys, seqax, *args)
    intermediates = [ln for ln in ours if "from the argument" not in ln]
    assert len(ours) == 4 + 3, ours  # 4 arguments, 2 marked projections, the named hidden
    assert sorted(ln.split(" ")[0] for ln in intermediates) == ["f32[4,16]"] * 3, ours
    if any("named '" in ln for ln in ours):  # JAX >= 0.10 prints names
        assert sum("ffn_hidden" in ln for ln in intermediates) == 1, ours

    strict = explicit_activation_checkpointing(only_save_for_backward=True)(_ffn)
    lines = _saved(capsys, strict, *args)
    intermediates = [ln for ln in lines if "from the argument" not in ln]
    assert len(lines) == 4 + 2, lines  # the library-named value is recomputed
    assert not any("ffn_hidden" in ln for ln in intermediates), lines

    want = jax.grad(_ffn, argnums=(1, 2, 3))(*args)
    for f in (explicit_activation_checkpointing(_ffn), strict):
        got = jax.grad(f, argnums=(1, 2, 3))(*args)
        for g, w in zip(got, want, strict=True):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
