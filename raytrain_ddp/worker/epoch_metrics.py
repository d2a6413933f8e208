"""An epoch's numbers, over the whole world: validation, the training means, the costs, and the row
of metrics.csv they make. All but epoch_row are collectives: every rank calls them at the epoch's
end, so every number describes the world, not rank 0's shard."""

from __future__ import annotations

import resource
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from raytrain_ddp.worker import parallel


@torch.no_grad()
def evaluate(model, loader, device, amp_dtype, beat: Callable[[], None] | None = None) -> tuple[float, float, float]:
    """(loss, accuracy, count) over every rank's val shard. The shards may differ in length, so no
    collective may run per batch: this runs the whole model with no collective in its forward
    (parallel.whole_model), after one broadcast of rank 0's buffers (BatchNorm's running stats, the
    ones a checkpoint keeps). `beat()` after each batch: the stall watch sees validation move."""
    sums = torch.zeros(3, dtype=torch.float64, device=device)
    with parallel.whole_model(model) as model:
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
            if beat is not None:
                beat()
    return all_reduce_means(sums)


def all_reduce_means(sums: torch.Tensor) -> tuple[float, float, float]:
    """(loss sum, correct, count) summed over ranks -> (mean loss, accuracy, global count)."""
    if dist.is_initialized():
        dist.all_reduce(sums)
    loss_sum, correct, count = sums.tolist()
    return loss_sum / max(count, 1), correct / max(count, 1), count


def epoch_resources(
    cuda: bool, data_wait: float, train_time: float, skipped: int, world_size: int, device, state_mib: float,
) -> tuple:
    """(peak RSS MiB, the epoch's peak GPU MiB or None) as the max over ranks, the mean data-wait
    share, the unreadable samples skipped (--skip-bad) summed over ranks, and the largest rank's
    model state."""
    rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
    gpu_mib = torch.cuda.max_memory_allocated(device) / 2**20 if cuda else 0.0
    if cuda:  # each row its own epoch's: the first one's holds cuDNN's one-time algorithm search (cudnn.benchmark)
        torch.cuda.reset_peak_memory_stats(device)
    peaks = torch.tensor([rss_mib, gpu_mib, state_mib], dtype=torch.float64, device=device)
    sums = torch.tensor([data_wait / max(train_time, 1e-9), skipped], dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(peaks, op=dist.ReduceOp.MAX)
        dist.all_reduce(sums)
    gpu = round(peaks[1].item(), 1) if cuda else None
    return round(peaks[0].item(), 1), gpu, sums[0].item() / world_size, int(sums[1].item()), round(peaks[2].item(), 1)


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
