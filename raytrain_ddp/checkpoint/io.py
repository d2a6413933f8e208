"""A checkpoint's directory through Ray Train: written and reported by every rank, and read back on
every rank. What goes into it, and when, is checkpointer.py's.

Every rank reports a directory and Ray merges them into one checkpoint: rank 0 writes the shared
state (model, optimizer, schedule, scaler, the global position in the epoch, the world's running
totals, metrics and resizes so far), which any world size can resume; each rank writes its RNG
states. Under FSDP no rank holds the whole model: every rank writes its shards of the model and
optimizer with torch.distributed.checkpoint (DCP) into SHARDS, and rank 0's STATE has the rest;
DCP reshards on load, for any world size and either strategy.

The shards are saved asynchronously: dcp.async_save copies this rank's shards to CPU memory and a
thread writes them while training goes on. The report is made at once (every rank reports at the
same step, as Ray needs), in Ray's ASYNC upload mode with an upload function that first waits for
the shards' files: Ray copies the directory to storage, and registers the checkpoint, only once
every file is complete, so a checkpoint that is still being written can never be resumed from. Ray
registers a checkpoint only after it is fully persisted, so a half-written one is never taken as the
latest; a rerun with the same --storage-path/--name resumes from it. Where Ray's run snapshot
cannot serve that rerun (its latest is damaged or gone, or another Ray release wrote it), the
driver sets it aside and hands the ranks its own choice, the newest whole checkpoint
(files.resume_choice), as `resume_from` (resumed_checkpoint).

Rank 0 also writes RESUME_INFO, a small JSON file the driver reads in milliseconds, without torch:
the resolved config that saved the checkpoint, where it stands, and the model's state-dict shapes,
so a rerun that changed what the saved position means is refused before any worker starts.
Everything loads with weights_only=True: a checkpoint holds tensors and plain values, never code.
"""

from __future__ import annotations

import functools
import json
import shutil
import tempfile
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Callable

import ray.train
import torch

from raytrain_ddp.checkpoint.files import RESUME_INFO, SHARDS, STATE, rank_file
from raytrain_ddp.checkpoint.rng import rng_states


def save(
    metrics: dict[str, Any], rank: int, shared: dict[str, Any], info: dict[str, Any] | None = None,
    shards: dict[str, Any] | None = None, behind: bool = False,
) -> None:
    """Report `metrics` with a checkpoint. Every rank must call this at the same point; rank 0 gives
    the shared state and the driver's RESUME_INFO; under FSDP every rank gives its `shards`.
    `behind`: the upload runs behind training (an object store's, which takes seconds per GiB where
    a local copy takes a fraction); the step waits only for the local files."""
    if shards is None and not behind:
        with tempfile.TemporaryDirectory(prefix="raytrain-ckpt-") as tmp:
            write_state(Path(tmp), rank, shared, info)
            ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(tmp))
        return
    if shards is None:
        tmp = Path(tempfile.mkdtemp(prefix="raytrain-ckpt-"))
        write_state(tmp, rank, shared, info)
        # Ray uploads it on its thread, one checkpoint after another, registers it once whole, then
        # deletes the local files; fit() waits for the last one.
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(tmp),
                         checkpoint_upload_mode=ray.train.CheckpointUploadMode.ASYNC,
                         delete_local_checkpoint_after_upload=True)
        return
    tmp = Path(tempfile.mkdtemp(prefix="raytrain-ckpt-"))
    try:
        written = write_shards(shards, tmp / SHARDS)
        write_state(tmp, rank, shared, info)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    ray.train.report(
        metrics, checkpoint=ray.train.Checkpoint.from_directory(tmp),
        checkpoint_upload_mode=ray.train.CheckpointUploadMode.ASYNC, delete_local_checkpoint_after_upload=True,
        checkpoint_upload_fn=functools.partial(upload_when_written, written),
    )


def write_state(directory: Path, rank: int, shared: dict[str, Any], info: dict[str, Any] | None) -> None:
    if rank == 0:
        torch.save(shared, directory / STATE)
        (directory / RESUME_INFO).write_text(json.dumps(info or {}, indent=1))
    torch.save({"rng": rng_states()}, directory / rank_file(rank))


_writing: list[Future] = []
"""This rank's shards still being written (at most one save at a time)."""
_group: list[Any] = []
"""A gloo group of our own for DCP's writer thread: its collectives (the save plan) then never
interleave with the training's on the default group, and NCCL runs need a CPU group for them."""


def write_shards(shards: dict[str, Any], directory: Path) -> Future:
    """Start writing this rank's shards; returns once they are copied to CPU memory."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    if _writing:  # the previous save's files first: two writers would share the group
        _writing.pop().result()
    if not _group:
        _group.append(dist.new_group(backend="gloo"))  # a collective: every rank saves at the same step
    written = dcp.async_save(shards, checkpoint_id=directory, process_group=_group[0])
    _writing.append(written)
    return written


def upload_when_written(written: Future, checkpoint: ray.train.Checkpoint, name: str) -> ray.train.Checkpoint:
    """Ray's upload, in Ray's upload thread, after the shards' files are complete."""
    written.result()  # raises if the write failed: Ray then fails the run rather than register it
    return ray.train.get_context().get_storage().persist_current_checkpoint(checkpoint, name)


def resumed_checkpoint(resume_from: str | ray.train.Checkpoint | None) -> ray.train.Checkpoint | None:
    """The checkpoint to resume from: the latest Ray registered in this run, else the driver's
    choice `resume_from` (the newest whole one, where Ray's run snapshot could not serve it: a local
    path, or a Checkpoint on an object store's filesystem)."""
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is None and resume_from is not None:
        return resume_from if isinstance(resume_from, ray.train.Checkpoint) else ray.train.Checkpoint(resume_from)
    return checkpoint


def load(
    rank: int, load_shards: Callable[[Path], None], resume_from: str | None = None,
) -> tuple[dict[str, Any], dict[str, Any] | None] | None:
    """(shared state, this rank's own part or None) from the checkpoint to resume from
    (resumed_checkpoint), if there is one; a sharded checkpoint's SHARDS directory goes to
    `load_shards` while it is at hand."""
    checkpoint = resumed_checkpoint(resume_from)
    if checkpoint is None:
        return None
    with checkpoint.as_directory() as directory:
        if (Path(directory) / SHARDS).is_dir():
            load_shards(Path(directory) / SHARDS)
        shared = torch.load(Path(directory) / STATE, map_location="cpu", weights_only=True)
        own_path = Path(directory) / rank_file(rank)
        # A rank that did not exist before (the world grew) starts from its fresh seed.
        own = torch.load(own_path, weights_only=True) if own_path.exists() else None
    return shared, own
