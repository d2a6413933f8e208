"""The commands that train (`run`, `scale`, `launch`) and those that look at a run or a cluster
(`verify`, `export`, `check`): options in, one call into the driver side, an exit status out."""

from __future__ import annotations

import dataclasses
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, NoReturn, Optional

import typer

from raytrain_ddp.cli.options import train_options
from raytrain_ddp.cli.usage_errors import finite_float
from raytrain_ddp.config import SCHEDULERS, STOP_GRACE_S, ConfigError, TrainConfig
from raytrain_ddp.doctor.bad_nodes import requeue_asked
from raytrain_ddp.driver.core.startup import process_started
from raytrain_ddp.driver.look.check import check_cluster
from raytrain_ddp.driver.run import command as driver
from raytrain_ddp.errors import EXIT_BAD_INPUT, EXIT_BAD_NODE, EXIT_FAILED, EXIT_INTERRUPTED, EXIT_STOPPED
from raytrain_ddp.launch.target import LAUNCH_FIELDS, LAUNCH_HELP
from raytrain_ddp.stops import NodeFailed, RankConfigError, Stalled, Stopped


@train_options
def run_command(
    cfg: TrainConfig,
    dry_run: bool = typer.Option(False, "--dry-run", help="Check without a cluster, with a trial first step on the CPU (a batch of 2), print the resolved config and Ray configs; start nothing."),
) -> None:
    """Train a model with DDP on Ray Train: a local Ray, $RAY_ADDRESS, or --address."""
    if dry_run:
        driver.dry_run(cfg)
        return
    try:
        summary = driver.run(cfg, launched=process_started())  # the start-up line counts our imports too
    except KeyboardInterrupt as err:  # typer would make it a silent exit 130; stops.Interrupted says how to resume
        print(f"stopped: {err}" if str(err) else "interrupted", file=sys.stderr)
        if getattr(err, "at_once", False):
            # A second Ctrl-C interrupts the driver wherever it is, Ray's C++ core mid-call included,
            # and the interpreter's teardown after it crashed the process 1 time in 5 (SIGSEGV, not
            # 130). The run's files are written; Ray ends a dead driver's job, and a local Ray with it.
            exit_at_once(EXIT_INTERRUPTED)
        raise typer.Exit(EXIT_INTERRUPTED) from None
    except Stopped as err:
        if not err.at_once:
            raise  # cli.main says it and exits EXIT_STOPPED
        print(f"stopped: {err}", file=sys.stderr)  # ranks that did not answer in time were ended; fit() may block
        exit_at_once(EXIT_STOPPED)
    except Stalled as err:  # the ranks are ended, but fit() may block in Ray: end now, as a second Ctrl-C does
        print(f"error: {err}", file=sys.stderr)
        exit_at_once(EXIT_FAILED)
    except NodeFailed as err:  # under slurm/ray_cluster.sbatch, exit 3 requeues the job without the node
        print(f"error: {err}", file=sys.stderr)
        code = EXIT_BAD_NODE if requeue_asked() else EXIT_FAILED
        if err.at_once:
            exit_at_once(code)
        raise typer.Exit(code) from None
    except RankConfigError as err:  # the ranks may be retrying under --max-failures: end now, they die with us
        print(f"error: {err}", file=sys.stderr)
        exit_at_once(EXIT_BAD_INPUT)
    final = summary["final"]
    print(
        f"done: {summary['world_size']} {summary['backend']} workers, val acc {final['val_acc']:.3f}, "
        f"{final['throughput']:.1f} samples/s, {summary['wall_time_s']:.1f} s -> {summary['run_dir']}"
    )


SWEEP_OWN = ("--space", "--trials", "--concurrent", "--scheduler", "--metric", "--mode", "--grace-epochs", "--eta")
"""sweep's own options, each with a value: not run flags, so not in the command that reproduces a trial."""


