"""The stall watch (doctor/stall_watch.py, read by doctor/diagnosis.py) on a rank whose DataLoader worker hangs: the report holds the
loader workers' stacks, and one line names the worker that is stuck and where."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import raytrain

from raytrain_ddp.doctor.diagnosis import EXITED, LoaderWorker, loader_finding, loader_place
from raytrain_ddp.doctor.stacks import is_zombie, loader_workers

BLOCKS_PY = """\
import os
import threading

import torch
from torch.utils.data import Dataset


class Blocks(Dataset):
    def __init__(self, split, image_size):
        self.split, self.image_size = split, image_size

    def __len__(self):
        return 128 if self.split == "train" else 32

    def __getitem__(self, index):
        if self.split == "val" and os.environ.get("RANK") == "1":
            threading.Event().wait()  # the fault: rank 1's validation loader worker never answers
        return torch.zeros(3, self.image_size, self.image_size), index % 2


def blocks(split, data_dir, image_size):
    return Blocks(split, image_size)
"""
BLOCK_LINE = 17
"""blocks.py's line of the wait, where the stuck loader worker's stack stands."""


@pytest.mark.e2e
def test_a_validation_loader_worker_stuck_on_one_rank_is_named_with_its_stack(ray_head, tmp_path: Path):
    (tmp_path / "blocks.py").write_text(BLOCKS_PY)
    try:
        proc = raytrain(
            "run", "--dataset", "blocks:blocks", "--num-classes", "2", "--image-size", "8", "--workers", "2",
            "--epochs", "1", "--batch-size", "16", "--data-workers", "1", "--progress", "plain",
            "--stall-timeout", "10", "--storage-path", str(tmp_path / "runs"), "--name", "stuck",
            env=ray_head.env, cwd=tmp_path, timeout=240,
        )
    except subprocess.TimeoutExpired:
        pytest.fail("the run hung: no stall was detected")
    assert proc.returncode == 1, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: the run stalled (the epoch's validation did not move"), proc.stderr[-3000:]
    at = f"blocks.py:{BLOCK_LINE} in Blocks.__getitem__"
    assert "rank 1's loader worker" in last and at in last, last
    assert "rank 0's loader worker" not in last, last  # rank 0's workers wait for work: no finding
    stall = tmp_path / "runs" / "stuck" / "stall"
    stuck = [path for path in stall.glob("rank1-loader-worker*.txt") if at.split(" in ")[0] in path.read_text()]
    assert len(stuck) == 1, sorted(p.name for p in stall.iterdir())
    assert sorted(p.name for p in stall.glob("rank0-loader-worker*.txt")), "rank 0's loader workers have no stacks"
    pid = int(last.split("rank 1's loader worker ")[1].split("(pid ")[1].split(")")[0])
    deadline = time.monotonic() + 10  # killed with its rank; init reaps it a moment later
    while os.path.exists(f"/proc/{pid}") and not is_zombie(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not os.path.exists(f"/proc/{pid}") or is_zombie(pid), f"the stuck loader worker {pid} outlived the run"


IDLE = """Process 7: python
Thread 7 (idle): "MainThread"
    poll (/usr/lib/python3.11/multiprocessing/connection.py:257)
    get (/usr/lib/python3.11/multiprocessing/queues.py:113)
    _worker_loop (/x/site-packages/torch/utils/data/_utils/worker.py:302)
"""
IN_DATASET = """Process 8: python
Thread 8 (idle): "MainThread"
    wait (/usr/lib/python3.11/threading.py:327)
    __getitem__ (/tmp/blocks.py:17)
    fetch (/x/site-packages/torch/utils/data/_utils/fetch.py:52)
    _worker_loop (/x/site-packages/torch/utils/data/_utils/worker.py:349)
"""
WAITS_ON_LOADER = """Process 5: ray::RayTrainWorker
Thread 5 (idle): "train"
    _try_get_data (/x/site-packages/torch/utils/data/dataloader.py:1133)
    __iter__ (/x/raytrain_ddp/data/batches.py:47)
    evaluate (/x/raytrain_ddp/worker/epoch_metrics.py:29)
"""
IN_ALL_REDUCE = """Process 4: ray::RayTrainWorker
Thread 4 (idle): "train"
    all_reduce (/x/site-packages/torch/distributed/distributed_c10d.py:2800)
    evaluate (/x/raytrain_ddp/worker/epoch_metrics.py:45)
"""


def test_a_loader_worker_reads_as_waiting_for_work_in_the_dataset_or_gone():
    assert loader_place(IDLE) == "waits for work"
    assert loader_place(IN_DATASET) == "is at /tmp/blocks.py:17 in __getitem__"
    assert loader_place(EXITED).startswith("has exited")
    idle, busy, gone = LoaderWorker(7, IDLE), LoaderWorker(8, IN_DATASET), LoaderWorker(9, EXITED)
    assert loader_finding([IN_ALL_REDUCE, WAITS_ON_LOADER], [[idle], [idle, busy]]) == \
        "rank 1's loader worker 1 (pid 8) is at /tmp/blocks.py:17 in __getitem__"
    assert loader_finding([WAITS_ON_LOADER], [[gone]]) == \
        "rank 0's loader worker 0 (pid 9) has exited (a zombie its rank has not reaped)"
    assert loader_finding([WAITS_ON_LOADER], [[]]) == "rank 0 waits on its loader, which has no worker process left"
    assert loader_finding([WAITS_ON_LOADER], [[idle, idle]]) == \
        "rank 0 waits on its loader, whose 2 workers all wait for work"
    assert loader_finding([IDLE.replace("worker.py", "other.py")], [[]]) is None


LOADS_PY = """\
import threading
import time

import torch
from torch.utils.data import DataLoader, Dataset


class Blocks(Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, index):
        if index == 1:
            threading.Event().wait()  # worker 1's first sample never comes back
        return torch.zeros(2)


if __name__ == "__main__":
    loader = DataLoader(Blocks(), batch_size=1, num_workers=2)
    print("started", flush=True)
    for _ in loader:  # waits for good at sample 1
        pass
"""


def test_a_process_s_loader_workers_are_found_under_it_with_their_stacks(tmp_path: Path):
    """Real processes: a script whose DataLoader's worker 1 blocks. (A forkserver's workers, a rank's
    grandchildren, are found in the run above.)"""
    (tmp_path / "loads.py").write_text(LOADS_PY)
    proc = subprocess.Popen([sys.executable, str(tmp_path / "loads.py")], stdout=subprocess.PIPE, text=True)
    found: list[LoaderWorker] = []
    stuck = f"is at {tmp_path / 'loads.py'}:14 in Blocks.__getitem__"
    try:
        assert proc.stdout.readline() == "started\n"
        deadline = time.monotonic() + 120
        while sorted(places := [loader_place(w.stack) for w in found]) != [stuck, "waits for work"]:
            assert time.monotonic() < deadline, places
            time.sleep(1)
            found = loader_workers(proc.pid)
    finally:
        for worker in found:  # the stuck one would outlive the script
            os.kill(worker.pid, signal.SIGKILL)
        proc.kill()
        proc.wait()
