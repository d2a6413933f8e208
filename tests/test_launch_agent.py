"""torchrun's environment for each rank, from where Ray placed the ranks; the script's output and
its stop, on real child processes (no Ray); the hub's rendezvous at scale, on the shared head."""

from __future__ import annotations

import io
import signal
import subprocess
import sys
import threading
import time

import pytest
from conftest import REPO

from raytrain_ddp.launch.agent import child_env, torchrun_env
from raytrain_ddp.launch.hub import TEARDOWN_WAIT_S, Attempt
from raytrain_ddp.launch.output import mark
from raytrain_ddp.launch.records import TEARDOWN_ABORT, RankExit, ScriptError, StopReason, exit_status
from raytrain_ddp.launch.supervisor import Stopper, pump


def peer(rank: int, node_rank: int, local_rank: int, gpus: list[str], ip: str, port: int | None = None) -> dict:
    return {"rank": rank, "node_rank": node_rank, "local_rank": local_rank, "gpus": gpus, "ip": ip, "port": port}


# Two nodes of two GPUs each. Ray gave rank 1 the node's GPU 5 and rank 0 its GPU 2.
PEERS = [
    peer(0, 0, 0, ["2"], "10.0.0.1", 29517),
    peer(1, 0, 1, ["5"], "10.0.0.1"),
    peer(2, 1, 0, ["0"], "10.0.0.2"),
    peer(3, 1, 1, ["1"], "10.0.0.2"),
]


def test_ranks_nodes_and_rendezvous():
    env = torchrun_env(3, PEERS, attempt=2, max_restarts=3, run_id="exp")
    assert env["RANK"] == "3" and env["WORLD_SIZE"] == "4"
    assert env["LOCAL_RANK"] == "1" and env["LOCAL_WORLD_SIZE"] == "2"
    assert env["NODE_RANK"] == env["GROUP_RANK"] == "1" and env["GROUP_WORLD_SIZE"] == "2"
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("10.0.0.1", "29517")  # rank 0's node and port
    assert env["TORCHELASTIC_RESTART_COUNT"] == "1" and env["TORCHELASTIC_MAX_RESTARTS"] == "3"
    assert all(isinstance(v, str) for v in env.values())


def test_cuda_local_rank_is_the_ranks_own_gpu():
    # Each rank sees its node's GPUs in local-rank order, so cuda:LOCAL_RANK is the GPU Ray gave it.
    for rank in range(4):
        env = torchrun_env(rank, PEERS, attempt=1, max_restarts=0, run_id="exp")
        visible = env["CUDA_VISIBLE_DEVICES"].split(",")
        assert visible[int(env["LOCAL_RANK"])] == PEERS[rank]["gpus"][0]
    assert torchrun_env(1, PEERS, 1, 0, "exp")["CUDA_VISIBLE_DEVICES"] == "2,5"


def test_cpu_ranks_get_no_cuda_devices():
    cpu = [peer(0, 0, 0, [], "10.0.0.1", 1234), peer(1, 0, 1, [], "10.0.0.1")]
    assert torchrun_env(1, cpu, 1, 0, "exp")["CUDA_VISIBLE_DEVICES"] == ""  # none, not every GPU of the node


