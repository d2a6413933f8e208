"""`raytrain sweep`: many runs of one base config, their parameters drawn from a space file, packed
into the cluster the sweep has, with Ray Tune's schedulers (FIFO, or ASHA's early stopping).

The trials are sampled once, up front, by Tune's own generator (space.py), and kept in
<storage-path>/<name>/sweep.json, so a dry run lists what the sweep will run and a rerun of the same
command goes on with the same trials. Tune runs them (a trial is a whole `raytrain run`,
trial.py), decides the cuts and keeps its experiment state in tune/, which a rerun restores:
finished and stopped trials stay as they ended, unfinished ones resume from their own checkpoints.
What the user reads and the files at the end are report.py's.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import logging
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from raytrain_ddp.config import ConfigError, TrainConfig
from raytrain_ddp.driver.plan import run_lock
from raytrain_ddp.driver.plan.preflight import resolve_run
from raytrain_ddp.driver.plan.shipping import ship_code, user_code
from raytrain_ddp.driver.session import connect as session
from raytrain_ddp.run_files import read_csv, write_json
from raytrain_ddp.stops import Interrupted, Stopped
from raytrain_ddp.storage.location import RunPath, below, ray_storage, storage_root, store_env
from raytrain_ddp.sweep.report import fmt, say

METRICS = {"val_acc": "max", "train_acc": "max", "val_loss": "min", "train_loss": "min"}
"""What a sweep may rank trials by, with the mode that each is best in."""
SCHEDULERS = ("fifo", "asha")
VOLATILE = ("address", "progress", "verbose", "wait_for_resources", "resume", "name", "storage_path")
"""Base-config fields a rerun may change without changing what the trials train."""


@dataclass(frozen=True)
class SweepConfig:
    """The sweep's own options; the runs' are the base TrainConfig."""

    space: Path
    """The space file (YAML): each key a TrainConfig field, each value {loguniform|uniform|randint: [lo, hi]}
    or {choice|grid: [values]} (docs/sweep.md)."""
    trials: int = 8
    """Samples drawn from the space; each repeats the grid, so trials x the grid's size run."""
    concurrent: int | None = None
    """Trials at once; None (auto): as many as the cluster's free resources fit."""
    scheduler: str = "fifo"
    """fifo runs every trial to its end; asha stops the weak ones at each rung (Ray Tune's ASHA)."""
    metric: str = "val_acc"
    """The epoch metric trials are ranked by: val_acc, val_loss, train_acc or train_loss."""
    mode: str | None = None
    """max or min; default: the metric's (max for accuracies, min for losses)."""
    grace_epochs: int = 1
    """ASHA: the epochs every trial gets before it can be cut (the first rung)."""
    eta: int = 3
    """ASHA: the reduction factor; each rung keeps the best 1/eta, and rungs are eta times apart."""
    dry_run: bool = False
    """List the trials and the plan; start nothing."""

    def __post_init__(self) -> None:
        if self.trials < 1:
            raise ConfigError(f"--trials must be at least 1 (got {self.trials})")
        if self.concurrent is not None and self.concurrent < 1:
            raise ConfigError(f"--concurrent takes a number of trials at least 1, or auto (got {self.concurrent})")
        if self.scheduler not in SCHEDULERS:
            raise ConfigError(f"--scheduler must be one of {', '.join(SCHEDULERS)} (got {self.scheduler!r})")
        if self.metric not in METRICS:
            raise ConfigError(f"--metric must be one of {', '.join(METRICS)} (got {self.metric!r})")
        if self.mode not in (None, "max", "min"):
            raise ConfigError(f"--mode must be max or min (got {self.mode!r})")
        if self.grace_epochs < 1:
            raise ConfigError(f"--grace-epochs must be at least 1 (got {self.grace_epochs})")
        if self.eta < 2:
            raise ConfigError(f"--eta must be at least 2 (got {self.eta})")

    @property
    def best_is(self) -> str:
        return self.mode or METRICS[self.metric]


@dataclass(frozen=True)
class Trial:
    id: str
    """t00, t01, ...: its run's name, and its directory under trials/."""
    params: dict[str, Any]
    """The sampled TrainConfig fields."""
    cfg: TrainConfig
    """The base config with them: what its run trains (its name and directory are set in its actor)."""


