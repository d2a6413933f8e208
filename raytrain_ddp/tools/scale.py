"""`raytrain scale --workers 1,2,4,8`: the same job at each size, and the table users fill by hand.

Writes <storage-path>/<name>/scale.csv, scale.md and scale.png beside one run directory per size.
"""

from __future__ import annotations

import csv
import dataclasses
import io
from pathlib import Path
from typing import Any

from raytrain_ddp.config import ConfigError, TrainConfig
from raytrain_ddp.metrics import write_atomic

COLUMNS = [
    "workers",
    "config",
    "train_loss",
    "train_acc",
    "throughput",
    "gpu0_peak_mib",
    "gpu0_avg_mib",
    "cpu_rss_mib",
    "throughput_scaling",
    "efficiency",
    "memory_scaling",
]


def parse_sizes(text: str) -> list[int]:
    try:
        sizes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1 or len(set(sizes)) != len(sizes):
        raise ConfigError(f"--workers for scale is a list of distinct counts like 1,2,4,8 (got {text!r})")
    return sorted(sizes)


def steady(values: list[float]) -> float:
    """Mean over epochs after the first, which pays for warm-up; the only epoch if there is one."""
    tail = values[1:] or values
    return sum(tail) / len(tail)


def table(summaries: list[dict[str, Any]], rows_per_run: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per run, with scaling against the smallest run (the first)."""
    out = []
    for summary, rows in zip(summaries, rows_per_run):
        cfg = summary["config"]
        gpu = [float(r["gpu_mem_peak_mib"]) for r in rows if r.get("gpu_mem_peak_mib") not in (None, "")]
        out.append(
            {
                "workers": summary["world_size"],
                "config": f"{cfg['model']} {cfg['dataset']} {cfg['image_size']}px bs{cfg['batch_size']}/worker "
                f"{summary['backend']}",
                "train_loss": float(rows[-1]["train_loss"]),
                "train_acc": float(rows[-1]["train_acc"]),
                "throughput": steady([float(r["throughput"]) for r in rows]),
                "gpu0_peak_mib": max(gpu) if gpu else None,
                "gpu0_avg_mib": sum(gpu) / len(gpu) if gpu else None,
                "cpu_rss_mib": max(float(r["cpu_rss_mib"]) for r in rows),
            }
        )
    base = out[0]
    memory_key = "gpu0_peak_mib" if base["gpu0_peak_mib"] else "cpu_rss_mib"
    for row in out:
        row["throughput_scaling"] = row["throughput"] / base["throughput"]
        row["efficiency"] = row["throughput_scaling"] / (row["workers"] / base["workers"])
        row["memory_scaling"] = row[memory_key] / base[memory_key]
    return out


def fmt(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 10 else f"{value:.1f}"
    return str(value)


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(fmt(row[c]) for c in COLUMNS) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display on cluster nodes
    import matplotlib.pyplot as plt

    workers = [r["workers"] for r in rows]
    ideal = [rows[0]["throughput"] * w / workers[0] for w in workers]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.plot(workers, [r["throughput"] for r in rows], "o-", label="measured")
    left.plot(workers, ideal, "--", color="grey", label="ideal (linear)")
    left.set(xlabel="workers", ylabel="samples/s", title="Throughput", xticks=workers)
    left.legend()
    right.plot(workers, [100 * r["efficiency"] for r in rows], "o-", color="tab:green")
    right.axhline(100, ls="--", color="grey")
    right.set(xlabel="workers", ylabel="% of linear", title="Scaling efficiency", xticks=workers, ylim=(0, 110))
    fig.suptitle(rows[0]["config"])
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def scale(cfg: TrainConfig, sizes: list[int]) -> Path:
    """Run each size, then write and print the table; returns the study's directory."""
    from raytrain_ddp import cluster, driver
    from raytrain_ddp.metrics import read_csv

    cfg, study_dir = cluster.resolve_run(cfg)
    summaries, rows = [], []
    for n in sizes:
        run_cfg = dataclasses.replace(cfg, workers=n, storage_path=str(study_dir), name=f"workers-{n}")
        summary = driver.run(run_cfg)
        summaries.append(summary)
        rows.append(read_csv(Path(summary["run_dir"]) / "metrics.csv"))
    result = table(summaries, rows)
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=COLUMNS, lineterminator="\n")
    writer.writeheader()
    writer.writerows(result)
    write_atomic(study_dir / "scale.csv", out.getvalue())
    write_atomic(study_dir / "scale.md", markdown(result))
    plot(result, study_dir / "scale.png")
    print(markdown(result), end="")
    print(f"-> {study_dir}/scale.csv, scale.md, scale.png")
    return study_dir
