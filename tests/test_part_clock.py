"""The part clock (worker/measure/part_clock.py) on a real DDP model in a one-rank process group: the parts
add up to the micro-batches' time, and the last gradient's hook splits backward from DDP's communication. On a
GPU (NCCL, CUDA events) too, where there is one."""

from __future__ import annotations

import multiprocessing
import os
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from raytrain_ddp.worker.measure.part_clock import PARTS, PartClock, run_queue_s
from raytrain_ddp.worker.step import forward_backward

DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (CI has none)")])]


@pytest.mark.parametrize("device", DEVICES)
def test_the_parts_add_up_and_only_a_synced_backward_has_communication(device: str, tmp_path):
    dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=f"file://{tmp_path}/store",
                            rank=0, world_size=1)
    try:
        model = DistributedDataParallel(nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 4)).to(device))
        parts = PartClock(model, torch.device(device), loader_workers=2)
        parts.new_pass(6)
        scaler = torch.amp.GradScaler("cuda", enabled=False)
        x, y = torch.randn(512, 64, device=device), torch.randint(4, (512,), device=device)
        parts.waited(0.25)
        start = time.perf_counter()
        for _ in range(5):
            forward_backward(model, x, y, None, scaler, 0.0, weight=1.0, sync=True, parts=parts)
        took = time.perf_counter() - start
        synced = dict(zip(PARTS, parts.seconds()))
        assert synced["data"] == 0.25
        assert synced["forward"] > 0 and synced["backward"] > 0 and synced["comm"] > 0, synced
        timed = synced["forward"] + synced["backward"] + synced["comm"]
        assert timed <= took and (device == "cuda" or timed >= 0.5 * took), (synced, took)

        forward_backward(model, x, y, None, scaler, 0.0, weight=1.0, sync=False, parts=parts)  # no_sync: no all-reduce
        unsynced = dict(zip(PARTS, parts.seconds()))
        more_backward, more_comm = unsynced["backward"] - synced["backward"], unsynced["comm"] - synced["comm"]
        assert more_backward > 0 and 0 <= more_comm < more_backward, (synced, unsynced)
        assert len(parts.hooks) == 1  # after the first backward, only the last gradient's hook is left

        [mine] = parts.gather(torch.device(device))
        assert mine["data"] == 0.25
        # the 6 micro-batches in 8 windows, whose seconds add up to the pass's
        assert mine["window_steps"] == [1, 1, 1, 0, 1, 1, 1, 0]
        for i, part in enumerate(PARTS):
            assert sum(window[i] for window in mine["windows"]) == pytest.approx(mine[part], abs=1e-3), (part, mine)
        assert mine["threads"] == torch.get_num_threads() and mine["loader_workers"] == 2 and mine["cores"] >= 1
        assert len(mine["queued"]) == 8 and all(q >= 0 for q in mine["queued"]) and mine["gpu"] == (device == "cuda")
        parts.new_pass(6)
        assert parts.seconds() == [0.0, 0.0, 0.0, 0.0]
    finally:
        dist.destroy_process_group()


def hog(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


@pytest.mark.skipif(not os.path.exists("/proc/thread-self/schedstat"), reason="no schedstat in this kernel")
def test_the_run_queue_wait_is_the_time_this_thread_waited_for_a_core():
    """Busy on every core plus one, for 1.5 s: this thread waits for a core part of that time."""
    cores = len(os.sched_getaffinity(0))
    hogs = [multiprocessing.get_context("spawn").Process(target=hog, args=(3.0,)) for _ in range(cores)]
    for p in hogs:
        p.start()
    try:
        time.sleep(1.0)  # the hogs are up
        before = run_queue_s()
        hog(1.5)
        waited = run_queue_s() - before
    finally:
        for p in hogs:
            p.terminate()
            p.join()
    assert 0.2 < waited < 1.5, waited
