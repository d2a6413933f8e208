"""The registry: splits and caps, and the driver's checks of --data-dir before any worker starts."""

from __future__ import annotations

import subprocess
import sys

import pytest
from sample_files import cfg_for, write_cifar10, write_imagefolder, write_mnist

from raytrain_ddp.config import ConfigError, TrainConfig
from raytrain_ddp.data import formats
from raytrain_ddp.data.convert import convert
from raytrain_ddp.data.download import DOWNLOADS
from raytrain_ddp.data.dataset_checks import BUILT_IN, FROM_FILES, validate
from raytrain_ddp.data.formats import READERS
from raytrain_ddp.data.registry import DATASETS, SYNTHETIC_SIZES
from raytrain_ddp.data.splits import split


def test_a_real_dataset_is_used_whole_by_default(tmp_path):
    write_imagefolder(tmp_path, per_class=10, val_per_class=5)
    cfg = TrainConfig(dataset="imagefolder", data_dir=str(tmp_path))  # no caps given
    train, val = split(cfg, formats.read_imagefolder(tmp_path))
    assert (len(train), len(val)) == (40, 20)
    synthetic = DATASETS["synthetic"](TrainConfig())
    assert (len(synthetic.train), len(synthetic.val)) == SYNTHETIC_SIZES  # its own default size


def test_caps_keep_a_fixed_random_subset(tmp_path):
    write_imagefolder(tmp_path, per_class=10, val_per_class=5)
    cfg = cfg_for("imagefolder", tmp_path, train_samples=12, val_samples=6)
    train, val = split(cfg, formats.read_imagefolder(tmp_path))
    again, _ = split(cfg, formats.read_imagefolder(tmp_path))
    assert (len(train), len(val)) == (12, 6) and train.paths == again.paths
    assert len(set(train.labels.tolist())) > 1  # not just the first class folder

# --- validate(): fast driver-side checks ---

def test_the_drivers_names_are_the_registrys():
    """dataset_checks.py names the built-in datasets without importing the registry (torch): the two must agree."""
    assert set(BUILT_IN) == set(DATASETS) and set(FROM_FILES) == set(READERS)


def check_fails(cfg: TrainConfig, *words: str) -> str:
    with pytest.raises(ConfigError) as err:
        validate(cfg)
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


CHECK_IN_A_NEW_DRIVER = """
import sys
from raytrain_ddp.config import TrainConfig
from raytrain_ddp.data.dataset_checks import validate
validate(TrainConfig(dataset=sys.argv[1], data_dir=sys.argv[2], num_classes=10, train_samples=1))
print("torch" in sys.modules)
"""


def test_the_drivers_check_of_each_format_imports_no_torch(tmp_path):
    """The driver reads a built-in dataset's files with the ranks' own readers, which import torch
    only to make a sample: its check, before any worker starts, costs no torch import (1.7 s or
    more). The note on --train-samples shows that the files were read."""
    write_imagefolder(tmp_path / "imagefolder", per_class=3, val_per_class=2)
    write_mnist(tmp_path / "mnist", n_train=20, n_val=5)
    write_cifar10(tmp_path / "cifar10", n_train=20, n_val=5)
    convert(tmp_path / "imagefolder", tmp_path / "parquet", "imagefolder", progress=False)
    for dataset in ("imagefolder", "mnist", "cifar10", "parquet"):
        proc = subprocess.run([sys.executable, "-c", CHECK_IN_A_NEW_DRIVER, dataset, str(tmp_path / dataset)],
                              capture_output=True, text=True)
        assert proc.returncode == 0 and "note: using 1 of" in proc.stderr, (dataset, proc.stderr[-2000:])
        assert proc.stdout.split() == ["False"], dataset


def test_validate_ray_loader_needs_parquet(tmp_path):
    check_fails(cfg_for("cifar10", tmp_path, loader="ray"), "raytrain data convert", "--format cifar10")


def test_download_is_tried_only_when_files_are_missing(tmp_path, monkeypatch):
    from urllib.error import URLError

    def offline(root):
        raise URLError("[Errno -2] Name or service not known")

    monkeypatch.setitem(DOWNLOADS, "mnist", offline)
    message = check_fails(cfg_for("mnist", tmp_path, download=True), "cannot download mnist", "Name or service not known")
    assert "copy the files there" in message
    write_mnist(tmp_path)
    validate(cfg_for("mnist", tmp_path, download=True))  # present: no download attempted
    check_fails(cfg_for("imagefolder", tmp_path, download=True), "no public source")
