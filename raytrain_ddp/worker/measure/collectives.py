"""What `raytrain check` runs on every rank: all-reduce and broadcast checked against known sums,
then timed at each message size, then the health check's per-node GEMM and link figures. The driver
side (driver/look/check.py) prints the verdict.

The driver imports this module to hand Ray the function, so torch is imported inside it, on the ranks.
"""

from __future__ import annotations

import socket
import time
from typing import Any

from raytrain_ddp.worker.measure.health_check import health_check


def collectives_check(loop_config: dict[str, Any]) -> None:
    """Runs on every rank: correctness of all-reduce and broadcast, then timing (rank 0 reports)."""
    import ray
    import ray.train
    import ray.train.torch
    import torch
    import torch.distributed as dist

    results, sizes, iters = loop_config["results"], loop_config["sizes"], loop_config["iters"]
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    device = ray.train.torch.get_device()
    report = {"rank": rank, "host": socket.gethostname(), "ip": ray.util.get_node_ip_address()}
    try:
        if not dist.is_initialized():
            raise RuntimeError("no process group: Ray Train did not set up torch.distributed")
        # Each rank adds rank + 1: the sum is known, and a dropped or doubled rank shows.
        x = torch.full((1024,), float(rank + 1), device=device)
        dist.all_reduce(x)
        expected = world * (world + 1) / 2
        if not torch.all(x == expected):
            raise RuntimeError(f"all-reduce gave {x[0].item()}, expected {expected}")
        y = torch.arange(1024, dtype=torch.float32, device=device) if rank == 0 else torch.zeros(1024, device=device)
        dist.broadcast(y, src=0)
        if not torch.equal(y.cpu(), torch.arange(1024, dtype=torch.float32)):
            raise RuntimeError("broadcast from rank 0 arrived corrupted")
        timings = []
        for size in sizes:
            buf = torch.ones(size // 4, device=device)
            dist.all_reduce(buf)  # warm-up: connection setup is not bandwidth
            sync(device)
            start = time.perf_counter()
            for _ in range(iters):
                dist.all_reduce(buf)
            sync(device)
            timings.append((size, (time.perf_counter() - start) / iters))
        nodes = health_check(rank, world, device)  # the same per-node figures a run's --health takes
        report.update(ok=True, backend=dist.get_backend(), timings=timings,
                      health=None if nodes is None else [node.to_json() for node in nodes])
    except Exception as err:  # report which rank and node failed, then fail the group
        report.update(ok=False, error=f"{type(err).__name__}: {err}")
        results.put(report)
        raise
    results.put(report)


def sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)
