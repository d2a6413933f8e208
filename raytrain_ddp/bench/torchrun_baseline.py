"""The hand-written arm of `raytrain bench overhead`: the textbook torchrun DDP loop a user writes.

init_process_group, a DistributedSampler (set_epoch each epoch) under a plain DataLoader, DDP,
then zero_grad / forward / backward / step. No raytrain data path: the data is torchvision's
ImageFolder, or the user's own dataset function (bench/regimes.py), read whole. The same model,
per-rank batch, threads, loader settings and SGD as raytrain's run of the regime; on GPU bf16
autocast and channels_last as raytrain's loop uses. With one process, no DDP wrapper (as Ray
Train's prepare_model). With `strategy: fsdp`, FSDP2's fully_shard on the same blocks as raytrain's,
computing in bf16 on a GPU.

    torchrun --standalone --nproc_per_node=2 -m raytrain_ddp.bench.torchrun_baseline '<TrainConfig JSON>'

Rank 0 prints one JSON line: when the first optimizer step had completed, its start-up marks (named
as raytrain's stages, startup.py), samples/s per epoch and, on a GPU, its peak GPU memory and the
host syncs its epochs made (counted as raytrain's are under RAYTRAIN_CHECK_HOST_SYNC=count).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from raytrain_ddp import plugins
from raytrain_ddp.bench.spawn import leave_group
from raytrain_ddp.config import TrainConfig
from raytrain_ddp.worker import host_sync
from raytrain_ddp.worker.models import model_builder
from raytrain_ddp.worker.parallel import fsdp_blocks


def train_set(cfg: TrainConfig) -> Dataset:
    if cfg.dataset == "imagefolder":  # the torchvision recipe, with raytrain's augmentation for ImageFolder
        from torchvision.datasets import ImageFolder
        from torchvision.transforms import v2

        transform = v2.Compose([
            v2.ToImage(),
            v2.RandomResizedCrop(cfg.image_size, scale=(0.25, 1.0), antialias=True),
            v2.RandomHorizontalFlip(),
            v2.ToDtype(torch.float32, scale=True),
            v2.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)),
        ])
        return ImageFolder(os.path.join(cfg.data_dir, "train"), transform=transform)
    build = plugins.load(cfg.dataset, "--dataset")  # the user's own, e.g. raytrain_ddp.bench.regimes:tensors
    return build(split="train", data_dir=cfg.data_dir, image_size=cfg.image_size)


def main() -> None:
    marks = {"python": time.time()}  # torchrun, the interpreters and their imports end here
    cfg = TrainConfig.from_dict(json.loads(sys.argv[1]))
    torch.set_num_threads(cfg.cpus_per_worker)
    cuda = cfg.gpu
    if cuda:
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        torch.backends.cudnn.benchmark = True
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    dist.barrier()  # every rank has arrived, as raytrain's first collective marks it
    marks["process group"] = time.time()
    torch.manual_seed(cfg.seed)

    dataset = train_set(cfg)
    sampler = DistributedSampler(dataset, seed=cfg.seed)
    loader = DataLoader(dataset, batch_size=cfg.batch_size, sampler=sampler, num_workers=cfg.data_workers,
                        pin_memory=cuda, persistent_workers=cfg.data_workers > 0)
    marks["data"] = time.time()

    model = model_builder(cfg.model)(num_classes=cfg.num_classes, in_channels=dataset[0][0].shape[0]).to(device)
    if cfg.strategy == "fsdp":  # fully_shard refuses channels_last weights
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in [*fsdp_blocks(cfg.model, model), model]:
            fully_shard(block, **({"mp_policy": bf16} if cuda and cfg.amp else {}))
    elif cuda:
        model = model.to(memory_format=torch.channels_last)
    if world_size > 1 and cfg.strategy != "fsdp":
        model = DistributedDataParallel(model, device_ids=[device.index] if cuda else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    amp = cuda and cfg.amp
    marks["model"] = time.time()

    first_step_unix, throughputs, steps = None, [], 0
    counting = host_sync.counted() if cuda else contextlib.nullcontext([None])
    with counting as syncs:
        for epoch in range(cfg.epochs):
            sampler.set_epoch(epoch)
            model.train()
            start, samples = time.perf_counter(), 0
            for inputs, labels in loader:
                inputs, labels = inputs.to(device, non_blocking=True), labels.to(device, non_blocking=True)
                if cuda and inputs.dim() == 4:
                    inputs = inputs.contiguous(memory_format=torch.channels_last)
                optimizer.zero_grad(set_to_none=True)
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
                    loss = F.cross_entropy(model(inputs), labels)
                loss.backward()
                optimizer.step()
                if first_step_unix is None:
                    if cuda:
                        torch.cuda.synchronize()  # the step has run, not just been queued
                    first_step_unix = time.time()
                samples += len(labels)
                steps += 1
            if cuda:
                torch.cuda.synchronize()
            throughputs.append(samples * world_size / (time.perf_counter() - start))
    if rank == 0:  # rank 0's GPU stands for the others': the same model and batch
        gpu_mib = torch.cuda.max_memory_allocated(device) / 2**20 if cuda else None
        print(json.dumps({"first_step_unix": first_step_unix, "marks": marks, "throughputs": throughputs,
                          "gpu_mib": gpu_mib,
                          "syncs_per_step": None if syncs[0] is None else syncs[0] / steps}))
    leave_group()


if __name__ == "__main__":
    main()
