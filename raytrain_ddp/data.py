"""Dataset registry and the two ingest paths.

`DATASETS` maps a --dataset name to a builder taking the TrainConfig. The file formats themselves
are read by formats.py; this module adds splits, caps and transforms, and feeds the worker loop:

- --loader torch: every rank builds the same dataset and a DistributedSampler picks its shard.
- --loader ray: the driver builds Ray Datasets over Parquet shards (`ray_datasets`), TorchTrainer
  splits them across ranks, and each rank iterates its split. Decoding and augmentation run in Ray
  Data tasks, beside the training workers rather than inside them.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler, Subset

from raytrain_ddp import formats, plugins
from raytrain_ddp.config import ConfigError, TrainConfig
from raytrain_ddp.formats import BadSample, Layout, Samples

if TYPE_CHECKING:  # torchvision takes seconds to import: only where a worker transforms images
    from torchvision.transforms import v2

SYNTHETIC_SIZES = (4096, 1024)
"""Synthetic train and val sizes when --train-samples / --val-samples are 0."""
SPLIT_SEED = 0
"""Seeds the held-out val split and the sample caps. Fixed, not --seed: runs compare on one val set."""
UNREADABLE = -1
"""Label of a sample that failed to decode under --skip-bad: Batches drops it and counts it."""
SHUFFLE_BUFFER_BATCHES = 4
"""Ray path: rows shuffle within a buffer of this many batches (convert already shuffled them once)."""
DECODE_BATCH = 64
"""Ray path: rows per decode_augment call."""
READ_BLOCK_BYTES = 1 << 20
"""Ray path: the Parquet reader hands on blocks of about this size, so decoding spreads over many tasks."""
READ_CPUS = 0.25
"""Ray path: CPU reserved per read task. Reading the stored bytes is cheap; decoding is the work."""


class Data(NamedTuple):
    train: Dataset
    val: Dataset
    in_channels: int


class Loaders(NamedTuple):
    """What the worker loop iterates: batches of (images, labels) for this rank only."""

    train: Iterable
    val: Iterable
    set_epoch: Callable[..., None]
    """set_epoch(epoch, skip=0), before each epoch: reshuffles the training shards, the same way on
    every rank, and starts the epoch after its first `skip` batches (resuming mid-epoch)."""
    steps_per_epoch: int
    in_channels: int
    skipped: Callable[[], int]
    """Unreadable samples this rank dropped so far this epoch (train + val; only with --skip-bad)."""


# --- transforms ---

IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


class Recipe(NamedTuple):
    mean: tuple[float, ...]
    std: tuple[float, ...]
    flip: bool


RECIPES: dict[str, Recipe] = {
    "mnist": Recipe((0.1307,), (0.3081,), flip=False),  # a mirrored digit is not the same digit
    "cifar10": Recipe((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616), flip=True),
    "tinyimagenet": Recipe(IMAGENET_MEAN, IMAGENET_STD, flip=True),
    "imagefolder": Recipe(IMAGENET_MEAN, IMAGENET_STD, flip=True),
}
"""Per source format: normalisation and whether horizontal flips keep the label."""


def augmentation(train: bool, image_size: int, native_size: int | None, flip: bool) -> v2.Transform:
    """uint8 CHW image -> uint8 CHW image of side image_size: the random, per-sample part."""
    from torchvision.transforms import v2

    if native_size is None:  # photos of any size: a random region for training, the centre for val
        steps = (
            [v2.RandomResizedCrop(image_size, scale=(0.25, 1.0), antialias=True)]
            if train
            else [v2.Resize(image_size, antialias=True), v2.CenterCrop(image_size)]
        )
    else:  # small fixed-size images: pad-and-crop shifts keep the whole object in view
        steps = [] if image_size == native_size else [v2.Resize([image_size, image_size], antialias=True)]
        if train:
            steps.append(v2.RandomCrop(image_size, padding=image_size // 8))
    if train and flip:
        steps.append(v2.RandomHorizontalFlip())
    return v2.Compose(steps) if steps else v2.Identity()


def normalization(recipe: Recipe) -> v2.Transform:
    """uint8 image or batch -> float32, normalised per channel."""
    from torchvision.transforms import v2

    return v2.Compose([v2.ToDtype(torch.float32, scale=True), v2.Normalize(recipe.mean, recipe.std)])


class Prepared(Dataset):
    """Samples -> (augmented, normalised image, label).

    An unreadable sample raises BadSample naming its file, or with --skip-bad comes out as a blank
    image labelled UNREADABLE, so batches keep their shape and Batches can drop and count it.
    """

    def __init__(self, samples: Samples, transform: v2.Transform, skip_bad: bool, shape: tuple[int, ...]):
        self.samples, self.transform, self.skip_bad, self.shape = samples, transform, skip_bad, shape

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        try:
            image, label = self.samples[index]
        except BadSample:
            if not self.skip_bad:
                raise
            return torch.zeros(self.shape), UNREADABLE
        return self.transform(image), label


# --- the registry ---

class SyntheticImages(Dataset):
    """Smooth per-class prototype images plus per-sample noise: learnable, generated from the seed.

    Samples are made on demand from (seed, split, index), so nothing is held in memory and every rank
    and every DataLoader worker produces the same sample for the same index.
    """

    def __init__(self, size: int, num_classes: int, image_size: int, seed: int, split: int):
        self.size, self.seed, self.split = size, seed, split
        g = torch.Generator().manual_seed(seed)
        low_res = torch.randn(num_classes, 3, 4, 4, generator=g)
        self.prototypes = F.interpolate(low_res, size=image_size, mode="bilinear", align_corners=False)
        self.prototypes /= self.prototypes.std(dim=(1, 2, 3), keepdim=True)
        g.manual_seed(seed * 7919 + split)
        self.labels = torch.randint(num_classes, (size,), generator=g)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        g = torch.Generator().manual_seed(((self.seed * 7919 + self.split) << 32) + index)
        label = int(self.labels[index])
        noise = torch.randn(self.prototypes.shape[1:], generator=g)
        # Noise at 2x the signal keeps the first epoch well short of 100%, so "it learned" shows.
        return self.prototypes[label] + 2.0 * noise, label


def synthetic(cfg: TrainConfig) -> Data:
    train_size = cfg.train_samples or SYNTHETIC_SIZES[0]
    val_size = cfg.val_samples or SYNTHETIC_SIZES[1]
    make = lambda size, split: SyntheticImages(size, cfg.num_classes, cfg.image_size, cfg.seed, split)
    return Data(make(train_size, 0), make(val_size, 1), in_channels=3)


def from_files(cfg: TrainConfig) -> Data:
    """A dataset in --data-dir, read by its format's reader (READERS)."""
    return prepare(cfg, READERS[cfg.dataset](data_root(cfg)))


