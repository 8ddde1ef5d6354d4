"""shardlib's transformer training step vs the same step written by hand with ``jax.shard_map``.

The shardlib step is ``examples/transformer_model.py`` (FSDP over ``d`` + tensor parallelism over
``t``). The hand-written step below is the same math with every ``shardops`` call replaced by
the ``jax.lax`` collective it stands for, einsum equations written with the letters shardlib
assigns (dim names get ``a, b, c, ...`` in order of first appearance, operands then output), and
the ``in_specs``/``out_specs`` written out as ``PartitionSpec`` literals.

It reports, on 8 simulated CPU devices in one process:

- the step-time ratio shardlib / hand: the median of per-pair ratios over interleaved pairs
  (A,B then B,A, each step blocked on), with a bootstrap 95% interval, beside an A/A control
  (hand / hand) that shows the noise floor;
- the trace, lower and compile time ratios, with fresh closures each repetition (so nothing is
  served from JAX's caches);
- the collectives of each kind in both compiled programs (they must be equal), and whether the
  canonicalized compiled HLO texts are identical.

Run from the repository root::

    python -m benchmarks.step_vs_hand --pairs 120 --compile-reps 5
"""

from __future__ import annotations

import os
import sys

if "jax" not in sys.modules:  # set before JAX starts; harmless when imported by the tests
    _flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in _flags:
        os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()
if __package__ in (None, ""):  # run as a file: make the repository root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import functools  # noqa: E402
import math  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable, Sequence  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.ad_checkpoint import checkpoint_name  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from benchmarks import _hlo  # noqa: E402
from examples import transformer_model as tm  # noqa: E402
from examples.transformer_model import Config, Layer, Model  # noqa: E402

# The pure-jnp pieces (no sharding, no communication) are shared with the shardlib model so
# that both steps do exactly the same arithmetic.
_rms_norm, _rope, _softmax = tm._rms_norm, tm._rope, tm._softmax

SIZES = {
    "tiny": (
        Config(
            vocab=64, d_model=32, n_heads=4, n_kv_heads=2, d_head=8, d_ff=64, n_layers=2, seq_len=16
        ),
        8,
    ),
    "small": (
        Config(
            vocab=512,
            d_model=128,
            n_heads=8,
            n_kv_heads=4,
            d_head=16,
            d_ff=512,
            n_layers=4,
            seq_len=64,
        ),
        16,
    ),
}

# ---------------------------------------------------------------------------------------------
# The hand-written step.
# ---------------------------------------------------------------------------------------------

_SAVE = "hand.save_for_backward"

LAYER_SPECS = Layer(
    ln1=P(None, ("t", "d")),
    w_q=P(None, "d", "t", None, None),
    w_k=P(None, "d", "t", None),
    w_v=P(None, "d", "t", None),
    w_o=P(None, "t", None, None, "d"),
    ln2=P(None, ("t", "d")),
    w_gate=P(None, "d", "t"),
    w_up=P(None, "d", "t"),
    w_down=P(None, "t", "d"),
)
MODEL_SPECS = Model(
    embed=P("t", "d"), layers=LAYER_SPECS, final_norm=P(("t", "d")), unembed=P("d", "t")
)
TOKENS_SPEC = P("d", None)


