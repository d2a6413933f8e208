"""`raytrain bench doctor`: what the straggler split costs a step when nothing is wrong:

    raytrain bench doctor --ranks 2 --model resnet18 --steps 20 --rounds 5

gloo ranks on CPU (no Ray: the driver's stall watch runs on the driver, and the ranks' beats to it
were already there for the progress line). Each rank trains three DDP replicas of the same model
from the same weights through the loop's own forward_backward: `plain` as before, `timed` with the
PartClock (its marks, and the gradient hook that splits backward from communication), and `plain
again`, a control: what two identical variants differ by is this machine's noise, the floor under
which the cost cannot be told apart. Every round runs --steps steps of each, the order rotated every
round so that a drift in the machine's speed falls on all. Printed: each variant's median step, the
median over rounds of its difference from `plain` in the same round, what the marks cost on their
own, and the epoch-end gather of every rank's parts, which runs once per epoch.
Figures only, nothing asserted.
"""

from __future__ import annotations

import copy
import os
import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from raytrain_ddp.bench.spawn import leave_group, run_ranks
from raytrain_ddp.config import TrainConfig
from raytrain_ddp.worker.measure.part_clock import PartClock
from raytrain_ddp.worker.models import model_builder
from raytrain_ddp.worker.step import apply_gradients, forward_backward, make_optimizer

VARIANTS = ("plain", "timed", "plain again")


@dataclass(frozen=True)
class Settings:
    """What the benchmark runs (the options of `raytrain bench doctor`)."""

    ranks: int = 2
    """gloo ranks, one process each."""
    model: str = "resnet18"
    """A built-in model."""
    batch: int = 32
    """Samples per rank per step."""
    image_size: int = 32
    """Input images are image_size x image_size, 3 channels."""
    steps: int = 20
    """Steps of each variant per round."""
    rounds: int = 5
    """Rounds; the variants' order alternates."""
    threads: int = 1
    """torch threads per rank."""


def rank_main(rank: int, port: int, settings: Settings, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=settings.ranks)
    torch.set_num_threads(settings.threads)
    torch.manual_seed(0)
    cfg = TrainConfig(model=settings.model)
    base = model_builder(settings.model)(num_classes=10, in_channels=3)
    cpu = torch.device("cpu")
    variants = {}
    for name in VARIANTS:
        model = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(base), gradient_as_bucket_view=True)
        parts = PartClock(model, cpu) if name == "timed" else None
        variants[name] = (model, make_optimizer(cfg, model), parts)
    scaler = torch.amp.GradScaler("cuda", enabled=False)
    x = torch.randn(settings.batch, 3, settings.image_size, settings.image_size)
    y = torch.randint(10, (settings.batch,))
    medians: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for round_ in range(settings.rounds + 1):  # round 0 warms them up and is not counted
        for name in VARIANTS[round_ % 3:] + VARIANTS[:round_ % 3]:
            model, optimizer, parts = variants[name]
            times = []
            for _ in range(settings.steps):
                start = time.perf_counter()
                optimizer.zero_grad(set_to_none=True)
                forward_backward(model, x, y, None, scaler, 0.0, weight=1.0, sync=True, parts=parts)
                apply_gradients(model, optimizer, scaler, 0.0)
                times.append(time.perf_counter() - start)
            if round_:
                medians[name].append(statistics.median(times))
    start = time.perf_counter()
    variants["timed"][2].gather(cpu)
    gathered = time.perf_counter() - start
    if rank == 0:
        out.put({"medians": medians, "gather_s": gathered, "marks_s": marks_cost(cpu)})
    leave_group(out)


def marks_cost(device: torch.device, micro_batches: int = 10_000) -> float:
    """Seconds one micro-batch's marks take on their own (start, forward, a gradient, backward, and
    adding them up): the part of the cost that a machine's noise cannot hide in the A/B steps."""
    parts = PartClock(torch.nn.Linear(1, 1), device)
    start = time.perf_counter()
    for _ in range(micro_batches):
        for name in ("start", "forward", "ready", "backward"):
            parts.mark(name)
        parts.step_done()
    return (time.perf_counter() - start) / micro_batches


def bench_doctor(settings: Settings) -> None:
    """Run the ranks and print the table."""
    print(f"{settings.model}, {settings.ranks} gloo ranks, batch {settings.batch}/rank at {settings.image_size} px, "
          f"{settings.threads} thread(s)/rank, {settings.rounds} rounds of {settings.steps} steps per variant")
    result, codes = run_ranks(rank_main, settings.ranks, settings)
    if result is None:
        print(f"failed: rank exit codes {codes}")
        return
    medians = result["medians"]
    print("| variant | step ms (median of rounds) | minus plain, same round (median) | per round |")
    print("|---|---|---|---|")
    for name in VARIANTS:
        diff = statistics.median(t - p for t, p in zip(medians[name], medians["plain"]))
        rounds = " ".join(f"{t * 1000:.1f}" for t in medians[name])
        print(f"| {name} | {statistics.median(medians[name]) * 1000:.2f} | {diff * 1000:+.2f} "
              f"({diff / statistics.median(medians['plain']):+.2%}) | {rounds} |")
    marks = result["marks_s"]
    print(f"the marks alone: {marks * 1e6:.1f} us a micro-batch ({marks / statistics.median(medians['plain']):.4%} of "
          f"the plain step); the epoch-end gather of every rank's parts: {result['gather_s'] * 1000:.2f} ms once per epoch")
