"""Cluster plumbing shared by `raytrain run` and `raytrain launch`: the run directory, connecting to
Ray, checking that the request fits, choosing the workers' layout, and Ray Train's configs."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import re
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Iterator

from raytrain_ddp.config import ConfigError, TrainConfig
from raytrain_ddp.ray_compat import has
from raytrain_ddp.ray_compat.state import (
    cluster_ray_version,
    free_resources_per_node,
    local_gpu_mib,
    quiet_ray_notices,
)


def resolve_run(cfg: TrainConfig) -> tuple[TrainConfig, Path]:
    """Fill in the run name and return the run directory, <storage-path>/<name>."""
    if cfg.name is None:
        cfg = dataclasses.replace(cfg, name=time.strftime("run-%Y%m%d-%H%M%S"))
    storage = Path(cfg.storage_path).expanduser().absolute()
    # Ray needs an absolute path: workers on other nodes do not share the driver's cwd.
    cfg = dataclasses.replace(cfg, storage_path=str(storage))
    return cfg, storage / cfg.name


def check_writable(run_dir: Path) -> None:
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / ".write-probe"
        probe.write_text("")
        probe.unlink()
    except OSError as err:
        raise ConfigError(
            f"cannot write run directory {run_dir} ({err.strerror}); pass a writable --storage-path"
        ) from None


def ray_address(cfg: TrainConfig) -> str | None:
    return cfg.address or os.environ.get("RAY_ADDRESS") or None


def connect(cfg: TrainConfig, runtime_env: dict[str, Any] | None = None) -> None:
    """Join (or start) the Ray cluster. `runtime_env` is the job's, for all its workers: Ray ships a
    local directory (the user's code) only when the connection is made with it."""
    import ray

    if ray.is_initialized():  # `raytrain scale` runs several trainings on one connection
        return
    address = ray_address(cfg)
    quiet = dict(
        logging_level=logging.INFO if cfg.verbose else logging.WARNING,
        log_to_driver=cfg.verbose,
    )
    if address is None:
        # "local" forces a new private cluster; None or "auto" would attach to whatever Ray this
        # machine last started, which may be another user's or another job's.
        if not cfg.verbose:
            quiet_ray_notices()
        ray.init(
            address="local",
            include_dashboard=False,
            _temp_dir=os.path.join(tempfile.gettempdir(), f"raytrain-{os.getuid()}"),
            **quiet,
        )
        return
    if address == "auto":
        raise ConfigError("--address auto could join someone else's Ray; give the cluster's host:port")
    check_reachable(address)
    if os.environ.get("RAY_AUTH_TOKEN_PATH") or os.environ.get("RAY_AUTH_TOKEN"):
        # A driver that names an address does not turn token auth on by itself, even with a token.
        os.environ.setdefault("RAY_AUTH_MODE", "token")
    with stderr_captured(not cfg.verbose) as log:
        # Before ray.init: across releases it may not get far enough to say (a 2.52 driver retries,
        # for most of a minute, a key a 2.60 cluster no longer writes); a driver must run the cluster's Ray.
        theirs = None if address.startswith("ray://") else cluster_ray_version(address)
        if theirs and (mismatch := version_mismatch(address, theirs, ray.__version__)):
            raise ConfigError(mismatch)
        try:
            ray.init(address=address, runtime_env=runtime_env, **quiet)
            return
        except (ConnectionError, RuntimeError) as err:
            if mismatch := ray_mismatch(address, str(err)):
                raise ConfigError(mismatch) from None
            reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            refused = log is not None and "InvalidAuthToken" in log.read_text(errors="replace")
    if refused:
        raise ConfigError(
            f"the Ray cluster at {address} refused our auth token; set RAY_AUTH_TOKEN_PATH to "
            "the cluster's token file (and RAY_AUTH_MODE=token)"
        )
    raise ConfigError(
        f"cannot connect to the Ray cluster at {address} ({reason}); check --address or "
        "$RAY_ADDRESS, and for a token-secured cluster RAY_AUTH_MODE=token and RAY_AUTH_TOKEN_PATH"
    )


RAY_MISMATCH = re.compile(r"started with:\s+Ray: (\S+)\s+Python: (\S+)\s+This process .*? started with:\s+Ray: (\S+)\s+Python: (\S+)", re.S)
"""Ray's refusal of a driver whose Ray or Python differs from the cluster's (ray._private.utils.check_version_info)."""


def version_mismatch(address: str, cluster_ray: str, driver_ray: str) -> str | None:
    """The one line for a driver whose Ray is not the cluster's, or None when they match."""
    if cluster_ray == driver_ray:
        return None
    return (
        f"the Ray cluster at {address} runs Ray {cluster_ray}, and this driver Ray {driver_ray}; a driver "
        f"must run the cluster's exact Ray: pip install 'ray[default,train]=={cluster_ray}'"
    )


def ray_mismatch(address: str, refusal: str) -> str | None:
    """Ray's page-long version refusal (ray.init), as one line that names the fix; None for any other error."""
    found = RAY_MISMATCH.search(refusal)
    if found is None:
        return None
    cluster_ray, cluster_python, driver_ray, driver_python = found.groups()
    return version_mismatch(address, cluster_ray, driver_ray) or (
        f"the Ray cluster at {address} runs Python {cluster_python}, and this driver Python {driver_python}; "
        f"Ray needs the same: run raytrain from a Python {cluster_python} environment"
    )


@contextlib.contextmanager
def stderr_captured(enabled: bool) -> Iterator[Path | None]:
    """Send fd 2 to a file: Ray's C++ core logs each connection retry there, a line a second."""
    if not enabled:
        yield None
        return
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.NamedTemporaryFile(prefix="raytrain-connect-", suffix=".log") as log:
        os.dup2(log.fileno(), 2)
        try:
            yield Path(log.name)
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)


