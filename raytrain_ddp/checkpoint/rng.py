"""Each rank's random streams, saved into its own rank_file and restored from it, so a resumed run
draws what the uninterrupted one would have (dropout, and anything else a model or user code draws)."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def rng_states() -> dict[str, Any]:
    """This process's random streams. Data augmentation does not draw from them: each sample seeds
    its own (data.torch_ingest)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    states = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        # as plain values, which weights_only loading accepts (an ndarray it would refuse)
        "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss],
    }
    if torch.cuda.is_available():
        # This rank's own GPU only (the current device, which the trainer sets per rank): every GPU
        # the node shows would not fit a rerun that shows fewer (fewer workers, an elastic shrink).
        states["cuda"] = torch.cuda.get_rng_state(torch.cuda.current_device())
    return states


def cuda_state_to_restore(saved: Any, device_count: int, current: int) -> torch.Tensor | None:
    """The saved CUDA RNG state to put into this rank's current device `current`, of `device_count`
    visible, or None to leave the device's fresh seed. `saved` is the saving rank's own device's
    state, or (checkpoints before it) a list of every device's the node showed the rank, of which
    this rank's is the current device's entry, if there is one."""
    if saved is None or device_count == 0 or not 0 <= current < device_count:
        return None
    if isinstance(saved, (list, tuple)):
        return saved[current] if current < len(saved) else None
    return saved


def set_rng_states(states: dict[str, Any]) -> None:
    torch.set_rng_state(states["torch"])
    random.setstate(states["python"])
    if "numpy" in states:
        kind, keys, pos, has_gauss, gauss = states["numpy"]
        np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    if torch.cuda.is_available():
        current = torch.cuda.current_device()
        cuda = cuda_state_to_restore(states.get("cuda"), torch.cuda.device_count(), current)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda, current)
