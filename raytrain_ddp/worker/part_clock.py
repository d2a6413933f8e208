"""This rank's own time in each part of its training steps: waiting for data, forward, backward, and
communication. The driver compares the ranks' parts each epoch (driver/stragglers.py) to name a rank
that is slow, and in what.

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

import time
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

PARTS = ("data", "forward", "backward", "comm")
RESOLVE_EVERY = 64
"""On a GPU: micro-batches of events kept before those already done are read (bounds their memory)."""


class PartClock:
    """One pass's seconds per part on this rank (`seconds()`), and the gradient hook that marks backward's split."""

    def __init__(self, model: torch.nn.Module, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.totals = dict.fromkeys(PARTS, 0.0)
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

    def new_pass(self) -> None:
        self.totals = dict.fromkeys(PARTS, 0.0)
        self.pending = []

    def waited(self, seconds: float) -> None:
        self.totals["data"] += seconds

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
        self.totals["forward"] += between(marks["start"], marks["forward"])
        own_end = marks.get("ready", marks["backward"])  # no hook ran: no DDP (or the last gradient was unused)
        self.totals["backward"] += between(marks["forward"], own_end)
        self.totals["comm"] += between(own_end, marks["backward"])

    def seconds(self) -> list[float]:
        """This pass's seconds per part, in PARTS' order."""
        if self.pending:
            self.pending[-1]["backward"].synchronize()
            for m in self.pending:
                self.add(m, gpu_seconds)
            self.pending = []
        return [self.totals[part] for part in PARTS]

    def gather(self, device: torch.device) -> list[dict[str, float]]:
        """Every rank's parts this pass, in rank order (a collective: every rank calls it)."""
        mine = torch.tensor(self.seconds(), dtype=torch.float64, device=device)
        world = [mine]
        if dist.is_initialized():
            world = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
            dist.all_gather(world, mine)
        return [{part: round(value, 4) for part, value in zip(PARTS, row.tolist())} for row in world]


def gpu_seconds(start: torch.cuda.Event, end: torch.cuda.Event) -> float:
    return start.elapsed_time(end) / 1000
