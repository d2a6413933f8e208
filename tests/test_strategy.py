"""DDP against FSDP on real 2-process gloo groups: the same losses, less state per rank, accumulation
with clipping, evaluation on uneven shards, and checkpoints that reshard and cross strategies.

No Ray, so each takes seconds; the loop's own step functions run on the wrapped models. The
end-to-end runs through the CLI are at the bottom.
"""

from __future__ import annotations

import copy
import json
import os
import queue
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import TINY, free_port, raytrain
from test_cli import assert_refused
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from raytrain_ddp.bench.spawn import leave_group
from raytrain_ddp.checkpoint import files, state_dicts
from raytrain_ddp.config import TrainConfig
from raytrain_ddp.driver.plan.model_shapes import estimate_state_mib, of
from raytrain_ddp.run_files import read_csv
from raytrain_ddp.worker import parallel as strategy
from raytrain_ddp.worker.epoch_metrics import evaluate
from raytrain_ddp.worker.step import apply_gradients, forward_backward, make_optimizer

NO_SCALER = torch.amp.GradScaler("cuda", enabled=False)  # CPU: the scaler passes everything through
CPU = torch.device("cpu")


class Net(nn.Module):
    """Three blocks through the `fsdp_blocks` hook a user's model may define; no batch norm, whose
    statistics would depend on the shard."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(20, 64), nn.ReLU()), nn.Sequential(nn.Linear(64, 64), nn.ReLU())])
        self.head = nn.Linear(64, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    def fsdp_blocks(self) -> list[nn.Module]:
        return list(self.blocks)


def batches(steps: int, size: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(size, 20, generator=g), torch.randint(4, (size,), generator=g)) for _ in range(steps)]


def config(**changes) -> TrainConfig:
    return TrainConfig(**{"model": "tests:Net", "lr": 0.05, "momentum": 0.9, "weight_decay": 1e-3, "scheduler": "none", **changes})


def train(model, optimizer, cfg: TrainConfig, data, micro: int) -> list[float]:
    """Optimizer steps as the loop takes them, each over one batch cut into `micro` micro-batches;
    the mean loss of each step."""
    losses = []
    for inputs, labels in data:
        optimizer.zero_grad(set_to_none=True)
        step_loss = 0.0
        for i, (x, y) in enumerate(zip(inputs.chunk(micro), labels.chunk(micro))):
            loss, _ = forward_backward(model, x, y, None, NO_SCALER, 0.0, weight=1 / micro, sync=i == micro - 1)
            step_loss += loss.item() / micro
        apply_gradients(model, optimizer, NO_SCALER, cfg.clip_grad_norm)
        losses.append(step_loss)
    return losses


def wrapped(cfg: TrainConfig, local_world_size: int = 1) -> nn.Module:
    """As strategy.wrap does it; DDP directly, as Ray's prepare_model (which needs a Ray Train worker) would."""
    if cfg.strategy == "ddp":
        return DistributedDataParallel(Net(), **strategy.ddp_options(cfg, cfg.grad_accum))
    return strategy.wrap(cfg, Net(), cfg.grad_accum, CPU, local_world_size)


