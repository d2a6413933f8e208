"""The sweep's search space: the file checked against the base config, Tune's domains, and the trials drawn."""

from __future__ import annotations

import dataclasses
import json
import tempfile
from pathlib import Path

import pytest
from ray import tune
from ray.train.constants import DEFAULT_STORAGE_PATH
from ray.tune.search.sample import Categorical, Float, Integer, LogUniform, Uniform

from raytrain_ddp.config import ConfigError, TrainConfig
from raytrain_ddp.sweep.space import FIXED, describe, load_space, sample_trials

GOOD = """\
lr: {loguniform: [1e-4, 1e-1]}
batch-size: {choice: [32, 64]}
workers: {grid: [1, 2]}
epochs: {randint: [2, 5]}
momentum: {uniform: [0.8, 0.99]}
model: {choice: [convnet, resnet18]}
"""


def write(tmp_path: Path, text: str, name: str = "space.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_good_space_becomes_tunes_domains(tmp_path):
    space = load_space(write(tmp_path, GOOD), TrainConfig())
    assert list(space.params) == ["lr", "batch_size", "workers", "epochs", "momentum", "model"]  # file order
    assert space.params["lr"] == ("loguniform", [1e-4, 0.1])  # 1e-4 is a number, not YAML 1.1's string
    domains = space.tune_space()
    lr, momentum, epochs, batch = domains["lr"], domains["momentum"], domains["epochs"], domains["batch_size"]
    assert isinstance(lr, Float) and isinstance(lr.sampler, LogUniform) and (lr.lower, lr.upper) == (1e-4, 0.1)
    assert isinstance(momentum.sampler, Uniform) and (momentum.lower, momentum.upper) == (0.8, 0.99)
    assert isinstance(epochs, Integer) and (epochs.lower, epochs.upper) == (2, 5)
    assert isinstance(batch, Categorical) and batch.categories == [32, 64]
    assert domains["workers"] == tune.grid_search([1, 2])
    assert space.grid_size == 2
    assert describe(space) == (
        "lr loguniform 1e-4..1e-1, batch_size choice [32, 64], workers grid [1, 2], epochs randint [2, 5), "
        "momentum uniform 0.8..0.99, model choice [convnet, resnet18]"
    )


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("lr: {loguniform: [1e-4\n", "does not parse: expected ',' or ']', but got '<stream end>' at line 2, column 1"),
        ("- lr\n", "must map config fields to ranges"),
        ("", "must map config fields to ranges"),
        ("lrr: {uniform: [0.01, 0.1]}\n", "lrr: not a config field; did you mean lr?"),
        ("zzz: {choice: [1]}\n", "zzz: not a config field; keys are `raytrain run` flags"),
        ("batch-size: {choice: [32]}\nbatch_size: {choice: [64]}\n", "batch_size: given twice; keep one"),
        ("lr: 0.1\n", "lr: give exactly one of {loguniform: [lo, hi]}"),
        ("lr: {uniform: [0.01, 0.1], choice: [0.1]}\n", "lr: give exactly one of"),
        ("lr: {normal: [0, 1]}\n", "lr: give exactly one of"),
        ("lr: {uniform: [0.1]}\n", "lr: uniform takes [lo, hi], two finite numbers"),
        ("lr: {uniform: [a, 0.1]}\n", "lr: uniform takes [lo, hi], two finite numbers"),
        ("lr: {uniform: [.nan, 0.1]}\n", "lr: uniform takes [lo, hi], two finite numbers"),
        ("lr: {uniform: [true, 0.1]}\n", "lr: uniform takes [lo, hi], two finite numbers"),
        ("batch_size: {choice: []}\n", "batch_size: choice takes a non-empty list"),
        ("batch_size: {grid: 32}\n", "batch_size: grid takes a non-empty list"),
        ("lr: {uniform: [0.1, 0.01]}\n", "lr: uniform needs lo < hi"),
        ("epochs: {randint: [3, 3]}\n", "epochs: randint needs lo < hi"),
        ("weight_decay: {loguniform: [0, 0.1]}\n", "weight_decay: loguniform needs lo > 0"),
        ("epochs: {randint: [1.5, 4]}\n", "epochs: randint takes two whole numbers"),
        ("model: {uniform: [1, 2]}\n", "model: uniform needs a number field; vary model with choice or grid"),
        ("amp: {randint: [0, 2]}\n", "amp: randint needs a number field"),
        ("epochs: {uniform: [1, 5]}\n", "epochs: uniform draws fractions for a whole-number field; use randint"),
        ("workers: {randint: [1, 4]}\n", "workers: sizes each trial's gang"),
        ("cpus_per_worker: {randint: [1, 4]}\n", "cpus_per_worker: sizes each trial's gang"),
        ("workers: {choice: [1, 2.5]}\n", "workers: choice takes whole numbers here"),
        # values TrainConfig itself refuses, each with the key in front
        ("lr: {uniform: [-1, 0.1]}\n", "lr: --lr must be a positive number (got -1.0)"),
        ("optimizer: {choice: [sgd, adam]}\n", "optimizer: --optimizer must be one of sgd, adamw (got 'adam')"),
        ("batch_size: {grid: [32, '64']}\n", "batch_size: --batch-size must be int (got '64')"),
        ("epochs: {randint: [0, 3]}\n", "epochs: --epochs must be at least 1 (got 0)"),
        ("momentum: {uniform: [0.5, 1.0]}\n", "momentum: --momentum must be in [0, 1) (got 1.0)"),
        ("workers: {grid: [1, 3]}\n", "workers: --global-batch-size 128 is not a multiple"),  # against the base
    ],
)
def test_bad_space_is_one_line_naming_the_key(tmp_path, text, fragment):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as caught:
        load_space(path, TrainConfig(batch_size=64, global_batch_size=128, workers=1))
    message = str(caught.value)
    assert fragment in message and "\n" not in message and str(path) in message


