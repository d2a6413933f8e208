"""The Ray Data ingest path, on a real Ray: shards, bad rows, and an end-to-end run."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from sample_files import (
    CLASSES,
    assert_learned,
    cfg_for,
    image_bytes,
    train,
    write_imagefolder,
)

from raytrain_ddp.data import formats
from raytrain_ddp.data.batches import UNREADABLE
from raytrain_ddp.data.convert import convert
from raytrain_ddp.data.ray_ingest import (
    RayShard,
    decode_augment,
    ray_data_config,
    ray_datasets,
)
from raytrain_ddp.data.transforms import RECIPES, normalization

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
    for name, dataset in ray_datasets(cfg).items():
        shards = [s[name] for s in ray_data_config(cfg).configure({name: dataset}, world, None, None)]
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
        # sample_files imports conftest, one folder up
        env={**ray_head.env, "PYTHONPATH": str(Path(__file__).parents[1])},
        capture_output=True, text=True, timeout=300, cwd=Path(__file__).parent,
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
        decode_augment(batch, skip_bad=False, **step)
    out = decode_augment(batch, skip_bad=True, **step)
    assert out["image"].shape == (12, 3, 16, 16) and out["image"].dtype == np.uint8
    assert out["label"][2] == UNREADABLE and (np.delete(out["label"], 2) >= 0).all()


def test_ray_shard_surfaces_the_bad_file_from_ray_datas_wrapped_error():
    class WrappedByRayData:
        def iter_torch_batches(self, **_):
            raise RuntimeError(
                "ray::MapBatches(decode_augment)()\n  File ray_ingest.py, line 1\n"
                "raytrain_ddp.formats.BadSample: cannot decode image a/b.jpg (in s/part-00000.parquet): truncated; "
                "fix or delete it, or pass --skip-bad\n\nUDF failed to process a data block.\nTo change retry attempts..."
            )
            yield

    shard = RayShard(WrappedByRayData(), 4, None, normalization(RECIPES["imagefolder"]))
    with pytest.raises(formats.BadSample) as err:
        list(shard)
    assert str(err.value) == (
        "cannot decode image a/b.jpg (in s/part-00000.parquet): truncated; fix or delete it, or pass --skip-bad"
    )


@pytest.mark.e2e
@pytest.mark.timeout(540)
def test_e2e_parquet_through_ray_data_skipping_a_bad_row_and_uneven_validation(tmp_path, ray_head):
    """One run for two things (CI time). Train: many small shards, one row spoiled and skipped under
    --skip-bad, and the run learns. Val: 129 rows in one Parquet file (one block), over 2 ranks: the
    exact split hands out whole blocks, so one rank gets every val row and the other none. The run
    must finish (a collective in the val batches, such as DDP's buffer broadcast, would wait forever
    for the rank with none) and count each row exactly once."""
    n_val = 129
    write_imagefolder(tmp_path / "src", per_class=80, val_per_class=32)
    val_0 = tmp_path / "src" / "val" / "class_0"
    (val_0 / "extra.png").write_bytes(sorted(val_0.glob("*.png"))[0].read_bytes())  # odd: 129
    # Train from a conversion into small shards, val from one into the default (one file).
    convert(tmp_path / "src", tmp_path / "pq", "imagefolder", shard_mib=0.05, group_mib=0.01, progress=False)
    whole = convert(tmp_path / "src", tmp_path / "whole", "imagefolder", progress=False)
    assert whole["splits"]["val"]["files"] == ["val/part-00000.parquet"]
    shutil.rmtree(tmp_path / "pq" / "val")
    shutil.copytree(tmp_path / "whole" / "val", tmp_path / "pq" / "val")
    manifest = json.loads((tmp_path / "pq" / "manifest.json").read_text())
    manifest["splits"]["val"] = whole["splits"]["val"]
    (tmp_path / "pq" / "manifest.json").write_text(json.dumps(manifest))
    spoil_parquet_row(tmp_path / "pq" / "train" / "part-00001.parquet")

    summary, rows, _ = train(tmp_path, ray_head.env, "--address", ray_head.address, "--dataset", "parquet", "--data-dir", str(tmp_path / "pq"),
                             "--loader", "ray", "--skip-bad")
    assert_learned(summary, rows)
    assert [int(row["skipped_samples"]) for row in rows] == [1, 1]
    assert [int(row["val_samples"]) for row in rows] == [n_val, n_val]  # equal=True would drop one


if __name__ == "__main__" and sys.argv[1:2] == ["ray-split-ids"]:
    print(json.dumps(ray_split_ids(Path(sys.argv[2]), world=2, epochs=2)))
