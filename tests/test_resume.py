"""Resume checks on the driver: the latest registered checkpoint, the config compared key by key, the
model against the checkpoint's shapes. (A real run rerun with a refused and an applied change is a
leg of test_strategy.py's crossing run.)"""

from __future__ import annotations

import dataclasses
import json
from importlib import metadata
from pathlib import Path

import pytest
import torch

from raytrain_ddp.checkpoint import compat as resume
from raytrain_ddp.checkpoint.files import RESUME_INFO, SNAPSHOT, STATE, latest_checkpoint, rank_file
from raytrain_ddp.config import ConfigError, TrainConfig
from raytrain_ddp.driver.plan.preflight import check_parts
from raytrain_ddp.worker.models import convnet

CFG = TrainConfig(name="r", epochs=3)


def saved(cfg: TrainConfig = CFG, epoch: int = 2, position: int = 128, in_channels: int = 3) -> dict:
    """A checkpoint's resume.json as rank 0 writes it (files.RESUME_INFO)."""
    model = convnet(cfg.num_classes, in_channels)
    return {
        "config": cfg.to_dict(), "epoch": epoch, "position": position, "train_size": 4096, "world_size": 2,
        "in_channels": in_channels, "model_shapes": {k: list(v.shape) for k, v in model.state_dict().items()},
        "schedule": {"anchor_samples": 0, "anchor_progress": 0.0, "total_samples": 3 * 4096},
    }


def write_checkpoint(checkpoint_dir: Path, info: dict | None, world_size: int = 2) -> Path:
    """A whole checkpoint directory as the ranks leave it: real torch.save archives, and RESUME_INFO if `info`."""
    checkpoint_dir.mkdir(parents=True)
    torch.save({"position": 0, "weight": torch.zeros(3)}, checkpoint_dir / STATE)
    for rank in range((info or {}).get("world_size", world_size)):
        torch.save({"rng": torch.zeros(4, dtype=torch.uint8)}, checkpoint_dir / rank_file(rank))
    if info is not None:
        (checkpoint_dir / RESUME_INFO).write_text(json.dumps(info))
    return checkpoint_dir


def write_run(run_dir: Path, registered: str | None, info: dict | None, unregistered: str | None = None,
              ray_version: str | None = None) -> None:
    """A run directory as Ray Train leaves it: checkpoint directories and its snapshot of those registered."""
    for name in filter(None, (registered, unregistered)):
        write_checkpoint(run_dir / name, info)
    latest = {"checkpoint_dir_name": registered, "metrics": {}, "version": 0} if registered else None
    run_dir.mkdir(parents=True, exist_ok=True)
    snapshot = {"ray_version": ray_version or metadata.version("ray"), "checkpoint_results": [latest] if latest else [],
                "latest_checkpoint_result": latest}
    (run_dir / SNAPSHOT).write_text(json.dumps(snapshot))


def test_every_config_key_is_classified():
    assert resume.unclassified() == set()


def test_only_a_registered_checkpoint_counts(tmp_path):
    assert latest_checkpoint(tmp_path) is None  # no snapshot: a fresh run
    # A newer directory that Ray never registered (written when the run died) is not resumed from.
    write_run(tmp_path, "checkpoint_2026-01-01_00-00-01.0", saved(), unregistered="checkpoint_2026-01-01_00-00-02.0")
    assert latest_checkpoint(tmp_path) == tmp_path / "checkpoint_2026-01-01_00-00-01.0"
    write_run(tmp_path / "none", None, None)
    assert latest_checkpoint(tmp_path / "none") is None


