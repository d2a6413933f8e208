"""The stall watch (doctor/stall_watch.py, read by doctor/diagnosis.py) on a rank that skips a collective the others enter: on gloo a
skipped barrier stalls every rank (a skipped all_reduce of a tensor fails at once instead, see
docs/troubleshooting.md). At 2 ranks each waits in a different collective, a tie; the one named is
the rank past the collective the other waits in."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from conftest import raytrain

SKIPS_PY = """\
import torch.distributed as dist
from torch import nn


class SkipsOnRank0(nn.Module):
    def __init__(self, num_classes, in_channels):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(in_channels, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                                  nn.Flatten(), nn.Linear(8, num_classes))
        self.forwards = 0

    def forward(self, x):
        if self.training:
            self.forwards += 1
            if not (self.forwards == 5 and dist.get_rank() == 0):  # the fault: rank 0 skips its 5th
                dist.barrier()
        return self.body(x)
"""
BARRIER_LINE = 16
"""skips.py's line of the barrier, where rank 1 waits."""


@pytest.mark.e2e
def test_the_rank_that_skipped_a_collective_is_named_not_the_one_waiting_in_it(ray_head, tmp_path: Path):
    # rank 0, not rank 1: a tie read in rank order would name rank 1, the one waiting where it should
    (tmp_path / "skips.py").write_text(SKIPS_PY)
    try:
        proc = raytrain(
            "run", "--model", "skips:SkipsOnRank0", "--workers", "2", "--epochs", "1", "--train-samples", "320",
            "--val-samples", "32", "--batch-size", "16", "--data-workers", "0", "--progress", "plain",
            "--stall-timeout", "10", "--storage-path", str(tmp_path / "runs"), "--name", "skipped",
            env=ray_head.env, cwd=tmp_path, timeout=240,
        )
    except subprocess.TimeoutExpired:
        pytest.fail("the run hung: no stall was detected")
    assert proc.returncode == 1, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: the run stalled"), proc.stderr[-3000:]
    assert "rank 0 (" in last and "rank 1 (" not in last, last
    assert "in forward_backward in DDP's gradient all-reduce (backward)" in last, last
    assert f"the others wait in torch.distributed barrier (forward) at {tmp_path}" in last, last
    assert f"skips.py:{BARRIER_LINE} in SkipsOnRank0.forward" in last, last
    assert "rank 0 went past that collective" in last, last
