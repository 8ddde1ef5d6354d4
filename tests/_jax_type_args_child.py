"""The child process of tests/test_jax_type_args.py: a ``typed_shard_map`` argument whose JAX
type is unreduced (``{U:t}``) or reduced (``{R:t}``), passed for every kind of annotation.

Some of these calls, were shardlib to pass them to JAX, abort the process inside XLA (Shardy's
``explicit_reshards_util.cc`` check on unreduced axes), so they run here, in one process, and
each prints one JSON line of its outcome before the next starts (flushed): a case the parent
finds no line for is the one that ended the process. Run by the parent with the test's
``XLA_FLAGS`` (8 CPU devices) and ``PYTHONPATH``; not collected by pytest.

Each case: a mesh, how the argument's value is made (the reference is its sum, an
independent ``numpy`` product), an annotation, and eager or ``jax.jit``. A call that runs
reports its result's largest difference from the reference.
"""

from __future__ import annotations

import json
import sys
import traceback

import jax
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from shardlib import shardops
from shardlib.shardtypes import Array, f32, typed_shard_map

RNG = np.random.default_rng(0)
A = RNG.standard_normal((4, 16)).astype(np.float32)
B = RNG.standard_normal((16, 6)).astype(np.float32)
REF = A @ B

# Case id -> (mesh shape and axis names, value, annotation of the argument). The value is
# "U:t" (the unreduced result of a typed matmul whose contracted dim is split over t),
# "R:t" (the product, typed reduced over t), or "-" (the product, an ordinary array).
CASES: dict[str, tuple[tuple[tuple[int, ...], tuple[str, ...]], str, str]] = {
    # refused: unreduced over an axis the clause does not type it unreduced over
    "2d U:t for +d": (((4, 2), ("t", "d")), "U:t", "M N {+d}"),
    "2d U:t for plain": (((4, 2), ("t", "d")), "U:t", "M N"),
    "2d U:d for =d": (((4, 2), ("t", "d")), "U:d", "M N {=d}"),
    "2d U:t for =t": (((4, 2), ("t", "d")), "U:t", "M N {=t}"),
    "2d U:t for +d=t": (((4, 2), ("t", "d")), "U:t", "M N {+d=t}"),
    "2d U:t/d for +t": (((4, 2), ("t", "d")), "U:t/d", "M N {+t}"),
    "2d U:t for split": (((4, 2), ("t", "d")), "U:t", "M/t N"),
    "1d U:t for plain": (((8,), ("t",)), "U:t", "M N"),
    "1d U:t for =t": (((8,), ("t",)), "U:t", "M N {=t}"),
    # run: moves without communication, or the type as annotated
    "2d U:t for +t": (((4, 2), ("t", "d")), "U:t", "M N {+t}"),
    "2d U:t for +t+d": (((4, 2), ("t", "d")), "U:t", "M N {+t+d}"),
    "2d U:t/d for +t+d": (((4, 2), ("t", "d")), "U:t/d", "M N {+t+d}"),
    "2d R:t for +t": (((4, 2), ("t", "d")), "R:t", "M N {+t}"),
    "2d - for +t": (((4, 2), ("t", "d")), "-", "M N {+t}"),
    "2d R:t for plain": (((4, 2), ("t", "d")), "R:t", "M N"),
    "1d U:t for +t": (((8,), ("t",)), "U:t", "M N {+t}"),
    "1d R:t for +t": (((8,), ("t",)), "R:t", "M N {+t}"),
}


def _value(mesh: jax.sharding.Mesh, kind: str) -> jax.Array:
    if kind.startswith("U:"):
        axes = kind[2:]  # "t", "d" or "t/d"
        contracted = f"K/{axes}".encode()

        @typed_shard_map
        def matmul(
            a: f32[Array, b"M " + contracted], b: f32[Array, contracted + b" N"]
        ) -> f32[Array, b"M N {+" + axes.replace("/", "+").encode() + b"}"]:
            pending = "+".join(axes.split("/"))
            return shardops.einsum_unreduced(
                f"M {contracted.decode()}, {contracted.decode()} N -> M N {{+{pending}}}", a, b
            )

        split = tuple(axes.split("/"))
        split_entry = split[0] if len(split) == 1 else split
        a = jax.device_put(A, NamedSharding(mesh, P(None, split_entry)))
        b = jax.device_put(B, NamedSharding(mesh, P(split_entry, None)))
        return jax.jit(matmul)(a, b)
    plain = jax.device_put(REF, NamedSharding(mesh, P()))
    if kind == "-":
        return plain
    return jax.jit(lambda x: jax.reshard(x, P(None, None, reduced={kind[2:]})))(plain)


def _function(annotation: str):
    spec = annotation.encode()
    pending = annotation.partition("{")[2].rstrip("}").partition("=")[0]
    axes = tuple(a for a in pending.split("+") if a)

    def g(y: f32[Array, spec]) -> f32[Array, b"M N"]:
        if axes:
            return shardops.psum(f"M N {{+{'+'.join(axes)}}}", y, axes=axes)
        if "/t" in annotation:
            return shardops.all_gather("M/t N -> M N", y)
        return y * 1.0

    g.__name__ = g.__qualname__ = "take"
    return typed_shard_map(g)


def run(case: str, mode: str) -> dict[str, object]:
    (shape, names), kind, annotation = CASES[case]
    mesh = jax.make_mesh(shape, names, axis_types=(AxisType.Explicit,) * len(names))
    out: dict[str, object] = {"case": case, "mode": mode}
    with jax.set_mesh(mesh):
        y = _value(mesh, kind)
        out["type"] = str(jax.typeof(y))
        g = _function(annotation)
        try:
            got = g(y) if mode == "eager" else jax.jit(g)(y)
            got = np.asarray(jax.jit(lambda r: jax.reshard(r, P()))(got))
        except Exception as e:  # the refusal under test, or a failure the parent reports
            out["error"] = type(e).__name__
            out["message"] = str(e)
            out["where"] = traceback.format_exc(limit=-3)
        else:
            out["max_err"] = float(np.max(np.abs(got - REF)))
    return out


def main() -> None:
    for case in CASES:
        for mode in ("eager", "jit"):
            print(json.dumps(run(case, mode)), flush=True)


if __name__ == "__main__":
    sys.exit(main())
