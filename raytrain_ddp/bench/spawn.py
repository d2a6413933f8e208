"""Ranks of a benchmark without Ray: one spawned process each, on a gloo group over localhost."""

from __future__ import annotations

import queue
from typing import Any, Callable

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


def leave_group() -> None:
    """A benchmark rank's last call: the ranks leave their group together, since a rank that tears it
    down while a peer still finishes the last collective can abort at exit under load ("terminate
    called without an active exception", seen on 2 busy cores)."""
    dist.barrier()
    dist.destroy_process_group()
