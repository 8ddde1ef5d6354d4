"""Random typed programs for the differential test of `shardlib.explain`, and an HLO reader.

`random_program(seed)` builds a `typed_shard_map` loss over a random mesh ((8,), (4, 2),
(2, 2, 2)) and dtype (f32, bf16) from random steps on an activation ``h`` [B, M] and a weight
``w`` [M, F] held FSDP-style: all_gather, psum_scatter, psum/pmean, all_to_all,
einsum_unreduced + a reduction, reshard, shift/ppermute; some steps run in a ``lax.scan`` or
``fori_loop``; the program is the loss, its ``jax.grad`` or its ``jax.value_and_grad``.

`report_totals`, `hlo_totals` and `compiled_differences` compare a report with the collectives
the test's own HLO reader (`tests/_explain_hlo_reader.py`, re-exported here) finds.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from shardlib import shardops
from shardlib._env.context import aval_varying
from shardlib.shardtypes import Array, bf16, f32, typed_shard_map
from tests._explain_hlo_reader import (
    HloCollective,
    compiled_text,
    hlo_collectives,
    sent_bytes,
    unoptimised_text,
)

__all__ = [
    "HloCollective",
    "compiled_text",
    "compiled_differences",
    "hlo_collectives",
    "hlo_totals",
    "random_program",
    "report_totals",
    "sent_bytes",
    "unoptimised_text",
]

MESHES = ((8,), (4, 2), (2, 2, 2))
AXES = ("a", "b", "c")
B, M = 16, 16  # global sizes of h's dims (w is [M, M])


@dataclasses.dataclass
class Program:
    """One random program: ``f`` and its arguments, on ``mesh``; ``steps`` says what it does."""

    seed: int
    mesh: jax.sharding.Mesh
    dtype: str
    mode: str  # "loss", "grad" or "value_and_grad"
    steps: list[str]
    f: Callable
    args: tuple


def _spec(b: tuple[str, ...], m: tuple[str, ...], extra: str = "") -> str:
    def dim(name: str, axes: tuple[str, ...]) -> str:
        return name + "".join("/" + a for a in axes)

    return f"{dim('B', b)} {dim('M', m)}{extra}"


class _Builder:
    """Draws steps; each step is a function of (h, w) -> h run inside the shard_map body, and
    tracks h's layout: the mesh axes of its B and M dims."""

    def __init__(self, rng: np.random.Generator, names: tuple[str, ...], sizes: dict[str, int]):
        self.rng, self.names, self.sizes = rng, names, sizes
        self.labels: list[str] = []

    def pick(self, seq):
        return seq[int(self.rng.integers(len(seq)))]

    def steps(self, b, m, n):
        """``n`` random steps from layout (b, m); returns (functions, final layout)."""
        out = []
        for _ in range(n):
            kinds = ["reshard", "einsum", "permute", "psum"]
            if m:
                kinds += ["all_gather"]
            if b:
                kinds += ["all_to_all"]
            fn, b, m = getattr(self, "_" + self.pick(kinds))(b, m)
            out.append(fn)
        return out, b, m

    def _free(self, b, m):
        return [a for a in self.names if a not in b and a not in m]

    def _all_gather(self, b, m):
        k = int(self.rng.integers(1, len(m) + 1))
        spec = f"{_spec(b, m)} -> {_spec(b, m[:-k])}"
        self.labels.append(f"all_gather {spec}")
        return (lambda h, w: shardops.all_gather(spec, h)), b, m[:-k]

    def _all_to_all(self, b, m):
        nb, nm = b[:-1], (*m, b[-1])
        spec = f"{_spec(b, m)} -> {_spec(nb, nm)}"
        self.labels.append(f"all_to_all {spec}")
        return (lambda h, w: shardops.all_to_all(spec, h)), nb, nm

    def _reshard(self, b, m):
        order = list(self.names)
        self.rng.shuffle(order)
        nb, nm = [], []
        for a in order:
            r = int(self.rng.integers(3))
            (nb if r == 0 else nm if r == 1 else []).append(a)
        nb, nm = tuple(nb), tuple(nm)
        if (nb, nm) == (b, m):
            return self._psum(b, m)
        spec = f"{_spec(b, m)} -> {_spec(nb, nm)}"
        self.labels.append(f"reshard {spec}")
        return (lambda h, w: shardops.reshard(spec, h)), nb, nm

    def _permute(self, b, m):
        if not b + m:  # a permute over an axis h is the same on would make it differ
            return self._psum(b, m)
        axis = self.pick(b + m)
        n = self.sizes[axis]
        spec = _spec(b, m)
        if self.rng.random() < 0.5:
            offset, wrap = self.pick([1, -1, 2]) % n or 1, bool(self.rng.random() < 0.5)
            self.labels.append(f"shift {spec} {axis} {offset} wrap={wrap}")
            return (lambda h, w: shardops.shift(spec, h, axis, offset, wrap)), b, m
        perm = list(self.rng.permutation(n))
        pairs = [(i, int(perm[i])) for i in range(n) if self.rng.random() < 0.8]
        if all(s == d for s, d in pairs):
            pairs = [(0, 1), (1, 0)]
        self.labels.append(f"ppermute {spec} {axis} {pairs}")
        return (lambda h, w: shardops.ppermute(spec, h, axis, pairs)), b, m

    def _psum(self, b, m):
        """psum/pmean over a free axis of a value made varying over it (a partial sum)."""
        free = self._free(b, m)
        if not free:
            return self._einsum(b, m)
        axes = tuple(a for a in free if self.rng.random() < 0.7) or (free[0],)
        op = self.pick(["psum", "pmean"])
        spec = _spec(b, m)
        self.labels.append(f"{op} {spec} over {'/'.join(axes)}")

        def fn(h, w):
            return getattr(shardops, op)(spec, _varying(h, axes), axes="/".join(axes))

        return fn, b, m

    def _einsum(self, b, m):
        """h @ w: w gathered (FSDP), sliced to h's M layout, a local einsum, then psum /
        pmean / psum_scatter of the partial sum over M's axes."""
        wspec = "M" + "".join("/" + a for a in m) + " F"
        ein = f"{_spec(b, m)}, {wspec} -> {_spec(b, ()).replace(' M', ' F')}"
        red = self.pick(["psum", "pmean", "psum_scatter"]) if m else None
        out_m = m if red == "psum_scatter" else ()
        self.labels.append(f"einsum {ein} + {red}")
        flat = "/".join(m)

        def fn(h, w):
            wf = shardops.all_gather(f"M F/{self.names[0]} -> M F", w)
            wl = shardops.reshard(f"M F -> {wspec}", wf) if m else wf
            y = shardops.einsum_unreduced(ein, h, wl)
            if red == "psum_scatter":
                return shardops.psum_scatter(f"{_spec(b, ())} -> {_spec(b, m)}", y)
            if red is not None:
                return getattr(shardops, red)(_spec(b, ()), y, axes=flat)
            return y

        return fn, b, out_m


