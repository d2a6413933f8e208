"""Taking the ranks' stacks and ending them: `py-spy dump` of each rank (and of its DataLoader
workers) on the rank's own node, here for the ranks on the driver's host and by a Ray task pinned to
the node for the others; and SIGKILL the same way. What the stacks say is diagnosis.py's to read.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

from raytrain_ddp.doctor.diagnosis import EXITED, LOADER_LOOP, LoaderWorker
from raytrain_ddp.doctor.ranks import RankProcess

PY_SPY_TIMEOUT_S = 20.0
"""Seconds one py-spy dump may take (it pauses the rank a few milliseconds)."""


def dump_stacks(ranks: list[RankProcess], dump: Callable[[int], str] | None = None) -> list[str]:
    """Every rank's `py-spy dump` (or `dump`'s, e.g. glance): here for the ranks on this host, by a
    task on its node for the others."""
    asks = on_each_rank(ranks, dump or py_spy)
    return [ask if isinstance(ask, str) else fetch(ask, f"no answer from {r.ip}") for ask, r in zip(asks, ranks)]


def dump_loader_workers(ranks: list[RankProcess], dump: Callable[[int], list[LoaderWorker]] | None = None
                        ) -> list[list[LoaderWorker]]:
    """Every rank's loader workers with their stacks (`loader_workers`, or `dump`), on the rank's node."""
    asks = on_each_rank(ranks, dump or loader_workers)
    found = [ask if isinstance(ask, (list, str)) else fetch(ask, "") for ask in asks]
    return [workers if isinstance(workers, list) else [] for workers in found]  # a str: no node, no answer


def loader_workers(pid: int, pause: bool = True) -> list[LoaderWorker]:
    """The DataLoader workers under the process `pid` on this host, whatever their start method (a
    forkserver's are its grandchildren), with their stacks; an exited one (a zombie) too."""
    found = []
    for child in descendants(pid):
        if is_zombie(child):
            found.append(LoaderWorker(child, EXITED))
            continue
        text = py_spy(child, pause)
        if LOADER_LOOP in text:
            found.append(LoaderWorker(child, text))
    return found


def glance_loader_workers(pid: int) -> list[LoaderWorker]:
    """`loader_workers` without pausing them (as `glance`)."""
    return loader_workers(pid, pause=False)


def end_ranks(ranks: list[RankProcess], workers: list[list[LoaderWorker]] | None = None) -> None:
    """SIGKILL every rank: stuck in a collective, none would end before its timeout. Then its
    loader workers: one stuck in a lock never sees its rank is gone (torch's watchdog runs in its loop)."""
    for ask in on_each_rank(ranks, kill):
        if ask is not None and not isinstance(ask, str):
            fetch(ask, "")
    if workers and any(workers):
        pids = [[w.pid for w in mine] for mine in workers]
        for ask in on_each_rank(ranks, kill_all, pids):
            if ask is not None and not isinstance(ask, str):
                fetch(ask, "")


def descendants(pid: int) -> list[int]:
    """Every process under `pid`, from /proc/PID/task/*/children (the kernel's record of each
    thread's children: a worker forked from the training thread is that thread's child)."""
    found: list[int] = []
    todo = [pid]
    while todo:
        for children in Path(f"/proc/{todo.pop()}/task").glob("*/children"):
            try:
                kids = [int(kid) for kid in children.read_text().split()]
            except OSError:  # the thread or process ended meanwhile
                continue
            found += kids
            todo += kids
    return sorted(set(found))


def is_zombie(pid: int) -> bool:
    try:
        # The state follows the command's closing parenthesis (the command may hold spaces).
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] == "Z"
    except (OSError, IndexError):
        return False


def on_each_rank(ranks: list[RankProcess], call: Callable[[Any], Any], args: list[Any] | None = None) -> list[Any]:
    """`call(arg)` for every rank, where `arg` is the rank's pid or its entry in `args`: its result
    for the ranks on this host, a Ray task's reference (or why there is none) for the ranks on other nodes."""
    import ray

    there = ray.remote(num_cpus=0)(call)
    here = ray.util.get_node_ip_address()
    nodes = {n["NodeManagerAddress"]: n["NodeID"] for n in ray.nodes() if n.get("Alive")}
    args = args if args is not None else [r.pid for r in ranks]
    return [call(arg) if r.ip == here else on_node(nodes.get(r.ip), there, arg) for r, arg in zip(ranks, args)]


def on_node(node_id: str | None, task: Any, arg: Any) -> Any:
    """`task(arg)` on the node `node_id`, or why not."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    if node_id is None:
        return "py-spy not run: the rank's node is not alive in Ray"
    return task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)).remote(arg)


def fetch(ref: Any, failed: str) -> str:
    import ray

    try:
        return ray.get(ref, timeout=PY_SPY_TIMEOUT_S + 10)
    except Exception as err:  # a dead node, a timeout: the file says so
        return f"{failed}: {err}"


def py_spy(pid: int, pause: bool = True) -> str:
    """`py-spy dump --pid PID` on this host (py-spy comes with ray[default]), or why it failed.
    `pause=False` (--nonblocking) reads the stack without stopping the process: two paused dumps of
    one process at once fail (only one may attach), and an unpaused one costs the rank nothing."""
    exe = Path(sys.executable).with_name("py-spy")
    exe = str(exe) if exe.exists() else shutil.which("py-spy")
    if exe is None:
        return "py-spy failed: not found next to the Python interpreter nor on PATH (pip install py-spy)"
    try:
        done = subprocess.run([exe, "dump", "--full-filenames", *([] if pause else ["--nonblocking"]), "--pid", str(pid)],
                              capture_output=True, text=True, timeout=PY_SPY_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return f"py-spy failed: no dump of pid {pid} within {PY_SPY_TIMEOUT_S:.0f} s"
    if done.returncode != 0:
        return f"py-spy failed (exit {done.returncode}): {done.stderr.strip() or done.stdout.strip()}"
    return done.stdout


def glance(pid: int) -> str:
    """`py_spy` without pausing the rank: for looks every few seconds, and for `raytrain stack`, which
    may look while a watch does. A moving rank may read torn; a still one reads true."""
    return py_spy(pid, pause=False)


def kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def kill_all(pids: list[int]) -> None:
    for pid in pids:
        kill(pid)
