"""raytrain_ddp: cluster-agnostic PyTorch DDP on Ray Train.

From a notebook or a script:

    from raytrain_ddp import TrainConfig, run
    summary = run(TrainConfig(workers=2, epochs=3), model="mymodels:build", dataset=my_dataset_fn)
"""

from __future__ import annotations

from typing import Any

from raytrain_ddp.config import ConfigError, TrainConfig

__version__ = "0.1.0"
__all__ = ["ConfigError", "TrainConfig", "run"]


def run(cfg: TrainConfig, model: Any = None, dataset: Any = None) -> dict[str, Any]:
    """Train as `raytrain run` does and return the run's summary (summary.json's contents).

    `model` and `dataset` replace cfg.model and cfg.dataset: a built-in name, an import path
    `PKG.MODULE:CALLABLE`, or the callable itself (see `raytrain run --help` for how each is called).
    Bad input raises ConfigError; a failed run raises Ray's error. Ctrl-C makes the ranks checkpoint at
    their next agreed step and stop, then raises KeyboardInterrupt (a second Ctrl-C stops at once);
    the same call resumes from the checkpoint.
    """
    from raytrain_ddp.driver.run import command as driver

    return driver.run(cfg, model=model, dataset=dataset)