def _vma(x) -> frozenset[str]:
    """The manual axes ``x``'s type says it varies over."""
    return aval_varying(jax.typeof(x)) or frozenset()  # JAX 0.10's manual_axis_type, 0.9's vma


def _typed_varying(x, names):
    """``x`` typed (check_vma) as varying over every axis of ``names``: a loop carry's type."""
    vary = tuple(a for a in names if a not in _vma(x))
    return jax.lax.pcast(x, vary, to="varying") if vary else x


def _varying(x, axes):
    """``x`` made to differ across the devices of ``axes`` (a partial sum over them)."""
    for a in axes:
        x = x * (1 + shardops.axis_index(a)).astype(x.dtype)
    return x


def _run(fns, h, w):
    for fn in fns:
        h = fn(h, w)
    return h


def random_program(seed: int) -> Program:
    """The program of ``seed`` (the same every run)."""
    rng = np.random.default_rng(seed)
    shape = MESHES[seed % len(MESHES)]
    names = AXES[: len(shape)]
    mesh = jax.make_mesh(shape, names, devices=jax.devices()[: math.prod(shape)])
    sizes: dict[str, int] = dict(zip(names, shape, strict=True))
    dtype = "bfloat16" if rng.random() < 0.4 else "float32"
    mode = ["loss", "grad", "value_and_grad"][int(rng.integers(3))]
    bld = _Builder(rng, names, sizes)
    b0 = tuple(a for a in names if rng.random() < 0.5)
    m0 = tuple(a for a in names if a not in b0 and rng.random() < 0.5)
    pre, b, m = bld.steps(b0, m0, int(rng.integers(0, 3)))
    loop = [None, "scan", "fori_loop"][int(rng.integers(3))]
    body, lb, lm = bld.steps(b, m, int(rng.integers(1, 3))) if loop else ([], b, m)
    if loop and (lb, lm) != (b, m):  # the carry keeps its layout
        spec = f"{_spec(lb, lm)} -> {_spec(b, m)}"
        bld.labels.append(f"reshard {spec} (loop carry)")
        body.append(lambda h, w: shardops.reshard(spec, h))
    length = int(rng.integers(2, 4))
    post, b, m = bld.steps(b, m, int(rng.integers(0, 2)))
    bld.labels.insert(len(bld.labels) - len(post), f"{loop} x{length}" if loop else "no loop")
    body_fns = list(body)

    def loss(x, w):
        h = _run(pre, x, w)
        if loop is not None:  # the carry typed as varying over every axis, in and out
            h = _typed_varying(h, names)
            if loop == "scan":
                h, _ = jax.lax.scan(
                    lambda c, _: (_typed_varying(_run(body_fns, c, w), names), None),
                    h,
                    None,
                    length,
                )
            else:
                h = jax.lax.fori_loop(
                    0, length, lambda i, c: _typed_varying(_run(body_fns, c, w), names), h
                )
        h = _run(post, h, w)
        local = _varying((h.astype(jnp.float32) ** 2).sum(), names)
        return shardops.psum("", local, axes="/".join(names))

    t: Any = bf16 if dtype == "bfloat16" else f32
    loss.__annotations__ = {
        "x": t[Array, _spec(b0, m0).encode()],
        "w": t[Array, f"M F/{names[0]}".encode()],
        "return": f32[Array, b""],
    }
    typed = typed_shard_map(loss)
    f = typed
    if mode == "grad":
        f = jax.grad(typed, argnums=(0, 1))
    elif mode == "value_and_grad":
        f = jax.value_and_grad(typed, argnums=(0, 1))
    shard_x = jax.sharding.NamedSharding(mesh, _pspec(b0, m0))
    shard_w = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, names[0]))
    args = (
        jax.ShapeDtypeStruct((B, M), jnp.dtype(dtype), sharding=shard_x),
        jax.ShapeDtypeStruct((M, M), jnp.dtype(dtype), sharding=shard_w),
    )
    return Program(seed, mesh, dtype, mode, bld.labels, f, args)


