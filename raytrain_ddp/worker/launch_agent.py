"""`raytrain launch` on each worker: a small torchrun agent that runs the user's script as a child.

Each Ray Train worker starts the script in its own process, as torchrun's agent does, rather than
running it in the worker: Ray Train calls the train function in a thread, where a script could not
install a SIGTERM handler, `sys.exit(3)` would not be an exit status, and the script's own
`init_process_group` would meet the one Ray Train already made. The child gets torchrun's
environment (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, ...) and a fresh MASTER_PORT that rank 0
found free on its own node, so the script's env:// rendezvous works as under torchrun.

The driver and the agents meet in one `LaunchHub` actor, keyed by worker group: every (re)start of
the group is a new attempt with its own rendezvous, so a restart never meets a dead attempt's peers.
The agents send their output lines through the hub, and learn there, as soon as it happens, that
the driver was signalled or that a peer failed. This module stays light (no torch).
"""

from __future__ import annotations

import asyncio
import ctypes
import io
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from typing import Any

import ray

from raytrain_ddp.ray_compat.state import lost_and_draining_nodes

POLL_S = 0.2
"""How often an agent sends its child's output on."""
WAIT_S = 5.0
"""How long one call that waits for a stop may block in the hub before the agent asks again."""
PEER_FAILED_GRACE_S = 10.0
"""After a peer failed: seconds between SIGTERM and SIGKILL, so no rank waits out a collective."""
RESIZE_MARGIN_S = 15.0
"""Beyond the grace: how long Ray Train's controller waits for the ranks' exits before a resize
(the agents' SIGKILL after the grace, then their reports), so a rank whose agent died already
delays the resize by a bounded time."""
NODE_CHECK_S = 1.0
"""How often the hub asks Ray whether a node of the running attempt died or is being drained."""
RAY_DEBUGGER = "ray.util.rpdb."
"""Ray's debugger hooks, which Ray puts in every worker's (and driver's) PYTHONBREAKPOINT: under
torchrun a script's breakpoint() is pdb's, not Ray's remote debugger."""
PR_SET_PDEATHSIG = 1
SIG_SETMASK = 2
_libc = ctypes.CDLL(None, use_errno=True)
_prctl, _signal, _sigmask = _libc.prctl, _libc.signal, _libc.pthread_sigmask  # loaded before any fork: see _as_torchrun_child
_EMPTY_SIGSET = ctypes.create_string_buffer(128)  # a sigset_t with no signal in it


