"""Checkpoints through Ray Train: save the whole training state, and restore it on every rank.

Every rank reports a directory and Ray merges them into one checkpoint: rank 0 writes the shared
state (model, optimizer, schedule, scaler, the global position in the epoch, the world's running
totals, metrics and resizes so far), which any world size can resume; each rank writes its RNG
states. Ray registers a checkpoint only after it is fully persisted, so a half-written one is never
taken as the latest; a rerun with the same --storage-path/--name resumes from it.
"""

from __future__ import annotations

import random
import tempfile
from pathlib import Path
from typing import Any

import ray.train
import torch

STATE = "state.pt"


def rank_file(rank: int) -> str:
    return f"rank-{rank}.pt"


def rng_states() -> dict[str, Any]:
    states = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def set_rng_states(states: dict[str, Any]) -> None:
    torch.set_rng_state(states["torch"])
    random.setstate(states["python"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


def save(metrics: dict[str, Any], rank: int, shared: dict[str, Any]) -> None:
    """Report `metrics` with a checkpoint. Every rank must call this at the same point."""
    with tempfile.TemporaryDirectory(prefix="raytrain-ckpt-") as tmp:
        if rank == 0:
            torch.save(shared, Path(tmp) / STATE)
        torch.save({"rng": rng_states()}, Path(tmp) / rank_file(rank))
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(tmp))


def model_state(model: torch.nn.Module) -> dict[str, Any]:
    """The state dict without DDP's `module.` prefix, so it loads with any world size."""
    return getattr(model, "module", model).state_dict()


def load(rank: int) -> tuple[dict[str, Any], dict[str, Any] | None] | None:
    """(shared state, this rank's own part or None) from the latest checkpoint, if there is one."""
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is None:
        return None
    with checkpoint.as_directory() as directory:
        shared = torch.load(Path(directory) / STATE, map_location="cpu", weights_only=False)
        own_path = Path(directory) / rank_file(rank)
        # A rank that did not exist before (the world grew) starts from its fresh seed.
        own = torch.load(own_path, weights_only=False) if own_path.exists() else None
    return shared, own
