"""`raytrain run`'s stall watch: when no rank has finished a training step (or an epoch's validation
has not moved) for --stall-timeout seconds, dump every rank's Python stack with py-spy, say where
each rank is and which one the others wait for, end the ranks and fail the run, instead of waiting
out the collective's timeout (30 min).
Where Ray Train may restart the worker group (--max-failures, an elastic run), a stall is one such
failure: the ranks are ended and the group restarts from the latest checkpoint. A stop the ranks do
not answer in time (run.py) gets the same report.

A step is known from rank 0's beats to the sink (sink.py: a step update about once a second, a
validation batch at most once a second, and the end of a checkpoint, whose writing is no stall).
Under DDP rank 0 cannot finish a step while any rank is stuck, so its silence is the world's; in
validation it can, until the collective that ends it.

A rank's DataLoader workers are read too (its child processes): a rank that waits on its loader
is stuck where they are.

How a stack is read, the diagnosis and the kill serve `raytrain launch`'s watch too (launch_stall.py),
and the reading `raytrain stack` (stack.py).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

MIN_STALL_S = 120.0
"""The default stall timeout's floor: a first epoch's loader start or a slow step is no stall."""
SLOW_STEPS = 10
"""... and the default is at least this many of the slowest recent gaps between steps."""
PY_SPY_TIMEOUT_S = 20.0
"""Seconds one py-spy dump may take (it pauses the rank a few milliseconds)."""
OURS = "raytrain_ddp/"
STDLIB = re.compile(r"/lib/python3\.\d+/(?!site-packages|dist-packages)|^<")
"""A frame of the interpreter's own library (threading.py), or of no file (<frozen ...>, <string>)."""
FRAME = re.compile(r"^\s+(?P<func>\S.*?) \((?P<file>.+):(?P<line>\d+)\)\s*$")
"""One frame of `py-spy dump`: `    Event.wait (/usr/lib/python3.11/threading.py:629)`."""
COLLECTIVES = {
    "all_reduce", "all_gather", "all_gather_object", "all_gather_into_tensor", "broadcast", "broadcast_object_list",
    "barrier", "monitored_barrier", "reduce", "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "gather",
    "scatter", "send", "recv", "wait",
}
"""torch.distributed's functions that wait for the other ranks."""
STEP_SILENCE = "no rank finished a training step"
"""What a stalled `raytrain run` did not do (launch's watch says its own)..."""
VALIDATION_SILENCE = "the epoch's validation did not move"
"""... and what it did not do in the phase after an epoch's last step (sink.py's "validation")."""
STAGES = ("(forward)", "(backward)")
"""Where in forward_backward a rank waits, in the order a step passes them."""
LOADER_LOOP = "torch/utils/data/_utils/worker.py"
"""The file of a DataLoader worker's loop: a process under a rank that runs it is one of its loader workers."""
LOADER_WAIT = "torch/utils/data/dataloader.py"
"""... and a rank's frame in this file waits on its loader."""


class Stalled(RuntimeError):
    """No rank finished a step for the stall timeout. The ranks were ended; fit() may still be
    blocked in Ray, so the CLI exits at once (os._exit) instead of waiting for it."""

    at_once = True


@dataclass(frozen=True)
class Place:
    """Where one rank's stack stands."""

    frame: str
    """The innermost frame in the user's code or ours (not torch's or Ray's): `file:line in func`."""
    collective: str | None
    """The collective it waits in, or None."""


def stall_limit(timeout: float | None, gaps: list[float]) -> float | None:
    """The seconds of silence that make a stall: --stall-timeout, or by default the longer of 2
    minutes and 10 of the slowest recent steps; None when the watch is off (0)."""
    if timeout == 0:
        return None
    return timeout if timeout is not None else max(MIN_STALL_S, SLOW_STEPS * max(gaps, default=0.0))


@dataclass(frozen=True)
class Report:
    """One diagnosed stall, as summary.json's `stalls` lists it."""

    at: float
    """When it was diagnosed (time.time())."""
    quiet_s: float | None
    """Seconds rank 0 had finished no training step, or no validation batch (None: it was writing a
    checkpoint, or had finished no step yet)."""
    culprits: list[int]
    """The ranks not where the others wait."""
    line: str
    """The verdict: who is where."""
    stacks: str
    """The folder of the ranks' stacks: stall/ for the run's first, stall-2/ for its second, ..."""


