"""shardlib's transformer training step vs the same step written by hand with ``jax.shard_map``.

The shardlib step is ``examples/transformer_model.py`` (FSDP over ``d`` + tensor parallelism over
``t``). The hand-written step (:mod:`benchmarks._transformer`) is the same math with every
``shardops`` call replaced by the ``jax.lax`` collective it stands for, einsum equations written
with the letters shardlib assigns (dim names get ``a, b, c, ...`` in order of first appearance,
operands then output), and the ``in_specs``/``out_specs`` written out as ``PartitionSpec``
literals.

This script uses a mesh with Explicit axes (``jax.make_mesh``'s default); ``python -m benchmarks``
runs the fuller comparison (three workloads, an auto-sharded variant too) on Auto axes.

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
import statistics  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable, Sequence  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks import _hlo  # noqa: E402
from benchmarks import workloads as _workloads  # noqa: E402
from benchmarks._transformer import LAYER_SPECS, MODEL_SPECS, TOKENS_SPEC, hand_loss  # noqa: E402
from examples import transformer_model as tm  # noqa: E402
from examples.transformer_model import Config, Model  # noqa: E402

__all__ = [
    "LAYER_SPECS",
    "MODEL_SPECS",
    "SIZES",
    "TOKENS_SPEC",
    "Structure",
    "compare_structure",
    "compile_times",
    "fresh_step",
    "hand_loss",
    "main",
    "make_inputs",
    "paired_ratios",
]

SIZES = {
    "tiny": _workloads.SIZES["tiny"]["transformer"],
    "small": _workloads.SIZES["full"]["transformer"],
}

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
    return _workloads.transformer_inputs(config, batch, seed)  # type: ignore[return-value]


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
        s = compare_structure(config, args)
        same = _print_structure(s, opts.dump_hlo)
        if opts.compile_reps > 0:
            _print_compile_times(config, args, opts.compile_reps)
        _print_step_times(s, args, opts)
    return 0 if same else 1


def _print_structure(s: Structure, dump_hlo: str | None) -> bool:
    """Print the collective census of both steps; whether it is the same."""
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
    if dump_hlo:
        os.makedirs(dump_hlo, exist_ok=True)
        for name, text in (("shardlib", s.shardlib_hlo), ("hand", s.hand_hlo)):
            with open(os.path.join(dump_hlo, f"{name}.hlo.txt"), "w") as f:
                f.write(text)
    return same


def _print_compile_times(config: Any, args: Any, reps: int) -> None:
    ct = compile_times(config, args, reps)
    print(f"\ntrace / lower / compile seconds (median of {reps} fresh closures each, interleaved):")
    print(f"  {'stage':<10}{'shardlib':>11}{'hand':>11}{'ratio':>9}")
    for stage in ("trace", "lower", "compile", "total"):
        a = statistics.median(ct["shardlib"][stage])
        b = statistics.median(ct["hand"][stage])
        print(f"  {stage:<10}{a:>11.4f}{b:>11.4f}{a / b:>9.3f}")


def _print_step_times(s: Structure, args: Any, opts: argparse.Namespace) -> None:
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


if __name__ == "__main__":
    raise SystemExit(main())