def parquet(cfg: TrainConfig) -> Data:
    data = from_files(cfg)
    # Load the image bytes now, in this process, so DataLoader workers share them after fork.
    for split in (data.train, data.val):
        split.samples.load_images()
    return data


DATASETS: dict[str, Callable[[TrainConfig], Data]] = {
    "synthetic": synthetic,
    "mnist": from_files,
    "cifar10": from_files,
    "tinyimagenet": from_files,
    "imagefolder": from_files,
    "parquet": parquet,
}

READERS: dict[str, Callable[[Path], Layout]] = {
    "mnist": formats.read_mnist,
    "cifar10": formats.read_cifar10,
    "tinyimagenet": formats.read_tinyimagenet,
    "imagefolder": formats.read_imagefolder,
    "parquet": formats.read_parquet,
}
"""The datasets read from --data-dir."""


def dataset_builder(name: str, given: Callable[..., Any] | None = None) -> Callable[[TrainConfig], Data]:
    """The builder for --dataset: a registry name, an import path, or a callable given by the Python API."""
    if given is None and not plugins.is_import_path(name):
        return DATASETS[name]
    return functools.partial(user_dataset, name, given or plugins.load(name, "--dataset"))


def user_dataset(name: str, build: Callable[..., Any], cfg: TrainConfig) -> Data:
    """The user's CALLABLE(split=, data_dir=, image_size=), called for "train" and "val", checked.

    Used whole: --train-samples/--val-samples size the synthetic set and cap the built-in ones; a
    builder that wants fewer samples returns fewer."""
    splits = []
    for split_name in ("train", "val"):
        ds = build(split=split_name, data_dir=cfg.data_dir, image_size=cfg.image_size)
        if not (isinstance(ds, Dataset) and hasattr(ds, "__getitem__") and hasattr(ds, "__len__")):
            raise ConfigError(
                f"--dataset {name} returned a {type(ds).__name__} for split={split_name!r}; return a map-style "
                "torch.utils.data.Dataset (with __len__ and __getitem__) of (input tensor, class index) pairs"
            )
        if len(ds) == 0:
            raise ConfigError(f"--dataset {name} returned an empty {split_name} split")
        splits.append(ds)
    first = splits[0][0]
    if not (isinstance(first, (tuple, list)) and len(first) == 2 and torch.is_tensor(first[0]) and first[0].dim() >= 1):
        raise ConfigError(
            f"--dataset {name}: a sample must be (input tensor of 1 or more dimensions, class index); "
            f"got {type(first).__name__}"
        )
    return Data(splits[0], splits[1], in_channels=int(first[0].shape[0]))


