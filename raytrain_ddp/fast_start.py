"""Ray Train, started lean: `fast(TorchTrainer)` and `fast(DataParallelTrainer)` start the same run
as Ray's own classes, less four costs that a start-up trace found in every run (README, Performance):

- **The controller's runtime_env.** Ray Train gives its controller one (`RAY_WARN_BLOCKING_GET_INSIDE_ASYNC=0`,
  plus any `RAY_TRAIN_*` variable the driver sets), and every actor the controller creates inherits
  it. So none of those processes can take one of Ray's idle worker processes, and each starts Python
  twice (`setup_worker.py`, then the worker). When the driver sets no `RAY_TRAIN_*` variable, the
  controller here starts without one and sets that warning switch in its own process.
- **torch on the controller.** `TorchConfig` lives in a module that imports torch at the top, so
  unpickling it costs the controller about 3 s of one core before it starts any worker.
  `ProcessGroupConfig` does what `_TorchBackend` does for gloo and NCCL, and imports torch only on
  the workers, which need it anyway.
- **The DatasetManager.** Its process is made for every run, with or without Ray Datasets. Here it
  is made only when the run has datasets.
- **The PlacementGroupCleaner.** It asks the State API, from inside an actor, whether the controller
  is alive. On a token-secured cluster (every Ray 2.60 cluster) that call waits 40 s for the GCS and
  fails, so the cleaner never cleans anything. Its `stop()` then holds the end of every fit for
  12 s. Without it, the run's placement group is still removed by the worker group's own shutdown,
  or by Ray when our driver (the job) exits.

This module must not import torch: the controller unpickles from it.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from typing import Any

from ray.train.backend import Backend, BackendConfig
from ray.train.v2._internal.execution.controller import TrainController as RayTrainController

from raytrain_ddp.elastic import staying_nodes_only

logger = logging.getLogger(__name__)

SHUTDOWN_TIMEOUT_S = 30
"""How long the controller waits for the ranks to leave the process group before giving up on them
(as Ray's TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S)."""


# --- the process group: on the workers, torch; on the controller, none ---


def join_process_group(backend: str, addr: str, port: int, timeout_s: int) -> None:
    """On each rank: torchrun's variables from Ray Train's context, then init_process_group."""
    from datetime import timedelta

    import ray.train
    import torch.distributed as dist

    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    os.environ.update(
        MASTER_ADDR=addr, MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
        LOCAL_RANK=str(ctx.get_local_rank()), LOCAL_WORLD_SIZE=str(ctx.get_local_world_size()),
        NODE_RANK=str(ctx.get_node_rank()),
    )
    if backend == "nccl" and "TORCH_NCCL_BLOCKING_WAIT" not in os.environ:
        # A timed-out NCCL collective then fails the rank instead of hanging it (as Ray sets it).
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))


def leave_process_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


class ProcessGroupBackend(Backend):
    share_cuda_visible_devices = True  # each rank sees its node's GPUs, so NCCL can use peer links

    def on_start(self, worker_group: Any, backend_config: ProcessGroupConfig) -> None:
        from ray.train._internal.utils import get_address_and_port

        addr, port = worker_group.execute_single(0, get_address_and_port)  # a free port on rank 0's node
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
        from ray.train.v2._internal.util import TrainingFramework

        return TrainingFramework.TORCH  # what Ray's Train dashboard shows for the run, as for TorchConfig

    def to_dict(self) -> dict[str, Any]:
        return {"backend": self.backend, "timeout_s": self.timeout_s}  # the dashboard's record of it


# --- the controller ---


class TrainController(RayTrainController):
    """Ray Train's controller, started without a runtime_env: it sets its one variable itself."""

    def __init__(self, **kwargs: Any) -> None:
        # The controller blocks on ray.get by design; Ray's runtime_env silences the warning so.
        os.environ.setdefault("RAY_WARN_BLOCKING_GET_INSIDE_ASYNC", "0")
        super().__init__(**kwargs)


def needed(callback: Any, datasets: dict[str, Any]) -> bool:
    """False for the controller callbacks whose processes cost a run time and give it nothing."""
    from ray.train.v2._internal.callbacks.datasets import DatasetsCallback
    from ray.train.v2._internal.callbacks.placement_group_callback import PlacementGroupCleanerCallback

    if isinstance(callback, PlacementGroupCleanerCallback):
        return False
    return bool(datasets) or not isinstance(callback, DatasetsCallback)


class FastStart:
    """Mixed in before a Ray Train V2 trainer class. It overrides the one private method through
    which the trainer starts its controller. A Ray without that method just starts the usual way."""

    def _initialize_and_run_controller(self, **kwargs: Any) -> Any:
        import ray
        from ray.train.v2._internal.constants import get_env_vars_to_propagate
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        kwargs["callbacks"] = [cb for cb in kwargs["callbacks"] if needed(cb, self.datasets)]
        kwargs["scaling_policy"] = staying_nodes_only(kwargs["scaling_policy"])
        if get_env_vars_to_propagate():  # the user's RAY_TRAIN_* settings travel in the runtime_env
            return super()._initialize_and_run_controller(**kwargs)  # type: ignore[misc]
        driver_node = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)  # as Ray's
        controller = ray.remote(num_cpus=0, scheduling_strategy=driver_node)(TrainController).remote(**kwargs)
        if threading.current_thread() is threading.main_thread():  # Ray's Ctrl-C handling, as Ray does
            self._register_sigint_handler(controller)  # type: ignore[attr-defined]
        ray.get(controller.run.remote())
        return ray.get(controller.get_result.remote())


def fast(trainer_class: type) -> type:
    """`trainer_class` (TorchTrainer or DataParallelTrainer) with the fast start."""
    return type(trainer_class.__name__, (FastStart, trainer_class), {"__module__": __name__})
