"""Nodes a run found bad: the health check's, a stall's culprit's, a rank's that crashed through no
fault of its code. Kept in the run's bad_nodes.json (the history) and, under slurm/ray_cluster.sbatch,
passed to the batch script, which requeues the job without them."""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from raytrain_ddp.errors import OOM_MARKERS, one_line
from raytrain_ddp.stops import NodeFailed

BAD_NODES = "bad_nodes.json"
"""In the run dir: every node recorded bad, oldest first; nothing ever removes one."""
SLURM_LIST_ENV = "RAYTRAIN_BAD_NODES"
"""A file the sbatch names for the job's command: each host recorded is added as a line, and the
sbatch excludes those when it requeues the job. Set only under the sbatch."""


@dataclass(frozen=True)
class BadNode:
    """One node found bad, as bad_nodes.json lists it."""

    host: str
    why: str
    """What was seen, in one line."""
    at: str
    """When (UTC, ISO 8601)."""
    slurm_job: str | None = None
    """The Slurm job it was seen in, if any."""
    slurm_restart: int | None = None
    """... and how often that job had been requeued then."""


def record_bad_node(run_dir: Path, host: str, why: str) -> None:
    """Add `host` to the run's bad_nodes.json and, under the sbatch, to the job's list to exclude."""
    job = os.environ.get("SLURM_JOB_ID")
    node = BadNode(host, why, time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), job,
                   int(os.environ.get("SLURM_RESTART_COUNT", "0")) if job else None)
    path = run_dir / BAD_NODES
    earlier = read_bad_nodes(run_dir)
    if not earlier and path.exists():
        path.replace(path.with_suffix(".json.unreadable"))  # kept aside, not overwritten
    path.parent.mkdir(parents=True, exist_ok=True)
    part = path.with_suffix(".json.part")
    part.write_text(json.dumps([asdict(old) for old in [*earlier, node]], indent=1) + "\n")
    part.replace(path)  # whole or not at all: a write cut short never costs the history
    if listed := os.environ.get(SLURM_LIST_ENV):
        with open(listed, "a") as out:
            out.write(f"{host}\n")


def read_bad_nodes(run_dir: Path) -> list[BadNode]:
    """The run's history of bad nodes; empty when it has none, or none that reads."""
    try:
        records = json.loads((run_dir / BAD_NODES).read_text())
        return [BadNode(**record) for record in records]
    except (OSError, ValueError, TypeError):
        return []


def bad_hosts(run_dir: Path) -> list[str]:
    """Every host the run recorded bad, each once, in the order first recorded."""
    return list(dict.fromkeys(node.host for node in read_bad_nodes(run_dir)))


def stall_hosts(culprits: list[int], hosts: list[str]) -> list[str]:
    """The nodes of a stall's culprit ranks (`hosts`: each rank's, by rank), when they stand apart:
    culprits on every node say nothing against any one node."""
    named = list(dict.fromkeys(hosts[rank] for rank in culprits if rank < len(hosts)))
    return named if named and len(named) < len(set(hosts)) else []


def node_fault(cause: BaseException) -> str | None:
    """Why a rank's failure is its node's fault, or None when it is not.

    A rank's process that died (a signal: SIGKILL, SIGSEGV, SIGBUS) or whose node died shows as Ray's
    actor error, under Ray Train's health check; an exception of the rank's own Python code is carried
    as itself, and would recur on any node. Ray's own memory monitor killing a rank is the batch
    size's fault, not the node's."""
    from ray.exceptions import NodeDiedError, RayActorError, RaySystemError

    seen: set[int] = set()
    err: BaseException | None = cause
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        text = f"{type(err).__name__}: {err}"
        if any(marker in text for marker in OOM_MARKERS):
            return None
        if isinstance(err, NodeDiedError) or "node has died" in text:
            return "its node died under the run"
        if isinstance(err, RayActorError) and not err.actor_init_failed:
            return "its process died (killed by a signal, or its node failed), not by an exception of its code"
        if isinstance(err, RaySystemError):
            return "its node's Ray failed under the run"
        err = getattr(err, "health_check_failure", None) or err.__cause__
    return None


def crash_hosts(error: BaseException, hosts: list[str]) -> list[tuple[str, str]]:
    """(host, why) for each failed rank of `error` (Ray Train's WorkerGroupError) that its node
    caused, once per host; `hosts`: each rank's, by rank."""
    found: dict[str, str] = {}
    failures: dict[int, Any] = getattr(error, "worker_failures", None) or {}
    for rank, cause in sorted(failures.items()):
        if rank < len(hosts) and isinstance(cause, BaseException) and (why := node_fault(cause)):
            found.setdefault(hosts[rank], f"rank {rank} on {hosts[rank]}: {why}")
    return list(found.items())


def requeue_asked() -> bool:
    """The command runs under slurm/ray_cluster.sbatch, which requeues the job without the nodes
    recorded (exit EXIT_BAD_NODE); elsewhere a run that failed exits as failed."""
    return bool(os.environ.get(SLURM_LIST_ENV))


def blame(run_dir: Path, failure: BaseException, found: list[tuple[str, str]], hosts: list[str]) -> BaseException:
    """The run's end for `failure`: with nodes to blame (`found`: host, why; `hosts`: every rank's), a
    NodeFailed saying them, after they are recorded; with none, `failure` itself."""
    if not found or (len({host for host, _ in found}) == len(set(hosts)) and not requeue_asked()):
        # Every node of the run is blamed (a laptop's one node): there is no other to run on, so the
        # failure is said as it is; under the sbatch the job may still get other nodes.
        return failure
    for host, why in found:
        record_bad_node(run_dir, host, why)
    hosts = [host for host, _ in found]
    # A crash's first failed rank may be a peer that only lost the dead one: say the node's fault instead.
    said = f"training failed: {found[0][1]}" if getattr(failure, "worker_failures", None) else one_line(failure)
    then = ("the Slurm job requeues without it" if requeue_asked()
            else f"leave it out of the next run (on Slurm: sbatch --exclude={','.join(hosts)})")
    return NodeFailed(f"{said}; {', '.join(hosts)} recorded bad in {run_dir / BAD_NODES}: {then}",
                      hosts, at_once=getattr(failure, "at_once", False))
