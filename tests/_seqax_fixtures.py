"""seqax's configuration dataclasses, as its ``train.py`` declares them (not collected).

Shared by the model written in seqax's idioms (``tests/seqax_style_model.py``) and the
compatibility tests (``tests/test_seqax_compat.py``), which extends `TrainingHparams` with
the fields of seqax's learning-rate schedule and batch. Frozen, so hashable: ``jax.jit``
takes them as static arguments, as seqax does.
"""

import dataclasses
from typing import Optional  # noqa: UP035 -- seqax's spelling


@dataclasses.dataclass(frozen=True)
class Hparams:
    d_model: int
    n_q_per_kv: int
    n_kv: int
    d_head: int
    layers: int
    vocab: int
    d_ff: int
    rope_max_timescale: int


@dataclasses.dataclass(frozen=True)
class TrainingHparams:
    """The part of seqax's training block that a hand-written AdamW loop reads."""

    adam_b1: float
    adam_b2: float
    adam_eps: float
    adam_eps_root: float
    weight_decay: float
    learning_rate: float
    steps: int
    seed: int
    queue: Optional[str] = None  # noqa: UP045 -- seqax's spelling


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    d: int
    t: int
