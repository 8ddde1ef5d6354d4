"""One tensor-parallel MLP written twice: the GSPMD way and the shardlib way.

Run: python examples/gspmd_vs_shardlib.py   (simulates 8 CPU devices when no accelerator is present)

The model is a Megatron-style two-layer MLP on a ``(d=4, t=2)`` mesh: the batch is split over
``d``, the first weight by columns and the second by rows over ``t``; the loss is the mean
squared error against a target.

- **GSPMD** (what Flax, scalax and ``jax.jit`` users write): global ``jax.numpy`` code; the
  layouts are given only at the boundary (``in_shardings``/``out_shardings`` of ``jax.jit``,
  plus one ``with_sharding_constraint`` on the hidden activation) and XLA's partitioner decides
  where to communicate. The mesh axes are Auto.
- **shardlib**: per-device code in ``typed_shard_map``; every collective is written down
  (``shardops.psum`` over ``t`` after the row-parallel matmul, over ``d`` for the loss), and
  every shape in the body is checked against its annotation.

Both compute the same loss and gradients (checked); the script prints the collectives each
compiles to (forward + backward), counted from the compiled HLO.
"""

from __future__ import annotations

import argparse
import re
from collections import Counter

from examples import _devices

_devices.simulate_cpu_devices(8)  # sets XLA_FLAGS: 8 simulated CPU devices, before JAX starts

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import shardlib.shardops as shardops  # noqa: E402
from shardlib.shardtypes import Array, f32, make_shardings, pytree_dataclass, typed_shard_map  # noqa: E402

__all__ = ["Weights", "collectives", "gspmd_loss", "main", "shardlib_loss"]


@pytree_dataclass
class Weights:
    w_in: f32[Array, b"M F/t"]  # column-parallel
    w_out: f32[Array, b"F/t M"]  # row-parallel


# --- GSPMD: global code, layouts at the boundary ---------------------------------------------


def gspmd_loss(w: Weights, x: jax.Array, target: jax.Array) -> jax.Array:
    h = jax.nn.gelu(x @ w.w_in)
    h = jax.lax.with_sharding_constraint(h, P("d", "t"))  # hidden units stay split over t
    y = h @ w.w_out
    return jnp.mean(jnp.square(y - target))


# --- shardlib: per-device code, explicit collectives --------------------------------------------


@typed_shard_map
def shardlib_loss(
    w: Weights, x: f32[Array, b"B/d M"], target: f32[Array, b"B/d M"]
) -> f32[Array, b""]:
    h = jax.nn.gelu(shardops.einsum_unreduced("B/d M, M F/t -> B/d F/t", x, w.w_in))
    partial = shardops.einsum_unreduced("B/d F/t, F/t M -> B/d M {+t}", h, w.w_out)
    y = shardops.psum("B/d M {+t}", partial, axes="t")  # add up the row blocks' parts
    local = jnp.sum(jnp.square(y - target))
    total = shardops.psum("", local, axes="d")
    return total / (x.shape[0] * shardops.axis_size("d") * x.shape[1])


# --- counting collectives in compiled HLO ------------------------------------------------------

COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
_LINE = re.compile(
    r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(\([^)]*\)|\S+)\s+("
    + "|".join(COLLECTIVES)
    + r")(?:-start)?\("
)


def collective_ops(compiled_text: str) -> list[tuple[str, str]]:
    """``(kind, shape)`` of every collective instruction in compiled HLO text.

    Matched by opcode at the start of an instruction, so names that merely contain
    ``all-reduce`` do not count, and an async ``-start``/``-done`` pair counts once.
    """
    ops = []
    for line in compiled_text.splitlines():
        m = _LINE.match(line)
        if m:
            shape = re.sub(r"\{[\d,]*\}", "", m.group(1))  # drop layouts such as {1,0}
            ops.append((m.group(2), shape))
    return ops


def collectives(compiled_text: str) -> Counter:
    """``Counter`` of collective kinds in compiled HLO text."""
    return Counter(kind for kind, _ in collective_ops(compiled_text))


def _census(ops: list[tuple[str, str]]) -> str:
    return "; ".join(f"{kind} {shape}" for kind, shape in ops) or "none"


