"""One preflight for every command that trains: a TrainConfig in, a frozen RunPlan out.

Every check that can fail in seconds runs here, before Ray starts a worker: Ray's features, the
user's --model and --dataset, the trackers' packages, the resume's fit with its checkpoint, the run
directory, the cluster's room for the request, and the model state per rank against the GPUs. The
config is resolved here once (name, absolute storage path, CPUs per worker, placement) and never
changed after: what the plan holds is what every rank gets.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from raytrain_ddp import plugins, ray_compat
from raytrain_ddp.config import ConfigError, TrainConfig
from raytrain_ddp.driver import resources, session
from raytrain_ddp.driver.resources import size


@dataclass(frozen=True)
class RunPlan:
    """What a command will run, checked: the driver core and Ray Train's configs read it, never the
    raw request."""

    cfg: TrainConfig
    """The resolved config: name, absolute --storage-path, --cpus-per-worker and --placement filled in."""
    run_dir: Path
    """<storage-path>/<name>: every file of the run."""
    given: dict[str, Callable[..., Any]] = field(default_factory=dict)
    """The Python API's model and dataset callables, sent to the ranks by value (none from the CLI)."""
    resume_lines: tuple[str, ...] = ()
    """What a resume applies from this request to the checkpoint's run, one line each (printed)."""
    state_mib: float | None = None
    """About how much model state (parameters, gradients, optimizer state) each rank holds; None
    where the command trains no model of ours (launch)."""
    marks: dict[str, float] = field(default_factory=dict)
    """When each of the driver's start-up stages ended (startup.py), as time.time()."""

    @property
    def world(self) -> str:
        """The world size as the user asked for it: 4, or 2 to 8 (elastic)."""
        cfg = self.cfg
        return f"{cfg.workers} to {cfg.max_workers} (elastic)" if cfg.elastic else str(cfg.workers)

    @property
    def most_workers(self) -> int:
        return self.cfg.max_workers or self.cfg.workers


def plan(cfg: TrainConfig, model: Any = None, dataset: Any = None, *, trains: bool = True) -> RunPlan:
    """Check the request, connect to Ray, and fit it to the cluster (--wait-for-resources waits
    that long for room first). `trains`: the command trains our loop (run), not a script of the
    user's (launch), so the model, data, trackers and resume are checked too."""
    cfg, run_dir, given, resume_lines = check_request(cfg, model, dataset, trains=trains)
    if without := ray_compat.going_without() if trains else ray_compat.going_without(("fast_start",)):
        print(without, file=sys.stderr)  # a launched script has no drain notices of ours
    if trains and not cfg.resume:
        start_fresh(run_dir)
    check_writable(run_dir)
    marks = {"checks": time.time()}
    session.connect(cfg)
    marks["connect"] = time.time()
    nodes, free_cpus = wait_for_room(cfg)
    cfg = dataclasses.replace(cfg, **layout(cfg, nodes, free_cpus))
    state_mib = model_state(cfg, given.get("model"), nodes) if trains else None
    marks["placement"] = time.time()
    return RunPlan(cfg, run_dir, given, resume_lines, state_mib, marks)


def check_request(
    cfg: TrainConfig, model: Any = None, dataset: Any = None, *, trains: bool = True, dry: bool = False,
) -> tuple[TrainConfig, Path, dict[str, Callable[..., Any]], tuple[str, ...]]:
    """Every check that needs no Ray, in seconds: the Ray features the request needs, and for a
    command that trains --model (it imports and builds an nn.Module), --dataset and its files, the
    trackers' packages, and a resume's fit with its checkpoint. Returns cfg with its name, absolute
    storage path and the Python API's model and dataset, the run directory, the callables to send
    by value, and the resume's lines (printed)."""
    if cfg.elastic:
        ray_compat.require("elastic")
    given: dict[str, Callable[..., Any]] = {}
    if trains:
        cfg, given = user_parts(cfg, model, dataset, dry)
    cfg, run_dir = resolve_run(cfg)
    lines: tuple[str, ...] = ()
    if trains:
        from raytrain_ddp.checkpoint.compat import check_resume

        lines = tuple(check_resume(cfg, run_dir, given.get("model")))
    for line in lines:
        print(line, file=sys.stderr)
    return cfg, run_dir, given, lines


