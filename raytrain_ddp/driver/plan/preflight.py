"""One preflight for every command that trains: a TrainConfig in, a frozen RunPlan out.

Every check that can fail in seconds runs here, before Ray starts a worker: Ray's features, the
user's --model and --dataset, the trackers' packages, the resume's fit with its checkpoint, the run
directory, the cluster's room for the request, and the model state per rank against the GPUs. The
config is resolved here once (name, absolute storage path, CPUs per worker, placement) and never
changed after: what the plan holds is what every rank gets.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from raytrain_ddp import plugins, ray_compat
from raytrain_ddp.checkpoint.compat import check_resume
from raytrain_ddp.checkpoint.files import ResumeChoice, read_info, resume_choice, set_aside
from raytrain_ddp.config import ConfigError, TrainConfig
from raytrain_ddp.data.dataset_checks import FROM_FILES, data_root, dataset_channels, validate
from raytrain_ddp.driver.plan import fit, run_lock
from raytrain_ddp.driver.plan.fit import size
from raytrain_ddp.driver.plan.model_shapes import ModelShapes, estimate_state_mib, model_shapes
from raytrain_ddp.driver.plan.ray_train import RayTrainConfigs, restarts, trainer_configs
from raytrain_ddp.driver.session import cluster
from raytrain_ddp.driver.session.connect import connect, ray_address
from raytrain_ddp.ray_compat.snapshot import snapshot_ray_version
from raytrain_ddp.storage.location import RunPath, check_store, first_line, is_uri, storage_root


def stderr_line(line: str) -> None:
    """How `run` says its own lines: on stderr, so a redirected stdout keeps the results."""
    print(line, file=sys.stderr)


@dataclass(frozen=True)
class RunPlan:
    """What a command will run, checked: the driver core and Ray Train's configs read it, never the
    raw request."""

    cfg: TrainConfig
    """The resolved config: name, absolute --storage-path, --cpus-per-worker and --placement filled in."""
    run_dir: RunPath
    """<storage-path>/<name>: every file of the run; a local path or an object store's."""
    given: dict[str, Callable[..., Any]] = field(default_factory=dict)
    """The Python API's model and dataset callables, sent to the ranks by value (none from the CLI)."""
    resume_lines: tuple[str, ...] = ()
    """What a resume applies from this request to the checkpoint's run, one line each (printed)."""
    model_shapes: ModelShapes | None = None
    """--model's shapes (model_shapes.py): what the resume and the state estimate were checked
    against; None where the command trains no model of ours (launch)."""
    code: dict[str, tuple[Path, Path]] = field(default_factory=dict)
    """The user's --model/--dataset import paths, each with its module's file and the sys.path
    directory it was imported from here: where the workers import it from, or what is shipped."""
    accum_steps: int = 1
    """Micro-batches per optimizer step at --workers ranks (TrainConfig.accum_steps), announced."""
    state_mib: float | None = None
    """About how much model state (parameters, gradients, optimizer state) each rank holds; None
    where the command trains no model of ours (launch), or before the cluster is known."""
    marks: dict[str, float] = field(default_factory=dict)
    """When each of the driver's start-up stages ended (startup.py), as time.time()."""
    resume: ResumeChoice | None = None
    """The checkpoint a resume starts from (the newest whole one), and what was skipped; None under
    --no-resume or for a command that trains no model of ours."""
    address: str | None = None
    """The Ray cluster to join: --address, else $RAY_ADDRESS; None for the private local Ray this
    driver starts (session/connect.py)."""
    restarts: int = 0
    """The worker-group failures Ray Train restarts from: --max-failures, or a few for an elastic run."""
    ray_train: RayTrainConfigs | None = None
    """Ray Train's configs, made from the config laid out on the cluster; None before the cluster's
    part (check_request's plan)."""
    data_root: RunPath | None = None
    """A built-in dataset's --data-dir as a path (dataset_checks.data_root): local, or for parquet on
    an object store with its filesystem (endpoint, credentials), which the ranks are given; None for
    synthetic data, the user's own dataset, or a command that trains no model of ours."""

    @property
    def world(self) -> str:
        """The world size as the user asked for it: 4, or 2 to 8 (elastic)."""
        cfg = self.cfg
        return f"{cfg.workers} to {cfg.max_workers} (elastic)" if cfg.elastic else str(cfg.workers)

    @property
    def most_workers(self) -> int:
        return self.cfg.max_workers or self.cfg.workers