@ray.remote(num_cpus=0)
class LaunchHub:
    """Where the ranks meet: each attempt's rendezvous, their output on its way to the driver, their exits.

    An attempt is one worker group, named by a key its rank 0 drew: `--max-failures` restarts and
    elastic resizes make new ones, numbered in the order they formed. A stop (the driver was
    signalled) holds for every attempt, current and later; a peer's failure only for its own.
    Async, so agents can wait here for a stop while others send their lines.
    """

    def __init__(self) -> None:
        self.attempts: dict[str, dict[str, Any]] = {}
        self.last: str | None = None
        self.lines: list[tuple[int, str, str]] = []
        self.stop: dict[str, Any] | None = None
        self.changed = asyncio.Event()
        self.watching = False
        self.told_startup = False

    def _attempt(self, key: str, world_size: int) -> dict[str, Any]:
        if key not in self.attempts:
            self.attempts[key] = {"number": len(self.attempts) + 1, "world_size": world_size, "peers": {},
                                  "formed": asyncio.Event(), "exits": {}}
        return self.attempts[key]

    async def join(self, key: str, rank: int, world_size: int, info: dict[str, Any]) -> dict[str, Any]:
        """Wait for every rank of this attempt; return its number and its peers, by rank."""
        if not self.watching:
            self.watching = True
            asyncio.get_running_loop().create_task(self._watch_nodes())
        attempt = self._attempt(key, world_size)
        attempt["peers"][rank] = info
        if len(attempt["peers"]) == world_size:
            before = self.last
            self.last = key
            failed = self.failed_first(before) if before else None
            self.lines.append((-1, "attempt", json.dumps({
                "number": attempt["number"], "world_size": world_size,
                "previous": {"rank": failed, **self.attempts[before]["exits"][failed]} if failed is not None else None,
                "resized": self.attempts[before].get("resize", {}).get("why") if before else None,
            })))
            attempt["formed"].set()
        await attempt["formed"].wait()
        return {"number": attempt["number"], "peers": [attempt["peers"][r] for r in range(world_size)]}

    def started(self, marks: dict[str, float]) -> None:
        """Rank 0's start-up marks (startup.py), once: for the driver's start-up line."""
        if not self.told_startup:
            self.told_startup = True
            self.lines.append((-1, "startup", json.dumps(marks)))

    def output(self, rank: int, lines: list[tuple[str, str]]) -> None:
        self.lines.extend((rank, stream, text) for stream, text in lines)

    def exited(self, key: str, rank: int, outcome: dict[str, Any]) -> None:
        self.attempts[key]["exits"][rank] = outcome
        self._wake()

    def failed_first(self, key: str) -> int | None:
        """The rank whose script failed first, by when it ended, not by when its agent said so: a
        rank that dies takes its peers down within milliseconds, and any of them may report first."""
        exits = self.attempts[key]["exits"] if key in self.attempts else {}
        failed = [(e["ended_at"], r) for r, e in exits.items() if e["code"] and not e["aborted"]]
        return min(failed)[1] if failed else None

    def _abort(self, key: str) -> dict[str, Any] | None:
        if self.stop is not None:
            return self.stop
        if key in self.attempts and "resize" in self.attempts[key]:
            return self.attempts[key]["resize"]
        first = self.failed_first(key)
        if first is not None:
            return {"signal": "SIGTERM", "why": f"rank {first} failed", "peer": True, "kill": False}
        return None

    async def wait_abort(self, key: str, timeout_s: float, known: dict[str, Any] | None = None) -> dict[str, Any] | None:
        """Why this attempt's scripts must stop, as soon as that differs from `known` (what the agent
        already acted on: a second Ctrl-C turns a stop into a kill), or `known` after timeout_s."""
        deadline = time.monotonic() + timeout_s
        while (reason := self._abort(key)) == known and (left := deadline - time.monotonic()) > 0:
            self.changed.clear()
            try:
                await asyncio.wait_for(self.changed.wait(), left)
            except asyncio.TimeoutError:
                break
        return reason

    async def _watch_nodes(self) -> None:
        """A node of the running attempt that Ray drains (a spot reclaim, `ray drain-node`) or lost:
        every rank gets SIGTERM, with the grace, before Ray Train restarts them at the new size, so
        a script can snapshot first, as under torchrun's elastic agent."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(NODE_CHECK_S)
            attempt = self.attempts.get(self.last) if self.last else None
            if attempt is None or "resize" in attempt or len(attempt["exits"]) == attempt["world_size"]:
                continue
            try:
                dead, draining = await loop.run_in_executor(None, lost_and_draining_nodes)
            except Exception:  # the GCS busy or restarting: ask again next time
                continue
            for peer in attempt["peers"].values():
                gone = "lost" if peer["node_id"] in dead else "being drained" if peer["node_id"] in draining else None
                if gone:
                    attempt["resize"] = {"signal": "SIGTERM", "why": f"node {peer['hostname']} ({peer['ip']}) is {gone}",
                                         "peer": False, "kill": False, "resize": True}
                    self._wake()
                    break

    async def resize(self, world_size: int, timeout_s: float) -> None:
        """Ray Train is about to restart the worker group at `world_size` ranks: if the last attempt
        is running and nothing else is stopping it, every rank gets SIGTERM; returns when all have
        exited (their agents SIGKILL a rank after the grace), or after timeout_s."""
        attempt = self.attempts.get(self.last) if self.last else None
        if attempt is None or world_size == attempt["world_size"] or self._abort(self.last) is not None \
                or len(attempt["exits"]) == attempt["world_size"]:
            return  # the first start, or a restart after the attempt already failed or was stopped
        why = (f"room appeared for {world_size} ranks" if world_size > attempt["world_size"]
               else f"only {world_size} ranks fit now")
        attempt["resize"] = {"signal": "SIGTERM", "why": why, "peer": False, "kill": False, "resize": True}
        self._wake()
        deadline = time.monotonic() + timeout_s
        while len(attempt["exits"]) < attempt["world_size"] and time.monotonic() < deadline:
            await asyncio.sleep(POLL_S)

    def request_stop(self, signal_name: str, kill: bool = False) -> None:
        """The driver was signalled: SIGINT goes on as SIGINT, SIGTERM and SIGUSR1 as SIGTERM; `kill`
        (a second Ctrl-C) is SIGKILL at once."""
        forwarded = "SIGINT" if signal_name == "SIGINT" else "SIGTERM"
        self.stop = {"signal": forwarded, "why": f"raytrain got {signal_name}", "peer": False, "kill": kill,
                     "received": signal_name}
        self._wake()

    def _wake(self) -> None:
        self.changed.set()

    def take_lines(self) -> list[tuple[int, str, str]]:
        lines, self.lines = self.lines, []
        return lines

    def outcome(self) -> dict[str, Any]:
        """The last attempt: each rank's exit, the first real failure, and whether a signal stopped it."""
        last = self.attempts.get(self.last) if self.last else None
        return {
            "attempts": len([a for a in self.attempts.values() if a["formed"].is_set()]),
            "world_size": last["world_size"] if last else None,
            "exits": last["exits"] if last else {},
            "failed_first": self.failed_first(self.last) if self.last else None,
            "stop_signal": self.stop["received"] if self.stop else None,
            "peers": [last["peers"].get(r) for r in range(last["world_size"])] if last else [],
        }