def test_child_env_is_torchruns_not_rays():
    worker = {"PATH": "/bin", "PYTHONBREAKPOINT": "ray.util.rpdb.set_trace", "RANK": "stale"}
    env = child_env(worker, {"RANK": "1"}, "/tmp/e/error.json")
    assert "PYTHONBREAKPOINT" not in env and env["RANK"] == "1" and env["PATH"] == "/bin"
    assert env["TORCHELASTIC_ERROR_FILE"] == "/tmp/e/error.json" and env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
    mine = child_env({"PYTHONBREAKPOINT": "ipdb.set_trace", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}, {}, "f")
    assert mine["PYTHONBREAKPOINT"] == "ipdb.set_trace" and mine["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"
    assert "RAYTRAIN_RUN_DIR" not in mine  # only where the driver named one
    assert child_env({}, {}, "f", "/runs/x")["RAYTRAIN_RUN_DIR"] == "/runs/x"  # where a script's profiler writes


def test_carriage_returns_stay_inside_their_line():
    pending, last = [], {"stdout": ""}
    pump(io.BytesIO(b" 10%\r 50%\r100%\nnext\r\n"), "stdout", pending, last, threading.Lock())
    assert pending == [("stdout", " 10%\r 50%\r100%"), ("stdout", "next")]
    assert last["stdout"] == "next"
    # Each in-place update keeps its rank mark on a terminal; torch's own [rank0]: is not doubled.
    assert mark(0, " 10%\r100%") == "[rank0]:  10%\r[rank0]: 100%"
    assert mark(0, "[rank0]:[W1123 c10d] warning") == "[rank0]: [W1123 c10d] warning"


def test_the_last_line_and_the_stderr_tail_drop_torchs_rank_mark():
    pending, last, tail = [], {"stderr": ""}, __import__("collections").deque(maxlen=3)
    pump(io.BytesIO(b"a\nb\n[rank1]: RuntimeError: x\n"), "stderr", pending, last, threading.Lock(), tail)
    assert last["stderr"] == "RuntimeError: x"  # the driver's error line quotes it with one mark, its own
    assert list(tail) == ["a", "b", "[rank1]: RuntimeError: x"]


def ended(rank: int, code: int, last_line: str = "", at: float = 0.0) -> RankExit:
    return RankExit(rank, code, "n1", "10.0.0.1", last_line, None, ended_at=at, aborted=False)


def test_a_teardown_abort_fails_nothing_once_every_other_rank_exited_0():
    attempt = Attempt(1, world_size=2)
    attempt.exits[0], attempt.arrived[0] = ended(0, -signal.SIGABRT, TEARDOWN_ABORT), time.monotonic()
    assert attempt.excused(0) and attempt.failed_first() is None  # rank 1 may yet exit 0: no peer stop
    attempt.exits[1], attempt.arrived[1] = ended(1, 0), time.monotonic()
    assert attempt.excused(0) and attempt.failed_first() is None


def test_a_teardown_abort_fails_when_a_peer_failed_or_did_not_exit_in_time():
    attempt = Attempt(1, world_size=2)
    attempt.exits[0], attempt.arrived[0] = ended(0, -signal.SIGABRT, TEARDOWN_ABORT, at=1.0), time.monotonic()
    attempt.exits[1], attempt.arrived[1] = ended(1, 1, "RuntimeError: x", at=2.0), time.monotonic()
    assert not attempt.excused(0) and attempt.failed_first() == 0
    late = Attempt(1, world_size=2)
    late.exits[0], late.arrived[0] = ended(0, -signal.SIGABRT, TEARDOWN_ABORT), time.monotonic() - TEARDOWN_WAIT_S
    assert not late.excused(0) and late.failed_first() == 0  # its peer is still running: a real failure
    other = Attempt(1, world_size=2)  # SIGABRT with other last words: an abort of the script's own
    other.exits[0], other.arrived[0] = ended(0, -signal.SIGABRT, "Fatal Python error: Aborted"), time.monotonic()
    other.exits[1], other.arrived[1] = ended(1, 0), time.monotonic()
    assert not other.excused(0) and other.failed_first() == 0
    alone = Attempt(1, world_size=1)  # no peer to vouch that its training ended
    alone.exits[0], alone.arrived[0] = ended(0, -signal.SIGABRT, TEARDOWN_ABORT), time.monotonic()
    assert alone.failed_first() == 0


def test_a_teardown_abort_after_an_uncaught_exception_is_the_exceptions_failure():
    """Both ranks raised, then both aborted in teardown, as gloo's threads can: neither vouches for
    the other, and the run fails with the exception's status 1 and its message."""
    error = ScriptError("RuntimeError: rank 1 failed", "Traceback (most recent call last):")
    attempt = Attempt(1, world_size=2)
    for rank, at in ((1, 1.0), (0, 2.0)):
        attempt.exits[rank] = RankExit(rank, -signal.SIGABRT, "n1", "10.0.0.1", TEARDOWN_ABORT, error,
                                       ended_at=at, aborted=False, raised=True)
        attempt.arrived[rank] = time.monotonic()
    assert not attempt.excused(0) and not attempt.excused(1) and attempt.failed_first() == 1
    first = attempt.exits[1]
    assert first.status == 1 and first.describe() == (
        "raised RuntimeError: rank 1 failed; torch's teardown then aborted it (SIGABRT)")
    clean = ended(0, -signal.SIGABRT, TEARDOWN_ABORT)
    assert clean.teardown_abort and clean.status == 134


def test_the_rank_that_failed_first_is_the_one_that_ended_first():
    attempt = Attempt(1, world_size=3)
    for rank, at in ((0, 5.0), (2, 3.0), (1, 4.0)):  # the order the reports arrived in
        attempt.exits[rank], attempt.arrived[rank] = ended(rank, 1, at=at), time.monotonic()
    assert attempt.failed_first() == 2


def test_exit_status_as_a_shell_reports_it():
    assert exit_status(3) == 3 and exit_status(0) == 0
    assert exit_status(-9) == 137 and exit_status(-15) == 143


STUBBORN = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "signal.signal(signal.SIGINT, signal.SIG_IGN); print('ready', flush=True); time.sleep(60)")
"""A rank that ignores every stop: only the SIGKILL ends it (one that died of the SIGINT itself
would race the kill)."""