def _hand_layer(config: Config, x: jax.Array, w: Layer) -> jax.Array:
    ln1 = lax.all_gather(w.ln1, ("t", "d"), axis=0, tiled=True)
    h = _rms_norm(x, ln1, config.norm_eps)
    w_q = lax.all_gather(w.w_q, "d", axis=0, tiled=True)
    q = jnp.einsum("abc,cdef->abdef", h, w_q)  # B L M, M K G D -> B L K G D
    w_k = lax.all_gather(w.w_k, "d", axis=0, tiled=True)
    k = jnp.einsum("abc,cde->abde", h, w_k)  # B L M, M K D -> B L K D
    w_v = lax.all_gather(w.w_v, "d", axis=0, tiled=True)
    v = jnp.einsum("abc,cde->abde", h, w_v)
    q = _rope(q, 1, config.rope_base)
    k = _rope(k, 1, config.rope_base)
    scores = jnp.einsum("abcde,afce->acdbf", q, k)  # B L K G D, B S K D -> B K G L S
    scores = scores / math.sqrt(q.shape[-1])
    seq = x.shape[1]
    causal = jnp.arange(seq)[:, None] >= jnp.arange(seq)[None, :]
    scores = jnp.where(causal, scores, -jnp.inf)
    probs = _softmax(scores)
    o = jnp.einsum("abcde,aebf->adbcf", probs, v)  # B K G L S, B S K D -> B L K G D
    o = checkpoint_name(o, _SAVE)
    w_o = lax.all_gather(w.w_o, "d", axis=3, tiled=True)
    attn = jnp.einsum("abcde,cdef->abf", o, w_o)  # B L K G D, K G D M -> B L M
    attn = lax.psum(attn, "t")
    x = checkpoint_name(x + attn, _SAVE)

    ln2 = lax.all_gather(w.ln2, ("t", "d"), axis=0, tiled=True)
    h = _rms_norm(x, ln2, config.norm_eps)
    w_gate = lax.all_gather(w.w_gate, "d", axis=0, tiled=True)
    gate = jnp.einsum("abc,cd->abd", h, w_gate)  # B L M, M F -> B L F
    w_up = lax.all_gather(w.w_up, "d", axis=0, tiled=True)
    up = jnp.einsum("abc,cd->abd", h, w_up)
    act = jax.nn.silu(gate) * up
    w_down = lax.all_gather(w.w_down, "d", axis=1, tiled=True)
    mlp = jnp.einsum("abc,cd->abd", act, w_down)  # B L F, F M -> B L M
    mlp = lax.psum(mlp, "t")
    return x + mlp


def _hand_loss_body(config: Config, tokens: jax.Array, model: Model) -> jax.Array:
    embed = lax.all_gather(model.embed, "d", axis=1, tiled=True)
    # index_unreduced('[V/t] M, B/d L -> B/d L M'): look up in this device's vocabulary block.
    block = embed.shape[0]
    local = tokens - lax.axis_index("t") * block
    ok = (local >= 0) & (local < block)
    got = jnp.take(embed, jnp.where(ok, local, 0), axis=0, mode="clip")
    x = jnp.where(ok.reshape(tokens.shape + (1,)), got, jnp.zeros((), embed.dtype))
    x = lax.psum(x, "t")

    layer = jax.checkpoint(
        functools.partial(_hand_layer, config),
        prevent_cse=True,
        policy=jax.checkpoint_policies.save_only_these_names(_SAVE),
    )

    def body(x, w):
        return layer(x, w), None

    x, _ = lax.scan(body, x, model.layers)

    gain = lax.all_gather(model.final_norm, ("t", "d"), axis=0, tiled=True)
    h = _rms_norm(x, gain, config.norm_eps)
    unembed = lax.all_gather(model.unembed, "d", axis=0, tiled=True)
    logits = jnp.einsum("abc,cd->abd", h, unembed)

    local_max = lax.stop_gradient(jnp.max(logits, axis=-1))
    shift = lax.pmax(local_max, "t")
    sum_exp = jnp.sum(jnp.exp(logits - shift[..., None]), axis=-1)
    lse = jnp.log(lax.psum(sum_exp, "t")) + shift

    targets = jnp.roll(tokens, -1, axis=1)
    block = logits.shape[-1]
    local_target = targets - lax.axis_index("t") * block
    hit = jnp.arange(block) == local_target[..., None]
    target_logit = jnp.sum(jnp.where(hit, logits, 0.0), axis=-1)
    target_logit = lax.psum(target_logit, "t")

    seq = tokens.shape[1]
    predicts = jnp.arange(seq) < seq - 1
    local_sum = jnp.sum(jnp.where(predicts, lse - target_logit, 0.0))
    total = lax.psum(local_sum, "d")
    return total / (tokens.shape[0] * lax.axis_size("d") * (seq - 1))


def hand_loss(config: Config, tokens: jax.Array, model: Model) -> jax.Array:
    """The loss with a plain ``jax.shard_map`` (mesh from ``jax.set_mesh``)."""
    return jax.shard_map(
        functools.partial(_hand_loss_body, config),
        in_specs=(TOKENS_SPEC, MODEL_SPECS),
        out_specs=P(),
    )(tokens, model)


# ---------------------------------------------------------------------------------------------
# Measuring.
# ---------------------------------------------------------------------------------------------

LossFn = Callable[[Config, jax.Array, Model], jax.Array]


def fresh_step(loss_fn: LossFn, config: Config) -> Callable[..., Any]:
    """A new jitted SGD step (a fresh closure, so JAX has nothing cached for it)."""

    def step(model: Model, tokens: jax.Array, lr: jax.Array) -> tuple[Model, jax.Array]:
        value, grads = jax.value_and_grad(lambda m: loss_fn(config, tokens, m))(model)
        return jax.tree.map(lambda w, g: w - lr * g, model, grads), value

    return jax.jit(step)


