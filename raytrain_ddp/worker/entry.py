"""What TorchTrainer runs on each worker for `raytrain run`: a light entry point into the loop.

The driver hands Ray a reference to this module, not to loop.py, so the driver itself never imports
torch's training stack (seconds on the critical path of every start).
"""

from __future__ import annotations

import sys
import time
from typing import Any

from raytrain_ddp.config import ConfigError


def train_entry(loop_config: dict[str, Any]) -> None:
    """What TorchTrainer ships to the workers: a reference to this light module, so the driver never
    imports the worker loop (torch and friends take seconds to import on the critical path)."""
    entered = time.time()  # Ray Train's start ends here; the loop's imports start (start-up stages)
    sys.path[:0] = [p for p in loop_config["code_paths"] if p not in sys.path]  # the user's modules
    from raytrain_ddp.worker.loop import train_loop

    try:
        train_loop(loop_config, entered)
    except RuntimeError as err:
        if "find_unused_parameters" not in str(err):
            raise
        # DDP's own message is a page long and names its Python argument, not our flag.
        name = loop_config["config"]["model"]
        raise ConfigError(
            f"--model {name} has parameters that got no gradient on a step (a layer its forward "
            "skipped), which DDP cannot all-reduce; pass --find-unused-parameters"
        ) from None
