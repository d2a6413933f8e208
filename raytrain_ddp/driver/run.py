"""The driver of `raytrain run`: check the request, run TorchTrainer, show progress, write the run's files."""

from __future__ import annotations

import contextlib
import dataclasses
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

from raytrain_ddp.driver.cluster import (
    FitThread,
    check_writable,
    choose_layout,
    connect,
    live_nodes,
    on_this_node,
    preflight,
    ray_address,
    resolve_run,
    state_preflight,
    trainer_configs,
)
from raytrain_ddp.config import TrainConfig, dumps
from raytrain_ddp.driver.metrics import (
    tensorboard_writer,
    write_csv,
    write_json,
    write_parquet,
)
from raytrain_ddp.driver.progress import Display
from raytrain_ddp.driver.startup import RUN_STAGES, stages, stages_line
from raytrain_ddp.driver.startup import summary as startup_summary

POLL_S = 0.5
"""How often the driver asks rank 0's metrics sink for news."""


def check_request(cfg: TrainConfig, model: Any = None, dataset: Any = None, dry: bool = False) -> tuple[TrainConfig, Path, dict[str, Any]]:
    """Every check that needs no Ray, in seconds, for a run and its --dry-run alike: --model (it
    imports and builds an nn.Module), --dataset and its files, the trackers' packages, and a resume's
    fit with its checkpoint (resume.py). Returns cfg with the Python API's model and dataset, the run
    directory, and the callables to send by value."""
    from raytrain_ddp import plugins, ray_compat
    from raytrain_ddp.checkpoint import compat as resume
    from raytrain_ddp.driver import tracking
    from raytrain_ddp.data.registry import validate
    from raytrain_ddp.worker.models import model_builder

    if cfg.elastic:
        ray_compat.require("elastic")

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
    cfg, run_dir = resolve_run(cfg)
    for line in resume.check(cfg, run_dir, given.get("model")):
        print(line, file=sys.stderr)
    return cfg, run_dir, given


def dry_run(cfg: TrainConfig) -> None:
    cfg, run_dir, _ = check_request(cfg, dry=True)
    state_preflight(cfg)  # the model state per rank; with --gpu checked against a local GPU only
    print(f"config:\n{dumps(cfg)}")
    if cfg.cpus_per_worker is None or cfg.placement is None:
        print("layout: --cpus-per-worker and --placement are chosen at start from the cluster's nodes (shown as 1, spread)")
    scaling, run, torch_config = trainer_configs(choose_layout(cfg, []))
    print(f"run directory: {run_dir}")
    print(f"ray address: {ray_address(cfg) or 'a new private local Ray'}")
    print(f"{scaling}\n{run}\n{torch_config}")


def run(cfg: TrainConfig, model: Any = None, dataset: Any = None, launched: float | None = None) -> dict[str, Any]:
    """Train, write metrics.csv and summary.json, and return the summary. `model` and `dataset`
    (the Python API) override cfg's: a name, an import path, or a callable. `launched`: when the
    command began (the CLI's process start), so the start-up stages count its imports; default now.
    Ctrl-C checkpoints, then raises Interrupted (a KeyboardInterrupt); SIGTERM or SIGUSR1
    checkpoints, then raises Stopped."""
    from raytrain_ddp import ray_compat
    from raytrain_ddp.driver import tracking
    from raytrain_ddp.data.ray_ingest import ray_data_config, ray_datasets
    from raytrain_ddp.driver.shipping import ship_code, user_code
    from raytrain_ddp.worker.entry import train_entry

    started = time.time()
    marks = {"python": started} if launched else {}  # start-up stages, the driver's (startup.py)
    cfg, run_dir, given = check_request(cfg, model, dataset)
    if without := ray_compat.going_without():
        print(without, file=sys.stderr)
    if not cfg.resume:
        start_fresh(run_dir)
    check_writable(run_dir)
    marks["checks"] = time.time()
    connect(cfg)
    marks["connect"] = time.time()
    cfg = preflight(cfg)
    state_preflight(cfg, given.get("model"), live_nodes())
    marks["placement"] = time.time()
    code_paths, code_env = user_code(cfg)
    ship_code(cfg, code_env)

    from ray.train.torch import TorchTrainer

    from raytrain_ddp.ray_compat import fast
    from raytrain_ddp.driver.metrics import MetricsSink

    scaling, run_config, torch_config = trainer_configs(cfg)
    sink = MetricsSink.options(scheduling_strategy=on_this_node()).remote()
    trainer = fast(TorchTrainer)(
        train_entry,
        train_loop_config={"config": cfg.to_dict(), "sink": sink, "given": given, "code_paths": code_paths},
        scaling_config=scaling,
        run_config=run_config,
        torch_config=torch_config,
        datasets=ray_datasets(cfg),
        dataset_config=ray_data_config(cfg),
    )
    display = Display(cfg.progress, cfg.epochs)
    size = f"{cfg.workers} to {cfg.max_workers} (elastic)" if cfg.elastic else str(cfg.workers)
    display.print(f"run {cfg.name}: {size} {cfg.resolved_backend} workers -> {run_dir}")
    if cfg.accum_steps(cfg.workers) > 1:
        accum = cfg.accum_steps(cfg.workers)
        display.print(
            f"global batch {cfg.batch_size * cfg.workers * accum} = --batch-size {cfg.batch_size} x "
            f"{cfg.workers} workers x {accum} accumulated micro-batches per optimizer step"
        )
    trackers = tracking.start(cfg, run_dir)
    watcher = Watcher(sink, display, run_dir, cfg.tensorboard, trackers, (launched or started, marks))
    watcher.start()
    summary = None
    try:
        with stop_on_signals(cfg, sink, display) as interrupted:
            try:
                fit(trainer)
            finally:
                watcher.stop()
                display.close()
        summary = finish_run(cfg, run_dir, watcher.info, watcher.rows, started, interrupted(), watcher.startup)
    finally:
        trackers.finish(run_dir / "summary.json", ok=summary is not None)  # a stopped run resumes it later
    return summary


