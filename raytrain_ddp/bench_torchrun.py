"""The baseline of `raytrain bench overhead`: the same training, launched by plain torchrun.

Same model, data, sampler, per-worker batch and optimizer as raytrain's worker loop, in the
textbook DDP loop users write by hand:

    torchrun --standalone --nproc_per_node=2 -m raytrain_ddp.bench_torchrun '<TrainConfig JSON>'

Rank 0 prints one JSON line: when the first optimizer step finished, samples/s per epoch, peak RSS.
"""

from __future__ import annotations

import json
import resource
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from raytrain_ddp.config import TrainConfig
from raytrain_ddp.data import make_loaders
from raytrain_ddp.loop import make_optimizer
from raytrain_ddp.models import MODELS


def main() -> None:
    cfg = TrainConfig.from_dict(json.loads(sys.argv[1]))
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(cfg.cpus_per_worker)
    torch.manual_seed(cfg.seed)
    loaders = make_loaders(cfg, rank, world_size, cuda=False)
    model = MODELS[cfg.model](cfg.num_classes, loaders.in_channels)
    model = DistributedDataParallel(model, gradient_as_bucket_view=True)
    optimizer = make_optimizer(cfg, model)

    first_step_unix, throughputs = None, []
    for epoch in range(1, cfg.epochs + 1):
        loaders.set_epoch(epoch)
        model.train()
        start, samples = time.perf_counter(), 0
        for images, labels in loaders.train:
            loss = F.cross_entropy(model(images), labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            if first_step_unix is None:
                first_step_unix = time.time()
            samples += len(labels)
        throughputs.append(samples * world_size / (time.perf_counter() - start))
    rss = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024], dtype=torch.float64)
    dist.all_reduce(rss, op=dist.ReduceOp.MAX)
    if rank == 0:
        print(json.dumps({"first_step_unix": first_step_unix, "throughputs": throughputs, "rss_mib": rss.item()}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
