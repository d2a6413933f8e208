"""The worker loop: the one function TorchTrainer runs on every rank.

Read it top to bottom: [1] set up the rank, [2] data, [3] model and optimizer, [4] resume from the
latest checkpoint, [5] epochs. An epoch is a pass of optimizer steps, each over `accum` micro-batches
(forward_backward each, then apply_gradients), then validation and a checkpoint. Metrics are
all-reduced, so every number describes the whole world, not rank 0's shard.

Exactness: the LR is a function of the samples trained so far (schedule.py), not of steps at some
world size; the data order and augmentation are functions of (seed, epoch, sample) (data.torch_ingest);
checkpoints hold every stream of state that is left (checkpoint/checkpointer.py). So a resumed run
trains what the uninterrupted run would have, bit for bit on CPU at the same world size.
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import ray
import ray.train
import ray.train.torch
import torch
import torch.distributed as dist
from torch import nn

from raytrain_ddp.checkpoint.checkpointer import Checkpointer
from raytrain_ddp.config import ConfigError, TrainConfig
from raytrain_ddp.data.batches import Loaders
from raytrain_ddp.data.loaders import make_loaders
from raytrain_ddp.data.registry import dataset_builder
from raytrain_ddp.data.torch_ingest import trained_position
from raytrain_ddp.doctor.ranks import ranks_from
from raytrain_ddp.run_records import GroupStart
from raytrain_ddp.worker import host_sync, parallel
from raytrain_ddp.worker.control import Control
from raytrain_ddp.worker.epoch_metrics import all_reduce_means, epoch_resources, epoch_row, evaluate
from raytrain_ddp.worker.measure import health_check
from raytrain_ddp.worker.measure.part_clock import PartClock
from raytrain_ddp.worker.measure.profiling import Profiler
from raytrain_ddp.worker.models import model_builder
from raytrain_ddp.worker.schedule import lr_factor, set_lr
from raytrain_ddp.worker.state import TrainState
from raytrain_ddp.worker.step import apply_gradients, autocast_dtype, forward_backward, make_optimizer

PROGRESS_EVERY_S = 1.0
"""How often rank 0 sends a step update to the driver's progress display."""


@dataclass(frozen=True)
class Setup:
    """What [1] to [4] built, for the epochs to use."""

    cfg: TrainConfig
    sink: Any
    """The driver's MetricsSink actor: progress, rows, stops."""
    rank: int
    world_size: int
    device: torch.device
    loaders: Loaders
    model: nn.Module
    """Wrapped by the strategy: DDP (a whole replica per rank) or FSDP (a shard per rank)."""
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    """Loss scaling under fp16; it passes everything through otherwise."""
    amp_dtype: torch.dtype | None
    accum: int
    """Micro-batches per optimizer step at this world size."""
    checkpointer: Checkpointer
    profiler: Profiler
    """--profile over micro-batches of the first pass (profiling.py); off, it does nothing."""
    parts: PartClock
    """This rank's seconds in data, forward, backward and communication, per pass (for stragglers)."""


def train_loop(loop_config: dict[str, Any], entered: float | None = None) -> None:
    """One rank's training (train_rank); a ConfigError it raises is told to the driver first."""
    try:
        train_rank(loop_config, entered)
    except (ConfigError, RuntimeError) as err:
        error = err if isinstance(err, ConfigError) else unused_parameters(err, loop_config["config"]["model"])
        if error is None:
            raise
        # The same on every retry: the driver ends the run at once, where Ray Train would retry it.
        ray.get(loop_config["sink"].config_error.remote(str(error)))
        raise error from None
    if ray.train.get_context().get_world_rank() == 0:  # what is left is Ray Train's upload of the last checkpoint: no stall
        loop_config["sink"].phase.remote("finished")