def check_reachable(address: str, timeout_s: float = 5.0) -> None:
    """Ray retries an unreachable GCS forever; a plain TCP connect fails in seconds instead."""
    host, _, port = address.split("://")[-1].rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"--address {address!r} is not host:port (e.g. 10.0.0.1:6379)")
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as err:
        raise ConfigError(
            f"no Ray cluster answers at {address} ({err.strerror or err}); check --address or "
            "$RAY_ADDRESS, and that the head node is up"
        ) from None


def cpu_share(workers: int, node_cpus: list[int]) -> int:
    """The most CPUs each of `workers` equal workers can have on nodes with `node_cpus` CPUs (at least 1).

    Ray's SPREAD placement then puts them over the nodes evenly: 2 workers on two 2-CPU nodes get
    a node and 2 CPUs each; 4 workers get 1 CPU each, two per node."""
    best = 1
    for cpus in range(1, max(node_cpus, default=1) + 1):
        if sum(n // cpus for n in node_cpus) >= workers:
            best = cpus
    return best


def choose_layout(cfg: TrainConfig, node_cpus: list[int]) -> TrainConfig:
    """Fill in --cpus-per-worker and --placement where the user left them out.

    On CPU the workers share the cluster's CPUs evenly and spread over the nodes: a worker's CPUs
    are its threads, so a node left idle is throughput lost. With --gpu the GPU is the unit and
    packing keeps NCCL on NVLink; --loader ray leaves CPUs to Ray Data's decode tasks."""
    share = not cfg.gpu and cfg.loader != "ray" and cfg.cpus_per_worker is None
    cpus = cfg.cpus_per_worker or (cpu_share(cfg.max_workers or cfg.workers, node_cpus) if share else 1)
    return dataclasses.replace(cfg, cpus_per_worker=cpus, placement=cfg.placement or ("spread" if share else "pack"))


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
                f"--gpu asks for {workers} GPUs, but the cluster has none ({layout}): Slurm job "
                f"{os.environ['SLURM_JOB_ID']} was given no GPUs; submit it with sbatch --gpus-per-node={each} "
                f"(or --gres=gpu:{each})"
            )
        return f"--gpu asks for {workers} GPUs, but the cluster has none ({layout}); drop --gpu to train on CPU"
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
    ray.util.placement_group_table(). `max_workers`: an elastic run's MAX (it starts at `workers`);
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
    holders = 0
    for group in groups:
        if group.get("state") != "CREATED":
            continue
        placed = group.get("bundles_to_node_id", {})
        here = [(placed.get(i), bundle.get(kind, 0)) for i, bundle in group.get("bundles", {}).items()]
        here = [(node, n) for node, n in here if node and n]
        holders += bool(here)
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
        who.append(f"{is_held(in_groups)} by {holders} placement group{plural} (another job or run){where(list(grouped))}")
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
    lower = f", or lower --workers to {fits}{f':{max_workers}' if max_workers else ''}" if fits else ""
    return f"asked for {need}; the cluster has them, but {now}{': ' + ', '.join(who) if who else ''}; {wait}{lower}"


