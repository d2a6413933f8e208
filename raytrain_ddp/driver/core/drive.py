"""The driver core that every command which trains shares (`run`, `launch`): the signals, fit() on a
thread of its own and the loop that watches it, the driver's actors on its node, and summary.json.

A command plans (preflight.py), builds its trainer, then hands it to `drive` with two functions of
its own: `poll`, which fetches the ranks' news and shows it, and `stop`, which passes a stop on to
the ranks. Everything else about watching a run is here, once.
"""

from __future__ import annotations

import signal
import threading
import time
from typing import Any, Callable

from raytrain_ddp import ray_compat
from raytrain_ddp.driver.core.startup import stages, stages_line, summary as startup_summary
from raytrain_ddp.driver.plan.preflight import RunPlan
from raytrain_ddp.driver.session.connect import LOST_SETTLE_S, ray_lost
from raytrain_ddp.run_files import write_json
from raytrain_ddp.stops import RayLost, Stopped

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)
"""Ctrl-C; scancel, a time limit, `raytrain stop`; Slurm's --signal=B:USR1@grace notice."""


class Signals:
    """The command's SIGINT, SIGTERM and SIGUSR1, from the moment it starts until it ends.

    The handler only notes a signal; the driver's loop acts on it (`news`). So no request is lost
    inside a Ray call that the signal interrupted, and no Ray call runs inside a handler. Until the
    ranks run (`live`), a Ctrl-C interrupts the command as usual: there is nothing to stop. The
    handlers that were there before come back after, for the Python API's callers. Only the main
    thread may set handlers; elsewhere (a thread of the caller's) this notes nothing.
    """

    def __init__(self) -> None:
        self.received: list[str] = []
        """Each signal's name (SIGINT, SIGTERM, SIGUSR1), in the order they came."""
        self.acted = 0
        """How many of `received` the driver has acted on."""
        self.live = False
        """Set once fit() runs: from then on a Ctrl-C is the run's to stop."""
        self.previous: dict[int, Any] = {}

    def __enter__(self) -> Signals:
        self.install()
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, old in self.previous.items():
            signal.signal(sig, old)

    def install(self) -> None:
        """(Again: ray.init puts its own SIGTERM handler in.)"""
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in STOP_SIGNALS:
            old = signal.signal(sig, self.handler)
            self.previous.setdefault(sig, old)

    def handler(self, signum: int, _frame: Any) -> None:
        if signum == signal.SIGINT and not self.live:
            raise KeyboardInterrupt
        self.received.append(signal.Signals(signum).name)

    def stop_before_start(self) -> None:
        """Before any rank started: put the handlers back (ray.init puts in Ray's C++ one for SIGTERM,
        which prints a stack and aborts), and end the command for a signal that came: nothing to stop."""
        self.install()
        if self.received:
            raise Stopped(f"got {self.first} before any rank started; nothing to stop")

    def ask(self, name: str) -> None:
        """A stop asked for from another thread, as if signal `name` had come (a sweep stopping its trial)."""
        self.received.append(name)

    @property
    def first(self) -> str | None:
        return self.received[0] if self.received else None

    def news(self) -> list[tuple[str, list[str]]]:
        """The signals not acted on yet, each with the ones that came before it."""
        fresh = [(self.received[i], self.received[:i]) for i in range(self.acted, len(self.received))]
        self.acted += len(fresh)
        return fresh


def drive(trainer: Any, signals: Signals, poll: Callable[[], None], stop: Callable[[str, list[str]], None],
          every_s: float) -> BaseException | None:
    """Run trainer.fit() on a thread of its own (FitThread, so our SIGINT handler stays in
    place) and watch it: every `every_s`, `poll()` the ranks' news, and pass each signal on as
    `stop(name, signals before it)`. A last poll after fit() returns catches the news that came with its end.
    Returns fit()'s error, for the command to judge; raises RayLost when the cluster went away, in place
    of whatever Ray's calls raised then."""
    fit = FitThread(trainer)
    signals.live = True
    fit.start()
    try:
        return watch(fit, signals, poll, stop, every_s)
    finally:
        if fit.is_alive() and not ray_lost():  # the driver leaves a fit that still runs: its own error, a stall
            ray_compat.stop_running_fit(fit)


