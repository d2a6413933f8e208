"""A run's checkpoint files by name, and the reads the driver makes of them: which checkpoint is the
newest whole one, and what its RESUME_INFO says. No torch and no Ray here, so the driver reads them
in milliseconds; everything else takes the names from this module.

A run directory holds Ray Train's SNAPSHOT and one directory per registered checkpoint, merged by
Ray from every rank's: STATE and RESUME_INFO from rank 0, rank_file(rank) from each rank and, under
FSDP, the DCP directory SHARDS with every rank's shards.

Whole: a checkpoint is resumed from only if every file it should hold is there and reads whole,
checked cheaply (a zip archive's central directory, never its tensors). Ray registers a checkpoint
in SNAPSHOT only once every rank's files are copied, but the ranks copy independently, so no one
file can mark a merged directory complete; the check of every expected file is what keeps a copy
that never finished, or a file damaged since, from being taken.
"""

from __future__ import annotations

import json
import time
import zipfile
from dataclasses import dataclass
from importlib import metadata
from typing import Any

from raytrain_ddp.config import ConfigError
from raytrain_ddp.storage.location import RunPath

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


@dataclass(frozen=True)
class ResumeChoice:
    """Which checkpoint a rerun resumes from, and what stood in the way of a newer one."""

    checkpoint: RunPath | None
    """The newest whole checkpoint; None when the run has none yet (a fresh start)."""
    skipped: tuple[tuple[str, str], ...] = ()
    """(name, why not whole) of each newer checkpoint, newest first."""
    snapshot_problem: str | None = None
    """Why Ray's SNAPSHOT cannot serve this resume, so it is moved aside; None when it can, or there is none."""

    def line(self, moved_to: str | None) -> str | None:
        """The one line to print: what was skipped and why, and where Ray's snapshot went (`moved_to`,
        None under --dry-run); None when the resume is the one Ray would have made."""
        if not (self.skipped or self.snapshot_problem):
            return None
        moved = f"moved to {moved_to}" if moved_to else "to be moved aside"
        if self.checkpoint is None:
            return (f"resume: Ray's run snapshot {self.snapshot_problem}, and names no checkpoint: {moved}; "
                    "starting fresh")
        if not self.skipped:
            return f"resume: Ray's run snapshot {self.snapshot_problem}: {moved}; resuming from {self.checkpoint.name}"
        skipped = ", ".join(f"{name}: {why}" for name, why in self.skipped)
        also = f" (Ray's run snapshot {moved})" if self.snapshot_problem else ""
        return f"resume: skipped {skipped}; resuming from {self.checkpoint.name}{also}"


def latest_checkpoint(run_dir: RunPath) -> RunPath | None:
    """The newest whole checkpoint of the run, as a resume takes it (resume_choice), or None: what
    `raytrain export` exports and a stop's line names."""
    return resume_choice(run_dir).checkpoint


def resume_choice(run_dir: RunPath, ray_writes: str | None = None) -> ResumeChoice:
    """The newest whole checkpoint: of those Ray's snapshot registered, its latest first, or where
    the snapshot is gone or unreadable, of the checkpoint directories themselves, newest first.
    ConfigError, naming each and why, when there are checkpoints and none is whole. `ray_writes`:
    the `ray_version` the installed Ray writes into its snapshot (ray_compat.snapshot; None for a
    Ray that writes none, as 2.52): it decides only whether the snapshot is set aside, never which
    checkpoint is chosen."""
    names, problem = snapshot_names(run_dir, ray_writes)
    from_snapshot = names is not None
    if names is None:  # nothing registered to go by: every directory, where only a whole one counts
        names = sorted((p.name for p in run_dir.glob("checkpoint_*") if p.is_dir()), reverse=True)
    skipped = []
    for name in names:
        why = checkpoint_problem(run_dir / name, registered=from_snapshot)
        if why is None:
            if skipped and from_snapshot and problem is None:
                problem = "names a newer checkpoint that is not whole"  # Ray would hand that one to the ranks
            return ResumeChoice(run_dir / name, tuple(skipped), problem)
        skipped.append((name, why))
    if skipped:
        each = ", ".join(f"{name} ({why})" for name, why in skipped)
        raise ConfigError(f"no checkpoint of run {run_dir.name!r} is whole: {each}; pass {FRESH}")
    return ResumeChoice(None, (), problem)