def user_parts(cfg: TrainConfig, model: Any, dataset: Any, dry: bool) -> tuple[TrainConfig, dict[str, Callable[..., Any]]]:
    """The model, dataset and trackers the run will use, each checked here: a name, an import path
    or (the Python API) a callable, which then travels to the ranks by value."""
    from raytrain_ddp.data.registry import validate
    from raytrain_ddp.driver import tracking
    from raytrain_ddp.worker.models import model_builder

    (model_spec, model_fn), (data_spec, data_fn) = plugins.as_spec(model, "model"), plugins.as_spec(dataset, "dataset")
    cfg = dataclasses.replace(cfg, model=model_spec or cfg.model, dataset=data_spec or cfg.dataset)
    given = {k: v for k, v in (("model", model_fn), ("dataset", data_fn)) if v is not None}
    if "model" not in given:
        model_builder(cfg.model)  # an unknown name or a broken import path fails here, in one line
    if dry and cfg.download and "dataset" not in given:
        print(f"--dry-run: --download fetches --dataset {cfg.dataset} at start; its files are not checked now", file=sys.stderr)
    elif "dataset" not in given:
        validate(cfg)
    tracking.check_installed(cfg)
    return cfg, given


def resolve_run(cfg: TrainConfig) -> tuple[TrainConfig, Path]:
    """Fill in the run name and the absolute storage path; return the run directory, <storage-path>/<name>."""
    name = cfg.name or time.strftime("run-%Y%m%d-%H%M%S")
    # Ray needs an absolute path: workers on other nodes do not share the driver's cwd.
    storage = Path(cfg.storage_path).expanduser().absolute()
    cfg = dataclasses.replace(cfg, name=name, storage_path=str(storage))
    return cfg, storage / name


def start_fresh(run_dir: Path) -> None:
    """--no-resume: move an old run aside rather than delete it, so nothing is lost."""
    if run_dir.exists() and any(run_dir.iterdir()):
        aside = run_dir.with_name(f"{run_dir.name}.old-{time.strftime('%Y%m%d-%H%M%S')}")
        run_dir.rename(aside)
        print(f"--no-resume: moved the previous run to {aside}")


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


def wait_for_room(cfg: TrainConfig) -> tuple[list[dict], list[int]]:
    """Fail in seconds, naming what is missing or held, instead of letting Ray Train wait forever for
    resources (--wait-for-resources waits that long first). Returns the live nodes' resources and
    the CPUs free on each."""
    deadline = time.monotonic() + cfg.wait_for_resources
    cpus = cfg.cpus_per_worker or 1
    said = False
    while True:
        nodes = resources.live_nodes()
        # What the nodes have, then what of it is free: Ray Train would wait forever for either,
        # retrying its worker-group start without a word.
        problem = resources.placement_problem(cfg.workers, cpus, cfg.gpu, nodes)
        if problem is None:
            use = resources.node_use(settle_s=0.0 if said else resources.SETTLE_S)
            problem = resources.busy_problem(cfg.workers, cpus, cfg.gpu, use, resources.placement_groups(),
                                             cfg.max_workers, cfg.wait_for_resources)
        if problem is None:
            break
        if time.monotonic() >= deadline:
            raise ConfigError(problem)
        if not said:
            print(f"waiting up to {cfg.wait_for_resources:g} s (--wait-for-resources): {problem.rsplit('; ', 1)[0]}",
                  file=sys.stderr)
            said = True
        time.sleep(1.0)
    # The layout takes what is free: CPUs another job holds would leave a worker waiting for them.
    if use[0]["id"] == "":
        return nodes, [int(n.get("CPU", 0)) for n in nodes]
    return nodes, [int(n["free"].get("CPU", 0)) for n in use]


