"""Does the latest checkpoint of <storage-path>/<name> fit this request? Asked on the driver, in
seconds, before any worker starts.

Rank 0 writes RESUME_INFO into every checkpoint (checkpointer.py): the resolved config that saved
it, where it stands, and the model's state-dict shapes. A change that alters what the saved position
means is refused in one line; a safe one is applied, one line per key; the rest (how the run runs,
not what it trains) goes through silently. No Ray and no torch here: the preflight hands in the model's
shapes (driver/plan/model_shapes.py).
"""

from __future__ import annotations

import os
from dataclasses import fields
from pathlib import Path
from typing import Any

from raytrain_ddp.checkpoint.files import FRESH, RESUME_INFO
from raytrain_ddp.config import ConfigError, TrainConfig

# Why refused: each decides which samples the saved position counts (dataset, its files, caps and
# split, the seed of its order, the image size), or what the saved state is the state of (model,
# classes, optimizer and its parameter groups, the schedule's shape). Resuming across a change would
# train some samples twice and skip others, or load state into something it does not describe.
REFUSED = (
    "dataset", "data_dir", "seed", "train_samples", "val_samples", "val_fraction", "image_size", "num_classes",
    "model", "optimizer", "decay_norm_bias", "loader", "scheduler", "warmup_epochs",
)
# The batch: samples per optimizer step set how far the schedule and the optimizer moved per sample.
# Only --global-batch-size holds it fixed at any --batch-size (the accumulation follows); without it
# a change to --batch-size or --grad-accum is refused (see batch_change).
BATCH = ("batch_size", "grad_accum", "global_batch_size")
# Why applied, and said: safe to change at any checkpoint, but they change what the rest of the run
# does, so the user sees each one taken. The worker re-applies them after loading the saved state.
APPLIED = (
    "epochs", "lr", "weight_decay", "momentum", "clip_grad_norm", "label_smoothing", "max_failures", "workers",
    "max_workers", "strategy", "sharding",
)
# Why silent: where and how the run runs, shows or saves itself; none changes what it trains.
SILENT = (
    "resize_check_s", "gpu", "cpus_per_worker", "placement", "address", "backend", "wait_for_resources",
    "data_workers", "download", "skip_bad", "amp", "find_unused_parameters", "compile", "checkpoint_every_steps",
    "keep_checkpoints", "resume", "storage_path", "name", "progress", "verbose", "tensorboard", "mlflow",
    "mlflow_experiment", "wandb", "profile", "stall_timeout", "stop_grace_s", "health",
)


def flag(key: str) -> str:
    return "--" + key.replace("_", "-")


def shown(value: Any) -> str:
    return "unset" if value is None else str(value)


def workers(config: dict[str, Any]) -> str:
    """--workers as typed: N, or MIN:MAX for an elastic run."""
    low, high = config.get("workers"), config.get("max_workers")
    return str(low) if high is None else f"{low}:{high}"


def same(key: str, old: Any, new: Any) -> bool:
    if key == "data_dir" and old is not None and new is not None:
        # the same directory written another way (relative here, absolute there)
        return old == new or os.path.abspath(os.path.expanduser(old)) == os.path.abspath(os.path.expanduser(new))
    return old == new


def batch_change(old: dict[str, Any], new: TrainConfig) -> tuple[list[str], list[str]]:
    """(refused, applied) changes to the batch."""
    changed = [k for k in BATCH if k in old and not same(k, old[k], getattr(new, k))]
    if not changed:
        return [], []
    described = [f"{flag(k)} {shown(old[k])} -> {shown(getattr(new, k))}" for k in changed]
    if new.global_batch_size is None or "global_batch_size" in changed:
        return described, []
    return [], [f"resume: {d} applied: the global batch stays {new.global_batch_size}, the accumulation follows"
                for d in described]


def compare(saved: dict[str, Any], new: TrainConfig, run: str) -> list[str]:
    """The lines to print for the changes from the checkpoint's config to `new`; a refused change
    raises ConfigError, one line naming every refused key and how to start fresh."""
    old = saved["config"]
    refused = [
        f"{flag(k)} {shown(old[k])} -> {shown(getattr(new, k))}"
        for k in REFUSED if k in old and not same(k, old[k], getattr(new, k))
    ]
    batch_refused, lines = batch_change(old, new)
    refused += batch_refused
    if refused:
        many = len(refused) > 1
        raise ConfigError(
            f"cannot resume run {run!r} with {', '.join(refused)}: its checkpoint's position and state mean "
            f"something else under the new setting{'s' if many else ''}; go back to the old value{'s' if many else ''}, "
            f"or pass {FRESH}"
        )
    epoch, position = saved["epoch"], saved["position"]
    least = epoch if position else epoch - 1  # epochs trained, the one under way counting whole
    if new.epochs < least:
        where = f"epoch {epoch} after {position} samples" if position else f"the end of epoch {epoch - 1}"
        raise ConfigError(
            f"--epochs {new.epochs} ends before where run {run!r} stands ({where}); pass --epochs {least} "
            f"or more, or {FRESH}"
        )
    for key in APPLIED:
        if key not in old or same(key, old[key], getattr(new, key)):
            continue
        if key == "epochs":
            lines.append(
                f"resume: --epochs {old[key]} -> {new.epochs}: the LR schedule stretches from epoch {epoch} "
                f"over the remaining epochs"
            )
        elif key in ("workers", "max_workers"):
            line = f"resume: --workers {workers(old)} -> {workers(new.to_dict())} applied"
            if line not in lines:
                lines.append(line)
        else:
            lines.append(f"resume: {flag(key)} {shown(old[key])} -> {shown(getattr(new, key))} applied")
    return lines


def check_shapes(here: dict[str, list[int]], shapes: dict[str, list[int]], cfg: TrainConfig, run: str) -> None:
    """Raise one line naming a state-dict key where the model's shapes (`here`) and the checkpoint's differ."""
    differ = [
        f"{key} is {shapes[key]} there, {here[key]} here" for key in here if key in shapes and shapes[key] != here[key]
    ]
    differ += [f"{key} is only there" for key in shapes if key not in here]
    differ += [f"{key} is only here" for key in here if key not in shapes]
    if differ:
        more = f" (and {len(differ) - 1} more)" if len(differ) > 1 else ""
        raise ConfigError(
            f"the checkpoint of run {run!r} does not fit --model {cfg.model} --num-classes {cfg.num_classes}: "
            f"{differ[0]}{more}; pass {FRESH}"
        )


def check_resume(
    cfg: TrainConfig, checkpoint_dir: Path | None, saved: dict[str, Any] | None, shapes: dict[str, list[int]] | None,
) -> list[str]:
    """A (re)start's fit with its checkpoint (files.resume_choice): the lines to print, or ConfigError.
    The config is compared, and the model's state-dict shapes with the checkpoint's in_channels
    (driver/plan/model_shapes.py) checked against the checkpoint's."""
    if saved is not None:
        lines = compare(saved, cfg, cfg.name)
        check_shapes(shapes, saved["model_shapes"], cfg, cfg.name)
        return lines
    if checkpoint_dir is not None:
        return [f"resume: {checkpoint_dir.name} predates {RESUME_INFO}; resuming without compatibility checks"]
    return []


def unclassified() -> set[str]:
    """TrainConfig fields that none of REFUSED, BATCH, APPLIED and SILENT names: a new field must
    be placed in one."""
    return {f.name for f in fields(TrainConfig)} - set(REFUSED + BATCH + APPLIED + SILENT)
