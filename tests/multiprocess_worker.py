"""One process of the multi-process test (see test_multiprocess.py); not a test module.

Usage: python tests/multiprocess_worker.py PROCESS_ID NUM_PROCESSES PORT OUT_JSON
Each process has 4 simulated CPU devices (XLA_FLAGS set by the parent); together they form
one (4, 2) mesh. Inputs are built with jax.make_array_from_process_local_data.
"""

import jax
import numpy as np
import typeguard

import shardlib
from examples import transformer_model as tm
from shardlib import shardtypes
from shardlib.shardtypes import make_shardings
from tests._multiprocess_util import worker_main

CONFIG = tm.Config(
    vocab=64, d_model=32, n_heads=4, n_kv_heads=2, d_head=8, d_ff=64, n_layers=2, seq_len=16
)
BATCH = 8
STEPS = 2
LR = 0.5


def global_tokens() -> np.ndarray:
    return np.random.default_rng(0).integers(0, CONFIG.vocab, (BATCH, CONFIG.seq_len), np.int32)


def local_rows(sharding, global_shape) -> slice:
    """The rows of the batch dim that this process's devices hold."""
    idx = sharding.addressable_devices_indices_map(global_shape).values()
    starts = [i[0].start or 0 for i in idx]
    stops = [i[0].stop if i[0].stop is not None else global_shape[0] for i in idx]
    return slice(min(starts), max(stops))


def _work() -> dict:
    shardtypes.register_with_typeguard()
    mesh = jax.make_mesh((4, 2), ("d", "t"))
    with jax.set_mesh(mesh), shardlib.axis_rules(tm.rules_for(mesh)):  # the model names roles
        host_model = jax.device_get(tm.init_model(CONFIG, jax.random.key(0)))
        shardings = make_shardings(tm.Model)  # a mesh spanning both processes
        model = jax.tree.map(
            lambda x, s: jax.make_array_from_callback(x.shape, s, lambda i, x=x: x[i]),
            host_model,
            shardings,
        )
        tokens_sharding = make_shardings(shardtypes.i32[b"B/d L"])
        tokens = global_tokens()
        local = tokens[local_rows(tokens_sharding, tokens.shape)]
        tokens = jax.make_array_from_process_local_data(tokens_sharding, local, tokens.shape)

        # Sharding checks on arrays that are not fully addressable.
        @typeguard.typechecked
        def check_layout(m: tm.Model, t: shardtypes.i32[b"B/d L"]) -> None:
            pass

        check_layout(model, tokens)
        wrong = None
        try:
            check_layout(model, jax.device_put(tokens, make_shardings(shardtypes.i32[b"B L/d"])))
        except typeguard.TypeCheckError as e:
            wrong = str(e)

        losses = []
        for _ in range(STEPS):
            model, loss = tm.train_step(CONFIG, model, tokens, LR)
            losses.append(float(loss))
    return {
        "fully_addressable": bool(tokens.is_fully_addressable),
        "losses": losses,
        "wrong_layout_error": wrong,
    }


if __name__ == "__main__":
    worker_main(_work)