def unused_parameters(err: RuntimeError, model: str) -> ConfigError | None:
    """DDP's page-long error for a parameter that got no gradient, as our flag's line; None for any other."""
    if "find_unused_parameters" not in str(err):
        return None
    return ConfigError(
        f"--model {model} has parameters that got no gradient on a step (a layer its forward "
        "skipped), which DDP cannot all-reduce; pass --find-unused-parameters"
    )


def train_rank(loop_config: dict[str, Any], entered: float | None = None) -> None:
    # Start-up stages (startup.py), stitched by the driver: wall-clock, since they cross processes.
    marks = {"workers": entered or time.time(), "imports": time.time()}
    cfg = TrainConfig.from_dict(loop_config["config"])
    sink = loop_config["sink"]  # the driver's MetricsSink actor
    run_dir = loop_config.get("run_dir") or Path(cfg.storage_path) / cfg.name  # the rank's own files: --profile's, a benchmark's
    given = loop_config.get("given", {})  # the Python API's model and dataset callables, if any
    data_root = loop_config.get("data_root")  # --data-dir as the driver resolved it: on a store, with its credentials

    # [1] The rank: threads, seed, device, and who runs where.
    ctx = ray.train.get_context()
    rank, world_size = ctx.get_world_rank(), ctx.get_world_size()
    if rank == 0:  # the start's live line on the driver
        sink.reached.remote("imports", marks["imports"])
    torch.set_num_threads(cfg.cpus_per_worker)
    torch.manual_seed(cfg.seed)  # the same initial weights on every rank
    device = ray.train.torch.get_device()
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True  # fixed input shapes: let cuDNN pick its fastest kernels
    ranks = where_ranks_run(world_size)
    mark(marks, "process group", sink, rank)  # every rank has arrived (and NCCL made its communicator)
    if rank == 0:
        sink.arrived.remote(ranks)  # the stall watch covers the start-up from here
    if cfg.health != "off":
        if not health_check.before_training(cfg.health, sink, rank, world_size, device):
            return  # --health exclude named a node: the driver ends the run, before any data or model
        mark(marks, "health", sink, rank)

    # [2] Data: each rank gets a disjoint shard (see data.make_loaders).
    build_data = dataset_builder(cfg.dataset, given.get("dataset"), data_root)
    loaders = make_loaders(cfg, rank, world_size, device.type == "cuda", build_data, data_root)
    mark(marks, "data", sink, rank)

    # [3] Model, optimizer, mixed precision.
    accum = cfg.accum_steps(world_size)  # --global-batch-size holds at every world size
    model = build_model(cfg, given.get("model"), loaders.in_channels, device)
    model = parallel.wrap(cfg, model, accum, device, ctx.get_local_world_size())
    optimizer = make_optimizer(cfg, model)
    amp_dtype = autocast_dtype(cfg, device)
    scaler = torch.amp.GradScaler("cuda", enabled=amp_dtype == torch.float16)
    torch.manual_seed(cfg.seed + rank)  # each rank's own stream from here (dropout; augmentation seeds per sample)

    # [4] Resume from the latest checkpoint: a restarted worker group (of any size), or a rerun of
    # the same --name. Positions are global, so the samples already trained are never trained again.
    state = TrainState.fresh(cfg, loaders.train_size, world_size, device)
    checkpointer = Checkpointer(cfg, rank, loaders.in_channels, model, optimizer, scaler,
                                loop_config.get("resume_from"))
    if rank == 0:  # reading a checkpoint may take long, as writing one may: no stall (sink.start counts again)
        sink.phase.remote("checkpoint")
    resumed = checkpointer.restore(state)
    marks["model"] = time.time()
    if rank == 0:
        announce(cfg, sink, state, resumed, ranks, loaders.steps_per_epoch, marks)
    profiler = Profiler(cfg, rank, device, loaders.steps_per_epoch, report=lambda line: sink.profiled.remote(rank, line),
                        run_dir=run_dir)
    run = Setup(cfg, sink, rank, world_size, device, loaders, model, optimizer, scaler, amp_dtype, accum,
                checkpointer, profiler, PartClock(model, device, loaders.loader_workers))

    # [5] Epochs: a pass of optimizer steps, then validation and the epoch's checkpoint.
    control = Control.new(rank, sink, amp_dtype, device)
    while state.epoch <= cfg.epochs:
        # This epoch's order, the same on every rank, minus the samples already trained.
        micro_steps = loaders.set_epoch(state.epoch, state.position)
        model.train()
        clock = Clock(counted=state.sums.clone())
        with host_sync.wall(device):  # tests only: a host sync outside the named points raises
            stopped = train_epoch(run, state, control, clock, micro_steps)
        if stopped:
            return  # the ranks agreed to stop: saved where that optimizer step ended
        if end_epoch(run, state, control, clock):
            return
    if rank == 0 and host_sync.syncs() is not None:  # a benchmark counted the passes' syncs (bench/overhead.py)
        (run_dir / host_sync.COUNT_FILE).write_text(json.dumps({"syncs": host_sync.syncs()}))