def build_parser() -> argparse.ArgumentParser:
    """The command line: ``--help`` lists every flag with its default."""
    p = argparse.ArgumentParser(
        description=(__doc__ or "").splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--batch", type=int, default=32, help="global batch (split over 'd')")
    p.add_argument("--d-model", type=int, default=16, help="model width M")
    p.add_argument("--d-ff", type=int, default=64, help="MLP hidden width F (split over 't')")
    p.add_argument("--seed", type=int, default=0, help="seeds the weights and the data")
    return p


def main(argv: list[str] | None = None) -> dict:
    """Run both versions; return their losses, gradients' largest difference and collectives."""
    args = build_parser().parse_args(argv)

    rng = np.random.default_rng(args.seed)
    m, f = args.d_model, args.d_ff
    w = Weights(
        w_in=(rng.standard_normal((m, f)) / np.sqrt(m)).astype(np.float32),
        w_out=(rng.standard_normal((f, m)) / np.sqrt(f)).astype(np.float32),
    )
    x = rng.standard_normal((args.batch, m)).astype(np.float32)
    target = rng.standard_normal((args.batch, m)).astype(np.float32)

    # GSPMD: an Auto mesh; shardings only at jit's boundary.
    auto_mesh = jax.make_mesh((4, 2), ("d", "t"), axis_types=(AxisType.Auto,) * 2)
    wsh = make_shardings(Weights, auto_mesh)  # Weights(P(None, 't'), P('t', None)) on auto_mesh
    xsh = NamedSharding(auto_mesh, P("d", None))
    gspmd = jax.jit(
        jax.value_and_grad(gspmd_loss),
        in_shardings=(wsh, xsh, xsh),
        out_shardings=(NamedSharding(auto_mesh, P()), wsh),
    )
    with jax.set_mesh(auto_mesh):
        g_compiled = gspmd.lower(w, x, target).compile()
        g_loss, g_grads = g_compiled(
            jax.device_put(w, wsh), jax.device_put(x, xsh), jax.device_put(target, xsh)
        )

    # shardlib: an Explicit mesh; the annotations give the layouts.
    mesh = jax.make_mesh((4, 2), ("d", "t"))
    with jax.set_mesh(mesh):
        ws = jax.device_put(w, make_shardings(Weights))
        xs = jax.device_put(x, make_shardings(f32[Array, b"B/d M"]))
        ts = jax.device_put(target, make_shardings(f32[Array, b"B/d M"]))
        s_compiled = jax.jit(jax.value_and_grad(shardlib_loss)).lower(ws, xs, ts).compile()
        s_loss, s_grads = s_compiled(ws, xs, ts)

    ref_loss, ref_grads = jax.value_and_grad(_plain_loss)(w, x, target)
    grad_diff = max(
        float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
        for a, b in zip(jax.tree.leaves(g_grads), jax.tree.leaves(s_grads), strict=True)
    )
    ref_diff = max(
        float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
        for a, b in zip(jax.tree.leaves(s_grads), jax.tree.leaves(ref_grads), strict=True)
    )
    g_ops = collective_ops(g_compiled.as_text() or "")
    s_ops = collective_ops(s_compiled.as_text() or "")
    print(
        f"loss: GSPMD {float(g_loss):.6f}  shardlib {float(s_loss):.6f}  one device {ref_loss:.6f}"
    )
    print(
        f"gradients: max |GSPMD - shardlib| = {grad_diff:.1e}, |shardlib - one device| = {ref_diff:.1e}"
    )
    print("collectives (forward + backward), per device:")
    print(f"  GSPMD:    {_census(g_ops)}")
    print(f"  shardlib: {_census(s_ops)}")
    print(
        "  shardlib's come from its code: the psum over t of the row-parallel output, and the "
        "psum over d of the loss, which XLA merges with the sum over d of the two weight "
        "gradients (the weights are replicated over d) into one all-reduce"
    )
    return {
        "gspmd_loss": float(g_loss),
        "shardlib_loss": float(s_loss),
        "reference_loss": float(ref_loss),
        "grad_diff": grad_diff,
        "reference_grad_diff": ref_diff,
        "gspmd_collectives": g_ops,
        "shardlib_collectives": s_ops,
        "shardlib_grad_shardings": jax.tree.map(lambda a: a.sharding.spec, s_grads),
    }


def _plain_loss(w: Weights, x: np.ndarray, target: np.ndarray) -> jax.Array:
    """The oracle: the MLP on one device, no sharding annotations at all."""
    y = jax.nn.gelu(x @ w.w_in) @ w.w_out
    return jnp.mean(jnp.square(y - target))


if __name__ == "__main__":
    main()
