"""Metrics from the workers to the driver, and the files they end up in.

Ray Train V2 keeps no metrics reported without a checkpoint, and the driver is the one process sure
to see the user's `--storage-path`, so rank 0 sends its rows to a small actor that the driver polls.
"""

from __future__ import annotations

import csv
import io
import json
import os
from pathlib import Path
from typing import Any

import ray

CSV_COLUMNS = [
    "epoch",
    "train_loss",
    "train_acc",
    "val_loss",
    "val_acc",
    "lr",
    "epoch_time_s",
    "throughput",
    "samples",
    "val_samples",
    "world_size",
    "backend",
    "gpu_mem_peak_mib",
    "cpu_rss_mib",
    "data_wait_frac",
    "skipped_samples",
    "resizes",
]


@ray.remote(num_cpus=0)
class MetricsSink:
    """Holds what rank 0 last said, and whether the driver asks to stop.

    Rank 0 calls it fire-and-forget, except for one `stop_requested` every CONTROL_EVERY steps.
    """

    def __init__(self) -> None:
        self.stop_asked = False
        self.run: dict[str, Any] = {}
        self.last_step: dict[str, Any] | None = None
        self.rows: dict[int, dict[str, Any]] = {}

    def start(self, **run: Any) -> None:
        self.run.update(run)  # a restarted worker group keeps the first group's first_step_unix

    def step(self, **update: Any) -> None:
        self.last_step = update
        self.run.setdefault("first_step_unix", update["at"])  # time to first step, for benchmarks

    def epoch(self, row: dict[str, Any]) -> None:
        # Keyed by epoch: a worker group restarted after a failure reports the epoch again.
        self.rows[row["epoch"]] = row
        self.last_step = None

    def request_stop(self) -> None:
        """The driver got SIGUSR1/SIGTERM: the ranks checkpoint at their next agreed step and stop."""
        self.stop_asked = True

    def stop_requested(self) -> bool:
        return self.stop_asked

    def drain_saved(self, epoch: int, position: int) -> None:
        """Ray announced a node drain (a preemption); the ranks checkpointed and train on."""
        self.run["drain_saved"] = [epoch, position]

    def stopped(self, epoch: int, step: int) -> None:
        self.run["stopped_at"] = [epoch, step]

    def poll(self) -> tuple[dict[str, Any], dict[str, Any] | None, list[dict[str, Any]]]:
        return self.run, self.last_step, [self.rows[e] for e in sorted(self.rows)]


def write_atomic(path: Path, text: str) -> None:
    """Write to a temp file and rename, so a reader never sees half a file."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=CSV_COLUMNS, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    write_atomic(path, out.getvalue())


def write_parquet(path: Path, rows: list[dict[str, Any]]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    tmp = path.with_name(f".{path.name}.tmp")
    pq.write_table(pa.Table.from_pylist(rows), tmp)
    os.replace(tmp, path)


def tensorboard_writer(run_dir: Path) -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        from raytrain_ddp.config import ConfigError

        raise ConfigError("--tensorboard needs the tensorboard package: pip install tensorboard") from None
    return SummaryWriter(log_dir=str(run_dir / "tensorboard"))


def read_csv(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def write_json(path: Path, value: dict[str, Any]) -> None:
    write_atomic(path, json.dumps(value, indent=2) + "\n")