def make_inputs(config: Config, batch: int, seed: int = 0) -> tuple[Model, jax.Array, jax.Array]:
    """Placed weights, tokens and learning rate (call under ``jax.set_mesh``)."""
    key = jax.random.key(seed, impl="rbg")  # compiles much faster on CPU than threefry
    model = tm.place_model(tm.init_model(config, key))
    tokens = jax.random.randint(
        jax.random.fold_in(key, 1), (batch, config.seq_len), 0, config.vocab, dtype=jnp.int32
    )
    mesh = jax.sharding.get_mesh()
    tokens = jax.device_put(tokens, NamedSharding(mesh, TOKENS_SPEC))
    return model, tokens, jnp.float32(0.1)


@dataclasses.dataclass
class Structure:
    census_shardlib: dict[str, int]
    census_hand: dict[str, int]
    identical_hlo: bool
    first_difference: str
    shardlib_hlo: str
    hand_hlo: str
    compiled: dict[str, Any]  # name -> the compiled step, callable with the same arguments


def compare_structure(config: Config, args: Sequence[Any]) -> Structure:
    """Compile both steps and compare their collectives and canonical HLO texts."""
    texts, compiled = {}, {}
    for name, loss_fn in (("shardlib", tm.loss), ("hand", hand_loss)):
        compiled[name] = fresh_step(loss_fn, config).trace(*args).lower().compile()
        texts[name] = compiled[name].as_text()
    a, b = (_hlo.canonicalize(texts[n]) for n in ("shardlib", "hand"))
    return Structure(
        census_shardlib=_hlo.collective_census(texts["shardlib"]),
        census_hand=_hlo.collective_census(texts["hand"]),
        identical_hlo=a == b,
        first_difference=_hlo.first_difference(a, b),
        shardlib_hlo=texts["shardlib"],
        hand_hlo=texts["hand"],
        compiled=compiled,
    )


def _bootstrap_median(ratios: Sequence[float], n: int = 2000, seed: int = 0) -> tuple[float, float]:
    rng = np.random.default_rng(seed)
    r = np.asarray(ratios)
    meds = np.median(rng.choice(r, size=(n, len(r)), replace=True), axis=1)
    return float(np.percentile(meds, 2.5)), float(np.percentile(meds, 97.5))


def _time_call(f: Callable[..., Any], args: Sequence[Any]) -> float:
    t0 = time.perf_counter()
    jax.block_until_ready(f(*args))
    return time.perf_counter() - t0


def paired_ratios(
    fa: Callable[..., Any], fb: Callable[..., Any], args: Sequence[Any], pairs: int
) -> tuple[list[float], list[float], list[float]]:
    """Per-pair ratios t_a / t_b, alternating the order (A,B then B,A), plus raw times."""
    ta, tb, ratios = [], [], []
    for i in range(pairs):
        if i % 2 == 0:
            a = _time_call(fa, args)
            b = _time_call(fb, args)
        else:
            b = _time_call(fb, args)
            a = _time_call(fa, args)
        ta.append(a)
        tb.append(b)
        ratios.append(a / b)
    return ratios, ta, tb


def compile_times(
    config: Config, args: Sequence[Any], reps: int
) -> dict[str, dict[str, list[float]]]:
    """Trace, lower and compile seconds of fresh steps, interleaved shardlib/hand."""
    out: dict[str, dict[str, list[float]]] = {
        n: {"trace": [], "lower": [], "compile": [], "total": []} for n in ("shardlib", "hand")
    }
    fns = {"shardlib": tm.loss, "hand": hand_loss}
    for i in range(reps):
        order = ("shardlib", "hand") if i % 2 == 0 else ("hand", "shardlib")
        for name in order:
            step = fresh_step(fns[name], config)
            t0 = time.perf_counter()
            traced = step.trace(*args)
            t1 = time.perf_counter()
            lowered = traced.lower()
            t2 = time.perf_counter()
            lowered.compile()
            t3 = time.perf_counter()
            rec = out[name]
            rec["trace"].append(t1 - t0)
            rec["lower"].append(t2 - t1)
            rec["compile"].append(t3 - t2)
            rec["total"].append(t3 - t0)
    return out


