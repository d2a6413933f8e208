"""What TorchTrainer runs on each worker for `raytrain run`: a light entry point into the loop.

The driver hands Ray a reference to this module, not to loop.py, so the driver itself never imports
torch's training stack (seconds on the critical path of every start).
"""

from __future__ import annotations

import sys
import time
from typing import Any


def train_entry(loop_config: dict[str, Any]) -> None:
    """What TorchTrainer ships to the workers: a reference to this light module, so the driver never
    imports the worker loop (torch and friends take seconds to import on the critical path)."""
    entered = time.time()  # Ray Train's start ends here; the loop's imports start (start-up stages)
    sys.path[:0] = [p for p in loop_config["code_paths"] if p not in sys.path]  # the user's modules
    from raytrain_ddp.worker.loop import train_loop

    train_loop(loop_config, entered)
