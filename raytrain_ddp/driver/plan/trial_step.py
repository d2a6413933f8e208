"""--dry-run's trial of a first step on the driver's CPU: the ranks' own train set, a batch of two of
its samples as the DataLoader collates them, the model built for real, its forward, the loss and the
backward. What would fail a rank at its first step (a dataset that returns the wrong thing, a label
outside --num-classes, an input the model cannot take, logits of the wrong width) fails here in one
line that names the part, before any worker starts.

Only under --dry-run: building the user's dataset may load all of it, and a run's driver must not
pay for that (its checks import the user's modules and read a built-in dataset's files, no more).
"""

from __future__ import annotations

from typing import Any, Callable, TypeVar

from raytrain_ddp.config import ConfigError, TrainConfig
from raytrain_ddp.errors import one_line

T = TypeVar("T")
BATCH = 2
"""Samples in the trial batch: two, so a BatchNorm in training mode has a batch to normalise over."""


def attempt(what: str, step: Callable[[], T]) -> T:
    """`step()`, or a ConfigError naming `what` failed and torch's (or the user's code's) reason."""
    try:
        return step()
    except ConfigError:
        raise
    except Exception as err:
        raise ConfigError(f"--dry-run: {what} failed: {one_line(err)}") from err


def trial_step(cfg: TrainConfig, given: dict[str, Callable[..., Any]]) -> str:
    """Run the trial; return the line that says what it ran. `given`: the Python API's callables."""
    import torch
    import torch.nn.functional as F
    from torch.utils.data import default_collate

    from raytrain_ddp.data.registry import dataset_builder
    from raytrain_ddp.worker.models import model_builder

    torch.manual_seed(cfg.seed)
    data = attempt(f"--dataset {cfg.dataset}: building it", lambda: dataset_builder(cfg.dataset, given.get("dataset"))(cfg))
    n = min(BATCH, len(data.train))
    inputs, labels = attempt(f"--dataset {cfg.dataset}: collating train samples 0 to {n - 1} into a batch",
                             lambda: default_collate([data.train[i] for i in range(n)]))
    if not torch.is_tensor(labels) or labels.dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        raise ConfigError(f"--dataset {cfg.dataset}: a sample's label must be a class index (int), not {labels!r}")
    if bool(((labels < 0) | (labels >= cfg.num_classes)).any()):
        raise ConfigError(f"--dataset {cfg.dataset}: train labels {labels.tolist()} are not all below --num-classes "
                          f"{cfg.num_classes}; pass --num-classes above the largest label, or fix the labels")
    model = attempt(f"--model {cfg.model}: building it",
                    lambda: model_builder(cfg.model, given.get("model"))(num_classes=cfg.num_classes, in_channels=data.in_channels))
    model.train()
    shape = tuple(inputs.shape)
    logits = attempt(f"--model {cfg.model} on a batch of inputs {shape} ({inputs.dtype})", lambda: model(inputs))
    if not torch.is_tensor(logits) or tuple(logits.shape) != (n, cfg.num_classes):
        got = tuple(logits.shape) if torch.is_tensor(logits) else type(logits).__name__
        raise ConfigError(f"--model {cfg.model} gave {got} for a batch of {n}, not ({n}, {cfg.num_classes}) logits "
                          "(batch, --num-classes); return one logit per class")
    loss = F.cross_entropy(logits, labels)
    attempt(f"--model {cfg.model}: the backward pass", loss.backward)
    return (f"dry run: a batch of {n} train samples, inputs {shape[1:]} {str(inputs.dtype).removeprefix('torch.')}, "
            f"labels {labels.tolist()}; --model {cfg.model} gave ({n}, {cfg.num_classes}) logits, loss {loss.item():.3f}, "
            "and its backward ran on the CPU")
