"""The real CLI against a real Ray: a private local one, and the shared session head."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import HEAD_CPUS, REPO, TINY, raytrain
from test_fast_start import actors_started, log_sizes
from test_profiling import check_profiled_run

from raytrain_ddp.checkpoint.files import STATE, latest_checkpoint
from raytrain_ddp.cli import main
from raytrain_ddp.config import TrainConfig
from raytrain_ddp.driver.core.startup import RUN_STAGES, stages_line
from raytrain_ddp.driver.plan.model_shapes import model_shapes
from raytrain_ddp.driver.session.private import runs_dir
from raytrain_ddp.run_files import CSV_COLUMNS, read_csv


@pytest.mark.e2e
def test_run_starts_a_local_ray_and_learns(tmp_path):
    """The README's first command, with no cluster around: a private local Ray on CPU. Its model
    was built before (the cache of driver/plan/model_shapes.py), so its driver never imports torch."""
    model_shapes(TrainConfig(), None, 3)
    private_rays = set(runs_dir().iterdir())
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "raytrain_ddp", "run", "--workers", "2", "--epochs", "2",
         "--train-samples", "1024", "--val-samples", "256", "--data-workers", "0", "--storage-path", str(tmp_path),
         "--name", "local"],
        env={k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}, capture_output=True, text=True, timeout=300,
    )
    imports = [line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")]
    proc.stderr = "\n".join(line for line in proc.stderr.splitlines() if not line.startswith("import time:"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ray.train" in imports and "torch" not in imports
    run_dir = tmp_path / "local"
    rows = read_csv(run_dir / "metrics.csv")
    assert [r["epoch"] for r in rows] == ["1", "2"]
    assert set(CSV_COLUMNS) <= set(rows[0])
    assert float(rows[-1]["val_acc"]) > 0.5  # 10 classes: chance is 0.1
    assert float(rows[-1]["train_loss"]) < float(rows[0]["train_loss"])
    assert all(r["world_size"] == "2" and r["backend"] == "gloo" for r in rows)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 2 and len(summary["nodes"]) == 2
    assert summary["final"]["val_acc"] == pytest.approx(float(rows[-1]["val_acc"]))
    assert summary["config"]["workers"] == 2
    assert "done: 2 gloo workers" in proc.stdout
    assert not [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("straggler:")], proc.stdout
    # Its private Ray, whose one node no one can drain, ran it without Ray Train's PreemptionWatcher
    # (private_ray.NO_DRAIN_WATCH): the logs it keeps of its processes (another test may have run one beside it).
    [session] = [d / "ray" / "session_latest" for d in set(runs_dir().iterdir()) - private_rays
                 if any('"run_name": "local"' in log.read_text(errors="replace")
                        for log in d.glob("ray/session_latest/logs/train/ray-train-sys-controller-*.log"))]
    actors = actors_started(session / "logs", {})
    assert actors.count("RayTrainWorker") == 2 and "PreemptionWatcher" not in actors, actors


@pytest.mark.e2e
def test_run_on_an_existing_cluster_with_a_config_file(ray_head, tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("workers: 2\noptimizer: adamw\nlr: 0.003\nscheduler: step\nname: from-file\n")
    # A tracking server that is down costs a warning, not the run.
    dead_tracker = {**ray_head.env, "MLFLOW_TRACKING_URI": "http://127.0.0.1:1"}
    logs = ray_head.session_dir / "logs"
    logs_before = log_sizes(logs)
    launched = time.time()
    proc = raytrain(
        "run", "--config", str(config), "--name", "from-flag", "--storage-path", str(tmp_path), *TINY,
        "--tensorboard", "--mlflow", "--profile", "1:1:2", env=dead_tracker,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    [warning] = [line for line in proc.stderr.splitlines() if line.startswith("warning: mlflow:")]
    assert warning.endswith("training goes on without it"), warning
    summary = json.loads((tmp_path / "from-flag" / "summary.json").read_text())
    assert summary["config"]["optimizer"] == "adamw" and summary["config"]["name"] == "from-flag"
    assert len(summary["node_ips"]) == 2 and len(set(summary["node_ips"])) == 1  # one machine
    assert "epoch 1/1" in proc.stdout  # plain progress lines for .out files
    # One start-up line at the first step, before the epoch's; summary.json has the same stages, and
    # they add up to the time from the command's start to its first step (driver and rank 0 stitched).
    [line] = [line for line in proc.stdout.splitlines() if line.startswith("start-up ")]
    assert proc.stdout.index(line) < proc.stdout.index("epoch 1/1")
    stages = summary["startup"]["stages"]
    assert list(stages) == list(RUN_STAGES) and line == stages_line(stages)
    assert all(seconds >= 0 for seconds in stages.values()) and stages["workers"] > 0
    # The health check (--health warn by default) ran before the data, on the one node: its figures in
    # summary.json, and no node named, for there is no other to compare it with.
    [node] = summary["health"]
    assert node["ranks"] == [0, 1] and node["gemm_gflops"] > 0 and node["link_gbps"] is None
    assert "health check:" not in proc.stdout + proc.stderr
    assert summary["startup"]["total_s"] == pytest.approx(summary["first_step_unix"] - launched, abs=1.0)
    # The fast start (ray_compat/controller.py) held: Ray Train started its controller, workers and the actors
    # a run needs, and no PlacementGroupCleaner or DatasetManager (a Ray upgrade could undo it).
    actors = actors_started(logs, logs_before)
    assert actors.count("RayTrainWorker") == 2 and {"TrainController", "SynchronizationActor"} <= set(actors), actors
    assert not {"PlacementGroupCleaner", "DatasetManager"} & set(actors), actors
    # This head cannot scale, so the controller asked Ray Data's AutoscalingCoordinator for nothing
    # (ray_compat/fixed_size.py): Ray's policy logs each request, and its first starts that actor.
    requests = [line for log in (logs / "train").glob("ray-train-sys-controller-*.log")
                for line in log.read_text(errors="replace").splitlines()
                if '"run_name": "from-flag"' in line and "Requesting resources" in line]
    assert not requests, requests

    run_dir = tmp_path / "from-flag"
    check_profiled_run(proc, run_dir)  # --profile's lines and traces (test_profiling.py)
    # metrics.parquet holds the same rows as metrics.csv; TensorBoard got the scalars.
    import pyarrow.parquet as pq
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    table = pq.read_table(run_dir / "metrics.parquet").to_pylist()
    assert table[0]["val_acc"] == pytest.approx(float(read_csv(run_dir / "metrics.csv")[0]["val_acc"]))
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    assert {"train_loss", "val_acc", "throughput"} <= set(events.Tags()["scalars"])

    # `raytrain verify` passes the finished run and fails it once truncated.
    good = raytrain("verify", str(run_dir))
    assert good.returncode == 0 and good.stdout.count("PASS") == 5, good.stdout
    lines = (run_dir / "metrics.csv").read_text().splitlines()
    (run_dir / "metrics.csv").write_text(lines[0] + "\n")
    bad = raytrain("verify", str(run_dir))
    assert bad.returncode == 1 and "FAIL  all epochs completed: asked for 1 epochs" in bad.stdout


def assert_refused(proc, *fragments, within_s=None, started=None):
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert "Traceback" not in proc.stderr
    for fragment in fragments:
        assert fragment in lines[0]
    if within_s is not None:
        assert time.monotonic() - started < within_s


@pytest.mark.parametrize(
    "args, fragments",
    [
        (["--workers", "0"], ["--workers must be at least 1"]),
        (["--batch-size", "0"], ["--batch-size must be at least 1"]),
        (["--model", "resnet9000"], ["unknown --model 'resnet9000'", "resnet18"]),
        (["--dataset", "nope"], ["unknown --dataset 'nope'", "synthetic"]),
        (["--address", "127.0.0.1:1"], ["no Ray cluster answers at 127.0.0.1:1"]),
        (["--address", "auto"], ["--address auto"]),
        (["--address", "http://127.0.0.1:8265"], ["is a dashboard's", "raytrain submit --address URL"]),
        (["--dataset", "cifar10"], ["pass --data-dir DIR"]),
        (["--dataset", "mnist", "--data-dir", "{tmp}/missing"], ["not found in {tmp}/missing", "--download"]),
        (["--dataset", "imagefolder", "--data-dir", "{tmp}"], ["{tmp} is empty", "<class>/<image>.jpg"]),
        (["--loader", "ray"], ["--loader ray reads Parquet shards", "raytrain data convert"]),
        (["--model", "usermods:no_model"], ["--model usermods:no_model returned a value of type dict, not a torch.nn.Module"]),
        (["--model", "nonexist:fn", "--dry-run"], ["no module 'nonexist'"]),
        (["--dataset", "mnist", "--data-dir", "{tmp}/missing", "--dry-run"], ["not found in {tmp}/missing"]),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args, fragments, tmp_path):
    args = [a.format(tmp=tmp_path) for a in args]
    fragments = [f.format(tmp=tmp_path) for f in fragments]
    code = tmp_path.with_name(tmp_path.name + "-code")  # beside tmp_path, which some cases need empty
    code.mkdir()
    (code / "usermods.py").write_text("def no_model(num_classes, in_channels):\n    return {}\n")
    started = time.monotonic()
    proc = raytrain("run", *args, "--storage-path", str(tmp_path / "runs"), timeout=60, cwd=code)
    assert_refused(proc, *fragments, within_s=60, started=started)


@pytest.mark.parametrize(
    "argv, line",
    [
        (["run", "--stall-timeout", "abc"], "--stall-timeout: 'abc' is not a number; see `raytrain run --help`"),
        (["run", "--epochs", "1e9"], "--epochs: '1e9' is not a whole number; see `raytrain run --help`"),
        (["run", "--epochs=1e9"], "--epochs: '1e9' is not a whole number; see `raytrain run --help`"),
        (["run", "--wait-for-resources", "nan"], "--wait-for-resources must be a finite number (got nan)"),
        (["run", "--weight-decay", "nan"], "--weight-decay must be a finite number (got nan)"),
        (["run", "--lr", "inf"], "--lr must be a finite number (got inf)"),
        (["run", "--foo"], "no such option: --foo; see `raytrain run --help`"),
        (["run", "--epochs"], "option '--epochs' requires an argument; see `raytrain run --help`"),
        (["run", "--gpu=3"], "option '--gpu' does not take a value; see `raytrain run --help`"),
        (["launch", "--stop-grace-s", "nan", "x.py"], "--stop-grace-s: 'nan' is not a finite number; see `raytrain launch --help`"),
        (["launch"], "SCRIPT.py|MODULE is missing; see `raytrain launch --help`"),
        (["data", "convert"], "SRC is missing; see `raytrain data convert --help`"),
        (["data", "convert", "a", "b", "--format", "x", "--shard-mib", "inf"],
         "--shard-mib: 'inf' is not a finite number; see `raytrain data convert --help`"),
        (["data", "convert", "a", "b"], "--format is missing; see `raytrain data convert --help`"),
        (["check", "--iters", "3.5"], "--iters: '3.5' is not a whole number; see `raytrain check --help`"),
        (["bench", "overhead", "--rounds", "x"], "--rounds: 'x' is not a whole number; see `raytrain bench overhead --help`"),
        (["nope"], "no such command 'nope'; see `raytrain --help`"),
    ],
)
def test_a_bad_flag_is_one_line_of_ours_not_typers_box(argv, line, capsys):
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    out, err = capsys.readouterr()
    assert (out, err) == ("", f"error: {line}\n")


def test_help_still_exits_0_and_a_bare_command_shows_it(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["run", "--help"])
    assert exited.value.code == 0 and "--stall-timeout" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exited:
        main(["data"])
    assert exited.value.code == 2 and "convert" in capsys.readouterr().out


def test_bad_config_file(tmp_path):
    config = tmp_path / "c.toml"
    config.write_text('workers = 2\nbatchsize = 3\n')
    assert_refused(raytrain("run", "--config", str(config)), "unknown config key(s): batchsize")


def test_unwritable_storage_path(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    proc = raytrain("run", "--storage-path", str(blocker / "runs"), "--address", "127.0.0.1:1")
    assert_refused(proc, "cannot write run directory", "--storage-path")


def test_debug_shows_the_traceback(tmp_path):
    proc = raytrain("run", "--workers", "0", "--debug")
    assert proc.returncode != 0 and "Traceback" in proc.stderr


def test_dry_run_starts_nothing(tmp_path):
    proc = raytrain("run", "--dry-run", "--workers", "3", "--gpu", "--storage-path", str(tmp_path), "--name", "x")
    assert proc.returncode == 0, proc.stderr
    assert "num_workers=3" in proc.stdout and "use_gpu=True" in proc.stdout
    assert "backend='nccl'" in proc.stdout
    assert not (tmp_path / "x").exists()


@pytest.mark.e2e
@pytest.mark.parametrize(
    "args, fragments",
    [
        (["--gpu"], ["--gpu asks for 2 GPUs, but the cluster has none"]),
        (["--workers", str(HEAD_CPUS + 1)],
         [f"asked for {HEAD_CPUS + 1} workers x 1 CPU, the cluster fits {HEAD_CPUS}: 1 node x {HEAD_CPUS} CPUs"]),
    ],
)
def test_preflight_refuses_what_the_cluster_cannot_fit(ray_head, tmp_path, args, fragments):
    started = time.monotonic()
    proc = raytrain("run", *args, "--storage-path", str(tmp_path / "runs"), env=ray_head.env, timeout=120)
    assert_refused(proc, *fragments, within_s=60, started=started)
    assert list(tmp_path.iterdir()) == []  # refused: no empty run directory left, nor the storage path made for it


@pytest.mark.e2e
@pytest.mark.smoke
def test_wrong_token_is_refused(ray_head, tmp_path):
    """In one line and in seconds: the GCS's refusal is read before ray.init, which retries it for 20 s
    and logs a line of Ray's C++ core for each try."""
    wrong = tmp_path / "token"
    wrong.write_text("0" * 64)
    env = {**ray_head.env, "RAY_AUTH_TOKEN_PATH": str(wrong)}
    started = time.monotonic()
    proc = raytrain("run", "--storage-path", str(tmp_path / "runs"), env=env, timeout=120)
    assert_refused(proc, "refused our auth token", "RAY_AUTH_TOKEN_PATH", within_s=15, started=started)
    assert [p.name for p in tmp_path.iterdir()] == ["token"]