def mark(marks: dict[str, float], stage: str, sink: Any, rank: int) -> None:
    """Take start-up mark `stage` (startup.py); rank 0 tells the driver at once, for its live line."""
    marks[stage] = time.time()
    if rank == 0:
        sink.reached.remote(stage, marks[stage])


def where_ranks_run(world_size: int) -> list[dict[str, Any]]:
    """Every rank's host, IP, pid and niceness, in rank order, on every rank."""
    where = {"hostname": socket.gethostname(), "ip": ray.util.get_node_ip_address(), "pid": os.getpid(),
             "nice": os.getpriority(os.PRIO_PROCESS, 0)}
    ranks = [where] * world_size
    if world_size > 1:
        dist.all_gather_object(ranks, where)
    return ranks


def build_model(cfg: TrainConfig, given: Callable[..., Any] | None, in_channels: int, device: torch.device) -> nn.Module:
    """The model as --model builds it, laid out for this device and compiled if asked, not yet wrapped."""
    model = model_builder(cfg.model, given)(num_classes=cfg.num_classes, in_channels=in_channels)
    if device.type == "cuda" and cfg.strategy == "ddp":  # FSDP2's fully_shard refuses channels_last (non-contiguous) weights
        model = model.to(memory_format=torch.channels_last)  # moves only 4-D (conv) weights
    if cfg.compile:
        # In place, before DDP: the state dict keeps its keys, and Dynamo never traces DDP's own
        # forward (its buffer broadcast breaks the graph, and the step would silently run eager).
        model.compile()
    return model