def sweep(base: TrainConfig, sc: SweepConfig, run_args: list[str]) -> dict[str, Any] | None:
    """Run the sweep (or, with --dry-run, list it); write results.csv, summary.json and the plots.
    `run_args`: the run flags given on the command line, for the command that reproduces a trial.
    Returns the summary; raises Interrupted (Ctrl-C) or Stopped (SIGTERM, SIGUSR1) after the trials
    checkpointed, for a rerun to resume."""
    from raytrain_ddp.sweep.space import describe, load_space

    if base.name is None:
        raise ConfigError("raytrain sweep needs --name: the sweep's directory, and what a rerun of it resumes")
    if base.elastic:
        raise ConfigError(
            f"a sweep's trials have a fixed size, which the packing splits the cluster by; give --workers N, not "
            f"{base.workers}:{base.max_workers}"
        )
    if not sc.dry_run:
        session.start_private_ray(base)  # it comes up while the sweep is planned and its trials checked
    base, sweep_dir = resolve_run(base)
    # A trial's workers take the CPUs the packing gave them, not a run's share of what is free when
    # it starts (which would leave the next trial waiting)
    base = dataclasses.replace(base, cpus_per_worker=base.cpus_per_worker or 1)
    space = load_space(sc.space, base)
    trials = sample(space, sc, base)
    code = check_trials(trials, below(base.storage_path, sweep_dir.name, "trials"))
    if not any(word.startswith("--cpus-per-worker") for word in run_args):
        run_args = [*run_args, "--cpus-per-worker", str(base.cpus_per_worker)]  # the trial's, for its command
    if sc.dry_run:
        return list_trials(trials, sc, describe(space), sweep_dir)
    run_lock.take(sweep_dir)
    try:
        keep_plan(sweep_dir, base, trials, sc)
        address = session.ray_address(base)
        session.connect(address, base.verbose)
        code_paths, code_env = user_code(code)
        # Once, before any trial: every trial's actor and worker is of this job, and gets its runtime_env
        ship_code(address, base.verbose, {**code_env, **actor_env(trials, base)})
        return run_trials(base, sc, trials, sweep_dir, describe(space), run_args, code_paths)
    finally:
        run_lock.release(sweep_dir)


def sample(space: Any, sc: SweepConfig, base: TrainConfig) -> list[Trial]:
    """The sweep's trials, each checked as a whole config: a space's ends may pass alone and not
    together (a batch size the accumulation does not divide)."""
    from raytrain_ddp.sweep.space import sample_trials

    trials = []
    for i, params in enumerate(sample_trials(space, sc.trials, base.seed)):
        tid = f"t{i:02d}" if sc.trials * space.grid_size <= 100 else f"t{i:03d}"
        try:
            cfg = dataclasses.replace(base, **params)
        except ConfigError as err:
            raise ConfigError(f"{sc.space}: trial {tid} ({fmt(params)}): {err}") from None
        trials.append(Trial(tid, params, cfg))
    if sc.scheduler == "asha" and sc.grace_epochs >= base.epochs:
        raise ConfigError(
            f"--scheduler asha cuts trials after --grace-epochs {sc.grace_epochs}, but each trains only --epochs "
            f"{base.epochs}; lower --grace-epochs or raise --epochs"
        )
    return trials


CHECKED_BY_PARTS = ("model", "dataset", "data_dir", "image_size", "num_classes", "download", "loader", "train_samples",
                    "val_samples", "mlflow", "wandb")
"""The fields preflight's checks of the model, the data and the trackers read: a trial that varies
none of them passes what another passed."""


def check_trials(trials: list[Trial], trials_dir: str) -> dict[str, tuple[Path, Path]]:
    """The checks that need no cluster, once for each distinct model, data and trackers among the
    trials, before Ray starts: a bad --model in one trial is found now, not an hour in. Returns the
    user's --model/--dataset modules (RunPlan.code), which the sweep places on the nodes once."""
    from raytrain_ddp.driver.plan.preflight import check_request

    seen: set[tuple[Any, ...]] = set()
    code: dict[str, tuple[Path, Path]] = {}
    for trial in trials:
        key = tuple(getattr(trial.cfg, name, None) for name in CHECKED_BY_PARTS)
        if key in seen:
            continue
        seen.add(key)
        cfg = dataclasses.replace(trial.cfg, name=trial.id, storage_path=trials_dir, resume=False)
        try:
            code.update(check_request(cfg, dry=True).code)
        except ConfigError as err:
            if not set(trial.params) & set(CHECKED_BY_PARTS):
                raise  # the base's, as `raytrain run` would say it
            raise ConfigError(f"trial {trial.id} ({fmt(trial.params)}): {err}") from None
    return code


TRACKER_ENV = ("MLFLOW_", "WANDB_")
"""The trackers' own settings (server, project, key, mode), which the trials' actors need as the
driver has them: a Ray worker gets the environment of the node it runs on, not the driver's."""