def run_ranks(target, *args, timeout: float = 120):
    """Run target(rank, *args) on 2 processes in one gloo group; return what rank 0 returned."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=rank_main, args=(r, port, results, target, args)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        results.get(timeout=600)  # the group is up: starting two Pythons with torch is slow on a loaded machine
        result = results.get(timeout=timeout)
    except queue.Empty:
        result = TimeoutError(f"rank 0 gave no result in {timeout} s (a hang?)")
    for p in procs:
        p.join(timeout=120)  # slow on a loaded machine
        if p.is_alive():
            p.kill()
    if isinstance(result, BaseException):
        raise result
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    return result


def rank_main(rank: int, port: int, results, target, args) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    dist.barrier()
    if rank == 0:
        results.put("ready")
    try:
        result = target(rank, *args)
    except Exception as err:  # rank 0's error is the test's; the other rank's shows in its exit code
        if rank == 0:
            results.put(RuntimeError(f"{type(err).__name__}: {err}"))
        raise
    if rank == 0:
        results.put(result)
    leave_group(results)  # without the interpreter's teardown, where gloo's work left to a model can abort it


def numpy_state(state: dict[str, torch.Tensor]) -> dict:
    # numpy, pickled by value: a tensor would be shared through a socket of this process, gone once it exits
    return {k: v.detach().numpy().copy() for k, v in state.items()}


def train_each_way(rank: int, configs: dict[str, TrainConfig]) -> dict[str, tuple[list[float], dict, float]]:
    """Each config in turn on this group: (the world's mean loss per step, the whole weights, the
    largest rank's model_state_mib) after 4 steps. One group for all: a spawn costs seconds."""
    results = {}
    for name, cfg in configs.items():
        model = wrapped(cfg)
        optimizer = make_optimizer(cfg, model)
        shard = [(x.chunk(2)[rank], y.chunk(2)[rank]) for x, y in batches(4, 32)]
        total = torch.tensor(train(model, optimizer, cfg, shard, micro=1))
        dist.all_reduce(total)
        mib = torch.tensor(strategy.state_mib(model, optimizer))
        dist.all_reduce(mib, op=dist.ReduceOp.MAX)
        results[name] = (total / 2).tolist(), numpy_state(state_dicts.whole_state(model)), mib.item()
    return results


ADAMW = {"optimizer": "adamw", "lr": 0.01}


def one_after_another(rank: int, calls: list[tuple]) -> list:
    """Each (target, args) in turn on this one group, their results in order."""
    return [target(rank, *args) for target, args in calls]


def sharded_after_forward(rank: int, cfg: TrainConfig) -> dict[str, bool]:
    """Which of the model's parameters are sharded (DTensors) between a forward and its backward."""
    from torch.distributed.tensor import DTensor

    model = wrapped(cfg)
    loss = model(batches(1, 8)[0][0]).sum()
    sharded = {name: isinstance(p, DTensor) for name, p in model.named_parameters()}
    loss.backward()
    return sharded


@pytest.fixture(scope="module")
def shared_group() -> list:
    """The checks that need no group of their own, on one: starting two processes with torch costs seconds."""
    configs = {"ddp": config(**ADAMW)} | {s: config(**ADAMW, strategy="fsdp", sharding=s) for s in ("full", "grad-op", "hybrid")}
    return run_ranks(one_after_another, [(train_each_way, (configs,)), (overflow_on_rank_1, (config(strategy="fsdp"),)),
                                         (sharded_after_forward, (config(strategy="fsdp"),))])


@pytest.fixture(scope="module")
def each_way(shared_group) -> dict[str, tuple[list[float], dict, float]]:
    """DDP and the three FSDP shardings, the same seed, data and AdamW steps. hybrid here is 2
    replicas of 1 shard (local_world_size 1): its all-reduce across replicas is what is tested."""
    return shared_group[0]


def test_after_forward_the_blocks_are_resharded_and_the_root_stays_whole_for_backward(shared_group):
    """Full sharding: each block frees its gathered parameters after its forward. The root's own
    (the head) are needed first in backward: resharded, they would be all-gathered twice a step."""
    sharded = shared_group[2]
    assert sharded == {"blocks.0.0.weight": True, "blocks.0.0.bias": True, "blocks.1.0.weight": True,
                       "blocks.1.0.bias": True, "head.weight": False, "head.bias": False}, sharded


@pytest.mark.parametrize("sharding", ["full", "grad-op", "hybrid"])
def test_fsdp_trains_as_ddp_does(each_way, sharding):
    """FSDP's losses and weights are DDP's, to float rounding."""
    ddp_losses, ddp_weights, _ = each_way["ddp"]
    fsdp_losses, fsdp_weights, _ = each_way[sharding]
    assert ddp_losses[-1] < ddp_losses[0]  # it trained
    assert fsdp_losses == pytest.approx(ddp_losses, rel=1e-5)
    for key, value in ddp_weights.items():
        torch.testing.assert_close(torch.from_numpy(fsdp_weights[key]), torch.from_numpy(value), rtol=1e-5, atol=1e-6)


def test_fsdp_holds_at_most_0_6x_of_ddps_state_per_rank(each_way):
    """AdamW: parameters, gradients and 2 moments. DDP holds all 4 copies per rank, FSDP half of them
    at 2 ranks (hybrid, with 1 shard per replica, holds them all)."""
    params = sum(p.numel() for p in Net().parameters()) * 4 / 2**20
    assert each_way["ddp"][2] == pytest.approx(4 * params, rel=1e-6)
    assert each_way["full"][2] <= 0.6 * each_way["ddp"][2]
    assert each_way["grad-op"][2] <= 0.6 * each_way["ddp"][2]


@pytest.mark.parametrize("name", ["ddp", "full", "grad-op", "hybrid"])
def test_the_preflight_estimate_is_what_the_ranks_measured(each_way, name):
    """estimate_state_mib from the shapes alone = state_mib on the largest of the 2 real ranks."""
    cfg = config(**ADAMW) if name == "ddp" else config(**ADAMW, strategy="fsdp", sharding=name)
    with torch.device("meta"):
        model = Net()
    assert estimate_state_mib(of(model), cfg, world_size=2, ranks_per_node=1) == pytest.approx(each_way[name][2], rel=1e-9)


def test_the_estimate_of_torchvision_resnet50():
    """25,557,032 parameters (torchvision's count for ImageNet's 1000 classes), 4 bytes each; SGD
    with momentum keeps one buffer, AdamW two; FSDP's 8 shards are an eighth, give or take the
    rows of a chunk rounded up."""
    from raytrain_ddp.worker.models import MODELS

    with torch.device("meta"):
        model = MODELS["resnet50"](num_classes=1000, in_channels=3)
    params_mib = 25_557_032 * 4 / 2**20
    sgd, adamw, plain = config(model="resnet50"), config(model="resnet50", optimizer="adamw"), config(model="resnet50", momentum=0.0)
    assert estimate_state_mib(of(model), sgd, world_size=8) == pytest.approx(3 * params_mib)
    assert estimate_state_mib(of(model), adamw, world_size=8) == pytest.approx(4 * params_mib)
    assert estimate_state_mib(of(model), plain, world_size=8) == pytest.approx(2 * params_mib)
    sharded = estimate_state_mib(of(model), config(model="resnet50", strategy="fsdp"), world_size=8)
    assert 3 * params_mib / 8 <= sharded < 1.01 * 3 * params_mib / 8
    hybrid = config(model="resnet50", strategy="fsdp", sharding="hybrid")
    assert estimate_state_mib(of(model), hybrid, world_size=8, ranks_per_node=4) == pytest.approx(2 * sharded, rel=0.01)


def huge(num_classes: int, in_channels: int) -> nn.Module:
    """1.34B parameters (5 x 16384^2): with AdamW 20 GiB of state, more than a T4's 16 GiB."""
    return nn.Sequential(*[nn.Linear(16384, 16384, bias=False) for _ in range(5)])


T4_NODES = [{"CPU": 16.0, "GPU": 4.0, "accelerator_type:T4": 1.0}] * 2
"""Two nodes of 4 T4s (16 GiB each), as Ray lists their resources."""


def test_preflight_refuses_ddp_that_cannot_fit_a_gpu_and_names_fsdp(capsys):
    from raytrain_ddp.driver.plan.preflight import model_state as state_preflight
    from raytrain_ddp.config import ConfigError
    from raytrain_ddp.worker.models import build_on_meta

    # an address, so a GPU on the machine running the test is not taken for the cluster's
    big = {"model": "mine:huge", "optimizer": "adamw", "gpu": True, "workers": 8, "address": "10.0.0.1:6379"}
    model = of(build_on_meta(TrainConfig(**big), huge, 3))
    with pytest.raises(ConfigError, match=r"ddp needs about 20\.0 GiB per GPU for the model state alone, more than the "
                                          r"16\.0 GiB of the cluster's T4 GPUs; pass --strategy fsdp \(about 2\.5 GiB per rank at 8 ranks\)$"):
        state_preflight(TrainConfig(**big), model, T4_NODES)
    state_preflight(TrainConfig(**big, strategy="fsdp"), model, T4_NODES)  # an eighth each: it fits
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "model state: 1342.2M parameters; with their gradients and adamw state about 2.5 GiB per rank under "
        "--strategy fsdp --sharding full at 8 ranks (ddp: 20.0 GiB), before activations")
    with pytest.raises(ConfigError, match=r"fsdp --sharding full needs about 20\.0 GiB .*; add --workers"):
        state_preflight(TrainConfig(**{**big, "workers": 1}, strategy="fsdp"), model, T4_NODES)  # one rank holds it all
    state_preflight(TrainConfig(**{**big, "optimizer": "sgd", "momentum": 0.0}), model, T4_NODES)  # 10 of 16 GiB
    assert "warning: the model state, about 10.0 GiB per GPU, leaves less than half" in capsys.readouterr().err
    state_preflight(TrainConfig(**big), model, [{"CPU": 16.0, "GPU": 4.0}])  # a GPU of unknown size: the line only
    assert "about 20.0 GiB per rank under --strategy ddp at 8 ranks" in capsys.readouterr().err


