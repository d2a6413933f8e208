"""Two fast-started fits in one driver, the first of whose controllers is SIGKILLed mid-run.

python dead_controller_fits.py STORAGE_DIR (RAY_ADDRESS and its token in the environment). Prints one
JSON line: fit 1's placement groups and their states after fit 1 failed, while fit 2 ran, and after;
and the state of a group the driver itself made (its creator, the driver, counts as a dead actor to
Ray), which the clean-up must leave alone.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import ray
from ray.train import RunConfig, ScalingConfig
from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer

from raytrain_ddp.ray_compat import fast

CONTROLLER_TITLE = "ray::TrainController"


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def controllers(gcs_address: str) -> set[int]:
    """TrainController processes of this cluster only: their parent is the raylet of `gcs_address`."""
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and cmdline(int(entry.name)).startswith(CONTROLLER_TITLE):
            try:
                if f"--gcs-address={gcs_address}" in cmdline(parent(int(entry.name))):
                    found.add(int(entry.name))
            except (OSError, ValueError, IndexError):
                continue
    return found


def states(ids: list[str]) -> dict[str, str]:
    table = ray.util.placement_group_table()
    return {i: table[i]["state"] for i in ids if i in table}


def sleeper(config: dict) -> None:
    Path(config["marker"]).write_text("running")
    time.sleep(300)


def check_groups(config: dict) -> None:
    """Fit 2's first act: where fit 1's groups stand once fit 2 has started."""
    Path(config["out"]).write_text(json.dumps(states(config["ids"])))


def main() -> None:
    storage = Path(sys.argv[1])
    ray.init(logging_level="ERROR")
    gcs_address = ray.get_runtime_context().gcs_address
    before_groups = set(ray.util.placement_group_table())
    before_controllers = controllers(gcs_address)
    own = ray.util.placement_group([{"CPU": 0.1}])  # the user's own, made by the driver
    ray.get(own.ready())
    before_groups.add(own.id.hex())
    marker = storage / "fit1-running"
    killed: list[int] = []

    def kill_fit1_controller() -> None:
        while not marker.exists():
            time.sleep(0.1)
        new = controllers(gcs_address) - before_controllers
        assert len(new) == 1, f"not one new controller of this cluster: {new}"
        killed.extend(new)
        os.kill(new.pop(), signal.SIGKILL)

    killer = threading.Thread(target=kill_fit1_controller, daemon=True)
    killer.start()
    fit1 = fast(DataParallelTrainer)(
        sleeper, train_loop_config={"marker": str(marker)}, scaling_config=ScalingConfig(num_workers=1),
        run_config=RunConfig(name="fit1", storage_path=str(storage)),
    )
    try:
        fit1.fit()
        failed = None
    except Exception as err:  # the controller died: RayActorError, however Ray wraps it
        failed = type(err).__name__
    ids = sorted(set(ray.util.placement_group_table()) - before_groups)
    after_fit1 = states(ids)

    out = storage / "during-fit2.json"
    fit2 = fast(DataParallelTrainer)(
        check_groups, train_loop_config={"ids": ids, "out": str(out)}, scaling_config=ScalingConfig(num_workers=1),
        run_config=RunConfig(name="fit2", storage_path=str(storage)),
    )
    fit2.fit()
    print(json.dumps({
        "killed": killed, "fit1_failed": failed, "after_fit1": after_fit1,
        "during_fit2": json.loads(out.read_text()), "after_fit2": states(ids),
        "own": states([own.id.hex()]),
    }))


if __name__ == "__main__":
    main()
