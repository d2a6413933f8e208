"""Start-up stages from wall-clock marks (the end-to-end line is checked in test_cli.py)."""

from __future__ import annotations

import subprocess
import sys
import time

from raytrain_ddp.driver.core.startup import LAUNCH_STAGES, RUN_STAGES, process_started, stages, stages_line, summary


def test_each_stage_runs_from_the_previous_mark_in_order():
    marks = {"first step": 9.0, "connect": 2.5, "workers": 6.0, "checks": 1.0}  # as they arrive: any order
    seconds = stages(0.5, marks, RUN_STAGES)
    assert seconds == {"checks": 0.5, "connect": 1.5, "workers": 3.5, "first step": 3.0}  # a missing stage is left out
    assert stages_line(seconds) == "start-up 8.5 s: checks 0.5, connect 1.5, workers 3.5, first step 3.0"
    assert summary(seconds) == {"total_s": 8.5, "stages": seconds}


def test_a_clock_a_little_behind_shows_no_time_gained():
    # rank 0's node a few ms behind the driver: its mark is before the driver's last one
    seconds = stages(0.0, {"placement": 2.0, "workers": 1.99, "rendezvous": 3.0}, LAUNCH_STAGES)
    assert seconds == {"placement": 2.0, "workers": 0.0, "rendezvous": 1.0}
    assert stages_line(seconds, " to the script's start").startswith("start-up 3.0 s to the script's start: ")


def test_process_started_is_this_process_start():
    before = time.time()
    child = subprocess.run([sys.executable, "-c", "import time; time.sleep(0.5)\n"
                            "from raytrain_ddp.driver.core.startup import process_started; print(process_started())"],
                           capture_output=True, text=True, check=True)
    assert before - 0.1 < float(child.stdout) < before + 0.5  # its start, not when it asked (0.5 s later)
    assert process_started() < before  # this test process began before the test
