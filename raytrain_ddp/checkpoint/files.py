"""A run's checkpoint files by name, and the two reads the driver makes of them: which checkpoint is
the latest, and what its RESUME_INFO says. No torch and no Ray here, so the driver reads them in
milliseconds; everything else takes the names from this module.

A run directory holds Ray Train's SNAPSHOT and one directory per registered checkpoint, merged by
Ray from every rank's: STATE and RESUME_INFO from rank 0, rank_file(rank) from each rank and, under
FSDP, the DCP directory SHARDS with every rank's shards.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from raytrain_ddp.config import ConfigError

STATE = "state.pt"
"""Rank 0's training state: the schedule, scaler, position, running sums, rows and resizes, and under
DDP the whole model and optimizer."""
RESUME_INFO = "resume.json"
"""Rank 0's small JSON for the driver: the config that saved the checkpoint, where it stands, and the
model's state-dict shapes."""
SHARDS = "shards"
"""The DCP directory: .metadata from rank 0, __<rank>_0.distcp from each rank (distinct names, so
Ray's merge of the ranks' directories gives one complete DCP checkpoint)."""
SNAPSHOT = "checkpoint_manager_snapshot.json"
"""Ray Train V2's record, in the run directory, of the checkpoints it registered (fully written)."""

FRESH = "--no-resume to start fresh (the old run is moved aside) or a new --name"
"""The way out of a checkpoint that cannot be resumed, as every refusal names it."""


def rank_file(rank: int) -> str:
    """Each rank's own part of a checkpoint: its RNG states."""
    return f"rank-{rank}.pt"


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The directory of the latest checkpoint Ray registered, or None. Only a registered checkpoint
    counts: a directory of one still being written when the run died is not resumed from."""
    try:
        snapshot = json.loads((run_dir / SNAPSHOT).read_text())
    except (FileNotFoundError, NotADirectoryError):  # no run yet; a bad --storage-path is check_writable's to name
        return None
    except (OSError, ValueError) as err:
        raise ConfigError(f"cannot read {run_dir / SNAPSHOT} ({err}); pass {FRESH}") from None
    latest = snapshot.get("latest_checkpoint_result") or {}
    return run_dir / latest["checkpoint_dir_name"] if latest.get("checkpoint_dir_name") else None


def read_info(checkpoint_dir: Path) -> dict[str, Any] | None:
    """The checkpoint's RESUME_INFO, or None for one saved before checkpoints carried it."""
    try:
        return json.loads((checkpoint_dir / RESUME_INFO).read_text()) or None
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as err:
        raise ConfigError(f"cannot read {checkpoint_dir / RESUME_INFO} ({err}); pass {FRESH}") from None
