"""Never lose work: exact resumes (bit for bit; at another world size), a killed worker, a NaN loss
under --no-resume, a worker killed for memory."""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import torch
from conftest import raytrain, wait_for

from raytrain_ddp.checkpoint.files import RESUME_INFO, SNAPSHOT, STATE
from raytrain_ddp.checkpoint.files import latest_checkpoint as resumes_from
from raytrain_ddp.data.torch_ingest import sample_seed
from raytrain_ddp.run_files import read_csv
from raytrain_ddp.storage.location import storage_root
from raytrain_ddp.storage.object_path import ObjectPath

pytestmark = pytest.mark.e2e

# 2 ranks x 32 steps per epoch: long enough to be stopped mid-epoch, short enough for CI.
RUN = ["--workers", "2", "--train-samples", "2048", "--val-samples", "256", "--batch-size", "32",
       "--data-workers", "0", "--progress", "plain", "--scheduler", "none"]


def start(args: list[str], env: dict, cwd: Path | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "raytrain_ddp", "run", *args],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd,
    )


SCRIPTS = Path(__file__).parent / "scripts"


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The latest checkpoint Ray Train registered (a half-written one never is)."""
    try:
        snapshot = json.loads((run_dir / SNAPSHOT).read_text())
    except (FileNotFoundError, json.JSONDecodeError):  # none yet, or caught mid-write
        return None
    return run_dir / snapshot["latest_checkpoint_result"]["checkpoint_dir_name"]


def final_weights(run_dir: Path | ObjectPath) -> dict[str, torch.Tensor]:
    return torch.load(io.BytesIO((latest_checkpoint(run_dir) / STATE).read_bytes()), weights_only=True)["model"]


EPOCHS = 3
"""A stop asked for mid-epoch lands at the epoch's end (the ranks agree at a pass's first step and
its last): 3 epochs leave a 2 -> 1 -> 2 chain of such stops a whole epoch to finish in."""


def exact_run(tmp_path: Path, name: str, workers: int, data_workers: int) -> list[str]:
    """Augmentation (the user's own random flips and shifts, logged_data), dropout, warmup then
    cosine, a checkpoint every 2 steps; 3 epochs of 128 samples. The log of which (epoch, sample)
    each sample read drew its randomness for goes to logs-NAME."""
    logs = tmp_path / f"logs-{name}"
    logs.mkdir(exist_ok=True)
    return ["--workers", str(workers), "--epochs", str(EPOCHS), "--dataset", "logged_data:build",
            "--data-dir", str(logs), "--model", "logged_data:net",
            "--num-classes", "4", "--batch-size", "8", "--data-workers", str(data_workers), "--warmup-epochs", "0.5",
            "--scheduler", "cosine", "--checkpoint-every-steps", "2", "--progress", "plain",
            "--storage-path", str(tmp_path), "--name", name]


def stop_mid_epoch(args: list[str], env: dict, run_dir: Path, sig: int, after: Path | None = None) -> subprocess.Popen:
    """Start the run and send `sig` to its driver once a checkpoint past `after` (the one it resumes
    from) is registered: past it in training, not only in another directory (ci55 cut at a checkpoint
    where `after` stood). A failure kills the driver: left running, its workers hold the shared
    head's CPUs and fail the next test."""
    proc = start(args, env, cwd=SCRIPTS)
    try:
        past = place(after) if after is not None else (0, -1)
        deadline = time.monotonic() + 240
        while (ckpt := latest_checkpoint(run_dir)) is None or place(ckpt) <= past:
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, f"no checkpoint registered past {past}"
            time.sleep(0.1)
        epoch, position = place(ckpt)
        # The cut falls mid-epoch: the first in epoch 1; a later one where the earlier stop left the run.
        assert position > 0 and (after is not None or epoch == 1), (epoch, position)
        proc.send_signal(sig)
    except BaseException:
        proc.kill()
        raise
    return proc


def place(checkpoint: Path) -> tuple[int, int]:
    """(epoch, samples into it) where the checkpoint resumes."""
    where = json.loads((checkpoint / RESUME_INFO).read_text())
    return where["epoch"], where["position"]


@pytest.fixture(scope="module")
def uninterrupted(ray_head, tmp_path_factory) -> Path:
    """The reference: 2 workers, 1 loader worker each, never stopped."""
    tmp_path = tmp_path_factory.mktemp("exact")
    whole = raytrain("run", *exact_run(tmp_path, "whole", workers=2, data_workers=1), env=ray_head.env, cwd=SCRIPTS)
    assert whole.returncode == 0, whole.stderr[-2000:]
    return tmp_path / "whole"


def test_a_run_killed_mid_epoch_resumes_bit_for_bit(ray_head, uninterrupted, tmp_path):
    """Killed at whatever step it was on (SIGKILL, no goodbye) and rerun, the run ends with the
    uninterrupted run's weights, bit for bit (CPU), augmentation and loader workers included. The
    killed driver's run lock died with it, so the rerun starts."""
    cut = exact_run(tmp_path, "cut", workers=2, data_workers=1)
    stop_mid_epoch(cut, ray_head.env, tmp_path / "cut", signal.SIGKILL).communicate(timeout=60)
    # The killed job's ranks are ended by Ray; the rerun waits for their CPUs.
    again = raytrain("run", *cut, "--wait-for-resources", "60", env=ray_head.env, cwd=SCRIPTS)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "resumed from the checkpoint at epoch 1" in again.stdout
    assert json.loads((tmp_path / "cut" / "summary.json").read_text())["final"]["epoch"] == EPOCHS

    ours, reference = final_weights(tmp_path / "cut"), final_weights(uninterrupted)
    assert ours.keys() == reference.keys()
    assert [key for key in reference if not torch.equal(ours[key], reference[key])] == []


@pytest.mark.smoke  # on every Ray we declare: Ray Train's storage on a pyarrow filesystem, its snapshot there
def test_a_run_on_an_object_store_killed_mid_epoch_resumes_bit_for_bit(ray_head, s3_server, uninterrupted, tmp_path,
                                                                        monkeypatch):
    """#52: the same, with every file of the run on S3 (moto's server): the checkpoints Ray Train
    uploads behind the steps, the driver's files, the run's lease. Nothing is written into the
    working directory."""
    for key, value in s3_server.env.items():  # this process reads the bucket as the driver does
        monkeypatch.setenv(key, value)
    root = f"s3://runs/exact-{time.time_ns()}"
    cut = [*exact_run(tmp_path, "cut", workers=2, data_workers=1)[:-4], "--storage-path", root, "--name", "cut",
           "--tensorboard"]
    env = {**ray_head.env, **s3_server.env}
    before = sorted(p.name for p in SCRIPTS.iterdir() if p.name != "__pycache__")
    run_dir = storage_root(root) / "cut"
    stop_mid_epoch(cut, env, run_dir, signal.SIGKILL).communicate(timeout=60)
    again = raytrain("run", *cut, "--wait-for-resources", "60", env=env, cwd=SCRIPTS)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "resumed from the checkpoint at epoch 1" in again.stdout and f"-> {root}/cut" in again.stdout
    assert json.loads((run_dir / "summary.json").read_text())["final"]["epoch"] == EPOCHS
    events = list((run_dir / "tensorboard").iterdir())  # staged locally, copied up at each epoch's row
    assert events and all(event.stat().st_size > 0 for event in events), events
    ours, reference = final_weights(run_dir), final_weights(uninterrupted)
    assert [key for key in reference if not torch.equal(ours[key], reference[key])] == []
    assert sorted(p.name for p in SCRIPTS.iterdir() if p.name != "__pycache__") == before
    # What reads a finished run reads it there too.
    checked = raytrain("verify", f"{root}/cut", env=env, cwd=tmp_path)  # (this tiny run's loss need not fall)
    assert "PASS  files present" in checked.stdout and "PASS  all epochs completed" in checked.stdout, checked
    exported = raytrain("export", f"{root}/cut", "--to", str(tmp_path / "model.pt"), env=env, cwd=tmp_path)
    assert exported.returncode == 0, exported.stderr[-2000:]
    model = torch.load(tmp_path / "model.pt", weights_only=True)
    assert [key for key in reference if not torch.equal(model[key], reference[key])] == []


def test_a_resume_at_another_world_size_trains_each_sample_once_at_the_same_lr(ray_head, uninterrupted, tmp_path):
    """2 -> 1 -> 2 workers, each stopped by Slurm's USR1 (checkpoint, exit 75): every sample of
    every epoch is trained exactly once, and each epoch ends at the uninterrupted run's LR. One chain
    shrinks and grows (CI time: one run fewer than a run per direction). (Not SIGKILL: a killed
    driver's workers train on for a moment before Ray reaps them, and their reads would be logged;
    the bit-for-bit test above covers SIGKILL.)"""
    run_dir, cut = tmp_path / "resized", None
    for workers in (2, 1):
        # No loader workers: they read ahead, and read-ahead would look trained.
        args = exact_run(tmp_path, "resized", workers=workers, data_workers=0)
        proc = stop_mid_epoch(args, ray_head.env, run_dir, signal.SIGUSR1, after=cut)
        _, err = proc.communicate(timeout=180)
        assert proc.returncode == 75 and "run the same command again" in err, err[-2000:]
        cut = resumes_from(run_dir)  # where the stop left the run, as the next run takes it
        epoch, step = map(int, re.search(r"with a checkpoint at epoch (\d+) step (\d+)", err).groups())
        assert (place(cut)[0], place(cut)[1] == 0) == (epoch, step == 0), (place(cut), err[-2000:])  # the one it named
    resumed = raytrain("run", *exact_run(tmp_path, "resized", workers=2, data_workers=0), env=ray_head.env, cwd=SCRIPTS)
    assert resumed.returncode == 0, resumed.stderr[-2000:]

    logs = (tmp_path / "logs-resized").glob("*.log")
    seeds = Counter(int(line) for log in logs for line in log.read_text().split())
    every = [sample_seed(0, epoch, index) for epoch in range(1, EPOCHS + 1) for index in range(128)]
    assert [seeds[seed] for seed in every] == [1] * len(every)
    rows = read_csv(run_dir / "metrics.csv")
    assert [r["lr"] for r in rows] == [r["lr"] for r in read_csv(uninterrupted / "metrics.csv")]
    assert rows[-1]["world_size"] == "2"
    resizes = json.loads((run_dir / "summary.json").read_text())["resizes"]
    assert [(r["from"], r["to"]) for r in resizes] == [(2, 1), (1, 2)]


def test_killed_worker_restarts_from_the_checkpoint(ray_head, tmp_path):
    args = [*RUN, "--epochs", "2", "--max-failures", "1", "--storage-path", str(tmp_path), "--name", "k"]
    proc = start(args, ray_head.env)
    run_dir = tmp_path / "k"
    wait_for(run_dir / "metrics.csv", proc)  # epoch 1 done and checkpointed
    victim = json.loads((run_dir / "workers.json").read_text())["ranks"][1]["pid"]
    os.kill(victim, signal.SIGKILL)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-2000:]
    assert [r["epoch"] for r in read_csv(run_dir / "metrics.csv")] == ["1", "2"]
    pids = [r["pid"] for r in json.loads((run_dir / "workers.json").read_text())["ranks"]]
    assert victim not in pids  # a new worker group finished the run


