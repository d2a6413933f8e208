"""Stragglers (worker/part_clock.py, driver/stragglers.py): a rank slow in its data, or in its own
backward, is named with its part, though DDP's all-reduce makes every rank's step as long as the slowest's."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
from conftest import raytrain

from raytrain_ddp.driver.stragglers import most_uneven, stragglers

UNEVEN_PY = """\
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import Dataset

SLOW_DATA_RANK, SLOW_BACKWARD_RANK = 1, 2


def rank():
    return dist.get_rank() if dist.is_initialized() else 0


class Samples(Dataset):
    def __init__(self, size, train):
        self.size, self.train = size, train

    def __len__(self):
        return self.size

    def __getitem__(self, index):
        if self.train and rank() == SLOW_DATA_RANK:
            time.sleep(0.004)  # the fault: this rank's reads are slow
        x = torch.randn(3, 8, 8, generator=torch.Generator().manual_seed(index))
        return x, index % 4


def build(split, data_dir, image_size):
    return Samples(480 if split == "train" else 32, split == "train")


class SlowBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if rank() == SLOW_BACKWARD_RANK:
            time.sleep(0.06)  # the fault: this rank's backward compute is slow
        return grad


class Net(nn.Module):
    def __init__(self, num_classes, in_channels):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, 8, 3, padding=1)
        self.head = nn.Sequential(nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, num_classes))

    def forward(self, x):
        # After the conv, so its weight's gradient (the last one ready) waits for the slow backward.
        return self.head(SlowBackward.apply(self.conv(x)))
"""


@pytest.mark.e2e
def test_a_rank_slow_in_data_and_one_slow_in_backward_are_each_named_with_their_part(ray_head, tmp_path: Path):
    (tmp_path / "uneven.py").write_text(UNEVEN_PY)
    proc = raytrain(
        "run", "--model", "uneven:Net", "--dataset", "uneven:build", "--num-classes", "4", "--workers", "3",
        "--epochs", "1", "--batch-size", "16", "--data-workers", "0", "--progress", "plain",
        "--storage-path", str(tmp_path / "runs"), "--name", "uneven", env=ray_head.env, cwd=tmp_path, timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    named = [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("straggler:")]
    assert len(named) == 2, named
    assert any("rank 1 on " in line and "median rank in data in epoch 1" in line for line in named), named
    assert any("rank 2 on " in line and "median rank in backward in epoch 1" in line for line in named), named
    run_dir = tmp_path / "runs" / "uneven"
    with open(run_dir / "rank_times.csv") as f:
        rows = list(csv.DictReader(f))
    assert [row["rank"] for row in rows] == ["0", "1", "2"]
    # The slow ranks' peers wait for them in the all-reduce: a long comm, not their own backward.
    assert float(rows[0]["comm_s"]) > float(rows[2]["comm_s"]), rows
    kept = json.loads((run_dir / "summary.json").read_text())["most_uneven_epoch"]
    assert kept["epoch"] == 1 and len(kept["ranks"]) == 3 and len(kept["stragglers"]) == 2, kept


def parts(data: float, forward: float, backward: float, comm: float) -> dict[str, float]:
    return {"data": data, "forward": forward, "backward": backward, "comm": comm}


def test_a_rank_20_percent_over_the_median_in_a_part_is_named_with_its_part_and_host():
    even = parts(1.0, 2.0, 3.0, 1.0)
    slow = stragglers(4, [even, parts(1.0, 2.0, 3.7, 0.3), even], ["a", "b", "c"])
    assert [(s.rank, s.host, s.part) for s in slow] == [(1, "b", "backward")]
    assert slow[0].line() == "straggler: rank 1 on b is 23% slower than the median rank in backward in epoch 4 (3.70 s vs 3.00 s)"
    assert stragglers(4, [even, parts(1.0, 2.0, 3.5, 0.5), even], ["a", "b", "c"]) == []  # 17%: within the rule


def test_a_long_wait_in_comm_names_no_rank_when_another_is_slow_in_its_own_work():
    waits, slow_data = parts(0.1, 2.0, 3.0, 2.0), parts(2.1, 2.0, 3.0, 0.1)
    assert [(s.rank, s.part) for s in stragglers(1, [waits, slow_data, waits], [])] == [(1, "data")]
    # with no rank slow in its own work, a slow link shows in comm alone
    assert [(s.rank, s.part) for s in stragglers(1, [waits, parts(0.1, 2.0, 3.0, 4.0), waits], [])] == [(1, "comm")]


def test_a_part_too_small_to_matter_names_no_one():
    """3 ms against 1 ms of data wait is 200% slower, and 0.03% of a 6 s epoch: noise, not a straggler."""
    assert stragglers(1, [parts(0.001, 2.0, 3.0, 1.0), parts(0.003, 2.0, 3.0, 1.0), parts(0.001, 2.0, 3.0, 1.0)], []) == []


def test_the_summary_keeps_the_most_uneven_epoch():
    even = parts(1.0, 2.0, 3.0, 1.0)
    kept = most_uneven({1: [even, even], 2: [even, parts(1.0, 2.0, 6.0, 0.1)], 3: [even, even]}, ["a", "b"])
    assert kept["epoch"] == 2 and kept["ranks"][1] == {"rank": 1, "host": "b", **parts(1.0, 2.0, 6.0, 0.1)}
    assert len(kept["stragglers"]) == 1 and most_uneven({}, []) is None
