"""The devices the examples run on: 8 simulated CPU devices, and meshes over what is there.

XLA splits the CPU into simulated devices when ``XLA_FLAGS`` holds
``--xla_force_host_platform_device_count=8`` as JAX starts. Each example calls
`simulate_cpu_devices` at its top, before it imports JAX, which is the same as starting it
with ``XLA_FLAGS=--xla_force_host_platform_device_count=8 python examples/...``. On a
machine with a GPU or TPU the accelerator stays the default device; `make_mesh` falls back
to the simulated CPU devices when the default ones are too few for the mesh.
"""

from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import jax

__all__ = ["make_mesh", "mesh_shape", "simulate_cpu_devices"]

_COUNT_FLAG = "--xla_force_host_platform_device_count"


def simulate_cpu_devices(count: int) -> None:
    """Ask XLA for ``count`` CPU devices: adds ``--xla_force_host_platform_device_count=count``
    to ``XLA_FLAGS``, unless it sets a count already. Call it before importing JAX."""
    flags = os.environ.get("XLA_FLAGS", "")
    if _COUNT_FLAG not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {_COUNT_FLAG}={count}".strip()


def mesh_shape(spec: str, names: tuple[str, ...]) -> tuple[int, ...]:
    """``--mesh`` text such as ``'2x2x2'`` -> one size per axis of ``names``; exits with a
    message naming the flag when the text is not that."""
    try:
        sizes = tuple(int(n) for n in spec.lower().split("x"))
    except ValueError:
        sizes = ()
    if len(sizes) != len(names):
        form, example = "x".join(n.upper() for n in names), "x".join("2" * len(names))
        raise SystemExit(f"--mesh must be {form} such as {example}, got {spec!r}")
    return sizes


def make_mesh(spec: str, names: tuple[str, ...], devices: list | None = None) -> jax.sharding.Mesh:
    """The mesh ``--mesh spec`` asks for, with axes ``names`` (Explicit axes), on ``devices``:
    by default the default devices when there are enough of them, else the CPU devices."""
    import jax  # here, not at the top: importing this module must not import JAX

    sizes = mesh_shape(spec, names)
    n = math.prod(sizes)
    if devices is None:
        devices = jax.devices()
        if len(devices) < n:
            devices = jax.devices("cpu")
    if len(devices) < n:
        raise SystemExit(
            f"--mesh {spec} needs {n} devices, found {len(devices)}; on CPU set "
            f"XLA_FLAGS={_COUNT_FLAG}={n} before starting Python"
        )
    return jax.make_mesh(sizes, names, devices=devices[:n])
