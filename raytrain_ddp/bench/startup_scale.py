"""`raytrain bench startup-scale`: the start-up stages at 2, 8 and 16 workers on a multi-node Ray
simulated on one machine, and two control arms that say which part grows with Ray and which with the
workers' own imports.

The cluster is real: a token-secured head (tools/head.py) plus `--nodes - 1` joined `ray start`
nodes, each with `--cpus-per-node` logical CPUs, all on this machine's real cores. At each world size,
`--rounds` times, in turn:

- **run**: `raytrain run --workers N` (tiny: 1 epoch, 256 samples, convnet); its summary.json stages.
- **ray only**: a Ray Train V2 `DataParallelTrainer` (no torch backend), started as the runs start
  theirs (ray_compat/controller.py), whose train fn only notes the time; fit() to rank 0 entering it. Ray's
  controller, placement and worker-group start at N, with no torch in the workers (the arm reports
  whether torch got imported anyway).
- **imports**: N plain `python -c "import torch, torch.distributed, torchvision"` processes started
  together, no Ray; the time until the last finishes. What N workers' imports cost on these cores,
  alone.

Reading: how `ray only` grows with N is Ray's share; how `imports` grows is the imports' share; the
run's `workers` + `imports` stages hold both (Ray Train's torch backend imports torch in each worker
during `workers`). The arms overlap with nothing: each runs alone. It prints figures; it asserts
nothing about speed.
"""

from __future__ import annotations

import contextlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from raytrain_ddp.bench.local_ray import Head, joined_node, local_head
from raytrain_ddp.driver.core.startup import RUN_STAGES

IMPORTS = "import torch, torch.distributed, torchvision"
ARMS = ("ray only s", "imports s")


def medians(runs: list[dict[str, Any]]) -> dict[str, float]:
    """Median seconds per run stage (in RUN_STAGES order, those present) and per control arm, and the
    run's total, over rounds."""
    out: dict[str, float] = {}
    stage_runs = [r["stages"] for r in runs if r.get("stages")]
    if stage_runs:
        out["total"] = statistics.median(sum(s.values()) for s in stage_runs)
    for name in RUN_STAGES:
        found = [s[name] for s in stage_runs if name in s]
        if found:
            out[name] = statistics.median(found)
    for arm in ARMS:
        found = [r[arm] for r in runs if r.get(arm) is not None]
        if found:
            out[arm] = statistics.median(found)
    return out


def table(results: dict[int, list[dict[str, Any]]]) -> str:
    """A Markdown table: one row per world size, median seconds per stage and arm; `-` where absent."""
    names = ("total", *RUN_STAGES, *ARMS)
    lines = ["| workers | " + " | ".join(names) + " |", "|---:|" + "---:|" * len(names)]
    for size, runs in sorted(results.items()):
        m = medians(runs)
        lines.append(f"| {size} | " + " | ".join(f"{m[n]:.1f}" if n in m else "-" for n in names) + " |")
    return "\n".join(lines)


@contextlib.contextmanager
def simulated_cluster(nodes: int, cpus_per_node: int):
    """A head and nodes - 1 joined nodes on this machine, joined one at a time (each waits to be
    alive at the head): started together on 2 cores, their dashboard agents come up too slowly and the
    raylets abort waiting for them."""
    with contextlib.ExitStack() as stack:
        head = stack.enter_context(local_head(num_cpus=cpus_per_node))
        for _ in range(1, nodes):
            stack.enter_context(joined_node(head, num_cpus=cpus_per_node))
        yield head


def run_arm(head: Head, workers: int, workdir: Path, name: str) -> dict[str, float]:
    config = workdir / f"{name}.yaml"
    config.write_text(yaml.safe_dump({
        "name": name, "storage_path": str(workdir), "workers": workers, "cpus_per_worker": 1, "model": "convnet",
        "epochs": 1, "train_samples": 256, "val_samples": 64, "data_workers": 0, "progress": "none",
    }))
    proc = subprocess.run([sys.executable, "-m", "raytrain_ddp", "run", "--config", str(config)],
                          env=head.env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"raytrain run failed: {proc.stderr.strip().splitlines()[-3:]}")
    return json.loads((workdir / name / "summary.json").read_text())["startup"]["stages"]


RAY_ONLY = """
import json, sys, time
from pathlib import Path
import ray
from ray.train import RunConfig, ScalingConfig
from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer
from raytrain_ddp.ray_compat import fast

def entered(config):
    import ray.train
    if ray.train.get_context().get_world_rank() == 0:
        Path(config["mark"]).write_text(json.dumps({"t": time.time(), "torch": "torch" in sys.modules}))

workers, mark, storage = int(sys.argv[1]), sys.argv[2], sys.argv[3]
ray.init(logging_level="ERROR")
trainer = fast(DataParallelTrainer)(entered, train_loop_config={"mark": mark},
    scaling_config=ScalingConfig(num_workers=workers, resources_per_worker={"CPU": 1}),
    run_config=RunConfig(storage_path=storage, name="ray-only"))
start = time.time()
trainer.fit()
print(json.dumps({"start": start, **json.loads(Path(mark).read_text())}))
"""


def ray_only_arm(head: Head, workers: int, workdir: Path, name: str) -> tuple[float, bool]:
    """Seconds from fit() to rank 0 entering an empty train fn, and whether the workers had torch."""
    proc = subprocess.run([sys.executable, "-c", RAY_ONLY, str(workers), str(workdir / f"{name}.json"),
                           str(workdir / name)], env=head.env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"ray-only arm failed: {proc.stderr.strip().splitlines()[-3:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    return out["t"] - out["start"], out["torch"]


def imports_arm(workers: int) -> float:
    """Seconds until the last of `workers` concurrent plain interpreters has imported torch & co."""
    start = time.monotonic()
    procs = [subprocess.Popen([sys.executable, "-c", IMPORTS]) for _ in range(workers)]
    if any(p.wait(timeout=1800) != 0 for p in procs):
        raise RuntimeError(f"`{IMPORTS}` failed in a plain interpreter")
    return time.monotonic() - start


def bench_startup_scale(sizes: list[int], nodes: int, cpus_per_node: int, rounds: int) -> dict[int, list[dict]]:
    results: dict[int, list[dict[str, Any]]] = {size: [] for size in sizes}
    with tempfile.TemporaryDirectory(prefix="raytrain-scale-") as tmp, simulated_cluster(nodes, cpus_per_node) as head:
        workdir = Path(tmp)
        for round_ in range(1, rounds + 1):
            for size in sizes:
                stages = run_arm(head, size, workdir, f"run-{size}-{round_}")
                ray_s, had_torch = ray_only_arm(head, size, workdir, f"ray-{size}-{round_}")
                imports_s = imports_arm(size)
                results[size].append({"stages": stages, "ray only s": ray_s, "imports s": imports_s})
                print(f"round {round_}/{rounds} workers {size}: run start-up {sum(stages.values()):.1f} s "
                      f"({', '.join(f'{k} {v:.1f}' for k, v in stages.items())}); ray only {ray_s:.1f} s"
                      f"{' (workers had torch)' if had_torch else ''}; imports {imports_s:.1f} s", flush=True)
    print(f"\n{nodes} nodes x {cpus_per_node} CPUs, median of {rounds} round(s), seconds\n")
    print(table(results))
    return results
