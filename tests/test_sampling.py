"""``shardlib.sampling.sample``: one token per row from logits whose vocabulary is split over a
mesh axis, against an unsharded reference in plain NumPy / jax.numpy.

Each case places global logits ``(B, V)`` on a mesh of the 8 simulated devices (the
vocabulary over ``t``; rows over ``d``; a third axis replicated) and runs `sample` inside
``typed_shard_map``: greedy is NumPy's argmax (the lowest id among ties) on every mesh;
sampled tokens are bit-identical on every mesh and to `sample` on the global array outside
``shard_map``; the empirical distribution of 20480 seeded draws matches
``softmax(logits / T)`` restricted to the top-k and the nucleus (a chi-square bound); top-k
and top-p never leave their sets; the one exchange equals `sample_bytes`, explain and the
compiled HLO; every argument rule refuses with its message.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from typeguard import TypeCheckError

import shardlib
from shardlib import SpecError, sampling
from shardlib._explain import hlo
from shardlib._sampling.noise import gumbel, keys, step_key
from shardlib.shardtypes import Array, bf16, f32, i32, typed_shard_map, u32
from tests._mesh_util import make_mesh, place

# (name, mesh shape, mesh names, rows' dim, vocabulary's dim)
MESHES = {
    "1x8": ((8,), ("t",), "B", "V/t"),
    "4x2": ((4, 2), ("d", "t"), "B/d", "V/t"),
    "2x2x2": ((2, 2, 2), ("d", "t", "z"), "B/d", "V/t"),
    "2x4/tu": ((2, 2, 2), ("d", "t", "u"), "B/d", "V/t/u"),
}
# The settings every mesh case runs, in one program: (temperature, top_k, top_p).
SETTINGS = (
    (0.0, None, None),
    (0.8, None, None),
    (0.8, 5, None),
    (1.3, None, 0.7),
    (0.6, 12, 0.9),
)
KEY = np.asarray(jax.random.PRNGKey(7))


@functools.cache
def _sampler(bs: str, vs: str, settings: tuple = SETTINGS):
    """A ``typed_shard_map`` that samples with every one of ``settings`` at once."""
    spec = f"{bs} {vs}"
    ret = tuple[(i32[Array, bs.encode()],) * len(settings)]

    @typed_shard_map
    def f(logits: f32[Array, spec.encode()], key: u32[Array, b"2"], step: i32[Array, b""]) -> ret:  # pyright: ignore[reportInvalidTypeForm]
        return tuple(
            sampling.sample(spec, logits, key, step=step, temperature=t, top_k=k, top_p=p)
            for t, k, p in settings
        )

    return f


def _run(name: str, logits: np.ndarray, step: int = 3, settings: tuple = SETTINGS):
    """Every setting's tokens on mesh ``name`` (``'global'``: outside shard_map, jitted)."""
    if name == "global":

        @jax.jit
        def g(x, key, s):
            return tuple(
                sampling.sample("B V", x, key, step=s, temperature=t, top_k=k, top_p=p)
                for t, k, p in settings
            )

        return [np.asarray(t) for t in g(logits, jnp.asarray(KEY), jnp.int32(step))]
    shape, names, bs, vs = MESHES[name]
    mesh = make_mesh(shape, names)
    with jax.set_mesh(mesh):
        args = (
            place(logits, mesh, f"{bs} {vs}"),
            place(KEY, mesh, "2"),
            place(np.int32(step), mesh, ""),
        )
        return [np.asarray(t) for t in jax.jit(_sampler(bs, vs, settings))(*args)]


# -- the reference: plain NumPy ------------------------------------------------------------------


def allowed(logits: np.ndarray, temperature: float, top_k, top_p) -> list[np.ndarray]:
    """Per row the ids `sample` may return and their probabilities (float64): the top-k by
    (logit, lowest id), then the shortest prefix whose tempered probability reaches top_p."""
    out = []
    for row in np.asarray(logits, np.float64):
        order = np.lexsort((np.arange(row.size), -row))  # logit descending, then id
        if top_k is not None:
            order = order[:top_k]
        u = row[order] / temperature
        p = np.exp(u - u.max())
        p /= p.sum()
        if top_p is not None:
            before = np.concatenate([[0.0], np.cumsum(p)[:-1]])
            keep = before < top_p
            order, p = order[keep], p[keep] / p[keep].sum()
        out.append(np.stack([order, p]))
    return out


