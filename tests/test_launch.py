"""`raytrain launch`: an unmodified torchrun-style script on a real local Ray, and its bad input."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import REPO, raytrain
from test_cli import assert_refused

from raytrain_ddp.launch import parse_ranks

SCRIPT = REPO / "tests" / "scripts" / "torchrun_train.py"
SAMPLES = 256


def ranks_said(out: Path, world_size: int = 2) -> list[dict]:
    return [json.loads((out / f"rank-{r}.json").read_text()) for r in range(world_size)]


@pytest.mark.e2e
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
