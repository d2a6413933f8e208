"""A sweep's search space: `--space space.yaml`, checked against the base config, and the trials it makes.

Each key of the file is a TrainConfig field; each value is one of

    lr: {loguniform: [1e-4, 1e-1]}      # ranges take [lo, hi]
    momentum: {uniform: [0.8, 0.99]}
    epochs: {randint: [2, 6]}           # hi excluded, as in Ray Tune
    model: {choice: [convnet, resnet18]}
    workers: {grid: [1, 2]}             # every sample runs each grid value

The space becomes Ray Tune's own domains, and Tune's BasicVariantGenerator draws the trials, so a
seed gives the same list in a dry run, in the sweep and in a resumed sweep.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from ray import tune
from ray.tune.search import BasicVariantGenerator

from raytrain_ddp.config import FIELD_TYPES, ConfigError, TrainConfig, flag_decls, load_yaml

RANGES = ("loguniform", "uniform", "randint")
LISTS = ("choice", "grid")
KINDS = RANGES + LISTS

FIXED: dict[str, str] = {
    "name": "the sweep names each trial's run, P/NAME/trials/<trial>",
    "storage_path": "every trial's run lives under the sweep's directory",
    "address": "a sweep runs all its trials on one Ray cluster",
    "resume": "the sweep decides each trial's resume, so that a resumed sweep continues exactly",
    "progress": "one driver shows every trial",
    "verbose": "one driver shows every trial's logs",
    "wait_for_resources": "the sweep waits for the cluster once, before it packs the trials",
    "gpu": "the sweep packs every trial's workers onto one kind of device",
    "max_workers": "an elastic trial would grow into room the sweep packs other trials into",
    "mlflow": "the trackers log every trial or none, so the sweep's group is whole",
    "wandb": "the trackers log every trial or none, so the sweep's group is whole",
    "mlflow_experiment": "the sweep groups its trials under one MLflow experiment",
}
"""Fields a trial may not vary, and why: they name, place or display the sweep as a whole."""

GANG = ("workers", "cpus_per_worker")
"""Fields that size a trial's gang: only a known list of values, so the packing can plan for the largest."""


@dataclass(frozen=True)
class SweepSpace:
    params: dict[str, tuple[str, list[Any]]]
    """Field -> (kind, args), in the file's order."""
    source: Path
    """The --space file it was read from."""

    def tune_space(self) -> dict[str, Any]:
        """The space as Ray Tune's domains (grid as tune.grid_search)."""
        build = {
            "loguniform": lambda args: tune.loguniform(*args),
            "uniform": lambda args: tune.uniform(*args),
            "randint": lambda args: tune.randint(*args),
            "choice": tune.choice,
            "grid": tune.grid_search,
        }
        return {key: build[kind](list(args)) for key, (kind, args) in self.params.items()}

    @property
    def grid_size(self) -> int:
        """Trials per sample: the product of the grid keys' lengths (1 without grid keys)."""
        return math.prod(len(args) for kind, args in self.params.values() if kind == "grid")


def load_space(path: str | Path, base: TrainConfig) -> SweepSpace:
    """Read --space and check every key and value against `base`, the sweep's base config."""
    path = Path(path)
    if path.suffix not in (".yaml", ".yml"):
        raise ConfigError(f"sweep space {path} must be a YAML file ending in .yaml or .yml")
    try:
        text = path.read_text()
    except OSError as err:
        raise ConfigError(f"cannot read sweep space {path}: {err.strerror}; check --space") from None
    try:
        values = load_yaml(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)  # the line PyYAML gave up on; its first line is only context
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(f"sweep space {path} does not parse: {getattr(err, 'problem', None) or err}{at}") from None
    if not isinstance(values, dict) or not values:
        raise ConfigError(
            f"sweep space {path} must map config fields to ranges, e.g. lr: {{loguniform: [1e-4, 1e-1]}}"
        )
    params = {}
    for raw, value in values.items():
        key = str(raw).replace("-", "_")
        if key in params:  # batch-size and batch_size are one field; YAML would keep the last silently
            raise ConfigError(f"{path}: {key}: given twice; keep one")
        params[key] = _check(path, key, value, base)
    return SweepSpace(params, path)