def data_root(cfg: TrainConfig) -> Path:
    if not cfg.data_dir:
        raise ConfigError(f"--dataset {cfg.dataset} reads files: pass --data-dir DIR")
    return Path(cfg.data_dir).expanduser()


def prepare(cfg: TrainConfig, layout: Layout) -> Data:
    """Split, cap and wrap a dataset read from disk with its transforms."""
    from torchvision.transforms import v2

    train, val = split(cfg, layout)
    recipe = RECIPES.get(layout.source, RECIPES["imagefolder"])
    shape = (layout.channels, cfg.image_size, cfg.image_size)

    def wrap(samples: Samples, is_train: bool) -> Prepared:
        augment = augmentation(is_train, cfg.image_size, layout.image_size, recipe.flip)
        return Prepared(samples, v2.Compose([augment, normalization(recipe)]), cfg.skip_bad, shape)

    return Data(wrap(train, True), wrap(val, False), layout.channels)


def split(cfg: TrainConfig, layout: Layout) -> tuple[Samples, Samples]:
    """(train, val): the data's own val split or --val-fraction held out, each capped by --*-samples."""
    train, val = layout.train, layout.val
    if val is None:
        train, val = hold_out(train, cfg.val_fraction)
    return cap(train, cfg.train_samples), cap(val, cfg.val_samples)


def hold_out(samples: Samples, fraction: float) -> tuple[Samples, Samples]:
    """(train, val) with a fixed random `fraction` of the samples in val."""
    order = np.random.default_rng(SPLIT_SEED).permutation(len(samples))
    n_val = round(len(samples) * fraction)
    if not 0 < n_val < len(samples):
        raise ConfigError(
            f"--val-fraction {fraction} of {len(samples)} samples leaves an empty split; "
            "add samples, change --val-fraction, or add a val/ folder"
        )
    return samples.select(np.sort(order[n_val:])), samples.select(np.sort(order[:n_val]))


def cap(samples: Samples, limit: int | None) -> Samples:
    """A fixed random subset of `limit` samples (None or 0 = all); random, so every class stays in it."""
    if not limit or limit >= len(samples):
        return samples
    keep = np.random.default_rng(SPLIT_SEED).permutation(len(samples))[:limit]
    return samples.select(np.sort(keep))


