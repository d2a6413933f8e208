"""Ray Train's fixed-size scaling policy, less its requests to Ray Data's AutoscalingCoordinator on a
cluster that cannot scale.

Ray's policy asks the coordinator for the run's resources as the controller starts, and again every
20 s, each time waiting up to 5 s for the answer. On a cluster with no autoscaler (a private local
Ray, the sbatch's, a fixed on-prem one) the requests reach nothing that acts on them, and the first
one on a fresh cluster makes Ray start the coordinator: a detached actor whose process imports Ray
Data before the controller asks for any worker (docs/performance.md). Whether the cluster can scale
is Ray Data's own test (its node groups as the GCS holds them), asked once by the driver; where it
cannot be asked, or the run is elastic (whose policy sizes itself by what the coordinator reserved),
Ray's policy stays as it is. Should the test misread a cluster that can grow, the run's pending
placement group still asks its autoscaler for the nodes, as every Ray Train run did before the
coordinator.

This module must not import torch: the controller unpickles from it.
"""

from __future__ import annotations

import logging
from typing import Any

from ray.train.v2._internal.execution.scaling_policy.fixed import FixedScalingPolicy

logger = logging.getLogger(__name__)


class FixedSizeNoCoordinator(FixedScalingPolicy):
    """Ray's fixed-size policy, with no resource request: its decisions are Ray's."""

    def after_controller_start(self, train_run_context: Any) -> None:
        self._requester_id = f"train-{train_run_context.run_id}"

    def _maybe_send_resource_request(self) -> None:
        pass

    def _send_resource_request(self) -> None:
        pass


def cluster_autoscales() -> bool:
    """Ray Data's answer to whether any node group of the cluster can grow; True where it cannot be asked."""
    try:
        from ray.data._internal.cluster_autoscaler.util import is_autoscaling_enabled

        return bool(is_autoscaling_enabled())
    except Exception as err:  # an older or newer Ray, or a GCS that did not answer: Ray's way
        logger.debug("could not tell whether the cluster autoscales: %s", err)
        return True


def without_coordinator(policy: Any) -> Any:
    """`policy` as FixedSizeNoCoordinator where it is Ray's own fixed-size policy (not a subclass, and
    not an elastic one) and the cluster cannot scale; else `policy` itself."""
    if type(policy) is not FixedScalingPolicy or cluster_autoscales():
        return policy
    return FixedSizeNoCoordinator(policy.scaling_config)
