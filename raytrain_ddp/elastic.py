"""Ray Train's elastic scaling policy, counting only the nodes that stay.

Ray's policy sizes a (re)start by what its AutoscalingCoordinator reserved for the run, and that
counts every node the GCS calls alive: a node that Ray is draining (a spot reclaim, `ray drain-node`)
until it goes, and a node whose Ray was killed until the GCS has missed its heartbeats for a while.
So the restart at a drain's deadline, or a second after a lost node, asked for a worker on that
node; its placement group could never be placed, and the run sat out Ray Train's 60 s worker-group
start timeout before it started smaller (69.5 s from drain to resumed run, 70.4 s from a killed
node; README, "Never lose work").

This module must not import torch: the controller unpickles from it.
"""

from __future__ import annotations

import socket
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import ray
from ray.train.v2._internal.execution.scaling_policy import ElasticScalingPolicy, NoopDecision, ResizeDecision

PROBE_TIMEOUT_S = 1.0
"""How long a restart waits for a node's raylet to accept a connection before it counts the node gone."""


def lost_and_draining_nodes() -> tuple[set[str], set[str]]:
    """(dead node ids, ids of nodes Ray is draining), from the GCS; Ray Train asks the same way."""
    dead = {n["NodeID"] for n in ray.nodes() if not n["Alive"]}
    return dead, set(ray._private.state.state.get_draining_nodes())


def answers(node: dict[str, Any]) -> bool:
    """Whether the node's raylet accepts a connection. The kernel accepts for a live process however
    busy it is; a killed raylet refuses at once, and a vanished host times out."""
    try:
        socket.create_connection((node["NodeManagerAddress"], node["NodeManagerPort"]), timeout=PROBE_TIMEOUT_S).close()
        return True
    except OSError:
        return False


def leaving_nodes() -> set[str]:
    """Ids of the nodes a restart must not count: dead, being drained, or with a raylet that is gone
    though the GCS has not noticed yet."""
    dead, draining = lost_and_draining_nodes()
    staying = [n for n in ray.nodes() if n["NodeID"] not in dead | draining]
    with ThreadPoolExecutor(max_workers=min(32, len(staying) or 1)) as pool:
        gone = {n["NodeID"] for n, up in zip(staying, pool.map(answers, staying)) if not up}
    return dead | draining | gone


class StayingNodesPolicy(ElasticScalingPolicy):
    """Ray's elastic policy, with leaving nodes left out of the count of workers."""

    def _count_possible_workers(self, reserved_resources: dict[str, Any]) -> int:
        leaving = leaving_nodes()
        staying = {node: res for node, res in reserved_resources.items() if node not in leaving}
        return super()._count_possible_workers(staying)

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
