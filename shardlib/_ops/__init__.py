"""The ``shardops`` ops: their recipes (pure Python) and what they emit (JAX).

Recipes (what a call does, worked out once per spec; the word "plan" is `shardlib.plan`'s),
cached per spec, no JAX: `recipe` (the base), `collective_recipes`, `local_recipes`,
`permute_recipes`, `reduced_einsum_recipe` (the reducing einsum), `overlap_recipe` (the
collective matmul: ``einsum(..., overlap=)``), `reshard_recipe`, `rearrange_recipe`,
`reduce_repeat_recipe`. At trace time: `run` (the op skeleton: check inputs, emit, leave notes, check the output), `emit` (the
JAX call of each op), `overlap_run` (the ring steps of an overlapped einsum), `reshard_run` and
`rearrange_run` (layout changes as a sequence of ops).
A new collective's recipe goes in a ``*_recipe(s)`` module, its emission in `emit`.

May import: `shardlib._lang`, `shardlib._env`, `shardlib._check`, `shardlib._analysis`
(its notes). `shardlib.shardops` is this layer's public face.
"""
