"""A torchrun script in the shape the PyTorch elastic tutorial teaches: a `@record` main, and a
snapshot loaded at start and saved after every epoch, so a restart at any world size goes on from
the last snapshot. Nothing in it knows about Ray.

    torchrun --nnodes 1:2 --nproc-per-node 1 ... tests/scripts/snapshot_train.py --snapshot S --out OUT
    raytrain launch --workers 1:2 tests/scripts/snapshot_train.py --snapshot S --out OUT

Each rank appends one JSON line per start to OUT/rank-N.jsonl (its environment, the epoch it started
from) and one when it ends. SIGINT or SIGTERM stops it after the epoch: every rank agrees, rank 0
saves the snapshot, all exit 0.
Knobs for tests: --crash-rank R raises on start-up in the first attempt (TORCHELASTIC_RESTART_COUNT 0),
once every rank has noted its start;
--stubborn-rank R ignores both signals and never exits once told to stop; --epoch-s slows epochs.
"""

import argparse
import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel

SEEN = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT",
        "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_ERROR_FILE", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
        "CUDA_VISIBLE_DEVICES", "PYTHONBREAKPOINT")
stop = None


def on_signal(signum, frame):
    global stop
    stop = signal.Signals(signum).name


def note(out, rank, **fields):
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"rank-{rank}.jsonl"), "a") as f:
        f.write(json.dumps(fields) + "\n")


def wait_for_starts(out, world_size, restart, timeout_s=120.0):
    def started(rank):
        try:
            lines = open(os.path.join(out, f"rank-{rank}.jsonl")).read().splitlines()
        except FileNotFoundError:
            return False
        return any(e["event"] == "start" and e["env"]["TORCHELASTIC_RESTART_COUNT"] == str(restart)
                   for e in map(json.loads, lines))

    end = time.time() + timeout_s
    while not all(started(r) for r in range(world_size)) and time.time() < end:
        time.sleep(0.1)


@record
def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--snapshot", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--epoch-s", type=float, default=0.0)
    parser.add_argument("--crash-rank", type=int, default=-1)
    parser.add_argument("--stubborn-rank", type=int, default=-1)
    args = parser.parse_args()

    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    status = dict(line.split(":\t", 1) for line in open("/proc/self/status").read().splitlines() if ":\t" in line)
    note(args.out, rank, event="start", env={k: os.environ.get(k) for k in SEEN},
         sigint_default=signal.getsignal(signal.SIGINT) is signal.default_int_handler,
         blocked=int(status["SigBlk"], 16), ignored=int(status["SigIgn"], 16))
    if rank == args.crash_rank and restart == 0:
        # Only once every rank has noted this attempt's start: on a loaded machine one rank may come
        # up seconds after the other, and the restart would end it before its start was on record.
        wait_for_starts(args.out, world_size, restart)
        raise ValueError(f"rank {rank} crashes on start-up on purpose")
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN if rank == args.stubborn_rank else on_signal)
    dist.init_process_group("gloo")

    model = nn.Linear(4, 1)
    epoch = 0
    if os.path.exists(args.snapshot):  # the tutorial's _load_snapshot: go on where the last attempt saved
        snapshot = torch.load(args.snapshot)
        model.load_state_dict(snapshot["model"])
        epoch = snapshot["epoch"]
    note(args.out, rank, event="resumed", epoch=epoch, world_size=world_size)
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
    torch.manual_seed(rank)
    while epoch < args.epochs:
        for _ in range(4):
            x = torch.randn(16, 4)
            loss = (ddp(x) - x.sum(1, keepdim=True)).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        epoch += 1
        # Every rank must see a stop at the same epoch, or one waits in a collective for the other.
        flag = torch.tensor([float(stop is not None)])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if rank == 0:
            tmp = args.snapshot + ".tmp"
            torch.save({"model": model.state_dict(), "epoch": epoch}, tmp)
            os.replace(tmp, args.snapshot)  # the tutorial's _save_snapshot, made atomic
        said = f"epoch {epoch} world size {world_size} loss {loss.item():.4f}"
        print(f"{said}\r{said} (saved)", flush=True)  # an in-place update, as a progress bar's
        if flag.item():
            break
        time.sleep(args.epoch_s)
    stopped = stop or ("a peer's signal" if epoch < args.epochs else None)
    dist.destroy_process_group()  # before any wait: rank 0's TCPStore would keep rank 0 alive for its clients
    if rank == args.stubborn_rank and stopped:
        note(args.out, rank, event="stubborn", epoch=epoch)
        while True:  # told to stop, it will not: only SIGKILL ends it
            time.sleep(1)
    note(args.out, rank, event="end", epoch=epoch, world_size=world_size, stopped=stopped)
    print(f"done at epoch {epoch}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
