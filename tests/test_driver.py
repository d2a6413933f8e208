"""The driver of `raytrain run`: Ctrl-C checkpoints and exits 130, then the same command resumes, and
a second driver on its --name meanwhile is refused; a worker group restarted with no checkpoint to
resume is still a recorded restart, and the epoch it redoes is shown again."""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import TINY, raytrain, wait_for

from raytrain_ddp.driver.run.news import profile_lines
from raytrain_ddp.driver.run.progress import Display
from raytrain_ddp.driver.run.sink import Sink
from raytrain_ddp.run_files import read_csv
from raytrain_ddp.run_records import GroupStart, RunState, Step


def row(epoch: int, loss: float) -> dict:
    return {"epoch": epoch, "train_loss": loss, "train_acc": 0.5, "val_loss": loss, "val_acc": 0.5,
            "throughput": 100.0, "epoch_time_s": 1.0, "world_size": 2, "resizes": 0}


def group(world_size: int, steps_per_epoch: int = 4, resumed_at: tuple | None = None, resizes: tuple = ()) -> GroupStart:
    return GroupStart(world_size, "gloo", (), steps_per_epoch, resumed_at, resizes)


def test_a_restart_without_a_checkpoint_is_recorded_and_its_epoch_reported_again():
    sink = Sink()
    assert sink.start(group(2)) == []
    sink.epoch(row(1, 2.0))  # epoch 1 reported, then its checkpoint never registered: a node was lost
    resizes = sink.start(group(2))
    [event] = resizes
    assert (event["epoch"], event["position"], event["from"], event["to"]) == (1, 0, 2, 2)
    assert sink.poll().rows == ()  # the redone epoch's row will come again
    [told] = sink.poll().resizes
    assert told.reason == "a worker group restarted after a failure"
    assert told.line().startswith("restarted: 2 workers at ")

    # The next group resumed from a checkpoint of the group before it, at another size, and found the
    # resize itself (from its checkpoint's size): one event, from the size of the group just before.
    own = {"epoch": 2, "position": 64, "from": 4, "to": 1, "at": time.time()}
    resizes = sink.start(group(1, 8, (2, 64, 2), (event, own)))
    assert [(e["from"], e["to"], e["epoch"], e["position"]) for e in resizes] == [(2, 2, 1, 0), (2, 1, 2, 64)]
    assert sink.poll().resizes[-1].reason == "a worker or its node was lost"


def test_a_new_driver_keeps_the_resizes_its_checkpoint_holds():
    held = [{"epoch": 1, "position": 0, "from": 2, "to": 2, "at": 1.0}]
    assert Sink().start(group(2, 4, (2, 0, 0), tuple(held))) == held


def test_a_redone_epoch_is_shown_again_and_a_restored_one_is_not(capsys):
    display = Display("plain", epochs=2)
    display.update(RunState(rows=(row(1, 2.0),)))
    display.update(RunState(rows=(row(1, 2.0),)))  # the same row again (a resume sends the checkpoint's rows)
    display.update(RunState())  # a restart found no checkpoint: epoch 1 is redone ...
    display.update(RunState(rows=(row(1, 1.9),)))  # ... and reported anew
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("epoch 1/2")]
    assert len(lines) == 2 and "train loss 2.0000" in lines[0] and "train loss 1.9000" in lines[1]


def test_profile_lines_wait_for_every_rank_and_come_in_rank_order():
    assert profile_lines({1: "profile rank 1: b"}, 2, {}) == ([], {})  # rank 0's is a poll behind
    lines, shown = profile_lines({1: "profile rank 1: b", 0: "profile rank 0: a"}, 2, {})
    assert lines == ["profile rank 0: a", "profile rank 1: b"]
    assert profile_lines({0: "profile rank 0: a", 1: "profile rank 1: b"}, 2, shown) == ([], shown)  # said once
    assert profile_lines({0: "profile rank 0: c", 1: "profile rank 1: b"}, 2, shown)[0] == ["profile rank 0: c"]


def test_plain_mode_prints_a_step_once_however_long_the_run_stays_there(capsys):
    display = Display("plain", epochs=2)
    for n in (1, 1, 1, 2):  # a stalled run polls the same step until its stall report
        display.last_plain = 0.0  # PLAIN_EVERY_S have passed since the last line
        display.update(RunState(steps_per_epoch=4, step=Step(epoch=1, step=n, loss=2.0, at=0.0, samples_per_s=100.0)))
    assert [line.split()[3] for line in capsys.readouterr().out.splitlines()] == ["1/4", "2/4"]


# --- end to end ---

RUN = ["--workers", "2", "--train-samples", "2048", "--val-samples", "256", "--batch-size", "32",
       "--data-workers", "0", "--progress", "plain", "--epochs", "2"]
"""2 ranks x 32 steps per epoch: long enough to be stopped mid-epoch."""


