"""The driver's session with Ray: joining a cluster (or starting the private local Ray), the watch
that says when it went away, and the one-line refusals of a cluster this driver cannot join."""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import re
import socket
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

from raytrain_ddp.config import ConfigError, TrainConfig
from raytrain_ddp.driver.session import keeper
from raytrain_ddp.ray_compat.state import cluster_ray_version, quiet_ray_notices, use_token_auth

if TYPE_CHECKING:
    from raytrain_ddp.driver.session.private import PrivateRay


def ray_address(cfg: TrainConfig) -> str | None:
    """The cluster a request names: --address, else $RAY_ADDRESS; None for the private local Ray."""
    return cfg.address or os.environ.get("RAY_ADDRESS") or None


def connect(address: str | None, verbose: bool = False, runtime_env: dict[str, Any] | None = None) -> None:
    """Join the Ray cluster at `address` (ray_address), or start the private one where it is None.
    `runtime_env` is the job's, for all its workers: Ray ships a local directory (the user's code)
    only when the connection is made with it. The one ray.init of the driver side."""
    global _joined
    import ray

    if ray.is_initialized():  # `raytrain scale` runs several trainings on one connection
        return
    if address is None:
        # Our own head, by its address and token: never whatever Ray this machine last started
        # (None or "auto"), which may be another user's or another job's.
        if not verbose:
            quiet_ray_notices()
        private = private_ray_up()
        use_token_auth(str(private.token))
        join(private.address, runtime_env, verbose, private.directory / "driver-connect.log",
             refused=f"this driver's private Ray at {private.address} refused its own token (a bug of raytrain's: "
                     f"please report it); its logs: {private.directory}",
             fix=f"its logs: {private.directory}")
        return
    if address == "auto":
        raise ConfigError("--address auto could join someone else's Ray; give the cluster's host:port")
    check_reachable(address)
    if os.environ.get("RAY_AUTH_TOKEN_PATH") or os.environ.get("RAY_AUTH_TOKEN"):
        # A driver that names an address does not turn token auth on by itself, even with a token.
        os.environ.setdefault("RAY_AUTH_MODE", "token")
    join(address, runtime_env, verbose, None,
         refused=f"the Ray cluster at {address} refused our auth token; set RAY_AUTH_TOKEN_PATH to the cluster's "
                 "token file (and RAY_AUTH_MODE=token)",
         fix="check --address or $RAY_ADDRESS, and for a token-secured cluster RAY_AUTH_MODE=token and "
             "RAY_AUTH_TOKEN_PATH")
    _joined = GcsWatch(address) if not address.startswith("ray://") else None


def join(address: str, runtime_env: dict[str, Any] | None, verbose: bool, log_to: Path | None, refused: str,
         fix: str) -> None:
    """ray.init at `address`, or one line (ConfigError) that says why not: `refused` where the cluster
    refuses our token, else the reason and `fix`. Ray's C++ core logs every retry on stderr, a line
    a second for most of a minute: those lines go to `log_to` (a temporary file where None)."""
    import ray
    from ray.exceptions import AuthenticationError

    with stderr_captured(not verbose, log_to) as log:
        try:
            # Before ray.init: a refused token is known here in milliseconds (ray.init retries it for
            # 20 s), and across releases ray.init may not get far enough to say the versions differ (a
            # 2.52 driver retries, for most of a minute, a key a 2.60 cluster no longer writes).
            theirs = None if address.startswith("ray://") else cluster_ray_version(address)
        except AuthenticationError:
            raise ConfigError(refused) from None
        if theirs and (mismatch := version_mismatch(address, theirs, ray.__version__)):
            raise ConfigError(mismatch)
        try:
            ray.init(address=address, runtime_env=runtime_env,
                     logging_level=logging.INFO if verbose else logging.WARNING, log_to_driver=verbose)
            return
        except (ConnectionError, RuntimeError, AuthenticationError) as err:
            if mismatch := ray_mismatch(address, str(err)):
                raise ConfigError(mismatch) from None
            reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            said = log.read_text(errors="replace") if log is not None else ""
            token_refused = isinstance(err, AuthenticationError) or "InvalidAuthToken" in said
    if token_refused:
        raise ConfigError(refused)
    if lost := ray_lost(wait_s=LOST_SETTLE_S):
        raise ConfigError(f"cannot connect to the Ray cluster at {address}: {lost}; {fix}")
    raise ConfigError(f"cannot connect to the Ray cluster at {address} ({reason}); {fix}")


_private: PrivateRay | None = None
"""This process's private Ray, from the command's start (start_private_ray) to its end."""
_joined: GcsWatch | None = None
"""The GCS of the cluster this process joined by address, watched while a run is driven."""


def start_private_ray(cfg: TrainConfig) -> None:
    """Spawn the private Ray now, when the command will want one (no --address): it comes up while the
    driver imports torch and checks the request. It ends when this process does (PrivateRay.stop at
    exit, or its keeper on seeing this process gone)."""
    if ray_address(cfg) is None:
        spawn_private_ray()


def spawn_private_ray() -> None:
    global _private
    if _private is not None:
        return
    from raytrain_ddp.driver.session.private import PrivateRay

    _private = PrivateRay()
    atexit.register(stop_private_ray)  # after ray.shutdown, which ray.init registers later