def layout(cfg: TrainConfig, nodes: list[dict], free_cpus: list[int]) -> dict[str, Any]:
    """--cpus-per-worker and --placement, as given or chosen from the free CPUs (resources.choose_layout),
    said in one line when chosen; refuse --loader ray where its decode tasks would get no CPU."""
    chosen = resources.choose_layout(cfg, free_cpus)
    total = sum(int(n.get("CPU", 0)) for n in nodes)
    free = " free" if sum(free_cpus) < total else ""
    if cfg.loader == "ray" and sum(free_cpus) - cfg.workers * chosen.cpus_per_worker < 1:
        raise ConfigError(
            "--loader ray decodes images in Ray Data tasks, which need CPUs beside the training workers', "
            f"but the workers take all {sum(free_cpus)}{free}; lower --workers or --cpus-per-worker, add CPUs, or use --loader torch"
        )
    if (cfg.cpus_per_worker, cfg.placement) != chosen:
        cpus = chosen.cpus_per_worker
        print(
            f"layout: {cfg.max_workers or cfg.workers} workers x {cpus} CPU{'s' if cpus > 1 else ''} "
            f"(threads), {chosen.placement} over {len(nodes)} node{'s' if len(nodes) > 1 else ''} of "
            f"{'+'.join(map(str, sorted(free_cpus, reverse=True)))}{free} CPUs; --cpus-per-worker and --placement override",
            file=sys.stderr,
        )
    return chosen._asdict()


def model_state(cfg: TrainConfig, given_model: Any = None, nodes: list[dict] | None = None) -> float:
    """Say, in one line, about how much model state (parameters, gradients, optimizer state) each
    rank will hold, under this strategy and the other, from the model built on the meta device; and
    return this strategy's. With --gpu, refuse a run whose state alone exceeds the GPU memory, and
    warn when it takes over half of it (activations need the rest), naming --strategy fsdp. `nodes`
    None: no cluster yet (--dry-run); then only a local GPU is looked at."""
    from raytrain_ddp.data.registry import dataset_channels
    from raytrain_ddp.worker import parallel
    from raytrain_ddp.worker.models import build_on_meta

    # What the cluster gives first, then the model: the driver's facts before the workers' code.
    world = cfg.workers  # an elastic run's smallest world: the most state per rank under FSDP
    per_node = resources.ranks_per_node(cfg, nodes or [])
    memory = resources.gpu_mib(nodes or [], local=session.ray_address(cfg) is None) if cfg.gpu else None
    model = build_on_meta(cfg, given_model, dataset_channels(cfg) or 3)
    mine = parallel.estimate_state_mib(model, cfg, world, per_node)
    # The other strategy, as its own run would be configured (DDP-only options dropped, not refused)
    other = dataclasses.replace(cfg, strategy="fsdp" if cfg.strategy == "ddp" else "ddp", sharding="full",
                                find_unused_parameters=False)
    theirs = parallel.estimate_state_mib(model, other, world, per_node)
    name = "ddp" if cfg.strategy == "ddp" else f"fsdp --sharding {cfg.sharding}"
    params = sum(p.numel() for p in model.parameters())
    print(
        f"model state: {params / 1e6:.1f}M parameters; with their gradients and {cfg.optimizer} state about "
        f"{size(mine)} per rank under --strategy {name} at {world} rank{'s' if world > 1 else ''} ({other.strategy}: {size(theirs)}), "
        "before activations",
        file=sys.stderr,
    )
    if memory is not None and mine > memory[0] / 2:
        too_big(cfg, mine, theirs, memory)
    return mine


def too_big(cfg: TrainConfig, mine: float, theirs: float, memory: tuple[float, str]) -> None:
    """Refuse a model state that exceeds the GPU; warn when it leaves less than half for activations."""
    gpu_total, gpus = memory
    world, name = cfg.workers, "ddp" if cfg.strategy == "ddp" else f"fsdp --sharding {cfg.sharding}"
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
