"""The `raytrain` command line: flags to a TrainConfig, and bad input to one line on stderr.

Every `TrainConfig` field is a flag of `raytrain run` (and of the commands that run training), with
its docstring as the help text, so a new field is one edit in config.py. The command tree is built
here; each command lives with its kind (commands, jobs, data, bench), and the work in the modules
they call. This package is the only one that imports typer.
"""

from __future__ import annotations

import sys
import traceback
from typing import Any, Callable

import typer

from raytrain_ddp.cli.bench import (
    data_command,
    doctor_command,
    overhead_command,
    sharded_command,
    startup_scale_command,
)
from raytrain_ddp.cli.commands import (
    check_command,
    exit_at_once,
    export_command,
    launch_command,
    run_command,
    scale_command,
    stack_command,
    sweep_command,
    verify_command,
)
from raytrain_ddp.cli.data import convert_command
from raytrain_ddp.cli.jobs import logs_command, status_command, stop_command, submit_command
from raytrain_ddp.cli.options import takes_debug
from raytrain_ddp.cli.usage_errors import USAGE_ERROR, usage_line
from raytrain_ddp.config import ConfigError
from raytrain_ddp.driver.session.connect import stop_private_ray
from raytrain_ddp.errors import (
    EXIT_BAD_INPUT,
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_STOPPED,
    one_line,
)
from raytrain_ddp.stops import RayLost, Stopped

PLAIN_HELP = {"rich_markup_mode": None}
"""click's own --help: Rich's tables cut `run`'s option names short at 80 columns
(`--checkpoint-every…`), and read help texts as markup, where `[mlflow]` vanished."""

app = typer.Typer(
    help="Cluster-agnostic PyTorch DDP on Ray Train: a laptop, Slurm, KubeRay or any Ray cluster.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,  # main() turns errors into one line; --debug shows tracebacks
    **PLAIN_HELP,
)
data_app = typer.Typer(help="Prepare datasets for training.", no_args_is_help=True, **PLAIN_HELP)
bench_app = typer.Typer(help="Benchmarks that print figures (they assert nothing about speed).", no_args_is_help=True, **PLAIN_HELP)

REST_IS_THE_SCRIPTS = {"allow_interspersed_args": False}
"""launch's options end at the script, and submit's at `launch`: the words after are not theirs."""


def add(group: typer.Typer, name: str, command: Callable[..., Any], **settings: Any) -> None:
    """Make `command` the group's command `name`, taking --debug as every command does."""
    group.command(name, **settings)(takes_debug(command))


add(app, "run", run_command)
add(app, "scale", scale_command)
add(app, "sweep", sweep_command)
add(app, "launch", launch_command, context_settings=REST_IS_THE_SCRIPTS)
add(app, "submit", submit_command, context_settings=REST_IS_THE_SCRIPTS)
add(app, "status", status_command)
add(app, "logs", logs_command)
add(app, "stop", stop_command)
add(app, "stack", stack_command)
add(app, "verify", verify_command)
add(app, "export", export_command)
add(app, "check", check_command)
app.add_typer(data_app, name="data")
add(data_app, "convert", convert_command)
app.add_typer(bench_app, name="bench")
add(bench_app, "overhead", overhead_command)
add(bench_app, "data", data_command)
add(bench_app, "startup-scale", startup_scale_command)
add(bench_app, "sharded", sharded_command)
add(bench_app, "doctor", doctor_command)


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
        # Not standalone: typer would print its parse errors in a framed box; they come here instead
        code = app(args=argv, prog_name="raytrain", standalone_mode=False)
    except USAGE_ERROR as err:
        if type(err).__name__ == "NoArgsIsHelpError":  # a bare `raytrain` or group: its help, as --help
            print(err.ctx.get_help())
        else:
            print(f"error: {usage_line(err, ours(argv))}", file=sys.stderr)
        sys.exit(EXIT_BAD_INPUT)
    except typer.Abort:
        print("aborted", file=sys.stderr)
        sys.exit(EXIT_FAILED)
    except ConfigError as err:
        if debug:
            raise
        print(f"error: {err}", file=sys.stderr)
        sys.exit(EXIT_BAD_INPUT)
    except Stopped as err:
        print(f"stopped: {err}", file=sys.stderr)
        sys.exit(EXIT_STOPPED)
    except RayLost as err:
        if debug:
            traceback.print_exc()
        print(f"error: {err}", file=sys.stderr)
        stop_private_ray()  # wait until nothing of it is left
        exit_at_once(EXIT_FAILED)  # Ray's shutdown at exit would wait on a cluster that is gone
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(EXIT_INTERRUPTED)
    except Exception as err:  # a failed run: one line, not a wall of Ray internals
        if debug:
            raise
        print(f"error: {one_line(err)} (rerun with --debug for the traceback)", file=sys.stderr)
        sys.exit(EXIT_FAILED)
    sys.exit(code if isinstance(code, int) else 0)  # typer.Exit(code), or a command that returned
