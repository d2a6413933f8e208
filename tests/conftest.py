"""Shared fixtures: one real local Ray head for the whole session, and a way to drive the real CLI.

Ray takes ~8 s to start on the CI machine, so end-to-end tests share one head started with
`ray start --head --block` (its own process group, so teardown stops exactly this cluster) and run
`raytrain run --address` against it, as a user on Slurm or any existing cluster would.

The suite runs in two pytest-xdist workers, a whole file at a time (pyproject's addopts): the Slurm
testbed's tests, one file, run one after another on one worker while the other worker goes through
the rest, and each worker that needs the shared head starts its own.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
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
    """The drivers' cache of built-in models' shapes (driver/plan/model_shapes.py) in the session's temp
    dir, not the user's ~/.cache; every driver a test starts inherits it."""
    root = tmp_path_factory.mktemp("xdg-cache")
    os.environ["XDG_CACHE_HOME"] = str(root)
    return root


SHARED: list[Head] = []
"""The shared head once a test asked for it: head_left_free looks at it after each file."""


@pytest.fixture(scope="session")
def ray_head() -> Head:
    with local_head(num_cpus=HEAD_CPUS) as head:
        SHARED.append(head)
        yield head
        SHARED.clear()


@dataclass(frozen=True)
class S3:
    """A real S3 server, moto's server mode, on this machine: its endpoint, and the environment that
    points a driver at it (credentials, endpoint, region), with a bucket `runs` made."""

    endpoint: str
    env: dict[str, str]


@pytest.fixture(scope="session")
def s3_server() -> S3:
    """One S3 server for the session (per xdist worker), on a free port, as Ray's own tests start one."""
    import boto3
    from moto.server import ThreadedMotoServer

    port = free_port("127.0.0.1")
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_ENDPOINT_URL_S3": endpoint,
           "AWS_REGION": "us-east-1"}
    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="testing",
                 aws_secret_access_key="testing").create_bucket(Bucket="runs")
    try:
        yield S3(endpoint, env)
    finally:
        server.stop()


@pytest.fixture
def store_env(s3_server: S3, monkeypatch: pytest.MonkeyPatch) -> S3:
    """This process pointed at the test's S3 server, as a user's shell would be."""
    for key, value in s3_server.env.items():
        monkeypatch.setenv(key, value)
    return s3_server


HELD_AFTER = """
import json, sys, time
import ray
from ray._private.state import state
from ray.core.generated.gcs_pb2 import PlacementGroupTableData
from ray.util.placement_group import PlacementGroup, remove_placement_group
from raytrain_ddp.ray_compat.state import placement_group_records
ray.init(logging_level="ERROR", log_to_driver=False)
me = ray.get_runtime_context().get_job_id()
deadline = time.monotonic() + float(sys.argv[1])
while True:  # a driver that just exited: the GCS ends its job, then removes its groups, in a second or so
    held = [g for g in placement_group_records()
            if g.state != PlacementGroupTableData.REMOVED and g.creator_job_id.hex() != me]
    if not held or time.monotonic() > deadline:
        break
    time.sleep(0.5)
jobs = {job["JobID"]: job for job in state.job_table()}
said = []
for g in held:
    job = jobs.get(g.creator_job_id.hex(), {})
    ended = g.creator_job_dead or job.get("IsDead", False)
    if ended:  # Ray will never free it: free it, so that only the file that left it fails
        remove_placement_group(PlacementGroup(ray.PlacementGroupID(g.placement_group_id)))
    said.append({"group": g.placement_group_id.hex(), "job": g.creator_job_id.hex(), "ended": ended,
                 "pid": job.get("DriverPid"), "entrypoint": job.get("Entrypoint")})
print(json.dumps(said))
"""


@pytest.fixture(scope="module", autouse=True)
def head_left_free(request: pytest.FixtureRequest):
    """After each file that used the shared head: no placement group left on it. One left holds the
    head's CPUs, so every later run on this worker is refused (ci54 failed 25 tests so, and said
    nothing of the file that left it). This names the job that made it, and frees it (removes a
    group whose job has ended, kills a driver this session started), so that the file that left it
    is the one that fails."""
    yield
    if not SHARED or not any("ray_head" in item.fixturenames for item in request.session.items
                             if item.module is request.module):
        return
    check = subprocess.run([sys.executable, "-c", HELD_AFTER, "10"], env=SHARED[0].env, capture_output=True,
                           text=True, timeout=120)
    assert check.returncode == 0, check.stderr[-2000:]
    held = json.loads(check.stdout.strip().splitlines()[-1])
    if not held:
        return
    said = []
    for group in held:
        pid = group["pid"]
        ours = not group["ended"] and bool(pid) and started_by(pid, os.getpid())
        if ours:
            os.kill(pid, signal.SIGKILL)
        how = ("its job has ended: removed" if group["ended"] else
               f"its driver, pid {pid}, {'was ours: killed' if ours else 'is not of this session'}")
        said.append(f"group {group['group']} of job {group['job']} ({how}): {group['entrypoint']}")
    pytest.fail(f"{request.module.__name__} left a placement group on the shared head: {'; '.join(said)}")


def started_by(pid: int, ancestor: int) -> bool:
    """Whether `pid` is alive and descends from `ancestor`, from /proc."""
    while pid > 1:
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            return False
        if pid == ancestor:
            return True
    return False


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


def refusal(proc: subprocess.CompletedProcess) -> str:
    """The one line a refused command printed, after checking it is one, with exit status 2."""
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-2000:]
    return lines[0]


RAY_LOG_LINE = re.compile(r"^\[\d{4}-\d\d-\d\d [\d:,]+ [DIWEF] \d+ \d+\] \S+\.(cc|h):\d+:")
"""A line of Ray's C++ log, as its core writes it on stderr (`[2026-11-28 21:58:22,760 W 2953 2953] gcs_client.cc:205: ...`)."""
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