def test_dry_run_prints_the_estimate(capsys, tmp_path):
    from raytrain_ddp.driver.run.command import dry_run

    dry_run(TrainConfig(strategy="fsdp", optimizer="adamw", workers=2, storage_path=str(tmp_path)))
    assert "adamw state about 0.7 MiB per rank under --strategy fsdp --sharding full at 2 ranks (ddp: 1.4 MiB)" \
        in capsys.readouterr().err


def test_the_estimate_of_a_ddp_only_run_names_fsdp_without_refusing_it(capsys, tmp_path):
    """--find-unused-parameters is refused under FSDP; the estimate's FSDP figure must not refuse the
    DDP run that asked for it (test_plugins' flat-vector run failed on it, exit 2)."""
    from raytrain_ddp.driver.run.command import dry_run

    dry_run(TrainConfig(find_unused_parameters=True, workers=2, storage_path=str(tmp_path)))
    assert "under --strategy ddp at 2 ranks (fsdp: " in capsys.readouterr().err


def accumulate_and_clip(rank: int, cfg: TrainConfig) -> dict:
    model = wrapped(cfg)
    optimizer = make_optimizer(cfg, model)
    shard = [(x.chunk(2)[rank] * 30, y.chunk(2)[rank]) for x, y in batches(3, 64)]  # large gradients, so clipping acts
    train(model, optimizer, cfg, shard, micro=4)
    return numpy_state(state_dicts.whole_state(model))


