"""A damaged newest checkpoint, with an older one whole: the driver resumes from the newest whole one
and says what it skipped; Ray's run snapshot never blocks it. First the driver's check of "whole" on
checkpoints written here with torch.save; then one real 2-epoch run, copied and damaged per test."""

from __future__ import annotations

import json
import re
import shutil
import time
from importlib import metadata
from pathlib import Path

import pytest
from conftest import TINY, raytrain
from test_resume import saved, write_checkpoint, write_run

from raytrain_ddp.checkpoint.files import (
    RESUME_INFO, SHARDS, SNAPSHOT, STATE, checkpoint_problem, latest_checkpoint, rank_file, resume_choice, set_aside,
)
from raytrain_ddp.config import ConfigError
from raytrain_ddp.run_files import read_csv

OLD, NEW = "checkpoint_2026-01-01_00-00-01.0", "checkpoint_2026-01-01_00-00-02.0"
RAY = metadata.version("ray")


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def unversioned(run_dir: Path) -> None:
    """The run's snapshot as Ray 2.52.1 writes it: no ray_version, and none of the fields later releases added."""
    snapshot = json.loads((run_dir / SNAPSHOT).read_text())
    old = {"version": 0, "checkpoint_results": [{k: r[k] for k in ("version", "checkpoint_dir_name", "metrics")}
                                                for r in snapshot["checkpoint_results"]]}
    old["latest_checkpoint_result"] = old["checkpoint_results"][-1]
    (run_dir / SNAPSHOT).write_text(json.dumps(old))


def two_checkpoints(run_dir: Path, version: str | None = None) -> None:
    """A run as Ray leaves it with --keep-checkpoints 2: both registered, NEW the latest."""
    write_run(run_dir, OLD, saved(), ray_version=version)
    write_checkpoint(run_dir / NEW, saved(epoch=3, position=0))
    snapshot = json.loads((run_dir / SNAPSHOT).read_text())
    newest = {"checkpoint_dir_name": NEW, "metrics": {}, "version": 0}
    snapshot["checkpoint_results"].append(newest)
    snapshot["latest_checkpoint_result"] = newest
    (run_dir / SNAPSHOT).write_text(json.dumps(snapshot))


# --- the driver's check, on files written here ---

def test_each_kind_of_damage_is_named_in_a_few_words(tmp_path):
    whole = write_checkpoint(tmp_path / "whole", saved())
    assert checkpoint_problem(whole) is None
    assert checkpoint_problem(tmp_path / "gone") == "its directory is gone"
    truncate(write_checkpoint(tmp_path / "state", saved()) / STATE)
    assert checkpoint_problem(tmp_path / "state") == "state.pt is truncated or damaged: not a whole zip archive"
    truncate(write_checkpoint(tmp_path / "info", saved()) / RESUME_INFO)
    assert checkpoint_problem(tmp_path / "info").startswith("resume.json is not whole JSON: ")
    (write_checkpoint(tmp_path / "rank", saved()) / rank_file(1)).unlink()  # a rank's copy that never came
    assert checkpoint_problem(tmp_path / "rank") == "rank-1.pt is missing"
    (write_checkpoint(tmp_path / "text", saved()) / rank_file(0)).write_text("not a zip")
    assert checkpoint_problem(tmp_path / "text") == "rank-0.pt is truncated or damaged: not a whole zip archive"
    fsdp = write_checkpoint(tmp_path / "fsdp", {**saved(), "strategy": "fsdp"})
    assert checkpoint_problem(fsdp) == "shards/.metadata is missing"
    (fsdp / SHARDS).mkdir()
    (fsdp / SHARDS / ".metadata").write_bytes(b"x")
    assert checkpoint_problem(fsdp) is None
    # Without RESUME_INFO: one Ray registered predates it; a directory it never registered is a copy cut short
    (write_checkpoint(tmp_path / "legacy", None)).joinpath(RESUME_INFO).unlink(missing_ok=True)
    assert checkpoint_problem(tmp_path / "legacy") is None
    assert checkpoint_problem(tmp_path / "legacy", registered=False) == "resume.json is missing"


