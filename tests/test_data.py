"""Dataset readers, transforms, sharding and bad data, on small files in each real format.

The writers at the top make learnable data (each class its own colour or brightness, plus noise),
in the exact on-disk formats: idx files, CIFAR pickle batches, a TinyImageNet tree, JPEG/PNG folders
and Parquet shards. Unit tests read them in-process; the e2e tests train on them through
`raytrain run` with 2 workers on the shared Ray head.
"""

from __future__ import annotations

import csv
import gzip
import io
import json
import pickle
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from conftest import TINY, raytrain
from raytrain_ddp import data, formats
from raytrain_ddp.config import ConfigError, TrainConfig
from raytrain_ddp.convert import convert

pytestmark = pytest.mark.filterwarnings("ignore:The image decoding and encoding capabilities:DeprecationWarning")

CLASSES = 4
PALETTE = np.array([[220, 40, 40], [40, 200, 40], [40, 60, 220], [230, 220, 50]], np.uint8)
"""One colour per class: a convnet separates them within an epoch."""


def pixels(label: int, size: int, channels: int, rng: np.random.Generator) -> np.ndarray:
    """HWC uint8: the class's colour (or brightness) plus noise."""
    base = PALETTE[label] if channels == 3 else np.array([30 + 65 * label], np.uint8)
    noise = rng.integers(-25, 26, (size, size, channels))
    return np.clip(base + noise, 0, 255).astype(np.uint8)


def image_bytes(array: np.ndarray, fmt: str = "JPEG") -> bytes:
    out = io.BytesIO()
    Image.fromarray(array[..., 0] if array.shape[-1] == 1 else array).save(out, format=fmt)
    return out.getvalue()


def labels_for(n: int, rng: np.random.Generator) -> np.ndarray:
    return rng.permutation(np.arange(n) % CLASSES)


def write_mnist(root: Path, n_train: int = 200, n_val: int = 40, gz: bool = True, seed: int = 0) -> Path:
    """torchvision's layout: root/MNIST/raw/{train,t10k}-{images-idx3,labels-idx1}-ubyte[.gz]."""
    rng = np.random.default_rng(seed)
    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    for prefix, n in (("train", n_train), ("t10k", n_val)):
        labels = labels_for(n, rng)
        images = np.stack([pixels(int(y), 28, 1, rng)[..., 0] for y in labels])
        idx_images = b"\0\0\x08\x03" + np.array([n, 28, 28], ">i4").tobytes() + images.tobytes()
        idx_labels = b"\0\0\x08\x01" + np.array([n], ">i4").tobytes() + labels.astype(np.uint8).tobytes()
        for name, content in ((f"{prefix}-images-idx3-ubyte", idx_images), (f"{prefix}-labels-idx1-ubyte", idx_labels)):
            if gz:
                (raw / f"{name}.gz").write_bytes(gzip.compress(content))
            else:
                (raw / name).write_bytes(content)
    return root


