"""The worker loop: the one function TorchTrainer runs on every rank.

Read it top to bottom: [1] set up the rank, [2] data, [3] model and optimizer, [4] resume from the
latest checkpoint, [5] epochs of train + validate + checkpoint. One optimizer step is `accum`
micro-batches (forward_backward each, then apply_gradients). Metrics are all-reduced, so every
number describes the whole world, not rank 0's shard.

Exactness: the LR is a function of the samples trained so far (Schedule), not of steps at some world
size; the data order and augmentation are functions of (seed, epoch, sample) (data.torch_ingest);
checkpoints hold every stream of state that is left. So a resumed run trains what the uninterrupted
run would have, bit for bit on CPU at the same world size.
"""

from __future__ import annotations

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

from raytrain_ddp import ray_compat
from raytrain_ddp.checkpoint import io as checkpoint
from raytrain_ddp.worker import parallel as strategy
from raytrain_ddp.config import ConfigError, TrainConfig
from raytrain_ddp.data.loaders import make_loaders
from raytrain_ddp.data.registry import dataset_builder
from raytrain_ddp.data.torch_ingest import trained_position
from raytrain_ddp.worker.models import model_builder
from raytrain_ddp.worker.profiling import Profiler

PROGRESS_EVERY_S = 1.0
"""How often rank 0 sends a step update to the driver's progress display."""
CONTROL_EVERY = 20
"""At most this many micro-batches between the ranks' agreements, in one tiny all-reduce, on whether
to stop (a signal, a node drain, a non-finite loss). Counted in micro-batches, which every rank
counts alike, so every rank agrees at the same one."""
CONTROL_EVERY_S = 5.0
"""... and at most about this many seconds: slow steps (a big model on CPU, --grad-accum 8) agree
more often, so a stop lands well inside Slurm's USR1@120 grace."""
FP16_BAD_LOSS_PATIENCE = 20
"""Under fp16 a non-finite loss on a few micro-batches in a row can pass (the GradScaler skips those
steps and backs off); this many in a row is a diverged run. fp32 and bf16 stop on the first."""


