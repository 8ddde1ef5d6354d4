"""Pipeline schedules: their arithmetic and argument rules (`plan`, pure Python), the forward
schedules as per-device shardlib code (`schedules`: gpipe, circular), the schedules that
interleave forward and backward work (1F1B, interleaved 1F1B, ZB-H1, ZB-V) as pure-Python
tables of fused ticks (`placement`: the tick of every piece of work, on the ring or the V;
`tables`: ring slots and the lockstep cost; `cost`: `critical_path`; `scopes`: the named
scope each schedule runs under, which `shardlib.explain` reads), the loop that runs
such a table (`one_f_one_b`) one tick at a time (`tick`), the zero-bubble schedules'
backward cut into an input half and a weight half (`split`), what may communicate inside
the per-stage branches and what the custom_vjp cannot differentiate (`branches`), the
cotangents it returns (`cotangents`), what each forward keeps for the backward
(`residuals`), the loss-returning entry points (`entry`) and the stacked weights' layouts
(`layout`: `to_groups`, `from_groups`, the ring's groups and the V's).

May import: every layer below it (`shardlib._lang` ... `shardlib._shard_map`) and the
``shardops`` face. `shardlib.pipeline` is this layer's public face.
"""
