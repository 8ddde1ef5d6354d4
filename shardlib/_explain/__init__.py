"""``shardlib.explain``: what a program communicates and keeps, read from its trace.

`walk` fills a report from a traced program (the equations `liveness` says run: the dead
code JAX drops when it lowers is not reported), `moves` prices the layout moves outside
``shard_map`` it finds, `memory` estimates the per-device memory the types imply, `report` holds
it all (records, totals, roofline, the comparison with XLA's program), `sections` reads the
pipeline schedules' cotangent transfers and the context-parallel attention calls from their
named scopes and writes their tables, `render` writes the rest as text, `hlo` is the one
reader of compiled HLO (shared with the benchmarks; `hlo_groups`, which reads replica groups,
is part of that reader), `explain` is the entry point. A new collective's row in the report
comes from its named scope ``shardops.OP[SPEC]``: `walk` reads it.

May import: every layer below it (`shardlib._lang` ... `shardlib._attention`).
"""
