"""The worker loop's step and schedule: accumulation, clipping, warmup and weight-decay groups.

These call the loop's own functions on real torch models, with a real 2-process gloo group for DDP's
gradient sync; no Ray, so they take seconds.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import TINY, free_port, raytrain
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from raytrain_ddp.config import TrainConfig
from raytrain_ddp.loop import (
    apply_gradients,
    ddp_options,
    forward_backward,
    lr_factor,
    make_optimizer,
    make_scheduler,
)
from raytrain_ddp.metrics import read_csv
from raytrain_ddp.models import MODELS

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
    scheduler = make_scheduler(cfg, optimizer, steps_per_epoch=len(data))
    for inputs, labels in data:
        optimizer.zero_grad(set_to_none=True)
        for i, (x, y) in enumerate(zip(inputs.chunk(micro), labels.chunk(micro))):
            forward_backward(model, x, y, None, NO_SCALER, 0.0, weight=1 / micro, sync=i == micro - 1)
        apply_gradients(model, optimizer, scaler=NO_SCALER, scheduler=scheduler, clip_grad_norm=cfg.clip_grad_norm)


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
    apply_gradients(model, optimizer, NO_SCALER, make_scheduler(cfg, optimizer, 1), cfg.clip_grad_norm)
    clipped = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
    assert clipped == pytest.approx(1.0, rel=1e-4)
    # Plain SGD moved every weight by lr x the clipped gradient: the update's norm is lr x 1.
    moved = torch.linalg.vector_norm(
        torch.stack([(a - b).detach().norm() for a, b in zip(model.parameters(), before.parameters())])
    )
    assert moved == pytest.approx(cfg.lr, rel=1e-4)


def test_warmup_then_cosine_per_optimizer_step():
    """10 steps an epoch, 2 epochs, half an epoch of warmup: 5 steps up to --lr, then a cosine to 0."""
    factor = lambda step: lr_factor(step, "cosine", epochs=2, steps_per_epoch=10, warmup_epochs=0.5)
    assert [factor(s) for s in range(5)] == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0])
    assert factor(5) == pytest.approx(1.0)
    assert factor(5 + 15 // 2) == pytest.approx(0.5 * (1 + torch.cos(torch.tensor(torch.pi * 7 / 15)).item()))
    assert factor(19) < 0.02
    # The real scheduler, stepped as apply_gradients does, gives the optimizer these LRs.
    cfg = TrainConfig(lr=0.4, epochs=2, warmup_epochs=0.5, scheduler="cosine")
    optimizer = make_optimizer(cfg, mlp())
    scheduler = make_scheduler(cfg, optimizer, steps_per_epoch=10)
    seen = []
    for _ in range(20):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert seen == pytest.approx([0.4 * factor(s) for s in range(20)])


def test_step_schedule_drops_at_half_and_three_quarters_of_the_epochs():
    factor = lambda step: lr_factor(step, "step", epochs=4, steps_per_epoch=3, warmup_epochs=0)
    assert [factor(s) for s in range(12)] == pytest.approx([1.0] * 6 + [0.1] * 3 + [0.01] * 3)
    assert lr_factor(7, "none", epochs=4, steps_per_epoch=3, warmup_epochs=1) == 1.0
    assert lr_factor(1, "none", epochs=4, steps_per_epoch=3, warmup_epochs=1) == pytest.approx(2 / 3)


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
    # 256 samples / 2 ranks / 32 = 4 micro-batches, 2 optimizer steps an epoch; cosine after 1 warmup step.
    assert float(rows[0]["lr"]) == pytest.approx(0.05 * lr_factor(2, "cosine", 2, 2, 0.5))
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
