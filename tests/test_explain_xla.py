"""explain reports what runs (issue 29): dead code gone, XLA's hoisting and merging flagged and
reconciled by `compare_hlo`, one byte convention for every permute, bf16 widened on XLA:CPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import shardlib
from jax_extra import explicit_activation_checkpointing
from shardlib import shardops
from shardlib._env import programs
from shardlib._explain.report import DUPLICATE, LOOP_INVARIANT, RECOMPUTED
from shardlib.shardtypes import Array, bf16, f32, pytree_dataclass, typed_shard_map
from tests import _explain_random as R


def _runs(text, mesh, kind):
    """Times the HLO ``text`` runs collectives of ``kind`` (the test's own HLO reader)."""
    return sum(c.runs for c in R.hlo_collectives(text, mesh) if c.kind == kind)


@typed_shard_map
def _loss(x: f32[Array, b"B/d M"], w: f32[Array, b"M F/d"]) -> f32[Array, b""]:
    wf = shardops.all_gather("M F/d -> M F", w)
    y = shardops.einsum_unreduced("B/d M, M F -> B/d F", x, wf)
    return shardops.psum("", (y**2).sum(), axes="d")


def test_the_forward_psum_a_grad_drops_is_not_reported():
    mesh = jax.make_mesh((8,), ("d",))
    x, w = jnp.ones((16, 8)), jnp.ones((8, 16))
    grad = jax.grad(_loss, argnums=1)
    with jax.set_mesh(mesh):
        report = shardlib.explain(grad, x, w)
        lowered = jax.jit(grad).lower(x, w)
        value = shardlib.explain(jax.value_and_grad(_loss, argnums=1), x, w)
    assert [c.kind for c in report.collectives] == ["all-gather", "reduce-scatter"]
    assert _runs(R.unoptimised_text(lowered), mesh, "all-reduce") == 0
    for text in (R.unoptimised_text(lowered), R.compiled_text(lowered)):
        assert report.compare_hlo(text).identical, str(report.compare_hlo(text))
    # value_and_grad uses the loss: its psum runs and is reported.
    assert "all-reduce" in [c.kind for c in value.collectives]


def test_a_loop_invariant_gather_is_flagged_and_reconciled():
    mesh = jax.make_mesh((8,), ("d",))

    @typed_shard_map
    def f(x: f32[Array, b"B/d M"], w: f32[Array, b"M F/d"]) -> f32[Array, b"B/d F"]:
        def body(h, _):
            wf = shardops.all_gather("M F/d -> M F", w)  # the same block at every iteration
            return shardops.einsum_unreduced("B/d M, M F -> B/d F", h, wf), None

        return jax.lax.scan(body, x, None, length=3)[0]

    x, w = jnp.ones((16, 8)), jnp.ones((8, 8))
    with jax.set_mesh(mesh):
        report = shardlib.explain(f, x, w)
        lowered = jax.jit(f).lower(x, w)
    (row,) = report.collectives
    assert (row.calls, row.min_calls, row.xla_may) == (3, 1, LOOP_INVARIANT)
    assert "row 0: loop-invariant: XLA may run it once" in report.render()
    assert _runs(R.unoptimised_text(lowered), mesh, "all-gather") == 3  # as JAX emits it
    compiled = R.compiled_text(lowered)
    assert _runs(compiled, mesh, "all-gather") == 1  # hoisted out of the loop by XLA
    assert report.compare_hlo(compiled).identical


def test_a_gather_of_the_carry_is_not_loop_invariant():
    mesh = jax.make_mesh((8,), ("d",))

    @typed_shard_map
    def f(x: f32[Array, b"B M/d"]) -> f32[Array, b"B M/d"]:
        def body(h, _):
            g = shardops.all_gather("B M/d -> B M", h)
            return shardops.reshard("B M -> B M/d", g * 2), None

        return jax.lax.scan(body, x, None, length=3)[0]

    with jax.set_mesh(mesh):
        report = shardlib.explain(f, jnp.ones((8, 16)))
    assert [(c.calls, c.min_calls, c.xla_may) for c in report.collectives] == [(3, 3, None)]


def _keep_first(text, kind, n, shape=""):
    """``text`` with the collectives of ``kind`` of each result shape (those whose shape starts
    with ``shape``) after the first ``n`` deleted; ``n=1``: the HLO of an XLA that merges
    repeated collectives (the dangling uses of the deleted ones are never read)."""
    seen: dict[str, int] = {}
    lines = []
    for line in text.splitlines():
        if f" {kind}(" in line:
            result = line.split("=", 1)[1].split()[0]
            seen[result] = seen.get(result, 0) + 1
            if result.startswith(shape) and seen[result] > n:
                continue
        lines.append(line)
    return "\n".join(lines)


@pytest.mark.parametrize("remat", [True, False])
def test_recomputed_gathers_merged_by_xla_are_reconciled(remat):
    """The guide's FSDP step: under grad the checkpointed block gathers each weight again;
    XLA may run the forward and the re-computed gather once (XLA:CPU of JAX 0.10 does; that
    of JAX 0.12 keeps all four), and the report must match the compiled HLO either way."""
    mesh = jax.make_mesh((8,), ("d",))

    @pytree_dataclass
    class W:
        w1: f32[Array, b"in hidden/d"]
        w2: f32[Array, b"hidden out/d"]

    @typed_shard_map
    def loss(x: f32[Array, b"batch/d in"], w: W) -> f32[Array, b""]:
        def block(x, w):
            w1 = shardops.all_gather("in hidden/d -> in hidden", w.w1)
            h = jax.nn.relu(
                shardops.einsum_unreduced("batch/d in, in hidden -> batch/d hidden", x, w1)
            )
            w2 = shardops.all_gather("hidden out/d -> hidden out", w.w2)
            return shardops.einsum_unreduced("batch/d hidden, hidden out -> batch/d out", h, w2)

        block = explicit_activation_checkpointing(block) if remat else block
        return shardops.psum("", (block(x, w) ** 2).sum(), axes="d")

    step = jax.grad(loss, argnums=1)
    w, x = W(jnp.ones((16, 32)), jnp.ones((32, 8))), jnp.ones((64, 16))
    with jax.set_mesh(mesh):
        report = shardlib.explain(step, x, w)
        lowered = jax.jit(step).lower(x, w)
    compiled = R.compiled_text(lowered)
    gathers = [c for c in report.collectives if c.kind == "all-gather"]
    assert len(gathers) == (4 if remat else 2)
    assert [c.xla_may for c in gathers if c.recomputed] == [RECOMPUTED] * (2 if remat else 0)
    assert "all-reduce" not in {c.kind for c in report.collectives}  # the dead forward psum
    # The report: each gather runs once, and XLA may merge each re-computed one away.
    calls = sum(c.calls for c in gathers)
    fewest = sum(c.calls if c.min_calls is None else c.min_calls for c in gathers)
    assert (calls, fewest) == ((4, 2) if remat else (2, 2))
    assert _runs(R.unoptimised_text(lowered), mesh, "all-gather") == calls  # as JAX emits it
    # The compiled HLO (the test's own reader) runs between the fewest and all of them, and
    # compare_hlo accounts for exactly the gathers XLA merged away: one merged row each.
    ran = _runs(compiled, mesh, "all-gather")
    assert fewest <= ran <= calls
    cmp = report.compare_hlo(compiled)
    assert cmp.identical, str(cmp)
    assert len(cmp.merged) == calls - ran
    assert all(c.recomputed and c.xla_may == RECOMPUTED for c in cmp.merged)
    assert ("merged by XLA" in str(cmp)) == (ran < calls)
    # Whatever this XLA did, the program with every repeated gather merged is reconciled too,
    # and one with a gather gone that nothing repeats is not.
    merged = report.compare_hlo(_keep_first(compiled, "all-gather", 1))
    assert merged.identical and len(merged.merged) == calls - fewest, str(merged)
    lost = report.compare_hlo(_keep_first(compiled, "all-gather", 0, shape="f32[32,8]"))  # w2's
    assert not lost.identical and len(lost.only_in_report) == (2 if remat else 1), str(lost)


def test_a_repeated_gather_of_the_same_value_is_flagged():
    mesh = jax.make_mesh((8,), ("d",))

    @typed_shard_map
    def f(x: f32[Array, b"B/d M"], w: f32[Array, b"M F/d"]) -> f32[Array, b"B/d F"]:
        a = shardops.einsum_unreduced(
            "B/d M, M F -> B/d F", x, shardops.all_gather("M F/d -> M F", w)
        )
        b = shardops.einsum_unreduced(
            "B/d M, M F -> B/d F", x, shardops.all_gather("M F/d -> M F", w)
        )
        return a + b

    x, w = jnp.ones((16, 8)), jnp.ones((8, 8))
    with jax.set_mesh(mesh):
        report = shardlib.explain(f, x, w)
        compiled = R.compiled_text(jax.jit(f).lower(x, w))
    assert [c.xla_may for c in report.collectives] == [None, DUPLICATE]
    assert _runs(compiled, mesh, "all-gather") == 1
    assert report.compare_hlo(compiled).identical


@pytest.mark.parametrize(
    "perm, sent",
    [
        ([(0, 0), (1, 2), (2, 1)], 64),  # fixed points: the busiest device sends its block
        ([(0, 1)], 64),  # a partial permutation: one device sends, one receives
        ([(0, 1), (1, 2), (2, 3), (3, 0)], 64),
    ],
)
def test_permute_bytes_are_the_busiest_devices(perm, sent):
    mesh = jax.make_mesh((4, 2), ("p", "t"))

    @typed_shard_map
    def f(x: f32[Array, b"B/p M"]) -> f32[Array, b"B/p M"]:
        return shardops.ppermute("B/p M", x, "p", perm)

    x = jnp.ones((16, 4))  # block [4, 4] float32: 64 B
    with jax.set_mesh(mesh):
        report = shardlib.explain(f, x)
        text = R.unoptimised_text(jax.jit(f).lower(x))
    (row,) = report.collectives
    assert (row.operand_bytes, row.sent_bytes, row.received_bytes) == (64, sent, sent)
    (hlo,) = R.hlo_collectives(text, mesh)
    assert R.sent_bytes(hlo.kind, hlo.operand_bytes, hlo.group, hlo.moving) == sent


def test_fractional_bytes_are_rounded_up_not_truncated():
    mesh = jax.make_mesh((8,), ("d",))

    @typed_shard_map
    def f(x: bf16[Array, b"B/d"]) -> bf16[Array, b""]:
        return shardops.psum("", x.sum(), axes="d")

    with jax.set_mesh(mesh):
        (row,) = shardlib.explain(f, jnp.ones((8,), jnp.bfloat16)).collectives
    assert (row.operand_bytes, row.sent_bytes) == (2, 4)  # 2 * 2 B * 7/8 = 3.5 B -> 4 B


def test_compare_hlo_says_when_xla_cpu_widens_bf16():
    mesh = jax.make_mesh((8,), ("d",))

    @typed_shard_map(check_vma=False)  # JAX types an all_gather result as still varying
    def f(w: bf16[Array, b"M F/d"]) -> bf16[Array, b"M F"]:
        return shardops.all_gather("M F/d -> M F", w)

    w = jnp.ones((8, 16), jnp.bfloat16)
    with jax.set_mesh(mesh):
        report = shardlib.explain(f, w)
        lowered = jax.jit(f).lower(w)
    before = report.compare_hlo(R.unoptimised_text(lowered))
    assert before.identical and not before.widened  # JAX emits bf16
    after = report.compare_hlo(R.compiled_text(lowered))
    (hlo,) = R.hlo_collectives(R.compiled_text(lowered), mesh)
    if hlo.dtype == "f32":  # XLA:CPU
        assert after.identical and after.widened == report.collectives
        assert "XLA:CPU compiles them as f32" in str(after)
    else:  # pragma: no cover - a backend that keeps bf16
        assert after.identical and not after.widened


@pytest.mark.parametrize("loop", ["scan", "while", "while read by the condition", "while fed back"])
def test_a_loop_carry_nothing_uses_is_dead(loop):
    """A carry of a loop that no output needs (here a gathered copy of the activations) is
    dropped by JAX, its gather with it; the report follows the carries to a fixed point. JAX
    0.10 keeps a live while loop's body whole (JAX 0.12 prunes it as it prunes a scan's), and
    the report does what this JAX does. A carry the condition reads, or one the body feeds
    back into a used carry, is live on every version."""
    mesh = jax.make_mesh((8,), ("d",))

    @typed_shard_map(check_vma=False)
    def f(x: f32[Array, b"B/d M"]) -> f32[Array, b"B/d M"]:
        def step(h, g):
            back = g[: h.shape[0]] if loop == "while fed back" else 0.0
            return h * 2 + back, g + shardops.all_gather("B/d M -> B M", h)

        def more(c):
            reads = c[2].sum() < 1e9 if loop == "while read by the condition" else True
            return (c[0] < 3) & reads

        g0 = jnp.zeros((x.shape[0] * 8, x.shape[1]), x.dtype)
        if loop == "scan":
            (h, _), _ = jax.lax.scan(lambda c, _: (step(*c), None), (x, g0), None, length=3)
        else:
            _, h, _ = jax.lax.while_loop(more, lambda c: (c[0] + 1, *step(c[1], c[2])), (0, x, g0))
        return h

    x = jnp.ones((16, 4))
    with jax.set_mesh(mesh):
        report = shardlib.explain(f, x)
        text = R.unoptimised_text(jax.jit(f).lower(x))
    kinds = [c.kind for c in R.hlo_collectives(text, mesh)]
    dead = loop == "scan" or (loop == "while" and programs.prunes_dead_while_carries())
    assert [c.kind for c in report.collectives] == kinds == ([] if dead else ["all-gather"])


def test_a_jitted_helper_called_twice_is_not_a_duplicate():
    """JAX traces a jitted helper once and calls the same body twice: its gathers of two
    different values are not the same collective."""
    mesh = jax.make_mesh((8,), ("d",))

    @jax.jit
    def helper(h):
        return shardops.all_gather("B/d M -> B M", h * 2)

    @typed_shard_map(check_vma=False)
    def f(x: f32[Array, b"B/d M"]) -> f32[Array, b"B M"]:
        return helper(x) + helper(x + 1)

    x = jnp.ones((16, 4))
    with jax.set_mesh(mesh):
        report = shardlib.explain(f, x)
        compiled = R.compiled_text(jax.jit(f).lower(x))
    assert [c.xla_may for c in report.collectives] == [None, None]
    assert _runs(compiled, mesh, "all-gather") == 2
