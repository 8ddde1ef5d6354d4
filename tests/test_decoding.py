"""Typed decoding of the headline transformer (``examples/decoding.py``) against the
full-sequence forward.

A small random model (f32) and a known sequence: prefill its first tokens, then decode the
rest one token per step with the true next token (teacher forcing). Every step's logits must
equal the logits of `transformer_model.reference_logits` (plain jax.numpy, no sharding, the
whole sequence at once) at that position, on a 1-D (``d``), 2-D (``d x t``) and 3-D mesh with
a context axis (``d x c x t``: the cache's positions split over ``c``); greedy generation
gives the same tokens on every mesh (and the reference's). Rows of different prompt lengths
in one batch equal each row decoded alone. And the refusals: a prompt longer than the cache,
a cache laid out for another mesh, a batch that differs, a ``max_len`` the context axis does
not divide; a row decoded past the cache, or prefilled with a length outside ``[1, L]``,
gives NaN logits.
"""

from __future__ import annotations

import contextlib
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

import shardlib
from examples import decoding as dec
from examples import transformer_model as tm

CONFIG = tm.Config(
    vocab=64, d_model=32, n_heads=4, n_kv_heads=2, d_head=8, d_ff=64, n_layers=2, seq_len=16
)
MESHES = {
    "d8": ((8,), ("d",)),
    "d4xt2": ((4, 2), ("d", "t")),
    "d2xc2xt2": ((2, 2, 2), ("d", "c", "t")),
}
BATCH, MAX_LEN, TOTAL, PROMPT = 8, 16, 12, 5
RTOL, ATOL = 1e-5, 1e-5

_prefill = jax.jit(dec.prefill, static_argnums=0)
_step = jax.jit(dec.decode_step, static_argnums=0)


@contextlib.contextmanager
def _on(name: str):
    shape, names = MESHES[name]
    mesh = jax.make_mesh(shape, names)
    with jax.set_mesh(mesh), shardlib.axis_rules(tm.rules_for(mesh)):
        yield


@pytest.fixture(scope="module")
def weights() -> tm.Model:
    return tm.init_model(CONFIG, jax.random.key(0, impl="rbg"))


@pytest.fixture(scope="module")
def sequence() -> np.ndarray:
    rng = np.random.default_rng(0)
    return rng.integers(0, CONFIG.vocab, size=(BATCH, TOTAL), dtype=np.int32)


@pytest.fixture(scope="module")
def reference(weights, sequence) -> np.ndarray:
    """The full-sequence forward's logits ``(B, TOTAL, V)``."""
    return np.asarray(jax.jit(tm.reference_logits, static_argnums=2)(weights, sequence, CONFIG))


def _run(model, prompt, lengths, feed):
    """Prefill ``prompt`` with ``lengths``, then one decode step per column of ``feed``:
    the logits of the prefill and of each step, and the final cache."""
    placed = tm.place_model(model)
    cache = dec.empty_cache(CONFIG, prompt.shape[0], MAX_LEN)
    cache, logits = _prefill(CONFIG, placed, prompt, jnp.asarray(lengths, jnp.int32), cache)
    out = [np.asarray(logits)]
    for column in feed:
        cache, logits = _step(CONFIG, placed, cache, jnp.asarray(column, jnp.int32))
        out.append(np.asarray(logits))
    return out, cache


def _greedy(model, prompt, steps):
    """Greedy tokens ``(B, steps)`` after ``prompt`` (argmax of the gathered vocabulary)."""
    placed = tm.place_model(model)
    cache = dec.empty_cache(CONFIG, prompt.shape[0], MAX_LEN)
    lengths = jnp.full((prompt.shape[0],), prompt.shape[1], jnp.int32)
    cache, logits = _prefill(CONFIG, placed, prompt, lengths, cache)
    tokens = []
    for _ in range(steps):
        # On the host: one program with collectives in flight at a time (XLA:CPU).
        next_tokens = np.argmax(np.asarray(logits), axis=-1).astype(np.int32)
        tokens.append(next_tokens)
        cache, logits = _step(CONFIG, placed, cache, jnp.asarray(next_tokens))
    return np.stack(tokens, axis=1)


@pytest.fixture(scope="module")
def runs(weights, sequence):
    """Per mesh: the teacher-forced logits (prefill, then each step) and greedy tokens."""
    out = {}
    for name in MESHES:
        with _on(name):
            logits, cache = _run(weights, sequence[:, :PROMPT], [PROMPT] * BATCH,
                                 sequence[:, PROMPT:].T)  # fmt: skip
            greedy = _greedy(weights, sequence[:, :PROMPT], TOTAL - PROMPT)
            out[name] = dict(logits=logits, cache=cache, greedy=greedy)
    return out


