"""The ways a run stops short of its last epoch, as exceptions: each carries the one line the user
reads, and the CLI maps each to its exit status (cli/__init__.py). Raised by the driver core (a
signal), the stall watches (doctor/), the session's watch on Ray (a lost cluster), the run's news
(a rank's bad config) and the doctor's blame of a bad node."""

from __future__ import annotations

from raytrain_ddp.config import ConfigError


class Stopped(Exception):
    """The run stopped early, as asked by SIGUSR1 or SIGTERM (after a checkpoint, where it makes them)."""

    def __init__(self, message: str, at_once: bool = False) -> None:
        super().__init__(message)
        self.at_once = at_once
        """The ranks did not answer in time and were ended: fit() may still block in Ray."""


class Interrupted(KeyboardInterrupt):
    """Ctrl-C: the run stopped (the first, after its ranks answered), or stopped at once (a second). A
    KeyboardInterrupt, as the Python API's callers expect of Ctrl-C."""

    def __init__(self, message: str, at_once: bool = False) -> None:
        super().__init__(message)
        self.at_once = at_once
        """A second Ctrl-C, or ranks that did not answer the first in time: the run did not wait for them."""


class Stalled(RuntimeError):
    """No rank finished a step for the stall timeout. The ranks were ended; fit() may still be
    blocked in Ray, so the CLI exits at once (os._exit) instead of waiting for it."""

    at_once = True


class RayLost(Exception):
    """The Ray cluster went away under the run (a part of the private Ray died, or a joined cluster's
    head): nothing of the run can go on, and Ray's own errors would only say that a call failed."""

    def __init__(self, what: str, kept: str = "Run the same command again to resume") -> None:
        super().__init__(f"the Ray cluster went away under the run: {what}. {kept}")
        self.what = what


class RankConfigError(ConfigError):
    """A ConfigError a rank raised (a checkpoint that does not load), told through the sink: a retry
    under --max-failures would raise it again, so the run ends at once."""


class NodeFailed(RuntimeError):
    """The run failed, and the nodes it failed on are recorded bad (doctor/bad_nodes.py): under the
    sbatch, the job requeues without them (EXIT_BAD_NODE); elsewhere it is a failed run."""

    def __init__(self, message: str, hosts: list[str], at_once: bool = False) -> None:
        super().__init__(message)
        self.hosts = hosts
        self.at_once = at_once
        """As the failure it stands for: the ranks were ended, and fit() may still block in Ray."""


class UnhealthyNode(Exception):
    """--health exclude found a node far below the others (doctor/health.py): the run stops before its
    first step."""

    at_once = True
    """The driver stops as the ranks leave their loop: fit() may not have returned yet."""

    def __init__(self, lines: list[str]) -> None:
        super().__init__(f"{'; '.join(lines)}; stopped before the first step under --health exclude "
                         "(--health warn trains on it)")
