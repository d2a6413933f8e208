"""What a checkpoint holds, when one is saved, and how a run goes on from one.

A checkpoint is the loop's TrainState (worker/state.py), the model and optimizer (whole under DDP,
this rank's shards under FSDP: state_dicts.py), the loss scaler, each rank's RNG streams (rng.py),
and RESUME_INFO for the driver (compat.py reads it); io.py takes the directory through Ray Train.
The loop calls save at the end of every optimizer step, and save decides whether one is due there.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from raytrain_ddp.checkpoint import io, state_dicts
from raytrain_ddp.checkpoint.rng import set_rng_states
from raytrain_ddp.config import ConfigError, TrainConfig
from raytrain_ddp.storage.location import is_uri


class TrainingState(Protocol):
    """What a checkpoint needs of the loop's state (worker/state.py's TrainState), as torchtitan's
    Stateful: so checkpointing sits below the worker loop that uses it, and never imports it."""

    epoch: int
    position: int
    train_size: int
    world_size: int
    schedule: Any

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, saved: dict[str, Any], rank: int) -> None: ...


@dataclass
class Checkpointer:
    """One rank's side of saving and restoring the training."""

    cfg: TrainConfig
    rank: int
    in_channels: int
    """The model's input channels, for RESUME_INFO: the driver builds the model with them to check a rerun."""
    model: nn.Module
    """As the strategy wrapped it (DDP or FSDP)."""
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    resume_from: Any = None
    """The driver's choice of checkpoint (the newest whole one), loaded while Ray has registered none in this
    run: a local path, or a ray.train.Checkpoint on an object store (io.resumed_checkpoint)."""

    def save(
        self, state: TrainingState, step: int | None = None, force: bool = False, metrics: dict[str, Any] | None = None,
    ) -> bool:
        """Save `state` with the model's, if a checkpoint is due where the pass's optimizer step `step`
        (counted from 1) ends: every --checkpoint-every-steps steps, or when `force`d (a stop, a node
        drain, an epoch's end). Every rank calls it at the same step. Ray records `metrics` with it:
        the epoch's row at its end, else where the run stands. Returns whether it saved."""
        if not self.due(step, force):
            return False
        training = state.state_dict()  # on every rank: its running sums are all-reduced
        # DDP: rank 0 saves the whole model and optimizer state; FSDP: every rank its own shards
        whole = state_dicts.full_state(self.model, self.optimizer)
        shards = None if whole else state_dicts.sharded_state(self.model, self.optimizer)
        shared, info = {}, None
        if self.rank == 0:
            shared = {**dict(zip(("model", "optimizer"), whole or ())), "scaler": self.scaler.state_dict(), **training}
            info = self.resume_info(state, whole[0] if whole else shards["model"])
        metrics = metrics if metrics is not None else {"epoch": state.epoch, "position": state.position}
        io.save(metrics, self.rank, shared, info, shards, behind=is_uri(self.cfg.storage_path))
        return True

    def due(self, step: int | None = None, force: bool = False) -> bool:
        """Whether save(state, step, force) would save."""
        every = self.cfg.checkpoint_every_steps
        return force or (every > 0 and step is not None and step % every == 0)

    def resume_info(self, state: TrainingState, model_state: dict[str, Any]) -> dict[str, Any]:
        """RESUME_INFO: what the driver checks a rerun against, in milliseconds and without torch."""
        return {
            "config": self.cfg.to_dict(), "epoch": state.epoch, "position": state.position,
            "train_size": state.train_size, "world_size": state.world_size, "in_channels": self.in_channels,
            "strategy": self.cfg.strategy, "model_shapes": state_dicts.shapes(model_state),
            "schedule": state.schedule._asdict(),
        }

    def restore(self, state: TrainingState) -> bool:
        """Load the latest checkpoint, if any, into the model, optimizer, scaler, RNG streams and
        `state`; False when there is none. The hyperparameters a rerun may change (--lr, --momentum,
        --weight-decay, --epochs; the driver checked the rest) are this run's, not the checkpoint's.
        Any failure to load it is one ConfigError line that names it."""
        from torch.distributed.checkpoint.api import CheckpointException  # DCP's, a BaseException

        hyper = [{k: v for k, v in group.items() if k != "params"} for group in self.optimizer.param_groups]
        loading = []  # the stage reached: a RuntimeError once the model loads is a model that does not fit

        def load_shards(directory: Path) -> None:
            loading.append("model")
            state_dicts.load_sharded(self.model, self.optimizer, directory)

        try:
            # A sharded (FSDP) checkpoint loads from its shards, at any world size, into either strategy
            restored = io.load(self.rank, load_shards, self.resume_from)
            if restored is None:
                return False
            saved, own = restored
            if "model" in saved:  # a DDP checkpoint: the whole state, in STATE
                loading.append("model")
                state_dicts.load_full(self.model, self.optimizer, saved["model"], saved["optimizer"])
            loading.append("state")
            for group, ours in zip(self.optimizer.param_groups, hyper):  # moments and momentum buffers loaded ...
                group.update(ours)  # ... under this run's hyperparameters
            self.scaler.load_state_dict(saved["scaler"])
            state.load_state_dict(saved, self.rank)
            if own is not None:  # a rank that did not exist before (the world grew) starts from its fresh seed
                set_rng_states(own["rng"])
            return True
        except (Exception, CheckpointException) as err:  # one line on every retry, not a traceback each time
            checkpoint = io.resumed_checkpoint(self.resume_from)
            mismatch = isinstance(err, RuntimeError) and loading[-1:] == ["model"]
            path = checkpoint.path if checkpoint is not None else None
            raise ConfigError(restore_failure(self.cfg, path, err, mismatch)) from None


def restore_failure(cfg: TrainConfig, path: str | None, err: BaseException, mismatch: bool) -> str:
    """The one line for a checkpoint that does not load: which one (run and path), why, and the fix."""
    where = f"the checkpoint of run {cfg.name!r}" + (f" at {path}" if path else "")
    fix = "pass --no-resume or a new --name"
    if mismatch:
        return f"{where} does not fit --model {cfg.model} --num-classes {cfg.num_classes}; {fix}"
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    why = f"{type(err).__name__}: {lines[0].split('. ')[0][:200]}" if lines else type(err).__name__
    return f"{where} could not be restored ({why}); {fix}"
