"""`raytrain scale`: the table's arithmetic alone, then one real two-size study."""

from __future__ import annotations

import csv

import pytest
from conftest import TINY, raytrain

from raytrain_ddp.config import ConfigError
from raytrain_ddp.tools.scale import parse_sizes, table


def summary(workers: int) -> dict:
    config = {"model": "convnet", "dataset": "synthetic", "image_size": 32, "batch_size": 64}
    return {"world_size": workers, "backend": "nccl", "config": config}


def rows(throughputs: list[float], gpu_mib: float) -> list[dict]:
    return [
        {"train_loss": "0.5", "train_acc": "0.9", "throughput": str(t), "gpu_mem_peak_mib": str(gpu_mib), "cpu_rss_mib": "900"}
        for t in throughputs
    ]


def test_table_scaling_and_efficiency():
    # The first epoch is warm-up and left out of the steady-state throughput.
    out = table([summary(1), summary(4)], [rows([10, 100, 100], 1000), rows([10, 300, 340], 1100)])
    assert out[0]["throughput"] == 100 and out[1]["throughput"] == 320
    assert out[1]["throughput_scaling"] == pytest.approx(3.2)
    assert out[1]["efficiency"] == pytest.approx(0.8)
    assert out[1]["memory_scaling"] == pytest.approx(1.1)
    assert out[1]["config"] == "convnet synthetic 32px bs64/worker nccl"


def test_parse_sizes():
    assert parse_sizes("4,1,2") == [1, 2, 4]
    for bad in ("", "0,1", "a,b", "2,2"):
        with pytest.raises(ConfigError):
            parse_sizes(bad)


@pytest.mark.e2e
def test_scale_study(ray_head, tmp_path):
    proc = raytrain("scale", "--workers", "1,2", *TINY, "--epochs", "2", "--storage-path", str(tmp_path),
                    "--name", "study", env=ray_head.env, timeout=400)
    assert proc.returncode == 0, proc.stderr[-2000:]
    study = tmp_path / "study"
    with open(study / "scale.csv") as f:
        table_rows = list(csv.DictReader(f))
    assert [r["workers"] for r in table_rows] == ["1", "2"]
    assert float(table_rows[0]["throughput_scaling"]) == 1.0
    assert float(table_rows[1]["throughput"]) > 0
    assert (study / "scale.md").read_text().startswith("| workers | config |")
    assert (study / "scale.png").stat().st_size > 10_000
    assert (study / "workers-2" / "summary.json").exists()
