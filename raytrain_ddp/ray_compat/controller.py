"""Ray Train, started lean: `fast(TorchTrainer)` and `fast(DataParallelTrainer)` start the same run
as Ray's own classes, less four costs that a trace found in every run (docs/performance.md):

- **The controller's runtime_env.** Ray Train gives its controller one (`RAY_WARN_BLOCKING_GET_INSIDE_ASYNC=0`,
  plus any `RAY_TRAIN_*` variable the driver sets), and every actor the controller creates inherits
  it. So none of those processes can take one of Ray's idle worker processes, and each starts Python
  twice (`setup_worker.py`, then the worker). When the driver sets no `RAY_TRAIN_*` variable, the
  controller here starts without one and sets that warning switch in its own process.
- **The DatasetManager.** Its process is made for every run, with or without Ray Datasets. Here it
  is made only when the run has datasets.
- **The controller's poll of the ranks**, every 2 s in Ray: the fit returns seconds after the
  ranks end, and a run's end waits for it. Here a run of a fixed size polls every POLL_S.
- **The PlacementGroupCleaner** (Ray >= 2.55). It asks the State API, from inside an actor, whether
  the controller is alive. On a token-secured cluster that call times out, so the cleaner never
  cleans anything, and its `stop()` holds the end of every fit. Its one job, removing the placement
  groups of a controller that died (Ray keeps them until the driver exits), is done here instead,
  by the driver, when its fit ends (`remove_dead_controllers_groups`).

(The fifth, torch on the controller, is process_group.py's; the sixth, the AutoscalingCoordinator
asked for the run's resources on a cluster that cannot scale, is fixed_size.py's.) The fast start
overrides the private method through which the trainer starts its controller; where the installed
Ray lacks any name it needs (ray_compat.FEATURES["fast_start"]), `ray_compat.fast` returns Ray's
class, which starts the usual way.

This module must not import torch: the controller unpickles from it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

from ray.train.v2._internal.execution.controller import TrainController as RayTrainController

from raytrain_ddp.ray_compat.features import has, supports

logger = logging.getLogger(__name__)

POLL_S = 0.5
"""How often the controller asks the ranks how they are, where Ray's default is every 2 s: a run's
end, and a rank that failed, are seen that much sooner (docs/performance.md, "The end of a run"). A
poll is a tiny actor call on each rank; one that hangs is a failure only after Ray's own timeout."""
HEALTH_CHECK_ENV = "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"


class TrainController(RayTrainController):
    """Ray Train's controller, started without a runtime_env: it sets its one variable itself."""

    def __init__(self, **kwargs: Any) -> None:
        # The controller blocks on ray.get by design; Ray's runtime_env silences the warning so.
        os.environ.setdefault("RAY_WARN_BLOCKING_GET_INSIDE_ASYNC", "0")
        super().__init__(**kwargs)
        # Ray's knob for it, RAY_TRAIN_HEALTH_CHECK_INTERVAL_S, set on the driver would give this
        # controller and every rank a runtime_env (above); a cluster whose nodes set it keeps theirs.
        # An elastic run keeps Ray's: each of its polls may also look for room to resize (a call to
        # the AutoscalingCoordinator, and elastic.py's GCS queries and probe of each node), and at
        # 0.5 s the elastic test's run grew an epoch or two later than at 2 s on the 2-core CI
        # machine (twice in a row), too late for its drain; that cost is the suspect, not proven.
        elastic = any(c.__name__ == "ElasticScalingPolicy" for c in type(kwargs.get("scaling_policy")).__mro__)
        if HEALTH_CHECK_ENV not in os.environ and not elastic and hasattr(self, "_health_check_interval_s"):
            self._health_check_interval_s = POLL_S


def needed(callback: Any, datasets: dict[str, Any]) -> bool:
    """False for the controller callbacks whose processes cost a run time and give it nothing. Ray's
    cleaner stays where this driver cannot do its job (can_clean_up). Ray 2.52 has neither callback
    (its DatasetsSetupCallback makes no process without datasets) and keeps all it has."""
    import ray.train.v2._internal.callbacks.datasets as ray_datasets

    try:
        from ray.train.v2._internal.callbacks.placement_group_callback import PlacementGroupCleanerCallback
    except ImportError:
        PlacementGroupCleanerCallback = ()  # noqa: N806  (isinstance of nothing)
    if isinstance(callback, PlacementGroupCleanerCallback):
        return not can_clean_up()
    return bool(datasets) or not isinstance(callback, getattr(ray_datasets, "DatasetsCallback", ()))


