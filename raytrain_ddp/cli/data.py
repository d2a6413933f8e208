"""`raytrain data convert`: a dataset in its own format to Parquet shards (data/convert.py does the work)."""

from __future__ import annotations

from pathlib import Path

import typer

from raytrain_ddp.cli.usage_errors import finite_float
from raytrain_ddp.data.convert import FORMATS, convert
from raytrain_ddp.data.download import DOWNLOADS
from raytrain_ddp.storage.location import check_store, is_uri, storage_root


def convert_command(
    src: Path = typer.Argument(..., metavar="SRC", help="The dataset's directory, as --data-dir names it for `raytrain run`."),
    dst: str = typer.Argument(..., metavar="DST", help="Where the Parquet shards and manifest.json go: a directory, or an object store's URI (s3://bucket/prefix)."),
    fmt: str = typer.Option(..., "--format", help=f"Source format: {', '.join(FORMATS)}."),
    val_fraction: float = typer.Option(0.1, parser=finite_float, help="Share held out for val when the source has no val split."),
    shard_mib: float = typer.Option(64.0, parser=finite_float, help="Target size of one Parquet file, MiB."),
    group_mib: float = typer.Option(4.0, parser=finite_float, help="Target size of one row group (the unit a reader holds), MiB."),
    seed: int = typer.Option(0, help="Seed of the one-off row shuffle."),
    skip_bad: bool = typer.Option(False, "--skip-bad", help="Leave out unreadable images (and count them)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace shards already in DST."),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="Show a progress bar."),
    download: bool = typer.Option(False, "--download", help=f"Fetch a public dataset ({', '.join(DOWNLOADS)}) into SRC first, where its files are not there."),
) -> None:
    """Write a dataset as Parquet shards + manifest.json, for --dataset parquet (and --loader ray)."""
    where = storage_root(dst, flag="DST")
    check_store(where, dst, flag="DST")  # a store that cannot take the shards: one line now, not after the decode
    manifest = convert(
        src, where, fmt, val_fraction=val_fraction, shard_mib=shard_mib, group_mib=group_mib, seed=seed,
        skip_bad=skip_bad, overwrite=overwrite, progress=progress, download=download,
    )
    train, val = manifest["splits"]["train"], manifest["splits"]["val"]
    skipped = train["skipped"] + val["skipped"]
    print(
        f"wrote {train['rows']} train + {val['rows']} val images in {len(train['files']) + len(val['files'])} "
        f"shards to {where}" + (f", skipped {skipped} unreadable" if skipped else "")
    )
    # On a store the ranks stream the shards (--loader ray); the torch loader would download each whole, on each rank.
    stream = " --loader ray" if is_uri(dst) else ""
    print(f"train with: raytrain run --dataset parquet --data-dir {dst if stream else where}{stream} "
          f"--num-classes {len(manifest['classes'])}")