def hub_options(world_size: int) -> dict[str, Any]:
    """The hub's actor options for a run of at most `world_size` ranks."""
    # Each rank holds up to two calls in the hub at once: its agent's own (join, which waits for every
    # rank, then wait_abort or exited) and its listener's wait_abort. After a restart the dead
    # attempt's listener calls linger up to WAIT_S beside the new attempt's joins: 3 per rank. A
    # rank's output calls, the driver's and the controller's add a few more: headroom of one per
    # rank and 100. Ray's default for async actors (1,000) would let 1,000 ranks' joins wait for a
    # 1,001st that never runs; the floor keeps small runs as they were.
    return {"max_concurrency": max(1000, 4 * world_size + 100)}


def resize_notice(hub: Any, grace_s: float, world_size: int) -> None:
    """In Ray Train's controller, before it resizes the worker group (an elastic run that found room
    for more ranks, or fits fewer; ray_compat.before_resize): the running scripts get SIGTERM and the
    grace, as under torchrun's elastic agent, where Ray Train alone would kill them outright and lose
    the work since their last snapshot. Returns once they have exited."""
    timeout = grace_s + RESIZE_MARGIN_S
    ray.get(hub.resize.remote(world_size, timeout), timeout=timeout + RESIZE_MARGIN_S)


