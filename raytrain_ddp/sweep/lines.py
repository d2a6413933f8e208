"""What a sweep says while Tune runs it: a line per trial start, rung and end, each trial's status in
status.json, and the stop signals noted for the exit status. Tune's side of the driver: imported
once Ray is joined."""

from __future__ import annotations

import contextlib
import json
import signal
from typing import Any

from ray import tune

from raytrain_ddp.driver.core.drive import STOP_SIGNALS
from raytrain_ddp.run_files import write_json
from raytrain_ddp.storage.location import RunPath, storage_root
from raytrain_ddp.sweep.report import fmt, say
from raytrain_ddp.sweep.trial import ended_before, outcome_path

RECEIVED: list[str] = []
"""The stop signals the sweep got, in order (Tune ends its loop on the first)."""


def trial_name(trial: Any) -> str:
    """Tune's name and directory for a trial: ours (t00, ...), so its files and ours pair up."""
    return trial.config["trial"]["id"]


@contextlib.contextmanager
def stop_signals() -> Any:
    """While Tune runs: SIGTERM ends it as Ctrl-C does (Tune's own handler, which stops every trial
    and saves its state), and each signal is noted in RECEIVED for the exit status. SweepLines.setup
    puts the noting handler in front of Tune's, which Tune installs inside fit()."""
    previous = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}

    def before_tune(signum: int, _frame: Any) -> None:
        RECEIVED.append(signal.Signals(signum).name)
        raise KeyboardInterrupt  # before Tune's loop, or a second signal: stop at once

    for sig in STOP_SIGNALS:
        signal.signal(sig, before_tune)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def noting(tune_handler: Any) -> Any:
    def handler(signum: int, frame: Any) -> None:
        RECEIVED.append(signal.Signals(signum).name)
        say(f"got {signal.Signals(signum).name}: stopping the sweep; its running trials checkpoint first "
            "(a second signal stops at once)")
        tune_handler(signal.SIGINT, frame)
    return handler


class SweepLines(tune.Callback):
    """Tune's callback: a line for each trial's start, rung and end, and its status in status.json
    (a rerun's report reads the ones before it). Tune pickles it with the experiment and restores it:
    so it keeps the sweep's directory as typed (a URI holds no credentials) and resolves it at use."""

    def __init__(self, sweep_dir: str, metric: str, mode: str, epochs: int, rungs: list[int]) -> None:
        self.sweep_dir, self.metric, self.mode, self.epochs, self.rungs = sweep_dir, metric, mode, epochs, rungs
        self.judged: dict[int, dict[str, float]] = {}
        """The metric of each trial ASHA judged at each epoch it judged at, for the lines' "2 of 5"."""

    def setup(self, **_info: Any) -> None:
        tune_handler = signal.getsignal(signal.SIGINT)  # Tune's, installed just before
        if callable(tune_handler):
            for sig in STOP_SIGNALS:
                signal.signal(sig, noting(tune_handler))

    def on_trial_start(self, iteration: int, trials: list, trial: Any, **_info: Any) -> None:
        tid = trial_name(trial)
        trials_dir = self.trials_dir()
        if ended_before(trials_dir, tid):
            return  # kept as it ended before the sweep was stopped (sweep_trial.ended_before)
        others = [t for t in trials if t is not trial]
        running = 1 + sum(t.status == "RUNNING" for t in others)
        ended = sum(t.status in ("TERMINATED", "ERROR") for t in others)
        waiting = sum(t.status in ("PENDING", "PAUSED") for t in others)
        # Its checkpoints, not its outcome file: the actor writes that in setup, before Tune calls this
        resumes = any((trials_dir / tid).glob("checkpoint_*"))
        again = "resumed from its checkpoint" if resumes else "started"
        say(f"trial {tid} {again}: {fmt(trial.config['trial']['params'])} ({running} running, {ended} ended, {waiting} waiting)")

    def on_trial_result(self, iteration: int, trials: list, trial: Any, result: dict, **_info: Any) -> None:
        """Tune calls this after its scheduler decided, with done set when the decision was to stop:
        before the last epoch, that is ASHA's cut (a run's own end comes with its last epoch)."""
        tid, epoch = trial_name(trial), result.get("epoch")
        if epoch is None or self.metric not in result or result.get("kept"):
            return
        cut = bool(result.get("done")) and epoch < self.trial_epochs(trial)
        if not cut and epoch not in self.rungs:
            return
        value = result[self.metric]
        judged = self.judged.setdefault(epoch, {})
        judged[tid] = value
        place = sorted(judged.values(), reverse=self.mode == "max").index(value) + 1
        where = f"{self.metric} {value:.4g}, {place} of {len(judged)} judged at epoch {epoch} so far"
        if cut:
            say(f"trial {tid} stopped early by ASHA after epoch {epoch}: {where}")
            self.status(tid, "stopped early")
            self.record("cuts.json", tid, epoch)
        else:
            say(f"trial {tid} passed the rung at epoch {epoch}: {where}")

    def on_trial_complete(self, iteration: int, trials: list, trial: Any, **_info: Any) -> None:
        tid, last = trial_name(trial), trial.last_result or {}
        if last.get("kept") or last.get("epoch", 0) < self.trial_epochs(trial):
            return  # kept as it ended, or stopped early: said with its result
        value = f", {self.metric} {last[self.metric]:.4g}" if self.metric in last else ""
        say(f"trial {tid} finished: {last['epoch']} epochs{value}")
        self.status(tid, "finished")

    def trial_epochs(self, trial: Any) -> int:
        return trial.config["trial"]["params"].get("epochs", self.epochs)

    def on_trial_error(self, iteration: int, trials: list, trial: Any, **_info: Any) -> None:
        tid = trial_name(trial)
        outcome = read_outcome(self.trials_dir(), tid)
        say(f"trial {tid} failed: {outcome.get('line') or 'see its log, ' + str(self.trials_dir() / (tid + '.log'))}")
        self.status(tid, "failed")

    def trials_dir(self) -> RunPath:
        return storage_root(self.sweep_dir) / "trials"

    def status(self, tid: str, status: str) -> None:
        self.record("status.json", tid, status)

    def record(self, name: str, tid: str, value: Any) -> None:
        """status.json: how each trial ended; cuts.json: the epoch ASHA cut each stopped one at."""
        path = self.trials_dir().parent / name
        values = json.loads(path.read_text()) if path.exists() else {}
        write_json(path, {**values, tid: value})


def read_outcome(trials_dir: RunPath, tid: str) -> dict[str, Any]:
    path = outcome_path(trials_dir, tid)
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
