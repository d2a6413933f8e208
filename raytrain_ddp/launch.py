"""`raytrain launch`: the driver that runs an unmodified torchrun-style script on N Ray workers.

It does what torchrun and the sbatch around it do by hand, with Ray placing the ranks: each worker
runs the script with torchrun's environment (launch_agent.py), every rank's output comes back here marked
with its rank, and the exit status is the script's. Scale is the same ScalingConfig as `raytrain
run`; the ranks are Ray Train workers of a plain DataParallelTrainer, since the script makes its
own process group (a TorchTrainer would make one more, and a CUDA context per rank for it).
"""

from __future__ import annotations

import importlib.util
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from raytrain_ddp.cluster import (
    check_writable,
    choose_layout,
    connect,
    on_this_node,
    preflight,
    resolve_run,
    trainer_configs,
)
from raytrain_ddp.config import ConfigError, TrainConfig
from raytrain_ddp.errors import EXIT_STOPPED
from raytrain_ddp.metrics import write_json
from raytrain_ddp.shipping import ship_code

POLL_S = 0.2
"""How often the driver fetches the ranks' output lines."""
LAUNCH_FIELDS = (
    "workers", "gpu", "cpus_per_worker", "placement", "address", "storage_path", "name",
    "max_failures", "wait_for_resources", "verbose",
)
"""The TrainConfig fields `raytrain launch` takes: where and how many, never what to train."""


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
        except (ImportError, ValueError) as err:
            spec, reason = None, f" ({err})"
        else:
            reason = ""
        if spec is None or spec.origin is None or not spec.origin.endswith(".py"):
            raise ConfigError(
                f"no module {name!r} to run with -m{reason}; run from the directory that holds it, "
                "or add that directory to PYTHONPATH"
            )
        file = Path(spec.origin).absolute()
        depth = name.count(".") + (1 if file.name == "__main__.py" else 0)
        return Target(name, True, tuple(args), file, file.parents[depth])
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


def launch(cfg: TrainConfig, target: Target, show_ranks: str, dry_run: bool = False) -> int:
    """Run the target on cfg.workers ranks; return the exit status (0, the script's, or 75)."""
    if cfg.elastic:
        raise ConfigError(
            f"raytrain launch runs a fixed number of ranks (a torchrun script keeps its own WORLD_SIZE); "
            f"give --workers {cfg.workers}, or use raytrain run for --workers MIN:MAX"
        )
    shown = parse_ranks(show_ranks, cfg.workers)
    cfg, run_dir = resolve_run(cfg)
    if dry_run:
        scaling, run_config, _ = trainer_configs(choose_layout(cfg, []))
        print(f"each of {cfg.workers} ranks runs: python {' '.join(target.argv(shared=True))}")
        print(f"run directory: {run_dir}\n{scaling}\n{run_config}")
        return 0
    started = time.time()
    check_writable(run_dir)
    connect(cfg)
    cfg = preflight(cfg)

    from ray.train.v2.api.data_parallel_trainer import (
        DataParallelTrainer,  # TorchTrainer, minus its process group
    )

    from raytrain_ddp import shipping
    from raytrain_ddp.launch_agent import LaunchHub, run_script

    placement = shipping.place(target.file, target.root)
    where = Path.cwd() if placement.shared else f"their copy of {target.root}"
    say(f"ranks run in {where} ({placement.describe()})")
    ship_code(cfg, placement.runtime_env())
    scaling, run_config, _ = trainer_configs(cfg)
    hub = LaunchHub.options(scheduling_strategy=on_this_node()).remote(cfg.workers)
    trainer = DataParallelTrainer(
        run_script,
        train_loop_config={
            "hub": hub,
            "argv": target.argv(placement.shared),
            "cwd": str(Path.cwd()) if placement.shared else None,  # shipped: the copy Ray made
            "probe": str(target.file.relative_to(target.root)),
            "max_restarts": cfg.max_failures,
            "run_id": cfg.name,
        },
        scaling_config=scaling,
        run_config=run_config,
    )
    backend = "GPU" if cfg.gpu else "CPU"
    which = "all ranks" if len(shown) == cfg.workers else "rank " + ",".join(map(str, sorted(shown)))
    say(f"{cfg.workers} {backend} ranks run: python {' '.join(target.argv(placement.shared))}")
    say(f"showing {which} (--show-ranks); every rank's output: {run_dir / 'logs'}/rank-N.log")
    printer = Printer(hub, run_dir / "logs", shown)
    printer.start()
    forward_signals(hub)
    error = None
    try:
        trainer.fit()
    except Exception as err:  # judged below, from what the ranks said
        error = err
    finally:
        printer.stop()

    import ray

    outcome = ray.get(hub.outcome.remote())
    write_summary(run_dir, cfg, target, outcome, started)
    return judge(outcome, error)


