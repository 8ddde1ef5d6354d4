"""Array types and checking values against them.

The annotation types (`types`: ``f32[Array, 'a b/d']``, ``Array``, ``Stacked``), pytree
dataclasses and stacked types (`pytree`), jaxtyping interop (`interop`), the dim-name scopes
a checked call owns (`scopes`), the value check itself (`checking`, with the actual layout
in `layouts` and message formatting in `format`), typeguard's checkers (`typeguard_checkers`)
and ``typechecked``, and what annotations give: ``make_shardings`` (`shardings`), the
sharding summary (`summary`), and the shardings of a whole train state, model + optimizer
state + step, for restoring checkpoints (`train_state`).

May import: `shardlib._lang`, `shardlib._env`.
"""
