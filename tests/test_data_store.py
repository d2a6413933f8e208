"""--dataset parquet --data-dir s3://...: shards written by `raytrain data convert`, read from a real
S3 server (moto's server mode) by the driver's checks, by both ingest paths, and by a run whose ranks
know nothing of the store but the filesystem the driver hands them; and a data directory the store
cannot serve, or a dataset it cannot hold, refused in one line."""

from __future__ import annotations

import csv
import io
import json
import os
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import free_port, raytrain, refusal

from raytrain_ddp.config import ConfigError, TrainConfig
from raytrain_ddp.data.convert import convert
from raytrain_ddp.data.dataset_checks import data_root, dataset_channels, validate
from raytrain_ddp.storage.location import storage_root
from raytrain_ddp.storage.object_path import ObjectPath

CLASSES, TRAIN, VAL = 4, 8, 2
"""The tiny dataset: 4 classes of 8 train and 2 val images each."""


def image_folder(tmp_path: Path) -> Path:
    """A tiny image folder: CLASSES classes of TRAIN train and VAL val PNGs of 8 px."""
    from PIL import Image

    rng = np.random.default_rng(0)
    for split, n in (("train", TRAIN), ("val", VAL)):
        for label in range(CLASSES):
            folder = tmp_path / "src" / split / f"class_{label}"
            folder.mkdir(parents=True)
            for i in range(n):
                pixels = np.clip(np.array([60 * label, 200 - 50 * label, 90]) + rng.integers(-20, 21, (8, 8, 3)), 0, 255)
                out = io.BytesIO()
                Image.fromarray(pixels.astype(np.uint8)).save(out, format="PNG")
                (folder / f"{i}.png").write_bytes(out.getvalue())
    return tmp_path / "src"


def shards_on_the_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> str:
    """The tiny image folder, converted by our converter straight into a fresh prefix of the bucket;
    its URI. This process is left pointed at the store, as a user's shell would be."""
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    uri = f"s3://runs/data-{time.time_ns()}"
    # Small shards: a few files per split, as a real dataset has many.
    convert(image_folder(tmp_path), storage_root(uri), "imagefolder", shard_mib=0.001, group_mib=0.001, progress=False)
    return uri


def parquet_cfg(uri: str, **overrides) -> TrainConfig:
    values = dict(dataset="parquet", data_dir=uri, num_classes=CLASSES, train_samples=0, val_samples=0,
                  data_workers=0, batch_size=8, image_size=8)
    return TrainConfig(**{**values, **overrides})


def test_the_driver_checks_and_the_torch_path_read_the_shards_through_the_store(s3_server, tmp_path, monkeypatch):
    """The manifest, the shards' presence and labels, on the driver; then the torch path's reader,
    given that path, with the store's settings gone from the environment, as on a rank."""
    from raytrain_ddp.data.loaders import make_loaders

    uri = shards_on_the_store(tmp_path, monkeypatch, s3_server.env)
    cfg = parquet_cfg(uri)
    root = data_root(cfg)
    assert isinstance(root, ObjectPath) and str(root) == uri
    assert dataset_channels(cfg, root) == 3
    validate(cfg, root)
    with pytest.raises(ConfigError, match=r"has 4 classes but --num-classes is 3; pass --num-classes 4"):
        validate(parquet_cfg(uri, num_classes=3), root)
    for key in s3_server.env:
        monkeypatch.delenv(key)
    loaders = make_loaders(cfg, 0, 1, cuda=False, root=root)
    loaders.set_epoch(1)
    seen = [labels for _, labels in loaders.train] + [labels for _, labels in loaders.val]
    assert sum(len(labels) for labels in seen) == CLASSES * (TRAIN + VAL)
    shard = json.loads((root / "manifest.json").read_text())["splits"]["train"]["files"][0]
    (root / shard).unlink()  # a shard gone from the store: named by the driver's check
    with pytest.raises(ConfigError, match=rf"{uri}/{shard} is listed in {uri}/manifest.json but missing"):
        validate(cfg, root)


