"""shardlib: typed shapes with sharding, typed shard_map and checked collectives for JAX.

Import the public modules: ``shardlib.shardtypes`` (types, checking, ``typed_shard_map``),
``shardlib.shardops`` (string-specified collectives and local ops), ``shardlib.pipeline``
(pipeline schedules), ``shardlib.attention`` (context-parallel attention) and
``shardlib.moe`` (mixture of experts with expert parallelism); ``shardlib.explain`` reports a
program's communication and memory from its trace, and ``shardlib.plan`` ranks a model's
layouts for any number of devices from it (``shardlib.calibrate`` measures the devices
present as a ``Hardware`` for it).
"""

from . import attention, moe, pipeline, sampling, shardops, shardtypes
from ._explain.explain import HARDWARE, ExplainReport, Hardware, explain
from ._lang.parsing import SpecError
from ._plan.calibrate import calibrate
from ._plan.plan import plan
from ._plan.result import Candidate, Plan
from .shardtypes import axis_rules, typechecked

__version__ = "0.1.0"

__all__ = [
    "HARDWARE",
    "Candidate",
    "ExplainReport",
    "Hardware",
    "SpecError",
    "attention",
    "axis_rules",
    "calibrate",
    "explain",
    "moe",
    "pipeline",
    "plan",
    "Plan",
    "sampling",
    "shardops",
    "shardtypes",
    "typechecked",
]
