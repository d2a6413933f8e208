"""The checkpoint stall and the state per rank, DDP against FSDP, on a model of 100M+ parameters:

    python -m raytrain_ddp.bench.sharded --ranks 2 --steps 8 --save-at 3

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

import argparse
import os
import queue
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from raytrain_ddp.checkpoint import io as checkpoint
from raytrain_ddp.worker import parallel as strategy
from raytrain_ddp.config import TrainConfig

VARIANTS = ("ddp", "fsdp-sync", "fsdp-async")


def wide_mlp(width: int, depth: int, inputs: int = 1024, classes: int = 10) -> nn.Module:
    torch.manual_seed(0)
    layers = [nn.Linear(inputs, width), nn.ReLU()]
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, classes))


def rank_main(rank: int, world: int, port: int, args: argparse.Namespace, variant: str, out) -> None:
    import torch.distributed.checkpoint as dcp

    from raytrain_ddp.worker.loop import apply_gradients, forward_backward, make_optimizer

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(args.threads)
    cfg = TrainConfig(model="bench:wide_mlp", optimizer="adamw", lr=1e-4, strategy="fsdp" if variant != "ddp" else "ddp")
    model = wide_mlp(args.width, args.depth)
    model = torch.nn.parallel.DistributedDataParallel(model) if variant == "ddp" else \
        strategy.wrap(cfg, model, 1, torch.device("cpu"), world)
    optimizer = make_optimizer(cfg, model)
    scaler = torch.amp.GradScaler("cuda", enabled=False)
    x, y = torch.randn(args.batch, 1024), torch.randint(10, (args.batch,))
    times, pending, written_after = [], None, None
    with tempfile.TemporaryDirectory(prefix="bench-sharded-", dir=args.dir) as tmp:
        for step in range(1, args.steps + 1):
            dist.barrier()
            start = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            forward_backward(model, x, y, None, scaler, 0.0, weight=1.0, sync=True)
            apply_gradients(model, optimizer, scaler, 0.0)
            if step == args.save_at:
                target = Path(tmp) / "ckpt"
                save_start = time.perf_counter()
                if variant == "ddp":
                    if rank == 0:
                        whole = strategy.full_state(model, optimizer)
                        torch.save({"model": whole[0], "optimizer": whole[1]}, Path(tmp) / "state.pt")
                elif variant == "fsdp-sync":
                    dcp.save(strategy.sharded_state(model, optimizer), checkpoint_id=target)
                else:  # the loop's own call: DCP's writer thread gets a gloo group of its own, as it must
                    # (on the default group its collectives would interleave with training's, and crash)
                    pending = checkpoint.write_shards(strategy.sharded_state(model, optimizer), target)
            if pending is not None and pending.done():
                pending.result()
                pending, written_after = None, time.perf_counter() - save_start
            dist.barrier()  # the next collective: a rank still saving holds the others here
            times.append(time.perf_counter() - start)
        if pending is not None:
            pending.result()
            written_after = time.perf_counter() - save_start
        mib = torch.tensor(strategy.state_mib(model, optimizer))
        dist.all_reduce(mib, op=dist.ReduceOp.MAX)
        if rank == 0:
            out.put({"times": times, "written_after": written_after, "state_mib": mib.item()})
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--batch", type=int, default=32, help="per rank")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--save-at", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--dir", default=None, help="where the checkpoint is written (default: $TMPDIR)")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    args = parser.parse_args()
    params = sum(p.numel() for p in wide_mlp(args.width, args.depth).parameters())
    print(f"wide MLP {args.width} x {args.depth}: {params / 1e6:.1f}M parameters, AdamW, {args.ranks} gloo ranks, "
          f"batch {args.batch}/rank, {args.threads} thread(s)/rank, save at step {args.save_at} of {args.steps}")
    print("| variant | step s (median, no save) | save step s | stall s | files complete after s | model_state_mib/rank |")
    print("|---|---|---|---|---|---|")
    from raytrain_ddp.bench.local_ray import free_port

    ctx = mp.get_context("spawn")
    for variant in args.variants.split(","):
        out = ctx.Queue()
        port = free_port()
        procs = [ctx.Process(target=rank_main, args=(r, args.ranks, port, args, variant, out)) for r in range(args.ranks)]
        for p in procs:
            p.start()
        result = None
        while result is None and not any(p.exitcode for p in procs):
            try:
                result = out.get(timeout=5)
            except queue.Empty:  # a rank that died (killed for memory, say) would leave us waiting forever
                pass
        for p in procs:
            p.join(timeout=None if result else 30)
            if p.is_alive():
                p.kill()
        if result is None:
            print(f"| {variant} | failed: rank exit codes {[p.exitcode for p in procs]} | | | | |", flush=True)
            continue
        times = result["times"]
        plain = statistics.median(t for i, t in enumerate(times, 1) if i not in (1, args.save_at))
        saved = times[args.save_at - 1]
        written = result["written_after"]
        print(f"| {variant} | {plain:.2f} | {saved:.2f} | {saved - plain:.2f} | "
              f"{'' if written is None else f'{written:.2f}'} | {result['state_mib']:.0f} |", flush=True)


if __name__ == "__main__":
    main()