@pytest.mark.parametrize("mesh", list(MESHES))
def test_every_step_equals_the_full_sequence_forward(mesh, runs, reference):
    logits = runs[mesh]["logits"]
    assert len(logits) == 1 + TOTAL - PROMPT
    for i, got in enumerate(logits):
        position = PROMPT - 1 + i
        want = reference[:, position]
        assert got.shape == (BATCH, CONFIG.vocab)
        assert np.max(np.abs(want)) > 0.1  # not vacuous
        np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL, err_msg=f"position {position}")
    np.testing.assert_array_equal(np.asarray(runs[mesh]["cache"].lengths), TOTAL)


def test_greedy_tokens_are_the_same_on_every_mesh(runs, weights, sequence):
    first = runs["d8"]["greedy"]
    for name in MESHES:
        np.testing.assert_array_equal(runs[name]["greedy"], first, err_msg=name)
    # And the reference's: each token the argmax of the full forward's logits of the one
    # before it, in the sequence of the prompt and the greedy tokens (causal: one call).
    seq = np.concatenate([sequence[:, :PROMPT], first], axis=1)
    logits = np.asarray(tm.reference_logits(weights, jnp.asarray(seq), CONFIG))
    np.testing.assert_array_equal(np.argmax(logits[:, PROMPT - 1 : -1], -1), first)


def test_the_cache_is_created_in_its_layout():
    with _on("d2xc2xt2"):
        cache = dec.empty_cache(CONFIG, BATCH, MAX_LEN)
    assert cache.k.shape == (CONFIG.n_layers, BATCH, MAX_LEN, CONFIG.n_kv_heads, CONFIG.d_head)
    assert isinstance(cache.k.sharding, NamedSharding)
    assert isinstance(cache.lengths.sharding, NamedSharding)
    assert cache.k.sharding.spec == PartitionSpec(None, "d", "c", "t", None)
    assert cache.lengths.sharding.spec == PartitionSpec("d")
    assert cache.k.addressable_shards[0].data.size * 8 == cache.k.size
    np.testing.assert_array_equal(np.asarray(cache.lengths), 0)


# The prompt lengths of the mixed batch: every row decodes up to position TOTAL - 1.
MIXED = np.array([1, 5, 3, 2, 4, 5, 1, 3], np.int32)
MIXED_STEPS = TOTAL - PROMPT  # the longest row's steps; shorter rows stay inside TOTAL


def _mixed_inputs(sequence: np.ndarray, lengths: np.ndarray):
    """Left-aligned prompts (padding past each row's length: other tokens, which must not
    leak) and the teacher-forced tokens of each step (row b's step i is its position
    lengths[b] + i)."""
    prompt = sequence[:, :PROMPT].copy()
    pad = np.arange(PROMPT)[None, :] >= lengths[:, None]
    prompt[pad] = (prompt[pad] + 7) % CONFIG.vocab
    feed = np.stack([sequence[np.arange(BATCH), lengths + i] for i in range(MIXED_STEPS)])
    return prompt, feed


def test_rows_of_different_lengths_equal_each_row_alone(weights, sequence, reference):
    with _on("d2xc2xt2"):
        prompt, feed = _mixed_inputs(sequence, MIXED)
        mixed, cache = _run(weights, prompt, MIXED, feed)
        # Writes only at each row's position: the slots past every row's end are still empty.
        k = np.asarray(cache.k)
        for b, end in enumerate(np.maximum(PROMPT, MIXED + MIXED_STEPS)):
            assert np.all(k[:, b, end:] == 0) and np.all(np.any(k[:, b, :end] != 0, -1)), b
        for b in [0, 1, 2]:  # each row alone: a batch of copies of it
            alone, _ = _run(weights, np.repeat(prompt[b : b + 1], BATCH, 0), [MIXED[b]] * BATCH,
                            np.repeat(feed[:, b : b + 1], BATCH, 1))  # fmt: skip
            for i, (got, want) in enumerate(zip(mixed, alone, strict=True)):
                np.testing.assert_allclose(got[b], want[0], rtol=RTOL, atol=ATOL,
                                           err_msg=f"row {b} step {i}")  # fmt: skip
    for b in range(BATCH):  # and the full forward of its sequence
        for i, got in enumerate(mixed):
            position = MIXED[b] - 1 + i
            np.testing.assert_allclose(got[b], reference[b, position], rtol=RTOL, atol=ATOL,
                                       err_msg=f"row {b} position {position}")  # fmt: skip


