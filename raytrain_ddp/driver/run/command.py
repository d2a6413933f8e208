"""`raytrain run`: plan the run, start Ray Train on our worker loop, show its progress, write its files.

The shared parts (the plan, signals, the watch loop, summary.json) are the driver's (plan/, core/);
what is `run`'s own is here: the trainer and its stages, start to finish. What rank 0 tells the
driver meanwhile, and what the run's files and lines say of it, is news.py's.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import sys
import time
from typing import Any, Callable

from raytrain_ddp.checkpoint.compat import compare
from raytrain_ddp.checkpoint.files import latest_checkpoint, read_info
from raytrain_ddp.config import ConfigError, TrainConfig, dumps
from raytrain_ddp.doctor.bad_nodes import blame, crash_hosts, stall_hosts
from raytrain_ddp.doctor.stragglers import most_uneven
from raytrain_ddp.driver.core.drive import Signals, StartupClock, drive, on_this_node, write_summary
from raytrain_ddp.driver.core.startup import RUN_STAGES
from raytrain_ddp.driver.plan import preflight, run_lock
from raytrain_ddp.driver.plan.preflight import RunPlan
from raytrain_ddp.driver.plan.shipping import ship_code, user_code
from raytrain_ddp.driver.plan.trial_step import trial_step
from raytrain_ddp.driver.run import tracking
from raytrain_ddp.driver.run.news import RESUME_HINT, RunNews, kept
from raytrain_ddp.driver.run.progress import Display
from raytrain_ddp.driver.session.connect import start_private_ray
from raytrain_ddp.stops import Interrupted, RayLost, Stalled, Stopped
from raytrain_ddp.storage.location import RunPath
from raytrain_ddp.storage.object_path import ObjectPath

POLL_S = 0.5
"""How often the driver asks rank 0's sink for news and passes on a signal it got."""


def dry_run(cfg: TrainConfig) -> None:
    """Every check that needs no cluster and a trial of the first step on the CPU (trial_step.py), then
    the resolved config and Ray Train's configs; start nothing."""
    checked = preflight.check_request(cfg, dry=True)
    configs = preflight.unplaced(checked).ray_train  # laid out over no nodes, as a start lays it out over its cluster's
    cfg, run_dir = checked.cfg, checked.run_dir
    preflight.model_state(cfg, checked.model_shapes, local=checked.address is None)  # with --gpu: a local GPU only
    if cfg.download or cfg.dataset == "parquet":  # files not there yet; a Parquet reader loads every row
        print(f"--dry-run: no trial step on --dataset {cfg.dataset}"
              f"{' before its --download' if cfg.download else ' (its reader loads every shard whole)'}", file=sys.stderr)
    else:
        print(trial_step(cfg, checked.given), file=sys.stderr)
    print(f"config:\n{dumps(cfg)}")
    if cfg.cpus_per_worker is None or cfg.placement is None:
        print("layout: --cpus-per-worker and --placement are chosen at start from the cluster's nodes (shown as 1, spread)")
    print(f"run directory: {run_dir}")
    print(f"ray address: {checked.address or 'a new private local Ray'}")
    print(f"{configs.scaling}\n{configs.run}\n{configs.backend}")


def run(cfg: TrainConfig, model: Any = None, dataset: Any = None, launched: float | None = None,
        signals: Signals | None = None, on_rows: Callable[[list[dict[str, Any]]], None] | None = None,
        code_paths: list[str] | None = None) -> dict[str, Any]:
    """Train, write metrics.csv and summary.json, and return the summary. `model` and `dataset`
    (the Python API) override cfg's: a name, an import path, or a callable. `launched`: when the
    command began (the CLI's process start), so the start-up stages count its imports; default now.
    Ctrl-C checkpoints, then raises Interrupted (a KeyboardInterrupt); SIGTERM or SIGUSR1
    checkpoints, then raises Stopped. `signals`: where a caller that is not the main thread (a
    sweep's trial) asks for those stops (Signals.ask); `on_rows`: given every epoch's row so far, each
    time a new one comes; `code_paths`: where the workers import the user's --model/--dataset from,
    when the caller placed the code already (a sweep, once for all its trials)."""
    started = time.time()
    # A sweep's trial (on_rows) takes its epochs' rows from the run's own start: it goes the long way.
    if on_rows is None and (trained := already_trained(cfg)) is not None:
        return trained
    start_private_ray(cfg)  # without --address: it starts while the request is checked
    marks: dict[str, float] = {}  # the plan's start-up marks, as it takes them: the display's live line reads them
    display = Display(cfg.progress, cfg.epochs, begin=launched, started=started, marks=marks)
    with signals or Signals() as signals:
        try:
            plan = preflight.plan(cfg, model, dataset, stop_check=signals.stop_before_start, marks=marks)
            try:
                if code_paths is None:
                    code_paths, code_env = user_code(plan.code)
                    ship_code(plan.address, plan.cfg.verbose, code_env)
                signals.stop_before_start()
                return train(plan, display, signals, code_paths, started, launched, on_rows)
            finally:
                run_lock.release(plan.run_dir)  # the Python API's process lives on: another driver may have the name
        finally:
            display.close()


