"""The worker loop: the one function TorchTrainer runs on every rank.

Read it top to bottom: [1] set up the rank, [2] data, [3] model and optimizer, [4] epochs of
train + validate + report. Metrics are all-reduced, so every number describes the whole world.
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any

import ray.train
import ray.train.torch
import torch
import torch.distributed as dist
import torch.nn.functional as F

from raytrain_ddp.config import TrainConfig
from raytrain_ddp.data import make_loaders
from raytrain_ddp.models import MODELS

PROGRESS_EVERY_S = 1.0
"""How often rank 0 sends a step update to the driver's progress display."""


def train_loop(loop_config: dict[str, Any]) -> None:
    cfg = TrainConfig.from_dict(loop_config["config"])
    sink = loop_config["sink"]  # the driver's MetricsSink actor

    # [1] The rank: threads, seed, device, and who runs where.
    ctx = ray.train.get_context()
    rank, world_size = ctx.get_world_rank(), ctx.get_world_size()
    torch.set_num_threads(cfg.cpus_per_worker)
    torch.manual_seed(cfg.seed)
    device = ray.train.torch.get_device()
    cuda = device.type == "cuda"
    if cuda:
        torch.backends.cudnn.benchmark = True  # fixed input shapes: let cuDNN pick its fastest kernels
    where = {"hostname": socket.gethostname(), "ip": ray.util.get_node_ip_address(), "pid": os.getpid()}
    ranks = [where] * world_size
    if world_size > 1:
        dist.all_gather_object(ranks, where)

    # [2] Data: each rank gets a disjoint shard (see data.make_loaders).
    loaders = make_loaders(cfg, rank, world_size, cuda)

    # [3] Model, optimizer, schedule, mixed precision.
    model = MODELS[cfg.model](cfg.num_classes, loaders.in_channels)
    if cuda:
        model = model.to(memory_format=torch.channels_last)
    model = ray.train.torch.prepare_model(
        model, parallel_strategy_kwargs={"gradient_as_bucket_view": True}
    )
    optimizer = make_optimizer(cfg, model)
    scheduler = make_scheduler(cfg, optimizer)
    amp_dtype = None
    if cuda and cfg.amp:
        amp_dtype = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    # Only fp16 needs loss scaling; bf16 has fp32's exponent range.
    scaler = torch.amp.GradScaler("cuda", enabled=amp_dtype == torch.float16)

    if rank == 0:
        sink.start.remote(
            world_size=world_size,
            backend=dist.get_backend() if dist.is_initialized() else "none",
            ranks=ranks,
            steps_per_epoch=loaders.steps_per_epoch,
        )

    # [4] Epochs.
    for epoch in range(1, cfg.epochs + 1):
        loaders.set_epoch(epoch)  # a fresh shuffle per epoch, the same on every rank
        model.train()
        sums = torch.zeros(3, dtype=torch.float64, device=device)  # loss x n, correct, n
        start = last_update = time.perf_counter()
        for step, (images, labels) in enumerate(loaders.train, start=1):
            images = images.to(device, non_blocking=True)
            labels = labels.to(device, non_blocking=True)
            if cuda:
                images = images.contiguous(memory_format=torch.channels_last)
            with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
                logits = model(images)
                loss = F.cross_entropy(logits, labels)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            # Accumulate on the device: no host sync per step.
            sums += torch.stack(
                [loss.detach() * len(labels), (logits.argmax(1) == labels).sum(), torch.tensor(len(labels), device=device)]
            ).double()
            if rank == 0 and time.perf_counter() - last_update >= PROGRESS_EVERY_S:
                last_update = time.perf_counter()
                elapsed = last_update - start
                sink.step.remote(
                    epoch=epoch,
                    step=step,
                    loss=loss.item(),
                    samples_per_s=sums[2].item() * world_size / elapsed,
                )
        train_time = time.perf_counter() - start
        train_loss, train_acc, train_n = all_reduce_means(sums)

        val_loss, val_acc, _ = evaluate(model, loaders.val, device, amp_dtype)
        lr = optimizer.param_groups[0]["lr"]
        scheduler.step()

        row = {
            "epoch": epoch,
            "train_loss": train_loss,
            "train_acc": train_acc,
            "val_loss": val_loss,
            "val_acc": val_acc,
            "lr": lr,
            "epoch_time_s": time.perf_counter() - start,
            "throughput": train_n / train_time,
            "world_size": world_size,
            "backend": dist.get_backend() if dist.is_initialized() else "none",
        }
        if rank == 0:
            sink.epoch.remote(row)


@torch.no_grad()
def evaluate(model, loader, device, amp_dtype) -> tuple[float, float, float]:
    model.eval()
    sums = torch.zeros(3, dtype=torch.float64, device=device)
    for images, labels in loader:
        images = images.to(device, non_blocking=True)
        labels = labels.to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
            logits = model(images)
        loss = F.cross_entropy(logits.float(), labels, reduction="sum")
        sums += torch.stack(
            [loss, (logits.argmax(1) == labels).sum(), torch.tensor(len(labels), device=device)]
        ).double()
    return all_reduce_means(sums)


def all_reduce_means(sums: torch.Tensor) -> tuple[float, float, float]:
    """(loss sum, correct, count) summed over ranks -> (mean loss, accuracy, global count)."""
    if dist.is_initialized():
        dist.all_reduce(sums)
    loss_sum, correct, count = sums.tolist()
    return loss_sum / max(count, 1), correct / max(count, 1), count


def make_optimizer(cfg: TrainConfig, model: torch.nn.Module) -> torch.optim.Optimizer:
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    return torch.optim.SGD(
        model.parameters(), lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay
    )


def make_scheduler(cfg: TrainConfig, optimizer: torch.optim.Optimizer):
    if cfg.scheduler == "cosine":
        return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=cfg.epochs)
    if cfg.scheduler == "step":
        milestones = sorted({max(1, cfg.epochs // 2), max(1, cfg.epochs * 3 // 4)})
        return torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=milestones, gamma=0.1)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