@dataclass(frozen=True)
class LoaderWorker:
    """One of a rank's DataLoader worker processes, as found on the rank's node."""

    pid: int
    stack: str
    """Its `py-spy dump`, or EXITED."""


EXITED = "exited: a zombie its rank has not reaped"
"""A loader worker that died: the rank's loader waits for a batch it will never send."""


class StallWatch:
    """Asks the sink how long rank 0 has been silent, and diagnoses each stall: the first one past
    `restarts` fails the run; the ones before are failures Ray Train restarts the group from."""

    def __init__(self, sink: Any, timeout: float | None, run_dir: Path, say: Callable[[str], None], restarts: int = 0) -> None:
        self.sink, self.timeout, self.run_dir, self.say, self.restarts = sink, timeout, Path(run_dir), say, restarts
        self.stalls: list[Report] = []
        """The stalls the run recovered from (and the last, if it failed it)."""

    def check(self, ranks: list[dict[str, Any]]) -> None:
        """Raise Stalled, after the diagnosis, when the run is stalled and may not restart."""
        if self.timeout == 0 or not ranks:
            return
        import ray

        quiet, gaps, phase = ray.get(self.sink.quiet.remote())
        limit = stall_limit(self.timeout, gaps)
        if quiet is None or limit is None or quiet < limit:
            return
        stacks = dump_stacks(ranks)
        if not any(map(is_stack, stacks)):
            # No rank's process is there: Ray Train is ending or restarting the worker group (a
            # failure, a resize, our own end of a stalled group), which is no stall. Count again from
            # now; the new group's start (sink.start) restarts the count anyway.
            self.sink.phase.remote(None)
            return
        report = diagnose(ranks, stacks, quiet, stall_folder(self.run_dir, self.stalls), self.say, silence=silence_in(phase))
        self.stalls.append(report)
        if len(self.stalls) > self.restarts:
            raise Stalled(report.line)
        self.sink.ended_for_stall.remote()
        self.say(f"{report.line}; the ranks were ended: Ray Train restarts them from the latest checkpoint "
                 f"({restart_count(self.stalls, self.restarts)})")

    def report_now(self, ranks: list[dict[str, Any]]) -> Report:
        """Diagnose the ranks as stalled now, whatever the timeout (the watch may be off): a stop
        they did not answer in time."""
        import ray

        quiet, _, phase = ray.get(self.sink.quiet.remote())
        return diagnose(ranks, dump_stacks(ranks), quiet, stall_folder(self.run_dir, self.stalls), self.say,
                        silence=silence_in(phase))


def restart_count(stalls: list[Report], restarts: int) -> str:
    """How many stalls the run has restarted from, of how many it may (the stall line's end)."""
    return f"stall {len(stalls)}; it restarts at most {restarts} failed worker groups"


def stall_folder(run_dir: Path, before: list[Report]) -> Path:
    """Where the next stall's stacks go: each stall keeps its own (stall/, stall-2/, ...)."""
    return run_dir / ("stall" if not before else f"stall-{len(before) + 1}")


def diagnose(ranks: list[dict[str, Any]], stacks: list[str], quiet: float | None, folder: Path,
             say: Callable[[str], None], silence: str = STEP_SILENCE) -> Report:
    """Write every rank's stack to `folder`/rankN.txt (its loader workers' to rankN-loader-workerI.txt),
    say where each is, end the ranks, and return the report that names the rank the others wait for
    (and, after it, any loader worker not waiting for work). `silence`: what did not happen for
    `quiet` seconds (a launched script has no steps: its stacks did not change)."""
    folder.mkdir(parents=True, exist_ok=True)
    places = []
    say(f"stalled: {silent_for(silence, quiet)}; every rank's stack -> {folder}")
    workers = dump_loader_workers(ranks)
    for rank, (where, text) in enumerate(zip(ranks, stacks)):
        (folder / f"rank{rank}.txt").write_text(text)
        place = read_place(text)
        places.append(place)
        waits = f"waits in {place.collective}" if place.collective else "waits in no collective"
        say(f"  rank {rank} on {where['hostname']} pid {where['pid']}: {place.frame}; {waits}")
        for i, worker in enumerate(workers[rank]):
            (folder / f"rank{rank}-loader-worker{i}.txt").write_text(worker.stack)
            say(f"    {worker_label(rank, i, worker)} {loader_place(worker.stack)}")
    end_ranks(ranks, workers)
    line = verdict(ranks, places, quiet, folder, silence)
    finding = loader_finding(stacks, workers)
    return Report(time.time(), quiet, culprit_ranks(places), f"{line}; {finding}" if finding else line, str(folder))


