"""Attention over a sequence split over a mesh axis (context parallelism): the arithmetic of
the layouts and the rules the arguments keep (`plan`, pure Python), the block math of
flash-style attention (`blocks`), the ring and all-gather variants as per-device shardlib
code (`ring`), and the helpers that put a global sequence into the load-balanced layout
(`layout`).

May import: every layer below it (`shardlib._lang` ... `shardlib._pipeline`) and the
``shardops`` face. `shardlib.attention` is this layer's public face.
"""
