"""This rank's own time in each part of its training steps: waiting for data, forward, backward, and
communication. The driver compares the ranks' parts each epoch (doctor/stragglers.py) to name a rank
that is slow, and in what: in every window of the pass's steps, not over one bad stretch, and not at
all where the ranks share their node's cores (each rank sends its busy threads and cores too).

Loss and throughput are all-reduced, and under DDP every rank waits for the slowest at the gradient
all-reduce, so a slow rank hides in plain timings: its peers' backward() takes as long as its own.
The split here undoes that. A hook on the parameter whose gradient is ready last (learnt on the
first backward) marks where this rank's own backward compute ended; the rest of backward() is DDP
waiting for its all-reduce, and for the peers still computing. So a rank slow in backward shows a
long `backward` and short `comm`, and its peers the reverse. One hook, not one per parameter, and
not a DDP communication hook: a Python one in place of DDP's built-in all-reduce cost 2-3% of a
step (docs/performance.md).

What each part holds:
- `data`: waiting for the loader's next batch.
- `forward`: the model and the loss (under DDP with a model of the user's that has buffers, also
  DDP's broadcast of rank 0's buffers before each forward).
- `backward`: this rank's own backward compute, until its last gradient is ready.
- `comm`: the rest of backward(): the gradient all-reduce still running once the last gradient was ready.
Under FSDP, or at one worker (no DDP), the collectives run inside forward and backward and `comm`
stays 0. The optimizer step is in no part.

On a GPU the marks are CUDA events on the compute stream, read once they are done, so timing adds no
synchronization to the step.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

PARTS = ("data", "forward", "backward", "comm")
RESOLVE_EVERY = 64
"""On a GPU: micro-batches of events kept before those already done are read (bounds their memory)."""
WINDOWS = 8
"""A pass's micro-batches are timed in this many windows of consecutive ones, for the driver to see
whether a rank's gap persists (doctor/stragglers.py)."""


