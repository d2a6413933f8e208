"""TrainConfig: defaults, validation at the edge, and the defaults < file < flags order."""

from __future__ import annotations

import math
from dataclasses import fields
from pathlib import Path

import pytest

from raytrain_ddp.config import FIELD_TYPES, ConfigError, TrainConfig, field_docs, load_file, resolve


def test_defaults_are_valid_and_round_trip():
    cfg = TrainConfig()
    assert TrainConfig.from_dict(cfg.to_dict()) == cfg
    assert cfg.resolved_backend == "gloo"
    assert TrainConfig(gpu=True).resolved_backend == "nccl"


def test_every_field_has_a_docstring():
    docs = field_docs()
    assert {f.name for f in fields(TrainConfig)} == set(docs)
    assert all(docs.values())


@pytest.mark.parametrize(
    "bad, fragment",
    [
        ({"workers": 0}, "--workers must be at least 1"),
        ({"batch_size": 0}, "--batch-size must be at least 1"),
        ({"optimizer": "adam"}, "--optimizer must be one of sgd, adamw"),
        ({"backend": "nccl"}, "--backend nccl needs --gpu"),
        ({"lr": float("nan")}, "--lr must be a finite number"),
        ({"workers": "2"}, "--workers must be int"),
        ({"workers": True}, "--workers must be int"),
        ({"gpu": "yes"}, "--gpu must be bool"),
        ({"name": "a/b"}, "--name must be a plain directory name"),
        ({"val_fraction": 1.5}, "--val-fraction must be between 0 and 1"),
        ({"grad_accum": 0}, "--grad-accum must be at least 1"),
        ({"global_batch_size": 100}, "--global-batch-size 100 is not a multiple of --batch-size x --workers 2 = 128; pick a multiple, e.g. 128"),
        ({"global_batch_size": 256, "grad_accum": 2}, "give --global-batch-size or --grad-accum, not both"),
        ({"clip_grad_norm": -1}, "--clip-grad-norm must be 0 or more"),
        ({"stop_grace_s": -1}, "--stop-grace-s must be 0 or more"),
        ({"stop_grace_s": float("inf")}, "--stop-grace-s must be a finite number"),
        ({"warmup_epochs": 4}, "--warmup-epochs 4.0 is longer than --epochs 3"),
        ({"label_smoothing": 1}, "--label-smoothing must be in"),
        ({"cpus_per_worker": 0}, "--cpus-per-worker must be at least 1"),
        ({"placement": "scatter"}, "--placement must be one of pack, spread"),
        ({"workers": 3, "max_workers": 2}, "--workers 3:2 has MAX below MIN"),
        ({"workers": 1, "max_workers": 3, "global_batch_size": 256},
         "--global-batch-size 256 is not a multiple of --batch-size x 3 workers \\(within --workers MIN:MAX\\) = 192"),
    ],
)
def test_bad_values_name_the_flag(bad, fragment):
    with pytest.raises(ConfigError, match=fragment):
        TrainConfig.from_dict(bad)


FLOAT_FIELDS = [name for name, kinds in FIELD_TYPES.items() if float in kinds]


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("name", FLOAT_FIELDS)
def test_every_float_refuses_nan_and_inf(name, value):
    # nan passes every `< 0` check (--wait-for-resources nan waited forever), and fails every `>= 0`
    with pytest.raises(ConfigError, match=f"^--{name.replace('_', '-')} must be a finite number \\(got {value}\\)$"):
        TrainConfig(**{name: value})


def test_int_is_accepted_where_a_float_belongs():
    cfg = TrainConfig(lr=1)
    assert cfg.lr == 1.0 and type(cfg.lr) is float


def test_unknown_keys_are_an_error():
    with pytest.raises(ConfigError, match="unknown config key.*wrokers"):
        TrainConfig.from_dict({"wrokers": 2})


@pytest.mark.parametrize("suffix, text", [
    (".yaml", "workers: 4\nlr: 0.2\nbatch-size: 16\n"),
    (".toml", "workers = 4\nlr = 0.2\nbatch-size = 16\n"),
])
def test_file_then_flags(tmp_path, suffix, text):
    path = tmp_path / f"c{suffix}"
    path.write_text(text)
    assert load_file(path) == {"workers": 4, "lr": 0.2, "batch_size": 16}
    # Flags the user gave win over the file; flags left out (None) do not erase it.
    cfg = resolve(path, {"workers": 8, "lr": None})
    assert (cfg.workers, cfg.lr, cfg.batch_size) == (8, 0.2, 16)


def test_a_yaml_file_reads_1e_4_as_a_number(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("lr: 1e-4\nweight-decay: 5E-5\n")  # YAML 1.1 (PyYAML) wants 1.0e-4, and gave a string
    assert resolve(path, {}).lr == 1e-4 and load_file(path)["weight_decay"] == 5e-5


def test_bad_files(tmp_path):
    (tmp_path / "c.json").write_text("{}")
    with pytest.raises(ConfigError, match="must end in .yaml, .yml or .toml"):
        load_file(tmp_path / "c.json")
    (tmp_path / "bad.toml").write_text("workers = ")
    with pytest.raises(ConfigError, match="does not parse"):
        load_file(tmp_path / "bad.toml")
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        load_file(tmp_path / "list.yaml")
    (tmp_path / "types.yaml").write_text("epochs: three\n")
    with pytest.raises(ConfigError, match="--epochs must be int"):
        resolve(tmp_path / "types.yaml", {})


def test_workers_min_max_makes_an_elastic_run(tmp_path):
    assert (resolve(None, {"workers": "2:8"}).workers, resolve(None, {"workers": "2:8"}).max_workers) == (2, 8)
    assert resolve(None, {"workers": "4"}).elastic is False
    (tmp_path / "c.yaml").write_text("workers: '1:2'\n")
    assert resolve(tmp_path / "c.yaml", {}).max_workers == 2
    with pytest.raises(ConfigError, match="--workers takes N or MIN:MAX"):
        resolve(None, {"workers": "two"})


def test_global_batch_size_sets_the_accumulation():
    cfg = TrainConfig(batch_size=32, workers=2, global_batch_size=256)
    assert cfg.accum_steps(2) == 4 and cfg.accum_steps(1) == 8  # a resize keeps the global batch
    assert TrainConfig(grad_accum=3).accum_steps(2) == 3 and TrainConfig().accum_steps(4) == 1


CONFIGS = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_recipe_files_are_valid_and_show_their_command(path):
    cfg = resolve(path, {})
    header = [line for line in path.read_text().splitlines() if line.startswith("#")]
    commands = [line.lstrip("# ") for line in header if "raytrain " in line]
    assert commands and all(f"--config configs/{path.name}" in c for c in commands), header
    assert cfg.model and cfg.dataset != "synthetic"


def test_recipe_files_exist():
    assert {p.name for p in CONFIGS} >= {"resnet50-tinyimagenet.yaml", "mnist-convnet.yaml"}
