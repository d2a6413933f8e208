"""--model's shapes, for the preflight: every state-dict key's (a resume's fit with its checkpoint)
and every parameter's size (the model state per rank), without torch on the driver where it can.

A built-in model's shapes follow from its name, --num-classes, the input channels and the code that
builds it (worker/models.py, torch, torchvision), so the first run that builds one on the meta
device keeps them in a small file (CACHE), and later runs read them there: their driver never
imports torch, about 2 s of a core before any worker starts (3.5 s with torchvision's resnets).
The user's own --model is built every time: the build is the check that it imports and returns an
nn.Module, and its code may have changed since.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import tempfile
from dataclasses import dataclass
from importlib import metadata
from importlib.util import find_spec
from pathlib import Path
from typing import Any, Callable

from raytrain_ddp import plugins
from raytrain_ddp.config import ConfigError, TrainConfig

CACHE_ENTRIES = 64
"""Models kept in the cache, the newest: a name, --num-classes and channels each."""


@dataclass(frozen=True)
class Param:
    """One parameter, as the state estimate needs it."""

    shape: tuple[int, ...]
    itemsize: int
    """Bytes per element (4 for the fp32 the ranks build in)."""
    trainable: bool
    """requires_grad: it has a gradient and optimizer state."""


@dataclass(frozen=True)
class ModelShapes:
    """What the preflight knows of --model: no tensors, no torch."""

    state: dict[str, list[int]] | None
    """Every state-dict key (parameters and buffers) and its shape, as a checkpoint records them;
    None for the user's own model on a fresh start, whose state_dict() is theirs to run on the ranks."""
    params: tuple[Param, ...]

    @property
    def count(self) -> int:
        """Parameters, in elements."""
        return sum(math.prod(p.shape) for p in self.params)

    def to_json(self) -> dict[str, Any]:  # of a built-in model: its state is always there
        return {"state": self.state, "params": [[list(p.shape), p.itemsize, p.trainable] for p in self.params]}

    @classmethod
    def from_json(cls, record: dict[str, Any]) -> ModelShapes:
        return cls({k: list(v) for k, v in record["state"].items()},
                   tuple(Param(tuple(shape), int(size), bool(trainable)) for shape, size, trainable in record["params"]))


def of(model: Any, state: bool = True) -> ModelShapes:
    """The shapes of an nn.Module (one on the meta device will do); `state`: its state dict's too."""
    return ModelShapes(
        {key: list(value.shape) for key, value in model.state_dict().items()} if state else None,
        tuple(Param(tuple(p.shape), p.element_size(), p.requires_grad) for p in model.parameters()),
    )


def model_shapes(cfg: TrainConfig, given: Callable[..., Any] | None, in_channels: int, resuming: bool = False) -> ModelShapes:
    """--model's shapes with `in_channels` inputs: a built-in model's from the cache when it has
    them, else the model built on the meta device (worker/models.py), and kept for the next run.
    `resuming`: a checkpoint's shapes will be checked against the state dict's. Only then does the
    user's own model's state_dict() run on the driver: it is the user's code, made for the ranks."""
    key = cache_key(cfg, in_channels) if given is None and not plugins.is_import_path(cfg.model) else None
    if key is not None and (record := read_cache().get(key)) is not None:
        try:
            return ModelShapes.from_json(record)
        except (AttributeError, KeyError, TypeError, ValueError):
            pass  # not an entry this code wrote: built again below, and replaced
    from raytrain_ddp.worker.models import build_on_meta  # torch

    model = build_on_meta(cfg, given, in_channels)
    refuse_lazy(cfg, model)
    shapes = of(model, state=key is not None or resuming)
    if key is not None:
        write_cache(key, shapes)
    return shapes


def refuse_lazy(cfg: TrainConfig, model: Any) -> None:
    """A model with lazy layers (nn.LazyLinear...) has no shapes until a forward, and DDP and FSDP
    refuse it on every rank: say so here, in one line."""
    from torch.nn.parameter import is_lazy

    lazy = [name for name, p in model.named_parameters() if is_lazy(p)]
    if lazy:
        raise ConfigError(
            f"--model {cfg.model} has lazy layers, whose parameters ({lazy[0]}{' and more' if len(lazy) > 1 else ''}) "
            "have no shape until a forward, and DDP and FSDP need them before training; give those layers their "
            "input sizes (nn.Linear for nn.LazyLinear), or run one forward on a sample input in the builder"
        )


def cache_key(cfg: TrainConfig, in_channels: int) -> str:
    """What a built-in model's shapes follow from, in one string: a change to any builds it again."""
    code = hashlib.sha256(Path(find_spec("raytrain_ddp.worker.models").origin).read_bytes()).hexdigest()[:16]
    return f"{cfg.model}|classes {cfg.num_classes}|channels {in_channels}|{version('torch')}|{version('torchvision')}|models.py {code}"


def version(package: str) -> str:
    try:
        return f"{package} {metadata.version(package)}"
    except metadata.PackageNotFoundError:
        return f"{package} none"


def cache_path() -> Path:
    """$XDG_CACHE_HOME/raytrain_ddp/model_shapes.json (~/.cache by default)."""
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "raytrain_ddp" / "model_shapes.json"


def read_cache() -> dict[str, Any]:
    """The cache's entries; none where it is missing or unreadable (it is only ever a shortcut)."""
    try:
        entries = json.loads(cache_path().read_text())
    except (OSError, ValueError):
        return {}
    return entries if isinstance(entries, dict) else {}


def write_cache(key: str, shapes: ModelShapes) -> None:
    """Add an entry, whole or not at all: drivers on other nodes may share the home directory. A
    cache that cannot be written costs the next run its build, nothing more."""
    path = cache_path()
    entries = {k: v for k, v in read_cache().items() if k != key}
    entries[key] = shapes.to_json()
    entries = dict(list(entries.items())[-CACHE_ENTRIES:])
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=".model_shapes.", delete=False) as tmp:
            json.dump(entries, tmp)
        os.replace(tmp.name, path)
    except OSError:
        pass


def optimizer_copies(cfg: TrainConfig) -> int:
    """Tensors of optimizer state per trainable parameter, each its size: AdamW's two moments, SGD's
    momentum buffer (none without momentum)."""
    if cfg.optimizer == "adamw":
        return 2
    return 1 if cfg.momentum else 0


def state_shards(cfg: TrainConfig, world_size: int, ranks_per_node: int | None = None) -> int:
    """Over how many ranks each parameter is split: none under DDP, the world under FSDP, the ranks
    of one node under hybrid sharding (the nodes hold replicas)."""
    if cfg.strategy != "fsdp" or world_size < 2:
        return 1
    return min(ranks_per_node or world_size, world_size) if cfg.sharding == "hybrid" else world_size


def estimate_state_mib(shapes: ModelShapes, cfg: TrainConfig, world_size: int, ranks_per_node: int | None = None) -> float:
    """What the ranks' state_mib (worker/parallel.py) will measure on the largest rank after a step,
    from the shapes alone: parameters, a gradient and the optimizer's state per trainable one.
    FSDP2 splits each parameter along its first dimension in chunks of ceil(rows / shards); rank 0
    always holds a full chunk, so it is the largest."""
    shards = state_shards(cfg, world_size, ranks_per_node)
    per_trainable = 2 + optimizer_copies(cfg)  # itself, its gradient, the optimizer's copies
    total = 0
    for p in shapes.params:
        rows = math.ceil(p.shape[0] / shards) if p.shape else 1
        local = rows * math.prod(p.shape[1:]) * p.itemsize
        total += local * (per_trainable if p.trainable else 1)
    return total / 2**20
