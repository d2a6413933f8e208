"""--loader ray: the driver builds Ray Datasets over Parquet shards (`ray_datasets`), TorchTrainer
splits them across ranks, and each rank iterates its split (`ray_loaders`). Decoding and augmentation
run in Ray Data tasks, beside the training workers rather than inside them."""

from __future__ import annotations

import functools
import itertools
import math
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import numpy as np
import torch

from raytrain_ddp.config import TrainConfig
from raytrain_ddp.data import formats
from raytrain_ddp.data.batches import UNREADABLE, Batches, Loaders, SkipCount
from raytrain_ddp.data.formats import BadSample
from raytrain_ddp.data.dataset_checks import data_root
from raytrain_ddp.data.transforms import RECIPES, augmentation, normalization
from raytrain_ddp.storage.object_path import ObjectPath

if TYPE_CHECKING:
    from torchvision.transforms import v2

SHUFFLE_BUFFER_BATCHES = 4
"""Ray path: rows shuffle within a buffer of this many batches (convert already shuffled them once)."""
DECODE_BATCH = 64
"""Ray path: rows per decode_augment call."""
READ_BLOCK_BYTES = 1 << 20
"""Ray path: the Parquet reader hands on blocks of about this size, so decoding spreads over many tasks."""
READ_CPUS = 0.25
"""Ray path: CPU reserved per read task. Reading the stored bytes is cheap; decoding is the work."""



class RayShard:
    """This rank's split of a Ray Dataset: each pass over it is one epoch, normalised on arrival.

    `limit` ends a pass after that many batches: a resumed epoch takes the steps it had left. Ray
    Data's order is not reproducible, so those are the right number of batches, not the same rows.
    """

    def __init__(self, shard: Any, batch_size: int, shuffle_buffer: int | None, normalize: v2.Transform):
        self.shard, self.batch_size, self.shuffle_buffer, self.normalize = shard, batch_size, shuffle_buffer, normalize
        self.limit: int | None = None

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        batches = self.shard.iter_torch_batches(batch_size=self.batch_size, local_shuffle_buffer_size=self.shuffle_buffer)
        try:
            for batch in itertools.islice(batches, self.limit):
                yield self.normalize(batch["image"]), batch["label"]
        except Exception as err:
            # Ray Data wraps a failed decode in its own exception, and the BadSample, which names
            # the file, survives only as a line of text in the middle of it: raise that line.
            found = re.search(r"BadSample: (.+)", str(err))
            if found is None:
                raise
            raise BadSample(found.group(1)) from err


