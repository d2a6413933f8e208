"""Shared fixtures: one real local Ray head for the whole session, and a way to drive the real CLI.

Ray takes ~8 s to start on the CI machine, so end-to-end tests share one head started with
`ray start --head --block` (its own process group, so teardown stops exactly this cluster) and run
`raytrain run --address` against it, as a user on Slurm or any existing cluster would.

The suite runs in two pytest-xdist workers, a whole file at a time (pyproject's addopts): the Slurm
testbed's tests, one file, run one after another on one worker while the other worker goes through
the rest, and each worker that needs the shared head starts its own.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from raytrain_ddp.bench.local_ray import Head, local_head  # noqa: F401 (test modules import them from here)
from raytrain_ddp.net import free_port  # noqa: F401 (test modules import it from here)

REPO = Path(__file__).resolve().parents[1]
HEAD_CPUS = 4
"""Logical CPUs: 2 training workers, and 2 left for Ray Data's decode tasks (--loader ray)."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The Slurm testbed's tests first, so that its file is the first work one xdist worker is given
    (--dist loadfile --no-loadscope-reorder): the testbed's waits then overlap the rest of the suite,
    instead of running last on one worker while the other sits idle."""
    items.sort(key=lambda item: item.get_closest_marker("slurm") is None)  # stable: each file keeps its order


@pytest.fixture(scope="session", autouse=True)
def model_shapes_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The drivers' cache of built-in models' shapes (driver/model_shapes.py) in the session's temp
    dir, not the user's ~/.cache; every driver a test starts inherits it."""
    root = tmp_path_factory.mktemp("xdg-cache")
    os.environ["XDG_CACHE_HOME"] = str(root)
    return root


@pytest.fixture(scope="session")
def ray_head() -> Head:
    with local_head(num_cpus=HEAD_CPUS) as head:
        yield head


def raytrain(*args: str, env: dict[str, str] | None = None, timeout: float = 300, cwd: Path | None = None):
    """Run the real CLI as a user would, as `python -m raytrain_ddp`; returns CompletedProcess."""
    return subprocess.run(
        [sys.executable, "-m", "raytrain_ddp", *args],
        env=env if env is not None else {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"},
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
    )


TINY = ["--epochs", "1", "--train-samples", "256", "--val-samples", "64", "--batch-size", "32",
        "--data-workers", "0", "--progress", "plain"]
"""A run small enough for CI: the point is the plumbing, not the model."""


def wait_for(path: Path, proc: subprocess.Popen, timeout_s: float = 240) -> None:
    """Until a running driver writes `path`; fails with its output if it exits first."""
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.2)