def actor_env(trials: list[Trial], base: TrainConfig) -> dict[str, Any]:
    """The job's runtime_env entry that hands the trials' actors the driver's tracker settings and
    its object store's (location.store_env: each trial's run resolves the store, and a parquet
    --data-dir there, again); {} when no trial tracks and nothing is on a store (joining again with a
    runtime_env costs a second or two)."""
    env: dict[str, str] = {}
    for where in {base.storage_path, *(t.cfg.data_dir for t in trials if t.cfg.data_dir)}:
        env |= store_env(where)
    if any(t.cfg.mlflow or t.cfg.wandb for t in trials):
        env |= {k: v for k, v in os.environ.items() if k.startswith(TRACKER_ENV)}
    return {"env_vars": env} if env else {}


def list_trials(trials: list[Trial], sc: SweepConfig, space: str, sweep_dir: RunPath) -> None:
    """--dry-run: the plan, printed; nothing started."""
    print(f"sweep {sweep_dir.name}: {len(trials)} trials over {space}; {sc.scheduler} on {sc.metric} ({sc.best_is})")
    for trial in trials:
        print(f"  {trial.id}: {fmt(trial.params)}  ({trial.cfg.workers} worker{'s' if trial.cfg.workers > 1 else ''})")
    at_once = sc.concurrent or "as many as the cluster's free resources fit"
    print(f"concurrent: {at_once}; trials in {sweep_dir / 'trials'}")
    return None


def keep_plan(sweep_dir: RunPath, base: TrainConfig, trials: list[Trial], sc: SweepConfig) -> None:
    """sweep.json: the trials and the base config. A rerun must ask for the same ones: it resumes them."""
    plan = {
        "trials": [{"id": t.id, "params": t.params} for t in trials],
        "base": {k: v for k, v in base.to_dict().items() if k not in VOLATILE},
        "scheduler": sc.scheduler, "metric": sc.metric, "mode": sc.best_is,
    }
    path = sweep_dir / "sweep.json"
    if path.exists():
        was = json.loads(path.read_text())
        if not base.resume:
            raise ConfigError(
                f"a sweep named {sweep_dir.name} is in {sweep_dir} and --no-resume would start it again; "
                "pass a new --name (or move that directory away)"
            )
        if plan != was:
            words = {"trials": "set of trials", "base": "run flags"}
            what = [words.get(k, f"--{k}") for k in plan if plan[k] != was.get(k)]
            raise ConfigError(
                f"the sweep {sweep_dir.name} in {sweep_dir} was started with other {' and '.join(what)}; rerun it "
                "with the same space, --trials, --seed and run flags to resume it, or pass a new --name"
            )
        return
    sweep_dir.mkdir(parents=True, exist_ok=True)
    write_json(path, plan)


def packing(trials: list[Trial], sc: SweepConfig, free: list[dict[str, float]]) -> tuple[int, int, str]:
    """(trials at once, worker slots the allocation has, the line that says how it is split), from the
    free resources of each node (Ray resources dicts). Every trial is sized as the biggest."""
    from raytrain_ddp.driver.plan.fit import room

    biggest = max(trials, key=lambda t: (t.cfg.workers * (t.cfg.cpus_per_worker or 1), t.cfg.workers)).cfg
    cpus, gpu = biggest.cpus_per_worker or 1, biggest.gpu
    slots = room(cpus, gpu, free)
    fits = slots // biggest.workers
    unit = f"{biggest.workers} worker{'s' if biggest.workers > 1 else ''} x {cpus} CPU{'s' if cpus > 1 else ''}"
    unit += " + 1 GPU each" if gpu else ""
    if fits == 0:
        raise ConfigError(
            f"a trial of {unit} does not fit in the cluster's free resources ({slots} such workers fit); lower "
            f"--workers or --cpus-per-worker, or add {'GPU' if gpu else 'CPU'}s"
        )
    at_once = min(sc.concurrent or fits, fits, len(trials))
    free_cpus = sum(int(n.get("CPU", 0)) for n in free)
    nodes = f"{len(free)} node{'s' if len(free) > 1 else ''}"
    line = f"{at_once} trial{'s' if at_once > 1 else ''} at once, each {unit}, in {free_cpus} free CPUs on {nodes}"
    if idle := slots - at_once * biggest.workers:
        if at_once < fits:
            why = "--concurrent" if sc.concurrent == at_once else f"{len(trials)} trials"
        else:
            why = f"a trial of {biggest.workers} workers"
        line += f"; {idle} worker slot{'s' if idle > 1 else ''} left idle ({why} leaves them)"
    if sc.concurrent and sc.concurrent > fits:
        line += f"; --concurrent {sc.concurrent} is more than fit, so {fits}"
    if (left := free_cpus - slots * cpus) > 0 and not gpu:
        line += f"; {left} CPU{'s' if left > 1 else ''} fit no whole worker of {cpus} CPUs"
    return at_once, slots, line


