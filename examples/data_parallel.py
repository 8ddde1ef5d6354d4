"""Pure data parallelism by hand: replicated weights, the batch split over ``d``, mean gradients.

Run: python examples/data_parallel.py   (simulates 8 CPU devices when no accelerator is present)

Every device holds all the weights (``f32[Array, b'In H']``: no mesh axis) and a slice of the batch
(``f32[Array, b'B/d In']``). Inside ``typed_shard_map`` each device computes the gradient of the loss on
its own slice, ``shardops.pmean`` averages the gradients over ``d``, and every device applies
the same SGD update, so the replicas stay identical. The result is checked against the same
training run on one device, without any sharding.

One modern-JAX detail matters here. ``jax.shard_map`` tracks which values vary across devices
(``check_vma=True``, the default). The weights come in replicated, so JAX knows they are the
same everywhere, and ``jax.grad`` with respect to them already sums the per-device gradients
over ``d`` (the transpose of "broadcast to every device" is a sum). To get the *per-device*
gradient that the classic recipe averages, first say that each device works on its own copy:
``jax.lax.pcast(w, 'd', to='varying')``. Without it, the ``pmean`` below would receive an
already-summed gradient and return it unchanged, ``|d|`` times too large; shardlib sees from
JAX's types that the value is already the same on every device and refuses it at trace time.
``summed_by_autodiff`` shows that trap.
"""

from __future__ import annotations

import argparse

from examples import _devices

_devices.simulate_cpu_devices(8)  # sets XLA_FLAGS: 8 simulated CPU devices, before JAX starts

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import shardlib.shardops as shardops  # noqa: E402
from shardlib.shardtypes import Array, f32, make_shardings, pytree_dataclass, typed_shard_map  # noqa: E402

__all__ = ["Weights", "dp_grads", "dp_train_step", "loss_fn", "main", "summed_by_autodiff"]


@pytree_dataclass
class Weights:
    """A two-layer MLP, replicated: no dim names a mesh axis."""

    w1: f32[Array, b"In H"]
    b1: f32[Array, b"H"]
    w2: f32[Array, b"H Out"]


def loss_fn(w: Weights, x: jax.Array, y: jax.Array) -> jax.Array:
    """Mean squared error of the MLP on ``x`` (plain jax.numpy: the same code runs anywhere)."""
    pred = jax.nn.gelu(x @ w.w1 + w.b1) @ w.w2
    return jnp.mean(jnp.square(pred - y))


def _mean_over_d(g: Weights) -> Weights:
    return Weights(
        w1=shardops.pmean("In H", g.w1, axes="d"),
        b1=shardops.pmean("H", g.b1, axes="d"),
        w2=shardops.pmean("H Out", g.w2, axes="d"),
    )


@typed_shard_map
def dp_grads(
    w: Weights, x: f32[Array, b"B/d In"], y: f32[Array, b"B/d Out"]
) -> tuple[f32[Array, b""], Weights]:
    """The loss and its gradient on the whole batch: per-device gradients, then ``pmean``.

    Equal to the single-device gradient because every device has the same number of examples
    and the loss is a mean.
    """
    mine = jax.tree.map(lambda a: jax.lax.pcast(a, "d", to="varying"), w)  # this device's copy
    loss, g = jax.value_and_grad(loss_fn)(mine, x, y)
    return shardops.pmean("", loss, axes="d"), _mean_over_d(g)


@typed_shard_map
def summed_by_autodiff(w: Weights, x: f32[Array, b"B/d In"], y: f32[Array, b"B/d Out"]) -> Weights:
    """The trap: without ``pcast`` the gradient is already summed over ``d`` before ``pmean``."""
    g = jax.grad(loss_fn)(w, x, y)
    return _mean_over_d(g)


@jax.jit
def dp_train_step(
    w: Weights, x: jax.Array, y: jax.Array, lr: jax.Array
) -> tuple[Weights, jax.Array]:
    """One SGD step; every device applies the same averaged gradient to its replica."""
    loss, g = dp_grads(w, x, y)
    return jax.tree.map(lambda a, b: a - lr * b, w, g), loss


