"""The spec language: shape specs (``'batch/d len'``) and op specs (``'a b/d -> a/d b'``).

Parsed once per distinct text into small frozen nodes that keep their text spans, so errors
print the spec with a caret under the fault (`parsing`, `op_spec`), and say how to fix
malformed text (`fixes`). Pure Python: imports no JAX and nothing else of shardlib's.
"""
