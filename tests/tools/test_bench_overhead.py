"""A tiny `raytrain bench overhead`, so the benchmark keeps working. It asserts nothing about speed."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import raytrain

from raytrain_ddp.bench.overhead import VARIANTS, report, stages_table, torchrun_failure


def test_report_ratios_against_torchrun():
    run = lambda first, rate, gpu=None: {"first_step_s": first, "samples_per_s": rate, "rss_mib": 500.0, "gpu_mib": gpu}
    table = report({"torchrun": [run(5, 100), run(7, 100)], "raytrain fresh Ray": [run(12, 98), run(14, 99)]})
    fresh = table.splitlines()[2].split()
    assert fresh[3:9] == ["13.0", "2.17", "98.5", "0.985", "500", "-"]  # no GPU memory on CPU
    table = report({"torchrun": [run(5, 100, 1000.0)], "raytrain fresh Ray": [run(12, 98, 1100.0)]})
    assert table.splitlines()[2].split()[8] == "1100"


def test_stages_table_medians_each_stage_and_marks_the_missing():
    torchrun = {"python": 2.0, "process group": 1.0, "first step": 0.5}
    ray = lambda workers: {"python": 2.0, "connect": 1.0, "workers": workers, "first step": 0.5}
    table = stages_table({"torchrun": [{"stages": torchrun}], "raytrain running Ray": [{"stages": ray(w)} for w in (4, 9, 5)]})
    header, base, running = table.splitlines()
    assert header.split()[4:8] == ["total", "python", "checks", "connect"]
    assert base.split()[1:5] == ["3.5", "2.0", "-", "-"]  # torchrun has no connect stage
    cells = running.split()[3:]
    assert cells[0] == "8.5" and cells[5] == "5.0"  # total and workers: medians of the 3 runs


def test_a_failed_torchrun_is_told_by_its_root_cause(tmp_path):
    script = tmp_path / "broken.py"
    script.write_text("import os\nif os.environ['RANK'] == '1':\n    raise ValueError('rank one broke')\n")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           str(script)], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    said = torchrun_failure(proc.stderr)
    assert said.startswith("ValueError: rank one broke; rank : 1") and "exitcode : 1" in said, said
    # A rank that aborted at exit (gloo's teardown under load, as a CI run saw): torchrun's own text.
    aborted = "\n".join([
        "terminate called without an active exception", "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ",
        "=" * 53, "Root Cause (first observed failure):", "[0]:", "  rank      : 1 (local_rank: 1)",
        "  exitcode  : -6 (pid: 961)  (SIGABRT)", "=" * 53,
    ])
    assert torchrun_failure(aborted) == (
        "terminate called without an active exception; rank : 1 (local_rank: 1); exitcode : -6 (pid: 961) (SIGABRT)")


@pytest.mark.e2e
def test_tiny_benchmark_prints_every_variant():
    proc = raytrain("bench", "overhead", "--rounds", "1", "--epochs", "1", "--train-samples", "256",
                    "--val-samples", "64", "--batch-size", "32", "--data-workers", "0", timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    print(proc.stdout)  # the figures, for the CI log
    table = proc.stdout.split("runs (first step s)")[1]
    for variant in VARIANTS:
        assert variant in table
    stages = proc.stdout.split("start-up stages, median s")[1].splitlines()[1:]
    assert [line[:26].strip() for line in stages] == list(VARIANTS)
    assert all("-" not in line.split()[-1] for line in stages)  # every arm timed its first step
