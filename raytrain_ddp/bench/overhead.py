"""`raytrain bench overhead`: what `raytrain run` costs against the DDP loop a user writes by hand.

In each regime (regimes.py: compute-bound, input-bound, per-step overhead) the two arms train the
same model on the same data with the same per-rank batch, threads, niceness and loader settings,
alternated round by round so that drifting machine load hits both alike: the hand-written loop
under `torchrun --standalone` (torchrun_baseline.py), and `raytrain run` on a Ray that is already
up (a private head, as on Slurm, where the sbatch starts Ray before the run). Each reports the
time from command start to the end of the first optimizer step, where those seconds went (the
start-up stages of startup.py; the hand loop's where it has them), steady-state samples/s, and the
niceness of its ranks, and the whole command's wall time. With --launch a third arm runs the same
hand-written loop under `raytrain launch`, its stages launch's then the script's. The machine's load
is printed at each regime's start and end. It prints figures; it asserts nothing about speed.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import yaml

from raytrain_ddp.bench.data import make_jpegs, process_tree
from raytrain_ddp.bench.local_ray import local_head
from raytrain_ddp.bench.regimes import GPU_COMPUTE, REGIMES, Regime, write_tensors
from raytrain_ddp.config import LOADER_WORKERS, TrainConfig
from raytrain_ddp.driver.core.startup import LAUNCH_STAGES, RUN_STAGES, stages, stages_line
from raytrain_ddp.driver.run.scale import steady
from raytrain_ddp.run_files import read_csv
from raytrain_ddp.worker import host_sync

ARMS = ("hand loop", "raytrain")
"""The hand-written loop under torchrun, and `raytrain run` on a running Ray."""
LAUNCH_ARM = "launch"
"""With --launch: the same hand-written loop under `raytrain launch` instead of torchrun."""
TORCHRUN_STAGES = ("python", "process group", "data", "model", "first step")
"""The hand loop's stages, named as raytrain's: `python` is torchrun's agent, the ranks' interpreters
and their imports; the rest as in startup.RUN_STAGES."""
STAGE_COLUMNS = (*RUN_STAGES[:RUN_STAGES.index("workers") + 1], *LAUNCH_STAGES[LAUNCH_STAGES.index("workers") + 1:],
                 "script imports", *RUN_STAGES[RUN_STAGES.index("workers") + 1:])
"""Every arm's stages in the order they happen: run's and launch's share theirs up to `workers`."""
SCRIPT_STAGES = ("script imports", "process group", "data", "model", "first step")
"""The hand loop's own stages under `raytrain launch`, after launch's (startup.LAUNCH_STAGES): its
interpreter's imports from the script's spawn, then the rest as under torchrun."""


