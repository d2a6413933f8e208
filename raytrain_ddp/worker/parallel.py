"""What differs between DDP and FSDP: how a model is wrapped, when gradients sync, how they are
clipped, and how big a rank's share of the training state is. How that state is got and set for a
checkpoint is checkpoint/state_dicts.py's.

The loop calls these and never asks which strategy it runs; each function tells the two apart by
the wrapped model itself (a DistributedDataParallel, or a module FSDP2's `fully_shard` made an
FSDPModule). As torchtitan keeps `parallelize` out of its trainer.

FSDP blocks. Each block is all-gathered on its own in forward and backward, so the peak memory is
one block's full parameters on top of the shards. The built-in models name theirs (BLOCKS). A
model of your own (--model PKG.MODULE:CALLABLE) may define `fsdp_blocks()`, returning the modules
to shard as units, inner ones before those that hold them; without it, the default policy makes a
block of every module that holds at least MIN_BLOCK_PARAMS parameters not already in a smaller
block (FSDP1's size-based policy). The root is always sharded last, and takes what is left.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from raytrain_ddp.config import TrainConfig
from raytrain_ddp.worker.models import MODELS

# FSDP, DTensor and DCP are imported where they are used: torch.distributed.tensor alone costs about a
# second, which a DDP rank never needs to pay.

MIN_BLOCK_PARAMS = 1_000_000
"""The default FSDP policy's smallest block, in parameters: smaller modules stay with their parent."""


def convnet_blocks(model: nn.Module) -> list[nn.Module]:
    return [child for child in model.children() if isinstance(child, nn.Sequential)]  # conv, norm, relu, pool


def resnet_blocks(model: nn.Module) -> list[nn.Module]:
    return [block for layer in (model.layer1, model.layer2, model.layer3, model.layer4) for block in layer]


BLOCKS: dict[str, Callable[[nn.Module], list[nn.Module]]] = {
    "convnet": convnet_blocks,
    "resnet18": resnet_blocks,
    "resnet50": resnet_blocks,
}


def default_blocks(model: nn.Module, min_params: int = MIN_BLOCK_PARAMS) -> list[nn.Module]:
    """Post-order: a module whose parameters, less those of blocks inside it, reach `min_params`."""
    blocks: list[nn.Module] = []

    def visit(module: nn.Module) -> int:
        left = sum(p.numel() for p in module.parameters(recurse=False))
        left += sum(visit(child) for child in module.children())
        # a ModuleList or ModuleDict has no forward of its own for FSDP's hooks to run on
        if module is not model and left >= min_params and not isinstance(module, (nn.ModuleList, nn.ModuleDict)):
            blocks.append(module)
            return 0
        return left

    visit(model)
    return blocks


def fsdp_blocks(name: str, model: nn.Module) -> list[nn.Module]:
    if name in BLOCKS:
        return BLOCKS[name](model)
    if callable(getattr(model, "fsdp_blocks", None)):
        return list(model.fsdp_blocks())
    return default_blocks(model)


def ddp_options(cfg: TrainConfig, accum: int) -> dict[str, Any]:
    """Gradients live in DDP's all-reduce buckets (no copy). Our own models use every parameter on
    every step, so their graph is static and DDP may skip its per-step search for unused ones; a
    user's model may skip a layer on some steps, so it gets DDP's safe defaults, or the search."""
    options: dict[str, Any] = {"gradient_as_bucket_view": True}
    if cfg.find_unused_parameters:
        options["find_unused_parameters"] = True
    elif cfg.model in MODELS and accum == 1:
        # static_graph with no_sync() fails its first backward, or silently stops all-reducing
        # gradients (pytorch/pytorch#187732): accumulation gets the default reducer.
        options["static_graph"] = True
    return options


def wrap_ddp(cfg: TrainConfig, model: nn.Module, accum: int, device: torch.device, local_world_size: int) -> nn.Module:
    import ray.train.torch  # Ray's: moves the model to the rank's device, and skips DDP at one worker

    return ray.train.torch.prepare_model(model, parallel_strategy_kwargs=ddp_options(cfg, accum))


