"""`raytrain launch` on each worker: a small torchrun agent that runs the user's script as a child.

Each Ray Train worker starts the script in its own process, as torchrun's agent does, rather than
running it in the worker: Ray Train calls the train function in a thread, where a script could not
install a SIGTERM handler, `sys.exit(3)` would not be an exit status, and the script's own
`init_process_group` would meet the one Ray Train already made. The child gets torchrun's
environment (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, ...) and a fresh MASTER_PORT that rank 0
found free on its own node, so the script's env:// rendezvous works as under torchrun.

The driver and the agents meet in one `LaunchHub` actor: the agents agree on the rendezvous there,
send their output lines through it, and learn there that a peer failed or that the driver was
signalled. This module stays light (no torch): the agents only watch a process.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any

import ray

POLL_S = 0.2
"""How often an agent sends its child's output on and asks whether to stop."""
KILL_GRACE_S = 10.0
"""After a peer failed: seconds between SIGTERM and SIGKILL to this rank's script."""
PR_SET_PDEATHSIG = 1
_prctl = ctypes.CDLL(None, use_errno=True).prctl  # loaded before any fork: see _die_with_parent


@ray.remote(num_cpus=0)
class LaunchHub:
    """Where the ranks meet: the rendezvous, their output on its way to the driver, their exits.

    An attempt is one worker group; `--max-failures` restarts make new ones. A rank's exit is
    (code, hostname, last line); `aborted` marks a script its agent killed because a peer failed, so
    the driver can name the rank that failed first.
    """

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.attempt = 0
        self.joined: dict[int, dict[str, Any]] = {}
        self.lines: list[tuple[int, str, str]] = []
        self.exits: dict[int, dict[int, dict[str, Any]]] = {}
        self.stop_signal: str | None = None

    def join(self, rank: int, info: dict[str, Any]) -> None:
        if len(self.joined) == self.world_size:  # the previous group is gone: a restart
            self.joined = {}
        self.joined[rank] = info
        if len(self.joined) == self.world_size:
            self.attempt += 1
            self.lines.append((-1, "attempt", str(self.attempt)))

    def group(self) -> dict[str, Any] | None:
        if len(self.joined) < self.world_size:
            return None
        return {"attempt": self.attempt, "peers": [self.joined[r] for r in range(self.world_size)]}

    def output(self, rank: int, lines: list[tuple[str, str]]) -> None:
        self.lines.extend((rank, stream, text) for stream, text in lines)

    def exited(self, attempt: int, rank: int, outcome: dict[str, Any]) -> None:
        self.exits.setdefault(attempt, {})[rank] = outcome

    def failed_first(self, attempt: int) -> int | None:
        """The rank whose script failed first, by when it ended, not by when its agent said so: a
        rank that dies takes its peers down within milliseconds, and any of them may report first."""
        failed = [(e["ended_at"], r) for r, e in self.exits.get(attempt, {}).items() if e["code"] and not e["aborted"]]
        return min(failed)[1] if failed else None

    def abort_reason(self, attempt: int) -> tuple[str, str] | None:
        """("stop", signal name) once the driver was signalled, ("peer", why) once a rank failed."""
        if self.stop_signal is not None:
            return "stop", self.stop_signal
        first = self.failed_first(attempt)
        return None if first is None else ("peer", f"rank {first} failed")

    def request_stop(self, signal_name: str) -> None:
        self.stop_signal = signal_name

    def take_lines(self) -> list[tuple[int, str, str]]:
        lines, self.lines = self.lines, []
        return lines

    def outcome(self) -> dict[str, Any]:
        """The last attempt: each rank's exit, the first real failure, and whether a signal stopped it."""
        return {
            "attempts": self.attempt,
            "exits": self.exits.get(self.attempt, {}),
            "failed_first": self.failed_first(self.attempt),
            "stop_signal": self.stop_signal,
            "peers": [self.joined.get(r) for r in range(self.world_size)],
        }


def torchrun_env(rank: int, peers: list[dict[str, Any]], attempt: int, max_restarts: int, run_id: str) -> dict[str, str]:
    """What torchrun puts in each worker's environment, for the rank `rank` of `peers` (by rank).

    Ray numbers the nodes (node_rank) and the ranks on each node (local_rank). On GPUs each child
    sees all of its node's GPUs in local-rank order, so `torch.cuda.set_device(LOCAL_RANK)` picks its
    own GPU and NCCL can still use peer-to-peer between the ranks of one node.
    """
    me = peers[rank]
    local = sorted((p for p in peers if p["node_rank"] == me["node_rank"]), key=lambda p: p["local_rank"])
    nodes = len({p["node_rank"] for p in peers})
    env = {
        "RANK": rank,
        "WORLD_SIZE": len(peers),
        "LOCAL_RANK": me["local_rank"],
        "LOCAL_WORLD_SIZE": len(local),
        "GROUP_RANK": me["node_rank"],
        "NODE_RANK": me["node_rank"],
        "GROUP_WORLD_SIZE": nodes,
        "ROLE_RANK": rank,
        "ROLE_WORLD_SIZE": len(peers),
        "ROLE_NAME": "default",
        "MASTER_ADDR": peers[0]["ip"],
        "MASTER_PORT": peers[0]["port"],
        "TORCHELASTIC_RUN_ID": run_id,
        "TORCHELASTIC_RESTART_COUNT": attempt - 1,
        "TORCHELASTIC_MAX_RESTARTS": max_restarts,
    }
    gpus = [gpu for p in local for gpu in p["gpus"]]
    if gpus:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
    return {k: str(v) for k, v in env.items()}


