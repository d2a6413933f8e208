"""Send a run to MLflow and/or Weights & Biases from the driver: config, per-epoch rows, summary.json.

A tracker is a side channel: one that fails prints one warning and is dropped, and training goes on.
<run dir>/tracking.json keeps each tracker's run id and the last epoch it got, so a run resumed after
a preemption continues the same tracked run, and the rows the driver sends again are not re-logged.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from raytrain_ddp.config import TrainConfig
from raytrain_ddp.run_files import write_json

ENV_DEFAULTS = {
    # MLflow's own (7 retries, exponential backoff, 120 s timeout) spend 4 minutes on a server that
    # is down, and W&B's init waits 90 s; these give up in about 15 s.
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "4",
    "WANDB_INIT_TIMEOUT": "15",
    # Off the terminal: "Creating initial MLflow database tables...", W&B's banners, and W&B's
    # capture of the driver's stdout, which it would wrap under the progress display.
    "MLFLOW_LOGGING_LEVEL": "WARNING",
    "WANDB_SILENT": "true",
    "WANDB_CONSOLE": "off",
}
"""Set before the libraries are imported; a user's own setting of any of them wins."""


def load(name: str) -> Any:
    for key, value in ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)
    return importlib.import_module(name)


def numeric(row: dict[str, Any]) -> dict[str, float]:
    """The row's metrics: the epoch is the step, not a metric; `backend` and missing values are skipped."""
    return {k: v for k, v in row.items() if k != "epoch" and isinstance(v, (int, float))}


class MLflow:
    """$MLFLOW_TRACKING_URI, else an sqlite store at <run dir>/mlflow.db with artifacts in
    <run dir>/mlartifacts: MLflow 3 refuses its old ./mlruns file store unless told otherwise."""

    def __init__(self, cfg: TrainConfig, run_dir: Path, run_id: str | None):
        mlflow = load("mlflow")
        uri = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{run_dir.absolute() / 'mlflow.db'}"
        self.client = mlflow.MlflowClient(uri)
        try:
            if run_id is not None:
                self.client.update_run(run_id, status="RUNNING")
        except mlflow.exceptions.MlflowException as err:
            if err.error_code != "RESOURCE_DOES_NOT_EXIST":
                raise
            run_id = None  # another tracking server than last time, or a deleted run: start anew
        if run_id is None:
            experiment = self.client.get_experiment_by_name(cfg.mlflow_experiment)
            experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(
                cfg.mlflow_experiment, artifacts_beside(uri),
            )
            run_id = self.client.create_run(experiment_id, run_name=cfg.name).info.run_id
            # Only once: MLflow refuses to change a param, and a resumed run may change, say, --epochs.
            params = [mlflow.entities.Param(k, str(v)) for k, v in cfg.to_dict().items()]
            self.client.log_batch(run_id, params=params)
        self.run_id = run_id

    def log(self, rows: list[dict[str, Any]]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        for row in rows:  # a batch per row: MLflow takes at most 1000 metrics per batch
            metrics = [Metric(k, float(v), now, row["epoch"]) for k, v in numeric(row).items()]
            self.client.log_batch(self.run_id, metrics=metrics)

    def finish(self, summary: Path, ok: bool) -> None:
        if summary.exists():
            self.client.log_artifact(self.run_id, str(summary))
        self.client.set_terminated(self.run_id, "FINISHED" if ok else "FAILED")


def artifacts_beside(uri: str) -> str | None:
    """Where a new experiment keeps its artifacts: beside an sqlite store's file (MLflow would put them
    under the cwd), or where the tracking server says (None)."""
    if not uri.startswith("sqlite:///"):
        return None
    return (Path(uri.removeprefix("sqlite:///")).parent / "mlartifacts").as_uri()


class WandB:
    """W&B reads WANDB_MODE, WANDB_ENTITY and its other WANDB_* settings itself."""

    def __init__(self, cfg: TrainConfig, run_dir: Path, run_id: str | None):
        self.wandb = load("wandb")
        try:
            self.run = self.wandb.init(
                project=os.environ.get("WANDB_PROJECT", "raytrain"),
                name=cfg.name,
                config=cfg.to_dict(),
                dir=None if os.environ.get("WANDB_DIR") else str(run_dir),
                id=run_id,
                resume="allow" if run_id else None,
            )
        except BaseException:
            self.wandb.teardown()
            raise
        self.run_id = self.run.id

    def log(self, rows: list[dict[str, Any]]) -> None:
        for row in rows:
            self.run.log(numeric(row), step=row["epoch"])

    def finish(self, summary: Path, ok: bool) -> None:
        try:
            if summary.exists():
                self.run.save(str(summary), base_path=str(summary.parent), policy="now")
            self.run.finish(exit_code=0 if ok else 1)
        finally:
            self.wandb.teardown()  # stop W&B's background service now, not at the driver's exit


class Trackers:
    """The trackers that started; each call skips one that failed before, after its one warning."""

    def __init__(self, cfg: TrainConfig, run_dir: Path):
        self.path = run_dir / "tracking.json"
        try:
            self.state: dict[str, dict[str, Any]] = json.loads(self.path.read_text())
        except (OSError, ValueError):  # the first start, or a file cut short by a crash
            self.state = {}
        self.active: dict[str, Any] = {}
        for name, tracker in (("mlflow", MLflow), ("wandb", WandB)):
            if getattr(cfg, name):
                self.call(name, self.begin, name, tracker, cfg, run_dir)

    def begin(self, name: str, tracker: type, cfg: TrainConfig, run_dir: Path) -> None:
        saved = self.state.get(name, {})
        self.active[name] = started = tracker(cfg, run_dir, saved.get("run_id"))
        epoch = saved.get("epoch", 0) if started.run_id == saved.get("run_id") else 0
        self.state[name] = {"run_id": started.run_id, "epoch": epoch}
        write_json(self.path, self.state)

    def log_rows(self, rows: list[dict[str, Any]]) -> None:
        for name, tracker in list(self.active.items()):
            # The driver sends every epoch's row again after a resume; a tracker gets each one once.
            new = [row for row in rows if row["epoch"] > self.state[name]["epoch"]]
            if new:
                self.call(name, self.send, name, tracker, new)

    def send(self, name: str, tracker: Any, rows: list[dict[str, Any]]) -> None:
        tracker.log(rows)
        self.state[name]["epoch"] = rows[-1]["epoch"]
        write_json(self.path, self.state)

    def finish(self, summary: Path, ok: bool) -> None:
        for name, tracker in list(self.active.items()):
            self.call(name, tracker.finish, summary, ok)
        self.active.clear()

    def call(self, name: str, fn: Any, *args: Any) -> None:
        """fn(*args); on any failure, one warning line and the tracker is dropped."""
        try:
            fn(*args)
        except Exception as err:
            reason = " ".join(str(err).split()) or type(err).__name__
            print(f"warning: {name}: {reason}; training goes on without it", file=sys.stderr, flush=True)
            self.active.pop(name, None)


def start(cfg: TrainConfig, run_dir: Path) -> Trackers:
    """Start (or resume) the trackers that cfg turns on; with none on, every call does nothing."""
    return Trackers(cfg, run_dir)
