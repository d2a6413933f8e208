"""ray_compat/controller.py (the fast start) and process_group.py: what the controller is sent imports no torch, and which Ray Train processes a run
leaves out, and that the driver removes the placement groups of a controller that died (two fits
in one driver, on the shared head). The whole start is covered by every end-to-end run. The check
that it stays fast after a Ray upgrade, `actors_started`, is used in test_cli.py against the shared head."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import cloudpickle
import pytest
from conftest import REPO
from ray.train import RunConfig, ScalingConfig
from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer

from raytrain_ddp.worker.process_group import ProcessGroupConfig
from raytrain_ddp.ray_compat import fast
from raytrain_ddp.ray_compat.controller import TrainController, needed

UNPICKLE = "import pickle, sys; pickle.loads(sys.stdin.buffer.read()); print('torch' in sys.modules)"


def imports_torch(obj: object) -> bool:
    """Whether unpickling `obj` in a fresh interpreter imports torch, as the controller would."""
    proc = subprocess.run([sys.executable, "-c", UNPICKLE], input=cloudpickle.dumps(obj), capture_output=True)
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    return proc.stdout.decode().strip() == "True"


def test_the_controller_unpickles_its_backend_and_class_without_torch():
    from ray.train.torch import TorchConfig

    assert imports_torch(TorchConfig(backend="gloo"))  # Ray's: 3 s of the controller's start
    assert not imports_torch((ProcessGroupConfig(backend="nccl"), TrainController))


def test_a_run_leaves_out_the_cleaner_and_the_dataset_manager_but_keeps_the_rest(tmp_path):
    trainer = fast(DataParallelTrainer)(
        lambda: None, scaling_config=ScalingConfig(num_workers=1), run_config=RunConfig(storage_path=str(tmp_path)),
    )
    names = {type(cb).__name__: needed(cb, {}) for cb in trainer._create_default_callbacks()}
    assert names.pop("PlacementGroupCleanerCallback") is False
    assert names.pop("DatasetsCallback") is False
    assert all(names.values()) and "BackendSetupCallback" in names, names
    with_data = {type(cb).__name__ for cb in trainer._create_default_callbacks() if needed(cb, {"train": "a dataset"})}
    assert "DatasetsCallback" in with_data and "PlacementGroupCleanerCallback" not in with_data


def log_sizes(logs: Path) -> dict[Path, int]:
    return {f: f.stat().st_size for f in logs.glob("worker-*.out")}


def actors_started(logs: Path, before: dict[Path, int]) -> list[str]:
    """The actor classes whose processes Ray started since `before` (log_sizes), from the
    `:actor_name:` line each worker process writes to its log when it becomes an actor."""
    names = []
    for f, size in log_sizes(logs).items():
        with open(f, errors="replace") as fh:
            fh.seek(before.get(f, 0))
            names += re.findall(r":actor_name:(\w+)", fh.read())
    return sorted(names)


@pytest.mark.e2e
def test_a_killed_controllers_placement_group_is_gone_once_the_next_fit_starts(ray_head, tmp_path):
    # Ray removes a group only once its creator and the job are dead: without the driver's clean-up,
    # a driver that fits again (the Python API, `raytrain scale`) keeps the dead fit's CPUs reserved.
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "scripts" / "dead_controller_fits.py"), str(tmp_path)],
                          env=ray_head.env, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(seen["killed"]) == 1 and seen["fit1_failed"], seen  # fit 1's controller died mid-run
    assert seen["after_fit1"], seen  # fit 1 had reserved its worker group
    alive = {when: {g: state for g, state in seen[when].items() if state != "REMOVED"} for when in ("during_fit2", "after_fit2")}
    assert alive == {"during_fit2": {}, "after_fit2": {}}, seen
    assert list(seen["own"].values()) == ["CREATED"], seen  # the driver's own group is not a dead controller's


@pytest.mark.e2e
def test_a_driver_that_leaves_a_running_fit_stops_its_controller_and_frees_its_group_first(ray_head, tmp_path):
    # Left to the job's end, a controller that was restarting its worker group then made a group that
    # Ray never freed: it held the shared head's 4 CPUs and failed 25 later tests (ci54).
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "scripts" / "driver_leaves_a_running_fit.py"), str(tmp_path)],
                          env=ray_head.env, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"left": {}}, proc.stderr[-2000:]


LEFT_RAY = """
import ray
from raytrain_ddp.ray_compat.controller import remove_dead_controllers_groups
ray.init(logging_level="ERROR")
ray.shutdown()  # the driver's exit, while a fit's thread still ends
remove_dead_controllers_groups()
print(ray.is_initialized())
"""


@pytest.mark.e2e
def test_a_fit_that_ends_after_the_driver_left_ray_does_not_connect_again(ray_head):
    """A run whose driver fails on its own (its error line said) exits while fit()'s thread still
    ends: the clean-up at that end must not connect to Ray again, which would print Ray's connection
    lines after the error (a CI run's OOM test saw them)."""
    proc = subprocess.run([sys.executable, "-c", LEFT_RAY], env=ray_head.env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "False", proc.stdout + proc.stderr[-2000:]
    assert "Connected to Ray cluster" not in proc.stderr and "could not remove" not in proc.stderr, proc.stderr[-2000:]
