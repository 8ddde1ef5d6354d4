"""Pipeline schedules. Each schedule is one `Schedule` object in `registry` (its name, scope,
route, B/W split, layer groups, microbatch rule; pure Python), which every other module asks
instead of testing names. Pure Python, no JAX: `arithmetic` (bubble fractions, `timeline`,
`work_items`), `arguments` (the rules a schedule's arguments keep and their messages),
`placement` (the tick of every forward, backward and weight half, on the ring or the V),
`tables` (the tick tables of 1F1B, interleaved 1F1B, ZB-H1 and ZB-V: ring slots and the
lockstep cost), `cost` (`critical_path`), `scopes` (the named scope each schedule runs under,
which `shardlib.explain` reads). JAX: `stage` (what every schedule's loop does with its stage:
argument checks, carry axes, layer groups), `schedules` (gpipe, circular as per-device
shardlib code), `table_loop` (the loop that runs a table schedule) one tick at a time
(`tick`), the zero-bubble schedules' backward cut into an input half and a weight half
(`split`), what may communicate inside the per-stage branches and what the custom_vjp cannot
differentiate (`branches`), the cotangents it returns (`cotangents`), what each forward keeps
for the backward (`residuals`), the warning of an unsplit backward (`unsplit`), the
loss-returning entry points (`entry`) and the stacked weights' layouts (`layout`:
`to_groups`, `from_groups`, the ring's groups and the V's).

May import: every layer below it (`shardlib._lang` ... `shardlib._shard_map`) and the
``shardops`` face. `shardlib.pipeline` is this layer's public face.
"""
