"""Does the request fit the cluster? Pure arithmetic on Ray's view of the nodes (session/cluster.py:
what each has, what is free, who holds the rest), the layout of the workers over them, and the model
state per rank against the GPUs' memory. preflight.py asks; nothing here decides when to wait or refuse."""

from __future__ import annotations

import os
from typing import NamedTuple

from raytrain_ddp.config import TrainConfig
from raytrain_ddp.ray_compat.state import ENDED, local_gpu_mib


def cpu_share(workers: int, node_cpus: list[int]) -> int:
    """The most CPUs each of `workers` equal workers can have on nodes with `node_cpus` CPUs (at least 1).

    Ray's SPREAD placement then puts them over the nodes evenly: 2 workers on two 2-CPU nodes get
    a node and 2 CPUs each; 4 workers get 1 CPU each, two per node."""
    best = 1
    for cpus in range(1, max(node_cpus, default=1) + 1):
        if sum(n // cpus for n in node_cpus) >= workers:
            best = cpus
    return best


class Layout(NamedTuple):
    """How the workers sit on the nodes: the TrainConfig fields of the same names."""

    cpus_per_worker: int
    placement: str


def choose_layout(cfg: TrainConfig, node_cpus: list[int]) -> Layout:
    """--cpus-per-worker and --placement: as given, or chosen where the user left them out.

    On CPU the workers share the cluster's CPUs evenly and spread over the nodes: a worker's CPUs
    are its threads, so a node left idle is throughput lost. With --gpu the GPU is the unit and
    packing keeps NCCL on NVLink; --loader ray leaves CPUs to Ray Data's decode tasks."""
    share = not cfg.gpu and cfg.loader != "ray" and cfg.cpus_per_worker is None
    cpus = cfg.cpus_per_worker or (cpu_share(cfg.max_workers or cfg.workers, node_cpus) if share else 1)
    return Layout(cpus, cfg.placement or ("spread" if share else "pack"))


def room(cpus_per_worker: int, gpu: bool, nodes: list[dict]) -> int:
    """How many workers of `cpus_per_worker` CPUs (and a GPU each with `gpu`) `nodes` hold, each node a
    Ray resources dict: a worker never spans two nodes."""
    fits = 0
    for node in nodes:
        here = int(node.get("CPU", 0) // cpus_per_worker)
        if gpu:
            here = min(here, int(node.get("GPU", 0)))
        fits += here
    return fits


def placement_problem(workers: int, cpus_per_worker: int, gpu: bool, nodes: list[dict]) -> str | None:
    """Why `workers` workers cannot be placed on `nodes` (each a Ray resources dict), or None."""
    fits = room(cpus_per_worker, gpu, nodes)
    if fits >= workers:
        return None
    kind = "GPU" if gpu else "CPU"
    per_node = [int(n.get(kind, 0)) for n in nodes]
    total = sum(per_node)
    layout = (
        f"{len(nodes)} node{'s' if len(nodes) != 1 else ''} x {per_node[0]} {kind}s"
        if len(set(per_node)) == 1
        else " + ".join(str(c) for c in per_node) + f" {kind}s on {len(nodes)} nodes"
    )
    if gpu and total == 0:
        if os.environ.get("SLURM_JOB_ID"):
            # A Slurm site gives a job GPUs only when it asks for them, and the sbatch's Ray counts
            # only those: the fix is in the submission, not in dropping --gpu.
            each = -(-workers // len(nodes))
            return (
                f"--gpu asks for {workers} GPU{'s' if workers > 1 else ''}, but the cluster has none ({layout}): Slurm job "
                f"{os.environ['SLURM_JOB_ID']} was given no GPUs; submit it with sbatch --gpus-per-node={each} "
                f"(or --gres=gpu:{each})"
            )
        return f"--gpu asks for {workers} GPU{'s' if workers > 1 else ''}, but the cluster has none ({layout}); drop --gpu to train on CPU"
    if gpu and total < workers:
        return f"asked for {workers} GPUs, the cluster has {total}: {layout}; lower --workers or add GPU nodes"
    need = f"{workers} workers x {cpus_per_worker} CPU{'s' if cpus_per_worker > 1 else ''}"
    return (
        f"asked for {need}, the cluster fits {fits}: {layout}; lower --workers or "
        "--cpus-per-worker, add nodes, or pass --wait-for-resources SECONDS for nodes still joining"
    )


def amount(n: float, kind: str) -> str:
    return f"{n:g} {kind}{'s' if n != 1 else ''}"


def busy_problem(workers: int, cpus_per_worker: int, gpu: bool, nodes: list[dict], groups: list[dict],
                 max_workers: int | None = None, waited: float = 0.0) -> str | None:
    """Why `workers` workers, which the cluster's nodes hold (placement_problem), cannot start on what
    is free now, and who holds the rest where Ray can tell; None when they fit.

    `nodes`: each live node as {"id", "ip", "total", "free"} (Ray resources dicts), or one record for
    the whole cluster (id and ip "") where Ray tells no more; `groups`: the values of
    ray.util.placement_group_table(), each with its "creator" in words where known (placement_groups).
    `max_workers`: an elastic run's MAX (it starts at `workers`);
    `waited`: the seconds of --wait-for-resources already spent."""
    fits = room(cpus_per_worker, gpu, [n["free"] for n in nodes])
    if fits >= workers:
        return None
    # With --gpu, a worker needs a CPU too: say what is short
    kind = "GPU" if gpu and sum(int(n["free"].get("GPU", 0)) for n in nodes) < workers else "CPU"
    held = {n["id"]: n["total"].get(kind, 0) - n["free"].get(kind, 0) for n in nodes}
    # A placement group holds its bundles from its creation to its removal, used or not: another
    # Ray Train run's workers, or a job that reserved them. Ours has none yet: preflight comes first.
    grouped: dict[str, float] = {}
    holders, creators, orphaned = 0, set(), 0.0
    for group in groups:
        if group.get("state") != "CREATED":
            continue
        placed = group.get("bundles_to_node_id", {})
        here = [(placed.get(i), bundle.get(kind, 0)) for i, bundle in group.get("bundles", {}).items()]
        here = [(node, n) for node, n in here if node and n]
        holders += bool(here)
        if here:
            creators.add(group.get("creator") or "another job or run")
            orphaned += sum(n for _, n in here) if ENDED in (group.get("creator") or "") else 0
        for node, n in here:
            grouped[node] = grouped.get(node, 0) + n
    # The rest of what is held, tasks and actors hold outside any placement group.
    loose = {node: n - grouped.get(node, 0) for node, n in held.items() if n > grouped.get(node, 0)}
    if "" in held:  # one record for the whole cluster: only the sums are known
        loose = {"": n} if (n := held[""] - sum(grouped.values())) > 0 else {}
    ips = {n["id"]: n["ip"] for n in nodes}

    def where(node_ids: list[str]) -> str:
        named = sorted({ips[node] for node in node_ids if ips.get(node)})
        if not named:
            return f" on {len(node_ids)} node{'s' if len(node_ids) != 1 else ''}" if any(node_ids) else ""
        more = f" and {len(named) - 3} more nodes" if len(named) > 3 else ""
        return " on " + ", ".join(named[:3]) + more

    def is_held(n: float) -> str:
        return f"{amount(n, kind)} {'is' if n == 1 else 'are'} held"

    who = []
    if in_groups := min(sum(grouped.values()), sum(held.values())):
        plural = "s" if holders != 1 else ""
        made = "; ".join(sorted(creators))  # the job of each: one that has ended should have freed it
        who.append(f"{is_held(in_groups)} by {holders} placement group{plural} ({made}){where(list(grouped))}")
    if n := sum(loose.values()):
        who.append(f"{f'{n:g}' if who else is_held(n)} by other jobs' tasks or actors{where(list(loose))}")
    free = sum(n["free"].get(kind, 0) for n in nodes)
    now = f"only {amount(free, kind)} {'is' if free == 1 else 'are'} free now" if free else f"no {kind} is free now"
    if kind == "CPU" and cpus_per_worker > 1 and free:
        now += f", room for {fits} worker{'s' if fits != 1 else ''}"
    need = f"{workers} worker{'s' if workers != 1 else ''} x {amount(cpus_per_worker, 'CPU')}"
    if gpu:
        need = f"{workers} GPUs" + (f" and {amount(cpus_per_worker, 'CPU')} each" if kind == "CPU" else "")
    if max_workers:
        need = f"at least {need} (the elastic run's MIN)"
    wait = f"wait longer than --wait-for-resources {waited:g}" if waited else "wait with --wait-for-resources SECONDS"
    if orphaned:  # no wait frees those: Ray's GCS let them outlive their job (ray_compat.controller)
        freed = ("Ray never frees a placement group whose job has ended: remove it "
                 "(ray.util.remove_placement_group) or restart Ray")
        wait = freed if orphaned >= sum(held.values()) else f"{freed}; or {wait}"
    lower = f", or lower --workers to {fits}{f':{max_workers}' if max_workers else ''}" if fits else ""
    return f"asked for {need}; the cluster has them, but {now}{': ' + ', '.join(who) if who else ''}; {wait}{lower}"


GPU_MEMORY_GIB = {
    "K80": 12, "P4": 8, "P100": 16, "V100": 32, "T4": 16, "A10G": 24, "L4": 24, "L40S": 48,
    "A100": 80, "A100-40G": 40, "A100-80G": 80, "H100": 94, "H200": 141, "H20": 141,
    "B200": 192, "GB200": 192, "B300": 288, "GB300": 288, "RTX-PRO-6000": 96,
}
"""Memory of one GPU of each of Ray's accelerator_type labels, the largest where a label covers
several sizes (V100 16/32, A100 40/80, H100 80/94): an upper bound, so a refusal on it is never wrong."""


def gpu_mib(nodes: list[dict], local: bool) -> tuple[float, str] | None:
    """(MiB, what it is) of the smallest GPU the run may get, or None if unknown: measured on this
    machine for a local run, else from the accelerator_type labels Ray gives GPU nodes."""
    if local and (measured := local_gpu_mib()):
        return measured, "this machine's GPUs"
    sizes = []
    for node in nodes:
        if not node.get("GPU"):
            continue
        labels = [key.split(":", 1)[1] for key in node if key.startswith("accelerator_type:")]
        known = [(GPU_MEMORY_GIB[label] * 1024, label) for label in labels if label in GPU_MEMORY_GIB]
        if not known:
            return None  # a GPU of unknown size: nothing certain to say
        sizes.append(min(known))  # "A100" and "A100-40G" on one node: the exact one is the smaller
    if not sizes:
        return None
    mib, label = min(sizes)
    return mib, f"the cluster's {label} GPUs"


def ranks_per_node(cfg: TrainConfig, nodes: list[dict]) -> int | None:
    """How many ranks a node will hold, as the placement puts them; None without the nodes."""
    fits = [int(n.get("GPU", 0)) if cfg.gpu else int(n.get("CPU", 0) // (cfg.cpus_per_worker or 1)) for n in nodes]
    fits = [f for f in fits if f > 0]
    if not fits:
        return None
    if cfg.placement == "spread":
        return min(-(-cfg.workers // len(fits)), max(fits))
    return min(cfg.workers, max(fits))


def size(mib: float) -> str:
    """MiB as a person reads them: 1.5 GiB, 300 MiB, 2.5 MiB, 120 KiB, 240 bytes."""
    if mib < 1 / 1024:
        return f"{mib * 1024 * 1024:.0f} bytes"
    if mib < 0.1:
        return f"{mib * 1024:.0f} KiB"
    return f"{mib / 1024:.1f} GiB" if mib >= 1024 else f"{mib:.0f} MiB" if mib >= 10 else f"{mib:.1f} MiB"