def plan(cfg: TrainConfig, model: Any = None, dataset: Any = None, *, trains: bool = True,
         stop_check: Callable[[], None] = lambda: None, say: Callable[[str], None] = stderr_line,
         marks: dict[str, float] | None = None) -> RunPlan:
    """Check the request, take its run directory (run_lock.py), connect to Ray, and fit it to the
    cluster (--wait-for-resources waits that long for room first). `trains`: the command trains our
    loop (run), not a script of the user's (launch), so the model, data, trackers and resume are
    checked too. `stop_check`: called once Ray is joined and every second of the wait; it puts the
    command's signal handlers back (ray.init replaces SIGTERM's) and raises for a stop that came.
    `say`: how the command prints its own lines (launch prefixes them, beside the script's). `marks`:
    the dict the start-up marks go into as each stage ends (the start's live line reads it)."""
    checked = check_request(cfg, model, dataset, trains=trains)
    made = run_lock.made_by(checked.run_dir)
    run_lock.take(checked.run_dir)  # before anything is moved, started or said: a live driver's name is refused alone
    try:
        return fit_to_cluster(checked, trains, stop_check, say, {} if marks is None else marks)
    except BaseException:
        run_lock.abandon(checked.run_dir, made)  # the Python API's caller may try again; no empty run left
        raise


def fit_to_cluster(checked: RunPlan, trains: bool, stop_check: Callable[[], None], say: Callable[[str], None],
                   marks: dict[str, float]) -> RunPlan:
    """The plan's part on the cluster: Ray joined, room found, the layout; then, as a refused request
    changes nothing, a fresh start's move aside or the resume's choice made good."""
    check_writable(checked.run_dir)
    marks["checks"] = time.time()
    connect(checked.address, checked.cfg.verbose)
    marks["connect"] = time.time()
    # Once joined: a driver that Ray refuses has its one line to say, and nothing else.
    if without := ray_compat.going_without() if trains else ray_compat.going_without(("fast_start",)):
        say(without)  # a launched script has no drain notices of ours
    stop_check()
    cfg, nodes = lay_out(checked.cfg, stop_check, say)
    ray_train = trainer_configs(cfg, checked.restarts, checked.run_dir.parent)
    state_mib = model_state(cfg, checked.model_shapes, nodes, local=checked.address is None) if trains else None
    if trains and not checked.cfg.resume:
        start_fresh(checked.run_dir)
    take_checkpoint(checked)
    marks["placement"] = time.time()
    return dataclasses.replace(checked, cfg=cfg, state_mib=state_mib, marks=marks, ray_train=ray_train)


def check_request(
    cfg: TrainConfig, model: Any = None, dataset: Any = None, *, trains: bool = True, dry: bool = False,
) -> RunPlan:
    """Every check that needs no Ray, in seconds: the Ray features the request needs, and for a
    command that trains the trackers' packages, --model's shapes, a resume's fit with its checkpoint,
    and --dataset and its files. Returns the plan before the cluster's part: cfg with its name,
    absolute storage path and the Python API's model and dataset, the run directory, the callables to
    send by value, the resume's lines (printed) and the model's shapes."""
    if cfg.elastic:
        ray_compat.require("elastic")
    cfg, run_dir = resolve_run(cfg)
    where = {"address": ray_address(cfg), "restarts": restarts(cfg)}  # what the cluster's part and Ray Train read
    if not trains:
        return RunPlan(cfg, run_dir, **where)
    check_kept_there(cfg, run_dir)
    cfg, given = user_parts(cfg, model, dataset)
    check_installed(cfg)
    data = data_root(cfg) if cfg.dataset in FROM_FILES and "dataset" not in given else None
    shapes, lines, choice = check_parts(cfg, run_dir, given, dry, data)
    for line in lines:
        print(line, file=sys.stderr)
    # where the user's modules came from, for the workers: one sent by value (__main__) has no module to import
    code = {s: plugins.source(s) for s in (cfg.model, cfg.dataset) if plugins.is_import_path(s) and not s.startswith("__main__:")}
    return RunPlan(cfg, run_dir, given, tuple(lines), shapes, code, cfg.accum_steps(cfg.workers), resume=choice,
                   data_root=data, **where)


