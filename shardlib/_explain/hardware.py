"""Hardware models behind the time estimates of `shardlib.explain` and `shardlib.plan`.

A `Hardware` is a few public numbers: peak dense matmul FLOP/s per device, the bandwidth one
device sends at over its fast interconnect (NVLink, TPU ICI) and over the slower one between
groups of devices (InfiniBand, TPU DCN), how many devices share the fast one (a node; a TPU
pod), and memory per device. `HARDWARE` holds presets, each with the spec sheet it comes from.
Vendors quote peaks: a real collective or matmul reaches a fraction of them, so every time
computed from them is a lower bound. Give measured numbers with ``dataclasses.replace``
(``replace(HARDWARE['h100'], inter_node_bytes_per_s=38e9)``) or per mesh axis with
``shardlib.plan(..., bandwidths={'data': 38e9})``.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = ["HARDWARE", "Hardware", "axis_bandwidth", "hardware_of", "positive"]


@dataclass(frozen=True)
class Hardware:
    """A hardware model for time estimates (vendor peaks: estimates, lower bounds on time).

    **Fields:**

    - ``name``: what it is.
    - ``link_bytes_per_s``: bytes per second one device sends (and receives) over its fast
      interconnect, one direction (NVLink; TPU ICI).
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

    def __post_init__(self) -> None:
        bad = [
            f"{f}={getattr(self, f)!r}"
            for f, optional in _POSITIVE.items()
            if not (optional and getattr(self, f) is None) and not positive(getattr(self, f))
        ]
        if not positive(self.collective_latency_s, zero=True):
            bad.append(f"collective_latency_s={self.collective_latency_s!r} (may be 0)")
        if self.node_size is not None and not isinstance(self.node_size, int):
            bad.append(f"node_size={self.node_size!r} (an int)")
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
# pages: 6.25 GB/s (50 Gb/s) is an assumption; give your measured number.
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
        "TPU v5e (ICI)",
        200e9,
        197e12,
        16 * _GIB,
        256,
        6.25e9,
        f"{_TPU}/v5e (197 TFLOP/s bf16, 16 GiB HBM at 819 GB/s, ICI 1600 Gb/s, 256 chips "
        "per pod); DCN per chip: assumed",
        hbm_bytes_per_s=8.1e11,
    ),
    "tpu-v5p": Hardware(
        "TPU v5p (ICI)",
        600e9,
        459e12,
        95 * _GIB,
        8960,
        6.25e9,
        f"{_TPU}/v5p (459 TFLOP/s bf16, 95 GiB HBM at 2765 GB/s, ICI 4800 Gb/s, 8960 chips "
        "per pod); DCN per chip: assumed",
        hbm_bytes_per_s=2.765e12,
    ),
    "tpu-v4": Hardware(
        "TPU v4 (ICI)",
        270e9,
        275e12,
        32 * _GIB,
        4096,
        6.25e9,
        f"{_TPU}/v4 (275 TFLOP/s bf16, 32 GiB HBM at 1200 GB/s, 4096 chips per pod); DCN "
        "per chip: assumed",
        hbm_bytes_per_s=1.2e12,
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
    hardware's fast link if its devices lie within one node, else the link between nodes.
    Devices are laid out row-major (``jax.make_mesh`` without a topology does that on GPUs):
    a group over axis ``a`` spans the sizes of ``a`` and every axis after it."""
    if measured and all(a in measured for a in axes) and axes:
        return min(measured[a] for a in axes)
    names = list(mesh)
    first = min((names.index(a) for a in axes if a in mesh), default=len(names))
    return hw.bandwidth(math.prod(mesh[a] for a in names[first:]))