class PartClock:
    """One pass's seconds per part on this rank (`seconds()`), and the gradient hook that marks backward's split."""

    def __init__(self, model: torch.nn.Module, device: torch.device, loader_workers: int = 0) -> None:
        self.cuda = device.type == "cuda"
        self.loader_workers = loader_workers
        """The DataLoader's worker processes: busy on this node besides torch's threads."""
        self.totals = dict.fromkeys(PARTS, 0.0)
        self.windows = [dict.fromkeys(PARTS, 0.0) for _ in range(WINDOWS)]
        """The same seconds, per window of the pass's micro-batches."""
        self.window_steps = [0] * WINDOWS
        """The micro-batches in each window (the last ones may hold one fewer, or none in a short pass)."""
        self.queued = [0.0] * WINDOWS
        """Seconds the training thread waited for a core in each window, from its step's start: where
        ranks share a node's cores, a rank slower by about that much was slowed by the scheduler."""
        self.queue_mark = run_queue_s()
        self.micro_steps, self.done = 1, 0
        """The pass's micro-batches, and those done so far: which window the next one is in."""
        self.marks: dict[str, Any] = {}
        """This micro-batch's marks: perf_counter seconds on CPU, CUDA events on a GPU."""
        self.pending: list[dict[str, Any]] = []
        """On a GPU: finished micro-batches' events, not read yet."""
        self.hooks: dict[int, Any] = {}
        """id(parameter) -> its gradient hook: every trainable one's until the first backward, then the last one's."""
        self.last: torch.Tensor | None = None
        """The parameter whose gradient was ready last in the latest backward."""
        if isinstance(model, DistributedDataParallel):  # FSDP sets its gradients after its reduce-scatter: no split
            params = [p for p in model.parameters() if p.requires_grad]
            self.hooks = {id(p): p.register_post_accumulate_grad_hook(self.gradient_ready) for p in params}

    def gradient_ready(self, param: torch.Tensor) -> None:
        self.last = param
        self.mark("ready")

    def new_pass(self, micro_steps: int) -> None:
        self.totals = dict.fromkeys(PARTS, 0.0)
        self.windows = [dict.fromkeys(PARTS, 0.0) for _ in range(WINDOWS)]
        self.window_steps = [0] * WINDOWS
        self.queued, self.queue_mark = [0.0] * WINDOWS, run_queue_s()
        self.micro_steps, self.done = max(micro_steps, 1), 0
        self.pending = []

    def window(self) -> int:
        """The window of the micro-batch under way."""
        return min(self.done * WINDOWS // self.micro_steps, WINDOWS - 1)

    def waited(self, seconds: float) -> None:
        self.totals["data"] += seconds
        self.windows[self.window()]["data"] += seconds

    def mark(self, name: str) -> None:
        """`start`, `forward` (its end), `ready` (the last gradient so far), `backward` (its end)."""
        if not self.cuda:
            self.marks[name] = time.perf_counter()
            return
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        self.marks[name] = event

    def step_done(self) -> None:
        """The micro-batch's backward() returned: add its parts."""
        marks, self.marks = self.marks, {}
        marks["window"] = self.window()
        self.window_steps[marks["window"]] += 1
        self.done += 1
        if self.window() != marks["window"] or self.done == self.micro_steps:  # the window's last micro-batch
            now = run_queue_s()
            self.queued[marks["window"]] += now - self.queue_mark
            self.queue_mark = now
        if len(self.hooks) > 1 and self.last is not None:  # learnt which gradient comes last: keep its hook only
            for key in [key for key in self.hooks if key != id(self.last)]:
                self.hooks.pop(key).remove()
        if not self.cuda:
            self.add(marks, lambda a, b: b - a)
            return
        self.pending.append(marks)
        if len(self.pending) >= RESOLVE_EVERY:
            still = []
            for m in self.pending:
                if m["backward"].query():
                    self.add(m, gpu_seconds)
                else:
                    still.append(m)
            self.pending = still

    def add(self, marks: dict[str, Any], between: Any) -> None:
        own_end = marks.get("ready", marks["backward"])  # no hook ran: no DDP (or the last gradient was unused)
        seconds = {"forward": between(marks["start"], marks["forward"]), "backward": between(marks["forward"], own_end),
                   "comm": between(own_end, marks["backward"])}
        for part, value in seconds.items():
            self.totals[part] += value
            self.windows[marks["window"]][part] += value

    def seconds(self) -> list[float]:
        """This pass's seconds per part, in PARTS' order."""
        if self.pending:
            self.pending[-1]["backward"].synchronize()
            for m in self.pending:
                self.add(m, gpu_seconds)
            self.pending = []
        return [self.totals[part] for part in PARTS]

    def gather(self, device: torch.device) -> list[dict[str, Any]]:
        """Every rank's parts this pass, in rank order (a collective: every rank calls it): its seconds
        per part, `windows` (the same per window), `window_steps` and `queued`; whether it computes on a
        `gpu`; its torch `threads`, `loader_workers` and the `cores` it may run on."""
        figures = [*self.seconds(), *(w[part] for w in self.windows for part in PARTS), *self.window_steps,
                   *self.queued, int(self.cuda), torch.get_num_threads(), self.loader_workers, cores()]
        mine = torch.tensor(figures, dtype=torch.float64, device=device)
        world = [mine]
        if dist.is_initialized():
            world = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
            dist.all_gather(world, mine)
        return [rank_figures([round(value, 4) for value in row.tolist()]) for row in world]


def rank_figures(row: list[float]) -> dict[str, Any]:
    """One rank's row of `gather` as the driver reads it."""
    n, steps = len(PARTS), len(PARTS) * (WINDOWS + 1)
    return {
        **dict(zip(PARTS, row[:n])),
        "windows": [row[n + w * n : n + (w + 1) * n] for w in range(WINDOWS)],
        "window_steps": [int(count) for count in row[steps : steps + WINDOWS]],
        "queued": row[steps + WINDOWS : steps + 2 * WINDOWS],
        "gpu": bool(row[-4]),
        "threads": int(row[-3]),
        "loader_workers": int(row[-2]),
        "cores": int(row[-1]),
    }


def cores() -> int:
    """The cores this rank may run on (its affinity, which a scheduler such as Slurm may narrow)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def run_queue_s() -> float:
    """Seconds this thread has waited for a core since it started (Linux's schedstat, read in about
    15 us, once a window); 0 where the kernel does not say."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


def gpu_seconds(start: torch.cuda.Event, end: torch.cuda.Event) -> float:
    return start.elapsed_time(end) / 1000