@pytest.mark.parametrize("key", sorted(FIXED))
def test_fields_a_trial_may_not_vary(tmp_path, key):
    with pytest.raises(ConfigError, match=f"{key}: cannot vary between trials .*; set --.* once, for the whole sweep"):
        load_space(write(tmp_path, f"{key}: {{choice: [1, 2]}}\n"), TrainConfig())


def test_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="cannot read sweep space .*nope.yaml: No such file or directory; check"):
        load_space(tmp_path / "nope.yaml", TrainConfig())
    with pytest.raises(ConfigError, match="space.toml must be a YAML file ending in .yaml or .yml"):
        load_space(write(tmp_path, "", "space.toml"), TrainConfig())


def test_values_are_checked_against_the_base(tmp_path):
    # warmup must not outlast the base's epochs: 4 would be refused, but randint [0, 4] never draws 4
    path = write(tmp_path, "warmup_epochs: {randint: [0, 4]}\n")
    assert load_space(path, TrainConfig(epochs=3)).params["warmup_epochs"] == ("randint", [0, 4])
    with pytest.raises(ConfigError, match="warmup_epochs: --warmup-epochs 3.0 is longer than --epochs 2"):
        load_space(path, TrainConfig(epochs=2))


def test_seed_makes_the_trials_reproducible(tmp_path):
    space = load_space(write(tmp_path, GOOD), TrainConfig())
    first = sample_trials(space, 4, seed=7)
    assert first == sample_trials(space, 4, seed=7)
    assert first != sample_trials(space, 4, seed=8)
    assert sample_trials(space, 4, seed=None) != sample_trials(space, 4, seed=None)


def test_each_sample_repeats_the_grid(tmp_path):
    path = write(tmp_path, "workers: {grid: [1, 2]}\noptimizer: {grid: [sgd, adamw]}\nlr: {uniform: [0.01, 0.1]}\n")
    space = load_space(path, TrainConfig())
    assert space.grid_size == 4
    trials = sample_trials(space, 3, seed=0)
    assert len(trials) == 3 * 4
    for start in range(0, 12, 4):
        assert {(t["workers"], t["optimizer"]) for t in trials[start:start + 4]} == {
            (1, "sgd"), (1, "adamw"), (2, "sgd"), (2, "adamw")}
    assert len({t["lr"] for t in trials}) == 12  # the ranges are drawn afresh for every grid point
    assert load_space(write(tmp_path, "lr: {uniform: [0.01, 0.1]}\n"), TrainConfig()).grid_size == 1


def test_trials_are_plain_values_inside_the_space(tmp_path):
    base = TrainConfig()
    space = load_space(write(tmp_path, GOOD + "amp: {choice: [true, false]}\n"), base)
    trials = sample_trials(space, 20, seed=1)
    assert json.loads(json.dumps(trials)) == trials
    for trial in trials:
        assert list(trial) == list(space.params)
        assert type(trial["lr"]) is float and 1e-4 <= trial["lr"] < 0.1
        assert type(trial["momentum"]) is float and 0.8 <= trial["momentum"] < 0.99
        assert type(trial["epochs"]) is int and 2 <= trial["epochs"] < 5
        assert trial["batch_size"] in (32, 64) and type(trial["batch_size"]) is int
        assert trial["model"] in ("convnet", "resnet18") and type(trial["amp"]) is bool
        dataclasses.replace(base, **trial)  # every trial is a valid run config
    assert {t["epochs"] for t in trials} == {2, 3, 4}


def test_sampling_leaves_no_files(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    marker = Path(DEFAULT_STORAGE_PATH, "space", ".validate_storage_marker")  # where Tune would mark its storage

    def marked() -> int | None:
        return marker.stat().st_mtime_ns if marker.exists() else None

    before = marked()
    space = load_space(write(tmp_path, GOOD), TrainConfig())
    sample_trials(space, 2, seed=0)
    assert list((tmp_path / "tmp").iterdir()) == []
    assert marked() == before


def test_trials_and_seed_are_checked(tmp_path):
    space = load_space(write(tmp_path, GOOD), TrainConfig())
    with pytest.raises(ConfigError, match="--trials must be at least 1 \\(got 0\\)"):
        sample_trials(space, 0, seed=0)
    with pytest.raises(ConfigError, match="the sweep's seed must be 0 or more \\(got -1\\)"):
        sample_trials(space, 1, seed=-1)
