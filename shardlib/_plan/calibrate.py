"""``shardlib.calibrate``: measure the devices present and return the `Hardware` they are.

`shardlib.plan`'s cost model (`shardlib._plan.cost`) takes a few numbers from a `Hardware`:
matmul FLOP/s, memory bandwidth, and each collective's latency and bandwidth. A preset gives
vendor peaks; `calibrate` measures them on the devices it runs on, every device working at
once (so 8 simulated CPU devices sharing 2 cores each measure their share, as they run a step):

- **matmul**: ``x @ w`` (``side x side``, f32) on every device, at three sides;
- **memory**: the elementwise ``x * 1.5 + 0.5`` on every device (one read and one write of
  each byte), at three sizes of 1 to 8 MiB per device;
- **op overhead**: the same op on 8 elements per device, a launch and nothing else;
- **collectives**, per mesh axis (of more than one device), inside ``jax.shard_map``: an
  ``all_gather`` with the ``psum_scatter`` that restores its shape, a ``psum`` and a
  ``ppermute`` (to the next device) over the axis, at two message sizes.

Only primitive operations are measured, never a model. Every program is compiled and run once
before it is timed; a time is the median of ``repeats`` runs. The matmuls, the op overhead and
the collectives run in a ``fori_loop`` whose trip count ``k`` is an argument (one compilation;
XLA can neither unroll the loop nor fuse one op with the next): one op's seconds are ``(t(9) -
t(1)) / 8`` (``(t(65) - t(1)) / 64`` for the op overhead), which leaves the program's launch
out; the memory sizes are large enough that the launch is the fit's intercept.

**The fit.** Each measurement is fitted by least squares over its sizes:

- matmul and memory (`fit_line`): ``t = overhead + x / rate``, ``x`` the FLOPs per device
  (``2 side^3``) or the bytes per device read and written (``8 n``): ``rate`` is
  ``flops_per_s`` or ``hbm_bytes_per_s`` (the overheads, launches, are not kept);
- collectives, per axis, in the cost model's own form (`fit_collectives`): ``t = calls *
  call + steps * latency + bytes / bandwidth``, ``steps`` the ring steps of the kind over the
  axis's group (`shardlib._plan.cost.ring_steps`), ``bytes`` the bytes per device the model
  counts for it (`shardlib._explain.hlo.ring_bytes`), ``calls`` 2 for the all-gather with its
  reduce-scatter, else 1: ``collective_call_s``, ``axis_latency_s`` and ``axis_bytes_per_s``.

Noise can make a term negative; it is then refitted as 0 (the fit of fewest squares whose
terms are all >= 0), never refused, so a loaded machine gives rough figures, not an error.
The fitting functions are pure (timings in, figures out) so that tests give them synthetic
timings; `calibrate` is the one that runs programs.
"""

from __future__ import annotations

import math
import statistics
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
    "hardware_from",
]

# The collectives measured on each axis (an all-gather is timed with the reduce-scatter that
# restores its shape).
KINDS = ("all-gather", "reduce-scatter", "all-reduce", "collective-permute")
_PAIRED = ("all-gather", "all-reduce", "collective-permute")
# Sizes measured (the points of each fit), per device, f32: matmul sides, elementwise
# elements, message elements; the loop lengths whose difference is one op's launch (`_per_op`;
# the matmuls and collectives use 1 and 9); the least seconds a difference of noisy times is
# taken to be.
_MATMUL_SIDES = (64, 128, 192)
_ELEMENTS = (1 << 18, 1 << 20, 1 << 21)
_MESSAGE_ELEMENTS = (1 << 10, 1 << 15)
_OP_CHAIN = (1, 65)
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
    """The collectives of one mesh axis: ``seconds = calls * call_s + steps * latency_s +
    moved / bytes_per_s``."""

    call_s: float
    latency_s: float
    bytes_per_s: float


