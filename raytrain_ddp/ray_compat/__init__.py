"""The one door to Ray's internals, and what the installed Ray can carry.

Every private Ray name the package uses (`ray._private`, `ray.*._internal`, a subclass of a private
class, an overridden private method) is imported in this folder and nowhere else
(tests/test_layout.py holds that wall). Each is imported lazily, at the point of use, and checked
there: where one is missing, Ray's stock behaviour takes over (the stock TorchTrainer start, Ray's
elastic policy, no drain notices), so an older or newer Ray breaks at most the feature that needs
the name, never every command.

- `features`: what the installed Ray can carry (FEATURES), checked by the names each feature needs.
- `controller`: the fast start (Ray Train's controller without its runtime_env, torch or idle actors),
  the clean-up of a dead controller's placement groups, and the stop of a running one before the
  driver leaves its fit.
- `elastic`: Ray's elastic scaling policy, counting only the nodes that stay.
- `fixed_size`: Ray's fixed-size scaling policy, without the resource requests to Ray Data's
  AutoscalingCoordinator on a cluster that cannot scale.
- `callbacks`: a hook in Ray Train's controller before it resizes a worker group.
- `state`: what the GCS knows that Ray has no public call for (draining nodes, token auth, the
  cluster's Ray version, a local GPU's memory, who made each placement group), and token auth
  turned on in a process that imported Ray already (`use_token_auth`).
- `snapshot`: which Ray release Ray Train's run snapshot says wrote it, so a resume knows when
  Ray would refuse the snapshot and our own checkpoint files must serve instead.

A feature that needs a newer Ray is refused in one line (`require`), and what a run goes without
is said once at its start (`going_without`). This package must not import torch: Ray Train's
controller unpickles from it.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

from raytrain_ddp.ray_compat.features import (  # noqa: F401  (the door's face)
    FEATURES,
    going_without,
    has,
    node_draining,
    ray_version,
    require,
    supports,
)


def fast(trainer_class: type) -> type:
    """`trainer_class` (TorchTrainer or DataParallelTrainer) with the fast start (controller.py), or
    the class itself where the installed Ray lacks what the fast start needs."""
    if not supports("fast_start"):
        return trainer_class
    from raytrain_ddp.ray_compat.controller import FastStart

    return type(trainer_class.__name__, (FastStart, trainer_class), {"__module__": FastStart.__module__})


def stop_running_fit(fit: threading.Thread) -> None:
    """Before a driver leaves a fit that still runs on thread `fit`: its controller stopped, and its
    placement groups removed (controller.stop_running_controller says why); nothing where the fast
    start started none."""
    if not supports("fast_start"):
        return
    from raytrain_ddp.ray_compat.controller import stop_running_controller

    stop_running_controller(fit)


def before_resize(notice: Callable[[int], None]) -> Any:
    """A RunConfig callback that calls `notice(new_size)` in Ray Train's controller before it resizes
    the worker group (callbacks.py); elastic runs only, which `require("elastic")` has let through."""
    from raytrain_ddp.ray_compat.callbacks import BeforeResize

    return BeforeResize(notice)
