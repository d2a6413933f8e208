"""A tiny `raytrain bench overhead`, so the benchmark keeps working. It asserts nothing about speed."""

from __future__ import annotations

import pytest
from conftest import raytrain

from raytrain_ddp.tools.bench_overhead import VARIANTS, report


def test_report_ratios_against_torchrun():
    run = lambda first, rate, gpu=None: {"first_step_s": first, "samples_per_s": rate, "rss_mib": 500.0, "gpu_mib": gpu}
    table = report({"torchrun": [run(5, 100), run(7, 100)], "raytrain fresh Ray": [run(12, 98), run(14, 99)]})
    fresh = table.splitlines()[2].split()
    assert fresh[3:9] == ["13.0", "2.17", "98.5", "0.985", "500", "-"]  # no GPU memory on CPU
    table = report({"torchrun": [run(5, 100, 1000.0)], "raytrain fresh Ray": [run(12, 98, 1100.0)]})
    assert table.splitlines()[2].split()[8] == "1100"


@pytest.mark.e2e
def test_tiny_benchmark_prints_every_variant():
    proc = raytrain("bench", "overhead", "--rounds", "1", "--epochs", "1", "--train-samples", "256",
                    "--val-samples", "64", "--batch-size", "32", "--data-workers", "0", timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    print(proc.stdout)  # the figures, for the CI log
    table = proc.stdout.split("runs (first step s)")[1]
    for variant in VARIANTS:
        assert variant in table
