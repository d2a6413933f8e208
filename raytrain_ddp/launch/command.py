"""`raytrain launch`: the driver that runs an unmodified torchrun-style script on N Ray workers.

It does what torchrun and the sbatch around it do by hand, with Ray placing the ranks: each worker
runs the script with torchrun's environment (launch/agent.py), every rank's output comes back here marked
with its rank, and the exit status is the script's. Scale is the same ScalingConfig as `raytrain
run`; the ranks are Ray Train workers of a plain DataParallelTrainer, since the script makes its
own process group (a TorchTrainer would make one more, and a CUDA context per rank for it).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from raytrain_ddp import ray_compat
from raytrain_ddp.config import STOP_GRACE_S, ConfigError, TrainConfig
from raytrain_ddp.doctor.launch_watch import StackWatch
from raytrain_ddp.doctor.stall_watch import Report
from raytrain_ddp.driver.core import drive as core
from raytrain_ddp.driver.plan import preflight, shipping
from raytrain_ddp.driver.core.drive import Signals, StartupClock, drive
from raytrain_ddp.driver.plan.preflight import RunPlan
from raytrain_ddp.driver.plan.resources import choose_layout
from raytrain_ddp.driver.session.connect import on_this_node, restarts, start_private_ray, trainer_configs
from raytrain_ddp.driver.core.startup import LAUNCH_STAGES
from raytrain_ddp.stops import Stalled
from raytrain_ddp.errors import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_STOPPED
from raytrain_ddp.launch.output import TRACEBACK, mark, settled, unmark
from raytrain_ddp.launch.records import (
    TEARDOWN_ABORT,
    AttemptEnded,
    AttemptStarted,
    LaunchOutcome,
    OutputLine,
    RankExit,
    StartupMarks,
    describe_exit,
    exit_status,
)

POLL_S = 0.2
"""How often the driver fetches the ranks' output lines and passes on a signal it got."""
HOLD_S = 5.0
"""How long a shown rank's traceback is held back from the terminal, waiting for its rank's exit to
tell a root cause (shown whole, once) from a knock-on (one line); a script that lives on after it
printed a traceback gets it shown after this."""
HUB_ANSWER_S = 10.0
"""How long a stalled run's driver waits for the hub's record of the ranks, for its summary.json."""
MOST_KNOCK_ONS = 3
"""Knock-on failures named one line each; more are counted."""
QUOTE_CHARS = 200
"""A knock-on's quoted message is cut here, to stay one line."""
LAUNCH_FIELDS = (
    "workers", "gpu", "cpus_per_worker", "placement", "address", "storage_path", "name",
    "max_failures", "wait_for_resources", "resize_check_s", "verbose", "stall_timeout",
)
"""The TrainConfig fields `raytrain launch` takes: where and how many, never what to train."""
LAUNCH_HELP = {
    "workers": "Ranks, one process of the script each (one per GPU with --gpu). MIN:MAX makes the launch elastic: "
               "every rank's script restarts at the new size when a node is lost or room appears, and resumes "
               "from its own checkpoint.",
    "gpu": "One GPU per rank, cuda:LOCAL_RANK (--gpu), or CPUs only (--cpu); the script makes its own process "
           "group, with the backend it picks.",
}
"""launch's help for the fields it means otherwise than `run`."""


@dataclass(frozen=True)
class Target:
    """What each rank runs: `python SCRIPT ARGS` or `python -m MODULE ARGS`."""

    name: str
    """The script's path or the module's name, as the user typed it."""
    module: bool
    args: tuple[str, ...]
    file: Path
    """The script, or the module's source file: what must be the same on every node."""
    root: Path
    """The directory shipped when the nodes do not share one: the script's, or the module's root."""

    def argv(self, shared: bool) -> list[str]:
        """The child's command line after `python`: absolute on a shared filesystem, relative to
        the shipped copy of `root` otherwise."""
        if self.module:
            return ["-m", self.name, *self.args]
        script = str(self.file) if shared else str(self.file.relative_to(self.root))
        return [script, *self.args]


