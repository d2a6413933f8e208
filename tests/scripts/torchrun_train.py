"""A torchrun-style training script, as users bring them: nothing in it knows about Ray.

    torchrun --nproc-per-node 2 tests/scripts/torchrun_train.py --out OUT
    raytrain launch --workers 2 tests/scripts/torchrun_train.py --out OUT

It reads torchrun's environment, makes its own process group, shards with DistributedSampler,
trains with DDP, all-reduces its metrics, meets at a barrier, and saves on rank 0. Each rank also
writes what it saw to OUT/rank-N.json, so tests can check the environment and the shards.
Knobs for tests: --fail-rank/--exit-code fail one rank; --wait-for-sigterm trains until SIGTERM,
then saves a checkpoint and exits 0 (as a preemptible script does).
"""

import argparse
import json
import os
import signal
import socket
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--samples", type=int, default=512)
parser.add_argument("--fail-rank", type=int, default=-1)
parser.add_argument("--exit-code", type=int, default=1)
parser.add_argument("--wait-for-sigterm", action="store_true")
parser.add_argument("--backend", default="gloo", help="nccl: one GPU per rank, cuda:LOCAL_RANK")
args = parser.parse_args()

rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
local_rank = int(os.environ["LOCAL_RANK"])
seen = {k: os.environ.get(k) for k in (
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT",
)}
device = torch.device("cpu")
if args.backend == "nccl":
    device = torch.device("cuda", local_rank)  # the torchrun habit: this rank's GPU is cuda:LOCAL_RANK
    torch.cuda.set_device(device)
dist.init_process_group(backend=args.backend)  # env://, as under torchrun
torch.manual_seed(0)

stop = False
signalled = False  # the handler's alone: the loop never writes it, so no update of the handler's is lost


def on_sigterm(signum, frame):
    global signalled
    signalled = True


signal.signal(signal.SIGTERM, on_sigterm)

# Labels a linear model can learn: the sign of the first feature.
x = torch.randn(args.samples, 8).to(device)
y = (x[:, 0] > 0).long()
indexes = TensorDataset(torch.arange(args.samples))
sampler = DistributedSampler(indexes, shuffle=True, seed=0)  # RANK and WORLD_SIZE from the process group
loader = DataLoader(indexes, batch_size=32, sampler=sampler)
model = DistributedDataParallel(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)).to(device))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
print(f"rank {rank}/{world_size} on {socket.gethostname()} local rank {local_rank}", flush=True)

indices = []
epoch = 0
while epoch < args.epochs or (args.wait_for_sigterm and not stop):
    sampler.set_epoch(epoch)
    for (idx,) in loader:
        if epoch == 0:
            indices += idx.tolist()
        loss = nn.functional.cross_entropy(model(x[idx]), y[idx])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    total = torch.tensor([loss.item(), 1.0], device=device)
    dist.all_reduce(total)
    print(f"epoch {epoch} mean loss {total[0].item() / total[1].item():.4f}", flush=True)
    if rank == args.fail_rank:
        print(f"rank {rank} is failing on purpose", file=sys.stderr, flush=True)
        # Past the interpreter's teardown: with gloo's threads still talking to rank 0 it can abort
        # (SIGABRT, "terminate called without an active exception"), even after destroy_process_group,
        # and the status would be lost (test_launch.py's teardown test covers that case).
        dist.destroy_process_group()
        os._exit(args.exit_code)
    epoch += 1
    if args.wait_for_sigterm:
        # Every rank must see the stop at the same epoch, or one waits in all_reduce for the other.
        flag = torch.tensor([float(signalled)], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        stop = bool(flag.item())
        time.sleep(0.2)

dist.barrier()
with torch.no_grad():
    accuracy = (model(x).argmax(1) == y).float().mean().item()
os.makedirs(args.out, exist_ok=True)
if rank == 0:
    torch.save({"model": model.module.state_dict(), "epoch": epoch, "stopped": stop}, os.path.join(args.out, "model.pt"))
with open(os.path.join(args.out, f"rank-{rank}.json"), "w") as f:
    json.dump({"env": seen, "cuda_visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
               "gpu": torch.cuda.current_device() if args.backend == "nccl" else None, "indices": indices, "accuracy": accuracy, "hostname": socket.gethostname(),
               "stopped_by_sigterm": stop, "cwd": os.getcwd()}, f)
dist.destroy_process_group()
print(f"done: accuracy {accuracy:.3f}", flush=True)
