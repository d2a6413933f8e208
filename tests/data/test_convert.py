"""`raytrain data convert`: Parquet shards and manifest from each source format, sized for streaming."""

from __future__ import annotations

import io
import json

import numpy as np
import pyarrow.parquet as pq
import pytest
from PIL import Image
from sample_files import (
    CLASSES,
    spoil,
    write_cifar10,
    write_imagefolder,
    write_mnist,
    write_tinyimagenet,
)
from typer.testing import CliRunner

from raytrain_ddp.config import ConfigError
from raytrain_ddp.data import formats
from raytrain_ddp.cli import app
from raytrain_ddp.data.convert import convert

pytestmark = pytest.mark.filterwarnings("ignore:The image decoding and encoding capabilities:DeprecationWarning")


def rows_of(dst, split):
    manifest = json.loads((dst / "manifest.json").read_text())
    return pq.read_table([dst / f for f in manifest["splits"][split]["files"]]).to_pydict()


def test_mnist_round_trips_losslessly(tmp_path):
    write_mnist(tmp_path / "src", n_train=50, n_val=10)
    manifest = convert(tmp_path / "src", tmp_path / "dst", "mnist", progress=False)
    assert manifest["source"] == "mnist" and manifest["channels"] == 1 and manifest["image_size"] == 28
    assert manifest["splits"]["train"]["rows"] == 50 and manifest["splits"]["val"]["rows"] == 10
    layout = formats.read_mnist(tmp_path / "src")
    rows = rows_of(tmp_path / "dst", "train")
    for image, label, source in zip(rows["image"][:5], rows["label"], rows["source"]):
        index = int(source.rsplit("#", 1)[1])
        assert source.startswith(str(tmp_path / "src" / "MNIST" / "raw" / "train-labels-idx1-ubyte"))
        assert np.array_equal(np.asarray(Image.open(io.BytesIO(image))), layout.train.images[index, ..., 0])
        assert label == layout.train.labels[index]


def test_rows_are_shuffled_and_counted_per_class(tmp_path):
    write_cifar10(tmp_path / "src", n_train=100, n_val=20)
    manifest = convert(tmp_path / "src", tmp_path / "dst", "cifar10", progress=False, seed=3)
    labels = rows_of(tmp_path / "dst", "train")["label"]
    assert labels != sorted(labels)
    assert manifest["splits"]["train"]["class_counts"][:CLASSES] == np.bincount(labels, minlength=CLASSES).tolist()
    assert manifest["classes"] == formats.CIFAR10_CLASSES


def test_shards_and_row_groups_are_bounded_in_size(tmp_path):
    write_tinyimagenet(tmp_path / "src", per_class=25, val_per_class=5)  # 100 JPEGs of ~2 KiB
    manifest = convert(tmp_path / "src", tmp_path / "dst", "tinyimagenet", shard_mib=0.05, group_mib=0.01,
                       progress=False)
    files = manifest["splits"]["train"]["files"]
    assert len(files) > 2 and manifest["image_size"] == 64 and manifest["classes"] == sorted(manifest["classes"])
    for f in files:
        meta = pq.ParquetFile(tmp_path / "dst" / f).metadata
        assert meta.num_row_groups >= 1
        assert all(meta.row_group(i).num_rows < 25 for i in range(meta.num_row_groups))
    assert sum(pq.ParquetFile(tmp_path / "dst" / f).metadata.num_rows for f in files) == 100


def test_imagefolder_without_val_is_split_and_sizes_are_recorded(tmp_path):
    write_imagefolder(tmp_path / "src", per_class=10, val_per_class=None, size=20)
    manifest = convert(tmp_path / "src", tmp_path / "dst", "imagefolder", val_fraction=0.25, progress=False)
    assert (manifest["splits"]["train"]["rows"], manifest["splits"]["val"]["rows"]) == (30, 10)
    assert manifest["image_size"] is None and manifest["image_sides"] == [20, 20]
    assert not set(rows_of(tmp_path / "dst", "train")["source"]) & set(rows_of(tmp_path / "dst", "val")["source"])


def test_a_corrupt_image_is_named_or_skipped_and_counted(tmp_path):
    write_imagefolder(tmp_path / "src", per_class=4, val_per_class=2)
    jpeg, png = spoil(tmp_path / "src" / "train" / "class_0")
    with pytest.raises(ConfigError, match="cannot decode image .*class_0/000[01]"):
        convert(tmp_path / "src", tmp_path / "dst", "imagefolder", progress=False)
    assert not (tmp_path / "dst" / "manifest.json").exists()  # no manifest: not a finished conversion
    # the rerun the error asks for, into the same DST: the stopped conversion's folders are its own to redo
    manifest = convert(tmp_path / "src", tmp_path / "dst", "imagefolder", skip_bad=True, progress=False)
    assert manifest["splits"]["train"]["skipped"] == 2 and manifest["splits"]["train"]["rows"] == 14
    assert str(jpeg) not in rows_of(tmp_path / "dst", "train")["source"]


def test_refuses_to_overwrite_without_the_flag(tmp_path):
    write_imagefolder(tmp_path / "src", per_class=2, val_per_class=1)
    convert(tmp_path / "src", tmp_path / "dst", "imagefolder", progress=False)
    with pytest.raises(ConfigError, match="--overwrite"):
        convert(tmp_path / "src", tmp_path / "dst", "imagefolder", progress=False)
    (tmp_path / "mine" / "train").mkdir(parents=True)
    (tmp_path / "mine" / "train" / "notes.txt").write_text("the user's own")  # no manifest, but not ours either
    with pytest.raises(ConfigError, match="--overwrite"):
        convert(tmp_path / "src", tmp_path / "mine", "imagefolder", progress=False)
    assert (tmp_path / "mine" / "train" / "notes.txt").exists()
    with pytest.raises(ConfigError, match=r"^SRC \S+/nothing is not a directory; give the dataset's directory"):
        convert(tmp_path / "nothing", tmp_path / "dst3", "imagefolder", progress=False)
    (tmp_path / "a-file").write_text("")
    with pytest.raises(ConfigError, match=r"^DST \S+/a-file is a file; give a directory"):
        convert(tmp_path / "src", tmp_path / "a-file", "imagefolder", progress=False)
    with pytest.raises(ConfigError, match="^imagefolder has no public source to download; drop --download"):
        convert(tmp_path / "src", tmp_path / "dst3", "imagefolder", progress=False, download=True)
    with pytest.raises(ConfigError, match="unknown --format 'png'"):
        convert(tmp_path / "src", tmp_path / "dst2", "png", progress=False)


def test_the_command(tmp_path):
    write_imagefolder(tmp_path / "src", per_class=3, val_per_class=1)
    result = CliRunner().invoke(
        app, ["data", "convert", str(tmp_path / "src"), str(tmp_path / "dst"), "--format", "imagefolder", "--no-progress"]
    )
    assert result.exit_code == 0, result.output
    assert "wrote 12 train + 4 val images in 2 shards" in result.output
    assert f"raytrain run --dataset parquet --data-dir {tmp_path / 'dst'} --num-classes 4" in result.output
