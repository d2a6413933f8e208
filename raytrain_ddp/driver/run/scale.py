"""`raytrain scale --workers 1,2,4,8 [--strategy ddp,fsdp]`: the same job at each size, under each
strategy, and the table users fill by hand.

Writes <storage-path>/<name>/scale.csv, scale.md and scale.png beside one run directory per strategy
and size (<strategy>-workers-<N>). Scaling is against the same strategy's smallest run.
"""

from __future__ import annotations

import csv
import dataclasses
import io
from typing import Any

from raytrain_ddp.config import STRATEGIES, ConfigError, TrainConfig
from raytrain_ddp.driver.plan import run_lock
from raytrain_ddp.driver.plan.preflight import resolve_run
from raytrain_ddp.driver.run import command as driver
from raytrain_ddp.run_files import read_csv, write_atomic, write_png
from raytrain_ddp.storage.location import RunPath, below

COLUMNS = [
    "strategy",
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
    "model_state_mib",
]


def parse_strategies(text: str) -> list[str]:
    strategies = [part.strip() for part in text.split(",") if part.strip()]
    if not strategies or len(set(strategies)) != len(strategies) or set(strategies) - set(STRATEGIES):
        raise ConfigError(f"--strategy for scale is a list of distinct strategies like ddp,fsdp (got {text!r})")
    return strategies


def parse_sizes(text: str) -> list[int]:
    try:
        sizes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1 or len(set(sizes)) != len(sizes):
        raise ConfigError(f"--workers takes distinct counts like 1,2,4,8 (got {text!r})")
    return sorted(sizes)


def steady(values: list[float]) -> float:
    """Mean over epochs after the first, which pays for warm-up; the only epoch if there is one."""
    tail = values[1:] or values
    return sum(tail) / len(tail)


def table(summaries: list[dict[str, Any]], rows_per_run: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per run, in the order given, with scaling against the first run of the same strategy
    (the smallest, as scale() runs them)."""
    out = []
    for summary, rows in zip(summaries, rows_per_run):
        cfg = summary["config"]
        gpu = [float(r["gpu_mem_peak_mib"]) for r in rows if r.get("gpu_mem_peak_mib") not in (None, "")]
        state = [float(r["model_state_mib"]) for r in rows if r.get("model_state_mib") not in (None, "")]
        out.append(
            {
                "strategy": cfg["strategy"] if cfg["strategy"] == "ddp" else f"fsdp {cfg['sharding']}",
                "workers": summary["world_size"],
                "config": f"{cfg['model']} {cfg['dataset']} {cfg['image_size']}px bs{cfg['batch_size']}/worker "
                f"{cfg['optimizer']} {summary['backend']}",
                "train_loss": float(rows[-1]["train_loss"]),
                "train_acc": float(rows[-1]["train_acc"]),
                "throughput": steady([float(r["throughput"]) for r in rows]),
                "gpu0_peak_mib": max(gpu) if gpu else None,
                "gpu0_avg_mib": sum(gpu) / len(gpu) if gpu else None,
                "cpu_rss_mib": max(float(r["cpu_rss_mib"]) for r in rows),
                "model_state_mib": max(state) if state else None,
            }
        )
    bases: dict[str, dict[str, Any]] = {}
    for row in out:
        base = bases.setdefault(row["strategy"], row)
        memory_key = "gpu0_peak_mib" if base["gpu0_peak_mib"] else "cpu_rss_mib"
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


def plot(rows: list[dict[str, Any]], path: RunPath) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display on cluster nodes
    import matplotlib.pyplot as plt

    fig, (speed, efficiency, state) = plt.subplots(1, 3, figsize=(15, 4))
    workers = sorted({r["workers"] for r in rows})
    for strategy in dict.fromkeys(r["strategy"] for r in rows):
        mine = [r for r in rows if r["strategy"] == strategy]
        sizes = [r["workers"] for r in mine]
        line = speed.plot(sizes, [r["throughput"] for r in mine], "o-", label=strategy)[0]
        ideal = [mine[0]["throughput"] * w / sizes[0] for w in sizes]
        speed.plot(sizes, ideal, "--", color=line.get_color(), alpha=0.5, label=f"{strategy}, ideal (linear)")
        efficiency.plot(sizes, [100 * r["efficiency"] for r in mine], "o-", label=strategy)
        if mine[0]["model_state_mib"] is not None:
            state.plot(sizes, [r["model_state_mib"] for r in mine], "o-", label=strategy)
    speed.set(xlabel="workers", ylabel="samples/s", title="Throughput", xticks=workers)
    efficiency.axhline(100, ls="--", color="grey")
    efficiency.set(xlabel="workers", ylabel="% of linear", title="Scaling efficiency", xticks=workers, ylim=(0, 110))
    state.set(xlabel="workers", ylabel="MiB", title="model_state_mib (largest rank)", xticks=workers, ylim=(0, None))
    for ax in (speed, efficiency, state):
        ax.legend()
    fig.suptitle(rows[0]["config"])
    fig.tight_layout()
    write_png(path, fig, dpi=120)


def scale(cfg: TrainConfig, sizes: list[int], strategies: list[str] | None = None, sharding: str | None = None) -> RunPath:
    """Run each strategy (default cfg's) at each size, then write and print the table; returns the
    study's directory. The strategies take turns at each size, so a machine that slows down over the
    study slows them alike. `sharding` (default cfg's) is the fsdp runs'."""
    strategies = strategies or [cfg.strategy]
    if sharding and "fsdp" not in strategies:
        raise ConfigError(f"--sharding {sharding} is for the fsdp runs; add fsdp to --strategy (e.g. ddp,fsdp)")
    dataclasses.replace(cfg, strategy="fsdp", sharding=sharding or cfg.sharding)  # a bad --sharding fails now, not after some runs
    cfg, study_dir = resolve_run(cfg)
    run_lock.take(study_dir)  # two studies on one --name would write one table over the other's
    runs = {}
    for n in sizes:
        for strategy in strategies:
            run_cfg = dataclasses.replace(cfg, workers=n, strategy=strategy,
                                          sharding=(sharding or cfg.sharding) if strategy == "fsdp" else "full",
                                          storage_path=below(cfg.storage_path, study_dir.name),
                                          name=f"{strategy}-workers-{n}")
            summary = driver.run(run_cfg)
            runs[strategy, n] = summary, read_csv(study_dir / run_cfg.name / "metrics.csv")
    ordered = [runs[strategy, n] for strategy in strategies for n in sizes]  # the table: by strategy, then size
    result = table([summary for summary, _ in ordered], [rows for _, rows in ordered])
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
