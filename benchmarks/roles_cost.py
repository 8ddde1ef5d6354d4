"""What axis roles cost: the same checks and the same model with roles and with mesh axes.

Run from the repository root: ``python benchmarks/roles_cost.py [--calls 2000] [--reps 12]``
(or ``python -m benchmarks --only roles``). Sets up 8 simulated CPU devices itself.

(a) Eager: median time of one ``shardlib.typechecked`` call whose argument and result are
    annotated ``f32[Array, b'batch/d len']`` (mesh axes, no rules in force) against the same
    function annotated ``f32[Array, b'batch/rows len']`` called under
    ``axis_rules(rows='d')``; blocks of calls, the two alternating.

(b) Trace: ``jax.jit(step).trace(...)`` of the headline transformer's training step
    (``examples/transformer_model.py``, written in roles, traced under its rules for the
    ``(4, 2)`` mesh) against the same module with the roles replaced by the mesh axes they
    resolve to (its source rewritten, no rules in force); fresh step functions, alternating.
    Reported: the median of the per-pair ratios of the whole trace (thread CPU time), and
    shardlib's self-time per trace: with mesh axes estimated by sampling; with roles, that
    plus what roles add, measured exactly: every call a trace makes of the functions that
    resolve roles is recorded and replayed (all of shardlib's other work is the same in both,
    since below the resolution only mesh axes exist). Sampling both variants instead proved
    too noisy to resolve a few per cent of ~1.5 ms, and cProfile's per-call cost inflates
    shardlib's many small functions.

Target (issue 27): roles within 5% of mesh axes, both (a) and (b).
"""

import os
import sys

if not __package__:  # run as a script: make the repository root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

if "jax" not in sys.modules:  # only effective before JAX is imported
    _flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in _flags:
        os.environ["XLA_FLAGS"] = f"{_flags} --xla_force_host_platform_device_count=8".strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import contextlib  # noqa: E402
import dataclasses  # noqa: E402
import functools  # noqa: E402
import gc  # noqa: E402
import importlib.util  # noqa: E402
import re  # noqa: E402
import signal  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable, Iterator  # noqa: E402
from pathlib import Path  # noqa: E402
from types import ModuleType  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import shardlib  # noqa: E402
from benchmarks._tables import row  # noqa: E402
from benchmarks.measures import bootstrap_median  # noqa: E402
from shardlib.shardtypes import Array, f32, typechecked  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TARGET = 1.05  # roles within 5% of mesh axes
SHARDLIB_DIR = str(ROOT / "shardlib") + os.sep


@typechecked
def with_axes(x: f32[Array, b"batch/d len"]) -> f32[Array, b"batch/d len"]:
    return x


@typechecked
def with_roles(x: f32[Array, b"batch/rows len"]) -> f32[Array, b"batch/rows len"]:
    return x


def _block(f: Callable, x: Any, n: int, rules: dict | None) -> float:
    """Mean µs per call of ``n`` calls of ``f(x)``, under ``rules`` (None: no rules)."""
    ctx = shardlib.axis_rules(**rules) if rules is not None else contextlib.nullcontext()
    with ctx:
        t0 = time.perf_counter_ns()
        for _ in range(n):
            f(x)
        return (time.perf_counter_ns() - t0) / n / 1e3


