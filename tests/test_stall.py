"""The stall watch (doctor/stall_watch.py, read by doctor/diagnosis.py): a rank stuck for good is named, with its frame, in seconds, not
after the collective's 30-minute timeout."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest
from conftest import raytrain

from raytrain_ddp.doctor.diagnosis import Place, culprit_ranks, is_stack, read_place, training_stack, verdict
from raytrain_ddp.doctor.ranks import RankProcess
from raytrain_ddp.doctor.stall_watch import stall_limit

HANGS_PY = """\
import threading

import torch.distributed as dist
from torch import nn


class HangsOnRank1(nn.Module):
    def __init__(self, num_classes, in_channels):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(in_channels, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                                  nn.Flatten(), nn.Linear(8, num_classes))
        self.forwards = 0

    def forward(self, x):
        if self.training:
            self.forwards += 1
            if self.forwards == 5 and dist.get_rank() == 1:
                threading.Event().wait()  # the fault: rank 1 never comes back
        return self.body(x)
"""
HANG_LINE = 18
"""hangs.py's line of the wait, as the culprit's frame names it."""
STALL_S = 10


@pytest.mark.e2e
def test_a_rank_stuck_in_its_forward_is_named_and_the_run_fails_in_seconds(ray_head, tmp_path: Path):
    (tmp_path / "hangs.py").write_text(HANGS_PY)
    started = time.monotonic()
    try:
        proc = raytrain(
            "run", "--model", "hangs:HangsOnRank1", "--workers", "2", "--epochs", "1", "--train-samples", "640",
            "--val-samples", "32", "--batch-size", "16", "--data-workers", "0", "--progress", "plain",
            "--stall-timeout", str(STALL_S), "--storage-path", str(tmp_path / "runs"), "--name", "stuck",
            env=ray_head.env, cwd=tmp_path, timeout=240,
        )
    except subprocess.TimeoutExpired:
        pytest.fail("the run hung: no stall was detected")
    took = time.monotonic() - started
    assert proc.returncode == 1, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: the run stalled"), proc.stderr[-3000:]
    assert "rank 1 (" in last and f"hangs.py:{HANG_LINE} in HangsOnRank1.forward" in last, last
    assert "rank 0 (" not in last and "DDP's gradient all-reduce" in last, last
    stall = tmp_path / "runs" / "stuck" / "stall"
    assert (stall / "rank0.txt").exists() and (stall / "rank1.txt").exists()
    assert "forward_backward" in (stall / "rank0.txt").read_text()
    assert took < 180, f"{took:.0f} s: the stall was not acted on within {STALL_S} s + 30 s of it (plus the start)"


HANGS_AT_START_PY = """\
import threading

import torch.distributed as dist
from torch import nn


class HangsOnRank1(nn.Module):
    def __init__(self, num_classes, in_channels):
        super().__init__()
        if dist.is_initialized() and dist.get_rank() == 1:  # not in the driver's check, on the meta device
            threading.Event().wait()  # the fault: rank 1 never builds its model
        self.body = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(in_channels, num_classes))

    def forward(self, x):
        return self.body(x)
"""
START_HANG_LINE = 11


@pytest.mark.e2e
def test_a_rank_stuck_before_its_first_step_is_named_while_the_others_wait_in_ddps_start(ray_head, tmp_path: Path):
    """The start-up (health check, data, model) is watched from the moment every rank met: rank 1
    never builds its model, rank 0 waits for it in DDP's constructor. Unwatched, gloo's 30 minutes."""
    (tmp_path / "hangs.py").write_text(HANGS_AT_START_PY)
    try:
        proc = raytrain(
            "run", "--model", "hangs:HangsOnRank1", "--workers", "2", "--epochs", "1", "--train-samples", "64",
            "--val-samples", "32", "--batch-size", "16", "--data-workers", "0", "--progress", "plain",
            "--stall-timeout", str(STALL_S), "--storage-path", str(tmp_path / "runs"), "--name", "stuck",
            env=ray_head.env, cwd=tmp_path, timeout=180,
        )
    except subprocess.TimeoutExpired:
        pytest.fail("the run hung: no stall was detected before the first step")
    assert proc.returncode == 1, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: the run stalled (no rank finished its first training step for "), last
    assert "rank 1 (" in last and f"hangs.py:{START_HANG_LINE} in HangsOnRank1.__init__" in last, last
    assert "rank 0 (" not in last and "DDP's check of every rank's parameter shapes" in last, last
    assert (tmp_path / "runs" / "stuck" / "workers.json").exists()  # `raytrain stack` finds the ranks too


def test_the_default_limit_is_two_minutes_or_ten_slow_steps_and_0_is_off():
    assert stall_limit(None, []) == 120.0
    assert stall_limit(None, [1.0, 30.0]) == 300.0
    assert stall_limit(7.5, [30.0]) == 7.5
    assert stall_limit(0, [30.0]) is None


RANK0 = """\
Process 11: ray::RayTrainWorker
Python v3.11.7 (/usr/bin/python3.11)