def test_nan_loss_stops_and_names_the_step_and_no_resume_kept_the_old_run(ray_head, tmp_path):
    """--no-resume over an earlier run of the same name, which this run's failure must not cost:
    --dry-run moves nothing; the run moves the old one aside, then stops at its first non-finite
    loss, naming the step and --lr, and saves nothing after it. (One run for both: CI time.)"""
    old = tmp_path / "nan"
    old.mkdir()
    (old / "metrics.csv").write_text("precious\n")
    args = [*RUN, "--epochs", "1", "--no-resume", "--storage-path", str(tmp_path), "--name", "nan"]
    proc = raytrain("run", *args, "--dry-run")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (old / "metrics.csv").read_text() == "precious\n"  # --dry-run changes nothing
    proc = raytrain("run", *args, "--lr", "1e30", "--momentum", "0", env=ray_head.env)
    assert proc.returncode == 1
    line = proc.stderr.strip().splitlines()[-1]
    assert "loss became non-finite at epoch 1 step" in line and "--lr" in line
    assert "Traceback" not in proc.stderr
    [aside] = tmp_path.glob("nan.old-*")
    assert (aside / "metrics.csv").read_text() == "precious\n"
    assert not list(old.glob("checkpoint_*"))  # nothing saved after the bad step


def test_worker_killed_for_memory_says_so(tmp_path):
    # A head whose memory monitor thinks any use is too much: Ray's real OOM killer fires.
    from raytrain_ddp.bench.local_ray import local_head

    with local_head(num_cpus=2, extra_env={"RAY_memory_usage_threshold": "0.01",
                                           "RAY_memory_monitor_refresh_ms": "100"}) as head:
        proc = raytrain("run", *RUN, "--epochs", "1", "--storage-path", str(tmp_path), env=head.env, timeout=300)
    assert proc.returncode == 1, proc.stderr[-2000:]
    line = proc.stderr.strip().splitlines()[-1]
    assert "ran out of memory" in line and "--batch-size" in line, proc.stderr[-2000:]
