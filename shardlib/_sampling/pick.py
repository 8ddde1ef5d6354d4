"""The sampler as per-device shardlib code (JAX): one token id per row from logits whose
vocabulary is split over mesh axes, with one exchange over those axes.

Each device reduces its block to a few candidates per row, one ``psum`` over the vocabulary's
axes of an ``(n, B, width)`` int32 array in which each device fills its own slot (the scores'
f32 bits, their global ids, a flag; adding zeros to ints is exact) gives every device all
``n`` devices' candidates, and each device then chooses the same token (ties: the lowest id):

- greedy (temperature 0) and plain temperature sampling: each device's best tempered score
  (its logits, plus Gumbel noise when sampling) and its lowest id: ``width`` 3. The
  Gumbel-max trick makes the sample exact: ``argmax_i (logit_i / T + g_i)`` with ``g_i``
  standard Gumbel is distributed as ``softmax(logits / T)``.
- top-k and top-p: each device's top ``min(k, V/n)`` logits and their ids (its whole block,
  ids implied, when that is all of it; ``k = V`` for top-p alone, so the whole row travels),
  then the global top ``k`` by (logit, lowest id), the nucleus of their tempered softmax,
  and the Gumbel-max over what is kept.

A psum and not an all-gather because JAX types an all-gather's result as still varying over
its axes (it has no public invariant all-gather), so the tokens could not be returned the
same on every device of the vocabulary's axes with ``check_vma`` on; the psum sends twice the
bytes of the all-gather, a few words per row but for top-p alone (`rules.sample_bytes`).

May import: `shardlib._sampling.rules`, `noise`, the layers below ``_sampling`` and the
``shardops`` face.
"""

from __future__ import annotations

import math
import numbers
import operator
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from .._check.checking import check_block
from .._check.scopes import op_scope
from .._env import rules as _rules
from .._env.context import manual_axis_items, manual_axis_sizes
from ..shardops import axis_index, psum
from .noise import gumbel, step_key
from .rules import FN, CheckedSample, Settings, check_settings, check_spec, top_k_error

__all__ = ["sample"]

F32 = jnp.float32
I32 = jnp.int32
NO_ID = jnp.iinfo(jnp.int32).max


def _axes(axis: Any) -> tuple[str, ...]:
    """The ``axis`` argument (``'t'``, ``'t/u'``, ``('t', 'u')``, roles resolved) as a tuple."""
    resolved = _rules.axes(axis, f"{FN}: argument `axis`")
    if isinstance(resolved, str):
        return tuple(p for p in resolved.split("/") if p)
    if isinstance(resolved, tuple | list) and all(isinstance(a, str) for a in resolved):
        return tuple(resolved)
    raise ValueError(
        f"{FN}: argument `axis` must be None or the mesh axis (or axes, 't/u') the vocabulary "
        f"is split over; got {axis!r}"
    )


def _check_key(key: Any) -> None:
    dtype, shape = getattr(key, "dtype", None), getattr(key, "shape", None)
    typed = dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key)
    if (typed and shape == ()) or (not typed and dtype == jnp.uint32 and len(shape or ()) == 1):
        return
    got = f"{dtype}{list(shape)}" if shape is not None else type(key).__name__
    raise ValueError(
        f"{FN}: argument `key` must be one PRNG key, the same on every device: shape () from "
        f"jax.random.key(seed) or uint32[2] from jax.random.PRNGKey(seed); got {got}"
    )


def _check_step(step: Any) -> None:
    if isinstance(step, numbers.Integral) and not isinstance(step, bool):
        if operator.index(step) >= 0:
            return
    elif getattr(step, "shape", None) == () and jnp.issubdtype(step.dtype, jnp.integer):
        return
    raise ValueError(
        f"{FN}: argument `step` must be an int >= 0 or an integer array of shape () (the "
        f"decoding step, folded into the key); got {step!r}"
    )


def _prepare(spec: Any, logits: Any, key: Any, step: Any, axis: Any, settings: Settings):
    """Check the arguments (the spec, the block, the key, the step); the checked spec."""
    manual = manual_axis_sizes()
    want = None if axis is None else _axes(axis)
    text = _rules.text(spec, f"{FN}: argument `spec`")
    checked = check_spec(text, want, bool(manual))
    where = f"{FN}: argument `logits`"
    check_block(logits, checked.spec, op_scope(), manual_axis_items(), where)
    if not jnp.issubdtype(logits.dtype, jnp.floating):
        raise ValueError(
            f"{where} must be floating-point logits; got dtype {logits.dtype}: cast them with "
            ".astype(jnp.float32)"
        )
    _check_key(key)
    _check_step(step)
    n = math.prod(manual[a] for a in checked.vocab.sharding)
    vocab = logits.shape[1] * n
    bad = top_k_error(settings.top_k, vocab, checked)
    if bad:
        raise ValueError(bad)
    if vocab < 1:
        raise ValueError(f"{where} must hold at least one token; dim {str(checked.vocab)!r} is 0")
    return checked, n


