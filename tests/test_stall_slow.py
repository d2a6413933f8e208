"""A stall watch that never ends a run that moves (doctor/diagnosis.py's `moving`): ranks that all
work in their own code are slow, not stuck; a rank inside torch.compile, while its peers wait for it
in a collective, is compiling. Each is said once, and the run finishes. The true stalls it must still
name are tests/test_stall*.py's."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from conftest import raytrain

from raytrain_ddp.doctor.diagnosis import EXITED, FIRST_STEP_SILENCE, LoaderWorker, moving
from raytrain_ddp.doctor.ranks import RankProcess
from raytrain_ddp.doctor.stall_watch import compile_limit

SLOW_PY = """\
import time

import torch
import torch.distributed as dist
from torch import nn

SLOW_S = 12
compiled = []


def slow_backend(graph, example_inputs):
    if not compiled:  # validation's recompile (eval mode) is quick
        time.sleep(SLOW_S)  # a compile that takes long (a large model's Inductor warm-up)
    compiled.append(graph)
    return graph.forward


class SlowThenCompiles(nn.Module):
    def __init__(self, num_classes, in_channels):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(in_channels, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                                  nn.Flatten())
        self.head = nn.Linear(8, num_classes)
        self.forwards = 0

    def forward(self, x):
        if self.training:
            self.forwards += 1
            if self.forwards == 1:
                time.sleep(SLOW_S)  # every rank's first forward is slow: busy, and waiting for no one
            if self.forwards == 3 and dist.get_rank() == 1:
                self.head = torch.compile(self.head, backend=slow_backend)  # rank 1 compiles; rank 0 waits
        return self.head(self.body(x))
"""


@pytest.mark.e2e
def test_a_slow_first_step_and_a_long_compile_are_said_once_and_the_run_finishes(ray_head, tmp_path: Path):
    """Every rank sleeps 12 s in its first forward, then rank 1 compiles for 12 s while rank 0 waits
    in DDP's all-reduce, under --stall-timeout 6: the run finishes, with one line for each."""
    (tmp_path / "slow.py").write_text(SLOW_PY)
    try:
        proc = raytrain(
            "run", "--model", "slow:SlowThenCompiles", "--workers", "2", "--epochs", "1", "--train-samples", "128",
            "--val-samples", "32", "--batch-size", "16", "--data-workers", "0", "--progress", "plain",
            "--stall-timeout", "6", "--storage-path", str(tmp_path / "runs"), "--name", "slow",
            env=ray_head.env, cwd=tmp_path, timeout=300,
        )
    except subprocess.TimeoutExpired:
        pytest.fail("the run hung")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "stalled" not in out, out[-3000:]
    slow = [line for line in out.splitlines() if "slow, not stuck" in line]
    assert len(slow) == 1 and FIRST_STEP_SILENCE in slow[0], out[-3000:]
    assert "slow.py:30 in SlowThenCompiles.forward" in slow[0], slow  # both ranks, or one still on its way there
    compiling = [line for line in out.splitlines() if "compiling, not stuck" in line]
    assert len(compiling) == 1, out[-3000:]
    assert "torch.compile runs on rank 1 (" in compiling[0] and "slow.py:13 in slow_backend" in compiling[0], compiling
    assert "while the others wait for it in DDP's gradient all-reduce (backward)" in compiling[0], compiling


def stack(*frames: str, thread: str = "TrainingThread") -> str:
    """A `py-spy dump` of one thread, innermost frame first."""
    return f'Process 1: ray::RayTrainWorker\n\nThread 2 (idle): "{thread}"\n' + "".join(f"    {f}\n" for f in frames)


LOOP = ("forward_backward (/src/raytrain_ddp/worker/step.py:56)", "train_epoch (/src/raytrain_ddp/worker/loop.py:220)")
MODULE = "Module._call_impl (/venv/lib/python3.11/site-packages/torch/nn/modules/module.py:1750)"
IN_FORWARD = stack("Slow.forward (/tmp/x/slow.py:9)", MODULE, *LOOP)
IN_ALL_REDUCE = stack("_engine_run_backward (/venv/lib/python3.11/site-packages/torch/autograd/graph.py:825)",
                      "backward (/venv/lib/python3.11/site-packages/torch/autograd/__init__.py:347)", *LOOP)
COMPILING = stack("slow_backend (/tmp/x/slow.py:12)",
                  "_compile (/venv/lib/python3.11/site-packages/torch/_dynamo/convert_frame.py:1000)",
                  "_fn (/venv/lib/python3.11/site-packages/torch/_dynamo/eval_frame.py:655)", MODULE, *LOOP)