def mesh(cfg: TrainConfig, device: torch.device, local_world_size: int):
    """1-D over all ranks; for hybrid 2-D, (nodes, ranks per node): shards within a node, where
    the all-gathers are cheap, replicas across nodes, which then only all-reduce gradients."""
    from torch.distributed.device_mesh import init_device_mesh

    world_size = dist.get_world_size()
    if cfg.sharding != "hybrid":
        return init_device_mesh(device.type, (world_size,))
    if world_size % local_world_size:
        raise ValueError(
            f"--sharding hybrid needs the same number of ranks on every node ({world_size} ranks, "
            f"{local_world_size} on this one); use --placement pack with a multiple of the GPUs per node"
        )
    return init_device_mesh(device.type, (world_size // local_world_size, local_world_size), mesh_dim_names=("replicate", "shard"))


def wrap_fsdp(cfg: TrainConfig, model: nn.Module, accum: int, device: torch.device, local_world_size: int) -> nn.Module:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = model.to(device)
    if not dist.is_initialized():  # one rank and no process group: nothing to shard over
        return model
    # Blocks compute in the loop's autocast dtype (half the all-gathers); gradients are reduced and the
    # optimizer steps in fp32. fp16 (GPUs without native bf16) is safe with the loop's plain
    # GradScaler: FSDP's gradients are DTensors, whose inf check is reduced over the shards, so every
    # rank skips the same steps (tests/test_strategy.py checks it on CPU).
    precision = MixedPrecisionPolicy()
    if device.type == "cuda" and cfg.amp:
        half = torch.bfloat16 if torch.cuda.is_bf16_supported(including_emulation=False) else torch.float16
        precision = MixedPrecisionPolicy(param_dtype=half, reduce_dtype=torch.float32)
    options = {"mesh": mesh(cfg, device, local_world_size), "mp_policy": precision}
    for block in [*fsdp_blocks(cfg.model, model), model]:
        # grad-op keeps full parameters until backward. The root's are needed first in backward, so
        # resharding them after forward would all-gather them twice a step: the root stays whole in
        # between, for a little memory, as torch's own default (None) has it in the releases that have one.
        reshard = cfg.sharding != "grad-op" and block is not model
        fully_shard(block, **options, reshard_after_forward=reshard)
        block.raytrain_reshard_after_forward = reshard  # for whole_model to restore
    return model


WRAPPERS: dict[str, Callable[..., nn.Module]] = {"ddp": wrap_ddp, "fsdp": wrap_fsdp}


def wrap(cfg: TrainConfig, model: nn.Module, accum: int, device: torch.device, local_world_size: int) -> nn.Module:
    return WRAPPERS[cfg.strategy](cfg, model, accum, device, local_world_size)


def gradient_sync(model: nn.Module, sync: bool) -> contextlib.AbstractContextManager:
    """Around one micro-batch's backward: reduce gradients over the ranks only when `sync` (the
    accumulation's last micro-batch); the others add to this rank's gradients locally."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, DistributedDataParallel) and not sync:
        return model.no_sync()
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(sync)  # all its blocks; unsharded gradients accumulate meanwhile
    return contextlib.nullcontext()


def clip_grad_norm(model: nn.Module, max_norm: float) -> torch.Tensor:
    """Scale the gradients so their global norm is at most `max_norm`. Under FSDP each rank holds a
    shard of each gradient: the norm of the DTensors is a partial one, summed over the ranks."""
    from torch.distributed.tensor import DTensor

    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()  # one all-reduce
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm


@contextlib.contextmanager
def whole_model(model: nn.Module) -> Iterator[nn.Module]:
    """The model with every parameter whole on every rank, for evaluation: then a forward runs no
    collective, so ranks with fewer validation batches cannot leave the others waiting. DDP's module
    is whole already (its own forward would broadcast buffers); FSDP's blocks are all-gathered once
    here, in the same order on every rank, and sharded again after."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, DistributedDataParallel):
        yield model.module
        return
    fsdp = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for module in fsdp:
        module.unshard()
        module.set_reshard_after_forward(False, recurse=False)
    try:
        yield model
    finally:
        for module in fsdp:
            module.set_reshard_after_forward(module.raytrain_reshard_after_forward, recurse=False)
            module.reshard()


def state_mib(model: nn.Module, optimizer: torch.optim.Optimizer) -> float:
    """This rank's parameters, their gradients (one per trainable parameter, as after a step) and
    optimizer state, in MiB; local shards under FSDP."""
    from torch.distributed.tensor import DTensor

    def local_bytes(t: torch.Tensor) -> int:
        t = t.to_local() if isinstance(t, DTensor) else t
        return t.numel() * t.element_size()

    total = sum(local_bytes(p) * (2 if p.requires_grad else 1) for p in model.parameters())
    for state in optimizer.state.values():
        total += sum(local_bytes(v) for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
    return total / 2**20
