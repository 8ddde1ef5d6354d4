"""Pipeline schedules: their arithmetic and argument rules (`plan`, pure Python), the forward
schedules as per-device shardlib code (`schedules`: gpipe, circular), the tick tables of the
schedules that interleave forward and backward work (`tables`, pure Python: 1F1B,
interleaved 1F1B, ZB-H1), the loop that runs such a table (`one_f_one_b`), what may
communicate inside its per-stage branches and what its custom_vjp cannot differentiate
(`branches`), the cotangents it returns (`cotangents`), what each of its forwards keeps for
the backward (`residuals`), the loss-returning entry points (`entry`) and the stacked
weights' two layouts (`layout`: `to_groups`, `from_groups`).

May import: every layer below it (`shardlib._lang` ... `shardlib._shard_map`) and the
``shardops`` face. `shardlib.pipeline` is this layer's public face.
"""
