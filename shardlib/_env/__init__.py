"""Where are we: the mesh in force and the manual axes (`context`), which Python frame is the
user's (`frames`, the one module that reads frames), a function's annotations resolved without
reading its source (`annotations`), and the one adapter for JAX's internals (`programs`: jaxprs
of JAX 0.9 to 0.12, the only module that reads an equation's parameters or imports
``jax._src``), and JAX's collective primitives over it
(`collectives`: which communicate, which are grouped, how a user writes each).

May import: `shardlib._lang`.
"""
