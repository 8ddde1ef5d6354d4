"""Typed shapes with sharding: ``f32[Array, 'batch/d len']``, checked at runtime.

Public face of shardlib's type layer (names follow seqax's ``shardlib.shardtypes``).

Static type checkers (pyright, mypy) see the dtype names as ``typing.Annotated``, ``Array``
as ``jax.Array`` and ``Stacked`` as ``typing.Annotated`` (the mechanism jaxtyping uses), so
``f32[Array, 'batch/d len']`` reads as ``jax.Array`` and ``Stacked[Layer, 'layers']`` as
``Layer``. At runtime they are shardlib's annotation types; the older spellings
``f32[b'batch/d len']``, ``f32['batch/d len']`` and ``Array['layers', Layer]`` mean the same.

A name after ``/`` may be a role (``f32[Array, 'B/batch M/fsdp']``), mapped to mesh axes by the
rules in force (`axis_rules`, read back with `current_axis_rules`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._check.checking import check
from ._check.pytree import pytree_dataclass
from ._check.scopes import Scope, scope
from ._check.shardings import is_fully_sharded, make_partition_specs, make_shardings
from ._check.summary import ShardingSummary, device_put_checked, sharding_summary
from ._check.train_state import restore_target, state_shardings
from ._check.typechecked import typechecked
from ._check.typeguard_checkers import register_with_typeguard
from ._check.types import ArrayType
from ._check.types import base as _base
from ._env.rules import AxisRules, axis_rules
from ._env.rules import current as current_axis_rules
from ._lang.parsing import DimSpec, ShapeSpec, SpecError
from ._shard_map.decorator import typed_shard_map

if TYPE_CHECKING:
    # What static type checkers see: `f32[Array, 'a b']` is `Annotated[jax.Array, 'a b']`.
    from typing import Annotated as Stacked
    from typing import Annotated as bf16
    from typing import Annotated as bool_
    from typing import Annotated as f8_e3m4
    from typing import Annotated as f8_e4m3
    from typing import Annotated as f8_e4m3b11fnuz
    from typing import Annotated as f8_e4m3fn
    from typing import Annotated as f8_e4m3fnuz
    from typing import Annotated as f8_e5m2
    from typing import Annotated as f8_e5m2fnuz
    from typing import Annotated as f8_e8m0fnu
    from typing import Annotated as f16
    from typing import Annotated as f32
    from typing import Annotated as f64
    from typing import Annotated as i8
    from typing import Annotated as i16
    from typing import Annotated as i32
    from typing import Annotated as i64
    from typing import Annotated as u8
    from typing import Annotated as u16
    from typing import Annotated as u32
    from typing import Annotated as u64

    from jax import Array

else:
    from ._check.types import Array, Stacked

    bool_ = _base("bool_")
    bf16 = _base("bf16")
    f16 = _base("f16")
    f32 = _base("f32")
    f64 = _base("f64")
    i8 = _base("i8")
    i16 = _base("i16")
    i32 = _base("i32")
    i64 = _base("i64")
    u8 = _base("u8")
    u16 = _base("u16")
    u32 = _base("u32")
    u64 = _base("u64")

    # float8 types (all present since jax 0.9, the lowest version shardlib supports).
    f8_e4m3fn = _base("f8_e4m3fn")
    f8_e5m2 = _base("f8_e5m2")
    f8_e4m3fnuz = _base("f8_e4m3fnuz")
    f8_e5m2fnuz = _base("f8_e5m2fnuz")
    f8_e4m3b11fnuz = _base("f8_e4m3b11fnuz")
    f8_e4m3 = _base("f8_e4m3")
    f8_e3m4 = _base("f8_e3m4")
    f8_e8m0fnu = _base("f8_e8m0fnu")

__all__ = [
    "Array",
    "ArrayType",
    "AxisRules",
    "DimSpec",
    "Scope",
    "ShapeSpec",
    "ShardingSummary",
    "SpecError",
    "Stacked",
    "bf16",
    "bool_",
    "axis_rules",
    "check",
    "current_axis_rules",
    "device_put_checked",
    "f16",
    "f32",
    "f64",
    "i8",
    "i16",
    "i32",
    "i64",
    "is_fully_sharded",
    "make_partition_specs",
    "make_shardings",
    "pytree_dataclass",
    "register_with_typeguard",
    "restore_target",
    "scope",
    "sharding_summary",
    "state_shardings",
    "typechecked",
    "typed_shard_map",
    "u8",
    "u16",
    "u32",
    "u64",
    "f8_e3m4",
    "f8_e4m3",
    "f8_e4m3b11fnuz",
    "f8_e4m3fn",
    "f8_e4m3fnuz",
    "f8_e5m2",
    "f8_e5m2fnuz",
    "f8_e8m0fnu",
]

# Checking shardlib annotations needs the typeguard plugin; installing it is idempotent and
# only affects shardlib's own types, so do it on import (register_with_typeguard() is kept
# for code written for seqax, which called it explicitly).
register_with_typeguard()
