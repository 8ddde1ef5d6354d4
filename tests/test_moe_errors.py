"""``shardlib.moe``: bad arguments raise shardlib messages (function, argument, dim, expected,
actual) before anything is traced past the check."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from shardlib import moe
from tests._mesh_util import make_mesh

M_, F_ = 8, 4


def _run(experts=8, k=2, wi_m=M_, wo_f=F_, axis="e", **kw):
    """``moe.layer`` in a ``jax.shard_map`` over a (4, 2) d x e mesh."""
    mesh = make_mesh((4, 2), ("d", "e"), auto=True)
    local = max(experts // 2, 1)
    x = jnp.ones((16, M_))
    wr = jnp.ones((M_, experts))
    wi = jnp.ones((2 * local, wi_m, F_))
    wo = jnp.ones((2 * local, wo_f, M_))

    def body(x, wr, wi, wo):
        return moe.layer(x, wr, wi, wo, k=k, axis=axis, **kw)[0]

    f = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(P(("d", "e")), P(), P("e"), P("e")),
        out_specs=P(("d", "e")),
    )
    with jax.set_mesh(mesh):
        return f(x, wr, wi, wo)


CASES = [
    (
        dict(experts=5),
        "moe.layer: argument `router_logits` dim -1 (experts) must be divisible by the size "
        "of mesh axis 'e' (2); got 5 experts: use a multiple of 2 experts",
    ),
    (dict(experts=3), "divisible by the size of mesh axis 'e' (2); got 3 experts"),
    (dict(k=9), "moe.layer: argument `k` (experts per token) must be an int in 1..8"),
    (dict(k=0), "must be an int in 1..8 (the experts, dim -1 of the router logits); got 0"),
    (dict(capacity=0), "moe.layer: argument `capacity` (slots per expert per device) must be"),
    (dict(capacity=4, dropless=True), "arguments `capacity` (4) and `dropless=True` disagree"),
    (dict(capacity_factor=0.0), "moe.layer: argument `capacity_factor` must be a number > 0"),
    (dict(axis="x"), "moe.layer: argument `axis` must name a mesh axis that is manual here"),
    (dict(axis="ee"), "which the mesh does not have (mesh axes: d=4, e=2) (did you mean 'e'?)"),
    (dict(hidden_axis="t"), "argument `hidden_axis` must name a mesh axis that is manual"),
    (dict(wi_m=5), "moe.layer: argument `w_in` dim 1 (M) must be 8 (x's last dim); got 5"),
    (dict(wo_f=3), "moe.layer: argument `w_out` dim 1 (F/t) must be 4 (w_in's dim 2); got 3"),
    (dict(gate="relu"), "moe.layer: argument `gate` must be one of 'softmax', 'sigmoid'"),
]


@pytest.mark.parametrize(("kw", "message"), CASES, ids=[str(c[0]) for c in CASES])
def test_bad_layer_arguments(kw, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        _run(**kw)


def test_not_in_a_body():
    with pytest.raises(ValueError, match="no mesh axis is manual here: call moe.layer inside"):
        moe.layer(
            jnp.ones((4, M_)), jnp.ones((M_, 2)), jnp.ones((2, M_, F_)), jnp.ones((2, F_, M_))
        )


def test_router_logits_layout():
    with pytest.raises(ValueError, match=re.escape("(tokens, experts) block, 2 dims; got shape")):
        moe.route(jnp.ones((2, 4, 8)), 2)


@pytest.mark.slow
def test_well_formed_call_runs():
    y = _run()
    assert np.asarray(y).shape == (16, M_)
