"""A zero-bubble schedule (ZB-H1, ZB-V) whose stage's backward could not be split into its
input half B and its weight half W: the warning, its category and what it costs.

The schedule stays right (B runs the whole backward, W nothing), but the step loses what the
split saves. `warn_unsplit` says so, why the split failed (`shardlib._pipeline.split`,
`shardlib._pipeline.tick`) and what the critical path then is (`shardlib._pipeline.cost`).
May import `shardlib._env.frames`, `.cost` and `.registry` only.
"""

from __future__ import annotations

import warnings

from .._env import frames as _frames
from .cost import cost_of
from .registry import ONE_F_ONE_B, Schedule

__all__ = ["UnsplitBackwardWarning", "warn_unsplit"]


class UnsplitBackwardWarning(UserWarning):
    """Warned when ``zb-h1`` or ``zb-v`` could not split a stage's backward into its input
    half B (the input's cotangent) and its weight half W (the weight gradient): B runs the
    whole backward and W nothing. The schedule's values stay right; its step loses what the
    split saves (the message gives the critical path then). ``shardlib.explain`` shows the
    same in its schedules table (``backward: whole in B``).

    Example::

        import warnings
        from shardlib import pipeline

        with warnings.catch_warnings():  # a stage known not to split, run under zb-h1 anyway
            warnings.simplefilter("ignore", pipeline.UnsplitBackwardWarning)
            ...
    """


def warn_unsplit(schedule: Schedule, why: str, p: int, m: int, v: int) -> None:
    """Warn that ``schedule`` (ZB-H1, ZB-V) runs its stage's backward whole in B, because
    ``why``, at ``p`` stages, ``m`` microbatches and ``v`` groups."""
    fn, name = schedule.function, schedule.name
    split = cost_of(schedule, p, m, v, (1.0, 1.0, 1.0)).lockstep
    whole = cost_of(schedule, p, m, v, (1.0, 2.0, 0.0)).lockstep
    one = cost_of(ONE_F_ONE_B, p, m, 1, (1.0, 1.0, 1.0)).lockstep
    warnings.warn(
        f"{fn}: the stage's backward could not be split into B (the input's cotangent) and W "
        f"(the weight gradient), so it runs whole in B: {why}. The values stay right, but "
        f"each B costs a whole backward and each W nothing: the lockstep critical path is "
        f"{whole:g} units of a stage's forward, not {split:g} (critical_path({name!r}, "
        f"p={p}, m={m}, t_b=2, t_w=0) against the split's t_b=t_w=1), where 1F1B's is "
        f"{one:g}. Use schedule '1f1b' for this stage, or write it as the pipeline guide's "
        f"'What a stage_fn must look like for the B/W split' says",
        UnsplitBackwardWarning,
        stacklevel=_frames.user_stacklevel(),
    )
