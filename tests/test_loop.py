"""The worker loop's step and schedule: accumulation, clipping, the LR in samples, weight-decay groups.

These call the loop's own functions on real torch models, with a real 2-process gloo group for DDP's
gradient sync; no Ray, so they take seconds.
"""

from __future__ import annotations

import copy
import math
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import TINY, free_port, raytrain
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from raytrain_ddp.config import TrainConfig
from raytrain_ddp.run_files import read_csv
from raytrain_ddp.worker.models import MODELS
from raytrain_ddp.worker.parallel import ddp_options
from raytrain_ddp.worker.schedule import Schedule, lr_factor, new_schedule, set_lr, stretched
from raytrain_ddp.worker.step import apply_gradients, forward_backward, make_optimizer

NO_SCALER = torch.amp.GradScaler("cuda", enabled=False)  # CPU: the scaler passes everything through


def mlp() -> nn.Module:
    """No batch norm: its statistics depend on the micro-batch, so accumulation could not match."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(20, 32), nn.ReLU(), nn.Linear(32, 4))


def batches(steps: int, size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(size, 20, generator=g), torch.randint(4, (size,), generator=g)) for _ in range(steps)]


def train(model, cfg: TrainConfig, data, micro: int) -> None:
    """Optimizer steps, each over one batch of `data` cut into `micro` micro-batches, as the loop does."""
    optimizer = make_optimizer(cfg, model)
    for inputs, labels in data:
        optimizer.zero_grad(set_to_none=True)
        for i, (x, y) in enumerate(zip(inputs.chunk(micro), labels.chunk(micro))):
            forward_backward(model, x, y, None, NO_SCALER, 0.0, weight=1 / micro, sync=i == micro - 1)
        apply_gradients(model, optimizer, scaler=NO_SCALER, clip_grad_norm=cfg.clip_grad_norm)


CFG = TrainConfig(lr=0.1, momentum=0.9, weight_decay=1e-3, epochs=1, scheduler="none")


def ddp_rank(rank: int, port: int, results, static: TrainConfig) -> None:
    """Rank `rank` of 2: half of each batch, in 4 micro-batches, through DDP with no_sync."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    model = DistributedDataParallel(mlp(), **ddp_options(static, accum=4))
    shard = [(x.chunk(2)[rank], y.chunk(2)[rank]) for x, y in batches(3, 64)]
    train(model, CFG, shard, micro=4)
    if rank == 0:
        # numpy, pickled by value: a tensor would be shared through a socket of this process, gone once it exits
        results.put({k: v.numpy().copy() for k, v in model.module.state_dict().items()})
    dist.destroy_process_group()


