"""The torch ingest path: disjoint shards, bad samples, and `raytrain run` on each format end to end."""

from __future__ import annotations

import csv
import random

import numpy as np
import pytest
import torch
from torch.utils.data import TensorDataset
from conftest import TINY, raytrain
from sample_files import (
    assert_learned,
    cfg_for,
    every_batch,
    spoil,
    train,
    write_imagefolder,
    write_mnist,
    write_tinyimagenet,
)

from raytrain_ddp.data import formats
from raytrain_ddp.data.batches import UNREADABLE, Batches, SkipCount
from raytrain_ddp.data.convert import convert
from raytrain_ddp.data.loaders import make_loaders
from raytrain_ddp.data.dataset_checks import validate
from raytrain_ddp.data.registry import DATASETS
from raytrain_ddp.data.torch_ingest import STREAMS, PerSampleRandom, epoch_shard, sample_seed, trained_position

# --- the torch ingest path: sharding ---

def test_torch_path_shards_are_disjoint_and_cover_the_epoch(tmp_path):
    write_imagefolder(tmp_path, per_class=10, val_per_class=5)  # 40 train, 20 val
    world = 3
    cfg = cfg_for("imagefolder", tmp_path, batch_size=4)
    loaders = [make_loaders(cfg, rank, world, cuda=False) for rank in range(world)]
    n_train = 40
    for epoch in (1, 2):
        orders = []
        for loader in loaders:
            loader.set_epoch(epoch)
            orders.append([index for _, index in loader.train.source.sampler])
        per_rank = -(-n_train // world)  # DistributedSampler pads to equal shards by repeating samples
        assert all(len(o) == per_rank for o in orders)
        assert all(loader.steps_per_epoch == -(-per_rank // cfg.batch_size) for loader in loaders)
        flat = [i for o in orders for i in o]
        assert set(flat) == set(range(n_train))
        assert len(flat) - len(set(flat)) == world * per_rank - n_train  # only the padding repeats
        if epoch == 1:
            first = orders
    assert first != orders  # reshuffled per epoch
    # Resuming after 3 batches on every rank, i.e. at global position 3 x 4 x 3: the same order, minus those.
    assert loaders[0].set_epoch(2, 3 * cfg.batch_size * world) == 1  # one batch left
    assert [index for _, index in loaders[0].train.source.sampler] == orders[0][3 * cfg.batch_size:]
    val = [list(loader.val.source.dataset.indices) for loader in loaders]
    assert sorted(i for v in val for i in v) == list(range(20))  # val: each sample exactly once


@pytest.mark.parametrize("before, after", [(2, 1), (1, 2), (2, 3), (3, 2), (2, 2)])
def test_a_resume_at_another_world_size_trains_each_remaining_sample_once(before, after):
    """Sample by sample: the batches trained before the resize, then the rest re-sharded over the new world."""
    n, batch, seed, epoch = 23, 2, 7, 3
    shards = [epoch_shard(n, before, rank, seed, epoch) for rank in range(before)]
    batches_done = 2
    trained = [i for shard in shards for i in shard[: batches_done * batch]]
    position = trained_position(0, before, batch, batches_done, n)
    assert position == before * batch * batches_done and len(set(trained)) == position  # no repeats yet

    rest = [epoch_shard(n, after, rank, seed, epoch, start=position) for rank in range(after)]
    assert len({len(shard) for shard in rest}) == 1  # equal shards: every rank takes the same steps
    again = [i for shard in rest for i in shard]
    assert set(trained) | set(again) == set(range(n))  # every sample of the epoch
    assert not set(trained) & set(again)  # nothing trained twice across the resize
    assert len(again) - len(set(again)) == -(n - position) % after  # only the evening-out repeats
    # The same world size continues exactly where each rank was, as DistributedSampler would (all but
    # the last sample, which may be the evening-out repeat of another sample).
    if before == after:
        assert [(s[: batches_done * batch] + r)[:-1] for s, r in zip(shards, rest)] == [s[:-1] for s in shards]


def test_the_epoch_order_is_distributed_samplers():
    from torch.utils.data import DistributedSampler

    reference = DistributedSampler(range(23), num_replicas=3, rank=1, shuffle=True, seed=7)
    reference.set_epoch(4)
    assert epoch_shard(23, 3, 1, seed=7, epoch=4) == list(reference)


# --- each sample's augmentation: a function of (seed, epoch, index) alone ---

class GlobalDraws(torch.utils.data.Dataset):
    """A user's dataset whose random transform draws from torch's, Python's and NumPy's global streams."""

    def __len__(self) -> int:
        return 10

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return torch.tensor([torch.rand(()).item(), random.random(), np.random.rand()], dtype=torch.float64), index


def seed_globals(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def next_draws() -> tuple:
    return torch.rand(3).tolist(), random.random(), np.random.rand(), np.random.randn()


def test_a_samples_augmentation_depends_only_on_seed_epoch_and_index():
    """Whatever the global streams held before, in the training process or a loader worker."""
    keys = [(1, 3), (1, 4), (2, 3)]

    def samples(before: int, workers: int) -> list[torch.Tensor]:
        seed_globals(before)  # a loader's workers seed their own streams from the global one, too
        loader = torch.utils.data.DataLoader(PerSampleRandom(GlobalDraws(), seed=5), sampler=keys, batch_size=None,
                                             num_workers=workers)
        return [sample for sample, _ in loader]

    first = samples(before=1, workers=0)
    for before, workers in ((2, 0), (1, 2), (3, 2)):
        assert all(map(torch.equal, samples(before, workers), first))
    assert not torch.equal(first[0], first[1]) and not torch.equal(first[0], first[2])  # another index, epoch
    # The streams that checkpoints written before per-stream seeding drew from, value for value.
    seed = sample_seed(5, 1, 3)
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)
    assert torch.equal(GlobalDraws()[3][0], first[0])


def test_drawing_a_sample_moves_no_stream_of_the_training_process():
    """With --data-workers 0 the model's dropout draws from the streams of the process that loads."""
    seed_globals(11)
    np.random.randn()  # an odd number of normals leaves NumPy a cached one, part of its state too
    expected = next_draws()
    seed_globals(11)
    np.random.randn()
    cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() else None
    PerSampleRandom(GlobalDraws(), seed=5)[(1, 3)]
    assert next_draws() == expected
    if cuda is not None:  # torch.manual_seed would reseed it
        assert torch.equal(torch.cuda.get_rng_state(), cuda)


@pytest.mark.parametrize("dataset", ["imagefolder", "synthetic"])
def test_our_datasets_draw_from_no_stream_but_those_they_name(tmp_path, dataset):
    write_imagefolder(tmp_path, per_class=2, val_per_class=1)
    train = DATASETS[dataset](cfg_for(dataset, tmp_path, train_samples=8)).train
    seed_globals(3)
    expected = next_draws()
    seed_globals(3)
    for index in range(len(train)):
        train[index]
    draws = next_draws()
    for name, drawn, want in zip(("torch", "python", "numpy", "numpy"), draws, expected):
        assert drawn == want or name in train.random_streams
    assert set(train.random_streams) <= set(STREAMS)

    def augmented(before: int) -> torch.Tensor:
        seed_globals(before)
        return torch.stack([PerSampleRandom(train, seed=5)[(1, index)][0] for index in range(len(train))])

    assert torch.equal(augmented(1), augmented(2))


# --- bad samples, at the moment they are read ---

RANK_WITH_LOADER_WORKERS = """
import sys
from raytrain_ddp.config import TrainConfig
from raytrain_ddp.data.loaders import make_loaders
cfg = TrainConfig(dataset="imagefolder", data_dir=sys.argv[1], num_classes=2, data_workers=2, batch_size=4, image_size=16)
loaders = make_loaders(cfg, 0, 1, cuda=False)
made = "torchvision" in sys.modules
loaders.set_epoch(1)
images, labels = next(iter(loaders.train))
print(made, tuple(images.shape), "torchvision" in sys.modules)
"""


def test_a_rank_with_loader_workers_leaves_the_transforms_to_them(tmp_path):
    """The workers transform the images, so the rank never imports torchvision (2 s of its start) for
    them: its forkserver imports it beside the rank's start, once for all its workers."""
    import subprocess
    import sys

    write_imagefolder(tmp_path, per_class=4, val_per_class=2, size=24)
    proc = subprocess.run([sys.executable, "-c", RANK_WITH_LOADER_WORKERS, str(tmp_path)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["False", "(4,", "3,", "16,", "16)", "False"], proc.stdout


def test_a_corrupt_image_stops_loading_with_its_name(tmp_path):
    write_imagefolder(tmp_path, per_class=4, val_per_class=2)
    jpeg = tmp_path / "train" / "class_2" / "0002.jpg"
    jpeg.write_bytes(jpeg.read_bytes()[:200])
    loaders = make_loaders(cfg_for("imagefolder", tmp_path, batch_size=64), 0, 1, cuda=False)
    with pytest.raises(formats.BadSample, match=f"cannot decode image {jpeg}: .*truncated.*--skip-bad"):
        every_batch(loaders)


def test_skip_bad_drops_and_counts_unreadable_samples(tmp_path):
    write_imagefolder(tmp_path, per_class=4, val_per_class=2)
    spoil(tmp_path / "train" / "class_2")
    spoil(tmp_path / "val" / "class_0")
    (tmp_path / "train" / "class_1" / "0000.jpg").write_bytes(b"")  # an empty file
    loaders = make_loaders(cfg_for("imagefolder", tmp_path, batch_size=4, skip_bad=True), 0, 1, cuda=False)
    batches = every_batch(loaders)
    assert loaders.skipped() == 5
    assert sum(len(labels) for _, labels in batches) == 16 + 8 - 5
    assert all((labels >= 0).all() for _, labels in batches)
    loaders.set_epoch(2)
    assert loaders.skipped() == 0  # counted per epoch


def test_a_training_batch_of_only_bad_samples_fails_rather_than_desync_ranks():
    skips = SkipCount()
    bad = [(torch.zeros(2, 3, 4, 4), torch.tensor([UNREADABLE] * 2))]
    with pytest.raises(RuntimeError, match="all 2 samples of a training batch were unreadable"):
        list(Batches(bad, skips, train=True, skip_bad=True))
    assert list(Batches(bad, skips, train=False, skip_bad=True)) == []  # val: no collective per batch, just skip


def test_parquet_via_the_torch_path(tmp_path):
    write_imagefolder(tmp_path / "src", per_class=6, val_per_class=2)
    jpeg, _ = spoil(tmp_path / "src" / "train" / "class_3")
    convert(tmp_path / "src", tmp_path / "pq", "imagefolder", skip_bad=True, progress=False)
    cfg = cfg_for("parquet", tmp_path / "pq", batch_size=8)
    validate(cfg)
    loaders = make_loaders(cfg, 0, 1, cuda=False)
    batches = every_batch(loaders)
    assert sum(len(labels) for _, labels in batches) == 22 + 8
    assert batches[0][0].shape[1:] == (3, 24, 24)


# --- end to end: `raytrain run` with 2 workers on each format ---

@pytest.mark.e2e
@pytest.mark.timeout(420)
@pytest.mark.parametrize("n_val", [1, 129])
def test_e2e_uneven_validation_finishes_and_counts_every_sample_once(tmp_path, ray_head, n_val):
    """Over 2 ranks at batch 64, 1 val sample leaves rank 1 no val batch at all, and 129 give rank 0
    two batches to rank 1's one. A collective that only some ranks reach (DDP's forward broadcasts
    BatchNorm buffers) would leave the others waiting forever."""
    result = raytrain(
        "run", *TINY, "--address", ray_head.address, "--model", "convnet", "--train-samples", "64",
        "--val-samples", str(n_val), "--batch-size", "64", "--image-size", "16",
        "--storage-path", str(tmp_path / "runs"), "--name", "uneven",
        env=ray_head.env, timeout=240,  # a hang fails here, in minutes
    )
    assert result.returncode == 0, result.stderr[-3000:]
    with open(tmp_path / "runs" / "uneven" / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [int(row["val_samples"]) for row in rows] == [n_val]


@pytest.mark.e2e
def test_e2e_mnist_idx_files_under_a_relative_data_dir(tmp_path, ray_head):
    """`--data-dir data`, as the README writes it: the ranks do not start in the driver's directory."""
    write_mnist(tmp_path / "data", n_train=256, n_val=64)
    summary, rows, _ = train(tmp_path, ray_head.env, "--address", ray_head.address, "--dataset", "mnist",
                             "--data-dir", "data", "--num-classes", "10", "--image-size", "28", cwd=tmp_path)
    assert_learned(summary, rows)
    assert summary["config"]["data_dir"] == str(tmp_path / "data")


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


def test_a_tensor_dataset_is_read_without_seeding_and_any_other_seeds_every_stream():
    tensors = TensorDataset(torch.arange(4.0))
    assert PerSampleRandom(tensors, seed=0).streams == ()

    class Yours(TensorDataset):  # a subclass may add random transforms of its own
        pass

    assert PerSampleRandom(Yours(torch.arange(4.0)), seed=0).streams == tuple(STREAMS)


# --- how many loader processes, where --data-workers is left unset ---

class SlowReads(torch.utils.data.Dataset):
    """A user's dataset that reads each sample from somewhere (here: 1 ms of waiting)."""

    def __len__(self):
        return 64

    def __getitem__(self, index):
        import time

        time.sleep(0.001)
        return torch.zeros(8), index % 4


def test_left_unset_the_loader_runs_in_the_rank_only_for_a_users_data_in_memory():
    """A user's TensorDataset reads a sample in microseconds: loader processes would only move each
    batch between processes (a third of the loop by hand's speed, 2 ranks on 2 cores). A user's data
    read from somewhere, and ours, which generate or decode each sample, keep 2; --data-workers, given,
    is taken as it is."""
    from raytrain_ddp.config import LOADER_WORKERS, TrainConfig
    from raytrain_ddp.data.registry import Data
    from raytrain_ddp.data.torch_ingest import torch_loaders

    in_memory = TensorDataset(torch.randn(256, 8), torch.randint(0, 4, (256,)))

    def workers(dataset, name="mine:data", **flags):
        cfg = TrainConfig(dataset=name, num_classes=4, batch_size=8, **flags)
        return torch_loaders(cfg, 0, 1, cuda=False, build=lambda _: Data(dataset, dataset, 1)).loader_workers

    assert LOADER_WORKERS == 2
    assert workers(in_memory) == 0
    assert workers(SlowReads()) == LOADER_WORKERS
    assert workers(in_memory, data_workers=1) == 1 and workers(SlowReads(), data_workers=0) == 0
    assert workers(in_memory, name="synthetic") == LOADER_WORKERS  # ours: not even read to tell
