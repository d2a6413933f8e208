"""--profile: torch.profiler over a few micro-batches of the worker loop, a trace per rank, one line.

The trace goes to <run dir>/profile/rankN.<id>.pt.trace.json through tensorboard_trace_handler (on
an object store: written to a local temporary directory, then copied up with the store's filesystem): a
Chrome trace that Perfetto (ui.perfetto.dev) opens as it is, and TensorBoard's profiler view reads
(`tensorboard --logdir runs/NAME/profile`). The line answers the first question people profile for:
is the step bound by the data, the compute or the communication.
"""

from __future__ import annotations

import re
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch
from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

from raytrain_ddp.config import TrainConfig
from raytrain_ddp.storage.object_path import ObjectPath

COLLECTIVE = re.compile(r"^(gloo|nccl):|^c10d::|^nccl.*kernel", re.IGNORECASE)
"""Events that are communication: gloo's and NCCL's collectives on the host (gloo runs them in
threads of its own), torch's c10d ops that launch them, and NCCL's kernels on the GPU."""
TOP_OPS = 3


class Profiler:
    """torch.profiler over micro-batches WAIT+1 .. of the first pass (--profile WAIT:WARMUP:ACTIVE);
    off, every call does nothing. `report` gets the rank's one line when the trace is written."""

    def __init__(self, cfg: TrainConfig, rank: int, device: torch.device, steps_per_epoch: int,
                 report: Callable[[str], Any], run_dir: Path | ObjectPath | None = None) -> None:
        self.prof, self.steps, self.waits = None, 0, []
        if cfg.profile_steps is None:
            return
        self.wait, warmup, self.active = cfg.profile_steps
        self.rank, self.cuda, self.report = rank, device.type == "cuda", report
        self.first_active = self.wait + warmup
        if self.first_active + self.active > steps_per_epoch:
            # A profile that spans epochs would count validation and a checkpoint as a step. Said, not
            # raised: a profile must never stop a run (an elastic one may only now have grown).
            report(
                f"profile rank {rank}: skipped: --profile {cfg.profile} needs {self.first_active + self.active} "
                f"micro-batches, but an epoch here has {steps_per_epoch} per rank; lower WAIT:WARMUP:ACTIVE"
            )
            return
        run_dir = run_dir if run_dir is not None else Path(cfg.storage_path) / cfg.name  # absolute: resolve_run made it so
        self.remote = run_dir / "profile" if isinstance(run_dir, ObjectPath) else None
        self.dir = Path(tempfile.mkdtemp(prefix="raytrain-profile-")) if self.remote else run_dir / "profile"
        self.dir.mkdir(parents=True, exist_ok=True)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        self.prof = profile(
            activities=activities, schedule=schedule(wait=self.wait, warmup=warmup, active=self.active, repeat=1),
            on_trace_ready=self.ready,
        )
        self.prof.start()

    def step(self, data_wait_s: float) -> None:
        """After each micro-batch, with the seconds it waited for its data (the loop measures them)."""
        if self.prof is None:
            return
        if self.steps >= self.first_active:
            self.waits.append(data_wait_s)
        self.steps += 1
        self.prof.step()  # after the last active step: writes the trace and reports (ready)
        if self.steps == self.first_active + self.active:
            self.finish()

    def finish(self) -> None:
        """Stop profiling (a pass that ended early keeps what it recorded)."""
        prof, self.prof = self.prof, None
        if prof is not None:
            prof.stop()

    def ready(self, prof: profile) -> None:
        tensorboard_trace_handler(str(self.dir), worker_name=f"rank{self.rank}")(prof)
        if self.remote is not None:  # a trace file is written whole, then copied whole
            for trace in self.dir.iterdir():
                (self.remote / trace.name).write_bytes(trace.read_bytes())
            shutil.rmtree(self.dir, ignore_errors=True)
        self.report(summary_line(self.rank, prof.events(), self.waits, self.cuda, self.remote or self.dir))


def summary_line(rank: int, events: Any, waits: list[float], cuda: bool, where: Path | ObjectPath) -> str:
    """`profile rank 0: 3 steps of 41.2 ms: data 12%, compute 71%, communication 17%; top ops ...`.

    Step time is the profiler's ProfilerStep windows; data is the loop's own wait for each batch;
    communication is the time any collective was running (their union, so two in parallel count
    once), also where DDP overlaps it with the backward pass; compute is the rest."""
    windows = [(e.time_range.start, e.time_range.end) for e in events if e.name.startswith("ProfilerStep")]  # "ProfilerStep*" here, "#N" in the trace
    step_us = sum(end - start for start, end in windows)
    comm = [(e.time_range.start, e.time_range.end) for e in events if COLLECTIVE.search(e.name)]
    comm_us = sum(overlap(union(comm), window) for window in windows)
    data = min(sum(waits) * 1e6 / max(step_us, 1), 1.0)
    communication = min(comm_us / max(step_us, 1), 1.0 - data)
    compute = 1.0 - data - communication
    ops = [e for e in events.key_averages() if not e.key.startswith("ProfilerStep")]
    self_us = (lambda e: e.self_device_time_total) if cuda else (lambda e: e.self_cpu_time_total)
    top = sorted(ops, key=self_us, reverse=True)[:TOP_OPS]
    n = max(len(windows), 1)
    return (
        f"profile rank {rank}: {len(windows)} steps of {step_us / n / 1e3:.1f} ms: data {data:.0%}, "
        f"compute {compute:.0%}, communication {communication:.0%}; top ops "
        + ", ".join(f"{e.key} {self_us(e) / n / 1e3:.1f} ms" for e in top)
        + f" per step -> {where}"
    )


def union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def overlap(intervals: list[tuple[float, float]], window: tuple[float, float]) -> float:
    return sum(max(0.0, min(end, window[1]) - max(start, window[0])) for start, end in intervals)