def check_kept_there(cfg: TrainConfig, run_dir: RunPath) -> None:
    """What a run on an object store cannot keep there yet, refused in one line before anything
    starts: each of these keeps a local directory of its own in the run directory. (TensorBoard's
    events and --profile's traces are written locally and copied up: storage/staged.py,
    worker/measure/profiling.py.)"""
    if isinstance(run_dir, Path):
        return
    store = f"a --storage-path on an object store ({run_dir.parent})"
    if cfg.mlflow and not os.environ.get("MLFLOW_TRACKING_URI"):
        raise ConfigError(f"--mlflow keeps its sqlite store in the run directory, which {store} cannot hold; set "
                          "MLFLOW_TRACKING_URI to your tracking server")
    if cfg.wandb and not os.environ.get("WANDB_DIR"):
        raise ConfigError(f"--wandb keeps its files in the run directory, which {store} cannot hold; set WANDB_DIR "
                          "to a local directory for them")


def unplaced(checked: RunPlan) -> RunPlan:
    """The plan as a dry run shows it, before any cluster: laid out over no nodes (by choose_layout,
    as a start lays it out over the cluster's), with the Ray Train configs of that layout."""
    cfg = dataclasses.replace(checked.cfg, **fit.choose_layout(checked.cfg, [])._asdict())
    return dataclasses.replace(checked, cfg=cfg, ray_train=trainer_configs(cfg, checked.restarts, checked.run_dir.parent))


def user_parts(cfg: TrainConfig, model: Any, dataset: Any) -> tuple[TrainConfig, dict[str, Callable[..., Any]]]:
    """The model and dataset the run will use: a name, an import path or (the Python API) a
    callable, which then travels to the ranks by value."""
    (model_spec, model_fn), (data_spec, data_fn) = plugins.as_spec(model, "model"), plugins.as_spec(dataset, "dataset")
    cfg = dataclasses.replace(cfg, model=model_spec or cfg.model, dataset=data_spec or cfg.dataset)
    return cfg, {k: v for k, v in (("model", model_fn), ("dataset", data_fn)) if v is not None}


def check_parts(
    cfg: TrainConfig, run_dir: RunPath, given: dict[str, Callable[..., Any]], dry: bool, data: RunPath | None = None,
) -> tuple[ModelShapes, list[str], ResumeChoice | None]:
    """--model's shapes with the channels of the checkpoint it resumes from, else of --dataset (the
    user's own --model is built, which proves that it imports and returns an nn.Module); --dataset
    and its files (unless the Python API gave a callable: the user's to check); and the resume's
    lines, its checkpoint's config and shapes checked against this request (checkpoint/compat.py);
    and which checkpoint it resumes from, the newest whole one (checkpoint/files.py). torch is
    imported only for what needs it: a model not built before, a dataset's files. `data`: --data-dir
    as data_root resolved it."""
    choice = resume_choice(run_dir, snapshot_ray_version()) if cfg.resume else None
    checkpoint_dir = choice.checkpoint if choice is not None else None
    saved = read_info(checkpoint_dir) if checkpoint_dir is not None else None
    shapes = model_shapes(cfg, given.get("model"), saved["in_channels"] if saved else dataset_channels(cfg, data) or 3,
                          resuming=saved is not None)
    if dry and cfg.download and "dataset" not in given:
        print(f"--dry-run: --download fetches --dataset {cfg.dataset} at start; its files are not checked now", file=sys.stderr)
    elif "dataset" not in given:
        validate(cfg, data)
    lines = check_resume(cfg, checkpoint_dir, saved, shapes.state)
    said = choice.line(None) if dry and choice is not None else None  # a real run says it once it moved the snapshot
    return shapes, [said, *lines] if said else lines, choice