def run_trials(base: TrainConfig, sc: SweepConfig, trials: list[Trial], sweep_dir: RunPath, space: str,
               run_args: list[str], code_paths: list[str]) -> dict[str, Any]:
    """Split the cluster, hand the trials to Tune (or restore its state), and report at the end."""
    from raytrain_ddp.driver.session.cluster import SETTLE_S, node_use
    from raytrain_ddp.sweep.lines import RECEIVED, stop_signals

    at_once, slots, split = packing(trials, sc, [n["free"] for n in node_use(settle_s=SETTLE_S)])
    say(f"sweep {sweep_dir.name}: {len(trials)} trials over {space}; {sc.scheduler} on {sc.metric} ({sc.best_is})")
    say(f"packing: {split}")
    os.environ["TUNE_DISABLE_STRICT_METRIC_CHECKING"] = "1"  # a trial's heartbeat step carries no metric
    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")  # Tune's own tables: the sweep says its own lines
    os.environ.setdefault("TUNE_GLOBAL_CHECKPOINT_S", "5")  # the state a killed sweep resumes from: seconds old
    if not base.verbose:  # each trial's failure is one line of ours; Tune's tracebacks stay in its logs
        for name in ("ray.tune", "ray.air"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    RECEIVED.clear()  # the Python API may sweep again in this process
    began = time.time()
    with stop_signals():
        tuner(base, sc, trials, sweep_dir, at_once, code_paths).fit()
    summary = report(trials, sc, sweep_dir, run_args, slots, began, time.time(), rungs(sc, base.epochs))
    if RECEIVED:
        how = f"rerun the same command (same --storage-path and --name {sweep_dir.name}) to resume it"
        message = (f"the sweep stopped on {RECEIVED[0]}, each running trial with a checkpoint at its next agreed step "
                   f"(one stopped before its first step starts over); {how}")
        raise Interrupted(message) if RECEIVED[0] == "SIGINT" else Stopped(message)
    return summary


MOVED = {"raytrain_ddp.driver.sweep_lines": "raytrain_ddp.sweep.lines", "raytrain_ddp.driver.sweep_trial": "raytrain_ddp.sweep.trial"}
"""Where the modules that Tune pickles by path (the callback, the trial namer, the trainable) were
before 0.1.0's driver/ became rooms: a sweep stopped before the move still resumes after it."""


def tuner(base: TrainConfig, sc: SweepConfig, trials: list[Trial], sweep_dir: RunPath, at_once: int,
          code_paths: list[str]) -> Any:
    """Ray Tune's Tuner over exactly these trials (a grid of them), or the one a stopped sweep saved."""
    import ray
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler, FIFOScheduler

    from raytrain_ddp.sweep.lines import SweepLines, trial_name
    from raytrain_ddp.sweep.trial import TrialRun

    # A trial's actor is its driver: on this node (on another it would die with that node), and
    # holding nothing, since its run's workers reserve their own.
    node = ray.get_runtime_context().get_node_id()
    ip = next((n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] == node), None)
    trainable = tune.with_resources(TrialRun, tune.PlacementGroupFactory([{"CPU": 0, f"node:{ip}": 0.001} if ip else {"CPU": 0}]))
    # Tune pickles its filesystem into its state (tuner.pkl, the trials'): one that holds no
    # credentials, which the driver and the trials' actors find in their environment (actor_env)
    store = ray_storage(storage_root(base.storage_path, keys=False) / sweep_dir.name)
    tune_dir = f"{store['storage_path']}/tune"
    if tune.Tuner.can_restore(tune_dir, storage_filesystem=store.get("storage_filesystem")):
        say(f"resuming sweep {sweep_dir.name}: finished and stopped trials are kept, the rest go on from their checkpoints")
        for old, new in MOVED.items():
            sys.modules.setdefault(old, importlib.import_module(new))
        return tune.Tuner.restore(tune_dir, trainable=trainable, resume_unfinished=True, resume_errored=False,
                                  storage_filesystem=store.get("storage_filesystem"))
    scheduler = (
        ASHAScheduler(time_attr="epoch", max_t=base.epochs, grace_period=sc.grace_epochs, reduction_factor=sc.eta,
                      stop_last_trials=False)  # a trial's last epoch ends it: no cut as it finishes
        if sc.scheduler == "asha" else FIFOScheduler()
    )
    where = below(base.storage_path, sweep_dir.name)  # as typed: the actors resolve it again
    return tune.Tuner(
        trainable,
        param_space={
            "trial": tune.grid_search([{"id": t.id, "params": t.params} for t in trials]),
            "base": base.to_dict(), "cwd": os.getcwd(), "trials_dir": below(where, "trials"), "code_paths": code_paths,
        },
        tune_config=tune.TuneConfig(
            metric=sc.metric, mode=sc.best_is, scheduler=scheduler, num_samples=1, max_concurrent_trials=at_once,
            reuse_actors=False, trial_name_creator=trial_name, trial_dirname_creator=trial_name,
        ),
        run_config=tune.RunConfig(
            name="tune", **store, verbose=0,
            callbacks=[SweepLines(where, sc.metric, sc.best_is, base.epochs, rungs(sc, base.epochs))],
            failure_config=tune.FailureConfig(max_failures=0),
        ),
    )


