"""``shardlib.plan``: rank a model's layouts for any number of devices from its trace.

`meshes` enumerates the candidate meshes (axis sizes for N devices over the model's axes) and
makes each one's axis rules and abstract arguments (pure bookkeeping: no trace); `cost` turns
an `ExplainReport` traced on a candidate's `jax.sharding.AbstractMesh`, and the matmuls
`roofline` reads from the same trace per phase, into predicted times and memory on a
`Hardware`; `strategies` enumerates the step's keyword choices (`plan(strategies=)`) and
tells when two of them trace to the same program; `screen` estimates a candidate from another
traced on a mesh over the same axes (`plan(screen=)`: many meshes, few traces); `calibrate` measures the devices present and
returns their `Hardware`; `result` holds the ranked candidates, renders them, and compiles
them on real devices to check the prediction (`Plan.verify`); `plan` is the entry point.

May import: every layer below it (`shardlib._lang` ... `shardlib._explain`); nothing imports it
but the public package.
"""