def find_target(name: str, module: bool, args: list[str]) -> Target:
    """The script or module, checked here so a typo fails in one line before any worker starts."""
    if module:
        sys.path.insert(0, os.getcwd())  # as `python -m` does
        try:
            spec = importlib.util.find_spec(name)
            package = spec is not None and spec.submodule_search_locations is not None
            main = importlib.util.find_spec(f"{name}.__main__") if package else spec
        except (ImportError, ValueError) as err:
            spec, main, package, reason = None, None, False, f" ({err})"
        else:
            reason = ""
        if spec is None:
            raise ConfigError(
                f"no module {name!r} to run with -m{reason}; run from the directory that holds it, "
                "or add that directory to PYTHONPATH"
            )
        if main is None or main.origin is None or not main.origin.endswith(".py"):
            raise ConfigError(f"-m {name}: {name} is a package without a __main__.py, so it cannot be run; "
                              "add one, or name the module to run (-m PKG.MODULE)")
        # The directory on sys.path that the top package was found in: what `python -m` needs on the ranks.
        where = Path(next(iter(spec.submodule_search_locations))) if package else Path(spec.origin)
        root = where.absolute().parents[name.count(".")]
        return Target(name, True, tuple(args), Path(main.origin).absolute(), root)
    file = Path(name).expanduser().absolute()
    if not file.is_file():
        raise ConfigError(f"no script {name} (looked for {file}); give the path to your training script")
    return Target(name, False, tuple(args), file, file.parent)


def parse_ranks(text: str, world_size: int) -> set[int]:
    """--show-ranks: "all", or rank numbers like "0" or "0,3"."""
    if text.strip() == "all":
        return set(range(world_size))
    try:
        ranks = {int(part) for part in text.split(",")}
    except ValueError:
        raise ConfigError(f"--show-ranks {text!r} must be all or rank numbers such as 0 or 0,3") from None
    outside = sorted(r for r in ranks if not 0 <= r < world_size)
    if outside:
        raise ConfigError(f"--show-ranks {text}: rank {outside[0]} is outside 0..{world_size - 1} (--workers {world_size})")
    return ranks


def launch(cfg: TrainConfig, target: Target, show_ranks: str, dry_run: bool = False,
           stop_grace_s: float = STOP_GRACE_S, launched: float | None = None) -> int:
    """Run the target on cfg.workers ranks (MIN:MAX: elastic); return the exit status: 0, the
    script's, 75 after a SIGTERM that every rank answered cleanly, 130 after Ctrl-C. `launched`: when
    the command began, for the start-up stages (default: now)."""
    if stop_grace_s < 0:
        raise ConfigError(f"--stop-grace-s must be 0 or more seconds (got {stop_grace_s})")
    shown = parse_ranks(show_ranks, cfg.max_workers or cfg.workers)
    if dry_run:
        checked = preflight.check_request(cfg, trains=False)
        scaling, run_config, _ = trainer_configs(dataclasses.replace(checked.cfg, **choose_layout(checked.cfg, [])._asdict()))
        print(f"each of {checked.world} ranks runs: python {' '.join(target.argv(shared=True))}")
        print(f"run directory: {checked.run_dir}\n{scaling}\n{run_config}")
        return 0
    started = time.time()
    start_private_ray(cfg)  # without --address: it starts while the request is checked
    with Signals() as signals:  # from here on, a SIGTERM is ours: remembered, then forwarded
        plan = preflight.plan(cfg, trains=False, stop_check=signals.stop_before_start, say=say)
        placement = shipping.place(target.file, target.root)
        where = Path.cwd() if placement.shared else f"their copy of {target.root}"
        say(f"ranks run in {where} ({placement.describe()})")
        shipping.ship_code(plan.cfg, placement.runtime_env())
        signals.install()  # again: ray.init put its own SIGTERM handler in
        if signals.received:  # before any rank started: nothing to forward, nothing lost
            say(f"got {signals.first} before any rank started; nothing to stop")
            return EXIT_INTERRUPTED if signals.first == "SIGINT" else EXIT_STOPPED
        clock = StartupClock(launched, started, plan, LAUNCH_STAGES, " to the script's start")
        return supervise(plan, target, placement, shown, signals, stop_grace_s, started, clock)