Thread 11 (idle): "MainThread"
    Condition.wait (/usr/lib/python3.11/threading.py:327)
    main_loop (/venv/lib/python3.11/site-packages/ray/_private/worker.py:900)

Thread 12 (idle): "TrainingThread"
    _engine_run_backward (/venv/lib/python3.11/site-packages/torch/autograd/graph.py:825)
    backward (/venv/lib/python3.11/site-packages/torch/autograd/__init__.py:347)
    Tensor.backward (/venv/lib/python3.11/site-packages/torch/_tensor.py:581)
    forward_backward (/src/raytrain_ddp/worker/step.py:58)
    train_epoch (/src/raytrain_ddp/worker/loop.py:220)
"""
RANK1 = """\
Thread 21 (idle): "TrainingThread"
    Condition.wait (/usr/lib/python3.11/threading.py:327)
    Event.wait (/usr/lib/python3.11/threading.py:629)
    HangsOnRank1.forward (/tmp/x/hangs.py:18)
    Module._call_impl (/venv/lib/python3.11/site-packages/torch/nn/modules/module.py:1750)
    forward_backward (/src/raytrain_ddp/worker/step.py:56)
    train_epoch (/src/raytrain_ddp/worker/loop.py:220)
"""
IN_BARRIER = """\
Thread 31 (idle): "TrainingThread"
    barrier (/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py:4000)
    wrapper (/venv/lib/python3.11/site-packages/torch/distributed/c10d_logger.py:81)
    agree (/src/raytrain_ddp/worker/control.py:70)
"""
IN_FORWARD = """\
Thread 41 (idle): "TrainingThread"
    barrier (/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py:6371)
    _exception_logger.<locals>.wrapper (/venv/lib/python3.11/site-packages/torch/distributed/c10d_logger.py:83)
    SkipsOnRank0.forward (/tmp/x/skips.py:17)
    Module._call_impl (/venv/lib/python3.11/site-packages/torch/nn/modules/module.py:1794)
    DistributedDataParallel.forward (/venv/lib/python3.11/site-packages/torch/nn/parallel/distributed.py:1891)
    Module._call_impl (/venv/lib/python3.11/site-packages/torch/nn/modules/module.py:1794)
    forward_backward (/src/raytrain_ddp/worker/step.py:54)
    train_epoch (/src/raytrain_ddp/worker/loop.py:220)
"""
"""A rank in a barrier its model's forward calls, where the rank that skipped it is past it, in RANK0's backward."""


def test_a_stack_reads_as_the_training_threads_own_frame_and_its_collective():
    assert read_place(RANK0) == Place("/src/raytrain_ddp/worker/step.py:58 in forward_backward",
                                      "DDP's gradient all-reduce (backward)")
    assert read_place(RANK1) == Place("/tmp/x/hangs.py:18 in HangsOnRank1.forward", None)
    assert read_place(IN_BARRIER).collective == "torch.distributed barrier"
    assert read_place(IN_FORWARD) == Place("/tmp/x/skips.py:17 in SkipsOnRank0.forward", "torch.distributed barrier (forward)")
    sync_bn = IN_FORWARD.replace("    SkipsOnRank0.forward", """\
    SyncBatchNorm.forward (/venv/lib/python3.11/site-packages/torch/nn/modules/_functions.py:90)
    Function.apply (/venv/lib/python3.11/site-packages/torch/autograd/function.py:581)
    SkipsOnRank0.forward""").replace("barrier (", "all_gather_into_tensor (")
    assert read_place(sync_bn).collective == "torch.distributed all_gather_into_tensor (forward)"
    assert read_place("py-spy failed (exit 1): Permission denied").collective is None


IN_DDP_START = """\
Thread 12 (idle): "TrainingThread"
    _verify_param_shape_across_processes (/venv/lib/python3.11/site-packages/torch/distributed/utils.py:299)
    DistributedDataParallel.__init__ (/venv/lib/python3.11/site-packages/torch/nn/parallel/distributed.py:835)
    wrap (/src/raytrain_ddp/worker/parallel.py:40)
    train_rank (/src/raytrain_ddp/worker/loop.py:129)
