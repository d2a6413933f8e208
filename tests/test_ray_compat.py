"""ray_compat/: what the installed Ray can carry, the lines that say so, and the elastic count that
never stops a run. The low end of the supported range runs the smoke set (`pytest -m smoke`, README):
all of this module, and the core's end-to-end tests elsewhere."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import ray
from conftest import RAY_LOG_LINE, REPO, TINY, local_head, raytrain
from ray.train import ScalingConfig

from raytrain_ddp import ray_compat
from raytrain_ddp.config import ConfigError
from raytrain_ddp.driver.session.connect import ray_mismatch, version_mismatch
from raytrain_ddp.ray_compat.features import FEATURES, has, refusal

pytestmark = pytest.mark.smoke


def test_has_checks_the_installed_ray_not_a_version_number():
    assert has("ray.train:ScalingConfig")
    assert has("ray.train.v2.api.data_parallel_trainer:DataParallelTrainer.fit")
    assert not has("ray.train:NoSuchThing")
    assert not has("ray.no_such_module:ScalingConfig")


def test_a_refusal_names_the_ray_it_needs_the_one_installed_and_the_fix():
    assert refusal("elastic", "2.52.1") == (
        "--workers MIN:MAX needs Ray >= 2.55; this is 2.52.1: pip install 'ray[default,train]>=2.55'"
    )


@pytest.mark.parametrize("feature", sorted(FEATURES))
def test_each_feature_is_checked_by_names_this_ray_has_or_lacks(feature):
    """On the newest Ray every feature is there; on an older one, require refuses in one line."""
    if ray_compat.supports(feature):
        ray_compat.require(feature)
        return
    with pytest.raises(ConfigError, match=rf"needs Ray >= {FEATURES[feature].since}; this is {ray.__version__}"):
        ray_compat.require(feature)


def test_going_without_names_only_what_this_ray_lacks():
    line = ray_compat.going_without()
    off = [f for f in ("fast_start", "drain_notices") if not ray_compat.supports(f)]
    assert (line is None) == (not off)
    for feature in off:
        assert FEATURES[feature].what in line


RAY_REFUSAL = """Version mismatch: The cluster was started with:
    Ray: 2.60.0
    Python: 3.11.7
This process on node 10.0.0.5 was started with:
    Ray: 2.52.1
    Python: 3.11.7
"""
"""ray.init's refusal, as ray._private.utils.check_version_info words it."""


def test_a_driver_on_another_ray_gets_one_line_with_both_versions_and_the_fix():
    assert ray_mismatch("head:6379", RAY_REFUSAL) == (
        "the Ray cluster at head:6379 runs Ray 2.60.0, and this driver Ray 2.52.1; a driver must run the "
        "cluster's exact Ray: pip install 'ray[default,train]==2.60.0'"
    )
    python = RAY_REFUSAL.replace("Ray: 2.52.1", "Ray: 2.60.0").replace("Python: 3.11.7\nThis", "Python: 3.12.1\nThis")
    assert "runs Python 3.12.1, and this driver Python 3.11.7" in ray_mismatch("head:6379", python)
    assert ray_mismatch("head:6379", "Failed to connect to GCS") is None
    assert version_mismatch("http://head:8265", "2.60.0", "2.60.0") is None


@pytest.mark.skipif(not ray_compat.supports("elastic"), reason="Ray < 2.55 has no elastic policy")
def test_the_elastic_count_falls_back_to_rays_when_ours_fails(caplog):
    """A failed GCS query (here a real one: no Ray to ask) must not stop the run: Ray's own count
    decides, and the fallback is logged once."""
    from raytrain_ddp.ray_compat.elastic import StayingNodesPolicy

    assert not ray.is_initialized()
    policy = StayingNodesPolicy(ScalingConfig(num_workers=(1, 4), resources_per_worker={"CPU": 1}))
    reserved = {"a" * 56: {"CPU": 2.0}, "b" * 56: {"CPU": 1.0}}
    with caplog.at_level(logging.WARNING, logger="raytrain_ddp.ray_compat.elastic"):
        assert policy._count_possible_workers(reserved) == 3
        assert policy._count_possible_workers(reserved) == 3
    assert [r.getMessage() for r in caplog.records if "counting workers as Ray does" in r.getMessage()] != []
    assert len([r for r in caplog.records if "counting workers as Ray does" in r.getMessage()]) == 1


