"""<run dir>/workers.json: where the drivers record which pid on which host is which rank, and the Ray
cluster they run on, so `raytrain stack` can reach them from any machine that reaches the cluster."""

from __future__ import annotations

import os
from pathlib import Path

from raytrain_ddp.doctor.ranks import RankProcess
from raytrain_ddp.ray_compat.state import token_auth_enabled
from raytrain_ddp.run_files import write_json

WORKERS = "workers.json"


def write_workers(run_dir: Path, ranks: list[RankProcess]) -> None:
    """<run dir>/workers.json: each rank's hostname, ip and pid, by rank; the address of the Ray
    cluster the driver is connected to (a private local Ray's too, while the driver runs), and
    whether it talks to it with a token, and the token's file (never the token itself): a private
    Ray's is its own, in a directory only this user reads, gone with it."""
    import ray

    write_json(run_dir / WORKERS, {"ranks": [r.to_json() for r in ranks], "ray_address": ray.get_runtime_context().gcs_address,
                                         "token_auth": token_auth_enabled(),
                                         "token_path": os.environ.get("RAY_AUTH_TOKEN_PATH")})
