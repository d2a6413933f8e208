"""`raytrain launch` on each worker: a small torchrun agent that runs the user's script as a child.

Each Ray Train worker starts the script in its own process, as torchrun's agent does, rather than
running it in the worker: Ray Train calls the train function in a thread, where a script could not
install a SIGTERM handler, `sys.exit(3)` would not be an exit status, and the script's own
`init_process_group` would meet the one Ray Train already made. The child gets torchrun's
environment (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, ...) and a fresh MASTER_PORT that rank 0
found free on its own node, so the script's env:// rendezvous works as under torchrun.

The agents meet in the driver's `LaunchHub` actor (launch/hub.py), which they reach only through
the handle the driver passed: there they rendezvous, send the script's lines and learn when to stop
it. The child itself is supervisor.py's.
"""

from __future__ import annotations

import os
import shutil
import socket
import sys
import tempfile
import threading
import time
import uuid
from typing import Any

import ray
import ray.train
import ray.train.collective

from raytrain_ddp.launch.records import RankExit, ScriptError, describe_exit
from raytrain_ddp.launch.supervisor import Child
from raytrain_ddp.net import free_port

POLL_S = 0.2
"""How often an agent sends its child's output on."""
WAIT_S = 5.0
"""How long one call that waits for a stop may block in the hub before the agent asks again."""
RAY_DEBUGGER = "ray.util.rpdb."
"""Ray's debugger hooks, which Ray puts in every worker's (and driver's) PYTHONBREAKPOINT: under
torchrun a script's breakpoint() is pdb's, not Ray's remote debugger."""


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


def shipped_copy(relative: str) -> str:
    """This node's unpacked copy of the shipped directory. Ray Train moves each worker into its run's
    own directory, but Ray keeps the copy first on the worker's PYTHONPATH."""
    for entry in sys.path:
        if entry and os.path.isfile(os.path.join(entry, relative)):
            return entry
    raise RuntimeError(f"the shipped copy of {relative} is not on this worker's PYTHONPATH ({sys.path[:3]} ...)")


def whereabouts(ctx: Any, rank: int) -> dict[str, Any]:
    """This rank, for the rendezvous: where Ray placed it, and rank 0's free port for the script's store."""
    return {
        "rank": rank,
        "local_rank": ctx.get_local_rank(),
        "node_rank": ctx.get_node_rank(),
        "ip": ray.util.get_node_ip_address(),
        "hostname": socket.gethostname(),
        "node_id": ray.get_runtime_context().get_node_id(),
        "gpus": [str(g) for g in ray.get_runtime_context().get_accelerator_ids().get("GPU", [])],
        "port": free_port() if rank == 0 else None,
    }


def report_exit(hub: Any, key: str, rank: int, code: int, ended_at: float, aborted: bool,
                last_line: str = "", error: ScriptError | None = None, ran: bool = True,
                raised: bool = False) -> RankExit:
    """Tell the hub how this rank's script ended; code 0 and not `ran` for one stopped before it started."""
    end = RankExit(
        rank=rank, code=code, hostname=socket.gethostname(), ip=ray.util.get_node_ip_address(),
        last_line=last_line, error=error, ended_at=ended_at, aborted=aborted, ran=ran, raised=raised,
    )
    ray.get(hub.exited.remote(key, end))
    return end


def listen(hub: Any, key: str, child: Child) -> None:
    """Wait in the hub for a reason to stop the script, and act on it at once."""
    known = None
    while not child.ended.is_set() and not (known is not None and known.kill):
        try:
            reason = ray.get(hub.wait_abort.remote(key, WAIT_S, known))
        except Exception:  # the hub is gone: the driver died, and Ray is about to end this worker
            return
        if reason is not None and reason != known:
            child.stopper.stop(reason)
            known = reason


def run_script(loop_config: dict[str, Any]) -> None:
    """The train function of `raytrain launch`: rendezvous, run the script, report how it ended."""
    marks = {"workers": time.time()}  # start-up stages (startup.py): Ray Train's start ends here
    hub, argv = loop_config["hub"], loop_config["argv"]
    cwd = loop_config["cwd"] or shipped_copy(loop_config["probe"])
    ctx = ray.train.get_context()
    rank, world_size = ctx.get_world_rank(), ctx.get_world_size()

    # [1] Rendezvous, fresh for this worker group: rank 0 names the attempt and finds the port.
    key = ray.train.collective.broadcast_from_rank_zero(uuid.uuid4().hex if rank == 0 else None)
    group = ray.get(hub.join.remote(key, rank, world_size, whereabouts(ctx, rank)))
    attempt = group["number"]
    marks["rendezvous"] = time.time()
    stopped_early = ray.get(hub.wait_abort.remote(key, 0))
    if stopped_early is not None:  # stopped before it started: nothing to signal, nothing lost
        report_exit(hub, key, rank, 0, time.time(), aborted=stopped_early.cause == "peer", ran=False)
        return

    # [2] The script, as torchrun's child, with a fresh error file for torch's @record.
    error_dir = tempfile.mkdtemp(prefix=f"raytrain-{loop_config['run_id']}-attempt{attempt}-rank{rank}-")
    error_file = os.path.join(error_dir, "error.json")
    env = child_env(
        dict(os.environ), torchrun_env(rank, group["peers"], attempt, loop_config["max_restarts"], loop_config["run_id"]),
        error_file, loop_config.get("run_dir"),
    )
    child = Child(argv, cwd, env, loop_config["stop_grace_s"])
    hub.script_started.remote(key, rank, child.proc.pid)  # for the driver's stall watch and `raytrain stack`
    if rank == 0:
        marks["script start"] = time.time()
        hub.started.remote(marks)
    threading.Thread(target=listen, args=(hub, key, child), daemon=True).start()

    # [3] Watch it: pass its output on; SIGKILL it if a stop's grace ran out.
    sent: list[Any] = []  # the hub's calls for output not yet known done

    def send(batch: list[tuple[str, str]]) -> None:
        pending = ray.wait(sent, num_returns=len(sent), timeout=0)[1] if sent else []
        sent[:] = [*pending, hub.output.remote(rank, batch)]

    code = child.supervise(send, POLL_S)
    # The hub is an async actor, which need not run one caller's calls in order: its last lines
    # must land before its exit does, or the driver tells the attempt's end before its tracebacks.
    ray.get(sent)

    # [4] Report. A failure of our own raises, so Ray Train restarts the group (--max-failures).
    reason = child.stopper.reason
    aborted = reason is not None and reason.cause != "signal"
    error, raised = child.error(error_file) if code != 0 else (None, False)
    shutil.rmtree(error_dir, ignore_errors=True)
    report_exit(hub, key, rank, code, child.ended_at, aborted, child.last_line(), error, raised=raised)
    # A failed rank waits (boundedly) for its peers' exits before it raises: raising now would have Ray
    # Train kill them mid-exit, before their agents say how they ended (the knock-on lines), or, for
    # a teardown abort that fails nothing once they all exit 0 (hub.py's Attempt.excused), mid-teardown.
    if code != 0 and reason is None and not ray.get(hub.excused.remote(key, rank)):
        raise RuntimeError(f"rank {rank} exited with {describe_exit(code)}")
    if aborted:  # Ray Train restarts the group, at the new size if a node went
        raise RuntimeError(f"rank {rank} stopped because {reason.why}")
