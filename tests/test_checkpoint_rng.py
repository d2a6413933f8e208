"""Each rank's RNG states: saved from its own GPU, restored into its own GPU at any visible device
count (old checkpoints hold every GPU's), and a checkpoint that does not load is one line. CPU only:
the CUDA side is the pure choice of what to restore (tests/test_gpu.py runs the real thing)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from raytrain_ddp.checkpoint.checkpointer import restore_failure
from raytrain_ddp.checkpoint.rng import cuda_state_to_restore, rng_states, set_rng_states
from raytrain_ddp.config import TrainConfig


def device_states(count: int) -> list[torch.Tensor]:
    """What get_rng_state_all gave on a node showing `count` GPUs: one distinct state per device."""
    return [torch.full((16,), i, dtype=torch.uint8) for i in range(count)]


@pytest.mark.parametrize("visible", [4, 1])
def test_old_checkpoint_saved_on_8_gpus_restores_own_device_where_fewer_are_visible(visible: int) -> None:
    saved = device_states(8)  # --workers 8 on one node: every rank saved all 8
    for current in range(visible):  # --workers 4 (or 1) now: rank r runs on device r
        assert torch.equal(cuda_state_to_restore(saved, visible, current), saved[current])


def test_old_checkpoint_without_the_own_device_is_skipped() -> None:
    saved = device_states(2)  # saved where 2 GPUs were visible
    assert cuda_state_to_restore(saved, 4, 3) is None  # now on device 3 of 4: no entry, no IndexError
    assert cuda_state_to_restore([], 1, 0) is None


@pytest.mark.parametrize(("visible", "current"), [(8, 5), (4, 3), (1, 0)])
def test_new_checkpoint_restores_into_own_device_at_any_count(visible: int, current: int) -> None:
    own = torch.full((16,), 7, dtype=torch.uint8)  # the saving rank's own device's state
    assert cuda_state_to_restore(own, visible, current) is own


def test_nothing_to_restore_without_a_gpu_or_a_saved_state() -> None:
    assert cuda_state_to_restore(device_states(8), 0, 0) is None  # a GPU checkpoint resumed on CPU
    assert cuda_state_to_restore(torch.zeros(16, dtype=torch.uint8), 0, 0) is None
    assert cuda_state_to_restore(None, 4, 0) is None  # a CPU checkpoint resumed on GPU


def test_old_checkpoint_with_every_gpus_state_loads_on_cpu() -> None:
    """torch's, numpy's and python's streams come back as before; an old 'cuda' list is no error."""
    torch.manual_seed(1), np.random.seed(1), random.seed(1)
    states = rng_states() | {"cuda": device_states(8)}
    expected = (torch.rand(3), np.random.rand(3), random.random())
    torch.manual_seed(2), np.random.seed(2), random.seed(2)
    set_rng_states(states)
    got = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(got[0], expected[0]) and np.array_equal(got[1], expected[1]) and got[2] == expected[2]


def test_a_checkpoint_that_does_not_load_is_one_line_that_names_it_and_the_fix() -> None:
    cfg = TrainConfig(name="g1")
    path = "/runs/g1/checkpoint_2026-11-25_09-00-00.000000"
    for err in (KeyError("scaler"), IndexError("list index out of range"),
                RuntimeError("PytorchStreamReader failed reading zip archive:\nfailed finding central directory"),
                OSError(5, "Input/output error")):
        line = restore_failure(cfg, path, err, mismatch=False)
        assert "\n" not in line and "run 'g1'" in line and path in line and type(err).__name__ in line
        assert line.endswith("pass --no-resume or a new --name")
    mismatch = restore_failure(cfg, path, RuntimeError("size mismatch for fc.weight"), mismatch=True)
    assert mismatch == (f"the checkpoint of run 'g1' at {path} does not fit --model {cfg.model} "
                        f"--num-classes {cfg.num_classes}; pass --no-resume or a new --name")
