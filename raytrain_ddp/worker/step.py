"""One optimizer step's pieces: the optimizer, the autocast dtype, a micro-batch's forward and
backward, and the step that ends an accumulation. The loop, the benchmarks and the tests all train
through these, so they measure and check what a run does."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from raytrain_ddp.config import TrainConfig
from raytrain_ddp.worker import host_sync, parallel
from raytrain_ddp.worker.measure.part_clock import PartClock


def make_optimizer(cfg: TrainConfig, model: torch.nn.Module) -> torch.optim.Optimizer:
    groups = param_groups(model, cfg.weight_decay, cfg.decay_norm_bias)
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(groups, lr=cfg.lr)
    return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum)


def param_groups(model: torch.nn.Module, weight_decay: float, decay_norm_bias: bool) -> list[dict[str, Any]]:
    """Weight decay on weight matrices and conv kernels only: decaying biases and norm scales (the
    1-D parameters) pulls them to 0 and costs accuracy, so most recipes exempt them."""
    params = [p for p in model.parameters() if p.requires_grad]
    if decay_norm_bias:
        return [{"params": params, "weight_decay": weight_decay}]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]


def autocast_dtype(cfg: TrainConfig, device: torch.device) -> torch.dtype | None:
    """The dtype the forward runs in under --amp on a GPU, or None for fp32."""
    if device.type != "cuda" or not cfg.amp:
        return None
    # Emulated bf16 is slower than fp16 and no more accurate; fp16 needs loss scaling, bf16 has
    # fp32's exponent range and does not.
    return torch.bfloat16 if torch.cuda.is_bf16_supported(including_emulation=False) else torch.float16


def forward_backward(
    model: torch.nn.Module, inputs: torch.Tensor, labels: torch.Tensor, amp_dtype: torch.dtype | None,
    scaler: torch.amp.GradScaler, label_smoothing: float, weight: float, sync: bool, parts: PartClock | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One micro-batch: forward, then backward of its loss x `weight` (1 / micro-batches in this
    optimizer step, so the summed gradient is the big batch's mean). Returns (loss, logits), detached.
    `parts`, when given, times the forward and the backward (and DDP's hook, the communication)."""
    # gradients are reduced over the ranks only on the last micro-batch; the others add to .grad locally
    with parallel.gradient_sync(model, sync):
        if parts is not None:
            parts.mark("start")
        with torch.autocast(inputs.device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
            logits = model(inputs)
            loss = F.cross_entropy(logits, labels, label_smoothing=label_smoothing)
        if parts is not None:
            parts.mark("forward")
        scaler.scale(loss * weight).backward()
        if parts is not None:
            parts.mark("backward")
            parts.step_done()
    return loss.detach(), logits.detach()


def apply_gradients(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler, clip_grad_norm: float,
) -> None:
    """The optimizer step that ends an accumulation: clip, then step."""
    if clip_grad_norm > 0:
        scaler.unscale_(optimizer)  # fp16: clip the true gradients, not the loss-scaled ones
        parallel.clip_grad_norm(model, clip_grad_norm)  # the global norm, over sharded gradients too
    with host_sync.allowed(scaler.is_enabled()):  # fp16: the scaler reads its overflow flag back, a named sync
        scaler.step(optimizer)  # skipped by the scaler when fp16 gradients overflowed
    scaler.update()