def live_nodes() -> list[dict]:
    """The resources dict of each live node of the Ray cluster this process is connected to."""
    import ray

    return [n["Resources"] for n in ray.nodes() if n["Alive"]]


SETTLE_S = 1.0
"""How long preflight reads again a cluster where something is held: resources given back (this
driver's previous run under `raytrain scale`, a job that just ended) reach Ray's view a moment later."""


def node_use(settle_s: float = 0.0) -> list[dict]:
    """Each live node as {"id", "ip", "total", "free"} (Ray resources dicts), for busy_problem; one
    record for the whole cluster, with no id or ip, where Ray tells only the cluster's free resources.
    While a CPU or GPU is held, read again for up to `settle_s`."""
    import ray

    deadline = time.monotonic() + settle_s
    while True:
        alive = [n for n in ray.nodes() if n["Alive"]]
        free = free_resources_per_node()
        if "" in free:
            total: dict[str, float] = {}
            for node in alive:
                for name, n in node["Resources"].items():
                    total[name] = total.get(name, 0) + n
            use = [{"id": "", "ip": "", "total": total, "free": free[""]}]
        else:
            # A node not in Ray's view of free resources yet cannot take a worker yet either.
            use = [{"id": n["NodeID"], "ip": n["NodeManagerAddress"], "total": n["Resources"], "free": free[n["NodeID"]]}
                   for n in alive if n["NodeID"] in free]
        held = any(n["free"].get(kind, 0) < n["total"].get(kind, 0) for n in use for kind in ("CPU", "GPU"))
        if not held or time.monotonic() >= deadline:
            return use
        time.sleep(0.2)


def placement_groups() -> list[dict]:
    """Every placement group of the cluster, as ray.util.placement_group_table() lists it."""
    import ray

    return list(ray.util.placement_group_table().values())