# --- driver-side checks ---

def validate(cfg: TrainConfig) -> None:
    """Driver-side checks that fail in seconds, before any worker starts (names the fix).

    With --download, fetches a dataset first if it is not already in --data-dir.
    """
    if plugins.is_import_path(cfg.dataset):
        plugins.load(cfg.dataset, "--dataset")  # fails here, in one line, if it does not import
    elif cfg.dataset not in DATASETS:
        raise ConfigError(
            f"unknown --dataset {cfg.dataset!r}; choose one of {', '.join(DATASETS)}, or give your own as "
            "PKG.MODULE:CALLABLE"
        )
    if cfg.loader == "ray" and cfg.dataset != "parquet":
        how = f"`raytrain data convert SRC DST --format {cfg.dataset}`" if cfg.dataset in READERS else "`raytrain data convert`"
        raise ConfigError(f"--loader ray reads Parquet shards: write them with {how}, then pass --dataset parquet --data-dir DST")
    if cfg.dataset == "synthetic" or plugins.is_import_path(cfg.dataset):
        return
    if cfg.download and cfg.dataset not in DOWNLOADS:
        raise ConfigError(f"--dataset {cfg.dataset} has no public source to download; drop --download")
    root = data_root(cfg)
    try:
        layout = READERS[cfg.dataset](root)
    except ConfigError:
        if not cfg.download:
            raise
        download(cfg.dataset, root)
        layout = READERS[cfg.dataset](root)
    check_labels(cfg, layout)
    train, val = split(cfg, layout)
    full_train, full_val = split(dataclasses.replace(cfg, train_samples=0, val_samples=0), layout)
    if len(train) < len(full_train) or len(val) < len(full_val):
        print(
            f"note: using {len(train)} of {len(full_train)} train and {len(val)} of {len(full_val)} val samples "
            "(--train-samples, --val-samples); leave them out to use all",
            file=sys.stderr,
        )


def check_labels(cfg: TrainConfig, layout: Layout) -> None:
    if len(layout.classes) > cfg.num_classes:
        raise ConfigError(
            f"{cfg.data_dir} has {len(layout.classes)} classes but --num-classes is {cfg.num_classes}; "
            f"pass --num-classes {len(layout.classes)}"
        )
    for samples in (layout.train, layout.val):
        if samples is None or len(samples) == 0:
            continue
        bad = np.flatnonzero((samples.labels < 0) | (samples.labels >= cfg.num_classes))
        if len(bad):
            first = int(bad[0])
            raise ConfigError(
                f"label {samples.labels[first]} of {samples.source(first)} is outside --num-classes "
                f"{cfg.num_classes} ({len(bad)} such samples); pass --num-classes {int(samples.labels.max()) + 1} "
                "or fix the labels"
            )


# --- downloads (where a public source exists) ---

TINYIMAGENET_URL = "http://cs231n.stanford.edu/tiny-imagenet-200.zip"
TINYIMAGENET_MD5 = "90528d7ca1a48142e341f4ef8d21d0de"


def _download_mnist(root: Path) -> None:
    from torchvision.datasets import MNIST

    MNIST(str(root), train=True, download=True)  # fetches all four idx files, checks their md5


def _download_cifar10(root: Path) -> None:
    from torchvision.datasets import CIFAR10
    from torchvision.datasets.utils import download_and_extract_archive

    download_and_extract_archive(CIFAR10.url, str(root), filename=CIFAR10.filename, md5=CIFAR10.tgz_md5)


def _download_tinyimagenet(root: Path) -> None:
    from torchvision.datasets.utils import download_and_extract_archive

    download_and_extract_archive(TINYIMAGENET_URL, str(root), md5=TINYIMAGENET_MD5)


DOWNLOADS: dict[str, Callable[[Path], None]] = {
    "mnist": _download_mnist,
    "cifar10": _download_cifar10,
    "tinyimagenet": _download_tinyimagenet,
}