def supervise(plan: RunPlan, target: Target, placement: Any, shown: set[int], signals: Signals, stop_grace_s: float,
              started: float, clock: StartupClock) -> int:
    """Start every rank's agent, relay their output and the driver's signals until they end; the exit status."""
    import ray
    from ray.train.v2.api.data_parallel_trainer import (
        DataParallelTrainer,  # TorchTrainer, minus its process group
    )

    from raytrain_ddp.launch.hub import LaunchHub, hub_options, resize_notice
    from raytrain_ddp.launch.agent import run_script

    cfg = plan.cfg
    scaling, run_config, _ = trainer_configs(cfg)
    hub = LaunchHub.options(scheduling_strategy=on_this_node(), **hub_options(plan.most_workers)).remote()
    if cfg.elastic:  # SIGTERM and the grace before Ray Train resizes the group, not a kill
        run_config.callbacks.append(ray_compat.before_resize(functools.partial(resize_notice, hub, stop_grace_s)))
    trainer = ray_compat.fast(DataParallelTrainer)(
        run_script,
        train_loop_config={
            "hub": hub,
            "argv": target.argv(placement.shared),
            "cwd": str(Path.cwd()) if placement.shared else None,  # shipped: the copy Ray made
            "probe": str(target.file.relative_to(target.root)),
            "max_restarts": restarts(cfg),
            "run_id": cfg.name,
            "run_dir": str(plan.run_dir),  # RAYTRAIN_RUN_DIR in the script's environment
            "stop_grace_s": stop_grace_s,
        },
        scaling_config=scaling,
        run_config=run_config,
    )
    backend = "GPU" if cfg.gpu else "CPU"
    which = "all ranks" if len(shown) == plan.most_workers else "rank " + ",".join(map(str, sorted(shown)))
    say(f"{plan.world} {backend} ranks run: python {' '.join(target.argv(placement.shared))}")
    say(f"showing {which} (--show-ranks); every rank's output: {plan.run_dir / 'logs'}/rank-N.log")
    printer = Printer(hub, plan.run_dir / "logs", shown, clock)
    watch = StackWatch(hub, cfg.stall_timeout, plan.run_dir, say, restarts(cfg))

    def news() -> None:
        printer.drain()
        watch.poll()  # raises Stalled, after it killed the scripts

    try:
        error = drive(trainer, signals, news, functools.partial(forward, hub, stop_grace_s), POLL_S)
    except Stalled:  # the run ends on the stall's line: its summary.json first, with the stall in it
        try:
            outcome = ray.get(hub.outcome.remote(), timeout=HUB_ANSWER_S)
        except (ray.exceptions.GetTimeoutError, ray.exceptions.RayActorError):
            outcome = None  # the stall's line says what matters, with no summary
        if outcome is not None:
            write_summary(plan, target, outcome, started, clock, watch.stalls)
        raise
    finally:
        printer.close()
    outcome = ray.get(hub.outcome.remote())
    write_summary(plan, target, outcome, started, clock, watch.stalls)
    return judge(outcome, error, signals.received, told=outcome.attempts in printer.told)


def forward(hub: Any, grace_s: float, name: str, before: list[str]) -> None:
    """A signal, passed to every rank's script as torchrun's agent passes it: SIGINT as SIGINT, SIGTERM
    and SIGUSR1 (Slurm's notice, scancel, a time limit) as SIGTERM; each rank is signalled once, then
    SIGKILLed if it outlives --stop-grace-s. A second Ctrl-C kills every rank at once. The driver
    waits until the hub has it, so no request is lost."""
    import ray

    if not before and not ray.get(hub.any_script.remote()):  # the ranks are still starting: no script to signal
        say(f"got {name} before any rank's script started: stopping the ranks' start-up")
        ray.get(hub.request_stop.remote(name))
    elif not before:
        sent = "SIGINT" if name == "SIGINT" else "SIGTERM"
        say(f"got {name}: sending {sent} to every rank's script; SIGKILL to any still running after "
            f"{grace_s:g} s (--stop-grace-s)" + ("; Ctrl-C again to kill them now" if name == "SIGINT" else ""))
        ray.get(hub.request_stop.remote(name))
    elif name == "SIGINT":
        say("got SIGINT again: killing every rank's script now")
        ray.get(hub.request_stop.remote(before[0], kill=True))


