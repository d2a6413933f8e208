"""A controller callback of Ray Train's: Ray has no public hook before it resizes a worker group.
RunConfig hands callbacks that are not UserCallbacks to the controller as they are, for such uses."""

from __future__ import annotations

from typing import Any, Callable

from ray.train.v2._internal.execution.callback import ControllerCallback


class BeforeResize(ControllerCallback):
    """In Ray Train's controller, before it resizes the worker group: `notice(new_size)`, which may
    block until the running ranks have stopped."""

    def __init__(self, notice: Callable[[int], None]) -> None:
        self.notice = notice

    def before_controller_execute_resize_decision(self, resize_decision: Any) -> None:
        try:
            self.notice(resize_decision.num_workers)
        except Exception:  # never fail the controller over a notice: at worst, Ray Train's kill as before
            pass