def train_loop(loop_config: dict[str, Any], entered: float | None = None) -> None:
    # Start-up stages (startup.py), stitched by the driver: wall-clock, since they cross processes.
    marks = {"workers": entered or time.time(), "imports": time.time()}
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
    marks["process group"] = time.time()  # every rank has arrived (and NCCL made its communicator)

    # [2] Data: each rank gets a disjoint shard (see data.make_loaders).
    loaders = make_loaders(cfg, rank, world_size, cuda, dataset_builder(cfg.dataset, given.get("dataset")))
    marks["data"] = time.time()

    # [3] Model, optimizer, schedule, mixed precision.
    model = model_builder(cfg.model, given.get("model"))(num_classes=cfg.num_classes, in_channels=loaders.in_channels)
    if cuda and cfg.strategy == "ddp":  # FSDP2's fully_shard refuses channels_last (non-contiguous) weights
        model = model.to(memory_format=torch.channels_last)  # moves only 4-D (conv) weights
    if cfg.compile:
        # In place, before DDP: the state dict keeps its keys, and Dynamo never traces DDP's own
        # forward (its buffer broadcast breaks the graph, and the step would silently run eager).
        model.compile()
    accum = cfg.accum_steps(world_size)  # --global-batch-size holds at every world size
    # DDP (a whole replica per rank) or FSDP (a shard per rank): see strategy.py
    model = strategy.wrap(cfg, model, accum, device, ctx.get_local_world_size())
    optimizer = make_optimizer(cfg, model)
    train_size = loaders.train_size
    amp_dtype = None
    if cuda and cfg.amp:
        # Emulated bf16 is slower than fp16 and no more accurate; fp16 needs loss scaling, bf16 has
        # fp32's exponent range and does not.
        amp_dtype = torch.bfloat16 if torch.cuda.is_bf16_supported(including_emulation=False) else torch.float16
    scaler = torch.amp.GradScaler("cuda", enabled=amp_dtype == torch.float16)
    bad_loss_patience = FP16_BAD_LOSS_PATIENCE if amp_dtype == torch.float16 else 1
    torch.manual_seed(cfg.seed + rank)  # each rank's own stream from here (dropout; augmentation seeds per sample)

    # [4] Resume from the latest checkpoint: a restarted worker group (of any size), or a rerun of
    # the same --name. Positions are global, so the samples already trained are never trained again.
    resume = restore(cfg, rank, world_size, device, model, optimizer, scaler, train_size)
    schedule, rows, resizes = resume.schedule, resume.rows, resume.resizes
    marks["model"] = time.time()

    def save(epoch: int, position: int, sums: torch.Tensor, train_time: float, metrics: dict) -> None:
        """Every rank, at the same step: the world's state at global `position` of `epoch`."""
        world_sums = sums.clone()
        if dist.is_initialized():
            dist.all_reduce(world_sums)  # any world size can resume the epoch's running totals
        shared, info = {}, None
        # DDP: rank 0 saves the whole model and optimizer state; FSDP: every rank its own shards
        whole = strategy.full_state(model, optimizer)
        shards = None if whole else strategy.sharded_state(model, optimizer)
        if rank == 0:
            shared = {
                **dict(zip(("model", "optimizer"), whole or ())),
                "schedule": schedule._asdict(),
                "scaler": scaler.state_dict(),
                "epoch": epoch,  # the epoch to continue with ...
                "position": position,  # ... after this many of its samples, in its global order
                "sums": world_sums.cpu(),
                "train_time": train_time,
                "world_size": world_size,
                "resizes": resizes,
                "rows": rows,
            }
            info = {
                "config": cfg.to_dict(), "epoch": epoch, "position": position, "train_size": train_size,
                "world_size": world_size, "in_channels": loaders.in_channels, "strategy": cfg.strategy,
                "model_shapes": checkpoint.shapes(whole[0] if whole else shards["model"]), "schedule": schedule._asdict(),
            }
        checkpoint.save(metrics, rank, shared, info, shards)

    if rank == 0:
        # The sink knows whether this driver started a worker group before: a restart is recorded
        # even when it found no checkpoint to resume from, and every later checkpoint carries it.
        told = ray.get(sink.start.remote(
            world_size=world_size,
            backend=dist.get_backend() if dist.is_initialized() else "none",
            ranks=ranks,
            steps_per_epoch=loaders.steps_per_epoch,
            # epoch, global position, and the same position as this world's step count
            resumed_at=[resume.epoch, resume.position, resume.position // (world_size * cfg.batch_size)]
            if resume.resumed
            else None,
            resizes=resizes,
            startup=marks,
        ))
        resizes = told if told is not None else resizes
        for row in rows:
            sink.epoch.remote(row)

    # [5] Epochs. --profile records micro-batches of the first pass (profiling.py); off, it does nothing.
    profiler = Profiler(cfg, rank, device, loaders.steps_per_epoch, report=lambda line: sink.profiled.remote(rank, line))
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
        bad_step = torch.zeros((), dtype=torch.float64, device=device)  # the first step of a diverged run
        bad_run = torch.zeros((), dtype=torch.float64, device=device)  # non-finite losses in a row
        tick = step_end = pass_start = time.perf_counter()
        last_update = 0.0  # the first step of each epoch is shown at once (and timestamped)
        # `step` counts this pass's micro-batches. The ranks agree at micro-batch `control` whether to
        # stop or checkpoint; checkpoints and stops then fall where that optimizer step ends, so a
        # resume never meets half-accumulated gradients.
        control, stopping, drain_news = 1, False, False  # the first agreement also measures the pace
        for step, (inputs, labels) in enumerate(loaders.train, start=1):
            waited = time.perf_counter() - step_end
            data_wait += waited
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
            position = trained_position(start, world_size, cfg.batch_size, step, train_size)
            if last:
                # The LR of a step is the schedule where the step ends, in samples: the same at any world size.
                set_lr(optimizer, cfg.lr * lr_factor(schedule, (epoch - 1) * train_size + position, cfg.scheduler))
                apply_gradients(model, optimizer, scaler, cfg.clip_grad_norm)
            n = torch.tensor(len(labels), device=device)
            sums += torch.stack([loss * n, (logits.argmax(1) == labels).sum(), n]).double()
            bad_run = torch.where(torch.isfinite(loss), 0.0, bad_run + 1)
            diverged = (bad_step == 0) & (bad_run >= bad_loss_patience)
            bad_step = torch.where(diverged, torch.tensor(float(done + step), device=device), bad_step)

            if rank == 0 and time.perf_counter() - last_update >= PROGRESS_EVERY_S:
                last_update = time.perf_counter()
                rate = (sums[2].item() - resumed_sums[2].item()) * world_size
                sink.step.remote(
                    epoch=epoch, step=done + step, loss=loss.item(), at=time.time(),
                    samples_per_s=rate / max(last_update - pass_start, 1e-9),
                )
            if step == control:
                stop, draining, elapsed = agree_to_stop(rank, sink, bad_step, bad_loss_patience, epoch, pass_start)
                stopping = stopping or stop
                drain_news = drain_news or (draining and not drain_saved)  # checkpoint once per drain, then train on
                drain_saved = drain_saved or draining
                pace = elapsed / step  # the slowest rank's seconds per micro-batch, the same number on every rank
                control = step + max(1, min(CONTROL_EVERY, int(CONTROL_EVERY_S / max(pace, 1e-9))))
            due = cfg.checkpoint_every_steps > 0 and math.ceil(step / accum) % cfg.checkpoint_every_steps == 0
            if last and (due or stopping or drain_news):
                train_time += time.perf_counter() - tick
                save(epoch, position, sums, train_time, {"epoch": epoch, "position": position})
                tick = time.perf_counter()
                if drain_news and rank == 0:
                    sink.drain_saved.remote(epoch=epoch, position=position)
                drain_news = False
                if stopping:
                    if rank == 0:
                        sink.stopped.remote(epoch=epoch, step=done + step)
                    return
            profiler.step(waited)  # before step_end: writing the trace is not the next batch's data wait
            step_end = time.perf_counter()
        profiler.finish()  # the first pass only: no validation or checkpoint inside a profiled step
        train_time += time.perf_counter() - tick
        stop, _, _ = agree_to_stop(rank, sink, bad_step, bad_loss_patience, epoch, pass_start)
        stop = stop or stopping  # asked for after the epoch's last agreement
        train = all_reduce_means(sums)
        val = evaluate(model, loaders.val, device, amp_dtype)
        state_mib = strategy.state_mib(model, optimizer)
        resources = epoch_resources(cuda, data_wait, train_time, loaders.skipped(), world_size, device, state_mib)
        lr = cfg.lr * lr_factor(schedule, epoch * train_size, cfg.scheduler)  # the epoch's last step's
        rows.append(epoch_row(epoch, train, val, lr, train_time, world_size, len(resizes), resources))
        rows[-1]["global_batch"] = cfg.batch_size * world_size * accum  # for the epoch line; not a CSV column
        if rank == 0:
            sink.epoch.remote(rows[-1])
        save(epoch + 1, 0, torch.zeros_like(sums), 0.0, rows[-1])
        if stop and epoch < cfg.epochs:
            if rank == 0:
                sink.stopped.remote(epoch=epoch + 1, step=0)
            return


class Schedule(NamedTuple):
    """The LR schedule in samples trained, which do not depend on the world size. Warmup rises
    linearly over the first `warmup` samples; the decay then runs from `anchor` (where it had gone
    `anchor_progress` of its way) to `total`, the run's last sample. A rerun with another --epochs
    moves `total` and re-anchors where the run stands, so the LR goes on from where it was."""

    total: int
    warmup: int
    anchor: int
    anchor_progress: float


def new_schedule(cfg: TrainConfig, train_size: int) -> Schedule:
    warmup = round(cfg.warmup_epochs * train_size)
    return Schedule(total=cfg.epochs * train_size, warmup=warmup, anchor=warmup, anchor_progress=0.0)


def decay_progress(schedule: Schedule, samples: int) -> float:
    """How far the decay has gone after `samples`, from 0 to 1, clamped: no LR rises past the end."""
    span = max(1, schedule.total - schedule.anchor)
    progress = schedule.anchor_progress + (1 - schedule.anchor_progress) * (samples - schedule.anchor) / span
    return min(1.0, max(0.0, progress))


def lr_factor(schedule: Schedule, samples: int, kind: str) -> float:
    """The share of --lr for the optimizer step that ends after `samples` samples of the run."""
    if samples < schedule.warmup:
        return samples / schedule.warmup
    progress = decay_progress(schedule, samples)
    if kind == "cosine":
        return 0.5 * (1 + math.cos(math.pi * progress))
    if kind == "step":  # x0.1 once past half of the decay, again past three quarters
        return 0.1 ** ((progress > 0.5) + (progress > 0.75))
    return 1.0


def stretched(schedule: Schedule, total: int, samples: int) -> Schedule:
    """`schedule` with its end moved to `total` from `samples` on, without a jump in the LR."""
    if total == schedule.total:
        return schedule
    if samples <= schedule.warmup:  # the decay has not begun: it simply ends elsewhere
        return schedule._replace(total=total)
    return Schedule(total, schedule.warmup, anchor=samples, anchor_progress=decay_progress(schedule, samples))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


class Resume(NamedTuple):
    """Where training continues: the epoch and global position in it, the LR schedule, the rows and
    resizes so far, and the world's running totals (on rank 0) and train time for that epoch."""

    epoch: int
    position: int
    schedule: Schedule
    rows: list[dict[str, Any]]
    resizes: list[dict[str, Any]]
    sums: torch.Tensor
    train_time: float
    resumed: bool


def restore(cfg: TrainConfig, rank: int, world_size: int, device: torch.device, model, optimizer, scaler, train_size: int) -> Resume:
    """Load the latest checkpoint, if any, into the model, optimizer and scaler. The hyperparameters
    a rerun may change (--lr, --momentum, --weight-decay, --epochs; the driver checked the rest) are
    this run's, not the checkpoint's. Any failure to load it is one ConfigError line that names it."""
    from torch.distributed.checkpoint.api import CheckpointException  # DCP's, a BaseException

    zeros = torch.zeros(3, dtype=torch.float64, device=device)
    hyper = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
    loading = []  # the stage reached: a RuntimeError once the model loads is a model that does not fit

    def load_sharded(shards):
        loading.append("model")
        strategy.load_sharded(model, optimizer, shards)

    try:
        # A sharded (FSDP) checkpoint loads from its shards, at any world size, into either strategy
        restored = checkpoint.load(rank, load_sharded)
        if restored is None:
            return Resume(1, 0, new_schedule(cfg, train_size), [], [], zeros, 0.0, resumed=False)
        state, own = restored
        if "model" in state:  # a DDP checkpoint: the whole state, in state.pt
            loading.append("model")
            strategy.load_full(model, optimizer, state["model"], state["optimizer"])
        loading.append("state")
        for group, ours in zip(optimizer.param_groups, hyper):  # moments and momentum buffers loaded ...
            group.update(ours)  # ... under this run's hyperparameters
        scaler.load_state_dict(state["scaler"])
        samples = (state["epoch"] - 1) * train_size + state["position"]
        schedule = stretched(Schedule(**state["schedule"]), cfg.epochs * train_size, samples)
        if own is not None:  # a rank that did not exist before (the world grew) starts from its fresh seed
            checkpoint.set_rng_states(own["rng"])
        resizes = list(state["resizes"])
        if state["world_size"] != world_size:
            resizes.append({
                "epoch": state["epoch"], "position": state["position"], "from": state["world_size"], "to": world_size,
                "at": time.time(),
            })
        sums = state["sums"].to(device) if rank == 0 else zeros  # the world's totals, counted once
        return Resume(state["epoch"], state["position"], schedule, state["rows"], resizes, sums, state["train_time"],
                      resumed=True)
    except (Exception, CheckpointException) as err:  # one line on every retry, not a traceback each time
        saved = ray.train.get_checkpoint()
        mismatch = isinstance(err, RuntimeError) and loading[-1:] == ["model"]
        raise ConfigError(restore_failure(cfg, saved.path if saved is not None else None, err, mismatch)) from None


def restore_failure(cfg: TrainConfig, path: str | None, err: BaseException, mismatch: bool) -> str:
    """The one line for a checkpoint that does not load: which one (run and path), why, and the fix."""
    where = f"the checkpoint of run {cfg.name!r}" + (f" at {path}" if path else "")
    fix = "pass --no-resume or a new --name"
    if mismatch:
        return f"{where} does not fit --model {cfg.model} --num-classes {cfg.num_classes}; {fix}"
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    why = f"{type(err).__name__}: {lines[0].split('. ')[0][:200]}" if lines else type(err).__name__
    return f"{where} could not be restored ({why}); {fix}"


def epoch_row(
    epoch: int, train: tuple[float, float, float], val: tuple[float, float, float], lr: float, train_time: float,
    world_size: int, resizes: int, resources: tuple,
) -> dict[str, Any]:
    """One row of metrics.csv: all-reduced (loss, accuracy, count) of train and val, and the epoch's costs."""
    (train_loss, train_acc, train_n), (val_loss, val_acc, val_n) = train, val
    rss_mib, gpu_mib, wait_frac, skipped, state_mib = resources
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
        "val_samples": int(val_n),  # every val sample once, whatever the world size
        "world_size": world_size,  # at the epoch's end
        "backend": dist.get_backend() if dist.is_initialized() else "none",
        "gpu_mem_peak_mib": gpu_mib,
        "cpu_rss_mib": rss_mib,
        "model_state_mib": state_mib,
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
    # gradients are reduced over the ranks only on the last micro-batch; the others add to .grad locally
    with strategy.gradient_sync(model, sync):
        with torch.autocast(inputs.device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
            logits = model(inputs)
            loss = F.cross_entropy(logits, labels, label_smoothing=label_smoothing)
        scaler.scale(loss * weight).backward()
    return loss.detach(), logits.detach()


def apply_gradients(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler, clip_grad_norm: float,
) -> None:
    """The optimizer step that ends an accumulation: clip, then step."""
    if clip_grad_norm > 0:
        scaler.unscale_(optimizer)  # fp16: clip the true gradients, not the loss-scaled ones
        strategy.clip_grad_norm(model, clip_grad_norm)  # the global norm, over sharded gradients too
    scaler.step(optimizer)  # skipped by the scaler when fp16 gradients overflowed
    scaler.update()


def agree_to_stop(
    rank: int, sink: Any, bad_step: torch.Tensor, patience: int, epoch: int, pass_start: float,
) -> tuple[bool, bool, float]:
    """All ranks learn, at the same micro-batch, whether the driver asked to stop, whether Ray says a
    node of theirs is being drained (checkpoint now, train on), and the slowest rank's seconds per
    pass so far (to space the next agreement); a diverged loss raises."""
    # A barrier over the ranks, like the all-reduce below: every rank calls it at the same step.
    preempted = ray_compat.node_draining()
    asked = rank == 0 and ray.get(sink.stop_requested.remote())
    elapsed = time.perf_counter() - pass_start
    flags = torch.tensor([float(asked), bad_step.item(), elapsed], dtype=torch.float64, device=bad_step.device)
    if dist.is_initialized():
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    if flags[1] > 0:
        how = "non-finite" if patience == 1 else f"non-finite on {patience} micro-batches in a row"
        raise FloatingPointError(
            f"loss became {how} at epoch {epoch} step {int(flags[1])}; nothing was saved after "
            "it, the last good checkpoint is kept: lower --lr, or try --no-amp"
        )
    return bool(flags[0]), preempted, flags[2].item()


def epoch_resources(
    cuda: bool, data_wait: float, train_time: float, skipped: int, world_size: int, device, state_mib: float,
) -> tuple:
    """(peak RSS MiB, peak GPU MiB or None) as the max over ranks, the mean data-wait share, the
    unreadable samples skipped (--skip-bad) summed over ranks, and the largest rank's model state."""
    rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
    gpu_mib = torch.cuda.max_memory_allocated(device) / 2**20 if cuda else 0.0
    peaks = torch.tensor([rss_mib, gpu_mib, state_mib], dtype=torch.float64, device=device)
    sums = torch.tensor([data_wait / max(train_time, 1e-9), skipped], dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(peaks, op=dist.ReduceOp.MAX)
        dist.all_reduce(sums)
    gpu = round(peaks[1].item(), 1) if cuda else None
    return round(peaks[0].item(), 1), gpu, sums[0].item() / world_size, int(sums[1].item()), round(peaks[2].item(), 1)


@torch.no_grad()
def evaluate(model, loader, device, amp_dtype) -> tuple[float, float, float]:
    """(loss, accuracy, count) over every rank's val shard. The shards may differ in length, so no
    collective may run per batch: this runs the whole model with no collective in its forward
    (strategy.whole_model), after one broadcast of rank 0's buffers (BatchNorm's running stats, the
    ones a checkpoint keeps)."""
    sums = torch.zeros(3, dtype=torch.float64, device=device)
    with strategy.whole_model(model) as model:
        if dist.is_initialized():
            for buffer in model.buffers():
                dist.broadcast(buffer, src=0)
        model.eval()
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
