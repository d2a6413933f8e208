"""What Ray knows that it has no public call for: each read here is imported at its use and has a
stock answer where the installed Ray lacks it."""

from __future__ import annotations

import json
import logging
import os
import warnings
from typing import Any

logger = logging.getLogger(__name__)

ENDED = "which has ended"
"""How placement_group_creators says a group's job is gone (Ray never frees such a group)."""
WORKER_GROUP_START_TIMEOUT_S = 60.0
"""Ray Train's default for how long a worker group may take to start, where Ray does not say."""


def lost_and_draining_nodes() -> tuple[set[str], set[str]]:
    """(dead node ids, ids of nodes Ray is draining), from the GCS, as Ray Train asks. A Ray without
    the draining call gives none: its drains are seen only once the node is gone."""
    import ray

    dead = {n["NodeID"] for n in ray.nodes() if not n["Alive"]}
    try:
        from ray._private.state import state
    except ImportError:
        return dead, set()
    if not hasattr(state, "get_draining_nodes"):
        return dead, set()
    return dead, set(state.get_draining_nodes())


def placement_group_records() -> list[Any] | None:
    """The GCS's record of every placement group (gcs_pb2.PlacementGroupTableData: who created it,
    whether that job and actor are dead), which ray.util.placement_group_table() leaves out; None
    where this Ray's cannot be read."""
    try:
        from ray._private.state import state
        from ray.core.generated.gcs_pb2 import PlacementGroupTableData
    except ImportError:
        return None
    try:
        table = state._connect_and_get_accessor().get_placement_group_table()
    except AttributeError:
        return None
    return [PlacementGroupTableData.FromString(raw) for raw in table]


def placement_group_creators() -> dict[str, str]:
    """Who made each placement group, in words, by its hex id: `job 05000000`, with `, which has
    ended` once that job has (a group that outlived it), or while it runs, its driver (job_driver);
    and `, detached`. Empty where the GCS's records cannot be read."""
    try:
        records = placement_group_records() or []
        jobs = job_drivers() if records else {}
        said = {}
        for group in records:
            job = group.creator_job_id.hex()
            # The job table, not only the group's own mark: a group a job's actor made after the GCS
            # had cleaned up that job's is never marked (ray_compat.controller.stop_running_controller).
            how = jobs.get(job, "")
            how = f", {ENDED}" if group.creator_job_dead or how is None else how
            said[group.placement_group_id.hex()] = f"job {job}{how}" + (", detached" if group.is_detached else "")
        return said
    except Exception as err:  # a Ray whose records differ: the error names no job then
        logger.debug("placement group creators unreadable: %s", err)
        return {}


def job_drivers() -> dict[str, str | None]:
    """Each job's driver, by job hex id, in words (job_driver), None for a job that has ended: on a
    shared cluster a job's id alone tells its owner nothing."""
    from ray._private.state import state

    return {job["JobID"]: None if job["IsDead"] else job_driver(job["DriverPid"], job["DriverIPAddress"],
                                                                  job.get("Entrypoint", ""))
            for job in state.job_table()}


def job_driver(pid: int, ip: str, entrypoint: str) -> str:
    """`, pid 4242 on 10.0.0.5: python3 train.py --lr 0.1`: the command shortened in its middle,
    where the script sits at the start and a run's name often at the end."""
    words = " ".join(entrypoint.split()).split(" ", 1)
    command = " ".join([os.path.basename(words[0]), *words[1:]]) if words[0] else ""
    if len(command) > 120:
        command = f"{command[:70]} … {command[-45:]}"
    where = f", pid {pid} on {ip}" if pid else ""
    return f"{where}: {command}" if command else where


def token_auth_enabled() -> bool:
    """Whether this process talks to Ray with a token (Ray's own switch)."""
    try:
        from ray._private.authentication.authentication_utils import is_token_auth_enabled
    except ImportError:  # a Ray without token auth
        return False
    return bool(is_token_auth_enabled())


