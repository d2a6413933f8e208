"""The pre-flight health check on the ranks, once the process group is up and before any data or
model: every rank times a short GEMM, then each node's first rank times exchanges with a few other
nodes' first ranks, in disjoint pairs, one round at a time. Rank 0 returns the per-node records;
doctor/health.py judges them.

A plain ring all-reduce takes as long as its slowest link, on every rank, so it cannot say which node
is slow; a pair exchange involves two nodes only, and a node with one sound partner shows a sound link.

torch is imported inside the functions, as worker/measure/collectives.py does: `raytrain check` hands this
module to Ray from the driver.
"""

from __future__ import annotations

import os
import socket
import statistics
import time
from pathlib import Path
from typing import Any

from raytrain_ddp.doctor.health import NodeHealth, best_of, slow_nodes

ROUNDS = 3
"""Pairings each node's first rank times (fewer with fewer nodes): with two or more, a sound node
meets at least one sound partner beside a slow one."""
GEMM_S = 0.3
"""About how long each rank's timed GEMMs run, after one warm-up."""
SAMPLE_S = 0.1
"""On a CPU, each timed sample runs GEMMs for at least this long, a CPU quota's whole period (CFS's
is 100 ms): a rank held to a share of a core by a cgroup (a container's CPU limit) then shows its
share, where a sample shorter than the period could run in the burst that the quota allows first."""
EXCHANGE_MIB = {False: 4, True: 64}
"""The message each side of a pair sends per exchange, on CPU (gloo) and on GPU (NCCL): MiB."""
EXCHANGES = 5
"""Timed exchanges per pairing, after one that sets up the connection."""


def health_check(rank: int, world_size: int, device: Any) -> list[NodeHealth] | None:
    """Run the check on this rank; every rank must call it. Rank 0 gets the nodes (by Ray's node IP),
    in the order of their first rank; the others None.

    A pass that finds a node slow is timed once more, and each node keeps its better figures of
    the two (doctor/health.py's best_of): a node another process held back for a moment is not
    named, while a throttled GPU or a taken core is slow both times."""
    import torch.distributed as dist

    nodes = measure(rank, world_size, device)
    again = [rank == 0 and bool(slow_nodes(nodes))]
    if world_size > 1:
        dist.broadcast_object_list(again, src=0)
    if again[0]:
        second = measure(rank, world_size, device)
        if rank == 0:
            nodes = best_of(nodes, second)
    return nodes


def measure(rank: int, world_size: int, device: Any) -> list[NodeHealth] | None:
    """One pass of the check: every rank's GEMM, then the node leaders' exchanges; rank 0 gets the nodes."""
    import ray
    import torch
    import torch.distributed as dist

    gpu = device.type == "cuda"
    mine = {"rank": rank, "host": socket.gethostname(), "machine": machine_id(), "ip": ray.util.get_node_ip_address(),
            "gflops": gemm_gflops(device), "threads": 0 if gpu else torch.get_num_threads(),
            "cores": sorted(os.sched_getaffinity(0))}
    everyone = [mine] * world_size
    if world_size > 1:
        dist.all_gather_object(everyone, mine)
    nodes: dict[str, list[dict[str, Any]]] = {}
    for record in everyone:
        nodes.setdefault(record["ip"], []).append(record)
    leaders = [ranks[0]["rank"] for ranks in nodes.values()]
    best = link_gbps(rank, leaders, device) if len(leaders) > 1 else None
    links = [best] * world_size
    if world_size > 1:
        dist.all_gather_object(links, best)
    if rank != 0:
        return None
    return [
        NodeHealth(host=ranks[0]["host"], ip=ip_, ranks=tuple(r["rank"] for r in ranks),
                   gemm_gflops=round(min(r["gflops"] for r in ranks), 2),
                   link_gbps=None if links[ranks[0]["rank"]] is None else round(links[ranks[0]["rank"]], 3),
                   gpu=gpu, shared_cores=shares_cores(ranks, everyone))
        for ip_, ranks in nodes.items()
    ]