def worker_label(rank: int, i: int, worker: LoaderWorker) -> str:
    return f"rank {rank}'s loader worker {i} (pid {worker.pid})"


def loader_place(stack: str) -> str:
    """Where a loader worker is, as a phrase after its label: waiting for work, in the dataset's code
    (the innermost frame of the user's or ours), or wherever its loop stands (a lock held at fork
    time shows here); or that it exited."""
    if stack == EXITED:
        return "has exited (a zombie its rank has not reaped)"
    if not is_stack(stack):
        return f"has no stack ({stack.splitlines()[0] if stack else 'py-spy said nothing'})"
    frames = loader_frames(stack)
    loop = next((i for i, m in enumerate(frames) if m["file"].endswith(LOADER_LOOP)), None)
    if loop is None:
        return "is not in a loader's loop"
    called = frames[loop - 1] if loop > 0 else None
    if called is not None and called["file"].endswith("multiprocessing/queues.py") and called["func"].endswith("get"):
        return "waits for work"
    m = next((m for m in frames[:loop] if is_ours(m["file"])), frames[0])
    return f"is at {m['file']}:{m['line']} in {m['func']}"


def loader_frames(stack: str) -> list[re.Match[str]]:
    """The frames, innermost first, of the worker's thread that runs the loader's loop."""
    blocks = re.split(r"^Thread ", stack, flags=re.M)[1:]
    threads = [[m for m in map(FRAME.match, block.splitlines()[1:]) if m] for block in blocks]
    return next((frames for frames in threads if any(m["file"].endswith(LOADER_LOOP) for m in frames)), [])


def loader_finding(stacks: list[str], workers: list[list[LoaderWorker]]) -> str | None:
    """The one line on the ranks' loader workers: the ones not waiting for work (stuck in the
    dataset, in a lock, or exited), or a rank that waits on its loader with no live worker, or
    whose workers all wait for work (a batch lost between them); None when nothing stands out."""
    said = []
    for rank, (text, mine) in enumerate(zip(stacks, workers)):
        busy = [f"{worker_label(rank, i, w)} {where}" for i, w in enumerate(mine)
                if (where := loader_place(w.stack)) != "waits for work"]
        waits = any(LOADER_WAIT in m["file"] for m in training_frames(text))
        if busy:
            said += busy
        elif waits and not mine:
            said.append(f"rank {rank} waits on its loader, which has no worker process left")
        elif waits:
            said.append(f"rank {rank} waits on its loader, whose {len(mine)} workers all wait for work")
    return "; ".join(said) or None


def silence_in(phase: str | None) -> str:
    """What a stalled run did not do, in the phase rank 0 is in."""
    return VALIDATION_SILENCE if phase == "validation" else STEP_SILENCE


def silent_for(silence: str, quiet: float | None) -> str:
    if quiet is None:
        return "rank 0 is writing a checkpoint, or has finished no step yet"
    return f"{silence} for {quiet:.0f} s"


def verdict(ranks: list[dict[str, Any]], places: list[Place], quiet: float | None, folder: Path,
            silence: str = STEP_SILENCE) -> str:
    """The one line: which rank(s) are not where the others wait, and where they are."""
    head = "the run stalled" if quiet is None else f"the run stalled ({silence} for {quiet:.0f} s)"
    common = where_most_wait(places)
    if common is None and len({p.collective for p in places if p.collective}) > 1:
        each = ", ".join(f"rank {r} in {p.collective or 'no collective'} at {p.frame}" for r, p in enumerate(places))
        return (f"{head}: the ranks wait in different collectives ({each}): one skipped a collective the others "
                f"called, or called one they do not; stacks in {folder}")
    culprits = culprit_ranks(places)
    if not culprits:
        return f"{head}, and no rank stands apart from the others; see the stacks in {folder}"
    named = "; ".join(f"rank {r} ({ranks[r]['hostname']} pid {ranks[r]['pid']}) is at {places[r].frame}"
                      + (f" in {places[r].collective}" if places[r].collective else "") for r in culprits)
    if common is None:  # no rank in a collective (outside_the_loop)
        at = next(p.frame for rank, p in enumerate(places) if rank not in culprits)
        return (f"{head}: {named}, while the others wait in the training loop at {at} (under NCCL, for the GPU, "
                f"where a collective waits); stacks in {folder}")
    at = next(p.frame for p in places if p.collective == common)
    return f"{head}: {named}, while the others wait in {common} at {at}{why_apart(places, culprits, common)}; " \
           f"stacks in {folder}"


