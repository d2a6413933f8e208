"""The one training config: defaults, then a config file, then CLI flags, validated once.

`TrainConfig` is frozen and JSON-safe. It crosses into Ray as `to_dict()` and the worker loop turns
it back with `from_dict()`, so only names, numbers and paths travel, never data.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import json
import math
import re
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import tomllib

OPTIMIZERS = ("sgd", "adamw")
SCHEDULERS = ("none", "step", "cosine")
BACKENDS = ("auto", "nccl", "gloo")
PLACEMENTS = ("pack", "spread")
LOADERS = ("torch", "ray")
PROGRESS = ("auto", "rich", "plain", "none")
STRATEGIES = ("ddp", "fsdp")
HEALTH = ("off", "warn", "exclude")
SHARDINGS = ("full", "grad-op", "hybrid")
LOADER_WORKERS = 2
"""The loader processes per rank where --data-workers is unset and the data is not in memory already."""
STOP_GRACE_S = 30.0
"""Seconds a stop (SIGTERM, SIGUSR1, Ctrl-C) waits for the ranks before it ends them, in `run` and
`launch` alike (torchrun's agent waits 30 too)."""


class ConfigError(ValueError):
    """A bad setting. The message is one line that names the fix."""


@dataclass(frozen=True)
class TrainConfig:
    # --- scale: what Ray Train's ScalingConfig gets ---
    workers: int = 2
    """Training workers (DDP ranks), one per GPU with --gpu. MIN:MAX makes the run elastic: it starts
    with as many as fit (at least MIN), goes on with fewer when a worker or node is lost, and grows
    back toward MAX when the cluster has room; each resize resumes from the latest checkpoint."""
    max_workers: int | None = None
    """The most workers of an elastic run (--workers MIN:MAX sets it); unset, the size is fixed."""
    resize_check_s: float = 30.0
    """Elastic runs: seconds between looks for room to grow."""
    gpu: bool = False
    """Train on GPUs with NCCL (--gpu) or on CPUs with gloo (--cpu)."""
    cpus_per_worker: int | None = None
    """CPUs reserved per worker; also its torch and OpenMP thread count. Default: with --gpu 1; on CPU
    an equal share of the cluster's CPUs, workers spread evenly over the nodes (1 with --loader ray,
    whose decode tasks need the rest)."""
    placement: str | None = None
    """Worker placement: pack (fill nodes in turn) or spread (one node each, as far as possible).
    Default: pack with --gpu or an explicit --cpus-per-worker, else spread."""
    address: str | None = None
    """Ray cluster address (GCS host:port). Default: $RAY_ADDRESS if set, else a private local Ray."""
    backend: str = "auto"
    """Process-group backend: auto (nccl with --gpu, else gloo), nccl or gloo."""
    wait_for_resources: float = 0.0
    """Seconds to wait for nodes still joining before failing a request the cluster cannot fit."""

    # --- model and data ---
    model: str = "convnet"
    """Model: convnet, resnet18, resnet50, or your own as PKG.MODULE:CALLABLE, called as
    CALLABLE(num_classes=, in_channels=) and returning an nn.Module."""
    dataset: str = "synthetic"
    """Dataset: synthetic, mnist, cifar10, tinyimagenet, imagefolder, parquet, or your own as
    PKG.MODULE:CALLABLE, called as CALLABLE(split="train"|"val", data_dir=, image_size=) and returning a
    map-style Dataset of (input tensor, class index)."""
    data_dir: str | None = None
    """Directory that holds the dataset's files (real datasets only); for parquet also an object
    store's URI, s3://BUCKET/PREFIX."""
    image_size: int = 32
    """Side of the square images fed to the model, in pixels."""
    num_classes: int = 10
    """Number of classes; real datasets must have labels below it."""
    train_samples: int | None = None
    """Synthetic train-set size (default 4096); for the built-in real datasets a cap on the samples
    used (default: all)."""
    val_samples: int | None = None
    """Synthetic validation-set size (default 1024); for the built-in real datasets a cap on the
    samples used (default: all)."""
    data_workers: int | None = None
    """DataLoader worker processes per training worker (0 = load in the training process). Unset: 2,
    or 0 where a sample reads in under 10 us (data in memory already, where workers only add the
    cost of moving each batch between processes)."""
    loader: str = "torch"
    """Ingest path: torch (DataLoader + DistributedSampler) or ray (Ray Data from Parquet shards)."""
    download: bool = False
    """Download the dataset into --data-dir first, where the dataset has a public source."""
    val_fraction: float = 0.1
    """Share of the training set held out for validation when the dataset has no val split."""
    skip_bad: bool = False
    """Skip corrupt or unreadable samples (and report how many) instead of stopping on the first."""

    # --- optimisation ---
    epochs: int = 3
    """Passes over the training set."""
    batch_size: int = 64
    """Batch size per worker per micro-batch; the global batch is batch_size x workers x grad_accum."""
    grad_accum: int = 1
    """Micro-batches per optimizer step; DDP all-reduces gradients only on the last of them."""
    global_batch_size: int | None = None
    """Samples per optimizer step over all workers; sets --grad-accum to global / (batch_size x
    workers), which must be a whole number."""
    lr: float = 0.05
    """Peak learning rate."""
    optimizer: str = "sgd"
    """Optimizer: sgd (with momentum) or adamw."""
    momentum: float = 0.9
    """SGD momentum."""
    weight_decay: float = 5e-4
    """Weight decay (decoupled for adamw)."""
    scheduler: str = "cosine"
    """LR schedule, stepped per optimizer step: none, step (x0.1 at 50% and 75% of epochs) or cosine."""
    warmup_epochs: float = 0.0
    """Epochs (fractions allowed) of linear LR warmup from ~0 to --lr, per optimizer step, before
    the schedule."""
    clip_grad_norm: float = 0.0
    """Clip the global gradient norm to this before each optimizer step (0 = off); unscaled first
    under fp16 AMP."""
    label_smoothing: float = 0.0
    """Label smoothing of the training loss (0 = off); validation loss is plain cross-entropy."""
    decay_norm_bias: bool = False
    """Apply weight decay to norm-layer and bias parameters too (default: only to weights of 2+
    dimensions, as most recipes do)."""
    amp: bool = True
    """Mixed precision on GPU: bf16 where supported, else fp16 with a GradScaler. Ignored on CPU."""
    strategy: str = "ddp"
    """Data parallelism: ddp (every rank holds the whole model, gradients and optimizer state) or fsdp
    (FSDP2: each rank holds a shard of them, gathered per block when needed; for models that do not
    fit one device, or to free its memory)."""
    sharding: str = "full"
    """With --strategy fsdp: full (parameters, gradients and optimizer state sharded, as ZeRO-3),
    grad-op (parameters kept whole from forward to backward, as ZeRO-2) or hybrid (sharded within a
    node, replicated across nodes)."""
    find_unused_parameters: bool = False
    """Let DDP find parameters that get no gradient on a step (a model whose forward skips layers
    or branches); costs a graph walk per step. Built-in models never need it."""
    compile: bool = False
    """torch.compile the model: a compile of a minute or so on each worker, then faster steps (GPU)."""
    seed: int = 0
    """Seed for the model, the synthetic data and the sampler's shuffle."""

    # --- never lose work ---
    checkpoint_every_steps: int = 0
    """Also checkpoint every N optimizer steps within an epoch (0 = at the end of each epoch only)."""
    keep_checkpoints: int = 2
    """How many of the latest checkpoints to keep."""
    resume: bool = True
    """Resume from the latest checkpoint of --storage-path/--name if there is one (--no-resume: start
    fresh, moving the old run directory aside)."""
    max_failures: int = 0
    """Worker-group failures (a dead node, a killed worker) to recover from the latest checkpoint."""
    stall_timeout: float | None = None
    """Seconds without a finished training step (or, in an epoch's validation, without it moving;
    checkpoint writing not counted; under `launch`, without a change in any rank's Python stack while
    one waits in a collective) after which the run is stalled: the driver dumps every rank's Python
    stack to <run dir>/stall/, names the rank that is not where the others wait, and fails the run at
    once instead of waiting out the collective timeout. Default: the longer of 120 s and 10x the
    slowest recent step (launch: 120 s); 0 turns the watch off. Under --max-failures or --workers
    MIN:MAX a stall is a failure: the ranks are ended and restart from the latest checkpoint (launch:
    the scripts restart; each stall's stacks in stall/, stall-2/, ...; listed in summary.json)."""
    stop_grace_s: float = STOP_GRACE_S
    """After SIGTERM, SIGUSR1 or Ctrl-C, seconds of training steps the ranks have to reach their next
    agreed step (checkpoint writing not counted; in an epoch's validation, only seconds in which it did
    not move); past it the run is stalled: the driver dumps
    every rank's stack to <run dir>/stall/, ends the ranks and stops anyway, keeping the last
    checkpoint."""
    health: str = "warn"
    """Pre-flight health check, once the ranks meet and before any data or model: every rank times a
    short GEMM and each node an exchange with a few others (about a second). warn: a node far below
    the other nodes' median is named in one line, and the run trains on; exclude: the run stops before
    its first step and records the node in <run dir>/bad_nodes.json (a requeued Slurm job leaves it
    out); off: no check."""

    # --- run identity and outputs ---
    storage_path: str = "./runs"
    """Where run directories go: a path all nodes share on a multi-node cluster, or an object store's URI
    (s3://bucket/prefix)."""
    name: str | None = None
    """Run name, the directory under --storage-path. Default: run-YYYYmmdd-HHMMSS."""
    progress: str = "auto"
    """Driver progress display: rich bar, plain lines, or none. auto = rich on a TTY, else plain. The
    rich display also says, until the first step, what the start waits for (stage and seconds)."""
    verbose: bool = False
    """Show Ray's own logs."""
    tensorboard: bool = False
    """Also write TensorBoard event files to <run dir>/tensorboard (needs the tensorboard package)."""
    mlflow: bool = False
    """Log the config, every metrics.csv column per epoch and summary.json to MLflow: $MLFLOW_TRACKING_URI,
    else a local store in the run directory (pip install 'raytrain-ddp[mlflow]')."""
    mlflow_experiment: str = "raytrain"
    """MLflow experiment the run is logged under (the MLflow run is named after --name)."""
    wandb: bool = False
    """Log the same to Weights & Biases, honouring WANDB_PROJECT, WANDB_MODE=offline and the other
    WANDB_* settings (pip install 'raytrain-ddp[wandb]')."""
    profile: str | None = None
    """Profile micro-batches of the first epoch with torch.profiler, as WAIT:WARMUP:ACTIVE, e.g. 5:2:3
    (skip 5, warm up 2, record 3). Each rank writes a trace to <run dir>/profile/ (TensorBoard's
    profiler view, Perfetto) and prints one line: data wait, compute and communication shares of the
    step, and the top ops. It changes nothing that is trained."""

    def __post_init__(self) -> None:
        _check_types(self)
        for key in ("workers", "cpus_per_worker", "image_size", "epochs", "batch_size", "grad_accum", "global_batch_size"):
            if getattr(self, key) is not None and getattr(self, key) < 1:
                raise ConfigError(f"{_flag(key)} must be at least 1 (got {getattr(self, key)})")
        if self.num_classes < 2:
            raise ConfigError(f"--num-classes must be at least 2 (got {self.num_classes})")
        if self.keep_checkpoints < 1:
            raise ConfigError(f"--keep-checkpoints must be at least 1 (got {self.keep_checkpoints})")
        for key in ("train_samples", "val_samples", "data_workers", "checkpoint_every_steps", "max_failures"):
            if getattr(self, key) is not None and getattr(self, key) < 0:
                raise ConfigError(f"{_flag(key)} must be 0 or more (got {getattr(self, key)})")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ConfigError(f"--lr must be a positive number (got {self.lr})")
        if not 0 <= self.momentum < 1:
            raise ConfigError(f"--momentum must be in [0, 1) (got {self.momentum})")
        if not 0 < self.val_fraction < 1:
            raise ConfigError(f"--val-fraction must be between 0 and 1 (got {self.val_fraction})")
        if self.wait_for_resources < 0:
            raise ConfigError(f"--wait-for-resources must be 0 or more (got {self.wait_for_resources})")
        if self.weight_decay < 0:
            raise ConfigError(f"--weight-decay must be 0 or more (got {self.weight_decay})")
        for key in ("warmup_epochs", "clip_grad_norm", "stop_grace_s"):
            if not (getattr(self, key) >= 0 and math.isfinite(getattr(self, key))):
                raise ConfigError(f"{_flag(key)} must be 0 or more (got {getattr(self, key)})")
        if self.warmup_epochs > self.epochs:
            raise ConfigError(f"--warmup-epochs {self.warmup_epochs} is longer than --epochs {self.epochs}; shorten it")
        if not 0 <= self.label_smoothing < 1:
            raise ConfigError(f"--label-smoothing must be in [0, 1) (got {self.label_smoothing})")
        if self.max_workers is not None and self.max_workers < self.workers:
            raise ConfigError(f"--workers {self.workers}:{self.max_workers} has MAX below MIN; swap them")
        if self.stall_timeout is not None and not (0 <= self.stall_timeout < math.inf):
            raise ConfigError(f"--stall-timeout must be 0 (off) or a number of seconds (got {self.stall_timeout})")
        if self.resize_check_s <= 0:
            raise ConfigError(f"--resize-check-s must be positive (got {self.resize_check_s})")
        if self.global_batch_size is not None:
            if self.grad_accum != 1:
                raise ConfigError("give --global-batch-size or --grad-accum, not both (the first sets the second)")
            for world_size in range(self.workers, (self.max_workers or self.workers) + 1):
                per_step = self.batch_size * world_size
                if self.global_batch_size % per_step:
                    workers = f"--workers {world_size}" if self.max_workers is None else f"{world_size} workers (within --workers MIN:MAX)"
                    raise ConfigError(
                        f"--global-batch-size {self.global_batch_size} is not a multiple of --batch-size x {workers} "
                        f"= {per_step}; pick a multiple, e.g. {per_step * max(1, round(self.global_batch_size / per_step))}"
                    )
        for key, choices in (
            ("optimizer", OPTIMIZERS),
            ("scheduler", SCHEDULERS),
            ("backend", BACKENDS),
            ("placement", PLACEMENTS),
            ("progress", PROGRESS),
            ("loader", LOADERS),
            ("strategy", STRATEGIES),
            ("sharding", SHARDINGS),
            ("health", HEALTH),
        ):
            if getattr(self, key) not in choices and not (key == "placement" and self.placement is None):
                raise ConfigError(
                    f"{_flag(key)} must be one of {', '.join(choices)} (got {getattr(self, key)!r})"
                )
        if self.sharding != "full" and self.strategy != "fsdp":
            raise ConfigError(f"--sharding {self.sharding} needs --strategy fsdp; add it, or drop --sharding")
        if self.find_unused_parameters and self.strategy == "fsdp":
            raise ConfigError("--find-unused-parameters is DDP's; FSDP needs no search, drop it with --strategy fsdp")
        if self.backend == "nccl" and not self.gpu:
            raise ConfigError("--backend nccl needs --gpu; use --backend gloo (or auto) on CPU")
        self.profile_steps  # a bad --profile fails here, in one line
        if self.name is not None and (not self.name or "/" in self.name or self.name in (".", "..")):
            raise ConfigError(f"--name must be a plain directory name (got {self.name!r})")

    def accum_steps(self, world_size: int) -> int:
        """Micro-batches per optimizer step at this world size: --grad-accum, or what
        --global-batch-size implies (so a resized run keeps its global batch)."""
        if self.global_batch_size is None:
            return self.grad_accum
        return self.global_batch_size // (self.batch_size * world_size)

    @property
    def profile_steps(self) -> tuple[int, int, int] | None:
        """--profile as (wait, warmup, active) micro-batches, or None when off."""
        if self.profile is None:
            return None
        match = re.fullmatch(r"\s*(\d+):(\d+):(\d+)\s*", self.profile)
        if match is None or int(match.group(3)) < 1:
            raise ConfigError(
                f"--profile takes WAIT:WARMUP:ACTIVE micro-batches with ACTIVE at least 1, e.g. 5:2:3 (got {self.profile!r})"
            )
        wait, warmup, active = map(int, match.groups())
        return wait, warmup, active

    @property
    def elastic(self) -> bool:
        return self.max_workers is not None

    @property
    def resolved_backend(self) -> str:
        if self.backend == "auto":
            return "nccl" if self.gpu else "gloo"
        return self.backend

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> TrainConfig:
        unknown = sorted(set(values) - {f.name for f in fields(cls)})
        if unknown:
            raise ConfigError(
                f"unknown config key(s): {', '.join(unknown)}; valid keys are the `raytrain run` "
                "flags with _ for -, see `raytrain run --help`"
            )
        return cls(**values)


def _flag(key: str) -> str:
    return "--" + key.replace("_", "-")


def _check_types(cfg: TrainConfig) -> None:
    """Reject wrong types from config files; YAML happily gives "3" or 3.5 where an int belongs."""
    for f in fields(cfg):
        value = getattr(cfg, f.name)
        kinds = FIELD_TYPES[f.name]
        if value is None and type(None) in kinds:
            continue
        # bool is an int subclass in Python; an int field must not take True.
        ok = any(type(value) is k for k in kinds) or (float in kinds and type(value) is int)
        if not ok:
            wanted = " or ".join(k.__name__ for k in kinds if k is not type(None))
            raise ConfigError(f"{_flag(f.name)} must be {wanted} (got {value!r})")
        if float in kinds and type(value) is int:
            object.__setattr__(cfg, f.name, float(value))
        if type(value) is float and not math.isfinite(value):  # nan passes (and fails) every comparison below
            raise ConfigError(f"{_flag(f.name)} must be a finite number (got {value})")


def _types_of(annotation: str) -> tuple[type, ...]:
    names = {"int": int, "float": float, "bool": bool, "str": str, "None": type(None)}
    return tuple(names[part.strip()] for part in annotation.split("|"))


FIELD_TYPES: dict[str, tuple[type, ...]] = {
    f.name: _types_of(f.type) for f in fields(TrainConfig)  # annotations are strings here
}


FLAG_SPELLINGS: dict[str, list[str]] = {
    "workers": ["--workers", "-w"],
    "gpu": ["--gpu/--cpu"],
    "amp": ["--amp/--no-amp"],
    "verbose": ["--verbose/--quiet"],
}
"""Flags whose spelling is not simply --field-name (scripts and docs rely on these)."""


def flag_decls(name: str) -> list[str]:
    """A field's flag as typer declares it, long form first: --field-name, or --name/--no-name for a bool."""
    if name in FLAG_SPELLINGS:
        return FLAG_SPELLINGS[name]
    flag = _flag(name)
    return [flag + (f"/--no-{flag[2:]}" if FIELD_TYPES[name] == (bool,) else "")]


def as_flag(name: str, value: Any) -> list[str]:
    """A field's value as the words `raytrain run` takes for it: --field VALUE, or --name/--no-name's
    half for a bool; none for None. A float keeps every digit it ran with."""
    if value is None:
        return []
    decl = flag_decls(name)[0]
    if FIELD_TYPES[name] == (bool,):
        on, off = decl.split("/")
        return [on if value else off]
    if isinstance(value, (list, tuple)):
        value = ",".join(map(str, value))
    return [decl, repr(value) if isinstance(value, float) else str(value)]


def run_flags(cfg: TrainConfig) -> list[str]:
    """`raytrain run` flags that rebuild `cfg`: each value that differs from the default."""
    defaults = TrainConfig()
    return [word for f in fields(TrainConfig) if getattr(cfg, f.name) != getattr(defaults, f.name)
            for word in as_flag(f.name, getattr(cfg, f.name))]


def flag_spellings() -> dict[str, tuple[str, bool | None]]:
    """Each run flag's every spelling -> (its field, the bool it sets, or None for a flag that takes a value)."""
    out: dict[str, tuple[str, bool | None]] = {}
    for name in FIELD_TYPES:
        for decl in flag_decls(name):
            if "/" in decl:
                on, off = decl.split("/")
                out[on], out[off] = (name, True), (name, False)
            else:
                out[decl] = (name, None)
    return out


@functools.cache
def field_docs() -> dict[str, str]:
    """Each field's docstring, read from this file, so `--help` and the docs never drift apart."""
    tree = ast.parse(inspect.getsource(TrainConfig))
    body = tree.body[0].body
    docs = {}
    for node, after in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(after, ast.Expr):
            docs[node.target.id] = inspect.cleandoc(after.value.value)
    return docs


def load_yaml(text: str) -> Any:
    """YAML read as a config means it: 1e-4 is a number. PyYAML follows YAML 1.1, which wants a dot
    (1.0e-4) and would hand back the string '1e-4'."""
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_implicit_resolver(
        "tag:yaml.org,2002:float", re.compile(r"^[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+$"), list("-+0123456789")
    )
    return yaml.load(text, Loader=Loader)


def load_file(path: str | Path) -> dict[str, Any]:
    """Read a YAML or TOML config file into a dict of TrainConfig keys (dashes allowed)."""
    path = Path(path)
    if path.suffix not in (".toml", ".yaml", ".yml"):
        raise ConfigError(f"config file {path} must end in .yaml, .yml or .toml")
    try:
        text = path.read_text()
    except OSError as err:
        raise ConfigError(f"cannot read config file {path}: {err.strerror}; check --config") from None
    try:
        if path.suffix == ".toml":
            values = tomllib.loads(text)
        else:
            values = load_yaml(text) or {}
    except Exception as err:  # tomllib.TOMLDecodeError or yaml.YAMLError
        raise ConfigError(f"config file {path} does not parse: {str(err).splitlines()[0]}") from None
    if not isinstance(values, dict):
        raise ConfigError(f"config file {path} must hold a mapping of keys to values")
    return {str(k).replace("-", "_"): v for k, v in values.items()}


def resolve(file: str | Path | None, flags: dict[str, Any]) -> TrainConfig:
    """Defaults, then the config file, then the flags the user actually gave (not None)."""
    values = load_file(file) if file else {}
    values.update({k: v for k, v in flags.items() if v is not None})
    if isinstance(values.get("workers"), str):  # --workers N or MIN:MAX, from the CLI or a file
        values.update(parse_workers(values["workers"]))
    return TrainConfig.from_dict(values)


def parse_workers(text: str) -> dict[str, int]:
    """"4" -> workers 4; "2:8" -> workers 2, max_workers 8 (an elastic run)."""
    match = re.fullmatch(r"\s*(\d+)\s*(?::\s*(\d+)\s*)?", text)
    if match is None:
        raise ConfigError(f"--workers takes N or MIN:MAX, e.g. 4 or 2:8 (got {text!r})")
    low, high = match.groups()
    return {"workers": int(low)} | ({"max_workers": int(high)} if high else {})


def dumps(cfg: TrainConfig) -> str:
    return json.dumps(cfg.to_dict(), indent=2)