def private_ray_up() -> PrivateRay:
    global _private
    from raytrain_ddp.driver.session.private import up

    spawn_private_ray()  # now, if the command did not at its start
    _private = up(_private)
    return _private


def stop_private_ray() -> None:
    """End the private Ray and wait until every process of it is gone (a no-op without one)."""
    if _private is not None:
        _private.stop()


LOST_SETTLE_S = 4.0 + keeper.REPORT_WAIT_S
"""How long an error in a run may wait for the cluster's loss to be known before it is reported as
itself, once the loss is suspected: the keeper waits up to REPORT_WAIT_S for `ray start` to say
which part died, a joined GCS GCS_LOST_S."""
SUSPECT_S = 1.2
"""How long it waits for a first sign of a loss (the keeper looks every 0.25 s, GcsWatch once a
second): without one, a failed run's error is its own."""


def ray_lost(wait_s: float = 0.0) -> str | None:
    """Which part of the Ray cluster this driver uses went away, in words; None while it is there (or
    where we cannot tell). `wait_s`: how long to wait for a suspected loss to show."""
    watch = _private if _private is not None else _joined
    if watch is None:
        return None
    start = time.monotonic()
    while True:
        lost = watch.lost()
        waited = time.monotonic() - start
        if lost or waited >= wait_s or (waited >= SUSPECT_S and not watch.suspect()):
            return lost
        time.sleep(0.1)


GCS_LOST_S = 3.0
"""How long a joined cluster's GCS may refuse connections before the cluster counts as gone."""


@dataclass
class GcsWatch:
    """A joined cluster's GCS, checked by a TCP connect at most once a second: Ray's own client
    retries a lost GCS for 60 s, a line a second, before it gives up."""

    address: str
    failing_since: float | None = None
    checked: float = 0.0
    reason: str = ""

    def suspect(self) -> bool:
        return self.failing_since is not None

    def lost(self) -> str | None:
        now = time.monotonic()
        if now - self.checked >= 1.0:
            self.checked = now
            host, _, port = self.address.rpartition(":")
            try:
                socket.create_connection((host, int(port)), timeout=1.0).close()
                self.failing_since = None
            except OSError as err:
                self.failing_since = self.failing_since or now
                self.reason = err.strerror or str(err)
        if self.failing_since is None or now - self.failing_since < GCS_LOST_S:
            return None
        return f"its head's GCS at {self.address} does not answer ({self.reason})"


RAY_MISMATCH = re.compile(r"started with:\s+Ray: (\S+)\s+Python: (\S+)\s+This process .*? started with:\s+Ray: (\S+)\s+Python: (\S+)", re.S)
"""Ray's refusal of a driver whose Ray or Python differs from the cluster's (ray._private.utils.check_version_info)."""


def version_mismatch(address: str, cluster_ray: str, driver_ray: str) -> str | None:
    """The one line for a driver whose Ray is not the cluster's, or None when they match."""
    if cluster_ray == driver_ray:
        return None
    return (
        f"the Ray cluster at {address} runs Ray {cluster_ray}, and this driver Ray {driver_ray}; a driver "
        f"must run the cluster's exact Ray: pip install 'ray[default,train]=={cluster_ray}'"
    )


def ray_mismatch(address: str, refusal: str) -> str | None:
    """Ray's page-long version refusal (ray.init), as one line that names the fix; None for any other error."""
    found = RAY_MISMATCH.search(refusal)
    if found is None:
        return None
    cluster_ray, cluster_python, driver_ray, driver_python = found.groups()
    return version_mismatch(address, cluster_ray, driver_ray) or (
        f"the Ray cluster at {address} runs Python {cluster_python}, and this driver Python {driver_python}; "
        f"Ray needs the same: run raytrain from a Python {cluster_python} environment"
    )


@contextlib.contextmanager
def stderr_captured(enabled: bool, log_to: Path | None = None) -> Iterator[Path | None]:
    """Send fd 2 to `log_to` (appended; a temporary file where None): Ray's C++ core logs each
    connection retry there, a line a second."""
    if not enabled:
        yield None
        return
    with contextlib.ExitStack() as files:
        if log_to is None:
            log = files.enter_context(tempfile.NamedTemporaryFile(prefix="raytrain-connect-", suffix=".log"))
        else:
            log = files.enter_context(open(log_to, "ab"))
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(log.fileno(), 2)
        try:
            yield Path(log.name)
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)


def check_reachable(address: str, timeout_s: float = 5.0) -> None:
    """Ray retries an unreachable GCS forever; a plain TCP connect fails in seconds instead."""
    if address.startswith(("http://", "https://")):
        raise ConfigError(
            f"--address {address} is a dashboard's (the Jobs API): run trains from a node of the cluster, at its "
            "GCS address HEAD:6379; from elsewhere, submit it with `raytrain submit --address URL`"
        )
    host, _, port = address.split("://")[-1].rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"--address {address!r} is not host:port (e.g. 10.0.0.1:6379)")
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as err:
        raise ConfigError(
            f"no Ray cluster answers at {address} ({err.strerror or err}); check --address or "
            "$RAY_ADDRESS, and that the head node is up"
        ) from None
