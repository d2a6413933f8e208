"""The GPU path: NCCL, bf16 AMP, channels_last, peak GPU memory. Skips cleanly without a CUDA GPU."""

from __future__ import annotations

import csv
import json
import os

import pytest
import torch
from conftest import REPO, TINY, raytrain

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CI has none)"),
]


def test_gpu_run_uses_nccl_and_reports_gpu_memory(tmp_path):
    proc = raytrain("run", *TINY, "--gpu", "--compile", "--workers", "1", "--model", "resnet18", "--image-size", "64",
                    "--storage-path", str(tmp_path), "--name", "gpu", timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "gpu" / "summary.json").read_text())
    assert summary["backend"] == "nccl"
    with open(tmp_path / "gpu" / "metrics.csv", newline="") as f:
        row = next(csv.DictReader(f))
    assert float(row["gpu_mem_peak_mib"]) > 0
    with open(tmp_path / "gpu" / "rank_times.csv", newline="") as f:
        parts = next(csv.DictReader(f))  # timed by CUDA events
    assert float(parts["forward_s"]) > 0 and float(parts["backward_s"]) > 0, parts


def test_gpu_fsdp_run_resumes_through_its_shards(tmp_path):
    """FSDP2 on a GPU, then a resume through DCP: fully_shard refuses channels_last conv weights,
    and each rank restores its own GPU's RNG state."""
    args = [*TINY, "--gpu", "--workers", "1", "--strategy", "fsdp", "--model", "resnet18", "--image-size", "64",
            "--storage-path", str(tmp_path), "--name", "fsdp"]
    first = raytrain("run", *args, timeout=600)
    assert first.returncode == 0, first.stderr[-3000:]
    again = raytrain("run", *args, "--epochs", "2", timeout=600)  # the last --epochs counts
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed from the checkpoint at epoch 2" in again.stdout, again.stdout[-2000:]


def test_gpu_overhead_benchmark_runs_the_compute_regime_on_the_gpu():
    proc = raytrain("bench", "overhead", "--gpu", "--workers", "1", "--regime", "compute", "--rounds", "1",
                    "--epochs", "2", "--train-samples", "1024", "--val-samples", "64", timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    print(proc.stdout)
    assert "resnet50, 224 px, bf16" in proc.stdout
    for arm in ("hand loop ", "raytrain "):
        row = next(line for line in proc.stdout.splitlines() if line.startswith(arm) and "first step" not in line)
        cells = row[len(arm):].split()
        assert float(cells[2]) > 0 and float(cells[7]) > 0  # samples/s, peak GPU MiB (after whole s, x, nice)
        assert float(cells[8]) >= 0  # host syncs per step: counted in both arms


def test_launch_gives_each_rank_its_own_gpu_for_nccl(tmp_path):
    """A torchrun script on every GPU here: cuda:LOCAL_RANK must be each rank's own GPU for NCCL."""
    workers = torch.cuda.device_count()
    out = tmp_path / "out"
    proc = raytrain("launch", "--gpu", "-w", str(workers), "--storage-path", str(tmp_path / "runs"),
                    str(REPO / "tests" / "scripts" / "torchrun_train.py"), "--backend", "nccl", "--out", str(out),
                    timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = [json.loads((out / f"rank-{r}.json").read_text()) for r in range(workers)]
    assert [s["gpu"] for s in said] == [int(s["env"]["LOCAL_RANK"]) for s in said]
    assert all(len(s["cuda_visible"].split(",")) == workers for s in said)


def test_gpu_steps_make_no_host_sync_outside_the_named_points(tmp_path):
    """Real steps of the loop under torch.cuda.set_sync_debug_mode("error") (worker/host_sync.py): any
    sync but the ranks' agreement, the progress update, a checkpoint and the epoch's end fails the run."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {"RAYTRAIN_CHECK_HOST_SYNC": "1"}
    proc = raytrain("run", *TINY, "--gpu", "--workers", str(torch.cuda.device_count()), "--model", "resnet18",
                    "--image-size", "64", "--train-samples", "2048", "--data-workers", "2",
                    "--storage-path", str(tmp_path), "--name", "sync", env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
