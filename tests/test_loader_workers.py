"""How a rank's DataLoader workers start (data/loader_workers.py): not by a fork of the rank, whose other
threads' locks a fork would copy held."""

from __future__ import annotations

import os
import signal
import threading
import time

import held_lock
import pytest
import torch
from torch.utils.data import TensorDataset

from raytrain_ddp.config import TrainConfig
from raytrain_ddp.data.loader_workers import COPY_LIMIT, pickled_size, worker_start
from raytrain_ddp.data.registry import Data
from raytrain_ddp.data.torch_ingest import torch_loaders


def test_a_lock_another_thread_holds_while_the_workers_start_does_not_hang_them():
    """The fault of issue 39 item 6, made certain: a thread holds a lock the dataset takes, just while
    the validation loader starts its workers. A forked worker's copy of the lock stays held for good."""
    cfg = TrainConfig(data_workers=2, batch_size=4)
    loaders = torch_loaders(cfg, 0, 1, False, lambda cfg: Data(held_lock.TakesTheLock(), held_lock.TakesTheLock(), 3))
    held_lock.LOCK.acquire()
    got: list[int] = []
    reader = threading.Thread(target=lambda: got.extend(len(labels) for _, labels in loaders.val), daemon=True)
    reader.start()
    time.sleep(3)  # the workers start (fork: with the lock held) while this thread holds it
    held_lock.LOCK.release()
    reader.join(timeout=60)
    workers = [w.pid for w in getattr(loaders.val.source, "_iterator", None)._workers]
    if reader.is_alive():
        for pid in workers:  # stuck for good: end them, or they outlive the test
            os.kill(pid, signal.SIGKILL)
        pytest.fail(f"the validation loader's workers {workers} hang on a lock held when they started")
    assert got == [4, 4]


def test_a_dataset_that_does_not_pickle_or_is_big_keeps_fork():
    tensors = TensorDataset(torch.zeros(4, 3), torch.zeros(4))
    assert pickled_size(tensors) > 0 and worker_start([tensors, tensors]).get_start_method() == "forkserver"
    big = TensorDataset(torch.zeros(COPY_LIMIT // 4 + 1))  # float32: just over the limit
    assert worker_start([big]).get_start_method() == "fork"  # a copy in every worker
    tensors.transform = lambda x: x  # what a forkserver's worker cannot receive
    assert pickled_size(tensors) is None and worker_start([tensors]).get_start_method() == "fork"