def test_accumulation_with_clipping_under_fsdp_matches_one_big_clipped_batch():
    """2 ranks x 4 micro-batches of 8, clipped by the global norm over the shards = one clipped step
    over 64 samples in one process."""
    cfg = config(clip_grad_norm=0.5, strategy="fsdp", grad_accum=4)
    big = [(x * 30, y) for x, y in batches(3, 64)]
    probe = Net()
    forward_backward(probe, *big[0], None, NO_SCALER, 0.0, weight=1.0, sync=True)
    raw = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in probe.parameters()]))
    assert raw > 5 * cfg.clip_grad_norm  # the clip really cuts (so a norm of one rank's shard would be off)
    reference = Net()
    train(reference, make_optimizer(cfg, reference), cfg, big, micro=1)
    accumulated = run_ranks(accumulate_and_clip, cfg)
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(torch.from_numpy(accumulated[key]), value, rtol=1e-4, atol=1e-5)


def evaluate_uneven(rank: int, cfg: TrainConfig) -> tuple[float, float, float]:
    model = wrapped(cfg)
    data = batches(3, 8, seed=2)
    mine = data if rank == 0 else []  # rank 1 has no validation batch at all
    return evaluate(model, mine, CPU, None)


def test_evaluation_under_fsdp_finishes_on_uneven_shards():
    """Rank 0 has 3 batches, rank 1 none: a per-batch all-gather would hang; every sample counts once."""
    loss, accuracy, count = run_ranks(evaluate_uneven, config(strategy="fsdp"), timeout=60)
    expected = evaluate(Net(), batches(3, 8, seed=2), CPU, None)
    assert count == 24
    assert (loss, accuracy) == pytest.approx(expected[:2], rel=1e-5)