def judge(outcome: dict[str, Any], error: BaseException | None) -> int:
    """The exit status and the line that explains it: torchrun's, or raytrain's 75 after a stop."""
    from raytrain_ddp.launch_agent import describe_exit, exit_status

    exits = outcome["exits"]
    first = outcome["failed_first"]
    if outcome["stop_signal"]:
        codes = {rank: e["code"] for rank, e in sorted(exits.items())}
        bad = {rank: code for rank, code in codes.items() if code != 0}
        if codes and not bad:
            say(f"stopped: every rank's script exited 0 after {outcome['stop_signal']}; run the same "
                "command again to resume from the script's own checkpoint")
            return EXIT_STOPPED
        if bad:
            rank, code = next(iter(bad.items()))
            say(f"stopped by {outcome['stop_signal']}: rank {rank} exited with {describe_exit(code)}")
            return exit_status(code)
    if first is not None:
        failed = exits[first]
        say(
            f"error: rank {first} on {failed['hostname']} ({failed['ip']}) exited with "
            f"{describe_exit(failed['code'])}" + (f": {failed['last_line']}" if failed["last_line"] else "")
        )
        return exit_status(failed["code"]) or 1
    if error is not None:
        raise error  # not the script: Ray itself failed (a lost node, no resources); cli says it in one line
    return 0


def write_summary(run_dir: Path, cfg: TrainConfig, target: Target, outcome: dict[str, Any], started: float) -> None:
    peers = [p or {} for p in outcome["peers"]]
    write_json(run_dir / "summary.json", {
        "name": cfg.name,
        "run_dir": str(run_dir),
        "command": ["python", *target.argv(shared=True)],
        "world_size": cfg.workers,
        "attempts": outcome["attempts"],
        "nodes": [p.get("hostname") for p in peers],
        "node_ips": [p.get("ip") for p in peers],
        "exit_codes": [outcome["exits"].get(r, {}).get("code") for r in range(cfg.workers)],
        "stop_signal": outcome["stop_signal"],
        "wall_time_s": round(time.time() - started, 3),
        "config": {key: getattr(cfg, key) for key in LAUNCH_FIELDS},
    })


def say(line: str) -> None:
    """raytrain's own lines go to stderr, so the script's stdout stays the script's."""
    print(f"raytrain: {line}" if not line.startswith("error: ") else line, file=sys.stderr, flush=True)


def forward_signals(hub: Any) -> None:
    """SIGTERM and SIGUSR1 (Slurm's notice, scancel, a time limit) reach every script as SIGTERM."""

    def handler(signum: int, _frame: Any) -> None:
        name = signal.Signals(signum).name
        say(f"got {name}: sending SIGTERM to every rank's script")
        hub.request_stop.remote(name)

    for sig in (signal.SIGUSR1, signal.SIGTERM):
        signal.signal(sig, handler)


class Printer(threading.Thread):
    """Fetches the ranks' lines while fit() blocks: every line to logs/rank-N.log, the shown ranks'
    lines to this terminal (stdout or stderr, as the script wrote them), marked `[rankN]:` as
    torchrun's --tee marks them."""

    def __init__(self, hub: Any, log_dir: Path, shown: set[int]):
        super().__init__(daemon=True)
        self.hub, self.log_dir, self.shown = hub, log_dir, shown
        self.files: dict[int, TextIO] = {}
        self.attempt = "1"
        self.done = threading.Event()
        log_dir.mkdir(parents=True, exist_ok=True)

    def log(self, rank: int) -> TextIO:
        if rank not in self.files:
            self.files[rank] = open(self.log_dir / f"rank-{rank}.log", "a", buffering=1)
        return self.files[rank]

    def drain(self) -> None:
        import ray

        for rank, stream, text in ray.get(self.hub.take_lines.remote()):
            if rank < 0:  # a new worker group: mark it in every log and on the terminal
                self.attempt = text
                for f in self.files.values():
                    f.write(f"--- attempt {text} ---\n")
                if text != "1":
                    say(f"attempt {text}: the worker group restarted (--max-failures); the script runs again")
                continue
            self.log(rank).write(text + "\n")
            if rank in self.shown:
                print(f"[rank{rank}]: {text}", file=sys.stdout if stream == "stdout" else sys.stderr, flush=True)

    def run(self) -> None:
        while not self.done.wait(POLL_S):
            self.drain()

    def stop(self) -> None:
        self.done.set()
        self.join()
        self.drain()  # the last lines may have landed after the previous poll
        for f in self.files.values():
            f.close()