def ray_loaders(cfg: TrainConfig, world_size: int, root: Path | ObjectPath | None = None) -> Loaders:
    """--loader ray on a worker: this rank's splits of the datasets ray_datasets made. `root`:
    --data-dir as the driver resolved it (dataset_checks.data_root)."""
    import ray.train

    manifest = formats.read_manifest(root or data_root(cfg))
    recipe = RECIPES.get(manifest.get("source"), RECIPES["imagefolder"])
    normalize = normalization(recipe)
    skips = SkipCount()

    # get_dataset_shard is a barrier: every rank asks for the same names in the same order.
    buffer = SHUFFLE_BUFFER_BATCHES * cfg.batch_size
    train = RayShard(ray.train.get_dataset_shard("train"), cfg.batch_size, buffer, normalize)
    val = RayShard(ray.train.get_dataset_shard("val"), cfg.batch_size, None, normalize)
    rows = ray_rows(cfg, manifest, "train")
    steps = math.ceil(rows // world_size / cfg.batch_size)

    def set_epoch(epoch: int, start: int = 0) -> int:
        # Ray Data's order is not reproducible: a resumed epoch takes as many rows as were left,
        # not the same rows. It reshuffles the file order every epoch by itself.
        left = math.ceil((rows - start) // world_size / cfg.batch_size) if start else steps
        train.limit = left if start else None
        skips.count = 0
        return left

    return Loaders(
        Batches(train, skips, train=True, skip_bad=cfg.skip_bad), Batches(val, skips, train=False, skip_bad=cfg.skip_bad),
        set_epoch, steps, rows,
        int(manifest["channels"]), lambda: skips.count, 0,
    )


def ray_rows(cfg: TrainConfig, manifest: dict, split: str) -> int:
    rows = int(manifest["splits"][split]["rows"])
    limit = cfg.train_samples if split == "train" else cfg.val_samples
    return min(rows, limit) if limit else rows


def decode_augment(
    batch: dict[str, np.ndarray], *, channels: int, train: bool, image_size: int, native_size: int | None,
    flip: bool, skip_bad: bool,
) -> dict[str, np.ndarray]:
    """Ray Data map_batches: rows of image bytes -> uint8 images, augmented; labels as int64.

    uint8 keeps object-store traffic at a quarter of float32; ray_loaders normalises on arrival.
    """
    augment = augmentation(train, image_size, native_size, flip)
    labels = batch["label"].astype(np.int64)
    images = np.zeros((len(labels), channels, image_size, image_size), np.uint8)
    for i, data in enumerate(batch["image"]):
        try:
            source = f"{batch['source'][i]} (in {batch['path'][i]})"
            images[i] = augment(formats.decode(data, channels, source)).numpy()
        except BadSample:
            if not skip_bad:
                raise
            labels[i] = UNREADABLE
    return {"image": images, "label": labels}


def ray_datasets(cfg: TrainConfig, root: Path | ObjectPath | None = None) -> dict | None:
    """The Ray Data datasets TorchTrainer splits across workers, for --loader ray; else None.
    `root`: --data-dir as the preflight resolved it (dataset_checks.data_root).

    Runs on the driver after it connected (and cluster.preflight saw CPUs to spare for decoding):
    the datasets are lazy plans, nothing is read yet.
    """
    if cfg.loader != "ray":
        return None
    root = (root or data_root(cfg)).absolute()
    manifest = formats.read_manifest(root)
    return {name: ray_split(cfg, root, manifest, name) for name in ("train", "val")}


def file_shuffle(seed: int) -> Any:
    """The training files' order, new every epoch, drawn from `seed`; the same every epoch on a Ray
    whose FileShuffleConfig cannot reseed (before 2.55; README, Supported versions)."""
    import ray.data

    try:
        return ray.data.FileShuffleConfig(seed=seed, reseed_after_execution=True)
    except TypeError:
        return ray.data.FileShuffleConfig(seed=seed)


def ray_split(cfg: TrainConfig, root: Path | ObjectPath, manifest: dict, name: str) -> Any:
    """One split as a lazy Ray Dataset: read Parquet -> cap -> decode and augment."""
    import ray.data

    train = name == "train"
    formats.parquet_files(root, manifest, name)  # all there?
    # The split's folder, not its file list: Ray 2.60 given a list of local paths fails to import
    # fsspec's HTTPFileSystem when aiohttp is missing. include_paths names the shard in error
    # messages. The training shards are read in a new order every epoch (Ray Data reseeds the file
    # shuffle per execution), drawn from --seed so that runs repeat.
    # On an object store: its key with its filesystem (endpoint, credentials), which the read tasks
    # get pickled; Ray refuses a URI given with a filesystem.
    where = {"paths": str(root / name)} if isinstance(root, Path) else {"paths": (root / name).key, "filesystem": root.fs}
    shuffle = file_shuffle(cfg.seed) if train else None
    ds = ray.data.read_parquet(
        **where, columns=["image", "label", "source"], include_paths=True, shuffle=shuffle, num_cpus=READ_CPUS,
    )
    # Ray Data packs up to 128 MiB of files into one read task, and would run the decode fused
    # into it: one core for all of CIFAR-10. A different CPU request keeps decoding a separate
    # step, and small blocks give it many tasks to spread over the cluster.
    ds.context.target_max_block_size = READ_BLOCK_BYTES
    limit = cfg.train_samples if train else cfg.val_samples
    if limit:
        ds = ds.limit(limit)
    recipe = RECIPES.get(manifest.get("source"), RECIPES["imagefolder"])
    decode = functools.partial(
        decode_augment, channels=int(manifest["channels"]), train=train, image_size=cfg.image_size,
        native_size=manifest.get("image_size"), flip=recipe.flip, skip_bad=cfg.skip_bad,
    )
    return ds.map_batches(decode, batch_size=DECODE_BATCH, batch_format="numpy")


def ray_data_config(cfg: TrainConfig) -> Any:
    """TorchTrainer's dataset_config for --loader ray (None otherwise).

    Ray Train splits every dataset with streaming_split(equal=True), which drops up to world_size-1
    rows. That is right for training, where every rank must take the same number of steps, but
    validation must count every sample once, so its split drops nothing. equal=False hands out
    whole blocks: the ranks get different numbers of val batches, or none (a small val set is one
    block). That is safe only because evaluate runs no collective per batch: DDP's forward
    broadcasts buffers, and a rank with no val batch would never join. Each rank also reads its
    val split to the end every epoch, since a split's next epoch starts only when all ranks ask.
    """
    if cfg.loader != "ray":
        return None
    from ray.train import DataConfig

    class ExactValSplit(DataConfig):
        def configure(self, datasets, world_size, worker_handles, worker_node_ids, **kwargs):
            # Ray Train 2.60 calls this once per dataset name, as each is first asked for.
            others = {name: ds for name, ds in datasets.items() if name != "val"}
            shards = super().configure(others, world_size, worker_handles, worker_node_ids, **kwargs)
            if "val" in datasets:
                # As DataConfig.configure does for each dataset, with equal=False.
                val = datasets["val"]
                if val.name is None:
                    val.set_name("val")
                val = val.copy(val)
                val.context.execution_options = DataConfig.default_ingest_options()
                splits = val.streaming_split(world_size, equal=False, locality_hints=worker_node_ids)
                for shard, split in zip(shards, splits):
                    shard["val"] = split
            return shards

    return ExactValSplit()