@jax.jit
def reference_train_step(
    w: Weights, x: jax.Array, y: jax.Array, lr: jax.Array
) -> tuple[Weights, jax.Array]:
    """The same step on one device, on global arrays."""
    loss, g = jax.value_and_grad(loss_fn)(w, x, y)
    return jax.tree.map(lambda a, b: a - lr * b, w, g), loss


def make_problem(
    seed: int = 0, batch: int = 64, d_in: int = 8, hidden: int = 32, d_out: int = 4
) -> tuple[Weights, np.ndarray, np.ndarray]:
    """Initial weights and a regression task: targets from a fixed random "teacher" network."""
    rng = np.random.default_rng(seed)

    def mat(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) / np.sqrt(shape[0])).astype(np.float32)

    teacher_w1, teacher_w2 = mat(d_in, hidden), mat(hidden, d_out)  # teacher bias: zero
    x = rng.standard_normal((batch, d_in)).astype(np.float32)
    y = np.asarray(jax.nn.gelu(x @ teacher_w1) @ teacher_w2, np.float32)
    w1, w2 = mat(d_in, hidden), mat(hidden, d_out)
    w = Weights(w1=jnp.asarray(w1), b1=jnp.zeros(hidden, jnp.float32), w2=jnp.asarray(w2))
    return w, x, y


def build_parser() -> argparse.ArgumentParser:
    """The command line: ``--help`` lists every flag with its default."""
    p = argparse.ArgumentParser(
        description=(__doc__ or "").splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--steps", type=int, default=50, help="SGD steps (both runs)")
    p.add_argument("--lr", type=float, default=0.1, help="learning rate")
    p.add_argument("--batch", type=int, default=64, help="global batch, split over the 8 devices")
    p.add_argument("--seed", type=int, default=0, help="seeds the weights and the task")
    return p


def main(argv: list[str] | None = None) -> dict:
    """Train data-parallel and on one device; return both loss curves and the gradient checks."""
    args = build_parser().parse_args(argv)

    w0, x, y = make_problem(args.seed, args.batch)
    mesh = jax.make_mesh((8,), ("d",))
    lr = jnp.float32(args.lr)
    with jax.set_mesh(mesh):
        w = jax.device_put(w0, make_shardings(Weights))  # replicated on all 8 devices
        xs = jax.device_put(x, make_shardings(f32[Array, b"B/d In"]))
        ys = jax.device_put(y, make_shardings(f32[Array, b"B/d Out"]))
        print(f"mesh d={mesh.size}: each device holds all weights and {args.batch // 8} examples")

        ref_loss, ref_grads = jax.jit(jax.value_and_grad(loss_fn))(w0, x, y)
        loss, grads = jax.jit(dp_grads)(w, xs, ys)
        grad_err = max(
            float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
            for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True)
        )
        try:
            jax.jit(summed_by_autodiff).trace(w, xs, ys)
            trap_error = None
        except ValueError as e:  # shardlib refuses to average an already-summed gradient
            trap_error = str(e)
        print(
            f"gradient: max |data-parallel - one device| = {grad_err:.1e}; without pcast "
            f"shardlib refuses the pmean: {(trap_error or 'NOT CAUGHT').split(';')[0]}"
        )

        dp_losses, ref_losses = [], []
        w_ref = w0
        for step in range(args.steps):
            w, value = dp_train_step(w, xs, ys, lr)
            w_ref, ref_value = reference_train_step(w_ref, x, y, lr)
            dp_losses.append(float(value))
            ref_losses.append(float(ref_value))
            if step % 10 == 0 or step == args.steps - 1:
                print(
                    f"step {step + 1:3d}  loss data-parallel {value:.6f}  one device {ref_value:.6f}"
                )
        weight_err = max(
            float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
            for a, b in zip(jax.tree.leaves(w), jax.tree.leaves(w_ref), strict=True)
        )
        replicated = all(a.sharding.is_fully_replicated for a in jax.tree.leaves(w))
        print(f"after {args.steps} steps: max |weights - one device| = {weight_err:.1e}")
    return {
        "loss": float(loss),
        "reference_loss": float(ref_loss),
        "grad_err": grad_err,
        "trap_error": trap_error,
        "dp_losses": dp_losses,
        "reference_losses": ref_losses,
        "weight_err": weight_err,
        "replicated": replicated,
        "devices": mesh.size,
    }


if __name__ == "__main__":
    main()
