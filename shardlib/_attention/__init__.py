"""Attention over a sequence split over a mesh axis (context parallelism): the arithmetic of
the layouts (`chunks`) and the rules the arguments keep (`rules`), both pure Python, the block
math of flash-style attention (`blocks`), what the variants share (`common`: the argument
checks, the scale, the settings), the ring and all-gather variants (`ring`), Ulysses and
ring x Ulysses (`ulysses`) and decoding against a split cache (`decode`) as per-device
shardlib code, and the helpers that put a global sequence into the load-balanced layout
(`layout`).

May import: every layer below it (`shardlib._lang` ... `shardlib._pipeline`) and the
``shardops`` face. `shardlib.attention` is this layer's public face.
"""
