"""The sweep's table, results.csv, summary.json, rerun command, idle share and plots, from hand-built trials."""

from __future__ import annotations

import csv
import json
import shlex
from pathlib import Path

import pytest

from raytrain_ddp.run_files import read_csv, write_csv
from raytrain_ddp.sweep.report import (
    TrialRecord,
    best_trial,
    best_value,
    idle_share,
    plot_curves,
    plot_parallel,
    reproduce_command,
    table,
    write_results_csv,
    write_summary,
)
from conftest import raytrain

PNG = b"\x89PNG\r\n\x1a\n"


def trial_rows(tmp_path: Path, name: str, val_acc: list[float]) -> list[dict[str, str]]:
    """The rows as the sweep driver gets them: a metrics.csv written by the run, read back (all strings)."""
    path = tmp_path / f"{name}.csv"
    write_csv(path, [{"epoch": e, "val_acc": a, "val_loss": 1 - a, "throughput": 100.0}
                     for e, a in enumerate(val_acc, 1)])
    return read_csv(path)


@pytest.fixture
def records(tmp_path: Path) -> list[TrialRecord]:
    return [
        TrialRecord("t00", {"lr": 0.0031, "batch_size": 64}, "finished", trial_rows(tmp_path, "t00", [0.5, 0.8, 0.9]),
                    2, 100.0, 400.0, checkpoint="/runs/s/trials/t00/checkpoint_000002"),
        TrialRecord("t01", {"lr": 0.00012345, "batch_size": 32}, "stopped early", trial_rows(tmp_path, "t01", [0.2]),
                    2, 100.0, 160.0),
        TrialRecord("t02", {"lr": 0.05, "batch_size": 128}, "finished", trial_rows(tmp_path, "t02", [0.6, 0.92, 0.91]),
                    1, 160.0, 420.0, checkpoint="/runs/s/trials/t02/checkpoint_000002"),
        TrialRecord("t03", {"lr": 0.2, "batch_size": 32}, "failed", trial_rows(tmp_path, "t03", [0.1]),
                    2, 400.0, 430.0, error="training failed on rank 0: RuntimeError: boom"),
        TrialRecord("t04", {"lr": 0.001, "batch_size": 64}, "pending", [], 2, None, None),
    ]


def test_table_marks_the_best_trial(records):
    assert table(records, "val_acc", "max") == (
        "   trial        lr  batch_size  status         epochs done  best val_acc\n"
        "   t00      0.0031          64  finished                 3           0.9\n"
        "   t01    0.000123          32  stopped early            1           0.2\n"
        "*  t02        0.05         128  finished                 3          0.92\n"
        "   t03         0.2          32  failed                   1           0.1\n"
        "   t04       0.001          64  pending                  0             -\n"
        "best: t02 val_acc 0.92 (lr=0.05, batch_size=128)\n"
    )
    assert table(records[-1:], "val_acc", "max").endswith("best: none (no trial has reported val_acc yet)\n")


def test_best_for_max_and_min(records, tmp_path):
    assert best_value(records[2], "val_acc", "max") == pytest.approx(0.92)
    assert best_value(records[2], "val_loss", "min") == pytest.approx(0.08)
    assert best_value(records[4], "val_acc", "max") is None
    assert best_trial(records, "val_acc", "max").trial == "t02"
    assert best_trial(records, "val_loss", "min").trial == "t02"
    assert best_trial(records, "val_acc", "min").trial == "t03"
    # Empty and nan cells (a row written before validation ran) are no value; on a tie the earlier trial wins.
    rows = [{"epoch": "1", "val_acc": ""}, {"epoch": "2", "val_acc": "nan"}, {"epoch": "3", "val_acc": "0.9"}]
    tie = TrialRecord("t05", {"lr": 0.1}, "finished", rows, 1, 0.0, 1.0)
    assert best_value(tie, "val_acc", "min") == 0.9
    assert best_trial([records[2], tie, records[0]], "val_loss", "min").trial == "t02"
    assert best_trial([records[0], tie], "val_acc", "max").trial == "t00"
    assert best_trial([tie, records[0]], "val_acc", "max").trial == "t05"
    assert best_trial(records[-1:], "val_acc", "max") is None