def test_accumulation_across_ddp_ranks_matches_one_big_batch():
    """2 ranks x 4 micro-batches of 8 = one step over 64 samples, the same update as a single model's."""
    reference = mlp()
    train(reference, CFG, batches(3, 64), micro=1)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    # The DDP options the loop gives a built-in model that accumulates (static_graph would break it).
    static = TrainConfig(model="convnet")
    procs = [ctx.Process(target=ddp_rank, args=(r, port, results, static)) for r in range(2)]
    for p in procs:
        p.start()
    accumulated = results.get(timeout=60)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(torch.from_numpy(accumulated[key]), value, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(mlp().state_dict()["0.weight"], torch.from_numpy(accumulated["0.weight"]))  # it trained


def test_clipping_bounds_the_gradient_norm():
    cfg = TrainConfig(lr=0.01, momentum=0.0, weight_decay=0.0, clip_grad_norm=1.0, scheduler="none")
    model = mlp()
    before = copy.deepcopy(model)
    x, y = batches(1, 64)[0]
    optimizer = make_optimizer(cfg, model)
    optimizer.zero_grad()
    forward_backward(model, x * 1000, y, None, NO_SCALER, 0.0, weight=1.0, sync=True)  # a huge gradient
    raw = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
    assert raw > 10
    apply_gradients(model, optimizer, NO_SCALER, cfg.clip_grad_norm)
    clipped = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
    assert clipped == pytest.approx(1.0, rel=1e-4)
    # Plain SGD moved every weight by lr x the clipped gradient: the update's norm is lr x 1.
    moved = torch.linalg.vector_norm(
        torch.stack([(a - b).detach().norm() for a, b in zip(model.parameters(), before.parameters())])
    )
    assert moved == pytest.approx(cfg.lr, rel=1e-4)


def step_ends(world_size: int, batch_size: int, train_size: int, epochs: int) -> list[int]:
    """The samples trained when each optimizer step of a run ends, as the loop counts them."""
    ends = []
    for epoch in range(epochs):
        ends += [epoch * train_size + min(train_size, k * world_size * batch_size)
                 for k in range(1, -(-train_size // (world_size * batch_size)) + 1)]
    return ends


def test_warmup_then_cosine_in_samples():
    """100 samples an epoch, 2 epochs, half an epoch of warmup: up to --lr at sample 50, then a cosine to 0."""
    schedule = new_schedule(TrainConfig(epochs=2, warmup_epochs=0.5), train_size=100)
    assert schedule == Schedule(total=200, warmup=50, anchor=50, anchor_progress=0.0)
    factor = lambda samples: lr_factor(schedule, samples, "cosine")
    assert [factor(s) for s in (10, 20, 40, 50)] == pytest.approx([0.2, 0.4, 0.8, 1.0])
    assert factor(125) == pytest.approx(0.5)  # halfway through the decay
    assert factor(200) == pytest.approx(0.0) and factor(260) == pytest.approx(0.0)  # clamped past the end
    # set_lr gives the optimizer exactly that
    cfg = TrainConfig(lr=0.4)
    optimizer = make_optimizer(cfg, mlp())
    set_lr(optimizer, cfg.lr * factor(125))
    assert [g["lr"] for g in optimizer.param_groups] == pytest.approx([0.2] * len(optimizer.param_groups))


def test_the_lr_at_every_epoch_end_does_not_depend_on_the_world_size():
    """The issue's run: cosine over 6 epochs, lr 0.05; 2 workers, then 1 after epoch 1 (or 4)."""
    schedule = new_schedule(TrainConfig(epochs=6, warmup_epochs=1.0), train_size=1000)
    for world_size in (1, 2, 4, 3):
        ends = step_ends(world_size, batch_size=64, train_size=1000, epochs=6)
        at_epoch_end = [lr_factor(schedule, s, "cosine") for s in ends if s % 1000 == 0]
        assert at_epoch_end == pytest.approx([1.0, 0.5 * (1 + math.cos(math.pi / 5)), 0.5 * (1 + math.cos(2 * math.pi / 5)),
                                             0.5 * (1 + math.cos(3 * math.pi / 5)), 0.5 * (1 + math.cos(4 * math.pi / 5)), 0.0])
    # without warmup, epoch 2 of 6 ends at 0.0375 of lr 0.05, epoch 6 at 0, as the issue expects
    plain = new_schedule(TrainConfig(epochs=6), train_size=1000)
    assert 0.05 * lr_factor(plain, 2000, "cosine") == pytest.approx(0.0375)
    assert 0.05 * lr_factor(plain, 6000, "cosine") == pytest.approx(0.0)
    # LRs never rise again once decaying, whatever the world size (the old schedule's bug past the end)
    for world_size in (1, 4):
        lrs = [lr_factor(plain, s, "cosine") for s in step_ends(world_size, 64, 1000, 6)]
        assert all(a >= b for a, b in zip(lrs, lrs[1:]))


def test_more_epochs_on_resume_stretch_the_schedule_from_where_it_stands():
    schedule = new_schedule(TrainConfig(epochs=4), train_size=100)
    here = lr_factor(schedule, 200, "cosine")  # halfway: 0.5
    longer = stretched(schedule, total=800, samples=200)
    assert lr_factor(longer, 200, "cosine") == pytest.approx(here)  # no jump
    assert lr_factor(longer, 500, "cosine") == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.75)))  # half the rest
    assert lr_factor(longer, 800, "cosine") == pytest.approx(0.0)
    assert stretched(schedule, total=400, samples=200) is schedule
    # still warming up: the warmup is kept, the decay simply ends later
    warm = new_schedule(TrainConfig(epochs=4, warmup_epochs=1.0), train_size=100)
    assert stretched(warm, total=600, samples=50) == warm._replace(total=600)


def test_step_schedule_drops_after_half_and_three_quarters_of_the_run():
    schedule = new_schedule(TrainConfig(epochs=4), train_size=30)
    ends = step_ends(1, 10, 30, 4)  # 3 steps an epoch
    assert [lr_factor(schedule, s, "step") for s in ends] == pytest.approx([1.0] * 6 + [0.1] * 3 + [0.01] * 3)
    warm = new_schedule(TrainConfig(epochs=4, warmup_epochs=1.0), train_size=30)
    assert lr_factor(warm, 70, "none") == 1.0
    assert lr_factor(warm, 20, "none") == pytest.approx(2 / 3)


def test_norm_and_bias_parameters_get_no_weight_decay():
    model = MODELS["resnet18"](num_classes=10, in_channels=3)
    decayed, exempt = make_optimizer(TrainConfig(weight_decay=5e-4), model).param_groups
    assert decayed["weight_decay"] == 5e-4 and exempt["weight_decay"] == 0.0
    ids = lambda group: {id(p) for p in group["params"]}
    assert {id(model.fc.weight), id(model.conv1.weight)} <= ids(decayed)
    assert {id(model.fc.bias), id(model.bn1.weight), id(model.bn1.bias)} <= ids(exempt)
    assert len(decayed["params"]) + len(exempt["params"]) == len(list(model.parameters()))
    [every] = make_optimizer(TrainConfig(weight_decay=5e-4, decay_norm_bias=True), model).param_groups
    assert every["weight_decay"] == 5e-4 and len(every["params"]) == len(list(model.parameters()))


@pytest.mark.e2e
def test_the_recipe_trains_and_mlflow_and_wandb_read_it_back(ray_head, tmp_path):
    """The issue's command: accumulation, clipping, warmup, a per-step cosine, MLflow and W&B (offline)."""
    from mlflow import MlflowClient

    env = {k: v for k, v in ray_head.env.items() if not k.startswith(("MLFLOW_", "WANDB_"))}
    env.update(WANDB_MODE="offline", WANDB_SILENT="true")
    proc = raytrain(
        "run", *TINY, "--epochs", "2", "--grad-accum", "2", "--clip-grad-norm", "1", "--warmup-epochs", "0.5",
        "--scheduler", "cosine", "--label-smoothing", "0.1", "--mlflow", "--wandb",
        "--storage-path", str(tmp_path), "--name", "recipe", env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "global batch 128 = --batch-size 32 x 2 workers x 2 accumulated micro-batches" in proc.stdout
    run_dir = tmp_path / "recipe"
    rows = read_csv(run_dir / "metrics.csv")
    assert [r["epoch"] for r in rows] == ["1", "2"] and float(rows[1]["train_loss"]) < float(rows[0]["train_loss"])
    # 256 samples an epoch, warmup over the first 128, then a cosine to the 512th: a third of it by epoch 1's end.
    schedule = new_schedule(TrainConfig(epochs=2, warmup_epochs=0.5), train_size=256)
    assert float(rows[0]["lr"]) == pytest.approx(0.05 * lr_factor(schedule, 256, "cosine")) == pytest.approx(0.0375)
    assert float(rows[1]["lr"]) == pytest.approx(0.0, abs=1e-9)

    client = MlflowClient(f"sqlite:///{run_dir / 'mlflow.db'}")  # the local store, MLFLOW_TRACKING_URI unset
    [run] = client.search_runs([client.get_experiment_by_name("raytrain").experiment_id])
    run_id = run.info.run_id
    history = client.get_metric_history(run_id, "val_acc")
    assert [m.step for m in history] == [1, 2]
    assert [m.value for m in history] == pytest.approx([float(r["val_acc"]) for r in rows])
    assert run.data.params["grad_accum"] == "2" and run.info.status == "FINISHED"

    [offline] = (run_dir / "wandb").glob("offline-run-*")
    assert list(offline.glob("run-*.wandb"))