def announce(
    cfg: TrainConfig, sink: Any, state: TrainState, resumed: bool, ranks: list[dict[str, Any]], steps_per_epoch: int,
    marks: dict[str, float],
) -> None:
    """Rank 0 tells the driver the world, where training starts and the rows so far."""
    # The sink knows whether this driver started a worker group before: a restart is recorded
    # even when it found no checkpoint to resume from, and every later checkpoint carries it.
    told = ray.get(sink.start.remote(GroupStart(
        world_size=state.world_size,
        backend=dist.get_backend() if dist.is_initialized() else "none",
        ranks=tuple(ranks_from(ranks)),
        steps_per_epoch=steps_per_epoch,
        # epoch, global position, and the same position as this world's step count
        resumed_at=(state.epoch, state.position, state.position // (state.world_size * cfg.batch_size))
        if resumed
        else None,
        resizes=tuple(state.resizes),
        startup=marks,
    )))
    state.resizes = told if told is not None else state.resizes
    for row in state.rows:
        sink.epoch.remote(row)


@dataclass
class Clock:
    """One pass's wall-clock accounts (perf_counter seconds); not saved."""

    counted: torch.Tensor
    """The running sums when the pass began: the display's rate counts this pass's samples only."""
    start: float = field(default_factory=time.perf_counter)
    """When the pass began."""
    tick: float = 0.0
    """Since when training time has not been added to the state's."""
    last_update: float = 0.0
    """When rank 0 last told the display; 0 shows each pass's first micro-batch at once (timestamped)."""

    def __post_init__(self) -> None:
        self.tick = self.start

    def lap(self) -> float:
        """Seconds since the last lap (or the pass's start)."""
        now = time.perf_counter()
        lap, self.tick = now - self.tick, now
        return lap


def timed(batches: Iterable) -> Iterator[tuple[Any, float]]:
    """Each batch with the seconds this rank waited for it (the first one's include the loader's start)."""
    asked = time.perf_counter()
    for batch in batches:
        yield batch, time.perf_counter() - asked
        asked = time.perf_counter()


def train_epoch(run: Setup, state: TrainState, control: Control, clock: Clock, micro_steps: int) -> bool:
    """The epoch's `micro_steps` micro-batches left on this rank, as optimizer steps; True once the
    ranks agreed to stop (saved where that step ended, and said)."""
    cfg, start = run.cfg, state.position
    done = start // (run.world_size * cfg.batch_size)  # batches per rank before this pass, for the display
    control.new_pass()
    run.parts.new_pass(micro_steps)
    batches = timed(run.loaders.train)
    for opt_step, first in enumerate(range(1, micro_steps + 1, run.accum), start=1):
        last = min(first + run.accum - 1, micro_steps)  # the epoch's last step may have fewer micro-batches
        run.optimizer.zero_grad(set_to_none=True)
        for step in range(first, last + 1):  # gradients add up locally; the ranks sync them on the last only
            with host_sync.allowed():  # the loader's work on the host is not the step's
                (inputs, labels), waited = next(batches)
            run.parts.waited(waited)
            inputs, labels = to_device(inputs, labels, run.device)
            loss, logits = forward_backward(run.model, inputs, labels, run.amp_dtype, run.scaler, cfg.label_smoothing,
                                            weight=1 / (last - first + 1), sync=step == last, parts=run.parts)
            state.count(loss, logits, labels)
            control.count(loss, done + step)
            control.agree(step, state.epoch, clock.start)  # a stop or drain it agrees waits for the step's end
            if step < last:  # the last one's profiled step holds the optimizer step and any checkpoint
                run.profiler.step(waited)

        # The LR of a step is the schedule where the step ends, in samples: the same at any world size.
        state.position = trained_position(start, run.world_size, cfg.batch_size, last, state.train_size)
        set_lr(run.optimizer, cfg.lr * lr_factor(state.schedule, state.samples, cfg.scheduler))
        apply_gradients(run.model, run.optimizer, run.scaler, cfg.clip_grad_norm)
        state.train_time += clock.lap()
        # After the step, so the first update (the run's first-step mark) counts the optimizer step too.
        if run.rank == 0 and time.perf_counter() - clock.last_update >= PROGRESS_EVERY_S:
            show_progress(run, state, clock, loss, done + last)
        if run.checkpointer.due(opt_step, force=control.stopping or control.drain_news):
            tell_phase(run, "checkpoint")
            with host_sync.allowed():
                run.checkpointer.save(state, opt_step, force=True)
            tell_phase(run, None)
            clock.lap()  # the checkpoint is no training time
            if stopped_after_save(run, state, control, done + last):
                return True
        run.profiler.step(waited)
    with host_sync.allowed():
        next(batches, None)  # asked once more, as a for loop would: the loader ends its epoch (workers, Ray Data's split)
    run.profiler.finish()  # the first pass only: no validation or checkpoint inside a profiled step
    state.train_time += clock.lap()
    return False


def to_device(inputs: torch.Tensor, labels: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    inputs = inputs.to(device, non_blocking=True)
    labels = labels.to(device, non_blocking=True)
    if device.type == "cuda" and inputs.dim() == 4:  # images; flat vectors and sequences stay as they are
        inputs = inputs.contiguous(memory_format=torch.channels_last)
    return inputs, labels


def show_progress(run: Setup, state: TrainState, clock: Clock, loss: torch.Tensor, step: int) -> None:
    """Rank 0's step update for the driver's display, at most once per PROGRESS_EVERY_S: a named host
    sync (host_sync.py), with the ranks' agreement (control.py), a checkpoint and the epoch's end."""
    clock.last_update = time.perf_counter()
    with host_sync.allowed():
        rate = (state.sums[2].item() - clock.counted[2].item()) * run.world_size
        loss_now = loss.item()
    run.sink.step.remote(
        epoch=state.epoch, step=step, loss=loss_now, at=time.time(),
        samples_per_s=rate / max(clock.last_update - clock.start, 1e-9),
    )


def tell_phase(run: Setup, name: str | None) -> None:
    """Rank 0 tells the driver's stall watch it enters (or leaves, None) a phase that is no
    training step: validation, a checkpoint. Fire-and-forget."""
    if run.rank == 0:
        run.sink.phase.remote(name)


def validation_beat(run: Setup) -> Callable[[], None] | None:
    """Rank 0's beat inside validation, at most once per PROGRESS_EVERY_S (fire-and-forget): a rank
    stuck there is a stall the driver sees, and a stop's grace waits while validation moves."""
    if run.rank != 0:
        return None
    last = time.perf_counter()

    def beat() -> None:
        nonlocal last
        if time.perf_counter() - last >= PROGRESS_EVERY_S:
            last = time.perf_counter()
            run.sink.phase.remote("validation")

    return beat


def stopped_after_save(run: Setup, state: TrainState, control: Control, step: int) -> bool:
    """After a checkpoint inside a pass: tell the driver a drain was answered, and stop if agreed."""
    if control.drain_news and run.rank == 0:
        run.sink.drain_saved.remote(epoch=state.epoch, position=state.position)
    control.drain_news = False
    if control.stopping and run.rank == 0:
        run.sink.stopped.remote(epoch=state.epoch, step=step)
    return control.stopping


def end_epoch(run: Setup, state: TrainState, control: Control, clock: Clock) -> bool:
    """The pass's last agreement, validation, the epoch's row (to the driver, and into the checkpoint)
    and the checkpoint at its end; True if the ranks agreed to stop after it."""
    cfg = run.cfg
    tell_phase(run, "validation")
    stop = control.at_epoch_end(state.epoch, clock.start)
    train = all_reduce_means(state.sums)
    val = evaluate(run.model, run.loaders.val, run.device, run.amp_dtype, beat=validation_beat(run))
    state_mib = parallel.state_mib(run.model, run.optimizer)
    resources = epoch_resources(run.device.type == "cuda", run.parts.totals["data"], state.train_time, run.loaders.skipped(),
                                run.world_size, run.device, state_mib)
    lr = cfg.lr * lr_factor(state.schedule, state.epoch * state.train_size, cfg.scheduler)  # the epoch's last step's
    row = epoch_row(state.epoch, train, val, lr, state.train_time, run.world_size, len(state.resizes), resources)
    row["global_batch"] = cfg.batch_size * run.world_size * run.accum  # for the epoch line; not a CSV column
    state.rows.append(row)
    parts = run.parts.gather(run.device)  # every rank's own time per part, for the driver to find a straggler
    if run.rank == 0:
        run.sink.epoch.remote(row)
        run.sink.rank_parts.remote(state.epoch, parts)
    state.next_epoch()
    tell_phase(run, "checkpoint")
    run.checkpointer.save(state, force=True, metrics=row)
    tell_phase(run, None)
    if stop and state.epoch <= cfg.epochs:
        if run.rank == 0:
            run.sink.stopped.remote(epoch=state.epoch, step=0)
        return True
    return False