def watch(fit: FitThread, signals: Signals, poll: Callable[[], None], stop: Callable[[str, list[str]], None],
          every_s: float) -> BaseException | None:
    """drive's loop, until fit() returns or the watch raises."""
    try:
        try:
            while fit.is_alive():
                if lost := ray_lost():
                    raise RayLost(lost)
                poll()
                for name, before in signals.news():
                    stop(name, before)
                fit.join(every_s)
            for name, before in signals.news():  # one that came as fit() ended still gets its answer
                stop(name, before)
        finally:
            if not ray_lost():
                poll()
    except RayLost:
        raise
    except Exception as err:
        if lost := ray_lost(settle_s(err)):
            raise RayLost(lost) from None
        raise
    if fit.error is not None and (lost := ray_lost(settle_s(fit.error))):
        raise RayLost(lost)
    return fit.error


def settle_s(err: BaseException) -> float:
    """How long an error waits for the cluster's loss to show: Ray's errors may be its first sign (a
    call to an actor on a dead raylet fails at once); ours (a stop, a stall) never are."""
    return LOST_SETTLE_S if type(err).__module__.startswith("ray.") else 0.0


class StartupClock:
    """The start-up stages of one command: the driver's marks (preflight's) and the first rank's,
    stitched into one line the first time the ranks send theirs."""

    def __init__(self, launched: float | None, started: float, plan: RunPlan, order: tuple[str, ...], until: str = "") -> None:
        """`launched`: when the command's process began (None: count from `started`, when the
        command's function was called); the stage up to `started` is the interpreter and our imports."""
        self.begin, self.order, self.until = launched or started, order, until
        self.marks = {"python": started, **plan.marks} if launched else dict(plan.marks)
        self.seconds: dict[str, float] | None = None
        """Seconds per stage, once the ranks' marks came."""

    def ranks_started(self, rank_marks: dict[str, float]) -> str | None:
        """The line to show when rank 0's marks first arrive; None after that."""
        if self.seconds is not None:
            return None
        self.seconds = stages(self.begin, {**self.marks, **rank_marks}, self.order)
        return stages_line(self.seconds, self.until)

    def summary(self) -> dict[str, Any] | None:
        return startup_summary(self.seconds) if self.seconds else None


def write_summary(plan: RunPlan, started: float, clock: StartupClock, config: dict[str, Any], **facts: Any) -> dict[str, Any]:
    """The run's summary.json: what every command's has (name, directory, wall time, start-up stages,
    config), then the command's own `facts` (world size, nodes, the result). Returns it."""
    summary = {
        "name": plan.cfg.name,
        "run_dir": str(plan.run_dir),
        **facts,
        "wall_time_s": round(time.time() - started, 3),
        "startup": clock.summary(),
        "config": config,
    }
    write_json(plan.run_dir / "summary.json", summary)
    return summary


def on_this_node() -> Any:
    """Ray's placement for the driver's own actors (metrics sink, launch hub): the driver's node.
    A 0-CPU actor may land on any node, and one on a worker node would die with it, taking an
    elastic run that should have gone on with it."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)


class FitThread(threading.Thread):
    """trainer.fit() off the main thread; its error, if any, in `error` for the caller to judge.

    In the main thread, Ray Train V2's fit() installs its own SIGINT handler
    (DataParallelTrainer._register_sigint_handler) over ours: the first Ctrl-C aborts the run at once,
    with no checkpoint, no summary and no signal to a launched script. It leaves SIGINT alone in any
    other thread (as under Ray Tune), so the drivers' handlers in the main thread keep Ctrl-C."""

    def __init__(self, trainer: Any) -> None:
        super().__init__(name="raytrain-fit", daemon=True)  # a second Ctrl-C leaves it behind
        self.trainer = trainer
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.trainer.fit()
        except BaseException as err:  # the caller re-raises or judges it
            self.error = err