def already_trained(cfg: TrainConfig) -> dict[str, Any] | None:
    """The summary of a named run that trained its --epochs to the end, said in one line, when the
    same command runs again (a second look, a job requeued after its end): Ray would start only to
    train nothing. None for anything else, which then resumes or starts the usual way; a change the
    checkpoint refuses (another --model, say) is refused here as it would be there."""
    if not cfg.resume or not cfg.name:
        return None
    cfg, run_dir = preflight.resolve_run(cfg)
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
        checkpoint = latest_checkpoint(run_dir)
        saved = read_info(checkpoint) if checkpoint is not None else None
    except (OSError, ValueError, ConfigError):
        return None  # no finished run here, or one to look at closer: the preflight does
    if saved is None or saved["position"] or saved["epoch"] - 1 != cfg.epochs or summary["final"]["epoch"] != cfg.epochs:
        return None
    compare(saved, cfg, cfg.name)
    epochs = f"{cfg.epochs} epoch{'s' if cfg.epochs > 1 else ''}"
    print(f"run {cfg.name} already trained its {epochs} ({checkpoint.name}); nothing to train: pass a larger --epochs "
          "to train on, or --no-resume to start over", file=sys.stderr)
    return summary


def train(plan: RunPlan, display: Display, signals: Signals, code_paths: list[str], started: float,
          launched: float | None, on_rows: Callable[[list[dict[str, Any]]], None] | None = None) -> dict[str, Any]:
    """Start the trainer and watch it to its end; the summary, or why the run did not finish."""
    # TorchTrainer is DataParallelTrainer with TorchConfig, whose work ours does (ProcessGroupConfig),
    # and its module imports torch: the driver of a run checked without torch never imports it.
    from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer

    from raytrain_ddp.driver.run.sink import MetricsSink
    from raytrain_ddp.ray_compat import fast
    from raytrain_ddp.worker.entry import train_entry

    cfg = plan.cfg
    trackers = tracking.start(cfg, plan.run_dir)
    configs = plan.ray_train
    sink = MetricsSink.options(scheduling_strategy=on_this_node()).remote()
    trainer = fast(DataParallelTrainer)(
        train_entry,
        # run_dir, data_root: a Path, or an ObjectPath with its store's filesystem (endpoint, credentials): the
        # ranks start with the raylet's environment, not the driver's
        train_loop_config={"config": cfg.to_dict(), "sink": sink, "given": plan.given, "code_paths": code_paths,
                           "run_dir": plan.run_dir, "data_root": plan.data_root,
                           "resume_from": resume_from(plan)},
        scaling_config=configs.scaling,
        run_config=configs.run,
        backend_config=configs.backend,
        **ray_data(cfg, plan.data_root),
    )
    announce(plan, display)
    news = RunNews(sink, display, plan, trackers, StartupClock(launched, started, plan, RUN_STAGES), on_rows)
    summary = None
    try:
        try:
            error = drive(trainer, signals, news.poll, functools.partial(ask_to_stop, news, display, plan), POLL_S)
        except RayLost as lost:
            raise RayLost(lost.what, kept(plan.run_dir, cfg.name)) from None
        except Stalled as stalled:  # its culprits' nodes, when they stand apart, are bad
            culprits, where = news.stall.stalls[-1].culprits if news.stall.stalls else [], news.state.hosts
            found = [(host, f"a stall's culprit: {stalled}") for host in stall_hosts(culprits, where)]
            raise blame(plan.run_dir, stalled, found, where) from None
        finally:
            news.close()  # the run's files, whole, before the summary and whatever ends the run
            display.close()
        if error is not None:
            where = news.state.hosts
            raise blame(plan.run_dir, error, crash_hosts(error, where), where)  # a node that killed a rank
        summary = finish(plan, news, started, "SIGINT" in signals.received)
    finally:
        trackers.finish(plan.run_dir / "summary.json", ok=summary is not None)  # a stopped run resumes it later
    return summary


