"""Ray Train's elastic scaling policy, counting only the nodes that stay.

Ray's policy sizes a (re)start by what its AutoscalingCoordinator reserved for the run, and that
counts every node the GCS calls alive, refreshed every 20 s. A node that Ray is draining (a spot
reclaim, `ray drain-node`) is alive until it goes, and a node that just died is counted until the
next refresh. So the restart at a drain's deadline, or after a lost node, asked for workers on that
node as well; their placement group could never be placed, and the run sat out Ray Train's 60 s
worker-group start timeout before it started smaller (measured: 60-65 s of every drain).

This module must not import torch: the controller unpickles from it.
"""

from __future__ import annotations

from typing import Any

import ray
from ray.train.v2._internal.execution.scaling_policy import ElasticScalingPolicy, NoopDecision, ResizeDecision


def lost_and_draining_nodes() -> tuple[set[str], set[str]]:
    """(dead node ids, ids of nodes Ray is draining), from the GCS; Ray Train asks the same way."""
    dead = {n["NodeID"] for n in ray.nodes() if not n["Alive"]}
    return dead, set(ray._private.state.state.get_draining_nodes())


class StayingNodesPolicy(ElasticScalingPolicy):
    """Ray's elastic policy, with dead and draining nodes left out of the count of workers."""

    def _count_possible_workers(self, reserved_resources: dict[str, Any]) -> int:
        dead, draining = lost_and_draining_nodes()
        leaving = dead | draining
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