@train_options(own_flags=("scheduler",))
def sweep_command(
    cfg: TrainConfig,
    space: Path = typer.Option(..., "--space", help="YAML file: each key a run option's field, each value "
                               "{loguniform|uniform|randint: [LO, HI]} or {choice|grid: [VALUES]} (docs/sweep.md)."),
    trials: int = typer.Option(8, "--trials", help="Samples drawn from the space (each repeats its grid keys); --seed fixes them."),
    concurrent: str = typer.Option("auto", "--concurrent", help="Trials at once: a number, or auto (as many as the cluster's free resources fit)."),
    scheduler: list[str] = typer.Option(
        [], "--scheduler", metavar="fifo|asha|LR", help="The trials' scheduler: fifo (default; every trial to its end) or asha (stops the weak ones "
        "early). none, step or cosine: the runs' LR schedule, as in run. Give it twice for both."),
    metric: str = typer.Option("val_acc", "--metric", help="What ranks trials: val_acc, val_loss, train_acc or train_loss."),
    mode: Optional[str] = typer.Option(None, "--mode", help="max or min (default: the metric's)."),
    grace_epochs: int = typer.Option(1, "--grace-epochs", help="ASHA: epochs every trial gets before it can be stopped."),
    eta: int = typer.Option(3, "--eta", help="ASHA: each rung keeps the best 1/eta of the trials."),
    dry_run: bool = typer.Option(False, "--dry-run", help="List the trials and the plan; start nothing."),
) -> None:
    """Run a hyperparameter sweep: trials drawn from --space, each a full `raytrain run` with these run options, packed into the cluster, with early stopping (--scheduler asha); the same command resumes it."""
    from raytrain_ddp.sweep.command import SweepConfig, sweep

    if concurrent != "auto" and not concurrent.isdigit():
        raise ConfigError(f"--concurrent takes a number of trials or auto (got {concurrent!r})")
    trial_scheduler = [s for s in scheduler if s not in SCHEDULERS] or ["fifo"]  # SweepConfig checks it
    if lr := [s for s in scheduler if s in SCHEDULERS]:
        cfg = dataclasses.replace(cfg, scheduler=lr[-1])
    sc = SweepConfig(space=space, trials=trials, concurrent=None if concurrent == "auto" else int(concurrent),
                     scheduler=trial_scheduler[-1], metric=metric, mode=mode, grace_epochs=grace_epochs, eta=eta, dry_run=dry_run)
    try:
        summary = sweep(cfg, sc, run_words(sys.argv[sys.argv.index("sweep") + 1:] if "sweep" in sys.argv else []))
    except KeyboardInterrupt as err:  # stops.Interrupted says how to resume
        print(f"stopped: {err}" if str(err) else "interrupted", file=sys.stderr)
        raise typer.Exit(EXIT_INTERRUPTED) from None
    if summary is not None and summary["trials"]["failed"] == summary["trials"]["total"]:
        print(f"error: every trial failed; each one's log is {summary['sweep_dir']}/trials/<trial>.log", file=sys.stderr)
        raise typer.Exit(EXIT_FAILED)


def run_words(argv: list[str]) -> list[str]:
    """The run options of a sweep's command line: the words that are not sweep's own (nor --debug)."""
    out, skip = [], False
    for i, word in enumerate(argv):
        flag, _, value = word.partition("=")
        if skip:
            skip = False
        elif flag == "--scheduler" and (value or (argv[i + 1] if i + 1 < len(argv) else "")) in SCHEDULERS:
            out.append(word)  # the runs' LR schedule
        elif flag in SWEEP_OWN:
            skip = not value
        elif word not in ("--dry-run", "--debug"):
            out.append(word)
    return out


@train_options(own_flags=("workers", "strategy", "sharding"))
def scale_command(
    cfg: TrainConfig,
    workers: str = typer.Option("1,2", "--workers", "-w", help="Worker counts to run, e.g. 1,2,4,8."),
    strategy: Optional[str] = typer.Option(None, "--strategy", help="Strategies to compare, e.g. ddp,fsdp (default: ddp)."),
    sharding: Optional[str] = typer.Option(
        None, "--sharding", help="The fsdp runs' sharding: full, grad-op or hybrid (default: full)."
    ),
) -> None:
    """Run the same job at each size (and strategy); write the scaling table (CSV, Markdown) and plot (PNG)."""
    from raytrain_ddp.driver.run.scale import parse_sizes, parse_strategies, scale

    # own flags, not TrainConfig's: a list of strategies, and a sharding for the fsdp runs among them
    scale(cfg, parse_sizes(workers), parse_strategies(strategy) if strategy else None, sharding)