def _logits(b: int, v: int, seed: int, ties: bool = False) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if ties:  # few distinct values: many ties, also across the devices' blocks
        return rng.integers(0, 4, (b, v)).astype(np.float32)
    return (2 * rng.standard_normal((b, v))).astype(np.float32)


# -- every mesh gives the same tokens --------------------------------------------------------------


@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "ties"])
def test_the_same_tokens_on_every_mesh_and_greedy_is_argmax(ties):
    """Greedy is NumPy's argmax (the lowest id among equal logits), and every setting's tokens
    are bit-identical on 1x8, 4x2, 2x2x2, a vocabulary over two axes, and the global array."""
    logits = _logits(8, 64, seed=1, ties=ties)
    want = _run("global", logits)
    np.testing.assert_array_equal(want[0], np.argmax(logits, axis=-1))
    for name in MESHES:
        got = _run(name, logits)
        for s, g, w in zip(SETTINGS, got, want, strict=True):
            np.testing.assert_array_equal(g, w, err_msg=f"{name} {s}")
    for (t, k, p), tokens in zip(SETTINGS[1:], want[1:], strict=True):
        for row, (ids, _) in zip(tokens, allowed(logits, t, k, p), strict=True):
            assert row in ids


def test_each_step_and_row_has_its_own_noise():
    """The noise of (step, row, id) differs for every triple; the same triple gives the same
    noise, whatever else is drawn with it (the block's shape, the other rows and ids)."""
    key = step_key(jnp.asarray(KEY), 0)
    rows, ids = jnp.arange(16, dtype=jnp.int32), jnp.arange(32, dtype=jnp.int32)[None]
    a = np.asarray(gumbel(key, rows, ids))
    words = np.concatenate(
        [np.asarray(keys(step_key(jnp.asarray(KEY), s), rows, ids)).reshape(-1, 2) for s in (0, 1)]
    )
    assert np.unique(words, axis=0).shape[0] == 2 * 16 * 32  # 64-bit keys: no collision
    part = np.asarray(gumbel(key, rows[5:7], ids[:, 8:12]))
    np.testing.assert_array_equal(part, a[5:7, 8:12])
    logits = np.zeros((8, 16), np.float32)  # every row alike: only the keys tell them apart
    s0, s1 = (_run("global", logits, step, SETTINGS[1:2])[0] for step in (0, 1))
    assert len(set(s0.tolist())) > 3 and (s0 != s1).any()


# -- the distribution ------------------------------------------------------------------------------

# scipy.stats.chi2.isf(1e-6, df) for df = 1..7: a correct sampler exceeds it once in a million
# seeds; the seed is fixed, so the test is deterministic, and this says it was not tuned to it.
CHI2_1E6 = {1: 23.93, 2: 27.63, 3: 30.66, 4: 33.38, 5: 35.89, 6: 38.26, 7: 40.52}
DRAWS = 20480
ROW = np.array([1.2, -0.3, 0.4, 2.0, 0.0, -1.5, 0.9, 0.4], np.float32)  # ids 2 and 7 tie
DIST_SETTINGS = ((0.7, None, None), (1.0, 3, None), (0.9, None, 0.8), (1.5, 5, 0.75))


def _chi2(counts: np.ndarray, ids: np.ndarray, p: np.ndarray) -> float:
    expected = DRAWS * p
    return float(np.sum((counts[ids] - expected) ** 2 / expected))


