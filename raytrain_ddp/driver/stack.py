"""`raytrain stack`: every rank's Python stack of a running `run` or `launch`, labelled by rank and
host (as `ray stack` shows a node's workers, but by rank and on every node); and the run's
workers.json, where the drivers record which pid on which host is which rank, and the Ray cluster
they run on, so this command can reach them from any machine that reaches the cluster.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from raytrain_ddp.config import ConfigError, TrainConfig
from raytrain_ddp.driver.metrics import write_json
from raytrain_ddp.driver.session import check_reachable, connect
from raytrain_ddp.driver.stall import dump_stacks, glance, is_stack
from raytrain_ddp.ray_compat.state import token_auth_enabled

WORKERS = "workers.json"


def write_workers(run_dir: Path, ranks: list[dict[str, Any]]) -> None:
    """<run dir>/workers.json: each rank's hostname, ip and pid, by rank; the address of the Ray
    cluster the driver is connected to (a private local Ray's too, while the driver runs), and
    whether it talks to it with a token (never the token itself)."""
    import ray

    write_json(Path(run_dir) / WORKERS, {"ranks": ranks, "ray_address": ray.get_runtime_context().gcs_address,
                                         "token_auth": token_auth_enabled()})


def show_stacks(storage_path: str, name: str | None) -> None:
    """Print `== rank N on HOST pid PID ==` and its `py-spy dump` for every rank of the run."""
    run_dir = find_run(Path(storage_path).expanduser().absolute(), name)
    record = json.loads((run_dir / WORKERS).read_text())
    address, ranks = record.get("ray_address"), record["ranks"]
    if not address:
        raise ConfigError(f"{run_dir / WORKERS} names no Ray cluster (a run started before `raytrain stack` existed)")
    try:
        check_reachable(address)
    except ConfigError:
        raise ConfigError(f"run {run_dir.name} is not running: the Ray cluster it ran on ({address}) does not answer") from None
    if record.get("token_auth"):
        # As the run's driver did. A private local Ray turns token auth on by itself (its token in
        # ~/.ray/auth_token, where Ray looks by default), but a driver that names an address does not.
        os.environ.setdefault("RAY_AUTH_MODE", "token")
    connect(TrainConfig(address=address))
    stacks = dump_stacks(ranks, glance)  # unpaused: the run's own stall watch may be looking too
    if not any(map(is_stack, stacks)):
        pids = ", ".join(f"{r['pid']} on {r['hostname']}" for r in ranks)
        raise ConfigError(f"run {run_dir.name} is not running: none of its ranks' processes is there ({pids})")
    for rank, (where, text) in enumerate(zip(ranks, stacks)):
        print(f"== rank {rank} on {where['hostname']} pid {where['pid']} ==\n{text.rstrip()}\n", flush=True)


def find_run(storage: Path, name: str | None) -> Path:
    """<storage>/<name>, or the run that wrote its workers.json last."""
    if name is not None:
        if not (storage / name / WORKERS).is_file():
            raise ConfigError(f"no running record of run {name} ({storage / name / WORKERS} is missing); check NAME "
                              "and --storage-path")
        return storage / name
    records = sorted(storage.glob(f"*/{WORKERS}"), key=lambda path: path.stat().st_mtime)
    if not records:
        raise ConfigError(f"no run under {storage} has a {WORKERS}; pass --storage-path where the run writes")
    return records[-1].parent
