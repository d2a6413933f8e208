"""`raytrain bench data`: CPU microseconds per training image of each ingest path, against a plain
torchvision Dataset + DataLoader over the same data.

Three sources, each read in the same run by the plain recipe and by ours:

    synthetic    SyntheticImages in a plain DataLoader  vs  --dataset synthetic
    imagefolder  a generated set of 64x64 JPEGs (TinyImageNet's size): torchvision ImageFolder
                 vs --loader torch over the same folder
    parquet      the same images converted to Parquet shards: a plain Dataset over their rows
                 vs --loader torch, and --loader ray (Ray Data reads, decodes and augments)

A plain path decodes as ours does (torchvision.io.decode_image) and applies the same v2 transforms
(RandomResizedCrop, flip, normalise), so the ratio is what our path itself costs. Every path gets
the same CPU budget, and the pass reported is the cheapest warm one (workers started, files cached).

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
    """Iterate `passes` times; return (images, wall seconds, CPU seconds) of the cheapest warm pass
    (the first warms up, unless it is the only one).

    CPU seconds are those of this process and all its descendants (DataLoader workers; a private
    Ray's workers), read from /proc: unlike wall time they barely depend on what else the machine
    runs, and the cheapest pass leaves out what they still do. None where /proc is missing.
    """
    timed = []
    for number in range(passes):
        if on_pass is not None:
            on_pass(number)
        images, before, start = 0, tree_cpu_seconds(), time.perf_counter()
        for batch, _ in batches:
            images += len(batch)
        seconds, after = time.perf_counter() - start, tree_cpu_seconds()
        cpu = sum(t - before.get(pid, 0.0) for pid, t in after.items()) if after else None
        timed.append((images, seconds, cpu))
    return min(timed[1:] or timed, key=lambda t: t[2] if t[2] is not None else t[1])


def tree_cpu_seconds(root: int | None = None) -> dict[int, float]:
    """User + system CPU seconds of `root` (this process) and its descendants, by pid (Linux)."""
    return {pid: cpu for pid, (cpu, _) in process_tree(root).items()}


def process_tree(root: int | None = None) -> dict[int, tuple[float, int]]:
    """(user + system CPU seconds, niceness) of `root` (this process) and its descendants, by pid,
    from /proc; empty where it is missing."""
    root = root or os.getpid()
    parent, stat = {}, {}
    try:
        entries = [e for e in os.listdir("/proc") if e.isdigit()]
    except OSError:
        return {}
    tick = os.sysconf("SC_CLK_TCK")
    for entry in entries:
        try:
            with open(f"/proc/{entry}/stat") as f:
                line = f.read()
        except OSError:  # gone since the listing
            continue
        # after the name, which may hold spaces: state, ppid, ..., utime (12), stime (13), ..., nice (17)
        fields = line[line.rindex(")") + 2:].split()
        parent[int(entry)], stat[int(entry)] = int(fields[1]), ((int(fields[11]) + int(fields[12])) / tick, int(fields[16]))
    tree, grew = {root}, True
    while grew:
        new = {pid for pid, ppid in parent.items() if ppid in tree} - tree
        tree |= new
        grew = bool(new)
    return {pid: stat[pid] for pid in tree if pid in stat}


def plain(source: str, root: Path, images: int, cpus: int, batch_size: int, passes: int) -> tuple[int, float, float | None]:
    """The textbook recipe: a torchvision (or, for Parquet, a hand-written) Dataset and a DataLoader."""
    import functools

    from torch.utils.data import DataLoader
    from torchvision.io import ImageReadMode, decode_image

    from raytrain_ddp.data.registry import SyntheticImages

    decode = functools.partial(decode_image, mode=ImageReadMode.RGB)  # a path or the bytes: uint8 CHW, as ours
    if source == "synthetic":
        dataset = SyntheticImages(images, CLASSES, SIZE, seed=0, split=0)
    elif source == "imagefolder":
        from torchvision.datasets import ImageFolder

        dataset = ImageFolder(str(root / "train"), transform=train_transform(), loader=decode)
    else:
        dataset = ParquetRows(root, decode)
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=True, num_workers=cpus, persistent_workers=True)
    return timed_passes(loader, passes)


def train_transform():
    """The v2 transforms our imagefolder path applies to a training image."""
    from torchvision.transforms import v2

    from raytrain_ddp.data.transforms import RECIPES, augmentation, normalization

    recipe = RECIPES["imagefolder"]
    return v2.Compose([augmentation(True, SIZE, None, recipe.flip), normalization(recipe)])


class ParquetRows:
    """The train rows of Parquet shards as one would read them by hand: pyarrow, each image's bytes a tensor."""

    def __init__(self, root: Path, decode):
        import pyarrow.parquet as pq
        import torch

        from raytrain_ddp.data import formats

        tables = [pq.read_table(f, columns=["image", "label"])
                  for f in formats.parquet_files(root, formats.read_manifest(root), "train")]
        self.images = [torch.frombuffer(bytearray(data), dtype=torch.uint8)
                       for t in tables for data in t.column("image").to_pylist()]
        self.labels = [label for t in tables for label in t.column("label").to_pylist()]
        self.decode, self.transform = decode, train_transform()

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int):
        return self.transform(self.decode(self.images[index])), self.labels[index]