def test_the_empirical_distribution_matches_the_restricted_softmax():
    """20480 draws (rows alike, so only their keys differ) on a 4x2 mesh: nothing outside the
    top-k and the nucleus, and the counts inside pass a chi-square test at p = 1e-6 against
    ``softmax(logits / T)`` restricted and renormalised. The bound has teeth: the same counts
    fail against the wrong temperature or the unrestricted softmax."""
    logits = np.tile(ROW, (DRAWS, 1))
    got = _run("4x2", logits, step=11, settings=DIST_SETTINGS)
    powered = 0
    for (t, k, p), tokens in zip(DIST_SETTINGS, got, strict=True):
        ids, prob = allowed(ROW[None], t, k, p)[0]
        ids = ids.astype(int)
        counts = np.bincount(tokens, minlength=ROW.size)
        assert counts.sum() == DRAWS and counts[np.setdiff1d(np.arange(ROW.size), ids)].sum() == 0
        stat = _chi2(counts, ids, prob)
        assert stat < CHI2_1E6[len(ids) - 1], (t, k, p, stat)
        wrong_ids, wrong = allowed(ROW[None], 2 * t, k, p)[0]
        if np.array_equal(wrong_ids, ids):  # the same support at twice the temperature
            powered += 1
            assert _chi2(counts, ids, wrong) > 4 * CHI2_1E6[len(ids) - 1], (t, k, p)
    assert powered >= 2
    (full,) = [g for s, g in zip(DIST_SETTINGS, got, strict=True) if s == (0.7, None, None)]
    assert len(np.unique(full)) == ROW.size  # every token drawn without restriction


# -- edges -------------------------------------------------------------------------------------


def test_nan_inf_and_masked_rows():
    """A row with a NaN or +inf logit, or with nothing above -inf, gives -1 in every setting;
    -inf logits (masked tokens) are never drawn; the other rows are untouched."""
    logits = _logits(8, 16, seed=5)
    logits[1, 13] = np.nan
    logits[2, 2] = np.inf
    logits[3] = -np.inf
    logits[4, :15] = -np.inf  # one token left: always it
    logits[5, ::2] = -np.inf
    want = _run("global", logits)
    for name in ("4x2",):
        for s, g, w in zip(SETTINGS, _run(name, logits), want, strict=True):
            np.testing.assert_array_equal(g, w, err_msg=f"{name} {s}")
    for tokens in want:
        assert (tokens[1:4] == -1).all() and tokens[4] == 15 and tokens[5] % 2 == 1
        assert (tokens[[0, 6, 7]] >= 0).all()


# -- the exchange: sample_bytes, explain and the compiled program ----------------------------------