def rungs(sc: SweepConfig, epochs: int) -> list[int]:
    """The epochs at which ASHA judges trials: grace x eta^k below the last epoch (its one bracket)."""
    if sc.scheduler != "asha":
        return []
    out, at = [], sc.grace_epochs
    while at < epochs:
        out.append(at)
        at *= sc.eta
    return out


def trial_checkpoint(run_dir: RunPath) -> RunPath | None:
    """The trial's newest whole checkpoint, for the table; None where it has none yet, or none whole
    (one stopped while its first checkpoint was written): the trial's own rerun says why, and one
    trial's files must not cost the sweep its report."""
    from raytrain_ddp.checkpoint.files import latest_checkpoint

    try:
        return latest_checkpoint(run_dir) if run_dir.exists() else None
    except ConfigError:
        return None


def report(trials: list[Trial], sc: SweepConfig, sweep_dir: RunPath, run_args: list[str], slots: int,
           began: float, ended: float, rung_epochs: list[int]) -> dict[str, Any]:
    """The table, results.csv, summary.json and the plots, from every trial's files."""
    from raytrain_ddp.sweep import report as out
    from raytrain_ddp.sweep.lines import read_outcome

    statuses, cuts = (json.loads(path.read_text()) if path.exists() else {}
                      for path in (sweep_dir / "status.json", sweep_dir / "cuts.json"))
    records = []
    for trial in trials:
        run_dir = sweep_dir / "trials" / trial.id
        outcome = read_outcome(sweep_dir / "trials", trial.id)
        rows = read_csv(run_dir / "metrics.csv") if (run_dir / "metrics.csv").exists() else []
        if trial.id in cuts:  # judged on the epochs before ASHA's cut, not those the stop took to land
            rows = [row for row in rows if int(row["epoch"]) <= cuts[trial.id]]
        said = outcome.get("status") if outcome.get("status") in ("finished", "failed") else None
        status = statuses.get(trial.id) or said or ("stopped" if outcome else "pending")
        checkpoint = trial_checkpoint(run_dir)
        records.append(out.TrialRecord(
            trial=trial.id, params=trial.params, status=status, rows=rows, workers=trial.cfg.workers,
            started=outcome.get("started"), ended=outcome.get("ended"),
            error=outcome.get("line") if status == "failed" else None,
            checkpoint=str(checkpoint) if checkpoint else None,
        ))
    print(out.table(records, sc.metric, sc.best_is))
    out.write_results_csv(sweep_dir / "results.csv", records, sc.metric, sc.best_is)
    out.plot_curves(sweep_dir / "curves.png", records, sc.metric, sc.best_is, rung_epochs)
    out.plot_parallel(sweep_dir / "parallel.png", records, sc.metric, sc.best_is)
    idle = out.idle_share(slots, began, ended, records)
    summary = out.write_summary(sweep_dir / "summary.json", records, sc.metric, sc.best_is, run_args, {
        "name": sweep_dir.name, "sweep_dir": str(sweep_dir), "scheduler": sc.scheduler, "worker_slots": slots,
        "idle_share": round(idle, 4), "wall_time_s": round(ended - began, 3),
    })
    say(f"{idle:.0%} of the allocation's worker-seconds sat idle; results -> {sweep_dir / 'results.csv'}, "
        f"plots -> {sweep_dir / 'curves.png'}, {sweep_dir / 'parallel.png'}")
    return summary