def test_results_csv(records, tmp_path):
    path = tmp_path / "results.csv"
    write_results_csv(path, records, "val_acc", "max")
    rows = list(csv.DictReader(path.open()))
    assert list(rows[0]) == ["trial", "lr", "batch_size", "status", "epochs_done", "best_val_acc", "started", "ended",
                             "worker_s", "error", "checkpoint"]
    assert [r["trial"] for r in rows] == ["t00", "t01", "t02", "t03", "t04"]
    assert rows[1]["lr"] == "0.00012345"  # full precision: the table rounds, the file does not
    assert rows[2] == {"trial": "t02", "lr": "0.05", "batch_size": "128", "status": "finished", "epochs_done": "3",
                       "best_val_acc": "0.92", "started": "160.0", "ended": "420.0", "worker_s": "260.0", "error": "",
                       "checkpoint": "/runs/s/trials/t02/checkpoint_000002"}
    assert rows[3]["error"] == "training failed on rank 0: RuntimeError: boom"
    assert rows[4]["best_val_acc"] == rows[4]["started"] == rows[4]["worker_s"] == ""
    assert not list(tmp_path.glob(".*.tmp"))


def test_summary_names_the_best_trial_and_its_command(records, tmp_path):
    sweep_dir = tmp_path / "s"
    (sweep_dir / "trials" / "t02").mkdir(parents=True)
    (sweep_dir / "trials" / "t02" / "summary.json").write_text(json.dumps({"config": {"lr": 0.05, "epochs": 3}}))
    summary = write_summary(sweep_dir / "summary.json", records, "val_acc", "max", ["--workers", "2"],
                            {"idle_share": 0.25, "scheduler": "asha"})
    assert json.loads((sweep_dir / "summary.json").read_text()) == summary
    assert summary == {
        "metric": "val_acc",
        "mode": "max",
        "best": {
            "trial": "t02",
            "params": {"lr": 0.05, "batch_size": 128},
            "value": 0.92,
            "checkpoint": "/runs/s/trials/t02/checkpoint_000002",
            "run_dir": str(sweep_dir / "trials" / "t02"),
            "command": "raytrain run --workers 2 --lr 0.05 --batch-size 128 --name s-t02",
            "config": {"lr": 0.05, "epochs": 3},
        },
        "trials": {"finished": 2, "stopped early": 1, "failed": 1, "stopped": 0, "pending": 1, "total": 5},
        "idle_share": 0.25,
        "scheduler": "asha",
    }
    nothing = write_summary(tmp_path / "summary.json", records[-1:], "val_acc", "max", [], {})
    assert nothing["best"] is None and nothing["trials"]["pending"] == 1


def test_idle_share_of_overlapping_and_gapped_trials():
    def held(workers, started, ended):
        return TrialRecord("t", {}, "finished", [], workers, started, ended)

    # 4 slots for 100 s = 400 worker-s. Two 2-worker trials overlap on 50..100 and fill all 4 slots there.
    assert idle_share(4, 0, 100, [held(2, 0, 100), held(2, 50, 100)]) == pytest.approx(1 - (200 + 100) / 400)
    # Gapped: 2 slots for 100 s = 200 worker-s; a 2-worker trial on 0..30, another on 60..100.
    assert idle_share(2, 0, 100, [held(2, 0, 30), held(2, 60, 100)]) == pytest.approx(1 - (60 + 80) / 200)
    # Only what lies inside [began, ended] counts: a trial of an earlier session (before a resume), one
    # that began before it, one still running (no end yet), one never started.
    records = [held(2, -500, -100), held(2, -50, 20), held(1, 90, None), held(2, None, None)]
    assert idle_share(2, 0, 100, records) == pytest.approx(1 - (40 + 10) / 200)
    assert idle_share(2, 0, 100, []) == 1.0
    assert idle_share(2, 0, 100, [held(4, 0, 100)]) == 0.0  # more than the slots (a bad count): clamped, not < 0
    assert idle_share(2, 100, 100, [held(2, 0, 100)]) == 0.0  # no time, nothing idle


