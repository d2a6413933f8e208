"""Small files in each real dataset format, written by the tests themselves: learnable data
(each class its own colour or brightness, plus noise), so an end-to-end run can show it learned."""

from __future__ import annotations

import csv
import gzip
import io
import json
import pickle
from pathlib import Path

import numpy as np
import torch
from conftest import TINY, raytrain
from PIL import Image

from raytrain_ddp.config import TrainConfig
from raytrain_ddp.data import formats
from raytrain_ddp.data.batches import Loaders

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


def spoil(folder: Path) -> tuple[Path, Path]:
    """Truncate one JPEG and replace one PNG with garbage; return both paths."""
    jpeg, png = sorted(folder.glob("*.jpg"))[0], sorted(folder.glob("*.png"))[0]
    jpeg.write_bytes(jpeg.read_bytes()[:200])
    png.write_bytes(b"this is not a png")
    return jpeg, png


def every_batch(loaders: Loaders) -> list[tuple[torch.Tensor, torch.Tensor]]:
    loaders.set_epoch(1)
    return list(loaders.train) + list(loaders.val)


def train(tmp_path: Path, env: dict, *args: str, cwd: Path | None = None) -> tuple[dict, list[dict], str]:
    """Run the real CLI (flags after TINY override it) in `cwd`; return summary.json, metrics rows, stderr."""
    result = raytrain(
        "run", *TINY, "--epochs", "2", "--batch-size", "16", "--train-samples", "0", "--val-samples", "0",
        "--num-classes", str(CLASSES), "--storage-path", str(tmp_path / "runs"), "--name", "e2e", *args,
        env=env, cwd=cwd,
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