"""
"""Rank 0 in DDP's constructor, whose collective (C++) has no Python frame: it waits for a rank
that has not built its model."""


def test_a_rank_in_ddps_start_waits_for_the_others():
    """Unread, its place is torch's own code, busy: the ranks would be called slow, and never ended."""
    assert read_place(IN_DDP_START).collective == "DDP's check of every rank's parameter shapes"
    at_init = RANK1.replace("HangsOnRank1.forward (/tmp/x/hangs.py:18)", "HangsOnRank1.__init__ (/tmp/x/hangs.py:11)")
    assert culprit_ranks([read_place(IN_DDP_START), read_place(at_init)]) == [1]


def test_the_culprit_is_the_rank_not_where_the_others_wait():
    waits, stuck, other = read_place(RANK0), read_place(RANK1), read_place(IN_BARRIER)
    assert culprit_ranks([waits, stuck, waits]) == [1]
    assert culprit_ranks([waits, waits, other]) == [2]
    assert culprit_ranks([stuck, stuck]) == []  # nobody waits: nothing to tell them apart
    assert culprit_ranks([waits, waits]) == []


AT_A_HOST_SYNC = """\
Thread 41 (idle): "TrainingThread"
    show_progress (/src/raytrain_ddp/worker/loop.py:262)
    train_epoch (/src/raytrain_ddp/worker/loop.py:231)
    train_loop (/src/raytrain_ddp/worker/loop.py:127)
"""
"""Under NCCL the all-reduce returns at once: a rank waiting for the others blocks on its GPU at the
loop's next .item(), in no torch.distributed call."""


def test_under_nccl_the_culprit_is_the_rank_in_user_code_while_the_others_wait_in_the_loop():
    waits, stuck = read_place(AT_A_HOST_SYNC), read_place(RANK1)
    assert waits.collective is None and culprit_ranks([waits, stuck]) == [1]
    assert culprit_ranks([waits, waits]) == [] and culprit_ranks([stuck, stuck]) == []
    where = [RankProcess(r, "vm", "10.0.0.1", 100 + r) for r in range(2)]
    assert verdict(where, [waits, stuck], 10, Path("runs/x/stall")) == (
        "the run stalled (no rank finished a training step for 10 s): rank 1 (vm pid 101) is at /tmp/x/hangs.py:18 in "
        "HangsOnRank1.forward, while the others wait in the training loop at /src/raytrain_ddp/worker/loop.py:262 in "
        "show_progress (under NCCL, for the GPU, where a collective waits); stacks in runs/x/stall")


def test_a_rank_that_skipped_a_collective_is_the_one_past_it_even_in_a_tie():
    """Rank 1 skipped the barrier its forward calls: it waits in DDP's gradient all-reduce, past the
    barrier the others wait in. At 2 ranks that is a tie, broken by which rank is further along."""
    ahead, behind, elsewhere = read_place(RANK0), read_place(IN_FORWARD), read_place(IN_BARRIER)
    assert culprit_ranks([behind, ahead, behind]) == [1]
    assert culprit_ranks([behind, ahead]) == [1]
    assert culprit_ranks([ahead, behind]) == [0]
    assert culprit_ranks([ahead, elsewhere]) == []  # which of these is ahead? nothing says
    assert culprit_ranks([ahead, elsewhere, read_place(RANK1)]) == [2]  # still the one stuck in none


RANKS = [RankProcess(r, "vm", "10.0.0.1", 100 + r) for r in range(3)]


