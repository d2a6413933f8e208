"""Ray Train's TorchConfig for gloo and NCCL with env://, without torch on the controller.

`TorchConfig` lives in a module that imports torch at the top, so unpickling it costs Ray Train's
controller seconds of one core before it starts any worker. `ProcessGroupConfig` does what
`_TorchBackend` does for gloo and NCCL, and imports torch only on the workers, which need it anyway.

This module must not import torch at the top: the controller unpickles from it.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

from ray.train.backend import Backend, BackendConfig

from raytrain_ddp.net import free_port
from raytrain_ddp.ray_compat.state import torch_framework

logger = logging.getLogger(__name__)

SHUTDOWN_TIMEOUT_S = 30
"""How long the controller waits for the ranks to leave the process group before giving up on them
(as Ray's TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S)."""


def rendezvous_address() -> tuple[str, int]:
    """On rank 0: its node's address and a port free there now, for the store the ranks meet at."""
    import ray

    return ray.util.get_node_ip_address(), free_port()


def join_process_group(backend: str, addr: str, port: int, timeout_s: int) -> None:
    """On each rank: torchrun's variables from Ray Train's context, then init_process_group."""
    from datetime import timedelta

    import ray.train
    import ray.train.torch
    import torch.distributed as dist

    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    os.environ.update(
        MASTER_ADDR=addr, MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
        LOCAL_RANK=str(ctx.get_local_rank()), LOCAL_WORLD_SIZE=str(ctx.get_local_world_size()),
        NODE_RANK=str(ctx.get_node_rank()),
    )
    device = None
    if backend == "nccl":
        if "TORCH_NCCL_BLOCKING_WAIT" not in os.environ:
            # A timed-out NCCL collective then fails the rank instead of hanging it (as Ray sets it).
            os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
        # The rank's own GPU, bound to the group: a collective from a thread that never called
        # set_device (Ray Train's train function runs in one) would otherwise use GPU 0.
        device = ray.train.torch.get_device()
    dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s), device_id=device)


def leave_process_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


class ProcessGroupBackend(Backend):
    share_cuda_visible_devices = True  # each rank sees its node's GPUs, so NCCL can use peer links

    def on_start(self, worker_group: Any, backend_config: ProcessGroupConfig) -> None:
        addr, port = worker_group.execute_single(0, rendezvous_address)
        worker_group.execute(join_process_group, backend=backend_config.backend, addr=addr, port=port,
                             timeout_s=backend_config.timeout_s)

    def on_shutdown(self, worker_group: Any, backend_config: ProcessGroupConfig) -> None:
        import ray
        from ray.exceptions import GetTimeoutError

        try:
            ray.get(worker_group.execute_async(leave_process_group), timeout=SHUTDOWN_TIMEOUT_S)
        except GetTimeoutError:  # a rank stuck in a collective: Ray kills the group next anyway
            logger.warning("ranks did not leave the process group within %s s", SHUTDOWN_TIMEOUT_S)


class CudaDevice:
    """Around the train function on each rank: its GPU is torch's current device (as TorchConfig's)."""

    def __enter__(self) -> None:
        import torch

        if torch.cuda.is_available():
            import ray.train.torch

            device = ray.train.torch.get_device()
            if device.type == "cuda":
                torch.cuda.set_device(device)

    def __exit__(self, *exc: object) -> bool:
        return False


@dataclass
class ProcessGroupConfig(BackendConfig):
    """Ray's TorchConfig for gloo and NCCL with env:// (its defaults), without torch on the controller."""

    backend: str = "gloo"
    """torch.distributed backend: gloo on CPUs, nccl on GPUs."""
    timeout_s: int = 1800
    """Seconds a collective may wait before it fails (init_process_group's timeout)."""

    @property
    def backend_cls(self) -> type[Backend]:
        return ProcessGroupBackend

    @property
    def train_func_context(self) -> type[CudaDevice]:
        return CudaDevice

    @property
    def framework(self) -> Any:
        return torch_framework()  # what Ray's Train dashboard shows for the run, as for TorchConfig

    def to_dict(self) -> dict[str, Any]:
        return {"backend": self.backend, "timeout_s": self.timeout_s}  # the dashboard's record of it