@train_options(only=LAUNCH_FIELDS, helps=LAUNCH_HELP)
def launch_command(
    cfg: TrainConfig,
    script: str = typer.Argument(..., metavar="SCRIPT.py|MODULE", help="The training script (or module, with -m)."),
    args: Optional[list[str]] = typer.Argument(None, metavar="SCRIPT_ARGS", help="Passed to the script untouched."),
    module: bool = typer.Option(False, "-m", "--module", help="Run SCRIPT as a module, as `python -m` does."),
    show_ranks: str = typer.Option(
        "0", "--show-ranks", help="Ranks whose output this terminal shows: 0, 0,3 or all. Every rank's goes to logs/rank-N.log."
    ),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print what each rank would run and Ray's configs; start nothing."),
    stop_grace_s: float = typer.Option(
        STOP_GRACE_S, "--stop-grace-s", parser=finite_float, help="After a forwarded SIGINT or SIGTERM, seconds before a rank still running gets SIGKILL."
    ),
) -> None:
    """Run a torchrun-style script on N Ray workers: RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT set.

    Options go before the script; everything after it is the script's. --workers MIN:MAX is elastic:
    every rank restarts at the new size when a node is lost or room appears. Exit status: the first
    failing rank's, 75 when SIGTERM stopped every rank cleanly, 130 after Ctrl-C, else 0.
    """
    from raytrain_ddp.launch.command import launch
    from raytrain_ddp.launch.target import find_target

    target = find_target(script, module, args or [])
    try:
        code = launch(cfg, target, show_ranks, dry_run, stop_grace_s, launched=process_started())
    except Stalled as err:  # the scripts are killed, but fit() may block in Ray: end now
        print(f"error: {err}", file=sys.stderr)
        exit_at_once(EXIT_FAILED)
    raise typer.Exit(code)


def exit_at_once(code: int) -> NoReturn:
    """Exit now, without the interpreter's teardown, which would wait for fit() in Ray (and may crash
    there); Ray ends a dead driver's job, and a private local Ray with it."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def stack_command(
    name: Optional[str] = typer.Argument(
        None, metavar="NAME", help="The run's name. Default: the run under --storage-path that started ranks last."
    ),
    storage_path: str = typer.Option(
        "./runs", "--storage-path", help="Where the run's directory is (as the run's --storage-path)."
    ),
) -> None:
    """Print every rank's Python stack (py-spy) of a running `run` or `launch`, each headed by its rank, host and pid."""
    from raytrain_ddp.driver.look.stack import show_stacks

    show_stacks(storage_path, name)


RUN_DIR = typer.Argument(..., metavar="RUN_DIR",
                         help="A run directory: <storage-path>/<name>, on disk or in an object store (s3://...).")


def verify_command(run_dir: str = RUN_DIR) -> None:
    """Check a finished run: files present, all epochs done, world size right, loss finite and fell."""
    from raytrain_ddp.driver.look.verify import verify

    if not verify(existing_run_dir(found_run_dir(run_dir))):
        raise typer.Exit(1)


def export_command(
    run_dir: str = RUN_DIR,
    to: Path = typer.Option(..., "--to", help="The file to write, e.g. model.pt."),
) -> None:
    """Write the latest checkpoint's model, DDP's or FSDP's, as one plain state dict for inference."""
    from raytrain_ddp.checkpoint.export import export

    print(export(existing_run_dir(found_run_dir(run_dir)), to))


def found_run_dir(run_dir: str) -> Any:
    """RUN_DIR as a path: local, or an object store's, checked to answer (storage/location.py)."""
    from raytrain_ddp.storage.location import check_store, storage_root

    where = storage_root(run_dir)
    check_store(where, run_dir)
    return where


def existing_run_dir(run_dir: Any) -> Any:
    if not run_dir.is_dir():
        raise ConfigError(f"{run_dir} is not a directory; pass a run directory such as runs/<name>")
    return run_dir


def check_command(
    workers: int = typer.Option(2, "--workers", "-w", help="Ranks to test."),
    gpu: bool = typer.Option(False, "--gpu/--cpu", help="Test GPUs with NCCL (--gpu) or CPUs with gloo."),
    cpus_per_worker: int = typer.Option(1, "--cpus-per-worker", help="CPUs per rank."),
    placement: str = typer.Option("spread", "--placement", help="pack or spread (spread tests the network)."),
    address: Optional[str] = typer.Option(None, "--address", help="Ray cluster address; default $RAY_ADDRESS or a local Ray."),
    iters: int = typer.Option(10, "--iters", help="Timed all-reduces per message size."),
    verbose: bool = typer.Option(False, "--verbose/--quiet", help="Show Ray's own logs."),
) -> None:
    """Cluster doctor: nodes, CPUs/GPUs, auth; all-reduce and broadcast correctness; bandwidth."""
    # A run directory of its own each time: Ray Train refuses one that another Ray release wrote,
    # and a fixed one in /tmp would be shared with every user of the machine.
    with tempfile.TemporaryDirectory(prefix="raytrain-check-") as storage:
        cfg = TrainConfig(
            workers=workers, gpu=gpu, cpus_per_worker=cpus_per_worker, placement=placement,
            address=address, verbose=verbose, name="raytrain-check", storage_path=storage,
        )
        passed = check_cluster(cfg, iters)
    if not passed:
        raise typer.Exit(1)