def test_the_verdict_names_the_rank_past_the_collective_and_where_the_others_wait():
    ahead, behind, elsewhere = read_place(RANK0), read_place(IN_FORWARD), read_place(IN_BARRIER)
    line = verdict(RANKS, [ahead, behind], 10, Path("runs/x/stall"))
    assert line == (
        "the run stalled (no rank finished a training step for 10 s): rank 0 (vm pid 100) is at /src/raytrain_ddp/worker/step.py:58 in "
        "forward_backward in DDP's gradient all-reduce (backward), while the others wait in torch.distributed barrier "
        "(forward) at /tmp/x/skips.py:17 in SkipsOnRank0.forward; rank 0 went past that collective: skipped it, or the "
        "others call one extra; stacks in runs/x/stall")
    line = verdict(RANKS, [ahead, elsewhere], 10, Path("s"))
    assert line.startswith("the run stalled (no rank finished a training step for 10 s): the ranks wait in different collectives (rank 0 "
                           "in DDP's gradient all-reduce (backward) at /src/raytrain_ddp/worker/step.py:58 in forward_backward, "
                           "rank 1 in torch.distributed barrier at /src/raytrain_ddp/worker/control.py:70 in agree)"), line
    line = verdict(RANKS, [elsewhere, ahead, elsewhere], 10, Path("s"))
    assert "rank 1 (vm pid 101)" in line and "rank 1 and the others call different collectives" in line, line
    line = verdict(RANKS, [ahead, read_place(RANK1)], 10, Path("s"))
    assert "rank 1 (vm pid 101) is at /tmp/x/hangs.py:18 in HangsOnRank1.forward, while the others" in line, line
    assert "skipped" not in line, line


def test_a_group_whose_processes_are_gone_is_no_stall():
    """Ray Train ending or restarting a worker group leaves the sink silent too; the ranks' processes
    are gone then, and the watch must not fail a run that is recovering."""
    assert is_stack("Process 4242: python -m raytrain_ddp\nPython v3.11.7 (/usr/bin/python3)\n\nThread 4242 (idle): ...")
    assert not is_stack("py-spy failed (exit 1): Failed to find process 4242")
    assert not is_stack("no answer from 10.0.0.2: timeout")
    assert not is_stack("py-spy not run: the rank's node is not alive in Ray")


LAUNCHED_IN_ALL_REDUCE = """\
Process 41: /venv/bin/python /tmp/x/train.py
Python v3.11.7 (/usr/bin/python3.11)

Thread 42 (idle): "pin_memory"
    Condition.wait (/usr/lib/python3.11/threading.py:327)
    _pin_memory_loop (/venv/lib/python3.11/site-packages/torch/utils/data/_utils/pin_memory.py:50)
Thread 41 (idle): "MainThread"
    all_reduce (/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py:3913)
    _exception_logger.<locals>.wrapper (/venv/lib/python3.11/site-packages/torch/distributed/c10d_logger.py:83)
    main (/tmp/x/train.py:9)
    <module> (/tmp/x/train.py:11)
"""
LAUNCHED_IN_BACKWARD = """\
Thread 51 (idle): "MainThread"
    _engine_run_backward (/venv/lib/python3.11/site-packages/torch/autograd/graph.py:1072)
    backward (/venv/lib/python3.11/site-packages/torch/autograd/__init__.py:395)
    Tensor.backward (/venv/lib/python3.11/site-packages/torch/_tensor.py:623)
    main (/tmp/x/train.py:12)
"""
LAUNCHED_IN_ITS_OWN_BACKWARD = """\
Thread 61 (idle): "MainThread"
    Event.wait (/usr/lib/python3.11/threading.py:629)
    Hangs.backward (/tmp/x/train.py:30)
    Function.apply (/venv/lib/python3.11/site-packages/torch/autograd/function.py:307)
    backward (/venv/lib/python3.11/site-packages/torch/autograd/__init__.py:395)
    Tensor.backward (/venv/lib/python3.11/site-packages/torch/_tensor.py:623)
    main (/tmp/x/train.py:12)
"""


def test_a_launched_scripts_stack_reads_as_its_main_threads():
    """No thread runs our loop in a launched script: its main thread trains, wherever py-spy lists it."""
    assert read_place(LAUNCHED_IN_ALL_REDUCE) == Place("/tmp/x/train.py:9 in main", "torch.distributed all_reduce")
    assert training_stack(LAUNCHED_IN_ALL_REDUCE)[-1] == ("<module>", "/tmp/x/train.py", "11")
    # Its loss.backward() waits for DDP's all-reduce; a backward of its own that hangs waits for nobody.
    assert read_place(LAUNCHED_IN_BACKWARD) == Place("/tmp/x/train.py:12 in main", "a backward (DDP's gradient all-reduce)")
    assert read_place(LAUNCHED_IN_ITS_OWN_BACKWARD) == Place("/tmp/x/train.py:30 in Hangs.backward", None)
    assert training_stack("py-spy failed (exit 1): Permission denied") == ()