def use_token_auth(token_path: str) -> None:
    """Connect with the token in `token_path` from now on. Ray's core reads RAY_AUTH_MODE once, as
    ray._raylet loads, and its token once, at first use: the variables alone come too late in a
    process that imported Ray already, so both caches are read again."""
    os.environ.pop("RAY_AUTH_TOKEN", None)  # Ray reads it before the path
    os.environ |= {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": token_path}
    try:
        from ray._raylet import AuthenticationTokenLoader, Config
    except ImportError:  # a Ray without token auth
        return
    # What 2.60's _enable_token_auth does; 2.52 has no such call, and its driver then connected with
    # no token, refused by its own private head (#49).
    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


def quiet_ray_notices() -> None:
    """Ray's notes at every local start that are no news to our users: that it turned token auth on
    (good news), and, before 2.53, a FutureWarning about GPU variables on CPU workers."""
    logging.getLogger("ray._private.authentication.authentication_token_setup").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message="Tip: In future versions of Ray", category=FutureWarning)


def local_gpu_mib() -> float | None:
    """The smallest GPU memory on this machine, from NVML through Ray's own copy of pynvml (Ray counts
    GPUs with it): no CUDA context, which a driver would otherwise hold on GPU 0 for the whole run.
    None without a GPU, NVML or that copy."""
    try:
        import ray._private.thirdparty.pynvml as nvml

        nvml.nvmlInit()
        try:
            sizes = [nvml.nvmlDeviceGetMemoryInfo(nvml.nvmlDeviceGetHandleByIndex(i)).total
                     for i in range(nvml.nvmlDeviceGetCount())]
        finally:
            nvml.nvmlShutdown()
    except Exception:  # no driver, no GPU, or Ray moved its copy: the estimate is printed unchecked
        return None
    return min(sizes) / 2**20 if sizes else None


def torch_framework() -> Any:
    """TrainingFramework.TORCH, what Ray's Train dashboard shows for a torch run; None where Ray has none."""
    try:
        from ray.train.v2._internal.util import TrainingFramework
    except ImportError:
        return None
    return TrainingFramework.TORCH


def worker_group_start_timeout_s() -> float:
    """How long Ray Train lets a worker group start before it retries."""
    try:
        from ray.train.v2._internal.constants import DEFAULT_WORKER_GROUP_START_TIMEOUT_S
    except ImportError:
        return WORKER_GROUP_START_TIMEOUT_S
    return float(DEFAULT_WORKER_GROUP_START_TIMEOUT_S)


def check_cluster_config(config: dict[str, Any]) -> None:
    """What `ray up` checks first in a cluster launcher config; raises on a bad one."""
    from ray.autoscaler._private.util import prepare_config, validate_config

    validate_config(prepare_config(config))


def free_resources_per_node() -> dict[str, dict[str, float]]:
    """Each live node's free resources (what no task, actor or placement group holds), by node id
    (hex), as the GCS last heard them. A Ray without the per-node call gives only the whole
    cluster's, under the id "" (ray.available_resources)."""
    import ray

    try:
        from ray._private.state import available_resources_per_node
    except ImportError:
        return {"": ray.available_resources()}
    return available_resources_per_node()


def cluster_ray_version(address: str, timeout_s: float = 10.0) -> str | None:
    """The Ray release the cluster at `address` (host:port of its GCS) runs, as its GCS records it
    for Ray's own version check; read before ray.init, which across releases may not get far enough
    to say (a 2.52 driver retries, for most of a minute, a key a 2.60 GCS no longer has). None where
    it cannot be read. Raises Ray's AuthenticationError, in milliseconds, where the GCS refuses this
    process's token."""
    from ray.exceptions import AuthenticationError

    try:
        from ray._common.usage.usage_constants import CLUSTER_METADATA_KEY
        from ray._private.ray_constants import KV_NAMESPACE_CLUSTER
        from ray._raylet import GcsClient

        raw = GcsClient(address=address).internal_kv_get(CLUSTER_METADATA_KEY, namespace=KV_NAMESPACE_CLUSTER,
                                                         timeout=timeout_s)
        return str(json.loads(raw)["ray_version"]) if raw else None
    except AuthenticationError:
        raise
    except Exception:  # an older layout of Ray's modules, or a GCS that does not answer: Ray's own check
        return None