def overflow_on_rank_1(rank: int, cfg: TrainConfig) -> list[list[float]]:
    """One fp16-style step with a loss scaler, after an inf lands in rank 1's gradient shard only:
    [stepped, scale after] of each rank."""
    model = wrapped(cfg)
    optimizer = make_optimizer(cfg, model)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)  # the loop's GradScaler("cuda"), on CPU
    x, y = batches(1, 32)[0]
    forward_backward(model, x.chunk(2)[rank], y.chunk(2)[rank], None, scaler, 0.0, weight=1.0, sync=True)
    first = next(model.parameters())
    if rank == 1:
        first.grad.to_local().view(-1)[0] = float("inf")
    before = first.to_local().clone()
    apply_gradients(model, optimizer, scaler, cfg.clip_grad_norm)
    mine = torch.tensor([float(not torch.equal(before, first.to_local())), scaler.get_scale()])
    both = [torch.zeros(2), torch.zeros(2)]
    dist.all_gather(both, mine)
    return [t.tolist() for t in both]


def test_a_loss_scaler_under_fsdp_skips_the_step_on_every_rank(shared_group):
    """fp16 under FSDP (GPUs without bf16) uses the loop's plain GradScaler: an overflow in one rank's
    shard must skip the step on all ranks (and halve the scale on all), or their shards would drift apart."""
    assert shared_group[1] == [[0.0, 512.0], [0.0, 512.0]]


def save_sharded(rank: int, cfg: TrainConfig, directory: str) -> dict:
    """An FSDP step, then DCP files from both ranks in one directory (as Ray's merge leaves them)."""
    import torch.distributed.checkpoint as dcp

    model = wrapped(cfg)
    optimizer = make_optimizer(cfg, model)
    train(model, optimizer, cfg, [(x.chunk(2)[rank], y.chunk(2)[rank]) for x, y in batches(1, 32)], micro=1)
    dcp.save(state_dicts.sharded_state(model, optimizer), checkpoint_id=directory)
    # the next step, as the run would have taken it: the resumed one must match
    train(model, optimizer, cfg, [(x.chunk(2)[rank], y.chunk(2)[rank]) for x, y in batches(2, 32)[1:]], micro=1)
    return numpy_state(state_dicts.whole_state(model))


def test_a_sharded_checkpoint_resumes_on_one_rank_without_fsdp(tmp_path):
    """FSDP at 2 ranks -> a plain model at 1: DCP reshards the model and AdamW's moments on load."""
    cfg = config(optimizer="adamw", lr=0.01, strategy="fsdp")
    expected = run_ranks(save_sharded, cfg, str(tmp_path))
    assert sorted(f.name for f in tmp_path.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    model = Net()
    optimizer = make_optimizer(cfg, model)
    state_dicts.load_sharded(model, optimizer, tmp_path)
    train(model, optimizer, cfg, batches(2, 32)[1:], micro=1)  # the whole batch on the one rank
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, torch.from_numpy(expected[key]), rtol=1e-5, atol=1e-6)


def ddp_then_fsdp(rank: int) -> tuple[dict, dict]:
    """A DDP step, its whole state as state.pt holds it, loaded into FSDP; one more step under each."""
    ddp_cfg = config(optimizer="adamw", lr=0.01)
    ddp = wrapped(ddp_cfg)
    ddp_optimizer = make_optimizer(ddp_cfg, ddp)
    data = [(x.chunk(2)[rank], y.chunk(2)[rank]) for x, y in batches(2, 32)]
    train(ddp, ddp_optimizer, ddp_cfg, data[:1], micro=1)
    model_state, optimizer_state = copy.deepcopy(state_dicts.full_state(ddp, ddp_optimizer))
    fsdp_cfg = config(optimizer="adamw", lr=0.01, strategy="fsdp")
    fsdp = wrapped(fsdp_cfg)
    fsdp_optimizer = make_optimizer(fsdp_cfg, fsdp)
    state_dicts.load_full(fsdp, fsdp_optimizer, model_state, optimizer_state)
    train(ddp, ddp_optimizer, ddp_cfg, data[1:], micro=1)
    train(fsdp, fsdp_optimizer, fsdp_cfg, data[1:], micro=1)
    return numpy_state(state_dicts.whole_state(ddp)), numpy_state(state_dicts.whole_state(fsdp))


def test_a_ddp_state_loads_into_fsdp_with_its_optimizer_moments():
    ddp, fsdp = run_ranks(ddp_then_fsdp)
    for key, value in ddp.items():
        torch.testing.assert_close(torch.from_numpy(fsdp[key]), torch.from_numpy(value), rtol=1e-5, atol=1e-6)


