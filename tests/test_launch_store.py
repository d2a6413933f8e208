"""`raytrain launch --storage-path s3://...`: the run's files on a real S3 server (moto's server
mode), none in the working directory."""

from __future__ import annotations

import json
import time

import pytest
from conftest import raytrain

from raytrain_ddp.storage.location import storage_root

SCRIPT = """
import os
import torch.distributed as dist

dist.init_process_group(backend="gloo")
print(f"rank {dist.get_rank()}/{dist.get_world_size()} run dir {os.environ['RAYTRAIN_RUN_DIR']}", flush=True)
dist.barrier()
dist.destroy_process_group()
"""


@pytest.mark.e2e
def test_a_launch_keeps_its_run_on_the_store_and_nothing_in_the_working_directory(ray_head, store_env, tmp_path):
    script, work = tmp_path / "script" / "train.py", tmp_path / "work"
    script.parent.mkdir()
    script.write_text(SCRIPT)
    work.mkdir()
    # The endpoint in the URI's query too: RAYTRAIN_RUN_DIR keeps it, as the store is where it says.
    uri, query = f"s3://runs/launch-{time.time_ns()}", f"?endpoint_override={store_env.endpoint}"
    proc = raytrain("launch", "--workers", "2", "--storage-path", uri + query, "--name", "t", str(script),
                    env={**ray_head.env, **store_env.env}, cwd=work)
    assert proc.returncode == 0, proc.stderr[-3000:]

    run = storage_root(uri) / "t"
    for rank in (0, 1):  # every rank's whole output, copied up; the script saw the run's URI, as typed
        assert f"rank {rank}/2 run dir {uri}/t{query}\n" in (run / "logs" / f"rank-{rank}.log").read_text()
    summary = json.loads((run / "summary.json").read_text())
    assert summary["exit_codes"] == [0, 0] and summary["world_size"] == 2
    assert list(work.iterdir()) == []  # no logs/, no `s3:` folder, as a URI taken for a local path would make
