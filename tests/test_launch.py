"""`raytrain launch`: an unmodified torchrun-style script on a real local Ray, and its bad input."""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import replace as dataclasses_replace
from pathlib import Path

import pytest
import torch
from conftest import REPO, raytrain
from test_cli import assert_refused

from raytrain_ddp.bench.local_ray import joined_node, local_head
from raytrain_ddp.config import ConfigError
from raytrain_ddp.driver.core.startup import LAUNCH_STAGES, stages_line
from raytrain_ddp.launch.command import judge, parse_ranks
from raytrain_ddp.launch.records import LaunchOutcome, RankExit
from raytrain_ddp.launch.target import find_target

SCRIPT = REPO / "tests" / "scripts" / "torchrun_train.py"
SNAPSHOT_SCRIPT = REPO / "tests" / "scripts" / "snapshot_train.py"
FAILS_SCRIPT = REPO / "tests" / "scripts" / "rank_fails.py"
SAMPLES = 256


def ranks_said(out: Path, world_size: int = 2) -> list[dict]:
    return [json.loads((out / f"rank-{r}.json").read_text()) for r in range(world_size)]


@pytest.mark.e2e
@pytest.mark.smoke
def test_torchrun_script_runs_unchanged(ray_head, tmp_path):
    out, runs = tmp_path / "out", tmp_path / "runs"
    proc = raytrain("launch", "--workers", "2", "--storage-path", str(runs), "--name", "t",
                    str(SCRIPT), "--out", str(out), "--samples", str(SAMPLES), env=ray_head.env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]

    said = ranks_said(out)
    for rank, env in enumerate(s["env"] for s in said):
        assert env["RANK"] == env["LOCAL_RANK"] == str(rank)
        assert env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == "2" and env["NODE_RANK"] == env["GROUP_RANK"] == "0"
    assert said[0]["env"]["MASTER_ADDR"] == said[1]["env"]["MASTER_ADDR"]
    assert said[0]["env"]["MASTER_PORT"] == said[1]["env"]["MASTER_PORT"]
    # DistributedSampler under the script's own process group: disjoint shards that cover the data.
    shards = [set(s["indices"]) for s in said]
    assert not shards[0] & shards[1] and shards[0] | shards[1] == set(range(SAMPLES))
    assert all(s["cwd"] == str(tmp_path) for s in said)  # the driver's directory, shared here
    assert torch.load(out / "model.pt")["epoch"] == 2  # rank 0 saved after the barrier

    # Rank 0 on the terminal, marked; every rank in its own log; raytrain's own lines on stderr.
    assert "[rank0]: done: accuracy" in proc.stdout and "[rank1]:" not in proc.stdout
    logs = runs / "t" / "logs"
    assert "rank 1/2" in (logs / "rank-1.log").read_text() and "rank 0/2" in (logs / "rank-0.log").read_text()
    assert f"ranks run in {tmp_path}" in proc.stderr
    summary = json.loads((runs / "t" / "summary.json").read_text())
    assert summary["exit_codes"] == [0, 0] and summary["world_size"] == 2
    # One start-up line, up to the script's start; summary.json holds the same stages.
    [line] = [line for line in proc.stderr.splitlines() if line.startswith("raytrain: start-up ")]
    stages = summary["startup"]["stages"]
    assert list(stages) == list(LAUNCH_STAGES) and line == "raytrain: " + stages_line(stages, " to the script's start")
    assert stages["workers"] > 0 and stages["script start"] >= 0
    # `raytrain verify` checks a run's metrics: a launch's is refused in one line, not failed for lacking them.
    checked = raytrain("verify", str(runs / "t"))
    assert checked.returncode == 2 and checked.stderr.strip() == (
        f"error: {runs / 't'} is a `raytrain launch` run, whose results are its script's: verify checks the files "
        "of a `raytrain run`"), checked.stderr


@pytest.mark.e2e
def test_failing_rank_is_named_and_its_exit_status_carried(ray_head, tmp_path):
    """`-m module` form, every rank shown; rank 1 exits 3 while rank 0 trains on."""
    shutil.copy(SCRIPT, tmp_path / "trainer.py")
    proc = raytrain("launch", "-w", "2", "--show-ranks", "all", "--storage-path", str(tmp_path / "runs"),
                    "-m", "trainer", "--out", str(tmp_path / "out"), "--fail-rank", "1", "--exit-code", "3",
                    env=ray_head.env, cwd=tmp_path)
    assert proc.returncode == 3, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: rank 1 on ") and last.endswith("exited with status 3: rank 1 is failing on purpose")
    assert "[rank0]: epoch 0" in proc.stdout and "[rank1]: epoch 0" in proc.stdout
    assert "Traceback" not in last


