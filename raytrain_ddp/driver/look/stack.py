"""`raytrain stack`: every rank's Python stack of a running `run` or `launch`, labelled by rank and
host (as `ray stack` shows a node's workers, but by rank and on every node), each with its
DataLoader workers' stacks, found through the run's workers.json (doctor/workers.py) from any
machine that reaches the cluster.
"""

from __future__ import annotations

import json
import os
from raytrain_ddp.config import ConfigError
from raytrain_ddp.doctor.diagnosis import is_stack, loader_place, worker_label
from raytrain_ddp.doctor.ranks import ranks_from
from raytrain_ddp.doctor.stacks import dump_loader_workers, dump_stacks, glance, glance_loader_workers
from raytrain_ddp.doctor.workers import WORKERS
from raytrain_ddp.driver.session.connect import check_reachable, connect
from raytrain_ddp.ray_compat.state import use_token_auth
from raytrain_ddp.storage.location import RunPath, check_store, storage_root


def show_stacks(storage_path: str, name: str | None) -> None:
    """Print `== rank N on HOST pid PID ==` and its `py-spy dump` for every rank of the run, then
    `== rank N's loader worker I (pid PID) on HOST: where ==` and its dump for each of its loader workers."""
    storage = storage_root(storage_path)
    check_store(storage, storage_path)
    run_dir = find_run(storage, name)
    record = json.loads((run_dir / WORKERS).read_text())
    address, ranks = record.get("ray_address"), ranks_from(record["ranks"])
    if not address:
        raise ConfigError(f"{run_dir / WORKERS} names no Ray cluster (a run started before `raytrain stack` existed)")
    try:
        check_reachable(address)
    except ConfigError:
        raise ConfigError(f"run {run_dir.name} is not running: the Ray cluster it ran on ({address}) does not answer") from None
    if record.get("token_auth"):
        # As the run's driver did: with the run's token file, unless this shell names one of its own.
        token_path = os.environ.get("RAY_AUTH_TOKEN_PATH") or record.get("token_path")
        if token_path:
            use_token_auth(token_path)
        os.environ.setdefault("RAY_AUTH_MODE", "token")
    connect(address)
    stacks = dump_stacks(ranks, glance)  # unpaused: the run's own stall watch may be looking too
    if not any(map(is_stack, stacks)):
        pids = ", ".join(f"{r.pid} on {r.host}" for r in ranks)
        raise ConfigError(f"run {run_dir.name} is not running: none of its ranks' processes is there ({pids})")
    workers = dump_loader_workers(ranks, glance_loader_workers)
    for rank, (where, text) in enumerate(zip(ranks, stacks)):
        print(f"== {where.label()} ==\n{text.rstrip()}\n", flush=True)
        for i, worker in enumerate(workers[rank]):
            print(f"== {worker_label(rank, i, worker)} on {where.host}: {loader_place(worker.stack)} ==\n"
                  f"{worker.stack.rstrip()}\n", flush=True)


def find_run(storage: RunPath, name: str | None) -> RunPath:
    """<storage>/<name>, or the run that wrote its workers.json last (on disk or in an object store)."""
    if name is not None:
        if not (storage / name / WORKERS).is_file():
            raise ConfigError(f"no running record of run {name} ({storage / name / WORKERS} is missing); check NAME "
                              "and --storage-path")
        return storage / name
    records = sorted((run / WORKERS for run in storage.iterdir() if (run / WORKERS).is_file()),
                     key=lambda path: path.stat().st_mtime)
    if not records:
        raise ConfigError(f"no run under {storage} has a {WORKERS}; pass --storage-path where the run writes")
    return records[-1].parent