def test_reproduce_command_replaces_and_appends_flags():
    run_args = ["--workers=2", "--epochs", "9", "--model", "resnet18", "--lr", "0.1", "--gpu", "--config", "base.yaml",
                "--name", "sweep1", "--lr=0.3"]
    params = {"lr": 0.0031, "workers": 4, "gpu": False, "batch_size": 64, "amp": False, "optimizer": "adamw"}
    command = reproduce_command(run_args, params, "sweep1-t03")
    assert shlex.split(command) == [
        "raytrain", "run", "--workers", "4", "--epochs", "9", "--model", "resnet18", "--lr", "0.0031", "--cpu",
        "--config", "base.yaml", "--batch-size", "64", "--no-amp", "--optimizer", "adamw", "--name", "sweep1-t03",
    ]
    # The short form, a joined one, the other spelling of a bool, and a value that needs quoting.
    assert reproduce_command(["-w", "2", "--cpu", "--data-dir", "/my data"], {"workers": 1, "gpu": True}, "t00") == (
        "raytrain run --workers 1 --gpu --data-dir '/my data' --name t00"
    )
    assert reproduce_command(["-w2", "--no-amp"], {"workers": 3, "amp": True, "lr": 1e-05}, "t") == (
        "raytrain run --workers 3 --amp --lr 1e-05 --name t"
    )
    assert reproduce_command([], {"cpus_per_worker": None}, "t") == "raytrain run --name t"


def test_reproduce_command_is_what_the_cli_takes(tmp_path):
    params = {"lr": 0.000123456789, "batch_size": 48, "optimizer": "adamw", "amp": False, "gpu": True,
              "label_smoothing": 0.1, "scheduler": "step", "warmup_epochs": 0.5}
    command = reproduce_command(["--workers", "2", "--epochs=4", "--cpu", "--lr", "0.1"], params, "again")
    args = shlex.split(command)[2:]
    proc = raytrain("run", *args, "--storage-path", str(tmp_path), "--dry-run")
    assert proc.returncode == 0, proc.stderr
    printed = proc.stdout.split("config:\n", 1)[1]
    config = json.loads(printed[: printed.index("\n}\n") + 2])
    assert {k: config[k] for k in params} == params
    assert (config["workers"], config["epochs"], config["name"]) == (2, 4, "again")


@pytest.mark.parametrize("count", [1, 6])
def test_plots_are_written(records, tmp_path, count):
    many = records + [TrialRecord("t05", {"lr": 0.3, "batch_size": 16}, "stopped early", records[1].rows, 2, 0, 1)]
    chosen = many[:count]
    for plot, path in ((plot_curves, tmp_path / "curves.png"), (plot_parallel, tmp_path / "parallel.png")):
        if plot is plot_curves:
            plot(path, chosen, "val_acc", "max", [1, 3] if count > 1 else [])
        else:
            plot(path, chosen, "val_loss", "min")
        assert path.read_bytes().startswith(PNG) and path.stat().st_size > 10_000
    assert not list(tmp_path.glob(".*.tmp"))


def test_plots_of_trials_without_rows(records, tmp_path):
    for chosen in (records[-1:], records[-2:]):  # only a pending trial; a pending one beside one with rows
        plot_curves(tmp_path / "curves.png", chosen, "val_acc", "max", [1])
        plot_parallel(tmp_path / "parallel.png", chosen, "val_acc", "max")
        for name in ("curves.png", "parallel.png"):
            assert (tmp_path / name).read_bytes().startswith(PNG)


def test_a_trial_whose_only_checkpoint_is_half_written_reports_none(tmp_path):
    """A trial stopped while its first checkpoint was written: the table shows no checkpoint, where
    the resume's ConfigError would have cost the whole sweep its report."""
    from raytrain_ddp.sweep.command import trial_checkpoint

    (tmp_path / "t0" / "checkpoint_2026-11-27_18-01-48.798400").mkdir(parents=True)
    assert trial_checkpoint(tmp_path / "t0") is None
    assert trial_checkpoint(tmp_path / "never-started") is None
