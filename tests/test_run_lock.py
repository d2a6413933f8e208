"""One driver per run directory (driver/plan/run_lock.py): a second driver on a live run's --name is
refused in one line that names the first, and the lock of a driver killed with SIGKILL is gone with
it, so the rerun starts and resumes."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import raytrain

from raytrain_ddp.config import ConfigError
from raytrain_ddp.driver.plan import run_lock

HOLD = """\
import sys, time
from pathlib import Path
from raytrain_ddp.driver.plan import run_lock
run_lock.take(Path(sys.argv[1]))
print("held", flush=True)
time.sleep(600)
"""
"""A process that takes a run directory's lock and keeps it until it is killed."""


def holder(run_dir: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "held\n"
    return proc


def test_a_second_process_is_refused_naming_the_first_and_a_killed_ones_lock_is_gone(tmp_path):
    run_dir = tmp_path / "e1"
    first = holder(run_dir)
    try:
        with pytest.raises(ConfigError) as refused:
            run_lock.take(run_dir)
        line = str(refused.value)
        assert line.startswith(f"run 'e1' is in use by another driver: pid {first.pid} on {socket.gethostname()}, since ")
        assert line.endswith("wait for it to end or stop it, or pass a new --name")
        assert "\n" not in line
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    run_lock.take(run_dir)  # the kernel dropped the dead holder's lock: no stale pid file to judge
    try:
        assert json.loads((run_dir / run_lock.LOCK).read_text())["pid"] != first.pid
    finally:
        run_lock.release(run_dir)


def test_a_process_takes_its_own_run_again_and_follows_it_when_moved_aside(tmp_path):
    run_dir = tmp_path / "e1"
    run_lock.take(run_dir)
    try:
        run_lock.take(run_dir)  # the Python API's second run of a name: no conflict with itself
        run_dir.rename(tmp_path / "e1.old")  # --no-resume's move aside takes the lock file with it
        run_lock.take(run_dir)
        assert (run_dir / run_lock.LOCK).exists()
        with pytest.raises(subprocess.CalledProcessError):  # the new directory is held, not only the old one
            subprocess.run([sys.executable, "-c", HOLD, str(run_dir)], check=True, timeout=60, capture_output=True)
    finally:
        run_lock.release(run_dir)


def test_a_refusal_removes_the_directories_it_made_and_nothing_else(tmp_path):
    """abandon(): what take() made for a refused request goes, its parents made with it too; a
    directory that was there, or that something else was put in meanwhile, stays."""
    run_dir = tmp_path / "storage" / "runs" / "r1"
    made = run_lock.made_by(run_dir)
    assert made == tmp_path / "storage"
    run_lock.take(run_dir)
    run_lock.abandon(run_dir, made)
    assert list(tmp_path.iterdir()) == []

    (tmp_path / "runs").mkdir()
    run_dir = tmp_path / "runs" / "r2"
    made = run_lock.made_by(run_dir)
    run_lock.take(run_dir)
    (tmp_path / "runs" / "r3").mkdir()  # another run started beside it meanwhile
    run_lock.abandon(run_dir, made)
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["r3"]

    run_lock.take(run_dir)  # a run that was there: released, its files kept
    run_lock.abandon(run_dir, run_lock.made_by(run_dir))
    assert (run_dir / run_lock.LOCK).exists()
    run_lock.take(run_dir)  # and free to take again
    run_lock.release(run_dir)


def refused_while_held(run_dir: Path, *args: str) -> None:
    """`raytrain ARGS` while another process holds `run_dir`: refused in one line naming that process,
    before any Ray (--address names no cluster, and is never reached)."""
    first = holder(run_dir)
    try:
        proc = raytrain(*args, "--name", run_dir.name, "--storage-path", str(run_dir.parent),
                        "--address", "127.0.0.1:1", timeout=120)
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    assert proc.returncode == 2, proc.stderr
    [line] = proc.stderr.strip().splitlines()
    assert line.startswith(f"error: run '{run_dir.name}' is in use by another driver: pid {first.pid} on "), line


def test_no_resume_does_not_move_a_live_run_aside(tmp_path):
    run_dir = tmp_path / "e1"
    run_dir.mkdir()
    (run_dir / "metrics.csv").write_text("epoch\n1\n")
    refused_while_held(run_dir, "run", "--no-resume")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["e1"]  # nothing moved aside
    assert (run_dir / "metrics.csv").exists()


def test_a_second_scale_study_on_one_name_is_refused(tmp_path):
    """`raytrain scale` writes its table into the study's directory: one study per --name too."""
    refused_while_held(tmp_path / "s1", "scale", "--workers", "1")


# End to end, with real drivers (in their runs, for CI time): a second driver on a live run's --name
# is refused in test_driver.py's Ctrl-C test; a SIGKILLed driver's rerun starts and resumes in
# test_checkpoint.py's killed-mid-epoch test.