@pytest.mark.parametrize(
    "change, fragments",
    [
        ({"seed": 1}, ["--seed 0 -> 1"]),
        ({"train_samples": 512, "dataset": "mnist"}, ["--dataset synthetic -> mnist", "--train-samples unset -> 512"]),
        ({"optimizer": "adamw"}, ["--optimizer sgd -> adamw"]),
        ({"decay_norm_bias": True}, ["--decay-norm-bias False -> True"]),
        ({"batch_size": 32}, ["--batch-size 64 -> 32"]),  # no --global-batch-size: the batch is refused
        ({"grad_accum": 2}, ["--grad-accum 1 -> 2"]),
        ({"global_batch_size": 256}, ["--global-batch-size unset -> 256"]),
        ({"epochs": 1}, ["--epochs 1 ends before where run 'r' stands (epoch 2 after 128 samples)", "--epochs 2 or more"]),
    ],
)
def test_a_change_to_what_the_position_means_is_refused(change, fragments):
    with pytest.raises(ConfigError) as err:
        resume.compare(saved(), dataclasses.replace(CFG, **change), "r")
    line = str(err.value)
    assert "\n" not in line and "--no-resume" in line and "--name" in line
    for fragment in fragments:
        assert fragment in line


def test_a_safe_change_is_applied_and_said_per_key():
    new = dataclasses.replace(CFG, lr=0.1, epochs=5, momentum=0.8, max_failures=2, workers=1, max_workers=2,
                              progress="plain", data_workers=0, storage_path="/elsewhere", checkpoint_every_steps=5)
    assert resume.compare(saved(), new, "r") == [
        "resume: --epochs 3 -> 5: the LR schedule stretches from epoch 2 over the remaining epochs",
        "resume: --lr 0.05 -> 0.1 applied",
        "resume: --momentum 0.9 -> 0.8 applied",
        "resume: --max-failures 0 -> 2 applied",
        "resume: --workers 2 -> 1:2 applied",
    ]
    assert resume.compare(saved(), dataclasses.replace(CFG, progress="none", amp=False), "r") == []  # silent keys
    # A finished run (at the end of epoch 3) may be rerun as it was.
    assert resume.compare(saved(epoch=4, position=0), CFG, "r") == []


def test_the_batch_may_change_under_an_unchanged_global_batch():
    old = dataclasses.replace(CFG, global_batch_size=256)
    [line] = resume.compare(saved(old), dataclasses.replace(old, batch_size=32), "r")
    assert line.startswith("resume: --batch-size 64 -> 32 applied: the global batch stays 256")


def test_a_checkpoint_that_does_not_fit_the_model_is_one_line(tmp_path):
    write_run(tmp_path, "checkpoint_a", saved(in_channels=1))  # saved from a 1-channel model (MNIST)
    assert check_parts(CFG, tmp_path, {}, dry=True)[1] == []  # the model is built with the checkpoint's in_channels: it fits
    info = saved()
    info["model_shapes"]["5.weight"] = [10, 64]
    (tmp_path / "checkpoint_a" / RESUME_INFO).write_text(json.dumps(info))
    with pytest.raises(ConfigError, match=r"does not fit --model convnet .*5\.weight is \[10, 64\] there, "
                                          r"\[10, 128\] here; pass --no-resume"):
        check_parts(CFG, tmp_path, {}, dry=True)
    assert check_parts(dataclasses.replace(CFG, resume=False), tmp_path, {}, dry=True)[1] == []  # --no-resume checks nothing


def test_a_checkpoint_without_resume_info_resumes_unchecked(tmp_path):
    write_run(tmp_path, "checkpoint_old", None)
    [line] = check_parts(dataclasses.replace(CFG, seed=7), tmp_path, {}, dry=True)[1]
    assert "checkpoint_old predates resume.json" in line and "without compatibility checks" in line


def test_a_model_that_is_no_module_is_refused_on_a_fresh_run(tmp_path):
    with pytest.raises(ConfigError, match="--model __main__:<lambda> returned a value of type dict, not a torch.nn.Module"):
        check_parts(dataclasses.replace(CFG, model="__main__:<lambda>"), tmp_path, {"model": lambda **_: {}}, dry=True)


# End to end, a rerun refused for a changed --seed and one that applies a new --lr and --epochs:
# in test_strategy.py's crossing run, whose legs are such reruns (one run for both: CI time).