def snapshot_names(run_dir: RunPath, ray_writes: str | None) -> tuple[list[str] | None, str | None]:
    """(the checkpoints Ray's snapshot registered, newest first; why Ray could not load it as it is).
    Names None: no snapshot, or one that cannot be read."""
    try:
        snapshot = json.loads((run_dir / SNAPSHOT).read_text())
        latest = snapshot.get("latest_checkpoint_result") or {}
        names = {r["checkpoint_dir_name"] for r in snapshot.get("checkpoint_results") or []}
    except (FileNotFoundError, NotADirectoryError):  # no run yet; a bad --storage-path is check_writable's to name
        return None, None
    except (OSError, ValueError, AttributeError, KeyError, TypeError) as err:
        return None, f"cannot be read: {str(err)[:120]}"
    names |= {latest["checkpoint_dir_name"]} if latest.get("checkpoint_dir_name") else set()
    saved_by = snapshot.get("ray_version")
    problem = None
    if saved_by != ray_writes:  # another release's: Ray refuses one it cannot parse, and only Ray knows which
        by = f"Ray {saved_by}" if saved_by else "another Ray release (it names none)"
        problem = f"was written by {by}, this is Ray {metadata.version('ray')}"
    elif gone := sorted(name for name in names if not (run_dir / name).is_dir()):
        problem = f"names {', '.join(gone)}, which {'is' if len(gone) == 1 else 'are'} gone"  # Ray refuses it too
    # Ray's latest first (the one it would resume), then the rest by the time in their names
    newest = sorted(names - {latest.get("checkpoint_dir_name")}, reverse=True)
    return [latest["checkpoint_dir_name"], *newest] if latest.get("checkpoint_dir_name") else newest, problem


def checkpoint_problem(checkpoint_dir: RunPath, registered: bool = True) -> str | None:
    """Why the checkpoint is not whole, in a few words; None when every file it should hold is
    there and reads whole. A checkpoint without RESUME_INFO predates it, if Ray `registered` it;
    if not, it is a copy that never finished."""
    if not checkpoint_dir.is_dir():
        return "its directory is gone"
    try:
        info: dict[str, Any] | None = json.loads((checkpoint_dir / RESUME_INFO).read_text()) or None
    except FileNotFoundError:
        if not registered:
            return f"{RESUME_INFO} is missing"
        info = None
    except (OSError, ValueError) as err:
        return f"{RESUME_INFO} is not whole JSON: {str(err)[:80]}"
    sharded = (checkpoint_dir / SHARDS).is_dir() or (info or {}).get("strategy") == "fsdp"
    if info is None:  # no world size to go by: the rank files there must read whole
        files = sorted(p.name for p in checkpoint_dir.glob("rank-*.pt"))
        files = files if sharded and not (checkpoint_dir / STATE).exists() else [STATE, *files]
    else:
        files = [STATE, *(rank_file(rank) for rank in range(info.get("world_size", 1)))]
    for name in files:
        if why := zip_problem(checkpoint_dir / name):
            return why
    if sharded and not (checkpoint_dir / SHARDS / ".metadata").is_file():
        return f"{SHARDS}/.metadata is missing"
    return None


def zip_problem(path: RunPath) -> str | None:
    """Why `path` is not a whole torch.save archive, from its end alone (the zip's central
    directory), never reading its tensors; None when it is."""
    try:
        size = path.stat().st_size
        with path.open("rb") as f, zipfile.ZipFile(f) as archive:  # on an object store: ranged reads
            members = archive.infolist()
    except FileNotFoundError:
        return f"{path.name} is missing"
    except (OSError, zipfile.BadZipFile, ValueError):
        return f"{path.name} is truncated or damaged: not a whole zip archive"
    if not any(m.filename.endswith("/data.pkl") for m in members):
        return f"{path.name} is not a torch.save archive"
    # a member that ends past the file: a central directory copied, its data not
    if any(m.header_offset + m.compress_size > size for m in members):
        return f"{path.name} is truncated: its members end past the file"
    return None


def set_aside(run_dir: RunPath) -> RunPath:
    """Move Ray's SNAPSHOT aside, kept, so Ray starts a new one: our own choice of checkpoint then
    reaches the ranks (io.load). Returns its new path."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    aside = run_dir / f"{SNAPSHOT}.old-{stamp}"
    count = 1
    while aside.exists():  # a rename would replace an earlier one moved in the same second
        aside, count = run_dir / f"{SNAPSHOT}.old-{stamp}-{count}", count + 1
    (run_dir / SNAPSHOT).rename(aside)
    return aside


def read_info(checkpoint_dir: RunPath) -> dict[str, Any] | None:
    """The checkpoint's RESUME_INFO, or None for one saved before checkpoints carried it."""
    try:
        return json.loads((checkpoint_dir / RESUME_INFO).read_text()) or None
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as err:
        raise ConfigError(f"cannot read {checkpoint_dir / RESUME_INFO} ({err}); pass {FRESH}") from None
