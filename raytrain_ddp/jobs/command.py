"""`raytrain submit`: a run as a Ray job on a long-lived cluster, through the Ray Jobs API; and
`raytrain status|logs|stop` to follow it from anywhere.

The job's entrypoint is `python -m raytrain_ddp run <flags>`, rebuilt from the config resolved here
(defaults, then --config, then flags), so the cluster runs what `raytrain run` would run here. Paths
(--storage-path, --data-dir) are the cluster's. The package's source, raytrain_ddp/ alone, travels
with the job as a `py_modules` entry: the cluster runs the code you have, with no internet, pip or
release needed; the cluster's Python must hold the dependencies (torch, torchvision, ray[train]...).

`raytrain submit [--address URL ...] launch [OPTIONS] SCRIPT.py [ARGS...]` submits a `raytrain
launch` instead: the entrypoint is that launch command line, and the script's directory (or the
module's root, with -m) travels too, as the job's `working_dir`, where the job's driver starts.

Exit status of `submit` and `logs --follow` is the job's: SUCCEEDED 0; FAILED the run's own status
(1 training failed, 2 bad request, 75 stopped with a checkpoint), else 1; STOPPED 130.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import re
import shlex
import sys
import time
from dataclasses import fields
from pathlib import Path
from typing import Any, Callable, Iterator

from raytrain_ddp.config import ConfigError, TrainConfig, resolve, run_flags
from raytrain_ddp.driver.plan.ray_train import PASSED_TO_WORKERS
from raytrain_ddp.driver.plan.shipping import SHIP_EXCLUDES
from raytrain_ddp.driver.session.connect import version_mismatch
from raytrain_ddp.errors import EXIT_INTERRUPTED
from raytrain_ddp.launch.target import LAUNCH_FIELDS, find_target
from raytrain_ddp.storage.location import below, is_uri

PACKAGE = Path(__file__).resolve().parents[1]
"""raytrain_ddp/, the source the job ships (found by path: the driver side never imports the package's face)."""

JOB_STOP_WAIT_S = 60
"""Seconds from `raytrain stop`'s SIGTERM to Ray's SIGKILL. The run checkpoints at its next agreed
step and exits in between; Ray's default, 3 s, is too short to save a checkpoint."""

CHECK_TIMEOUT_S = 10.0
"""Ray's client waits for the OS's TCP timeout (minutes) on an address that drops packets."""

JOB_END_WAIT_S = 30.0
"""How long the job may take to turn terminal after its log stream closed."""


# ---- where the cluster is, and how we prove who we are --------------------------------------------


def dashboard_address(address: str | None) -> str:
    """--address, else $RAY_API_SERVER_ADDRESS, else $RAY_ADDRESS when it is an http(s):// URL."""
    ray_address = os.environ.get("RAY_ADDRESS", "")
    address = (
        address
        or os.environ.get("RAY_API_SERVER_ADDRESS")
        or (ray_address if ray_address.startswith(("http://", "https://")) else None)
    )
    if not address:
        raise ConfigError(
            "no Ray cluster given: pass --address http://HEAD:8265 (the head's dashboard) "
            "or set RAY_API_SERVER_ADDRESS"
        )
    if "://" not in address:
        address = f"http://{address}"
    if not address.startswith(("http://", "https://")):
        raise ConfigError(
            f"--address {address} is not a dashboard URL; give the head's http://HEAD:8265 "
            "(not ray:// nor the GCS port)"
        )
    return address.rstrip("/")


def auth_headers() -> dict[str, str]:
    """The token where every Ray process looks: $RAY_AUTH_TOKEN, the file $RAY_AUTH_TOKEN_PATH, or,
    with RAY_AUTH_MODE=token, ~/.ray/auth_token. Sent explicitly so the check below and Ray's client
    agree on it."""
    token = os.environ.get("RAY_AUTH_TOKEN", "").strip()
    path = os.environ.get("RAY_AUTH_TOKEN_PATH")
    if not path and os.environ.get("RAY_AUTH_MODE") == "token":
        default = Path("~/.ray/auth_token").expanduser()
        path = str(default) if default.is_file() else None
    if not token and path:
        try:
            token = Path(path).expanduser().read_text().strip()
        except OSError as err:
            raise ConfigError(
                f"cannot read RAY_AUTH_TOKEN_PATH={path} ({err.strerror}); point it at the cluster's token file"
            ) from None
        if not token:
            raise ConfigError(f"RAY_AUTH_TOKEN_PATH={path} is empty; point it at the cluster's token file")
    return {"Authorization": f"Bearer {token}"} if token else {}


def check_dashboard(url: str, headers: dict[str, str], timeout_s: float = CHECK_TIMEOUT_S) -> str:
    """Fail in seconds with one line that names the fix; return the cluster's Ray version."""
    import requests

    try:
        reply = requests.get(f"{url}/api/version", headers=headers, timeout=timeout_s)
    except requests.exceptions.Timeout:
        reason = f"no answer within {timeout_s:.0f} s"
    except requests.exceptions.RequestException as err:
        reason = connection_reason(err)
    else:
        if reply.status_code == 401:
            raise ConfigError(
                f"the Ray cluster at {url} needs an auth token; set RAY_AUTH_TOKEN_PATH to the "
                "cluster's token file (or RAY_AUTH_TOKEN)"
            )
        if reply.status_code == 403:
            raise ConfigError(
                f"the Ray cluster at {url} refused our auth token; set RAY_AUTH_TOKEN_PATH to the "
                "cluster's token file (or RAY_AUTH_TOKEN)"
            )
        try:
            return str(reply.json()["ray_version"])
        except (ValueError, KeyError, TypeError):
            raise ConfigError(
                f"{url} answered HTTP {reply.status_code} but is not a Ray dashboard; --address takes "
                "the head's dashboard, http://HEAD:8265"
            ) from None
    raise ConfigError(
        f"no Ray dashboard answers at {url} ({reason}); check --address (http://HEAD:8265), that the "
        "head is up, and your port-forward or ssh tunnel"
    )


def connection_reason(err: BaseException) -> str:
    """'Connection refused' out of a page of urllib3 wrapping."""
    found = re.findall(r"\[Errno -?\d+\] ([^'\")\]]+)", str(err))
    return found[-1].strip() if found else type(err).__name__


def job_client(address: str | None) -> tuple[Any, str]:
    """A JobSubmissionClient for the cluster, checked first, and the dashboard URL."""
    url = dashboard_address(address)
    try:
        import aiohttp  # noqa: F401  the log stream needs it; it comes with ray[default]
        from ray.job_submission import JobSubmissionClient
    except ImportError:
        raise ConfigError("the Ray Jobs client is missing; pip install 'ray[default]'") from None
    headers = auth_headers()
    import ray

    if mismatch := version_mismatch(url, check_dashboard(url, headers), ray.__version__):
        raise ConfigError(mismatch)
    # Ray logs every package upload and socket close at INFO; we say what matters ourselves.
    for name in ("ray.dashboard.modules.dashboard_sdk", "ray.dashboard.modules.job.sdk",
                 "ray._private.runtime_env.packaging"):
        logging.getLogger(name).setLevel(logging.WARNING)
    # Ray's client lets these two override the address it is given.
    saved = {k: os.environ.pop(k) for k in ("RAY_API_SERVER_ADDRESS", "RAY_ADDRESS") if k in os.environ}
    try:
        with answers(url):
            return JobSubmissionClient(url, headers=headers), url
    finally:
        os.environ.update(saved)


@contextlib.contextmanager
def answers(url: str, job_id: str | None = None) -> Iterator[None]:
    """Ray's client errors (a refused token, an unknown job, a lost connection) as one line."""
    import requests
    from ray.exceptions import AuthenticationError

    try:
        yield
    except AuthenticationError:
        raise ConfigError(
            f"the Ray cluster at {url} refused our auth token; set RAY_AUTH_TOKEN_PATH to the "
            "cluster's token file (or RAY_AUTH_TOKEN)"
        ) from None
    except requests.exceptions.RequestException as err:
        raise RuntimeError(f"lost the Ray dashboard at {url} ({connection_reason(err)})") from None
    except RuntimeError as err:
        if job_id and "404" in str(err):
            raise ConfigError(
                f"no job {job_id} on the cluster at {url}; list them with `raytrain status --address {url}`"
            ) from None
        raise


# ---- the job: what runs on the cluster ----------------------------------------------------------


def for_cluster(cfg: TrainConfig) -> TrainConfig:
    """The config as the job's driver will see it: a fixed run name, the cluster's own paths."""
    for key, example in (("storage_path", "/mnt/shared/runs"), ("data_dir", "/mnt/shared/data")):
        path = getattr(cfg, key)
        if path is not None and not path.startswith(("/", "~")) and not is_uri(path):  # s3://: every node's
            flag = "--" + key.replace("_", "-")
            raise ConfigError(
                f"{flag} {path} is relative, but a submitted run starts in a temporary directory on "
                f"the cluster; give an absolute path there that all nodes share, e.g. {flag} {example}"
            )
    # The job's driver finds its cluster through $RAY_ADDRESS, which Ray sets for every job.
    return dataclasses.replace(cfg, name=cfg.name or time.strftime("run-%Y%m%d-%H%M%S"), address=None)


def entrypoint(cfg: TrainConfig) -> str:
    return shlex.join(["python", "-m", "raytrain_ddp", "run", *run_flags(cfg)])


def runtime_env() -> dict[str, Any]:
    """The package's source (never .venv, runs/ or tests), and the NCCL/Gloo settings you exported."""
    env_vars = {k: v for k, v in os.environ.items() if k.startswith(PASSED_TO_WORKERS)}
    env_vars["RAY_JOB_STOP_WAIT_TIME_S"] = str(JOB_STOP_WAIT_S)
    return {
        "py_modules": [str(PACKAGE)],
        "excludes": ["__pycache__", "*.pyc"],
        "env_vars": env_vars,
    }


def launch_job(argv: list[str], parse_launch: Callable[[list[str]], dict[str, Any]]) -> tuple[TrainConfig, str, dict[str, Any]]:
    """`raytrain launch ARGV` as a job: its config, its entrypoint and its runtime_env. ARGV is
    parsed by the real `launch` command (`parse_launch`, which the CLI passes in and which raises
    ConfigError on a usage error) and its script found here, so a typo fails in one line before
    anything is uploaded."""
    params = parse_launch(list(argv))
    if params["address"] is not None:
        raise ConfigError(
            f"--address {params['address']} in the launch command: the job's driver finds its cluster by itself; "
            "give the dashboard to submit, before `launch`: raytrain submit --address http://HEAD:8265 launch ..."
        )
    cfg = for_cluster(resolve(None, {key: params[key] for key in LAUNCH_FIELDS}))
    args = list(params["args"] or [])
    target = find_target(params["script"], params["module"], args)
    # The options are the user's, as typed: everything before the script (after it, all is the script's).
    options = list(argv[: len(argv) - 1 - len(args)])
    if params["name"] is None:
        options = ["--name", cfg.name, *options]  # first, in case the options end with `--`
    # The driver starts in the shipped copy of target.root; -m MODULE stays as typed (-m is among the options).
    script = target.name if target.module else str(target.file.relative_to(target.root))
    command = shlex.join(["python", "-m", "raytrain_ddp", "launch", *options, script, *args])
    env = runtime_env()
    env["working_dir"] = str(target.root)
    env["excludes"] = list(dict.fromkeys([*env["excludes"], *SHIP_EXCLUDES]))
    return cfg, command, env


def run_dir(cfg: TrainConfig) -> str:
    return below(cfg.storage_path, cfg.name)  # an object store's URI keeps its ?endpoint_override=


# ---- the commands ------------------------------------------------------------------------------


def submit(
    cfg: TrainConfig, address: str | None, wait: bool = True, dry_run: bool = False, launch: list[str] | None = None,
    parse_launch: Callable[[list[str]], dict[str, Any]] | None = None,
) -> int:
    """Submit `raytrain run` with cfg, or, given `launch` and a launch command line, that launch."""
    if launch:
        if launch[0] != "launch":
            raise ConfigError(
                f"submit takes run options, or `launch` and a launch command line, not {launch[0]!r}; e.g. "
                "raytrain submit --address http://HEAD:8265 launch -w 2 --storage-path /mnt/shared/runs train.py"
            )
        defaults = TrainConfig()
        mixed = [f.name for f in fields(TrainConfig) if getattr(cfg, f.name) != getattr(defaults, f.name)]
        if mixed:
            flag = "--" + mixed[0].replace("_", "-")
            raise ConfigError(
                f"{flag} is a run option, but submit takes either run options or a launch command; "
                "put launch's own options (-w, --storage-path...) after `launch`"
            )
        cfg, command, env = launch_job(launch[1:], parse_launch)
    else:
        cfg = for_cluster(cfg)
        command, env = entrypoint(cfg), runtime_env()
    if dry_run:
        print(f"entrypoint: {command}")
        print(f"runtime_env: {json.dumps(env, indent=2)}")
        print(f"run directory on the cluster: {run_dir(cfg)}")
        return 0
    client, url = job_client(address)
    with answers(url):
        job_id = client.submit_job(
            entrypoint=command,
            runtime_env=env,
            metadata={"raytrain_run": cfg.name, "raytrain_dir": run_dir(cfg)},
        )
    say(f"submitted {job_id} to {url}: run {cfg.name} -> {run_dir(cfg)} on the cluster")
    if not wait:
        print(job_id)  # alone on stdout, for JOB=$(raytrain submit --no-wait ...)
        return 0
    return follow(client, url, job_id)


def follow(client: Any, url: str, job_id: str) -> int:
    """Stream the job's logs to stdout until it ends; return its exit status."""

    async def stream() -> None:
        async for chunk in client.tail_job_logs(job_id):
            sys.stdout.write(chunk)
            sys.stdout.flush()

    try:
        with answers(url, job_id):
            asyncio.run(stream())
            info = client.get_job_info(job_id)
            deadline = time.monotonic() + JOB_END_WAIT_S
            while not info.status.is_terminal() and time.monotonic() < deadline:
                time.sleep(1.0)
                info = client.get_job_info(job_id)
    except KeyboardInterrupt:
        say(f"detached; job {job_id} keeps running. Follow it: raytrain logs {job_id} --follow "
            f"--address {url}; stop it: raytrain stop {job_id} --address {url}")
        return EXIT_INTERRUPTED  # the job was stopped, or Ctrl-C detached us from it
    if not info.status.is_terminal():
        raise RuntimeError(
            f"the log stream of {job_id} ended while the job is {info.status}; "
            f"follow it again with: raytrain logs {job_id} --follow --address {url}"
        )
    # Ray appends the log's tail to a failure's message; the logs were just streamed above.
    say(f"job {job_id} {info.status}: {first_line(info.message).split(', last available logs')[0]}")
    return job_exit_code(info)


def job_exit_code(info: Any) -> int:
    """The exit status a job's end maps to (the module's docstring lists them)."""
    status = str(info.status)
    if status == "SUCCEEDED":
        return 0
    if status == "STOPPED":
        return EXIT_INTERRUPTED  # the job was stopped, or Ctrl-C detached us from it
    code = info.driver_exit_code
    return code if isinstance(code, int) and 0 < code < 256 else 1


def status(address: str | None, job_id: str | None) -> int:
    client, url = job_client(address)
    with answers(url, job_id):
        if job_id is not None:
            info = client.get_job_info(job_id)
            print(f"{job_id}: {info.status}")
            meta = info.metadata or {}
            if "raytrain_run" in meta:
                print(f"  run: {meta['raytrain_run']} -> {meta.get('raytrain_dir', '?')} on the cluster")
            if info.message:
                print(f"  message: {first_line(info.message)}")
            print(f"  entrypoint: {info.entrypoint}")
            return 0
        submitted = [j for j in client.list_jobs() if j.submission_id]
    for info in sorted(submitted, key=lambda j: j.start_time or 0):
        run = (info.metadata or {}).get("raytrain_run", "-")
        print(f"{info.submission_id}  {str(info.status):9}  {run}")
    if not submitted:
        say(f"no jobs on the cluster at {url}")
    return 0


def logs(address: str | None, job_id: str, follow_logs: bool = False) -> int:
    client, url = job_client(address)
    with answers(url, job_id):
        client.get_job_status(job_id)  # an unknown id fails here, in one line, not in the stream
        if not follow_logs:
            sys.stdout.write(client.get_job_logs(job_id))
            return 0
    return follow(client, url, job_id)


def stop(address: str | None, job_id: str) -> int:
    client, url = job_client(address)
    with answers(url, job_id):
        stopping = client.stop_job(job_id)
        now = client.get_job_status(job_id)
    if stopping:
        say(f"stopping {job_id}: SIGTERM now; a run checkpoints at its next agreed step and exits "
            f"(Ray kills it after {JOB_STOP_WAIT_S} s). Watch: raytrain status {job_id} --address {url}")
    else:
        say(f"{job_id} had already ended: {now}")
    return 0


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def first_line(text: str | None) -> str:
    lines = [line.strip() for line in (text or "").splitlines() if line.strip()]
    return lines[0] if lines else ""

