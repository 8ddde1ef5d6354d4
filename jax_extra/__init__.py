"""Small, independent extras for JAX: explicit remat, string-keyed PRNG, dataclass configs."""

from jax_extra._dataclass import (
    DataclassFromDictError,
    UnknownKeyWarning,
    make_dataclass_from_dict,
)
from jax_extra._random import fold_in_str
from jax_extra._remat import (
    SAVE_FOR_BACKWARD_NAME,
    explicit_activation_checkpointing,
    save_for_backward,
)

__all__ = [
    "SAVE_FOR_BACKWARD_NAME",
    "DataclassFromDictError",
    "UnknownKeyWarning",
    "explicit_activation_checkpointing",
    "fold_in_str",
    "make_dataclass_from_dict",
    "save_for_backward",
]
