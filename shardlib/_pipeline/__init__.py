"""Pipeline schedules: their arithmetic and argument rules (`plan`, pure Python) and the
schedules themselves as per-device shardlib code (`schedules`).

May import: every layer below it (`shardlib._lang` ... `shardlib._shard_map`) and the
``shardops`` face. `shardlib.pipeline` is this layer's public face.
"""
