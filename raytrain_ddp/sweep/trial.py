"""One trial of a sweep, as Ray Tune runs it: a whole `raytrain run`, driven from the trial's actor.

Tune's actor is the trial's driver: it plans, starts Ray Train's controller and watches the ranks,
as `raytrain run` does from a terminal, so the trial has everything a run has (exact resume, the
doctor, trackers, FSDP). Tune sees only what a scheduler needs: the run's epoch rows. Tune stops a
trial (ASHA's cut, the sweep's end or Ctrl-C) by calling `cleanup`, which asks the run to stop as
SIGTERM would: its ranks checkpoint at the next agreed step and Ray Train removes its placement
group itself, so nothing of a stopped trial outlives it.

This module runs in Tune's actors; sweep.py imports it only once Ray is joined.
"""

from __future__ import annotations

import json
import os
import queue
import sys
import threading
import time
from pathlib import Path
from typing import Any

from ray import tune

from raytrain_ddp.config import TrainConfig
from raytrain_ddp.driver.core.drive import Signals
from raytrain_ddp.errors import one_line
from raytrain_ddp.run_files import write_json
from raytrain_ddp.stops import Interrupted, Stopped
from raytrain_ddp.storage.location import RunPath, storage_root
from raytrain_ddp.storage.staged import StagedDir

HEARTBEAT_S = 5.0
"""The longest a step waits for an epoch's row: Tune can stop a trial only between steps, so a
stop (the sweep's Ctrl-C) waits at most this long before the run is asked to checkpoint and end."""
LEFTOVER_WAIT_S = 60.0
"""How long a trial waits for room that the trial before it is still giving back."""
METRICS = ("train_loss", "train_acc", "val_loss", "val_acc", "throughput")
"""The row's figures Tune gets (a scheduler's metric is one of them); the rest stays in metrics.csv."""


def trial_config(config: dict[str, Any]) -> TrainConfig:
    """The trial's run: the sweep's base config with the trial's parameters, in the sweep's trials/
    directory, on the cluster this actor is in. It always resumes: a trial Tune starts again after
    the sweep was stopped goes on from its own checkpoint."""
    import ray

    trial = config["trial"]
    base = config["base"]
    sweep = storage_root(config["trials_dir"]).parent.name
    values = {
        **base, **trial["params"], "name": trial["id"], "storage_path": config["trials_dir"], "resume": True,
        "address": ray.get_runtime_context().gcs_address, "progress": "plain",
        # A trial starts as another one ends: its workers' placement group is on its way out
        "wait_for_resources": max(base["wait_for_resources"], LEFTOVER_WAIT_S),
        # MLflow: the trials are runs of one experiment, named for the sweep (unless one was named)
        "mlflow_experiment": sweep if base["mlflow_experiment"] == "raytrain" else base["mlflow_experiment"],
    }
    return TrainConfig.from_dict(values)


def group_trackers(sweep_dir: RunPath) -> None:
    """W&B groups the trials' runs under the sweep's name; MLflow's local store is the sweep's, one
    for all its trials (a tracking server the user set is left as it is; on an object store, where
    SQLite cannot be, the sweep's checks asked for one)."""
    os.environ.setdefault("WANDB_RUN_GROUP", sweep_dir.name)
    if isinstance(sweep_dir, Path):
        os.environ.setdefault("MLFLOW_TRACKING_URI", f"sqlite:///{sweep_dir / 'mlflow.db'}")


def outcome_path(trials_dir: RunPath, trial: str) -> RunPath:
    """What the trial's actor last said of its run: started, ended, status and a line (sweep.py reads it)."""
    return trials_dir / f"{trial}.json"


def ended_before(trials_dir: RunPath, trial: str) -> str | None:
    """How the trial ended in an earlier life of the sweep, when it did: "finished" (its actor said so),
    or "stopped early" or "failed" (the driver's callback said so). A sweep killed before Tune saved
    that end restores the trial as running; it must be kept as it ended, not run again."""
    for path, key in ((outcome_path(trials_dir, trial), "status"), (trials_dir.parent / "status.json", trial)):
        try:
            status = json.loads(path.read_text()).get(key)
        except (OSError, ValueError):
            continue
        if status in ("finished", "stopped early", "failed"):
            return status
    return None