class FastStart:
    """Mixed in before a Ray Train V2 trainer class: it overrides the one private method through
    which the trainer starts its controller (`ray_compat.fast` checks first that the installed Ray has it)."""

    def _initialize_and_run_controller(self, **kwargs: Any) -> Any:
        import ray
        from ray.train.v2._internal.constants import get_env_vars_to_propagate
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        if "callbacks" in kwargs:
            kwargs["callbacks"] = [cb for cb in kwargs["callbacks"] if needed(cb, self.datasets)]
        if "scaling_policy" in kwargs and supports("elastic"):
            from raytrain_ddp.ray_compat.elastic import staying_nodes_only

            kwargs["scaling_policy"] = staying_nodes_only(kwargs["scaling_policy"])
        if "scaling_policy" in kwargs and has(
                "ray.train.v2._internal.execution.scaling_policy.fixed:FixedScalingPolicy._maybe_send_resource_request"):
            from raytrain_ddp.ray_compat.fixed_size import without_coordinator  # on a cluster that cannot scale

            kwargs["scaling_policy"] = without_coordinator(kwargs["scaling_policy"])
        remove_dead_controllers_groups()  # an earlier fit's, in this driver, if its end could not
        try:
            if get_env_vars_to_propagate():  # the user's RAY_TRAIN_* settings travel in the runtime_env
                return super()._initialize_and_run_controller(**kwargs)  # type: ignore[misc]
            driver_node = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)  # as Ray's
            controller = ray.remote(num_cpus=0, scheduling_strategy=driver_node)(TrainController).remote(**kwargs)
            RUNNING[threading.current_thread()] = controller
            if threading.current_thread() is threading.main_thread():  # Ray's Ctrl-C handling, as Ray does
                self._register_sigint_handler(controller)  # type: ignore[attr-defined]
            ray.get(controller.run.remote())
            return ray.get(controller.get_result.remote())
        finally:
            RUNNING.pop(threading.current_thread(), None)
            remove_dead_controllers_groups()


RUNNING: dict[threading.Thread, Any] = {}
"""This driver's controllers whose fit has not returned (fast start), by the thread that runs the fit."""
STOP_WAIT_S = 10.0
"""How long a driver that leaves a running fit waits for its controllers' deaths: a kill lands in
well under a second; a cluster that does not answer must not hold the driver's exit."""


def stop_running_controller(fit: threading.Thread) -> None:
    """Kill the controller of the fit that thread `fit` runs, wait for its death, and remove the
    placement groups it made: before the driver leaves a fit that still runs (its own error, a stall,
    a second Ctrl-C).
    Left to the driver's exit, a controller that was restarting its worker group as the job ended
    makes its new group after the GCS cleaned up the job's; Ray then never marks that group's job
    dead, and it holds its CPUs until the cluster stops (CI: every later run refused, 'held by 1
    placement group'). Ray's stock trainer (no fast start) keeps Ray's behaviour."""
    import ray

    controller = RUNNING.get(fit)
    if controller is None or not ray.is_initialized():
        return
    try:
        ray.kill(controller, no_restart=True)
        deadline = time.monotonic() + STOP_WAIT_S
        while True:  # the kill lands a moment later: a call may still be answered before it
            try:
                ray.get(controller.__ray_ready__.remote(), timeout=max(0.1, deadline - time.monotonic()))
            except ray.exceptions.RayActorError:
                break  # dead, as asked
            if time.monotonic() > deadline:
                raise TimeoutError(f"it outlived its kill by {STOP_WAIT_S:g} s")
            time.sleep(0.1)
        actor = getattr(controller, "_actor_id", None)
        remove_dead_controllers_groups(frozenset([actor.binary()]) if actor is not None else frozenset())
    except Exception as err:  # never hold or fail the driver's exit over it
        logger.warning("could not stop a running controller: %s", err)


# --- placement groups of a controller that died ---


def groups_of_dead_controllers(killed: frozenset[bytes] = frozenset()) -> list[str] | None:
    """Hex ids of the live placement groups that an actor of this job created and that outlived it
    (a controller killed mid-run). Ray removes a group only once both its creator and the job are
    dead, so a driver that goes on to another fit keeps them reserved. None where this Ray's GCS
    records cannot be read. Never another job's groups. `killed`: the actor ids of controllers this
    driver killed and saw die, whose groups count even where Ray has not marked their creator dead."""
    import ray

    from raytrain_ddp.ray_compat.state import placement_group_records

    job = ray.get_runtime_context().get_job_id()  # first: once Ray is shut down, asking would connect again
    if (records := placement_group_records()) is None:
        return None
    from ray.core.generated.gcs_pb2 import PlacementGroupTableData

    driver = ray.ActorID.nil().binary()  # the creator of the driver's own groups, "dead" from the start
    found = []
    for group in records:
        dead = group.creator_actor_dead or group.creator_actor_id in killed
        if (group.creator_job_id.hex() == job and group.creator_actor_id != driver and dead
                and not group.is_detached and group.state != PlacementGroupTableData.REMOVED):
            found.append(group.placement_group_id.hex())
    return found


def can_clean_up() -> bool:
    """Whether this Ray lets the driver read who created each placement group (else Ray's cleaner stays)."""
    if not has("ray._private.state:state._connect_and_get_accessor"):
        return False
    try:
        from ray.core.generated.gcs_pb2 import PlacementGroupTableData
    except ImportError:
        return False
    return {"creator_job_id", "creator_actor_dead"} <= set(PlacementGroupTableData.DESCRIPTOR.fields_by_name)


def remove_dead_controllers_groups(killed: frozenset[bytes] = frozenset()) -> None:
    """Remove the placement groups a dead controller of this job left reserved. Not once the driver
    has left Ray: a fit ending after the driver's exit (its error already said) would make Ray connect
    again, and print so after that last line. `killed`: as groups_of_dead_controllers'."""
    import ray
    from ray.util.placement_group import PlacementGroup, remove_placement_group

    if not ray.is_initialized():
        return
    try:
        for hex_id in groups_of_dead_controllers(killed) or []:
            remove_placement_group(PlacementGroup(ray.PlacementGroupID(bytes.fromhex(hex_id))))
    except Exception as err:  # never fail a fit's end over it
        if ray.is_initialized():  # else the driver shut Ray down meanwhile, after its last line
            logger.warning("could not remove a dead controller's placement groups: %s", err)