def torch_path(source: str, root: Path, images: int, cpus: int, batch_size: int, passes: int) -> tuple[int, float, float | None]:
    """Our --loader torch, exactly as a worker builds it (one rank)."""
    from raytrain_ddp.config import TrainConfig
    from raytrain_ddp.data.loaders import make_loaders

    synthetic = source == "synthetic"
    cfg = TrainConfig(
        dataset=source, data_dir=None if synthetic else str(root), image_size=SIZE, num_classes=CLASSES,
        train_samples=images if synthetic else 0, val_samples=0, data_workers=cpus, batch_size=batch_size,
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


PATHS = ("synthetic/plain", "synthetic/torch", "imagefolder/plain", "imagefolder/torch", "parquet/plain",
         "parquet/torch", "parquet/ray")
"""SOURCE/PATH: plain is the textbook DataLoader recipe, torch and ray our --loader paths."""


def bench_data(
    images: int = 10_000,
    cpus: int | None = None,
    batch_size: int = 256,
    passes: int = 4,
    address: str | None = None,
    workdir: Path | None = None,
    paths: tuple[str, ...] = PATHS,
    echo=print,
) -> dict[str, Any]:
    """Generate the images, time each path, print the table; return the figures."""
    import ray

    from raytrain_ddp.data.convert import convert

    cpus = cpus or os.cpu_count() or 1
    train = images - images // 50  # make_jpegs holds 1 in 50 out for val
    root = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="raytrain-bench-"))
    try:
        jpegs, shards, made = root / "jpeg", root / "parquet", root / "images.txt"
        if not made.exists() or made.read_text() != str(images):
            echo(f"generating {images} {SIZE}x{SIZE} JPEGs in {jpegs} ...")
            shutil.rmtree(jpegs, ignore_errors=True)
            make_jpegs(jpegs, images)
            convert(jpegs, shards, "imagefolder", progress=False, shard_mib=8, group_mib=1, overwrite=True)
            made.write_text(str(images))
        roots = {"synthetic": None, "imagefolder": jpegs, "parquet": shards}
        results = []
        for name in paths:
            source, path = name.split("/")
            if path == "ray":
                if not ray.is_initialized():
                    connect_ray(address, cpus)  # only now, so Ray's processes cost the other paths nothing
                n, seconds, cpu = ray_path(shards, batch_size, passes)
                cpu = None if address else cpu  # an existing cluster's workers are not our descendants
                cores = int(ray.cluster_resources().get("CPU", cpus))
            else:
                run = plain if path == "plain" else torch_path
                (n, seconds, cpu), cores = run(source, roots[source], train, cpus, batch_size, passes), cpus
            results.append({"source": source, "path": path, "images": n, "seconds": round(seconds, 3), "cores": cores,
                            "cpu_seconds": cpu and round(cpu, 3), "images_per_s": round(n / seconds, 1)})
        # CPU time, which other load on the machine barely moves; where any path's is unknown, all
        # fall back to wall time x the cores given.
        by_cpu = all(r["cpu_seconds"] for r in results)
        for r in results:
            r["us_per_image"] = round(1e6 * (r["cpu_seconds"] if by_cpu else r["seconds"] * r["cores"]) / r["images"], 1)
        plain_us = {r["source"]: r["us_per_image"] for r in results if r["path"] == "plain"}
        for r in results:
            r["vs_plain"] = round(r["us_per_image"] / plain_us[r["source"]], 2) if r["source"] in plain_us else None
        report = {"images": train, "size": SIZE, "batch_size": batch_size, "cpus": cpus,
                  "cpu": "CPU time of the process and its workers" if by_cpu else "wall time x cores given",
                  "results": results}
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
        f"data benchmark: {report['images']} training images {report['size']}x{report['size']}, batch "
        f"{report['batch_size']}, {report['cpus']} loader CPUs, cheapest warm pass; CPU us = {report['cpu']}, per image",
        f"{'source':<13}{'path':<7}{'images/s':>10}{'CPU s':>8}{'CPU us/image':>14}{'vs plain':>10}",
    ]
    for r in report["results"]:
        ratio = f"{r['vs_plain']:.2f}x" if r["vs_plain"] is not None else "-"
        cpu = f"{r['cpu_seconds']:.2f}" if r.get("cpu_seconds") else "-"
        lines.append(f"{r['source']:<13}{r['path']:<7}{r['images_per_s']:>10.0f}{cpu:>8}{r['us_per_image']:>14.0f}{ratio:>10}")
    return "\n".join(lines)
