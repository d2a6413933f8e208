"""The private Ray (no --address): nothing of it outlives its driver, however the driver dies, and a
part of it killed under a run ends the run in one line of ours that names the part and the kept
checkpoint. Real `raytrain run`s on a Ray of their own (not the shared test head), and the keeper's
parsing alone."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from raytrain_ddp.checkpoint.files import latest_checkpoint
from raytrain_ddp.config import ConfigError
from raytrain_ddp.driver.session import keeper
from conftest import TINY

GONE_S = 15.0
"""How soon after the driver's death (or the run's end) every process of its Ray must be gone: the
keeper's grace is 2 s; the rest is this busy 2-core machine."""


def start(tmp_path: Path, name: str) -> subprocess.Popen:
    """`raytrain run` on a private Ray, long enough to kill things under it, checkpointing often."""
    env = without_ray_env()
    args = [*TINY, "--epochs", "2", "--train-samples", "4096", "--checkpoint-every-steps", "4", "--max-failures", "0"]
    return subprocess.Popen(
        [sys.executable, "-m", "raytrain_ddp", "run", "--workers", "2", "--name", name, "--storage-path",
         str(tmp_path), *args],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
    )


def without_ray_env() -> dict[str, str]:
    """A user's shell: no cluster named, no token."""
    return {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_TOKEN_PATH", "RAY_AUTH_MODE")}


def tree(root: int) -> dict[int, tuple[str, str]]:
    """Every live descendant of `root`, from /proc: pid -> (comm, start time), so a reused pid is not
    mistaken for one of them later."""
    return {pid: (comm, started(pid)) for pid, comm in keeper.descendants(root).items()}


def started(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except OSError:
        return ""


def alive(recorded: dict[int, tuple[str, str]]) -> dict[int, str]:
    """Those of `recorded` still running (a zombie is not)."""
    left = {}
    for pid, (comm, start_time) in recorded.items():
        try:
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z" and started(pid) == start_time:
            left[pid] = comm
    return left


def wait_training(proc: subprocess.Popen, run_dir: Path, timeout_s: float = 400) -> dict[int, tuple[str, str]]:
    """Until the run has a checkpoint and its ranks train; then every process under the driver."""
    deadline = time.monotonic() + timeout_s
    while not ((run_dir / "workers.json").exists() and whole_checkpoint(run_dir) is not None):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the run saved no checkpoint in time"
        time.sleep(0.2)
    procs = tree(proc.pid)
    assert "raylet" in {comm for comm, _ in procs.values()}, procs  # the head runs under the driver's keeper
    return procs


def whole_checkpoint(run_dir: Path) -> Path | None:
    try:
        return latest_checkpoint(run_dir)
    except ConfigError:  # the first checkpoint is being written (ci on 0d4b21d read it half-written)
        return None


def wait_gone(recorded: dict[int, tuple[str, str]], since: float) -> float:
    """Seconds from `since` until none of `recorded` runs; fails naming those left after GONE_S."""
    while left := alive(recorded):
        assert time.monotonic() - since < GONE_S, f"still running {GONE_S:g} s later: {left}"
        time.sleep(0.1)
    return time.monotonic() - since


@pytest.mark.e2e
def test_nothing_of_the_private_ray_outlives_a_sigkilled_driver(tmp_path):
    proc = start(tmp_path, "k1")
    try:
        recorded = wait_training(proc, tmp_path / "k1")
        # `raytrain stack` reaches the private Ray with the run's own token, from a shell that has none
        stack = subprocess.run([sys.executable, "-m", "raytrain_ddp", "stack", "k1", "--storage-path", str(tmp_path)],
                               env=without_ray_env(), capture_output=True, text=True, timeout=120)
        assert stack.returncode == 0 and "== rank 1 on " in stack.stdout, stack.stderr[-2000:]
        [directory] = [keeper_directory(pid) for pid, (comm, _) in recorded.items() if keeper_directory(pid)]
        killed = time.monotonic()
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        took = wait_gone(recorded, killed)
    finally:
        proc.kill()
    print(f"{len(recorded)} processes of its Ray gone {took:.1f} s after the SIGKILL")
    assert (directory / keeper.ENDED).exists()  # its logs may go once newer runs have ended (keeper.prune)


def keeper_directory(pid: int) -> Path | None:
    """The private Ray's directory, from its keeper's command line; None for another process."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    except OSError:
        return None
    return Path(argv[5]) if len(argv) > 5 and argv[1].endswith("keeper.py") else None


def test_only_the_newest_ended_private_rays_keep_their_directories(tmp_path):
    """keeper.prune: the newest KEEP_ENDED ended directories stay, a running head's always does."""
    for i in range(keeper.KEEP_ENDED + 3):
        (tmp_path / f"ended{i}").mkdir()
        (tmp_path / f"ended{i}" / keeper.ENDED).touch()
        os.utime(tmp_path / f"ended{i}" / keeper.ENDED, (1000 + i, 1000 + i))
    (tmp_path / "running").mkdir()
    (tmp_path / "a-file").touch()
    keeper.prune(tmp_path)
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == sorted(["running", "a-file", *(f"ended{i}" for i in range(3, keeper.KEEP_ENDED + 3))])


@pytest.mark.e2e
def test_a_raylet_killed_under_the_run_ends_it_in_one_line_and_the_same_command_resumes(tmp_path):
    proc = start(tmp_path, "r1")
    try:
        recorded = wait_training(proc, tmp_path / "r1")
        raylet = next(pid for pid, (comm, _) in recorded.items() if comm == "raylet")
        killed = time.monotonic()
        os.kill(raylet, signal.SIGKILL)
        _, err = proc.communicate(timeout=120)
        ended = time.monotonic() - killed
        took = wait_gone(recorded, killed)
    finally:
        proc.kill()
    ours = [line for line in err.splitlines() if line.startswith("error:")]
    assert proc.returncode == 1, err
    assert len(ours) == 1, err
    assert f"the private Ray's raylet (pid {raylet}) was killed by SIGKILL" in ours[0], err
    assert "checkpoint_" in ours[0] and "is kept: run the same command again" in ours[0], err
    assert "GCS has been unavailable" not in err and "rpc_code" not in err, err
    assert ended < 20, f"the run took {ended:.1f} s to end"
    print(f"ended {ended:.1f} s after the raylet's SIGKILL, every process gone after {took:.1f} s: {ours[0]}")

    again = start(tmp_path, "r1")
    out, err = again.communicate(timeout=600)
    assert again.returncode == 0, err
    assert "resumed from the checkpoint" in out + err, out + err


@pytest.mark.parametrize(
    ("said", "expected"),
    [
        ("  raylet [exit code=-9 (signal 9)]\n", {"raylet": "was killed by SIGKILL"}),
        ("Some Ray subprocesses exited unexpectedly:\n  gcs_server [exit code=1]\n",
         {"gcs_server": "exited with status 1"}),
        ("2026-11-26 05:36:46,089\tERR scripts.py:87 -- \x1b[31m\x1b[1mraylet\x1b[22m\x1b[26m\x1b[39m\x1b[0m\x1b[2m "
         "[exit code=-9]\x1b[22m\x1b[0m\n", {"raylet": "was killed by SIGKILL"}),
        ("ERR scripts.py:115 -- \x1b[31m----- BEGIN raylet.out tail (exit code(s)=-9 (signal 9)) -----\x1b[39m\n", {}),
    ],
)
def test_what_ray_start_said_of_a_dead_child_is_read(said, expected):
    assert keeper.reported_deaths(said) == expected


def test_of_several_parts_gone_at_one_look_the_one_ray_start_saw_die_is_named():
    core = {101: "gcs_server", 102: "raylet"}  # as found: the GCS first
    assert keeper.culprit(core, [101, 102], {"raylet": "was killed by SIGKILL"}) == 102
    assert keeper.culprit(core, [101, 102], {}) == 101  # no word from `ray start`: the first found


TREE = """
import json, os, subprocess, sys, time

from raytrain_ddp.driver.session import keeper

core = "import ctypes, time; ctypes.CDLL(None).prctl(15, b'raylet'); print(flush=True); time.sleep(60)"
stubborn = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print(flush=True); time.sleep(60)"
children = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE) for code in (core, stubborn)]
for child in children:
    child.stdout.readline()  # up, its name and handlers set
names = sorted(keeper.descendants(os.getpid()).values())
began = time.monotonic()
keeper.end_tree({})
print(json.dumps({"names": names, "took": time.monotonic() - began, "left": keeper.descendants(os.getpid())}))
"""


def test_the_rest_of_a_head_is_killed_once_its_raylet_is_gone_not_after_the_grace():
    # As the keeper ends a head: a raylet that ends on SIGTERM, and a process that ignores it (as the
    # GCS, `ray start --block` and the autoscaler's monitor sat out the grace). Real processes.
    proc = subprocess.run([sys.executable, "-c", TREE], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "raylet" in seen["names"] and seen["left"] == {}, seen
    assert seen["took"] < keeper.GRACE_S * 0.75, seen  # the stubborn one did not get the whole grace


HEAD_THAT_FORKS = """
import ctypes, os, subprocess, sys, time

# As `ray start`: a child named raylet, which forks a worker that bears its name until it would exec.
raylet = '''
import ctypes, os, time
ctypes.CDLL(None).prctl(15, b"raylet")
if os.fork() == 0:
    time.sleep(1.5)  # a worker seen before its exec, which then ends
    os._exit(0)
time.sleep(60)
'''
subprocess.Popen([sys.executable, "-c", raylet])
time.sleep(60)
"""


def test_a_worker_the_raylet_forked_is_not_taken_for_the_raylet(tmp_path):
    """The keeper watches `ray start`'s own children. It once took a worker, seen forked from the raylet
    before its exec (so named raylet), for the raylet, and ended a sweep's private Ray when that worker
    exited: `the private Ray's raylet (pid 11632) ended`, then `Failed to connect to GCS`."""
    read, write = os.pipe()
    proc = subprocess.Popen([sys.executable, keeper.__file__, str(os.getpid()), str(read), "0", str(tmp_path),
                             sys.executable, "-c", HEAD_THAT_FORKS], pass_fds=(read,))
    os.close(read)
    deadline = time.monotonic() + 6.0  # the worker ends 1.5 s in; the keeper looks every 0.25 s
    while time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.25)
    os.close(write)  # as the driver's end: the keeper ends the head
    status = proc.wait(timeout=30)
    assert not (tmp_path / keeper.LOST).exists(), (tmp_path / keeper.LOST).read_text()
    assert status == 0
