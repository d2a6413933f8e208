"""doctor/bad_nodes.py: the run's bad_nodes.json, which failures blame a node, and a crashed rank's node
recorded and handed to the sbatch (exit 3) by a real run on the shared local Ray."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from ray.exceptions import ActorDiedError
from ray.train.v2.api.exceptions import WorkerGroupError

from conftest import TINY, wait_for
from raytrain_ddp.doctor.bad_nodes import (
    BAD_NODES,
    SLURM_LIST_ENV,
    bad_hosts,
    blame,
    crash_hosts,
    node_fault,
    read_bad_nodes,
    record_bad_node,
    stall_hosts,
)
from raytrain_ddp.errors import EXIT_BAD_NODE
from raytrain_ddp.stops import NodeFailed


def test_the_history_is_kept_and_each_host_listed_once(tmp_path: Path, monkeypatch) -> None:
    listed = tmp_path / "for-sbatch"
    monkeypatch.setenv(SLURM_LIST_ENV, str(listed))
    monkeypatch.setenv("SLURM_JOB_ID", "41")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "2")
    record_bad_node(tmp_path / "run", "n3", "GEMM 3.1 GFLOPS, median 24.0")
    monkeypatch.delenv("SLURM_JOB_ID")
    record_bad_node(tmp_path / "run", "n1", "a stall's culprit")
    record_bad_node(tmp_path / "run", "n3", "rank 2 failed")

    assert bad_hosts(tmp_path / "run") == ["n3", "n1"]
    first, second, _ = read_bad_nodes(tmp_path / "run")
    assert (first.host, first.why) == ("n3", "GEMM 3.1 GFLOPS, median 24.0")
    assert (first.slurm_job, first.slurm_restart) == ("41", 2)
    assert (second.slurm_job, second.slurm_restart) == (None, None) and second.at.endswith("Z")
    assert listed.read_text() == "n3\nn1\nn3\n"
    assert bad_hosts(tmp_path / "none") == []
    (tmp_path / "torn" / BAD_NODES).parent.mkdir()
    (tmp_path / "torn" / BAD_NODES).write_text('[{"host": "n')
    record_bad_node(tmp_path / "torn", "n2", "a stall's culprit")
    assert bad_hosts(tmp_path / "torn") == ["n2"]
    assert (tmp_path / "torn" / "bad_nodes.json.unreadable").read_text() == '[{"host": "n'


def test_a_stall_blames_its_culprits_nodes_only_when_they_stand_apart() -> None:
    hosts = ["n1", "n1", "n2", "n2"]
    assert stall_hosts([2], hosts) == ["n2"]
    assert stall_hosts([2, 3], hosts) == ["n2"]
    assert stall_hosts([1, 2], hosts) == []  # a culprit on every node says nothing of any one
    assert stall_hosts([], hosts) == []
    assert stall_hosts([0], ["n1"]) == []  # one node: nothing to move to


def failed_with(err: BaseException, cause: BaseException) -> BaseException:
    err.__cause__ = cause
    return err


def test_a_dead_rank_process_is_its_nodes_fault_and_its_codes_exception_is_not() -> None:
    died = failed_with(RuntimeError("worker 1 failed its health check"), ActorDiedError())
    assert "process died" in node_fault(died)
    assert node_fault(ValueError("bad shape")) is None  # its own code's: the real run's path is the e2e below
    oom = failed_with(RuntimeError("Task was killed due to the node running low on memory"), ActorDiedError())
    assert node_fault(oom) is None  # the batch size's fault, not the node's

    failed = WorkerGroupError("training failed", {0: ValueError("bad shape"), 1: died, 2: died})
    assert crash_hosts(failed, ["n1", "n2", "n2"]) == [("n2", "rank 1 on n2: " + node_fault(died))]
    assert crash_hosts(RuntimeError("no ranks"), ["n1"]) == []


def test_blame_records_and_names_the_nodes_or_leaves_the_failure_alone(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv(SLURM_LIST_ENV, raising=False)
    failure = RuntimeError("the run stalled")
    assert blame(tmp_path, failure, [], ["n1", "n2"]) is failure and not (tmp_path / BAD_NODES).exists()
    # A laptop's one node: there is no other to run on, so nothing is recorded and the failure is said as it is.
    assert blame(tmp_path, failure, [("vm", "a crash")], ["vm", "vm"]) is failure and not (tmp_path / BAD_NODES).exists()
    ended = blame(tmp_path, failure, [("n2", "a stall's culprit")], ["n1", "n2"])
    assert isinstance(ended, NodeFailed) and ended.hosts == ["n2"]
    assert str(ended) == (f"the run stalled; n2 recorded bad in {tmp_path / BAD_NODES}: leave it out of the next "
                          "run (on Slurm: sbatch --exclude=n2)")
    assert bad_hosts(tmp_path) == ["n2"]


def test_a_rank_killed_by_a_signal_records_its_node_and_exits_for_the_sbatch(ray_head, tmp_path: Path) -> None:
    """What the sbatch sees when a node kills a rank: the host in its list, exit 3, one line."""
    listed = tmp_path / "for-sbatch"
    listed.touch()
    env = {**ray_head.env, SLURM_LIST_ENV: str(listed)}
    run_dir = tmp_path / "crash"
    proc = subprocess.Popen(
        [sys.executable, "-m", "raytrain_ddp", "run", *TINY, "--workers", "2", "--epochs", "3",
         "--train-samples", "4096", "--storage-path", str(tmp_path), "--name", "crash"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    wait_for(run_dir / "workers.json", proc)
    victim = json.loads((run_dir / "workers.json").read_text())["ranks"][1]
    os.kill(victim["pid"], signal.SIGKILL)
    _, err = proc.communicate(timeout=300)
    host = victim.get("host") or victim["hostname"]
    assert proc.returncode == EXIT_BAD_NODE, err[-3000:]
    assert listed.read_text() == f"{host}\n"
    assert bad_hosts(run_dir) == [host]
    why = read_bad_nodes(run_dir)[0].why
    assert why.startswith(f"rank 1 on {host}: its process died"), why
    line = [line for line in err.splitlines() if line.startswith("error:")]
    assert line == [f"error: training failed: {why}; {host} recorded bad in {run_dir / BAD_NODES}: "
                    "the Slurm job requeues without it"], err[-3000:]
    assert "Traceback" not in err
