"""Ray Train's elastic scaling policy, counting only the nodes that stay.

Ray's policy sizes a (re)start by what its AutoscalingCoordinator reserved for the run, and that
counts every node the GCS calls alive: a node that Ray is draining (a spot reclaim, `ray drain-node`)
until it goes, and a node whose Ray was killed until the GCS has missed its heartbeats for a while.
So the restart at a drain's deadline, or a second after a lost node, asked for a worker on that
node; its placement group could never be placed, and the run sat out Ray Train's worker-group start
timeout before it started smaller (docs: "Never lose work").

The count is a guess that helps, never one that can stop a run: where it fails (a GCS query while
nodes die), or where Ray hands the policy no node ids (before 2.60), Ray's own count decides.

This module must not import torch: the controller unpickles from it.
"""

from __future__ import annotations

import logging
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ray.train.v2._internal.execution.scaling_policy import ElasticScalingPolicy, NoopDecision, ResizeDecision

from raytrain_ddp.ray_compat.state import lost_and_draining_nodes

logger = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 1.0
"""How long a count waits for a node's raylet to accept a connection before it counts the node gone."""
CACHE_S = 1.0
"""How long one look at the leaving nodes serves: while the controller waits for workers it asks for
a count back to back, and each look costs GCS queries and a probe of every node of the run. No
longer than Ray's own cache of the reserved resources, so a restart just after a loss sees it."""


def answers(node: dict[str, Any]) -> bool:
    """Whether the node's raylet accepts a connection. The kernel accepts for a live process however
    busy it is; a killed raylet refuses at once, and a vanished host times out."""
    try:
        socket.create_connection((node["NodeManagerAddress"], node["NodeManagerPort"]), timeout=PROBE_TIMEOUT_S).close()
        return True
    except OSError:
        return False


def leaving_nodes(among: set[str]) -> set[str]:
    """Which of the nodes `among` a restart must not count: dead, being drained, or with a raylet that
    is gone though the GCS has not noticed yet. Only they are probed, not the whole cluster."""
    import ray

    dead, draining = lost_and_draining_nodes()
    staying = [n for n in ray.nodes() if n["NodeID"] in among and n["NodeID"] not in dead | draining]
    with ThreadPoolExecutor(max_workers=min(32, len(staying) or 1)) as pool:
        gone = {n["NodeID"] for n, up in zip(staying, pool.map(answers, staying)) if not up}
    return (dead | draining | gone) & among


class StayingNodesPolicy(ElasticScalingPolicy):
    """Ray's elastic policy, with leaving nodes left out of the count of workers."""

    def __init__(self, scaling_config: Any) -> None:
        super().__init__(scaling_config)
        self._seen: tuple[float, frozenset[str], set[str]] | None = None
        self._fell_back = False

    def _count_possible_workers(self, reserved_resources: Any) -> int:
        if not isinstance(reserved_resources, dict):  # Ray < 2.60: per-node resources without node ids
            return super()._count_possible_workers(reserved_resources)
        try:
            leaving = self._leaving(frozenset(reserved_resources))
        except Exception as err:  # a GCS query that failed (as nodes die): this decision is Ray's own
            if not self._fell_back:
                self._fell_back = True
                logger.warning("counting workers as Ray does: the nodes that stay could not be told (%s)", err)
            return super()._count_possible_workers(reserved_resources)
        return super()._count_possible_workers({n: r for n, r in reserved_resources.items() if n not in leaving})

    def _leaving(self, nodes: frozenset[str]) -> set[str]:
        now = time.monotonic()
        if self._seen is None or self._seen[1] != nodes or now - self._seen[0] >= CACHE_S:
            self._seen = (now, nodes, leaving_nodes(set(nodes)))
        return self._seen[2]

    def make_decision_for_running_worker_group(self, worker_group_state: Any, worker_group_status: Any) -> Any:
        decision = super().make_decision_for_running_worker_group(worker_group_state, worker_group_status)
        if isinstance(decision, ResizeDecision) and decision.num_workers < worker_group_state.num_workers:
            # A node of the running group is leaving. A drain is answered with a checkpoint, then
            # Ray Train restarts the group at the deadline (a lost node fails the group at once);
            # a resize now would stop the ranks before that checkpoint.
            return NoopDecision()
        return decision


def staying_nodes_only(policy: Any) -> Any:
    """The policy Ray made for the run's ScalingConfig, with StayingNodesPolicy for Ray's elastic one."""
    if type(policy) is ElasticScalingPolicy:
        return StayingNodesPolicy(policy.scaling_config)
    return policy
