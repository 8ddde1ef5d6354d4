"""Where are we: the mesh in force and the manual axes (`context`, the one place private JAX
is touched, if ever), which Python frame is the user's (`frames`, the one module that reads
frames), and a function's annotations resolved without reading its source (`annotations`).

May import: `shardlib._lang`.
"""
