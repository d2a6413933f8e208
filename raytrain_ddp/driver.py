"""The driver of `raytrain run`: check the request, run TorchTrainer, show progress, write the run's files."""

from __future__ import annotations

import dataclasses
import signal
import threading
import time
from pathlib import Path
from typing import Any

from raytrain_ddp.cluster import (
    check_writable,
    choose_layout,
    connect,
    on_this_node,
    preflight,
    ray_address,
    resolve_run,
    trainer_configs,
)
from raytrain_ddp.config import TrainConfig, dumps
from raytrain_ddp.metrics import (
    tensorboard_writer,
    write_csv,
    write_json,
    write_parquet,
)
from raytrain_ddp.progress import Display

POLL_S = 0.5
"""How often the driver asks rank 0's metrics sink for news."""


def dry_run(cfg: TrainConfig) -> None:
    cfg, run_dir = resolve_run(cfg)
    print(f"config:\n{dumps(cfg)}")
    if cfg.cpus_per_worker is None or cfg.placement is None:
        print("layout: --cpus-per-worker and --placement are chosen at start from the cluster's nodes (shown as 1, spread)")
    scaling, run, torch_config = trainer_configs(choose_layout(cfg, []))
    print(f"run directory: {run_dir}")
    print(f"ray address: {ray_address(cfg) or 'a new private local Ray'}")
    print(f"{scaling}\n{run}\n{torch_config}")


def run(cfg: TrainConfig, model: Any = None, dataset: Any = None) -> dict[str, Any]:
    """Train, write metrics.csv and summary.json, and return the summary. `model` and `dataset`
    (the Python API) override cfg's: a name, an import path, or a callable."""
    from raytrain_ddp import plugins, tracking
    from raytrain_ddp.data.ray_ingest import ray_datasets
    from raytrain_ddp.data.registry import validate
    from raytrain_ddp.models import model_builder
    from raytrain_ddp.shipping import ship_code, user_code
    from raytrain_ddp.worker import train_entry

    started = time.time()
    (model_spec, model_fn), (data_spec, data_fn) = plugins.as_spec(model, "model"), plugins.as_spec(dataset, "dataset")
    cfg = dataclasses.replace(cfg, model=model_spec or cfg.model, dataset=data_spec or cfg.dataset)
    given = {k: v for k, v in (("model", model_fn), ("dataset", data_fn)) if v is not None}
    if "model" not in given:
        model_builder(cfg.model)  # an unknown name or a broken import path fails here, in one line
    if "dataset" not in given:
        validate(cfg)
    tracking.check_installed(cfg)
    cfg, run_dir = resolve_run(cfg)
    if not cfg.resume:
        start_fresh(run_dir)
    check_writable(run_dir)
    connect(cfg)
    cfg = preflight(cfg)
    code_paths, code_env = user_code(cfg)
    ship_code(cfg, code_env)

    from ray.train.torch import TorchTrainer

    from raytrain_ddp.metrics import MetricsSink

    scaling, run_config, torch_config = trainer_configs(cfg)
    sink = MetricsSink.options(scheduling_strategy=on_this_node()).remote()
    trainer = TorchTrainer(
        train_entry,
        train_loop_config={"config": cfg.to_dict(), "sink": sink, "given": given, "code_paths": code_paths},
        scaling_config=scaling,
        run_config=run_config,
        torch_config=torch_config,
        datasets=ray_datasets(cfg),
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
    watcher = Watcher(sink, display, run_dir, cfg.tensorboard, trackers)
    watcher.start()
    stop_on_signals(sink, display)
    summary = None
    try:
        try:
            trainer.fit()
        finally:
            watcher.stop()
            display.close()
        summary = finish_run(cfg, run_dir, watcher.info, watcher.rows, started)
    finally:
        trackers.finish(run_dir / "summary.json", ok=summary is not None)  # a stopped run resumes it later
    return summary


def finish_run(cfg: TrainConfig, run_dir: Path, info: dict[str, Any], rows: list[dict], started: float) -> dict[str, Any]:
    """The run's summary.json, once fit() returned; or why the run did not finish."""
    if info.get("stopped_at"):
        epoch, step = info["stopped_at"]
        raise Stopped(
            f"stopped by a signal with a checkpoint at epoch {epoch} step {step}; run the same "
            f"command again (same --storage-path and --name {cfg.name}) to resume"
        )
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
        "resizes": [{**event, "why": resize_reason(event)} for event in info.get("resizes", [])],
        "config": cfg.to_dict(),
    }
    write_json(run_dir / "summary.json", summary)
    return summary


def resize_reason(event: dict[str, Any]) -> str:
    return "a worker or its node was lost" if event["to"] < event["from"] else "the cluster had room for more workers"


def describe_resize(event: dict[str, Any]) -> str:
    when = time.strftime("%H:%M:%S", time.localtime(event["at"]))
    return (
        f"{event['from']} -> {event['to']} workers at {when}, epoch {event['epoch']} after {event['position']} "
        f"samples ({resize_reason(event)}); the epoch goes on from there, re-sharded"
    )


class Stopped(Exception):
    """The run checkpointed and stopped early because the driver got SIGUSR1 or SIGTERM."""


def start_fresh(run_dir: Path) -> None:
    """--no-resume: move an old run aside rather than delete it, so nothing is lost."""
    if run_dir.exists() and any(run_dir.iterdir()):
        aside = run_dir.with_name(f"{run_dir.name}.old-{time.strftime('%Y%m%d-%H%M%S')}")
        run_dir.rename(aside)
        print(f"--no-resume: moved the previous run to {aside}")


def stop_on_signals(sink: Any, display: Display) -> None:
    """Slurm sends SIGUSR1 (--signal=B:USR1@grace) or SIGTERM before it kills a job."""

    def handler(signum: int, _frame: Any) -> None:
        display.print(f"got {signal.Signals(signum).name}: checkpointing at the next agreed step, then stopping")
        sink.request_stop.remote()

    for sig in (signal.SIGUSR1, signal.SIGTERM):
        signal.signal(sig, handler)


class Watcher(threading.Thread):
    """Polls the metrics sink while fit() blocks: updates the display, rewrites the metrics files."""

    def __init__(self, sink: Any, display: Display, run_dir: Path, tensorboard: bool, trackers: Any):
        super().__init__(daemon=True)
        self.sink, self.display, self.run_dir, self.trackers = sink, display, run_dir, trackers
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
            if self.tensorboard is not None:
                for row in rows[len(self.rows) :]:
                    for key, value in row.items():
                        if isinstance(value, (int, float)) and key != "epoch":
                            self.tensorboard.add_scalar(key, value, global_step=row["epoch"])
                self.tensorboard.flush()
            self.trackers.log_rows(rows[len(self.rows) :])
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
            self.display.print(f"resized: {describe_resize(event)}")
        self.info, self.rows = info, rows
        self.display.update(info, step, rows)

    def run(self) -> None:
        while not self.done.wait(POLL_S):
            self.poll()

    def stop(self) -> None:
        self.done.set()
        self.join()
        self.poll()  # the last epoch's row may have landed after the previous poll
