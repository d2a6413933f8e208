"""`raytrain data convert`: a dataset in its own format -> Parquet shards plus manifest.json.

The shards are what --dataset parquet reads and --loader ray streams. Rows are shuffled once
(seeded), so any run of rows mixes the classes and a streaming reader needs only a small shuffle
buffer. Row groups of a few MiB keep a reader's memory small, and files of tens of MiB give Ray Data
many files to read in parallel. Every image is decoded once here, so a corrupt file is caught now,
named, not halfway through training.

    raytrain data convert ~/data ~/data/cifar10-parquet --format cifar10
    raytrain run --dataset parquet --data-dir ~/data/cifar10-parquet --loader ray

DST may be on an object store (`s3://bucket/cifar10`), for clusters whose nodes share no
filesystem: each shard is streamed up as it is written, and the manifest, an object put whole, is
still written last.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from raytrain_ddp.config import ConfigError
from raytrain_ddp.storage.location import RunPath
from raytrain_ddp.storage.object_path import ObjectPath

if TYPE_CHECKING:
    from raytrain_ddp.data.formats import Samples

FORMATS = ("mnist", "cifar10", "tinyimagenet", "imagefolder")
"""The source formats; formats.read_layout reads them (imported late, as the command needs them)."""
MANIFEST = "manifest.json"
MIB = 1 << 20


def convert(
    src: Path,
    dst: RunPath,
    fmt: str,
    *,
    val_fraction: float = 0.1,
    shard_mib: float = 64.0,
    group_mib: float = 4.0,
    seed: int = 0,
    skip_bad: bool = False,
    overwrite: bool = False,
    progress: bool = True,
    download: bool = False,
) -> dict[str, Any]:
    """Write dst/{train,val}/part-NNNNN.parquet and dst/manifest.json; return the manifest.
    `download`: fetch a public dataset into src first where its files are not there."""
    from raytrain_ddp.data import formats
    from raytrain_ddp.data.formats import read_layout
    from raytrain_ddp.data.splits import hold_out

    if fmt not in FORMATS:
        raise ConfigError(f"unknown --format {fmt!r}; choose one of {', '.join(FORMATS)}")
    if not 0 < val_fraction < 1:
        raise ConfigError(f"--val-fraction must be between 0 and 1 (got {val_fraction})")
    if shard_mib <= 0 or group_mib <= 0 or group_mib > shard_mib:
        raise ConfigError(f"need 0 < --group-mib <= --shard-mib (got {group_mib} and {shard_mib})")
    src, dst = Path(src).expanduser(), dst.expanduser()
    if not src.is_dir() and not download:
        raise ConfigError(f"SRC {src} is not a directory; give the dataset's directory (as --data-dir names it for run)")
    if dst.exists() and not dst.is_dir():
        raise ConfigError(f"DST {dst} is a file; give a directory for the shards")
    layout = read_layout(fmt, src, download)
    train, val = (layout.train, layout.val) if layout.val is not None else hold_out(layout.train, val_fraction)
    clear(dst, overwrite)

    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
    )

    bar = Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
        console=Console(stderr=True), disable=not progress,
    )
    splits, sides = {}, []
    with bar:
        for name, samples in (("train", train), ("val", val)):
            task = bar.add_task(f"{name:5}", total=len(samples))
            splits[name] = write_split(
                samples, dst, name, layout.channels, len(layout.classes), sides,
                seed=seed, shard_bytes=int(shard_mib * MIB), group_bytes=int(group_mib * MIB),
                skip_bad=skip_bad, advance=lambda: bar.advance(task),
            )
    manifest = {
        "format": formats.MANIFEST_FORMAT,
        "source": layout.source,
        "classes": layout.classes,
        "channels": layout.channels,
        "image_size": layout.image_size,
        "image_sides": [min(sides), max(sides)] if sides else None,
        "columns": {"image": "encoded image file (PNG for mnist/cifar10)", "label": "class index", "source": "original file"},
        "splits": splits,
        "seed": seed,
    }
    # Written last: a manifest means the conversion finished (an object is put whole; a file is renamed into place).
    text = json.dumps(manifest, indent=2) + "\n"
    if isinstance(dst, ObjectPath):
        (dst / MANIFEST).write_text(text)
    else:
        tmp = dst / f".{MANIFEST}.tmp"
        tmp.write_text(text)
        os.replace(tmp, dst / MANIFEST)
    return manifest


def clear(dst: RunPath, overwrite: bool) -> None:
    """Make dst ready: refuse a finished conversion (its manifest) or folders with files that are not
    our shards unless --overwrite; an unfinished one of ours (a decode error stopped it) is redone
    without asking, as its error line tells the user to rerun."""
    ours = [dst / MANIFEST, dst / "train", dst / "val"]
    unfinished = not ours[0].exists() and all(holds_only_shards(p) for p in ours[1:])
    if any(p.exists() for p in ours):
        if not overwrite and not unfinished:
            raise ConfigError(f"{dst} already holds converted data; pass --overwrite or choose another DST")
        for p in ours:
            if isinstance(p, ObjectPath) and p.is_dir():
                p.fs.delete_dir(p.key)
            else:
                shutil.rmtree(p) if p.is_dir() else p.unlink(missing_ok=True)
    for split in ("train", "val"):
        (dst / split).mkdir(parents=True, exist_ok=True)


def holds_only_shards(split: RunPath) -> bool:
    """A split folder that is missing, or holds nothing but shards this module writes."""
    return not split.exists() or (split.is_dir() and all(f.name.startswith("part-") and f.suffix == ".parquet"
                                                         for f in split.iterdir()))


def write_split(
    samples: Samples, dst: RunPath, name: str, channels: int, num_classes: int, sides: list[int], *,
    seed: int, shard_bytes: int, group_bytes: int, skip_bad: bool, advance,
) -> dict[str, Any]:
    """Decode-check every sample and write them, shuffled, into size-bounded shards and row groups."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from raytrain_ddp.data import formats
    from raytrain_ddp.data.formats import BadSample

    schema = pa.schema([("image", pa.binary()), ("label", pa.int64()), ("source", pa.string())])
    files: list[str] = []
    counts = np.zeros(num_classes, np.int64)
    skipped = 0
    writer, file_bytes = None, 0
    rows: dict[str, list] = {"image": [], "label": [], "source": []}
    row_bytes = 0

    def flush() -> None:
        nonlocal writer, file_bytes, row_bytes
        if not rows["label"]:
            return
        if writer is None:
            files.append(f"{name}/part-{len(files):05d}.parquet")
            path = dst / files[-1]
            writer = pq.ParquetWriter(
                path.key if isinstance(path, ObjectPath) else path, schema,
                filesystem=path.fs if isinstance(path, ObjectPath) else None,
                compression={"image": "NONE", "label": "SNAPPY", "source": "SNAPPY"},  # images are compressed already
                use_dictionary=["label"], write_statistics=["label"],
            )
        table = pa.table(rows, schema=schema)
        writer.write_table(table, row_group_size=len(table))
        file_bytes += row_bytes
        for column in rows.values():
            column.clear()
        row_bytes = 0
        if file_bytes >= shard_bytes:
            writer.close()
            writer, file_bytes = None, 0

    for index in np.random.default_rng(seed).permutation(len(samples)):
        advance()
        source = samples.source(index)
        try:
            data = samples.encoded(index)
            image = formats.decode(data, channels, source)
        except BadSample as err:
            if not skip_bad:
                raise ConfigError(str(err)) from None
            skipped += 1
            continue
        sides.extend(image.shape[1:])
        label = int(samples.labels[index])
        if not 0 <= label < num_classes:
            raise ConfigError(f"label {label} of {source} is not one of the {num_classes} classes; fix the labels")
        counts[label] += 1
        rows["image"].append(data)
        rows["label"].append(label)
        rows["source"].append(source)
        row_bytes += len(data)
        if row_bytes >= group_bytes:
            flush()
    flush()
    if writer is not None:
        writer.close()
    if not files:
        raise ConfigError(f"no readable {name} images in the source; nothing to write")
    return {"rows": int(counts.sum()), "files": files, "class_counts": counts.tolist(), "skipped": skipped}