@pytest.mark.e2e
@pytest.mark.parametrize("command", [["run"], ["launch", str(REPO / "tests" / "scripts" / "rank_fails.py")]],
                         ids=["run", "launch"])
def test_sigterm_while_waiting_for_room_is_our_line_and_exit_75(ray_head, tmp_path, command):
    proc = subprocess.Popen(
        [sys.executable, "-m", "raytrain_ddp", command[0], "--workers", "99", "--wait-for-resources", "60",
         "--storage-path", str(tmp_path), "--name", "w", *command[1:]],
        env=ray_head.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    seen = ""
    while "waiting up to 60 s (--wait-for-resources)" not in seen:  # Ray is joined: its handlers are in
        line = proc.stderr.readline()
        assert line, seen + proc.communicate()[1]
        seen += line
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 75, seen + err
    assert err.strip().splitlines() == ["stopped: got SIGTERM before any rank started; nothing to stop"], err
    assert "SIGTERM received" not in err and "logging.cc" not in err  # Ray's C++ handler: a stack, then abort


@pytest.mark.e2e
def test_a_checkpoint_a_rank_cannot_load_fails_the_run_at_once_not_on_each_retry(ray_head, tmp_path):
    args = ["run", *TINY, "--storage-path", str(tmp_path), "--name", "c"]
    first = raytrain(*args, env=ray_head.env)
    assert first.returncode == 0, first.stderr[-2000:]
    # A whole torch.save archive, so the driver's checks pass it; only the rank's load finds it wanting.
    state_file = latest_checkpoint(tmp_path / "c") / STATE
    state = torch.load(state_file, weights_only=False)
    del state["scaler"]
    torch.save(state, state_file)
    started = time.monotonic()
    again = raytrain(*args, "--epochs", "2", "--max-failures", "2", env=ray_head.env)
    took = time.monotonic() - started
    assert again.returncode == 2, again.stderr[-2000:]
    last = again.stderr.strip().splitlines()[-1]
    assert last.startswith("error: the checkpoint of run 'c' at ") and last.endswith(
        "could not be restored (KeyError: 'scaler'); pass --no-resume or a new --name"), again.stderr[-2000:]
    assert again.stderr.count("could not be restored") == 1 and "restarted:" not in again.stdout
    assert "Traceback" not in again.stderr
    print(f"refused after {took:.1f} s")