def ray_data(cfg: TrainConfig, root: RunPath | None) -> dict[str, Any]:
    """The trainer's datasets and dataset_config for --loader ray, over `root` (the plan's data_root);
    none otherwise, and then ray_ingest (torch) is not imported."""
    if cfg.loader != "ray":
        return {}
    from raytrain_ddp.data.ray_ingest import ray_data_config, ray_datasets

    return {"datasets": ray_datasets(cfg, root), "dataset_config": ray_data_config(cfg)}


def resume_from(plan: RunPlan) -> Any:
    """The checkpoint the ranks load while Ray has registered none in this run: the preflight's
    choice, the newest whole one (Ray's own latest wins once there is one). Ray Train V2 refuses
    TorchTrainer(resume_from_checkpoint=...), so it goes in the loop's config: a local path, or on
    an object store a ray.train.Checkpoint with the store's filesystem (its endpoint, its credentials)."""
    checkpoint = plan.resume.checkpoint if plan.resume is not None else None
    if isinstance(checkpoint, ObjectPath):
        import ray.train

        return ray.train.Checkpoint(checkpoint.key, filesystem=checkpoint.fs)
    return str(checkpoint) if checkpoint is not None else None


def announce(plan: RunPlan, display: Display) -> None:
    """The run's first lines: who trains where, and the global batch when micro-batches accumulate."""
    cfg = plan.cfg
    display.print(f"run {cfg.name}: {plan.world} {cfg.resolved_backend} workers -> {plan.run_dir}")
    accum = plan.accum_steps
    if accum > 1:
        display.print(
            f"global batch {cfg.batch_size * cfg.workers * accum} = --batch-size {cfg.batch_size} x "
            f"{cfg.workers} workers x {accum} accumulated micro-batches per optimizer step"
        )


def ask_to_stop(news: RunNews, display: Display, plan: RunPlan, name: str, before: list[str]) -> None:
    """A signal, passed on: the ranks checkpoint at their next agreed step and stop, within
    --stop-grace-s (RunNews.stop_overdue). A second Ctrl-C stops at once, without them."""
    if name == "SIGINT" and "SIGINT" in before:
        raise Interrupted(
            f"stopped at once by a second Ctrl-C, without a new checkpoint; {RESUME_HINT.format(name=plan.cfg.name)} "
            "from the last one",
            at_once=True,
        )
    label = "Ctrl-C" if name == "SIGINT" else name
    again = "; Ctrl-C again stops at once, without it" if name == "SIGINT" else ""
    if news.state.phase == "finished":  # nothing left to stop but the wait for the last checkpoint
        display.print(f"got {label}: the ranks finished training; the run ends once Ray Train has saved its last "
                      f"checkpoint{again}")
    else:
        display.print(f"got {label}: checkpointing at the next agreed step, then stopping{again}")
    news.stop_asked(name)
    news.sink.request_stop.remote()


def finish(plan: RunPlan, news: RunNews, started: float, interrupted: bool) -> dict[str, Any]:
    """The run's summary.json, once fit() returned; or why the run did not finish."""
    cfg, state = plan.cfg, news.state
    if state.stopped_at:
        epoch, step = state.stopped_at
        message = (
            f"stopped by {'Ctrl-C' if interrupted else 'a signal'} with a checkpoint at epoch {epoch} step {step}; "
            f"{RESUME_HINT.format(name=cfg.name)}"
        )
        raise Interrupted(message) if interrupted else Stopped(message)
    if len(state.rows) != cfg.epochs:
        raise RuntimeError(f"training ended after {len(state.rows)} of {cfg.epochs} epochs")
    return write_summary(
        plan, started, news.clock, cfg.to_dict(),
        final=state.rows[-1],
        world_size=state.world_size,
        backend=state.backend,
        nodes=[r.host for r in state.ranks],
        node_ips=[r.ip for r in state.ranks],
        first_step_unix=state.first_step_unix,
        profile=[line for _, line in sorted(state.profiles.items())] or None,  # --profile, by rank
        most_uneven_epoch=most_uneven(state.rank_parts, state.hosts),  # every rank's parts, and stragglers
        resizes=[{**event.to_json(), "why": event.reason} for event in state.resizes],
        health=list(state.health) if state.health is not None else None,  # the pre-flight check's nodes, GEMM and link figures (doctor/health.py)
        stalls=[dataclasses.asdict(report) for report in news.stall.stalls],  # each one Ray Train restarted from
    )
