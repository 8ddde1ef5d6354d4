"""Mixture of experts with expert parallelism, as per-device code.

Call `layer` **inside** a ``typed_shard_map`` body whose expert weights are split over an
expert axis ``e``: ``w_in`` ``f32['E/e M F']`` and ``w_out`` ``f32['E/e F M']`` (or ``F/t``
with ``hidden_axis='t'``), the router ``w_router`` ``f32['M E']``, and tokens ``x`` this
device's block (``f32['B/d/e L M']`` usually: the batch split over the expert axis too, so
that every device routes different tokens).

- `route`: top-k gates (softmax or sigmoid, optionally renormalised to sum to 1), the expert
  ids, the Switch/GShard load-balancing loss ``E * sum_e f_e * P_e`` and the router z-loss
  ``mean(logsumexp(logits) ** 2)``; over this device's tokens, or over every token of the
  mesh ``axes`` named.
- `layer` (the default path, capacity-based): each device gives every expert ``C`` slots,
  ``C = ceil(capacity_factor * T * k / E)`` for its ``T`` tokens (or ``capacity=``); slots are
  filled by the rule of `assign` (all first choices in token order, then all second choices,
  ...), and a (token, choice) pair that finds its expert full is dropped (counted in
  ``Stats.dropped``; a token whose every choice dropped comes back as zeros: add the
  residual). One `shardops.all_to_all` ``'E C/e M -> E/e C M'`` sends the slots to the
  experts' devices, one batched matmul each way runs the ``E/e`` local experts, and the
  reverse all-to-all ``'E/e C M -> E C/e M'`` brings the outputs home, summed with the gates.
  Shapes are static; each all-to-all moves ``all_to_all_bytes(E, C, M, itemsize, e)`` per
  device, and the backward pass runs the two reverse all-to-alls.
- Dropless: ``dropless=True`` sets ``C = T`` (`dropless_capacity`): a token picks ``k``
  distinct experts, so no expert gets more than ``T`` pairs from one device, and nothing is
  dropped, at ``E / (k * capacity_factor)`` times the bytes and FLOPs of the capacity path.
  Accelerators avoid the padding with ``jax.lax.ragged_all_to_all``, which XLA:CPU does not
  implement; shardlib does not offer that path.

Example::

    @typed_shard_map
    def ffn(x: f32[b'B/d/e L M'], wr: f32[b'M E'], w_in: f32[b'E/e M F'],
            w_out: f32[b'E/e F M']) -> f32[b'B/d/e L M']:
        y, stats = moe.layer(x, wr, w_in, w_out, k=2, axis='e')
        return y
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from ._env import rules as _rules
from ._moe import dispatch as _d
from ._moe import plan as _plan
from ._moe import router as _r
from ._moe.dispatch import Slots, Stats
from ._moe.plan import all_to_all_bytes, capacity, dropless_capacity
from ._moe.router import Routing

__all__ = [
    "Routing",
    "Slots",
    "Stats",
    "all_to_all_bytes",
    "assign",
    "capacity",
    "combine",
    "dispatch",
    "dropless_capacity",
    "expert_ffn",
    "layer",
    "route",
]


def route(
    router_logits: jax.Array,
    k: int,
    *,
    gate: str = "softmax",
    renormalize: bool = True,
    axes: str | tuple[str, ...] = (),
) -> Routing:
    """Top-k routing of this device's tokens.

    **Arguments:**

    - `router_logits`: ``(T, E)``, this device's tokens by every expert.
    - `k`: experts per token, ``1 <= k <= E``.
    - `gate`: ``'softmax'`` (over the experts) or ``'sigmoid'`` (each expert on its own).
    - `renormalize`: scale each token's ``k`` gates to sum to 1.
    - `axes`: manual mesh axes the tokens are split over; the losses' statistics (the
      fraction of pairs per expert ``f_e``, the mean probability ``P_e``, the z-loss) are
      then means over every token of those axes (`shardops.pmean`), as on one device.

    **Returns:** a `Routing`: ``gates`` ``(T, k)``, ``experts`` ``(T, k)`` int32, ``probs``,
    ``aux_loss`` ``E * sum_e f_e * P_e`` (1 when balanced) and ``z_loss``.

    Examples:
        >>> r = moe.route(x @ w_router, 2, axes=('d', 'e'))
    """
    return _r.route(router_logits, k, gate=gate, renormalize=renormalize, axes=axes)


def assign(experts: jax.Array, num_experts: int, cap: int) -> Slots:
    """The drop rule: each (token, choice) pair's slot in its expert's ``cap`` rows.

    Slots are filled in priority order: every token's first choice in token order, then every
    token's second choice, and so on (GShard's rule: a token's best expert comes first). A
    pair finding its expert's ``cap`` slots full is dropped (``keep`` False, ``slot``
    ``num_experts * cap``).

    **Raises:** ``ValueError`` when ``num_experts`` or ``cap`` is not an int ``>= 1`` (NumPy
    ints are fine, bools and floats are not).

    Examples:
        >>> slots = moe.assign(routing.experts, 8, 4)
    """
    num_experts, cap = _counts("assign", num_experts, cap)
    return _d.assign(experts, num_experts, cap)


def dispatch(x: jax.Array, slots: Slots, num_experts: int, cap: int, axis: str = "e") -> jax.Array:
    """This device's tokens ``(T, M)`` into the slots of its experts: ``(E/e, e * C, M)``.

    One `shardops.all_to_all` ``'E C/e M -> E/e C M'`` over mesh ``axis``: expert ``j``'s
    ``C`` rows go to the device holding expert ``j``, which receives ``C`` rows per expert
    from each of the ``e`` devices.

    **Raises:** ``ValueError`` when ``num_experts`` or ``cap`` is not an int ``>= 1``.

    Examples:
        >>> buf = moe.dispatch(tokens, slots, 8, 4, axis='e')
    """
    num_experts, cap = _counts("dispatch", num_experts, cap)
    return _d.dispatch(x, slots, num_experts, cap, _axis("dispatch", axis))


def combine(y: jax.Array, slots: Slots, gates: jax.Array, axis: str = "e") -> jax.Array:
    """The experts' outputs ``(E/e, e * C, M)`` back home as tokens ``(T, M)``.

    The reverse all-to-all ``'E/e C M -> E C/e M'``, then each token's kept choices summed
    with their gates (a token with every choice dropped gets zeros).

    Examples:
        >>> out = moe.combine(y, slots, routing.gates, axis='e')
    """
    return _d.combine(y, slots, gates, _axis("combine", axis))


def expert_ffn(
    buf: jax.Array,
    w_in: jax.Array,
    w_out: jax.Array,
    axis: str = "e",
    hidden_axis: str | None = None,
    activation: Callable[[jax.Array], jax.Array] = _d.GELU,
) -> jax.Array:
    """The local experts' FFN on their slots: ``activation(buf @ w_in) @ w_out`` per expert,
    ``activation`` ``jax.nn.gelu`` by default (JAX's default form, ``approximate=True``).

    ``buf`` ``(E/e, C, M)``, ``w_in`` ``f32['E/e M F']``, ``w_out`` ``f32['E/e F M']``, as
    two batched `shardops.einsum`s; with ``hidden_axis='t'`` the weights are ``F/t`` and the
    second einsum all-reduces over ``t``.

    Examples:
        >>> y = moe.expert_ffn(buf, w_in, w_out, axis='e', hidden_axis='t')
    """
    hidden = _hidden("expert_ffn", hidden_axis)
    return _d.expert_ffn(buf, w_in, w_out, _axis("expert_ffn", axis), hidden, activation)


def layer(
    x: jax.Array,
    w_router: jax.Array,
    w_in: jax.Array,
    w_out: jax.Array,
    *,
    k: int = 2,
    axis: str = "e",
    hidden_axis: str | None = None,
    capacity_factor: float = 1.25,
    capacity: int | None = None,
    dropless: bool = False,
    gate: str = "softmax",
    renormalize: bool = True,
    stats_axes: str | tuple[str, ...] = (),
    activation: Callable[[jax.Array], jax.Array] = _d.GELU,
) -> tuple[jax.Array, Stats]:
    """A mixture-of-experts FFN on this device's tokens, experts split over ``axis``.

    `route`, `assign`, `dispatch`, `expert_ffn`, `combine`, under the named scope
    ``shardlib.moe.layer[E=.. k=.. C=.. axis=..]``.

    **Arguments:**

    - `x`: this device's tokens ``(..., M)`` (any leading dims; flattened to ``T`` tokens).
    - `w_router`: ``f32['M E']``, replicated. `w_in`, `w_out`: ``f32['E/e M F']`` and
      ``f32['E/e F M']`` (``F/t`` with `hidden_axis`).
    - `k`: experts per token. `axis`: the expert mesh axis, manual here.
    - `capacity_factor`, `capacity`: slots per expert per device, ``capacity`` if given,
      else ``ceil(capacity_factor * T * k / E)`` (at least 1), computed exactly with the
      factor as written (`capacity`). `dropless`: ``C = T`` (nothing dropped).
    - `gate`, `renormalize`, `stats_axes`: as `route`'s ``gate``, ``renormalize``, ``axes``
      (an axis the tokens are replicated on, ``x`` ``'B/d L M'`` with ``('d', 'e')``, adds
      nothing: the statistics are the same on each of its devices).
    - `activation`: the experts' nonlinearity, ``jax.nn.gelu`` by default (JAX's default,
      the tanh approximation ``approximate=True``); any ``jax.Array -> jax.Array`` function,
      e.g. ``jax.nn.relu`` or ``functools.partial(jax.nn.gelu, approximate=False)``.

    Tokens replicated over ``axis`` (``x`` ``'B/d L M'``) work, as ``e`` copies of the same
    routing: every device of ``e`` sends the same tokens, and with ``check_vma`` on the
    output is averaged over ``axis`` (one more all-reduce) so that it is typed replicated
    like ``x``. Split the tokens over ``axis`` too (``'B/d/e L M'``) to spread the work.

    **Returns:** ``(y, stats)``: ``y`` shaped like ``x``; `Stats` (``aux_loss``, ``z_loss``,
    ``dropped`` pairs on this device, ``load`` pairs per expert on this device,
    ``capacity``).

    **Raises:** ``ValueError`` naming the argument, dim, expected and actual value: an axis
    that is not manual, experts not divisible by the axis size, ``k`` outside ``1..E``, a
    capacity below 1, a ``capacity_factor`` not a finite number > 0, weights whose dims
    disagree. Counts (``k``, ``capacity``) may be Python or NumPy ints, not bools or floats.

    Examples:
        >>> y, stats = moe.layer(x, w_router, w_in, w_out, k=2, axis='e')
    """
    return _d.layer(
        x,
        w_router,
        w_in,
        w_out,
        k=k,
        axis=_axis("layer", axis),
        hidden_axis=_hidden("layer", hidden_axis),
        capacity_factor=capacity_factor,
        capacity=capacity,
        dropless=dropless,
        gate=gate,
        renormalize=renormalize,
        stats_axes=stats_axes,
        activation=activation,
    )


def _counts(fn: str, num_experts: Any, cap: Any) -> tuple[int, int]:
    """``num_experts`` and ``cap`` as Python ints (NumPy ints too), or a shardlib error."""
    experts = _plan.as_int(f"moe.{fn}", "num_experts", num_experts, "number of experts")
    return experts, _plan.as_int(f"moe.{fn}", "cap", cap, "slots per expert per device")


def _axis(fn: str, axis: Any) -> Any:
    """The expert axis (a mesh axis or a role) as one mesh axis."""
    return _rules.one_axis(f"moe.{fn}", "axis", axis)


def _hidden(fn: str, axis: Any) -> Any:
    """The hidden axis (a mesh axis or a role; None when its role is replicated)."""
    if axis is None:
        return None
    out = _rules.axes(axis, f"moe.{fn}: argument `hidden_axis`")
    return None if out == () else _rules.one_axis(f"moe.{fn}", "hidden_axis", axis)