COMPILED_AND_STUCK = stack("Slow.forward (/tmp/x/slow.py:9)",
                           "_fn (/venv/lib/python3.11/site-packages/torch/_dynamo/eval_frame.py:655)", MODULE, *LOOP)
AT_A_SYNC = stack("show_progress (/src/raytrain_ddp/worker/loop.py:262)", *LOOP[1:])
ON_LOADER = stack("_get_data (/venv/lib/python3.11/site-packages/torch/utils/data/dataloader.py:1290)",
                  "timed (/src/raytrain_ddp/worker/part_clock.py:40)", *LOOP[1:])
LOADER_LOOP = "_worker_loop (/venv/lib/python3.11/site-packages/torch/utils/data/_utils/worker.py:302)"
IN_GETITEM = stack("Big.__getitem__ (/tmp/x/big.py:5)", LOADER_LOOP, thread="MainThread")
WAITS_FOR_WORK = stack("get (/usr/lib/python3.11/multiprocessing/queues.py:113)", LOADER_LOOP, thread="MainThread")
RANKS = [RankProcess(r, "vm", "10.0.0.1", 100 + r) for r in range(2)]
NONE: list[list[LoaderWorker]] = [[], []]


def test_ranks_all_in_their_own_code_are_slow_and_one_apart_from_waiting_peers_is_stuck():
    slow = moving(RANKS, [IN_FORWARD, IN_FORWARD], NONE, 31.0, FIRST_STEP_SILENCE)
    assert slow is not None and slow.kind == "slow", slow
    assert slow.line == (f"slow, not stuck: {FIRST_STEP_SILENCE} for 31 s, but no rank waits for another: every one "
                         "works in its own code (ranks 0, 1 at /tmp/x/slow.py:9 in Slow.forward)")
    assert moving(RANKS, [IN_ALL_REDUCE, IN_FORWARD], NONE, 31.0) is None  # rank 1 holds rank 0 up: a stall
    assert moving(RANKS, [AT_A_SYNC, IN_FORWARD], NONE, 31.0) is None  # so it does under NCCL, at a host sync
    assert moving(RANKS, [AT_A_SYNC, AT_A_SYNC], NONE, 31.0) is None  # every rank waits: nothing works
    assert moving(RANKS, [IN_FORWARD, "py-spy failed (exit 1): Permission denied"], NONE, 31.0) is None


def test_a_rank_in_torch_compile_while_the_others_wait_for_it_is_compiling():
    seen = moving(RANKS, [IN_ALL_REDUCE, COMPILING], NONE, 31.0)
    assert seen is not None and seen.kind == "compiling" and seen.compilers == (1,), seen
    assert "torch.compile runs on rank 1 (vm pid 101) at /tmp/x/slow.py:12 in slow_backend, while the others wait " \
           "for it in DDP's gradient all-reduce (backward)" in seen.line
    assert moving(RANKS, [COMPILING, COMPILING], NONE, 31.0).kind == "compiling"
    assert moving(RANKS, [IN_ALL_REDUCE, COMPILED_AND_STUCK], NONE, 31.0) is None  # compiled code that runs is no compile
    assert compile_limit(6) == 1800 and compile_limit(600) == 6000


def test_ranks_waiting_on_loader_workers_in_the_dataset_are_slow_and_on_idle_or_dead_ones_stuck():
    busy = [[LoaderWorker(7, IN_GETITEM)], [LoaderWorker(8, WAITS_FOR_WORK), LoaderWorker(9, IN_GETITEM)]]
    seen = moving(RANKS, [ON_LOADER, ON_LOADER], busy, 61.0, "the epoch's validation did not move")
    assert seen is not None and seen.kind == "slow" and "its loader worker at /tmp/x/big.py:5 in Big.__getitem__" in seen.line
    idle = [[LoaderWorker(7, WAITS_FOR_WORK)], [LoaderWorker(8, IN_GETITEM)]]
    assert moving(RANKS, [ON_LOADER, ON_LOADER], idle, 61.0) is None  # rank 0's batch is lost between its workers
    dead = [[LoaderWorker(7, IN_GETITEM), LoaderWorker(9, EXITED)], [LoaderWorker(8, IN_GETITEM)]]
    assert moving(RANKS, [ON_LOADER, ON_LOADER], dead, 61.0) is None
    assert moving(RANKS, [ON_LOADER, ON_LOADER], NONE, 61.0) is None  # no worker left at all