def take_checkpoint(checked: RunPlan) -> None:
    """The resume's choice made good, under the run's lock: Ray's run snapshot moved aside (kept)
    where it cannot serve it, so Ray starts a new one and the ranks load ours; and said in one line."""
    choice = checked.resume
    if choice is None:
        return
    moved = set_aside(checked.run_dir).name if choice.snapshot_problem else None
    if line := choice.line(moved):
        print(line, file=sys.stderr)


def resolve_run(cfg: TrainConfig) -> tuple[TrainConfig, RunPath]:
    """Fill in the run name, and make a local storage path and --data-dir absolute; return the run
    directory, <storage-path>/<name>. An object store's is checked to answer (location.check_store)."""
    name = cfg.name or time.strftime("run-%Y%m%d-%H%M%S")
    # The ranks do not start in the driver's directory (Ray Train gives each its own), wherever they run.
    storage = storage_root(cfg.storage_path)
    check_store(storage, cfg.storage_path)
    data_dir = str(Path(cfg.data_dir).expanduser().absolute()) if cfg.data_dir and not is_uri(cfg.data_dir) else cfg.data_dir
    # A URI stays as typed: its query (?endpoint_override=) is part of it.
    storage_path = cfg.storage_path if is_uri(cfg.storage_path) else str(storage)
    cfg = dataclasses.replace(cfg, name=name, storage_path=storage_path, data_dir=data_dir)
    return cfg, storage / name


def start_fresh(run_dir: RunPath) -> None:
    """--no-resume: move an old run aside rather than delete it, so nothing is lost. Its lock is
    ours (plan took it), so no live driver's run is moved; the lock goes with it, so take the new one."""
    if run_dir.exists() and any(path.name != run_lock.LOCK for path in run_dir.iterdir()):
        aside = run_dir.with_name(f"{run_dir.name}.old-{time.strftime('%Y%m%d-%H%M%S')}")
        run_dir.rename(aside)
        run_lock.take(run_dir)
        print(f"--no-resume: moved the previous run to {aside}")


def check_writable(run_dir: RunPath) -> None:
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / ".write-probe"
        probe.write_text("")
        probe.unlink()
    except OSError as err:
        raise ConfigError(
            f"cannot write run directory {run_dir} ({err.strerror or first_line(err)}); pass a writable --storage-path"
        ) from None


def lay_out(cfg: TrainConfig, stop_check: Callable[[], None] = lambda: None,
            say: Callable[[str], None] = stderr_line) -> tuple[TrainConfig, list[dict]]:
    """The request laid out on the cluster this driver joined: room found (or waited for), then
    --cpus-per-worker and --placement chosen; the laid-out config and the live nodes."""
    nodes, free_cpus = wait_for_room(cfg, stop_check, say)
    return dataclasses.replace(cfg, **layout(cfg, nodes, free_cpus, say)), nodes


def wait_for_room(
    cfg: TrainConfig, stop_check: Callable[[], None] = lambda: None, say: Callable[[str], None] = stderr_line,
) -> tuple[list[dict], list[int]]:
    """Fail in seconds, naming what is missing or held, instead of letting Ray Train wait forever for
    resources (--wait-for-resources waits that long first; `stop_check` ends the wait on a signal).
    Returns the live nodes' resources and the CPUs free on each."""
    deadline = time.monotonic() + cfg.wait_for_resources
    cpus = cfg.cpus_per_worker or 1
    said = False
    while True:
        nodes = cluster.live_nodes()
        # What the nodes have, then what of it is free: Ray Train would wait forever for either,
        # retrying its worker-group start without a word.
        problem = fit.placement_problem(cfg.workers, cpus, cfg.gpu, nodes)
        if problem is None:
            use = cluster.node_use(settle_s=0.0 if said else cluster.SETTLE_S)
            problem = fit.busy_problem(cfg.workers, cpus, cfg.gpu, use, cluster.placement_groups(),
                                             cfg.max_workers, cfg.wait_for_resources)
        if problem is None:
            break
        if time.monotonic() >= deadline:
            raise ConfigError(problem)
        if not said:
            say(f"waiting up to {cfg.wait_for_resources:g} s (--wait-for-resources): {problem.rsplit('; ', 1)[0]}")
            said = True
        time.sleep(1.0)
        stop_check()
    # The layout takes what is free: CPUs another job holds would leave a worker waiting for them.
    if use[0]["id"] == "":
        return nodes, [int(n.get("CPU", 0)) for n in nodes]
    return nodes, [int(n["free"].get("CPU", 0)) for n in use]


