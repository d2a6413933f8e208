"""Checkpoints through Ray Train: save the whole training state, and restore it on every rank.

Every rank reports a directory and Ray merges them into one checkpoint: rank 0 writes the shared
state (model, optimizer, schedule, scaler, the global position in the epoch, the world's running
totals, metrics and resizes so far), which any world size can resume; each rank writes its RNG
states. Ray registers a checkpoint only after it is fully persisted, so a half-written one is never
taken as the latest; a rerun with the same --storage-path/--name resumes from it.

Rank 0 also writes RESUME_INFO, a small JSON file the driver reads in milliseconds, without torch:
the resolved config that saved the checkpoint, where it stands, and the model's state-dict shapes,
so a rerun that changed what the saved position means is refused before any worker starts.
Everything loads with weights_only=True: a checkpoint holds tensors and plain values, never code.
"""

from __future__ import annotations

import json
import random
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import ray.train
import torch

STATE = "state.pt"
RESUME_INFO = "resume.json"


def rank_file(rank: int) -> str:
    return f"rank-{rank}.pt"


def rng_states() -> dict[str, Any]:
    """This process's random streams (dropout and anything else a model or user code draws). Data
    augmentation does not draw from them: each sample seeds its own (data.torch_ingest)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    states = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        # as plain values, which weights_only loading accepts (an ndarray it would refuse)
        "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss],
    }
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def set_rng_states(states: dict[str, Any]) -> None:
    torch.set_rng_state(states["torch"])
    random.setstate(states["python"])
    if "numpy" in states:
        kind, keys, pos, has_gauss, gauss = states["numpy"]
        np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


def save(metrics: dict[str, Any], rank: int, shared: dict[str, Any], info: dict[str, Any] | None = None) -> None:
    """Report `metrics` with a checkpoint. Every rank must call this at the same point; rank 0 gives
    the shared state and the driver's RESUME_INFO."""
    with tempfile.TemporaryDirectory(prefix="raytrain-ckpt-") as tmp:
        if rank == 0:
            torch.save(shared, Path(tmp) / STATE)
            (Path(tmp) / RESUME_INFO).write_text(json.dumps(info or {}, indent=1))
        torch.save({"rng": rng_states()}, Path(tmp) / rank_file(rank))
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(tmp))


def model_state(model: torch.nn.Module) -> dict[str, Any]:
    """The state dict without DDP's `module.` prefix, so it loads with any world size."""
    return getattr(model, "module", model).state_dict()


def shapes(state: dict[str, Any]) -> dict[str, list[int]]:
    """A state dict's tensor shapes, for RESUME_INFO: the driver checks a rerun's model against them."""
    return {key: list(value.shape) for key, value in state.items() if isinstance(value, torch.Tensor)}


def load(rank: int) -> tuple[dict[str, Any], dict[str, Any] | None] | None:
    """(shared state, this rank's own part or None) from the latest checkpoint, if there is one."""
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is None:
        return None
    with checkpoint.as_directory() as directory:
        shared = torch.load(Path(directory) / STATE, map_location="cpu", weights_only=True)
        own_path = Path(directory) / rank_file(rank)
        # A rank that did not exist before (the world grew) starts from its fresh seed.
        own = torch.load(own_path, weights_only=True) if own_path.exists() else None
    return shared, own