def _exchange(checked: CheckedSample, packed: jax.Array, n: int) -> jax.Array:
    """Every device's ``(B, width)`` int32 block, ``(n, B, width)``, on every device of the
    vocabulary's axes (in the order of their blocks of the vocabulary): one psum in which each
    device fills its own slot."""
    if n == 1:
        return packed[None]
    axes = checked.vocab.sharding
    mine = jnp.arange(n) == axis_index(axes)
    slots = jnp.where(mine[:, None, None], packed[None], 0)
    return psum(checked.exchange_text(n, packed.shape[1]), slots, axes)


def _bits(x: jax.Array) -> jax.Array:
    return lax.bitcast_convert_type(x.astype(F32), I32)


def _floats(x: jax.Array) -> jax.Array:
    return lax.bitcast_convert_type(x, F32)


def _rows_first(x: jax.Array) -> jax.Array:
    """``(n, B, w)`` -> ``(B, n * w)``: each row's candidates in the order of the devices."""
    return jnp.moveaxis(x, 0, 1).reshape(x.shape[1], -1)


def _choose(scores: jax.Array, ids: jax.Array, bad: jax.Array) -> jax.Array:
    """Per row the id of the greatest score, the lowest id among ties; -1 where ``bad`` or
    where every score is -inf (nothing to choose)."""
    top = jnp.max(scores, axis=-1)
    tok = jnp.min(jnp.where(scores == top[:, None], ids, NO_ID), axis=-1)
    return jnp.where(bad | (top == -jnp.inf), -1, tok).astype(I32)


def _best(checked, x, bad, scores, offset, n):
    """Greedy and plain temperature: each device's best score and id, exchanged; the token."""
    arg = jnp.argmax(scores, axis=-1).astype(I32)  # the first: the lowest id among ties
    best = jnp.max(scores, axis=-1)
    packed = jnp.stack([_bits(best), offset + arg, bad.astype(I32)], axis=-1)
    every = _exchange(checked, packed, n)
    vals, ids = _floats(every[..., 0]).T, every[..., 1].T
    return _choose(vals, ids, jnp.any(every[..., 2] != 0, axis=0))


def _candidates(checked, x, bad, offset, n, k):
    """Each row's global top ``k`` logits, sorted (ties: the lowest id first), their ids, and
    the rows' NaN flags, from every device's top ``min(k, V/n)``."""
    b, v = x.shape
    local = min(k, v)
    if local == v:  # the whole block: the ids are implied by the slots' order
        every = _exchange(checked, jnp.concatenate([_bits(x), bad[:, None].astype(I32)], -1), n)
        vals = _rows_first(_floats(every[..., :v]))
        ids = jnp.broadcast_to(jnp.arange(n * v, dtype=I32), vals.shape)
        flags = every[..., v]
    else:
        tv, ti = lax.top_k(x, local)  # ties: the lower index first
        packed = jnp.concatenate([_bits(tv), offset + ti.astype(I32), bad[:, None].astype(I32)], -1)
        every = _exchange(checked, packed, n)
        vals = _rows_first(_floats(every[..., :local]))
        ids = _rows_first(every[..., local : 2 * local])
        flags = every[..., 2 * local]
    # Among equal logits the candidates' order is their ids' (by device, then within one), so
    # top_k's "lower index first" is "lowest id first".
    vals, pos = lax.top_k(vals, k)
    return vals, jnp.take_along_axis(ids, pos, axis=-1), jnp.any(flags != 0, axis=0)


def _nucleus(u: jax.Array, top_p: float) -> jax.Array:
    """``u`` (tempered logits, sorted descending) with -inf past the nucleus: the shortest
    prefix whose probability (softmax of ``u``) reaches ``top_p`` is kept."""
    m = u[:, :1]
    w = jnp.exp(u - jnp.where(m == -jnp.inf, 0.0, m))
    total = jnp.sum(w, axis=-1, keepdims=True)
    prob = w / jnp.where(total == 0, 1.0, total)
    before = jnp.concatenate([jnp.zeros_like(prob[:, :1]), jnp.cumsum(prob, axis=-1)[:, :-1]], -1)
    return jnp.where(before < top_p, u, -jnp.inf)


