"""The ranks' agreement (worker/control.py): the divergence it finds from the losses it kept."""

from __future__ import annotations

import math
import random

import pytest
import torch

from raytrain_ddp.worker.control import Control


def first_diverged(losses: list[float], patience: int) -> int:
    """The step (from 1) where `patience` non-finite losses in a row were first reached, 0 if never."""
    run = 0
    for step, loss in enumerate(losses, start=1):
        run = 0 if math.isfinite(loss) else run + 1
        if run >= patience:
            return step
    return 0


@pytest.mark.parametrize("patience", [1, 3])
def test_settling_at_any_agreements_finds_the_step_a_per_step_count_finds(patience):
    rng = random.Random(patience)
    for _ in range(200):
        losses = [rng.choice([1.0, 1.0, 1.0, math.nan, math.inf]) for _ in range(rng.randrange(1, 30))]
        control = Control(0, None, patience, torch.zeros((), dtype=torch.float64), torch.zeros((), dtype=torch.float64))
        for step, loss in enumerate(losses, start=1):
            control.count(torch.tensor(loss), step)
            if rng.random() < 0.3:  # an agreement here: a run of bad losses may span it
                control.settle()
        control.settle()
        assert int(control.bad_step) == first_diverged(losses, patience), (losses, patience)