def layout(cfg: TrainConfig, nodes: list[dict], free_cpus: list[int], say: Callable[[str], None] = stderr_line) -> dict[str, Any]:
    """--cpus-per-worker and --placement, as given or chosen from the free CPUs (fit.choose_layout),
    said in one line when chosen; refuse --loader ray where its decode tasks would get no CPU."""
    chosen = fit.choose_layout(cfg, free_cpus)
    total = sum(int(n.get("CPU", 0)) for n in nodes)
    free = " free" if sum(free_cpus) < total else ""
    if cfg.loader == "ray" and sum(free_cpus) - cfg.workers * chosen.cpus_per_worker < 1:
        raise ConfigError(
            "--loader ray decodes images in Ray Data tasks, which need CPUs beside the training workers', "
            f"but the workers take all {sum(free_cpus)}{free}; lower --workers or --cpus-per-worker, add CPUs, or use --loader torch"
        )
    if (cfg.cpus_per_worker, cfg.placement) != chosen:
        cpus = chosen.cpus_per_worker
        say(
            f"layout: {cfg.max_workers or cfg.workers} workers x {cpus} CPU{'s' if cpus > 1 else ''} "
            f"(threads), {chosen.placement} over {len(nodes)} node{'s' if len(nodes) > 1 else ''} of "
            f"{'+'.join(map(str, sorted(free_cpus, reverse=True)))}{free} CPUs; --cpus-per-worker and --placement override"
        )
    return chosen._asdict()


def model_state(cfg: TrainConfig, shapes: ModelShapes, nodes: list[dict] | None = None, local: bool = True) -> float:
    """Say, in one line, about how much model state (parameters, gradients, optimizer state) each
    rank will hold, under this strategy and the other, from the model's shapes (check_parts); and
    return this strategy's. With --gpu, refuse a run whose state alone exceeds the GPU memory,
    and warn when it takes over half of it (activations need the rest), naming --strategy fsdp.
    `nodes` None: no cluster yet (--dry-run); then only a local GPU is looked at. `local`: the run's
    Ray is the private one on this machine, whose GPUs can be measured here."""
    # What the cluster gives first, then the model: the driver's facts before the workers' code.
    world = cfg.workers  # an elastic run's smallest world: the most state per rank under FSDP
    per_node = fit.ranks_per_node(cfg, nodes or [])
    memory = fit.gpu_mib(nodes or [], local=local) if cfg.gpu else None
    mine = estimate_state_mib(shapes, cfg, world, per_node)
    # The other strategy, as its own run would be configured (DDP-only options dropped, not refused)
    other = dataclasses.replace(cfg, strategy="fsdp" if cfg.strategy == "ddp" else "ddp", sharding="full",
                                find_unused_parameters=False)
    theirs = estimate_state_mib(shapes, other, world, per_node)
    name = "ddp" if cfg.strategy == "ddp" else f"fsdp --sharding {cfg.sharding}"
    params = shapes.count
    print(
        f"model state: {f'{params / 1e6:.1f}M' if params >= 100_000 else f'{params:,}'} parameters; with their gradients and {cfg.optimizer} state about "
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


def check_installed(cfg: TrainConfig) -> None:
    """Raise before training, not warn after it started, when a tracker asked for is not installed.
    Looks without importing: fast, and leaves os.environ alone until the trackers start (run/tracking.py)."""
    needs = {"mlflow": ["mlflow"], "wandb": ["wandb"]}
    if not os.environ.get("MLFLOW_TRACKING_URI"):
        needs["mlflow"] += ["sqlalchemy", "alembic"]  # the local sqlite store; mlflow-skinny lacks them
    for flag, modules in needs.items():
        if getattr(cfg, flag) and not all(installed(m) for m in modules):
            raise ConfigError(f"--{flag} needs the {flag} package: pip install 'raytrain-ddp[{flag}]'")


def installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # ValueError: set to None in sys.modules, which blocks its import
        return False
