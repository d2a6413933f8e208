"""The sweep's plan, as pure functions: its options checked, the split of the cluster among trials,
the rungs ASHA judges at, the run flags that reproduce a trial, and a rerun held to its trials."""

from __future__ import annotations

from pathlib import Path

import pytest

from raytrain_ddp.cli.commands import run_words
from raytrain_ddp.config import ConfigError, TrainConfig
from raytrain_ddp.sweep.command import SweepConfig, Trial, keep_plan, packing, rungs


def trials(n: int, workers: int = 1, cpus: int = 1, gpu: bool = False) -> list[Trial]:
    cfg = TrainConfig(workers=workers, cpus_per_worker=cpus, gpu=gpu)
    return [Trial(f"t{i:02d}", {"lr": 0.1 * (i + 1)}, cfg) for i in range(n)]


def test_options_are_checked_in_one_line():
    for bad, words in [({"trials": 0}, "--trials"), ({"concurrent": 0}, "--concurrent"), ({"scheduler": "hyperband"}, "fifo, asha"),
                       ({"metric": "acc"}, "val_acc"), ({"mode": "up"}, "max or min"), ({"eta": 1}, "--eta")]:
        with pytest.raises(ConfigError, match=words):
            SweepConfig(space=Path("s.yaml"), **bad)
    assert SweepConfig(space=Path("s.yaml"), metric="val_loss").best_is == "min"
    assert SweepConfig(space=Path("s.yaml"), metric="val_loss", mode="max").best_is == "max"


def test_packing_splits_the_free_resources_and_says_what_it_leaves():
    sc = SweepConfig(space=Path("s.yaml"))
    assert packing(trials(6, workers=2), sc, [{"CPU": 4}]) == (2, 4, "2 trials at once, each 2 workers x 1 CPU, in 4 free CPUs on 1 node")
    at_once, slots, line = packing(trials(6, workers=2), sc, [{"CPU": 3}, {"CPU": 2}])
    assert (at_once, slots) == (2, 5) and line.endswith("; 1 worker slot left idle (a trial of 2 workers leaves them)"), line
    at_once, slots, line = packing(trials(6, workers=1, cpus=2), sc, [{"CPU": 3}, {"CPU": 3}])
    assert (at_once, slots) == (2, 2) and line.endswith("; 2 CPUs fit no whole worker of 2 CPUs"), line
    at_once, _, line = packing(trials(6), SweepConfig(space=Path("s.yaml"), concurrent=8), [{"CPU": 4}])
    assert at_once == 4 and "--concurrent 8 is more than fit, so 4" in line, line
    at_once, _, line = packing(trials(2), sc, [{"CPU": 4}])
    assert at_once == 2 and "2 worker slots left idle (2 trials leaves them)" in line, line
    with pytest.raises(ConfigError, match="a trial of 2 workers x 1 CPU \\+ 1 GPU each does not fit"):
        packing(trials(2, workers=2, gpu=True), sc, [{"CPU": 16, "GPU": 1}])


def test_an_elastic_base_is_refused(tmp_path):
    from raytrain_ddp.sweep.command import sweep

    with pytest.raises(ConfigError, match="give --workers N, not 2:4"):
        sweep(TrainConfig(workers=2, max_workers=4, name="x", storage_path=str(tmp_path)), SweepConfig(space=tmp_path / "s.yaml"), [])


def test_rungs_are_grace_times_eta_below_the_last_epoch():
    asha = SweepConfig(space=Path("s.yaml"), scheduler="asha", grace_epochs=1, eta=3)
    assert rungs(asha, 27) == [1, 3, 9] and rungs(asha, 3) == [1]
    assert rungs(SweepConfig(space=Path("s.yaml")), 27) == []


def test_run_flags_keep_the_runs_and_drop_the_sweeps_own():
    argv = ["--space", "s.yaml", "--trials=6", "--scheduler", "asha", "--scheduler", "step", "--workers", "2",
            "--epochs=9", "--dry-run", "--concurrent", "2", "--name", "x", "--debug"]
    assert run_words(argv) == ["--scheduler", "step", "--workers", "2", "--epochs=9", "--name", "x"]


def test_a_rerun_must_ask_for_the_same_trials(tmp_path):
    sc = SweepConfig(space=Path("s.yaml"))
    keep_plan(tmp_path, TrainConfig(), trials(2), sc)
    keep_plan(tmp_path, TrainConfig(progress="none", address="h:1"), trials(2), sc)  # what a rerun may change
    with pytest.raises(ConfigError, match="was started with other set of trials; rerun it with the same space"):
        keep_plan(tmp_path, TrainConfig(), trials(3), sc)
    with pytest.raises(ConfigError, match="other run flags"):
        keep_plan(tmp_path, TrainConfig(epochs=5), trials(2), sc)
    with pytest.raises(ConfigError, match="--no-resume would start it again"):
        keep_plan(tmp_path, TrainConfig(resume=False), trials(2), sc)
