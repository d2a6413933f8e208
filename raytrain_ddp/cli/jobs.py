"""`raytrain submit|status|logs|stop`: Ray jobs on a running cluster (jobs/command.py does the work)."""

from __future__ import annotations

from typing import Any, Optional

import typer

from raytrain_ddp.cli.options import train_options
from raytrain_ddp.config import ConfigError, TrainConfig
from raytrain_ddp.jobs import command as jobs

ADDRESS_HELP = (
    "The cluster's dashboard, http://HEAD:8265. Default: $RAY_API_SERVER_ADDRESS, or $RAY_ADDRESS "
    "if it is http(s)://. Token: $RAY_AUTH_TOKEN_PATH or $RAY_AUTH_TOKEN."
)
ADDRESS = typer.Option(None, "--address", help=ADDRESS_HELP)
JOB_ID = typer.Argument(..., metavar="JOB_ID", help="A job id from `raytrain submit`.")


@train_options(own_flags=("address",))
def submit_command(
    cfg: TrainConfig,
    ctx: typer.Context,
    launch: Optional[list[str]] = typer.Argument(
        None, metavar="launch OPTIONS SCRIPT.py ARGS",
        help="Submit a `raytrain launch` command line instead of a run (submit's own options go before it).",
    ),
    address: Optional[str] = ADDRESS,
    wait: bool = typer.Option(
        True, "--wait/--no-wait", help="Stream the logs and exit with the job's status (--no-wait: print the job id)."
    ),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the job's entrypoint and runtime_env; submit nothing."),
) -> None:
    """Run training, or `launch` a script, as a Ray job; exit 0 SUCCEEDED, the run's status FAILED, 130 STOPPED."""

    def parse_launch(argv: list[str]) -> dict[str, Any]:
        """What this CLI's own `launch` command makes of argv, without running it."""
        command = ctx.find_root().command.get_command(ctx, "launch")
        try:
            return command.make_context("launch", argv).params
        except typer.TyperException as err:  # click's usage errors, as typer ships them
            reason = " ".join(err.format_message().split()).rstrip(".")
            raise ConfigError(f"in the launch command: {reason}; see raytrain launch --help") from None

    raise typer.Exit(jobs.submit(cfg, address, wait=wait, dry_run=dry_run, launch=launch, parse_launch=parse_launch))


def status_command(
    job_id: Optional[str] = typer.Argument(None, metavar="JOB_ID", help="A job id from `raytrain submit`; omit to list the jobs."),
    address: Optional[str] = ADDRESS,
) -> None:
    """Show a submitted job's status, or list the cluster's jobs."""
    raise typer.Exit(jobs.status(address, job_id))


def logs_command(
    job_id: str = JOB_ID,
    follow_logs: bool = typer.Option(
        False, "--follow", "-f", help="Stream until the job ends and exit with its status, as submit does."
    ),
    address: Optional[str] = ADDRESS,
) -> None:
    """Print a submitted job's logs."""
    raise typer.Exit(jobs.logs(address, job_id, follow_logs))


def stop_command(job_id: str = JOB_ID, address: Optional[str] = ADDRESS) -> None:
    """Stop a submitted job: SIGTERM, so the run checkpoints and exits; SIGKILL after 60 s."""
    raise typer.Exit(jobs.stop(address, job_id))