def judge(outcome: LaunchOutcome, error: BaseException | None, received: list[str], told: bool = False) -> int:
    """The exit status and the line that explains it: torchrun's, 75 after a stop, 130 after Ctrl-C.
    `told`: the Printer already showed the last attempt's root cause, knock-ons and teardown aborts."""
    exits = outcome.exits
    first = outcome.failed_first
    if received and not any(e.ran for e in exits.values()):  # signalled while the ranks were starting
        say(f"stopped by {received[0]} before any rank's script started; nothing was running, nothing lost")
        return EXIT_INTERRUPTED if received[0] == "SIGINT" else EXIT_STOPPED
    if received:
        name = received[0]
        codes = {rank: e.code for rank, e in sorted(exits.items())}
        bad = {rank: code for rank, code in codes.items() if code != 0}
        if name == "SIGINT":
            killed = f"; rank {next(iter(bad))} exited with {describe_exit(next(iter(bad.values())))}" if bad else ""
            say(f"interrupted: every rank's script got SIGINT{killed}")
            return EXIT_INTERRUPTED
        if codes and not bad:
            say(f"stopped: every rank's script exited 0 after {name}; run the same "
                "command again to resume from the script's own checkpoint")
            return EXIT_STOPPED
        if bad:
            rank, code = next(iter(bad.items()))
            say(f"stopped by {name}: rank {rank} exited with {describe_exit(code)}")
            return exit_status(code)
    if first is not None:
        failed = exits[first]
        if not told:
            tell_end(exits, first, outcome.excused)
        say(f"error: rank {first} on {failed.hostname} ({failed.ip}) {failed.describe()}")
        return failed.status or EXIT_FAILED
    if error is not None:
        raise error  # not the script: Ray itself failed (a lost node, no resources); cli says it in one line
    if not told:
        tell_end(exits, None, outcome.excused)
    return 0


def root_cause(failed: RankExit) -> None:
    """The failing rank's traceback, as torchrun's summary shows it: the one its torch `@record` left
    in its TORCHELASTIC_ERROR_FILE, else the last one it printed."""
    error = failed.error
    if error and error.traceback:
        say(f"root cause: rank {failed.rank} on {failed.hostname} raised {error.message}")
        print(error.traceback.rstrip("\n"), file=sys.stderr, flush=True)


def tell_end(exits: dict[int, RankExit], first: int | None, excused: list[int]) -> None:
    """How an attempt's ranks ended, beyond its exit status: the root cause's traceback, then each
    rank that failed after it in one line (a knock-on: a peer gone from its collective), and each
    teardown abort that fails nothing."""
    if first is not None:
        root_cause(exits[first])
        after = sorted((e.ended_at, r) for r, e in exits.items() if r != first and e.code != 0 and e.ran)
        for _, rank in after[:MOST_KNOCK_ONS]:
            end = exits[rank]
            said = end.error.message if end.error and end.error.message else end.last_line
            said = said if len(said) <= QUOTE_CHARS else said[:QUOTE_CHARS] + " ..."
            why = f"stopped because rank {first} failed" if end.aborted else f"a knock-on of rank {first}'s failure"
            say(f"rank {rank} exited with {describe_exit(end.code)} {end.ended_at - exits[first].ended_at:.1f} s "
                f"later, {why}" + (f": {said}" if said else ""))
        if len(after) > MOST_KNOCK_ONS:
            say(f"{len(after) - MOST_KNOCK_ONS} more ranks failed after rank {first}; every rank's output is in logs/")
    for rank in excused:
        end = exits[rank]
        say(f"rank {rank} on {end.hostname} ended with signal SIGABRT after its script's last line "
            f"({TEARDOWN_ABORT!r}) while every other rank exited 0: that looks like torch's interpreter "
            "teardown, not a training failure, so it fails nothing; dist.destroy_process_group() at the "
            "script's end usually avoids it")


def write_summary(plan: RunPlan, target: Target, outcome: LaunchOutcome, started: float, clock: StartupClock,
                  stalls: list[Report]) -> None:
    peers = [p or {} for p in outcome.peers]
    world_size = outcome.world_size or plan.cfg.workers
    codes = [outcome.exits[r].code if r in outcome.exits else None for r in range(world_size)]
    core.write_summary(
        plan, started, clock, {key: getattr(plan.cfg, key) for key in LAUNCH_FIELDS},
        command=["python", *target.argv(shared=True)],
        world_size=world_size,
        attempts=outcome.attempts,
        nodes=[p.get("hostname") for p in peers],
        node_ips=[p.get("ip") for p in peers],
        exit_codes=[None if code is None else exit_status(code) for code in codes],  # as a shell shows them
        stop_signal=outcome.stop_signal,
        stalls=[dataclasses.asdict(report) for report in stalls],  # each one Ray Train restarted from, or the last
    )


def say(line: str) -> None:
    """raytrain's own lines go to stderr, so the script's stdout stays the script's."""
    print(f"raytrain: {line}" if not line.startswith("error: ") else line, file=sys.stderr, flush=True)


