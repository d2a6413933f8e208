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
import time
from pathlib import Path
from typing import Any

from raytrain_ddp import ray_compat
from raytrain_ddp.config import STOP_GRACE_S, ConfigError, TrainConfig
from raytrain_ddp.doctor.launch_watch import StackWatch
from raytrain_ddp.doctor.stall_watch import Report
from raytrain_ddp.driver.core import drive as core
from raytrain_ddp.driver.core.drive import Signals, StartupClock, drive, on_this_node
from raytrain_ddp.driver.core.startup import LAUNCH_STAGES
from raytrain_ddp.driver.plan import preflight, shipping
from raytrain_ddp.driver.plan.preflight import RunPlan
from raytrain_ddp.driver.session.connect import start_private_ray
from raytrain_ddp.errors import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_STOPPED
from raytrain_ddp.launch.printer import Printer, say, tell_end
from raytrain_ddp.launch.records import LaunchOutcome, describe_exit, exit_status
from raytrain_ddp.launch.target import LAUNCH_FIELDS, Target
from raytrain_ddp.stops import Stalled
from raytrain_ddp.storage.location import below

POLL_S = 0.2
"""How often the driver fetches the ranks' output lines and passes on a signal it got."""
HUB_ANSWER_S = 10.0
"""How long a stalled run's driver waits for the hub's record of the ranks, for its summary.json."""


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
        checked = preflight.unplaced(preflight.check_request(cfg, trains=False))
        print(f"each of {checked.world} ranks runs: python {' '.join(target.argv(shared=True))}")
        print(f"run directory: {checked.run_dir}\n{checked.ray_train.scaling}\n{checked.ray_train.run}")
        return 0
    started = time.time()
    start_private_ray(cfg)  # without --address: it starts while the request is checked
    with Signals() as signals:  # from here on, a SIGTERM is ours: remembered, then forwarded
        plan = preflight.plan(cfg, trains=False, stop_check=signals.stop_before_start, say=say)
        placement = shipping.place(target.file, target.root)
        where = Path.cwd() if placement.shared else f"their copy of {target.root}"
        say(f"ranks run in {where} ({placement.describe()})")
        shipping.ship_code(plan.address, plan.cfg.verbose, placement.runtime_env())
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

    cfg, run_config = plan.cfg, plan.ray_train.run
    hub = LaunchHub.options(scheduling_strategy=on_this_node(), **hub_options(plan.most_workers)).remote()
    if cfg.elastic:  # SIGTERM and the grace before Ray Train resizes the group, not a kill
        resize = ray_compat.before_resize(functools.partial(resize_notice, hub, stop_grace_s))
        run_config = dataclasses.replace(run_config, callbacks=[*run_config.callbacks, resize])
    trainer = ray_compat.fast(DataParallelTrainer)(
        run_script,
        train_loop_config={
            "hub": hub,
            "argv": target.argv(placement.shared),
            "cwd": str(Path.cwd()) if placement.shared else None,  # shipped: the copy Ray made
            "probe": str(target.file.relative_to(target.root)),
            "max_restarts": plan.restarts,
            "run_id": cfg.name,
            # RAYTRAIN_RUN_DIR in the script's environment: on an object store its URI as typed, query and
            # all, which a script reaches from any node (a local path would be each node's own, and lost).
            "run_dir": below(cfg.storage_path, cfg.name),
            "stop_grace_s": stop_grace_s,
        },
        scaling_config=plan.ray_train.scaling,
        run_config=run_config,
    )
    backend = "GPU" if cfg.gpu else "CPU"
    which = "all ranks" if len(shown) == plan.most_workers else "rank " + ",".join(map(str, sorted(shown)))
    say(f"{plan.world} {backend} ranks run: python {' '.join(target.argv(placement.shared))}")
    say(f"showing {which} (--show-ranks); every rank's output: {plan.run_dir / 'logs'}/rank-N.log")
    printer = Printer(hub, plan.run_dir / "logs", shown, clock)
    watch = StackWatch(hub, cfg.stall_timeout, plan.run_dir, say, plan.restarts)

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
