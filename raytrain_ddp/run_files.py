"""The run's files on the driver: metrics.csv and .parquet (CSV_COLUMNS), summary.json and the rest,
each written whole (a reader never sees half a file), and read back for verify and scale. A run
directory is a local Path or an object store's ObjectPath (storage/): an upload there is seen whole too."""

from __future__ import annotations

import csv
import io
import json
import os
from pathlib import Path
from typing import Any

from raytrain_ddp.storage.object_path import ObjectPath
from raytrain_ddp.storage.staged import StagedDir

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
    """Write to a temp file and rename, so a reader never sees half a file (an object: one upload,
    which appears when it completes)."""
    if isinstance(path, ObjectPath):
        path.write_text(text)
        return
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_png(path: Path | ObjectPath, fig: Any, **savefig: Any) -> None:
    """A matplotlib figure as a PNG, written whole as write_atomic writes text; the figure is closed."""
    import matplotlib.pyplot as plt

    image = io.BytesIO()
    fig.savefig(image, format="png", **savefig)
    plt.close(fig)
    if isinstance(path, ObjectPath):
        path.write_bytes(image.getvalue())
        return
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(image.getvalue())
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


def tensorboard_writer(run_dir: Path | ObjectPath) -> Any:
    """A SummaryWriter of the run's tensorboard/ directory (StagedEvents' on an object store)."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        from raytrain_ddp.config import ConfigError

        raise ConfigError("--tensorboard needs the tensorboard package: pip install tensorboard") from None
    if isinstance(run_dir, ObjectPath):
        return StagedEvents(SummaryWriter, run_dir / "tensorboard")
    return SummaryWriter(log_dir=str(run_dir / "tensorboard"))


class StagedEvents:
    """TensorBoard's event files for a run on an object store. A SummaryWriter appends to a local
    file, which an object cannot be; so it writes into a staged directory, and each flush (at each
    epoch's row) copies its files up whole, a few KiB an epoch. A resumed run's writer starts a file
    of its own, beside the earlier ones, as on disk."""

    def __init__(self, writer: Any, remote: ObjectPath) -> None:
        self.staged = StagedDir(remote)
        self.writer = writer(log_dir=str(self.staged.local))

    def add_scalar(self, *args: Any, **kwargs: Any) -> None:
        self.writer.add_scalar(*args, **kwargs)

    def flush(self) -> None:
        self.writer.flush()
        self.staged.sync()  # already behind the driver's poll (news.py's WriteBehind)


def read_csv(path: Path | ObjectPath) -> list[dict[str, str]]:
    return list(csv.DictReader(io.StringIO(path.read_text(), newline="")))


def write_json(path: Path, value: dict[str, Any]) -> None:
    write_atomic(path, json.dumps(value, indent=2) + "\n")
