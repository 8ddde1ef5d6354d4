"""Create weights directly in their sharded layout: no device ever holds a full copy.

Run: python examples/sharded_init.py   (simulates 8 CPU devices when no accelerator is present)

A model too big for one device cannot be initialised on one device and then split. Each
device must compute only its own block of every weight. Four ways to try, compared by the
largest array in the compiled program and by XLA's per-device memory estimate:

1. ``eager, then device_put``: the full weights are built on one device, then split.
2. ``jit(out_shardings=...)`` on an **Explicit** mesh (what ``jax.make_mesh`` gives): the
   output is split, but the random numbers have a replicated type inside the program, so
   every device computes the *full* arrays and keeps its block.
3. ``out_sharding=`` on each random call, from the annotations (``make_partition_specs``), on
   the Explicit mesh: each device generates only its block. This is the recipe
   (``examples/transformer_model.py``'s ``init_model(..., sharded=True)`` uses it).
4. ``jit(out_shardings=...)`` on an **Auto** mesh: GSPMD propagates the output layout back
   into the random-number computation and partitions it.

JAX's random bits do not depend on the layout (``jax_threefry_partitionable``, on by
default), so every way gives the same values as the plain single-device initialisation; the
script checks that.
"""

from __future__ import annotations

import argparse
import math
import re

from examples import _devices

_devices.simulate_cpu_devices(8)  # sets XLA_FLAGS: 8 simulated CPU devices, before JAX starts

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType  # noqa: E402

from jax_extra import fold_in_str  # noqa: E402
from shardlib.shardtypes import (  # noqa: E402
    Array,
    f32,
    make_partition_specs,
    make_shardings,
    pytree_dataclass,
    sharding_summary,
)

__all__ = ["Weights", "init", "largest_array_bytes", "main"]


@pytree_dataclass
class Weights:
    embed: f32[Array, b"V/t M/d"]
    w_up: f32[Array, b"M/d F/t"]
    w_down: f32[Array, b"F/t M/d"]
    norm: f32[Array, b"M/t/d"]


def init(key: jax.Array, vocab: int, d_model: int, d_ff: int, sharded: bool = False) -> Weights:
    """Random weights; with ``sharded=True`` each array is created in its annotated layout.

    ``sharded=True`` needs a mesh with Explicit axes in force (``jax.set_mesh``).
    """
    specs = make_partition_specs(Weights) if sharded else None

    def spec(name: str):
        return getattr(specs, name) if specs is not None else None

    def normal(name: str, shape: tuple[int, ...], fan_in: int) -> jax.Array:
        x = jax.random.normal(fold_in_str(key, name), shape, jnp.float32, out_sharding=spec(name))
        return x / math.sqrt(fan_in)

    return Weights(
        embed=normal("embed", (vocab, d_model), 1),
        w_up=normal("w_up", (d_model, d_ff), d_model),
        w_down=normal("w_down", (d_ff, d_model), d_ff),
        norm=jnp.ones((d_model,), jnp.float32, out_sharding=spec("norm")),
    )


_ARRAY = re.compile(r"\b(f32|u32|s32|u8|pred)\[([\d,]+)\]")
_ITEMSIZE = {"f32": 4, "u32": 4, "s32": 4, "u8": 1, "pred": 1}


def largest_array_bytes(compiled_text: str) -> int:
    """The size of the largest array shape anywhere in a compiled (per-device) HLO program."""
    sizes = [
        _ITEMSIZE[dt] * math.prod(int(n) for n in dims.split(","))
        for dt, dims in _ARRAY.findall(compiled_text)
    ]
    return max(sizes, default=0)


def _mib(n: float) -> str:
    return f"{n / 2**20:7.2f} MiB"


def build_parser() -> argparse.ArgumentParser:
    """The command line: ``--help`` lists every flag with its default."""
    p = argparse.ArgumentParser(
        description=(__doc__ or "").splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--vocab", type=int, default=4096, help="vocabulary size V")
    p.add_argument("--d-model", type=int, default=256, help="model width M")
    p.add_argument("--d-ff", type=int, default=1024, help="MLP hidden width F")
    p.add_argument("--seed", type=int, default=0, help="seeds the weights")
    return p


def main(argv: list[str] | None = None) -> dict:
    """Initialise four ways; return their per-device footprints and value checks."""
    args = build_parser().parse_args(argv)
    dims = (args.vocab, args.d_model, args.d_ff)
    key = jax.random.key(args.seed)

    def plain(k):
        return init(k, *dims)

    def created_sharded(k):
        return init(k, *dims, sharded=True)

    reference = jax.device_get(jax.jit(plain)(key))
    full = {
        name: int(np.asarray(a).nbytes)
        for name, a in zip(
            ("embed", "w_up", "w_down", "norm"), jax.tree.leaves(reference), strict=True
        )
    }
    biggest = max(full.values())

    explicit = jax.make_mesh((4, 2), ("d", "t"))
    auto = jax.make_mesh((4, 2), ("d", "t"), axis_types=(AxisType.Auto,) * 2)
    results: dict[str, dict] = {}

    def measure(name: str, mesh, fn) -> None:
        with jax.set_mesh(mesh):
            compiled = fn.lower(key).compile()
            weights = compiled(key)
            mem = compiled.memory_analysis()
            shardings = make_shardings(Weights)
        values_equal = all(
            np.allclose(np.asarray(a), b, rtol=1e-6, atol=0)
            for a, b in zip(jax.tree.leaves(weights), jax.tree.leaves(reference), strict=True)
        )
        layout_ok = all(
            a.sharding.is_equivalent_to(s, a.ndim)
            for a, s in zip(jax.tree.leaves(weights), jax.tree.leaves(shardings), strict=True)
        )
        results[name] = {
            "largest_array": largest_array_bytes(compiled.as_text()),
            "temp": getattr(mem, "temp_size_in_bytes", -1) if mem is not None else -1,
            "output": getattr(mem, "output_size_in_bytes", -1) if mem is not None else -1,
            "values_equal": values_equal,
            "layout_ok": layout_ok,
            "weights": weights,
        }

    with jax.set_mesh(explicit):
        out = make_shardings(Weights)
    measure("jit(out_shardings), Explicit mesh", explicit, jax.jit(plain, out_shardings=out))
    measure("out_sharding= per array, Explicit", explicit, jax.jit(created_sharded))
    with jax.set_mesh(auto):
        out_auto = make_shardings(Weights)
    measure("jit(out_shardings), Auto mesh", auto, jax.jit(plain, out_shardings=out_auto))

    with jax.set_mesh(explicit):
        print(sharding_summary(results["out_sharding= per array, Explicit"]["weights"]))
    print(
        f"\nfull size of the largest weight: {_mib(biggest)}; every device's share of all "
        f"weights: {_mib(sum(full.values()) / 8)}"
    )
    print(f"{'method':38s}  {'largest array':>13s}  {'XLA temp':>11s}  values  layout")
    print(f"{'eager, then device_put':38s}  {_mib(biggest):>13s}  {'(1 device)':>11s}")
    for name, r in results.items():
        print(
            f"{name:38s}  {_mib(r['largest_array']):>13s}  {_mib(r['temp']):>11s}  "
            f"{'same' if r['values_equal'] else 'DIFF':6s}  {'ok' if r['layout_ok'] else 'WRONG'}"
        )
    for r in results.values():
        del r["weights"]
    return {"full_bytes": full, "largest_weight_bytes": biggest, "methods": results}


if __name__ == "__main__":
    main()
