"""``typed_shard_map``: ``jax.shard_map`` with in/out specs read from annotations.

`signature` reads a function's annotations once at decoration time (its
`ShardMapSignature`); `call` checks a call's global
arguments, traces and analyses the body (`shardlib._analysis`); `layout` moves an argument
to the layout ``jax.shard_map`` wants where it would refuse it; `refusal` explains JAX's
refusals of a body and names a failed op's operands; `body` is the per-device function with
its result checked; `decorator` is ``typed_shard_map`` itself.

May import: `shardlib._lang`, `shardlib._env`, `shardlib._check`, `shardlib._analysis`,
`shardlib._ops`. `shardlib.shardtypes` is this layer's public face.
"""