def free_port() -> int:
    """A port free on this node now, for the script's TCPStore (torchrun picks one the same way)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """In the child: SIGKILL when the agent's thread dies, so no script outlives its Ray worker."""
    # Only a call through an already loaded pointer: between fork and exec, in a process full of
    # threads, loading a library could wait forever on a lock another thread held.
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def shipped_copy(relative: str) -> str:
    """This node's unpacked copy of the shipped directory. Ray Train moves each worker into its run's
    own directory, but Ray keeps the copy first on the worker's PYTHONPATH."""
    for entry in sys.path:
        if entry and os.path.isfile(os.path.join(entry, relative)):
            return entry
    raise RuntimeError(f"the shipped copy of {relative} is not on this worker's PYTHONPATH ({sys.path[:3]} ...)")


def run_script(loop_config: dict[str, Any]) -> None:
    """The train function of `raytrain launch`: rendezvous, run the script, report how it ended."""
    import ray.train

    hub, argv = loop_config["hub"], loop_config["argv"]
    cwd = loop_config["cwd"] or shipped_copy(loop_config["probe"])
    ctx = ray.train.get_context()
    rank = ctx.get_world_rank()

    # [1] Rendezvous: who runs where, and rank 0's free port.
    ray.get(hub.join.remote(rank, {
        "rank": rank,
        "local_rank": ctx.get_local_rank(),
        "node_rank": ctx.get_node_rank(),
        "ip": ray.util.get_node_ip_address(),
        "hostname": socket.gethostname(),
        "gpus": [str(g) for g in ray.get_runtime_context().get_accelerator_ids().get("GPU", [])],
        "port": free_port() if rank == 0 else None,
    }))
    while (group := ray.get(hub.group.remote())) is None:
        time.sleep(POLL_S)
    attempt = group["attempt"]
    env = {
        **os.environ,
        **torchrun_env(rank, group["peers"], attempt, loop_config["max_restarts"], loop_config["run_id"]),
        "PYTHONUNBUFFERED": "1",  # lines reach the terminal as they are printed, as they do under torchrun
    }

    # [2] The script, in its own session, so a stop reaches only it and a kill takes its children too.
    child = subprocess.Popen(
        [sys.executable, *argv], cwd=cwd, env=env, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, start_new_session=True,
        preexec_fn=_die_with_parent, text=True, errors="replace", bufsize=1,
    )
    pending: list[tuple[str, str]] = []
    last = {"stdout": "", "stderr": ""}
    lock = threading.Lock()
    ended = threading.Event()
    ended_at: list[float] = []

    def pump(stream: Any, name: str) -> None:
        for line in stream:
            line = line.rstrip("\n")
            with lock:
                pending.append((name, line))
                if line.strip():
                    last[name] = line.strip()

    def wait() -> None:
        child.wait()
        ended_at.append(time.time())  # when, exactly: the driver names the rank that failed first
        ended.set()

    threads = [threading.Thread(target=pump, args=(child.stdout, "stdout"), daemon=True),
               threading.Thread(target=pump, args=(child.stderr, "stderr"), daemon=True),
               threading.Thread(target=wait, daemon=True)]
    for t in threads:
        t.start()

    def flush() -> None:
        with lock:
            batch = pending[:]
            pending.clear()
        if batch:
            hub.output.remote(rank, batch)

    # [3] Watch it: pass its output on; stop it when the driver is signalled or a peer failed.
    aborted, killed_at = None, None
    try:
        while not ended.wait(POLL_S):
            flush()
            reason = ray.get(hub.abort_reason.remote(attempt))
            if reason is not None and aborted is None:
                aborted = reason
                # A stop (Slurm's notice, scancel) is SIGTERM to the script, which may checkpoint as
                # long as it likes; a failed peer leaves this rank waiting in a collective forever.
                child.send_signal(signal.SIGTERM)
                killed_at = time.monotonic() + KILL_GRACE_S if reason[0] == "peer" else None
            if killed_at is not None and time.monotonic() > killed_at:
                os.killpg(child.pid, signal.SIGKILL)
                killed_at = None
    finally:
        if not ended.is_set():  # the agent itself is being torn down
            os.killpg(child.pid, signal.SIGKILL)
            ended.wait()
    for t in threads:
        t.join(timeout=5)
    flush()

    # [4] Report. A failure of our own raises, so Ray Train restarts the group (--max-failures).
    code = child.returncode
    peer_failed = aborted is not None and aborted[0] == "peer"
    ray.get(hub.exited.remote(attempt, rank, {
        "code": code, "ended_at": ended_at[0], "hostname": socket.gethostname(),
        "ip": ray.util.get_node_ip_address(), "last_line": last["stderr"] or last["stdout"],
        "aborted": peer_failed,
    }))
    if code != 0 and aborted is None:
        raise RuntimeError(f"rank {rank} exited with {describe_exit(code)}")
    if peer_failed:
        raise RuntimeError(f"rank {rank} stopped because {aborted[1]}")


def describe_exit(code: int) -> str:
    if code < 0:
        return f"signal {signal.Signals(-code).name}"
    return f"status {code}"


def exit_status(code: int) -> int:
    """A child's returncode as a shell would report it: -9 (killed by SIGKILL) is 137."""
    return 128 - code if code < 0 else code
