"""Mixture of experts (expert parallelism) as per-device shardlib code.

``capacity`` holds the capacity arithmetic, the bytes of the two all-to-alls and the
argument rules in pure Python (no JAX); ``router`` the top-k router and its auxiliary losses;
``dispatch`` the capacity-based dispatch, the expert FFN, the combine and the whole layer,
written with `shardlib.shardops`. `shardlib.moe` is this layer's public face (re-exports).

May import ``_lang``, ``_env``, ``_check``, ``_ops`` (and its ``shardops`` face) and the layers
up to ``_attention``; never ``_explain``.
"""