def machine_id() -> str:
    """This machine as its kernel knows it: the boot id, the same in every container and network
    namespace on it, whose hostnames differ (KubeRay's pods on one host, the Slurm testbed's nodes);
    the hostname where there is no /proc."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return socket.gethostname()


def shares_cores(node: list[dict[str, Any]], everyone: list[dict[str, Any]]) -> bool:
    """Whether a node's ranks, with every rank of its machine that may run on the same cores (Ray
    nodes side by side on one machine, in containers or not), run more threads than those cores."""
    cores = {core for rank in node for core in rank["cores"]}
    near = [r for r in everyone if r["machine"] == node[0]["machine"] and cores & set(r["cores"])]
    return sum(r["threads"] for r in near) > len(cores.union(*(r["cores"] for r in near)))


def before_training(mode: str, sink: Any, rank: int, world_size: int, device: Any) -> bool:
    """The run's check (--health warn or exclude): rank 0 hands the nodes to the driver's sink, and the
    driver names a slow one; False on every rank when the run must not train (exclude, a node named)."""
    import ray
    import torch.distributed as dist

    nodes = health_check(rank, world_size, device)
    train_on = [True]
    if rank == 0:
        ray.get(sink.health.remote([node.to_json() for node in nodes]))  # waited: the driver must see why they leave
        train_on = [mode != "exclude" or not slow_nodes(nodes)]
    if world_size > 1:
        dist.broadcast_object_list(train_on, src=0)
    return train_on[0]


def gemm_gflops(device: Any) -> float:
    """This rank's median GEMM rate over about GEMM_S: fp32 on CPU, bf16 on GPU (its tensor cores)."""
    import torch

    gpu = device.type == "cuda"
    n, per_rep = (8192, 10) if gpu else (512, 4)
    dtype = torch.bfloat16 if gpu else torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    torch.mm(a, b)  # warm-up: cuBLAS's handle, the CPU's thread pool
    sync(device)
    rates, began = [], time.perf_counter()
    while len(rates) < 3 or (time.perf_counter() - began < GEMM_S and len(rates) < 50):
        start, reps = time.perf_counter(), 0
        while reps < per_rep or (not gpu and time.perf_counter() - start < SAMPLE_S):  # a GPU's sync ends the sample
            torch.mm(a, b)
            reps += 1
        sync(device)
        rates.append(2 * n**3 * reps / (time.perf_counter() - start) / 1e9)
    return statistics.median(rates)


def pairings(count: int, rounds: int = ROUNDS) -> list[list[tuple[int, int]]]:
    """Up to `rounds` rounds of disjoint pairs among `count` nodes, no pair twice (the circle method
    of a round-robin; with an odd count one node sits each round out)."""
    slots = list(range(count)) + ([None] if count % 2 else [])
    out = []
    for _ in range(min(rounds, len(slots) - 1)):
        half = len(slots) // 2
        pairs = [(slots[i], slots[-1 - i]) for i in range(half)]
        out.append([(a, b) for a, b in pairs if a is not None and b is not None])
        slots = [slots[0], slots[-1], *slots[1:-1]]  # keep the first, turn the rest
    return out


def link_gbps(rank: int, leaders: list[int], device: Any) -> float | None:
    """This node's best exchange rate with its partners, on a node's first rank (None elsewhere).
    Every rank walks the rounds, so the barrier between them keeps each round's pairs alone."""
    import torch
    import torch.distributed as dist

    size = EXCHANGE_MIB[device.type == "cuda"] << 20
    out = torch.ones(size // 4, device=device)
    into = torch.empty_like(out)
    rates = []
    for pairs in pairings(len(leaders)):
        for a, b in pairs:
            if rank in (leaders[a], leaders[b]):
                peer = leaders[b] if rank == leaders[a] else leaders[a]
                exchange(out, into, peer)  # sets up the pair's connection (NCCL: its communicator)
                sync(device)
                start = time.perf_counter()
                for _ in range(EXCHANGES):
                    exchange(out, into, peer)
                sync(device)
                rates.append(2 * size * EXCHANGES / (time.perf_counter() - start) / 1e9)
        dist.barrier()
    return max(rates) if rates else None


def exchange(out: Any, into: Any, peer: int) -> None:
    import torch.distributed as dist

    ops = [dist.P2POp(dist.isend, out, peer), dist.P2POp(dist.irecv, into, peer)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()


def sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)
