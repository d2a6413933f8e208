"""A driver that leaves a fit which still runs, as it does on its own error (a stall, a checkpoint a
rank cannot load): drive()'s watch raises while the ranks train.

python driver_leaves_a_running_fit.py STORAGE_DIR (RAY_ADDRESS and its token in the environment).
Prints one JSON line, taken once drive() has raised and before the driver exits: the states of the
placement groups this job made, that are not removed. Left running, a controller that restarts its
worker group as the job ends makes a group Ray never frees (ray_compat.controller.stop_running_controller).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import ray
from ray.train import RunConfig, ScalingConfig
from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer

from raytrain_ddp.driver.core.drive import Signals, drive
from raytrain_ddp.ray_compat import fast
from raytrain_ddp.ray_compat.state import placement_group_records


class DriversOwnError(Exception):
    pass


def sleeper(config: dict) -> None:
    Path(config["marker"]).write_text("running")
    time.sleep(300)


def main() -> None:
    storage = Path(sys.argv[1])
    ray.init(logging_level="ERROR")
    job = ray.get_runtime_context().get_job_id()
    marker = storage / "rank-running"
    trainer = fast(DataParallelTrainer)(
        sleeper, train_loop_config={"marker": str(marker)}, scaling_config=ScalingConfig(num_workers=1),
        run_config=RunConfig(name="left", storage_path=str(storage)),
    )

    def poll() -> None:
        if marker.exists():
            raise DriversOwnError

    try:
        drive(trainer, Signals(), poll, lambda name, before: None, 0.2)
    except DriversOwnError:
        pass
    from ray.core.generated.gcs_pb2 import PlacementGroupTableData

    left = {g.placement_group_id.hex(): PlacementGroupTableData.PlacementGroupState.Name(g.state)
            for g in placement_group_records() if g.creator_job_id.hex() == job and g.state != PlacementGroupTableData.REMOVED}
    print(json.dumps({"left": left}))


if __name__ == "__main__":
    main()