def download(dataset: str, root: Path) -> None:
    print(f"downloading {dataset} into {root} ...", file=sys.stderr)
    try:
        root.mkdir(parents=True, exist_ok=True)
        DOWNLOADS[dataset](root)
    except Exception as err:  # URLError, RuntimeError (md5, all mirrors failed), OSError
        lines = [line.strip() for line in str(err).splitlines() if line.strip()]
        reason = lines[-1] if lines else type(err).__name__
        raise ConfigError(
            f"cannot download {dataset} into {root} ({reason}); without network, copy the files there "
            "yourself and drop --download"
        ) from None


# --- the ingest paths, on each worker ---

class SkipCount:
    def __init__(self) -> None:
        self.count = 0


class Batches:
    """One split's (images, labels) batches for this rank; iterate once per epoch.

    Rows labelled UNREADABLE (--skip-bad) are dropped and counted. A training batch is never dropped
    whole: DDP needs the same number of steps on every rank, or its all-reduce waits forever.
    """

    def __init__(self, source: Iterable, skips: SkipCount, train: bool):
        self.source, self.skips, self.train = source, skips, train

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for images, labels in self.source:
            bad = labels == UNREADABLE
            n_bad = int(bad.sum())
            if n_bad:
                self.skips.count += n_bad
                if n_bad == len(labels):
                    if not self.train:
                        continue
                    raise RuntimeError(
                        f"all {n_bad} samples of a training batch were unreadable ({self.skips.count} skipped "
                        "this epoch on this rank); most of --data-dir is bad, check it"
                    )
                images, labels = images[~bad], labels[~bad]
            yield images, labels


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


class EpochSampler(Sampler[int]):
    """A DistributedSampler whose epoch can start after its first `skip` batches."""

    def __init__(self, sampler: DistributedSampler, batch_size: int):
        self.sampler, self.batch_size, self.start = sampler, batch_size, 0

    def set_epoch(self, epoch: int, skip: int = 0) -> None:
        self.sampler.set_epoch(epoch)  # the order depends on (seed, epoch) only: a resumed epoch repeats it
        self.start = skip * self.batch_size

    def __iter__(self) -> Iterator[int]:
        return itertools.islice(iter(self.sampler), self.start, None)

    def __len__(self) -> int:
        return max(len(self.sampler) - self.start, 0)


def make_loaders(
    cfg: TrainConfig, rank: int, world_size: int, cuda: bool, build: Callable[[TrainConfig], Data] | None = None
) -> Loaders:
    """This rank's train and val batches, from either ingest path.

    Training shards are disjoint and of equal length on every rank: the torch path repeats the
    first few samples of the shuffled order to even them out (DistributedSampler), the ray path
    drops up to world_size - 1 rows per epoch (streaming_split(equal=True)). Validation is split
    with no padding and nothing dropped, so each val sample counts exactly once in the all-reduced
    metrics.
    """
    if cfg.loader == "ray":
        return ray_loaders(cfg, world_size)
    data = (build or dataset_builder(cfg.dataset))(cfg)
    shards = DistributedSampler(data.train, num_replicas=world_size, rank=rank, shuffle=True, seed=cfg.seed)
    sampler = EpochSampler(shards, cfg.batch_size)
    common = dict(
        batch_size=cfg.batch_size,
        num_workers=cfg.data_workers,
        pin_memory=cuda,  # pinned host memory only helps host-to-GPU copies
        persistent_workers=cfg.data_workers > 0,
    )
    train = DataLoader(data.train, sampler=sampler, **common)
    val = DataLoader(Subset(data.val, range(rank, len(data.val), world_size)), shuffle=False, **common)
    skips = SkipCount()

    def set_epoch(epoch: int, skip: int = 0) -> None:
        sampler.set_epoch(epoch, skip)
        skips.count = 0

    return Loaders(
        Batches(train, skips, train=True),
        Batches(val, skips, train=False),
        set_epoch,
        math.ceil(len(shards) / cfg.batch_size),
        data.in_channels,
        lambda: skips.count,
    )


