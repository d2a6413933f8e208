"""The pure reading of the ranks' stacks (`py-spy dump` text): where each rank stands, which
collective most ranks wait in, the rank(s) not there, and what a rank's DataLoader workers are
doing. No Ray, no processes: every function here takes text and returns a verdict, so each rule is
tested on stacks alone (tests/test_stall.py).

A rank is where the innermost frame of the user's code or ours is, in the thread that trains (our
loop's, or a launched script's main thread). A rank waits for the others when that thread is in a
torch.distributed collective, or in DDP's gradient all-reduce at the end of a backward.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from raytrain_ddp.doctor.ranks import RankProcess

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
DDP_START = {
    "_verify_param_shape_across_processes": "DDP's check of every rank's parameter shapes",
    "_sync_module_states": "DDP's broadcast of rank 0's weights",
    "_sync_params_and_buffers": "DDP's broadcast of rank 0's weights",
}
"""What DDP's constructor waits for the other ranks in (torch/distributed/utils.py; the collective
itself is C++, with no Python frame of its own): a rank that hangs before its model is wrapped."""
STEP_SILENCE = "no rank finished a training step"
"""What a stalled `raytrain run` did not do (launch's watch says its own)..."""
VALIDATION_SILENCE = "the epoch's validation did not move"
"""... and what it did not do in the phase after an epoch's last step (sink.py's "validation") ..."""
FIRST_STEP_SILENCE = "no rank finished its first training step"
"""... and before its first step, where the loaders start and torch.compile and cuDNN warm up."""
COMPILE_FRAMES = ("torch/_dynamo/convert_frame.py", "torch/_inductor/compile_fx.py")
"""The entries of a compile: Dynamo's, for a frame it has no code for (the backend's work runs under
it), and Inductor's, for a backward AOTAutograd compiles at its first call. Compiled code that runs
passes neither (it enters through eval_frame.py and the graph's own wrappers)."""
STAGES = ("(forward)", "(backward)")
"""Where in forward_backward a rank waits, in the order a step passes them."""
LOADER_LOOP = "torch/utils/data/_utils/worker.py"
"""The file of a DataLoader worker's loop: a process under a rank that runs it is one of its loader workers."""
LOADER_WAIT = "torch/utils/data/dataloader.py"
"""... and a rank's frame in this file waits on its loader."""
EXITED = "exited: a zombie its rank has not reaped"
"""A loader worker that died: the rank's loader waits for a batch it will never send."""

@dataclass(frozen=True)


class Place:
    """Where one rank's stack stands."""

    frame: str
    """The innermost frame in the user's code or ours (not torch's or Ray's): `file:line in func`."""
    collective: str | None
    """The collective it waits in, or None."""


@dataclass(frozen=True)


class LoaderWorker:
    """One of a rank's DataLoader worker processes, as found on the rank's node."""

    pid: int
    stack: str
    """Its `py-spy dump`, or EXITED."""


def read_place(text: str) -> Place:
    """Where a `py-spy dump` says the rank's training thread is (training_frames)."""
    frames = training_frames(text)
    if not frames:
        return Place("no Python stack (py-spy failed, see the rank's file)", None)
    own = next((m for m in frames if is_ours(m["file"])), frames[0])
    return Place(f"{own['file']}:{own['line']} in {own['func']}", collective_of(frames))


def verdict(ranks: list[RankProcess], places: list[Place], quiet: float | None, folder: Path,
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
    named = "; ".join(f"rank {r} ({ranks[r].host} pid {ranks[r].pid}) is at {places[r].frame}"
                      + (f" in {places[r].collective}" if places[r].collective else "") for r in culprits)
    if common is None:  # no rank in a collective (outside_the_loop)
        at = next(p.frame for rank, p in enumerate(places) if rank not in culprits)
        return (f"{head}: {named}, while the others wait in the training loop at {at} (under NCCL, for the GPU, "
                f"where a collective waits); stacks in {folder}")
    at = next(p.frame for p in places if p.collective == common)
    return f"{head}: {named}, while the others wait in {common} at {at}{why_apart(places, culprits, common)}; " \
           f"stacks in {folder}"


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
    compares between two looks at a rank (launch_watch.py)."""
    return tuple((m["func"], m["file"], m["line"]) for m in training_frames(text))


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
        if "torch/distributed/" in m["file"] and m["func"] in DDP_START:
            return DDP_START[m["func"]]
    if entry is not None and own is not None and own["file"].endswith(OURS + "worker/step.py") and own["func"] == "forward_backward":
        return f"DDP's gradient all-reduce {STAGES[1]}"
    # A launched script's loss.backward(): its own frame calls the backward, none runs inside it (a
    # custom autograd Function's backward that hangs is no wait for the others).
    if entry is not None and own is not None and OURS not in own["file"] and frames.index(own) > entry:
        return "a backward (DDP's gradient all-reduce)"
    return None


def is_stack(text: str) -> bool:
    """Whether a rank's dump is a stack, not why there is none (py-spy's own output begins `Process PID:`)."""
    return text.startswith("Process ")


def is_ours(file: str) -> bool:
    """A frame of the user's code or of ours: not torch's, Ray's or the interpreter's."""
    if OURS in file:
        return True
    return not STDLIB.search(file) and "site-packages" not in file and "dist-packages" not in file


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
    return {"validation": VALIDATION_SILENCE, "first step": FIRST_STEP_SILENCE}.get(phase or "", STEP_SILENCE)


@dataclass(frozen=True)
class Moving:
    """A silence that is no stall: what the ranks do instead of waiting for each other."""

    kind: str
    """"compiling": a rank is inside torch.compile and the others wait for it; "slow": no rank waits
    for another, every one is busy in its own code (or its loader workers are, in the dataset's)."""
    line: str
    """What the user reads, once."""
    compilers: tuple[int, ...] = ()
    """The ranks that compile."""


def moving(ranks: list[RankProcess], stacks: list[str], workers: list[list[LoaderWorker]], quiet: float | None,
           silence: str = STEP_SILENCE) -> Moving | None:
    """Whether a silence is slowness rather than a stall, and what the ranks are doing; None when it
    is a stall (some rank waits for another that is not compiling, or a rank's place is unknown).

    A rank that compiles may take minutes while its peers wait in the next collective: that wait
    is expected. Ranks that all work in their own code (a slow first batch, a long first forward,
    a dataset whose every item takes a minute) wait for no one: the run is slow, not stuck."""
    if not stacks or not all(map(is_stack, stacks)):
        return None
    places = [read_place(text) for text in stacks]
    quiet_for = silent_for(silence, quiet)
    compilers = [rank for rank, text in enumerate(stacks) if compiling(text)]
    if compilers:
        others = [rank for rank in range(len(stacks)) if rank not in compilers]
        if not all(places[r].collective or OURS + "worker/" in places[r].frame for r in others):
            return None  # a rank that neither compiles nor waits: the compile is not what holds the run
        who = "; ".join(f"rank {r} ({ranks[r].host} pid {ranks[r].pid}) at {places[r].frame}" for r in compilers)
        wait = f", while the others wait for it in {places[others[0]].collective or 'the training loop'}" if others else ""
        return Moving("compiling", f"compiling, not stuck: {quiet_for}: torch.compile runs on {who}{wait}",
                      tuple(compilers))
    if any(p.collective for p in places):
        return None
    busy = [busy_at(text, place, mine) for text, place, mine in zip(stacks, places, workers)]
    if not all(busy):
        return None
    at: dict[str, list[int]] = {}
    for rank, where in enumerate(busy):
        at.setdefault(where, []).append(rank)
    each = "; ".join(f"{'rank' if len(rs) == 1 else 'ranks'} {', '.join(map(str, rs))} at {where}" for where, rs in at.items())
    return Moving("slow", f"slow, not stuck: {quiet_for}, but no rank waits for another: every one works in its own "
                          f"code ({each})")


def busy_at(text: str, place: Place, workers: list[LoaderWorker]) -> str | None:
    """Where a rank works, waiting for no other rank: in something our loop called (the model, the
    user's code, the data path), or, when it waits on its DataLoader, a loader worker in the dataset's
    code; None when it waits: in a collective, or at a line of our loop itself (under NCCL, a host
    sync that waits for the GPU, and so for the others), or on a loader with no worker at work."""
    frames = training_frames(text)
    if place.collective or not frames:
        return None
    if any(LOADER_WAIT in m["file"] for m in frames):
        found = [loader_place(w.stack) for w in workers]
        working = [where.removeprefix("is at ") for where in found if where.startswith("is at ")]
        exited = any(w.stack == EXITED for w in workers)
        return f"its loader worker at {working[0]}" if working and not exited else None
    inner = frames[0]
    if OURS + "worker/" in inner["file"]:
        return None
    return place.frame if OURS + "worker/" not in place.frame else f"{inner['file']}:{inner['line']} in {inner['func']}"


def compiling(text: str) -> bool:
    """Whether a rank's training thread is inside torch.compile."""
    return any(part in m["file"] for m in training_frames(text) for part in COMPILE_FRAMES)


def silent_for(silence: str, quiet: float | None) -> str:
    if quiet is None:
        return "rank 0 is writing a checkpoint, or the ranks have not started"
    return f"{silence} for {quiet:.0f} s"
