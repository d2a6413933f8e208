"""What a `raytrain launch` runs and with which of the run's settings: the script or module, found
and checked on the driver (and by `raytrain submit`), before any worker starts."""

from __future__ import annotations

import importlib.util
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from raytrain_ddp.config import ConfigError

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
