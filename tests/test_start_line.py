"""The start's live line on a terminal (driver/run/progress.py): what the start waits for, stage by
stage, with its seconds, until the first step. Where the output is no terminal there is none
(test_ray_compat.py's quick start)."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import struct
import subprocess
import sys
import termios

import pytest
from conftest import TINY

from raytrain_ddp.driver.core.startup import RUN_STAGES, WAITING_FOR, waiting_line

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
FRAME = re.compile(r"starting (\d+) s: (.+?) \(([a-z ]+), (\d+) s\)")


def test_the_line_names_the_stage_after_the_latest_mark():
    begin = 100.0
    assert waiting_line(begin, {}, RUN_STAGES, 101.4) == "starting 1 s: Python and raytrain's imports (python, 1 s)"
    marks = {"python": 100.5, "checks": 101.0, "connect": 103.0}
    assert waiting_line(begin, marks, RUN_STAGES, 104.6) == (
        "starting 5 s: fitting the request to the cluster (placement, 2 s)")
    # --health off: no health mark ever comes, and the line goes on from the data's
    ranks = {**marks, "placement": 103.5, "workers": 108.0, "imports": 108.1, "process group": 108.2, "data": 108.3}
    assert waiting_line(begin, ranks, RUN_STAGES, 109.0) == "starting 9 s: building the model (model, 1 s)"


def in_a_terminal(argv: list[str], env: dict[str, str]) -> tuple[int, str]:
    """Run `argv` with a pseudo-terminal of 160 columns as its stdin, stdout and stderr; its exit
    status and everything it wrote."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))
    proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, env=env, close_fds=True)
    os.close(slave)
    out = b""
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # the terminal closed with the last process on it
            break
        if not chunk:
            break
        out += chunk
    os.close(master)
    return proc.wait(timeout=300), out.decode(errors="replace")


@pytest.mark.e2e
def test_a_start_on_a_terminal_says_what_it_waits_for(ray_head, tmp_path):
    argv = [sys.executable, "-m", "raytrain_ddp", "run", "--workers", "1", "--storage-path", str(tmp_path),
            "--name", "live", *TINY[:-2]]  # no --progress plain: a terminal gets the rich display
    status, out = in_a_terminal(argv, {**ray_head.env, "TERM": "xterm", "COLUMNS": "160"})
    text = ANSI.sub("", out)
    assert status == 0, text[-3000:]
    frames = [(int(total), what, stage, int(stage_s)) for total, what, stage, stage_s in FRAME.findall(text)]
    assert frames, text[-3000:]
    # Each frame says a stage and what it waits for; the stages come in their order, the seconds count up.
    assert all(WAITING_FOR[stage] == what for _, what, stage, _ in frames), frames
    order = [RUN_STAGES.index(stage) for _, _, stage, _ in frames]
    assert order == sorted(order), frames
    assert [total for total, *_ in frames] == sorted(total for total, *_ in frames), frames
    # The line updates while the start waits on Ray Train, and rank 0's own stages reach it as they come.
    assert "workers" in {stage for _, _, stage, _ in frames}, frames
    assert any(RUN_STAGES.index("workers") < i < RUN_STAGES.index("first step") for i in order), frames
    assert "epoch 1/1" in text and "done: 1 gloo workers" in text