class TrialRun(tune.Trainable):
    """The trial's run on a thread of the actor; each step hands Tune the newest epoch row."""

    def setup(self, config: dict[str, Any]) -> None:
        # Tune runs trials in its own directory; the user's --model/--dataset paths are the sweep's.
        os.chdir(config["cwd"])
        sys.path[:0] = [config["cwd"]]
        self.id, self.trials_dir = config["trial"]["id"], storage_root(config["trials_dir"])
        self.log = StagedDir(self.trials_dir)  # on an object store: the log, copied up every KEEP_S and at the end
        sys.stdout = sys.stderr = self.log.open(f"{self.id}.log")  # one trial per actor: its lines, in its log
        self.cfg = trial_config(config)
        group_trackers(self.trials_dir.parent)
        self.code_paths = config["code_paths"]
        self.kept = ended_before(self.trials_dir, self.id)
        self.signals = Signals()
        self.rows: queue.Queue[list[dict[str, Any]] | None] = queue.Queue()
        self.reported = 0
        """The last epoch Tune got."""
        self.pending: list[dict[str, Any]] = []
        """Epoch rows that came and Tune has not got yet."""
        self.last: dict[str, Any] = {}
        self.status, self.line = "running", ""
        self.thread = threading.Thread(target=self.run_trial, name=f"trial-{self.id}", daemon=True)
        if self.kept is None:
            self.started = time.time()
            self.say()
            self.thread.start()

    def run_trial(self) -> None:
        from raytrain_ddp.driver.run.command import run

        try:
            summary = run(self.cfg, signals=self.signals, on_rows=self.rows.put, code_paths=self.code_paths)
            self.status, self.line = "finished", f"val acc {summary['final']['val_acc']:.3f}"
        except (Stopped, Interrupted) as err:
            self.status, self.line = "stopped", str(err)
        except BaseException as err:  # the trial's failure, said in its one line; the sweep goes on
            self.status, self.line = "failed", one_line(err)
        finally:
            try:
                self.say(ended=time.time())
            finally:  # Tune's step waits on it, whatever the store did
                self.rows.put(None)

    def say(self, ended: float | None = None) -> None:
        if ended is not None:
            self.log.sync()  # before the outcome: the sweep reads that as the trial's end
        write_json(outcome_path(self.trials_dir, self.id), {
            "trial": self.id, "status": self.status, "line": self.line, "started": self.started, "ended": ended,
            "workers": self.cfg.workers,
        })

    def step(self) -> dict[str, Any]:
        """The next epoch's row Tune has not seen, each in turn (ASHA judges a trial at its rung's own
        epoch); {} when none came within HEARTBEAT_S; the last one again, done, when the run ended."""
        if self.kept is not None:
            return self.as_it_ended()
        self.log.keep()  # Tune steps at least every HEARTBEAT_S
        if not self.pending:
            try:
                rows = self.rows.get(timeout=HEARTBEAT_S)
            except queue.Empty:
                return {}  # no epoch yet: Tune may stop the trial between steps (TUNE_DISABLE_STRICT_METRIC_CHECKING)
            if rows is None:
                if self.status != "finished":
                    raise RuntimeError(self.line)  # Tune marks the trial failed; sweep.py reads the line
                return {**self.last, "done": True}
            self.pending = [row for row in rows if int(row["epoch"]) > self.reported]
            if not self.pending:
                return {}
        row = self.pending.pop(0)
        self.reported = int(row["epoch"])
        self.last = {"epoch": self.reported, **{k: float(row[k]) for k in METRICS if row.get(k) not in (None, "")}}
        return dict(self.last)

    def as_it_ended(self) -> dict[str, Any]:
        """A kept trial's end, for Tune: its last epoch's row, done, marked kept (no line is said again)."""
        from raytrain_ddp.run_files import read_csv

        path = self.trials_dir / self.id / "metrics.csv"
        rows = read_csv(path) if path.exists() else []
        last = {k: float(rows[-1][k]) for k in METRICS if rows and rows[-1].get(k) not in (None, "")}
        return {"epoch": int(rows[-1]["epoch"]) if rows else 0, **last, "done": True, "kept": True}

    def save_checkpoint(self, checkpoint_dir: str) -> dict[str, Any]:
        """Tune's checkpoint of a trial it stops: nothing, since the run keeps its own."""
        return {"trial": self.id}

    def load_checkpoint(self, checkpoint: Any) -> None:
        """The run resumes from its own checkpoint, in its own directory."""

    def cleanup(self) -> None:
        """Tune's stop: ask the run to checkpoint and end, and wait for it (Ray Train then removes its
        placement group); a run that does not answer is ended by its own --stop-grace-s."""
        if self.thread.is_alive():
            self.signals.ask("SIGTERM")
            self.thread.join(self.cfg.stop_grace_s + 60)
