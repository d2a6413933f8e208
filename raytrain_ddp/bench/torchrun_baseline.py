"""The baseline of `raytrain bench overhead`: the same training, launched by plain torchrun.

Same model, data, sampler, per-worker batch, optimizer and, on GPU, the same speed habits (AMP,
channels_last, cudnn.benchmark) as raytrain's worker loop, in the textbook DDP loop users write by
hand. With one process there is no DDP wrapper (as Ray Train's prepare_model): a plain loop.

    torchrun --standalone --nproc_per_node=2 -m raytrain_ddp.bench.torchrun_baseline '<TrainConfig JSON>'

Rank 0 prints one JSON line: when the first optimizer step finished, its start-up marks (the same
stages as raytrain's, where they exist: startup.py), samples/s per epoch, peak RSS and peak GPU
memory (max over ranks).
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from raytrain_ddp.bench.spawn import leave_group
from raytrain_ddp.config import TrainConfig
from raytrain_ddp.data.loaders import make_loaders
from raytrain_ddp.worker.step import make_optimizer
from raytrain_ddp.worker.models import MODELS


def main() -> None:
    marks = {"python": time.time()}  # torchrun, the interpreters and their imports end here
    cfg = TrainConfig.from_dict(json.loads(sys.argv[1]))
    cuda = cfg.gpu
    if cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        torch.backends.cudnn.benchmark = True
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    dist.barrier()  # every rank has arrived, as raytrain's first collective marks it
    marks["process group"] = time.time()
    torch.set_num_threads(cfg.cpus_per_worker)
    torch.manual_seed(cfg.seed)
    loaders = make_loaders(cfg, rank, world_size, cuda=cuda)
    marks["data"] = time.time()
    model = MODELS[cfg.model](cfg.num_classes, loaders.in_channels).to(device)
    if cuda:
        model = model.to(memory_format=torch.channels_last)
    if world_size > 1:
        model = DistributedDataParallel(model, device_ids=[device.index] if cuda else None, gradient_as_bucket_view=True)
    optimizer = make_optimizer(cfg, model)
    amp_dtype = None
    if cuda and cfg.amp:
        amp_dtype = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    scaler = torch.amp.GradScaler("cuda", enabled=amp_dtype == torch.float16)
    marks["model"] = time.time()

    first_step_unix, throughputs = None, []
    for epoch in range(1, cfg.epochs + 1):
        loaders.set_epoch(epoch)
        model.train()
        start, samples = time.perf_counter(), 0
        for images, labels in loaders.train:
            images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
            if cuda:
                images = images.contiguous(memory_format=torch.channels_last)
            with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
                loss = F.cross_entropy(model(images), labels)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            if first_step_unix is None:
                if cuda:
                    torch.cuda.synchronize()
                first_step_unix = time.time()
            samples += len(labels)
        if cuda:
            torch.cuda.synchronize()
        throughputs.append(samples * world_size / (time.perf_counter() - start))
    gpu_mib = torch.cuda.max_memory_allocated(device) / 2**20 if cuda else 0.0
    peaks = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, gpu_mib], dtype=torch.float64, device=device)
    dist.all_reduce(peaks, op=dist.ReduceOp.MAX)
    if rank == 0:
        print(json.dumps({"first_step_unix": first_step_unix, "marks": marks, "throughputs": throughputs,
                          "rss_mib": peaks[0].item(), "gpu_mem_peak_mib": peaks[1].item() if cuda else None}))
    leave_group()


if __name__ == "__main__":
    main()
