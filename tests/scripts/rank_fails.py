"""A torchrun-style script with no `@record`, for `raytrain launch`'s error reports. Nothing in it
knows about Ray.

    raytrain launch --workers 2 tests/scripts/rank_fails.py --fail-rank 1 --fail-step 5

Each rank trains a few steps of DDP on gloo, with a `\\r` progress line. Knobs: --fail-rank R raises
a RuntimeError at step --fail-step, so its peers fail in their next collective;
--abort-at-exit R [R ...] end, raised or not, by dying as torch's teardown sometimes does (SIGABRT
after `terminate called without an active exception`).
"""

import argparse
import atexit
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=10)
parser.add_argument("--fail-rank", type=int, default=-1)
parser.add_argument("--fail-step", type=int, default=5)
parser.add_argument("--abort-at-exit", type=int, nargs="+", default=[])
args = parser.parse_args()
ABORT_AFTER_S = 2.0
finished = False


def check_step(step):
    if step == args.fail_step:
        raise RuntimeError(f"rank {dist.get_rank()} failed at step {step} on purpose")


def abort_in_teardown():
    # What libstdc++ does when a joinable std::thread (gloo's, NCCL's) is destroyed at exit. After a
    # clean end, late in the teardown, as torch's comes: at once, rank 0 (which holds the rendezvous
    # store) could cut a peer's last ring transfer or its destroy_process_group on a loaded machine,
    # failing the peer too (a flake CI saw once).
    if finished:
        time.sleep(ABORT_AFTER_S)
    sys.stderr.write("terminate called without an active exception\n")
    sys.stderr.flush()
    os.abort()


dist.init_process_group("gloo")  # env://, as under torchrun
rank = dist.get_rank()
if rank in args.abort_at_exit:
    atexit.register(abort_in_teardown)
torch.manual_seed(0)
model = DistributedDataParallel(nn.Linear(4, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(args.steps):
    loss = model(torch.randn(8, 4)).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    print(f"\rstep {step} loss {loss.item():.3f}", end="", flush=True)
    if rank == args.fail_rank:
        check_step(step)
print(f"\ndone after {args.steps} steps", flush=True)
dist.destroy_process_group()
finished = True
