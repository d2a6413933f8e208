"""Model registry: a plain dict from name to a builder taking (num_classes, in_channels); or the
user's own builder by import path (plugins.py), called the same way."""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from raytrain_ddp import plugins
from raytrain_ddp.config import ConfigError, TrainConfig


def convnet(num_classes: int, in_channels: int) -> nn.Module:
    """A small CNN for 28-32 px images (MNIST, CIFAR-10); global pooling makes any size work."""

    def block(c_in: int, c_out: int) -> nn.Sequential:
        return nn.Sequential(
            nn.Conv2d(c_in, c_out, 3, padding=1, bias=False),
            nn.BatchNorm2d(c_out),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
        )

    return nn.Sequential(
        block(in_channels, 32),
        block(32, 64),
        block(64, 128),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(128, num_classes),
    )


def _torchvision(name: str) -> Callable[[int, int], nn.Module]:
    def build(num_classes: int, in_channels: int) -> nn.Module:
        import torchvision

        model = getattr(torchvision.models, name)(weights=None, num_classes=num_classes)
        if in_channels != 3:  # e.g. MNIST: swap the stem, keep the rest of the architecture
            old = model.conv1
            model.conv1 = nn.Conv2d(
                in_channels, old.out_channels, old.kernel_size, old.stride, old.padding, bias=False
            )
        return model

    return build


MODELS: dict[str, Callable[[int, int], nn.Module]] = {
    "convnet": convnet,
    "resnet18": _torchvision("resnet18"),
    "resnet50": _torchvision("resnet50"),
}


def model_builder(name: str, given: Callable[..., Any] | None = None) -> Callable[..., nn.Module]:
    """The builder for --model: a registry name, an import path, or a callable given by the Python API."""
    if given is None and not plugins.is_import_path(name):
        if name not in MODELS:
            raise ConfigError(f"unknown --model {name!r}; choose one of {', '.join(MODELS)}, or give your own as PKG.MODULE:CALLABLE")
        return MODELS[name]
    build = given or plugins.load(name, "--model")

    def checked(num_classes: int, in_channels: int) -> nn.Module:
        model = build(num_classes=num_classes, in_channels=in_channels)
        if not isinstance(model, nn.Module):
            raise ConfigError(f"--model {name} returned a value of type {type(model).__name__}, not a torch.nn.Module")
        return model

    return checked


def build_on_meta(cfg: TrainConfig, given: Callable[..., Any] | None, in_channels: int) -> nn.Module:
    """The model as the workers will build it, on the meta device: shapes, no memory, no init cost.
    A builder that cannot run on meta (it loads weights, say) is built on the CPU instead."""
    build = model_builder(cfg.model, given)
    try:
        with torch.device("meta"):
            return build(num_classes=cfg.num_classes, in_channels=in_channels)
    except ConfigError:
        raise  # not an nn.Module: model_builder's own line
    except Exception:
        pass
    try:
        return build(num_classes=cfg.num_classes, in_channels=in_channels)
    except ConfigError:
        raise
    except Exception as err:
        raise ConfigError(
            f"--model {cfg.model} failed to build with num_classes={cfg.num_classes}, in_channels={in_channels}: "
            f"{type(err).__name__}: {err}"
        ) from None