@pytest.mark.parametrize("name", ["4x2", "2x4/tu"])
def test_one_exchange_equals_the_formula_explain_and_the_hlo(name):
    """One all-reduce over the vocabulary's axes per setting (greedy 3 words per row, top-k
    ``2k + 1``, top-p alone the whole block); explain's rows and bytes are `sample_bytes`'s,
    and equal the compiled HLO's."""
    shape, names, bs, vs = MESHES[name]
    sizes = dict(zip(names, shape, strict=True))
    vaxes = tuple(a for a in vs.split("/")[1:])
    n = int(np.prod([sizes[a] for a in vaxes]))
    b, v = 8, 64
    mesh = make_mesh(shape, names)
    f = _sampler(bs, vs)
    with jax.set_mesh(mesh):
        args = (
            place(_logits(b, v, 0), mesh, f"{bs} {vs}"),
            place(KEY, mesh, "2"),
            place(np.int32(0), mesh, ""),
        )
        report = shardlib.explain(f, *args)
        text = jax.jit(f).lower(*args).compile().as_text() or ""
    local_b = b // sizes.get("d", 1)
    want = [sampling.sample_bytes(local_b, v, n, *s) for s in SETTINGS]
    assert want[0] == 2 * (n - 1) * local_b * 3 * 4
    assert want[3] == 2 * (n - 1) * local_b * (v // n + 1) * 4  # top-p alone: the whole row
    assert [(r.kind, r.axes, r.total_sent) for r in report.collectives] == [
        ("all-reduce", vaxes, w) for w in want
    ]
    found, unknown = hlo.collectives(text)
    # XLA may combine the five all-reduces into one instruction; their operands are the
    # (n, B, width) int32 exchanges, all-reduce sends 2 (n - 1) / n of each
    assert unknown == 0 and {x.kind for x in found} == {"all-reduce"}
    operands = sorted(b for x in found for b in x.operand_bytes)
    assert sorted(w * n // (2 * (n - 1)) for w in want) == operands
    cmp = report.compare_hlo(text)
    assert cmp.identical and cmp.n_hlo == cmp.n_report == len(SETTINGS), str(cmp)


def test_a_vocabulary_that_is_not_split_needs_no_collective():
    mesh = make_mesh((8,), ("d",))
    f = _sampler("B/d", "V")
    with jax.set_mesh(mesh):
        args = (
            place(_logits(8, 16, 0), mesh, "B/d V"),
            place(KEY, mesh, "2"),
            place(np.int32(0), mesh, ""),
        )
        report = shardlib.explain(f, *args)
        got = [np.asarray(t) for t in jax.jit(f)(*args)]
    assert report.collectives == []
    for g, w in zip(got, _run("global", _logits(8, 16, 0), step=0), strict=True):
        np.testing.assert_array_equal(g, w)


# -- a seeded random suite -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "seed", [0, 1, *(pytest.param(s, marks=pytest.mark.slow) for s in range(2, 10))]
)
def test_random_shapes_splits_and_settings(seed):
    """Seeded random meshes, rows, vocabularies (a block of 1 to 9 ids per device) and
    settings: the same tokens as on the global array, each in its allowed set."""
    rng = np.random.default_rng(100 + seed)
    name = list(MESHES)[seed % len(MESHES)]
    shape, names, bs, vs = MESHES[name]
    sizes = dict(zip(names, shape, strict=True))
    n = int(np.prod([sizes[a] for a in vs.split("/")[1:]]))
    b = sizes.get("d", 1) * int(rng.integers(1, 4))
    v = n * int(rng.integers(1, 10))
    settings = (
        (0.0, None, None),
        (float(rng.uniform(0.3, 2.0)), int(rng.integers(1, v + 1)), None),
        (float(rng.uniform(0.3, 2.0)), None, float(rng.uniform(0.2, 1.0))),
        (float(rng.uniform(0.3, 2.0)), int(rng.integers(1, v + 1)), float(rng.uniform(0.2, 1.0))),
    )
    logits = _logits(b, v, seed, ties=bool(seed % 2))
    got = _run(name, logits, step=seed, settings=settings)
    want = _run("global", logits, step=seed, settings=settings)
    np.testing.assert_array_equal(got[0], np.argmax(logits, axis=-1))
    for s, g, w in zip(settings, got, want, strict=True):
        np.testing.assert_array_equal(g, w, err_msg=f"{name} {s}")
        if s[0]:
            for tok, (ids, _) in zip(g, allowed(logits, *s), strict=True):
                assert tok in ids, (s, tok, ids)


# -- the argument rules ------------------------------------------------------------------------------


def _global(**kw):
    x = kw.pop("logits", np.zeros((4, 8), np.float32))
    spec = kw.pop("spec", "B V")
    key = kw.pop("key", jax.random.key(0))
    step = kw.pop("step", 0)
    return jax.jit(lambda x: sampling.sample(spec, x, key, step=step, **kw)).trace(x)


def _raises(exc, fn, *words):
    with pytest.raises(exc) as err:
        fn()
    for w in words:
        assert w in str(err.value), str(err.value)


VALUE_RULES = [
    (dict(temperature=-0.5), ("argument `temperature` must be a finite number >= 0", "-0.5")),
    (dict(temperature=float("nan")), ("argument `temperature`",)),
    (dict(temperature=True), ("argument `temperature`",)),
    (dict(temperature=1.0, top_k=0), ("argument `top_k` must be None or an int >= 1", "got 0")),
    (dict(temperature=1.0, top_k=2.0), ("argument `top_k`", "2.0")),
    (dict(temperature=1.0, top_k=9), ("argument `top_k` must be at most", "'V' = 8", "got 9")),
    (
        dict(temperature=1.0, top_p=0.0),
        ("argument `top_p` must be None or a number in (0, 1]",),
    ),
    (dict(temperature=1.0, top_p=1.5), ("argument `top_p`", "1.5")),
    (
        dict(logits=np.zeros((4, 8), np.int32)),
        ("argument `logits` must be floating-point", "int32"),
    ),
    (dict(key=np.zeros(2, np.int32)), ("argument `key` must be one PRNG key", "int32[2]")),
    (
        dict(key=jax.random.split(jax.random.key(0), 2)),
        ("argument `key` must be one PRNG key",),
    ),
    (dict(step=-1), ("argument `step` must be an int >= 0", "-1")),
    (dict(step=1.5), ("argument `step`",)),
    (dict(axis=3), ("argument `axis` must be None or the mesh axis",)),
]


def test_value_rules():
    for kw, words in VALUE_RULES:
        _raises(ValueError, lambda kw=kw: _global(**kw), "sampling.sample: ", *words)


SPEC_RULES = [
    (dict(spec="B L V"), ("must give the logits two dims", "3 dims")),
    (dict(spec="B V {+t}"), ("must give the logits two dims",)),
    (dict(spec="B V/t"), ("names mesh axes ('t',), but no mesh axis is manual here",)),
    (
        dict(spec="B V", axis="t"),
        ("must split the vocabulary dim over exactly argument `axis`",),
    ),
]


def test_spec_rules():
    for kw, words in SPEC_RULES:
        _raises(SpecError, lambda kw=kw: _global(**kw), "sampling.sample: argument `spec`", *words)


def test_block_rules_inside_shard_map():
    """Inside a body: a block that does not match the spec, an ``axis`` the spec does not
    split the vocabulary over, a ``top_k`` above the global vocabulary (``V/t`` times ``t``)."""
    mesh = make_mesh((4, 2), ("d", "t"))

    def trace(spec, block_spec, axis=None, **kw):
        @typed_shard_map
        def f(logits: f32[Array, block_spec.encode()]) -> i32[Array, b"B/d"]:
            return sampling.sample(spec, logits, jax.random.key(0), step=0, axis=axis, **kw)

        with jax.set_mesh(mesh):
            x = place(np.zeros((8, 16), np.float32), mesh, block_spec)
            return jax.jit(f).trace(x)

    trace("B/d V/t", "B/d V/t", axis="t", temperature=1.0, top_k=16)  # fine
    _raises(TypeCheckError, lambda: trace("B/d V/t", "B/d V"), "sampling.sample: argument `logits`")
    _raises(
        SpecError, lambda: trace("B/d V/t", "B/d V/t", axis="d"), "argument `axis` ('d')", "'V/t'"
    )
    _raises(
        ValueError, lambda: trace("B/d V/t", "B/d V/t", temperature=1.0, top_k=17), "'V/t' = 16"
    )


def test_roles_for_the_spec_and_the_axis_and_bf16_logits():
    """The spec and ``axis`` may name roles (`shardlib.axis_rules`); bf16 logits are scored in
    f32 (the same tokens as their f32 values)."""
    mesh = make_mesh((2, 4), ("d", "t"))
    logits = _logits(4, 32, seed=8)

    @typed_shard_map
    def f(x: bf16[Array, b"B/batch V/vocab"], key: u32[Array, b"2"]) -> i32[Array, b"B/batch"]:
        return sampling.sample("B/batch V/vocab", x, key, step=3, temperature=0.8, axis="vocab")

    with jax.set_mesh(mesh), shardlib.axis_rules(batch="d", vocab="t"):
        args = (place(logits.astype(jnp.bfloat16), mesh, "B/d V/t"), place(KEY, mesh, "2"))
        got = np.asarray(jax.jit(f)(*args))
        (row,) = shardlib.explain(f, *args).collectives
    want = _run("global", np.asarray(logits.astype(jnp.bfloat16), np.float32), step=3)[1]
    np.testing.assert_array_equal(got, want)
    assert (row.kind, row.axes) == ("all-reduce", ("t",))


def test_top_p_one_keeps_every_token():
    """``top_p=1`` is no nucleus at all (never the f32 cumulative sum's rounding): the same
    tokens and the same exchange as temperature alone."""
    logits = _logits(8, 16, seed=3)
    logits[:, 8:] -= 30.0  # a tail whose mass rounds the running sum to 1 in f32
    a, b = _run("global", logits, settings=((1.0, None, None), (1.0, None, 1.0)))
    np.testing.assert_array_equal(a, b)
    assert sampling.sample_bytes(8, 64, 2, 1.0, None, 1.0) == sampling.sample_bytes(8, 64, 2, 1.0)


def test_sampling_is_public():
    assert set(sampling.__all__) == {"sample", "sample_bytes"}
    assert shardlib.sampling is sampling
    _raises(ValueError, lambda: sampling.sample_bytes(8, 30, 4), "argument `vocab`")