def eager(calls: int) -> dict[str, Any]:
    """Blocks of 50 calls of each function, alternating: per-pair ratios and medians."""
    mesh = jax.make_mesh((8,), ("d",), axis_types=(AxisType.Explicit,))
    axes, roles = [], []
    with jax.set_mesh(mesh):
        x = jax.device_put(jnp.zeros((64, 32), jnp.float32), NamedSharding(mesh, P("d")))
        _block(with_axes, x, 50, None)
        _block(with_roles, x, 50, {"rows": "d"})
        was = gc.isenabled()
        gc.disable()
        try:
            for i in range(max(1, calls // 50)):
                pair = [(with_axes, None, axes), (with_roles, {"rows": "d"}, roles)]
                for f, rules, out in pair if i % 2 == 0 else pair[::-1]:
                    out.append(_block(f, x, 50, rules))
        finally:
            if was:
                gc.enable()
    ratios = [r / a for a, r in zip(axes, roles, strict=True)]
    lo, hi = bootstrap_median(ratios)
    return {
        "axes_us": statistics.median(axes),
        "roles_us": statistics.median(roles),
        "ratio": statistics.median(ratios),
        "ratio_ci95": [lo, hi],
        "blocks": len(ratios),
    }


# ------------------------------------------------------------------ (b) the transformer's trace


def physical_source(source: str, rules: dict[str, Any]) -> str:
    """``source`` with every role of ``rules`` replaced by the mesh axes it resolves to: after
    ``/`` in specs (a replicated role disappears) and as a quoted axis argument
    (``axes="tensor"``, ``axis_index("tensor")``)."""

    def axes_of(role: str) -> tuple[str, ...]:
        target = rules[role]
        if target is None:
            return ()
        return (target,) if isinstance(target, str) else tuple(target)

    names = "|".join(sorted(rules, key=len, reverse=True))
    source = re.sub(
        rf"/({names})\b", lambda m: "".join("/" + a for a in axes_of(m.group(1))), source
    )

    def quoted(m: re.Match[str]) -> str:
        axes = axes_of(m.group(2))
        return m.group(1) + (repr(axes[0]) if len(axes) == 1 else repr(axes))

    return re.sub(rf'(axes=|axis=|axis_index\(|axis_size\()"({names})"', quoted, source)


def physical_model(rules: dict[str, Any]) -> ModuleType:
    """``examples/transformer_model.py`` with its roles replaced by ``rules``' mesh axes,
    loaded as a module of its own, which puts no rules in force."""
    source = (ROOT / "examples" / "transformer_model.py").read_text()
    text = physical_source(source, rules)
    path = Path(tempfile.mkdtemp()) / "transformer_model_axes.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location("transformer_model_axes", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    if hasattr(module, "default_rules"):  # its specs name mesh axes: no rules needed
        module.default_rules = _no_rules  # type: ignore[attr-defined]
    return module


@contextlib.contextmanager
def _no_rules(*_args: Any, **_kwargs: Any) -> Iterator[None]:
    yield


def _sampled(trace_once: Callable[[], float], reps: int, interval: float = 2e-4) -> float:
    """shardlib's self-time per trace (ms), by sampling: an interval timer interrupts each
    trace every ``interval`` s and the handler notes whether the innermost Python frame is
    shardlib's; that share of the samples times the median unsampled trace time."""
    hits = [0, 0]

    def on_sample(_signum: int, frame: Any) -> None:
        if frame is not None:
            hits[0] += os.path.realpath(frame.f_code.co_filename).startswith(SHARDLIB_DIR)
            hits[1] += 1

    plain = [trace_once() for _ in range(3)]
    previous = signal.signal(signal.SIGALRM, on_sample)
    try:
        for _ in range(reps):
            signal.setitimer(signal.ITIMER_REAL, interval, interval)
            trace_once()
            signal.setitimer(signal.ITIMER_REAL, 0.0)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0.0)
        signal.signal(signal.SIGALRM, previous)
    return statistics.median(plain) * hits[0] / max(1, hits[1])


# What roles add to a trace: the calls that resolve them (the rest of shardlib's work is the
# same with roles and with mesh axes: below the resolution only mesh axes exist).
_RESOLVING = ("shape", "text", "axes", "one_axis")


def _resolution_calls(trace_once: Callable[[], float]) -> list[tuple[Callable, tuple, dict]]:
    """Every call one trace makes of the functions that resolve roles (`shardlib._env.rules`,
    and the per-rules plan lookup of typed_shard_map), with its arguments."""
    from shardlib._env import rules
    from shardlib._shard_map.call import Calls

    calls: list[tuple[Callable, tuple, dict]] = []

    def spy(fn: Callable) -> Callable:
        def recorded(*args: Any, **kwargs: Any) -> Any:
            calls.append((fn, args, kwargs))
            return fn(*args, **kwargs)

        return recorded

    saved = {name: getattr(rules, name) for name in _RESOLVING}
    get = Calls.get
    try:
        for name, fn in saved.items():
            setattr(rules, name, spy(fn))
        Calls.get = spy(get)  # type: ignore[method-assign]
        trace_once()
    finally:
        for name, fn in saved.items():
            setattr(rules, name, fn)
        Calls.get = get  # type: ignore[method-assign]
    return calls


def _replay_us(calls: list[tuple[Callable, tuple, dict]], reps: int = 200) -> float:
    """Median µs to make ``calls`` again (each a cache hit, as in a trace after the first)."""
    times = []
    for _ in range(reps):
        t0 = time.perf_counter_ns()
        for fn, args, kwargs in calls:
            fn(*args, **kwargs)
        times.append((time.perf_counter_ns() - t0) / 1e3)
    return statistics.median(times)


def trace(reps: int) -> dict[str, Any]:
    """The transformer step traced with roles (under its rules) and with mesh axes."""
    from benchmarks import workloads as wls
    from examples import transformer_model as tm

    mesh = jax.make_mesh((4, 2), ("d", "t"), axis_types=(AxisType.Explicit,) * 2)
    rules = tm.rules_for(mesh)
    axes_tm = physical_model(rules)
    config, batch = wls.SIZES["tiny"]["transformer"]
    key = jax.random.key(0, impl="rbg")
    with jax.set_mesh(mesh):
        tokens = jax.device_put(
            jax.random.randint(key, (batch, config.seq_len), 0, config.vocab, dtype=jnp.int32),
            NamedSharding(mesh, P("d")),
        )
        lr = jnp.float32(0.1)
        with shardlib.axis_rules(rules):
            roles_model = tm.place_model(tm.init_model(config, key))
        axes_config = axes_tm.Config(**dataclasses.asdict(config))  # the module's own class
        axes_model = axes_tm.place_model(axes_tm.init_model(axes_config, key))
        variants = {
            "roles": (lambda: wls.transformer_step(tm.loss, config), rules, roles_model),
            "axes": (lambda: wls.transformer_step(axes_tm.loss, axes_config), None, axes_model),
        }

        def traced(name: str) -> float:
            make, r, model = variants[name]
            ctx = shardlib.axis_rules(r) if r is not None else contextlib.nullcontext()
            with ctx:
                step = jax.jit(make())
                t0 = time.thread_time()
                step.trace(model, tokens, lr)
                return (time.thread_time() - t0) * 1e3

        for name in variants:  # warm up
            traced(name)
        times: dict[str, list[float]] = {"roles": [], "axes": []}
        for i in range(reps):
            for name in ("roles", "axes") if i % 2 == 0 else ("axes", "roles"):
                times[name].append(traced(name))
        base = _sampled(functools.partial(traced, "axes"), reps)
        replayed = {}
        for name, (_make, r, _model) in variants.items():
            calls = _resolution_calls(functools.partial(traced, name))
            with shardlib.axis_rules(r) if r is not None else contextlib.nullcontext():
                replayed[name] = (len(calls), _replay_us(calls))
        added_ms = (replayed["roles"][1] - replayed["axes"][1]) / 1e3
    ratios = [r / a for r, a in zip(times["roles"], times["axes"], strict=True)]
    lo, hi = bootstrap_median(ratios)
    return {
        "roles_ms": statistics.median(times["roles"]),
        "axes_ms": statistics.median(times["axes"]),
        "ratio": statistics.median(ratios),
        "ratio_ci95": [lo, hi],
        "shardlib_self_ms": {"axes": base, "roles": base + added_ms},
        "resolution": {k: {"calls": n, "us": us} for k, (n, us) in replayed.items()},
        "self_ratio": (base + added_ms) / base,
        "reps": reps,
    }


def targets(r: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 27: the eager check and the trace's shardlib self-time with roles within 5%."""
    e, t, limit = r["eager"], r["trace"], r["target"]
    return [
        row(
            f"axis roles: eager check ≤ {limit:.2f}× the same check with mesh axes",
            f"{e['ratio']:.3f}× ({e['roles_us']:.2f} vs {e['axes_us']:.2f} µs, median of "
            f"{e['blocks']} blocks)",
            e["ratio"] <= limit,
        ),
        row(
            f"axis roles: transformer step's trace ≤ {limit:.2f}× with mesh axes",
            f"{t['ratio']:.3f}× ({t['roles_ms']:.1f} vs {t['axes_ms']:.1f} ms); shardlib "
            f"self-time {t['self_ratio']:.3f}× ({t['shardlib_self_ms']['roles']:.2f} vs "
            f"{t['shardlib_self_ms']['axes']:.2f} ms)",
            t["ratio"] <= limit and t["self_ratio"] <= limit,
        ),
    ]


def main(calls: int = 2000, reps: int = 30, out: Any = None) -> dict[str, Any]:
    """Both measurements, printed as markdown, returned as numbers."""
    out = out if out is not None else sys.stdout
    e, t = eager(calls), trace(reps)
    print("## Axis roles against mesh axes", file=out)
    print(file=out)
    print("| measure | mesh axes | roles | ratio (95% CI) | target |", file=out)
    print("|---|---:|---:|---:|---:|", file=out)
    lo, hi = e["ratio_ci95"]
    print(
        f"| eager check, µs per call | {e['axes_us']:.2f} | {e['roles_us']:.2f} | "
        f"{e['ratio']:.3f} ({lo:.3f}-{hi:.3f}) | ≤ {TARGET} |",
        file=out,
    )
    lo, hi = t["ratio_ci95"]
    print(
        f"| transformer step trace, ms | {t['axes_ms']:.1f} | {t['roles_ms']:.1f} | "
        f"{t['ratio']:.3f} ({lo:.3f}-{hi:.3f}) | ≤ {TARGET} |",
        file=out,
    )
    s = t["shardlib_self_ms"]
    print(
        f"| shardlib self-time per trace, ms | {s['axes']:.2f} | {s['roles']:.2f} | "
        f"{t['self_ratio']:.3f} | ≤ {TARGET} |",
        file=out,
    )
    rr = t["resolution"]
    print(file=out)
    print(
        f"Self-time with mesh axes: sampled. With roles: that plus the resolution calls one "
        f"trace makes, replayed ({rr['roles']['calls']} calls, {rr['roles']['us']:.0f} µs; "
        f"with mesh axes {rr['axes']['calls']} calls, {rr['axes']['us']:.0f} µs: the same "
        "functions, returning at once with no rules in force).",
        file=out,
    )
    print(file=out)
    return {"eager": e, "trace": t, "target": TARGET}


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--reps", type=int, default=30)
    a = p.parse_args()
    main(a.calls, a.reps)
