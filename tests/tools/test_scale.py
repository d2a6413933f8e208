"""`raytrain scale`: the table's arithmetic alone, then one real study on an object store."""

from __future__ import annotations

import csv
import io
import time

import pytest
from conftest import TINY, raytrain

from raytrain_ddp.config import ConfigError
from raytrain_ddp.driver.run.scale import parse_sizes, parse_strategies, table


def summary(workers: int, strategy: str = "ddp") -> dict:
    config = {"model": "convnet", "dataset": "synthetic", "image_size": 32, "batch_size": 64, "optimizer": "sgd",
              "strategy": strategy, "sharding": "full"}
    return {"world_size": workers, "backend": "nccl", "config": config}


def rows(throughputs: list[float], gpu_mib: float, state_mib: float = 1.0) -> list[dict]:
    return [
        {"train_loss": "0.5", "train_acc": "0.9", "throughput": str(t), "gpu_mem_peak_mib": str(gpu_mib), "cpu_rss_mib": "900",
         "model_state_mib": str(state_mib)}
        for t in throughputs
    ]


def test_table_scaling_and_efficiency():
    # The first epoch is warm-up and left out of the steady-state throughput.
    out = table([summary(1), summary(4)], [rows([10, 100, 100], 1000), rows([10, 300, 340], 1100)])
    assert out[0]["throughput"] == 100 and out[1]["throughput"] == 320
    assert out[1]["throughput_scaling"] == pytest.approx(3.2)
    assert out[1]["efficiency"] == pytest.approx(0.8)
    assert out[1]["memory_scaling"] == pytest.approx(1.1)
    assert out[1]["config"] == "convnet synthetic 32px bs64/worker sgd nccl"


def test_each_strategy_scales_against_its_own_smallest_run():
    out = table(
        [summary(1), summary(2), summary(1, "fsdp"), summary(2, "fsdp")],
        [rows([100], 1000, 12.0), rows([180], 1000, 12.0), rows([50], 900, 12.0), rows([90], 600, 6.0)],
    )
    assert [r["strategy"] for r in out] == ["ddp", "ddp", "fsdp full", "fsdp full"]
    assert [r["efficiency"] for r in out] == pytest.approx([1.0, 0.9, 1.0, 0.9])
    assert [r["model_state_mib"] for r in out] == [12.0, 12.0, 12.0, 6.0]
    assert out[3]["memory_scaling"] == pytest.approx(600 / 900)


def test_parse_sizes_and_strategies():
    assert parse_sizes("4,1,2") == [1, 2, 4]
    for bad in ("", "0,1", "a,b", "2,2"):
        with pytest.raises(ConfigError):
            parse_sizes(bad)
    assert parse_strategies("fsdp, ddp") == ["fsdp", "ddp"]
    for bad in ("", "ddp,ddp", "ddp,zero3"):
        with pytest.raises(ConfigError):
            parse_strategies(bad)


@pytest.mark.e2e
def test_scale_study(ray_head, s3_server, tmp_path, monkeypatch):
    """Both strategies at 2 workers: 2 one-epoch runs, the study's table, plot and run directories,
    all on an object store (#52: FSDP's sharded checkpoints there too). (One size keeps CI short;
    scaling across sizes is the arithmetic tested above.)"""
    for key, value in s3_server.env.items():  # this process reads the bucket as the driver does
        monkeypatch.setenv(key, value)
    from raytrain_ddp.storage.location import storage_root

    root = f"s3://runs/scale-{time.time_ns()}"
    proc = raytrain("scale", "--workers", "2", "--strategy", "ddp,fsdp", *TINY, "--storage-path", root,
                    "--name", "study", env={**ray_head.env, **s3_server.env}, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    study = storage_root(root) / "study"
    table_rows = list(csv.DictReader(io.StringIO((study / "scale.csv").read_text())))
    assert [(r["strategy"], r["workers"]) for r in table_rows] == [("ddp", "2"), ("fsdp full", "2")]
    assert float(table_rows[0]["throughput_scaling"]) == float(table_rows[1]["throughput_scaling"]) == 1.0
    assert all(float(r["throughput"]) > 0 for r in table_rows)
    ddp, fsdp = (float(r["model_state_mib"]) for r in table_rows)
    assert fsdp < 0.6 * ddp  # half a replica per rank, where DDP holds all of it
    assert (study / "scale.md").read_text().startswith("| strategy | workers | config |")
    assert (study / "scale.png").stat().st_size > 10_000
    assert list((study / "fsdp-workers-2").glob("checkpoint_*"))  # each rank's shard, uploaded
    assert list(tmp_path.iterdir()) == []  # nothing in the working directory
    assert (study / "fsdp-workers-2" / "summary.json").exists()
