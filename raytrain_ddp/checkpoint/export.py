"""`raytrain export RUN_DIR --to model.pt`: the latest registered checkpoint's model as one plain
state dict, for inference: `model.load_state_dict(torch.load("model.pt", weights_only=True))`.

A DDP checkpoint has it whole in STATE; an FSDP one in SHARDS, which are read here, in one
process without a process group, and put together (the optimizer's shards are left unread).
"""

from __future__ import annotations

import tempfile
import warnings
from pathlib import Path

import torch

from raytrain_ddp.checkpoint.files import SHARDS, STATE, latest_checkpoint
from raytrain_ddp.config import ConfigError
from raytrain_ddp.storage.location import RunPath
from raytrain_ddp.storage.object_path import ObjectPath

MODEL = "model."  # the model's keys in the shards, under "model" as state_dicts.sharded_state nests them


def model_state(checkpoint_dir: Path) -> dict[str, torch.Tensor]:
    """The model's whole state dict from one checkpoint directory, DDP's or FSDP's."""
    if (checkpoint_dir / SHARDS).is_dir():
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemReader

        reader = FileSystemReader(str(checkpoint_dir / SHARDS))
        tensors = {key[len(MODEL):]: meta for key, meta in reader.read_metadata().state_dict_metadata.items()
                   if key.startswith(MODEL)}
        # whole tensors to read into: DCP copies each saved shard into its place in them
        state = {key: torch.empty(meta.size, dtype=meta.properties.dtype) for key, meta in tensors.items()}
        with warnings.catch_warnings():  # DCP warns that it reads in one process: that is the point here
            warnings.simplefilter("ignore", UserWarning)
            dcp.load({"model": state}, storage_reader=reader, no_dist=True)
        return state
    return torch.load(checkpoint_dir / STATE, map_location="cpu", weights_only=True)["model"]


def export(run_dir: RunPath, to: Path) -> str:
    """Write the latest checkpoint's model to `to`; returns the line to print. One in an object store
    is downloaded to a temporary directory first, and read there."""
    checkpoint_dir = latest_checkpoint(run_dir)
    if checkpoint_dir is None:
        raise ConfigError(f"{run_dir} has no registered checkpoint; pass a run directory of a run that saved one")
    if isinstance(checkpoint_dir, ObjectPath):
        from pyarrow.fs import LocalFileSystem, copy_files

        with tempfile.TemporaryDirectory(prefix="raytrain-export-") as local:
            copy_files(checkpoint_dir.key, local, source_filesystem=checkpoint_dir.fs,
                       destination_filesystem=LocalFileSystem(), use_threads=False)  # as Ray copies
            state = model_state(Path(local))
    else:
        state = model_state(checkpoint_dir)
    to.parent.mkdir(parents=True, exist_ok=True)
    torch.save(state, to)
    params = sum(value.numel() for value in state.values() if value.is_floating_point())
    return f"exported {checkpoint_dir.name} of {run_dir} to {to}: {len(state)} tensors, {params:,} values"