def sample(
    spec: str | bytes,
    logits: jax.Array,
    key: jax.Array,
    *,
    step: int | jax.Array,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    axis: str | tuple[str, ...] | None = None,
) -> jax.Array:
    """One token id per row from logits whose vocabulary may be split over mesh axes
    (per-device code), the same on every mesh.

    Inside a ``typed_shard_map`` body, `logits` is this device's block (``'B/d V/t'``: rows
    over ``d``, the vocabulary over ``t``); each device reduces it to a few candidates per
    row and one all-reduce over the vocabulary's axes brings every device's to every device
    (`sample_bytes`), which then all choose the same token. Outside ``shard_map`` the logits
    are the global array (spec ``'B V'``, no mesh axes) and nothing is communicated.

    - ``temperature=0``: greedy, the argmax; among equal logits the lowest id.
    - ``temperature > 0``: an exact sample of ``softmax(logits / temperature)`` by the
      Gumbel-max trick, restricted to the ``top_k`` greatest logits (ties: the lowest ids)
      and then to the nucleus of ``top_p``: the shortest prefix of those tokens, in order of
      probability, whose tempered probability (renormalised over the top-k) reaches
      ``top_p`` (Holtzman et al.; Hugging Face's and vLLM's order: temperature, top-k,
      top-p). Top-p without ``top_k`` needs the whole row: every device's whole block is
      exchanged (``B * V/t`` words each); with ``top_k`` only ``k`` per device.
    - The noise of a (row, token) pair is a function of ``key``, ``step``, the row's global
      index and the token's global id only (``fold_in`` of each, in that order), so the
      token is bit-identical on every mesh and batch split, and outside ``shard_map``.
    - A row with a NaN or +inf logit, or with no logit above -inf, gives -1 (never a
      silently chosen token); -inf logits are masked tokens.

    **Arguments:**

    - `spec`: the logits' shape spec, rows then the vocabulary: ``'B/d V/t'`` (the vocabulary
      may be split over several axes, ``'V/t/u'``; roles are resolved under
      `shardlib.axis_rules`).
    - `logits`: this device's block ``(B, V/t)``, any float dtype (scored in f32).
    - `key`: one PRNG key, the same on every device (``jax.random.key(seed)`` or
      ``jax.random.PRNGKey(seed)``); unused when greedy.
    - `step`: the decoding step (an int ``>= 0`` or a traced integer scalar): a new
      step, new noise.
    - `temperature`, `top_k`, `top_p`: Python numbers, fixed at trace time; ``top_k`` at most
      ``V``, ``top_p`` in ``(0, 1]`` (1 keeps every token). Greedy ignores ``top_k`` and
      ``top_p`` (the argmax is in both).
    - `axis`: optional, the mesh axis (or axes) the vocabulary is split over, checked against
      the spec (which says it already).

    **Returns:** ``i32 (B,)``, global token ids (or -1, above), spec the rows' dim
    (``'B/d'``), the same on every device of the vocabulary's axes.

    **Raises:** `SpecError` for a spec that is not two dims, a vocabulary dim not split over
    exactly ``axis``, or mesh axes outside ``shard_map``; ``ValueError`` naming the argument
    for a temperature ``< 0``, a ``top_k`` not in ``[1, V]``, a ``top_p`` outside ``(0, 1]``,
    logits that are not floats, a key that is not one key, a negative step;
    ``TypeCheckError`` for a block that does not match the spec.

    Examples:
        >>> tokens = sampling.sample('B/d V/t', logits, key, step=t, temperature=0.7, top_k=50)
    """
    settings = check_settings(temperature, top_k, top_p)
    checked, n = _prepare(spec, logits, key, step, axis, settings)
    x = logits.astype(F32)
    b, v = x.shape
    vocab = n * v
    bad_entry = jnp.isnan(x) | (x == jnp.inf)
    bad = jnp.any(bad_entry, axis=-1)
    x = jnp.where(bad_entry, -jnp.inf, x)
    offset = (axis_index(checked.vocab.sharding) * v).astype(I32) if n > 1 else jnp.int32(0)
    batch_axes = checked.batch.sharding
    first = axis_index(batch_axes) * b if batch_axes else 0
    rows = (first + jnp.arange(b)).astype(I32)
    if settings.greedy:
        return _best(checked, x, bad, x, offset, n)
    key = step_key(key, step)
    t = settings.temperature
    if not settings.restricted(vocab):
        noise = gumbel(key, rows, (offset + jnp.arange(v, dtype=I32))[None])
        return _best(checked, x, bad, x / t + noise, offset, n)
    vals, ids, bad = _candidates(checked, x, bad, offset, n, settings.top_k or vocab)
    u = vals / t
    if settings.top_p is not None:
        u = _nucleus(u, settings.top_p)
    return _choose(u + gumbel(key, rows, ids), ids, bad)