def test_the_newest_whole_checkpoint_is_chosen_and_ray_s_snapshot_is_set_aside(tmp_path):
    two_checkpoints(tmp_path)
    assert resume_choice(tmp_path, RAY).line(None) is None  # both whole: Ray's own resume, nothing said
    assert latest_checkpoint(tmp_path) == tmp_path / NEW
    truncate(tmp_path / NEW / STATE)
    choice = resume_choice(tmp_path, RAY)
    assert choice.checkpoint == tmp_path / OLD and choice.snapshot_problem
    assert choice.line("s.old") == (f"resume: skipped {NEW}: state.pt is truncated or damaged: not a whole zip "
                                    f"archive; resuming from {OLD} (Ray's run snapshot moved to s.old)")
    aside = set_aside(tmp_path)
    assert not (tmp_path / SNAPSHOT).exists() and json.loads(aside.read_text())["ray_version"] == RAY  # kept
    # Without a snapshot the directories themselves are read, newest first, and agree
    assert resume_choice(tmp_path, RAY).checkpoint == latest_checkpoint(tmp_path) == tmp_path / OLD


def test_a_snapshot_of_another_ray_or_unreadable_does_not_block_the_resume(tmp_path):
    two_checkpoints(tmp_path, version="2.99.0")
    choice = resume_choice(tmp_path, RAY)
    assert choice.checkpoint == tmp_path / NEW and choice.skipped == ()
    assert choice.line("s.old") == (f"resume: Ray's run snapshot was written by Ray 2.99.0, this is Ray {RAY}: "
                                    f"moved to s.old; resuming from {NEW}")
    # Ray 2.52 writes no version: its snapshot is another release's to a Ray that writes one, its own to 2.52
    unversioned(tmp_path)
    assert resume_choice(tmp_path, RAY).snapshot_problem == (f"was written by another Ray release (it names none), "
                                                             f"this is Ray {RAY}")
    assert resume_choice(tmp_path, None).snapshot_problem is None
    (tmp_path / SNAPSHOT).write_text('{"ray_version": "2.6')  # cut short
    choice = resume_choice(tmp_path, RAY)
    assert choice.checkpoint == tmp_path / NEW and choice.snapshot_problem.startswith("cannot be read: ")
    # read from the directories, a newer one that Ray never registered counts only if whole
    (write_checkpoint(tmp_path / "checkpoint_2026-01-01_00-00-03.0", saved()) / RESUME_INFO).unlink()
    choice = resume_choice(tmp_path, RAY)
    assert choice.checkpoint == tmp_path / NEW
    assert choice.skipped == (("checkpoint_2026-01-01_00-00-03.0", "resume.json is missing"),)


def test_a_registered_checkpoint_that_is_gone_is_skipped(tmp_path):
    two_checkpoints(tmp_path)
    shutil.rmtree(tmp_path / NEW)
    choice = resume_choice(tmp_path, RAY)
    assert choice.checkpoint == tmp_path / OLD and choice.skipped == ((NEW, "its directory is gone"),)
    assert choice.snapshot_problem == f"names {NEW}, which is gone"  # Ray refuses such a snapshot


def test_when_none_is_whole_each_is_named_in_one_line(tmp_path):
    two_checkpoints(tmp_path)
    truncate(tmp_path / NEW / STATE)
    (tmp_path / OLD / rank_file(1)).unlink()
    with pytest.raises(ConfigError) as refused:
        resume_choice(tmp_path, RAY)
    assert str(refused.value) == (
        f"no checkpoint of run {tmp_path.name!r} is whole: {NEW} (state.pt is truncated or damaged: not a whole "
        f"zip archive), {OLD} (rank-1.pt is missing); pass --no-resume to start fresh (the old run is moved "
        "aside) or a new --name"
    )


# --- end to end: one real run with --keep-checkpoints 2, copied and damaged per test ---

@pytest.fixture(scope="module")
def finished_run(ray_head, tmp_path_factory) -> Path:
    """A 2-epoch run's directory, with both epochs' checkpoints."""
    storage = tmp_path_factory.mktemp("damage")
    first = raytrain("run", *TINY, "--epochs", "2", "--keep-checkpoints", "2", "--storage-path", str(storage),
                     "--name", "c1", env=ray_head.env)
    assert first.returncode == 0, first.stderr[-3000:]
    return storage / "c1"


