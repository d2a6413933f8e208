"""`raytrain bench overhead`: what Ray Train costs against plain `torchrun --standalone`.

The same training three ways, alternated round by round so that drifting machine load hits all of
them alike: torchrun; `raytrain run` starting a fresh local Ray; `raytrain run` against a Ray
cluster that is already up (as on Slurm, where the sbatch starts Ray before the run). Each reports
the time from command start to the end of the first optimizer step, where those seconds went (the
start-up stages of startup.py; torchrun's where it has them), steady-state samples/s, and peak RSS
per worker. With --gpu both use NCCL and the GPU speed habits, and the table adds peak GPU
memory; with --workers 1 the baseline is a plain single-process loop. It prints figures; it
asserts nothing about speed.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from raytrain_ddp.config import TrainConfig
from raytrain_ddp.driver.metrics import read_csv
from raytrain_ddp.driver.startup import RUN_STAGES, stages, stages_line
from raytrain_ddp.bench.local_ray import local_head
from raytrain_ddp.driver.scale import steady

VARIANTS = ("torchrun", "raytrain fresh Ray", "raytrain running Ray")
TORCHRUN_STAGES = ("python", "process group", "data", "model", "first step")
"""The baseline's stages, named as raytrain's: `python` is torchrun's agent, the ranks' interpreters
and their imports; the rest as in startup.RUN_STAGES."""


def plain_env(cfg: TrainConfig) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["OMP_NUM_THREADS"] = str(cfg.cpus_per_worker)  # what raytrain gives its workers too
    return env


def run_torchrun(cfg: TrainConfig) -> dict[str, float]:
    started = time.time()
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={cfg.workers}",
         "-m", "raytrain_ddp.bench.torchrun_baseline", json.dumps(cfg.to_dict())],
        env=plain_env(cfg), capture_output=True, text=True, timeout=1800,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"torchrun baseline failed: {torchrun_failure(proc.stderr)}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    return {
        "first_step_s": result["first_step_unix"] - started,
        "stages": stages(started, {**result["marks"], "first step": result["first_step_unix"]}, TORCHRUN_STAGES),
        "samples_per_s": steady(result["throughputs"]),
        "rss_mib": result["rss_mib"],
        "gpu_mib": result["gpu_mem_peak_mib"],
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


def run_raytrain(cfg: TrainConfig, env: dict[str, str], workdir: Path, name: str) -> dict[str, float]:
    config = workdir / f"{name}.yaml"
    config.write_text(yaml.safe_dump({**cfg.to_dict(), "name": name, "storage_path": str(workdir)}))
    started = time.time()
    proc = subprocess.run(
        [sys.executable, "-m", "raytrain_ddp", "run", "--config", str(config)],
        env=env, capture_output=True, text=True, timeout=1800,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"raytrain run failed: {proc.stderr.strip().splitlines()[-1:]}")
    summary = json.loads((workdir / name / "summary.json").read_text())
    rows = read_csv(workdir / name / "metrics.csv")
    return {
        "first_step_s": summary["first_step_unix"] - started,
        "stages": summary["startup"]["stages"],
        "samples_per_s": steady([float(r["throughput"]) for r in rows]),
        "rss_mib": max(float(r["cpu_rss_mib"]) for r in rows),
        "gpu_mib": max(float(r["gpu_mem_peak_mib"]) for r in rows) if cfg.gpu else None,
    }


def report(results: dict[str, list[dict[str, float]]]) -> str:
    base = {key: statistics.median(r[key] for r in results["torchrun"]) for key in ("first_step_s", "samples_per_s")}
    lines = [
        f"{'variant':<22} {'first step s':>12} {'x torchrun':>10} {'samples/s':>10} {'x torchrun':>10} "
        f"{'RSS MiB/worker':>14} {'GPU MiB':>8}  runs (first step s)",
    ]
    for variant, runs in results.items():
        first = statistics.median(r["first_step_s"] for r in runs)
        rate = statistics.median(r["samples_per_s"] for r in runs)
        rss = statistics.median(r["rss_mib"] for r in runs)
        gpus = [r["gpu_mib"] for r in runs if r.get("gpu_mib") is not None]
        gpu = f"{statistics.median(gpus):.0f}" if gpus else "-"
        each = " ".join(f"{r['first_step_s']:.1f}" for r in runs)
        lines.append(
            f"{variant:<22} {first:>12.1f} {first / base['first_step_s']:>10.2f} {rate:>10.1f} "
            f"{rate / base['samples_per_s']:>10.3f} {rss:>14.0f} {gpu:>8}  {each}"
        )
    return "\n".join(lines) + "\n\n" + stages_table(results)


def stages_table(results: dict[str, list[dict[str, Any]]]) -> str:
    """Median seconds per start-up stage and variant, so a slower start points at its stage; `-`
    where a variant has no such stage."""
    names = ("total", *RUN_STAGES)
    widths = [max(len(name) + 2, 8) for name in names]
    lines = [f"{'start-up stages, median s':<26}" + "".join(f"{n:>{w}}" for n, w in zip(names, widths))]
    for variant, runs in results.items():
        timed = [r["stages"] for r in runs if r.get("stages")]
        cells = [statistics.median(sum(s.values()) for s in timed) if timed else None]
        for name in RUN_STAGES:
            found = [s[name] for s in timed if name in s]
            cells.append(statistics.median(found) if found else None)
        lines.append(f"{variant:<26}" + "".join("-".rjust(w) if c is None else f"{c:>{w}.1f}" for c, w in zip(cells, widths)))
    return "\n".join(lines)


def bench_overhead(cfg: TrainConfig, rounds: int) -> dict[str, list[dict[str, float]]]:
    # Medians over alternating rounds; the table reports them with every run's figure.
    # Fixed threads per worker, so raytrain's workers and torchrun's run alike (no CPU share).
    cfg = dataclasses.replace(
        cfg, progress="none", address=None, cpus_per_worker=cfg.cpus_per_worker or 1, placement=cfg.placement or "pack"
    )
    results: dict[str, list[dict[str, Any]]] = {v: [] for v in VARIANTS}
    with tempfile.TemporaryDirectory(prefix="raytrain-bench-") as tmp, local_head(
        num_cpus=cfg.workers * cfg.cpus_per_worker, num_gpus=cfg.workers if cfg.gpu else 0
    ) as head:
        workdir = Path(tmp)
        for round_ in range(1, rounds + 1):
            for variant in VARIANTS:
                if variant == "torchrun":
                    result = run_torchrun(cfg)
                elif variant == "raytrain fresh Ray":
                    result = run_raytrain(cfg, plain_env(cfg), workdir, f"fresh-{round_}")
                else:
                    result = run_raytrain(cfg, head.env, workdir, f"running-{round_}")
                results[variant].append(result)
                print(
                    f"round {round_}/{rounds} {variant:<22} first step {result['first_step_s']:.1f} s, "
                    f"{result['samples_per_s']:.1f} samples/s, {result['rss_mib']:.0f} MiB"
                    + (f", GPU {result['gpu_mib']:.0f} MiB" if result.get("gpu_mib") is not None else "")
                    + f"\n  {stages_line(result['stages'])}",
                    flush=True,
                )
    print(report(results))
    return results