# --- end to end: what a user of an older or another Ray sees (the smoke set runs these on the lowest) ---

OTHER_RAY = os.environ.get("RAYTRAIN_OTHER_RAY")
"""A `ray` command of another Ray release (.ci/run sets it for the low-end smoke: the newest's)."""


QUICK_STARTS = {
    "run": ["run", "--workers", "2", "--epochs", "1", "--train-samples", "256", "--val-samples", "64"],
    "launch": ["launch", "--workers", "2", str(REPO / "tests" / "scripts" / "torchrun_train.py"), "--out", "out",
               "--epochs", "1", "--samples", "256"],
    "sweep": ["sweep", "--space", "space.yaml", "--trials", "1", "--concurrent", "2", "--name", "lr", "--workers", "1",
              "--epochs", "1", "--train-samples", "128", "--val-samples", "32", "--data-workers", "0", "--health", "off"],
    "check": ["check", "--iters", "2"],
}
"""The README's commands as a user types them: no --address, so each starts a private Ray of its own."""


@pytest.mark.e2e
@pytest.mark.parametrize("command", list(QUICK_STARTS))
def test_the_quick_start_trains_on_a_private_ray_of_this_release(tmp_path, command):
    """#49: on Ray 2.52.1 the private Ray refused its own driver (the driver's ray.init went without
    the head's token: 20 lines of Ray's C++ log, then `ConnectionError`). Each command trains to the
    end here, on every Ray the smoke set runs on, and no line of Ray's C++ log reaches the screen (the
    check's queue, left to Ray's exit, once ended it with `core_worker.cc: ... Attempting to recover 1
    lost objects`)."""
    (tmp_path / "space.yaml").write_text("lr: {grid: [0.01, 0.1]}\n")
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_TOKEN_PATH", "RAY_AUTH_MODE")}
    # The `raytrain` command itself, as a user types it: under `python -m raytrain_ddp` Ray's exit differs
    # (the check's lost-object line was never printed there).
    proc = subprocess.run([str(Path(sys.executable).with_name("raytrain")), *QUICK_STARTS[command]], env=env,
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not [line for line in (proc.stdout + proc.stderr).splitlines() if RAY_LOG_LINE.match(line)], proc.stderr
    if command == "run":
        assert "done: 2 gloo workers" in proc.stdout, proc.stdout
        assert "starting " not in proc.stdout + proc.stderr  # the start's live line is a terminal's (test_start_line.py)
    elif command == "launch":
        [run] = (tmp_path / "runs").iterdir()
        assert json.loads((run / "summary.json").read_text())["exit_codes"] == [0, 0]
    elif command == "sweep":
        rows = (tmp_path / "runs" / "lr" / "results.csv").read_text().splitlines()
        assert len(rows) == 3, rows  # a header and both trials
    else:
        assert "PASS  all-reduce and broadcast on 2 ranks (gloo)" in proc.stdout, proc.stdout


@pytest.mark.e2e
@pytest.mark.skipif(ray_compat.supports("elastic"), reason="this Ray has elastic runs (test_cluster runs them)")
@pytest.mark.parametrize("command", [["run", *TINY], ["launch", "tests/scripts/torchrun_train.py", "--out", "x"]])
def test_an_elastic_run_on_a_ray_without_one_is_refused_in_one_line(tmp_path, command):
    proc = raytrain(command[0], "--workers", "1:2", "--storage-path", str(tmp_path), *command[1:], cwd=REPO)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip() == f"error: {refusal('elastic', ray.__version__)}"


@pytest.mark.e2e
@pytest.mark.skipif(not OTHER_RAY, reason="RAYTRAIN_OTHER_RAY names no other Ray release's `ray` command")
def test_a_driver_on_another_ray_is_refused_before_any_worker_starts(tmp_path):
    theirs = subprocess.run([OTHER_RAY, "--version"], capture_output=True, text=True, check=True).stdout.split()[-1]
    assert theirs != ray.__version__
    with local_head(num_cpus=1, ray=OTHER_RAY) as head:
        proc = raytrain("run", *TINY, "--address", head.address, "--storage-path", str(tmp_path), env=head.env)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: the Ray cluster at {head.address} runs Ray {theirs}, and this driver Ray {ray.__version__}; "
        f"a driver must run the cluster's exact Ray: pip install 'ray[default,train]=={theirs}'"
    )
