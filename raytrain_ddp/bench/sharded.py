"""`raytrain bench sharded`: the checkpoint stall and the state per rank, DDP against FSDP, on a
model of 100M+ parameters:

    raytrain bench sharded --ranks 2 --steps 8 --save-at 3

2 gloo ranks on CPU (no Ray: the point is what the save costs the training loop), AdamW, a wide
MLP (--width 4096 --depth 6: 105M parameters). Each variant trains --steps steps and saves once,
at step --save-at, as the loop does (checkpoint.save's writes, without Ray's upload to storage):

- ddp:        rank 0 writes the whole state with torch.save; the others wait at the next collective
- fsdp-sync:  every rank writes its shards (dcp.save) and training waits for the files
- fsdp-async: every rank stages a copy of its shards (dcp.async_save, through checkpoint.write_shards
  as the loop calls it) and trains on while a thread writes them; the files are complete when the
  future is done

Printed per variant: the median step without a save, the save step's time over it (the stall),
and for async the seconds until the files were complete; and model_state_mib per rank.
Figures only, nothing asserted.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from raytrain_ddp.bench.spawn import leave_group, run_ranks
from raytrain_ddp.checkpoint import io as checkpoint_io
from raytrain_ddp.checkpoint.files import STATE
from raytrain_ddp.checkpoint.state_dicts import full_state, sharded_state
from raytrain_ddp.config import TrainConfig
from raytrain_ddp.worker import parallel
from raytrain_ddp.worker.step import apply_gradients, forward_backward, make_optimizer

VARIANTS = ("ddp", "fsdp-sync", "fsdp-async")


@dataclass(frozen=True)
class Settings:
    """What the benchmark runs (the options of `raytrain bench sharded`)."""

    ranks: int = 2
    """gloo ranks, one process each."""
    width: int = 4096
    """The MLP's hidden width."""
    depth: int = 6
    """Hidden layers of `width` x `width`."""
    batch: int = 32
    """Samples per rank per step."""
    steps: int = 8
    """Steps per variant."""
    save_at: int = 3
    """The step that saves."""
    threads: int = 1
    """torch threads per rank."""
    checkpoint_dir: str | None = None
    """Where the checkpoint is written (None: $TMPDIR)."""


def wide_mlp(width: int, depth: int, inputs: int = 1024, classes: int = 10) -> nn.Module:
    torch.manual_seed(0)
    layers = [nn.Linear(inputs, width), nn.ReLU()]
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, classes))


def rank_main(rank: int, port: int, settings: Settings, variant: str, out) -> None:
    import torch.distributed.checkpoint as dcp


    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=settings.ranks)
    torch.set_num_threads(settings.threads)
    cfg = TrainConfig(model="bench:wide_mlp", optimizer="adamw", lr=1e-4, strategy="fsdp" if variant != "ddp" else "ddp")
    model = wide_mlp(settings.width, settings.depth)
    model = torch.nn.parallel.DistributedDataParallel(model) if variant == "ddp" else \
        parallel.wrap(cfg, model, 1, torch.device("cpu"), settings.ranks)
    optimizer = make_optimizer(cfg, model)
    scaler = torch.amp.GradScaler("cuda", enabled=False)
    x, y = torch.randn(settings.batch, 1024), torch.randint(10, (settings.batch,))
    times, pending, written_after = [], None, None
    with tempfile.TemporaryDirectory(prefix="bench-sharded-", dir=settings.checkpoint_dir) as tmp:
        for step in range(1, settings.steps + 1):
            dist.barrier()
            start = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            forward_backward(model, x, y, None, scaler, 0.0, weight=1.0, sync=True)
            apply_gradients(model, optimizer, scaler, 0.0)
            if step == settings.save_at:
                target = Path(tmp) / "ckpt"
                save_start = time.perf_counter()
                if variant == "ddp":
                    if rank == 0:
                        whole = full_state(model, optimizer)
                        torch.save({"model": whole[0], "optimizer": whole[1]}, Path(tmp) / STATE)
                elif variant == "fsdp-sync":
                    dcp.save(sharded_state(model, optimizer), checkpoint_id=target)
                else:  # the loop's own call: DCP's writer thread gets a gloo group of its own, as it must
                    # (on the default group its collectives would interleave with training's, and crash)
                    pending = checkpoint_io.write_shards(sharded_state(model, optimizer), target)
            if pending is not None and pending.done():
                pending.result()
                pending, written_after = None, time.perf_counter() - save_start
            dist.barrier()  # the next collective: a rank still saving holds the others here
            times.append(time.perf_counter() - start)
        if pending is not None:
            pending.result()
            written_after = time.perf_counter() - save_start
        mib = torch.tensor(parallel.state_mib(model, optimizer))
        dist.all_reduce(mib, op=dist.ReduceOp.MAX)
        if rank == 0:
            out.put({"times": times, "written_after": written_after, "state_mib": mib.item()})
    leave_group(out)


def bench_sharded(settings: Settings, variants: tuple[str, ...] = VARIANTS) -> None:
    """Run each variant on fresh ranks and print its row of the table."""
    params = sum(p.numel() for p in wide_mlp(settings.width, settings.depth).parameters())
    print(f"wide MLP {settings.width} x {settings.depth}: {params / 1e6:.1f}M parameters, AdamW, "
          f"{settings.ranks} gloo ranks, batch {settings.batch}/rank, {settings.threads} thread(s)/rank, "
          f"save at step {settings.save_at} of {settings.steps}")
    print("| variant | step s (median, no save) | save step s | stall s | files complete after s | model_state_mib/rank |")
    print("|---|---|---|---|---|---|")
    for variant in variants:
        result, codes = run_ranks(rank_main, settings.ranks, settings, variant)
        if result is None:
            print(f"| {variant} | failed: rank exit codes {codes} | | | | |", flush=True)
            continue
        times = result["times"]
        plain = statistics.median(t for i, t in enumerate(times, 1) if i not in (1, settings.save_at))
        saved = times[settings.save_at - 1]
        written = result["written_after"]
        print(f"| {variant} | {plain:.2f} | {saved:.2f} | {saved - plain:.2f} | "
              f"{'' if written is None else f'{written:.2f}'} | {result['state_mib']:.0f} |", flush=True)

