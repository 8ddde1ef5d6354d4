"""Sampling the next token from logits whose vocabulary is split over mesh axes, as per-device
shardlib code: the argument rules and the bytes of the one exchange (`rules`, pure Python),
the Gumbel noise of each (key, step, row, vocabulary id) (`noise`) and the sampler itself
(`pick`: greedy, temperature, top-k, top-p). `shardlib.sampling` is this layer's public face.

May import: every layer below it (`shardlib._lang` ... `shardlib._moe`) and the ``shardops``
face; never ``_explain`` or ``_plan``.
"""
