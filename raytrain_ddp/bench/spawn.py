"""Ranks of a benchmark without Ray: one spawned process each, on a gloo group over localhost."""

from __future__ import annotations

import os
import queue
import sys
from typing import Any, Callable, NoReturn

import torch.distributed as dist
import torch.multiprocessing as mp

from raytrain_ddp.net import free_port


def run_ranks(target: Callable[..., None], ranks: int, *args: Any) -> tuple[Any, list[int | None]]:
    """`target(rank, port, *args, out)` on each rank; returns what rank 0 put on `out` (None if no
    rank did), and every rank's exit code."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port("127.0.0.1")
    procs = [ctx.Process(target=target, args=(r, port, *args, out)) for r in range(ranks)]
    for p in procs:
        p.start()
    result = None
    while result is None and not any(p.exitcode for p in procs):
        try:
            result = out.get(timeout=5)
        except queue.Empty:  # a rank that died (killed for memory, say) would leave us waiting forever
            pass
    for p in procs:
        p.join(timeout=None if result else 30)
        if p.is_alive():
            p.kill()
    return result, [p.exitcode for p in procs]


def leave_group(*queues: Any) -> NoReturn:
    """A rank's last call, once its results are out (on `queues`, or printed): leave the group with
    the others, then exit without the interpreter's teardown. A DDP or FSDP model still holds the
    group after destroy_process_group, and its gloo work, torn down while the interpreter finalizes,
    aborts the process now and then on a loaded machine ("terminate called without an active
    exception"), a barrier before it or not."""
    for out in queues:  # what was put must reach the parent: the queue's feeder thread dies with os._exit
        out.close()
        out.join_thread()
    sys.stdout.flush()
    sys.stderr.flush()
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)
