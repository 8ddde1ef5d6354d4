"""Hardware models behind the time estimates of `shardlib.explain` and `shardlib.plan`.

A `Hardware` is a few public numbers: peak dense matmul FLOP/s per device, the bandwidth one
device sends at over its fast interconnect (NVLink, TPU ICI) and over the slower one between
groups of devices (InfiniBand, TPU DCN), how many devices share the fast one (a node; a TPU
pod), and memory per device; on a TPU, how many physical axes its ICI torus has
(``torus_axes``), a collective then getting one axis's bandwidth per physical axis it spans.
`HARDWARE` holds presets, each with the spec sheet it comes from.
Vendors quote peaks: a real collective or matmul reaches a fraction of them, so every time
computed from them is a lower bound. Give measured numbers with ``dataclasses.replace``
(``replace(HARDWARE['h100'], inter_node_bytes_per_s=38e9)``) or per mesh axis with
``shardlib.plan(..., bandwidths={'data': 38e9})``.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache

__all__ = [
    "HARDWARE",
    "Hardware",
    "axis_bandwidth",
    "hardware_of",
    "positive",
    "prime_factors",
    "slice_shape",
    "torus_axes_of",
]


@dataclass(frozen=True)
class Hardware:
    """A hardware model for time estimates (vendor peaks: estimates, lower bounds on time).

    **Fields:**

    - ``name``: what it is.
    - ``link_bytes_per_s``: bytes per second one device sends (and receives) over its fast
      interconnect, one direction (NVLink); with ``torus_axes``, what one device moves over
      one physical axis of the torus (a bidirectional ring with wrap-around: twice one link's
      one-way bandwidth).
    - ``flops_per_s``: peak dense matmul FLOP/s per device (bf16).
    - ``memory_bytes``: accelerator memory per device (None: not stated).
    - ``node_size``: devices that share the fast interconnect (a node of 8 GPUs, a TPU pod);
      a collective whose devices span more than one node runs at ``inter_node_bytes_per_s``.
      None: every device shares it.
    - ``inter_node_bytes_per_s``: bytes per second one device sends between nodes
      (InfiniBand, TPU DCN); None: the fast link everywhere.
    - ``source``: where the numbers come from.
    - ``hbm_bytes_per_s``: memory (HBM) bandwidth per device; with it each matmul takes the
      longer of its FLOPs at peak and its bytes (operands and result) at this bandwidth (the
      roofline). None: no memory roofline, matmuls at peak FLOP/s.
    - ``collective_latency_s``: seconds each step of a collective's algorithm costs besides its
      bytes (the alpha of the alpha-beta model: a ring over N devices has N - 1 steps, an
      all-reduce 2 (N - 1)); 0: bandwidth alone.
    - ``torus_axes``: the fast interconnect is a torus of this many physical axes (TPU ICI: 3
      on v4 and v5p, 2 on v5e); a collective within one node (a pod) whose devices vary along
      k of them runs at k x ``link_bytes_per_s`` (see `axis_bandwidth` for which ones a mesh
      axis occupies). None: one link, whatever the group (GPUs: NVLink is a switch).
    - ``collective_call_s``: seconds each collective call costs whatever its group and bytes
      (the devices meeting: a rendezvous of threads on a CPU, a kernel launch on a GPU); 0:
      none (every preset).
    - ``op_overhead_s``: seconds each equation of the traced program costs besides its FLOPs
      and bytes (launching a kernel; `shardlib._plan.roofline`); 0: none (every preset).
    - ``elementwise_bytes_per_s``: the memory bandwidth at which the equations other than
      matmuls move their bytes (operands and results, per device); None: those bytes are not
      counted (every preset: matmuls dominate an accelerator's step).
    - ``axis_bytes_per_s``, ``axis_latency_s``: measured bandwidth and latency per step of a
      collective over a mesh axis (axis name -> number), used for collectives over axes they
      name instead of the links and ``collective_latency_s``; ``plan(bandwidths=)`` overrides
      them. None: not measured. `shardlib.calibrate` sets them and the two above.
    - ``collective_call_by_kind_s``: the cost per call of each collective kind (``'all-gather'``,
      ``'reduce-scatter'``, ``'all-reduce'``, ``'collective-permute'``: kind -> seconds), used
      instead of ``collective_call_s`` for the kinds it names; None: ``collective_call_s`` for
      every kind. `shardlib.calibrate` sets it.
    - ``collective_latency_by_kind_s``: the latency per ring step of each collective kind
      (kind -> seconds); a collective of a kind it names pays the smaller of it and its
      axes' latency (``axis_latency_s`` or ``collective_latency_s``): calibrated, each is the
      largest over what it spans (axes of one kind, kinds of one axis), so the smaller is the
      nearer bound. None: by axis alone. `shardlib.calibrate` sets it.

    Every number must be positive and finite (a latency may be 0); anything else is refused
    here, naming the field.
    """

    name: str
    link_bytes_per_s: float
    flops_per_s: float
    memory_bytes: float | None = None
    node_size: int | None = None
    inter_node_bytes_per_s: float | None = None
    source: str = ""
    hbm_bytes_per_s: float | None = None
    collective_latency_s: float = 0.0
    torus_axes: int | None = None
    op_overhead_s: float = 0.0
    collective_call_s: float = 0.0
    elementwise_bytes_per_s: float | None = None
    axis_bytes_per_s: Mapping[str, float] | None = field(default=None, hash=False)
    axis_latency_s: Mapping[str, float] | None = field(default=None, hash=False)
    collective_call_by_kind_s: Mapping[str, float] | None = field(default=None, hash=False)
    collective_latency_by_kind_s: Mapping[str, float] | None = field(default=None, hash=False)

    def __post_init__(self) -> None:
        bad = [
            f"{f}={getattr(self, f)!r}"
            for f, optional in _POSITIVE.items()
            if not (optional and getattr(self, f) is None) and not positive(getattr(self, f))
        ]
        for f in ("collective_latency_s", "op_overhead_s", "collective_call_s"):
            if not positive(getattr(self, f), zero=True):
                bad.append(f"{f}={getattr(self, f)!r} (may be 0)")
        for f, zero in (
            ("axis_bytes_per_s", False),
            ("axis_latency_s", True),
            ("collective_call_by_kind_s", True),
            ("collective_latency_by_kind_s", True),
        ):
            table = getattr(self, f)
            if table is not None and not (
                isinstance(table, Mapping)
                and all(isinstance(k, str) and positive(v, zero) for k, v in table.items())
            ):
                keys = "kind" if f.endswith("_by_kind_s") else "axis name"
                bad.append(f"{f}={table!r} ({keys} -> number)")
        if self.node_size is not None and not isinstance(self.node_size, int):
            bad.append(f"node_size={self.node_size!r} (an int)")
        if self.torus_axes is not None and not isinstance(self.torus_axes, int):
            bad.append(f"torus_axes={self.torus_axes!r} (an int)")
        if bad:
            raise ValueError(
                f"Hardware({self.name!r}): {', '.join(bad)}: each must be a positive, finite "
                "number (None where optional); pass the measured or published figure"
            )

    def bandwidth(self, span: int) -> float:
        """Bytes per second per device for a collective whose devices lie within ``span``
        consecutive devices (row-major device order: the mesh's last axis varies fastest)."""
        if self.node_size is None or self.inter_node_bytes_per_s is None:
            return self.link_bytes_per_s
        return self.link_bytes_per_s if span <= self.node_size else self.inter_node_bytes_per_s


_POSITIVE = {  # field -> may be None
    "link_bytes_per_s": False,
    "flops_per_s": False,
    "memory_bytes": True,
    "node_size": True,
    "inter_node_bytes_per_s": True,
    "hbm_bytes_per_s": True,
    "torus_axes": True,
    "elementwise_bytes_per_s": True,
}


def positive(x: object, zero: bool = False) -> bool:
    """Whether ``x`` is a real number (not a bool), finite, and > 0 (>= 0 with ``zero``)."""
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        return False
    value = float(x)
    return math.isfinite(value) and (value >= 0 if zero else value > 0)


_GIB = 2**30
_NV = "https://www.nvidia.com/en-us/data-center"
_TPU = "https://cloud.google.com/tpu/docs"
# The NICs of NVIDIA's DGX/HGX nodes: one ConnectX-7 per GPU at 400 Gb/s (50 GB/s), or
# ConnectX-6 at 200 Gb/s (25 GB/s) on DGX A100. TPU DCN bandwidth per chip is not on the spec
# pages: 6.25 GB/s (50 Gb/s) is an assumption; give your measured number. TPU ICI: one figure
# per generation, the one-way bandwidth of one link from "How to Scale Your Model" (its TPU
# chapter's table, from Google's numbers); a torus axis is a bidirectional ring with wrap-around,
# so a device moves twice that over one physical axis (Google's per-chip totals, 4800 Gb/s on
# v5p and 1600 Gb/s on v5e, are every link of the chip at once: 6 and 4 links).
_ICI = "(jax-ml.github.io/scaling-book/tpus, 'ICI BW/link'):"
HARDWARE: dict[str, Hardware] = {
    "h100": Hardware(
        "NVIDIA H100 SXM (NVLink 4)",
        450e9,
        989e12,
        80e9,
        8,
        50e9,
        f"{_NV}/h100/ (989 TFLOP/s dense bf16, 80 GB, NVLink 900 GB/s both ways); "
        f"{_NV}/dgx-h100/ (8 GPUs, 8x ConnectX-7 400 Gb/s; HBM3 3.35 TB/s)",
        hbm_bytes_per_s=3.35e12,
    ),
    "h200": Hardware(
        "NVIDIA H200 SXM (NVLink 4)",
        450e9,
        989e12,
        141e9,
        8,
        50e9,
        f"{_NV}/h200/ (989 TFLOP/s dense bf16, 141 GB, NVLink 900 GB/s both ways; "
        "8 GPUs per HGX node, 400 Gb/s per GPU; HBM3e 4.8 TB/s)",
        hbm_bytes_per_s=4.8e12,
    ),
    "b200": Hardware(
        "NVIDIA B200 (NVLink 5)",
        900e9,
        2.25e15,
        180e9,
        8,
        50e9,
        f"{_NV}/hgx/ (HGX B200: 8 GPUs, 36 PFLOP/s bf16 with sparsity = 2.25 dense per GPU, "
        "1.4 TB, NVLink 1.8 TB/s both ways per GPU; HBM3e 8 TB/s per GPU); 400 Gb/s "
        "ConnectX-7 per GPU (DGX B200)",
        hbm_bytes_per_s=8e12,
    ),
    "a100": Hardware(
        "NVIDIA A100 SXM (NVLink 3)",
        300e9,
        312e12,
        80e9,
        8,
        25e9,
        f"{_NV}/a100/ (312 TFLOP/s dense bf16, 80 GB, NVLink 600 GB/s both ways); "
        f"{_NV}/dgx-a100/ (8 GPUs, 8x ConnectX-6 200 Gb/s; HBM2e 2.039 TB/s)",
        hbm_bytes_per_s=2.039e12,
    ),
    "tpu-v5e": Hardware(
        "TPU v5e (ICI, 2-D torus)",
        2 * 4.5e10,
        197e12,
        16 * _GIB,
        256,
        6.25e9,
        f"{_TPU}/v5e (197 TFLOP/s bf16, 16 GiB HBM at 819 GB/s, 256 chips per pod as 16x16); "
        f"ICI {_ICI} 4.5e10 B/s one way per link: 9e10 per torus axis",
        hbm_bytes_per_s=8.1e11,
        torus_axes=2,
    ),
    "tpu-v5p": Hardware(
        "TPU v5p (ICI, 3-D torus)",
        2 * 9e10,
        459e12,
        95 * _GIB,
        8960,
        6.25e9,
        f"{_TPU}/v5p (459 TFLOP/s bf16, 95 GiB HBM at 2765 GB/s, 8960 chips per pod as "
        f"16x20x28); ICI {_ICI} 9e10 B/s one way per link: 1.8e11 per torus axis",
        hbm_bytes_per_s=2.765e12,
        torus_axes=3,
    ),
    "tpu-v4": Hardware(
        "TPU v4 (ICI, 3-D torus)",
        2 * 4.5e10,
        275e12,
        32 * _GIB,
        4096,
        6.25e9,
        f"{_TPU}/v4 (275 TFLOP/s bf16, 32 GiB HBM at 1200 GB/s, 4096 chips per pod); ICI "
        f"{_ICI} 4.5e10 B/s one way per link: 9e10 per torus axis",
        hbm_bytes_per_s=1.2e12,
        torus_axes=3,
    ),
    "cpu": Hardware("host CPU (simulated devices)", 10e9, 1e11, source="a rough laptop"),
}


def hardware_of(hardware: str | Hardware, caller: str) -> Hardware:
    """``hardware`` itself, or the preset it names; an unknown name is refused, naming
    ``caller`` (``'explain'``, ``'plan'``) and the presets."""
    if isinstance(hardware, Hardware):
        return hardware
    if hardware not in HARDWARE:
        raise ValueError(
            f"{caller}: unknown hardware {hardware!r}; known: {', '.join(HARDWARE)}, or pass "
            "shardlib.Hardware(name, link_bytes_per_s, flops_per_s, ...)"
        )
    return HARDWARE[hardware]


def axis_bandwidth(
    hw: Hardware,
    mesh: Mapping[str, int],
    axes: Sequence[str],
    measured: Mapping[str, float] | None = None,
) -> float:
    """Bytes per second per device of a collective over ``axes`` of ``mesh`` (axis -> size,
    in mesh order): the slowest of the ``measured`` bandwidths given for its axes, else the
    link between nodes if its devices span more than one node, else the fast link: on a torus
    (``hw.torus_axes``) ``link_bytes_per_s`` times the physical axes it occupies
    (`torus_axes_of`), elsewhere ``link_bytes_per_s``. Devices are laid out row-major
    (``jax.make_mesh`` without a topology does that on GPUs): a group over axis ``a`` spans the
    sizes of ``a`` and every axis after it."""
    if measured and all(a in measured for a in axes) and axes:
        return min(measured[a] for a in axes)
    names = list(mesh)
    first = min((names.index(a) for a in axes if a in mesh), default=len(names))
    span = math.prod(mesh[a] for a in names[first:])
    if hw.torus_axes is None or hw.node_size is not None and span > hw.node_size:
        return hw.bandwidth(span)
    return hw.link_bytes_per_s * max(1, len(torus_axes_of(hw, mesh, axes)))


def slice_shape(devices: int, torus_axes: int) -> tuple[int, ...]:
    """The torus a slice of ``devices`` chips is taken to be: ``devices`` split over
    ``torus_axes`` physical axes as evenly as its prime factors allow (each, largest first, to
    the shortest axis so far), longest axis first: 1024 on 3 axes is 16x8x8, 64 is 4x4x4, 256
    on 2 is 16x16 (the shapes Google offers for powers of two)."""
    if devices < 1 or torus_axes < 1:
        raise ValueError(
            f"slice_shape: devices={devices!r}, torus_axes={torus_axes!r}: each must be >= 1"
        )
    dims = [1] * torus_axes
    for p in sorted(prime_factors(devices), reverse=True):
        dims[dims.index(min(dims))] *= p
    return tuple(sorted(dims, reverse=True))


def torus_axes_of(hw: Hardware, mesh: Mapping[str, int], axes: Sequence[str]) -> frozenset[int]:
    """The physical axes (indices into `slice_shape`) a collective over mesh ``axes`` occupies.

    The rule: the slice is ``slice_shape(devices, hw.torus_axes)``, devices the mesh's (on a
    mesh larger than a node, the product of its trailing axes that fits in one); devices are numbered row-major over the mesh (its last axis
    fastest) and over the slice (its last physical axis fastest), so device ``i`` of the mesh
    is device ``i`` of the slice. A mesh axis occupies every physical axis along which its
    group's coordinates vary; a collective over several mesh axes the union of theirs. So
    ``{"d": 1024}`` occupies all 3 axes of 16x8x8, and in ``{"data": 16, "t": 64}`` ``t`` the
    last two (8x8) and ``data`` the first (16). A mesh axis that covers part of a physical axis
    (``t=4`` on an axis of 8) counts it whole: no wrap-around is modelled, so its time is a
    lower bound like the rest."""
    if hw.torus_axes is None:
        return frozenset()
    devices = 1
    for size in reversed(list(mesh.values())):  # the trailing axes that fit in one node
        if hw.node_size is not None and devices * size > hw.node_size:
            break
        devices *= size
    shape = slice_shape(devices, hw.torus_axes)
    names = list(mesh)
    out: set[int] = set()
    for a in axes:
        if a in mesh:
            stride = math.prod(mesh[b] for b in names[names.index(a) + 1 :])
            out |= _varying(shape, stride, mesh[a])
    return frozenset(out)


@lru_cache(maxsize=4096)
def _varying(shape: tuple[int, ...], stride: int, size: int) -> frozenset[int]:
    """The physical axes of ``shape`` (last fastest) along which devices ``0, stride, ...,
    (size - 1) * stride`` differ (indices wrap modulo the slice)."""
    inner = [math.prod(shape[i + 1 :]) for i in range(len(shape))]
    total = math.prod(shape)
    return frozenset(
        i
        for i, (n, c) in enumerate(zip(shape, inner, strict=True))
        if any((j * stride % total) // c % n for j in range(1, size))
    )


def prime_factors(n: int) -> list[int]:
    """The prime factors of ``n`` (>= 1), with multiplicity, smallest first: 12 -> [2, 2, 3]."""
    out, p = [], 2
    while p * p <= n:
        while n % p == 0:
            out.append(p)
            n //= p
        p += 1
    return [*out, n] if n > 1 else out
