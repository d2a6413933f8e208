"""A tiny `raytrain bench overhead`, so the benchmark keeps working. It asserts nothing about speed."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from conftest import raytrain

from raytrain_ddp.bench.overhead import ARMS, LAUNCH_ARM, NiceWatch, report, stages_table, torchrun_failure


def test_report_ratios_against_the_hand_loop_with_every_round_and_niceness():
    run = lambda first, rate, nice=(0,), wall=10.0: {"first_step_s": first, "samples_per_s": rate, "wall_s": wall,
                                                     "nice": list(nice)}
    table = report({"hand loop": [run(5, 100), run(7, 100)], "raytrain": [run(12, 98), run(14, 99, (0, 15), 16.0)]})
    header, base, ray = table.splitlines()[:3]
    assert "x hand loop" in header and base.split()[2:9] == ["6.0", "1.00", "100.0", "1.000", "10.0", "1.00", "0"]
    assert ray.split()[1:8] == ["13.0", "2.17", "98.5", "0.985", "13.0", "1.30", "0,15"]  # a rank at nice 15 shows
    assert ray.endswith("-  12.0 14.0; 98.0 99.0")  # no GPU memory on CPU; every round's first step and samples/s
    gpu = lambda mib: {**run(5, 100), "gpu_mib": mib}
    assert report({"hand loop": [gpu(320.0)], "raytrain": [gpu(300.0), gpu(310.0)]}).splitlines()[2].split()[8] == "305"


def test_stages_table_medians_each_stage_and_marks_the_missing():
    hand = {"python": 2.0, "process group": 1.0, "first step": 0.5}
    ray = lambda workers: {"python": 2.0, "connect": 1.0, "workers": workers, "first step": 0.5}
    table = stages_table({"hand loop": [{"stages": hand}], "raytrain": [{"stages": ray(w)} for w in (4, 9, 5)]})
    header, base, running = table.splitlines()
    assert header.split()[4:8] == ["total", "python", "connect", "workers"]  # a stage no arm has is no column
    assert base.split()[2:6] == ["3.5", "2.0", "-", "-"]  # the hand loop has no connect stage
    cells = running.split()[1:]
    assert cells[0] == "8.5" and cells[3] == "5.0"  # total and workers: medians of the 3 runs
    # launch's own stages come after run's, and only stages some arm has are columns
    launch = {"python": 1.0, "workers": 5.0, "rendezvous": 0.2, "script start": 0.1, "script imports": 2.0}
    header, *_ = stages_table({"hand loop": [{"stages": hand}], "launch": [{"stages": launch}]}).splitlines()
    assert header.split()[4:] == ["total", "python", "workers", "rendezvous", "script", "start", "script", "imports",
                                  "process", "group", "first", "step"]  # in the order they happen


def test_nice_watch_reads_the_busiest_children_niceness():
    # Each child burns a fixed amount of CPU, not of wall time, and then stays alive past the watch's
    # next look: on a loaded machine (CI) a nice-5 child gets little of the cores, and a wall-time
    # loop would leave it with less CPU than a sleeper's start-up.
    burn = "import os, sys, time\nos.nice({})\nwhile time.process_time() < {}: pass\nprint(flush=True)\ntime.sleep({})\n"
    # a child busy before the block and idle in it, as a Ray head started by this process: not a rank
    earlier = subprocess.Popen([sys.executable, "-c", burn.format(0, 1.5, 6)], stdout=subprocess.PIPE, text=True)
    earlier.stdout.readline()  # its burning is over
    with NiceWatch(ranks=2) as watch:
        procs = [subprocess.Popen([sys.executable, "-c", burn.format(n, 1.0, 1.5)]) for n in (3, 5)]
        idle = subprocess.Popen([sys.executable, "-c", "import os, time; os.nice(9); time.sleep(2.5)"])
        for p in [*procs, idle]:
            p.wait()
    earlier.wait()
    assert watch.seen == [3, 5], watch.seen  # the sleeper is not a rank, nor the one busy before


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
def test_tiny_benchmark_prints_both_arms():
    proc = raytrain("bench", "overhead", "--regime", "overhead", "--rounds", "1", "--epochs", "1",
                    "--train-samples", "512", "--val-samples", "64", "--launch", timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    print(proc.stdout)  # the figures, for the CI log
    assert proc.stdout.count("load average at the") == 2
    arms = [*ARMS, LAUNCH_ARM]
    table = proc.stdout.split("rounds (first step s; samples/s)")[1]
    for arm in arms:
        assert arm in table
    header, *stages = proc.stdout.split("start-up stages, median s")[1].splitlines()[:4]
    assert [line[:26].strip() for line in stages] == arms
    assert header.endswith("first step")
    assert all(line.split()[-1] != "-" for line in stages)  # every arm timed its first step
    assert "rendezvous" in header and "script imports" in " ".join(header.split())