def test_decoding_past_the_cache_gives_nan_in_that_row_only(weights, sequence):
    with _on("d2xc2xt2"):
        placed = tm.place_model(weights)
        cache = dec.empty_cache(CONFIG, BATCH, MAX_LEN)
        lengths = jnp.full((BATCH,), PROMPT, jnp.int32)
        cache, _ = _prefill(CONFIG, placed, sequence[:, :PROMPT], lengths, cache)
        first = jnp.arange(BATCH) == 0
        full = dataclasses.replace(cache, lengths=jnp.where(first, MAX_LEN, cache.lengths))
        after, logits = _step(CONFIG, placed, full, jnp.asarray(sequence[:, PROMPT]))
    logits = np.asarray(logits)
    assert np.all(np.isnan(logits[0])) and np.all(np.isfinite(logits[1:]))
    # The full row's cache is untouched (its position MAX_LEN is no slot of any device).
    np.testing.assert_array_equal(np.asarray(after.k)[:, 0], np.asarray(full.k)[:, 0])
    assert int(np.asarray(after.lengths)[0]) == MAX_LEN + 1


def test_a_prefill_length_outside_the_prompt_gives_nan(weights, sequence):
    bad = np.array([0, PROMPT + 1, *[PROMPT] * (BATCH - 2)], np.int32)
    with _on("d4xt2"):
        logits, cache = _run(weights, sequence[:, :PROMPT], bad, sequence[:, PROMPT : PROMPT + 1].T)
    for step in logits:
        assert np.all(np.isnan(step[:2])) and np.all(np.isfinite(step[2:]))
    assert np.all(np.asarray(cache.lengths)[:2] > MAX_LEN)


def test_lengths_out_of_range_are_refused_when_called_outside_jit(weights, sequence):
    """Called eagerly, the lengths are values: a full row, a negative length, a prefill length
    outside [1, L] are refused, naming the function, the argument, the row and the value (under
    jax.jit they are traced: the tests above check the NaN rows instead)."""
    with _on("d4xt2"):
        placed = tm.place_model(weights)
        cache = dec.empty_cache(CONFIG, BATCH, MAX_LEN)
        prompt = sequence[:, :PROMPT]
        for bad, value in [(0, 0), (PROMPT + 1, PROMPT + 1)]:
            lengths = np.full((BATCH,), PROMPT, np.int32)
            lengths[3] = bad
            with pytest.raises(ValueError) as info:
                dec.prefill(CONFIG, placed, prompt, jnp.asarray(lengths), cache)
            msg = str(info.value)
            assert f"prefill: argument `lengths` is {value} in row 3" in msg, msg
            assert f"[1, {PROMPT}]" in msg, msg
        filled, _ = dec.prefill(CONFIG, placed, prompt, jnp.full((BATCH,), PROMPT), cache)
        tokens = jnp.asarray(sequence[:, PROMPT])
        for value in (MAX_LEN, -1):
            lengths = jnp.where(jnp.arange(BATCH) == 5, value, filled.lengths)
            with pytest.raises(ValueError) as info:
                dec.decode_step(
                    CONFIG, placed, dataclasses.replace(filled, lengths=lengths), tokens
                )
            msg = str(info.value)
            assert f"decode_step: argument `cache.lengths` is {value} in row 5" in msg, msg
            assert ("the cache is full" in msg) == (value == MAX_LEN), msg
        dec.decode_step(CONFIG, placed, filled, tokens)  # in range: runs


def test_a_prompt_longer_than_the_cache_is_refused(weights):
    tokens = np.zeros((BATCH, MAX_LEN + 1), np.int32)
    with _on("d4xt2"):
        cache = dec.empty_cache(CONFIG, BATCH, MAX_LEN)
        lengths = jnp.ones((BATCH,), jnp.int32)
        with pytest.raises(ValueError) as info:
            jax.jit(dec.prefill, static_argnums=0).trace(
                CONFIG, tm.place_model(weights), tokens, lengths, cache
            )
    msg = str(info.value)
    assert "prefill: argument `tokens`" in msg and "L=17" in msg and "max_len=16" in msg, msg


def test_a_batch_that_differs_from_the_cache_is_refused(weights):
    with _on("d4xt2"):
        placed = tm.place_model(weights)
        cache = dec.empty_cache(CONFIG, BATCH, MAX_LEN)
        with pytest.raises(ValueError, match=r"decode_step: argument `tokens` has shape \(4,\)"):
            dec.decode_step(CONFIG, placed, cache, jnp.zeros((4,), jnp.int32))
        with pytest.raises(ValueError, match=r"prefill: argument `tokens` has shape \(4, 3\)"):
            dec.prefill(CONFIG, placed, jnp.zeros((4, 3), jnp.int32), cache.lengths, cache)