def preflight(cfg: TrainConfig) -> TrainConfig:
    """Fail in seconds, naming what is missing or held, instead of waiting forever for resources
    (--wait-for-resources waits that long first); then choose the layout (choose_layout) from the
    CPUs free on the nodes, say it, and return cfg with it."""
    deadline = time.monotonic() + cfg.wait_for_resources
    cpus = cfg.cpus_per_worker or 1
    said = False
    while True:
        nodes = live_nodes()
        # What the nodes have, then what of it is free: Ray Train would wait forever for either,
        # retrying its worker-group start without a word.
        problem = placement_problem(cfg.workers, cpus, cfg.gpu, nodes)
        if problem is None:
            use = node_use(settle_s=0.0 if said else SETTLE_S)
            problem = busy_problem(cfg.workers, cpus, cfg.gpu, use, placement_groups(), cfg.max_workers,
                                   cfg.wait_for_resources)
        if problem is None:
            break
        if time.monotonic() >= deadline:
            raise ConfigError(problem)
        if not said:
            print(f"waiting up to {cfg.wait_for_resources:g} s (--wait-for-resources): {problem.rsplit('; ', 1)[0]}",
                  file=sys.stderr)
            said = True
        time.sleep(1.0)
    total_cpus = [int(n.get("CPU", 0)) for n in nodes]
    # The layout takes what is free: CPUs another job holds would leave a worker waiting for them.
    free_cpus = total_cpus if use[0]["id"] == "" else [int(n["free"].get("CPU", 0)) for n in use]
    chosen = choose_layout(cfg, free_cpus)
    free = " free" if sum(free_cpus) < sum(total_cpus) else ""
    if chosen.loader == "ray" and sum(free_cpus) - chosen.workers * chosen.cpus_per_worker < 1:
        raise ConfigError(
            "--loader ray decodes images in Ray Data tasks, which need CPUs beside the training workers', "
            f"but the workers take all {sum(free_cpus)}{free}; lower --workers or --cpus-per-worker, add CPUs, or use --loader torch"
        )
    if chosen != cfg:
        node_cpus = sorted(free_cpus, reverse=True)
        print(
            f"layout: {cfg.max_workers or cfg.workers} workers x {chosen.cpus_per_worker} CPU{'s' if chosen.cpus_per_worker > 1 else ''} "
            f"(threads), {chosen.placement} over {len(nodes)} node{'s' if len(nodes) > 1 else ''} of "
            f"{'+'.join(map(str, node_cpus))}{free} CPUs; --cpus-per-worker and --placement override",
            file=sys.stderr,
        )
    return chosen


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
    return f"{mib / 1024:.1f} GiB" if mib >= 1024 else f"{mib:.0f} MiB" if mib >= 10 else f"{mib:.1f} MiB"


def state_preflight(cfg: TrainConfig, given_model: Any = None, nodes: list[dict] | None = None) -> None:
    """Say, in one line, about how much model state (parameters, gradients, optimizer state) each
    rank will hold, under this strategy and the other, from the model built on the meta device.
    With --gpu, refuse a run whose state alone exceeds the GPU memory, and warn when it takes over
    half of it (activations need the rest), naming --strategy fsdp. `nodes` None: no cluster yet
    (--dry-run); then only a local GPU is looked at."""
    from raytrain_ddp.checkpoint import compat as resume
    from raytrain_ddp.worker import parallel as strategy

    model = resume.build_on_meta(cfg, given_model, resume.dataset_channels(cfg) or 3)
    world = cfg.workers  # an elastic run's smallest world: the most state per rank under FSDP
    per_node = ranks_per_node(cfg, nodes or [])
    mine = strategy.estimate_state_mib(model, cfg, world, per_node)
    # The other strategy, as its own run would be configured (DDP-only options dropped, not refused)
    other = dataclasses.replace(cfg, strategy="fsdp" if cfg.strategy == "ddp" else "ddp", sharding="full",
                                find_unused_parameters=False)
    theirs = strategy.estimate_state_mib(model, other, world, per_node)
    name = "ddp" if cfg.strategy == "ddp" else f"fsdp --sharding {cfg.sharding}"
    params = sum(p.numel() for p in model.parameters())
    print(
        f"model state: {params / 1e6:.1f}M parameters; with their gradients and {cfg.optimizer} state about "
        f"{size(mine)} per rank under --strategy {name} at {world} rank{'s' if world > 1 else ''} ({other.strategy}: {size(theirs)}), "
        "before activations",
        file=sys.stderr,
    )
    memory = gpu_mib(nodes or [], local=ray_address(cfg) is None) if cfg.gpu else None
    if memory is None or mine <= memory[0] / 2:
        return
    gpu_total, gpus = memory
    if cfg.strategy == "ddp":
        fix = f"pass --strategy fsdp (about {size(theirs)} per rank at {world} ranks"
        fix += ")" if theirs <= gpu_total / 2 else "; add --workers: the share falls as 1/N)"
    else:
        fix = "add --workers: each rank's share falls as 1/N" + (", or use --sharding full" if cfg.sharding != "full" else "")
    if mine > gpu_total:
        raise ConfigError(
            f"--strategy {name} needs about {size(mine)} per GPU for the model state alone, more than the "
            f"{size(gpu_total)} of {gpus}; {fix}"
        )
    print(f"warning: the model state, about {size(mine)} per GPU, leaves less than half of the {size(gpu_total)} of "
          f"{gpus} for activations; {fix}", file=sys.stderr)