def test_a_data_dir_the_store_cannot_serve_is_refused_in_one_line(store_env, monkeypatch):
    with pytest.raises(ConfigError, match=r"--data-dir s3:///data names no bucket; pass s3://BUCKET/PREFIX"):
        data_root(parquet_cfg("s3:///data"))
    with pytest.raises(ConfigError, match=r"there is no bucket 'nobucket' at its store; create it, or pass another --data-dir"):
        data_root(parquet_cfg("s3://nobucket/data"))
    empty = parquet_cfg(f"s3://runs/nothing-{time.time_ns()}")
    with pytest.raises(ConfigError, match=r"no manifest.json in s3://runs/nothing-\d+; write Parquet shards there "
                                          r"with `raytrain data convert SRC s3://runs/nothing-\d+ --format \.\.\.`"):
        validate(empty, data_root(empty))
    with pytest.raises(ConfigError, match=r"--download fetches into a local directory, not --data-dir s3://runs/x"):
        data_root(TrainConfig(dataset="cifar10", data_dir="s3://runs/x", download=True))
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", f"http://127.0.0.1:{free_port('127.0.0.1')}")  # nothing listens
    with pytest.raises(ConfigError, match=r"--data-dir s3://runs/x: cannot reach its store .*check the endpoint"):
        data_root(parquet_cfg("s3://runs/x"))


def test_the_cli_refuses_a_dataset_the_store_cannot_hold_and_a_prefix_with_no_shards(s3_server, tmp_path):
    env = {**{k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}, **s3_server.env}
    run = ["run", "--dry-run", "--storage-path", str(tmp_path / "runs")]
    said = refusal(raytrain(*run, "--dataset", "cifar10", "--data-dir", "s3://runs/cifar", env=env, cwd=tmp_path))
    assert "only --dataset parquet reads from an object store" in said and "convert SRC s3://runs/cifar --format cifar10" in said, said
    said = refusal(raytrain(*run, "--dataset", "parquet", "--data-dir", "s3://runs/nothing", env=env, cwd=tmp_path))
    assert "no manifest.json in s3://runs/nothing" in said, said


def test_the_command_converts_into_the_store_and_keeps_a_finished_conversion(store_env, tmp_path):
    """`raytrain data convert SRC s3://...`: the shards and manifest in the bucket, the run's line to
    train on them; a finished conversion there is kept unless --overwrite; a bucket that is not there
    is named in one line before any image is decoded."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    src, uri = image_folder(tmp_path), f"s3://runs/convert-{time.time_ns()}"
    command = ["data", "convert", str(src), uri, "--format", "imagefolder", "--no-progress"]
    done = raytrain(*command, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"wrote {CLASSES * TRAIN} train + {CLASSES * VAL} val images in 2 shards to {uri}" in done.stdout, done.stdout
    assert f"raytrain run --dataset parquet --data-dir {uri} --loader ray --num-classes {CLASSES}" in done.stdout
    assert "--overwrite" in refusal(raytrain(*command, env=env, cwd=tmp_path))
    again = raytrain(*command, "--overwrite", "--seed", "1", env=env, cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-2000:]
    root = storage_root(uri)
    manifest = json.loads((root / "manifest.json").read_text())
    assert manifest["seed"] == 1 and [p.name for p in (root / "train").iterdir()] == ["part-00000.parquet"]
    said = refusal(raytrain("data", "convert", str(src), "s3://nobucket/x", "--format", "imagefolder", env=env, cwd=tmp_path))
    assert said.startswith("error: DST s3://nobucket/x: there is no bucket 'nobucket'"), said
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]  # nothing written here


@pytest.mark.e2e
@pytest.mark.timeout(360)
def test_e2e_parquet_from_the_store_through_ray_data(ray_head, s3_server, tmp_path, monkeypatch):
    """`raytrain run --dataset parquet --loader ray --data-dir s3://...`: the cluster's environment has
    no endpoint or credentials (the head started without them), so the ranks and Ray Data's read
    tasks read the store only through the filesystem the driver resolved and handed them."""
    assert not {"AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID"} & set(ray_head.env), "the head must not know the store"
    uri = shards_on_the_store(tmp_path, monkeypatch, s3_server.env)
    result = raytrain(
        "run", "--address", ray_head.address, "--workers", "1", "--epochs", "1", "--dataset", "parquet",
        "--loader", "ray", "--data-dir", uri, "--num-classes", str(CLASSES), "--image-size", "8", "--batch-size", "8",
        "--train-samples", "0", "--val-samples", "0", "--data-workers", "0", "--progress", "plain",
        "--storage-path", str(tmp_path / "runs"), "--name", "e2e", env={**ray_head.env, **s3_server.env}, cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir = tmp_path / "runs" / "e2e"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["final"]["epoch"] == 1 and summary["config"]["data_dir"] == uri  # as typed: no credentials in it
    with open(run_dir / "metrics.csv", newline="") as f:
        [row] = list(csv.DictReader(f))
    assert int(row["samples"]) == CLASSES * TRAIN and int(row["val_samples"]) == CLASSES * VAL, row