def test_a_cache_laid_out_for_another_mesh_is_refused(weights):
    with _on("d2xc2xt2"):
        cache = dec.empty_cache(CONFIG, BATCH, MAX_LEN)
    with _on("d4xt2"):
        placed = tm.place_model(weights)
        tokens = jnp.zeros((BATCH,), jnp.int32)
        for fn, call in [
            ("decode_step", lambda: dec.decode_step(CONFIG, placed, cache, tokens)),
            ("prefill", lambda: dec.prefill(CONFIG, placed, tokens[:, None], tokens + 1, cache)),
        ]:
            with pytest.raises(ValueError) as info:
                call()
            msg = str(info.value)
            assert f"{fn}: argument `cache.k` is laid out for the mesh" in msg, msg
            assert "{'d': 2, 'c': 2, 't': 2}" in msg and "{'d': 4, 't': 2}" in msg, msg


def test_a_max_len_the_context_axis_does_not_divide_is_refused():
    with _on("d2xc2xt2"), pytest.raises(ValueError) as info:
        dec.empty_cache(CONFIG, BATCH, 15)
    msg = str(info.value)
    assert "empty_cache: argument `max_len` is 15" in msg and "multiple of 2" in msg, msg


# ---------------------------------------------------------------------------------------------
# examples/generate.py: train (or restore), then generate greedily.
# ---------------------------------------------------------------------------------------------

try:
    from examples import generate
except ImportError:  # the `examples` extra (optax, orbax-checkpoint) is not installed
    generate = None  # type: ignore[assignment]

needs_examples = pytest.mark.skipif(generate is None, reason="needs the examples extra")
GENERATE_TINY = [
    *("--steps", "20", "--d-model", "64", "--heads", "8", "--kv-heads", "8", "--d-ff", "64"),
    *("--seq-len", "16", "--batch", "8", "--prompt-len", "6", "--new-tokens", "10"),
]


@needs_examples
def test_generate_help_lists_every_flag_with_its_default(capsys):
    assert generate is not None
    parser = generate.build_parser()
    with pytest.raises(SystemExit) as info:
        generate.main(["--help"])
    assert info.value.code == 0
    shown = " ".join(capsys.readouterr().out.split())
    for action in parser._actions:
        if action.option_strings and action.dest != "help":
            flag = max(action.option_strings, key=len)
            assert f"{' '.join(str(action.help).split())} (default: {action.default})" in shown, (
                flag
            )


@needs_examples
@pytest.mark.slow  # trains, then restores on two more meshes: about a minute
def test_generate_restored_on_every_mesh_gives_the_same_tokens(tmp_path):
    assert generate is not None
    ckpt = ["--checkpoint-dir", str(tmp_path / "ckpt")]
    out = {m: generate.main([*GENERATE_TINY, *ckpt, "--mesh", m]) for m in ("4x2", "1x8", "2x2x2")}
    first = out["4x2"]["tokens"]
    assert first.shape == (8, 10)
    for mesh, got in out.items():
        np.testing.assert_array_equal(got["tokens"], first, err_msg=mesh)
        assert got["tokens_per_s"] > 0 and 0 <= got["allowed"] <= 1
    # The cache's bytes: 2 x layers x B x S x K x D floats and B lengths, split 8 ways (1x8:
    # K over t=8, the batch whole; 4x2: B over d, K over t; 2x2x2: B, S and K), lengths over d.
    kv = 2 * 2 * 8 * 16 * 8 * 8 * 4
    assert out["4x2"]["cache_bytes"] == kv + 8 * 4
    assert out["1x8"]["cache_bytes_per_device"] == kv // 8 + 8 * 4
    assert out["4x2"]["cache_bytes_per_device"] == kv // 8 + 8 * 4 // 4
    assert out["2x2x2"]["cache_bytes_per_device"] == kv // 8 + 8 * 4 // 2


def test_the_cache_over_two_context_axes_is_refused(weights):
    """Role seq over two mesh axes ('c' and 'u'): decoding splits the cache over one."""
    mesh = jax.make_mesh((1, 2, 2, 2), ("d", "c", "u", "t"))
    with jax.set_mesh(mesh), shardlib.axis_rules(tm.rules_for(mesh)):
        cache = dec.empty_cache(CONFIG, BATCH, MAX_LEN)
        placed = tm.place_model(weights)
        tokens = jnp.zeros((BATCH,), jnp.int32)
        for fn, call in [
            ("decode_step", lambda: dec.decode_step(CONFIG, placed, cache, tokens)),
            ("prefill", lambda: dec.prefill(CONFIG, placed, tokens[:, None], tokens + 1, cache)),
        ]:
            with pytest.raises(ValueError) as info:
                call()
            msg = str(info.value)
            assert f"{fn}: the axis rules in force put role seq" in msg, msg
            assert "('c', 'u')" in msg, msg
