"""`raytrain launch`'s stall watch (doctor/launch_watch.py) and `raytrain stack` (driver/look/stack.py): a
launched script's rank stuck for good is named, with its frame, seconds after every rank's stack
stopped moving; and every rank's stack can be printed while the run goes on."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import raytrain
from test_launch import wait_for_line

from raytrain_ddp.doctor.launch_watch import StackWatch, between_looks

STUCK_PY = """\
import os
import sys
import threading
import time

import torch
import torch.distributed as dist


def main():
    dist.init_process_group("gloo")  # env://, as under torchrun
    print("ready", flush=True)
    while not os.path.exists(sys.argv[1]):  # until the test has looked at the stacks
        time.sleep(0.1)
    if dist.get_rank() == 1:
        threading.Event().wait()  # the fault: rank 1 never comes back
    print("in all_reduce", flush=True)
    dist.all_reduce(torch.ones(1))


main()
"""
STUCK_LINE = 16
"""stuck.py's line of the wait, as the culprit's frame names it."""
STALL_S = 10


@pytest.mark.e2e
def test_a_launched_rank_stuck_outside_a_collective_is_named_and_stack_shows_every_rank(ray_head, tmp_path: Path):
    (tmp_path / "stuck.py").write_text(STUCK_PY)
    go, runs = tmp_path / "go", tmp_path / "runs"
    driver = subprocess.Popen(
        [sys.executable, "-m", "raytrain_ddp", "launch", "--workers", "2", "--stall-timeout", str(STALL_S),
         "--show-ranks", "all", "--storage-path", str(runs), "--name", "stuck", "stuck.py", str(go)],
        env=ray_head.env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        wait_for_line(driver, "]: ready")
        wait_for_line(driver, "]: ready")
        # `raytrain stack` finds the cluster from the run's workers.json alone: no RAY_ADDRESS.
        env = {k: v for k, v in ray_head.env.items() if k != "RAY_ADDRESS"}
        stack = raytrain("stack", "--storage-path", str(runs), env=env, cwd=tmp_path, timeout=120)
        go.touch()
        stuck = time.monotonic()
        stdout, stderr = driver.communicate(timeout=STALL_S + 90)
    except subprocess.TimeoutExpired:
        pytest.fail("the launch hung: no stall was detected")
    finally:
        driver.kill()
    took = time.monotonic() - stuck

    assert stack.returncode == 0, stack.stderr[-3000:]
    for rank in (0, 1):
        assert f"== rank {rank} on " in stack.stdout, stack.stdout
    assert stack.stdout.count(f"main ({tmp_path / 'stuck.py'}:") == 2, stack.stdout

    assert driver.returncode == 1, stderr[-3000:]
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("error: the run stalled (no rank's Python stack changed for "), stderr[-3000:]
    assert "rank 1 (" in last and f"stuck.py:{STUCK_LINE} in main" in last, last
    assert "rank 0 (" not in last and "torch.distributed all_reduce" in last, last
    assert "cannot read" not in stderr, stderr[-3000:]
    stall = runs / "stuck" / "stall"
    assert "all_reduce" in (stall / "rank0.txt").read_text() and "Event.wait" in (stall / "rank1.txt").read_text()
    [record] = json.loads((runs / "stuck" / "summary.json").read_text())["stalls"]  # written before the stall's exit
    assert record["culprits"] == [1] and record["stacks"] == str(stall), record
    assert took < STALL_S + 30, f"{took:.0f} s: the stall was not acted on within {STALL_S} s + 30 s of it"


def test_the_stacks_are_looked_at_4_times_within_the_limit_and_at_least_every_15_s():
    assert between_looks(10) == 2.5
    assert between_looks(120) == 15.0 and between_looks(3600) == 15.0


STILL = 'Process 1: python x.py\n\nThread 1 (idle): "MainThread"\n    main (/tmp/x.py:{line})\n'


def test_a_stall_counts_from_the_last_change_of_any_rank_and_a_missing_stack_resets_it(tmp_path):
    watch = StackWatch(None, 10, tmp_path, print)
    assert watch.still_for([STILL.format(line=1), STILL.format(line=2)]) == 0.0
    time.sleep(0.05)
    assert watch.still_for([STILL.format(line=1), STILL.format(line=2)]) >= 0.05
    time.sleep(0.05)
    assert watch.still_for([STILL.format(line=1), STILL.format(line=3)]) < 0.05  # rank 1 moved
    assert watch.still_for([STILL.format(line=1), "py-spy failed (exit 1): no such process"]) == 0.0
    assert watch.still_for([STILL.format(line=1), STILL.format(line=3)]) == 0.0  # counting again from here


@pytest.mark.e2e
def test_a_watch_that_cannot_read_the_scripts_says_so_once_and_fails_nothing(ray_head, tmp_path: Path):
    """Each rank's script becomes a process py-spy cannot read (as where py-spy lacks the right to
    attach): one line says the watch is blind, and the launch ends as the scripts do."""
    (tmp_path / "blind.py").write_text('import os\nos.execv("/bin/sleep", ["sleep", "6"])\n')
    proc = raytrain("launch", "--workers", "2", "--stall-timeout", "4", "--storage-path", str(tmp_path / "runs"),
                    "blind.py", env=ray_head.env, cwd=tmp_path, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.count("raytrain: the stall watch cannot read the scripts' stacks, so it will see no stall: ") == 1


ONCE_PY = """\
import os
import threading

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
if dist.get_rank() == 1 and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
    threading.Event().wait()  # the fault, in the first attempt only
dist.all_reduce(torch.ones(1))
print("done", flush=True)
"""


@pytest.mark.e2e
def test_under_max_failures_a_launched_stall_restarts_the_scripts_and_the_run_finishes(ray_head, tmp_path: Path):
    (tmp_path / "once.py").write_text(ONCE_PY)
    runs = tmp_path / "runs"
    proc = raytrain("launch", "--workers", "2", "--stall-timeout", str(STALL_S), "--max-failures", "1",
                    "--storage-path", str(runs), "--name", "once", "once.py", env=ray_head.env, cwd=tmp_path, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "; the scripts were ended: Ray Train restarts them (stall 1; it restarts at most 1" in proc.stderr, proc.stderr[-3000:]
    summary = json.loads((runs / "once" / "summary.json").read_text())
    [stall] = summary["stalls"]
    assert stall["culprits"] == [1] and stall["stacks"] == str(runs / "once" / "stall"), stall
    assert summary["attempts"] == 2 and (runs / "once" / "stall" / "rank1.txt").exists()