@pytest.mark.e2e
def test_sigterm_reaches_the_script_which_checkpoints(ray_head, tmp_path):
    out = tmp_path / "out"
    driver = subprocess.Popen(
        [sys.executable, "-m", "raytrain_ddp", "launch", "-w", "2", "--storage-path", str(tmp_path / "runs"),
         str(SCRIPT), "--out", str(out), "--wait-for-sigterm"],
        env=ray_head.env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        for line in driver.stdout:  # trains until told to stop
            if "[rank0]: epoch 1 " in line:
                break
        driver.send_signal(signal.SIGTERM)
        stdout, stderr = driver.communicate(timeout=120)
    finally:
        driver.kill()
    assert driver.returncode == 75, stderr[-3000:]
    assert "got SIGTERM: sending SIGTERM to every rank's script" in stderr
    assert all(s["stopped_by_sigterm"] for s in ranks_said(out))
    assert torch.load(out / "model.pt")["stopped"] is True


def events(out: Path, rank: int) -> list[dict]:
    return [json.loads(line) for line in (out / f"rank-{rank}.jsonl").read_text().splitlines()]


def start_launch(ray_head, tmp_path: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "raytrain_ddp", "launch", "-w", "2", "--storage-path", str(tmp_path / "runs"),
         "--name", "s", *args], env=ray_head.env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def wait_for_line(proc: subprocess.Popen, text: str) -> None:
    for line in proc.stdout:
        if text in line:
            return
    pytest.fail(f"never printed {text!r}: {proc.communicate()[1][-3000:]}")


@pytest.mark.e2e
def test_a_start_up_crash_restarts_with_a_fresh_rendezvous_and_its_root_cause_is_shown(ray_head, tmp_path):
    """Rank 1's @record main raises before init_process_group on the first attempt; --max-failures 1
    restarts both ranks, which meet at a new rendezvous and finish. One run also checks torchrun's
    environment and output."""
    out = tmp_path / "out"
    proc = subprocess.run(  # bytes: text mode would turn the script's \r into \n on the way in
        [sys.executable, "-m", "raytrain_ddp", "launch", "-w", "2", "--max-failures", "1", "--show-ranks", "all",
         "--storage-path", str(tmp_path / "runs"), "--name", "r", str(SNAPSHOT_SCRIPT), "--snapshot",
         str(tmp_path / "snap.pt"), "--out", str(out), "--epochs", "2", "--crash-rank", "1"],
        env=ray_head.env, cwd=tmp_path, capture_output=True, timeout=600,
    )
    proc.stdout, proc.stderr = proc.stdout.decode(), proc.stderr.decode()
    assert proc.returncode == 0, proc.stderr[-3000:]

    starts = [[e for e in events(out, r) if e["event"] == "start"] for r in (0, 1)]
    assert [[s["env"]["TORCHELASTIC_RESTART_COUNT"] for s in rank] for rank in starts] == [["0", "1"], ["0", "1"]]
    second = [rank[1]["env"] for rank in starts]
    assert second[0]["MASTER_PORT"] == second[1]["MASTER_PORT"]  # both ranks of attempt 2 met at one rendezvous
    assert [e["epoch"] for e in events(out, 1) if e["event"] == "end"] == [2]
    assert "raytrain: attempt 2: the worker group restarted at world size 2" in proc.stderr
    # The root cause, from the TORCHELASTIC_ERROR_FILE that torch's @record wrote, as torchrun's summary shows it.
    assert "raytrain: root cause: rank 1 on " in proc.stderr
    assert '\n  File "' + str(SNAPSHOT_SCRIPT) + '", line' in proc.stderr  # the traceback itself, unprefixed
    assert "ValueError: rank 1 crashes on start-up on purpose" in proc.stderr
    summary = json.loads((tmp_path / "runs" / "r" / "summary.json").read_text())
    assert summary["attempts"] == 2 and summary["exit_codes"] == [0, 0]

    # torchrun's environment: no Ray debugger, no GPUs without --gpu, NCCL's async errors, an error file;
    # Ctrl-C and SIGTERM reach the script: neither ignored nor blocked.
    for start in (rank[0] for rank in starts):
        env = start["env"]
        assert env["PYTHONBREAKPOINT"] is None and env["CUDA_VISIBLE_DEVICES"] == ""
        assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1" and env["TORCHELASTIC_ERROR_FILE"].endswith("error.json")
        assert start["sigint_default"] and start["blocked"] & (1 << (signal.SIGINT - 1) | 1 << (signal.SIGTERM - 1)) == 0
    # A \r update reaches a file (not a terminal) as a terminal would leave it, with one rank mark;
    # the rank's own log keeps every update.
    assert re.search(r"^\[rank0\]: epoch 1 world size 2 loss [0-9.]+ \(saved\)$", proc.stdout, re.M)
    assert "\r" not in proc.stdout
    log = (tmp_path / "runs" / "r" / "logs" / "rank-0.log").read_bytes()
    assert re.search(rb"(?m)^epoch 1 world size 2 loss [0-9.]+\repoch 1 ", log)


@pytest.mark.e2e
def test_ctrl_c_reaches_every_rank_which_checkpoints_and_a_second_kills_at_once(ray_head, tmp_path):
    """Ctrl-C: both ranks get SIGINT and agree to stop; rank 0 saves its snapshot and exits 0, while
    rank 1 refuses to exit. The grace is long, so only the second Ctrl-C can end rank 1 quickly."""
    out, snap = tmp_path / "out", tmp_path / "snap.pt"
    driver = start_launch(ray_head, tmp_path, "--stop-grace-s", "120", str(SNAPSHOT_SCRIPT), "--snapshot", str(snap),
                          "--out", str(out), "--epochs", "1000", "--epoch-s", "0.3", "--stubborn-rank", "1")
    try:
        wait_for_line(driver, "[rank0]: epoch 2 ")
        driver.send_signal(signal.SIGINT)
        deadline = time.monotonic() + 60
        while not all((out / f"rank-{r}.jsonl").exists() and events(out, r)[-1]["event"] == e
                      for r, e in ((0, "end"), (1, "stubborn"))):
            assert time.monotonic() < deadline and driver.poll() is None, driver.communicate()[1][-3000:]
            time.sleep(0.2)
        second = time.monotonic()
        driver.send_signal(signal.SIGINT)
        stdout, stderr = driver.communicate(timeout=60)
    finally:
        driver.kill()
    assert driver.returncode == 130, stderr[-3000:]
    assert time.monotonic() - second < 45, stderr[-3000:]  # not the 120 s grace
    assert stderr.count("got SIGINT: sending SIGINT to every rank's script") == 1
    assert "got SIGINT again: killing every rank's script now" in stderr
    [end] = [e for e in events(out, 0) if e["event"] == "end"]
    assert end["stopped"] == "SIGINT" and torch.load(snap)["epoch"] == end["epoch"] >= 2
    summary = json.loads((tmp_path / "runs" / "s" / "summary.json").read_text())
    # Rank 1 was killed; rank 0 may still have been tearing down its interpreter (0, or 137 too).
    assert summary["exit_codes"][1] == 137 and summary["stop_signal"] == "SIGINT"


@pytest.mark.e2e
def test_a_rank_that_ignores_sigterm_is_killed_after_the_grace(ray_head, tmp_path):
    out = tmp_path / "out"
    driver = start_launch(ray_head, tmp_path, "--stop-grace-s", "10", str(SNAPSHOT_SCRIPT), "--snapshot",
                          str(tmp_path / "snap.pt"), "--out", str(out), "--epochs", "1000", "--epoch-s", "0.3",
                          "--stubborn-rank", "1")
    try:
        wait_for_line(driver, "[rank0]: epoch 2 ")
        driver.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        stdout, stderr = driver.communicate(timeout=120)
    finally:
        driver.kill()
    assert driver.returncode == 137, stderr[-3000:]  # rank 1's SIGKILL, as a shell shows it: no requeue
    assert time.monotonic() - sent >= 10
    assert "stopped by SIGTERM: rank 1 exited with signal SIGKILL" in stderr
    assert [e["stopped"] for e in events(out, 0) if e["event"] == "end"] == ["SIGTERM"]
    assert events(out, 1)[-1]["event"] == "stubborn"


@pytest.mark.e2e
def test_an_elastic_launch_that_finds_room_stops_every_rank_with_sigterm_and_grows(tmp_path):
    """`launch --workers 1:2` on a 1-CPU head starts at world size 1; a node joins, and before Ray
    Train restarts the group at 2 the script gets SIGTERM (not a kill), snapshots where it is, and
    goes on from there at world size 2, as under `torchrun --nnodes 1:2`."""
    out, snapshot = tmp_path / "out", tmp_path / "snapshot.pt"
    with local_head(num_cpus=1) as head:
        driver = subprocess.Popen(
            [sys.executable, "-m", "raytrain_ddp", "launch", "--workers", "1:2", "--cpus-per-worker", "1",
             "--resize-check-s", "2", "--storage-path", str(tmp_path / "runs"), "--name", "grow", str(SNAPSHOT_SCRIPT),
             "--snapshot", str(snapshot), "--out", str(out), "--epochs", "50", "--epoch-s", "1"],
            env=head.env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        try:
            wait_for_line(driver, "[rank0]: epoch 2 world size 1 ")
            with joined_node(head, num_cpus=1):
                stdout, stderr = driver.communicate(timeout=300)
        finally:
            driver.kill()
    assert driver.returncode == 0, stderr[-3000:]
    assert "attempt 1: every rank got SIGTERM because room appeared for 2 ranks" in stderr, stderr[-3000:]
    rank0 = events(out, 0)
    [stopped] = [e for e in rank0 if e["event"] == "end" and e["world_size"] == 1]
    assert stopped["stopped"] == "SIGTERM" and stopped["epoch"] >= 2, rank0  # told, so it snapshotted
    [start] = [e for e in rank0 if e["event"] == "start" and e["env"]["WORLD_SIZE"] == "2"]
    assert start["env"]["TORCHELASTIC_RESTART_COUNT"] == "1", rank0
    grown = [e for e in rank0 if e["event"] == "resumed" and e["world_size"] == 2]
    assert grown == [{"event": "resumed", "epoch": stopped["epoch"], "world_size": 2}], rank0  # nothing lost
    assert rank0[-1] == {"event": "end", "epoch": 50, "world_size": 2, "stopped": None}, rank0
    assert events(out, 1)[-1] == {"event": "end", "epoch": 50, "world_size": 2, "stopped": None}
    summary = json.loads((tmp_path / "runs" / "grow" / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["exit_codes"] == [0, 0], summary


@pytest.mark.e2e
def test_the_rank_that_failed_first_is_the_root_cause_and_a_knock_on_is_one_line(ray_head, tmp_path):
    """Rank 1 raises at step 5 (no `@record`); rank 0 then fails in its next collective. Then both
    abort in teardown, as gloo's threads can after an exception (CI saw it), so neither teardown abort
    may pass for a clean end. The screen shows rank 1's traceback, rank 0's failure in one line, one
    rank mark, and no `\r` updates; the exit status is the exception's."""
    proc = raytrain("launch", "--workers", "2", "--storage-path", str(tmp_path / "runs"), "--name", "f",
                    str(FAILS_SCRIPT), "--fail-rank", "1", "--fail-step", "5", "--abort-at-exit", "0", "1",
                    env=ray_head.env, cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert lines[-1].startswith("error: rank 1 on "), proc.stderr[-3000:]
    assert lines[-1].endswith("raised RuntimeError: rank 1 failed at step 5 on purpose; "
                              "torch's teardown then aborted it (SIGABRT)"), lines[-1]
    assert "fails nothing" not in proc.stderr, proc.stderr[-3000:]
    cause = lines.index(next(line for line in lines if line.startswith("raytrain: root cause: ")))
    assert lines[cause].endswith("raised RuntimeError: rank 1 failed at step 5 on purpose"), lines[cause]
    assert lines[cause + 1] == "Traceback (most recent call last):", proc.stderr[-3000:]
    assert f'  File "{FAILS_SCRIPT}", line ' in lines[cause + 2] and "in check_step" in proc.stderr
    [knock_on] = [line for line in lines if line.startswith("raytrain: rank 0 exited with ")]
    # Rank 0 fails in its collective, or the stop for rank 1's failure reaches it first: said either way.
    assert "a knock-on of rank 1's failure" in knock_on or "stopped because rank 1 failed" in knock_on, knock_on
    assert "Traceback" not in proc.stderr.replace(lines[cause + 1], "", 1), proc.stderr[-3000:]  # rank 0's is not shown
    assert "[rank1]" not in proc.stderr and "[rank0]: [rank0]" not in proc.stderr + proc.stdout
    assert "[rank0]: step 5 loss " in proc.stdout and "\r" not in proc.stdout  # a file gets each line settled
    if "a knock-on" in knock_on:  # rank 0 raised: its traceback, not on screen, is in its log (a stop leaves none)
        assert "Traceback (most recent call last):" in (tmp_path / "runs" / "f" / "logs" / "rank-0.log").read_text()
    assert any(line.startswith("raytrain: layout: 2 workers x ") for line in lines)  # raytrain's own lines: prefixed


@pytest.mark.e2e
def test_a_teardown_abort_after_the_scripts_end_fails_nothing_and_is_said(ray_head, tmp_path):
    """Rank 0 prints its end, then aborts as torch's teardown can (`terminate called without an active
    exception`, SIGABRT), while rank 1 exits 0: the run succeeded, and one line says why."""
    proc = raytrain("launch", "--workers", "2", "--max-failures", "1", "--storage-path", str(tmp_path / "runs"),
                    "--name", "a", str(FAILS_SCRIPT), "--abort-at-exit", "0", env=ray_head.env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "[rank0]: done after 10 steps" in proc.stdout
    [said] = [line for line in proc.stderr.splitlines() if "SIGABRT" in line]
    assert said.startswith("raytrain: rank 0 on ") and "looks like torch's interpreter teardown" in said, said
    assert "attempt 2" not in proc.stderr  # not rerun under --max-failures
    summary = json.loads((tmp_path / "runs" / "a" / "summary.json").read_text())
    assert summary["attempts"] == 1 and summary["exit_codes"] == [134, 0], summary


def test_ctrl_c_before_any_script_started_says_nothing_was_running(capsys):
    stopped_early = RankExit(0, 0, "n1", "10.0.0.1", "", None, ended_at=0.0, aborted=False, ran=False)
    outcome = LaunchOutcome(attempts=1, world_size=2, exits={0: stopped_early}, failed_first=None, excused=[],
                            stop_signal="SIGINT", peers=[])
    assert judge(outcome, None, ["SIGINT"]) == 130
    assert judge(dataclasses_replace(outcome, exits={}), None, ["SIGTERM"]) == 75  # before the rendezvous
    said = capsys.readouterr().err.splitlines()
    assert said == ["raytrain: stopped by SIGINT before any rank's script started; nothing was running, nothing lost",
                    "raytrain: stopped by SIGTERM before any rank's script started; nothing was running, nothing lost"]


def test_missing_script_is_one_line(tmp_path):
    started = time.monotonic()
    proc = raytrain("launch", "-w", "2", "--address", "127.0.0.1:1", "trian.py", "--lr", "3", cwd=tmp_path)
    assert_refused(proc, "no script trian.py", "path to your training script", within_s=30, started=started)


def test_missing_module_is_one_line(tmp_path):
    proc = raytrain("launch", "--address", "127.0.0.1:1", "-m", "no_such_trainer", cwd=tmp_path)
    assert_refused(proc, "no module 'no_such_trainer' to run with -m", "PYTHONPATH")


def test_options_after_the_script_are_the_scripts(tmp_path):
    """--workers after the script is the script's own flag, as with torchrun, so raytrain keeps its 3."""
    proc = raytrain("launch", "--dry-run", "-w", "3", str(SCRIPT), "--workers", "9", "-m", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert f"each of 3 ranks runs: python {SCRIPT} --workers 9 -m" in proc.stdout
    assert "num_workers=3" in proc.stdout


def test_show_ranks():
    assert parse_ranks("all", 4) == {0, 1, 2, 3}
    assert parse_ranks("0,3", 4) == {0, 3}
    with pytest.raises(ValueError, match="rank 4 is outside 0..3"):
        parse_ranks("4", 4)
    with pytest.raises(ValueError, match="must be all or rank numbers"):
        parse_ranks("first", 4)


def test_modules_ship_the_directory_python_found_them_in(tmp_path, monkeypatch):
    """`python -m` finds the top package in a sys.path directory: that directory is what the ranks
    need, for `-m pkg` (its __main__.py), `-m pkg.__main__` and `-m pkg.sub.mod` alike."""
    pkg = tmp_path / "launchpkg19"
    (pkg / "sub").mkdir(parents=True)
    for f in ("__init__.py", "__main__.py", "sub/__init__.py", "sub/mod.py"):
        (pkg / f).write_text("")
    (tmp_path / "nomain19").mkdir()
    (tmp_path / "nomain19" / "__init__.py").write_text("")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    for name, file in [("launchpkg19", "__main__.py"), ("launchpkg19.__main__", "__main__.py"),
                       ("launchpkg19.sub.mod", "sub/mod.py")]:
        target = find_target(name, True, [])
        assert (target.root, target.file) == (tmp_path, pkg / file), name
        assert target.argv(shared=False) == ["-m", name]
    with pytest.raises(ConfigError, match="package without a __main__.py"):
        find_target("nomain19", True, [])
