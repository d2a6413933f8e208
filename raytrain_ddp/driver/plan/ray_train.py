"""Ray Train's configs for a plan: the scaling, the run's name and storage, its failures and log
level, the backend, and the workers' environment."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from raytrain_ddp.config import TrainConfig
from raytrain_ddp.ray_compat import has
from raytrain_ddp.storage.location import RunPath, ray_storage, storage_root


@dataclass(frozen=True)
class RayTrainConfigs:
    """What a planned run hands to Ray Train's trainer, made once, from the plan."""

    scaling: Any
    """ray.train.ScalingConfig: the workers, their resources and placement; MIN:MAX when elastic."""
    run: Any
    """ray.train.RunConfig: the run's name and storage, its checkpoints kept, failures, workers' env, log level."""
    backend: Any
    """worker/process_group.py's ProcessGroupConfig: TorchConfig's work (gloo or NCCL), without its
    module's torch import on the driver."""


def trainer_configs(cfg: TrainConfig, restarts: int, storage: RunPath | None = None) -> RayTrainConfigs:
    """Ray Train's configs for a config laid out on its cluster (--cpus-per-worker and --placement
    set), the worker-group failures it restarts from, and where its runs are kept (`storage`:
    --storage-path's, location.storage_root)."""
    from ray.train import (
        CheckpointConfig,
        FailureConfig,
        RunConfig,
        ScalingConfig,
    )
    from raytrain_ddp.worker.process_group import ProcessGroupConfig

    resources = {"CPU": cfg.cpus_per_worker}
    if cfg.gpu:
        resources["GPU"] = 1
    elastic = {"elastic_resize_monitor_interval_s": cfg.resize_check_s} if cfg.elastic else {}
    scaling = ScalingConfig(
        num_workers=(cfg.workers, cfg.max_workers) if cfg.elastic else cfg.workers,
        use_gpu=cfg.gpu,
        resources_per_worker=resources,
        placement_strategy=cfg.placement.upper(),
        **elastic,
    )
    run = RunConfig(
        name=cfg.name,
        **ray_storage(storage if storage is not None else storage_root(cfg.storage_path)),
        checkpoint_config=CheckpointConfig(num_to_keep=cfg.keep_checkpoints),
        failure_config=FailureConfig(max_failures=restarts),
        worker_runtime_env=worker_env(),
        **train_log_level("INFO" if cfg.verbose else "WARNING"),
    )
    return RayTrainConfigs(scaling, run, ProcessGroupConfig(backend=cfg.resolved_backend))


def restarts(cfg: TrainConfig) -> int:
    """The worker-group failures Ray Train restarts from (FailureConfig's max_failures)."""
    # A lost worker is a failure to Ray Train: an elastic run must be allowed some, or it could not shrink.
    # Node drains (preemption) have their own budget, without limit, and never use these up.
    return cfg.max_failures or (ELASTIC_RETRIES if cfg.elastic else 0)


def train_log_level(level: str) -> dict[str, Any]:
    """RunConfig's logging_config at `level`, where Ray Train has one (2.58 and later)."""
    if not has("ray.train:LoggingConfig"):
        return {}
    from ray.train import LoggingConfig

    return {"logging_config": LoggingConfig(log_level=level)}


ELASTIC_RETRIES = 3
"""Lost workers an elastic run recovers from when --max-failures is left at 0."""


PASSED_TO_WORKERS = ("NCCL_", "GLOO_", "TORCH_NCCL_", "TORCH_DISTRIBUTED_")
"""Env-var prefixes the driver hands to every worker: Ray workers inherit the raylet's environment,
not the driver's, so `NCCL_SOCKET_IFNAME=ib0 raytrain run` would otherwise do nothing."""


def worker_env() -> dict[str, Any] | None:
    """The workers' runtime_env: the driver's NCCL/gloo variables, None when there are none (then a
    worker may start in one of Ray's idle processes; ray_compat/controller.py keeps the controller's runtime_env
    off them too). Ray sets OMP_NUM_THREADS to each worker's CPUs by itself."""
    env = {k: v for k, v in os.environ.items() if k.startswith(PASSED_TO_WORKERS)}
    return {"env_vars": env} if env else None
