"""The ``shardops`` ops: their plans (pure Python) and what they emit (JAX).

Plans, cached per spec, no JAX: `plan` (the base), `collective_plans`, `local_plans`,
`permute_plans`, `einsum_plan` (the reducing einsum), `overlap_plan` (the collective matmul:
``einsum(..., overlap=)``), `reshard_plan`, `rearrange_plan`, `reduce_repeat_plan`. At trace
time: `run` (the op skeleton: check inputs, emit, leave notes, check the output), `emit` (the
JAX call of each op), `overlap_run` (the ring steps of an overlapped einsum), `reshard_run` and
`rearrange_run` (layout changes as a sequence of ops).
A new collective's plan goes in a ``*_plan`` module, its emission in `emit`.

May import: `shardlib._lang`, `shardlib._env`, `shardlib._check`, `shardlib._analysis`
(its notes). `shardlib.shardops` is this layer's public face.
"""
