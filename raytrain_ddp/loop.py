"""The worker loop: the one function TorchTrainer runs on every rank.

Read it top to bottom: [1] set up the rank, [2] data, [3] model and optimizer, [4] resume from the
latest checkpoint, [5] epochs of train + validate + checkpoint. One optimizer step is `accum`
micro-batches (forward_backward each, then apply_gradients). Metrics are all-reduced, so every
number describes the whole world, not rank 0's shard.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import resource
import socket
import time
from typing import Any, NamedTuple

import ray
import ray.train
import ray.train.torch
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from raytrain_ddp import checkpoint
from raytrain_ddp.config import ConfigError, TrainConfig
from raytrain_ddp.data.loaders import make_loaders
from raytrain_ddp.data.registry import dataset_builder
from raytrain_ddp.data.torch_ingest import trained_position
from raytrain_ddp.models import MODELS, model_builder

PROGRESS_EVERY_S = 1.0
"""How often rank 0 sends a step update to the driver's progress display."""
CONTROL_EVERY = 20
"""Every this many steps the ranks agree, in one tiny all-reduce, whether to stop (preemption or a
non-finite loss). A fixed step count, so every rank checks at the same step."""


def train_loop(loop_config: dict[str, Any]) -> None:
    cfg = TrainConfig.from_dict(loop_config["config"])
    sink = loop_config["sink"]  # the driver's MetricsSink actor
    given = loop_config.get("given", {})  # the Python API's model and dataset callables, if any

    # [1] The rank: threads, seed, device, and who runs where.
    ctx = ray.train.get_context()
    rank, world_size = ctx.get_world_rank(), ctx.get_world_size()
    torch.set_num_threads(cfg.cpus_per_worker)
    torch.manual_seed(cfg.seed)  # the same initial weights on every rank
    device = ray.train.torch.get_device()
    cuda = device.type == "cuda"
    if cuda:
        torch.backends.cudnn.benchmark = True  # fixed input shapes: let cuDNN pick its fastest kernels
    where = {"hostname": socket.gethostname(), "ip": ray.util.get_node_ip_address(), "pid": os.getpid()}
    ranks = [where] * world_size
    if world_size > 1:
        dist.all_gather_object(ranks, where)

    # [2] Data: each rank gets a disjoint shard (see data.make_loaders).
    loaders = make_loaders(cfg, rank, world_size, cuda, dataset_builder(cfg.dataset, given.get("dataset")))

    # [3] Model, optimizer, schedule, mixed precision.
    model = model_builder(cfg.model, given.get("model"))(num_classes=cfg.num_classes, in_channels=loaders.in_channels)
    if cuda:
        model = model.to(memory_format=torch.channels_last)  # moves only 4-D (conv) weights
    if cfg.compile:
        # In place, before DDP: the state dict keeps its keys, and Dynamo never traces DDP's own
        # forward (its buffer broadcast breaks the graph, and the step would silently run eager).
        model.compile()
    accum = cfg.accum_steps(world_size)  # --global-batch-size holds at every world size
    model = ray.train.torch.prepare_model(model, parallel_strategy_kwargs=ddp_options(cfg, accum))
    optimizer = make_optimizer(cfg, model)
    scheduler = make_scheduler(cfg, optimizer, steps_per_epoch=math.ceil(loaders.steps_per_epoch / accum))
    amp_dtype = None
    if cuda and cfg.amp:
        amp_dtype = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    # Only fp16 needs loss scaling; bf16 has fp32's exponent range.
    scaler = torch.amp.GradScaler("cuda", enabled=amp_dtype == torch.float16)
    torch.manual_seed(cfg.seed + rank)  # from here on each rank draws its own augmentation

    # [4] Resume from the latest checkpoint: a restarted worker group (of any size), or a rerun of
    # the same --name. Positions are global, so the samples already trained are never trained again.
    resume = restore(cfg, rank, world_size, device, model, optimizer, scheduler, scaler)
    rows, resizes = resume.rows, resume.resizes

    def save(epoch: int, position: int, sums: torch.Tensor, train_time: float, metrics: dict) -> None:
        """Every rank, at the same step: the world's state at global `position` of `epoch`."""
        world_sums = sums.clone()
        if dist.is_initialized():
            dist.all_reduce(world_sums)  # any world size can resume the epoch's running totals
        shared = {}
        if rank == 0:
            shared = {
                "model": checkpoint.model_state(model),
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
                "scaler": scaler.state_dict(),
                "epoch": epoch,  # the epoch to continue with ...
                "position": position,  # ... after this many of its samples, in its global order
                "sums": world_sums.cpu(),
                "train_time": train_time,
                "world_size": world_size,
                "resizes": resizes,
                "rows": rows,
            }
        checkpoint.save(metrics, rank, shared)

    if rank == 0:
        sink.start.remote(
            world_size=world_size,
            backend=dist.get_backend() if dist.is_initialized() else "none",
            ranks=ranks,
            steps_per_epoch=loaders.steps_per_epoch,
            # epoch, global position, and the same position as this world's step count
            resumed_at=[resume.epoch, resume.position, resume.position // (world_size * cfg.batch_size)]
            if resume.resumed
            else None,
            resizes=resizes,
        )
        for row in rows:
            sink.epoch.remote(row)

    # [5] Epochs.
    drain_saved = False  # a node drain announced by Ray was answered with a checkpoint
    for epoch in range(resume.epoch, cfg.epochs + 1):
        start = resume.position if epoch == resume.epoch else 0
        # This epoch's order, the same on every rank, minus the samples already trained.
        micro_steps = loaders.set_epoch(epoch, start)
        done = start // (world_size * cfg.batch_size)  # batches per rank before this pass, for the display
        model.train()
        # (loss x n, correct, n) accumulate on the device: no host sync per step. A resumed epoch
        # starts from the world's totals so far, on rank 0.
        resumed_sums = resume.sums if start else torch.zeros(3, dtype=torch.float64, device=device)
        sums = resumed_sums.clone()
        train_time, data_wait = (resume.train_time if start else 0.0), 0.0
        bad_step = torch.zeros((), dtype=torch.float64, device=device)
        tick = step_end = pass_start = time.perf_counter()
        last_update = 0.0  # the first step of each epoch is shown at once (and timestamped)
        # `step` counts this pass's micro-batches; checkpoints and stops fall only where an optimizer
        # step ends, so a resume never meets half-accumulated gradients.
        for step, (inputs, labels) in enumerate(loaders.train, start=1):
            data_wait += time.perf_counter() - step_end
            inputs = inputs.to(device, non_blocking=True)
            labels = labels.to(device, non_blocking=True)
            if cuda and inputs.dim() == 4:  # images; flat vectors and sequences stay as they are
                inputs = inputs.contiguous(memory_format=torch.channels_last)
            group_start = step - (step - 1) % accum  # the first micro-batch of this optimizer step
            group_size = min(accum, micro_steps - group_start + 1)  # the epoch's last group may be short
            last = step == group_start + group_size - 1
            if step == group_start:
                optimizer.zero_grad(set_to_none=True)
            loss, logits = forward_backward(
                model, inputs, labels, amp_dtype, scaler, cfg.label_smoothing, weight=1 / group_size, sync=last
            )
            if last:
                apply_gradients(model, optimizer, scaler, scheduler, cfg.clip_grad_norm)
            n = torch.tensor(len(labels), device=device)
            sums += torch.stack([loss * n, (logits.argmax(1) == labels).sum(), n]).double()
            first_bad = (bad_step == 0) & ~torch.isfinite(loss)
            bad_step = torch.where(first_bad, torch.tensor(float(done + step), device=device), bad_step)

            if rank == 0 and time.perf_counter() - last_update >= PROGRESS_EVERY_S:
                last_update = time.perf_counter()
                rate = (sums[2].item() - resumed_sums[2].item()) * world_size
                sink.step.remote(
                    epoch=epoch, step=done + step, loss=loss.item(), at=time.time(),
                    samples_per_s=rate / max(last_update - pass_start, 1e-9),
                )
            opt_step = math.ceil(step / accum)
            due = last and cfg.checkpoint_every_steps > 0 and opt_step % cfg.checkpoint_every_steps == 0
            if last and (opt_step % CONTROL_EVERY == 0 or due):
                stop, draining = agree_to_stop(rank, sink, bad_step, epoch)
                drain_news = draining and not drain_saved  # checkpoint once per drain, then train on
                drain_saved = drain_saved or draining
                if due or stop or drain_news:
                    train_time += time.perf_counter() - tick
                    position = trained_position(start, world_size, cfg.batch_size, step, loaders.train_size)
                    save(epoch, position, sums, train_time, {"epoch": epoch, "position": position})
                    tick = time.perf_counter()
                    if drain_news and rank == 0:
                        sink.drain_saved.remote(epoch=epoch, position=position)
                if stop:
                    if rank == 0:
                        sink.stopped.remote(epoch=epoch, step=done + step)
                    return
            step_end = time.perf_counter()
        train_time += time.perf_counter() - tick
        stop, _ = agree_to_stop(rank, sink, bad_step, epoch)
        train = all_reduce_means(sums)
        val = evaluate(model, loaders.val, device, amp_dtype)
        resources = epoch_resources(cuda, data_wait, train_time, loaders.skipped(), world_size, device)
        lr = optimizer.param_groups[0]["lr"]
        rows.append(epoch_row(epoch, train, val, lr, train_time, world_size, len(resizes), resources))
        rows[-1]["global_batch"] = cfg.batch_size * world_size * accum  # for the epoch line; not a CSV column
        if rank == 0:
            sink.epoch.remote(rows[-1])
        save(epoch + 1, 0, torch.zeros_like(sums), 0.0, rows[-1])
        if stop and epoch < cfg.epochs:
            if rank == 0:
                sink.stopped.remote(epoch=epoch + 1, step=0)
            return


class Resume(NamedTuple):
    """Where training continues: the epoch and global position in it, the rows and resizes so far,
    and the world's running totals (on rank 0) and train time for that epoch."""

    epoch: int
    position: int
    rows: list[dict[str, Any]]
    resizes: list[dict[str, Any]]
    sums: torch.Tensor
    train_time: float
    resumed: bool


def restore(cfg: TrainConfig, rank: int, world_size: int, device: torch.device, model, optimizer, scheduler, scaler) -> Resume:
    """Load the latest checkpoint, if any, into the model, optimizer, schedule and scaler."""
    zeros = torch.zeros(3, dtype=torch.float64, device=device)
    restored = checkpoint.load(rank)
    if restored is None:
        return Resume(1, 0, [], [], zeros, 0.0, resumed=False)
    state, own = restored
    try:
        getattr(model, "module", model).load_state_dict(state["model"])
    except RuntimeError:
        raise ConfigError(
            f"the checkpoint of run {cfg.name!r} does not fit --model {cfg.model} "
            f"--num-classes {cfg.num_classes}; pass --no-resume or a new --name"
        ) from None
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    scaler.load_state_dict(state["scaler"])
    if own is not None:  # a rank that did not exist before (the world grew) starts from its fresh seed
        checkpoint.set_rng_states(own["rng"])
    resizes = list(state["resizes"])
    if state["world_size"] != world_size:
        resizes.append({
            "epoch": state["epoch"], "position": state["position"], "from": state["world_size"], "to": world_size,
            "at": time.time(),
        })
    sums = state["sums"].to(device) if rank == 0 else zeros  # the world's totals, counted once
    return Resume(state["epoch"], state["position"], state["rows"], resizes, sums, state["train_time"], resumed=True)


def epoch_row(
    epoch: int, train: tuple[float, float, float], val: tuple[float, float, float], lr: float, train_time: float,
    world_size: int, resizes: int, resources: tuple,
) -> dict[str, Any]:
    """One row of metrics.csv: all-reduced (loss, accuracy, count) of train and val, and the epoch's costs."""
    (train_loss, train_acc, train_n), (val_loss, val_acc, _) = train, val
    rss_mib, gpu_mib, wait_frac, skipped = resources
    return {
        "epoch": epoch,
        "train_loss": train_loss,
        "train_acc": train_acc,
        "val_loss": val_loss,
        "val_acc": val_acc,
        "lr": lr,  # at the epoch's end
        "epoch_time_s": train_time,
        "throughput": train_n / train_time,
        "samples": int(train_n),
        "world_size": world_size,  # at the epoch's end
        "backend": dist.get_backend() if dist.is_initialized() else "none",
        "gpu_mem_peak_mib": gpu_mib,
        "cpu_rss_mib": rss_mib,
        "data_wait_frac": wait_frac,
        "skipped_samples": skipped,
        "resizes": resizes,  # world-size changes in the run so far
    }


def forward_backward(
    model: torch.nn.Module, inputs: torch.Tensor, labels: torch.Tensor, amp_dtype: torch.dtype | None,
    scaler: torch.amp.GradScaler, label_smoothing: float, weight: float, sync: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One micro-batch: forward, then backward of its loss x `weight` (1 / micro-batches in this
    optimizer step, so the summed gradient is the big batch's mean). Returns (loss, logits), detached."""
    # in DDP, gradients are all-reduced only on the last micro-batch; the others add to .grad locally
    quiet = model.no_sync() if not sync and isinstance(model, DistributedDataParallel) else contextlib.nullcontext()
    with quiet:
        with torch.autocast(inputs.device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
            logits = model(inputs)
            loss = F.cross_entropy(logits, labels, label_smoothing=label_smoothing)
        scaler.scale(loss * weight).backward()
    return loss.detach(), logits.detach()


def apply_gradients(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler, scheduler: Any,
    clip_grad_norm: float,
) -> None:
    """The optimizer step that ends an accumulation: clip, step, and advance the LR schedule."""
    if clip_grad_norm > 0:
        scaler.unscale_(optimizer)  # fp16: clip the true gradients, not the loss-scaled ones
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip_grad_norm)
    scaler.step(optimizer)  # skipped by the scaler when fp16 gradients overflowed
    scaler.update()
    scheduler.step()


def ddp_options(cfg: TrainConfig, accum: int) -> dict[str, Any]:
    """Gradients live in DDP's all-reduce buckets (no copy). Our own models use every parameter on
    every step, so their graph is static and DDP may skip its per-step search for unused ones; a
    user's model may skip a layer on some steps, so it gets DDP's safe defaults, or the search."""
    options: dict[str, Any] = {"gradient_as_bucket_view": True}
    if cfg.find_unused_parameters:
        options["find_unused_parameters"] = True
    elif cfg.model in MODELS and accum == 1:
        # static_graph with no_sync() fails its first backward, or silently stops all-reducing
        # gradients (pytorch/pytorch#187732): accumulation gets the default reducer.
        options["static_graph"] = True
    return options


def agree_to_stop(rank: int, sink: Any, bad_step: torch.Tensor, epoch: int) -> tuple[bool, bool]:
    """All ranks learn, at the same step, whether the driver asked to stop, and whether Ray says a
    node of theirs is being drained (checkpoint now, train on); a NaN loss raises."""
    # A barrier over the ranks, like the all-reduce below: every rank calls it at the same step.
    preempted = ray.train.get_preemption_info() is not None
    asked = rank == 0 and ray.get(sink.stop_requested.remote())
    flags = torch.stack([torch.tensor(float(asked), device=bad_step.device), bad_step.double()])
    if dist.is_initialized():
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    if flags[1] > 0:
        raise FloatingPointError(
            f"loss became NaN or inf at epoch {epoch} step {int(flags[1])}; nothing was saved after "
            "it, the last good checkpoint is kept: lower --lr, or try --no-amp"
        )
    return bool(flags[0]), preempted


def epoch_resources(cuda: bool, data_wait: float, train_time: float, skipped: int, world_size: int, device) -> tuple:
    """(peak RSS MiB, peak GPU MiB or None) as the max over ranks, the mean data-wait share, and
    the unreadable samples skipped (--skip-bad) summed over ranks."""
    rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
    gpu_mib = torch.cuda.max_memory_allocated(device) / 2**20 if cuda else 0.0
    peaks = torch.tensor([rss_mib, gpu_mib], dtype=torch.float64, device=device)
    sums = torch.tensor([data_wait / max(train_time, 1e-9), skipped], dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(peaks, op=dist.ReduceOp.MAX)
        dist.all_reduce(sums)
    gpu = round(peaks[1].item(), 1) if cuda else None
    return round(peaks[0].item(), 1), gpu, sums[0].item() / world_size, int(sums[1].item())


@torch.no_grad()
def evaluate(model, loader, device, amp_dtype) -> tuple[float, float, float]:
    model.eval()
    sums = torch.zeros(3, dtype=torch.float64, device=device)
    for inputs, labels in loader:
        inputs = inputs.to(device, non_blocking=True)
        labels = labels.to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
            logits = model(inputs)
        loss = F.cross_entropy(logits.float(), labels, reduction="sum")
        n = torch.tensor(len(labels), device=device)
        sums += torch.stack([loss, (logits.argmax(1) == labels).sum(), n]).double()
    return all_reduce_means(sums)


def all_reduce_means(sums: torch.Tensor) -> tuple[float, float, float]:
    """(loss sum, correct, count) summed over ranks -> (mean loss, accuracy, global count)."""
    if dist.is_initialized():
        dist.all_reduce(sums)
    loss_sum, correct, count = sums.tolist()
    return loss_sum / max(count, 1), correct / max(count, 1), count


def make_optimizer(cfg: TrainConfig, model: torch.nn.Module) -> torch.optim.Optimizer:
    groups = param_groups(model, cfg.weight_decay, cfg.decay_norm_bias)
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(groups, lr=cfg.lr)
    return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum)


def param_groups(model: torch.nn.Module, weight_decay: float, decay_norm_bias: bool) -> list[dict[str, Any]]:
    """Weight decay on weight matrices and conv kernels only: decaying biases and norm scales (the
    1-D parameters) pulls them to 0 and costs accuracy, so most recipes exempt them."""
    params = [p for p in model.parameters() if p.requires_grad]
    if decay_norm_bias:
        return [{"params": params, "weight_decay": weight_decay}]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]


def lr_factor(step: int, schedule: str, epochs: int, steps_per_epoch: int, warmup_epochs: float) -> float:
    """The share of --lr that optimizer step `step` (from 0) uses: linear warmup, then the schedule."""
    warmup = round(warmup_epochs * steps_per_epoch)
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "cosine":
        total = epochs * steps_per_epoch
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))
    if schedule == "step":
        milestones = {max(1, epochs // 2), max(1, epochs * 3 // 4)}
        return 0.1 ** sum(step // steps_per_epoch >= m for m in milestones)
    return 1.0


def make_scheduler(cfg: TrainConfig, optimizer: torch.optim.Optimizer, steps_per_epoch: int) -> Any:
    """The LR schedule, stepped once per optimizer step (apply_gradients)."""
    factor = functools.partial(
        lr_factor, schedule=cfg.scheduler, epochs=cfg.epochs, steps_per_epoch=steps_per_epoch,
        warmup_epochs=cfg.warmup_epochs,
    )
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