def on_this_node() -> Any:
    """Ray's placement for the driver's own actors (metrics sink, launch hub): the driver's node.
    A 0-CPU actor may land on any node, and one on a worker node would die with it, taking an
    elastic run that should have gone on with it."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)


def trainer_configs(cfg: TrainConfig) -> tuple[Any, Any, Any]:
    """The ScalingConfig, RunConfig and backend config (TorchConfig's work, process_group.py) this run
    hands to TorchTrainer."""
    from ray.train import (
        CheckpointConfig,
        FailureConfig,
        RunConfig,
        ScalingConfig,
    )
    from raytrain_ddp.worker.process_group import ProcessGroupConfig

    resources = {"CPU": cfg.cpus_per_worker}
    if cfg.gpu:
        resources["GPU"] = 1
    elastic = {"elastic_resize_monitor_interval_s": cfg.resize_check_s} if cfg.elastic else {}
    scaling = ScalingConfig(
        num_workers=(cfg.workers, cfg.max_workers) if cfg.elastic else cfg.workers,
        use_gpu=cfg.gpu,
        resources_per_worker=resources,
        placement_strategy=cfg.placement.upper(),
        **elastic,
    )
    # A lost worker is a failure to Ray Train: an elastic run must be allowed some, or it could not shrink.
    # Node drains (preemption) have their own budget, without limit, and never use these up.
    max_failures = cfg.max_failures or (ELASTIC_RETRIES if cfg.elastic else 0)
    run = RunConfig(
        name=cfg.name,
        storage_path=cfg.storage_path,
        checkpoint_config=CheckpointConfig(num_to_keep=cfg.keep_checkpoints),
        failure_config=FailureConfig(max_failures=max_failures),
        worker_runtime_env=worker_env(),
        **train_log_level("INFO" if cfg.verbose else "WARNING"),
    )
    return scaling, run, ProcessGroupConfig(backend=cfg.resolved_backend)


def train_log_level(level: str) -> dict[str, Any]:
    """RunConfig's logging_config at `level`, where Ray Train has one (2.58 and later)."""
    if not has("ray.train:LoggingConfig"):
        return {}
    from ray.train import LoggingConfig

    return {"logging_config": LoggingConfig(log_level=level)}


ELASTIC_RETRIES = 3
"""Lost workers an elastic run recovers from when --max-failures is left at 0."""


PASSED_TO_WORKERS = ("NCCL_", "GLOO_", "TORCH_NCCL_", "TORCH_DISTRIBUTED_")
"""Env-var prefixes the driver hands to every worker: Ray workers inherit the raylet's environment,
not the driver's, so `NCCL_SOCKET_IFNAME=ib0 raytrain run` would otherwise do nothing."""


def worker_env() -> dict[str, Any] | None:
    """The workers' runtime_env: the driver's NCCL/gloo variables, None when there are none (then a
    worker may start in one of Ray's idle processes; ray_compat/controller.py keeps the controller's runtime_env
    off them too). Ray sets OMP_NUM_THREADS to each worker's CPUs by itself."""
    env = {k: v for k, v in os.environ.items() if k.startswith(PASSED_TO_WORKERS)}
    return {"env_vars": env} if env else None


class FitThread(threading.Thread):
    """trainer.fit() off the main thread; its error, if any, in `error` for the caller to judge.

    In the main thread, Ray Train V2's fit() installs its own SIGINT handler
    (DataParallelTrainer._register_sigint_handler) over ours: the first Ctrl-C aborts the run at once,
    with no checkpoint, no summary and no signal to a launched script. It leaves SIGINT alone in any
    other thread (as under Ray Tune), so the drivers' handlers in the main thread keep Ctrl-C."""

    def __init__(self, trainer: Any) -> None:
        super().__init__(name="raytrain-fit", daemon=True)  # a second Ctrl-C leaves it behind
        self.trainer = trainer
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.trainer.fit()
        except BaseException as err:  # the caller re-raises or judges it
            self.error = err