def _parse_mesh(text: str) -> tuple[int, int]:
    try:
        d, t = (int(p) for p in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--mesh takes DxT like 4x2, got {text!r}") from None
    return d, t


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="small")
    parser.add_argument("--mesh", type=_parse_mesh, default=(4, 2), help="d x t, e.g. 4x2")
    parser.add_argument("--pairs", type=int, default=60, help="interleaved step pairs (>= 30)")
    parser.add_argument(
        "--control-pairs", type=int, default=None, help="A/A pairs (default --pairs)"
    )
    parser.add_argument(
        "--compile-reps", type=int, default=4, help="fresh compiles of each step (0: skip)"
    )
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps of each first")
    parser.add_argument("--dump-hlo", default=None, help="directory to write both HLO texts to")
    opts = parser.parse_args(argv)
    if opts.pairs < 2:
        parser.error("--pairs must be at least 2")
    config, batch = SIZES[opts.size]
    mesh = jax.make_mesh(opts.mesh, ("d", "t"))
    print(
        f"jax {jax.__version__}, {jax.device_count()} {jax.devices()[0].platform} devices, mesh "
        f"d={opts.mesh[0]} t={opts.mesh[1]}, size {opts.size}: {config}, batch {batch}"
    )
    with jax.set_mesh(mesh):
        args = make_inputs(config, batch)

        # --- structure ----------------------------------------------------------------------
        s = compare_structure(config, args)
        print("\ncollectives in the compiled step (async start/done counted once):")
        kinds = sorted(set(s.census_shardlib) | set(s.census_hand))
        print(f"  {'kind':<20}{'shardlib':>10}{'hand':>10}")
        for k in kinds:
            print(f"  {k:<20}{s.census_shardlib.get(k, 0):>10}{s.census_hand.get(k, 0):>10}")
        same = s.census_shardlib == s.census_hand
        print(f"  census identical: {same}")
        print(f"  canonicalized compiled HLO identical: {s.identical_hlo}")
        if not s.identical_hlo:
            print("  first difference (shardlib -, hand +):\n" + s.first_difference)
        if opts.dump_hlo:
            os.makedirs(opts.dump_hlo, exist_ok=True)
            for name, text in (("shardlib", s.shardlib_hlo), ("hand", s.hand_hlo)):
                with open(os.path.join(opts.dump_hlo, f"{name}.hlo.txt"), "w") as f:
                    f.write(text)

        # --- compile time ---------------------------------------------------------------------
        if opts.compile_reps > 0:
            ct = compile_times(config, args, opts.compile_reps)
            print(
                f"\ntrace / lower / compile seconds (median of {opts.compile_reps} fresh "
                "closures each, interleaved):"
            )
            print(f"  {'stage':<10}{'shardlib':>11}{'hand':>11}{'ratio':>9}")
            for stage in ("trace", "lower", "compile", "total"):
                a = statistics.median(ct["shardlib"][stage])
                b = statistics.median(ct["hand"][stage])
                print(f"  {stage:<10}{a:>11.4f}{b:>11.4f}{a / b:>9.3f}")

        # --- step time ------------------------------------------------------------------------
        step_a, step_b = s.compiled["shardlib"], s.compiled["hand"]
        loss_a, loss_b = float(step_a(*args)[1]), float(step_b(*args)[1])
        for _ in range(opts.warmup):
            for f in (step_a, step_b):
                jax.block_until_ready(f(*args))
        ratios, ta, tb = paired_ratios(step_a, step_b, args, opts.pairs)
        # A/A control: the hand step against itself shows how large the noise alone is.
        control, _, _ = paired_ratios(step_b, step_b, args, opts.control_pairs or opts.pairs)
        lo, hi = _bootstrap_median(ratios)
        clo, chi = _bootstrap_median(control)
        print(
            f"\nstep time over {opts.pairs} interleaved pairs (losses: shardlib {loss_a:.6f}, "
            f"hand {loss_b:.6f}):"
        )
        print(
            f"  median step: shardlib {statistics.median(ta) * 1e3:.3f} ms, hand "
            f"{statistics.median(tb) * 1e3:.3f} ms"
        )
        print(
            f"  shardlib / hand: median ratio {statistics.median(ratios):.4f} "
            f"(95% bootstrap CI {lo:.4f} .. {hi:.4f})"
        )
        print(
            f"  A/A control hand / hand: median ratio {statistics.median(control):.4f} "
            f"(95% bootstrap CI {clo:.4f} .. {chi:.4f})"
        )
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
