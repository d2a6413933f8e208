"""How a rank's DataLoader workers start (worker_start): from a forkserver, not forked from the rank."""

from __future__ import annotations

import importlib
import multiprocessing
import multiprocessing.forkserver
import pickle
from multiprocessing.context import BaseContext
from typing import Any

PRELOAD = ["torch", "raytrain_ddp.data.torch_ingest"]
"""What the forkserver imports once, so that each loader worker it forks starts in milliseconds."""
COPY_LIMIT = 256 * 2**20
"""The most pickled bytes of data a forkserver's worker may receive: each worker gets its own copy
(a fork's share the rank's pages), so a dataset held in memory (Parquet's images) above it keeps fork."""


def worker_start(datasets: list[Any]) -> BaseContext:
    """How this rank's DataLoader workers start: forked from a forkserver, a fresh single-threaded
    process, not from the rank. A rank is a Ray worker running many threads (Ray's gRPC and event
    loops, gloo's, Ray Train's), and a fork copies every lock one of them holds at that moment, held
    for good in the child: such a loader worker hangs at its start (seen in torch.manual_seed, on the
    default generator's mutex), and its rank waits on it until the stall watch ends the run.
    A dataset that does not pickle (a lambda in it) cannot reach a forkserver's worker, and one that
    pickles to more than COPY_LIMIT would cost each worker a copy: those keep fork."""
    sizes = [pickled_size(dataset) for dataset in datasets]
    imports = sorted({module for dataset in datasets for module in getattr(dataset, "worker_imports", ())})
    if None in sizes or sum(sizes) > COPY_LIMIT:
        for module in imports:  # here, once: every forked worker has it then
            importlib.import_module(module)
        return multiprocessing.get_context("fork")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD + imports)  # no effect once this rank's forkserver runs: the same list
    # Started now, not at the first batch: its import of torch (3 s, more on a loaded machine) then
    # runs while the rank builds its model and resumes. It takes this process's sys.path as it is now,
    # with the directory of a --dataset module already on it.
    multiprocessing.forkserver.ensure_running()
    return context


class Counter:
    """A file that keeps nothing, only counts: pickled_size() holds no copy of the dataset."""

    def __init__(self) -> None:
        self.size = 0

    def write(self, data: bytes) -> int:
        self.size += len(data)
        return len(data)


def pickled_size(dataset: Any) -> int | None:
    """The bytes `dataset` pickles to, as a forkserver's worker receives it; None when it does not
    pickle (a lambda or a local class in it)."""
    counter = Counter()
    try:
        pickle.Pickler(counter, protocol=pickle.HIGHEST_PROTOCOL).dump(dataset)
    except Exception:  # PicklingError, AttributeError, TypeError: whatever the dataset's parts raise
        return None
    return counter.size
