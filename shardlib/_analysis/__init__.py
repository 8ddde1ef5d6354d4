"""The partial-sum analysis: values that still owe a reduction, followed through a traced body.

Ops leave identity *notes* in the traced program (`notes`); after a ``typed_shard_map`` body
is traced, `walk` follows every noted value through its jaxpr with the facts of `facts` and
the per-primitive rules of `rules`, `rules_select` and `rules_permute` (and the list of
primitives known not to be linear, `nonlinear`), and refuses a partial sum that reaches
a non-linear use, an output, or control flow that differs across its devices.

May import: `shardlib._lang`, `shardlib._env`.
"""
