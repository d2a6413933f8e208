"""How the user's own code reaches the workers: already there on a shared filesystem, or shipped.

On Slurm and most HPC clusters the driver's directory is the same path, with the same files, on
every node, so the ranks simply run there. Where it is not (a laptop driving a cloud cluster,
nodes with local disks), the code's directory travels with Ray's runtime_env `working_dir`, which
every worker unpacks and runs in. A runtime_env costs seconds at start (Ray cannot reuse its idle
workers), so it is used only when a node lacks the code.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from raytrain_ddp.config import ConfigError

PROBE_TIMEOUT_S = 60.0
"""How long the per-node file check may take before we give up and ship the code."""
SHIP_EXCLUDES = [".git", "**/__pycache__", "*.pyc", ".venv", ".venv-*", "venv", "runs", "*.egg-info"]
"""Never shipped: version control, caches, virtual environments, our own run directories."""


@dataclass(frozen=True)
class Placement:
    directory: Path
    """The code's directory on the driver: shipped when some node lacks it."""
    nodes: int
    """Alive nodes in the cluster."""
    lacking: int
    """Nodes that do not see the probe file, the same bytes at the same path (0: shared)."""

    @property
    def shared(self) -> bool:
        return self.lacking == 0

    def runtime_env(self) -> dict[str, Any]:
        """The runtime_env entries that bring the code to the workers ({} when shared)."""
        if self.shared:
            return {}
        check_shippable(self.directory)
        return {"working_dir": str(self.directory), "excludes": SHIP_EXCLUDES}

    def describe(self) -> str:
        if self.shared:
            return "all on this machine" if self.nodes == 1 else f"a filesystem all {self.nodes} nodes share"
        return f"{self.lacking} of {self.nodes} nodes lack it; shipping {self.directory} with Ray's runtime_env"


def check_shippable(directory: Path) -> None:
    """A home directory or / would go to every node whole, dotfiles, keys and caches included."""
    directory = directory.resolve()
    if directory == Path.home().resolve() or directory == Path(directory.anchor):
        which = "your home directory" if directory != Path(directory.anchor) else "the filesystem root"
        raise ConfigError(
            f"the code to ship is in {directory}, {which}, and the nodes lack it; shipping would upload all "
            "of it to every node: move the script (or module) into a project directory of its own and run it there"
        )


def digest(path: Path) -> str | None:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None


def place(probe: Path, directory: Path) -> Placement:
    """Shared when every alive node has `probe` at the same path with the same bytes; otherwise
    `directory` (which holds `probe`) is shipped.

    A file's content, not just its path: a home directory that exists on each node's local disk
    must not pass for a shared one.
    """
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    probe, directory = probe.absolute(), directory.absolute()
    here = ray.util.get_node_ip_address()
    nodes = [n for n in ray.nodes() if n["Alive"]]
    if all(n["NodeManagerAddress"] == here for n in nodes):
        return Placement(directory, nodes=1, lacking=0)
    want = digest(probe)

    @ray.remote(num_cpus=0)
    def seen(path: str) -> str | None:
        return digest(Path(path))

    checks = [
        seen.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)).remote(str(probe))
        for n in nodes
    ]
    try:
        found = ray.get(checks, timeout=PROBE_TIMEOUT_S)
    except Exception:  # a node too busy to answer: shipping always works
        found = [None] * len(nodes)
    return Placement(directory, nodes=len(nodes), lacking=sum(f != want for f in found))


def user_code(code: dict[str, tuple[Path, Path]]) -> tuple[list[str], dict[str, Any]]:
    """(directories the workers import the user's --model/--dataset modules from, runtime_env entries
    that ship them), from `code`: each import path with its module's file and the directory it was
    imported from on the driver (RunPlan.code)."""
    placed = {source: place(*source) for source in set(code.values())}
    roots = {root for _, root in placed}
    placements = list(placed.values())
    if all(p.shared for p in placements):
        for root in sorted(roots):  # one line per directory, with every module the workers import from it
            specs = [spec for spec, source in code.items() if source[1] == root]
            print(f"importing {', '.join(specs)} from {root} on the workers ({placed[code[specs[0]]].describe()})")
        return sorted(str(r) for r in roots), {}
    if len(roots) > 1:
        raise ConfigError(
            f"--model and --dataset come from two directories ({', '.join(map(str, sorted(roots)))}) that the "
            "nodes do not share; put both modules in one directory, or on storage every node mounts"
        )
    shipped = next(p for p in placements if not p.shared)
    print(f"--model/--dataset modules: {shipped.describe()}")
    return [], shipped.runtime_env()  # Ray puts each worker's unpacked copy on its PYTHONPATH


def ship_code(address: str | None, verbose: bool, runtime_env: dict[str, Any]) -> None:
    """Connect again, with the user's code as the job's runtime_env: the only way Ray uploads a
    local directory. Only on a multi-node cluster whose nodes lack the code (a local Ray never)."""
    import ray

    from raytrain_ddp.driver.session.connect import connect

    if runtime_env:
        ray.shutdown()
        connect(address, verbose, runtime_env)