def _check(path: Path, key: str, value: Any, base: TrainConfig) -> tuple[str, list[Any]]:
    """One key of the space, checked; returns (kind, args)."""
    where = f"{path}: {key}:"
    if key not in FIELD_TYPES:
        near = difflib.get_close_matches(key, FIELD_TYPES, n=1)
        hint = f"did you mean {near[0]}?" if near else "keys are `raytrain run` flags with _ for -"
        raise ConfigError(f"{where} not a config field; {hint}")
    if key in FIXED:
        raise ConfigError(
            f"{where} cannot vary between trials ({FIXED[key]}); set {flag_decls(key)[0]} once, for the whole sweep"
        )
    if not (isinstance(value, dict) and len(value) == 1 and next(iter(value)) in KINDS):
        raise ConfigError(
            f"{where} give exactly one of {{loguniform: [lo, hi]}}, {{uniform: [lo, hi]}}, {{randint: [lo, hi]}}, "
            f"{{choice: [a, b, ...]}} or {{grid: [a, b, ...]}} (got {value!r})"
        )
    kind, args = next(iter(value.items()))
    if kind in LISTS:
        if not isinstance(args, list) or not args:
            raise ConfigError(f"{where} {kind} takes a non-empty list of values, e.g. [32, 64] (got {args!r})")
        if key in GANG and not all(type(v) is int for v in args):
            raise ConfigError(f"{where} {kind} takes whole numbers here, e.g. [1, 2] (got {args!r})")
        for v in args:
            _check_value(where, base, key, v)
        return kind, args
    if key in GANG:
        raise ConfigError(
            f"{where} sizes each trial's gang, which the sweep packs by the largest; "
            f"give it as {{choice: [...]}} or {{grid: [...]}} of whole numbers"
        )
    _check_range(where, key, kind, args)
    lo, hi = args
    for v in (lo, hi - 1 if kind == "randint" else hi):  # randint never draws hi
        _check_value(where, base, key, v)
    return kind, [float(lo), float(hi)] if kind != "randint" else [lo, hi]


def _check_range(where: str, key: str, kind: str, args: Any) -> None:
    kinds = FIELD_TYPES[key]
    if int not in kinds and float not in kinds:
        raise ConfigError(f"{where} {kind} needs a number field; vary {key} with choice or grid")
    if not (isinstance(args, list) and len(args) == 2 and all(_is_number(v) for v in args)):
        raise ConfigError(f"{where} {kind} takes [lo, hi], two finite numbers (got {args!r})")
    lo, hi = args
    if kind == "randint" and not all(type(v) is int for v in args):
        raise ConfigError(f"{where} randint takes two whole numbers [lo, hi], hi excluded (got {args!r})")
    if kind != "randint" and float not in kinds:
        raise ConfigError(f"{where} {kind} draws fractions for a whole-number field; use randint [lo, hi]")
    if lo >= hi:
        raise ConfigError(f"{where} {kind} needs lo < hi (got [{lo}, {hi}]); swap or widen them")
    if kind == "loguniform" and lo <= 0:
        raise ConfigError(f"{where} loguniform needs lo > 0 (got {lo}); use uniform for a range from 0")


def _check_value(where: str, base: TrainConfig, key: str, value: Any) -> None:
    """A value TrainConfig itself refuses is refused here, with the key in front."""
    try:
        dataclasses.replace(base, **{key: value})
    except ConfigError as err:
        raise ConfigError(f"{where} {err}") from None


def _is_number(value: Any) -> bool:
    return type(value) in (int, float) and math.isfinite(value)  # type(): True is an int to Python


def sample_trials(space: SweepSpace, trials: int, seed: int | None) -> list[dict[str, Any]]:
    """The trials the sweep runs, in order: Ray Tune's BasicVariantGenerator over the space, with
    num_samples=trials, so trials x grid_size of them. The same seed gives the same list."""
    if trials < 1:
        raise ConfigError(f"--trials must be at least 1 (got {trials})")
    if seed is not None and seed < 0:
        raise ConfigError(f"the sweep's seed must be 0 or more (got {seed})")
    generator = BasicVariantGenerator(random_state=seed)
    # Tune's Experiment marks its storage as it is built; the trials are ours to run, so it gets a
    # scratch directory that goes with it.
    with tempfile.TemporaryDirectory(prefix="raytrain-sweep-space-") as scratch:
        experiment = tune.Experiment(
            "space", _trainable, config=space.tune_space(), num_samples=trials, storage_path=scratch
        )
        generator.add_configurations(experiment)
        configs = []
        while (trial := generator.next_trial()) is not None:
            configs.append({key: trial.config[key] for key in space.params})
    return configs


def _trainable(config: dict[str, Any]) -> None:
    """Tune's Experiment wants a trainable to name; the sweep runs each trial as a run of its own."""


def describe(space: SweepSpace) -> str:
    """One line: "lr loguniform 1e-4..1e-1, batch_size choice [32, 64], workers grid [1, 2]"."""
    parts = []
    for key, (kind, args) in space.params.items():
        if kind == "loguniform":
            text = f"{_sci(args[0])}..{_sci(args[1])}"
        elif kind == "uniform":
            text = f"{args[0]:g}..{args[1]:g}"
        elif kind == "randint":
            text = f"[{args[0]}, {args[1]})"
        else:
            text = "[" + ", ".join(_plain(v) for v in args) + "]"
        parts.append(f"{key} {kind} {text}")
    return ", ".join(parts)


def _sci(value: float) -> str:
    """1e-4 rather than 0.0001: a log range reads by its exponents."""
    mantissa, exponent = f"{value:e}".split("e")
    return f"{mantissa.rstrip('0').rstrip('.')}e{int(exponent)}"


def _plain(value: Any) -> str:
    """A value as it is written in YAML."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)
