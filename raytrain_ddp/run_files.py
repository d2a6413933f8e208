"""The run's files on the driver: metrics.csv and .parquet (CSV_COLUMNS), summary.json and the rest,
each written whole (a reader never sees half a file), and read back for verify and scale. A run
directory is a local Path or an object store's ObjectPath (storage/): one PUT there is whole too."""

from __future__ import annotations

import csv
import io
import json
import os
from pathlib import Path
from typing import Any

from raytrain_ddp.storage.object_path import ObjectPath

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
    "model_state_mib",
    "data_wait_frac",
    "skipped_samples",
    "resizes",
]


def write_atomic(path: Path | ObjectPath, text: str) -> None:
    """Write to a temp file and rename, so a reader never sees half a file (an object: one PUT)."""
    if isinstance(path, ObjectPath):
        path.write_text(text)
        return
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=CSV_COLUMNS, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    write_atomic(path, out.getvalue())


def write_parquet(path: Path | ObjectPath, rows: list[dict[str, Any]]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    if isinstance(path, ObjectPath):
        pq.write_table(pa.Table.from_pylist(rows), path.key, filesystem=path.fs)
        return
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
