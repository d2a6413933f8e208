"""What the installed Ray can carry: the features that need more of Ray than the core, each checked by
the names it needs (not by the version number), and the lines that refuse one or say it is off."""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass

from raytrain_ddp.config import ConfigError


@dataclass(frozen=True)
class Feature:
    what: str
    """What the user asked for or goes without, as a line names it."""
    since: str
    """The first Ray release that has what it needs (checked by `names`, not by this number)."""
    names: tuple[str, ...]
    """`module:attribute` (or a bare module) that must exist for it: checked, not assumed from the version."""


FEATURES = {
    "elastic": Feature("--workers MIN:MAX", "2.55", (
        "ray.train.v2._internal.execution.scaling_policy:ElasticScalingPolicy",
        "ray.train.v2._internal.execution.scaling_policy:ResizeDecision",
        "ray.train.v2._internal.execution.callback:ControllerCallback",
    )),
    "drain_notices": Feature("drain notices (a checkpoint when Ray drains a node)", "2.58", (
        "ray.train:get_preemption_info",
    )),
    "fast_start": Feature("the fast start", "2.52", (
        "ray.train.v2._internal.execution.controller:TrainController",
        "ray.train.v2._internal.constants:get_env_vars_to_propagate",
        "ray.train.v2.api.data_parallel_trainer:DataParallelTrainer._initialize_and_run_controller",
        "ray.train.v2.api.data_parallel_trainer:DataParallelTrainer._register_sigint_handler",
    )),
}
"""The features that need more of Ray than the core (a fixed-size run or launch, resume, Ctrl-C,
SIGTERM), by the name the code asks for them."""


def ray_version() -> str:
    import ray

    return ray.__version__


def has(module_attr: str) -> bool:
    """Whether `module:attr.sub` exists in the installed Ray."""
    module, _, attrs = module_attr.partition(":")
    try:
        obj = importlib.import_module(module)
        for attr in filter(None, attrs.split(".")):
            obj = getattr(obj, attr)
    except (ImportError, AttributeError):
        return False
    return True


@functools.cache
def supports(feature: str) -> bool:
    return all(has(name) for name in FEATURES[feature].names)


def refusal(feature: str, installed: str) -> str:
    f = FEATURES[feature]
    return f"{f.what} needs Ray >= {f.since}; this is {installed}: pip install 'ray[default,train]>={f.since}'"


def require(feature: str) -> None:
    """Refuse, in one line (exit 2), a feature the installed Ray cannot carry."""
    if not supports(feature):
        raise ConfigError(refusal(feature, ray_version()))


def going_without(features: tuple[str, ...] = ("fast_start", "drain_notices")) -> str | None:
    """The line a run prints once at start when the installed Ray switches some of `features` off."""
    off = [f"{FEATURES[f].what} (Ray >= {FEATURES[f].since})" for f in features if not supports(f)]
    return f"Ray {ray_version()} runs without {', '.join(off)}" if off else None


def node_draining() -> bool:
    """On a rank: whether Ray is draining its node (a spot reclaim, `ray drain-node`). False where the
    installed Ray cannot tell (the run then goes without drain notices; going_without says so)."""
    if not supports("drain_notices"):
        return False
    import ray.train

    return ray.train.get_preemption_info() is not None