def torchrun_env(rank: int, peers: list[dict[str, Any]], attempt: int, max_restarts: int, run_id: str) -> dict[str, str]:
    """What torchrun puts in each worker's environment, for the rank `rank` of `peers` (by rank).

    Ray numbers the nodes (node_rank) and the ranks on each node (local_rank). On GPUs each child
    sees all of its node's GPUs in local-rank order, so `torch.cuda.set_device(LOCAL_RANK)` picks its
    own GPU and NCCL can still use peer-to-peer between the ranks of one node. Without GPUs it sees
    none, as torchrun's scripts see none under `--no-cuda` style launches.
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
        "CUDA_VISIBLE_DEVICES": ",".join(gpu for p in local for gpu in p["gpus"]),
    }
    return {k: str(v) for k, v in env.items()}


def child_env(base: dict[str, str], torchrun: dict[str, str], error_file: str, run_dir: str | None = None) -> dict[str, str]:
    """The script's whole environment: the worker's, minus Ray's debugger hook, plus torchrun's, and
    RAYTRAIN_RUN_DIR, the run directory, where a script may put its own outputs (a profiler's traces)."""
    env = {k: v for k, v in base.items() if not (k == "PYTHONBREAKPOINT" and v.startswith(RAY_DEBUGGER))}
    env.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")  # as torchrun: a hung NCCL collective fails
    return {
        **env,
        **torchrun,
        "TORCHELASTIC_ERROR_FILE": error_file,  # where torch's @record writes the script's traceback
        "PYTHONUNBUFFERED": "1",  # lines reach the terminal as they are printed, as they do under torchrun
        **({"RAYTRAIN_RUN_DIR": run_dir} if run_dir else {}),
    }


def free_port() -> int:
    """A port free on this node now, for the script's TCPStore (torchrun picks one the same way)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _as_torchrun_child() -> None:
    """In the child, before exec: SIGKILL when the agent's thread dies, so no script outlives its Ray
    worker; and the signals a script under torchrun can count on. A Ray worker ignores SIGINT and
    its threads may block signals, and both would pass to the script through exec: Ctrl-C would
    never reach it, nor a SIGTERM while it is blocked."""
    # Only calls through already loaded pointers: between fork and exec, in a process full of
    # threads, loading a library could wait forever on a lock another thread held.
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    _sigmask(SIG_SETMASK, _EMPTY_SIGSET, None)
    for sig in (signal.SIGINT, signal.SIGTERM):
        _signal(sig, 0)  # SIG_DFL: Python then installs its own KeyboardInterrupt handler


def shipped_copy(relative: str) -> str:
    """This node's unpacked copy of the shipped directory. Ray Train moves each worker into its run's
    own directory, but Ray keeps the copy first on the worker's PYTHONPATH."""
    for entry in sys.path:
        if entry and os.path.isfile(os.path.join(entry, relative)):
            return entry
    raise RuntimeError(f"the shipped copy of {relative} is not on this worker's PYTHONPATH ({sys.path[:3]} ...)")


def read_error_file(path: str) -> dict[str, str] | None:
    """What torch's @record wrote when the script raised: its message and traceback."""
    try:
        with open(path) as f:
            data = json.load(f)["message"]
        if isinstance(data, str):
            return {"message": data, "traceback": ""}
        return {"message": data["message"], "traceback": data.get("extraInfo", {}).get("py_callstack", "")}
    except (OSError, ValueError, KeyError, TypeError):
        return None


class Stopper:
    """Signals one script once, then SIGKILLs its process group if it is still there after the grace.

    The agent learns of a stop from the hub the moment it is asked for (a waiting call, not a poll),
    so every rank gets the signal within milliseconds of the others: a rank must not learn of the
    stop from its peers' collectives first, exit 0, and then be signalled again while its
    interpreter tears down (its handlers gone), which would kill a clean exit.
    """

    def __init__(self, child: subprocess.Popen, grace_s: float) -> None:
        self.child, self.grace_s = child, grace_s
        self.reason: dict[str, Any] | None = None
        self.kill_at: float | None = None
        self.lock = threading.Lock()

    def stop(self, reason: dict[str, Any]) -> None:
        with self.lock:
            if self.child.poll() is not None:
                return  # it ended on its own: nothing to stop, and no signal to kill a clean exit with
            if reason["kill"]:
                self.reason = self.reason or reason
                self._kill()
                return
            if self.reason is not None:
                return  # signalled once already
            self.reason = reason
            self.child.send_signal(getattr(signal, reason["signal"]))
            grace = PEER_FAILED_GRACE_S if reason["peer"] else self.grace_s
            self.kill_at = time.monotonic() + grace

    def overdue(self) -> None:
        with self.lock:
            if self.kill_at is not None and time.monotonic() > self.kill_at:
                self._kill()

    def _kill(self) -> None:
        self.kill_at = None
        try:
            os.killpg(self.child.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def pump(stream: Any, name: str, pending: list[tuple[str, str]], last: dict[str, str], lock: threading.Lock) -> None:
    """The child's lines, split on newlines only: a `\\r` progress update stays inside its line, as a
    terminal would keep it on one line, not one line per update."""
    for line in io.TextIOWrapper(stream, encoding="utf-8", errors="replace", newline="\n"):
        line = line.rstrip("\n").removesuffix("\r")
        with lock:
            pending.append((name, line))
            shown = line.rsplit("\r", 1)[-1].strip()
            if shown:
                last[name] = shown


def run_script(loop_config: dict[str, Any]) -> None:
    """The train function of `raytrain launch`: rendezvous, run the script, report how it ended."""
    marks = {"workers": time.time()}  # start-up stages (startup.py): Ray Train's start ends here
    import ray.train
    import ray.train.collective

    hub, argv = loop_config["hub"], loop_config["argv"]
    cwd = loop_config["cwd"] or shipped_copy(loop_config["probe"])
    ctx = ray.train.get_context()
    rank, world_size = ctx.get_world_rank(), ctx.get_world_size()

    # [1] Rendezvous, fresh for this worker group: rank 0 names the attempt and finds the port.
    key = ray.train.collective.broadcast_from_rank_zero(uuid.uuid4().hex if rank == 0 else None)
    group = ray.get(hub.join.remote(key, rank, world_size, {
        "rank": rank,
        "local_rank": ctx.get_local_rank(),
        "node_rank": ctx.get_node_rank(),
        "ip": ray.util.get_node_ip_address(),
        "hostname": socket.gethostname(),
        "node_id": ray.get_runtime_context().get_node_id(),
        "gpus": [str(g) for g in ray.get_runtime_context().get_accelerator_ids().get("GPU", [])],
        "port": free_port() if rank == 0 else None,
    }))
    attempt = group["number"]
    marks["rendezvous"] = time.time()
    error_dir = tempfile.mkdtemp(prefix=f"raytrain-{loop_config['run_id']}-attempt{attempt}-rank{rank}-")
    error_file = os.path.join(error_dir, "error.json")
    env = child_env(
        dict(os.environ), torchrun_env(rank, group["peers"], attempt, loop_config["max_restarts"], loop_config["run_id"]),
        error_file, loop_config.get("run_dir"),
    )

    # [2] The script, in its own session, so a stop reaches only it and a kill takes its children too.
    stopped_early = ray.get(hub.wait_abort.remote(key, 0))
    if stopped_early is not None:  # stopped before it started: nothing to signal, nothing lost
        ray.get(hub.exited.remote(key, rank, {
            "code": 0, "ended_at": time.time(), "hostname": socket.gethostname(),
            "ip": ray.util.get_node_ip_address(), "last_line": "", "aborted": stopped_early["peer"],
            "error": None, "started": False,
        }))
        shutil.rmtree(error_dir, ignore_errors=True)
        return
    child = subprocess.Popen(
        [sys.executable, *argv], cwd=cwd, env=env, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, start_new_session=True,
        preexec_fn=_as_torchrun_child,
    )
    if rank == 0:
        marks["script start"] = time.time()
        hub.started.remote(marks)
    pending: list[tuple[str, str]] = []
    last = {"stdout": "", "stderr": ""}
    lock = threading.Lock()
    ended = threading.Event()
    ended_at: list[float] = []
    stopper = Stopper(child, loop_config["stop_grace_s"])

    def wait() -> None:
        child.wait()
        ended_at.append(time.time())  # when, exactly: the driver names the rank that failed first
        ended.set()

    def listen() -> None:
        """Wait in the hub for a reason to stop, and act on it at once."""
        known = None
        while not ended.is_set() and not (known and known["kill"]):
            try:
                reason = ray.get(hub.wait_abort.remote(key, WAIT_S, known))
            except Exception:  # the hub is gone: the driver died, and Ray is about to end this worker
                return
            if reason is not None and reason != known:
                stopper.stop(reason)
                known = reason

    threads = [threading.Thread(target=pump, args=(child.stdout, "stdout", pending, last, lock), daemon=True),
               threading.Thread(target=pump, args=(child.stderr, "stderr", pending, last, lock), daemon=True),
               threading.Thread(target=wait, daemon=True),
               threading.Thread(target=listen, daemon=True)]
    for t in threads:
        t.start()

    def flush() -> None:
        with lock:
            batch = pending[:]
            pending.clear()
        if batch:
            hub.output.remote(rank, batch)

    # [3] Watch it: pass its output on; SIGKILL it if a stop's grace ran out.
    try:
        while not ended.wait(POLL_S):
            flush()
            stopper.overdue()
    finally:
        if not ended.is_set():  # the agent itself is being torn down
            os.killpg(child.pid, signal.SIGKILL)
            ended.wait()
    for t in threads[:2]:
        t.join(timeout=5)
    flush()

    # [4] Report. A failure of our own raises, so Ray Train restarts the group (--max-failures).
    code = child.returncode
    aborted = stopper.reason
    peer_failed = aborted is not None and aborted["peer"]
    resized = aborted is not None and aborted.get("resize", False)
    error = read_error_file(error_file)
    shutil.rmtree(error_dir, ignore_errors=True)
    ray.get(hub.exited.remote(key, rank, {
        "code": code, "ended_at": ended_at[0], "hostname": socket.gethostname(),
        "ip": ray.util.get_node_ip_address(), "last_line": last["stderr"] or last["stdout"],
        "aborted": peer_failed or resized, "error": error, "started": True,
    }))
    if code != 0 and aborted is None:
        raise RuntimeError(f"rank {rank} exited with {describe_exit(code)}")
    if peer_failed or resized:  # Ray Train restarts the group, at the new size if a node went
        raise RuntimeError(f"rank {rank} stopped because {aborted['why']}")


def describe_exit(code: int) -> str:
    if code < 0:
        return f"signal {signal.Signals(-code).name}"
    return f"status {code}"


def exit_status(code: int) -> int:
    """A child's returncode as a shell would report it: -9 (killed by SIGKILL) is 137."""
    return 128 - code if code < 0 else code