def regime_config(cfg: TrainConfig, regime: Regime, overrides: dict[str, Any], workdir: Path) -> TrainConfig:
    """The run both arms make of `regime`, its data written: the regime's model, data and sizes
    unless the flags gave them. A JPEG tree (--data-dir, or one of --train-samples train images
    made here) is read whole by both arms."""
    own = dict(model=regime.model, dataset=regime.dataset, batch_size=regime.batch_size,
               train_samples=regime.train_samples, val_samples=regime.val_samples)
    if len(regime.shape) == 3:
        own["image_size"] = regime.shape[-1]
    own.update({k: v for k, v in overrides.items() if v is not None})
    given_dir = cfg.data_dir
    # Both arms load alike: the regime's data in memory in the rank, or as many loader processes each.
    workers = cfg.data_workers if cfg.data_workers is not None else LOADER_WORKERS
    cfg = dataclasses.replace(cfg, **own, data_workers=workers if regime.loader_workers else 0)
    if cfg.dataset == "imagefolder":
        # make_jpegs puts 1 image in 50 in val/
        tree = given_dir or str(make_jpegs(workdir / f"{regime.name}-jpegs", cfg.train_samples * 50 // 49 + 1))
        return dataclasses.replace(cfg, data_dir=tree, train_samples=0, val_samples=0)
    shape = (regime.shape[0], cfg.image_size, cfg.image_size) if len(regime.shape) == 3 else regime.shape
    folder = write_tensors(workdir / f"{regime.name}-tensors", shape, cfg.train_samples, cfg.val_samples or 64,
                           cfg.num_classes, cfg.seed)
    return dataclasses.replace(cfg, data_dir=str(folder))


def same_env(cfg: TrainConfig) -> dict[str, str]:
    """The hand loop's environment: threads as Ray gives its workers (OMP_NUM_THREADS = CPUs per
    worker), and no Ray address."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["OMP_NUM_THREADS"] = str(cfg.cpus_per_worker)
    return env


def run_hand_loop(cfg: TrainConfig) -> dict[str, Any]:
    started = time.time()
    with NiceWatch(cfg.workers) as nice:
        proc = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={cfg.workers}",
             "-m", "raytrain_ddp.bench.torchrun_baseline", json.dumps(cfg.to_dict())],
            env=same_env(cfg), capture_output=True, text=True, timeout=1800,
        )
    wall_s = time.time() - started
    if proc.returncode != 0:
        raise RuntimeError(f"the hand loop failed: {torchrun_failure(proc.stderr)}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    return {
        "first_step_s": result["first_step_unix"] - started,
        "stages": stages(started, {**result["marks"], "first step": result["first_step_unix"]}, TORCHRUN_STAGES),
        "samples_per_s": steady(result["throughputs"]),
        "wall_s": wall_s,
        "nice": nice.seen,
        "gpu_mib": result["gpu_mib"],
        "syncs_per_step": result["syncs_per_step"],
    }


def run_launch(cfg: TrainConfig, env: dict[str, str], workdir: Path, name: str) -> dict[str, Any]:
    """The hand loop of run_hand_loop, unchanged, under `raytrain launch` on the running Ray: its
    stages are launch's up to the script's start, then the script's own."""
    started = time.time()
    with NiceWatch(cfg.workers) as nice:
        proc = subprocess.run(
            [sys.executable, "-m", "raytrain_ddp", "launch", "--workers", str(cfg.workers),
             "--cpus-per-worker", str(cfg.cpus_per_worker), "--storage-path", str(workdir), "--name", name,
             "-m", "raytrain_ddp.bench.torchrun_baseline", json.dumps(cfg.to_dict())],
            env={**env, "OMP_NUM_THREADS": str(cfg.cpus_per_worker)}, capture_output=True, text=True, timeout=1800,
        )
    wall_s = time.time() - started
    if proc.returncode != 0:
        raise RuntimeError(f"raytrain launch failed: {proc.stderr.strip().splitlines()[-1:]}")
    run_dir = workdir / name
    result = json.loads((run_dir / "logs" / "rank-0.log").read_text().strip().splitlines()[-1])
    launched = json.loads((run_dir / "summary.json").read_text())["startup"]["stages"]
    script_start = started + sum(launched.values())
    own = {"script imports": result["marks"]["python"], **result["marks"], "first step": result["first_step_unix"]}
    return {
        "first_step_s": result["first_step_unix"] - started,
        "stages": {**launched, **stages(script_start, own, SCRIPT_STAGES)},
        "samples_per_s": steady(result["throughputs"]),
        "wall_s": wall_s,
        "nice": nice.seen,
        "gpu_mib": result["gpu_mib"],
        "syncs_per_step": result["syncs_per_step"],
    }


ROOT_CAUSE = "Root Cause (first observed failure):"
"""The heading of the failed rank's part of torchrun's summary."""


def torchrun_failure(stderr: str) -> str:
    """A failed torchrun's root cause in one line: the rank's last exception (or C++ `terminate`), and
    the rank and exit code from torchrun's summary (whose border is its stderr's last line)."""
    lines = [" ".join(line.split()) for line in stderr.splitlines() if line.strip()]
    raised = [line for line in lines if re.match(r"[\w.]*(Error|Exception)\b|terminate called", line)
              and "ChildFailedError" not in line]
    root = lines[lines.index(ROOT_CAUSE):] if ROOT_CAUSE in lines else []
    said = raised[-1:] + [line for line in root if line.startswith(("rank :", "exitcode :"))][:2]
    return "; ".join(said) or (lines[-1] if lines else "no output")


def run_raytrain(cfg: TrainConfig, env: dict[str, str], workdir: Path, name: str) -> dict[str, Any]:
    config = workdir / f"{name}.yaml"
    config.write_text(yaml.safe_dump({**cfg.to_dict(), "name": name, "storage_path": str(workdir)}))
    started = time.time()
    with NiceWatch(cfg.workers) as nice:
        proc = subprocess.run(
            [sys.executable, "-m", "raytrain_ddp", "run", "--config", str(config)],
            env=env, capture_output=True, text=True, timeout=1800,
        )
    wall_s = time.time() - started
    if proc.returncode != 0:
        raise RuntimeError(f"raytrain run failed: {proc.stderr.strip().splitlines()[-1:]}")
    summary = json.loads((workdir / name / "summary.json").read_text())
    rows = read_csv(workdir / name / "metrics.csv")
    return {
        "first_step_s": summary["first_step_unix"] - started,
        "stages": summary["startup"]["stages"],
        "samples_per_s": steady([float(r["throughput"]) for r in rows]),
        "wall_s": wall_s,
        "nice": nice.seen,
        "gpu_mib": max(float(r["gpu_mem_peak_mib"]) for r in rows) if cfg.gpu else None,
        "syncs_per_step": syncs_per_step(workdir / name, rows, cfg.batch_size),
    }


def syncs_per_step(run_dir: Path, rows: list[dict[str, str]], batch_size: int) -> float | None:
    """Rank 0's host syncs (counted on a GPU, host_sync.COUNT_FILE) per training step of the run."""
    counted = run_dir / host_sync.COUNT_FILE
    if not counted.is_file():
        return None
    steps = sum(math.ceil(int(r["samples"]) / int(r["world_size"]) / batch_size) for r in rows)
    return json.loads(counted.read_text())["syncs"] / steps


class NiceWatch:
    """The niceness of the `ranks` processes under this one that used the most CPU while the block
    ran, read from /proc every second: the ranks (or their loader workers, which inherit it), whoever
    started them, torchrun or Ray's raylet. CPU counts from the block's start, so processes that were
    busy before it (a Ray head's) do not pass for ranks. Empty where /proc is missing."""

    def __init__(self, ranks: int):
        self.ranks, self.seen = ranks, []
        self.before: dict[int, float] = {}
        """pid: CPU seconds when the block began."""
        self.cpu: dict[int, tuple[float, int]] = {}
        """pid: (CPU seconds since the block began, nice)."""
        self.done = threading.Event()
        self.thread = threading.Thread(target=self.watch, daemon=True)

    def __enter__(self) -> NiceWatch:
        self.before = {pid: cpu for pid, (cpu, _) in process_tree().items()}
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.done.set()
        self.thread.join()
        busiest = sorted(self.cpu.values(), reverse=True)[: self.ranks]
        self.seen = sorted({nice for _, nice in busiest})

    def watch(self) -> None:
        while not self.done.wait(1.0):
            for pid, (cpu, nice) in process_tree().items():
                if pid != os.getpid():  # the benchmark itself is no rank
                    self.cpu[pid] = (cpu - self.before.get(pid, 0.0), nice)


def report(results: dict[str, list[dict[str, Any]]]) -> str:
    """One regime's table: medians against the hand loop's, each arm's ranks' niceness, its peak GPU
    memory and host syncs per training step (`-` on CPU) and each round's figures; then its start-up
    stages."""
    keys = ("first_step_s", "samples_per_s", "wall_s")
    base = {key: statistics.median(r[key] for r in results["hand loop"]) for key in keys}
    lines = [
        f"{'arm':<10} {'first step s':>12} {'x hand loop':>11} {'samples/s':>10} {'x hand loop':>11} {'whole s':>8} "
        f"{'x hand loop':>11} {'nice':>5} {'GPU MiB':>8} {'syncs/step':>10}  rounds (first step s; samples/s)",
    ]
    for arm, runs in results.items():
        first, rate, wall = (statistics.median(r[key] for r in runs) for key in keys)
        nice = ",".join(str(n) for n in sorted({n for r in runs for n in r.get("nice", [])})) or "?"
        gpus = [r["gpu_mib"] for r in runs if r.get("gpu_mib") is not None]
        gpu = f"{statistics.median(gpus):.0f}" if gpus else "-"
        counts = [r["syncs_per_step"] for r in runs if r.get("syncs_per_step") is not None]
        syncs = f"{statistics.median(counts):.3f}" if counts else "-"
        each = " ".join(f"{r['first_step_s']:.1f}" for r in runs) + "; " + " ".join(f"{r['samples_per_s']:.1f}" for r in runs)
        lines.append(
            f"{arm:<10} {first:>12.1f} {first / base['first_step_s']:>11.2f} {rate:>10.1f} "
            f"{rate / base['samples_per_s']:>11.3f} {wall:>8.1f} {wall / base['wall_s']:>11.2f} {nice:>5} {gpu:>8} "
            f"{syncs:>10}  {each}"
        )
    return "\n".join(lines) + "\n\n" + stages_table(results)


def stages_table(results: dict[str, list[dict[str, Any]]]) -> str:
    """Median seconds per start-up stage and arm, so a slower start points at its stage; `-` where
    an arm has no such stage; only the stages some arm has are columns."""
    seen = {name for runs in results.values() for r in runs for name in r.get("stages", {})}
    names = ("total", *(name for name in STAGE_COLUMNS if name in seen))
    widths = [max(len(name) + 2, 8) for name in names]
    lines = [f"{'start-up stages, median s':<26}" + "".join(f"{n:>{w}}" for n, w in zip(names, widths))]
    for arm, runs in results.items():
        timed = [r["stages"] for r in runs if r.get("stages")]
        cells = [statistics.median(sum(s.values()) for s in timed) if timed else None]
        for name in names[1:]:
            found = [s[name] for s in timed if name in s]
            cells.append(statistics.median(found) if found else None)
        lines.append(f"{arm:<26}" + "".join("-".rjust(w) if c is None else f"{c:>{w}.1f}" for c, w in zip(cells, widths)))
    return "\n".join(lines)


def load_line(when: str) -> str:
    one, five, fifteen = os.getloadavg()
    return f"load average {when}: {one:.2f} {five:.2f} {fifteen:.2f} ({os.cpu_count()} CPUs)"


def bench_overhead(
    cfg: TrainConfig, regimes: list[str], rounds: int, overrides: dict[str, Any], launch: bool = False,
) -> dict[str, dict[str, list[dict[str, Any]]]]:
    """Every regime's arms alternated for `rounds` rounds; prints each regime's table as it ends.
    `launch`: a third arm, the hand loop under `raytrain launch`."""
    arms = (*ARMS, LAUNCH_ARM) if launch else ARMS
    # Fixed threads per worker, so raytrain's workers and the hand loop's run alike (no CPU share).
    cfg = dataclasses.replace(
        cfg, progress="none", address=None, cpus_per_worker=cfg.cpus_per_worker or 1, placement=cfg.placement or "pack"
    )
    tables = {}
    # On a GPU both arms count their host syncs: torch's warn mode costs a flag test per sync.
    counting = {host_sync.CHECK_ENV: "count"} if cfg.gpu else None
    with tempfile.TemporaryDirectory(prefix="raytrain-bench-") as tmp, local_head(
        num_cpus=cfg.workers * cfg.cpus_per_worker, extra_env=counting, num_gpus=cfg.workers if cfg.gpu else 0
    ) as head:
        workdir = Path(tmp)
        for name in regimes:
            # With --gpu every regime trains on the GPU; the compute regime's model is the GPU's own.
            regime = GPU_COMPUTE if cfg.gpu and name == "compute" else REGIMES[name]
            run_cfg = regime_config(cfg, regime, overrides, workdir)
            print(f"\n== {name}: {regime.what}; {run_cfg.workers} ranks, batch {run_cfg.batch_size} per rank, "
                  f"{run_cfg.epochs} epochs, {run_cfg.data_workers} loader workers\n{load_line('at the start')}", flush=True)
            results: dict[str, list[dict[str, Any]]] = {arm: [] for arm in arms}
            for round_ in range(1, rounds + 1):
                for arm in arms:
                    if arm == "hand loop":
                        result = run_hand_loop(run_cfg)
                    elif arm == LAUNCH_ARM:
                        result = run_launch(run_cfg, head.env, workdir, f"{name}-launch-{round_}")
                    else:
                        result = run_raytrain(run_cfg, head.env, workdir, f"{name}-{round_}")
                    results[arm].append(result)
                    print(f"round {round_}/{rounds} {arm:<10} first step {result['first_step_s']:.1f} s, "
                          f"{result['samples_per_s']:.1f} samples/s, nice {result['nice']}\n  {stages_line(result['stages'])}",
                          flush=True)
            print(f"{load_line('at the end')}\n\n{report(results)}", flush=True)
            tables[name] = results
    return tables