def ray_loaders(cfg: TrainConfig, world_size: int) -> Loaders:
    """--loader ray on a worker: this rank's splits of the datasets ray_datasets made."""
    import ray.train

    manifest = formats.read_manifest(data_root(cfg))
    recipe = RECIPES.get(manifest.get("source"), RECIPES["imagefolder"])
    normalize = normalization(recipe)
    skips = SkipCount()

    # get_dataset_shard is a barrier: every rank asks for the same names in the same order.
    buffer = SHUFFLE_BUFFER_BATCHES * cfg.batch_size
    train = RayShard(ray.train.get_dataset_shard("train"), cfg.batch_size, buffer, normalize)
    val = RayShard(ray.train.get_dataset_shard("val"), cfg.batch_size, None, normalize)
    steps = math.ceil(ray_rows(cfg, manifest, "train") // world_size / cfg.batch_size)

    def set_epoch(epoch: int, skip: int = 0) -> None:
        train.limit = steps - skip if skip else None  # Ray Data reshuffles the file order by itself
        skips.count = 0

    return Loaders(
        Batches(train, skips, train=True), Batches(val, skips, train=False), set_epoch, steps,
        int(manifest["channels"]), lambda: skips.count,
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


def ray_datasets(cfg: TrainConfig) -> dict | None:
    """The Ray Data datasets TorchTrainer splits across workers, for --loader ray; else None.

    Runs on the driver after it connected: the datasets are lazy plans, nothing is read yet.
    """
    if cfg.loader != "ray":
        return None
    import ray

    spare = ray.cluster_resources().get("CPU", 0) - cfg.workers * cfg.cpus_per_worker
    if spare < 1:
        raise ConfigError(
            "--loader ray decodes images in Ray Data tasks, which need CPUs beside the training workers', "
            f"but the workers take all {int(ray.cluster_resources().get('CPU', 0))}; lower --workers or "
            "--cpus-per-worker, add CPUs, or use --loader torch"
        )
    root = data_root(cfg).absolute()
    manifest = formats.read_manifest(root)
    return {name: ray_split(cfg, root, manifest, name) for name in ("train", "val")}


def ray_split(cfg: TrainConfig, root: Path, manifest: dict, name: str) -> Any:
    """One split as a lazy Ray Dataset: read Parquet -> cap -> decode and augment."""
    import ray.data

    train = name == "train"
    formats.parquet_files(root, manifest, name)  # all there?
    # The split's folder, not its file list: Ray 2.60 given a list of local paths fails to import
    # fsspec's HTTPFileSystem when aiohttp is missing. include_paths names the shard in error
    # messages. The training shards are read in a new order every epoch (Ray Data reseeds the file
    # shuffle per execution), drawn from --seed so that runs repeat.
    shuffle = ray.data.FileShuffleConfig(seed=cfg.seed, reseed_after_execution=True) if train else None
    ds = ray.data.read_parquet(
        str(root / name), columns=["image", "label", "source"], include_paths=True,
        shuffle=shuffle, num_cpus=READ_CPUS,
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
    validation must count every sample once, so its split drops nothing.
    """
    if cfg.loader != "ray":
        return None
    from ray.train import DataConfig

    class EqualTrainExactVal(DataConfig):
        def configure(self, datasets, world_size, worker_handles, worker_node_ids, **kwargs):
            others = {k: v for k, v in datasets.items() if k != "val"}
            shards = super().configure(others, world_size, worker_handles, worker_node_ids, **kwargs)
            if "val" in datasets:
                splits = datasets["val"].streaming_split(world_size, equal=False, locality_hints=worker_node_ids)
                for shard, val in zip(shards, splits):
                    shard["val"] = val
            return shards

    return EqualTrainExactVal()
