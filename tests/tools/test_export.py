"""`raytrain export`: the latest registered checkpoint's model, from DDP's state.pt or FSDP's shards,
as a state dict a plain nn.Module loads. Real 2-rank FSDP shards; the CLI as a user runs it."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from conftest import raytrain
from test_strategy import Net, config, run_ranks, save_sharded

from raytrain_ddp.checkpoint.files import SHARDS, SNAPSHOT, STATE


def registered(run_dir: Path, name: str) -> Path:
    """A checkpoint directory that Ray's snapshot names as the latest."""
    (run_dir / name).mkdir(parents=True)
    (run_dir / SNAPSHOT).write_text(json.dumps({"latest_checkpoint_result": {"checkpoint_dir_name": name}}))
    return run_dir / name


def test_export_puts_fsdp_shards_together_for_a_plain_module(tmp_path):
    saved = registered(tmp_path / "run", "checkpoint_2")
    registered(tmp_path / "other", "checkpoint_1")  # not the latest of this run: never read
    trained = run_ranks(save_sharded, config(optimizer="adamw", lr=0.01, strategy="fsdp"), str(saved / SHARDS))
    result = raytrain("export", str(tmp_path / "run"), "--to", str(tmp_path / "model.pt"))
    assert result.returncode == 0, result.stderr
    assert "exported checkpoint_2" in result.stdout
    model = Net()
    model.load_state_dict(torch.load(tmp_path / "model.pt", weights_only=True))  # strict: every key, every shape
    # the weights saved after the first step: the returned ones took a second, so they differ; check
    # against the shards loaded through the training path instead
    from raytrain_ddp.checkpoint.state_dicts import load_sharded
    from raytrain_ddp.worker.step import make_optimizer

    reference = Net()
    load_sharded(reference, make_optimizer(config(optimizer="adamw"), reference), saved / SHARDS)
    for key, value in reference.state_dict().items():
        assert torch.equal(model.state_dict()[key], value), key
    assert not torch.equal(model.state_dict()["head.weight"], Net().state_dict()["head.weight"])  # trained
    assert trained.keys() == model.state_dict().keys()


def test_export_takes_a_ddp_checkpoints_model_as_it_is(tmp_path):
    saved = registered(tmp_path / "run", "checkpoint_0")
    model = Net()
    torch.save({"model": model.state_dict(), "optimizer": {}}, saved / STATE)
    result = raytrain("export", str(tmp_path / "run"), "--to", str(tmp_path / "out" / "model.pt"))
    assert result.returncode == 0, result.stderr
    exported = torch.load(tmp_path / "out" / "model.pt", weights_only=True)
    assert all(torch.equal(exported[k], v) for k, v in model.state_dict().items())


def test_export_of_a_run_without_a_checkpoint_is_one_line(tmp_path):
    (tmp_path / "run").mkdir()
    result = raytrain("export", str(tmp_path / "run"), "--to", str(tmp_path / "model.pt"))
    assert result.returncode == 2
    assert "has no registered checkpoint" in result.stderr and "Traceback" not in result.stderr