def fit(trainer: Any) -> None:
    """trainer.fit(), from a thread of its own (cluster.FitThread) when this is the main thread, which
    waits for it: then Ctrl-C reaches stop_on_signals' handler here."""
    if threading.current_thread() is not threading.main_thread():
        trainer.fit()
        return
    thread = FitThread(trainer)
    thread.start()
    while thread.is_alive():
        thread.join(POLL_S)  # signal handlers run between waits; a second Ctrl-C raises out of here
    if thread.error is not None:
        raise thread.error


def finish_run(
    cfg: TrainConfig, run_dir: Path, info: dict[str, Any], rows: list[dict], started: float, interrupted: bool = False,
    startup: dict[str, float] | None = None,
) -> dict[str, Any]:
    """The run's summary.json, once fit() returned; or why the run did not finish. `startup`: seconds
    per start-up stage (startup.py), as the run's line showed them."""
    if info.get("stopped_at"):
        epoch, step = info["stopped_at"]
        message = (
            f"stopped by {'Ctrl-C' if interrupted else 'a signal'} with a checkpoint at epoch {epoch} step {step}; "
            f"{RESUME_HINT.format(cfg=cfg)}"
        )
        raise Interrupted(message) if interrupted else Stopped(message)
    if len(rows) != cfg.epochs:
        raise RuntimeError(f"training ended after {len(rows)} of {cfg.epochs} epochs")
    summary = {
        "name": cfg.name,
        "run_dir": str(run_dir),
        "final": rows[-1],
        "world_size": info["world_size"],
        "backend": info["backend"],
        "nodes": [r["hostname"] for r in info["ranks"]],
        "node_ips": [r["ip"] for r in info["ranks"]],
        "wall_time_s": round(time.time() - started, 3),
        "first_step_unix": info.get("first_step_unix"),
        "startup": startup_summary(startup) if startup else None,
        "profile": [line for _, line in sorted(info.get("profiles", {}).items())] or None,  # --profile, by rank
        "resizes": [{**event, "why": resize_reason(event)} for event in info.get("resizes", [])],
        "config": cfg.to_dict(),
    }
    write_json(run_dir / "summary.json", summary)
    return summary


RESUME_HINT = "run the same command again (same --storage-path and --name {cfg.name}) to resume"


def resize_reason(event: dict[str, Any]) -> str:
    if event["to"] == event["from"]:
        return "a worker group restarted after a failure"
    return "a worker or its node was lost" if event["to"] < event["from"] else "the cluster had room for more workers"


def describe_resize(event: dict[str, Any]) -> str:
    when = time.strftime("%H:%M:%S", time.localtime(event["at"]))
    if event["to"] == event["from"]:
        where = "the start" if (event["epoch"], event["position"]) == (1, 0) else (
            f"epoch {event['epoch']} after {event['position']} samples")
        return f"restarted: {event['to']} workers at {when}, from {where} ({resize_reason(event)})"
    return (
        f"resized: {event['from']} -> {event['to']} workers at {when}, epoch {event['epoch']} after {event['position']} "
        f"samples ({resize_reason(event)}); the epoch goes on from there, re-sharded"
    )


class Stopped(Exception):
    """The run checkpointed and stopped early because the driver got SIGUSR1 or SIGTERM."""


class Interrupted(KeyboardInterrupt):
    """Ctrl-C: the run checkpointed and stopped (the first), or stopped at once (a second). A
    KeyboardInterrupt, as the Python API's callers expect of Ctrl-C."""

    def __init__(self, message: str, at_once: bool = False) -> None:
        super().__init__(message)
        self.at_once = at_once
        """A second Ctrl-C: the run did not wait for its ranks."""