def start(args: list[str], env: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "raytrain_ddp", "run", *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for_line(proc: subprocess.Popen, text: str, timeout_s: float = 120) -> str:
    """The driver's stdout up to the line that holds `text`."""
    seen, deadline = "", time.monotonic() + timeout_s
    while text not in seen:
        line = proc.stdout.readline()
        assert line and time.monotonic() < deadline, seen + proc.communicate()[1][-2000:]
        seen += line
    return seen


@pytest.mark.e2e
@pytest.mark.smoke
def test_ctrl_c_checkpoints_exits_130_and_the_same_command_resumes(ray_head, tmp_path):
    args = [*RUN, "--storage-path", str(tmp_path), "--name", "c"]
    run_dir = tmp_path / "c"
    # Ctrl-C while epoch 1 trains (a terminal sends it to the foreground process, the driver).
    proc = start(args, ray_head.env)
    wait_for(run_dir / "workers.json", proc)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 130, err[-2000:]
    assert "got Ctrl-C: checkpointing at the next agreed step" in out
    last = err.strip().splitlines()[-1]
    assert last.startswith("stopped: stopped by Ctrl-C with a checkpoint at epoch 1 step "), err[-2000:]
    assert "run the same command again (same --storage-path and --name c) to resume" in last
    assert not (run_dir / "summary.json").exists()

    # A second Ctrl-C stops at once, without waiting for the ranks (here, before they even started).
    proc = start(args, ray_head.env)
    seen = wait_for_line(proc, "run c: 2 gloo workers")
    time.sleep(1.0)  # the driver is about to call fit(), with its handlers in place
    proc.send_signal(signal.SIGINT)
    seen += wait_for_line(proc, "got Ctrl-C: checkpointing at the next agreed step")
    proc.send_signal(signal.SIGINT)  # at once: the first may end a run quickly (before any rank, say)
    stopped = time.monotonic()
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, seen + out + err[-2000:]
    assert time.monotonic() - stopped < 30
    assert err.strip().splitlines()[-1].startswith("stopped: stopped at once by a second Ctrl-C"), err[-2000:]

    # While the rerun trains, a second driver on its --name is refused in one line that names it,
    # before any Ray or rank (driver/plan/run_lock.py; here and not in a run of its own: CI time).
    again = start(args, ray_head.env)
    try:
        seen = wait_for_line(again, "run c: 2 gloo workers")
        asked = time.monotonic()
        second = raytrain("run", *args, env=ray_head.env, timeout=120)
        took = time.monotonic() - asked
        out, err = again.communicate(timeout=300)
    finally:
        again.kill()
    assert second.returncode == 2, second.stderr[-2000:]
    lines = second.stderr.strip().splitlines()
    assert len(lines) == 1, second.stderr  # the refusal alone: on an older Ray, no notice of its features first
    [line] = lines
    assert line.startswith(f"error: run 'c' is in use by another driver: pid {again.pid} on {socket.gethostname()}, "
                           "since "), line
    assert "raytrain run --workers 2" in line and "pass a new --name" in line
    assert took < 60 and "run c:" not in second.stdout  # no Ray, no rank
    assert again.returncode == 0, err[-2000:]
    assert "resumed from the checkpoint at epoch 1" in seen + out
    rows = read_csv(run_dir / "metrics.csv")
    assert [r["epoch"] for r in rows] == ["1", "2"]
    assert all(r["samples"] == "2048" for r in rows)  # every sample of each epoch once, the stopped one too
    summary = (run_dir / "summary.json").read_text()
    assert json.loads(summary)["final"]["epoch"] == 2

    # The same command once more (a job requeued after its end): said in one line, no Ray, nothing changed.
    done = raytrain("run", *args, env=ray_head.env, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert re.search(r"^run c already trained its 2 epochs \(checkpoint_\S+\); nothing to train: pass a larger --epochs",
                     done.stderr, re.M), done.stderr[-2000:]
    assert "run c:" not in done.stdout and "done: 2 gloo workers" in done.stdout
    assert (run_dir / "summary.json").read_text() == summary


DIES_AT_FIRST_SAVE = '''\
import os
import time
from pathlib import Path

from torch import nn

from raytrain_ddp.worker.models import convnet

MARKER = Path(__file__).with_name("died-once")


class Net(nn.Module):
    """The convnet, whose process dies while the run's first checkpoint is being written."""

    def __init__(self, num_classes, in_channels):
        super().__init__()
        self.net = convnet(num_classes, in_channels)

    def forward(self, x):
        return self.net(x)

    def state_dict(self, *args, **kwargs):
        try:
            os.close(os.open(MARKER, os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            return super().state_dict(*args, **kwargs)
        time.sleep(2)  # the epoch's row reaches the driver first
        os._exit(1)
'''


@pytest.mark.e2e
def test_a_restart_that_finds_no_checkpoint_is_recorded_and_its_epoch_shown_again(ray_head, tmp_path):
    (tmp_path / "dies.py").write_text(DIES_AT_FIRST_SAVE)
    proc = raytrain("run", *TINY, "--model", "dies:Net", "--max-failures", "1", "--storage-path", str(tmp_path),
                    "--name", "d", env=ray_head.env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "died-once").exists()  # the first worker group did die at its first save
    assert "restarted: 2 workers at " in proc.stdout and "from the start (a worker group restarted" in proc.stdout
    assert len([line for line in proc.stdout.splitlines() if line.startswith("epoch 1/1  train loss")]) == 2
    [event] = json.loads((tmp_path / "d" / "summary.json").read_text())["resizes"]
    assert (event["from"], event["to"], event["epoch"], event["position"]) == (2, 2, 1, 0)
    assert event["why"] == "a worker group restarted after a failure"
    assert [r["resizes"] for r in read_csv(tmp_path / "d" / "metrics.csv")] == ["1"]


def test_a_joined_clusters_gcs_that_stops_answering_is_said_gone_within_seconds():
    import socket

    from raytrain_ddp.driver.session.connect import GCS_LOST_S, GcsWatch

    listener = socket.create_server(("127.0.0.1", 0))
    address = f"127.0.0.1:{listener.getsockname()[1]}"
    watch = GcsWatch(address)
    assert watch.lost() is None
    listener.close()  # the head went away: its port refuses
    closed = time.monotonic()
    while (lost := watch.lost()) is None:
        assert time.monotonic() - closed < GCS_LOST_S + 3, "never said gone"
        time.sleep(0.1)
    assert time.monotonic() - closed >= GCS_LOST_S  # a blip shorter than that is no loss
    assert lost == f"its head's GCS at {address} does not answer (Connection refused)"