def why_apart(places: list[Place], culprits: list[int], common: str) -> str:
    """What ranks in another collective than the others' mean: past it (a rank in backward has
    passed the forward the others wait in), or in another order of calls."""
    theirs = {places[r].collective for r in culprits} - {None}
    if not theirs:
        return ""  # stuck outside any collective: its frame says where
    who = f"rank {culprits[0]}" if len(culprits) == 1 else "ranks " + ", ".join(map(str, culprits))
    behind = stage_of(common)
    if behind is not None and all((stage_of(c) or -1) > behind for c in theirs):
        return f"; {who} went past that collective: skipped it, or the others call one extra"
    return f"; {who} and the others call different collectives: one skipped, or one extra"


def culprit_ranks(places: list[Place]) -> list[int]:
    """The ranks not in the collective most ranks wait in: those in none, when some wait; else
    those in another one. When two collectives tie, the ranks further along in the step (in
    backward, past the forward's collective) are the ones not where the others wait; a tie that
    cannot be broken names only the ranks in no collective. None when no rank waits, or all wait in
    the same."""
    if not any(p.collective for p in places):
        return outside_the_loop(places)
    common = where_most_wait(places)
    if common is None:
        return [rank for rank, p in enumerate(places) if p.collective is None]
    return [rank for rank, p in enumerate(places) if p.collective != common]


def outside_the_loop(places: list[Place]) -> list[int]:
    """When no rank waits in a collective: the ranks in the user's code while the others stand in
    our loop. Under NCCL a collective returns at once and waits on the GPU, so a rank waiting for
    the others blocks at the loop's next host sync (a .item(), a .tolist()), in no torch.distributed call."""
    in_loop = [OURS + "worker/" in p.frame for p in places]
    if all(in_loop) or not any(in_loop):
        return []
    return [rank for rank, inside in enumerate(in_loop) if not inside]


def where_most_wait(places: list[Place]) -> str | None:
    """The collective most ranks wait in; on a tie, the one earliest in the step, where they are
    behind the others; None when no rank waits, or the tie cannot be broken."""
    waiting = Counter(p.collective for p in places if p.collective)
    if not waiting:
        return None
    most = max(waiting.values())
    tied = [c for c, n in waiting.items() if n == most]
    if len(tied) == 1:
        return tied[0]
    stages = [stage_of(c) for c in tied]
    if None in stages or stages.count(min(stages)) > 1:
        return None
    return tied[stages.index(min(stages))]


def stage_of(collective: str) -> int | None:
    """How far into forward_backward a collective is: 0 in the forward, 1 in the backward, None elsewhere."""
    return next((i for i, stage in enumerate(STAGES) if collective.endswith(stage)), None)


def read_place(text: str) -> Place:
    """Where a `py-spy dump` says the rank's training thread is (training_frames)."""
    frames = training_frames(text)
    if not frames:
        return Place("no Python stack (py-spy failed, see the rank's file)", None)
    own = next((m for m in frames if is_ours(m["file"])), frames[0])
    return Place(f"{own['file']}:{own['line']} in {own['func']}", collective_of(frames))


def training_frames(text: str) -> list[re.Match[str]]:
    """The frames, innermost first, of the thread that trains: the one running our loop (`raytrain
    run`), else the main thread (a launched script's), else the first; none where py-spy failed."""
    blocks = [block.splitlines() for block in re.split(r"^Thread ", text, flags=re.M)[1:]]
    threads = [(lines[0], [m for m in map(FRAME.match, lines[1:]) if m]) for lines in blocks]
    loop = [frames for _, frames in threads if any(OURS + "worker/" in m["file"] for m in frames)]
    main = [frames for head, frames in threads if head.endswith('"MainThread"')]
    return (loop or main or [frames for _, frames in threads] or [[]])[0]


