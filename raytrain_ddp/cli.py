"""Command line: flags to a TrainConfig, and bad input to one line on stderr.

Every `TrainConfig` field is a flag of `raytrain run` (and of the commands that run training), with
its docstring as the help text, so a new field is one edit in config.py.
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
import tempfile
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any, Callable, Optional

import typer

from raytrain_ddp.driver import run as driver
from raytrain_ddp.config import (
    FIELD_TYPES,
    ConfigError,
    TrainConfig,
    field_docs,
    flag_decls,
    resolve,
)
from raytrain_ddp.data.convert import data_app
from raytrain_ddp.errors import (
    EXIT_BAD_INPUT,
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_STOPPED,
    one_line,
)
from raytrain_ddp.driver.launch import LAUNCH_FIELDS
from raytrain_ddp.driver.startup import process_started
from raytrain_ddp.driver import jobs as submit
from raytrain_ddp.bench.data import data_command

app = typer.Typer(
    help="Cluster-agnostic PyTorch DDP on Ray Train: a laptop, Slurm, KubeRay or any Ray cluster.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,  # main() turns errors into one line; --debug shows tracebacks
)


def train_options(
    command: Callable[..., Any] | None = None, *, own_flags: tuple[str, ...] = (), only: tuple[str, ...] | None = None
):
    """Give `command(cfg, ...)` one option per TrainConfig field, plus --config.

    Options left out arrive as None, so config.resolve lets the flags the user typed override the
    config file, and the file override the defaults. Fields in `own_flags` are the command's own
    (e.g. scale's --workers 1,2,4); with `only`, the command takes just those fields (and no --config).
    """
    if command is None:
        return functools.partial(train_options, own_flags=own_flags, only=only)
    own = list(inspect.signature(command).parameters.values())[1:]  # all but cfg
    docs = field_docs()
    taken = [f.name for f in fields(TrainConfig) if f.name not in own_flags and (only is None or f.name in only)]
    generated = []
    for f in fields(TrainConfig):
        if f.name not in taken:
            continue
        kinds = [k for k in FIELD_TYPES[f.name] if k is not type(None)]
        default = "" if f.default in (MISSING, None) else f" [default: {f.default}]"
        option = typer.Option(None, *flag_decls(f.name), help=docs[f.name] + default, show_default=False)
        kind = str if f.name == "workers" else kinds[0]  # N, or MIN:MAX (config.parse_workers)
        generated.append(inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=option, annotation=Optional[kind]))
    config_file = inspect.Parameter(
        "config",
        inspect.Parameter.KEYWORD_ONLY,
        default=typer.Option(None, "--config", help="YAML or TOML file of the same keys; flags override it."),
        annotation=Optional[Path],
    )
    params = own + ([config_file] if only is None else []) + generated

    @functools.wraps(command)
    def wrapper(**kwargs: Any) -> Any:
        flags = {name: kwargs.pop(name) for name in taken}
        cfg = resolve(kwargs.pop("config", None), flags)
        return command(cfg, **kwargs)

    del wrapper.__wrapped__  # typer must see the generated signature, not the original one
    wrapper.__signature__ = inspect.Signature(params)
    wrapper.__annotations__ = {p.name: p.annotation for p in params}
    return wrapper


DEBUG = typer.Option(False, "--debug", help="Show full tracebacks.")


@app.callback()
def _group() -> None:
    """Keeps `run` a subcommand while it is the only one."""


@app.command()
@train_options
def run(
    cfg: TrainConfig,
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the resolved config and Ray configs; start nothing."),
    debug: bool = DEBUG,
) -> None:
    """Train a model with DDP on Ray Train: a local Ray, $RAY_ADDRESS, or --address."""
    if dry_run:
        driver.dry_run(cfg)
        return
    try:
        summary = driver.run(cfg, launched=process_started())  # the start-up line counts our imports too
    except KeyboardInterrupt as err:  # typer would make it a silent exit 130; driver.Interrupted says how to resume
        print(f"stopped: {err}" if str(err) else "interrupted", file=sys.stderr)
        if getattr(err, "at_once", False):
            # A second Ctrl-C interrupts the driver wherever it is, Ray's C++ core mid-call included,
            # and the interpreter's teardown after it crashed the process 1 time in 5 (SIGSEGV, not
            # 130). The run's files are written; Ray ends a dead driver's job, and a local Ray with it.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(EXIT_INTERRUPTED)
        raise typer.Exit(EXIT_INTERRUPTED) from None
    final = summary["final"]
    print(
        f"done: {summary['world_size']} {summary['backend']} workers, val acc {final['val_acc']:.3f}, "
        f"{final['throughput']:.1f} samples/s, {summary['wall_time_s']:.1f} s -> {summary['run_dir']}"
    )


@app.command()
@train_options(own_flags=("workers", "strategy", "sharding"))
def scale(
    cfg: TrainConfig,
    workers: str = typer.Option("1,2", "--workers", "-w", help="Worker counts to run, e.g. 1,2,4,8."),
    strategy: Optional[str] = typer.Option(None, "--strategy", help="Strategies to compare, e.g. ddp,fsdp (default: ddp)."),
    sharding: Optional[str] = typer.Option(None, "--sharding", help="The fsdp runs' sharding: full, grad-op or hybrid (default: full)."),
    debug: bool = DEBUG,
) -> None:
    """Run the same job at each size (and strategy); write the scaling table (CSV, Markdown) and plot (PNG)."""
    from raytrain_ddp.driver.scale import parse_sizes, parse_strategies
    from raytrain_ddp.driver.scale import scale as run_scale

    # own flags, not TrainConfig's: a list of strategies, and a sharding for the fsdp runs among them
    run_scale(cfg, parse_sizes(workers), parse_strategies(strategy) if strategy else None, sharding)


@app.command("launch", context_settings={"allow_interspersed_args": False})
@train_options(only=LAUNCH_FIELDS)
def launch_command(
    cfg: TrainConfig,
    script: str = typer.Argument(..., metavar="SCRIPT.py|MODULE", help="The training script (or module, with -m)."),
    args: Optional[list[str]] = typer.Argument(None, metavar="[SCRIPT_ARGS]...", help="Passed to the script untouched."),
    module: bool = typer.Option(False, "-m", "--module", help="Run SCRIPT as a module, as `python -m` does."),
    show_ranks: str = typer.Option(
        "0", "--show-ranks", help="Ranks whose output this terminal shows: 0, 0,3 or all. Every rank's goes to logs/rank-N.log."
    ),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print what each rank would run and Ray's configs; start nothing."),
    stop_grace_s: float = typer.Option(
        30.0, "--stop-grace-s", help="After a forwarded SIGINT or SIGTERM, seconds before a rank still running gets SIGKILL."
    ),
    debug: bool = DEBUG,
) -> None:
    """Run a torchrun-style script on N Ray workers: RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT set.

    Options go before the script; everything after it is the script's. --workers MIN:MAX is elastic:
    every rank restarts at the new size when a node is lost or room appears. Exit status: the first
    failing rank's, 75 when SIGTERM stopped every rank cleanly, 130 after Ctrl-C, else 0.
    """
    from raytrain_ddp.driver.launch import find_target
    from raytrain_ddp.driver.launch import launch as run_script

    target = find_target(script, module, args or [])
    raise typer.Exit(run_script(cfg, target, show_ranks, dry_run, stop_grace_s, launched=process_started()))


submit.register(app, train_options, DEBUG)  # submit, status, logs, stop: Ray Jobs on a running cluster
app.add_typer(data_app, name="data")  # data convert: datasets to Parquet shards

bench_app = typer.Typer(help="Benchmarks that print figures (they assert nothing about speed).", no_args_is_help=True)
app.add_typer(bench_app, name="bench")


@bench_app.command("overhead")
@train_options
def bench_overhead(
    cfg: TrainConfig,
    rounds: int = typer.Option(3, "--rounds", help="A/B rounds; each runs all three variants."),
    debug: bool = DEBUG,
) -> None:
    """Ray Train vs plain torchrun on the same job: time to first step, samples/s, RSS, GPU memory."""
    from raytrain_ddp.bench.overhead import bench_overhead as run_bench

    if rounds < 1:
        raise ConfigError(f"--rounds must be at least 1 (got {rounds})")
    if cfg.gpu:
        import torch

        if torch.cuda.device_count() < cfg.workers:
            raise ConfigError(
                f"bench overhead --gpu runs on this machine, which has {torch.cuda.device_count()} GPUs "
                f"for --workers {cfg.workers}; lower --workers or drop --gpu"
            )
    run_bench(cfg, rounds)


bench_app.command("data")(data_command)


@bench_app.command("startup-scale")
def bench_startup_scale(
    workers: str = typer.Option("2,8,16", "--workers", help="World sizes, comma-separated."),
    nodes: int = typer.Option(8, "--nodes", help="Ray nodes to start on this machine (a head and joined nodes)."),
    cpus_per_node: int = typer.Option(2, "--cpus-per-node", help="Logical CPUs per simulated node."),
    rounds: int = typer.Option(1, "--rounds", help="Rounds; each runs every size and control arm."),
    debug: bool = DEBUG,
) -> None:
    """Start-up stages at each world size on a simulated multi-node Ray, with control arms for Ray's
    share and the imports' share."""
    from raytrain_ddp.bench.startup_scale import bench_startup_scale as run_bench
    from raytrain_ddp.driver.scale import parse_sizes

    sizes = parse_sizes(workers)
    if rounds < 1 or nodes < 1 or cpus_per_node < 1:
        raise ConfigError("--rounds, --nodes and --cpus-per-node must each be at least 1")
    if max(sizes) > nodes * cpus_per_node:
        raise ConfigError(f"--workers {max(sizes)} needs {max(sizes)} CPUs; raise --nodes or --cpus-per-node")
    run_bench(sizes, nodes, cpus_per_node, rounds)


@app.command()
def verify(
    run_dir: Path = typer.Argument(..., help="A run directory: <storage-path>/<name>."),
    debug: bool = DEBUG,
) -> None:
    """Check a finished run: files present, all epochs done, world size right, loss finite and fell."""
    from raytrain_ddp.driver.verify import verify as verify_run

    if not run_dir.is_dir():
        raise ConfigError(f"{run_dir} is not a directory; pass a run directory such as runs/<name>")
    if not verify_run(run_dir):
        raise typer.Exit(1)


@app.command()
def export(
    run_dir: Path = typer.Argument(..., help="A run directory: <storage-path>/<name>."),
    to: Path = typer.Option(..., "--to", help="The file to write, e.g. model.pt."),
    debug: bool = DEBUG,
) -> None:
    """Write the latest checkpoint's model, DDP's or FSDP's, as one plain state dict for inference."""
    from raytrain_ddp.checkpoint.export import export as export_run

    if not run_dir.is_dir():
        raise ConfigError(f"{run_dir} is not a directory; pass a run directory such as runs/<name>")
    print(export_run(run_dir, to))


@app.command()
def check(
    workers: int = typer.Option(2, "--workers", "-w", help="Ranks to test."),
    gpu: bool = typer.Option(False, "--gpu/--cpu", help="Test GPUs with NCCL (--gpu) or CPUs with gloo."),
    cpus_per_worker: int = typer.Option(1, "--cpus-per-worker", help="CPUs per rank."),
    placement: str = typer.Option("spread", "--placement", help="pack or spread (spread tests the network)."),
    address: Optional[str] = typer.Option(None, "--address", help="Ray cluster address; default $RAY_ADDRESS or a local Ray."),
    iters: int = typer.Option(10, "--iters", help="Timed all-reduces per message size."),
    verbose: bool = typer.Option(False, "--verbose/--quiet", help="Show Ray's own logs."),
    debug: bool = DEBUG,
) -> None:
    """Cluster doctor: nodes, CPUs/GPUs, auth; all-reduce and broadcast correctness; bandwidth."""
    from raytrain_ddp.driver.cluster_check import check as run_check

    # A run directory of its own each time: Ray Train refuses one that another Ray release wrote,
    # and a fixed one in /tmp would be shared with every user of the machine.
    with tempfile.TemporaryDirectory(prefix="raytrain-check-") as storage:
        cfg = TrainConfig(
            workers=workers, gpu=gpu, cpus_per_worker=cpus_per_worker, placement=placement,
            address=address, verbose=verbose, name="raytrain-check", storage_path=storage,
        )
        passed = run_check(cfg, iters)
    if not passed:
        raise typer.Exit(1)


def ours(argv: list[str]) -> list[str]:
    """The part of the command line that is raytrain's: for `launch` (and `submit ... launch`) the
    words before the script, since the script's own arguments may hold a --debug of their own."""
    for i, word in enumerate(argv):
        if word in ("-m", "--module") or word.endswith(".py"):
            return argv[:i]
    return argv


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    debug = "--debug" in ours(argv)
    try:
        app(args=argv, prog_name="raytrain")
    except ConfigError as err:
        if debug:
            raise
        print(f"error: {err}", file=sys.stderr)
        sys.exit(EXIT_BAD_INPUT)
    except driver.Stopped as err:
        print(f"stopped: {err}", file=sys.stderr)
        sys.exit(EXIT_STOPPED)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(EXIT_INTERRUPTED)
    except Exception as err:  # a failed run: one line, not a wall of Ray internals
        if debug:
            raise
        print(f"error: {one_line(err)} (rerun with --debug for the traceback)", file=sys.stderr)
        sys.exit(EXIT_FAILED)
