"""The data benchmark: its generated set, its table, and a tiny end-to-end run of every path."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
from PIL import Image

from raytrain_ddp.bench import data as bench_data

pytestmark = pytest.mark.filterwarnings("ignore:The image decoding and encoding capabilities:DeprecationWarning")


def test_generated_set_is_64px_jpegs_in_class_folders(tmp_path):
    bench_data.make_jpegs(tmp_path, 100)
    train = sorted((tmp_path / "train").glob("*/*.JPEG"))
    val = sorted((tmp_path / "val").glob("*/*.JPEG"))
    assert (len(train), len(val)) == (98, 2)
    assert len({p.parent.name for p in train}) == bench_data.CLASSES
    with Image.open(train[0]) as image:
        assert (image.format, image.size, image.mode) == ("JPEG", (64, 64), "RGB")
    assert 1000 < train[0].stat().st_size < 6000  # about a TinyImageNet file, not a flat colour


def test_table_prints_cpu_per_image_and_the_ratio_to_the_plain_path():
    report = {"images": 314, "size": 64, "batch_size": 32, "cpus": 2, "cpu": "CPU time of the process and its workers",
              "results": [
                  {"source": "parquet", "path": "plain", "images_per_s": 1000.0, "cpu_seconds": 0.64, "us_per_image": 2038.2,
                   "vs_plain": 1.0},
                  {"source": "parquet", "path": "ray", "images_per_s": 1500.0, "cpu_seconds": 0.43, "us_per_image": 1369.4,
                   "vs_plain": 0.67},
              ]}
    lines = bench_data.table(report).splitlines()
    assert "2 loader CPUs" in lines[0] and "CPU time of the process and its workers" in lines[0]
    assert lines[1].split() == ["source", "path", "images/s", "CPU", "s", "CPU", "us/image", "vs", "plain"]
    assert lines[-1].split() == ["parquet", "ray", "1500", "0.43", "1369", "0.67x"]


def test_cpu_time_counts_child_processes():
    import multiprocessing

    child = multiprocessing.get_context("fork").Process(target=sum, args=(range(30_000_000),))
    child.start()
    seen = 0.0
    while child.is_alive():
        seen = max(seen, bench_data.tree_cpu_seconds().get(child.pid, 0.0))
        time.sleep(0.05)
    child.join()
    assert seen > 0.1


def test_plain_and_torch_paths_of_every_source_without_ray(tmp_path):
    paths = tuple(p for p in bench_data.PATHS if not p.endswith("/ray"))
    report = bench_data.bench_data(images=300, cpus=1, batch_size=16, passes=1, workdir=tmp_path, paths=paths,
                                   echo=lambda _: None)
    assert [f"{r['source']}/{r['path']}" for r in report["results"]] == list(paths)
    assert all(r["images"] == 294 for r in report["results"])  # the same train split, and as many synthetic
    assert all(r["images_per_s"] > 0 and r["cpu_seconds"] > 0 and r["us_per_image"] > 0 for r in report["results"])
    assert [r["vs_plain"] for r in report["results"] if r["path"] == "plain"] == [1.0] * 3
    assert report["cpu"] == "CPU time of the process and its workers"


@pytest.mark.e2e
def test_tiny_benchmark_runs_every_path(tmp_path, ray_head):
    result = subprocess.run(
        [sys.executable, "-m", "raytrain_ddp", "bench", "data", "--tiny", "--address", ray_head.address,
         "--json", str(tmp_path / "bench.json")],
        env=ray_head.env, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((tmp_path / "bench.json").read_text())
    assert [f"{r['source']}/{r['path']}" for r in report["results"]] == list(bench_data.PATHS)
    assert all(r["images"] == 314 and r["us_per_image"] > 0 for r in report["results"])
    assert "vs plain" in result.stdout and "1.00x" in result.stdout
