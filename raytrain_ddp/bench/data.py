"""`raytrain bench data`: decoded and augmented images/s per CPU core, for each ingest path.

One generated set of 64x64 JPEGs (TinyImageNet's size) is read, in the same run, by:

    baseline       torchvision.datasets.ImageFolder (PIL) + DataLoader, the textbook recipe
    torch          --loader torch over the same folder (torchvision.io decoding, our transforms)
    torch+parquet  --loader torch over the same images converted to Parquet shards
    ray+parquet    --loader ray: Ray Data reads the shards, decodes and augments in its tasks

Every path applies the same augmentation (RandomResizedCrop, flip, normalise) to the same images
with the same CPU budget, and the timed pass is a warm one (workers started, files cached). It
prints images/s, images/s per core, and each path's ratio to the baseline.

    raytrain bench data                 # 10000 images, all cores of this machine
    raytrain bench data --tiny          # a few hundred images: a smoke test for CI
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Iterable

import numpy as np

SIZE = 64
CLASSES = 10
TINY_IMAGES = 320
"""Images of `raytrain bench data --tiny`, a smoke test for CI."""


def make_jpegs(root: Path, images: int, seed: int = 0) -> Path:
    """root/{train,val}/<class>/*.JPEG: smooth class-tinted textures, about TinyImageNet's file size.

    val holds 1 image in 50, so the train split is the same set for every path.
    """
    from PIL import Image

    rng = np.random.default_rng(seed)
    tints = rng.integers(40, 216, (CLASSES, 3))
    for k in range(images):
        split = "val" if k % 50 == 49 else "train"
        label = k % CLASSES
        folder = root / split / f"class_{label}"
        folder.mkdir(parents=True, exist_ok=True)
        low = rng.normal(0, 40, (8, 8, 3))
        texture = np.kron(low, np.ones((SIZE // 8, SIZE // 8, 1))) + rng.normal(0, 12, (SIZE, SIZE, 3))
        pixels = np.clip(tints[label] + texture, 0, 255).astype(np.uint8)
        Image.fromarray(pixels).save(folder / f"{k:06d}.JPEG", quality=90)
    return root


def timed_passes(batches: Iterable, passes: int, on_pass=None) -> tuple[int, float, float | None]:
    """Iterate `passes` times; return (images, wall seconds, CPU seconds) of the last, warm pass.

    CPU seconds are those of this process and all its descendants (DataLoader workers; a private
    Ray's workers), read from /proc: unlike wall time they do not depend on what else the machine
    runs. None where /proc is missing.
    """
    images, seconds, cpu = 0, 0.0, None
    for number in range(passes):
        if on_pass is not None:
            on_pass(number)
        images, before, start = 0, tree_cpu_seconds(), time.perf_counter()
        for batch, _ in batches:
            images += len(batch)
        seconds, after = time.perf_counter() - start, tree_cpu_seconds()
        cpu = sum(t - before.get(pid, 0.0) for pid, t in after.items()) if after else None
    return images, seconds, cpu


def tree_cpu_seconds(root: int | None = None) -> dict[int, float]:
    """User + system CPU seconds of `root` (this process) and its descendants, by pid (Linux)."""
    root = root or os.getpid()
    parent, cpu = {}, {}
    try:
        entries = [e for e in os.listdir("/proc") if e.isdigit()]
    except OSError:
        return {}
    tick = os.sysconf("SC_CLK_TCK")
    for entry in entries:
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:  # gone since the listing
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # the name may hold spaces; fields 3.. follow it
        parent[int(entry)], cpu[int(entry)] = int(fields[1]), (int(fields[11]) + int(fields[12])) / tick
    tree, grew = {root}, True
    while grew:
        new = {pid for pid, ppid in parent.items() if ppid in tree} - tree
        tree |= new
        grew = bool(new)
    return {pid: cpu[pid] for pid in tree if pid in cpu}


def baseline(root: Path, cpus: int, batch_size: int, passes: int) -> tuple[int, float, float | None]:
    """The plain torchvision recipe: ImageFolder with its PIL loader, v2 transforms, DataLoader."""
    import torch
    from torch.utils.data import DataLoader
    from torchvision.datasets import ImageFolder
    from torchvision.transforms import v2

    from raytrain_ddp.data.transforms import IMAGENET_MEAN, IMAGENET_STD

    transform = v2.Compose([
        v2.ToImage(),
        v2.RandomResizedCrop(SIZE, scale=(0.25, 1.0), antialias=True),
        v2.RandomHorizontalFlip(),
        v2.ToDtype(torch.float32, scale=True),
        v2.Normalize(IMAGENET_MEAN, IMAGENET_STD),
    ])
    dataset = ImageFolder(str(root / "train"), transform=transform)
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=True, num_workers=cpus, persistent_workers=True)
    return timed_passes(loader, passes)


def torch_path(dataset: str, root: Path, cpus: int, batch_size: int, passes: int) -> tuple[int, float, float | None]:
    """Our --loader torch, exactly as a worker builds it (one rank)."""
    from raytrain_ddp.config import TrainConfig
    from raytrain_ddp.data.loaders import make_loaders

    cfg = TrainConfig(
        dataset=dataset, data_dir=str(root), image_size=SIZE, num_classes=CLASSES, train_samples=0,
        val_samples=0, data_workers=cpus, batch_size=batch_size,
    )
    loaders = make_loaders(cfg, rank=0, world_size=1, cuda=False)
    return timed_passes(loaders.train, passes, on_pass=lambda n: loaders.set_epoch(n + 1))


def ray_path(root: Path, batch_size: int, passes: int) -> tuple[int, float, float | None]:
    """Our --loader ray: the same lazy Dataset ray_datasets builds, read as a worker reads its shard."""
    from raytrain_ddp.config import TrainConfig
    from raytrain_ddp.data import formats
    from raytrain_ddp.data.ray_ingest import SHUFFLE_BUFFER_BATCHES, RayShard, ray_split
    from raytrain_ddp.data.transforms import RECIPES, normalization

    cfg = TrainConfig(
        dataset="parquet", data_dir=str(root), loader="ray", image_size=SIZE, num_classes=CLASSES,
        train_samples=0, val_samples=0, batch_size=batch_size,
    )
    manifest = formats.read_manifest(root)
    dataset = ray_split(cfg, root, manifest, "train")
    normalize = normalization(RECIPES[manifest["source"]])
    return timed_passes(RayShard(dataset.iterator(), batch_size, SHUFFLE_BUFFER_BATCHES * batch_size, normalize), passes)


def bench_data(
    images: int = 10_000,
    cpus: int | None = None,
    batch_size: int = 256,
    passes: int = 2,
    address: str | None = None,
    workdir: Path | None = None,
    paths: tuple[str, ...] = ("baseline", "torch", "torch+parquet", "ray+parquet"),
    echo=print,
) -> dict[str, Any]:
    """Generate the images, time each path, print the table; return the figures."""
    import ray

    from raytrain_ddp.data.convert import convert

    cpus = cpus or os.cpu_count() or 1
    root = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="raytrain-bench-"))
    try:
        jpegs, shards, made = root / "jpeg", root / "parquet", root / "images.txt"
        if not made.exists() or made.read_text() != str(images):
            echo(f"generating {images} {SIZE}x{SIZE} JPEGs in {jpegs} ...")
            shutil.rmtree(jpegs, ignore_errors=True)
            make_jpegs(jpegs, images)
            convert(jpegs, shards, "imagefolder", progress=False, shard_mib=8, group_mib=1, overwrite=True)
            made.write_text(str(images))
        runs = {
            "baseline": lambda: baseline(jpegs, cpus, batch_size, passes),
            "torch": lambda: torch_path("imagefolder", jpegs, cpus, batch_size, passes),
            "torch+parquet": lambda: torch_path("parquet", shards, cpus, batch_size, passes),
            "ray+parquet": lambda: ray_path(shards, batch_size, passes),
        }
        results = []
        for name in paths:
            if name.startswith("ray") and not ray.is_initialized():
                connect_ray(address, cpus)  # only now, so Ray's processes cost the other paths nothing
            n, seconds, cpu = runs[name]()
            if name.startswith("ray") and address:
                cpu = None  # an existing cluster's workers are not our descendants
            cores = int(ray.cluster_resources().get("CPU", cpus)) if name.startswith("ray") else cpus
            results.append({"path": name, "images": n, "seconds": round(seconds, 3), "cores": cores,
                            "cpu_seconds": cpu and round(cpu, 2), "images_per_s": round(n / seconds, 1)})
        # Per core: images per CPU-second the path used, which other load on the machine barely
        # moves; where any path's CPU time is unknown, all fall back to images/s / cores given.
        by_cpu = all(r["cpu_seconds"] for r in results)
        for r in results:
            r["per_core"] = round(r["images"] / r["cpu_seconds"] if by_cpu else r["images_per_s"] / r["cores"], 1)
        base = next((r["per_core"] for r in results if r["path"] == "baseline"), None)
        for r in results:
            r["vs_baseline"] = round(r["per_core"] / base, 2) if base else None
        report = {"images": images, "size": SIZE, "batch_size": batch_size, "cpus": cpus,
                  "per_core": "images per CPU-second" if by_cpu else "images/s per core given", "results": results}
        echo(table(report))
        return report
    finally:
        if workdir is None:
            shutil.rmtree(root, ignore_errors=True)


def connect_ray(address: str | None, cpus: int) -> None:
    import ray

    if address:
        ray.init(address=address, logging_level="ERROR", log_to_driver=False)
    else:  # a private Ray with the CPU budget the DataLoader paths get as workers
        ray.init(address="local", num_cpus=cpus, include_dashboard=False, logging_level="ERROR",
                 log_to_driver=False, _temp_dir=os.path.join(tempfile.gettempdir(), f"raytrain-{os.getuid()}"))
    import ray.data  # first: importing it sets up its loggers

    logging.getLogger("ray.data").setLevel(logging.ERROR)  # then: turning the bars off logs a warning
    ray.data.DataContext.get_current().enable_progress_bars = False


def table(report: dict[str, Any]) -> str:
    lines = [
        f"data benchmark: {report['images']} {report['size']}x{report['size']} JPEGs, batch {report['batch_size']}, "
        f"{report['cpus']} loader CPUs, RandomResizedCrop + flip + normalise, warm pass; "
        f"per core = {report['per_core']}",
        f"{'path':<15}{'images/s':>10}{'CPU s':>8}{'per core':>10}{'vs baseline':>13}",
    ]
    for r in report["results"]:
        ratio = f"{r['vs_baseline']:.2f}x" if r["vs_baseline"] is not None else "-"
        cpu = f"{r['cpu_seconds']:.1f}" if r.get("cpu_seconds") else "-"
        lines.append(f"{r['path']:<15}{r['images_per_s']:>10.0f}{cpu:>8}{r['per_core']:>10.0f}{ratio:>13}")
    return "\n".join(lines)