def fit_collectives(
    calls: Sequence[float],
    steps: Sequence[float],
    moved: Sequence[float],
    seconds: Sequence[float],
    what: str = "fit_collectives",
) -> CollectiveFit:
    """Least squares ``seconds = calls * call_s + steps * latency_s + moved / bytes_per_s``,
    every term >= 0 (the cost model's collectives: ``steps`` ring steps, ``moved`` bytes per
    device, ``calls`` collectives run; the fit of fewest squares among those whose terms are
    all >= 0, a term that noise would make negative being 0; the bandwidth alone, through the
    origin, always is one)."""
    c, _ = _arrays(calls, seconds, what, distinct=False)
    s, _ = _arrays(steps, seconds, what, distinct=False)
    b, t = _arrays(moved, seconds, what)
    columns = np.stack([c, s, b], axis=1)
    fits = []
    for keep in ((0, 1, 2), (0, 2), (1, 2), (2,)):  # the bandwidth is always fitted
        coef, *_ = np.linalg.lstsq(columns[:, keep], t, rcond=None)
        if (coef >= 0).all() and coef[-1] > 0:  # (2,): b @ t / b @ b > 0, as t > 0
            full = np.zeros(3)
            full[list(keep)] = coef
            fits.append((float(((columns @ full - t) ** 2).sum()), len(fits), full))
    call_s, latency_s, inverse = min(fits)[2]
    return CollectiveFit(float(call_s), float(latency_s), float(1.0 / inverse))


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


