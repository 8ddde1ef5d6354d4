"""``examples/moe.py``: the MoE decoder trains on the headline's synthetic language."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("optax")

from examples import moe as example  # noqa: E402


@pytest.fixture(scope="module")
def run():
    return example.main(["--steps", "60"])


@pytest.mark.slow  # 60 training steps: about 20 s
def test_moe_example_loss_falls_below_the_bound(run):
    losses = np.asarray(run["losses"])
    assert np.all(np.isfinite(losses))
    # From about a uniform guess over 64 tokens (ln 64 = 4.16) to within 0.55 nats of the
    # chain's entropy (1.08), which no model can beat on fresh data.
    assert abs(losses[0] - np.log(64)) < 1.0
    assert losses[-5:].mean() < 1.6, losses
    assert losses[-5:].mean() > run["best_possible_loss"] - 0.05


@pytest.mark.slow
def test_moe_example_reports_drops_and_load(run):
    dropped = np.asarray(run["dropped"])  # steps x MoE layers
    load = np.asarray(run["load"])  # steps x MoE layers x experts
    assert dropped.shape == (60, 2) and load.shape == (60, 2, 8)
    assert np.all(load.sum(-1) == 16 * 32 * 2)  # every (token, choice) pair counted once
    # The load-balancing loss spreads the tokens: fewer drops at the end than at the start.
    assert dropped[-10:].mean() < dropped[:5].mean() / 2


@pytest.mark.slow
def test_moe_example_on_2x4():
    losses = np.asarray(example.main(["--steps", "30", "--mesh", "2x4"])["losses"])
    assert losses[-3:].mean() < losses[0] - 1.5


def test_moe_example_help_lists_every_flag_with_its_default():
    text = example.build_parser().format_help()
    for flag in ("--mesh", "--steps", "--batch", "--lr", "--seed"):
        assert flag in text
    assert text.count("(default") == 5