def _pspec(b, m):
    def one(axes):
        return None if not axes else axes[0] if len(axes) == 1 else tuple(axes)

    return jax.sharding.PartitionSpec(one(b), one(m))


# -- the comparisons ------------------------------------------------------------------------

Totals = dict[tuple[str, tuple[str, ...]], tuple[int, int, int]]


def report_totals(report) -> Totals:
    """``{(kind, axes): (calls, operand bytes, bytes sent)}`` of a report, per call of f."""
    out: dict = {}
    for c in report.collectives:
        key = (c.kind, tuple(sorted(c.axes)))
        n, b, s = out.get(key, (0, 0, 0))
        out[key] = (n + c.calls, b + c.calls * c.operand_bytes, s + c.calls * c.sent_bytes)
    return out


def hlo_totals(found: list[HloCollective]) -> Totals:
    """The same totals of an HLO program's collectives, bytes by this module's own rule."""
    out: dict = {}
    for c in found:
        key = (c.kind, c.axes)
        n, b, s = out.get(key, (0, 0, 0))
        sent = sent_bytes(c.kind, c.operand_bytes, c.group, c.moving)
        out[key] = (n + c.runs, b + c.runs * c.operand_bytes, s + c.runs * sent)
    return out


def compiled_differences(report, found: list[HloCollective]) -> list[str]:
    """What the compiled program runs differently from the report, beyond what the report
    flags: per (kind, axes, operand bytes), the compiled runs must lie between the fewest
    the flagged rows allow (``min_calls``) and the report's calls. A bf16 row counts at twice
    its bytes when the compiled collective runs in f32 (XLA:CPU widens them)."""
    widened = any(c.dtype == "f32" for c in found) and any(
        c.dtype == "bfloat16" for c in report.collectives
    )
    want: dict = {}
    for c in report.collectives:
        scale = 2 if widened and c.dtype == "bfloat16" else 1
        key = (c.kind, tuple(sorted(c.axes)), c.operand_bytes * scale)
        lo, hi = want.get(key, (0, 0))
        want[key] = (lo + (c.calls if c.min_calls is None else c.min_calls), hi + c.calls)
    got: dict = {}
    for c in found:
        key = (c.kind, c.axes, c.operand_bytes)
        got[key] = got.get(key, 0) + c.runs
    return [
        f"{key}: compiled runs {got.get(key, 0)}, report allows {want.get(key, (0, 0))}"
        for key in sorted(set(want) | set(got))
        if not want.get(key, (0, 0))[0] <= got.get(key, 0) <= want.get(key, (0, 0))[1]
    ]
