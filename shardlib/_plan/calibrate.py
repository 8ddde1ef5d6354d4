"""``shardlib.calibrate``: measure the devices present and return the `Hardware` they are.

`shardlib.plan`'s cost model (`shardlib._plan.cost`) takes a few numbers from a `Hardware`:
matmul FLOP/s, memory bandwidth, and each collective's latency and bandwidth. A preset gives
vendor peaks; `calibrate` measures them on the devices it runs on, every device working at
once (so 8 simulated CPU devices sharing 2 cores each measure their share, as they run a step):

- **matmul**: ``x @ w`` (``side x side``, f32) on every device, at three sides;
- **memory**: the elementwise ``x * 1.5 + 0.5`` on every device (one read and one write of
  each byte), one program per size, at three sizes of 1 to 8 MiB per device (every run
  writes a fresh output buffer);
- **elementwise ops**: the same op in a loop, its buffers reused from one op to the next as
  in a step's program, at three sizes of 128 KiB to 2 MiB per device;
- **collectives**, per mesh axis (of more than one device), inside ``jax.shard_map``: an
  ``all_gather`` with the ``psum_scatter`` that restores its shape, a ``psum`` and a
  ``ppermute`` (to the next device) over the axis, at two message sizes and at up to three
  group sizes (`group_sizes`: 2, 4 and 8 on an axis of 8; consecutive devices of the axis,
  every group at once).

Only primitive operations are measured, never a model. Every program is compiled and run once
before it is timed; a time is the fastest of ``repeats`` runs (other work on a shared machine
only adds time). The matmuls, the elementwise ops and the collectives run in a ``fori_loop``
whose trip count ``k`` is an argument (one compilation; XLA can neither unroll the loop nor
fuse one op with the next): one op's seconds are ``(t(17) - t(1)) / 16``, which leaves the
program's launch out; the memory sizes are large enough that the launch is the fit's
intercept.

**The fit.** Each measurement is fitted by least squares over its sizes:

- matmul, memory and elementwise ops (`fit_line`): ``t = overhead + x / rate``, ``x`` the
  FLOPs per device (``2 side^3``) or the bytes per device read and written (``8 n``):
  ``rate`` is ``flops_per_s``, ``hbm_bytes_per_s`` or ``elementwise_bytes_per_s``; the
  elementwise ops' ``overhead`` (one op in a loop: its launch) is ``op_overhead_s`` (the
  other overheads, the programs' launches, are not kept);
- collectives, per axis, in the cost model's own form (`fit_collectives`): ``t = calls *
  call[kind] + steps * latency[kind] + bytes / bandwidth``, ``steps`` the ring steps of the
  kind over the group (`shardlib._plan.cost.ring_steps`), ``bytes`` the bytes per device the
  model counts for it (`shardlib._explain.hlo.ring_bytes`), ``calls`` 2 for the all-gather
  with its reduce-scatter (each pays the all-gather's figures), else 1:
  ``collective_call_by_kind_s``, ``collective_latency_by_kind_s``, ``axis_latency_s`` and
  ``axis_bytes_per_s``. The group sizes tell the cost per step from the cost per call (a ring
  over 8 devices has 7 steps, over 2 one; both make one call); a permute runs one step
  whatever its group, so its call holds its step.

Noise can make a term negative; it is then refitted as 0 (the fit of fewest squares whose
terms are all >= 0), never refused, so a loaded machine gives rough figures, not an error.
The fitting functions are pure (timings in, figures out) so that tests give them synthetic
timings; `calibrate` is the one that runs programs.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from .._explain.hardware import Hardware
from .._explain.hlo import ring_bytes
from .cost import ring_steps

__all__ = [
    "KINDS",
    "CollectiveFit",
    "Fit",
    "calibrate",
    "fit_collectives",
    "fit_line",
    "group_mesh",
    "group_sizes",
    "hardware_from",
]

# The collectives measured on each axis (an all-gather is timed with the reduce-scatter that
# restores its shape).
KINDS = ("all-gather", "reduce-scatter", "all-reduce", "collective-permute")
_PAIRED = ("all-gather", "all-reduce", "collective-permute")
# Sizes measured (the points of each fit), per device, f32: matmul sides, elementwise
# elements (one program each: memory bandwidth; in a loop: the elementwise ops between
# matmuls), message elements; the loop lengths whose difference is timed (`_per_op`); the
# least seconds a difference of noisy times is taken to be.
_MATMUL_SIDES = (64, 128, 192)
_ELEMENTS = (1 << 18, 1 << 20, 1 << 21)
_ELEMENTS_IN_LOOP = (1 << 15, 1 << 17, 1 << 19)
_MESSAGE_ELEMENTS = (1 << 10, 1 << 15)
_CHAIN = (1, 17)
_FLOOR = 1e-7


@dataclass(frozen=True)
class Fit:
    """``t = overhead + x / rate``: seconds at ``x = 0``, and ``x`` per second."""

    overhead: float
    rate: float


def fit_line(xs: Sequence[float], seconds: Sequence[float], what: str = "fit_line") -> Fit:
    """Least squares ``seconds = overhead + xs / rate`` over at least two distinct ``xs``.

    Noise can make a fit meaningless; it is then refitted, never refused: a negative intercept
    through the origin (``overhead`` 0), and a slope that is not positive (the times did not
    grow with ``xs``) as the largest ``x`` over its time (``overhead`` 0: a lower bound on the
    rate). Malformed input (lengths that differ, one distinct size, a time that is not
    positive and finite) is refused, naming ``what``."""
    x, t = _arrays(xs, seconds, what)
    design = np.stack([np.ones_like(x), x], axis=1)
    (overhead, slope), *_ = np.linalg.lstsq(design, t, rcond=None)
    if overhead < 0:
        overhead, slope = 0.0, float(x @ t / (x @ x))
    if not slope > 0:
        i = int(np.argmax(x))
        return Fit(0.0, float(x[i] / t[i]))
    return Fit(float(overhead), float(1.0 / slope))


@dataclass(frozen=True)
class CollectiveFit:
    """The collectives of one mesh axis: ``seconds = calls * call_s[kind] + steps *
    latency_s[kind] + moved / bytes_per_s``, per collective kind (e.g. ``'all-reduce'``)."""

    call_s: Mapping[str, float]
    latency_s: Mapping[str, float]
    bytes_per_s: float


def fit_collectives(
    kinds: Sequence[str],
    calls: Sequence[float],
    steps: Sequence[float],
    moved: Sequence[float],
    seconds: Sequence[float],
    what: str = "fit_collectives",
) -> CollectiveFit:
    """Least squares ``seconds = calls * call_s[kind] + steps * latency_s[kind] + moved /
    bytes_per_s`` over timings of collectives of ``kinds`` (one per timing: the kind whose
    costs per call and per step it pays), each term >= 0.

    ``steps`` are the ring steps run, ``moved`` the bytes per device, ``calls`` the
    collectives run. The squares are of relative errors (each timing weighs alike, the small
    messages, which the latencies set, as much as the large ones). Of the fits on every subset
    of the terms (the bandwidth always in), the one of fewest squares whose terms are all >= 0
    is kept: a term that noise would make negative is 0 (the bandwidth alone, through the
    origin, is always one). A kind timed at two group sizes or more has its cost per step told
    apart from its cost per call; a kind whose steps are a fixed number per call (a permute, or
    any kind timed at one group size) has its latency 0, its cost per call holding both."""
    if len(kinds) != len(seconds) or not all(isinstance(k, str) for k in kinds):
        raise ValueError(
            f"{what}: kinds must be one collective kind (a str) per timing; got {list(kinds)!r} "
            f"for {len(seconds)} times"
        )
    c, _ = _arrays(calls, seconds, what, distinct=False)
    s, _ = _arrays(steps, seconds, what, distinct=False)
    b, t = _arrays(moved, seconds, what)
    names = sorted(set(kinds))
    of = {n: np.array([k == n for k in kinds]) for n in names}
    per_call = [np.where(of[n], c, 0.0) for n in names]
    # A kind's cost per step is a term of its own where its steps per call vary.
    varied = [n for n in names if len(set((s[of[n]] / np.maximum(c[of[n]], 1)).tolist())) > 1]
    per_step = [np.where(of[n], s, 0.0) for n in varied]
    columns = np.stack([*per_call, *per_step, b], axis=1) / t[:, None]  # relative errors
    ones = np.ones_like(t)
    width = columns.shape[1]
    fits = []
    for mask in range(1 << (width - 1)):  # every subset of the other terms; bandwidth always
        keep = [j for j in range(width - 1) if mask >> j & 1] + [width - 1]
        coef, *_ = np.linalg.lstsq(columns[:, keep], ones, rcond=None)
        if (coef >= 0).all() and coef[-1] > 0:  # bandwidth alone: b/t @ 1 / |b/t|^2 > 0
            full = np.zeros(width)
            full[keep] = coef
            fits.append((float(((columns @ full - ones) ** 2).sum()), len(fits), full))
    full = min(fits)[2]
    latency = dict.fromkeys(names, 0.0)
    latency.update({n: float(full[len(names) + j]) for j, n in enumerate(varied)})
    return CollectiveFit(
        {n: float(full[j]) for j, n in enumerate(names)}, latency, float(1.0 / full[-1])
    )


def _arrays(
    xs: Sequence[float], seconds: Sequence[float], what: str, distinct: bool = True
) -> tuple[np.ndarray, np.ndarray]:
    x, t = np.asarray(xs, float), np.asarray(seconds, float)
    if x.shape != t.shape or x.ndim != 1:
        raise ValueError(
            f"{what}: sizes and seconds must be two sequences of one length; got "
            f"{len(x) if x.ndim else x!r} sizes and {len(t) if t.ndim else t!r} times"
        )
    if not (np.isfinite(x).all() and np.isfinite(t).all() and (t > 0).all() and (x >= 0).all()):
        raise ValueError(
            f"{what}: sizes must be finite and >= 0, seconds finite and > 0; got sizes "
            f"{x.tolist()}, seconds {t.tolist()}"
        )
    if distinct and len(set(x.tolist())) < 2:
        raise ValueError(
            f"{what}: needs at least two distinct sizes to fit a line; got {x.tolist()}"
        )
    return x, t


# ---------------------------------------------------------------------------------------------
# Measuring.
# ---------------------------------------------------------------------------------------------


def _fastest_seconds(f: Callable[..., Any], args: tuple, repeats: int) -> float:
    """Fastest wall seconds of ``repeats`` runs of ``f(*args)`` (compiled, and run once before
    timing): other work on a shared machine only ever adds time."""
    jax.block_until_ready(f(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(f(*args))
        times.append(time.perf_counter() - start)
    return min(times)


def _compiled(f: Callable[..., Any], *args: Any) -> Callable[..., Any]:
    return jax.jit(f).lower(*args).compile()


def _split(mesh: Mesh, shape: tuple[int, ...]) -> jax.Array:
    """Zeros of ``shape`` per device, split over every device of ``mesh`` on the first dim."""
    spec = PartitionSpec(tuple(mesh.axis_names))
    n = math.prod(mesh.shape.values())
    glob = (shape[0] * n, *shape[1:])
    return jax.device_put(jnp.ones(glob, jnp.float32), NamedSharding(mesh, spec))


def _per_op(
    looped: Callable[..., Any], args: tuple, repeats: int, chain: tuple[int, int] = _CHAIN
) -> float:
    """Seconds of one op: ``looped(*args, k)`` runs ``k`` of them in a loop of one program
    (``k`` a traced value: one compilation, no unrolling, no fusion across ops); the difference
    between the ``chain`` lengths over their difference leaves out the program's launch (the
    least `_FLOOR` where noise makes it smaller)."""
    lo, hi = chain
    f = _compiled(looped, *args, jnp.int32(lo))
    t = [_fastest_seconds(f, (*args, jnp.int32(n)), repeats) for n in (lo, hi)]
    return max((t[1] - t[0]) / (hi - lo), _FLOOR)


def _loop(body: Callable[..., jax.Array]) -> Callable[..., jax.Array]:
    """``body(v, *rest)`` applied ``k`` times to ``v``: ``f(v, *rest, k)``."""

    def f(v: jax.Array, *rest: Any) -> jax.Array:
        *consts, k = rest
        return jax.lax.fori_loop(0, k, lambda _, u: body(u, *consts), v)

    return f


def _matmul(mesh: Mesh, repeats: int) -> Fit:
    """Seconds of one ``x @ w`` (``side x side`` each, per device) against its FLOPs per
    device."""
    flops, seconds = [], []
    for side in _MATMUL_SIDES:
        x = _split(mesh, (side, side))
        w = jax.device_put(
            jnp.full((side, side), 1.0 / side, jnp.float32), NamedSharding(mesh, PartitionSpec())
        )
        seconds.append(_per_op(_loop(jnp.matmul), (x, w), repeats))
        flops.append(2.0 * side**3)
    return fit_line(flops, seconds, "calibrate (matmul FLOP/s)")


def _memory(mesh: Mesh, repeats: int) -> Fit:
    """Seconds of ``x * 1.5 + 0.5`` (one program each: sizes large enough that the bytes, not
    the launch, set the slope) against the bytes per device it reads and writes: the rate is
    the memory bandwidth."""
    moved, seconds = [], []
    for n in _ELEMENTS:
        x = _split(mesh, (n,))
        seconds.append(_fastest_seconds(_compiled(_axpb, x), (x,), repeats))
        moved.append(2.0 * 4 * n)
    return fit_line(moved, seconds, "calibrate (memory bandwidth)")


def _elementwise(mesh: Mesh, repeats: int) -> Fit:
    """Seconds of one ``x * 1.5 + 0.5`` in a loop (`_per_op`: its buffers reused from one op
    to the next, as in a step's program), at 128 KiB to 2 MiB per device, against the bytes
    per device it reads and writes: the intercept is one op's launch, the rate the bandwidth
    of the elementwise kernels between a step's matmuls."""
    moved, seconds = [], []
    for n in _ELEMENTS_IN_LOOP:
        seconds.append(_per_op(_loop(_axpb), (_split(mesh, (n,)),), repeats))
        moved.append(2.0 * 4 * n)
    return fit_line(moved, seconds, "calibrate (elementwise ops)")


def _axpb(v: jax.Array) -> jax.Array:
    return v * 1.5 + 0.5


def _collective(kind: str, axis: str, group: int) -> Callable[[jax.Array], jax.Array]:
    """One collective over ``axis`` that keeps its operand's shape (an all-gather with the
    reduce-scatter that undoes its shape: one of each)."""
    if kind == "all-gather":
        return lambda v: jax.lax.psum_scatter(
            jax.lax.all_gather(v, axis, tiled=True), axis, tiled=True
        )
    if kind == "all-reduce":
        return lambda v: jax.lax.psum(v, axis)
    perm = [(i, (i + 1) % group) for i in range(group)]
    return lambda v: jax.lax.ppermute(v, axis, perm)


def group_sizes(size: int) -> tuple[int, ...]:
    """The group sizes the collectives over an axis of ``size`` devices are timed at: its
    smallest divisor above 1, a middle one, and ``size`` itself (one, two or three sizes)."""
    divisors = [d for d in range(2, size + 1) if size % d == 0]
    return tuple(sorted({divisors[0], divisors[(len(divisors) - 1) // 2], size}))


def group_mesh(mesh: Mesh, axis: str, group: int) -> Mesh:
    """A mesh of ``mesh``'s devices whose ``axis`` is ``group`` consecutive devices of
    ``mesh``'s ``axis`` (``group`` divides its size), every other device along a second axis:
    collectives over ``axis`` run in groups of ``group``, among the same neighbours."""
    devices = np.moveaxis(mesh.devices, mesh.axis_names.index(axis), -1).reshape(-1, group)
    return Mesh(devices, ("rest" if axis != "rest" else "rest_", axis))


def _axis(mesh: Mesh, axis: str, repeats: int) -> CollectiveFit:
    """The collectives over ``axis`` of ``mesh``, fitted (`fit_collectives`): each kind (an
    all-gather paired with a reduce-scatter, an all-reduce, a permute) at each message size
    and group size (`group_sizes`), one collective's seconds from chains of them
    (`_per_op`)."""
    kinds, calls, steps, moved, seconds = [], [], [], [], []
    for group in group_sizes(mesh.shape[axis]):
        sub = group_mesh(mesh, axis, group)
        spec = PartitionSpec(tuple(sub.axis_names))
        for kind in _PAIRED:
            body = _collective(kind, axis, group)
            looped = jax.shard_map(
                _loop(body),
                mesh=sub,
                in_specs=(spec, PartitionSpec()),
                out_specs=spec,
                check_vma=False,
            )
            for n in _MESSAGE_ELEMENTS:
                seconds.append(_per_op(looped, (_split(sub, (n,)),), repeats))
                block = 4.0 * n  # (kind, bytes in, bytes out) of each collective run
                parts = [
                    ("all-gather", block, group * block),
                    ("reduce-scatter", group * block, block),
                ]
                parts = parts if kind == "all-gather" else [(kind, block, block)]
                moved.append(sum(ring_bytes(p, i, o, group) for p, i, o in parts))
                steps.append(sum(ring_steps(p, group) for p, _, _ in parts))
                calls.append(len(parts))
                kinds.append(kind)
    fit = fit_collectives(
        kinds, calls, steps, moved, seconds, f"calibrate (collectives over {axis!r})"
    )
    # The all-gather was timed with its reduce-scatter, two calls: each costs the fitted call
    # and latency.
    return CollectiveFit(
        {**fit.call_s, "reduce-scatter": fit.call_s["all-gather"]},
        {**fit.latency_s, "reduce-scatter": fit.latency_s["all-gather"]},
        fit.bytes_per_s,
    )


# ---------------------------------------------------------------------------------------------
# The entry point.
# ---------------------------------------------------------------------------------------------


def hardware_from(
    name: str,
    matmul: Fit,
    memory: Fit,
    elementwise: Fit,
    axes: Mapping[str, CollectiveFit],
    source: str = "",
) -> Hardware:
    """The `Hardware` of fitted measurements: ``matmul`` (FLOPs per second), ``memory``
    (bytes per second, one program per op), ``elementwise`` (one op's launch as its
    overhead, its bytes per second in a loop) and, per mesh axis, the fit of its collectives.

    The links are the slowest axis's bandwidth; each axis keeps its own bandwidth
    (``axis_bytes_per_s``) and its largest latency per step (``axis_latency_s``); each kind
    keeps its largest cost per call and per step over the axes
    (``collective_call_by_kind_s``, ``collective_latency_by_kind_s``);
    ``collective_latency_s`` and ``collective_call_s`` are the largest of all."""
    if not axes:
        raise ValueError(f"hardware_from: axes={dict(axes)!r}: needs at least one measured axis")
    kinds = sorted({k for f in axes.values() for k in f.call_s})
    calls = {k: max(f.call_s.get(k, 0.0) for f in axes.values()) for k in kinds}
    steps = {k: max(f.latency_s.get(k, 0.0) for f in axes.values()) for k in kinds}
    per_axis = {a: max(f.latency_s.values(), default=0.0) for a, f in axes.items()}
    return Hardware(
        name,
        link_bytes_per_s=min(f.bytes_per_s for f in axes.values()),
        flops_per_s=matmul.rate,
        source=source,
        hbm_bytes_per_s=memory.rate,
        collective_latency_s=max(per_axis.values()),
        collective_call_s=max(calls.values(), default=0.0),
        op_overhead_s=elementwise.overhead,
        elementwise_bytes_per_s=elementwise.rate,
        axis_bytes_per_s={a: f.bytes_per_s for a, f in axes.items()},
        axis_latency_s=per_axis,
        collective_call_by_kind_s=calls,
        collective_latency_by_kind_s=steps,
    )


def calibrate(mesh: Mesh | Mapping[str, int] | None = None, *, repeats: int = 7) -> Hardware:
    """Measure the devices present and return the `Hardware` they are, for `shardlib.plan`.

    Every device works at once in each measurement: matmul FLOP/s per device, memory
    bandwidth per device (one program per op), the launch and bandwidth of elementwise ops (in
    a loop), and per mesh axis (of more than one device) the latency per step, the cost
    per call of each kind and the bandwidth of its collectives, each fitted over several sizes
    by least squares (the module's docstring, `shardlib._plan.calibrate`, states the fit).
    Each program is compiled and run once before it is timed; a time is the fastest of
    ``repeats`` runs. About 5 to 15 s on 8 simulated CPU devices on 2 cores (one axis; the
    first call compiles the most).

    **Arguments:**

    - `mesh`: a ``jax.sharding.Mesh`` to measure each axis of; or axis name -> size (a mesh of
      ``jax.devices()`` is made, ``jax.make_mesh``), e.g. ``{'data': 4, 'tensor': 2}``; None:
      one axis, ``'devices'``, over every device. Name the axes as your plan's ``axes=`` to
      have each axis's own figures used for it.
    - `repeats`: timed runs per measurement (an int >= 1); the fastest is kept.

    **Returns:** a `Hardware` (``source`` says how it was measured): ``flops_per_s``,
    ``hbm_bytes_per_s``, ``elementwise_bytes_per_s`` and ``op_overhead_s``,
    ``axis_bytes_per_s`` and ``axis_latency_s`` per measured axis,
    ``collective_call_by_kind_s`` and ``collective_latency_by_kind_s`` (each kind's largest
    over the axes), and as
    ``link_bytes_per_s``, ``collective_latency_s`` and ``collective_call_s`` the slowest
    axis's (the call: the largest kind's). Pass it as ``plan(..., hardware=calibrate(mesh))``.
    Measured on CPU devices it describes that CPU, not any accelerator.

    Examples:
        ```python
        hw = shardlib.calibrate({"data": 4, "tensor": 2})
        result = shardlib.plan(step, *args, axes=axes, devices=8, hardware=hw)
        ```
    """
    start = time.perf_counter()
    mesh = _mesh_of(mesh)
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"calibrate: repeats={repeats!r} must be an int >= 1 (timed runs)")
    axes = [a for a in mesh.axis_names if mesh.shape[a] > 1]
    if not axes:
        raise ValueError(
            f"calibrate: mesh={dict(mesh.shape)!r} has no axis of more than one device: "
            "collectives need two; run it where two or more devices are present"
        )
    matmul = _matmul(mesh, repeats)
    memory = _memory(mesh, repeats)
    elementwise = _elementwise(mesh, repeats)
    per_axis = {str(a): _axis(mesh, a, repeats) for a in axes}
    devices = mesh.devices.flat[0]
    seconds = time.perf_counter() - start
    shape = " x ".join(f"{a}={n}" for a, n in mesh.shape.items())
    return hardware_from(
        f"calibrated: {mesh.devices.size} {devices.platform} devices ({shape})",
        matmul,
        memory,
        elementwise,
        per_axis,
        source=(
            f"shardlib.calibrate on {devices.device_kind} ({shape}), fastest of {repeats} "
            f"runs, {seconds:.1f} s"
        ),
    )


def _mesh_of(mesh: Mesh | Mapping[str, int] | None) -> Mesh:
    if isinstance(mesh, Mesh):
        return mesh
    devices = jax.devices()
    if mesh is None:
        return jax.make_mesh((len(devices),), ("devices",), devices=devices)
    if not isinstance(mesh, Mapping) or not all(
        isinstance(a, str) and isinstance(n, int) and not isinstance(n, bool) and n >= 1
        for a, n in mesh.items()
    ):
        raise TypeError(
            f"calibrate: mesh={mesh!r} must be a jax.sharding.Mesh, a mapping of axis names "
            "to sizes (ints >= 1), e.g. {'data': 4, 'tensor': 2}, or None (every device)"
        )
    if not mesh:
        raise ValueError("calibrate: mesh={} names no axis; name at least one, e.g. {'d': 8}")
    total = math.prod(mesh.values())
    if total > len(devices):
        raise ValueError(
            f"calibrate: mesh={dict(mesh)!r} needs {total} devices; {len(devices)} are "
            f"present ({devices[0].platform}): give sizes whose product is at most that"
        )
    return jax.make_mesh(tuple(mesh.values()), tuple(mesh), devices=devices[:total])