def rerun(ray_head, finished_run: Path, tmp_path: Path, damage) -> tuple:
    """Copy the run, damage it, rerun the same command: (the rerun, the old checkpoints' names, oldest first)."""
    run_dir = tmp_path / "c1"
    shutil.copytree(finished_run, run_dir)
    old, new = sorted(p.name for p in run_dir.glob("checkpoint_*") if p.is_dir())
    damage(run_dir / new, run_dir)
    again = raytrain("run", *TINY, "--epochs", "2", "--keep-checkpoints", "2", "--storage-path", str(tmp_path),
                     "--name", "c1", env=ray_head.env)
    return again, old, new


def assert_resumed_from_the_older(again, run_dir: Path, old: str, said: str) -> None:
    assert again.returncode == 0, again.stderr[-3000:]
    [line] = [line for line in again.stderr.splitlines() if line.startswith("resume: ")]
    assert line.startswith(f"resume: {said}"), line
    assert re.search(rf"; resuming from {old} \(Ray's run snapshot moved to {SNAPSHOT}\.old-[0-9-]+\)$", line), line
    assert "Traceback" not in again.stderr and "CheckpointManagerInitializationError" not in again.stderr
    assert "resumed from the checkpoint at epoch 2" in again.stdout + again.stderr  # the older: epoch 1 done
    assert [row["epoch"] for row in read_csv(run_dir / "metrics.csv")] == ["1", "2"]  # epoch 2 trained again
    assert len(list(run_dir.glob(f"{SNAPSHOT}.old-*"))) == 1 and (run_dir / SNAPSHOT).exists()  # Ray's new one
    assert (run_dir / old).is_dir()  # nothing of ours deleted


@pytest.mark.e2e
def test_a_truncated_newest_state_resumes_from_the_older_and_says_so(ray_head, finished_run, tmp_path):
    again, old, new = rerun(ray_head, finished_run, tmp_path, lambda newest, _: truncate(newest / STATE))
    assert_resumed_from_the_older(
        again, tmp_path / "c1", old, f"skipped {new}: state.pt is truncated or damaged: not a whole zip archive")
    assert (tmp_path / "c1" / new / STATE).exists()  # the damaged one is left as it was, for the user


@pytest.mark.e2e
def test_a_snapshot_of_another_ray_release_is_set_aside_and_the_newest_resumes(ray_head, finished_run, tmp_path):
    # as Ray 2.52.1 writes it (the run made under it, Ray upgraded since): Ray itself refuses it. The run
    # ended before its summary.json, or its rerun would say it trained its epochs and start no Ray at all.
    def unversioned_unsummed(_: Path, run_dir: Path) -> None:
        unversioned(run_dir)
        (run_dir / "summary.json").unlink()

    again, old, new = rerun(ray_head, finished_run, tmp_path, unversioned_unsummed)
    assert again.returncode == 0, again.stderr[-3000:]
    [line] = [line for line in again.stderr.splitlines() if line.startswith("resume: ")]
    assert line.startswith(f"resume: Ray's run snapshot was written by another Ray release (it names none), this is "
                           f"Ray {RAY}: moved to {SNAPSHOT}.old-") and line.endswith(f"; resuming from {new}"), line
    assert "CheckpointManagerInitializationError" not in again.stderr
    assert [row["epoch"] for row in read_csv(tmp_path / "c1" / "metrics.csv")] == ["1", "2"]  # nothing left to train


@pytest.mark.e2e
def test_when_every_checkpoint_is_damaged_the_rerun_names_each_and_exits_2(ray_head, finished_run, tmp_path):
    def both(newest: Path, run_dir: Path) -> None:
        truncate(newest / STATE)
        (min(run_dir.glob("checkpoint_2*")) / rank_file(1)).unlink()

    started = time.monotonic()
    again, old, new = rerun(ray_head, finished_run, tmp_path, both)
    assert again.returncode == 2, again.stderr[-3000:]
    assert again.stderr.strip().splitlines()[-1] == (
        f"error: no checkpoint of run 'c1' is whole: {new} (state.pt is truncated or damaged: not a whole zip "
        f"archive), {old} (rank-1.pt is missing); pass --no-resume to start fresh (the old run is moved aside) "
        "or a new --name"
    )
    assert "Traceback" not in again.stderr and time.monotonic() - started < 60  # refused before any worker