def test_default_blocks_are_the_big_modules_inner_first():
    big = nn.Sequential(nn.Sequential(nn.Linear(1000, 1000), nn.Linear(1000, 1000)), nn.Linear(1000, 10))
    blocks = strategy.default_blocks(big)
    assert blocks == [big[0][0], big[0][1]]  # 1M each; the rest (10k) stays with the root
    assert strategy.fsdp_blocks("tests:Net", Net())[0] is not None  # the hook wins over the default


# --- end to end: the real CLI on the shared Ray head ---

def run_args(tmp_path: Path, name: str, *more: str) -> list[str]:
    return ["run", *TINY, "--storage-path", str(tmp_path), "--name", name, *more]


def latest(run_dir: Path) -> Path:
    from raytrain_ddp.checkpoint.files import latest_checkpoint

    return latest_checkpoint(run_dir)


@pytest.mark.e2e
def test_a_run_crosses_ddp_fsdp_and_world_sizes_resuming_each_time_and_exports_the_shards(ray_head, tmp_path):
    """One run, four legs (one run and not several tests: CI time): DDP at 2 workers; a rerun with a
    changed --seed, refused; FSDP at 2, from the DDP checkpoint, saving shards, with a new --lr and
    --epochs applied; FSDP at 1, from those shards; the shards exported as a plain state dict; and
    DDP again, from the shards."""
    def leg(epochs: int, *more: str):
        proc = raytrain(*run_args(tmp_path, "crossed", "--epochs", str(epochs), *more), env=ray_head.env)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc

    leg(1, "--workers", "2")
    checkpoints = sorted(p.name for p in (tmp_path / "crossed").glob("checkpoint_*"))
    # Refused in seconds, in one line, before any worker starts (preflight's `layout:` line never came).
    started = time.monotonic()
    refused = raytrain(*run_args(tmp_path, "crossed", "--epochs", "1", "--seed", "1"), env=ray_head.env)
    assert_refused(refused, "cannot resume run 'crossed' with --seed 0 -> 1", "--no-resume",
                   within_s=30, started=started)
    assert sorted(p.name for p in (tmp_path / "crossed").glob("checkpoint_*")) == checkpoints

    fsdp = leg(2, "--strategy", "fsdp", "--workers", "2", "--lr", "0.1")
    assert "resume: --strategy ddp -> fsdp applied" in fsdp.stdout + fsdp.stderr
    assert "resume: --epochs 1 -> 2: the LR schedule stretches from epoch 2 over the remaining epochs" in fsdp.stderr
    assert "resume: --lr 0.05 -> 0.1 applied" in fsdp.stderr
    assert json.loads((tmp_path / "crossed" / "summary.json").read_text())["config"]["lr"] == 0.1
    saved = latest(tmp_path / "crossed")
    assert sorted(f.name for f in (saved / files.SHARDS).iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert "model" not in torch.load(saved / files.STATE, weights_only=True)  # no rank held it whole
    assert '"strategy": "fsdp"' in (saved / files.RESUME_INFO).read_text()

    one = leg(3, "--strategy", "fsdp", "--workers", "1", "--lr", "0.1")
    assert "resumed from the checkpoint at epoch 3" in one.stdout
    exported = raytrain("export", str(tmp_path / "crossed"), "--to", str(tmp_path / "model.pt"))
    assert exported.returncode == 0, exported.stderr
    from raytrain_ddp.worker.models import convnet

    convnet(num_classes=10, in_channels=3).load_state_dict(torch.load(tmp_path / "model.pt", weights_only=True))

    back = leg(4, "--workers", "2", "--lr", "0.1")
    assert "resumed from the checkpoint at epoch 4" in back.stdout
    rows = read_csv(tmp_path / "crossed" / "metrics.csv")
    assert [(r["epoch"], r["world_size"]) for r in rows] == [("1", "2"), ("2", "2"), ("3", "1"), ("4", "2")]
    assert float(rows[3]["train_loss"]) < float(rows[0]["train_loss"])  # each leg went on from the trained weights
    # the largest rank's share of the state: about half at 2 FSDP ranks of what 1 rank holds
    assert float(rows[1]["model_state_mib"]) < 0.6 * float(rows[2]["model_state_mib"])
