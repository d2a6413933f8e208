"""`raytrain sweep` on the shared Ray head: ASHA's cut at concurrency 1 (ray-project/ray#54305's
deadlock), a driver killed mid-sweep and resumed (on an object store), and no placement group left behind either way."""

from __future__ import annotations

import csv
import io
import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from conftest import raytrain

pytestmark = pytest.mark.e2e

RUN = ["--train-samples", "256", "--val-samples", "64", "--batch-size", "32", "--data-workers", "0",
       "--progress", "plain", "--workers", "1", "--health", "off"]
"""Each trial: one worker on one CPU, a few seconds an epoch."""


def live_groups(env: dict[str, str]) -> list[str]:
    """The states of the head's placement groups that still hold (or wait for) resources."""
    code = ("import json, ray; ray.init(logging_level='ERROR'); "
            "print(json.dumps([g['state'] for g in ray.util.placement_group_table().values()]))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return [state for state in json.loads(out.stdout.strip().splitlines()[-1]) if state != "REMOVED"]


def results(sweep_dir: Path) -> dict[str, dict[str, str]]:
    with open(sweep_dir / "results.csv", newline="") as f:
        return {row["trial"]: row for row in csv.DictReader(f)}


def test_asha_cuts_the_weak_trial_at_concurrency_one_and_leaves_no_placement_group(ray_head, tmp_path):
    space = tmp_path / "space.yaml"
    space.write_text("lr: {grid: [0.01, 0.3]}\n")  # t01 overshoots in its first epoch: val_loss in the tens
    done = raytrain("sweep", "--space", str(space), "--trials", "1", "--concurrent", "1", "--scheduler", "asha",
                    "--eta", "2", "--metric", "val_loss", "--epochs", "3", "--name", "cut", "--mlflow",
                    "--storage-path", str(tmp_path), *RUN, timeout=400, cwd=tmp_path,
                    env={**ray_head.env, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'server.db'}"})
    assert done.returncode == 0, done.stderr
    err = done.stderr
    assert "packing: 1 trial at once, each 1 worker x 1 CPU" in err, err
    assert "trial t01 stopped early by ASHA after epoch 1: val_loss" in err, err
    assert "trial t00 finished: 3 epochs" in err, err
    sweep_dir = tmp_path / "cut"
    table = results(sweep_dir)
    assert (table["t00"]["status"], table["t01"]["status"]) == ("finished", "stopped early"), table
    assert table["t01"]["epochs_done"] == "1", table  # up to the cut, however late its stop landed
    summary = json.loads((sweep_dir / "summary.json").read_text())
    assert summary["best"]["trial"] == "t00" and "--lr 0.01 " in summary["best"]["command"], summary
    assert "* " in done.stdout and "best: t00" in done.stdout, done.stdout  # the table, best marked
    for plot in ("curves.png", "parallel.png"):
        assert (sweep_dir / plot).stat().st_size > 10_000
    assert live_groups(ray_head.env) == []
    # MLflow: one run per trial, in one experiment named for the sweep, in the store the driver was
    # given (the head's workers never saw that variable)
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path / 'server.db'}")
    experiment = client.get_experiment_by_name("cut")
    runs = client.search_runs([experiment.experiment_id])
    assert sorted(run.info.run_name for run in runs) == ["t00", "t01"]
    assert (tmp_path / "mlartifacts").is_dir() and not (tmp_path / "mlruns").exists()  # beside the store, not in the cwd


BEFORE_THE_MOVE = """
import importlib, sys
lines = sys.modules["raytrain_ddp.driver.sweep_lines"] = importlib.import_module("raytrain_ddp.sweep.lines")
lines.SweepLines.__module__ = lines.trial_name.__module__ = "raytrain_ddp.driver.sweep_lines"
from raytrain_ddp.cli import main
main()
"""
"""`raytrain` as the code before driver/'s move ran it, as far as Tune's tuner.pkl can tell: the
callback and the trial namer that Tune pickles there, named by their old module paths. (The trainable
is named, not pickled, and the trials' actors import it anew.)"""


def test_a_killed_sweep_on_an_object_store_resumes_without_rerunning_a_finished_trial(ray_head, s3_server, tmp_path,
                                                                                     monkeypatch):
    """Killed under the modules' old paths (BEFORE_THE_MOVE), resumed under today's; every file of
    the sweep on S3 (moto's server), Tune's state too (#52). The head's raylet never had the store's
    settings: the trials' actors get them from the driver. No object there holds the secret key."""
    secret = f"sweep-secret-{time.time_ns()}"  # moto takes any key: one that no file could hold by chance
    env = {**ray_head.env, **s3_server.env, "AWS_SECRET_ACCESS_KEY": secret}
    for key in s3_server.env:  # this process reads the bucket as the driver does
        monkeypatch.setenv(key, env[key])
    from raytrain_ddp.storage.location import storage_root

    root = f"s3://runs/sweep-{time.time_ns()}"
    space = tmp_path / "space.yaml"
    space.write_text("epochs: {grid: [1, 6]}\n")  # t00 ends at once; t01 is mid-run when the driver dies
    args = ["sweep", "--space", str(space), "--trials", "1", "--concurrent", "2", "--name", "killed",
            "--storage-path", root, *RUN]
    sweep_dir = storage_root(root) / "killed"
    trials = sweep_dir / "trials"
    driver = subprocess.Popen([sys.executable, "-c", BEFORE_THE_MOVE, *args], env=env, cwd=tmp_path,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while not (finished(trials, "t00") and list((trials / "t01").glob("checkpoint_*"))):
        assert driver.poll() is None, driver.communicate()
        assert time.monotonic() < deadline, "t00 never finished, or t01 never checkpointed"
        time.sleep(0.5)
    while not (trials / "t01.log").is_file():  # copied up while it runs (KEEP_S), from its first step
        assert time.monotonic() < deadline + 30, "t01's log never reached the store while it ran"
        time.sleep(0.5)
    driver.send_signal(signal.SIGKILL)
    driver.communicate(timeout=30)
    first_start = json.loads((trials / "t00.json").read_text())["started"]
    first_life = (trials / "t01.log").read_text()

    pickled = (sweep_dir / "tune" / "tuner.pkl").read_bytes()
    assert b"raytrain_ddp.driver.sweep_lines" in pickled and b"raytrain_ddp.sweep.lines" not in pickled

    again = raytrain(*args, env=env, timeout=400, cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert "resuming sweep killed" in again.stderr, again.stderr
    assert "trial t00" not in again.stderr and "trial t01 resumed from its checkpoint" in again.stderr, again.stderr
    assert json.loads((trials / "t00.json").read_text())["started"] == first_start
    log = (trials / "t01.log").read_text()
    assert log.startswith(first_life) and "resumed from the checkpoint" in log[len(first_life):], log
    table = {row["trial"]: row for row in csv.DictReader(io.StringIO((sweep_dir / "results.csv").read_text()))}
    assert [table[t]["status"] for t in ("t00", "t01")] == ["finished", "finished"], table
    epochs = [row["epoch"] for row in csv.DictReader(io.StringIO((trials / "t01" / "metrics.csv").read_text()))]
    assert epochs == [str(e) for e in range(1, 7)], epochs  # every epoch once: resumed, not restarted
    assert (sweep_dir / "curves.png").stat().st_size > 10_000
    assert list(tmp_path.iterdir()) == [space]  # nothing of the sweep's in the working directory
    holding = [path for path in objects(sweep_dir) if secret.encode() in path.read_bytes()]
    assert holding == [], holding
    assert live_groups(ray_head.env) == []


def objects(where: Any) -> list[Any]:
    """Every object below a prefix of the store."""
    found = []
    for path in where.iterdir():
        found += objects(path) if path.is_dir() else [path]
    return found


def finished(trials: Any, trial: str) -> bool:
    try:
        return json.loads((trials / f"{trial}.json").read_text())["status"] == "finished"
    except (OSError, ValueError):
        return False