def write_cifar10(root: Path, n_train: int = 200, n_val: int = 40, seed: int = 0) -> Path:
    """torchvision's layout: root/cifar-10-batches-py/{data_batch_1..5,test_batch,batches.meta}."""
    rng = np.random.default_rng(seed)
    base = root / "cifar-10-batches-py"
    base.mkdir(parents=True, exist_ok=True)

    def batch(n: int) -> dict:
        labels = labels_for(n, rng)
        images = np.stack([pixels(int(y), 32, 3, rng) for y in labels])  # N x H x W x C
        return {"data": images.transpose(0, 3, 1, 2).reshape(n, 3072), "labels": labels.tolist()}

    for i in range(1, 6):
        (base / f"data_batch_{i}").write_bytes(pickle.dumps(batch(n_train // 5)))
    (base / "test_batch").write_bytes(pickle.dumps(batch(n_val)))
    meta = {"label_names": formats.CIFAR10_CLASSES, "num_cases_per_batch": n_train // 5}
    (base / "batches.meta").write_bytes(pickle.dumps(meta))
    return root


WNIDS = ["n01443537", "n01629819", "n01641577", "n01644900"]


def write_tinyimagenet(root: Path, per_class: int = 40, val_per_class: int = 10, seed: int = 0) -> Path:
    """The official layout: wnids.txt, train/<wnid>/images/*.JPEG, val/images + val_annotations.txt."""
    rng = np.random.default_rng(seed)
    base = root / "tiny-imagenet-200"
    (base / "val" / "images").mkdir(parents=True, exist_ok=True)
    (base / "wnids.txt").write_text("\n".join(WNIDS) + "\n")
    lines = []
    for label, wnid in enumerate(WNIDS):
        folder = base / "train" / wnid / "images"
        folder.mkdir(parents=True)
        (base / "train" / wnid / f"{wnid}_boxes.txt").write_text("")  # the real tree has these too
        for i in range(per_class):
            (folder / f"{wnid}_{i}.JPEG").write_bytes(image_bytes(pixels(label, 64, 3, rng)))
        for i in range(val_per_class):
            name = f"val_{label * val_per_class + i}.JPEG"
            (base / "val" / "images" / name).write_bytes(image_bytes(pixels(label, 64, 3, rng)))
            lines.append(f"{name}\t{wnid}\t0\t0\t63\t63")
    (base / "val" / "val_annotations.txt").write_text("\n".join(lines) + "\n")
    return root


def write_imagefolder(root: Path, per_class: int = 40, val_per_class: int | None = 10, size: int = 24, seed: int = 0) -> Path:
    """root/train/<class>/*.{jpg,png} and root/val/<class>/... (no val/ when val_per_class is None)."""
    rng = np.random.default_rng(seed)
    for split, n in (("train", per_class), ("val", val_per_class)):
        if n is None:
            continue
        for label in range(CLASSES):
            folder = root / split / f"class_{label}"
            folder.mkdir(parents=True)
            for i in range(n):
                fmt, ext = ("PNG", "png") if i % 2 else ("JPEG", "jpg")  # both formats in every class
                (folder / f"{i:04d}.{ext}").write_bytes(image_bytes(pixels(label, size, 3, rng), fmt))
    return root


def cfg_for(dataset: str, root: Path, **overrides) -> TrainConfig:
    values = dict(dataset=dataset, data_dir=str(root), num_classes=10, train_samples=0, val_samples=0,
                  data_workers=0, batch_size=16, image_size=24)
    values.update(overrides)
    return TrainConfig(**values)


# --- readers ---

@pytest.mark.parametrize("gz", [True, False])
def test_mnist_reads_idx_files(tmp_path, gz):
    layout = formats.read_mnist(write_mnist(tmp_path, gz=gz))
    assert (len(layout.train), len(layout.val), layout.channels, layout.image_size) == (200, 40, 1, 28)
    image, label = layout.train[3]
    assert image.shape == (1, 28, 28) and image.dtype == torch.uint8
    assert abs(float(image.float().mean()) - (30 + 65 * label)) < 10  # the pixels of the right sample


def test_mnist_truncated_idx_names_the_file(tmp_path):
    write_mnist(tmp_path, gz=False)
    path = tmp_path / "MNIST" / "raw" / "train-images-idx3-ubyte"
    path.write_bytes(path.read_bytes()[:5000])
    with pytest.raises(ConfigError, match="train-images-idx3-ubyte is truncated"):
        formats.read_mnist(tmp_path)


def test_cifar10_reads_pickle_batches(tmp_path):
    layout = formats.read_cifar10(write_cifar10(tmp_path))
    assert (len(layout.train), len(layout.val), layout.classes[:2]) == (200, 40, ["airplane", "automobile"])
    image, label = layout.train[7]
    assert image.shape == (3, 32, 32)
    assert np.abs(image.float().mean(dim=(1, 2)).numpy() - PALETTE[label]).max() < 10  # channels in order


def test_tinyimagenet_reads_the_official_tree(tmp_path):
    layout = formats.read_tinyimagenet(write_tinyimagenet(tmp_path, per_class=3, val_per_class=2))
    assert layout.classes == WNIDS and (len(layout.train), len(layout.val)) == (12, 8)
    assert layout.val.paths[0].endswith("val_0.JPEG") and layout.val.labels.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    assert layout.train[0][0].shape == (3, 64, 64)


def test_imagefolder_with_and_without_val(tmp_path):
    layout = formats.read_imagefolder(write_imagefolder(tmp_path / "a", per_class=3, val_per_class=2))
    assert (len(layout.train), len(layout.val), layout.classes) == (12, 8, [f"class_{i}" for i in range(4)])
    write_imagefolder(tmp_path / "b", per_class=10, val_per_class=None)
    train, val = data.split(cfg_for("imagefolder", tmp_path / "b", val_fraction=0.25), formats.read_imagefolder(tmp_path / "b"))
    assert (len(train), len(val)) == (30, 10)
    assert not set(train.paths) & set(val.paths)
    # Class folders straight under --data-dir work too.
    assert len(formats.read_imagefolder(tmp_path / "b" / "train").train) == 40


def test_a_real_dataset_is_used_whole_by_default(tmp_path):
    write_imagefolder(tmp_path, per_class=10, val_per_class=5)
    cfg = TrainConfig(dataset="imagefolder", data_dir=str(tmp_path))  # no caps given
    train, val = data.split(cfg, formats.read_imagefolder(tmp_path))
    assert (len(train), len(val)) == (40, 20)
    synthetic = data.DATASETS["synthetic"](TrainConfig())
    assert (len(synthetic.train), len(synthetic.val)) == data.SYNTHETIC_SIZES  # its own default size


def test_caps_keep_a_fixed_random_subset(tmp_path):
    write_imagefolder(tmp_path, per_class=10, val_per_class=5)
    cfg = cfg_for("imagefolder", tmp_path, train_samples=12, val_samples=6)
    train, val = data.split(cfg, formats.read_imagefolder(tmp_path))
    again, _ = data.split(cfg, formats.read_imagefolder(tmp_path))
    assert (len(train), len(val)) == (12, 6) and train.paths == again.paths
    assert len(set(train.labels.tolist())) > 1  # not just the first class folder


# --- transforms ---

@pytest.mark.parametrize(
    "dataset, writer, channels", [("mnist", write_mnist, 1), ("cifar10", write_cifar10, 3),
                                  ("tinyimagenet", write_tinyimagenet, 3), ("imagefolder", write_imagefolder, 3)]
)
def test_transforms_give_normalised_images_of_image_size(tmp_path, dataset, writer, channels):
    writer(tmp_path)
    built = data.DATASETS[dataset](cfg_for(dataset, tmp_path, image_size=20))
    assert built.in_channels == channels
    for split in (built.train, built.val):
        image, label = split[0]
        assert image.shape == (channels, 20, 20) and image.dtype == torch.float32 and 0 <= label < CLASSES
    batch = torch.stack([built.val[i][0] for i in range(len(built.val))])
    assert abs(float(batch.mean())) < 3 and float(batch.std()) > 0.1  # normalised, not raw 0..255


def test_training_augmentation_is_random_and_val_is_not():
    image = torch.arange(3 * 32 * 32, dtype=torch.float32).reshape(3, 32, 32).to(torch.uint8)
    train = data.augmentation(True, 32, 32, flip=True)
    assert any(not torch.equal(train(image), train(image)) for _ in range(10))
    val = data.augmentation(False, 32, 32, flip=True)
    assert torch.equal(val(image), image)
    assert data.augmentation(False, 16, None, flip=True)(image).shape == (3, 16, 16)


def test_mnist_is_never_flipped():
    assert not data.RECIPES["mnist"].flip and data.RECIPES["cifar10"].flip


# --- validate(): fast driver-side checks ---

def check_fails(cfg: TrainConfig, *words: str) -> str:
    with pytest.raises(ConfigError) as err:
        data.validate(cfg)
    message = str(err.value)
    assert "\n" not in message
    for word in words:
        assert word in message, message
    return message


def test_validate_names_missing_and_empty_directories(tmp_path):
    check_fails(cfg_for("imagefolder", tmp_path / "nope"), "nope")
    (tmp_path / "empty").mkdir()
    check_fails(cfg_for("imagefolder", tmp_path / "empty"), "empty", "is empty")
    check_fails(TrainConfig(dataset="cifar10"), "--data-dir")
    check_fails(cfg_for("mnist", tmp_path / "empty"), "--download")
    check_fails(cfg_for("tinyimagenet", tmp_path / "empty"), "wnids.txt")


def test_validate_names_a_class_folder_with_no_images(tmp_path):
    write_imagefolder(tmp_path, per_class=2, val_per_class=1)
    (tmp_path / "train" / "class_9").mkdir()
    (tmp_path / "train" / "class_9" / "notes.txt").write_text("not an image")
    check_fails(cfg_for("imagefolder", tmp_path), str(tmp_path / "train" / "class_9"), "no images")


def test_validate_rejects_labels_outside_num_classes(tmp_path):
    write_imagefolder(tmp_path / "folder", per_class=2, val_per_class=1)
    check_fails(cfg_for("imagefolder", tmp_path / "folder", num_classes=3), "4 classes", "--num-classes 4")
    write_mnist(tmp_path / "mnist", gz=False)
    labels = tmp_path / "mnist" / "MNIST" / "raw" / "t10k-labels-idx1-ubyte"
    raw = bytearray(labels.read_bytes())
    raw[8 + 5] = 12
    labels.write_bytes(bytes(raw))
    check_fails(cfg_for("mnist", tmp_path / "mnist"), "label 12", "t10k-labels-idx1-ubyte #5", "--num-classes 13")


def test_validate_rejects_parquet_labels_outside_num_classes(tmp_path):
    write_imagefolder(tmp_path / "src", per_class=3, val_per_class=2)
    convert(tmp_path / "src", tmp_path / "pq", "imagefolder", progress=False)
    check_fails(cfg_for("parquet", tmp_path / "pq", num_classes=3), "--num-classes 4")
    check_fails(cfg_for("parquet", tmp_path / "src"), "manifest.json", "raytrain data convert")


def test_validate_ray_loader_needs_parquet(tmp_path):
    check_fails(cfg_for("cifar10", tmp_path, loader="ray"), "raytrain data convert", "--format cifar10")


def test_download_is_tried_only_when_files_are_missing(tmp_path, monkeypatch):
    from urllib.error import URLError

    def offline(root):
        raise URLError("[Errno -2] Name or service not known")

    monkeypatch.setitem(data.DOWNLOADS, "mnist", offline)
    message = check_fails(cfg_for("mnist", tmp_path, download=True), "cannot download mnist", "Name or service not known")
    assert "copy the files there" in message
    write_mnist(tmp_path)
    data.validate(cfg_for("mnist", tmp_path, download=True))  # present: no download attempted
    check_fails(cfg_for("imagefolder", tmp_path, download=True), "no public source")


# --- the torch ingest path: sharding ---

def test_torch_path_shards_are_disjoint_and_cover_the_epoch(tmp_path):
    write_imagefolder(tmp_path, per_class=10, val_per_class=5)  # 40 train, 20 val
    world = 3
    cfg = cfg_for("imagefolder", tmp_path, batch_size=4)
    loaders = [data.make_loaders(cfg, rank, world, cuda=False) for rank in range(world)]
    n_train = 40
    for epoch in (1, 2):
        orders = []
        for loader in loaders:
            loader.set_epoch(epoch)
            orders.append(list(loader.train.source.sampler))
        per_rank = -(-n_train // world)  # DistributedSampler pads to equal shards by repeating samples
        assert all(len(o) == per_rank for o in orders)
        assert all(loader.steps_per_epoch == -(-per_rank // cfg.batch_size) for loader in loaders)
        flat = [i for o in orders for i in o]
        assert set(flat) == set(range(n_train))
        assert len(flat) - len(set(flat)) == world * per_rank - n_train  # only the padding repeats
        if epoch == 1:
            first = orders
    assert first != orders  # reshuffled per epoch
    loaders[0].set_epoch(2, 3)  # resuming after 3 batches: the same order, minus those
    assert list(loaders[0].train.source.sampler) == orders[0][3 * cfg.batch_size:]
    val = [list(loader.val.source.dataset.indices) for loader in loaders]
    assert sorted(i for v in val for i in v) == list(range(20))  # val: each sample exactly once


# --- bad samples, at the moment they are read ---

def spoil(folder: Path) -> tuple[Path, Path]:
    """Truncate one JPEG and replace one PNG with garbage; return both paths."""
    jpeg, png = sorted(folder.glob("*.jpg"))[0], sorted(folder.glob("*.png"))[0]
    jpeg.write_bytes(jpeg.read_bytes()[:200])
    png.write_bytes(b"this is not a png")
    return jpeg, png


def every_batch(loaders: data.Loaders) -> list[tuple[torch.Tensor, torch.Tensor]]:
    loaders.set_epoch(1)
    return list(loaders.train) + list(loaders.val)


def test_a_corrupt_image_stops_loading_with_its_name(tmp_path):
    write_imagefolder(tmp_path, per_class=4, val_per_class=2)
    jpeg = tmp_path / "train" / "class_2" / "0002.jpg"
    jpeg.write_bytes(jpeg.read_bytes()[:200])
    loaders = data.make_loaders(cfg_for("imagefolder", tmp_path, batch_size=64), 0, 1, cuda=False)
    with pytest.raises(formats.BadSample, match=f"cannot decode image {jpeg}: .*truncated.*--skip-bad"):
        every_batch(loaders)


def test_skip_bad_drops_and_counts_unreadable_samples(tmp_path):
    write_imagefolder(tmp_path, per_class=4, val_per_class=2)
    spoil(tmp_path / "train" / "class_2")
    spoil(tmp_path / "val" / "class_0")
    (tmp_path / "train" / "class_1" / "0000.jpg").write_bytes(b"")  # an empty file
    loaders = data.make_loaders(cfg_for("imagefolder", tmp_path, batch_size=4, skip_bad=True), 0, 1, cuda=False)
    batches = every_batch(loaders)
    assert loaders.skipped() == 5
    assert sum(len(labels) for _, labels in batches) == 16 + 8 - 5
    assert all((labels >= 0).all() for _, labels in batches)
    loaders.set_epoch(2)
    assert loaders.skipped() == 0  # counted per epoch


def test_a_training_batch_of_only_bad_samples_fails_rather_than_desync_ranks():
    skips = data.SkipCount()
    bad = [(torch.zeros(2, 3, 4, 4), torch.tensor([data.UNREADABLE] * 2))]
    with pytest.raises(RuntimeError, match="all 2 samples of a training batch were unreadable"):
        list(data.Batches(bad, skips, train=True))
    assert list(data.Batches(bad, skips, train=False)) == []  # val: no collective per batch, just skip


def test_parquet_via_the_torch_path(tmp_path):
    write_imagefolder(tmp_path / "src", per_class=6, val_per_class=2)
    jpeg, _ = spoil(tmp_path / "src" / "train" / "class_3")
    convert(tmp_path / "src", tmp_path / "pq", "imagefolder", skip_bad=True, progress=False)
    cfg = cfg_for("parquet", tmp_path / "pq", batch_size=8)
    data.validate(cfg)
    loaders = data.make_loaders(cfg, 0, 1, cuda=False)
    batches = every_batch(loaders)
    assert sum(len(labels) for _, labels in batches) == 22 + 8
    assert batches[0][0].shape[1:] == (3, 24, 24)


# --- end to end: `raytrain run` with 2 workers on each format ---

def train(tmp_path: Path, env: dict, *args: str) -> tuple[dict, list[dict], str]:
    """Run the real CLI (flags after TINY override it); return summary.json, metrics rows, stderr."""
    result = raytrain(
        "run", *TINY, "--epochs", "2", "--batch-size", "16", "--train-samples", "0", "--val-samples", "0",
        "--num-classes", str(CLASSES), "--storage-path", str(tmp_path / "runs"), "--name", "e2e", *args,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir = tmp_path / "runs" / "e2e"
    with open(run_dir / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    return json.loads((run_dir / "summary.json").read_text()), rows, result.stderr


def assert_learned(summary: dict, rows: list[dict]) -> None:
    assert summary["world_size"] == 2
    assert float(rows[-1]["train_loss"]) < float(rows[0]["train_loss"])
    assert summary["final"]["val_acc"] > 0.6, rows  # chance is 1/4


@pytest.mark.e2e
def test_e2e_mnist_idx_files(tmp_path, ray_head):
    write_mnist(tmp_path / "data", n_train=256, n_val=64)
    summary, rows, _ = train(tmp_path, ray_head.env, "--address", ray_head.address, "--dataset", "mnist",
                             "--data-dir", str(tmp_path / "data"), "--num-classes", "10", "--image-size", "28")
    assert_learned(summary, rows)


@pytest.mark.e2e
def test_e2e_cifar10_pickles(tmp_path, ray_head):
    write_cifar10(tmp_path / "data", n_train=256, n_val=64)
    summary, rows, _ = train(tmp_path, ray_head.env, "--address", ray_head.address, "--dataset", "cifar10",
                             "--data-dir", str(tmp_path / "data"), "--num-classes", "10", "--image-size", "32")
    assert_learned(summary, rows)


@pytest.mark.e2e
def test_e2e_tinyimagenet_tree_at_a_smaller_image_size(tmp_path, ray_head):
    write_tinyimagenet(tmp_path / "data", per_class=64, val_per_class=16)
    summary, rows, _ = train(tmp_path, ray_head.env, "--address", ray_head.address, "--dataset", "tinyimagenet",
                             "--data-dir", str(tmp_path / "data"), "--image-size", "32")
    assert_learned(summary, rows)


@pytest.mark.e2e
def test_e2e_imagefolder_split_by_val_fraction_skipping_bad_files(tmp_path, ray_head):
    write_imagefolder(tmp_path / "data", per_class=80, val_per_class=None)
    spoil(tmp_path / "data" / "train" / "class_1")
    summary, rows, _ = train(tmp_path, ray_head.env, "--address", ray_head.address, "--dataset", "imagefolder",
                             "--data-dir", str(tmp_path / "data"), "--val-fraction", "0.2", "--skip-bad")
    assert_learned(summary, rows)
    assert [int(row["skipped_samples"]) for row in rows] == [2, 2]  # both spoiled files, every epoch


@pytest.mark.e2e
def test_e2e_a_corrupt_image_fails_the_run_naming_the_file(tmp_path, ray_head):
    write_imagefolder(tmp_path / "data", per_class=8, val_per_class=2)
    jpeg = tmp_path / "data" / "train" / "class_3" / "0004.jpg"
    jpeg.write_bytes(jpeg.read_bytes()[:100])
    result = raytrain("run", *TINY, "--address", ray_head.address, "--dataset", "imagefolder",
                      "--data-dir", str(tmp_path / "data"), "--num-classes", "4", "--batch-size", "64",
                      "--storage-path", str(tmp_path / "runs"), env=ray_head.env)
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert str(jpeg) in last and "--skip-bad" in last, result.stderr[-3000:]


# --- the ray ingest path, on a real Ray ---

def write_numbered(root: Path, n_train: int, n_val: int) -> Path:
    """An image folder where image k is one solid colour that encodes k: crops, flips and resizes
    keep it, so a sample's identity survives the real decode-and-augment pipeline."""
    for split, ids in (("train", range(n_train)), ("val", range(n_train, n_train + n_val))):
        for k in ids:
            folder = root / split / f"class_{k % CLASSES}"
            folder.mkdir(parents=True, exist_ok=True)
            colour = np.array([k % 256, k // 256, 0], np.uint8)
            (folder / f"{k}.png").write_bytes(image_bytes(np.broadcast_to(colour, (8, 8, 3)).copy(), "PNG"))
    return root


def ray_split_ids(pq: Path, world: int, epochs: int) -> dict:
    """Run in a driver process: split our Ray Datasets with our DataConfig, as TorchTrainer does,
    consume the `world` shards at once (one thread per rank), and return the ids each rank saw."""
    import ray

    cfg = cfg_for("parquet", pq, loader="ray", workers=world, image_size=8)
    ray.init(logging_level="ERROR", log_to_driver=False)
    seen = {}
    for name, dataset in data.ray_datasets(cfg).items():
        shards = [s[name] for s in data.ray_data_config(cfg).configure({name: dataset}, world, None, None)]
        for epoch in range(epochs):
            per_rank, errors = [[] for _ in range(world)], []

            def consume(rank: int) -> None:
                try:
                    for batch in shards[rank].iter_batches(batch_size=8):
                        image = batch["image"]
                        per_rank[rank] += (image[:, 0, 0, 0].astype(int) + 256 * image[:, 1, 0, 0].astype(int)).tolist()
                except Exception as err:  # a thread's exception would vanish: hand it to the main one
                    errors.append(err)

            threads = [threading.Thread(target=consume, args=(rank,)) for rank in range(world)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            if errors:
                raise errors[0]
            seen[f"{name}/{epoch}"] = per_rank
    ray.shutdown()
    return seen


@pytest.mark.e2e
def test_ray_path_shards_are_disjoint_and_cover_the_epoch(tmp_path, ray_head):
    """Our Ray Datasets, split by our DataConfig the way TorchTrainer splits them, read by 2 ranks."""
    n_train, n_val = 61, 23  # odd: equal train shards must drop a row, val must drop none
    write_numbered(tmp_path / "src", n_train, n_val)
    # Many small shards: the epoch's order is the shards' order, and 8+ shards make a repeat unlikely.
    convert(tmp_path / "src", tmp_path / "pq", "imagefolder", shard_mib=0.0005, group_mib=0.0005, progress=False)
    assert len(json.loads((tmp_path / "pq" / "manifest.json").read_text())["splits"]["train"]["files"]) >= 8
    driver = subprocess.run(
        [sys.executable, __file__, "ray-split-ids", str(tmp_path / "pq")],
        env=ray_head.env, capture_output=True, text=True, timeout=300, cwd=Path(__file__).parent,
    )
    assert driver.returncode == 0, driver.stderr[-3000:]
    seen = json.loads(driver.stdout.strip().splitlines()[-1])
    for epoch in range(2):
        ranks = seen[f"train/{epoch}"]
        assert len(ranks[0]) == len(ranks[1]) == n_train // 2  # equal: same number of steps per rank
        assert not set(ranks[0]) & set(ranks[1])
        assert set(ranks[0]) | set(ranks[1]) <= set(range(n_train))
        ranks = seen[f"val/{epoch}"]
        assert sorted(ranks[0] + ranks[1]) == list(range(n_train, n_train + n_val))  # each exactly once
    assert seen["train/0"] != seen["train/1"]  # a new order every epoch


def spoil_parquet_row(shard: Path, row: int = 0) -> str:
    """Truncate one stored image inside a Parquet shard; return that row's source."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pq.read_table(shard)
    images = table.column("image").to_pylist()
    images[row] = images[row][:50]
    pq.write_table(table.set_column(0, "image", pa.array(images, pa.binary())), shard)
    return table.column("source")[row].as_py()


def test_ray_decode_step_names_the_bad_row_or_marks_it(tmp_path):
    write_imagefolder(tmp_path / "src", per_class=3, val_per_class=1)
    convert(tmp_path / "src", tmp_path / "pq", "imagefolder", progress=False)
    shard = tmp_path / "pq" / "train" / "part-00000.parquet"
    source = spoil_parquet_row(shard, row=2)
    import pyarrow.parquet as pq

    batch = {k: np.array(v, dtype=object) if k != "label" else np.array(v) for k, v in
             pq.read_table(shard).to_pydict().items()}
    batch["path"] = np.array([str(shard)] * len(batch["label"]), dtype=object)
    step = dict(channels=3, train=True, image_size=16, native_size=None, flip=True)
    with pytest.raises(formats.BadSample, match=f"cannot decode image {source} \\(in {shard}\\)"):
        data.decode_augment(batch, skip_bad=False, **step)
    out = data.decode_augment(batch, skip_bad=True, **step)
    assert out["image"].shape == (12, 3, 16, 16) and out["image"].dtype == np.uint8
    assert out["label"][2] == data.UNREADABLE and (np.delete(out["label"], 2) >= 0).all()


def test_ray_shard_surfaces_the_bad_file_from_ray_datas_wrapped_error():
    class WrappedByRayData:
        def iter_torch_batches(self, **_):
            raise RuntimeError(
                "ray::MapBatches(decode_augment)()\n  File data.py, line 1\n"
                "raytrain_ddp.formats.BadSample: cannot decode image a/b.jpg (in s/part-00000.parquet): truncated; "
                "fix or delete it, or pass --skip-bad\n\nUDF failed to process a data block.\nTo change retry attempts..."
            )
            yield

    shard = data.RayShard(WrappedByRayData(), 4, None, data.normalization(data.RECIPES["imagefolder"]))
    with pytest.raises(formats.BadSample) as err:
        list(shard)
    assert str(err.value) == (
        "cannot decode image a/b.jpg (in s/part-00000.parquet): truncated; fix or delete it, or pass --skip-bad"
    )


@pytest.mark.e2e
def test_e2e_parquet_through_ray_data_skipping_a_bad_row(tmp_path, ray_head):
    write_imagefolder(tmp_path / "src", per_class=80, val_per_class=16)
    convert(tmp_path / "src", tmp_path / "pq", "imagefolder", shard_mib=0.05, group_mib=0.01, progress=False)
    spoil_parquet_row(tmp_path / "pq" / "train" / "part-00001.parquet")
    summary, rows, _ = train(tmp_path, ray_head.env, "--address", ray_head.address, "--dataset", "parquet", "--data-dir", str(tmp_path / "pq"),
                             "--loader", "ray", "--skip-bad")
    assert_learned(summary, rows)
    assert [int(row["skipped_samples"]) for row in rows] == [1, 1]


if __name__ == "__main__" and sys.argv[1:2] == ["ray-split-ids"]:
    print(json.dumps(ray_split_ids(Path(sys.argv[2]), world=2, epochs=2)))