def start_fresh(run_dir: Path) -> None:
    """--no-resume: move an old run aside rather than delete it, so nothing is lost."""
    if run_dir.exists() and any(run_dir.iterdir()):
        aside = run_dir.with_name(f"{run_dir.name}.old-{time.strftime('%Y%m%d-%H%M%S')}")
        run_dir.rename(aside)
        print(f"--no-resume: moved the previous run to {aside}")


@contextlib.contextmanager
def stop_on_signals(cfg: TrainConfig, sink: Any, display: Display) -> Iterator[Callable[[], bool]]:
    """While fit() runs, SIGUSR1 or SIGTERM (Slurm's --signal=B:USR1@grace, scancel, `raytrain stop`)
    and the first Ctrl-C make the ranks checkpoint at their next agreed step and stop; a second
    Ctrl-C stops at once. Yields whether a Ctrl-C asked (then exit 130, else 75). The handlers that
    were there before come back after, for the Python API's callers."""
    interrupted = threading.Event()
    if threading.current_thread() is not threading.main_thread():  # only the main thread may set handlers
        yield interrupted.is_set
        return

    def handler(signum: int, _frame: Any) -> None:
        if signum == signal.SIGINT:
            if interrupted.is_set():
                raise Interrupted(
                    f"stopped at once by a second Ctrl-C, without a new checkpoint; {RESUME_HINT.format(cfg=cfg)} "
                    "from the last one",
                    at_once=True,
                )
            interrupted.set()
        name = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        again = "; Ctrl-C again stops at once, without it" if signum == signal.SIGINT else ""
        display.print(f"got {name}: checkpointing at the next agreed step, then stopping{again}")
        sink.request_stop.remote()

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)}
    try:
        yield interrupted.is_set
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


class Watcher(threading.Thread):
    """Polls the metrics sink while fit() blocks: updates the display, rewrites the metrics files,
    and at the first step shows the start-up stages."""

    def __init__(
        self, sink: Any, display: Display, run_dir: Path, tensorboard: bool, trackers: Any,
        driver_marks: tuple[float, dict[str, float]] = (0.0, {}),
    ):
        super().__init__(daemon=True)
        self.sink, self.display, self.run_dir, self.trackers = sink, display, run_dir, trackers
        self.begin, self.marks = driver_marks
        self.startup: dict[str, float] | None = None
        self.tensorboard = tensorboard_writer(run_dir) if tensorboard else None
        self.info: dict[str, Any] = {}
        self.rows: list[dict[str, Any]] = []
        self.done = threading.Event()

    def poll(self) -> None:
        import ray

        info, step, rows = ray.get(self.sink.poll.remote())
        if rows != self.rows:
            write_csv(self.run_dir / "metrics.csv", rows)
            write_parquet(self.run_dir / "metrics.parquet", rows)
            fresh = [row for row in rows if row not in self.rows]  # a redone epoch's row is fresh again
            if self.tensorboard is not None:
                for row in fresh:
                    for key, value in row.items():
                        if isinstance(value, (int, float)) and key != "epoch":
                            self.tensorboard.add_scalar(key, value, global_step=row["epoch"])
                self.tensorboard.flush()
            self.trackers.log_rows(fresh)
        if info.get("ranks") and info.get("ranks") != self.info.get("ranks"):
            # Which pid on which host is which rank: for the user (and for tests that kill one).
            write_json(self.run_dir / "workers.json", {"ranks": info["ranks"]})
        if info.get("resumed_at") and info.get("resumed_at") != self.info.get("resumed_at"):
            epoch, position, at_step = info["resumed_at"]
            self.display.print(f"resumed from the checkpoint at epoch {epoch} step {at_step} (after {position} of its samples)")
        if info.get("drain_saved") and info.get("drain_saved") != self.info.get("drain_saved"):
            epoch, position = info["drain_saved"]
            self.display.print(f"Ray is draining a node of this run: checkpointed at epoch {epoch} after {position} samples")
        for event in info.get("resizes", [])[len(self.info.get("resizes", [])) :]:
            self.display.print(describe_resize(event))
        if self.startup is None and info.get("startup") and info.get("first_step_unix"):
            marks = {**self.marks, **info["startup"], "first step": info["first_step_unix"]}
            self.startup = stages(self.begin, marks, RUN_STAGES)
            self.display.print(stages_line(self.startup))
        for rank, line in sorted(info.get("profiles", {}).items()):
            if line != self.info.get("profiles", {}).get(rank):
                self.display.print(line)
        self.info, self.rows = info, rows
        self.display.update(info, step, rows)

    def run(self) -> None:
        while not self.done.wait(POLL_S):
            self.poll()

    def stop(self) -> None:
        self.done.set()
        self.join()
        self.poll()  # the last epoch's row may have landed after the previous poll
