"""The GPU path: NCCL, bf16 AMP, channels_last, peak GPU memory. Skips cleanly without a CUDA GPU."""

from __future__ import annotations

import csv
import json

import pytest
import torch

from conftest import TINY, raytrain

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


def test_gpu_overhead_benchmark_prints_gpu_memory():
    proc = raytrain("bench", "overhead", "--gpu", "--workers", "1", "--rounds", "1", "--epochs", "2",
                    "--model", "resnet18", "--image-size", "64", "--train-samples", "1024", "--val-samples", "64",
                    "--batch-size", "64", "--data-workers", "2", timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    print(proc.stdout)
    torchrun = next(line for line in proc.stdout.splitlines() if line.startswith("torchrun "))
    assert float(torchrun.split()[6]) > 0  # the GPU MiB column