def _median_seconds(f: Callable[..., Any], args: tuple, repeats: int) -> float:
    """Median wall seconds of ``f(*args)`` (compiled, and run once before timing)."""
    jax.block_until_ready(f(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(f(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _compiled(f: Callable[..., Any], *args: Any) -> Callable[..., Any]:
    return jax.jit(f).lower(*args).compile()


def _split(mesh: Mesh, shape: tuple[int, ...]) -> jax.Array:
    """Zeros of ``shape`` per device, split over every device of ``mesh`` on the first dim."""
    spec = PartitionSpec(tuple(mesh.axis_names))
    n = math.prod(mesh.shape.values())
    glob = (shape[0] * n, *shape[1:])
    return jax.device_put(jnp.ones(glob, jnp.float32), NamedSharding(mesh, spec))


def _per_op(
    looped: Callable[..., Any], args: tuple, repeats: int, chain: tuple[int, int] = (1, 9)
) -> float:
    """Seconds of one op: ``looped(*args, k)`` runs ``k`` of them in a loop of one program
    (``k`` a traced value: one compilation, no unrolling, no fusion across ops); the difference
    between the ``chain`` lengths over their difference leaves out the program's launch (the
    least `_FLOOR` where noise makes it smaller)."""
    lo, hi = chain
    f = _compiled(looped, *args, jnp.int32(lo))
    t = [_median_seconds(f, (*args, jnp.int32(n)), repeats) for n in (lo, hi)]
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


def _elementwise(mesh: Mesh, repeats: int) -> Fit:
    """Seconds of ``x * 1.5 + 0.5`` (one program each: sizes large enough that the bytes, not
    the launch, set the slope) against the bytes per device it reads and writes: the rate is
    the memory bandwidth."""
    moved, seconds = [], []
    for n in _ELEMENTS:
        x = _split(mesh, (n,))
        seconds.append(_median_seconds(_compiled(_axpb, x), (x,), repeats))
        moved.append(2.0 * 4 * n)
    return fit_line(moved, seconds, "calibrate (memory bandwidth)")


def _axpb(v: jax.Array) -> jax.Array:
    return v * 1.5 + 0.5


def _op_overhead(mesh: Mesh, repeats: int) -> float:
    """Seconds of one op on a few elements per device, in a loop (`_per_op`): its launch."""
    return _per_op(_loop(_axpb), (_split(mesh, (8,)),), repeats, _OP_CHAIN)


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


def _axis(mesh: Mesh, axis: str, repeats: int) -> CollectiveFit:
    """The collectives over ``axis`` of ``mesh``, fitted (`fit_collectives`): each kind (an
    all-gather paired with a reduce-scatter, an all-reduce, a permute) at each message size,
    one collective's seconds from chains of them (`_per_op`)."""
    group = mesh.shape[axis]
    spec = PartitionSpec(tuple(mesh.axis_names))
    calls, steps, moved, seconds = [], [], [], []
    for kind in _PAIRED:
        body = _collective(kind, axis, group)
        for n in _MESSAGE_ELEMENTS:
            looped = jax.shard_map(
                _loop(body),
                mesh=mesh,
                in_specs=(spec, PartitionSpec()),
                out_specs=spec,
                check_vma=False,
            )
            seconds.append(_per_op(looped, (_split(mesh, (n,)),), repeats))
            in_bytes = 4.0 * n
            parts = [("all-gather", group * in_bytes), ("reduce-scatter", in_bytes / group)]
            parts = parts if kind == "all-gather" else [(kind, in_bytes)]
            moved.append(sum(ring_bytes(p, in_bytes, out, group) for p, out in parts))
            steps.append(sum(ring_steps(p, group) for p, _ in parts))
            calls.append(len(parts))
    return fit_collectives(calls, steps, moved, seconds, f"calibrate (collectives over {axis!r})")


# ---------------------------------------------------------------------------------------------
# The entry point.
# ---------------------------------------------------------------------------------------------


def hardware_from(
    name: str,
    matmul: Fit,
    memory: Fit,
    op_overhead_s: float,
    axes: Mapping[str, CollectiveFit],
    source: str = "",
) -> Hardware:
    """The `Hardware` of fitted measurements: ``matmul`` (FLOPs per second), ``memory``
    (bytes per second), ``op_overhead_s`` (one op's launch) and, per
    mesh axis, the fit of its collectives. The links are the slowest axis's bandwidth, the
    latencies (per call, per step) the largest axis's; each axis's own bandwidth and latency
    per step are kept in ``axis_bytes_per_s`` and ``axis_latency_s``."""
    if not axes:
        raise ValueError(f"hardware_from: axes={dict(axes)!r}: needs at least one measured axis")
    return Hardware(
        name,
        link_bytes_per_s=min(f.bytes_per_s for f in axes.values()),
        flops_per_s=matmul.rate,
        source=source,
        hbm_bytes_per_s=memory.rate,
        collective_latency_s=max(f.latency_s for f in axes.values()),
        collective_call_s=max(f.call_s for f in axes.values()),
        op_overhead_s=op_overhead_s,
        elementwise_bytes_per_s=memory.rate,
        axis_bytes_per_s={a: f.bytes_per_s for a, f in axes.items()},
        axis_latency_s={a: f.latency_s for a, f in axes.items()},
    )


def calibrate(mesh: Mesh | Mapping[str, int] | None = None, *, repeats: int = 7) -> Hardware:
    """Measure the devices present and return the `Hardware` they are, for `shardlib.plan`.

    Every device works at once in each measurement: matmul FLOP/s per device, memory
    bandwidth per device, one op's launch overhead, and per mesh axis (of more than one
    device) the latency and bandwidth of its collectives, each fitted over several sizes by
    least squares (the module's docstring, `shardlib._plan.calibrate`, states the fit). Each
    program is compiled and run once before it is timed; a time is the median of ``repeats``
    runs. About 2 to 6 s on 8 simulated CPU devices on 2 cores (one axis; the first call
    compiles the most).

    **Arguments:**

    - `mesh`: a ``jax.sharding.Mesh`` to measure each axis of; or axis name -> size (a mesh of
      ``jax.devices()`` is made, ``jax.make_mesh``), e.g. ``{'data': 4, 'tensor': 2}``; None:
      one axis, ``'devices'``, over every device. Name the axes as your plan's ``axes=`` to
      have each axis's own figures used for it.
    - `repeats`: timed runs per measurement (an int >= 1); the median is kept.

    **Returns:** a `Hardware` (``source`` says how it was measured): ``flops_per_s``,
    ``hbm_bytes_per_s`` and ``elementwise_bytes_per_s`` (the same measured bandwidth),
    ``op_overhead_s``, ``axis_bytes_per_s`` and ``axis_latency_s`` per measured axis, and as
    ``link_bytes_per_s``, ``collective_latency_s`` and ``collective_call_s`` the slowest
    axis's. Pass it as ``plan(..., hardware=calibrate(mesh))``. Measured on CPU devices it
    describes that CPU, not any accelerator.

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
    memory = _elementwise(mesh, repeats)
    op_overhead_s = _op_overhead(mesh, repeats)
    per_axis = {str(a): _axis(mesh, a, repeats) for a in axes}
    devices = mesh.devices.flat[0]
    seconds = time.perf_counter() - start
    shape = " x ".join(f"{a}={n}" for a, n in mesh.shape.items())
    return hardware_from(
        f"calibrated: {mesh.devices.size} {devices.platform} devices ({shape})",
        matmul,
        memory,
        op_overhead_s,
        per_axis,
        source=(
            f"shardlib.calibrate on {devices.device_kind} ({shape}), medians of {repeats} "
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