def child(code: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, start_new_session=True)
    proc.stdout.readline()  # its handlers are in place
    return proc


def test_a_rank_that_ignores_the_stop_is_killed_after_the_grace():
    proc = child(STUBBORN)
    stopper = Stopper(proc, grace_s=1.0)
    stopper.stop(StopReason.signalled("SIGTERM"))
    stopper.stop(StopReason.signalled("SIGTERM"))  # once only
    started = time.monotonic()
    while proc.poll() is None and time.monotonic() - started < 10:
        stopper.overdue()
        time.sleep(0.05)
    assert proc.returncode == -signal.SIGKILL and time.monotonic() - started >= 0.9


def test_a_kill_does_not_wait_for_the_grace():
    proc = child(STUBBORN)
    stopper = Stopper(proc, grace_s=60.0)
    stopper.stop(StopReason.signalled("SIGINT"))
    stopper.stop(StopReason.signalled("SIGINT", kill=True))  # a second Ctrl-C
    assert proc.wait(timeout=5) == -signal.SIGKILL


def test_a_rank_that_already_exited_is_not_signalled():
    proc = child("print('ready', flush=True)")
    proc.wait()
    stopper = Stopper(proc, grace_s=1.0)
    stopper.stop(StopReason.signalled("SIGTERM"))
    assert stopper.reason is None and proc.returncode == 0


JOIN_ALL = """
import sys, time, ray
from raytrain_ddp.launch.hub import LaunchHub, hub_options
n = int(sys.argv[1])
ray.init(logging_level="ERROR")
hub = LaunchHub.options(**hub_options(n)).remote()
ray.get(hub.take_events.remote())  # the hub is up: time the rendezvous alone
started = time.monotonic()
joins = [hub.join.remote("attempt", rank, n, {}) for rank in range(n)]
done, _ = ray.wait(joins, num_returns=n, timeout=30)
print(len(done), round(time.monotonic() - started, 1))
"""


@pytest.mark.e2e
def test_a_world_larger_than_rays_default_concurrency_meets(ray_head):
    # 1,001 ranks: with Ray's default max_concurrency (1,000) the first 1,000 joins wait for the
    # last, which never runs. A driver of its own, so this process stays unconnected.
    world = 1001
    proc = subprocess.run([sys.executable, "-c", JOIN_ALL, str(world)], env=ray_head.env, cwd=REPO,
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    joined, seconds = proc.stdout.split()
    assert int(joined) == world, f"{joined} of {world} ranks met in {seconds} s"
