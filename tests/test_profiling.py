"""--profile: the real torch.profiler around real steps of a small model, in this process (the
end-to-end run with two gloo ranks is in test_cli.py)."""

from __future__ import annotations

import json
import re

import torch
import torch.nn.functional as F
from conftest import raytrain

from raytrain_ddp.config import TrainConfig
from raytrain_ddp.worker.measure.profiling import Profiler, overlap, union
from raytrain_ddp.worker.models import MODELS

LINE = re.compile(
    r"profile rank 0: 2 steps of [\d.]+ ms: data (\d+)%, compute (\d+)%, communication (\d+)%; "
    r"top ops (\S+ [\d.]+ ms, ){2}\S+ [\d.]+ ms per step -> (\S+)"
)


def train(profile: str | None, tmp_path, steps: int = 6) -> tuple[list[str], dict[str, torch.Tensor]]:
    """`steps` SGD steps of the convnet, under Profiler as the worker loop runs it; its lines and weights."""
    cfg = TrainConfig(profile=profile, storage_path=str(tmp_path), name="p")
    torch.manual_seed(0)
    model = MODELS["convnet"](10, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    lines: list[str] = []
    profiler = Profiler(cfg, 0, torch.device("cpu"), steps, report=lines.append)
    data = torch.Generator().manual_seed(1)
    for _ in range(steps):
        inputs, labels = torch.randn(16, 3, 32, 32, generator=data), torch.randint(0, 10, (16,), generator=data)
        optimizer.zero_grad()
        F.cross_entropy(model(inputs), labels).backward()
        optimizer.step()
        profiler.step(0.001)
    profiler.finish()
    return lines, {k: v.clone() for k, v in model.state_dict().items()}


def test_profile_writes_a_trace_and_one_line_and_trains_the_same(tmp_path):
    lines, profiled = train("1:1:2", tmp_path / "on")
    [line] = lines
    match = LINE.fullmatch(line)
    assert match, line
    data, compute, communication = map(int, match.groups()[:3])
    assert communication == 0 and data + compute in (99, 100, 101)  # one process: nothing to communicate
    assert match.group(5) == str(tmp_path / "on" / "p" / "profile")
    [trace] = (tmp_path / "on" / "p" / "profile").glob("rank0.*.pt.trace.json")  # the name TensorBoard looks for
    names = {event.get("name") for event in json.loads(trace.read_text())["traceEvents"]}
    assert {"ProfilerStep#2", "ProfilerStep#3"} <= names and "ProfilerStep#1" not in names  # warmup not kept

    _, plain = train(None, tmp_path / "off")
    assert not (tmp_path / "off" / "p").exists()
    assert all(torch.equal(profiled[k], plain[k]) for k in plain)  # bit for bit: profiling trains nothing else


def test_a_profile_longer_than_an_epoch_is_skipped_and_said(tmp_path):
    lines: list[str] = []
    profiler = Profiler(TrainConfig(profile="5:2:3", storage_path=str(tmp_path), name="p"), 1, torch.device("cpu"), 8,
                        lines.append)
    assert lines == ["profile rank 1: skipped: --profile 5:2:3 needs 10 micro-batches, but an epoch here has 8 "
                     "per rank; lower WAIT:WARMUP:ACTIVE"]
    profiler.step(0.0)  # off: the loop calls it all the same
    profiler.finish()
    assert not (tmp_path / "p").exists()


def test_communication_counts_overlapping_collectives_once():
    merged = union([(5.0, 8.0), (0.0, 2.0), (1.0, 3.0), (7.0, 9.0)])
    assert merged == [(0.0, 3.0), (5.0, 9.0)]
    assert overlap(merged, (2.0, 6.0)) == 2.0  # 2..3 and 5..6


def check_profiled_run(proc, run_dir) -> None:
    """What test_cli's existing-cluster run (2 gloo ranks, --profile 1:1:2, 4 micro-batches per rank)
    must show: a line per rank whose shares add up, with communication in them, and each rank's
    trace. Folded into that run: a Ray run of its own costs CI half a minute, and that the profile
    changes no weight is the in-process test above."""
    lines = [line for line in proc.stdout.splitlines() if line.startswith("profile rank")]
    assert [line.split(":")[0] for line in lines] == ["profile rank 0", "profile rank 1"], proc.stdout
    for line in lines:
        shares = dict(re.findall(r"(data|compute|communication) (\d+)%", line))
        assert abs(sum(map(int, shares.values())) - 100) <= 1, line
        assert int(shares["communication"]) > 0, line  # gloo all-reduces the gradients of two ranks
        assert line.endswith(f"-> {run_dir / 'profile'}")
    for rank in (0, 1):
        [trace] = (run_dir / "profile").glob(f"rank{rank}.*.pt.trace.json")
        names = {event.get("name") for event in json.loads(trace.read_text())["traceEvents"]}
        assert {"ProfilerStep#2", "ProfilerStep#3", "gloo:all_reduce"} <= names
    assert json.loads((run_dir / "summary.json").read_text())["profile"] == lines


def test_a_bad_profile_is_one_line_and_exit_2():
    proc = raytrain("run", "--profile", "5:2", "--address", "127.0.0.1:1")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr == "error: --profile takes WAIT:WARMUP:ACTIVE micro-batches with ACTIVE at least 1, e.g. 5:2:3 (got '5:2')\n"