def training_stack(text: str) -> tuple[tuple[str, str, str], ...]:
    """The training thread's frames as (function, file, line): what `raytrain launch`'s watch
    compares between two looks at a rank (launch_stall.py)."""
    return tuple((m["func"], m["file"], m["line"]) for m in training_frames(text))


def is_stack(text: str) -> bool:
    """Whether a rank's dump is a stack, not why there is none (py-spy's own output begins `Process PID:`)."""
    return text.startswith("Process ")


def is_ours(file: str) -> bool:
    """A frame of the user's code or of ours: not torch's, Ray's or the interpreter's."""
    if OURS in file:
        return True
    return not STDLIB.search(file) and "site-packages" not in file and "dist-packages" not in file


def collective_of(frames: list[re.Match[str]]) -> str | None:
    """The collective the stack waits in: a torch.distributed call, or DDP's gradient all-reduce at
    the end of a backward called from our forward_backward or from a launched script's code. Within
    forward_backward it says where in the step, (forward) or (backward), so a tie between two ranks
    can tell which one is ahead."""
    own = next((m for m in frames if is_ours(m["file"])), None)
    # autograd's entry to a backward, not any autograd frame: a Function's apply (SyncBatchNorm) runs in a forward
    entry = next((i for i, m in enumerate(frames) if "torch/autograd/" in m["file"]
                  and m["func"] in ("backward", "_engine_run_backward")), None)
    in_step = any(m["file"].endswith(OURS + "worker/step.py") and m["func"] == "forward_backward" for m in frames)
    stage = f" {STAGES[1] if entry is not None else STAGES[0]}" if in_step else ""
    for m in frames:
        if "torch/distributed/" in m["file"] and m["func"].split(".")[-1] in COLLECTIVES:
            return f"torch.distributed {m['func'].split('.')[-1]}{stage}"
    if entry is not None and own is not None and own["file"].endswith(OURS + "worker/step.py") and own["func"] == "forward_backward":
        return f"DDP's gradient all-reduce {STAGES[1]}"
    # A launched script's loss.backward(): its own frame calls the backward, none runs inside it (a
    # custom autograd Function's backward that hangs is no wait for the others).
    if entry is not None and own is not None and OURS not in own["file"] and frames.index(own) > entry:
        return "a backward (DDP's gradient all-reduce)"
    return None


def dump_stacks(ranks: list[dict[str, Any]], dump: Callable[[int], str] | None = None) -> list[str]:
    """Every rank's `py-spy dump` (or `dump`'s, e.g. glance): here for the ranks on this host, by a
    task on its node for the others."""
    asks = on_each_rank(ranks, dump or py_spy)
    return [ask if isinstance(ask, str) else fetch(ask, f"no answer from {r['ip']}") for ask, r in zip(asks, ranks)]


def end_ranks(ranks: list[dict[str, Any]], workers: list[list[LoaderWorker]] | None = None) -> None:
    """SIGKILL every rank: stuck in a collective, none would end before its timeout. Then its
    loader workers: one stuck in a lock never sees its rank is gone (torch's watchdog runs in its loop)."""
    for ask in on_each_rank(ranks, kill):
        if ask is not None and not isinstance(ask, str):
            fetch(ask, "")
    if workers and any(workers):
        pids = [{**r, "pid": [w.pid for w in mine]} for r, mine in zip(ranks, workers)]
        for ask in on_each_rank(pids, kill_all):
            if ask is not None and not isinstance(ask, str):
                fetch(ask, "")


def dump_loader_workers(ranks: list[dict[str, Any]], dump: Callable[[int], list[LoaderWorker]] | None = None
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


def on_each_rank(ranks: list[dict[str, Any]], call: Callable[[int], Any]) -> list[Any]:
    """`call(pid)` for every rank: its result for the ranks on this host, a Ray task's reference (or
    why there is none) for the ranks on other nodes."""
    import ray

    there = ray.remote(num_cpus=0)(call)
    here = ray.util.get_node_ip_address()
    nodes = {n["NodeManagerAddress"]: n["NodeID"] for n in ray.nodes() if n.get("Alive")}
    return [call(r["pid"]) if r["ip"] == here else on_node(nodes.get(r["ip"]), there, r["pid"]) for r in ranks]


def on_node(node_id: str | None, task: Any, pid: int) -> Any:
    """`task(pid)` on the node `node_id`, or why not."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    if node_id is None:
        return "py-spy not run: the rank's node is not alive in Ray"
    return task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)).remote(pid)


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