class Printer:
    """The ranks' lines, fetched by the driver's main loop while fit() runs: every line to
    logs/rank-N.log, the shown ranks' lines to this terminal (stdout or stderr, as the script wrote
    them), marked `[rankN]:` as torchrun's --tee marks them; and, when the first script starts, the
    start-up stages.

    A shown rank's traceback waits (HOLD_S) for how the attempt ended: the rank that failed first
    gets it shown as the root cause, a rank that failed after it one line, as a knock-on."""

    def __init__(self, hub: Any, log_dir: Path, shown: set[int], clock: StartupClock):
        self.hub, self.log_dir, self.shown, self.clock = hub, log_dir, shown, clock
        self.files: dict[int, TextIO] = {}
        self.held: dict[int, list[OutputLine]] = {}
        """A shown rank's stderr lines from its last traceback on, by rank."""
        self.held_since: dict[int, float] = {}
        self.told: set[int] = set()
        """The attempts whose end (root cause, knock-ons) was said."""
        # A terminal redraws a `\r` update in place; a file (a Slurm .out) would keep every one.
        self.tty = {"stdout": sys.stdout.isatty(), "stderr": sys.stderr.isatty()}
        log_dir.mkdir(parents=True, exist_ok=True)

    def log(self, rank: int) -> TextIO:
        if rank not in self.files:
            self.files[rank] = open(self.log_dir / f"rank-{rank}.log", "a", buffering=1, newline="")
        return self.files[rank]

    def drain(self) -> None:
        import ray

        for event in ray.get(self.hub.take_events.remote()):
            if isinstance(event, StartupMarks):  # rank 0's agent marks (the first attempt's), stitched to ours
                if line := self.clock.ranks_started(event.marks):
                    say(line)
            elif isinstance(event, AttemptStarted):
                self.new_attempt(event)
            elif isinstance(event, AttemptEnded):
                self.attempt_ended(event)
            else:
                self.log(event.rank).write(event.text + "\n")
                if event.rank in self.held and event.stream == "stderr":  # its traceback goes on
                    self.held[event.rank].append(event)
                elif event.rank in self.shown and event.stream == "stderr" and unmark(event.text) == TRACEBACK:
                    self.held[event.rank], self.held_since[event.rank] = [event], time.monotonic()
                elif event.rank in self.shown:
                    self.show(event)
        for rank in [r for r, since in self.held_since.items() if time.monotonic() - since > HOLD_S]:
            self.release(rank)

    def show(self, line: OutputLine) -> None:
        text = line.text if self.tty[line.stream] else settled(line.text)
        print(mark(line.rank, text), file=sys.stdout if line.stream == "stdout" else sys.stderr, flush=True)

    def release(self, rank: int, drop: bool = False) -> None:
        """A held traceback: to the terminal as it was, or dropped where the attempt's end says it."""
        lines = self.held.pop(rank, [])
        self.held_since.pop(rank, None)
        for line in [] if drop else lines:
            self.show(line)

    def attempt_ended(self, ended: AttemptEnded) -> None:
        """Every rank of an attempt exited: its root cause and knock-ons, in place of their tracebacks."""
        first = None if ended.signalled else ended.failed_first
        for rank in list(self.held):
            end = ended.exits.get(rank)
            said = end is not None and end.code != 0 and (rank != first or bool(end.error and end.error.traceback))
            self.release(rank, drop=first is not None and said)
        if not ended.signalled:
            tell_end(ended.exits, first, ended.excused)
            self.told.add(ended.number)

    def new_attempt(self, attempt: AttemptStarted) -> None:
        """A new worker group: marked in every log; on the terminal, why the last one ended."""
        for rank in list(self.held):
            self.release(rank)
        for f in self.files.values():
            f.write(f"--- attempt {attempt.number}, world size {attempt.world_size} ---\n")
        if attempt.number == 1:
            return
        failed = attempt.previous
        if failed is not None:  # a script failed first: that is the cause, whatever came after
            if attempt.number - 1 not in self.told:
                root_cause(failed)
            say(f"attempt {attempt.number - 1}: rank {failed.rank} on {failed.hostname} {failed.describe()}")
        elif attempt.resized:
            say(f"attempt {attempt.number - 1}: every rank got SIGTERM because {attempt.resized}")
        say(f"attempt {attempt.number}: the worker group restarted at world size {attempt.world_size} "
            f"(TORCHELASTIC_RESTART_COUNT={attempt.number - 1}); the script runs again")

    def close(self) -> None:
        self.drain()  # the last lines may have landed after the previous poll
        for rank in list(self.held):
            self.release(rank)
        for f in self.files.values():
            f.close()
